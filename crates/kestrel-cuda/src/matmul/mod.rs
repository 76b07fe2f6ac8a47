//! Matrix products: which kernel family takes a product (the predicates below, asked once
//! per product), and the products the forward pass asks for (`matmul`, `qkv`, `gate_up`,
//! `matmul_add`). The launchers of each family live beside this file: `gemv` (decode-sized,
//! kernels/gemv.cu), `mmq` (int8 tensor cores, kernels/mmq.cu), `mmw` (4-bit repacked gate/up,
//! kernels/mmw.cu), `cublas` (f16 products through cuBLAS).

use crate::*;
use kestrel_model::Backend;

pub(crate) mod cublas;
pub(crate) mod gemv;
pub(crate) mod mmq;
pub(crate) mod mmw;
pub mod plan;

pub(crate) use cublas::*;
pub(crate) use gemv::*;
pub(crate) use mmq::*;
pub(crate) use mmw::*;
pub use plan::Kernel;
pub(crate) use plan::{Context, Matrix, gemv_supported, q8_supported};

/// The kernels this module launches (matmul (kernels/quant.cu) for what no other kernel takes; the merged cuBLAS products' split and activation (kernels/elementwise.cu)).
pub(crate) const KERNELS: &[&str] = &["matmul", "split_qkv", "gated_act_merged"];

/// The most tokens of a batch-invariant step (speculative verification: up to 7 drafts
/// after the pending token) that run as such; longer ones run as any step.
pub const INVARIANT_MAX_TOKENS: usize = 8;

/// Tokens up to which Q8-capable weights with an f16 copy still use the 8-bit GEMVs.
pub(crate) const Q8_GEMV_MAX_TOKENS: usize = 4;

pub(crate) const MMQ_MIN_TOKENS: usize = 3;

/// Fewest tokens of a step whose Q4_K / Q6_K products take the staged kernels `mms_*`.
pub(crate) const MMS_MIN_TOKENS: usize = 9;

/// Waves of 2 blocks a SM beyond which a launch stays off `mmk_t8*` (see `plan::mmk_reads`).
pub(crate) const MMK_MAX_WAVES: usize = 8;

/// A merged Q/K/V product (`qkv` through cuBLAS) not yet split into q, k and v: `qkv`
/// returns it (as [`Prepared::Split`]) to the forward pass, which hands it to
/// `rope_store_kv`, which reads the heads straight from the product (one launch and one
/// pass over the outputs fewer).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PendingSplit {
    /// `split_qkv`'s arguments: the product, q, k, v, the three biases (0: none), the
    /// widths of q and k, the values.
    pub(crate) args: [Arg; 10],
    pub(crate) n: usize,
}

/// The most tokens a step multiplies through the merged Q/K/V f16 copy (see `qkv`).
pub(crate) const MERGED_QKV_MAX_TOKENS: usize = 512;

/// [`CudaBackend::multi_q8_layout`]'s answer.
pub(crate) struct MultiQ8 {
    pub(crate) npad: usize,
    pub(crate) mmk: bool,
    pub(crate) q8: Q8Ptrs,
}

impl CudaBackend {
    /// What the kernel choice depends on besides the product (see [`plan::Context`]).
    pub(crate) fn plan_context(&self) -> Context {
        Context {
            cublas: self.cublas_now(),
            q8: self.q8_decode(),
            mmk: self.mmk_on(),
            forced_rows: self.gemv_q8_rows(),
            sm_count: self.sm_count,
            q8_capacity: self.q8_capacity(),
        }
    }

