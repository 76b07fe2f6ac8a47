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
//! for quantized weights take) are replayed as CUDA graphs: their
//! launches are recorded, not issued, until the step's results are needed (`read_rows`,
//! `check`, the next `prepare_step`). A recorded list identical to the previous one (same
//! kernels, grids and arguments, pointers included) is captured once as a graph and
//! replayed from then on; anything else runs launch by launch. Keying graphs by the exact
//! launch list means a replay can never use stale buffers or sizes.

pub mod compile;
mod cublas;
mod options;

use rayon::prelude::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use anyhow::{Context, bail};
use cudarc::driver::{CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, sys};
use kestrel_gguf::{GgmlType, GgufFile, TensorInfo};
use kestrel_model::{
    Activation, AttnParams, Batch, LayerWeights, ModelConfig, RopeParams, SamplingBatch,
};

pub use compile::Origin;
pub use options::{F16Copies, Options, request_profile};

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

/// Steps of at most this many tokens are recorded and replayed as CUDA graphs.
pub const GRAPH_MAX_TOKENS: usize = 8;
/// Tokens up to which Q8-capable weights with an f16 copy still use the 8-bit GEMVs.
const Q8_GEMV_MAX_TOKENS: usize = 4;
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
const MMQ_MIN_TOKENS: usize = 3;
/// Fewest tokens of a step whose Q4_K / Q6_K products take the staged kernels `mms_*`.
const MMS_MIN_TOKENS: usize = 9;
/// Rows a block of `mms_*` owns (MH_ROWS in kernels/mmq.cu; gated launches: half of them
/// of gate, half of up), and the room for their split partial sums and arrival counters.
const MMS_ROWS: usize = 64;
const MMS_WORK_FLOATS: usize = 8 << 20;
const MMS_MAX_TILES: usize = 1 << 16;
/// `mmw_*` (kernels/mmw.cu): bytes of one 16-row tile's 256-value step in the mmw layout,
/// the most warps (tiles) a block takes, and its staged steps (dynamic shared memory).
const MW_TILE_BYTES: usize = 2560;
const MW_MAX_WARPS: usize = 8;
const MW_STAGES: u32 = 3;
const MW_XBYTES: u32 = 64 * 528;
/// The token range of `mmw_gated`: steps of 33..=64 tokens (below, the int8 kernels keep
/// them).
const MMW_MIN_TOKENS: usize = 33;
const MMW_MAX_TOKENS: usize = 64;
/// Tokens per block of the prefill attention kernel, and the largest head it handles
/// (`attention_prefill` in kernels/ops.cu: FA_Q and FA_HD); runs of fewer tokens take the
/// split kernels.
const PREFILL_ATTN_TOKENS: usize = 16;
const PREFILL_ATTN_MAX_HEAD_DIM: usize = 128;
/// Tokens per block of the tensor-core prefill attention (`attention_prefill_mma64` and
/// `attention_prefill_mma128` in kernels/ops.cu: FM_Q).
const PREFILL_MMA_TOKENS: usize = 64;
/// Most tokens of a step the split (decode) attention handles.
const SPLIT_ATTN_MAX_TOKENS: usize = 64;
/// Most key ranges the decode attention splits a (token, head) into.
const MAX_ATTN_SPLITS: usize = 64;
/// Most query heads per kv head the tiled decode attention takes (TA_MAX_GROUP).
const TILED_ATTN_MAX_GROUP: usize = 8;
/// Keys one block of the tiled decode attention covers per round (4 warps × 16).
const TILED_ATTN_KEYS_PER_ROUND: usize = 64;
/// Graphs kept (one per distinct launch list, e.g. per batch size).
const MAX_GRAPHS: usize = 8;

/// Whether split decode attention runs `attention_split_gqa` (one block per kv head, its
/// query heads together: each key and value row read once per group) where the tiled
/// kernels ([`tiled_split_attention`]) do not: grouped heads, a head of 32 · (1 to 4) dims,
/// at most 8 heads per group.
fn gqa_split_attention(p: &AttnParams) -> bool {
    let group = p.n_head / p.n_head_kv.max(1);
    (2..=8).contains(&group)
        && p.n_head.is_multiple_of(p.n_head_kv)
        && p.head_dim.is_multiple_of(32)
        && p.head_dim <= 128
}

/// The tensor-core prefill attention kernel for `p`'s heads: 64- or 128-dim heads, whole
/// groups of query heads per kv head; `None` keeps `attention_prefill`.
fn prefill_mma_kernel(p: &AttnParams) -> Option<&'static str> {
    if p.n_head_kv == 0 || !p.n_head.is_multiple_of(p.n_head_kv) {
        return None;
    }
    match p.head_dim {
        64 => Some("attention_prefill_mma64"),
        128 => Some("attention_prefill_mma128"),
        _ => None,
    }
}

/// Whether split decode attention runs `attention_split_tiled64` / `attention_split_tiled128`
/// (tensor cores; one block per kv head and key range, the keys in 16-key chunks through
/// shared memory): heads of 64 or 128 dims, 1 to 8 query heads per kv head. The kernels
/// need sm_80, as the `mmq_*` kernels do.
fn tiled_split_attention(p: &AttnParams) -> bool {
    p.n_head_kv > 0
        && p.n_head.is_multiple_of(p.n_head_kv)
        && (1..=TILED_ATTN_MAX_GROUP).contains(&(p.n_head / p.n_head_kv))
        && matches!(p.head_dim, 64 | 128)
}

/// A merged Q/K/V product (`qkv` through cuBLAS) whose split into q, k and v waits for the
/// next launch: `rope_store_kv` takes it and reads its heads straight from the product; any
/// other launch, or the end of the step, splits it first (`split_qkv`).
struct PendingSplit {
    /// `split_qkv`'s arguments: the product, q, k, v, the three biases (0: none), the
    /// widths of q and k, the values.
    args: [Arg; 10],
    n: usize,
}

/// A kernel argument.
#[derive(Clone, Copy, Debug)]
enum Arg {
    /// A device pointer.
    P(u64),
    I(i32),
    L(i64),
    F(f32),
}

impl PartialEq for Arg {
    fn eq(&self, other: &Arg) -> bool {
        match (self, other) {
            (Arg::P(a), Arg::P(b)) => a == b,
            (Arg::I(a), Arg::I(b)) => a == b,
            (Arg::L(a), Arg::L(b)) => a == b,
            // Bit equality: a graph replays exactly the recorded value.
            (Arg::F(a), Arg::F(b)) => a.to_bits() == b.to_bits(),
            _ => false,
        }
    }
}

/// One kernel launch, as recorded for a step.
#[derive(Clone, Debug, PartialEq)]
struct Launch {
    func: usize,
    grid: (u32, u32, u32),
    block: u32,
    args: Vec<Arg>,
    /// Weight bytes the launch streams (GEMVs; 0 otherwise), for the profiler's GB/s.
    weight_bytes: u64,
}

/// A captured step.
struct StepGraph(CudaGraph);

// SAFETY: a CUDA graph exec handle may be launched from any thread; the backend only
// touches it under the recorder's mutex.
unsafe impl Send for StepGraph {}

/// Launches of the step being recorded, the last list run eagerly, and the graphs.
#[derive(Default)]
struct Recorder {
    /// Whether launches are being recorded instead of issued.
    deferring: bool,
    pending: Vec<Launch>,
    previous: Vec<Launch>,
    graphs: Vec<(Vec<Launch>, StepGraph)>,
    captures: u64,
}

/// Launches bracketed by timing events, and the totals per (kernel, grid).
/// A (kernel, grid) pair the profiler totals by.
type KernelKey = (usize, (u32, u32, u32));

/// A launch bracketed by two timing events.
type TimedLaunch = (
    KernelKey,
    u64,
    cudarc::driver::CudaEvent,
    cudarc::driver::CudaEvent,
);

#[derive(Default)]
struct Profiler {
    pending: Vec<TimedLaunch>,
    /// Milliseconds, calls and weight bytes per (kernel, grid).
    totals: HashMap<KernelKey, (f64, u64, u64)>,
    /// Steps run (prepare_step calls), for per-step times.
    steps: u64,
}

/// [`CudaBackend::multi_q8_layout`]'s answer.
struct MultiQ8 {
    npad: usize,
    mmk: bool,
    q8: Q8Ptrs,
}

/// Buffers and sizes one layer's attention launches share.
struct AttnLaunch {
    q: u64,
    k: u64,
    v: u64,
    out: u64,
    block_size: usize,
    window: i32,
    /// Single-token steps: the 8-bit activation buffers (values, block steps) the output's
    /// quantization goes to as well, for the output projection's gemv_q8.
    q8: Option<(u64, u64)>,
    /// Steps of a few tokens whose output projection reads mmk's layout: the padded row
    /// count and the buffers (values, per-256 steps, group sums) attention_combine_mmk
    /// writes.
    mmk: Option<(usize, [u64; 3])>,
}

/// One matrix of a GEMV launch.
struct GemvSeg {
    ptr: u64,
    row_bytes: usize,
    ty: GgmlType,
    rows: usize,
    out: u64,
    ld: usize,
    bias: u64,
    /// Add into `out` instead of overwriting it (single-token `gemv_dec` only).
    accumulate: bool,
}

impl GemvSeg {
    /// The segment of matrix `w` writing `ld`-float rows at `out` (None: not a matrix).
    fn of(w: &CudaWeight, out: u64, ld: usize, bias: u64) -> Option<GemvSeg> {
        let CudaWeight::Matrix {
            ptr,
            ty,
            rows,
            row_bytes,
            ..
        } = w
        else {
            return None;
        };
        Some(GemvSeg {
            ptr: *ptr,
            row_bytes: *row_bytes,
            ty: *ty,
            rows: *rows,
            out,
            ld,
            bias,
            accumulate: false,
        })
    }
}

/// Whether the GEMV kernels read `ty` with rows of `cols` values.
fn gemv_supported(ty: GgmlType, cols: usize) -> bool {
    match ty {
        GgmlType::Q4K | GgmlType::Q6K => cols.is_multiple_of(256),
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 => cols.is_multiple_of(32),
        GgmlType::F16 | GgmlType::BF16 => cols.is_multiple_of(8),
        GgmlType::F32 => cols.is_multiple_of(4),
        _ => false,
    }
}

/// The tensor-core kernel families of steps of several tokens (see `CudaBackend::mmq_plan`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum MmqKind {
    /// `mmq_t8` / `mmk_t8*`: int8 activations, every warp loading its own activation
    /// fragments.
    Int8,
    /// `mms_*`: int8 activations per 256 values (`mmk_t8*`'s layout) staged in shared memory.
    Staged,
}

/// How many blocks of an `mms_*` launch (`tiles` tiles, rows of `steps` 256-value steps,
/// `npad` tokens) share each tile's row length: enough blocks for `blocks_per_sm` per SM
/// (as many of the kernel's blocks as are resident at once), at
/// least two steps each, and room for the partial sums. Every split gets at least one step
/// (the count is recomputed from the steps per split).
fn mms_splits(tiles: usize, steps: usize, npad: usize, sms: usize, blocks_per_sm: usize) -> usize {
    if tiles == 0 || steps < 4 || tiles > MMS_MAX_TILES {
        return 1;
    }
    let want = (blocks_per_sm * sms).div_ceil(tiles).min(steps / 2);
    if want <= 1 {
        return 1;
    }
    let per = steps.div_ceil(want);
    let splits = steps.div_ceil(per);
    // Floats of partial sums per block: MMS_ROWS rows × npad tokens.
    let per_block = MMS_ROWS * npad;
    if tiles * splits * per_block > MMS_WORK_FLOATS {
        return 1;
    }
    splits
}

/// Dynamic shared memory of a kernel's launches: `mms_*` stage MS_STAGES (3) steps of their
/// block's 64 weight rows (MS_WROW = 224 bytes each) and of the activations of their 8·J
/// tokens (MS_XROW = 288 bytes each and a 4-byte step; kernels/mmq.cu); others use none.
fn dynamic_smem(name: &str) -> u32 {
    if name == "mmw_gated" {
        return MW_STAGES * (MW_XBYTES + (MW_MAX_WARPS * 2 * MW_TILE_BYTES) as u32);
    }
    let tokens = match name.strip_suffix("_gated").unwrap_or(name) {
        "mms_t16" => 16,
        "mms_t32" => 32,
        _ => return 0,
    };
    3 * (MMS_ROWS as u32 * 224 + tokens * (288 + 4))
}

/// Whether single-token `gemv_ws` reads these segments: Q4_K / Q6_K rows (gated: Q4_K
/// gate and up of equal row bytes), 16-byte aligned (cp.async).
fn ws_takes(segs: &[GemvSeg], gated: bool) -> bool {
    let aligned = segs
        .iter()
        .all(|s| s.ptr.is_multiple_of(16) && s.row_bytes.is_multiple_of(16));
    let formats = if gated {
        segs[0].ty == GgmlType::Q4K
            && segs[1].ty == GgmlType::Q4K
            && segs[0].row_bytes == segs[1].row_bytes
    } else {
        segs.iter()
            .all(|s| matches!(s.ty, GgmlType::Q4K | GgmlType::Q6K))
    };
    aligned && formats
}

/// Waves of 2 blocks a SM beyond which a launch stays off `mmk_t8*` (see `mmk_reads`).
const MMK_MAX_WAVES: usize = 8;

/// A Q6_K block as the GPU stores it (`Q6K_GPU_BYTES` in kernels/quant.cu).
const Q6K_GPU_BLOCK_BYTES: usize = 224;

/// `data` (whole blocks of `from` bytes) with each block followed by zeros up to `to` bytes.
/// The tensors whose f16 copies a leader's copy holds behind its own rows, in order: K and V
/// behind Q, so one cuBLAS product computes all three (`CudaBackend::qkv`), and up behind
/// gate.
fn merged_followers(leader: &str) -> Vec<String> {
    if let Some(prefix) = leader.strip_suffix("attn_q.weight") {
        return vec![
            format!("{prefix}attn_k.weight"),
            format!("{prefix}attn_v.weight"),
        ];
    }
    // Up behind gate: one product for both (`CudaBackend::gate_up_of`).
    match leader.strip_suffix("ffn_gate.weight") {
        Some(prefix) => vec![format!("{prefix}ffn_up.weight")],
        None => Vec::new(),
    }
}

/// The kernels' code of an activation (`gated_value` in kernels/ops.cu).
fn activation_id(act: Activation) -> i32 {
    match act {
        Activation::Silu => 0,
        Activation::GeluTanh => 1,
    }
}

/// Rows of a GGUF matrix (the product of its dimensions after the first).
fn tensor_rows(t: &TensorInfo) -> usize {
    t.dims.iter().skip(1).product::<u64>() as usize
}

fn pad_blocks(data: &[u8], from: usize, to: usize) -> Vec<u8> {
    let mut out = vec![0u8; data.len() / from * to];
    for (src, dst) in data.chunks_exact(from).zip(out.chunks_exact_mut(to)) {
        dst[..from].copy_from_slice(src);
    }
    out
}

/// Rows of `row_bytes` bytes (blocks of `block` bytes) rearranged part by part: for each
/// (offset, length) in `parts`, that slice of every block of the row, in block order; rows
/// of `out_row` ≥ `row_bytes` bytes (zeros after). The layout the kernels read for Q8_0,
/// Q4_0 and Q5_0: the quants of the whole row first, so that they are 16-byte aligned.
fn split_planes(
    data: &[u8],
    row_bytes: usize,
    out_row: usize,
    block: usize,
    parts: &[(usize, usize)],
) -> Vec<u8> {
    let mut out = vec![0u8; data.len() / row_bytes * out_row];
    for (src, dst) in data
        .chunks_exact(row_bytes)
        .zip(out.chunks_exact_mut(out_row))
    {
        let mut at = 0;
        for &(offset, len) in parts {
            for blk in src.chunks_exact(block) {
                dst[at..at + len].copy_from_slice(&blk[offset..offset + len]);
                at += len;
            }
        }
    }
    out
}

/// Token rows the int8 `mmq_*` kernels' activations take for a step of `n` tokens (whole
/// 8-token tiles; `quantize_x_mmq` / `rms_norm_mmq` zero the padding).
fn mmq_int8_rows(n: usize) -> usize {
    n.next_multiple_of(8)
}

/// Warps of a `gemv_dec` / `gemv_q8` launch at `rows_per_warp`: each matrix's rows in
/// groups (gated launches: gate's rows, each warp reading up's too).
fn gemv_warps(segs: &[GemvSeg], gated: bool, rows_per_warp: usize) -> usize {
    if gated {
        segs[0].rows.div_ceil(rows_per_warp)
    } else {
        segs.iter().map(|s| s.rows.div_ceil(rows_per_warp)).sum()
    }
}

