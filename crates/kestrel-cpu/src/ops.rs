//! The CPU implementations of the backend operations.

use kestrel_model::{Activation, AttnParams, Batch, RopeParams};

use crate::numerics::{self, Numerics};
use crate::pool::SharedMut;
use crate::{CpuBackend, CpuCache, CpuTensor, CpuWeight, Kernels};
use crate::{gemm, packed, qdot, qdot8, simd};

/// Splits a matrix weight into what the kernels need: type, rows, row length, bytes.
fn matrix(w: &CpuWeight) -> (kestrel_gguf::GgmlType, usize, usize, &[u8]) {
    match w {
        CpuWeight::Matrix {
            file,
            info,
            ty,
            rows,
            cols,
            copy,
            ..
        } => {
            let data = file.tensor_data(info);
            match copy {
                Some(c) => {
                    let at = data.as_ptr() as usize - file.as_bytes().as_ptr() as usize;
                    (*ty, *rows, *cols, &c.bytes()[at..at + data.len()])
                }
                None => (*ty, *rows, *cols, data),
            }
        }
        // Shapes are checked when the model loads: 2-D tensors are always matrices.
        CpuWeight::Vector(_) => unreachable!("a vector weight used as a matrix"),
    }
}

pub fn embed(table: &CpuWeight, tokens: &[u32], out: &mut CpuTensor) {
    let cols = out.cols;
    for (i, &t) in tokens.iter().enumerate() {
        row(table, t as usize, &mut out.data[i * cols..(i + 1) * cols]);
    }
}

/// Row `r` of a matrix weight, dequantized into `out` (its row length).
pub(crate) fn row(w: &CpuWeight, r: usize, out: &mut [f32]) {
    let (ty, _rows, cols, data) = matrix(w);
    let row_bytes = ty.bytes_for(cols as u64).unwrap_or(0) as usize;
    let src = &data[r * row_bytes..(r + 1) * row_bytes];
    // Row lengths were validated at load; the row index (a token id, an expert) by the
    // caller.
    let _ = kestrel_quant::dequantize_row(ty, src, out);
}

pub fn rms_norm(x: &CpuTensor, w: &[f32], eps: f32, n: usize, out: &mut CpuTensor) {
    let c = x.cols;
    for (xr, or) in x.data[..n * c]
        .chunks_exact(c)
        .zip(out.data[..n * c].chunks_exact_mut(c))
    {
        let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>() / c as f32;
        let scale = 1.0 / (ss + eps).sqrt();
        for ((o, v), g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * scale * g;
        }
    }
}

pub fn rms_norm_heads(x: &mut CpuTensor, w: &[f32], head_dim: usize, eps: f32, n: usize) {
    for head in x.data[..n * x.cols].chunks_exact_mut(head_dim) {
        let ss: f32 = head.iter().map(|v| v * v).sum::<f32>() / head_dim as f32;
        let scale = 1.0 / (ss + eps).sqrt();
        head.iter_mut()
            .zip(w)
            .for_each(|(v, g)| *v = *v * scale * g);
    }
}

pub fn matmul(be: &CpuBackend, x: &CpuTensor, w: &CpuWeight, n: usize, out: &mut CpuTensor) {
    let m = Matmul::new(be, w, n);
    debug_assert_eq!(out.cols, m.n_out);
    debug_assert_eq!(x.cols, m.k);
    m.apply(&x.data[..n * m.k], &mut out.data);
}

/// `out = x · W[rows]ᵀ` for the `n` rows of `x` (`[n × k]`, `out` `[n × rows.len()]`)
/// and a range of rows of a matrix or stacked-matrix weight (one expert of a 3-D tensor),
/// computed exactly as [`matmul`] computes those rows.
pub fn matmul_rows(
    be: &CpuBackend,
    x: &[f32],
    w: &CpuWeight,
    rows: std::ops::Range<usize>,
    n: usize,
    out: &mut [f32],
) {
    let mut m = Matmul::new(be, w, n);
    m.data = &m.data[rows.start * m.row_bytes..rows.end * m.row_bytes];
    m.n_out = rows.len();
    // The repacked groups are laid out for the whole matrix.
    m.packed = None;
    m.apply(&x[..n * m.k], out);
}

