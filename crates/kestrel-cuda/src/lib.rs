//! CUDA backend: the model's weights live on the GPU in their GGUF block layout and the
//! kernels (`kernels/*.cu`, compiled with NVRTC at first use and cached on disk) read them
//! directly. Activations are f32, the paged KV cache f16.
//!
//! cudarc loads libcuda and libnvrtc at run time, so this crate builds and its users run on
//! machines without CUDA; [`CudaBackend::new`] is where a missing driver or GPU shows up.
//!
//! Every step's inputs (token ids, positions, block tables, ...) go to the device in one
//! copy in `prepare_step`, into a buffer allocated once; the kernels read them from there.
//! Backend operations cannot return errors (the trait's shape), so a failed launch is
//! remembered and reported by the next `prepare_step` or `read_rows`.
//!
//! Decode steps (at most [`GRAPH_MAX_TOKENS`] tokens, or as many as the tensor-core kernels
//! for quantized weights take, or one token a sequence of any count, their cuBLAS products
//! included: see `step::record_step`) are replayed as CUDA graphs: their
//! launches are recorded, not issued, until the step's results are needed (`read_rows`,
//! `check`, the next `prepare_step`). A recorded list identical to the previous one (same
//! kernels, grids and arguments, pointers included) is captured once as a graph and
//! replayed from then on; anything else runs launch by launch. Keying graphs by the exact
//! launch list means a replay can never use stale buffers or sizes.

mod attention;
pub mod compile;
mod delta;
mod launch;
mod matmul;
mod moe;
mod moe_mma;
pub mod nccl;
mod norm_rope;
mod options;
mod sample;
pub mod split;
mod step;
pub mod tp;
mod weights;

use attention::*;
use launch::*;
use matmul::*;
use norm_rope::*;

use step::*;
use weights::*;

use rayon::prelude::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use anyhow::{Context, bail};
use cudarc::driver::{CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, sys};
use kestrel_gguf::{GgmlType, GgufFile, TensorInfo};
use kestrel_model::{
    Activation, AttnParams, Batch, DeltaNetConfig, DeltaNetWeights, KvType, KvTypes, LayerWeights,
    ModelConfig, RopeParams, SamplingBatch,
};

pub use compile::Origin;
pub use launch::Prepared;
pub use matmul::{INVARIANT_MAX_TOKENS, Kernel, PendingSplit, QkvWeights};
pub use options::{F16Copies, Options, request_profile};
pub use split::SplitBackend;
pub use tp::TpBackend;
pub use weights::WeightSource;

/// Largest head size the attention kernel handles.
pub const MAX_HEAD_DIM: usize = 256;

/// Weight types the kernels dequantize.
pub const SUPPORTED_TYPES: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::IQ4NL,
    GgmlType::IQ4XS,
    GgmlType::MXFP4,
];

/// Number of CUDA devices, or an error saying why there are none usable.
pub fn device_count() -> anyhow::Result<usize> {
    // SAFETY: only probes whether the shared library can be opened.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        bail!(
            "no CUDA driver found (libcuda.so could not be loaded): is an NVIDIA GPU and its driver installed?"
        );
    }
    let n = CudaContext::device_count().map_err(|e| anyhow::anyhow!("CUDA driver: {e:?}"))?;
    Ok(n.max(0) as usize)
}

