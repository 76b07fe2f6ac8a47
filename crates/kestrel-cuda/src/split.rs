//! Layer split (pipeline stages in one process): [`SplitBackend`] implements the `Backend`
//! trait over several [`CudaBackend`]s, each holding a contiguous range of the model's
//! layers (sized by its device's free memory: [`kestrel_model::shard::layer_ranges_by_memory`])
//! and the KV cache of those layers only; the first stage also holds the embedding table,
//! the last the output norm and LM head. The one forward definition runs unchanged on one
//! host thread: an operation runs on the stage that holds its weight (or its layer's
//! cache), and an activation it reads that another stage wrote is first copied there.
//!
//! Every activation tensor exists on every stage and remembers which stage wrote it last
//! (and how many rows). The copy to stage `s` is a launch record of the stage that holds
//! the values (a peer-to-peer copy over NVLink where the GPUs differ, a device copy where
//! two stages share a GPU), so it is captured into that stage's step graph like its
//! kernels; that stage's step is then issued and stage `s`'s stream waits for it on an
//! event. Each stage's `prepare_step` waits for the stage's previous step (the single-GPU
//! backend's check), so a copy never overwrites values a later stage still reads.
//! Stages may share a GPU (`--devices cuda:0,cuda:0`): that is how the split is checked on
//! one GPU.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{Context, bail};
use kestrel_gguf::{GgufFile, TensorInfo};
use kestrel_model::shard::layer_ranges_by_memory;
use kestrel_model::{
    Activation, AttnParams, Backend, Batch, DeltaNetConfig, DeltaNetWeights, KvType, KvTypes,
    LayerWeights, ModelConfig, MoeConfig, RopeParams, SamplingBatch,
};

use crate::launch::{Arg, SPECIAL_PEER_COPY};
use crate::weights::{WeightSource, load_weight_from, tensor_rows};
use crate::{CudaBackend, CudaCache, CudaStep, CudaTensor, CudaWeight, Prepared, QkvWeights, sys};

/// Memory each stage keeps free of weights (kernels, step buffers, the smallest cache).
const STAGE_RESERVE: u64 = 2 << 30;

/// The most stages of one split.
pub const MAX_STAGES: usize = 8;

/// The kernels this module launches.
pub(crate) const KERNELS: &[&str] = &["copy_peer"];

impl CudaBackend {
    /// Copies `len` values from `src` (this device) to `dst` (this device or a peer's), as a
    /// step's launch: a kernel writing over peer access where the devices have it, else a
    /// memory copy (then the split's steps run without graphs: see `SplitBackend::new`).
    fn push_values(&self, dst: u64, src: u64, len: usize, peer_access: bool) {
        if len == 0 {
            return;
        }
        if peer_access {
            let blocks = len.div_ceil(4 * 256).clamp(1, 1024);
            self.launch(
                "copy_peer",
                (blocks as u32, 1, 1),
                256,
                &[Arg::P(src), Arg::P(dst), Arg::L(len as i64)],
            );
        } else {
            self.enqueue(
                SPECIAL_PEER_COPY,
                (1, 1, 1),
                1,
                &[Arg::P(dst), Arg::P(src), Arg::L(4 * len as i64)],
                0,
            );
        }
    }

    /// Makes this stream wait for the work queued so far on `other`'s stream.
    fn wait_for(&self, other: &CudaBackend) -> anyhow::Result<()> {
        let e = other
            .stream
            .record_event(None)
            .map_err(|e| anyhow::anyhow!("recording an event: {e:?}"))?;
        self.stream
            .wait(&e)
            .map_err(|e| anyhow::anyhow!("waiting for another device: {e:?}"))
    }

    /// Lets this device's kernels and copies reach `other`'s memory directly (NVLink or
    /// PCIe peer access) where the hardware allows (then true; copies between devices
    /// without it go through the host).
    pub(crate) fn enable_peer_access(&self, other: &CudaBackend) -> anyhow::Result<bool> {
        if self.ctx.cu_device() == other.ctx.cu_device() {
            return Ok(true);
        }
        let mut can = 0;
        // SAFETY: plain queries and a context flag, with live contexts.
        unsafe {
            let r =
                sys::cuDeviceCanAccessPeer(&mut can, self.ctx.cu_device(), other.ctx.cu_device());
            if r != sys::CUresult::CUDA_SUCCESS || can == 0 {
                return Ok(false);
            }
            self.bind()?;
            let r = sys::cuCtxEnablePeerAccess(other.ctx.cu_ctx(), 0);
            if r != sys::CUresult::CUDA_SUCCESS
                && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
            {
                bail!("enabling peer access: {r:?}");
            }
            // Memory from the stream-ordered allocator (cudarc's allocations, where the
            // driver has one) lives in the device's memory pool, which the context flag
            // above does not open: the pool grants the access itself.
            if other.ctx.has_async_alloc() {
                let mut pool = std::ptr::null_mut();
                let r = sys::cuDeviceGetMemPool(&mut pool, other.ctx.cu_device());
                if r != sys::CUresult::CUDA_SUCCESS {
                    bail!("finding another GPU's memory pool: {r:?}");
                }
                let access = sys::CUmemAccessDesc {
                    location: sys::CUmemLocation {
                        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                        id: self.ctx.cu_device(),
                    },
                    flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                };
                let r = sys::cuMemPoolSetAccess(pool, &access, 1);
                if r != sys::CUresult::CUDA_SUCCESS {
                    bail!("opening another GPU's memory pool: {r:?}");
                }
            }
        }
        Ok(true)
    }
}