impl Matmul<'_> {
    /// The product with llama.cpp's numerics where the backend has them: the input rounded
    /// to the weight's activation format, then integer kernels where there are some, else
    /// f32 kernels on the rounded values.
    fn apply(&self, x: &[f32], out: &mut [f32]) {
        if self.be.numerics == Numerics::Ggml
            && let Some(act) = numerics::activation_type(self.ty)
        {
            if self.integer_act() == Some(act) {
                self.integer(act, x, out);
            } else {
                ROUNDED_X.with_borrow_mut(|(bytes, rounded)| {
                    numerics::round_trip(act, x, bytes, rounded);
                    self.run(rounded, out);
                });
            }
            return;
        }
        self.run(x, out);
    }
}

thread_local! {
    /// The current matmul's input rounded as llama.cpp rounds it (`Numerics::Ggml`), and
    /// its quantized form; grown once, then reused.
    static ROUNDED_X: std::cell::RefCell<(Vec<u8>, Vec<f32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Several products of one input `x` (`[n × k]`) with the integer kernels, as one
/// parallel loop over all their rows with the input quantized once: Q, K and V (with
/// their biases), or gate and up with the gated activation applied in the same tasks.
/// Each (row, token) value is computed exactly as [`matmul`] computes it. Returns false,
/// having done nothing, where some weight cannot take the integer path with the same
/// activation format as the others (the caller then runs the separate operations).
pub fn integer_multi(
    be: &CpuBackend,
    x: &CpuTensor,
    n: usize,
    parts: &mut [(&CpuWeight, &mut CpuTensor, Option<&[f32]>)],
    gated: Option<Activation>,
) -> bool {
    // Fixed-size arrays: a decode step allocates nothing (tests/decode_alloc.rs).
    const MAX_PARTS: usize = 3;
    assert!(
        (1..=MAX_PARTS).contains(&parts.len()),
        "1 to 3 products at once"
    );
    let mats: [Option<Matmul>; MAX_PARTS] =
        std::array::from_fn(|p| parts.get(p).map(|(w, _, _)| Matmul::new(be, w, n)));
    let part = |p: usize| mats[p].as_ref().expect("a part below parts.len()");
    let Some(act) = part(0).integer_act() else {
        return false;
    };
    if mats
        .iter()
        .flatten()
        .any(|m| m.integer_act() != Some(act) || m.k != x.cols)
        || (gated.is_some() && (parts.len() != 2 || part(0).n_out != part(1).n_out))
    {
        return false;
    }
    let k = x.cols;
    let xq_row = qdot8::activation_bytes(act, k);
    let mut outs = [SharedMut(std::ptr::null_mut()); MAX_PARTS];
    for (o, (_, t, _)) in outs.iter_mut().zip(parts.iter_mut()) {
        *o = SharedMut(t.data.as_mut_ptr());
    }
    let numerics = be.numerics;
    Q8_X.with_borrow_mut(|xq| {
        quantize_x(act, &x.data[..n * k], k, xq);
        let xq = &xq[..n * xq_row];
        // Tasks of all the parts one after the other: each thread streams its own share
        // of the rows (gate and up interleaved per task streamed 10% slower).
        let mut tasks = [0usize; MAX_PARTS];
        for (t, m) in tasks.iter_mut().zip(mats.iter().flatten()) {
            *t = m.n_out.div_ceil(FUSED_ROWS_PER_TASK);
        }
        let total = tasks.iter().sum();
        crate::pool::pool().run(total, &|mut t| {
            let mut p = 0;
            while t >= tasks[p] {
                t -= tasks[p];
                p += 1;
            }
            let m = part(p);
            let j0 = t * FUSED_ROWS_PER_TASK;
            let j1 = (j0 + FUSED_ROWS_PER_TASK).min(m.n_out);
            m.integer_rows(xq, xq_row, j0, j1, outs[p]);
        });
    });
    if let Some(activation) = gated {
        let (g, u) = parts.split_at_mut(1);
        let len = n * g[0].1.cols;
        let (g, u) = (&mut g[0].1.data[..len], &u[0].1.data[..len]);
        // In as many pieces as threads, each a multiple of 16 values.
        let threads = crate::pool::pool().threads();
        let piece = len.div_ceil(threads).next_multiple_of(16);
        let gp = SharedMut(g.as_mut_ptr());
        crate::pool::pool().run(len.div_ceil(piece), &|t| {
            let (a, b) = (t * piece, ((t + 1) * piece).min(len));
            // SAFETY: values a..b of the gate belong to this task alone.
            let g = unsafe { std::slice::from_raw_parts_mut(gp.at(a), b - a) };
            gate_values(numerics, g, &u[a..b], activation);
        });
    }
    for (_, out, bias) in parts.iter_mut() {
        if let Some(b) = bias {
            let c = out.cols;
            for row in out.data[..n * c].chunks_exact_mut(c) {
                row.iter_mut().zip(*b).for_each(|(v, b)| *v += b);
            }
        }
    }
    true
}

/// One matmul's shape and weight bytes.
struct Matmul<'a> {
    be: &'a CpuBackend,
    ty: kestrel_gguf::GgmlType,
    data: &'a [u8],
    /// The rows' whole groups of 16 repacked (`packed.rs`), where the weight has them.
    packed: Option<&'a [u8]>,
    row_bytes: usize,
    k: usize,
    n: usize,
    n_out: usize,
}

impl<'a> Matmul<'a> {
    fn new(be: &'a CpuBackend, w: &'a CpuWeight, n: usize) -> Matmul<'a> {
        let (ty, n_out, k, data) = matrix(w);
        let packed = match w {
            CpuWeight::Matrix {
                packed: Some(p), ..
            } => Some(p.bytes()),
            _ => None,
        };
        Matmul {
            be,
            ty,
            data,
            packed,
            row_bytes: ty.bytes_for(k as u64).unwrap_or(0) as usize,
            k,
            n,
            n_out,
        }
    }

    /// The activation format of this product's integer kernels, where it takes them
    /// (llama.cpp's numerics, fast kernels, a supported type, whole activation blocks).
    fn integer_act(&self) -> Option<kestrel_gguf::GgmlType> {
        let act = numerics::activation_type(self.ty)?;
        (self.be.numerics == Numerics::Ggml
            && self.be.kernels == Kernels::Fast
            && qdot8::supported(self.ty)
            && self.k.is_multiple_of(act.block_size()))
        .then_some(act)
    }

    /// `out[i][j] = row_j · x_i` with f32 activations.
    fn run(&self, x: &[f32], out: &mut [f32]) {
        let Matmul {
            be,
            ty,
            data,
            row_bytes,
            k,
            n,
            n_out,
            ..
        } = *self;
        if be.kernels == Kernels::Scalar {
            for i in 0..n {
                let xi = &x[i * k..(i + 1) * k];
                for j in 0..n_out {
                    out[i * n_out + j] =
                        kestrel_quant::vec_dot(ty, &data[j * row_bytes..(j + 1) * row_bytes], xi);
                }
            }
            return;
        }
        let isa = be.isa;
        // With llama.cpp's rounding, a last-bit difference in one token's product can flip
        // a later 8-bit rounding and grow, so a token's result must not depend on how
        // many tokens share the step: one kernel, one order of additions, for any batch.
        let batch_invariant = be.numerics == Numerics::Ggml;
        if (n <= FUSED_MAX_TOKENS || batch_invariant) && qdot::supported(isa, ty) {
            self.fused(x, out);
        } else {
            self.grouped(x, out, batch_invariant);
        }
    }

    /// Each task takes a group of weight rows, dequantizes them once and multiplies them
    /// with every token, writing its own columns of the output. `batch_invariant`
    /// computes every (row, token) pair with the same one-row, one-token kernel (no
    /// register tiles, whose order of additions differs).
    fn grouped(&self, x: &[f32], out: &mut [f32], batch_invariant: bool) {
        let Matmul {
            be,
            ty,
            data,
            row_bytes,
            k,
            n,
            n_out,
            ..
        } = *self;
        let isa = be.isa;
        const GROUP: usize = 16;
        let out_ptr = SharedMut(out.as_mut_ptr());
        let n_groups = n_out.div_ceil(GROUP);
        crate::pool::pool().run(n_groups, &|g| {
            // Per-thread dequantization scratch, grown once (no allocation per step).
            DEQUANT_SCRATCH.with_borrow_mut(|scratch| {
                if scratch.len() < GROUP * k {
                    scratch.resize(GROUP * k, 0.0);
                }
                let j0 = g * GROUP;
                let j1 = (j0 + GROUP).min(n_out);
                for j in j0..j1 {
                    let dst = &mut scratch[(j - j0) * k..(j - j0 + 1) * k];
                    let _ = kestrel_quant::dequantize_row(
                        ty,
                        &data[j * row_bytes..(j + 1) * row_bytes],
                        dst,
                    );
                }
                let r = |jj: usize| &scratch[(jj - j0) * k..(jj - j0 + 1) * k];
                // Full 4-token × 4-row tiles first; the rest of the tokens below.
                let n_tiled = if j1 - j0 >= 4 && !batch_invariant {
                    n / 4 * 4
                } else {
                    0
                };
                for i in (0..n_tiled).step_by(4) {
                    let xs = [0, 1, 2, 3].map(|t| &x[(i + t) * k..(i + t + 1) * k]);
                    let mut j = j0;
                    while j < j1 {
                        if j + 4 <= j1 {
                            let d = gemm::tile4x4(isa, [r(j), r(j + 1), r(j + 2), r(j + 3)], xs);
                            for (t, row) in d.iter().enumerate() {
                                for (c, &v) in row.iter().enumerate() {
                                    // SAFETY: column j + c of token i + t belongs to this task.
                                    unsafe { *out_ptr.at((i + t) * n_out + j + c) = v };
                                }
                            }
                            j += 4;
                        } else {
                            for (t, xt) in xs.iter().enumerate() {
                                let v = simd::dot(isa, r(j), xt);
                                // SAFETY: as above.
                                unsafe { *out_ptr.at((i + t) * n_out + j) = v };
                            }
                            j += 1;
                        }
                    }
                }
                for i in n_tiled..n {
                    let xi = &x[i * k..(i + 1) * k];
                    let mut j = j0;
                    while j < j1 {
                        if j + 4 <= j1 && !batch_invariant {
                            let d = simd::dot4(isa, [r(j), r(j + 1), r(j + 2), r(j + 3)], xi);
                            for (t, v) in d.into_iter().enumerate() {
                                // SAFETY: column j + t of row i belongs to this task alone.
                                unsafe { *out_ptr.at(i * n_out + j + t) = v };
                            }
                            j += 4;
                        } else {
                            let v = simd::dot(isa, r(j), xi);
                            // SAFETY: as above.
                            unsafe { *out_ptr.at(i * n_out + j) = v };
                            j += 1;
                        }
                    }
                }
            })
        });
    }

    /// `out[i][j] = row_j · x_i` with the fused quantized dot kernels, rows split into
    /// tasks across the thread pool. Allocates nothing.
    fn fused(&self, x: &[f32], out: &mut [f32]) {
        let Matmul {
            be,
            ty,
            data,
            row_bytes,
            k,
            n,
            n_out,
            ..
        } = *self;
        let isa = be.isa;
        let out_ptr = SharedMut(out.as_mut_ptr());
        let n_tasks = n_out.div_ceil(FUSED_ROWS_PER_TASK);
        crate::pool::pool().run(n_tasks, &|t| {
            let j0 = t * FUSED_ROWS_PER_TASK;
            let j1 = (j0 + FUSED_ROWS_PER_TASK).min(n_out);
            for j in j0..j1 {
                let row = &data[j * row_bytes..(j + 1) * row_bytes];
                for i in 0..n {
                    let v = qdot::dot_row(isa, ty, row, &x[i * k..(i + 1) * k]);
                    // SAFETY: column j of every row belongs to this task alone, and
                    // i * n_out + j < n * n_out = the output's used length.
                    unsafe { *out_ptr.at(i * n_out + j) = v };
                }
            }
        });
    }
}