/// Steps of at most this many tokens are recorded and replayed as CUDA graphs (and larger
/// ones: see `step::record_step`).
pub const GRAPH_MAX_TOKENS: usize = 8;
/// Steps of at most this many tokens use the GEMV kernels (`kernels/gemv.cu`).
pub const GEMV_MAX_TOKENS: usize = 8;
/// Most tokens of a step the tensor-core kernels for quantized weights take
/// (`kernels/mmq.cu`), and the fewest. They take Q4_K and Q6_K weights, and Q8_0 / Q4_0 up
/// to 8 tokens (see `mmq_reads`; before those rows were stored 16-byte aligned, Llama-3-8B
/// Q4_0 at B = 8 gave 696 t/s on them against 882 for cuBLAS on the f16 copies). Steps of
/// 3..=8 tokens run the int8 kernels `mmq_t8` / `mmk_t8*`, 9..=32 the staged int8 ones
/// `mms_*`, larger steps cuBLAS on the f16 copies. Measured on the H100 (Llama-3-8B Q4_K_M,
/// `bench --seqs`, decode t/s, same call): B = 16 mms 2,641 / 2,582 vs the f16 `mmh_*`
/// (since deleted) 2,421; 32: 3,605 / 3,446 vs 3,226; 64: mms 4,335 / 4,119 vs cuBLAS 4,544
/// (so 64 stays on cuBLAS). Earlier: B = 8 1,452 (mmh there: 1,440).
pub const MMQ_MAX_TOKENS: usize = 32;
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    funcs: Vec<CudaFunction>,
    /// Dynamic shared memory of each kernel's launches (bytes; see [`dynamic_smem`]).
    func_smem: Vec<u32>,
    func_index: HashMap<&'static str, usize>,
    /// Each kernel's name, by index.
    func_names: Vec<&'static str>,
    recorder: Mutex<Recorder>,
    /// This device's NCCL communicator, when it is one rank of a tensor-parallel group.
    comm: std::sync::OnceLock<nccl::Comm>,
    /// The one-shot all-reduce's buffers, when this rank's group has them.
    oneshot: std::sync::OnceLock<tp::OneShot>,
    /// Whether decode steps are captured and replayed as graphs.
    graphs: std::sync::atomic::AtomicBool,
    /// Per-kernel timing (`KESTREL_CUDA_PROFILE=1`; turns graphs off), printed on drop.
    profile: Option<Mutex<Profiler>>,
    /// Steps replayed from a graph so far (shared: see [`CudaBackend::replay_counter`]).
    replays: Arc<std::sync::atomic::AtomicU64>,
    device_name: String,
    arch: String,
    origin: Origin,
    /// The first failure of an operation that could not return it.
    error: Mutex<Option<String>>,
    /// RoPE frequency factors already uploaded, by their host array.
    freq_factors: Mutex<Vec<UploadedFactors>>,
    /// Tensors whose f16 copy goes into a merged copy allocated by an earlier one (K and V
    /// into Q's, see `load_weight`): name → device address of their rows there.
    merged_f16_rows: Mutex<HashMap<String, u64>>,
    /// cuBLAS, for prompt-sized matrix products on the tensor cores (None: library absent
    /// or `KESTREL_CUDA_CUBLAS=0`; the `matmul` kernel is used instead).
    blas: Option<cudarc::cublas::CudaBlas>,
    /// The settings read from the environment at start.
    options: Options,
    /// Rows per warp of every single-token `gemv_q8` launch (1 or 2; 0, the default: by
    /// launch, see `gemv`); the self-check forces each.
    gemv_q8_rows: std::sync::atomic::AtomicUsize,
    /// Single-token GEMVs on 8-bit activations (`gemv_q8`; `KESTREL_CUDA_Q8=0` turns it
    /// off: f32 activations everywhere, as the CPU backend computes).
    q8_decode: std::sync::atomic::AtomicBool,
    /// The quantized activations of those GEMVs: int8 values and a scale per 32, sized at
    /// `new_step` for the model's widest input so that recorded graphs never see it move.
    q8_scratch: Mutex<Option<Q8Scratch>>,
    /// Steps of up to 8 tokens on Q4_K / Q6_K weights: `mmk_t8*` (activations quantized per
    /// 256 values, integer sums per super-block) instead of `mmq_t8` (on by default; the
    /// self-check turns it off to cover `mmq_t8` on those formats, which the LM head takes).
    mmk: std::sync::atomic::AtomicBool,
    /// Whether the step being run is a batch-invariant one (`Batch::invariant`, 2 to
    /// [`INVARIANT_MAX_TOKENS`] tokens): every op computes each token as a single-token step
    /// would (see `invariant_step`).
    invariant: std::sync::atomic::AtomicBool,
    /// Whether launches allow programmatic dependent launch (the option, on sm_90 and up).
    pdl: bool,
    /// Host buffer the results are read back through.
    pinned: Mutex<Option<cudarc::driver::PinnedHostSlice<f32>>>,
    /// Read-ahead of logit rows (see [`CudaBackend::gemm_reading_ahead`]): the stream that
    /// copies them into `pinned` while the product still runs, made at first use.
    copy_stream: std::sync::OnceLock<Option<Arc<CudaStream>>>,
    /// The rows whose copy into `pinned` is queued on the copy stream: (device address,
    /// rows, columns); valid until the next kernel launch (`read_ahead_valid`).
    read_ahead: Mutex<Option<(u64, usize, usize)>>,
    read_ahead_valid: std::sync::atomic::AtomicBool,
    /// Whether the last large read-back was of rows (not sampled ids): the next logits
    /// product then copies its rows ahead, if the options allow it.
    rows_read_back: std::sync::atomic::AtomicBool,
    /// Whether the copy stream may still be writing into `pinned`.
    copy_in_flight: std::sync::atomic::AtomicBool,
    /// Reads served by a read-ahead (for the self-check).
    read_ahead_hits: std::sync::atomic::AtomicU64,
    /// Token ids of `argmax_rows` and `sample_rows` (`launch_for_ids`), on the device
    /// (grown to the most rows asked).
    argmax_ids: Mutex<Option<CudaSlice<u32>>>,
    /// Chained decode steps (`Backend::chain_ids`).
    chain: Mutex<sample::Chain>,
    /// `sample_rows`' settings, packed on the host and their device copy (grown).
    sample_params: Mutex<(Vec<u32>, Option<CudaSlice<u32>>)>,
    /// `sample_rows`' token masks: their pinned host copy and device copy (grown), and
    /// the stream that uploads them beside the step (made at first use).
    sample_masks: Mutex<sample::MaskBuffers>,
    mask_stream: std::sync::OnceLock<Option<Arc<CudaStream>>>,
    /// Whether some weight has an f16 copy (or is F16) that small batches multiply through
    /// cuBLAS (then steps of 2–8 tokens are recorded with their cuBLAS products).
    f16_copies: std::sync::atomic::AtomicBool,
    /// The Q8-capable types (bit `GgmlType::id()`) of which some weight has an f16 copy:
    /// cuBLAS takes their steps that the 8-bit kernels do not.
    f16_copies_q8: std::sync::atomic::AtomicU64,
    /// f16 operands of those products, grown to the largest seen.
    gemm_scratch: Mutex<GemmScratch>,
    /// Weight bytes the load under way has still to upload here, and the model file it
    /// was counted for (its address; see `expect_weights`): the optional copies made along
    /// the way leave room for them.
    weights_to_come: std::sync::atomic::AtomicU64,
    weights_file: Mutex<usize>,
    /// Streaming multiprocessors of the device (the split rules of `mms_*` and `mmw_gated`).
    sm_count: usize,
    /// Warps (16-row tiles) per block of `mmw_gated`; 0 (the default): by the matrix and
    /// the SM count; the self-check forces others.
    mmw_warps: std::sync::atomic::AtomicUsize,
    /// Buffers of the mixture-of-experts blocks (`moe.rs`), made at their first step.
    moe_scratch: Mutex<Option<moe::MoeScratch>>,
    /// Buffers of the grouped tensor-core expert products (`moe_mma.rs`).
    moe_mma_scratch: Mutex<Option<moe_mma::MoeMmaScratch>>,
}

