//! CPU backend: computes straight from the quantized blocks (no dequantized copy of the
//! weights) of the memory-mapped file, or of one copy of it in huge pages (see
//! [`HugeCopy`]), on all cores through the backend's thread pool (`pool.rs`).
//!
//! `Kernels::Scalar` runs the plain single-threaded scalar path: it is the oracle the
//! fast path is tested against.

mod delta;
pub mod gemm;
mod moe;
pub mod numerics;
mod ops;
pub mod packed;
pub mod pool;
pub mod profile;
pub mod qdot;
pub mod qdot8;
pub mod simd;

use std::sync::{Arc, Weak};

use anyhow::{Context, bail};
use kestrel_gguf::{GgmlType, GgufFile, TensorInfo};
use kestrel_model::{Batch, KvType, KvTypes, ModelConfig};

pub use numerics::Numerics;
pub use simd::Isa;

/// Which kernels the backend runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernels {
    /// Plain scalar loops on one thread: the reference implementation.
    Scalar,
    /// SIMD kernels on all cores.
    Fast,
}

pub struct CpuBackend {
    kernels: Kernels,
    isa: Isa,
    numerics: Numerics,
    /// The huge-page copies of the files whose weights this backend loaded (the weights
    /// hold them; an entry whose file or copy is gone is dropped).
    copies: std::sync::Mutex<Vec<(Weak<GgufFile>, Weak<HugeCopy>)>>,
    /// Chained decode steps ([`kestrel_model::Backend::chain_ids`]): the ids not read
    /// yet, oldest first, and the last step's (the next chained step's tokens). A step here
    /// is done when its call returns, so chaining only keeps the engine's loop one path.
    chained: std::sync::Mutex<(std::collections::VecDeque<Vec<u32>>, Vec<u32>)>,
}

/// A file's bytes copied into anonymous memory advised to use transparent huge pages.
/// Decode streams every weight once per token: from the file's 4 KiB pages it ran at
/// 26-28 GB/s, from 2 MiB pages at 29-33 (fewer TLB misses, and the hardware
/// prefetchers do not stop at every 4 KiB boundary). The cost is the copy at load
/// (~0.2 s per GB once the memory is backed; 2-3 s per GB on a VM that returns free
/// memory to its host) and the memory: the file's page cache can be evicted, the copy
/// cannot. On by default where the memory is available; `KESTREL_CPU_HUGEPAGES=0` turns
/// it off, `=1` on.
pub struct HugeCopy {
    map: memmap2::MmapMut,
    start: usize,
    len: usize,
}

impl HugeCopy {
    const HUGE: usize = 2 << 20;

    /// `len` bytes written by `fill` (given the whole buffer, zeroed).
    fn filled(len: usize, fill: impl FnOnce(&mut [u8])) -> std::io::Result<HugeCopy> {
        let mut map = memmap2::MmapMut::map_anon(len + Self::HUGE)?;
        #[cfg(target_os = "linux")]
        map.advise(memmap2::Advice::HugePage)?;
        let start = (Self::HUGE - map.as_ptr() as usize % Self::HUGE) % Self::HUGE;
        fill(&mut map[start..start + len]);
        Ok(HugeCopy { map, start, len })
    }

    fn of(bytes: &[u8]) -> std::io::Result<HugeCopy> {
        const HUGE: usize = HugeCopy::HUGE;
        Self::filled(bytes.len(), |out| {
            // Faulting the pages in is most of the time: on all the pool's threads.
            let dst = pool::SharedMut(out.as_mut_ptr());
            pool::pool().run(bytes.len().div_ceil(HUGE), &|c| {
                let src = &bytes[c * HUGE..((c + 1) * HUGE).min(bytes.len())];
                // SAFETY: chunk c of the destination (which holds `bytes.len()` bytes) is
                // written by this task alone.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.at(c * HUGE), src.len()) };
            });
        })
    }

    fn bytes(&self) -> &[u8] {
        &self.map[self.start..self.start + self.len]
    }
}

/// Whether to copy a file of `len` bytes into huge pages (see [`HugeCopy`]).
fn hugepages(len: usize) -> bool {
    match std::env::var("KESTREL_CPU_HUGEPAGES").as_deref() {
        Ok("0") => false,
        Ok("1") => cfg!(target_os = "linux"),
        // Where at least twice the file is available (Linux only).
        _ => cfg!(target_os = "linux") && mem_available().is_some_and(|b| b >= 2 * len as u64),
    }
}