thread_local! {
    /// Dequantized weight rows of the grouped matmul on this thread.
    static DEQUANT_SCRATCH: std::cell::RefCell<Vec<f32>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// From this many tokens a step, the repacked rows' product takes the tokens four at a time
/// (one decode of each block for four); below it, one at a time over rows still in L1 is
/// faster. 2-core EPYC (AVX-512 VNNI), Qwen2.5-Coder-1.5B Q4_K_M, `bench --verify`: steps
/// of 4 / 8 / 12 / 16 tokens 37.8 / 61.5 / 87.0 / 117.1 ms one at a time against 46.2 / 73.2
/// / 95.0 / 113.1 four at a time; pp128 275.6 t/s four at a time against 214.8. Each
/// token's values are the same either way (`packed::dot_rows`).
const PACKED_GROUPED_MIN_TOKENS: usize = 16;

/// Up to this many tokens, matmul reads each weight row straight from its quantized
/// blocks once per token (decode); larger batches dequantize row groups and reuse them.
const FUSED_MAX_TOKENS: usize = 4;

/// Output rows one fused-matmul task computes: enough work per task, and the columns a
/// task writes span whole cache lines for most of its range.
const FUSED_ROWS_PER_TASK: usize = 32;

/// Weight bytes of one row sub-tile in the integer matmul (half of a 32 KiB L1D).
const Q8_TILE_BYTES: usize = 16 * 1024;

thread_local! {
    /// The activations of the current matmul quantized to Q8_K or Q8_0; grows to the largest
    /// batch once, then is reused (no allocation per decode step).
    static Q8_X: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Matmul<'_> {
    /// `out[i][j] = row_j · q8(x_i)` with the integer kernels (`qdot8`), the activations
    /// quantized to `act`, the weight type's format (Q8_K or Q8_0).
    fn integer(&self, act: kestrel_gguf::GgmlType, x: &[f32], out: &mut [f32]) {
        let xq_row = qdot8::activation_bytes(act, self.k);
        let n_out = self.n_out;
        Q8_X.with_borrow_mut(|xq| {
            quantize_x(act, x, self.k, xq);
            let xq = &xq[..self.n * xq_row];
            let out_ptr = SharedMut(out.as_mut_ptr());
            crate::pool::pool().run(n_out.div_ceil(FUSED_ROWS_PER_TASK), &|t| {
                let j0 = t * FUSED_ROWS_PER_TASK;
                self.integer_rows(
                    xq,
                    xq_row,
                    j0,
                    (j0 + FUSED_ROWS_PER_TASK).min(n_out),
                    out_ptr,
                );
            });
        });
    }

    /// Rows `j0..j1` of the integer product for every token: `out[i][j] = row_j · xq_i`,
    /// `xq` holding the tokens' quantized activations, `xq_row` bytes each. The caller
    /// gives these columns of `out` (`[n × n_out]`) to this call alone.
    fn integer_rows(&self, xq: &[u8], xq_row: usize, j0: usize, j1: usize, out: SharedMut<f32>) {
        let row_bytes = self.row_bytes;
        let mut j0 = j0;
        if let Some(packed) = self.packed {
            // Whole groups of 16 repacked rows (tasks start at multiples of 16).
            let group_bytes = packed::group_bytes(self.ty, self.k);
            while j0.is_multiple_of(packed::ROWS) && j0 + packed::ROWS <= j1 {
                let group = &packed[j0 / packed::ROWS * group_bytes..][..group_bytes];
                let i = if self.n >= PACKED_GROUPED_MIN_TOKENS {
                    self.packed_tokens::<4>(group, xq, xq_row, 0, j0, out)
                } else {
                    0
                };
                self.packed_tokens::<1>(group, xq, xq_row, i, j0, out);
                j0 += packed::ROWS;
            }
        }
        // Sub-tiles of rows small enough to stay in L1 while every token passes over
        // them, so each token's activations are read once per sub-tile, not per row.
        let tile = (Q8_TILE_BYTES / row_bytes.max(1)).max(1);
        for t0 in (j0..j1).step_by(tile) {
            let t1 = (t0 + tile).min(j1);
            // Eight tokens per decoded weight block (16 measured no faster for Q5_0).
            let i = self.token_groups::<8>(xq, xq_row, 0, t0..t1, out);
            let i = self.token_groups::<4>(xq, xq_row, i, t0..t1, out);
            self.token_groups::<1>(xq, xq_row, i, t0..t1, out);
        }
    }

    /// The 16 rows `j..j + 16` of the integer product, repacked as `group`, for tokens
    /// `i0..` in whole groups of `N`, as many as fit; returns the first token left.
    fn packed_tokens<const N: usize>(
        &self,
        group: &[u8],
        xq: &[u8],
        xq_row: usize,
        i0: usize,
        j: usize,
        out: SharedMut<f32>,
    ) -> usize {
        let (n, n_out) = (self.n, self.n_out);
        let i1 = i0 + (n - i0) / N * N;
        for i in (i0..i1).step_by(N) {
            let ys: [&[u8]; N] =
                std::array::from_fn(|t| &xq[(i + t) * xq_row..(i + t + 1) * xq_row]);
            let v = packed::dot_rows(self.ty, group, ys);
            for (t, rows) in v.iter().enumerate() {
                // SAFETY: columns j..j + 16 of every row belong to this call alone (the
                // caller's guarantee), j + 16 <= n_out and token i + t < n.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        rows.as_ptr(),
                        out.at((i + t) * n_out + j),
                        packed::ROWS,
                    )
                };
            }
        }
        i1
    }

    /// Rows `rows` of the integer product for tokens `i0..` in whole groups of `N`
    /// (`qdot8::dot_rows`: each weight block decoded once per group), as many as fit;
    /// returns the first token left. Each token's values are the same for any `N`.
    fn token_groups<const N: usize>(
        &self,
        xq: &[u8],
        xq_row: usize,
        i0: usize,
        rows: std::ops::Range<usize>,
        out: SharedMut<f32>,
    ) -> usize {
        let Matmul {
            ty,
            data,
            row_bytes,
            n,
            n_out,
            ..
        } = *self;
        let i1 = i0 + (n - i0) / N * N;
        for i in (i0..i1).step_by(N) {
            let ys: [&[u8]; N] =
                std::array::from_fn(|t| &xq[(i + t) * xq_row..(i + t + 1) * xq_row]);
            for j in rows.clone() {
                let row = &data[j * row_bytes..(j + 1) * row_bytes];
                let v = qdot8::dot_rows(ty, row, ys);
                for (t, v) in v.into_iter().enumerate() {
                    // SAFETY: column j of every row belongs to this call alone (the
                    // caller's guarantee), and token i + t < n.
                    unsafe { *out.at((i + t) * n_out + j) = v };
                }
            }
        }
        i1
    }
}