/// Steps of more tokens than this multiply through cuBLAS (when present): below it the
/// cost of dequantizing each weight to f16 outweighs the tensor cores' gain.
pub const GEMM_MIN_TOKENS: usize = 16;

/// A weight on the device.
pub enum CudaWeight {
    /// A matrix in its GGUF block layout: `rows` rows of `cols` values, `row_bytes` each.
    Matrix {
        buf: CudaSlice<u8>,
        ptr: u64,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        row_bytes: usize,
        /// A dequantized f16 copy (row-major, `cols` per row) for prompt-sized products,
        /// kept when memory allows (see [`CudaBackend::keep_f16_copy`]).
        f16: Option<CudaSlice<u16>>,
        /// Q4_K: the blocks repacked for `mmw_*` (kernels/mmw.cu), kept when memory allows
        /// (see [`CudaBackend::keep_mmw_copy`]).
        mmw: Option<CudaSlice<u8>>,
    },
    /// A vector (norm weights, biases) as f32.
    Vector {
        buf: CudaSlice<f32>,
        ptr: u64,
        len: usize,
    },
}

/// Row-major `[rows × cols]` f32 activations on the device.
pub struct CudaTensor {
    buf: CudaSlice<f32>,
    ptr: u64,
    rows: usize,
    cols: usize,
}

