//! CPU backend: computes straight from the quantized blocks of the memory-mapped file
//! (no dequantized copy of the weights), on all cores through rayon.
//!
//! `Kernels::Scalar` runs the plain single-threaded scalar path: it is the oracle the
//! fast path is tested against.

pub mod gemm;
pub mod numerics;
mod ops;
pub mod pool;
pub mod profile;
pub mod qdot;
pub mod qdot8;
pub mod simd;

use std::sync::Arc;

use anyhow::{Context, bail};
use half::f16;
use kestrel_gguf::{GgmlType, GgufFile, TensorInfo};
use kestrel_model::{Batch, ModelConfig};

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
}

impl Drop for CpuBackend {
    fn drop(&mut self) {
        if profile::enabled() {
            profile::report();
        }
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

/// The paged KV cache: per layer, `n_blocks × block_size` slots of `kv_dim` f16 values
/// for keys and for values.
pub struct CpuCache {
    pub block_size: usize,
    pub n_blocks: usize,
    pub kv_dim: usize,
    pub k: Vec<Vec<f16>>,
    pub v: Vec<Vec<f16>>,
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
        Ok(CpuWeight::Matrix {
            file: file.clone(),
            info: info.clone(),
            ty: info.ty,
            rows,
            cols,
        })
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
        let kv_dim = config.kv_dim();
        let per_layer = config
            .kv_cache_len(n_blocks, block_size)
            .context("KV cache size overflows")?;
        Ok(CpuCache {
            block_size,
            n_blocks,
            kv_dim,
            k: (0..config.n_layer)
                .map(|_| vec![f16::ZERO; per_layer])
                .collect(),
            v: (0..config.n_layer)
                .map(|_| vec![f16::ZERO; per_layer])
                .collect(),
        })
    }

    fn new_step(&self, _config: &ModelConfig, _max_tokens: usize) -> anyhow::Result<CpuStep> {
        Ok(CpuStep {
            batch: Batch::default(),
        })
    }

    fn prepare_step(&self, batch: &Batch, step: &mut CpuStep) -> anyhow::Result<()> {
        step.batch.clone_from(batch);
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
            match w {
                CpuWeight::Matrix { info, .. } => info.n_bytes(),
                CpuWeight::Vector(_) => 0,
            },
            || ops::matmul(self, x, w, n, out),
        );
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
            || ops::attention(self, q, cache, params, &step.batch, n, out),
        );
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
}
