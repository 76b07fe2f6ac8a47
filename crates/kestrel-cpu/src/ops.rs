//! The CPU implementations of the backend operations.

use half::f16;
use kestrel_model::{Activation, AttnParams, Batch, RopeParams, RopeScaling};
use rayon::prelude::*;

use crate::simd;
use crate::{CpuBackend, CpuCache, CpuTensor, CpuWeight, Kernels};

/// A pointer that tasks writing disjoint elements of one buffer may share.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: only used to write disjoint elements from different tasks.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

/// Splits a matrix weight into what the kernels need: type, rows, row length, bytes.
fn matrix(w: &CpuWeight) -> (kestrel_gguf::GgmlType, usize, usize, &[u8]) {
    match w {
        CpuWeight::Matrix {
            file,
            info,
            ty,
            rows,
            cols,
        } => (*ty, *rows, *cols, file.tensor_data(info)),
        // Shapes are checked when the model loads: 2-D tensors are always matrices.
        CpuWeight::Vector(_) => unreachable!("a vector weight used as a matrix"),
    }
}

pub fn embed(table: &CpuWeight, tokens: &[u32], out: &mut CpuTensor) {
    let (ty, _rows, cols, data) = matrix(table);
    let row_bytes = ty.bytes_for(cols as u64).unwrap_or(0) as usize;
    for (i, &t) in tokens.iter().enumerate() {
        let src = &data[t as usize * row_bytes..(t as usize + 1) * row_bytes];
        // Row lengths were validated at load; the token ids by the batch check.
        let _ = kestrel_quant::dequantize_row(ty, src, &mut out.data[i * cols..(i + 1) * cols]);
    }
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
    let (ty, n_out, k, data) = matrix(w);
    debug_assert_eq!(out.cols, n_out);
    debug_assert_eq!(x.cols, k);
    let row_bytes = ty.bytes_for(k as u64).unwrap_or(0) as usize;
    let x = &x.data[..n * k];
    // EXPERIMENT: emulate llama.cpp's 8-bit activation rounding.
    let xq: Vec<f32>;
    let x = if std::env::var_os("KESTREL_EMULATE_Q8").is_some() {
        use kestrel_gguf::GgmlType as T;
        let vt = match ty {
            T::Q4_0 | T::Q5_0 | T::Q8_0 => Some(T::Q8_0),
            T::Q4_1 | T::Q5_1 => Some(T::Q8_1),
            T::Q2K | T::Q3K | T::Q4K | T::Q5K | T::Q6K => Some(T::Q8K),
            _ => None,
        };
        match vt {
            Some(vt) => {
                let q = kestrel_quant::quantize(vt, x, k).unwrap();
                xq = kestrel_quant::dequantize(vt, &q).unwrap();
                &xq[..]
            }
            None => x,
        }
    } else {
        x
    };
    if be.kernels == Kernels::Scalar {
        for i in 0..n {
            let xi = &x[i * k..(i + 1) * k];
            for j in 0..n_out {
                out.data[i * n_out + j] =
                    kestrel_quant::vec_dot(ty, &data[j * row_bytes..(j + 1) * row_bytes], xi);
            }
        }
        return;
    }

    // Each task takes a group of weight rows, dequantizes them once and multiplies them
    // with every token, writing its own columns of the output.
    const GROUP: usize = 16;
    let isa = be.isa;
    let out_ptr = SharedOut(out.data.as_mut_ptr());
    let n_groups = n_out.div_ceil(GROUP);
    (0..n_groups).into_par_iter().for_each_init(
        || vec![0f32; GROUP * k],
        |scratch, g| {
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
            let out_ptr = out_ptr;
            for i in 0..n {
                let xi = &x[i * k..(i + 1) * k];
                let mut j = j0;
                while j < j1 {
                    let r = |jj: usize| &scratch[(jj - j0) * k..(jj - j0 + 1) * k];
                    if j + 4 <= j1 {
                        let d = simd::dot4(isa, [r(j), r(j + 1), r(j + 2), r(j + 3)], xi);
                        for (t, v) in d.into_iter().enumerate() {
                            // SAFETY: column j + t of row i belongs to this task alone.
                            unsafe { *out_ptr.0.add(i * n_out + j + t) = v };
                        }
                        j += 4;
                    } else {
                        let v = simd::dot(isa, r(j), xi);
                        // SAFETY: as above.
                        unsafe { *out_ptr.0.add(i * n_out + j) = v };
                        j += 1;
                    }
                }
            }
        },
    );
}