/// A weight on the stage that holds it.
pub struct SplitWeight {
    stage: usize,
    w: CudaWeight,
    /// The embedding table's copy on the last stage when it doubles as the LM head.
    head: Option<CudaWeight>,
}

/// An activation: a buffer on every stage, the stage whose buffer holds its values, and
/// how many rows were written.
pub struct SplitTensor {
    t: Vec<CudaTensor>,
    at: AtomicUsize,
    rows: AtomicUsize,
}

impl SplitTensor {
    fn wrote(&self, stage: usize, rows: usize) {
        self.at.store(stage, Ordering::Relaxed);
        self.rows.store(rows, Ordering::Relaxed);
    }

    fn stage(&self) -> usize {
        self.at.load(Ordering::Relaxed)
    }
}

/// What an operation prepared, and on which stage (a consumer on another stage ignores it).
#[derive(Clone, Copy, Debug, Default)]
pub struct SplitPrepared {
    stage: usize,
    p: Prepared,
}

/// Each stage's KV cache (its layers only).
pub struct SplitCache(Vec<CudaCache>);
/// Each stage's step inputs.
pub struct SplitStep(Vec<CudaStep>);

/// Several GPUs (or several stages on one) as one backend, by layer split (see the
/// module's doc).
pub struct SplitBackend {
    stages: Vec<CudaBackend>,
    ordinals: Vec<usize>,
    /// Whether every stage reaches every other's memory (the same GPU, or peer access).
    peer_access: bool,
    /// Each stage's layers, fixed by the first weight loaded.
    ranges: Mutex<Option<Arc<Vec<std::ops::Range<usize>>>>>,
    /// The model's layers (from `check_model`).
    n_layer: AtomicUsize,
    /// The current step's tokens and logit rows.
    n_tokens: AtomicUsize,
    n_logit_rows: AtomicUsize,
    /// The stage whose chained steps' ids the host reads (the last: it holds the logits).
    chain_stage: AtomicUsize,
}

impl SplitBackend {
    /// Opens the GPUs `ordinals` (stage i on `ordinals[i]`; a GPU may hold several stages).
    pub fn new(ordinals: &[usize]) -> anyhow::Result<SplitBackend> {
        if ordinals.len() < 2 || ordinals.len() > MAX_STAGES {
            bail!(
                "a layer split takes 2 to {MAX_STAGES} devices, not {}",
                ordinals.len()
            );
        }
        let stages = ordinals
            .iter()
            .map(|&o| CudaBackend::new(o).with_context(|| format!("opening cuda:{o}")))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let mut peer_access = true;
        for (i, a) in stages.iter().enumerate() {
            for b in &stages[i + 1..] {
                peer_access &= a.enable_peer_access(b)?;
                peer_access &= b.enable_peer_access(a)?;
            }
        }
        if !peer_access {
            // Copies between devices without peer access are memory copies through the
            // host, which a step graph cannot capture: launch every step's work directly.
            for b in &stages {
                b.set_graphs(false);
            }
        }
        Ok(SplitBackend {
            stages,
            ordinals: ordinals.to_vec(),
            peer_access,
            ranges: Mutex::new(None),
            n_layer: AtomicUsize::new(0),
            n_tokens: AtomicUsize::new(0),
            n_logit_rows: AtomicUsize::new(0),
            chain_stage: AtomicUsize::new(0),
        })
    }

    /// The number of stages.
    pub fn stages(&self) -> usize {
        self.stages.len()
    }

    /// Stage `s`'s backend.
    pub fn stage(&self, s: usize) -> &CudaBackend {
        &self.stages[s]
    }

    /// Each stage's layers (after the model's first weight loaded).
    pub fn layer_ranges(&self) -> Option<Vec<std::ops::Range<usize>>> {
        self.lock_ranges().as_deref().cloned()
    }