/// Quantizes `n` tokens' activations (`x`, rows of `k`) to `act` into `xq` (grown as
/// needed), one row of `qdot8::activation_bytes(act, k)` bytes per token.
fn quantize_x(act: kestrel_gguf::GgmlType, x: &[f32], k: usize, xq: &mut Vec<u8>) {
    let xq_row = qdot8::activation_bytes(act, k);
    let n = x.len() / k;
    if xq.len() < n * xq_row {
        xq.resize(n * xq_row, 0);
    }
    crate::profile::timed(
        || crate::profile::op("quantize_x", n),
        0,
        || {
            if n < 8 {
                for (src, dst) in x.chunks_exact(k).zip(xq.chunks_exact_mut(xq_row)) {
                    qdot8::quantize_activations(act, src, dst);
                }
                return;
            }
            // A prompt's tokens on all threads (each token's bytes are the same either way).
            let dst = SharedMut(xq.as_mut_ptr());
            crate::pool::pool().run(n, &|i| {
                // SAFETY: row i of the buffer (which holds n rows) is written by this task
                // alone.
                let d = unsafe { std::slice::from_raw_parts_mut(dst.at(i * xq_row), xq_row) };
                qdot8::quantize_activations(act, &x[i * k..(i + 1) * k], d);
            });
        },
    );
}

