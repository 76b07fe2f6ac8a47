//! RMSNorm (with the 8-bit or f16 copy of its output for the product that reads it next),
//! RoPE, the embedding gather and the element-wise kernels (kernels/norm_rope.cu,
//! kernels/elementwise.cu).

use crate::*;

/// The kernels this module launches (kernels/norm_rope.cu, kernels/elementwise.cu, the embedding gather of kernels/quant.cu; rms_norm_mmq / rms_norm_mmk write mmq.cu's layouts).
pub(crate) const KERNELS: &[&str] = &[
    "embed",
    "scale_f32",
    "scale_by_position",
    "add_f32",
    "add_bias",
    "gated_act",
    "gated_act_f16",
    "rms_norm",
    "rms_norm_f16",
    "rms_norm_q8",
    "rms_norm_mmq",
    "rms_norm_mmk",
    "rope",
];

/// The kernels' code of an activation (`gated_value` in kernels/elementwise.cu).
pub(crate) fn activation_id(act: Activation) -> i32 {
    match act {
        Activation::Silu => 0,
        Activation::GeluTanh => 1,
    }
}

impl CudaBackend {
    /// The trailing `ROPE_PARAMS` arguments of the RoPE kernels (kernels/norm_rope.cu), or None
    /// when the frequency factors could not be uploaded (the failure is recorded).
    pub(crate) fn rope_args(&self, head_dim: usize, rope: &RopeParams) -> Option<[Arg; 10]> {
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
}

pub(crate) fn embed(
    backend: &CudaBackend,
    table: &CudaWeight,
    step: &CudaStep,
    out: &mut CudaTensor,
) {
    let CudaWeight::Matrix {
        ptr,
        ty,
        rows,
        cols,
        row_bytes,
        ..
    } = table
    else {
        backend.fail("embed: the table is not a matrix".into());
        return;
    };
    backend.launch(
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
            Arg::I(*rows as i32),
        ],
    );
}

pub(crate) fn scale(backend: &CudaBackend, x: &mut CudaTensor, n: usize, factor: f32) {
    let len = n * x.cols;
    backend.elementwise(
        "scale_f32",
        len,
        &[Arg::P(x.ptr), Arg::I(len as i32), Arg::F(factor)],
    );
}

/// Each of the `n` token rows of `x` times its position's attention temperature factor
/// (`AttnTemperature::factor`, Mistral 3).
pub(crate) fn scale_by_position(
    backend: &CudaBackend,
    x: &mut CudaTensor,
    temp: &kestrel_model::AttnTemperature,
    step: &CudaStep,
    n: usize,
) -> anyhow::Result<()> {
    if temp.floor_scale == 0 || n > step.max_tokens || n > x.rows {
        bail!(
            "attention temperature: floor scale {}, {n} tokens for a step of {} and {} rows",
            temp.floor_scale,
            step.max_tokens,
            x.rows
        );
    }
    if n == 0 {
        return Ok(());
    }
    backend.launch(
        "scale_by_position",
        (n as u32, 1, 1),
        128,
        &[
            Arg::P(x.ptr),
            Arg::I(x.cols as i32),
            Arg::P(step.positions()),
            Arg::F(temp.scale),
            Arg::I(temp.floor_scale.min(i32::MAX as u32) as i32),
        ],
    );
    Ok(())
}