    fn lock_ranges(&self) -> std::sync::MutexGuard<'_, Option<Arc<Vec<std::ops::Range<usize>>>>> {
        self.ranges.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn last(&self) -> usize {
        self.stages.len() - 1
    }

    /// The stage running `layer`, and the layer's index in that stage's cache.
    fn stage_of_layer(&self, layer: usize) -> (usize, usize) {
        let ranges = self.lock_ranges().clone();
        let Some(ranges) = ranges else {
            return (0, layer);
        };
        ranges
            .iter()
            .position(|r| r.contains(&layer))
            .map_or((self.last(), layer), |s| (s, layer - ranges[s].start))
    }

    /// Stage `s`'s copy of the configuration: its layers only.
    fn stage_config(&self, cfg: &ModelConfig, s: usize) -> anyhow::Result<ModelConfig> {
        let ranges = self
            .lock_ranges()
            .clone()
            .context("the layer split is planned when the model's weights load")?;
        let mut c = cfg.clone();
        c.n_layer = ranges[s].len();
        // A hybrid's layer kinds renumbered as the stage's (its recurrent states' slots).
        c.layer_kinds = cfg
            .layer_kinds
            .get(ranges[s].clone())
            .map(<[_]>::to_vec)
            .unwrap_or_default();
        Ok(c)
    }

    /// Plans each stage's layers from the file's tensor sizes and the devices' free memory.
    fn plan(&self, file: &GgufFile) -> anyhow::Result<Arc<Vec<std::ops::Range<usize>>>> {
        if let Some(r) = self.lock_ranges().clone() {
            return Ok(r);
        }
        // Every layer of the configuration, also one without tensors of its own.
        let mut layer_bytes: Vec<u64> = vec![0; self.n_layer.load(Ordering::Relaxed)];
        let (mut first, mut last) = (0u64, 0u64);
        let tied = file.tensor("output.weight").is_none();
        for t in file.tensors() {
            let bytes = t.n_bytes();
            match layer_of(&t.name) {
                Some(i) => {
                    if layer_bytes.len() <= i {
                        layer_bytes.resize(i + 1, 0);
                    }
                    layer_bytes[i] += bytes;
                }
                None if t.name == "token_embd.weight" => {
                    first += bytes;
                    if tied {
                        last += bytes;
                    }
                }
                None => last += bytes,
            }
        }
        // Each device's free memory less a reserve, shared evenly by its stages.
        let mut capacity = Vec::with_capacity(self.stages.len());
        for (s, b) in self.stages.iter().enumerate() {
            let (free, _) = b
                .device_memory()
                .with_context(|| format!("reading cuda:{}'s free memory", self.ordinals[s]))?;
            let sharing = self
                .ordinals
                .iter()
                .filter(|&&o| o == self.ordinals[s])
                .count();
            capacity.push((free as u64).saturating_sub(STAGE_RESERVE) / sharing as u64);
        }
        let ranges = Arc::new(layer_ranges_by_memory(
            &layer_bytes,
            first,
            last,
            &capacity,
        )?);
        *self.lock_ranges() = Some(ranges.clone());
        Ok(ranges)
    }

    /// The stage that holds tensor `name` (a layer's: the stage of that layer; the
    /// embedding table: the first; the rest: the last), the split planned and every
    /// stage told the bytes to come on the first call.
    fn stage_of_tensor(&self, file: &Arc<GgufFile>, name: &str) -> anyhow::Result<usize> {
        let ranges = self.plan(file)?;
        for (s, b) in self.stages.iter().enumerate() {
            // Stages sharing a GPU load one after the other: the first leaves room for all.
            b.expect_weights(file, || {
                (0..self.stages.len())
                    .filter(|&t| t >= s && self.ordinals[t] == self.ordinals[s])
                    .map(|t| stage_weight_bytes(file, &ranges, t, self.last()))
                    .sum()
            });
        }
        Ok(match layer_of(name) {
            Some(i) => ranges
                .iter()
                .position(|r| r.contains(&i))
                .with_context(|| format!("{name}: layer {i} is past the model's layers"))?,
            None if name == "token_embd.weight" => 0,
            None => self.last(),
        })
    }

    /// Issues every stage's recorded launches, in stage order.
    fn issue_all(&self) {
        for b in &self.stages {
            b.issue();
        }
    }