    /// Whether this step is batch-invariant (`Batch::invariant`: a speculative
    /// verification): each of its tokens is computed exactly as a step of that token alone
    /// would compute it, so greedy speculation gives the tokens decoding one at a time
    /// gives. Products take the single-token kernel family (its multi-token form with the
    /// same per-token sums: `gemv_v*` / `gemv_dec_t*`), norms
    /// `rms_norm_q8` per row, attention each token's single-token split count.
    pub(crate) fn invariant_step(&self) -> bool {
        self.invariant.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Makes the products launched from now until the next step's preparation batch-invariant
    /// (as in a verification step) or not: the self-check compares such products with
    /// single-token ones outside a step.
    pub fn set_invariant(&self, on: bool) {
        self.invariant
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// The token count a kernel choice is made for: 1 in a batch-invariant step.
    pub(crate) fn plan_tokens(&self, n: usize) -> usize {
        if self.invariant_step() { 1 } else { n }
    }

    /// The kernel of `out = x · wᵀ` for `n` tokens ([`plan::plan`]); `matmul` when `w` is
    /// not a matrix.
    pub fn plan_of(&self, w: &CudaWeight, n: usize) -> Kernel {
        let n = self.plan_tokens(n);
        match Matrix::of(w) {
            Some(m) => plan::plan(&m, n, &self.plan_context()).0,
            None => Kernel::Matmul,
        }
    }

    /// The GEMV-family kernel of one launch over `segs` (rows of `k` values) for `n`
    /// tokens ([`plan::plan_launch`]); None when none takes it.
    pub(crate) fn plan_segs(
        &self,
        k: usize,
        n: usize,
        segs: &[GemvSeg],
        gated: bool,
    ) -> Option<Kernel> {
        let n = self.plan_tokens(n);
        // (On the stack: asked for every launch of every step.)
        let mut mats = [segs[0].matrix(k); 3];
        for (m, s) in mats.iter_mut().zip(segs) {
            *m = s.matrix(k);
        }
        let launch = plan::Launch {
            mats: &mats[..segs.len().min(3)],
            k,
            n,
            gated,
            accumulate: segs.iter().any(|s| s.accumulate),
        };
        plan::plan_launch(&launch, &self.plan_context())
    }

    /// Whether a product of `n` tokens with `w` goes through cuBLAS
    /// ([`plan::prefer_gemm`]; vectors: from GEMM_MIN_TOKENS, where cuBLAS is usable).
    pub(crate) fn prefer_gemm(&self, w: &CudaWeight, n: usize) -> bool {
        let n = self.plan_tokens(n);
        let cx = self.plan_context();
        match Matrix::of(w) {
            Some(m) => plan::prefer_gemm(&m, n, &cx),
            None => cx.cublas && n >= GEMM_MIN_TOKENS,
        }
    }

    /// Whether `mmk_t8*` takes the Q4_K / Q6_K launches of up to 8 tokens that it reads (on by
    /// default).
    pub(crate) fn mmk_on(&self) -> bool {
        self.mmk.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Turns `mmk_t8*` off, so that `mmq_t8` takes those launches as it takes the LM head's
    /// (the self-check covers both).
    pub fn set_mmk(&self, on: bool) {
        self.mmk.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether a single-token product with `w` alone runs on `gemv_ws_r1`.
    pub fn matmul_uses_ws(&self, w: &CudaWeight, n: usize) -> bool {
        self.plan_of(w, n) == Kernel::GemvWs
    }

    /// Whether a product of `n` tokens with `w` runs on activations quantized per 256
    /// values: `mmk_t8*` or `mms_*` (a subset of [`Self::matmul_uses_q8`]).
    pub fn matmul_uses_mmk(&self, w: &CudaWeight, n: usize) -> bool {
        self.plan_of(w, n).per_256()
    }

    /// Whether a product of `n` tokens with `w` runs on `mms_*`.
    pub fn matmul_uses_mms(&self, w: &CudaWeight, n: usize) -> bool {
        self.plan_of(w, n) == Kernel::Mms
    }

    /// Whether `matmul` of `n` tokens with `w` (an `x` of `w`'s row length) runs on 8-bit
    /// activations.
    pub fn matmul_uses_q8(&self, w: &CudaWeight, n: usize) -> bool {
        self.plan_of(w, n).q8()
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

    /// Launches the split of a merged Q/K/V product into q, k and v (when nothing reads
    /// its heads straight from it).
    pub(crate) fn split_qkv(&self, p: &PendingSplit) {
        let Arg::L(len) = p.args[9] else {
            return;
        };
        self.elementwise("split_qkv", len as usize, &p.args);
    }

    /// `gate = act(gate_w·x) * (up_w·x)`: one gated launch where the GEMV or tensor-core
    /// kernels take both matrices, else two products and the activation (the backend's
    /// `gate_up`; public for the self-check). Returns what it prepared for the down
    /// projection.
    #[allow(clippy::too_many_arguments)]
    pub fn gate_up_of(
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
        let mut ready = x_ready;
        if let Some(gated) = self.gate_up_mmw(x, &mut ready, gate_w, up_w, act, n, gate) {
            return gated;
        }
        let fused = !self.prefer_gemm(gate_w, n)
            && match (
                self.gemv_seg(x, gate_w, gate, None),
                self.gemv_seg(x, up_w, up, None),
            ) {
                (Some(g), Some(u)) if g.rows == u.rows => {
                    let segs = [g, u];
                    let kernel = self.plan_segs(x.cols, n, &segs, true);
                    if let Some(kernel) = kernel {
                        self.gemv(x, &mut ready, n, &segs, Some(act), kernel);
                    }
                    kernel.is_some()
                }
                _ => false,
            };
        if fused {
            return Prepared::Nothing;
        }
        // Through cuBLAS with gate's merged f16 copy (up's rows behind gate's): one product,
        // the activation reading both halves of each row; steps of more than
        // MERGED_QKV_MAX_TOKENS (whose f32 product would be large) take the halves as two.
        if self.prefer_gemm(gate_w, n)
            // (The activation pairs gate's columns with up's: as many of each.)
            && let Some((a, rows)) = self.merged_copy(gate_w, &[up_w], x.cols, &[gate, up])
                .filter(|_| up.cols == gate.cols)
            && let Some(xh) = self.x_to_f16(x, n, &mut ready)
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
                return kestrel_model::Backend::gated_activation(self, gate, up, act, n);
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
            // The down projection's input, as gated_act_f16 leaves it.
            return match h {
                Some(h) => Prepared::F16 { of: gate.ptr, n, h },
                None => Prepared::Nothing,
            };
        }
        self.matmuls_of(x, ready, n, &mut [(gate_w, &mut *gate), (up_w, &mut *up)]);
        kestrel_model::Backend::gated_activation(self, gate, up, act, n)
    }

    /// `out = x · wᵀ` for several weights sharing `x`: through cuBLAS from one f16
    /// conversion of x when every product goes there, one `matmul` each otherwise.
    pub(crate) fn matmuls_of(
        &self,
        x: &CudaTensor,
        x_ready: Prepared,
        n: usize,
        products: &mut [(&CudaWeight, &mut CudaTensor)],
    ) {
        let shared = products
            .iter()
            .all(|(w, _)| self.prefer_gemm(w, n) && w.cols() == Some(x.cols));
        let mut ready = x_ready;
        match shared.then(|| self.x_to_f16(x, n, &mut ready)).flatten() {
            Some(xh) => {
                for (w, out) in products.iter() {
                    self.gemm_f16_from(xh, w, n, out);
                }
            }
            None => {
                // (Each product may leave x prepared for the next: `ready` follows.)
                for (w, out) in products.iter_mut() {
                    matmul(self, x, &mut ready, w, n, out);
                }
            }
        }
    }
}

/// `out = x · wᵀ`; `ready`: what x's producer (or an earlier product of x) left prepared,
/// updated to what the buffers hold afterwards.
pub(crate) fn matmul(
    backend: &CudaBackend,
    x: &CudaTensor,
    ready: &mut Prepared,
    w: &CudaWeight,
    n: usize,
    out: &mut CudaTensor,
) {
    let CudaWeight::Matrix {
        ptr,
        ty,
        rows,
        cols,
        row_bytes,
        ..
    } = w
    else {
        backend.fail("matmul: the weight is not a matrix".into());
        return;
    };
    if x.cols != *cols || out.cols != *rows {
        backend.fail(format!(
            "matmul: x has {} columns, out {}, weight is {rows}×{cols}",
            x.cols, out.cols
        ));
        return;
    }
    // One choice of kernel for the product (see `plan`).
    match backend.plan_of(w, n) {
        Kernel::Cublas => {
            if backend.gemm_f16(x, ready, w, n, out) {
                return;
            }
        }
        Kernel::Matmul => {}
        kernel => {
            if let Some(seg) = backend.gemv_seg(x, w, out, None) {
                backend.gemv(x, ready, n, &[seg], None, kernel);
                return;
            }
        }
    }
    const ROWS_PER_BLOCK: usize = 8;
    const TOKENS_PER_BLOCK: usize = 4;
    let grid_y = n.div_ceil(TOKENS_PER_BLOCK);
    if grid_y > 65535 {
        backend.fail(format!("matmul: {n} tokens in one call is too many"));
        return;
    }
    backend.launch(
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

/// Several products of one input (`Backend::matmul_many`): the first three in one GEMV
/// launch where the step's kernel plan takes them together (as `qkv` does), the others
/// (or all, in prompt-sized steps) one by one on `x` prepared once.
pub(crate) fn matmul_many(
    backend: &CudaBackend,
    x: &CudaTensor,
    x_ready: Prepared,
    ws: &[&CudaWeight],
    n: usize,
    outs: &mut [&mut CudaTensor],
) {
    let mut ready = x_ready;
    let mut done = 0;
    if ws.len() >= 3 && outs.len() >= 3 && !backend.prefer_gemm(ws[0], n) {
        let segs = [0, 1, 2].map(|i| backend.gemv_seg(x, ws[i], outs[i], None));
        if let [Some(a), Some(b), Some(c)] = segs {
            let segs = [a, b, c];
            if let Some(kernel) = backend.plan_segs(x.cols, n, &segs, false) {
                backend.gemv(x, &mut ready, n, &segs, None, kernel);
                done = 3;
            }
        }
    }
    for (w, out) in ws.iter().zip(outs.iter_mut()).skip(done) {
        matmul(backend, x, &mut ready, w, n, out);
    }
}

/// The Q, K and V projections of a layer (and their biases), and whether Q/K norms follow.
pub struct QkvWeights<'a> {
    pub attn_q: &'a CudaWeight,
    pub attn_k: &'a CudaWeight,
    pub attn_v: &'a CudaWeight,
    pub attn_q_bias: Option<&'a CudaWeight>,
    pub attn_k_bias: Option<&'a CudaWeight>,
    pub attn_v_bias: Option<&'a CudaWeight>,
    pub qk_norm: bool,
}

impl<'a> QkvWeights<'a> {
    /// None for a linear-attention layer (no Q/K/V products).
    pub fn of(layer: &'a LayerWeights<CudaWeight>) -> Option<Self> {
        Self::picked(layer, |w| w)
    }

    /// [`Self::of`] for the weights of a backend over several GPUs: `pick` gives the one
    /// GPU's part of each weight (a rank's shard, a stage's copy).
    pub fn picked<W>(
        layer: &'a LayerWeights<W>,
        pick: impl Fn(&'a W) -> &'a CudaWeight,
    ) -> Option<Self> {
        let (attn_q, attn_k, attn_v) = layer.qkv_weights()?;
        Some(QkvWeights {
            attn_q: pick(attn_q),
            attn_k: pick(attn_k),
            attn_v: pick(attn_v),
            attn_q_bias: layer.attn_q_bias.as_ref().map(&pick),
            attn_k_bias: layer.attn_k_bias.as_ref().map(&pick),
            attn_v_bias: layer.attn_v_bias.as_ref().map(&pick),
            qk_norm: layer.attn_q_norm.is_some() || layer.attn_k_norm.is_some(),
        })
    }
}

/// Returns the merged product still to split ([`Prepared::Split`]) where the layer has no
/// Q/K norm, so `rope_store_kv` comes next and splits it on the way.
#[allow(clippy::too_many_arguments)]
pub(crate) fn qkv(
    backend: &CudaBackend,
    x: &CudaTensor,
    x_ready: Prepared,
    layer: &QkvWeights<'_>,
    n: usize,
    q: &mut CudaTensor,
    k: &mut CudaTensor,
    v: &mut CudaTensor,
) -> Prepared {
    let mut ready = x_ready;
    if !backend.prefer_gemm(layer.attn_q, n) {
        let segs = [
            backend.gemv_seg(x, layer.attn_q, q, layer.attn_q_bias),
            backend.gemv_seg(x, layer.attn_k, k, layer.attn_k_bias),
            backend.gemv_seg(x, layer.attn_v, v, layer.attn_v_bias),
        ];
        if let [Some(a), Some(b), Some(c)] = segs {
            let segs = [a, b, c];
            if let Some(kernel) = backend.plan_segs(x.cols, n, &segs, false) {
                backend.gemv(x, &mut ready, n, &segs, None, kernel);
                return Prepared::Nothing;
            }
        }
    }
    // Through cuBLAS: one product over Q's merged f16 copy (K's and V's rows behind
    // Q's), split into q, k and v with the biases added.
    // (Only where prefer_gemm agrees: a step recorded without cuBLAS (`record_step`) must
    // not call it, and formats the GEMVs do not read come here in such steps too.) Up to
    // MERGED_QKV_MAX_TOKENS: Llama-3-8B Q4_K_M, B = 64 decode with device argmax
    // 6,710 / 6,738 / 6,803 -> 6,902 / 7,047 / 6,885 t/s, pp512 +0.9%; its 2,048-token
    // prefill steps lost 2.5% to the split's extra pass over the outputs.
    if n <= MERGED_QKV_MAX_TOKENS
        && backend.prefer_gemm(layer.attn_q, n)
        && let Some((a, rows)) = backend.merged_copy(
            layer.attn_q,
            &[layer.attn_k, layer.attn_v],
            x.cols,
            &[q, k, v],
        )
        && let Some(xh) = backend.x_to_f16(x, n, &mut ready)
        && let Some(merged) = backend.scratch_ptr(|s| &mut s.qkv, 2 * n * rows)
    {
        let bias = |b: Option<&CudaWeight>| match b {
            Some(b) => backend.vector_ptr(b, "qkv bias"),
            None => Some(0),
        };
        let (Some(bq), Some(bk), Some(bv)) = (
            bias(layer.attn_q_bias),
            bias(layer.attn_k_bias),
            bias(layer.attn_v_bias),
        ) else {
            return Prepared::Nothing;
        };
        backend.gemm_f16_raw(a, rows, x.cols, xh, n, merged, rows, false);
        let split = PendingSplit {
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
        };
        // Without Q/K norms rope_store_kv comes next and splits on the way.
        if !layer.qk_norm {
            return Prepared::Split(split);
        }
        backend.split_qkv(&split);
        return Prepared::Nothing;
    }
    // Through cuBLAS: x converted to f16 once for the three products.
    backend.matmuls_of(
        x,
        ready,
        n,
        &mut [
            (layer.attn_q, &mut *q),
            (layer.attn_k, &mut *k),
            (layer.attn_v, &mut *v),
        ],
    );
    for (t, b) in [
        (q, layer.attn_q_bias),
        (k, layer.attn_k_bias),
        (v, layer.attn_v_bias),
    ] {
        if let Some(b) = b {
            crate::norm_rope::add_bias(backend, t, b, n);
        }
    }
    Prepared::Nothing
}

pub(crate) fn matmul_add(
    backend: &CudaBackend,
    x: &CudaTensor,
    x_ready: Prepared,
    w: &CudaWeight,
    n: usize,
    tmp: &mut CudaTensor,
    residual: &mut CudaTensor,
) {
    let mut ready = x_ready;
    // Single-token steps, verification steps (whose kernels are the single-token ones'
    // multi-token forms, adding as those do) and the tensor-core kernels of a few tokens
    // add into the residual themselves.
    if !backend.prefer_gemm(w, n)
        && let Some(mut seg) = backend.gemv_seg(x, w, residual, None)
    {
        seg.accumulate = true;
        let segs = [seg];
        match backend.plan_segs(x.cols, n, &segs, false) {
            Some(kernel) if n == 1 || kernel.tensor_core() || backend.invariant_step() => {
                backend.gemv(x, &mut ready, n, &segs, None, kernel);
                return;
            }
            _ => {}
        }
    }
    // Prompt-sized steps on cuBLAS: the product added into the residual by the GEMM.
    if backend.blas.is_some()
        && backend.prefer_gemm(w, n)
        && w.cols() == Some(x.cols)
        && let Some(xh) = backend.x_to_f16(x, n, &mut ready)
    {
        backend.gemm_f16_into(xh, w, n, residual, true);
        return;
    }
    matmul(backend, x, &mut ready, w, n, tmp);
    backend.add(residual, tmp, n);
}