/// The paged KV cache: per layer, `n_blocks × block_size` slots of `kv_dim` keys and values,
/// each stored as f16 or quantized (`types`; kernels/attention.cu's `kv_load` gives the
/// layout: a quantized layer holds every slot's quants, then every slot's scales from
/// `k_scale` / `v_scale`).
pub struct CudaCache {
    k: Vec<CudaSlice<u16>>,
    v: Vec<CudaSlice<u16>>,
    k_ptr: Vec<u64>,
    v_ptr: Vec<u64>,
    /// Each layer's scale region (0 for f16).
    k_scale: Vec<u64>,
    v_scale: Vec<u64>,
    types: KvTypes,
    block_size: usize,
    n_blocks: usize,
    kv_dim: usize,
    /// The linear-attention layers' per-sequence states (models that have them).
    delta: Option<delta::DeltaStates>,
}

/// The storage types the CUDA attention reads (kernels/attention.cu: KV_F16, KV_Q8_0,
/// KV_FP8, KV_Q4_0).
pub const CUDA_CACHE_TYPES: [KvType; 4] = [KvType::F16, KvType::Q8_0, KvType::Q4_0, KvType::Fp8];

/// `t`'s kind number in kernels/attention.cu (KV_F16 / KV_Q8_0 / KV_FP8 / KV_Q4_0).
fn cuda_kind(t: KvType) -> i32 {
    match t {
        KvType::Q8_0 => 1,
        KvType::Fp8 => 2,
        KvType::Q4_0 => 3,
        _ => 0,
    }
}

impl CudaCache {
    /// Whether keys or values are quantized (the kernels reading `kv_load`'s layouts).
    fn quantized(&self) -> bool {
        self.types != KvTypes::default()
    }

    /// The quantized kernels' trailing arguments for `layer`: scales, kinds.
    fn quant_args(&self, layer: usize) -> [Arg; 4] {
        [
            Arg::P(self.k_scale[layer]),
            Arg::P(self.v_scale[layer]),
            Arg::I(cuda_kind(self.types.k)),
            Arg::I(cuda_kind(self.types.v)),
        ]
    }
}

/// Per-step inputs in one device buffer of u32, at fixed offsets (`T` = max tokens):
/// tokens `[0, T)`, positions `[T, 2T)`, seq_of `[2T, 3T)`, logit rows `[3T, 4T)`,
/// block-table offsets per sequence `[4T, 5T)`, kv_len per sequence `[5T, 6T)`, then the
/// block tables of all sequences back to back.
pub struct CudaStep {
    buf: CudaSlice<u32>,
    ptr: u64,
    /// Partial results of the split decode attention: room for [`SPLIT_ATTN_MAX_TOKENS`] tokens ×
    /// `n_head` heads × [`MAX_ATTN_SPLITS`] splits × (head_dim + 2) floats.
    _attn_part: CudaSlice<f32>,
    attn_part_ptr: u64,
    attn_part_len: usize,
    max_tokens: usize,
    table_capacity: usize,
    host: Vec<u32>,
    n_tokens: usize,
    n_seqs: usize,
    n_logit_rows: usize,
    /// The linear-attention layers' convolution output, `[max_tokens × conv_dim]` (models
    /// that have them).
    _delta_conv: Option<CudaSlice<f32>>,
    delta_conv_ptr: Option<u64>,
}