    /// Makes `x`'s values available on stage `s`: when another stage wrote them, that
    /// stage copies its rows into stage `s`'s buffer, issues its step, and stage `s` waits
    /// for it.
    fn bring(&self, x: &SplitTensor, s: usize) {
        let from = x.stage();
        if from == s {
            return;
        }
        let (src, dst) = (&x.t[from], &x.t[s]);
        let rows = x.rows.load(Ordering::Relaxed).min(src.rows);
        let len = rows * src.cols;
        let b = &self.stages[from];
        if len > dst.buf.len() || len > src.buf.len() {
            return b.fail("a copy between stages larger than its buffer".into());
        }
        b.push_values(dst.ptr, src.ptr, len, self.peer_access);
        b.issue();
        if let Err(e) = self.stages[s].wait_for(b) {
            self.stages[s].fail(format!("{e:#}"));
        }
        x.wrote(s, rows);
    }

    /// The stage `w` lives on, with `x` brought there.
    fn at_weight(&self, x: &SplitTensor, w: &SplitWeight) -> usize {
        self.bring(x, w.stage);
        w.stage
    }
}

/// The layer index of a `blk.N.` tensor name.
/// Bytes of `file`'s weights stage `stage` holds (of `last + 1`, layers `ranges`).
fn stage_weight_bytes(
    file: &GgufFile,
    ranges: &[std::ops::Range<usize>],
    stage: usize,
    last: usize,
) -> u64 {
    let tied = file.tensor("output.weight").is_none();
    file.tensors()
        .iter()
        .filter(|t| match layer_of(&t.name) {
            Some(i) => ranges.get(stage).is_some_and(|r| r.contains(&i)),
            None if t.name == "token_embd.weight" => stage == 0 || (tied && stage == last),
            None => stage == last,
        })
        .map(|t| t.n_bytes())
        .sum()
}

fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

fn ready_on(p: SplitPrepared, s: usize) -> Prepared {
    if p.stage == s { p.p } else { Prepared::Nothing }
}

fn prep(stage: usize, p: Prepared) -> SplitPrepared {
    SplitPrepared { stage, p }
}

/// The layer's Q/K/V weights on their stage, as that stage's kernels take them.
fn qkv_of(layer: &LayerWeights<SplitWeight>) -> Option<(usize, QkvWeights<'_>)> {
    let (q, _, _) = layer.qkv_weights()?;
    Some((q.stage, QkvWeights::picked(layer, |w| &w.w)?))
}

impl Backend for SplitBackend {
    type Weight = SplitWeight;
    type Tensor = SplitTensor;
    type Cache = SplitCache;
    type Step = SplitStep;
    type Prepared = SplitPrepared;

    fn name(&self) -> String {
        format!(
            "{} × {} (layer split, cuda:{})",
            self.stages.len(),
            self.stages[0].name(),
            self.ordinals
                .iter()
                .map(|o| o.to_string())
                .collect::<Vec<_>>()
                .join(",")
        )
    }

    /// Each stage runs the single-GPU kernels on its layers, so a step is as
    /// batch-invariant as on one GPU.
    fn invariant_max_tokens(&self) -> usize {
        self.stages[0].invariant_max_tokens()
    }

    fn check_model(&self, cfg: &ModelConfig) -> anyhow::Result<()> {
        self.stages[0].check_model(cfg)?;
        if cfg.n_layer < self.stages.len() {
            bail!(
                "{} layers cannot be split over {} devices",
                cfg.n_layer,
                self.stages.len()
            );
        }
        self.n_layer.store(cfg.n_layer, Ordering::Relaxed);
        Ok(())
    }