/// cos/sin of each rotated pair at one position, as ggml computes them (f32 throughout,
/// the angle advanced by repeated multiplication).
fn rope_cache(rope: &RopeParams, pos: u32, cache: &mut Vec<(f32, f32)>) {
    let n_rot = rope.n_rot;
    let theta_scale = rope.base.powf(-2.0 / n_rot as f32);
    let freq_scale = rope.freq_scale();
    let (ext_factor, attn_factor, corr) = match rope.scaling {
        RopeScaling::Yarn {
            orig_ctx,
            ext_factor,
            attn_factor,
            beta_fast,
            beta_slow,
            ..
        } => {
            let corr_dim = |n_rotations: f32| {
                n_rot as f32 * (orig_ctx as f32 / (n_rotations * 2.0 * std::f32::consts::PI)).ln()
                    / (2.0 * rope.base.ln())
            };
            let lo = corr_dim(beta_fast).floor().max(0.0);
            let hi = corr_dim(beta_slow).ceil().min(n_rot as f32 - 1.0);
            (ext_factor, attn_factor, (lo, hi))
        }
        _ => (0.0, 1.0, (0.0, 0.0)),
    };
    cache.clear();
    let mut theta_extrap = pos as f32;
    for i in 0..n_rot / 2 {
        let factor = rope.freq_factors.as_ref().map_or(1.0, |f| f[i]);
        let extrap = theta_extrap / factor;
        let interp = freq_scale * extrap;
        let (mut theta, mut mscale) = (interp, attn_factor);
        if ext_factor != 0.0 {
            let y = (i as f32 - corr.0) / (corr.1 - corr.0).max(0.001);
            let ramp = (1.0 - y.clamp(0.0, 1.0)) * ext_factor;
            theta = interp * (1.0 - ramp) + extrap * ramp;
            mscale *= 1.0 + 0.1 * (1.0 / freq_scale).ln();
        }
        cache.push((theta.cos() * mscale, theta.sin() * mscale));
        theta_extrap *= theta_scale;
    }
}

pub fn rope(x: &mut CpuTensor, head_dim: usize, rope: &RopeParams, positions: &[u32], n: usize) {
    let c = x.cols;
    let half = rope.n_rot / 2;
    x.data[..n * c]
        .par_chunks_exact_mut(c)
        .zip(&positions[..n])
        .for_each_init(Vec::new, |cs, (row, &pos)| {
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
        });
}

/// Cache slot of a position in a sequence's block table.
fn slot(block_table: &[u32], block_size: usize, pos: usize) -> usize {
    block_table[pos / block_size] as usize * block_size + pos % block_size
}

pub fn store_kv(
    cache: &mut CpuCache,
    layer: usize,
    k: &CpuTensor,
    v: &CpuTensor,
    batch: &Batch,
    n: usize,
) {
    let d = cache.kv_dim;
    for i in 0..n {
        let seq = &batch.seqs[batch.seq_of[i] as usize];
        let s = slot(
            &seq.block_table,
            cache.block_size,
            batch.positions[i] as usize,
        );
        for (dst, src) in cache.k[layer][s * d..(s + 1) * d]
            .iter_mut()
            .zip(&k.data[i * d..(i + 1) * d])
        {
            *dst = f16::from_f32(*src);
        }
        for (dst, src) in cache.v[layer][s * d..(s + 1) * d]
            .iter_mut()
            .zip(&v.data[i * d..(i + 1) * d])
        {
            *dst = f16::from_f32(*src);
        }
    }
}