impl CudaBackend {
    /// Opens GPU `ordinal`, compiling (or loading the cached) kernels for its architecture.
    pub fn new(ordinal: usize) -> anyhow::Result<CudaBackend> {
        let count = device_count()?;
        if ordinal >= count {
            bail!("CUDA device {ordinal} requested, {count} present");
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| anyhow::anyhow!("opening CUDA device {ordinal}: {e:?}"))?;
        // One stream, in order: cudarc's per-buffer events are not needed (and would stop
        // graph capture later).
        // SAFETY: called before any buffer or stream exists.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| anyhow::anyhow!("creating a CUDA stream: {e:?}"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| anyhow::anyhow!("reading the compute capability: {e:?}"))?;
        let arch = compile::arch_name(major, minor)?;
        let device_name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let (ptx, mut origin) = compile::load(&arch)?;
        let module = match ctx.load_module(ptx) {
            Ok(m) => m,
            // A cached cubin this driver refuses (made by a newer toolkit, or damaged):
            // compile afresh, which replaces it.
            Err(e) if origin == Origin::Cached => {
                eprintln!("cached kernels for {arch} did not load ({e:?}); compiling them");
                compile::forget(&arch);
                origin = Origin::Compiled;
                ctx.load_module(compile::compile(&arch)?)
                    .map_err(|e| anyhow::anyhow!("loading the kernel module for {arch}: {e:?}"))?
            }
            Err(e) => bail!("loading the kernel module for {arch}: {e:?}"),
        };
        let mut funcs = Vec::new();
        let mut func_smem = Vec::new();
        let mut func_index = HashMap::new();
        let mut func_names = Vec::new();
        for name in compile::kernels() {
            let f = module
                .load_function(name)
                .map_err(|e| anyhow::anyhow!("kernel {name} missing from the module: {e:?}"))?;
            let smem = dynamic_smem(name);
            if smem > 48 << 10 {
                f.set_attribute(
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
                .map_err(|e| {
                    anyhow::anyhow!("allowing {name} {smem} bytes of shared memory: {e:?}")
                })?;
            }
            func_index.insert(name, funcs.len());
            func_names.push(name);
            funcs.push(f);
            func_smem.push(smem);
        }
        let options = Options::from_env();
        let blas = if !options.cublas
            // SAFETY: only probes whether the shared library can be opened.
            || !unsafe { cudarc::cublas::sys::is_culib_present() }
        {
            None
        } else {
            Some(
                cudarc::cublas::CudaBlas::new(stream.clone())
                    .map_err(|e| anyhow::anyhow!("creating a cuBLAS handle: {e:?}"))?,
            )
        };
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_or(132, |c| c.max(1) as usize);
        Ok(CudaBackend {
            ctx,
            stream,
            funcs,
            func_smem,
            func_index,
            func_names,
            recorder: Mutex::new(Recorder::default()),
            comm: std::sync::OnceLock::new(),
            oneshot: std::sync::OnceLock::new(),
            graphs: std::sync::atomic::AtomicBool::new(options.graphs),
            replays: Arc::default(),
            profile: options.profile.then(|| Mutex::new(Profiler::default())),
            device_name,
            arch,
            origin,
            error: Mutex::new(None),
            freq_factors: Mutex::new(Vec::new()),
            merged_f16_rows: Mutex::new(HashMap::new()),
            blas,
            gemv_q8_rows: std::sync::atomic::AtomicUsize::new(0),
            f16_copies: Default::default(),
            f16_copies_q8: Default::default(),
            pinned: Mutex::new(None),
            copy_stream: std::sync::OnceLock::new(),
            read_ahead: Mutex::new(None),
            read_ahead_valid: std::sync::atomic::AtomicBool::new(false),
            rows_read_back: std::sync::atomic::AtomicBool::new(false),
            copy_in_flight: std::sync::atomic::AtomicBool::new(false),
            read_ahead_hits: std::sync::atomic::AtomicU64::new(0),
            argmax_ids: Mutex::new(None),
            chain: Mutex::default(),
            sample_params: Mutex::new((Vec::new(), None)),
            sample_masks: Mutex::default(),
            mask_stream: std::sync::OnceLock::new(),
            q8_decode: std::sync::atomic::AtomicBool::new(options.q8),
            q8_scratch: Mutex::new(None),
            pdl: options.pdl && major >= 9,
            mmk: std::sync::atomic::AtomicBool::new(true),
            invariant: std::sync::atomic::AtomicBool::new(false),
            gemm_scratch: Mutex::default(),
            weights_to_come: Default::default(),
            weights_file: Mutex::new(0),
            sm_count,
            mmw_warps: std::sync::atomic::AtomicUsize::new(0),
            moe_scratch: Mutex::new(None),
            moe_mma_scratch: Mutex::new(None),
            options,
        })
    }

    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// `sm_XY` of the device.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// Whether the kernels were compiled at start or read from the disk cache.
    pub fn kernels_origin(&self) -> Origin {
        self.origin
    }
}

impl kestrel_model::Backend for CudaBackend {
    type Weight = CudaWeight;
    type Tensor = CudaTensor;
    type Cache = CudaCache;
    type Step = CudaStep;
    type Prepared = Prepared;

    fn name(&self) -> String {
        format!("cuda ({}, {})", self.device_name, self.arch)
    }

    fn with_rows(
        &self,
        x: &CudaTensor,
        n: usize,
        _scratch: &mut Vec<f32>,
        f: &mut dyn FnMut(&[f32]),
    ) -> anyhow::Result<()> {
        self.read_pinned(x, n, |values| f(values))
    }

    fn gate_up_pair(
        &self,
        x: &CudaTensor,
        x_ready: Prepared,
        gate_w: &CudaWeight,
        up_w: &CudaWeight,
        act: Activation,
        n: usize,
        gate: &mut CudaTensor,
        up: &mut CudaTensor,
    ) -> Prepared {
        self.gate_up_of(x, x_ready, gate_w, up_w, act, n, gate, up)
    }