    fn cache_types(&self) -> &'static [KvType] {
        self.stages[0].cache_types()
    }

    fn load_weight(&self, file: &Arc<GgufFile>, info: &TensorInfo) -> anyhow::Result<SplitWeight> {
        let stage = self.stage_of_tensor(file, &info.name)?;
        let name = info.name.as_str();
        let tied = file.tensor("output.weight").is_none();
        let load = |s: usize, gathered_only: bool| {
            let b = &self.stages[s];
            b.bind()?;
            load_weight_from(
                b,
                &WeightSource {
                    name,
                    ty: info.ty,
                    dims: &info.dims,
                    data: file.tensor_data(info),
                    gathered_only,
                    shape_of: &|other| {
                        file.tensor(other)
                            .filter(|t| t.dims.len() == 2)
                            .map(|t| (t.dims[0] as usize, tensor_rows(t)))
                    },
                },
            )
            .with_context(|| format!("{name} on cuda:{} (stage {s})", self.ordinals[s]))
        };
        if name == "token_embd.weight" {
            // Only gathered from on the first stage when the last holds the LM head.
            let head_elsewhere = !tied || self.last() != 0;
            let w = load(0, head_elsewhere)?;
            let head = if tied {
                Some(load(self.last(), false)?)
            } else {
                None
            };
            return Ok(SplitWeight { stage: 0, w, head });
        }
        Ok(SplitWeight {
            stage,
            w: load(stage, false)?,
            head: None,
        })
    }

    fn new_tensor(&self, rows: usize, cols: usize) -> anyhow::Result<SplitTensor> {
        let t = self
            .stages
            .iter()
            .map(|b| b.new_tensor(rows, cols))
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(SplitTensor {
            t,
            at: AtomicUsize::new(0),
            rows: AtomicUsize::new(0),
        })
    }

    fn new_cache(
        &self,
        config: &ModelConfig,
        n_blocks: usize,
        block_size: usize,
    ) -> anyhow::Result<SplitCache> {
        self.new_cache_typed(config, n_blocks, block_size, KvTypes::default())
    }

    fn new_cache_typed(
        &self,
        config: &ModelConfig,
        n_blocks: usize,
        block_size: usize,
        kv: KvTypes,
    ) -> anyhow::Result<SplitCache> {
        let mut caches = Vec::with_capacity(self.stages.len());
        for (s, b) in self.stages.iter().enumerate() {
            let c = self.stage_config(config, s)?;
            caches.push(
                b.new_cache_typed(&c, n_blocks, block_size, kv)
                    .with_context(|| format!("the KV cache of stage {s}"))?,
            );
        }
        Ok(SplitCache(caches))
    }

    /// The memory a cache of every layer may take: each device holds its stages' share of
    /// the layers, so the whole cache fits where the tightest device's free memory, scaled
    /// by all layers over its layers, allows.
    fn device_memory(&self) -> Option<(usize, usize)> {
        let ranges = self.lock_ranges().clone()?;
        let n_layer: usize = ranges.iter().map(|r| r.len()).sum();
        let mut out: Option<(usize, usize)> = None;
        for (s, b) in self.stages.iter().enumerate() {
            let o = self.ordinals[s];
            if self.ordinals[..s].contains(&o) {
                continue;
            }
            let layers: usize = (0..self.stages.len())
                .filter(|&t| self.ordinals[t] == o)
                .map(|t| ranges[t].len())
                .sum();
            let (free, total) = b.device_memory()?;
            let scale = |m: usize| (m as u128 * n_layer as u128 / layers.max(1) as u128) as usize;
            let (f, t) = (scale(free), scale(total));
            out = Some(out.map_or((f, t), |(a, b)| (a.min(f), b.min(t))));
        }
        out
    }

    fn new_step(&self, config: &ModelConfig, max_tokens: usize) -> anyhow::Result<SplitStep> {
        let mut steps = Vec::with_capacity(self.stages.len());
        for (s, b) in self.stages.iter().enumerate() {
            steps.push(b.new_step(&self.stage_config(config, s)?, max_tokens)?);
        }
        Ok(SplitStep(steps))
    }

    fn prepare_step(&self, batch: &Batch, step: &mut SplitStep) -> anyhow::Result<()> {
        self.issue_all();
        for (s, (b, st)) in self.stages.iter().zip(step.0.iter_mut()).enumerate() {
            b.prepare_step(batch, st)
                .with_context(|| format!("cuda:{} (stage {s})", self.ordinals[s]))?;
        }
        self.n_tokens.store(batch.len(), Ordering::Relaxed);
        self.n_logit_rows
            .store(batch.logit_rows.len(), Ordering::Relaxed);
        Ok(())
    }

    fn embed(&self, table: &SplitWeight, step: &SplitStep, out: &mut SplitTensor) {
        let s = table.stage;
        self.stages[s].embed(&table.w, &step.0[s], &mut out.t[s]);
        out.wrote(s, self.n_tokens.load(Ordering::Relaxed));
    }

    fn scale(&self, x: &mut SplitTensor, n: usize, factor: f32) {
        let s = x.stage();
        self.stages[s].scale(&mut x.t[s], n, factor);
    }

    fn rms_norm(
        &self,
        x: &SplitTensor,
        weight: &SplitWeight,
        eps: f32,
        n: usize,
        out: &mut SplitTensor,
    ) -> SplitPrepared {
        let s = self.at_weight(x, weight);
        let p = self.stages[s].rms_norm(&x.t[s], &weight.w, eps, n, &mut out.t[s]);
        out.wrote(s, n);
        prep(s, p)
    }

    fn rms_norm_heads(
        &self,
        x: &mut SplitTensor,
        weight: &SplitWeight,
        head_dim: usize,
        eps: f32,
        n: usize,
    ) {
        let s = self.at_weight(x, weight);
        self.stages[s].rms_norm_heads(&mut x.t[s], &weight.w, head_dim, eps, n);
    }

    fn matmul(&self, x: &SplitTensor, w: &SplitWeight, n: usize, out: &mut SplitTensor) {
        self.matmul_ready(x, SplitPrepared::default(), w, n, out)
    }

    fn matmul_ready(
        &self,
        x: &SplitTensor,
        x_ready: SplitPrepared,
        w: &SplitWeight,
        n: usize,
        out: &mut SplitTensor,
    ) {
        // The tied LM head runs on the last stage, from its copy of the table.
        let (s, weight) = match &w.head {
            Some(h) => (self.last(), h),
            None => (w.stage, &w.w),
        };
        self.bring(x, s);
        let p = ready_on(x_ready, s);
        self.stages[s].matmul_ready(&x.t[s], p, weight, n, &mut out.t[s]);
        out.wrote(s, n);
    }

    fn add_bias(&self, x: &mut SplitTensor, bias: &SplitWeight, n: usize) {
        let s = self.at_weight(x, bias);
        self.stages[s].add_bias(&mut x.t[s], &bias.w, n);
    }

    fn rope(
        &self,
        x: &mut SplitTensor,
        head_dim: usize,
        rope: &RopeParams,
        step: &SplitStep,
        n: usize,
    ) {
        let s = x.stage();
        self.stages[s].rope(&mut x.t[s], head_dim, rope, &step.0[s], n);
    }

    fn store_kv(
        &self,
        cache: &mut SplitCache,
        layer: usize,
        k: &SplitTensor,
        v: &SplitTensor,
        step: &SplitStep,
        n: usize,
    ) {
        let (s, local) = self.stage_of_layer(layer);
        self.bring(k, s);
        self.bring(v, s);
        self.stages[s].store_kv(&mut cache.0[s], local, &k.t[s], &v.t[s], &step.0[s], n);
    }

    fn attention(
        &self,
        q: &SplitTensor,
        cache: &SplitCache,
        params: &AttnParams,
        step: &SplitStep,
        n: usize,
        out: &mut SplitTensor,
    ) -> SplitPrepared {
        let (s, local) = self.stage_of_layer(params.layer);
        self.bring(q, s);
        let p = AttnParams {
            layer: local,
            ..*params
        };
        let r = self.stages[s].attention(&q.t[s], &cache.0[s], &p, &step.0[s], n, &mut out.t[s]);
        out.wrote(s, n);
        prep(s, r)
    }

    fn scale_by_position(
        &self,
        x: &mut SplitTensor,
        temp: &kestrel_model::AttnTemperature,
        step: &SplitStep,
        n: usize,
    ) -> anyhow::Result<()> {
        let s = x.stage();
        self.stages[s].scale_by_position(&mut x.t[s], temp, &step.0[s], n)
    }

    fn gated_activation(
        &self,
        gate: &mut SplitTensor,
        up: &SplitTensor,
        act: Activation,
        n: usize,
    ) -> SplitPrepared {
        let s = gate.stage();
        self.bring(up, s);
        let r = self.stages[s].gated_activation(&mut gate.t[s], &up.t[s], act, n);
        prep(s, r)
    }

    fn add(&self, x: &mut SplitTensor, y: &SplitTensor, n: usize) {
        let s = y.stage();
        self.bring(x, s);
        self.stages[s].add(&mut x.t[s], &y.t[s], n);
    }

    fn gather_logit_rows(&self, x: &SplitTensor, step: &SplitStep, out: &mut SplitTensor) {
        let s = x.stage();
        self.stages[s].gather_logit_rows(&x.t[s], &step.0[s], &mut out.t[s]);
        out.wrote(s, self.n_logit_rows.load(Ordering::Relaxed));
    }

    fn read_rows(&self, x: &SplitTensor, n: usize, out: &mut Vec<f32>) -> anyhow::Result<()> {
        self.issue_all();
        let s = x.stage();
        self.stages[s].read_rows(&x.t[s], n, out)
    }

    fn with_rows(
        &self,
        x: &SplitTensor,
        n: usize,
        scratch: &mut Vec<f32>,
        f: &mut dyn FnMut(&[f32]),
    ) -> anyhow::Result<()> {
        self.issue_all();
        let s = x.stage();
        self.stages[s].with_rows(&x.t[s], n, scratch, f)
    }

    fn argmax_rows(
        &self,
        x: &SplitTensor,
        n: usize,
        scratch: &mut Vec<f32>,
        out: &mut Vec<u32>,
    ) -> anyhow::Result<()> {
        self.issue_all();
        let s = x.stage();
        self.stages[s].argmax_rows(&x.t[s], n, scratch, out)
    }

    fn can_chain(&self) -> bool {
        true
    }

    /// The last stage chooses the ids into its own token slots and copies them into every
    /// other stage's (the embedding's stage reads them; each stage's next step checks them).
    fn chain_ids(
        &self,
        x: &SplitTensor,
        n: usize,
        sampling: Option<&SamplingBatch>,
    ) -> anyhow::Result<()> {
        self.issue_all();
        let last = x.stage();
        let b = &self.stages[last];
        b.chain_ids(&x.t[last], n, sampling)?;
        for (s, other) in self.stages.iter().enumerate() {
            if s != last {
                b.push_values(other.chain_tokens(), b.chain_tokens(), n, self.peer_access);
                b.issue();
                other.wait_for(b)?;
                other.chain_ready(n);
            }
        }
        self.chain_stage.store(last, Ordering::Relaxed);
        Ok(())
    }

    fn read_chained(&self, out: &mut Vec<u32>) -> anyhow::Result<()> {
        self.stages[self.chain_stage.load(Ordering::Relaxed)].read_chained(out)
    }

    fn sample_rows(
        &self,
        x: &SplitTensor,
        n: usize,
        sampling: &SamplingBatch,
        scratch: &mut Vec<f32>,
        out: &mut Vec<u32>,
    ) -> anyhow::Result<()> {
        self.issue_all();
        let s = x.stage();
        self.stages[s].sample_rows(&x.t[s], n, sampling, scratch, out)
    }

    fn attention_sinks(
        &self,
        q: &SplitTensor,
        cache: &SplitCache,
        params: &AttnParams,
        sinks: &SplitWeight,
        step: &SplitStep,
        n: usize,
        out: &mut SplitTensor,
    ) -> anyhow::Result<()> {
        let (s, local) = self.stage_of_layer(params.layer);
        self.bring(q, s);
        let p = AttnParams {
            layer: local,
            ..*params
        };
        let b = &self.stages[s];
        b.attention_sinks(
            &q.t[s],
            &cache.0[s],
            &p,
            &sinks.w,
            &step.0[s],
            n,
            &mut out.t[s],
        )?;
        out.wrote(s, n);
        Ok(())
    }

    fn load_experts(&self, file: &Arc<GgufFile>, info: &TensorInfo) -> anyhow::Result<SplitWeight> {
        let stage = self.stage_of_tensor(file, &info.name)?;
        let b = &self.stages[stage];
        b.bind()?;
        let w = crate::moe::load_experts(b, file, info).with_context(|| {
            format!(
                "{} on cuda:{} (stage {stage})",
                info.name, self.ordinals[stage]
            )
        })?;
        Ok(SplitWeight {
            stage,
            w,
            head: None,
        })
    }

    /// The block on the stage holding the layer's experts, as on one GPU.
    fn moe_ffn(
        &self,
        x: &SplitTensor,
        layer: &LayerWeights<SplitWeight>,
        moe: &MoeConfig,
        act: Activation,
        n: usize,
        out: &mut SplitTensor,
    ) -> anyhow::Result<()> {
        let s = self.at_weight(x, &layer.ffn_gate);
        let experts = crate::moe::Experts::picked(layer, |w: &SplitWeight| &w.w);
        crate::moe::moe_ffn(
            &self.stages[s],
            &x.t[s],
            experts,
            moe,
            act,
            n,
            &mut out.t[s],
        )?;
        out.wrote(s, n);
        Ok(())
    }

    fn add_sigmoid_gated(
        &self,
        out: &mut SplitTensor,
        y: &SplitTensor,
        x: &SplitTensor,
        w: &SplitWeight,
        n: usize,
    ) -> anyhow::Result<()> {
        let s = self.at_weight(x, w);
        self.bring(y, s);
        self.bring(out, s);
        self.stages[s].add_sigmoid_gated(&mut out.t[s], &y.t[s], &x.t[s], &w.w, n)
    }

    fn check_linear_attention(&self) -> anyhow::Result<()> {
        self.stages[0].check_linear_attention()
    }

    /// Each stage keeps the states of its own linear-attention layers.
    fn forget_state(&self, cache: &mut SplitCache, first_block: u32) {
        for (b, c) in self.stages.iter().zip(cache.0.iter_mut()) {
            b.forget_state(c, first_block);
        }
    }

    fn split_gated_query(
        &self,
        qg: &SplitTensor,
        head_dim: usize,
        n: usize,
        q: &mut SplitTensor,
        gate: &mut SplitTensor,
    ) -> anyhow::Result<()> {
        let s = qg.stage();
        self.stages[s].split_gated_query(&qg.t[s], head_dim, n, &mut q.t[s], &mut gate.t[s])?;
        q.wrote(s, n);
        gate.wrote(s, n);
        Ok(())
    }

    fn sigmoid_mul(&self, x: &mut SplitTensor, gate: &SplitTensor, n: usize) -> anyhow::Result<()> {
        let s = x.stage();
        self.bring(gate, s);
        self.stages[s].sigmoid_mul(&mut x.t[s], &gate.t[s], n)
    }

    /// The layer's core on the stage holding it, in that stage's states.
    fn delta_net(
        &self,
        cache: &mut SplitCache,
        layer: usize,
        cfg: &DeltaNetConfig,
        w: &DeltaNetWeights<SplitWeight>,
        mix: &SplitTensor,
        z: &SplitTensor,
        beta: &SplitTensor,
        alpha: &SplitTensor,
        eps: f32,
        step: &SplitStep,
        n: usize,
        out: &mut SplitTensor,
    ) -> anyhow::Result<SplitPrepared> {
        let (s, local) = self.stage_of_layer(layer);
        for t in [mix, z, beta, alpha] {
            self.bring(t, s);
        }
        let core = crate::delta::DeltaCore::picked(w, |x: &SplitWeight| &x.w);
        let p = crate::delta::delta_net(
            &self.stages[s],
            &mut cache.0[s],
            local,
            cfg,
            core,
            &mix.t[s],
            &z.t[s],
            &beta.t[s],
            &alpha.t[s],
            eps,
            &step.0[s],
            n,
            &mut out.t[s],
        )?;
        out.wrote(s, n);
        Ok(prep(s, p))
    }

    fn qkv(
        &self,
        x: &SplitTensor,
        x_ready: SplitPrepared,
        layer: &LayerWeights<SplitWeight>,
        n: usize,
        q: &mut SplitTensor,
        k: &mut SplitTensor,
        v: &mut SplitTensor,
    ) -> SplitPrepared {
        let Some((s, w)) = qkv_of(layer) else {
            self.stages[0].fail("qkv: a layer without Q/K/V projections".into());
            return SplitPrepared::default();
        };
        self.bring(x, s);
        let b = &self.stages[s];
        let r = crate::matmul::qkv(
            b,
            &x.t[s],
            ready_on(x_ready, s),
            &w,
            n,
            &mut q.t[s],
            &mut k.t[s],
            &mut v.t[s],
        );
        for t in [&*q, &*k, &*v] {
            t.wrote(s, n);
        }
        prep(s, r)
    }

    fn gate_up(
        &self,
        x: &SplitTensor,
        x_ready: SplitPrepared,
        layer: &LayerWeights<SplitWeight>,
        act: Activation,
        n: usize,
        gate: &mut SplitTensor,
        up: &mut SplitTensor,
    ) -> SplitPrepared {
        let s = self.at_weight(x, &layer.ffn_gate);
        let r = self.stages[s].gate_up_of(
            &x.t[s],
            ready_on(x_ready, s),
            &layer.ffn_gate.w,
            &layer.ffn_up.w,
            act,
            n,
            &mut gate.t[s],
            &mut up.t[s],
        );
        gate.wrote(s, n);
        up.wrote(s, n);
        prep(s, r)
    }

    fn matmul_add(
        &self,
        x: &SplitTensor,
        x_ready: SplitPrepared,
        w: &SplitWeight,
        n: usize,
        tmp: &mut SplitTensor,
        residual: &mut SplitTensor,
    ) {
        let s = self.at_weight(x, w);
        self.bring(residual, s);
        let p = ready_on(x_ready, s);
        self.stages[s].matmul_add(&x.t[s], p, &w.w, n, &mut tmp.t[s], &mut residual.t[s]);
        tmp.wrote(s, n);
    }

    fn rope_store_kv(
        &self,
        q: &mut SplitTensor,
        k: &mut SplitTensor,
        v: &SplitTensor,
        qkv_ready: SplitPrepared,
        head_dim: usize,
        rope: &RopeParams,
        cache: &mut SplitCache,
        layer: usize,
        step: &SplitStep,
        n: usize,
    ) {
        let (s, local) = self.stage_of_layer(layer);
        for t in [&*q, &*k, v] {
            self.bring(t, s);
        }
        self.stages[s].rope_store_kv(
            &mut q.t[s],
            &mut k.t[s],
            &v.t[s],
            ready_on(qkv_ready, s),
            head_dim,
            rope,
            &mut cache.0[s],
            local,
            &step.0[s],
            n,
        );
    }
}

impl Drop for SplitBackend {
    fn drop(&mut self) {
        self.issue_all();
        for b in &self.stages {
            let _ = b.check();
        }
    }
}