/// Values one lane handles per step of the GEMV loop (see `Fmt<..>::units`).
fn gemv_unit_values(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q4K | GgmlType::Q6K => 32,
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 => 16,
        GgmlType::F16 | GgmlType::BF16 => 8,
        _ => 4,
    }
}

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    funcs: Vec<CudaFunction>,
    /// Dynamic shared memory of each kernel's launches (bytes; see [`dynamic_smem`]).
    func_smem: Vec<u32>,
    func_index: HashMap<&'static str, usize>,
    recorder: Mutex<Recorder>,
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
    /// The activation tensor whose first row the Q8 buffers hold (set by `rms_norm_q8`;
    /// any other launch clears it).
    q8_holds: Mutex<Option<u64>>,
    /// (tensor, rows, f16 buffer): the f16 copy of those rows of an activation tensor
    /// that `rms_norm_f16` / `gated_act_f16` left in the GEMM scratch for the cuBLAS
    /// products reading it next ([`Self::x_to_f16`] then converts nothing; any other
    /// launch clears it).
    f16_holds: Mutex<Option<(u64, usize, u64)>>,
    /// A merged Q/K/V product not yet split into q, k and v (see [`PendingSplit`]), and
    /// whether there is one (every launch asks; only cuBLAS steps set it).
    pending_split: Mutex<Option<PendingSplit>>,
    split_waits: std::sync::atomic::AtomicBool,
    /// The activation tensor, its token count and padded rows whose quantization for the
    /// int8 kernels the Q8 buffers hold, and whether in `mmk_t8*`'s layout (set by
    /// `rms_norm_mmq` / `rms_norm_mmk`; any launch other than those kernels clears it).
    mmq_holds: Mutex<Option<(u64, usize, usize, bool)>>,
    /// Steps of up to 8 tokens on Q4_K / Q6_K weights: `mmk_t8*` (activations quantized per
    /// 256 values, integer sums per super-block) instead of `mmq_t8` (on by default; the
    /// self-check turns it off to cover `mmq_t8` on those formats, which the LM head takes).
    mmk: std::sync::atomic::AtomicBool,
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
    /// `sample_rows`' settings, packed on the host and their device copy (grown).
    sample_params: Mutex<(Vec<u32>, Option<CudaSlice<u32>>)>,
    /// Whether some weight has an f16 copy (or is F16) that small batches multiply through
    /// cuBLAS (then steps of 2–8 tokens are not recorded for graph replay).
    f16_copies: std::sync::atomic::AtomicBool,
    /// The Q8-capable types (bit `GgmlType::id()`) of which some weight has an f16 copy:
    /// cuBLAS takes their steps that the 8-bit kernels do not.
    f16_copies_q8: std::sync::atomic::AtomicU64,
    /// f16 operands of those products, grown to the largest seen.
    gemm_scratch: Mutex<GemmScratch>,
    /// Streaming multiprocessors of the device (the split rules of `mms_*` and `mmw_gated`).
    sm_count: usize,
    /// Warps (16-row tiles) per block of `mmw_gated`; 0 (the default): by the matrix and
    /// the SM count; the self-check forces others.
    mmw_warps: std::sync::atomic::AtomicUsize,
}

/// Int8 activations and their per-32 scales for `gemv_q8` (and for `mmq_t*`: scales with
/// the block sums, token-minor).
struct Q8Scratch {
    q: CudaSlice<i8>,
    d: CudaSlice<f32>,
    ds: CudaSlice<f32>,
    /// Split partial sums of the `mms_*` kernels (MMS_WORK_FLOATS) and their per-tile
    /// arrival counters (MMS_MAX_TILES, zero between launches).
    work: CudaSlice<f32>,
    count: CudaSlice<u32>,
    /// Values it holds room for.
    cap: usize,
}

/// Device addresses of a [`Q8Scratch`]'s buffers.
struct Q8Ptrs {
    q: u64,
    d: u64,
    ds: u64,
    work: u64,
    count: u64,
}

impl Q8Ptrs {
    /// Where mmk's layout keeps, in the scale buffer, the per-256 steps and the group sums
    /// of `npad` token rows of `k` values: the steps first, then the sums.
    fn mmk_steps_sums(&self, npad: usize, k: usize) -> (u64, u64) {
        (self.ds, self.ds + 4 * (npad * k / 256) as u64)
    }
}

/// Weight types `gemv_q8` reads.
fn q8_supported(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4K | GgmlType::Q6K | GgmlType::Q8_0 | GgmlType::Q4_0
    )
}

/// Device buffers holding a dequantized weight and the converted activations.
#[derive(Default)]
struct GemmScratch {
    w: Option<CudaSlice<u16>>,
    x: Option<CudaSlice<u16>>,
    /// The merged Q/K/V product's f32 output (two u16 a value), split by `split_qkv`.
    qkv: Option<CudaSlice<u16>>,
    /// The merged gate/up product's f32 output (two u16 a value).
    gate_up: Option<CudaSlice<u16>>,
    /// f16 activations written by a kernel that reads others from `x` (`mmw_gated`).
    h: Option<CudaSlice<u16>>,
}

/// Steps of more tokens than this multiply through cuBLAS (when present): below it the
/// cost of dequantizing each weight to f16 outweighs the tensor cores' gain.
pub const GEMM_MIN_TOKENS: usize = 16;

/// Products whose output is at least this large copy their rows to the host as they are
/// made while the host reads every step's rows (see `gemm_reading_ahead`), in this many
/// column chunks.
const READ_AHEAD_MIN_BYTES: usize = 8 << 20;
const READ_AHEAD_CHUNKS: usize = 4;

/// The most tokens a step multiplies through the merged Q/K/V f16 copy (see `qkv`).
const MERGED_QKV_MAX_TOKENS: usize = 512;

/// A host array of RoPE frequency factors, its device copy and that copy's address.
type UploadedFactors = (Arc<[f32]>, CudaSlice<f32>, u64);

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

/// The paged KV cache: per layer, `n_blocks × block_size` slots of `kv_dim` f16 values.
pub struct CudaCache {
    k: Vec<CudaSlice<u16>>,
    v: Vec<CudaSlice<u16>>,
    k_ptr: Vec<u64>,
    v_ptr: Vec<u64>,
    block_size: usize,
    n_blocks: usize,
    kv_dim: usize,
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
    n_logit_rows: usize,
}

impl CudaStep {
    fn at(&self, slot: usize) -> u64 {
        self.ptr + (slot * self.max_tokens * 4) as u64
    }
    fn tokens(&self) -> u64 {
        self.at(0)
    }
    fn positions(&self) -> u64 {
        self.at(1)
    }
    fn seq_of(&self) -> u64 {
        self.at(2)
    }
    fn logit_rows(&self) -> u64 {
        self.at(3)
    }
    fn table_off(&self) -> u64 {
        self.at(4)
    }
    fn tables(&self) -> u64 {
        self.at(6)
    }
    /// What a kernel needs to find each token's KV slot: positions, owning sequence,
    /// each sequence's block-table offset, the block tables.
    fn slot_args(&self) -> [Arg; 4] {
        [
            Arg::P(self.positions()),
            Arg::P(self.seq_of()),
            Arg::P(self.table_off()),
            Arg::P(self.tables()),
        ]
    }
    /// The longest sequence (cached positions after this step) among the step's.
    fn max_kv_len(&self) -> usize {
        let t = self.max_tokens;
        self.host
            .get(5 * t..6 * t)
            .and_then(|l| l.iter().max())
            .map_or(0, |&m| m as usize)
    }

    /// (start, length) of each run of consecutive tokens of the same sequence among the
    /// step's first `n` tokens.
    fn sequence_runs(&self, n: usize) -> Vec<(usize, usize)> {
        let t = self.max_tokens;
        let seq_of = self.host.get(2 * t..2 * t + n).unwrap_or(&[]);
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for (i, s) in seq_of.iter().enumerate() {
            match runs.last_mut() {
                Some((start, len)) if seq_of[*start] == *s => *len += 1,
                _ => runs.push((i, 1)),
            }
        }
        runs
    }
}