    fn attention_sinks(
        &self,
        q: &CudaTensor,
        cache: &CudaCache,
        params: &AttnParams,
        sinks: &CudaWeight,
        step: &CudaStep,
        n: usize,
        out: &mut CudaTensor,
    ) -> anyhow::Result<()> {
        attention::attention_sinks(self, q, cache, params, sinks, step, n, out)
    }

    fn scale_by_position(
        &self,
        x: &mut CudaTensor,
        temp: &kestrel_model::AttnTemperature,
        step: &CudaStep,
        n: usize,
    ) -> anyhow::Result<()> {
        norm_rope::scale_by_position(self, x, temp, step, n)
    }

    fn invariant_max_tokens(&self) -> usize {
        INVARIANT_MAX_TOKENS
    }

    fn check_model(&self, cfg: &kestrel_model::ModelConfig) -> anyhow::Result<()> {
        delta::check_config(cfg)
    }

    fn load_weight(&self, file: &Arc<GgufFile>, info: &TensorInfo) -> anyhow::Result<CudaWeight> {
        weights::load_weight(self, file, info)
    }

    fn new_tensor(&self, rows: usize, cols: usize) -> anyhow::Result<CudaTensor> {
        weights::new_tensor(self, rows, cols)
    }

    fn load_experts(&self, file: &Arc<GgufFile>, info: &TensorInfo) -> anyhow::Result<CudaWeight> {
        moe::load_experts(self, file, info)
    }

    fn moe_ffn(
        &self,
        x: &CudaTensor,
        layer: &LayerWeights<CudaWeight>,
        moe: &kestrel_model::MoeConfig,
        act: Activation,
        n: usize,
        out: &mut CudaTensor,
    ) -> anyhow::Result<()> {
        moe::moe_ffn(self, x, moe::Experts::of(layer), moe, act, n, out)
    }

    fn add_sigmoid_gated(
        &self,
        out: &mut CudaTensor,
        y: &CudaTensor,
        x: &CudaTensor,
        w: &CudaWeight,
        n: usize,
    ) -> anyhow::Result<()> {
        moe::add_sigmoid_gated(self, out, y, x, w, n)
    }

    fn new_cache(
        &self,
        config: &ModelConfig,
        n_blocks: usize,
        block_size: usize,
    ) -> anyhow::Result<CudaCache> {
        step::new_cache(self, config, n_blocks, block_size, KvTypes::default())
    }

    fn cache_types(&self) -> &'static [KvType] {
        &CUDA_CACHE_TYPES
    }

    fn new_cache_typed(
        &self,
        config: &ModelConfig,
        n_blocks: usize,
        block_size: usize,
        kv: KvTypes,
    ) -> anyhow::Result<CudaCache> {
        kv.check(self.cache_types(), config.head_dim, &self.name())?;
        step::new_cache(self, config, n_blocks, block_size, kv)
    }

    fn device_memory(&self) -> Option<(usize, usize)> {
        self.ctx.bind_to_thread().ok()?;
        cudarc::driver::result::mem_get_info().ok()
    }

    fn new_step(&self, config: &ModelConfig, max_tokens: usize) -> anyhow::Result<CudaStep> {
        step::new_step(self, config, max_tokens)
    }

    fn prepare_step(&self, batch: &Batch, step: &mut CudaStep) -> anyhow::Result<()> {
        step::prepare_step(self, batch, step)
    }

    fn gather_logit_rows(&self, x: &CudaTensor, step: &CudaStep, out: &mut CudaTensor) {
        step::gather_logit_rows(self, x, step, out)
    }

    fn read_rows(&self, x: &CudaTensor, n: usize, out: &mut Vec<f32>) -> anyhow::Result<()> {
        step::read_rows(self, x, n, out)
    }

    fn matmul(&self, x: &CudaTensor, w: &CudaWeight, n: usize, out: &mut CudaTensor) {
        matmul::matmul(self, x, &mut Prepared::Nothing, w, n, out)
    }

    fn matmul_ready(
        &self,
        x: &CudaTensor,
        x_ready: Prepared,
        w: &CudaWeight,
        n: usize,
        out: &mut CudaTensor,
    ) {
        matmul::matmul(self, x, &mut { x_ready }, w, n, out)
    }