pub(crate) fn rms_norm(
    backend: &CudaBackend,
    x: &CudaTensor,
    weight: &CudaWeight,
    eps: f32,
    n: usize,
    out: &mut CudaTensor,
) -> Prepared {
    let Some(w) = backend.vector_ptr(weight, "rms_norm") else {
        return Prepared::Nothing;
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
    // A single-token row whose consumer is a gemv_q8: quantize it on the way out (and a
    // verification step's rows each as alone, `invariant_step`: rms_norm_q8's row sums are
    // not the plain kernel's).
    let rows_q8 = if backend.invariant_step() {
        backend
            .single_q8_buffers(1, x.cols)
            .and_then(|_| backend.q8_buffers(n * x.cols))
    } else {
        backend.single_q8_buffers(n, x.cols)
    };
    if let Some(Q8Ptrs {
        q: q_ptr, d: d_ptr, ..
    }) = rows_q8
    {
        // One block per 256 values, each summing the whole row (see the kernel). One
        // block for the whole row measured 576 / 585 against 627 / 611 t/s (tg128,
        // Qwen2.5-1.5B Q4_K_M, H100), 305 / 303 against 310 / 307 on Llama-3-8B.
        let (cols_grid, threads) = (grid_1d(x.cols, 256), 256);
        let grid = (cols_grid.0, n as u32, 1);
        let args = [&head[..], &[Arg::P(q_ptr), Arg::P(d_ptr)]].concat();
        backend.launch("rms_norm_q8", grid, threads, &args);
        return Prepared::Q8 { of: out.ptr, n };
    }
    // A few tokens whose consumer is an int8 mmq launch (steps of MMQ_MIN_TOKENS up to
    // MMQ_MAX_TOKENS): quantize them on the way out, in that kernel's layout.
    if let Some(MultiQ8 { npad, mmk, q8 }) = backend.multi_q8_layout(n, x.cols) {
        let Q8Ptrs { q, ds, .. } = q8;
        let tail = [Arg::I(n as i32), Arg::I(npad as i32), Arg::P(q), Arg::P(ds)];
        let mut args = [&head[..], &tail].concat();
        // mmk's layout: one block per token; else `mmq_t*`'s, one block per 256 values.
        if mmk {
            args.push(Arg::P(q8.mmk_steps_sums(npad, x.cols).1));
            let threads = 64 * (x.cols / 256).min(16) as u32;
            let grid = (1, npad as u32, 1);
            backend.launch("rms_norm_mmk", grid, threads, &args);
        } else {
            let grid = (x.cols.div_ceil(256) as u32, npad as u32, 1);
            backend.launch("rms_norm_mmq", grid, 256, &args);
        }
        return Prepared::Mmq {
            of: out.ptr,
            n,
            npad,
            mmk,
        };
    }
    // Rows for cuBLAS: their f16 copy on the way out (B = 64 on Llama-3-8B: two
    // conversion launches a layer less).
    if let Some(h) = backend.f16_copy_for_gemm(n, x.cols) {
        let args = [&head[..], &[Arg::P(h)]].concat();
        let grid = (n as u32, 1, 1);
        backend.launch("rms_norm_f16", grid, block, &args);
        return Prepared::F16 { of: out.ptr, n, h };
    }
    backend.launch("rms_norm", (n as u32, 1, 1), block, &head);
    Prepared::Nothing
}

pub(crate) fn rms_norm_heads(
    backend: &CudaBackend,
    x: &mut CudaTensor,
    weight: &CudaWeight,
    head_dim: usize,
    eps: f32,
    n: usize,
) {
    let Some(w) = backend.vector_ptr(weight, "rms_norm_heads") else {
        return;
    };
    // Heads are contiguous rows of `head_dim` values: a row norm over n·heads rows.
    let rows = n * x.cols / head_dim;
    let block = head_dim.next_multiple_of(32).min(256) as u32;
    backend.launch(
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

pub(crate) fn add_bias(backend: &CudaBackend, x: &mut CudaTensor, bias: &CudaWeight, n: usize) {
    let Some(b) = backend.vector_ptr(bias, "add_bias") else {
        return;
    };
    let len = n * x.cols;
    backend.elementwise(
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

pub(crate) fn rope(
    backend: &CudaBackend,
    x: &mut CudaTensor,
    head_dim: usize,
    rope: &RopeParams,
    step: &CudaStep,
    n: usize,
) {
    let Some(rope_args) = backend.rope_args(head_dim, rope) else {
        return;
    };
    let mut args = vec![
        Arg::P(x.ptr),
        Arg::P(step.positions()),
        Arg::I(x.cols as i32),
    ];
    args.extend_from_slice(&rope_args);
    backend.launch("rope", (n as u32, 1, 1), 128, &args);
}

pub(crate) fn gated_activation(
    backend: &CudaBackend,
    gate: &mut CudaTensor,
    up: &CudaTensor,
    act: Activation,
    n: usize,
) -> Prepared {
    let len = n * gate.cols;
    let mut args = vec![
        Arg::P(gate.ptr),
        Arg::P(up.ptr),
        Arg::I(len as i32),
        Arg::I(activation_id(act)),
    ];
    // The down projection's input for cuBLAS: its f16 copy on the way out.
    if let Some(h) = backend.f16_copy_for_gemm(n, gate.cols) {
        args.push(Arg::P(h));
        let grid = grid_1d(len, 256);
        backend.launch("gated_act_f16", grid, 256, &args);
        return Prepared::F16 { of: gate.ptr, n, h };
    }
    backend.elementwise("gated_act", len, &args);
    Prepared::Nothing
}

pub(crate) fn add(backend: &CudaBackend, x: &mut CudaTensor, y: &CudaTensor, n: usize) {
    let len = n * x.cols;
    backend.elementwise(
        "add_f32",
        len,
        &[Arg::P(x.ptr), Arg::P(y.ptr), Arg::I(len as i32)],
    );
}