fn grid_1d(len: usize, block: usize) -> (u32, u32, u32) {
    (len.div_ceil(block) as u32, 1, 1)
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
        for &name in compile::KERNELS {
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
            recorder: Mutex::new(Recorder::default()),
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
            sample_params: Mutex::new((Vec::new(), None)),
            q8_decode: std::sync::atomic::AtomicBool::new(options.q8),
            q8_scratch: Mutex::new(None),
            pdl: options.pdl && major >= 9,
            q8_holds: Mutex::new(None),
            f16_holds: Mutex::new(None),
            pending_split: Mutex::new(None),
            split_waits: std::sync::atomic::AtomicBool::new(false),
            mmq_holds: Mutex::new(None),
            mmk: std::sync::atomic::AtomicBool::new(true),
            gemm_scratch: Mutex::default(),
            sm_count,
            mmw_warps: std::sync::atomic::AtomicUsize::new(0),
            options,
        })
    }

    /// A `rows × cols` matrix of type `ty` from its GGUF block bytes.
    pub fn upload_matrix(
        &self,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> anyhow::Result<CudaWeight> {
        if !SUPPORTED_TYPES.contains(&ty) {
            bail!("type {ty} is not supported by the CUDA backend yet");
        }
        let row_bytes = ty
            .bytes_for(cols as u64)
            .with_context(|| format!("rows of {cols} values are not whole {ty} blocks"))?
            as usize;
        if data.len() != row_bytes * rows {
            bail!("{} bytes, expected {}", data.len(), row_bytes * rows);
        }
        // Q6_K blocks are padded to 16-byte-aligned ones (Q6K_GPU_BYTES in kernels/quant.cu):
        // their 210 bytes otherwise allow only 2-byte loads, which bound the kernels reading
        // them on load instructions (ncu: L1/TEX 78% busy against DRAM 32%).
        // Q8_0 / Q4_0 / Q5_0 rows keep all quants first, then (Q5_0) the fifth bits, then
        // the f16 scales, each row padded to a multiple of 16 bytes (nothing to pad when it
        // holds a multiple of 8 blocks, as in every real model): aligned loads for all.
        let converted;
        let (data, row_bytes) = match ty {
            GgmlType::Q6K => {
                converted = pad_blocks(data, ty.type_size(), Q6K_GPU_BLOCK_BYTES);
                (&converted[..], cols / 256 * Q6K_GPU_BLOCK_BYTES)
            }
            GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 => {
                // (offset, length) of each block's parts, in the order the row keeps them.
                let parts: &[(usize, usize)] = match ty {
                    GgmlType::Q8_0 => &[(2, 32), (0, 2)],
                    GgmlType::Q4_0 => &[(2, 16), (0, 2)],
                    _ => &[(6, 16), (2, 4), (0, 2)],
                };
                let gpu_row_bytes = row_bytes.next_multiple_of(16);
                converted = split_planes(data, row_bytes, gpu_row_bytes, ty.type_size(), parts);
                (&converted[..], gpu_row_bytes)
            }
            _ => (data, row_bytes),
        };
        let buf = self
            .stream
            .clone_htod(data)
            .map_err(|e| anyhow::anyhow!("uploading a matrix: {e:?}"))?;
        let ptr = self.ptr(&buf);
        Ok(CudaWeight::Matrix {
            buf,
            ptr,
            ty,
            rows,
            cols,
            row_bytes,
            f16: None,
            mmw: None,
        })
    }

    /// Adds the mmw copy (kernels/mmw.cu) to a Q4_K matrix when [`Self::keep_mmw_copy`]
    /// allows it; other matrices are left as they are.
    pub fn add_mmw_copy(&self, w: &mut CudaWeight) -> anyhow::Result<()> {
        if let CudaWeight::Matrix {
            ptr,
            ty,
            rows,
            cols,
            row_bytes,
            mmw,
            ..
        } = w
            && mmw.is_none()
            && self.keep_mmw_copy(*ty, *rows, *cols)
        {
            *mmw = Some(self.repack_mmw(*ptr, *row_bytes, *rows, *cols)?);
        }
        Ok(())
    }

    /// Bytes of a `rows × cols` Q4_K matrix in the mmw layout.
    fn mmw_bytes(rows: usize, cols: usize) -> usize {
        rows.div_ceil(16) * (cols / 256) * MW_TILE_BYTES
    }

    /// Whether to keep the mmw copy of a `ty` matrix (Q4_K, rows of whole 256-value
    /// blocks): unless `KESTREL_CUDA_MMW=0`, when it leaves at least 40% of the GPU's memory
    /// (and 8 GiB) free, as the f16 copies.
    fn keep_mmw_copy(&self, ty: GgmlType, rows: usize, cols: usize) -> bool {
        if ty != GgmlType::Q4K || !cols.is_multiple_of(256) || cols == 0 {
            return false;
        }
        self.options.mmw_copies && Self::leaves_room_for_cache(Self::mmw_bytes(rows, cols))
    }

    /// The mmw copy of the Q4_K matrix at `ptr` (kernels/mmw.cu: `repack_q4k_mmw`).
    fn repack_mmw(
        &self,
        ptr: u64,
        row_bytes: usize,
        rows: usize,
        cols: usize,
    ) -> anyhow::Result<CudaSlice<u8>> {
        let copy = self.alloc::<u8>(Self::mmw_bytes(rows, cols), "an mmw weight copy")?;
        let threads = rows.div_ceil(16) * (cols / 256) * 32;
        self.launch(
            "repack_q4k_mmw",
            grid_1d(threads, 256),
            256,
            &[
                Arg::P(ptr),
                Arg::L(row_bytes as i64),
                Arg::I(rows as i32),
                Arg::I(cols as i32),
                Arg::P(self.ptr(&copy)),
            ],
        );
        self.check()?;
        Ok(copy)
    }

    /// A `rows × cols` activation tensor holding `data` (row-major).
    pub fn upload_tensor(
        &self,
        rows: usize,
        cols: usize,
        data: &[f32],
    ) -> anyhow::Result<CudaTensor> {
        if data.len() != rows * cols {
            bail!("{} values for a {rows}×{cols} tensor", data.len());
        }
        let buf = self
            .stream
            .clone_htod(data)
            .map_err(|e| anyhow::anyhow!("uploading a tensor: {e:?}"))?;
        let ptr = self.ptr(&buf);
        Ok(CudaTensor {
            buf,
            ptr,
            rows,
            cols,
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

    /// Turns graph capture and replay of decode steps on or off (on by default; the
    /// environment variable `KESTREL_CUDA_GRAPHS=0` turns it off).
    pub fn set_graphs(&self, on: bool) {
        self.flush();
        self.graphs.store(on, std::sync::atomic::Ordering::Relaxed);
        let mut rec = self.lock_recorder();
        rec.graphs.clear();
        rec.previous.clear();
    }

    /// Graphs captured so far.
    pub fn graphs_captured(&self) -> u64 {
        self.lock_recorder().captures
    }

    /// A counter of the steps replayed from a graph, readable after the backend has moved
    /// into an engine.
    pub fn replay_counter(&self) -> Arc<std::sync::atomic::AtomicU64> {
        self.replays.clone()
    }

    fn lock_recorder(&self) -> std::sync::MutexGuard<'_, Recorder> {
        self.recorder.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn launch_now(&self, l: &Launch) {
        let timing = self.profile.as_ref().and_then(|_| {
            let ev = || {
                self.ctx
                    .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .ok()
            };
            let (a, b) = (ev()?, ev()?);
            a.record(&self.stream).ok()?;
            Some((a, b))
        });
        self.launch_raw(l);
        if let (Some(p), Some((a, b))) = (&self.profile, timing)
            && b.record(&self.stream).is_ok()
        {
            let mut p = p.lock().unwrap_or_else(|e| e.into_inner());
            p.pending.push(((l.func, l.grid), l.weight_bytes, a, b));
        }
    }

    /// Drains the profiler's finished launches into its totals (after a synchronize).
    fn profile_collect(&self) {
        if let Some(p) = &self.profile {
            let mut p = p.lock().unwrap_or_else(|e| e.into_inner());
            let pending = std::mem::take(&mut p.pending);
            for (key, bytes, a, b) in pending {
                if let Ok(ms) = a.elapsed_ms(&b) {
                    let e = p.totals.entry(key).or_default();
                    e.0 += ms as f64;
                    e.1 += 1;
                    e.2 += bytes;
                }
            }
        }
    }

    /// Issues one launch on the stream, with programmatic stream serialization unless
    /// `KESTREL_CUDA_PDL=0`: the kernel may be scheduled while the previous one runs, and
    /// waits for it in `pdl_enter` (kernels/common.cuh), which hides the launch latency
    /// between the step's kernels.
    fn launch_raw(&self, l: &Launch) {
        // Each argument in an 8-byte slot (little-endian: a 4-byte argument is the low
        // half); the driver reads each parameter's size from the kernel's signature.
        let mut slots: Vec<u64> = l
            .args
            .iter()
            .map(|a| match *a {
                Arg::P(v) => v,
                Arg::I(v) => u64::from(v as u32),
                Arg::L(v) => v as u64,
                Arg::F(v) => u64::from(v.to_bits()),
            })
            .collect();
        let mut params: Vec<*mut std::ffi::c_void> =
            slots.iter_mut().map(|s| (s as *mut u64).cast()).collect();
        // SAFETY: the union is plain data; all-zero is a valid value of every member.
        let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        value.programmaticStreamSerializationAllowed = 1;
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value,
        };
        let cfg = sys::CUlaunchConfig {
            gridDimX: l.grid.0,
            gridDimY: l.grid.1,
            gridDimZ: l.grid.2,
            blockDimX: l.block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: self.func_smem[l.func],
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(self.pdl),
        };
        if let Err(e) = self.ctx.bind_to_thread() {
            self.fail(format!("binding the CUDA context: {e:?}"));
            return;
        }
        // SAFETY: every kernel's arguments are built by the matching method below, with
        // pointers to live buffers sized by the same geometry the kernel uses; `params`
        // points into `slots`, both alive across the call (the driver copies them).
        let r = unsafe {
            sys::cuLaunchKernelEx(
                &cfg,
                self.funcs[l.func].cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            self.fail(format!("launching {}: {r:?}", compile::KERNELS[l.func]));
        }
    }

    /// Issues the recorded launches of the current step: from a graph when the same list
    /// was seen before, eagerly otherwise.
    fn flush(&self) {
        let mut rec = self.lock_recorder();
        rec.deferring = false;
        if rec.pending.is_empty() {
            return;
        }
        let pending = std::mem::take(&mut rec.pending);
        if let Some(i) = rec.graphs.iter().position(|(l, _)| *l == pending) {
            if let Err(e) = rec.graphs[i].1.0.launch() {
                self.fail(format!("launching a CUDA graph: {e:?}"));
            }
            self.replays
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            rec.pending = pending;
            rec.pending.clear();
            return;
        }
        if pending == rec.previous {
            match self.capture(&pending) {
                Ok(graph) => {
                    if let Err(e) = graph.launch() {
                        self.fail(format!("launching a CUDA graph: {e:?}"));
                    }
                    rec.captures += 1;
                    self.replays
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if rec.graphs.len() >= MAX_GRAPHS {
                        rec.graphs.remove(0);
                    }
                    rec.graphs.push((pending, StepGraph(graph)));
                    rec.previous.clear();
                    return;
                }
                Err(e) => {
                    // Run the step eagerly and stop trying.
                    self.graphs
                        .store(false, std::sync::atomic::Ordering::Relaxed);
                    self.fail(format!("capturing a CUDA graph: {e}"));
                }
            }
        }
        for l in &pending {
            self.launch_now(l);
        }
        rec.previous = pending;
    }

    /// Captures `launches` on the stream into an instantiated graph.
    fn capture(&self, launches: &[Launch]) -> anyhow::Result<CudaGraph> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(|e| anyhow::anyhow!("begin capture: {e:?}"))?;
        for l in launches {
            self.launch_now(l);
        }
        let graph = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(|e| anyhow::anyhow!("end capture: {e:?}"))?;
        if let Some(msg) = self.lock_error().clone() {
            bail!("a launch failed during capture: {msg}");
        }
        graph.context("the capture produced no graph")
    }

    /// Waits for the queued work; returns the first error of any operation since the last
    /// check.
    pub fn check(&self) -> anyhow::Result<()> {
        self.split_pending();
        self.flush();
        // A step ends here: the next one quantizes its activations afresh.
        *self.q8_holds.lock().unwrap_or_else(|p| p.into_inner()) = None;
        *self.f16_holds.lock().unwrap_or_else(|p| p.into_inner()) = None;
        let sync = self.stream.synchronize();
        self.profile_collect();
        if let Some(msg) = self.lock_error().take() {
            bail!("CUDA: {msg}");
        }
        sync.map_err(|e| anyhow::anyhow!("CUDA: {e:?}"))?;
        self.ctx
            .check_err()
            .map_err(|e| anyhow::anyhow!("CUDA: {e:?}"))?;
        Ok(())
    }

    fn lock_error(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        // A poisoned lock still holds a usable Option.
        self.error.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn fail(&self, msg: String) {
        let mut e = self.lock_error();
        if e.is_none() {
            *e = Some(msg);
        }
    }

    fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _sync) = s.device_ptr(&self.stream);
        p
    }

    fn launch(&self, name: &'static str, grid: (u32, u32, u32), block: u32, args: &[Arg]) {
        self.launch_reading(name, grid, block, args, 0);
    }

    /// [`Self::launch`] of a kernel that streams `weight_bytes` of weights (the profiler
    /// reports its GB/s).
    fn launch_reading(
        &self,
        name: &'static str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
        weight_bytes: u64,
    ) {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return;
        }
        // Any kernel may write the rows a read-ahead copied: it no longer stands for them.
        self.read_ahead_valid
            .store(false, std::sync::atomic::Ordering::Relaxed);
        let Some(&func) = self.func_index.get(name) else {
            self.fail(format!("kernel {name} not loaded"));
            return;
        };
        self.split_pending();
        // Only the GEMVs that read them keep the quantized activations valid.
        if !matches!(
            name,
            "rms_norm_q8" | "gemv_q8" | "gemv_q8_r1" | "gemv_q8_b" | "gemv_q8_b_r1" | "gemv_ws_r1"
        ) {
            *self.q8_holds.lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
        if !matches!(name, "rms_norm_f16" | "gated_act_f16") {
            *self.f16_holds.lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
        if !(name == "rms_norm_mmq"
            || name == "rms_norm_mmk"
            || name.starts_with("mmq_t")
            || name.starts_with("mmk_t")
            || name.starts_with("mms_t"))
        {
            *self.mmq_holds.lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
        let l = Launch {
            func,
            grid,
            block,
            args: args.to_vec(),
            weight_bytes,
        };
        let mut rec = self.lock_recorder();
        if rec.deferring {
            rec.pending.push(l);
        } else {
            drop(rec);
            self.launch_now(&l);
        }
    }

    /// Whether to keep an f16 copy of a `ty` matrix of `len` values next to its blocks, so
    /// prompt-sized products skip dequantizing it each time. `KESTREL_CUDA_F16_WEIGHTS=1`
    /// always, `=0` never; by default when cuBLAS is present and the copy leaves at least
    /// 40% of the GPU's memory (and 8 GiB) free for the KV cache and activations. F16
    /// weights need no copy.
    fn keep_f16_copy(&self, ty: GgmlType, len: usize) -> bool {
        if self.blas.is_none() || ty == GgmlType::F16 {
            return false;
        }
        match self.options.f16_copies {
            F16Copies::Never => false,
            F16Copies::Always => true,
            F16Copies::ByMemory => Self::leaves_room_for_cache(len * 2),
        }
    }

    /// Whether `bytes` more of weight copies still leave at least 40% of the GPU's memory
    /// (and 8 GiB) free for the KV cache and activations (the rule for every optional copy).
    fn leaves_room_for_cache(bytes: usize) -> bool {
        match cudarc::driver::result::mem_get_info() {
            Ok((free, total)) => {
                let reserve = (total / 10 * 4).max(8 << 30);
                free.saturating_sub(bytes) >= reserve
            }
            Err(_) => false,
        }
    }

    /// Adds the dequantized f16 copy to a matrix, in a buffer of `room_rows` rows (at least
    /// its own; the rest for the matrices merged behind it).
    fn add_f16_copy(&self, w: &mut CudaWeight, room_rows: usize) -> anyhow::Result<()> {
        let CudaWeight::Matrix { rows, cols, .. } = w else {
            return Ok(());
        };
        let copy = self.alloc::<u16>(room_rows.max(*rows) * *cols, "an f16 weight copy")?;
        let at = self.ptr(&copy);
        self.dequant_f16_into(w, at)?;
        let CudaWeight::Matrix { ty, f16, .. } = w else {
            return Ok(());
        };
        *f16 = Some(copy);
        self.note_f16_copy(*ty);
        Ok(())
    }

    /// Records that a `ty` matrix has an f16 copy: small batches of it will use cuBLAS
    /// unless the 8-bit GEMVs read it.
    fn note_f16_copy(&self, ty: GgmlType) {
        if q8_supported(ty) {
            self.f16_copies_q8
                .fetch_or(1 << ty.id(), std::sync::atomic::Ordering::Relaxed);
        } else {
            self.f16_copies
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Rows to allocate for the f16 copy of `info` (`rows` × `cols`): its own, plus those of
    /// the matrices merged behind it ([`merged_followers`]) when all of them are in the
    /// file with rows of `cols` values and the whole copy fits [`Self::keep_f16_copy`].
    fn merge_f16_behind(
        &self,
        file: &GgufFile,
        info: &TensorInfo,
        rows: usize,
        cols: usize,
    ) -> usize {
        let mut total = rows;
        let followers = merged_followers(&info.name);
        for name in &followers {
            match file.tensor(name) {
                Some(t) if t.dims.len() == 2 && t.dims[0] as usize == cols => {
                    total += tensor_rows(t)
                }
                _ => return rows,
            }
        }
        if followers.is_empty() || !self.keep_f16_copy(info.ty, total * cols) {
            return rows;
        }
        total
    }

    /// Dequantizes matrix `w` to f16 rows at device address `at`.
    fn dequant_f16_into(&self, w: &CudaWeight, at: u64) -> anyhow::Result<()> {
        let CudaWeight::Matrix {
            ptr,
            ty,
            rows,
            cols,
            row_bytes,
            ..
        } = w
        else {
            return Ok(());
        };
        self.launch(
            "dequant_f16",
            grid_1d(*rows * cols.div_ceil(32), 256),
            256,
            &[
                Arg::P(*ptr),
                Arg::I(ty.id() as i32),
                Arg::L(*row_bytes as i64),
                Arg::I(*cols as i32),
                Arg::I(*rows as i32),
                Arg::P(at),
            ],
        );
        self.check()
    }

    /// Whether a product of `n` tokens with `w` should go through cuBLAS: never while a
    /// step is being recorded for graph replay (cuBLAS calls are not recorded launches);
    /// from GEMM_MIN_TOKENS tokens, or from 2 when `w` needs no dequantizing (f16 copy or
    /// F16 weights: one read of 2 bytes per weight beats the GEMV kernels' per-token cost).
    fn prefer_gemm(&self, w: &CudaWeight, n: usize) -> bool {
        if let CudaWeight::Matrix { ty, cols, .. } = w
            && self.mmq_reads(*ty, n)
            && gemv_supported(*ty, *cols)
        {
            return false;
        }
        // Small batches of Q8-capable weights stay on the 8-bit GEMVs (one read of the
        // quantized rows for all tokens) up to Q8_GEMV_MAX_TOKENS when an f16 copy exists
        // (measured at 8 tokens, Llama-3-8B Q4_K_M: gemv_q8_t8 575 t/s, cuBLAS on the f16
        // copies 705), up to GEMV_MAX_TOKENS otherwise.
        let q8_gemv = n <= Q8_GEMV_MAX_TOKENS
            && matches!(w, CudaWeight::Matrix { ty, .. } if self.q8_gemv_reads(*ty, n));
        self.blas.is_some()
            && !self.lock_recorder().deferring
            && (n >= GEMM_MIN_TOKENS || (n >= 2 && w.has_f16() && !q8_gemv))
    }

    /// Attention of tokens `tok0 .. tok0 + n` of any sequences: split across key ranges
    /// (the count below), in ranges of at most
    /// SPLIT_ATTN_MAX_TOKENS tokens; the one-block-per-(token, head) kernel when the
    /// partials buffer is too small.
    /// Returns whether the launches wrote `a.q8` (the kernels that write the normalized
    /// output do: attention_split_tiled* with one split, attention_combine).
    fn attention_short(
        &self,
        a: &AttnLaunch,
        p: &AttnParams,
        step: &CudaStep,
        tok0: usize,
        n: usize,
    ) -> bool {
        // About ATTN_SPLIT_BLOCKS blocks in all, and at least ~16 keys a split of the
        // longest sequence (its length rounded up to a power of two, so that a recorded graph
        // serves every step until it doubles). Measured on the H100, Llama-3-8B Q4_K_M, ~600
        // keys, decode t/s with 4 / 8 / 16 / 32 / 64 splits: 1 sequence 210 / 242 / 255 /
        // 264 / 265, 8 sequences 1,207 / 1,341 / 1,287 / 1,228 / 1,144: both best at ~512
        // blocks. (Splits used to follow the cache size: 64 for 8 sequences.)
        //
        // The tiled kernels instead take at most ATTN_SPLIT_BLOCKS blocks (about one wave on
        // the H100: 132 SMs × 4 resident blocks of the 128-dim kernel, 5 of the 64-dim one;
        // a block's warps stream 16-key chunks with the next chunk in flight, so one wave
        // already keeps enough bytes in flight), the count rounded down to a power of two,
        // and splits of TILED_ATTN_KEYS_PER_ROUND keys or more of the longest length rounded
        // up to a power of two (32 to 64 keys of the longest sequence: a 16-key chunk for
        // 2 to 4 of the block's 4 warps; more, shorter splits would not shorten a block's one
        // round of loads, and each split is one more partial to write and merge). One split
        // (e.g. 64 sequences × 8 kv heads, or no sequence longer than 64) writes the output
        // directly, without attention_combine. The count is a power of two and changes only
        // when the longest length crosses one.
        const ATTN_SPLIT_BLOCKS: usize = 512;
        let tiled = tiled_split_attention(p);
        let splits = if tiled {
            let by_len = step.max_kv_len().next_power_of_two() / TILED_ATTN_KEYS_PER_ROUND;
            let pairs = n.min(SPLIT_ATTN_MAX_TOKENS) * p.n_head_kv.max(1);
            let by_blocks = (ATTN_SPLIT_BLOCKS / pairs)
                .checked_ilog2()
                .map_or(1, |e| 1 << e);
            by_len.min(by_blocks)
        } else {
            let heads = if gqa_split_attention(p) {
                p.n_head_kv
            } else {
                p.n_head
            };
            let by_len = step.max_kv_len().next_power_of_two().div_ceil(16);
            let by_blocks = ATTN_SPLIT_BLOCKS.div_ceil(n.min(SPLIT_ATTN_MAX_TOKENS) * heads.max(1));
            by_len.min(by_blocks)
        }
        .clamp(if tiled { 1 } else { 2 }, MAX_ATTN_SPLITS);
        // The kernels' shared leading arguments, writing to `dest`.
        let common = |dest: u64| {
            [
                &[Arg::P(a.q), Arg::P(a.k), Arg::P(a.v), Arg::P(dest)][..],
                &step.slot_args(),
                &[
                    Arg::I(a.block_size as i32),
                    Arg::I(p.n_head as i32),
                    Arg::I(p.n_head_kv as i32),
                    Arg::I(p.head_dim as i32),
                    Arg::F(p.scale),
                    Arg::I(a.window),
                ],
            ]
            .concat()
        };
        let (q8, q8d) = a.q8.unwrap_or((0, 0));
        // The merge kernels' leading arguments: the partials, the output, their geometry.
        let merge = [
            Arg::P(step.attn_part_ptr),
            Arg::P(a.out),
            Arg::I(p.n_head as i32),
            Arg::I(p.head_dim as i32),
            Arg::I(splits as i32),
        ];
        let combine = |m: usize, t: usize| {
            let tail = [Arg::I(t as i32), Arg::P(q8), Arg::P(q8d)];
            let grid = (m as u32, p.n_head as u32, 1);
            self.launch(
                "attention_combine",
                grid,
                128,
                &[&merge[..], &tail].concat(),
            );
        };
        // The merge into mmk's layout: all n tokens in one launch (tok0 = 0).
        let combine_mmk = |npad: usize, [q, xk, xb]: [u64; 3]| {
            let tail = [
                Arg::I(n as i32),
                Arg::I(npad as i32),
                Arg::P(q),
                Arg::P(xk),
                Arg::P(xb),
            ];
            let grid = (npad as u32, (p.n_head * p.head_dim / 256) as u32, 1);
            self.launch(
                "attention_combine_mmk",
                grid,
                256,
                &[&merge[..], &tail].concat(),
            );
        };
        let mmk = a.mmk.filter(|_| tok0 == 0 && n <= SPLIT_ATTN_MAX_TOKENS);
        let mut wrote_q8 = false;
        let mut done = 0;
        while done < n {
            let m = (n - done).min(SPLIT_ATTN_MAX_TOKENS);
            let t = tok0 + done;
            let part_len = m * p.n_head * splits * (p.head_dim + 2);
            let fits = part_len <= step.attn_part_len;
            if tiled && (splits == 1 || fits) {
                let name = if p.head_dim == 64 {
                    "attention_split_tiled64"
                } else {
                    "attention_split_tiled128"
                };
                // One split: the output itself (normalized); otherwise the partials.
                let dest = if splits == 1 {
                    a.out
                } else {
                    step.attn_part_ptr
                };
                let mut args = common(dest);
                args.push(Arg::I(splits as i32));
                args.push(Arg::I(t as i32));
                let (q8, q8d) = if splits == 1 { (q8, q8d) } else { (0, 0) };
                args.extend([Arg::P(q8), Arg::P(q8d)]);
                self.launch(
                    name,
                    (m as u32, p.n_head_kv as u32, splits as u32),
                    128,
                    &args,
                );
                match mmk {
                    _ if splits == 1 => {}
                    Some((npad, bufs)) => combine_mmk(npad, bufs),
                    None => combine(m, t),
                }
                wrote_q8 = a.q8.is_some() || (mmk.is_some() && splits > 1);
            } else if splits > 1 && fits {
                let mut args = common(step.attn_part_ptr);
                args.push(Arg::I(splits as i32));
                args.push(Arg::I(t as i32));
                if gqa_split_attention(p) {
                    self.launch(
                        "attention_split_gqa",
                        (m as u32, p.n_head_kv as u32, splits as u32),
                        128,
                        &args,
                    );
                } else {
                    self.launch(
                        "attention_split",
                        (m as u32, p.n_head as u32, splits as u32),
                        128,
                        &args,
                    );
                }
                match mmk {
                    Some((npad, bufs)) => combine_mmk(npad, bufs),
                    None => combine(m, t),
                }
                wrote_q8 = a.q8.is_some() || mmk.is_some();
            } else {
                let mut args = common(a.out);
                args.push(Arg::I(t as i32));
                self.launch("attention", (m as u32, p.n_head as u32, 1), 128, &args);
                wrote_q8 = false;
            }
            done += m;
        }
        wrote_q8
    }

    /// Attention of one sequence's run of tokens `tok0 .. tok0 + n` (a prompt chunk),
    /// flash style: on the tensor cores in tiles of PREFILL_MMA_TOKENS (grid: heads, then
    /// tiles) where [`prefill_mma_kernel`] has a kernel, else in tiles of
    /// PREFILL_ATTN_TOKENS (grid: tiles, then heads). Same arguments for both.
    fn attention_prefill(
        &self,
        a: &AttnLaunch,
        p: &AttnParams,
        step: &CudaStep,
        tok0: usize,
        n: usize,
    ) {
        let (name, grid) = match prefill_mma_kernel(p) {
            Some(name) => (
                name,
                (p.n_head as u32, n.div_ceil(PREFILL_MMA_TOKENS) as u32, 1),
            ),
            None => (
                "attention_prefill",
                (n.div_ceil(PREFILL_ATTN_TOKENS) as u32, p.n_head as u32, 1),
            ),
        };
        self.launch(
            name,
            grid,
            128,
            &[
                &[Arg::P(a.q), Arg::P(a.k), Arg::P(a.v), Arg::P(a.out)][..],
                &step.slot_args(),
                &[
                    Arg::I(a.block_size as i32),
                    Arg::I(tok0 as i32),
                    Arg::I(n as i32),
                    Arg::I(p.n_head as i32),
                    Arg::I(p.n_head_kv as i32),
                    Arg::I(p.head_dim as i32),
                    Arg::F(p.scale),
                    Arg::I(a.window),
                ],
            ]
            .concat(),
        );
    }

    /// Whether single-token GEMVs run on 8-bit activations where the format allows.
    pub fn q8_decode(&self) -> bool {
        self.q8_decode.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Turns the 8-bit activation GEMVs on or off (the self-check covers both paths).
    pub fn set_q8_decode(&self, on: bool) {
        self.q8_decode
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Makes the Q8 activation buffers hold at least `k` values.
    pub fn reserve_q8(&self, k: usize) -> anyhow::Result<()> {
        let mut s = self.q8_scratch.lock().unwrap_or_else(|p| p.into_inner());
        if s.as_ref().is_some_and(|s| s.cap >= k) {
            return Ok(());
        }
        *s = None;
        let cap = k.next_multiple_of(256);
        *s = Some(Q8Scratch {
            q: self.alloc::<i8>(cap, "the quantized activations")?,
            d: self.alloc::<f32>(cap / 32, "the activation scales")?,
            ds: self.alloc::<f32>(cap / 16, "the activation scales and sums")?,
            work: self.alloc::<f32>(MMS_WORK_FLOATS, "the split partial sums")?,
            count: self.alloc::<u32>(MMS_MAX_TILES, "the split arrival counters")?,
            cap,
        });
        Ok(())
    }

    /// Device addresses of the Q8 activation buffers — the int8 values, the per-32 scales
    /// (`gemv_q8`) and the scale-and-sum pairs (`mmq_t*`) — if they hold `values` values.
    fn q8_buffers(&self, values: usize) -> Option<Q8Ptrs> {
        let s = self.q8_scratch.lock().unwrap_or_else(|p| p.into_inner());
        s.as_ref().filter(|s| s.cap >= values).map(|s| Q8Ptrs {
            q: self.ptr(&s.q),
            d: self.ptr(&s.d),
            ds: self.ptr(&s.ds),
            work: self.ptr(&s.work),
            count: self.ptr(&s.count),
        })
    }

    /// The 8-bit activation buffers a kernel that writes a single token's row of `cols`
    /// values fills on the way out for the consuming `gemv_q8` (None: n > 1, the f32 paths,
    /// or rows not of whole 32-value blocks).
    fn single_q8_buffers(&self, n: usize, cols: usize) -> Option<Q8Ptrs> {
        (n == 1 && self.q8_decode() && cols.is_multiple_of(32))
            .then(|| self.q8_buffers(cols))
            .flatten()
    }

    /// Where a kernel that writes `n` token rows of `cols` values for an 8-bit multi-token
    /// product (steps of MMQ_MIN_TOKENS..=8 on `mmq_t8` / `mmk_t8*`, and 9..=MMQ_MAX_TOKENS
    /// on `mms_*`) quantizes them on the way out: the padded row count, whether in
    /// mmk's layout (where a launch of these rows may take `mmk_t8*` or `mms_*`; the
    /// consumer quantizes again if its weights turn out to need the other one) or mmq's,
    /// and the buffers. None where the consumer quantizes its input itself.
    fn multi_q8_layout(&self, n: usize, cols: usize) -> Option<MultiQ8> {
        let staged = n >= MMS_MIN_TOKENS && cols.is_multiple_of(256);
        let npad = if staged {
            n.next_power_of_two()
        } else {
            mmq_int8_rows(n)
        };
        if !((MMQ_MIN_TOKENS..=MMQ_MAX_TOKENS).contains(&n)
            && (n < MMS_MIN_TOKENS || staged)
            && self.q8_decode()
            && cols.is_multiple_of(32))
        {
            return None;
        }
        let mmk = staged || (npad == 8 && self.mmk_on() && cols.is_multiple_of(256));
        let q8 = self.q8_buffers(npad * cols)?;
        Some(MultiQ8 { npad, mmk, q8 })
    }

    /// Whether products of `n` tokens with `ty` weights go through the tensor-core kernels
    /// `mmq_t8` / `mmk_t8*` / `mms_*` (8-bit activations, MMQ_MIN_TOKENS..=MMQ_MAX_TOKENS
    /// tokens).
    fn mmq_reads(&self, ty: GgmlType, n: usize) -> bool {
        self.q8_decode()
            && (MMQ_MIN_TOKENS..=MMQ_MAX_TOKENS).contains(&n)
            && match ty {
                GgmlType::Q4K | GgmlType::Q6K => true,
                // Faster than cuBLAS on the f16 copies up to 8 tokens since their rows
                // are 16-byte aligned (B = 8: Q4_0 992 → 1,318, Q8_0 926 → 1,126 t/s).
                GgmlType::Q8_0 | GgmlType::Q4_0 => n <= 8,
                _ => false,
            }
    }

    /// Whether one `mmq_t*` launch computes these segments for `n` tokens (gated: gate and
    /// up of one format and row length).
    fn mmq_applies(&self, k: usize, n: usize, segs: &[GemvSeg], gated: bool) -> bool {
        k.is_multiple_of(32)
            && segs.iter().all(|s| self.mmq_reads(s.ty, n))
            && (!gated || (segs[0].ty == segs[1].ty && segs[0].row_bytes == segs[1].row_bytes))
            && self.q8_buffers(self.mmq_plan(n, k, segs).1 * k).is_some()
    }

    /// Whether an int8 launch of `npad` token rows, rows of `k` values, `tiles` 16-row tiles
    /// and these weight types goes to `mmk_t8*` rather than `mmq_t8*`. Launches of more
    /// than MMK_MAX_WAVES waves (the LM head) stay on `mmq_t8`: on the H100 the Q6_K LM head
    /// took 305–370 µs there against 261 µs on `mmq_t8` (B = 8, `KESTREL_CUDA_PROFILE=1`).
    fn mmk_reads(
        &self,
        k: usize,
        npad: usize,
        tiles: usize,
        types: impl IntoIterator<Item = GgmlType>,
    ) -> bool {
        npad == 8
            && self.mmk_on()
            && tiles <= MMK_MAX_WAVES * 2 * self.sm_count
            && k.is_multiple_of(256)
            && types
                .into_iter()
                .all(|ty| matches!(ty, GgmlType::Q4K | GgmlType::Q6K))
    }

    /// Whether `mmk_t8*` takes the Q4_K / Q6_K launches of up to 8 tokens that it reads (on by
    /// default).
    fn mmk_on(&self) -> bool {
        self.mmk.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Turns `mmk_t8*` off, so that `mmq_t8` takes those launches as it takes the LM head's
    /// (the self-check covers both).
    pub fn set_mmk(&self, on: bool) {
        self.mmk.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether products of `n` tokens with `ty` weights of rows of `k` values go through the
    /// staged int8 kernels `mms_*` (Q4_K / Q6_K from MMS_MIN_TOKENS tokens).
    fn mms_reads(&self, ty: GgmlType, n: usize, k: usize) -> bool {
        self.mmq_reads(ty, n)
            && n >= MMS_MIN_TOKENS
            && k.is_multiple_of(256)
            && matches!(ty, GgmlType::Q4K | GgmlType::Q6K)
    }

    /// Which tensor-core kernels take an mmq launch of `n` tokens, and the tokens their tile
    /// holds (the activations are quantized for that many rows): `mms_*` when they read
    /// every segment (tiles of 16 or 32), else `mmq_t8` / `mmk_t8*` (8 tokens).
    fn mmq_plan(&self, n: usize, k: usize, segs: &[GemvSeg]) -> (MmqKind, usize) {
        if segs.iter().all(|s| self.mms_reads(s.ty, n, k)) {
            (MmqKind::Staged, n.next_power_of_two())
        } else {
            // (mmq_reads leaves only steps of up to 8 tokens to the 8-token kernels.)
            debug_assert!(n <= 8);
            (MmqKind::Int8, mmq_int8_rows(n))
        }
    }

    /// Forces the rows per warp of single-token `gemv_q8` launches (1 or 2; 0: by
    /// launch). The self-check runs every variant.
    pub fn set_gemv_q8_rows(&self, rows: usize) {
        self.gemv_q8_rows
            .store(rows.min(2), std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether an unforced single-token 8-bit launch takes one row per warp: launches where
    /// one row per warp still fits in one wave of resident warps (5 blocks of 4 per SM:
    /// `gemv_ws_r1` and `gemv_q8_b_r1`; `gemv_q8_r1`, which takes K-quant rows only where
    /// `gemv_ws_r1` does not, fits 4 since its 64-value units — the rule was measured at 5 and
    /// kept: Qwen2.5-1.5B tg128 with K-quants on `gemv_q8_r1` 712–724 against 689–750 on
    /// `gemv_ws_r1` in the tenth session, within the spread). Short rows (≤ 2,048 values)
    /// used to take one row a warp at any size; with one short row a warp, a launch of
    /// several waves keeps too few bytes in flight a SM (~1.3 KB a warp). Two rows a warp
    /// beyond one wave for short rows too, on Qwen2.5-1.5B's gate/up (3.4 waves) and LM head
    /// (58): tg128 +3.5% (five alternated pairs in two calls, means 755 → 781, four of five
    /// pairs for; the LM head alone +1.2%).
    fn gemv_q8_one_row(&self, segs: &[GemvSeg], gated: bool) -> bool {
        gemv_warps(segs, gated, 1) <= self.sm_count * 20
    }

    /// Whether a single-token product with `w` alone runs on `gemv_ws_r1`.
    pub fn matmul_uses_ws(&self, w: &CudaWeight, n: usize) -> bool {
        let Some(seg) = GemvSeg::of(w, 0, 0, 0) else {
            return false;
        };
        n == 1 && self.matmul_uses_q8(w, n) && self.ws_launch(&[seg], false)
    }

    /// Whether an 8-bit single-token launch over `segs` (rows of `k` values) runs on
    /// `gemv_ws_r1`: rows per warp not forced, the kernel on, formats and alignment it
    /// reads, and one row a warp by [`Self::gemv_q8_one_row`].
    fn ws_launch(&self, segs: &[GemvSeg], gated: bool) -> bool {
        self.gemv_q8_rows() == 0 && ws_takes(segs, gated) && self.gemv_q8_one_row(segs, gated)
    }

    /// The forced rows per warp of single-token `gemv_q8` launches (0: by launch).
    pub fn gemv_q8_rows(&self) -> usize {
        self.gemv_q8_rows.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether [`Self::gemv`] takes these segments for `n` tokens.
    fn gemv_takes(&self, k: usize, n: usize, segs: &[GemvSeg], gated: bool) -> bool {
        n <= GEMV_MAX_TOKENS || self.mmq_applies(k, n, segs, gated)
    }

    /// Whether the 8-bit GEMVs (`gemv_q8*`) are on and read `ty` for `n` tokens.
    fn q8_gemv_reads(&self, ty: GgmlType, n: usize) -> bool {
        self.q8_decode() && (1..=GEMV_MAX_TOKENS).contains(&n) && q8_supported(ty)
    }

    /// Whether a single-token product with these segments runs on 8-bit activations.
    fn q8_applies(&self, k: usize, n: usize, segs: &[GemvSeg]) -> bool {
        k.is_multiple_of(32)
            && segs.iter().all(|s| self.q8_gemv_reads(s.ty, n))
            // Only the single-token kernels add into their outputs.
            && (n == 1 || segs.iter().all(|s| !s.accumulate))
            && self.q8_buffers(n * k).is_some()
    }

    /// Whether a product of `n` tokens with `w` runs on activations quantized per 256
    /// values: `mmk_t8*` or `mms_*` (a subset of [`Self::matmul_uses_q8`]).
    pub fn matmul_uses_mmk(&self, w: &CudaWeight, n: usize) -> bool {
        let CudaWeight::Matrix { ty, cols, rows, .. } = w else {
            return false;
        };
        self.matmul_uses_q8(w, n)
            && self.mmq_reads(*ty, n)
            && (self.mms_reads(*ty, n, *cols)
                || self.mmk_reads(*cols, mmq_int8_rows(n), rows.div_ceil(16), [*ty]))
    }

    /// Whether a product of `n` tokens with `w` runs on `mms_*`.
    pub fn matmul_uses_mms(&self, w: &CudaWeight, n: usize) -> bool {
        let CudaWeight::Matrix { ty, cols, .. } = w else {
            return false;
        };
        self.matmul_uses_q8(w, n) && self.mms_reads(*ty, n, *cols)
    }

    /// Whether `matmul` of `n` tokens with `w` (an `x` of `w`'s row length) runs a GEMV on
    /// 8-bit activations.
    pub fn matmul_uses_q8(&self, w: &CudaWeight, n: usize) -> bool {
        let CudaWeight::Matrix { ty, cols, .. } = w else {
            return false;
        };
        (self.q8_gemv_reads(*ty, n) || self.mmq_reads(*ty, n))
            && gemv_supported(*ty, *cols)
            && !self.prefer_gemm(w, n)
    }

    /// The trailing `ROPE_PARAMS` arguments of the RoPE kernels (kernels/ops.cu), or None
    /// when the frequency factors could not be uploaded (the failure is recorded).
    fn rope_args(&self, head_dim: usize, rope: &RopeParams) -> Option<[Arg; 10]> {
        let c = rope.constants();
        let factors = match &rope.freq_factors {
            Some(f) => self.freq_factors_ptr(f)?,
            None => 0,
        };
        Some([
            Arg::I(head_dim as i32),
            Arg::I(rope.n_rot as i32),
            Arg::I(rope.neox as i32),
            Arg::F(c.theta_scale),
            Arg::F(c.freq_scale),
            Arg::F(c.ext_factor),
            Arg::F(c.mscale),
            Arg::F(c.corr_lo),
            Arg::F(c.corr_hi),
            Arg::P(factors),
        ])
    }

    /// Whether `matmul` of `n` tokens with `w` goes through cuBLAS (f16 operands) when no
    /// step is being recorded.
    pub fn matmul_uses_cublas(&self, w: &CudaWeight, n: usize) -> bool {
        self.prefer_gemm(w, n)
    }

    /// Whether prompt-sized products go through cuBLAS.
    pub fn uses_cublas(&self) -> bool {
        self.blas.is_some()
    }

    /// A scratch buffer of at least `len` f16 values (grown, never shrunk).
    fn scratch_ptr(
        &self,
        which: fn(&mut GemmScratch) -> &mut Option<CudaSlice<u16>>,
        len: usize,
    ) -> Option<u64> {
        let mut s = self.gemm_scratch.lock().unwrap_or_else(|p| p.into_inner());
        let slot = which(&mut s);
        if slot.as_ref().is_none_or(|b| b.len() < len) {
            *slot = None; // free the old one first
            match self.alloc::<u16>(len, "GEMM scratch") {
                Ok(b) => *slot = Some(b),
                Err(e) => {
                    self.fail(format!("{e:#}"));
                    return None;
                }
            }
        }
        slot.as_ref().map(|b| self.ptr(b))
    }

    /// out[t][r] = W[r]·x[t] for `n` tokens on the tensor cores: W dequantized to f16 (F16
    /// weights are used in place), x converted to f16, products summed in f32 by cuBLAS.
    /// Returns false when cuBLAS is not available.
    fn gemm_f16(&self, x: &CudaTensor, w: &CudaWeight, n: usize, out: &CudaTensor) -> bool {
        if self.blas.is_none() {
            return false;
        }
        match self.x_to_f16(x, n) {
            Some(xh) => self.gemm_f16_from(xh, w, n, out),
            None => true, // the failure is recorded
        }
    }

    /// The first `n` rows of `x` as f16 in the activation scratch buffer (the B operand of
    /// [`Self::gemm_f16_from`]; valid until the next conversion).
    fn x_to_f16(&self, x: &CudaTensor, n: usize) -> Option<u64> {
        let len = n * x.cols;
        let b = self.scratch_ptr(|s| &mut s.x, len)?;
        let held = *self.f16_holds.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, rows, h)) = held
            && at == x.ptr
            && rows == n
            && (h == b || h == self.scratch_ptr(|s| &mut s.h, len)?)
        {
            return Some(h);
        }
        self.elementwise(
            "f32_to_f16",
            len,
            &[Arg::P(x.ptr), Arg::P(b), Arg::L(len as i64)],
        );
        Some(b)
    }

    /// Where a kernel producing `n` rows of `cols` activations should also write them as
    /// f16 (the GEMM scratch), for the cuBLAS products that read them next: steps above
    /// the tensor-core kernels' token range run on cuBLAS (see `prefer_gemm`). None: not
    /// such a step.
    fn f16_copy_for_gemm(&self, n: usize, cols: usize) -> Option<u64> {
        let gemm_step = self.blas.is_some()
            && n >= GEMM_MIN_TOKENS
            && n > MMQ_MAX_TOKENS
            && !self.lock_recorder().deferring;
        gemm_step
            .then(|| self.scratch_ptr(|s| &mut s.x, n * cols))
            .flatten()
    }

    /// A leader's merged f16 copy (its address and rows: the leader's, then each
    /// follower's, see `load_weight`) when it has one, the followers (rows of `cols` values,
    /// as many each) keep none of their own, and `outs[i]` has the columns of part `i`
    /// (leader first); None otherwise.
    fn merged_copy(
        &self,
        leader: &CudaWeight,
        followers: &[&CudaWeight],
        cols: usize,
        outs: &[&CudaTensor],
    ) -> Option<(u64, usize)> {
        let CudaWeight::Matrix {
            f16: Some(copy),
            rows: lead_rows,
            cols: lead_cols,
            ..
        } = leader
        else {
            return None;
        };
        // Each follower's rows, when it is merged (no copy of its own) and fits.
        let follower_rows = |w: &CudaWeight| match w {
            CudaWeight::Matrix {
                f16: None,
                rows,
                cols: c,
                ..
            } if *c == cols => Some(*rows),
            _ => None,
        };
        let each = follower_rows(followers.first()?)?;
        let fits = followers.iter().all(|w| follower_rows(w) == Some(each))
            && outs.len() == followers.len() + 1
            && outs[0].cols == *lead_rows
            && outs[1..].iter().all(|t| t.cols == each);
        let rows = lead_rows + followers.len() * each;
        (fits && *lead_cols == cols && copy.len() == rows * cols).then(|| (self.ptr(copy), rows))
    }

    /// `out = x · wᵀ` for several weights sharing `x`: through cuBLAS from one f16
    /// conversion of x when every product goes there, one `matmul` each otherwise.
    fn matmuls_of(
        &self,
        x: &CudaTensor,
        n: usize,
        products: &mut [(&CudaWeight, &mut CudaTensor)],
    ) {
        let shared = products
            .iter()
            .all(|(w, _)| self.prefer_gemm(w, n) && w.cols() == Some(x.cols));
        match shared.then(|| self.x_to_f16(x, n)).flatten() {
            Some(xh) => {
                for (w, out) in products.iter() {
                    self.gemm_f16_from(xh, w, n, out);
                }
            }
            None => {
                for (w, out) in products.iter_mut() {
                    kestrel_model::Backend::matmul(self, x, w, n, out);
                }
            }
        }
    }

    /// `out = x · wᵀ` through cuBLAS from x already converted to f16 (`xh`, `n` rows of
    /// w's column count). Returns false when cuBLAS is not available.
    fn gemm_f16_from(&self, xh: u64, w: &CudaWeight, n: usize, out: &CudaTensor) -> bool {
        self.gemm_f16_into(xh, w, n, out, false)
    }

    /// [`Self::gemm_f16_from`], or with `accumulate` `out += x · wᵀ` (cuBLAS's beta = 1:
    /// the residual add of `matmul_add` without a kernel of its own).
    fn gemm_f16_into(
        &self,
        xh: u64,
        w: &CudaWeight,
        n: usize,
        out: &CudaTensor,
        accumulate: bool,
    ) -> bool {
        if self.blas.is_none() {
            return false;
        }
        let CudaWeight::Matrix {
            ptr: w_ptr,
            ty,
            rows,
            cols,
            row_bytes,
            f16,
            ..
        } = w
        else {
            return false;
        };
        let (w_ptr, ty, rows, cols, row_bytes) = (*w_ptr, *ty, *rows, *cols, *row_bytes);
        if out.cols != rows || n > out.rows {
            self.fail(format!(
                "GEMM: output of {} columns for a {rows}×{cols} weight",
                out.cols
            ));
            return true;
        }
        let a = if ty == GgmlType::F16 && row_bytes == cols * 2 {
            w_ptr
        } else if let Some(copy) = f16 {
            self.ptr(copy)
        } else {
            let Some(p) = self.scratch_ptr(|s| &mut s.w, rows * cols) else {
                return true;
            };
            let groups = rows * cols.div_ceil(32);
            self.launch(
                "dequant_f16",
                grid_1d(groups, 256),
                256,
                &[
                    Arg::P(w_ptr),
                    Arg::I(ty.id() as i32),
                    Arg::L(row_bytes as i64),
                    Arg::I(cols as i32),
                    Arg::I(rows as i32),
                    Arg::P(p),
                ],
            );
            p
        };
        if accumulate || !self.gemm_reading_ahead(a, rows, cols, xh, n, out) {
            self.gemm_f16_raw(a, rows, cols, xh, n, out.ptr, out.cols, accumulate);
        }
        true
    }

    /// Logit-sized products (at least READ_AHEAD_MIN_BYTES of output) while the host reads
    /// every step's rows back (`kestrel bench --seqs` without `--argmax`, llama-batched-bench's
    /// way): the product in READ_AHEAD_CHUNKS column chunks, each chunk's columns copied into
    /// the pinned read-back buffer on a second stream while the next chunk computes, so that
    /// the PCIe copy (33 MB a step at 64 sequences of a 128K vocabulary, ~0.6 ms) overlaps
    /// the product instead of following it. `read_pinned` then only waits. False: not such a
    /// product (nothing was queued).
    fn gemm_reading_ahead(
        &self,
        a: u64,
        rows: usize,
        cols: usize,
        xh: u64,
        n: usize,
        out: &CudaTensor,
    ) -> bool {
        let len = n * out.cols;
        if !self.options.read_ahead
            || !self
                .rows_read_back
                .load(std::sync::atomic::Ordering::Relaxed)
            || len * 4 < READ_AHEAD_MIN_BYTES
            || out.cols != rows
            || rows < READ_AHEAD_CHUNKS
        {
            return false;
        }
        let Some(copy) = self
            .copy_stream
            .get_or_init(|| self.ctx.new_stream().ok())
            .clone()
        else {
            return false;
        };
        // The pinned buffer: large enough, and not still being written by an earlier copy.
        if self.wait_copies().is_err() {
            return false;
        }
        let host = {
            let mut pinned = self.pinned.lock().unwrap_or_else(|p| p.into_inner());
            match self.pinned_room(&mut pinned, len).map(|p| p.as_mut_ptr()) {
                Ok(Ok(p)) => p as u64,
                _ => return false,
            }
        };
        self.copy_in_flight
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let pitch = out.cols * 4;
        for c in 0..READ_AHEAD_CHUNKS {
            let (c0, c1) = (
                rows * c / READ_AHEAD_CHUNKS,
                rows * (c + 1) / READ_AHEAD_CHUNKS,
            );
            self.gemm_f16_raw(
                a + (c0 * cols * 2) as u64,
                c1 - c0,
                cols,
                xh,
                n,
                out.ptr + (c0 * 4) as u64,
                out.cols,
                false,
            );
            let queued = self
                .stream
                .record_event(None)
                .and_then(|ev| copy.wait(&ev))
                .map_err(|e| format!("{e:?}"))
                .and_then(|()| {
                    let params = sys::CUDA_MEMCPY2D {
                        srcXInBytes: c0 * 4,
                        srcY: 0,
                        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                        srcHost: std::ptr::null(),
                        srcDevice: out.ptr,
                        srcArray: std::ptr::null_mut(),
                        srcPitch: pitch,
                        dstXInBytes: c0 * 4,
                        dstY: 0,
                        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_HOST,
                        dstHost: host as *mut std::ffi::c_void,
                        dstDevice: 0,
                        dstArray: std::ptr::null_mut(),
                        dstPitch: pitch,
                        WidthInBytes: (c1 - c0) * 4,
                        Height: n,
                    };
                    // SAFETY: both regions hold n rows of `pitch` bytes (checked by the
                    // caller for `out`, allocated above for the pinned buffer).
                    unsafe { sys::cuMemcpy2DAsync_v2(&params, copy.cu_stream()) }
                        .result()
                        .map_err(|e| format!("{e:?}"))
                });
            if let Err(e) = queued {
                self.fail(format!("queuing the read-ahead copy: {e}"));
                return true;
            }
        }
        *self.read_ahead.lock().unwrap_or_else(|p| p.into_inner()) = Some((out.ptr, n, out.cols));
        self.read_ahead_valid
            .store(true, std::sync::atomic::Ordering::Relaxed);
        true
    }

    /// Forgets whether the last large read was of rows (the next product reads nothing
    /// ahead until one is).
    pub fn forget_rows_read_back(&self) {
        self.rows_read_back
            .store(false, std::sync::atomic::Ordering::Relaxed);
    }

    /// Reads of rows served by a read-ahead so far.
    pub fn read_ahead_hits(&self) -> u64 {
        self.read_ahead_hits
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Waits until no read-ahead copy still writes into the pinned buffer.
    fn wait_copies(&self) -> anyhow::Result<()> {
        if self
            .copy_in_flight
            .swap(false, std::sync::atomic::Ordering::Relaxed)
            && let Some(Some(copy)) = self.copy_stream.get()
        {
            copy.synchronize()
                .map_err(|e| anyhow::anyhow!("CUDA: the read-ahead copy: {e:?}"))?;
        }
        Ok(())
    }

    /// cuBLAS: `out` (n rows of `ld` floats; the first `rows` of each written) = x · aᵀ, or
    /// += with `accumulate`, for f16 `a` (rows × cols, row-major) and f16 x (n × cols). The
    /// caller has checked that the buffers hold that much.
    #[allow(clippy::too_many_arguments)]
    fn gemm_f16_raw(
        &self,
        a: u64,
        rows: usize,
        cols: usize,
        xh: u64,
        n: usize,
        out: u64,
        ld: usize,
        accumulate: bool,
    ) {
        let Some(blas) = &self.blas else {
            self.fail("GEMM without cuBLAS".into());
            return;
        };
        let shape = cublas::Shape { rows, cols, n, ld };
        if let Err(e) = cublas::gemm_ex_raw(blas, shape, a, xh, out, accumulate) {
            self.fail(format!("cuBLAS GEMM ({rows}×{cols} by {n} tokens): {e}"));
        }
    }

    /// A GEMV segment for `w` writing into `out`, if the GEMV kernels handle it.
    fn gemv_seg(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        out: &CudaTensor,
        bias: Option<&CudaWeight>,
    ) -> Option<GemvSeg> {
        let CudaWeight::Matrix { ty, rows, cols, .. } = w else {
            return None;
        };
        if *cols != x.cols || out.cols != *rows || !gemv_supported(*ty, *cols) {
            return None;
        }
        let bias = match bias {
            None => 0,
            Some(CudaWeight::Vector { ptr, len, .. }) if *len == *rows => *ptr,
            Some(_) => return None,
        };
        GemvSeg::of(w, out.ptr, out.cols, bias)
    }

    /// One GEMV launch over up to three matrices sharing `x` (`gated`: two matrices, gate
    /// and up, producing `act(gate·x) * (up·x)` in the first's output).
    fn gemv(&self, x: &CudaTensor, n: usize, segs: &[GemvSeg], gated: Option<Activation>) {
        debug_assert!(!segs.is_empty() && segs.len() <= 3);
        let k = x.cols;
        let weight_bytes: u64 = segs.iter().map(|s| (s.rows * s.row_bytes) as u64).sum();
        let units = segs
            .iter()
            .map(|s| k / gemv_unit_values(s.ty))
            .max()
            .unwrap_or(0);
        // Rows per 4-warp block: short rows get one warp each, long rows all four.
        let rpb: usize = if units <= 48 {
            4
        } else if units <= 96 {
            2
        } else {
            1
        };
        let total = if gated.is_some() {
            segs[0].rows
        } else {
            segs.iter().map(|s| s.rows).sum()
        };
        // gemv_dec reads `act` of a plain (not gated) launch as "add into the output".
        let act = match gated {
            Some(Activation::GeluTanh) => 1,
            Some(_) => 0,
            None => i32::from(segs.iter().any(|s| s.accumulate)),
        };
        let mut args = vec![
            Arg::P(x.ptr),
            Arg::I(k as i32),
            Arg::I(n as i32),
            Arg::I(rpb as i32),
            Arg::I(total as i32),
            Arg::I(i32::from(gated.is_some())),
            Arg::I(act),
        ];
        for i in 0..3 {
            let s = segs.get(i).unwrap_or(&segs[0]);
            let rows = if i < segs.len() { s.rows } else { 0 };
            args.push(Arg::P(s.ptr));
            args.push(Arg::L(s.row_bytes as i64));
            args.push(Arg::I(s.ty.id() as i32));
            if i < 2 {
                args.push(Arg::I(rows as i32));
            }
            args.push(Arg::P(s.out));
            args.push(Arg::I(s.ld as i32));
            args.push(Arg::P(s.bias));
        }
        if self.mmq_applies(k, n, segs, gated.is_some()) {
            self.mmq(x, n, segs, gated.is_some(), &args, weight_bytes);
            return;
        }
        // Only the single-token kernels and the mmq_t8 / mmk_t8* / mms_* add into their
        // outputs.
        debug_assert!(n == 1 || segs.iter().all(|s| !s.accumulate));
        debug_assert!(n <= GEMV_MAX_TOKENS);
        if self.q8_applies(k, n, segs) {
            let Some(Q8Ptrs {
                q: q_ptr, d: d_ptr, ..
            }) = self.q8_buffers(n * k)
            else {
                return;
            };
            let quantized =
                n == 1 && *self.q8_holds.lock().unwrap_or_else(|p| p.into_inner()) == Some(x.ptr);
            if !quantized {
                // Rows of k values back to back: n·k/32 blocks of 32.
                self.launch(
                    "quantize_x_q8",
                    grid_1d(n * k / 32, 8),
                    256,
                    &[
                        Arg::P(x.ptr),
                        Arg::I((n * k) as i32),
                        Arg::P(q_ptr),
                        Arg::P(d_ptr),
                    ],
                );
            }
            let forced = self.gemv_q8_rows();
            let (kernel, rows) = match (n, forced) {
                (2..=4, _) => ("gemv_q8_t4", 2),
                (5.., _) => ("gemv_q8_t8", 2),
                (_, 1) => ("gemv_q8_r1", 1),
                (_, 2) => ("gemv_q8", 2),
                // One row per warp for short rows, and where one row per warp still fits
                // in one wave of resident warps (5 blocks of 4 per SM): tg128 Qwen2.5-1.5B
                // (down: 1,536 rows of 8,960) 635 / 636 -> 674 / 680 t/s; Llama-3-8B, whose
                // 4,096-row launches would take 1.6 waves, stays on two (309 / 311 against
                // 282 / 286 with one).
                _ if self.gemv_q8_one_row(segs, gated.is_some()) => ("gemv_q8_r1", 1),
                _ => ("gemv_q8", 2),
            };
            // One-row launches on the staged kernel where it reads the formats (tg128 H100,
            // alternated: Qwen2.5-1.5B, all one-row launches, 709 / 679 -> 723 / 724 t/s;
            // Llama-3-8B's two-row launches lost on it, 329 / 325 -> 312 / 316, so they stay).
            // (n == 1 and unforced, ws_launch implies the one-row gemv_q8_r1 above.)
            let kernel = if n == 1 && self.ws_launch(segs, gated.is_some()) {
                "gemv_ws_r1"
            } else if n == 1
                && segs
                    .iter()
                    .all(|s| matches!(s.ty, GgmlType::Q8_0 | GgmlType::Q4_0))
            {
                // No K-quant matrix: the byte-format kernels, at 5 blocks per SM where the
                // K-quants' 64-value units need 4.
                if rows == 1 {
                    "gemv_q8_b_r1"
                } else {
                    "gemv_q8_b"
                }
            } else {
                kernel
            };
            let warps = gemv_warps(segs, gated.is_some(), rows);
            let mut q8_args = vec![Arg::P(q_ptr), Arg::P(d_ptr)];
            q8_args.extend_from_slice(&args);
            self.launch_reading(kernel, grid_1d(warps, 4), 128, &q8_args, weight_bytes);
            return;
        }
        if n == 1 {
            // gemv_dec: `rows` rows per warp, 4 warps per block, per matrix.
            // Rows of at most SHORT_ROW values: one row per warp (a lane then has one or two
            // units of the row, so a second row adds latency instead of bytes in flight).
            // Measured (tg128, H100) with one variant for every launch: r1 413 vs r2 409 t/s
            // on Qwen2.5-1.5B (rows of 1536 but the down projection's 8960), r1 175 vs r2
            // 201 on Llama-3-8B (rows of 4096 and 14336); splitting by launch size instead
            // (< 8192 rows: r1) gave 448 and 192.
            const SHORT_ROW: usize = 2048;
            let (kernel, rows) = if k <= SHORT_ROW {
                ("gemv_dec_r1", 1)
            } else {
                ("gemv_dec", 2)
            };
            let warps = gemv_warps(segs, gated.is_some(), rows);
            self.launch_reading(kernel, grid_1d(warps, 4), 128, &args, weight_bytes);
            return;
        }
        self.launch_reading("gemv", grid_1d(total, rpb), 128, &args, weight_bytes);
    }

    /// The GEMV launch `args` (see [`Self::gemv`]) on the tensor cores: x quantized to 8 bits
    /// for a multiple of 8 tokens, then one block per 16 rows.
    fn mmq(
        &self,
        x: &CudaTensor,
        n: usize,
        segs: &[GemvSeg],
        gated: bool,
        args: &[Arg],
        weight_bytes: u64,
    ) {
        let k = x.cols;
        let (kind, npad) = self.mmq_plan(n, k, segs);
        let Some(bufs) = self.q8_buffers(npad * k) else {
            return;
        };
        let (xk, xb) = bufs.mmk_steps_sums(npad, k);
        let Q8Ptrs {
            q: q_ptr,
            ds: ds_ptr,
            work,
            count,
            ..
        } = bufs;
        // The activations as the kernels read them (8 bits with the block sums; npad rows),
        // then the product: its kernel, grid, block and leading arguments.
        let prep_args = [
            Arg::P(x.ptr),
            Arg::I(k as i32),
            Arg::I(n as i32),
            Arg::I(npad as i32),
        ];
        let (kernel, blocks, threads, mut kernel_args) = match kind {
            MmqKind::Staged => {
                let held = *self.mmq_holds.lock().unwrap_or_else(|p| p.into_inner());
                if held != Some((x.ptr, n, npad, true)) {
                    self.quantize_mmk(&prep_args, k, npad, [q_ptr, xk, xb]);
                }
                // Kernel names by tile (16, 32 tokens) and gated.
                const MMS: [[&str; 2]; 2] =
                    [["mms_t16", "mms_t16_gated"], ["mms_t32", "mms_t32_gated"]];
                let tile = usize::from(npad > 16);
                let tiles = gemv_warps(segs, gated, if gated { MMS_ROWS / 2 } else { MMS_ROWS });
                let per_sm = 3; // MMS_KERNEL's launch bounds for tiles of up to 32 tokens
                let splits = mms_splits(tiles, k / 256, npad, self.sm_count, per_sm);
                let args = vec![
                    Arg::P(q_ptr),
                    Arg::P(xk),
                    Arg::P(xb),
                    Arg::I(npad as i32),
                    Arg::I(splits as i32),
                    Arg::P(work),
                    Arg::P(count),
                ];
                // MS_THREADS (kernels/mmq.cu): two warps per 16 rows, each half the tokens.
                const MMS_THREADS: u32 = 8 * 32;
                (MMS[tile][gated as usize], tiles * splits, MMS_THREADS, args)
            }
            MmqKind::Int8 => {
                let tiles = gemv_warps(segs, gated, 16);
                let mmk = self.mmk_reads(k, npad, tiles, segs.iter().map(|s| s.ty));
                let held = *self.mmq_holds.lock().unwrap_or_else(|p| p.into_inner());
                if held != Some((x.ptr, n, npad, mmk)) {
                    if mmk {
                        self.quantize_mmk(&prep_args, k, npad, [q_ptr, xk, xb]);
                    } else {
                        let outs = [Arg::P(q_ptr), Arg::P(ds_ptr)];
                        self.launch(
                            "quantize_x_mmq",
                            grid_1d(npad * k / 32, 8),
                            256,
                            &[&prep_args[..], &outs].concat(),
                        );
                    }
                }
                // MQ_WARPS / MK_WARPS (kernels/mmq.cu) warps a block, one block per 16 rows.
                const MMQ_THREADS: u32 = 8 * 32;
                if mmk {
                    let name = match gated {
                        true if segs[0].ty == GgmlType::Q4K => "mmk_t8_gated_q4k",
                        true => "mmk_t8_gated_q6k",
                        false => "mmk_t8_pipe",
                    };
                    let args = vec![Arg::P(q_ptr), Arg::P(xk), Arg::P(xb), Arg::I(npad as i32)];
                    (name, tiles, MMQ_THREADS, args)
                } else {
                    let args = vec![Arg::P(q_ptr), Arg::P(ds_ptr), Arg::I(npad as i32)];
                    let name = if gated { "mmq_t8_gated" } else { "mmq_t8" };
                    (name, tiles, MMQ_THREADS, args)
                }
            }
        };
        kernel_args.extend_from_slice(args);
        self.launch_reading(
            kernel,
            (blocks as u32, 1, 1),
            threads,
            &kernel_args,
            weight_bytes,
        );
    }

    /// `quantize_x_mmk` of `npad` token rows of `k` values (`prep_args`: x, k, n, npad) into
    /// `outs` (the int8 values, the per-256 steps, the group sums).
    fn quantize_mmk(&self, prep_args: &[Arg], k: usize, npad: usize, outs: [u64; 3]) {
        let outs = outs.map(Arg::P);
        self.launch(
            "quantize_x_mmk",
            ((k / 256) as u32, npad as u32, 1),
            256,
            &[prep_args, &outs].concat(),
        );
    }

    /// `gate = act(gate_w·x) * (up_w·x)`: one gated launch where the GEMV or tensor-core
    /// kernels take both matrices, else two products and the activation (the backend's
    /// `gate_up`; public for the self-check).
    #[allow(clippy::too_many_arguments)]
    pub fn gate_up_of(
        &self,
        x: &CudaTensor,
        gate_w: &CudaWeight,
        up_w: &CudaWeight,
        act: Activation,
        n: usize,
        gate: &mut CudaTensor,
        up: &mut CudaTensor,
    ) {
        if self.gate_up_mmw(x, gate_w, up_w, act, n, gate) {
            return;
        }
        let fused = !self.prefer_gemm(gate_w, n)
            && match (
                self.gemv_seg(x, gate_w, gate, None),
                self.gemv_seg(x, up_w, up, None),
            ) {
                (Some(g), Some(u)) if g.rows == u.rows => {
                    let segs = [g, u];
                    let takes = self.gemv_takes(x.cols, n, &segs, true);
                    if takes {
                        self.gemv(x, n, &segs, Some(act));
                    }
                    takes
                }
                _ => false,
            };
        if fused {
            return;
        }
        // Through cuBLAS with gate's merged f16 copy (up's rows behind gate's): one product,
        // the activation reading both halves of each row; steps of more than
        // MERGED_QKV_MAX_TOKENS (whose f32 product would be large) take the halves as two.
        if self.prefer_gemm(gate_w, n)
            // (The activation pairs gate's columns with up's: as many of each.)
            && let Some((a, rows)) = self.merged_copy(gate_w, &[up_w], x.cols, &[gate, up])
                .filter(|_| up.cols == gate.cols)
            && let Some(xh) = self.x_to_f16(x, n)
        {
            let merged = if n <= MERGED_QKV_MAX_TOKENS {
                self.scratch_ptr(|s| &mut s.gate_up, 2 * n * rows)
            } else {
                None
            };
            let Some(merged) = merged else {
                let half = rows / 2;
                let up_at = a + (half * x.cols * 2) as u64;
                self.gemm_f16_raw(a, half, x.cols, xh, n, gate.ptr, half, false);
                self.gemm_f16_raw(up_at, half, x.cols, xh, n, up.ptr, half, false);
                kestrel_model::Backend::gated_activation(self, gate, up, act, n);
                return;
            };
            self.gemm_f16_raw(a, rows, x.cols, xh, n, merged, rows, false);
            let len = n * gate.cols;
            let h = self.f16_copy_for_gemm(n, gate.cols);
            self.elementwise(
                "gated_act_merged",
                len,
                &[
                    Arg::P(merged),
                    Arg::I(gate.cols as i32),
                    Arg::I(len as i32),
                    Arg::I(activation_id(act)),
                    Arg::P(gate.ptr),
                    Arg::P(h.unwrap_or(0)),
                ],
            );
            if let Some(h) = h {
                // The down projection's input, as gated_act_f16 leaves it.
                *self.f16_holds.lock().unwrap_or_else(|p| p.into_inner()) = Some((gate.ptr, n, h));
            }
            return;
        }
        self.matmuls_of(x, n, &mut [(gate_w, &mut *gate), (up_w, &mut *up)]);
        kestrel_model::Backend::gated_activation(self, gate, up, act, n);
    }

    /// Whether gate and up of `n` tokens go to `mmw_gated` (both Q4_K with mmw copies, as
    /// many rows, n in MMW_MIN_TOKENS..=MMW_MAX_TOKENS).
    pub fn matmul_uses_mmw(&self, gate_w: &CudaWeight, up_w: &CudaWeight, n: usize) -> bool {
        let shape = |w: &CudaWeight| match w {
            CudaWeight::Matrix {
                mmw: Some(_),
                rows,
                cols,
                ..
            } => Some((*rows, *cols)),
            _ => None,
        };
        (MMW_MIN_TOKENS..=MMW_MAX_TOKENS).contains(&n) && {
            let g = shape(gate_w);
            g.is_some() && g == shape(up_w)
        }
    }

    /// `gate = act(gate_w·x) * (up_w·x)` on `mmw_gated` when [`Self::matmul_uses_mmw`];
    /// the f16 copy of the result is left for the down projection's cuBLAS product.
    fn gate_up_mmw(
        &self,
        x: &CudaTensor,
        gate_w: &CudaWeight,
        up_w: &CudaWeight,
        act: Activation,
        n: usize,
        gate: &mut CudaTensor,
    ) -> bool {
        if !self.matmul_uses_mmw(gate_w, up_w, n) {
            return false;
        }
        let (
            CudaWeight::Matrix {
                mmw: Some(wg),
                rows,
                cols,
                ..
            },
            CudaWeight::Matrix { mmw: Some(wu), .. },
        ) = (gate_w, up_w)
        else {
            return false;
        };
        if x.cols != *cols || gate.cols != *rows || n > x.rows || n > gate.rows {
            return false;
        }
        let Some(xh) = self.x_to_f16(x, n) else {
            return true; // the failure is recorded
        };
        let Some(h) = self.scratch_ptr(|s| &mut s.h, n * rows) else {
            return true;
        };
        let tiles = rows.div_ceil(16);
        // Tiles a block: the fewest warps that still fill every SM once (one block a SM).
        let warps = match self.mmw_warps.load(std::sync::atomic::Ordering::Relaxed) {
            0 => tiles.div_ceil(self.sm_count.max(1)),
            w => w,
        }
        .clamp(1, MW_MAX_WARPS);
        self.launch(
            "mmw_gated",
            (tiles.div_ceil(warps) as u32, 1, 1),
            (warps * 32) as u32,
            &[
                Arg::P(xh),
                Arg::I(n as i32),
                Arg::I(*cols as i32),
                Arg::P(self.ptr(wg)),
                Arg::P(self.ptr(wu)),
                Arg::I(*rows as i32),
                Arg::I(activation_id(act)),
                Arg::P(gate.ptr),
                Arg::P(h),
            ],
        );
        // The down projection's input, as gated_act_f16 leaves it.
        *self.f16_holds.lock().unwrap_or_else(|p| p.into_inner()) = Some((gate.ptr, n, h));
        true
    }

    /// Forces the warps per block of `mmw_*` (0: chosen by shape; the self-check's small
    /// matrices would otherwise only see one).
    pub fn set_mmw_warps(&self, warps: usize) {
        self.mmw_warps
            .store(warps, std::sync::atomic::Ordering::Relaxed);
    }

    fn alloc<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        len: usize,
        what: &str,
    ) -> anyhow::Result<CudaSlice<T>> {
        self.stream
            .alloc_zeros::<T>(len.max(1))
            .map_err(|e| anyhow::anyhow!("allocating {what} ({len} elements) on the GPU: {e:?}"))
    }

    fn vector_ptr(&self, w: &CudaWeight, what: &str) -> Option<u64> {
        match w {
            CudaWeight::Vector { ptr, .. } => Some(*ptr),
            CudaWeight::Matrix { .. } => {
                self.fail(format!("{what}: expected a vector weight, got a matrix"));
                None
            }
        }
    }

    fn freq_factors_ptr(&self, f: &Arc<[f32]>) -> Option<u64> {
        let mut cache = self.freq_factors.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, _, p)) = cache.iter().find(|(a, _, _)| Arc::ptr_eq(a, f)) {
            return Some(*p);
        }
        match self.stream.clone_htod(&f[..]) {
            Ok(buf) => {
                let p = self.ptr(&buf);
                cache.push((f.clone(), buf, p));
                Some(p)
            }
            Err(e) => {
                self.fail(format!("uploading rope frequency factors: {e:?}"));
                None
            }
        }
    }

    /// Copies the first `n` rows of `x` into the pinned read-back buffer and calls `f` with
    /// them there (under its lock). The copy is queued right behind the step, without a
    /// wait first: launch errors so far are reported before it, the step's and the copy's
    /// by the check after it.
    fn read_pinned<R>(
        &self,
        x: &CudaTensor,
        n: usize,
        f: impl FnOnce(&[f32]) -> R,
    ) -> anyhow::Result<R> {
        if n > x.rows {
            bail!("reading {n} rows of a tensor of {}", x.rows);
        }
        let len = n * x.cols;
        // Rows copied ahead by the product that made them (and untouched since).
        let ahead = self
            .read_ahead
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .filter(|_| {
                self.read_ahead_valid
                    .swap(false, std::sync::atomic::Ordering::Relaxed)
            })
            == Some((x.ptr, n, x.cols));
        self.rows_read_back.store(
            len * 4 >= READ_AHEAD_MIN_BYTES,
            std::sync::atomic::Ordering::Relaxed,
        );
        if len == 0 {
            self.check()?;
            return Ok(f(&[]));
        }
        if ahead {
            // The rows are on their way into the pinned buffer: wait for the step and them.
            self.check()?;
            self.wait_copies()?;
            self.read_ahead_hits
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        } else {
            self.wait_copies()?;
            self.flush();
            if let Some(msg) = self.lock_error().take() {
                bail!("CUDA: {msg}");
            }
        }
        // Pinned: a copy into pageable memory is several times slower (batched decode
        // reads a row of logits per sequence every step).
        let mut pinned = self.pinned.lock().unwrap_or_else(|p| p.into_inner());
        let host = self.pinned_room(&mut pinned, len)?;
        // The driver sees the page-locked address whatever the slice type; cudarc wants
        // equal lengths, so copy into a plain sub-slice of it.
        let values = host
            .as_mut_slice()
            .map_err(|e| anyhow::anyhow!("reading the pinned host buffer: {e:?}"))?;
        if !ahead {
            self.stream
                .memcpy_dtoh(&x.buf.slice(..len), &mut values[..len])
                .map_err(|e| anyhow::anyhow!("copying results from the GPU: {e:?}"))?;
            self.check()?;
        }
        Ok(f(&values[..len]))
    }

    /// The pinned read-back buffer held in `slot`, grown to at least `len` values (a read-
    /// ahead filled it with `len` values already: it is never grown then).
    fn pinned_room<'a>(
        &self,
        slot: &'a mut Option<cudarc::driver::PinnedHostSlice<f32>>,
        len: usize,
    ) -> anyhow::Result<&'a mut cudarc::driver::PinnedHostSlice<f32>> {
        if slot.as_ref().is_none_or(|p| p.len() < len) {
            *slot = None; // free the old one first
            // SAFETY: the buffer is only read after the copies into it have completed (the
            // synchronize in `check`, `wait_copies` for the read-ahead's).
            let buf = unsafe { self.ctx.alloc_pinned::<f32>(len.next_power_of_two()) }
                .map_err(|e| anyhow::anyhow!("allocating a pinned host buffer: {e:?}"))?;
            *slot = Some(buf);
        }
        slot.as_mut().context("no pinned host buffer")
    }

    /// The pending merged product of exactly these q, k, v and `n` tokens, taken (it is
    /// then split by whoever took it); None when there is none or another waits.
    fn take_split_of(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        n: usize,
    ) -> Option<PendingSplit> {
        let relaxed = std::sync::atomic::Ordering::Relaxed;
        if !self.split_waits.load(relaxed) {
            return None;
        }
        let mut slot = self.pending_split.lock().unwrap_or_else(|p| p.into_inner());
        let ours = slot.as_ref().is_some_and(|p| {
            p.n == n
                && p.args[1] == Arg::P(q.ptr)
                && p.args[2] == Arg::P(k.ptr)
                && p.args[3] == Arg::P(v.ptr)
        });
        if !ours {
            return None;
        }
        self.split_waits.store(false, relaxed);
        slot.take()
    }

    /// Launches the split of a pending merged Q/K/V product, if any.
    fn split_pending(&self) {
        if !self
            .split_waits
            .swap(false, std::sync::atomic::Ordering::Relaxed)
        {
            return;
        }
        let pending = self
            .pending_split
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(p) = pending {
            let Arg::L(len) = p.args[9] else {
                return;
            };
            self.elementwise("split_qkv", len as usize, &p.args);
        }
    }

    /// Launches `kernel` with one block of `threads` per row for `n` rows, each writing its
    /// token id into the id buffer (`args` gets its address), and reads the ids into `out`.
    fn launch_for_ids(
        &self,
        kernel: &'static str,
        n: usize,
        threads: u32,
        out: &mut Vec<u32>,
        args: impl FnOnce(u64) -> Vec<Arg>,
    ) -> anyhow::Result<()> {
        // Rows are sampled on the device now: the next logits need no read-ahead.
        self.rows_read_back
            .store(false, std::sync::atomic::Ordering::Relaxed);
        let mut ids = self.argmax_ids.lock().unwrap_or_else(|p| p.into_inner());
        if ids.as_ref().is_none_or(|b| b.len() < n) {
            *ids = Some(self.alloc::<u32>(n.next_power_of_two(), "token ids")?);
        }
        let Some(buf) = ids.as_ref() else {
            bail!("no token id buffer");
        };
        self.launch(kernel, (n as u32, 1, 1), threads, &args(self.ptr(buf)));
        self.check()?;
        out.resize(n, 0);
        self.stream
            .memcpy_dtoh(&buf.slice(..n), &mut out[..])
            .map_err(|e| anyhow::anyhow!("copying token ids from the GPU: {e:?}"))?;
        self.check()
    }

    fn elementwise(&self, name: &'static str, len: usize, args: &[Arg]) {
        self.launch(name, grid_1d(len, 256), 256, args);
    }
}

impl kestrel_model::Backend for CudaBackend {
    type Weight = CudaWeight;
    type Tensor = CudaTensor;
    type Cache = CudaCache;
    type Step = CudaStep;

    fn name(&self) -> String {
        format!("cuda ({}, {})", self.device_name, self.arch)
    }

    fn load_weight(&self, file: &Arc<GgufFile>, info: &TensorInfo) -> anyhow::Result<CudaWeight> {
        let cols = info.dims.first().copied().unwrap_or(1) as usize;
        let rows = info.dims.iter().skip(1).product::<u64>() as usize;
        if info.dims.len() <= 1 {
            let mut v = vec![0f32; cols];
            kestrel_quant::dequantize_row(info.ty, file.tensor_data(info), &mut v)
                .with_context(|| format!("tensor {}", info.name))?;
            let buf = self
                .stream
                .clone_htod(&v)
                .map_err(|e| anyhow::anyhow!("uploading {}: {e:?}", info.name))?;
            let ptr = self.ptr(&buf);
            return Ok(CudaWeight::Vector {
                buf,
                ptr,
                len: cols,
            });
        }
        let mut w = self
            .upload_matrix(info.ty, rows, cols, file.tensor_data(info))
            .with_context(|| format!("tensor {}", info.name))?;
        // The embedding table is only gathered from, unless it doubles as the LM head.
        if info.ty == GgmlType::F16 {
            self.f16_copies
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
        let gathered_only =
            info.name == "token_embd.weight" && file.tensor("output.weight").is_some();
        // The 4-bit tensor-core copy of gate and up (mmw_gated).
        let gate_or_up =
            info.name.ends_with("ffn_gate.weight") || info.name.ends_with("ffn_up.weight");
        if !gathered_only && gate_or_up {
            self.add_mmw_copy(&mut w)
                .with_context(|| format!("tensor {}", info.name))?;
        }
        let merged_at = self
            .merged_f16_rows
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&info.name);
        if let Some(at) = merged_at {
            // K or V: rows of the merged copy Q's load allocated.
            self.dequant_f16_into(&w, at)
                .with_context(|| format!("tensor {}", info.name))?;
            self.note_f16_copy(info.ty);
        } else if !gathered_only && self.keep_f16_copy(info.ty, rows * cols) {
            let room = self.merge_f16_behind(file, info, rows, cols);
            self.add_f16_copy(&mut w, room)
                .with_context(|| format!("tensor {}", info.name))?;
            if room > rows
                && let CudaWeight::Matrix {
                    f16: Some(copy), ..
                } = &w
            {
                // K's and V's rows follow Q's; they fill them as they load (next).
                let mut at = self.ptr(copy) + (rows * cols * 2) as u64;
                let mut pending = self
                    .merged_f16_rows
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                pending.clear();
                for name in merged_followers(&info.name) {
                    let follower_rows = file.tensor(&name).map_or(0, tensor_rows);
                    pending.insert(name, at);
                    at += (follower_rows * cols * 2) as u64;
                }
            }
        }
        Ok(w)
    }

    fn new_tensor(&self, rows: usize, cols: usize) -> anyhow::Result<CudaTensor> {
        let len = rows.checked_mul(cols).context("tensor size overflows")?;
        let buf = self.alloc::<f32>(len, "an activation buffer")?;
        let ptr = self.ptr(&buf);
        Ok(CudaTensor {
            buf,
            ptr,
            rows,
            cols,
        })
    }

    fn new_cache(
        &self,
        config: &ModelConfig,
        n_blocks: usize,
        block_size: usize,
    ) -> anyhow::Result<CudaCache> {
        let kv_dim = config.kv_dim();
        let per_layer = config
            .kv_cache_len(n_blocks, block_size)
            .context("KV cache size overflows")?;
        let mut cache = CudaCache {
            k: Vec::new(),
            v: Vec::new(),
            k_ptr: Vec::new(),
            v_ptr: Vec::new(),
            block_size,
            n_blocks,
            kv_dim,
        };
        for _ in 0..config.n_layer {
            let k = self.alloc::<u16>(per_layer, "the KV cache")?;
            let v = self.alloc::<u16>(per_layer, "the KV cache")?;
            cache.k_ptr.push(self.ptr(&k));
            cache.v_ptr.push(self.ptr(&v));
            cache.k.push(k);
            cache.v.push(v);
        }
        Ok(cache)
    }

    fn new_step(&self, config: &ModelConfig, max_tokens: usize) -> anyhow::Result<CudaStep> {
        let max_tokens = max_tokens.max(1);
        let widest = config
            .n_embd
            .max(config.n_ff)
            .max(config.n_head * config.head_dim);
        // Room for the widest input of the largest step the 8-bit kernels take.
        self.reserve_q8(GEMV_MAX_TOKENS.max(MMQ_MAX_TOKENS) * widest)?;
        // Room for one sequence at full context; grows if a step needs more.
        let table_capacity = config.context_length.div_ceil(16).max(64);
        let buf = self.alloc::<u32>(6 * max_tokens + table_capacity, "the step inputs")?;
        let ptr = self.ptr(&buf);
        let attn_part_len = max_tokens.min(SPLIT_ATTN_MAX_TOKENS)
            * config.n_head
            * MAX_ATTN_SPLITS
            * (config.head_dim + 2);
        let attn_part = self.alloc::<f32>(attn_part_len, "the attention partials")?;
        let attn_part_ptr = self.ptr(&attn_part);
        Ok(CudaStep {
            buf,
            ptr,
            _attn_part: attn_part,
            attn_part_ptr,
            attn_part_len,
            max_tokens,
            table_capacity,
            host: Vec::new(),
            n_tokens: 0,
            n_logit_rows: 0,
        })
    }

    fn prepare_step(&self, batch: &Batch, step: &mut CudaStep) -> anyhow::Result<()> {
        // Errors of the previous step surface here at the latest.
        self.check()?;
        if let Some(p) = &self.profile {
            p.lock().unwrap_or_else(|e| e.into_inner()).steps += 1;
        }
        let t = step.max_tokens;
        let n = batch.len();
        if n > t || batch.seqs.len() > t || batch.logit_rows.len() > t {
            bail!(
                "batch of {n} tokens, {} sequences, {} logit rows exceeds the step size {t}",
                batch.seqs.len(),
                batch.logit_rows.len()
            );
        }
        if batch.positions.len() != n || batch.seq_of.len() != n {
            bail!("bad batch: tokens, positions and seq_of differ in length");
        }
        let tables: usize = batch.seqs.iter().map(|s| s.block_table.len()).sum();
        if tables > step.table_capacity {
            let cap = tables.next_power_of_two();
            step.buf = self.alloc::<u32>(6 * t + cap, "the step inputs")?;
            step.ptr = self.ptr(&step.buf);
            step.table_capacity = cap;
        }
        let h = &mut step.host;
        h.clear();
        h.resize(6 * t + tables, 0);
        h[..n].copy_from_slice(&batch.tokens);
        h[t..t + n].copy_from_slice(&batch.positions);
        h[2 * t..2 * t + n].copy_from_slice(&batch.seq_of);
        h[3 * t..3 * t + batch.logit_rows.len()].copy_from_slice(&batch.logit_rows);
        let mut off = 0usize;
        for (s, seq) in batch.seqs.iter().enumerate() {
            h[4 * t + s] = off as u32;
            h[5 * t + s] = seq.kv_len as u32;
            h[6 * t + off..6 * t + off + seq.block_table.len()].copy_from_slice(&seq.block_table);
            off += seq.block_table.len();
        }
        let len = h.len();
        self.stream
            .memcpy_htod(&h[..], &mut step.buf.slice_mut(..len))
            .map_err(|e| anyhow::anyhow!("copying the step inputs to the GPU: {e:?}"))?;
        step.n_tokens = n;
        step.n_logit_rows = batch.logit_rows.len();
        // Steps whose products go through cuBLAS (see `prefer_gemm`) are not recorded:
        // cuBLAS calls are not launches the recorder can replay.
        let relaxed = std::sync::atomic::Ordering::Relaxed;
        let copies_q8 = self.f16_copies_q8.load(relaxed);
        let q8_kernels_take =
            |ty: GgmlType| self.mmq_reads(ty, n) || (n <= Q8_GEMV_MAX_TOKENS && self.q8_decode());
        let uses_cublas = self.blas.is_some()
            && n >= 2
            && (self.f16_copies.load(relaxed)
                || [GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q8_0, GgmlType::Q4_0]
                    .into_iter()
                    .any(|ty| copies_q8 & (1 << ty.id()) != 0 && !q8_kernels_take(ty)));
        let graph_max = GRAPH_MAX_TOKENS.max(MMQ_MAX_TOKENS);
        if n <= graph_max && !uses_cublas && self.graphs.load(std::sync::atomic::Ordering::Relaxed)
        {
            self.lock_recorder().deferring = true;
        }
        Ok(())
    }

    fn embed(&self, table: &CudaWeight, step: &CudaStep, out: &mut CudaTensor) {
        let CudaWeight::Matrix {
            ptr,
            ty,
            cols,
            row_bytes,
            ..
        } = table
        else {
            self.fail("embed: the table is not a matrix".into());
            return;
        };
        self.launch(
            "embed",
            (step.n_tokens as u32, 1, 1),
            128,
            &[
                Arg::P(*ptr),
                Arg::I(ty.id() as i32),
                Arg::L(*row_bytes as i64),
                Arg::I(*cols as i32),
                Arg::P(step.tokens()),
                Arg::P(out.ptr),
            ],
        );
    }

    fn scale(&self, x: &mut CudaTensor, n: usize, factor: f32) {
        let len = n * x.cols;
        self.elementwise(
            "scale_f32",
            len,
            &[Arg::P(x.ptr), Arg::I(len as i32), Arg::F(factor)],
        );
    }

    fn rms_norm(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        eps: f32,
        n: usize,
        out: &mut CudaTensor,
    ) {
        let Some(w) = self.vector_ptr(weight, "rms_norm") else {
            return;
        };
        // About 4 values per thread: a single-token row is one block's latency.
        let block = (x.cols / 4).next_multiple_of(32).clamp(32, 1024) as u32;
        // The leading arguments of every rms_norm kernel.
        let head = [
            Arg::P(x.ptr),
            Arg::P(w),
            Arg::P(out.ptr),
            Arg::I(x.cols as i32),
            Arg::F(eps),
        ];
        // A single-token row whose consumer is a gemv_q8: quantize it on the way out.
        if let Some(Q8Ptrs {
            q: q_ptr, d: d_ptr, ..
        }) = self.single_q8_buffers(n, x.cols)
        {
            // One block per 256 values, each summing the whole row (see the kernel). One
            // block for the whole row measured 576 / 585 against 627 / 611 t/s (tg128,
            // Qwen2.5-1.5B Q4_K_M, H100), 305 / 303 against 310 / 307 on Llama-3-8B.
            let (grid, threads) = (grid_1d(x.cols, 256), 256);
            let args = [&head[..], &[Arg::P(q_ptr), Arg::P(d_ptr)]].concat();
            self.launch("rms_norm_q8", grid, threads, &args);
            *self.q8_holds.lock().unwrap_or_else(|p| p.into_inner()) = Some(out.ptr);
            return;
        }
        // A few tokens whose consumer is an int8 mmq launch (steps of MMQ_MIN_TOKENS up to
        // MMQ_MAX_TOKENS): quantize them on the way out, in that kernel's layout.
        if let Some(MultiQ8 { npad, mmk, q8 }) = self.multi_q8_layout(n, x.cols) {
            let Q8Ptrs { q, ds, .. } = q8;
            let tail = [Arg::I(n as i32), Arg::I(npad as i32), Arg::P(q), Arg::P(ds)];
            let mut args = [&head[..], &tail].concat();
            // mmk's layout: one block per token; else `mmq_t*`'s, one block per 256 values.
            if mmk {
                args.push(Arg::P(q8.mmk_steps_sums(npad, x.cols).1));
                let threads = 64 * (x.cols / 256).min(16) as u32;
                self.launch("rms_norm_mmk", (1, npad as u32, 1), threads, &args);
            } else {
                let grid = (x.cols.div_ceil(256) as u32, npad as u32, 1);
                self.launch("rms_norm_mmq", grid, 256, &args);
            }
            *self.mmq_holds.lock().unwrap_or_else(|p| p.into_inner()) =
                Some((out.ptr, n, npad, mmk));
            return;
        }
        // Rows for cuBLAS: their f16 copy on the way out (B = 64 on Llama-3-8B: two
        // conversion launches a layer less).
        if let Some(h) = self.f16_copy_for_gemm(n, x.cols) {
            let args = [&head[..], &[Arg::P(h)]].concat();
            self.launch("rms_norm_f16", (n as u32, 1, 1), block, &args);
            *self.f16_holds.lock().unwrap_or_else(|p| p.into_inner()) = Some((out.ptr, n, h));
            return;
        }
        self.launch("rms_norm", (n as u32, 1, 1), block, &head);
    }

    fn rms_norm_heads(
        &self,
        x: &mut CudaTensor,
        weight: &CudaWeight,
        head_dim: usize,
        eps: f32,
        n: usize,
    ) {
        let Some(w) = self.vector_ptr(weight, "rms_norm_heads") else {
            return;
        };
        // Heads are contiguous rows of `head_dim` values: a row norm over n·heads rows.
        let rows = n * x.cols / head_dim;
        let block = head_dim.next_multiple_of(32).min(256) as u32;
        self.launch(
            "rms_norm",
            (rows as u32, 1, 1),
            block,
            &[
                Arg::P(x.ptr),
                Arg::P(w),
                Arg::P(x.ptr),
                Arg::I(head_dim as i32),
                Arg::F(eps),
            ],
        );
    }

    fn matmul(&self, x: &CudaTensor, w: &CudaWeight, n: usize, out: &mut CudaTensor) {
        let CudaWeight::Matrix {
            ptr,
            ty,
            rows,
            cols,
            row_bytes,
            ..
        } = w
        else {
            self.fail("matmul: the weight is not a matrix".into());
            return;
        };
        if x.cols != *cols || out.cols != *rows {
            self.fail(format!(
                "matmul: x has {} columns, out {}, weight is {rows}×{cols}",
                x.cols, out.cols
            ));
            return;
        }
        if self.prefer_gemm(w, n) && self.gemm_f16(x, w, n, out) {
            return;
        }
        if let Some(seg) = self.gemv_seg(x, w, out, None)
            && self.gemv_takes(x.cols, n, std::slice::from_ref(&seg), false)
        {
            self.gemv(x, n, &[seg], None);
            return;
        }
        const ROWS_PER_BLOCK: usize = 8;
        const TOKENS_PER_BLOCK: usize = 4;
        let grid_y = n.div_ceil(TOKENS_PER_BLOCK);
        if grid_y > 65535 {
            self.fail(format!("matmul: {n} tokens in one call is too many"));
            return;
        }
        self.launch(
            "matmul",
            (rows.div_ceil(ROWS_PER_BLOCK) as u32, grid_y as u32, 1),
            (ROWS_PER_BLOCK * 32) as u32,
            &[
                Arg::P(*ptr),
                Arg::I(ty.id() as i32),
                Arg::L(*row_bytes as i64),
                Arg::I(*cols as i32),
                Arg::I(*rows as i32),
                Arg::P(x.ptr),
                Arg::P(out.ptr),
                Arg::I(n as i32),
            ],
        );
    }

    fn add_bias(&self, x: &mut CudaTensor, bias: &CudaWeight, n: usize) {
        let Some(b) = self.vector_ptr(bias, "add_bias") else {
            return;
        };
        let len = n * x.cols;
        self.elementwise(
            "add_bias",
            len,
            &[
                Arg::P(x.ptr),
                Arg::P(b),
                Arg::I(len as i32),
                Arg::I(x.cols as i32),
            ],
        );
    }

    fn rope(
        &self,
        x: &mut CudaTensor,
        head_dim: usize,
        rope: &RopeParams,
        step: &CudaStep,
        n: usize,
    ) {
        let Some(rope_args) = self.rope_args(head_dim, rope) else {
            return;
        };
        let mut args = vec![
            Arg::P(x.ptr),
            Arg::P(step.positions()),
            Arg::I(x.cols as i32),
        ];
        args.extend_from_slice(&rope_args);
        self.launch("rope", (n as u32, 1, 1), 128, &args);
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
        if k.cols != cache.kv_dim || v.cols != cache.kv_dim || layer >= cache.k.len() {
            self.fail(format!(
                "store_kv: bad geometry (layer {layer}, {} / {} columns, kv_dim {})",
                k.cols, v.cols, cache.kv_dim
            ));
            return;
        }
        self.launch(
            "store_kv",
            (n as u32, 1, 1),
            128,
            &[
                &[
                    Arg::P(k.ptr),
                    Arg::P(v.ptr),
                    Arg::P(cache.k_ptr[layer]),
                    Arg::P(cache.v_ptr[layer]),
                ][..],
                &step.slot_args(),
                &[Arg::I(cache.block_size as i32), Arg::I(cache.kv_dim as i32)],
            ]
            .concat(),
        );
    }

    fn attention(
        &self,
        q: &CudaTensor,
        cache: &CudaCache,
        p: &AttnParams,
        step: &CudaStep,
        n: usize,
        out: &mut CudaTensor,
    ) {
        if p.head_dim > MAX_HEAD_DIM {
            self.fail(format!(
                "attention: head size {} exceeds the kernel's {MAX_HEAD_DIM}",
                p.head_dim
            ));
            return;
        }
        if p.layer >= cache.k.len() || p.n_head_kv * p.head_dim != cache.kv_dim {
            self.fail(format!("attention: bad geometry for layer {}", p.layer));
            return;
        }
        let window = p.window.map_or(0, |w| w.min(i32::MAX as usize) as i32);
        let width = p.n_head * p.head_dim;
        // A single token's output feeds the output projection's gemv_q8: quantized by the
        // kernel that writes it (no quantize_x_q8 launch), as rms_norm_q8 does for its rows.
        let q8 = self
            .single_q8_buffers(n, width)
            .filter(|_| p.head_dim.is_multiple_of(32))
            .map(|b| (b.q, b.d));
        // A few tokens whose output projection reads mmk's layout (mmk_t8*, mms_*): the
        // split merge quantizes them (256-value blocks of whole heads).
        let mmk = self
            .multi_q8_layout(n, width)
            .filter(|l| l.mmk && p.head_dim <= 256 && 256 % p.head_dim == 0)
            .map(|l| {
                let (xk, xb) = l.q8.mmk_steps_sums(l.npad, width);
                (l.npad, [l.q8.q, xk, xb])
            });
        let ctx = AttnLaunch {
            q: q.ptr,
            k: cache.k_ptr[p.layer],
            v: cache.v_ptr[p.layer],
            out: out.ptr,
            block_size: cache.block_size,
            window,
            q8,
            mmk,
        };
        // After launches that wrote the whole step's quantized output: the consumer finds it.
        let note_quantized = || {
            if let Some((npad, _)) = mmk {
                *self.mmq_holds.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some((out.ptr, n, npad, true));
            } else {
                *self.q8_holds.lock().unwrap_or_else(|p| p.into_inner()) = Some(out.ptr);
            }
        };
        if n <= GEMV_MAX_TOKENS {
            // Decode: one launch list whatever the sequences (graph replay).
            if self.attention_short(&ctx, p, step, 0, n) {
                note_quantized();
            }
            return;
        }
        // Runs of one sequence's tokens (a batch keeps each sequence's tokens together):
        // prompt chunks go to the tiled prefill kernels, the short runs between them (decode
        // tokens of other sequences) to the split kernels, gathered into ranges.
        let prefill_ok = p.head_dim <= PREFILL_ATTN_MAX_HEAD_DIM && p.head_dim.is_multiple_of(4);
        let mut short: Option<(usize, usize)> = None;
        for (start, len) in step.sequence_runs(n) {
            if prefill_ok && len >= PREFILL_ATTN_TOKENS {
                if let Some((a, b)) = short.take() {
                    self.attention_short(&ctx, p, step, a, b - a);
                }
                self.attention_prefill(&ctx, p, step, start, len);
            } else {
                short = match short {
                    Some((a, b)) if b == start => Some((a, start + len)),
                    Some((a, b)) => {
                        self.attention_short(&ctx, p, step, a, b - a);
                        Some((start, start + len))
                    }
                    None => Some((start, start + len)),
                };
            }
        }
        if let Some((a, b)) = short
            && self.attention_short(&ctx, p, step, a, b - a)
            && (a, b) == (0, n)
        {
            note_quantized();
        }
    }

    fn gated_activation(&self, gate: &mut CudaTensor, up: &CudaTensor, act: Activation, n: usize) {
        let len = n * gate.cols;
        let mut args = vec![
            Arg::P(gate.ptr),
            Arg::P(up.ptr),
            Arg::I(len as i32),
            Arg::I(activation_id(act)),
        ];
        // The down projection's input for cuBLAS: its f16 copy on the way out.
        if let Some(h) = self.f16_copy_for_gemm(n, gate.cols) {
            args.push(Arg::P(h));
            self.elementwise("gated_act_f16", len, &args);
            *self.f16_holds.lock().unwrap_or_else(|p| p.into_inner()) = Some((gate.ptr, n, h));
            return;
        }
        self.elementwise("gated_act", len, &args);
    }

    fn add(&self, x: &mut CudaTensor, y: &CudaTensor, n: usize) {
        let len = n * x.cols;
        self.elementwise(
            "add_f32",
            len,
            &[Arg::P(x.ptr), Arg::P(y.ptr), Arg::I(len as i32)],
        );
    }

    fn gather_logit_rows(&self, x: &CudaTensor, step: &CudaStep, out: &mut CudaTensor) {
        self.launch(
            "gather_rows",
            (step.n_logit_rows as u32, 1, 1),
            256,
            &[
                Arg::P(x.ptr),
                Arg::P(out.ptr),
                Arg::P(step.logit_rows()),
                Arg::I(x.cols as i32),
            ],
        );
    }

    fn read_rows(&self, x: &CudaTensor, n: usize, out: &mut Vec<f32>) -> anyhow::Result<()> {
        self.read_pinned(x, n, |values| {
            // Large reads out of the pinned buffer on every core: one thread moved ~8 GB/s
            // on the H100 host, ~4 ms a step for the 33 MB of logits 64 sequences of a
            // 128K-word vocabulary return (Llama-3-8B `bench --seqs 64`: 4,235 / 4,315 ->
            // 5,787 / 5,681 t/s). Small ones stay on this thread: waking the pool cost
            // single-token decode of Qwen2.5-1.5B (608 KB of logits) 7-13%.
            const CHUNK: usize = 1 << 16;
            const PARALLEL_FROM: usize = 1 << 20;
            if out.len() != values.len() {
                out.clear();
                out.resize(values.len(), 0.0);
            }
            if values.len() < PARALLEL_FROM {
                out.copy_from_slice(values);
            } else {
                out.par_chunks_mut(CHUNK)
                    .zip(values.par_chunks(CHUNK))
                    .for_each(|(d, s)| d.copy_from_slice(s));
            }
        })
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

    fn argmax_rows(
        &self,
        x: &CudaTensor,
        n: usize,
        _scratch: &mut Vec<f32>,
        out: &mut Vec<u32>,
    ) -> anyhow::Result<()> {
        if n > x.rows {
            bail!("argmax_rows: {n} rows asked, tensor has {}", x.rows);
        }
        out.clear();
        if n == 0 {
            return self.check();
        }
        self.launch_for_ids("argmax_rows", n, 256, out, |ids| {
            vec![Arg::P(x.ptr), Arg::P(ids), Arg::I(x.cols as i32)]
        })
    }

    fn sample_rows(
        &self,
        x: &CudaTensor,
        n: usize,
        sampling: &SamplingBatch,
        scratch: &mut Vec<f32>,
        out: &mut Vec<u32>,
    ) -> anyhow::Result<()> {
        sampling.check_rows(n)?;
        if n > x.rows {
            bail!("sample_rows: {n} rows asked, tensor has {}", x.rows);
        }
        if sampling.rows.iter().all(|r| r.is_argmax()) {
            return self.argmax_rows(x, n, scratch, out);
        }
        out.clear();
        // The kernel's layout (kernels/sample.cu): SAMPLE_WORDS words a row, then the
        // penalty pairs of every row.
        const SAMPLE_WORDS: usize = 12;
        let mut params = self.sample_params.lock().unwrap_or_else(|p| p.into_inner());
        let (host, device) = &mut *params;
        host.clear();
        for r in &sampling.rows {
            let inv_t = if r.is_greedy() {
                0.0
            } else {
                1.0 / r.temperature
            };
            let u = r.u.to_bits();
            host.extend_from_slice(&[
                inv_t.to_bits(),
                r.top_k,
                r.top_p.to_bits(),
                r.min_p_log().to_bits(),
                r.repeat_penalty.to_bits(),
                r.presence_penalty.to_bits(),
                r.frequency_penalty.to_bits(),
                r.penalty_start,
                r.penalty_len,
                u as u32,
                (u >> 32) as u32,
                0,
            ]);
        }
        debug_assert_eq!(host.len(), n * SAMPLE_WORDS);
        let pairs = sampling.penalties.len();
        if sampling
            .rows
            .iter()
            .any(|r| r.penalty_start as usize + r.penalty_len as usize > pairs)
        {
            bail!("a sampling row's penalties lie outside its batch");
        }
        host.extend(
            sampling
                .penalties
                .iter()
                .flat_map(|&(id, count)| [id, count]),
        );
        let len = host.len();
        if device.as_ref().is_none_or(|b| b.len() < len) {
            *device = Some(self.alloc::<u32>(len.next_power_of_two(), "sampling settings")?);
        }
        let Some(dev) = device.as_mut() else {
            bail!("no sampling buffer");
        };
        self.stream
            .memcpy_htod(&host[..], &mut dev.slice_mut(..len))
            .map_err(|e| anyhow::anyhow!("copying the sampling settings to the GPU: {e:?}"))?;
        let params_ptr = self.ptr(dev);
        drop(params);
        self.launch_for_ids("sample_rows", n, 1024, out, |ids| {
            vec![
                Arg::P(x.ptr),
                Arg::P(params_ptr),
                Arg::P(ids),
                Arg::I(x.cols as i32),
            ]
        })
    }

    fn qkv(
        &self,
        x: &CudaTensor,
        layer: &LayerWeights<CudaWeight>,
        n: usize,
        q: &mut CudaTensor,
        k: &mut CudaTensor,
        v: &mut CudaTensor,
    ) {
        if !self.prefer_gemm(&layer.attn_q, n) {
            let segs = [
                self.gemv_seg(x, &layer.attn_q, q, layer.attn_q_bias.as_ref()),
                self.gemv_seg(x, &layer.attn_k, k, layer.attn_k_bias.as_ref()),
                self.gemv_seg(x, &layer.attn_v, v, layer.attn_v_bias.as_ref()),
            ];
            if let [Some(a), Some(b), Some(c)] = segs {
                let segs = [a, b, c];
                if self.gemv_takes(x.cols, n, &segs, false) {
                    self.gemv(x, n, &segs, None);
                    return;
                }
            }
        }
        // Through cuBLAS: one product over Q's merged f16 copy (K's and V's rows behind
        // Q's), split into q, k and v with the biases added.
        // (Only where prefer_gemm agrees: a step recorded for graph replay must not call
        // cuBLAS, and formats the GEMVs do not read come here in such steps too.) Up to
        // MERGED_QKV_MAX_TOKENS: Llama-3-8B Q4_K_M, B = 64 decode with device argmax
        // 6,710 / 6,738 / 6,803 -> 6,902 / 7,047 / 6,885 t/s, pp512 +0.9%; its 2,048-token
        // prefill steps lost 2.5% to the split's extra pass over the outputs.
        if n <= MERGED_QKV_MAX_TOKENS
            && self.prefer_gemm(&layer.attn_q, n)
            && let Some((a, rows)) = self.merged_copy(
                &layer.attn_q,
                &[&layer.attn_k, &layer.attn_v],
                x.cols,
                &[q, k, v],
            )
            && let Some(xh) = self.x_to_f16(x, n)
            && let Some(merged) = self.scratch_ptr(|s| &mut s.qkv, 2 * n * rows)
        {
            let bias = |b: &Option<CudaWeight>| match b {
                Some(b) => self.vector_ptr(b, "qkv bias"),
                None => Some(0),
            };
            let (Some(bq), Some(bk), Some(bv)) = (
                bias(&layer.attn_q_bias),
                bias(&layer.attn_k_bias),
                bias(&layer.attn_v_bias),
            ) else {
                return;
            };
            self.gemm_f16_raw(a, rows, x.cols, xh, n, merged, rows, false);
            // The split waits for rope_store_kv, which does it on the way (one launch and
            // one pass over the outputs fewer; see PendingSplit).
            self.split_pending();
            self.split_waits
                .store(true, std::sync::atomic::Ordering::Relaxed);
            *self.pending_split.lock().unwrap_or_else(|p| p.into_inner()) = Some(PendingSplit {
                args: [
                    Arg::P(merged),
                    Arg::P(q.ptr),
                    Arg::P(k.ptr),
                    Arg::P(v.ptr),
                    Arg::P(bq),
                    Arg::P(bk),
                    Arg::P(bv),
                    Arg::I(q.cols as i32),
                    Arg::I(k.cols as i32),
                    Arg::L((n * rows) as i64),
                ],
                n,
            });
            return;
        }
        // Through cuBLAS: x converted to f16 once for the three products.
        self.matmuls_of(
            x,
            n,
            &mut [
                (&layer.attn_q, &mut *q),
                (&layer.attn_k, &mut *k),
                (&layer.attn_v, &mut *v),
            ],
        );
        self.add_qkv_biases(layer, n, q, k, v);
    }

    fn gate_up(
        &self,
        x: &CudaTensor,
        layer: &LayerWeights<CudaWeight>,
        act: Activation,
        n: usize,
        gate: &mut CudaTensor,
        up: &mut CudaTensor,
    ) {
        self.gate_up_of(x, &layer.ffn_gate, &layer.ffn_up, act, n, gate, up);
    }

    fn matmul_add(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        n: usize,
        tmp: &mut CudaTensor,
        residual: &mut CudaTensor,
    ) {
        // Single-token steps and the tensor-core kernels of a few tokens add into the
        // residual themselves.
        if !self.prefer_gemm(w, n)
            && let Some(mut seg) = self.gemv_seg(x, w, residual, None)
        {
            seg.accumulate = true;
            let segs = [seg];
            if n == 1 || self.mmq_applies(x.cols, n, &segs, false) {
                self.gemv(x, n, &segs, None);
                return;
            }
        }
        // Prompt-sized steps on cuBLAS: the product added into the residual by the GEMM.
        if self.blas.is_some()
            && self.prefer_gemm(w, n)
            && w.cols() == Some(x.cols)
            && let Some(xh) = self.x_to_f16(x, n)
        {
            self.gemm_f16_into(xh, w, n, residual, true);
            return;
        }
        self.matmul(x, w, n, tmp);
        self.add(residual, tmp, n);
    }

    fn rope_store_kv(
        &self,
        q: &mut CudaTensor,
        k: &mut CudaTensor,
        v: &CudaTensor,
        head_dim: usize,
        rope: &RopeParams,
        cache: &mut CudaCache,
        layer: usize,
        step: &CudaStep,
        n: usize,
    ) {
        if k.cols != cache.kv_dim || v.cols != cache.kv_dim || layer >= cache.k.len() {
            self.fail(format!(
                "rope_store_kv: bad geometry (layer {layer}, {} / {} columns, kv_dim {})",
                k.cols, v.cols, cache.kv_dim
            ));
            return;
        }
        let Some(rope_args) = self.rope_args(head_dim, rope) else {
            return;
        };
        let heads = q.cols / head_dim + k.cols / head_dim;
        let threads = (head_dim / 2).next_multiple_of(32).clamp(32, 256) as u32;
        // The merged product of these q, k and v, if it waits unsplit: the kernel splits it
        // on the way (the product and the three biases), else it reads q, k and v.
        let source = match self.take_split_of(q, k, v, n) {
            Some(p) => [p.args[0], p.args[4], p.args[5], p.args[6]],
            None => [Arg::P(0); 4],
        };
        let args = [
            &source[..],
            &[
                Arg::P(q.ptr),
                Arg::P(k.ptr),
                Arg::P(v.ptr),
                Arg::P(cache.k_ptr[layer]),
                Arg::P(cache.v_ptr[layer]),
            ],
            &step.slot_args(),
            &[
                Arg::I(cache.block_size as i32),
                Arg::I((q.cols / head_dim) as i32),
                Arg::I((k.cols / head_dim) as i32),
            ],
            &rope_args,
        ]
        .concat();
        // One block per (token, query or key head); a thread per rotated pair.
        self.launch("rope_store_kv", (n as u32, heads as u32, 1), threads, &args);
    }
}

impl CudaCache {
    pub fn n_blocks(&self) -> usize {
        self.n_blocks
    }
}

impl CudaWeight {
    /// Bytes this weight holds on the device.
    /// Row length of a matrix.
    fn cols(&self) -> Option<usize> {
        match self {
            CudaWeight::Matrix { cols, .. } => Some(*cols),
            CudaWeight::Vector { .. } => None,
        }
    }

    /// Whether prompt-sized products can read this matrix as f16 without dequantizing it.
    fn has_f16(&self) -> bool {
        matches!(self, CudaWeight::Matrix { f16: Some(_), .. })
            || matches!(
                self,
                CudaWeight::Matrix {
                    ty: GgmlType::F16,
                    ..
                }
            )
    }

    pub fn device_bytes(&self) -> usize {
        match self {
            CudaWeight::Matrix { buf, f16, .. } => {
                buf.len() + f16.as_ref().map_or(0, |c| c.len() * 2)
            }
            CudaWeight::Vector { buf, len, .. } => {
                debug_assert_eq!(buf.len(), *len);
                len * 4
            }
        }
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let Some(p) = &self.profile else {
            return;
        };
        let _ = self.stream.synchronize();
        self.profile_collect();
        let p = p.lock().unwrap_or_else(|e| e.into_inner());
        let mut rows: Vec<_> = p.totals.iter().collect();
        rows.sort_by(|a, b| b.1.0.total_cmp(&a.1.0));
        let all: f64 = rows.iter().map(|r| r.1.0).sum();
        let steps = p.steps.max(1) as f64;
        eprintln!(
            "kernel profile (KESTREL_CUDA_PROFILE=1): {all:.2} ms in kernels over {} steps ({:.3} ms per step; events add a few µs per launch)",
            p.steps,
            all / steps
        );
        eprintln!(
            "{:<20} {:>18} {:>8} {:>10} {:>9} {:>11} {:>6} {:>8}",
            "kernel", "grid", "calls", "total ms", "avg µs", "µs / step", "share", "GB/s"
        );
        for ((func, grid), (ms, calls, bytes)) in rows.into_iter().take(40) {
            // Weight bytes over kernel time: against the ~3.0 TB/s device-copy ceiling.
            let gbs = if *bytes > 0 {
                format!("{:.0}", *bytes as f64 / (ms * 1e6))
            } else {
                "-".into()
            };
            eprintln!(
                "{:<20} {:>18} {:>8} {:>10.3} {:>9.2} {:>11.2} {:>5.1}% {:>8}",
                compile::KERNELS[*func],
                format!("{}x{}x{}", grid.0, grid.1, grid.2),
                calls,
                ms,
                ms * 1e3 / *calls as f64,
                ms * 1e3 / steps,
                100.0 * ms / all.max(1e-12),
                gbs
            );
        }
    }
}

#[cfg(test)]
mod layout_tests {
    use super::{pad_blocks, split_planes};

    /// Two rows of three 22-byte blocks (Q5_0's shape), every byte distinct: each part of
    /// every block must land in its plane, in block order, with the row's padding zero.
    #[test]
    fn split_planes_keeps_every_part_of_every_block() {
        let data: Vec<u8> = (0..2 * 3 * 22).map(|i| i as u8).collect();
        let out = split_planes(&data, 66, 80, 22, &[(6, 16), (2, 4), (0, 2)]);
        assert_eq!(out.len(), 160);
        for row in 0..2 {
            let o = &out[row * 80..(row + 1) * 80];
            for b in 0..3 {
                let blk = &data[row * 66 + b * 22..row * 66 + (b + 1) * 22];
                assert_eq!(&o[16 * b..16 * b + 16], &blk[6..22]);
                assert_eq!(&o[48 + 4 * b..48 + 4 * b + 4], &blk[2..6]);
                assert_eq!(&o[60 + 2 * b..60 + 2 * b + 2], &blk[..2]);
            }
            assert!(o[66..].iter().all(|&x| x == 0));
        }
    }

    #[test]
    fn pad_blocks_appends_zeros_to_each_block() {
        let data: Vec<u8> = (1..=2 * 210).map(|i| (i % 251) as u8 + 1).collect();
        let out = pad_blocks(&data, 210, 224);
        assert_eq!(out.len(), 448);
        for b in 0..2 {
            assert_eq!(&out[224 * b..224 * b + 210], &data[210 * b..210 * (b + 1)]);
            assert!(out[224 * b + 210..224 * (b + 1)].iter().all(|&x| x == 0));
        }
    }
}