/// Bytes of memory available to new allocations (Linux's MemAvailable), if known.
pub fn mem_available() -> Option<u64> {
    let m = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = m.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib = line.split_whitespace().nth(1)?.parse::<u64>().ok()?;
    Some(kib * 1024)
}

impl CpuBackend {
    /// A backend with the default numerics (or `KESTREL_CPU_NUMERICS`'s).
    pub fn new(kernels: Kernels) -> CpuBackend {
        CpuBackend::with_numerics(kernels, Numerics::from_env())
    }

    pub fn with_numerics(kernels: Kernels, numerics: Numerics) -> CpuBackend {
        let isa = match kernels {
            Kernels::Scalar => Isa::Scalar,
            Kernels::Fast => Isa::detect(),
        };
        CpuBackend {
            kernels,
            isa,
            numerics,
            copies: std::sync::Mutex::new(Vec::new()),
            chained: Default::default(),
        }
    }

    pub fn numerics(&self) -> Numerics {
        self.numerics
    }

    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// A weight as [`kestrel_model::Backend::load_weight`] prepares it, its rows repacked
    /// for the integer kernels only where `repack` allows.
    fn load(
        &self,
        file: &Arc<GgufFile>,
        info: &TensorInfo,
        repack: bool,
    ) -> anyhow::Result<CpuWeight> {
        let cols = info.dims.first().copied().unwrap_or(1) as usize;
        let rows = info.dims.iter().skip(1).product::<u64>() as usize;
        if info.dims.len() <= 1 {
            let mut v = vec![0f32; cols];
            kestrel_quant::dequantize_row(info.ty, file.tensor_data(info), &mut v)
                .with_context(|| format!("tensor {}", info.name))?;
            return Ok(CpuWeight::Vector(v));
        }
        if info.ty.bytes_for(cols as u64).is_none() {
            bail!(
                "tensor {}: rows of {cols} values are not whole {} blocks",
                info.name,
                info.ty
            );
        }
        // Repacked where the layout applies and memory allows: a matrix is left in its
        // file layout, and the row-by-row kernels, when less than twice its repacked size
        // is available.
        let len = packed::packed_len(info.ty, rows, cols);
        let packed = if repack
            && self.kernels == Kernels::Fast
            && self.numerics == Numerics::Ggml
            && packed::applies(info.ty, rows, cols)
            && mem_available().is_none_or(|b| b >= 2 * len as u64)
        {
            let data = file.tensor_data(info);
            let packed =
                HugeCopy::filled(len, |out| packed::pack_into(info.ty, data, rows, cols, out))
                    .context("allocating the repacked weights")?;
            Some(Arc::new(packed))
        } else {
            None
        };
        // The file's huge-page copy serves the matrices read in their file layout: made
        // when the first of them loads, never for a model whose matrices are all repacked
        // (the embedding rows are then read from the mapped file).
        let file_layout = packed.is_none() || !rows.is_multiple_of(packed::ROWS);
        let copy = if self.kernels == Kernels::Fast && file_layout {
            let mut copies = self.copies.lock().unwrap_or_else(|e| e.into_inner());
            copies.retain(|(f, c)| f.strong_count() > 0 && c.strong_count() > 0);
            let known = copies
                .iter()
                .find(|(f, _)| std::ptr::eq(f.as_ptr(), Arc::as_ptr(file)))
                .and_then(|(_, c)| c.upgrade());
            match known {
                Some(c) => Some(c),
                None if hugepages(file.as_bytes().len()) => {
                    let c = Arc::new(HugeCopy::of(file.as_bytes()).context("copying the weights")?);
                    copies.push((Arc::downgrade(file), Arc::downgrade(&c)));
                    Some(c)
                }
                None => None,
            }
        } else {
            None
        };
        Ok(CpuWeight::Matrix {
            copy,
            packed,
            file: file.clone(),
            info: info.clone(),
            ty: info.ty,
            rows,
            cols,
        })
    }
}

impl Drop for CpuBackend {
    fn drop(&mut self) {
        if profile::enabled() {
            profile::report();
        }
    }
}

/// Bytes of a matrix weight (0 for a vector).
fn weight_bytes(w: &CpuWeight) -> u64 {
    match w {
        CpuWeight::Matrix { info, .. } => info.n_bytes(),
        CpuWeight::Vector(_) => 0,
    }
}