/// cos/sin of each rotated pair at one position, as ggml computes them (f32 throughout,
/// the angle advanced by repeated multiplication).
fn rope_cache(rope: &RopeParams, pos: u32, cache: &mut Vec<(f32, f32)>) {
    let n_rot = rope.n_rot;
    let c = rope.constants();
    cache.clear();
    let mut theta_extrap = pos as f32;
    for i in 0..n_rot / 2 {
        let factor = rope.freq_factors.as_ref().map_or(1.0, |f| f[i]);
        let extrap = theta_extrap / factor;
        let interp = c.freq_scale * extrap;
        let mut theta = interp;
        if c.ext_factor != 0.0 {
            let y = (i as f32 - c.corr_lo) / (c.corr_hi - c.corr_lo).max(0.001);
            let ramp = (1.0 - y.clamp(0.0, 1.0)) * c.ext_factor;
            theta = interp * (1.0 - ramp) + extrap * ramp;
        }
        cache.push((theta.cos() * c.mscale, theta.sin() * c.mscale));
        theta_extrap *= c.theta_scale;
    }
}

pub fn rope(x: &mut CpuTensor, head_dim: usize, rope: &RopeParams, positions: &[u32], n: usize) {
    let c = x.cols;
    let half = rope.n_rot / 2;
    let rows = SharedMut(x.data[..n * c].as_mut_ptr());
    let positions = &positions[..n];
    crate::pool::pool().run(n, &|t| {
        // SAFETY: row t of the first n rows belongs to this task alone.
        let row = unsafe { std::slice::from_raw_parts_mut(rows.at(t * c), c) };
        let pos = positions[t];
        // Per-thread angle table, grown once (no allocation per decode step).
        ROPE_ANGLES.with_borrow_mut(|cs| {
            rope_cache(rope, pos, cs);
            for head in row.chunks_exact_mut(head_dim) {
                for (i, &(cos, sin)) in cs.iter().enumerate() {
                    let (a, b) = if rope.neox {
                        (i, i + half)
                    } else {
                        (2 * i, 2 * i + 1)
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * cos - x1 * sin;
                    head[b] = x0 * sin + x1 * cos;
                }
            }
        })
    });
}

thread_local! {
    /// (cos, sin) per rotated pair of the token being rotated.
    static ROPE_ANGLES: std::cell::RefCell<Vec<(f32, f32)>> =
        const { std::cell::RefCell::new(Vec::new()) };
    /// Attention scratch of this thread, grown to the longest context once.
    static ATTN_SCRATCH: std::cell::RefCell<AttnScratch> =
        const { std::cell::RefCell::new(AttnScratch {
            kv_row: Vec::new(),
            scores: Vec::new(),
            q_row: Vec::new(),
            q_bytes: Vec::new(),
        }) };
}

/// Cache slot of a position in a sequence's block table.
fn slot(block_table: &[u32], block_size: usize, pos: usize) -> usize {
    block_table[pos / block_size] as usize * block_size + pos % block_size
}

/// Writes each token's key and value rows into its slot, in the cache's storage types
/// (quantized by the quantizer ggml's CPU backend uses, see [`numerics::quantize_like_ggml`]).
pub fn store_kv(
    cache: &mut CpuCache,
    layer: usize,
    k: &CpuTensor,
    v: &CpuTensor,
    batch: &Batch,
    n: usize,
) {
    let d = cache.kv_dim;
    let (kb, vb) = cache.row_bytes();
    // The CPU cache holds ggml types only (`new_cache_typed` checks): nothing else comes.
    let (Some(kt), Some(vt)) = (cache.types.k.ggml(), cache.types.v.ggml()) else {
        return;
    };
    for i in 0..n {
        let seq = &batch.seqs[batch.seq_of[i] as usize];
        let s = slot(
            &seq.block_table,
            cache.block_size,
            batch.positions[i] as usize,
        );
        // The sizes were checked when the cache was made: these cannot fail.
        let stored = numerics::quantize_like_ggml(
            kt,
            &k.data[i * d..(i + 1) * d],
            &mut cache.k[layer][s * kb..(s + 1) * kb],
        ) && numerics::quantize_like_ggml(
            vt,
            &v.data[i * d..(i + 1) * d],
            &mut cache.v[layer][s * vb..(s + 1) * vb],
        );
        debug_assert!(stored, "KV rows of {d} values do not fit {kt}/{vt} slots");
    }
}

/// Scratch of one attention task.
#[derive(Default)]
struct AttnScratch {
    kv_row: Vec<f32>,
    scores: Vec<f32>,
    /// The query rounded to the keys' dot-product format (`Numerics::Ggml`).
    q_row: Vec<f32>,
    q_bytes: Vec<u8>,
}

#[allow(clippy::too_many_arguments)]
pub fn attention(
    be: &CpuBackend,
    q: &CpuTensor,
    cache: &CpuCache,
    p: &AttnParams,
    sinks: Option<&[f32]>,
    batch: &Batch,
    n: usize,
    out: &mut CpuTensor,
) {
    let isa = be.isa;
    let hd = p.head_dim;
    let group = p.n_head / p.n_head_kv;
    let q_cols = q.cols;
    let (kc, vc) = (&cache.k[p.layer], &cache.v[p.layer]);
    // The CPU cache holds ggml types only (`new_cache_typed` checks): nothing else comes.
    let (Some(kt), Some(vt)) = (cache.types.k.ggml(), cache.types.v.ggml()) else {
        return;
    };
    let (k_row, v_row) = cache.row_bytes();
    // Bytes of one head's slice of a row (whole blocks: checked when the cache was made).
    let (k_head, v_head) = (cache.types.k.bytes(hd), cache.types.v.bytes(hd));
    // llama.cpp rounds the query to the keys' dot-product format (f16 for f16 keys, Q8_0
    // for Q8_0 and Q4_0 keys), and the probabilities to f16 for f16 values only (its
    // other value types are converted to f32 rows and weighted in f32).
    let ggml = be.numerics == Numerics::Ggml;
    let q_type = numerics::activation_type(kt).unwrap_or(kt);
    let round_probs = ggml && vt == kestrel_gguf::GgmlType::F16;
    let oc = out.cols;
    // Token i's heads sharing kv head g (`o`: their `group * hd` outputs).
    let per_task = |scr: &mut AttnScratch, i: usize, g: usize, o: &mut [f32]| {
        let seq = &batch.seqs[batch.seq_of[i] as usize];
        let pos = batch.positions[i] as usize;
        let lo = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let len = pos + 1 - lo;
        let heads = g * group * hd..(g + 1) * group * hd;
        let mut qi = &q.data[i * q_cols..(i + 1) * q_cols][heads];
        if ggml {
            numerics::round_trip(q_type, qi, &mut scr.q_bytes, &mut scr.q_row);
            qi = &scr.q_row;
        }
        o.fill(0.0);
        scr.kv_row.resize(hd, 0.0);
        scr.scores.resize(group * len, 0.0);
        // Scores of the heads sharing kv head g.
        for (t, kp) in (lo..=pos).enumerate() {
            let s = slot(&seq.block_table, cache.block_size, kp) * k_row + g * k_head;
            decode(kt, &kc[s..s + k_head], &mut scr.kv_row);
            for h in 0..group {
                let qh = &qi[h * hd..(h + 1) * hd];
                scr.scores[h * len + t] = simd::dot(isa, qh, &scr.kv_row) * p.scale;
            }
        }
        for h in 0..group {
            let sc = &mut scr.scores[h * len..(h + 1) * len];
            // A head's sink logit counts in the softmax's maximum and denominator only.
            let sink = sinks.map(|s| s[g * group + h]);
            let max = sc
                .iter()
                .copied()
                .chain(sink)
                .fold(f32::NEG_INFINITY, f32::max);
            let mut sum = sink.map_or(0.0, |s| (s - max).exp());
            sc.iter_mut().for_each(|v| {
                *v = (*v - max).exp();
                sum += *v;
            });
            let inv = 1.0 / sum;
            if round_probs {
                sc.iter_mut()
                    .for_each(|v| *v = numerics::round_f16(*v * inv));
            } else {
                sc.iter_mut().for_each(|v| *v *= inv);
            }
        }
        for (t, kp) in (lo..=pos).enumerate() {
            let s = slot(&seq.block_table, cache.block_size, kp) * v_row + g * v_head;
            decode(vt, &vc[s..s + v_head], &mut scr.kv_row);
            for h in 0..group {
                let w = scr.scores[h * len + t];
                simd::axpy(isa, w, &scr.kv_row, &mut o[h * hd..(h + 1) * hd]);
            }
        }
    };
    let n_kv = p.n_head_kv;
    if be.kernels == Kernels::Scalar {
        let mut scr = AttnScratch::default();
        for (i, o) in out.data[..n * oc].chunks_exact_mut(oc).enumerate() {
            for (g, og) in o[..n_kv * group * hd]
                .chunks_exact_mut(group * hd)
                .enumerate()
            {
                per_task(&mut scr, i, g, og);
            }
        }
    } else {
        // One task per token and kv head: a decode step's heads spread over the threads.
        let out_ptr = SharedMut(out.data.as_mut_ptr());
        crate::pool::pool().run(n * n_kv, &|task| {
            let (i, g) = (task / n_kv, task % n_kv);
            // SAFETY: the outputs of token i's heads sharing kv head g belong to this
            // task alone, inside the output's first n rows.
            let o = unsafe {
                std::slice::from_raw_parts_mut(out_ptr.at(i * oc + g * group * hd), group * hd)
            };
            ATTN_SCRATCH.with_borrow_mut(|scr| per_task(scr, i, g, o));
        });
    }
}

/// One head's keys or values of one position, from the cache's bytes to f32 (exact for
/// every storage type; f16 through F16C where the CPU has it).
#[inline]
fn decode(ty: kestrel_gguf::GgmlType, src: &[u8], out: &mut [f32]) {
    // The cache's sizes were checked when it was made: this cannot fail.
    let decoded = kestrel_quant::dequantize_row(ty, src, out);
    debug_assert!(decoded.is_ok(), "{decoded:?}");
}

pub fn gated_activation(
    numerics: Numerics,
    gate: &mut CpuTensor,
    up: &CpuTensor,
    act: Activation,
    n: usize,
) {
    let len = n * gate.cols;
    gate_values(numerics, &mut gate.data[..len], &up.data[..len], act);
}

/// `g = act(g) * u`, element by element.
pub(crate) fn gate_values(numerics: Numerics, g: &mut [f32], u: &[f32], act: Activation) {
    match (act, numerics) {
        (Activation::Silu, _) => g
            .iter_mut()
            .zip(u)
            .for_each(|(g, u)| *g = *g / (1.0 + (-*g).exp()) * u),
        (Activation::GeluTanh, Numerics::F32) => g
            .iter_mut()
            .zip(u)
            .for_each(|(g, u)| *g = numerics::gelu_f32(*g) * u),
        (Activation::GeluTanh, Numerics::Ggml) => g
            .iter_mut()
            .zip(u)
            .for_each(|(g, u)| *g = numerics::gelu_ggml(*g) * u),
    }
}