    fn qkv(
        &self,
        x: &CudaTensor,
        x_ready: Prepared,
        layer: &LayerWeights<CudaWeight>,
        n: usize,
        q: &mut CudaTensor,
        k: &mut CudaTensor,
        v: &mut CudaTensor,
    ) -> Prepared {
        // Attention layers only (the forward pass calls `delta_net` for the others).
        let Some(w) = QkvWeights::of(layer) else {
            self.fail("qkv: a layer without Q/K/V projections".into());
            return Prepared::Nothing;
        };
        matmul::qkv(self, x, x_ready, &w, n, q, k, v)
    }

    fn matmul_many(
        &self,
        x: &CudaTensor,
        x_ready: Prepared,
        ws: &[&CudaWeight],
        n: usize,
        outs: &mut [&mut CudaTensor],
    ) {
        matmul::matmul_many(self, x, x_ready, ws, n, outs)
    }

    fn matmul_add(
        &self,
        x: &CudaTensor,
        x_ready: Prepared,
        w: &CudaWeight,
        n: usize,
        tmp: &mut CudaTensor,
        residual: &mut CudaTensor,
    ) {
        matmul::matmul_add(self, x, x_ready, w, n, tmp, residual)
    }

    fn store_kv(
        &self,
        cache: &mut CudaCache,
        layer: usize,
        k: &CudaTensor,
        v: &CudaTensor,
        step: &CudaStep,
        n: usize,
    ) {
        attention::store_kv(self, cache, layer, k, v, step, n)
    }

    fn attention(
        &self,
        q: &CudaTensor,
        cache: &CudaCache,
        p: &AttnParams,
        step: &CudaStep,
        n: usize,
        out: &mut CudaTensor,
    ) -> Prepared {
        attention::attention(self, q, cache, p, step, n, out)
    }

    fn rope_store_kv(
        &self,
        q: &mut CudaTensor,
        k: &mut CudaTensor,
        v: &CudaTensor,
        qkv_ready: Prepared,
        head_dim: usize,
        rope: &RopeParams,
        cache: &mut CudaCache,
        layer: usize,
        step: &CudaStep,
        n: usize,
    ) {
        attention::rope_store_kv(
            self, q, k, v, qkv_ready, head_dim, rope, cache, layer, step, n,
        )
    }

    fn embed(&self, table: &CudaWeight, step: &CudaStep, out: &mut CudaTensor) {
        norm_rope::embed(self, table, step, out)
    }

    fn scale(&self, x: &mut CudaTensor, n: usize, factor: f32) {
        norm_rope::scale(self, x, n, factor)
    }

    fn rms_norm(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        eps: f32,
        n: usize,
        out: &mut CudaTensor,
    ) -> Prepared {
        norm_rope::rms_norm(self, x, weight, eps, n, out)
    }

    fn rms_norm_heads(
        &self,
        x: &mut CudaTensor,
        weight: &CudaWeight,
        head_dim: usize,
        eps: f32,
        n: usize,
    ) {
        norm_rope::rms_norm_heads(self, x, weight, head_dim, eps, n)
    }

    fn add_bias(&self, x: &mut CudaTensor, bias: &CudaWeight, n: usize) {
        norm_rope::add_bias(self, x, bias, n)
    }

    fn rope(
        &self,
        x: &mut CudaTensor,
        head_dim: usize,
        rope: &RopeParams,
        step: &CudaStep,
        n: usize,
    ) {
        norm_rope::rope(self, x, head_dim, rope, step, n)
    }

    fn gated_activation(
        &self,
        gate: &mut CudaTensor,
        up: &CudaTensor,
        act: Activation,
        n: usize,
    ) -> Prepared {
        norm_rope::gated_activation(self, gate, up, act, n)
    }

    fn add(&self, x: &mut CudaTensor, y: &CudaTensor, n: usize) {
        norm_rope::add(self, x, y, n)
    }

    fn argmax_rows(
        &self,
        x: &CudaTensor,
        n: usize,
        scratch: &mut Vec<f32>,
        out: &mut Vec<u32>,
    ) -> anyhow::Result<()> {
        sample::argmax_rows(self, x, n, scratch, out)
    }

    fn sample_rows(
        &self,
        x: &CudaTensor,
        n: usize,
        sampling: &SamplingBatch,
        scratch: &mut Vec<f32>,
        out: &mut Vec<u32>,
    ) -> anyhow::Result<()> {
        sample::sample_rows(self, x, n, sampling, scratch, out)
    }