/// A weight as the CPU reads it.
pub enum CpuWeight {
    /// A matrix left in its file format: `rows` rows of `cols` values, read in place.
    Matrix {
        file: Arc<GgufFile>,
        info: TensorInfo,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        /// The file's bytes copied into huge pages, if they were.
        copy: Option<Arc<HugeCopy>>,
        /// The whole groups of 16 rows repacked for the integer kernels (`packed.rs`),
        /// where that layout applies; the original bytes still serve the other rows and
        /// row lookups (embeddings).
        packed: Option<Arc<HugeCopy>>,
    },
    /// A vector (norm weights, biases) converted to f32.
    Vector(Vec<f32>),
}

impl CpuWeight {
    fn vector(&self) -> &[f32] {
        match self {
            CpuWeight::Vector(v) => v,
            CpuWeight::Matrix { .. } => &[],
        }
    }
}

/// Row-major `[rows × cols]` activations.
pub struct CpuTensor {
    pub data: Vec<f32>,
    pub cols: usize,
}

impl CpuTensor {
    pub fn rows(&self, n: usize) -> &[f32] {
        &self.data[..n * self.cols]
    }
}

/// The paged KV cache: per layer, `n_blocks × block_size` slots, each holding a row of
/// `kv_dim` keys stored as `types.k` and one of values stored as `types.v` (the bytes of
/// f16/bf16 values, or of 32-value Q8_0/Q4_0 blocks along the head dimension, so a head's
/// slice of a row is whole blocks). Attention reads the rows in their storage type.
pub struct CpuCache {
    pub block_size: usize,
    pub n_blocks: usize,
    pub kv_dim: usize,
    pub types: KvTypes,
    /// Keys and values of each layer (empty for linear-attention layers).
    pub k: Vec<Vec<u8>>,
    pub v: Vec<Vec<u8>>,
    /// The linear-attention layers' per-sequence states (`delta.rs`).
    pub recurrent: delta::RecurrentStates,
}

impl CpuCache {
    /// Bytes of one slot's key row and of its value row.
    pub fn row_bytes(&self) -> (usize, usize) {
        (
            self.types.k.bytes(self.kv_dim),
            self.types.v.bytes(self.kv_dim),
        )
    }
}

/// The batch description, kept on the host.
pub struct CpuStep {
    pub batch: Batch,
}

impl kestrel_model::Backend for CpuBackend {
    type Weight = CpuWeight;
    type Tensor = CpuTensor;
    type Cache = CpuCache;
    type Step = CpuStep;
    type Prepared = ();

    fn name(&self) -> String {
        match self.kernels {
            Kernels::Scalar => format!("cpu (scalar reference, {})", self.numerics.name()),
            Kernels::Fast => format!(
                "cpu ({}, {}, {} threads)",
                self.isa.name(),
                self.numerics.name(),
                rayon::current_num_threads()
            ),
        }
    }

    fn load_weight(&self, file: &Arc<GgufFile>, info: &TensorInfo) -> anyhow::Result<CpuWeight> {
        self.load(file, info, true)
    }

    /// Stacked experts are matrices of `n_expert × rows` rows read one expert at a time,
    /// left in the file's layout (the repacked one serves whole-matrix products only).
    fn load_experts(&self, file: &Arc<GgufFile>, info: &TensorInfo) -> anyhow::Result<CpuWeight> {
        self.load(file, info, false)
    }

    fn moe_ffn(
        &self,
        x: &CpuTensor,
        layer: &kestrel_model::LayerWeights<CpuWeight>,
        moe: &kestrel_model::MoeConfig,
        act: kestrel_model::Activation,
        n: usize,
        out: &mut CpuTensor,
    ) -> anyhow::Result<()> {
        profile::timed(
            || profile::op("moe_ffn", n),
            0,
            || moe::moe_ffn(self, x, layer, moe, act, n, out),
        )
    }

    fn new_tensor(&self, rows: usize, cols: usize) -> anyhow::Result<CpuTensor> {
        Ok(CpuTensor {
            data: vec![0.0; rows * cols],
            cols,
        })
    }

    fn new_cache(
        &self,
        config: &ModelConfig,
        n_blocks: usize,
        block_size: usize,
    ) -> anyhow::Result<CpuCache> {
        self.new_cache_typed(config, n_blocks, block_size, KvTypes::default())
    }