/// Scratch of one attention task.
#[derive(Default)]
struct AttnScratch {
    kv_row: Vec<f32>,
    scores: Vec<f32>,
}

pub fn attention(
    be: &CpuBackend,
    q: &CpuTensor,
    cache: &CpuCache,
    p: &AttnParams,
    batch: &Batch,
    n: usize,
    out: &mut CpuTensor,
) {
    let isa = be.isa;
    let hd = p.head_dim;
    let group = p.n_head / p.n_head_kv;
    let q_cols = q.cols;
    let kv_dim = cache.kv_dim;
    let (kc, vc) = (&cache.k[p.layer], &cache.v[p.layer]);
    let per_token = |scr: &mut AttnScratch, i: usize, o: &mut [f32]| {
        let seq = &batch.seqs[batch.seq_of[i] as usize];
        let pos = batch.positions[i] as usize;
        let lo = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let len = pos + 1 - lo;
        let qi = &q.data[i * q_cols..(i + 1) * q_cols];
        o.fill(0.0);
        scr.kv_row.resize(hd, 0.0);
        scr.scores.resize(group * len, 0.0);
        for g in 0..p.n_head_kv {
            // Scores of the heads sharing kv head g.
            for (t, kp) in (lo..=pos).enumerate() {
                let s = slot(&seq.block_table, cache.block_size, kp);
                let src = &kc[s * kv_dim + g * hd..s * kv_dim + (g + 1) * hd];
                scr.kv_row
                    .iter_mut()
                    .zip(src)
                    .for_each(|(d, v)| *d = v.to_f32());
                for h in 0..group {
                    let head = g * group + h;
                    let qh = &qi[head * hd..(head + 1) * hd];
                    scr.scores[h * len + t] = simd::dot(isa, qh, &scr.kv_row) * p.scale;
                }
            }
            for h in 0..group {
                let sc = &mut scr.scores[h * len..(h + 1) * len];
                let max = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0;
                sc.iter_mut().for_each(|v| {
                    *v = (*v - max).exp();
                    sum += *v;
                });
                let inv = 1.0 / sum;
                sc.iter_mut().for_each(|v| *v *= inv);
            }
            for (t, kp) in (lo..=pos).enumerate() {
                let s = slot(&seq.block_table, cache.block_size, kp);
                let src = &vc[s * kv_dim + g * hd..s * kv_dim + (g + 1) * hd];
                scr.kv_row
                    .iter_mut()
                    .zip(src)
                    .for_each(|(d, v)| *d = v.to_f32());
                for h in 0..group {
                    let head = g * group + h;
                    let w = scr.scores[h * len + t];
                    simd::axpy(isa, w, &scr.kv_row, &mut o[head * hd..(head + 1) * hd]);
                }
            }
        }
    };
    let oc = out.cols;
    let rows = out.data[..n * oc].chunks_exact_mut(oc).enumerate();
    if be.kernels == Kernels::Scalar {
        let mut scr = AttnScratch::default();
        rows.for_each(|(i, o)| per_token(&mut scr, i, o));
    } else {
        out.data[..n * oc]
            .par_chunks_exact_mut(oc)
            .enumerate()
            .for_each_init(AttnScratch::default, |scr, (i, o)| per_token(scr, i, o));
    }
}

pub fn gated_activation(gate: &mut CpuTensor, up: &CpuTensor, act: Activation, n: usize) {
    let len = n * gate.cols;
    let g = &mut gate.data[..len];
    let u = &up.data[..len];
    match act {
        Activation::Silu => g
            .iter_mut()
            .zip(u)
            .for_each(|(g, u)| *g = *g / (1.0 + (-*g).exp()) * u),
        Activation::GeluTanh => {
            const SQRT_2_OVER_PI: f32 = 0.797_884_6;
            const COEF_A: f32 = 0.044_715;
            g.iter_mut().zip(u).for_each(|(g, u)| {
                let x = *g;
                let gelu = 0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + COEF_A * x * x)).tanh());
                *g = gelu * u;
            })
        }
    }
}