    fn submit(&self) {
        self.flush();
    }

    fn can_chain(&self) -> bool {
        true
    }

    fn chain_ids(
        &self,
        x: &CudaTensor,
        n: usize,
        sampling: Option<&SamplingBatch>,
    ) -> anyhow::Result<()> {
        sample::chain_ids(self, x, n, sampling)
    }

    fn read_chained(&self, out: &mut Vec<u32>) -> anyhow::Result<()> {
        sample::read_chained(self, out)
    }

    fn check_linear_attention(&self) -> anyhow::Result<()> {
        Ok(())
    }

    fn forget_state(&self, cache: &mut CudaCache, first_block: u32) {
        delta::forget(cache, first_block)
    }

    fn split_gated_query(
        &self,
        qg: &CudaTensor,
        head_dim: usize,
        n: usize,
        q: &mut CudaTensor,
        gate: &mut CudaTensor,
    ) -> anyhow::Result<()> {
        delta::split_gated_query(self, qg, head_dim, n, q, gate)
    }

    fn sigmoid_mul(&self, x: &mut CudaTensor, gate: &CudaTensor, n: usize) -> anyhow::Result<()> {
        delta::sigmoid_mul(self, x, gate, n)
    }

    fn delta_net(
        &self,
        cache: &mut CudaCache,
        layer: usize,
        cfg: &DeltaNetConfig,
        w: &DeltaNetWeights<CudaWeight>,
        mix: &CudaTensor,
        z: &CudaTensor,
        beta: &CudaTensor,
        alpha: &CudaTensor,
        eps: f32,
        step: &CudaStep,
        n: usize,
        out: &mut CudaTensor,
    ) -> anyhow::Result<Prepared> {
        let w = delta::DeltaCore::picked(w, |x| x);
        delta::delta_net(
            self, cache, layer, cfg, w, mix, z, beta, alpha, eps, step, n, out,
        )
    }
}

impl CudaCache {
    pub fn n_blocks(&self) -> usize {
        self.n_blocks
    }

    pub fn types(&self) -> KvTypes {
        self.types
    }

    /// Sequences whose linear-attention state the cache holds (0 for other models).
    pub fn live_states(&self) -> usize {
        self.delta.as_ref().map_or(0, |d| d.live())
    }
}

impl CudaBackend {
    /// Layer `layer` of `cache` read back (after the queued work), keys then values, each
    /// as the rows of its slots in the CPU cache's layout (ggml blocks: for Q8_0 each 32
    /// values' f16 scale then their 32 quants; fp8 likewise), for the self-check.
    pub fn read_cache_layer(
        &self,
        cache: &CudaCache,
        layer: usize,
    ) -> anyhow::Result<(Vec<u8>, Vec<u8>)> {
        anyhow::ensure!(layer < cache.k.len(), "no layer {layer}");
        self.check()?;
        let slots = cache.n_blocks * cache.block_size;
        let read = |buf: &CudaSlice<u16>, t: KvType| -> anyhow::Result<Vec<u8>> {
            let mut host = vec![0u16; buf.len()];
            self.stream
                .memcpy_dtoh(buf, &mut host[..])
                .map_err(|e| anyhow::anyhow!("copying the cache from the GPU: {e:?}"))?;
            self.check()?;
            let bytes: Vec<u8> = host.iter().flat_map(|h| h.to_le_bytes()).collect();
            let n = slots * cache.kv_dim;
            Ok(match t {
                KvType::Q8_0 | KvType::Fp8 => {
                    let (quants, scales) = bytes.split_at(n);
                    let mut out = Vec::with_capacity(n / 32 * 34);
                    for (qs, d) in quants.chunks_exact(32).zip(scales.chunks_exact(2)) {
                        out.extend_from_slice(d);
                        out.extend_from_slice(qs);
                    }
                    out
                }
                KvType::Q4_0 => {
                    let (quants, scales) = bytes.split_at(n / 2);
                    let mut out = Vec::with_capacity(n / 32 * 18);
                    for (qs, d) in quants.chunks_exact(16).zip(scales.chunks_exact(2)) {
                        out.extend_from_slice(d);
                        out.extend_from_slice(qs);
                    }
                    out
                }
                _ => bytes[..n * 2].to_vec(),
            })
        };
        Ok((
            read(&cache.k[layer], cache.types.k)?,
            read(&cache.v[layer], cache.types.v)?,
        ))
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        self.print_profile();
    }
}