    fn cache_types(&self) -> &'static [KvType] {
        &KvType::ALL
    }

    fn new_cache_typed(
        &self,
        config: &ModelConfig,
        n_blocks: usize,
        block_size: usize,
        types: KvTypes,
    ) -> anyhow::Result<CpuCache> {
        types.check(self.cache_types(), config.head_dim, &self.name())?;
        let kv_dim = config.kv_dim();
        // Checked in values: a slot's bytes are never more than 2 per value.
        config
            .kv_cache_len(n_blocks, block_size)
            .and_then(|n| n.checked_mul(2))
            .context("KV cache size overflows")?;
        let slots = n_blocks * block_size;
        // Linear-attention layers keep no keys or values.
        let layer = |il: usize, t: KvType| match config.layer_kinds[il] {
            kestrel_model::LayerKind::Attention => vec![0u8; slots * t.bytes(kv_dim)],
            kestrel_model::LayerKind::DeltaNet => Vec::new(),
        };
        Ok(CpuCache {
            block_size,
            n_blocks,
            kv_dim,
            types,
            k: (0..config.n_layer).map(|il| layer(il, types.k)).collect(),
            v: (0..config.n_layer).map(|il| layer(il, types.v)).collect(),
            recurrent: delta::RecurrentStates::default(),
        })
    }

    fn new_step(&self, _config: &ModelConfig, _max_tokens: usize) -> anyhow::Result<CpuStep> {
        Ok(CpuStep {
            batch: Batch::default(),
        })
    }

    fn prepare_step(&self, batch: &Batch, step: &mut CpuStep) -> anyhow::Result<()> {
        step.batch.clone_from(batch);
        if batch.tokens_on_device {
            let chained = self.chained.lock().unwrap_or_else(|p| p.into_inner());
            if chained.1.len() != batch.len() {
                anyhow::bail!(
                    "a chained step of {} tokens after a step of {} greedy ids",
                    batch.len(),
                    chained.1.len()
                );
            }
            step.batch.tokens.clone_from(&chained.1);
        }
        Ok(())
    }

    fn embed(&self, table: &CpuWeight, step: &CpuStep, out: &mut CpuTensor) {
        profile::timed(
            || profile::op("embed", step.batch.tokens.len()),
            0,
            || ops::embed(table, &step.batch.tokens, out),
        );
    }

    fn scale(&self, x: &mut CpuTensor, n: usize, factor: f32) {
        x.data[..n * x.cols].iter_mut().for_each(|v| *v *= factor);
    }

    fn rms_norm(&self, x: &CpuTensor, weight: &CpuWeight, eps: f32, n: usize, out: &mut CpuTensor) {
        profile::timed(
            || profile::op("rms_norm", n),
            0,
            || ops::rms_norm(x, weight.vector(), eps, n, out),
        );
    }

    fn rms_norm_heads(
        &self,
        x: &mut CpuTensor,
        weight: &CpuWeight,
        head_dim: usize,
        eps: f32,
        n: usize,
    ) {
        ops::rms_norm_heads(x, weight.vector(), head_dim, eps, n);
    }

    fn matmul(&self, x: &CpuTensor, w: &CpuWeight, n: usize, out: &mut CpuTensor) {
        profile::timed(
            || match w {
                CpuWeight::Matrix { ty, rows, cols, .. } => profile::Key {
                    op: "matmul",
                    ty: ty.to_string(),
                    rows: *rows,
                    cols: *cols,
                    n,
                },
                CpuWeight::Vector(_) => profile::op("matmul", n),
            },
            weight_bytes(w),
            || ops::matmul(self, x, w, n, out),
        );
    }

    fn check_linear_attention(&self) -> anyhow::Result<()> {
        Ok(())
    }

    fn forget_state(&self, cache: &mut CpuCache, first_block: u32) {
        cache.recurrent.forget(first_block);
    }

    fn split_gated_query(
        &self,
        qg: &CpuTensor,
        head_dim: usize,
        n: usize,
        q: &mut CpuTensor,
        gate: &mut CpuTensor,
    ) -> anyhow::Result<()> {
        profile::timed(
            || profile::op("split_gated_query", n),
            0,
            || delta::split_gated_query(qg, head_dim, n, q, gate),
        )
    }

    fn sigmoid_mul(&self, x: &mut CpuTensor, gate: &CpuTensor, n: usize) -> anyhow::Result<()> {
        profile::timed(
            || profile::op("sigmoid_mul", n),
            0,
            || delta::sigmoid_mul(x, gate, n),
        )
    }

    fn add_sigmoid_gated(
        &self,
        out: &mut CpuTensor,
        y: &CpuTensor,
        x: &CpuTensor,
        w: &CpuWeight,
        n: usize,
    ) -> anyhow::Result<()> {
        profile::timed(
            || profile::op("add_sigmoid_gated", n),
            0,
            || delta::add_sigmoid_gated(out, y, x, w, n),
        )
    }

    fn delta_net(
        &self,
        cache: &mut CpuCache,
        layer: usize,
        cfg: &kestrel_model::DeltaNetConfig,
        w: &kestrel_model::DeltaNetWeights<CpuWeight>,
        mix: &CpuTensor,
        z: &CpuTensor,
        beta: &CpuTensor,
        alpha: &CpuTensor,
        eps: f32,
        step: &CpuStep,
        n: usize,
        out: &mut CpuTensor,
    ) -> anyhow::Result<()> {
        profile::timed(
            || profile::op("delta_net", n),
            0,
            || {
                delta::delta_net(
                    &mut cache.recurrent,
                    layer,
                    cfg,
                    w,
                    mix,
                    z,
                    beta,
                    alpha,
                    eps,
                    &step.batch,
                    n,
                    out,
                )
            },
        )
    }

    fn qkv(
        &self,
        x: &CpuTensor,
        _x_ready: (),
        layer: &kestrel_model::LayerWeights<CpuWeight>,
        n: usize,
        q: &mut CpuTensor,
        k: &mut CpuTensor,
        v: &mut CpuTensor,
    ) {
        fn bias(b: &Option<CpuWeight>) -> Option<&[f32]> {
            b.as_ref().map(|b| b.vector())
        }
        // The forward pass asks attention layers only, which have all three.
        let Some((wq, wk, wv)) = layer.qkv_weights() else {
            return;
        };
        let bytes = [wq, wk, wv].iter().map(|w| weight_bytes(w)).sum();
        let fused = profile::timed(
            || profile::op("qkv", n),
            bytes,
            || {
                ops::integer_multi(
                    self,
                    x,
                    n,
                    &mut [
                        (wq, &mut *q, bias(&layer.attn_q_bias)),
                        (wk, &mut *k, bias(&layer.attn_k_bias)),
                        (wv, &mut *v, bias(&layer.attn_v_bias)),
                    ],
                    None,
                )
            },
        );
        if !fused {
            self.matmul(x, wq, n, q);
            self.matmul(x, wk, n, k);
            self.matmul(x, wv, n, v);
            self.add_qkv_biases(layer, n, q, k, v);
        }
    }

    fn gate_up(
        &self,
        x: &CpuTensor,
        _x_ready: (),
        layer: &kestrel_model::LayerWeights<CpuWeight>,
        act: kestrel_model::Activation,
        n: usize,
        gate: &mut CpuTensor,
        up: &mut CpuTensor,
    ) {
        let bytes = weight_bytes(&layer.ffn_gate) + weight_bytes(&layer.ffn_up);
        let fused = profile::timed(
            || profile::op("gate_up", n),
            bytes,
            || {
                ops::integer_multi(
                    self,
                    x,
                    n,
                    &mut [
                        (&layer.ffn_gate, &mut *gate, None),
                        (&layer.ffn_up, &mut *up, None),
                    ],
                    Some(act),
                )
            },
        );
        if !fused {
            self.matmul(x, &layer.ffn_gate, n, gate);
            self.matmul(x, &layer.ffn_up, n, up);
            self.gated_activation(gate, up, act, n);
        }
    }

    fn add_bias(&self, x: &mut CpuTensor, bias: &CpuWeight, n: usize) {
        profile::timed(
            || profile::op("add_bias", n),
            0,
            || {
                let b = bias.vector();
                for row in x.data[..n * x.cols].chunks_exact_mut(x.cols) {
                    row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
                }
            },
        );
    }

    fn rope(
        &self,
        x: &mut CpuTensor,
        head_dim: usize,
        rope: &kestrel_model::RopeParams,
        step: &CpuStep,
        n: usize,
    ) {
        profile::timed(
            || profile::op("rope", n),
            0,
            || ops::rope(x, head_dim, rope, &step.batch.positions, n),
        );
    }

    fn store_kv(
        &self,
        cache: &mut CpuCache,
        layer: usize,
        k: &CpuTensor,
        v: &CpuTensor,
        step: &CpuStep,
        n: usize,
    ) {
        profile::timed(
            || profile::op("store_kv", n),
            0,
            || ops::store_kv(cache, layer, k, v, &step.batch, n),
        );
    }

    fn attention(
        &self,
        q: &CpuTensor,
        cache: &CpuCache,
        params: &kestrel_model::AttnParams,
        step: &CpuStep,
        n: usize,
        out: &mut CpuTensor,
    ) {
        profile::timed(
            || profile::op("attention", n),
            0,
            || ops::attention(self, q, cache, params, None, &step.batch, n, out),
        );
    }

    fn scale_by_position(
        &self,
        x: &mut CpuTensor,
        temp: &kestrel_model::AttnTemperature,
        step: &CpuStep,
        n: usize,
    ) -> anyhow::Result<()> {
        let cols = x.cols;
        for (row, &pos) in x.data[..n * cols]
            .chunks_exact_mut(cols)
            .zip(&step.batch.positions)
        {
            let f = temp.factor(pos);
            row.iter_mut().for_each(|v| *v *= f);
        }
        Ok(())
    }

    fn attention_sinks(
        &self,
        q: &CpuTensor,
        cache: &CpuCache,
        params: &kestrel_model::AttnParams,
        sinks: &CpuWeight,
        step: &CpuStep,
        n: usize,
        out: &mut CpuTensor,
    ) -> anyhow::Result<()> {
        let sinks = sinks.vector();
        if sinks.len() != params.n_head {
            bail!(
                "{} attention sinks for {} heads",
                sinks.len(),
                params.n_head
            );
        }
        profile::timed(
            || profile::op("attention", n),
            0,
            || ops::attention(self, q, cache, params, Some(sinks), &step.batch, n, out),
        );
        Ok(())
    }

    fn gated_activation(
        &self,
        gate: &mut CpuTensor,
        up: &CpuTensor,
        act: kestrel_model::Activation,
        n: usize,
    ) {
        profile::timed(
            || profile::op("gated_act", n),
            0,
            || ops::gated_activation(self.numerics, gate, up, act, n),
        );
    }

    fn add(&self, x: &mut CpuTensor, y: &CpuTensor, n: usize) {
        profile::timed(
            || profile::op("add", n),
            0,
            || {
                let len = n * x.cols;
                x.data[..len]
                    .iter_mut()
                    .zip(&y.data[..len])
                    .for_each(|(a, b)| *a += b);
            },
        );
    }

    fn gather_logit_rows(&self, x: &CpuTensor, step: &CpuStep, out: &mut CpuTensor) {
        let c = x.cols;
        for (dst, &r) in step.batch.logit_rows.iter().enumerate() {
            let r = r as usize;
            out.data[dst * c..(dst + 1) * c].copy_from_slice(&x.data[r * c..(r + 1) * c]);
        }
    }

    fn read_rows(&self, x: &CpuTensor, n: usize, out: &mut Vec<f32>) -> anyhow::Result<()> {
        out.clear();
        out.extend_from_slice(x.rows(n));
        Ok(())
    }

    fn with_rows(
        &self,
        x: &CpuTensor,
        n: usize,
        _scratch: &mut Vec<f32>,
        f: &mut dyn FnMut(&[f32]),
    ) -> anyhow::Result<()> {
        f(x.rows(n));
        Ok(())
    }

    fn can_chain(&self) -> bool {
        true
    }

    fn chain_ids(
        &self,
        x: &CpuTensor,
        n: usize,
        sampling: Option<&kestrel_model::SamplingBatch>,
    ) -> anyhow::Result<()> {
        let mut ids = Vec::new();
        match sampling {
            Some(s) => self.sample_rows(x, n, s, &mut Vec::new(), &mut ids)?,
            None => self.argmax_rows(x, n, &mut Vec::new(), &mut ids)?,
        }
        let mut chained = self.chained.lock().unwrap_or_else(|p| p.into_inner());
        chained.1.clone_from(&ids);
        chained.0.push_back(ids);
        Ok(())
    }

    fn read_chained(&self, out: &mut Vec<u32>) -> anyhow::Result<()> {
        let mut chained = self.chained.lock().unwrap_or_else(|p| p.into_inner());
        *out = chained.0.pop_front().context("no chained step to read")?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kestrel_model::synth::{SynthConfig, WeightType, write_synth_to};
    use kestrel_model::{Activation, Arch, Backend, Model};
    use rand::{Rng, SeedableRng};

    fn tensor(data: Vec<f32>, cols: usize) -> CpuTensor {
        CpuTensor { data, cols }
    }

    /// Q/K/V and gate/up as one loop (`ops::integer_multi`) give exactly the bits of the
    /// separate products, biases and activation, for weight types with integer kernels
    /// and row counts that do not fill whole tasks (or split evenly between threads).
    #[test]
    fn fused_products_match_the_separate_ones() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
        let be = CpuBackend::with_numerics(Kernels::Fast, Numerics::Ggml);
        let mut fused_runs = 0;
        for (ty, n_ff) in [
            (WeightType::Q4KM, 768),
            (WeightType::Q4K, 512),
            (WeightType::Q8_0, 800),
            (WeightType::Q4_0, 736),
            (WeightType::Q5_0, 800),
        ] {
            // 4 heads of 48 and one kv head: 192 query rows, 48 key and value rows (one
            // and a half tasks), feed-forward rows in an odd number of tasks.
            let cfg = SynthConfig {
                n_head: 4,
                n_head_kv: 1,
                head_dim: 48,
                n_ff,
                ..SynthConfig::tiny(Arch::Qwen2)
            };
            let (bytes, _) = write_synth_to(Vec::new(), &cfg, ty, rng.random()).expect("synth");
            let file = Arc::new(GgufFile::from_bytes(bytes).expect("parses"));
            let model = Model::load(&be, file).expect("loads");
            let c = &model.config;
            let layer = &model.weights.layers[0];
            let (wq, wk, wv) = layer.qkv_weights().expect("an attention layer");
            for n in [1usize, 3, 6] {
                let x: Vec<f32> = (0..n * c.n_embd)
                    .map(|_| rng.random_range(-2.0f32..2.0))
                    .collect();
                let x = tensor(x, c.n_embd);
                let new = |cols: usize| tensor(vec![0.0; n * cols], cols);
                let (mut q, mut k, mut v) = (new(c.q_dim()), new(c.kv_dim()), new(c.kv_dim()));
                let fused = ops::integer_multi(
                    &be,
                    &x,
                    n,
                    &mut [
                        (wq, &mut q, layer.attn_q_bias.as_ref().map(|b| b.vector())),
                        (wk, &mut k, layer.attn_k_bias.as_ref().map(|b| b.vector())),
                        (wv, &mut v, layer.attn_v_bias.as_ref().map(|b| b.vector())),
                    ],
                    None,
                );
                let (mut q2, mut k2, mut v2) = (new(c.q_dim()), new(c.kv_dim()), new(c.kv_dim()));
                be.matmul(&x, wq, n, &mut q2);
                be.matmul(&x, wk, n, &mut k2);
                be.matmul(&x, wv, n, &mut v2);
                for (t, b) in [
                    (&mut q2, &layer.attn_q_bias),
                    (&mut k2, &layer.attn_k_bias),
                    (&mut v2, &layer.attn_v_bias),
                ] {
                    be.add_bias(t, b.as_ref().expect("qwen2 has biases"), n);
                }
                if fused {
                    fused_runs += 1;
                    assert!(q.data == q2.data, "{ty:?} n={n}: q");
                    assert!(k.data == k2.data, "{ty:?} n={n}: k");
                    assert!(v.data == v2.data, "{ty:?} n={n}: v");
                }
                for act in [Activation::Silu, Activation::GeluTanh] {
                    let (mut g, mut u) = (new(c.n_ff), new(c.n_ff));
                    let fused = ops::integer_multi(
                        &be,
                        &x,
                        n,
                        &mut [
                            (&layer.ffn_gate, &mut g, None),
                            (&layer.ffn_up, &mut u, None),
                        ],
                        Some(act),
                    );
                    let (mut g2, mut u2) = (new(c.n_ff), new(c.n_ff));
                    be.matmul(&x, &layer.ffn_gate, n, &mut g2);
                    be.matmul(&x, &layer.ffn_up, n, &mut u2);
                    be.gated_activation(&mut g2, &u2, act, n);
                    if fused {
                        fused_runs += 1;
                        assert!(g.data == g2.data, "{ty:?} n={n} {act:?}: gate");
                    }
                }
            }
        }
        // Every case above has integer kernels where the CPU has AVX-512 VNNI.
        if qdot8::supported(GgmlType::Q4K) {
            assert_eq!(fused_runs, 5 * 3 * 3);
        }
    }
}
