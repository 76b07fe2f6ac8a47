//! Quantization with an importance matrix: ggml's `quantize_q*` with `quant_weights`
//! (`quantize_row_*_impl` in ggml-quants.c), which llama-quantize calls when given
//! `--imatrix`. The weights are one per column of the row (`qw.len() == row_len`), the same
//! for every row; each value's weight is `qw[j] · sqrt(σ² + x[j]²)`, σ² the row's (legacy
//! types) or the super-block's mean square. The f32 operations are ggml's, in its order,
//! so the bytes are identical.

use crate::codebook::{IQ4NL, best_index_int8};
use crate::float::{f32_to_f16, read_f16};
use crate::kquants::{
    QK_K, make_qx_quants, nearest_int, quant_q6_k_weighted, scale_min_k4, weighted_range,
};
use crate::{GgmlType, QuantError, quantize_row, row_bytes};

const GROUP_MAX_EPS: f32 = 1e-15;

fn put_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&f32_to_f16(v).to_le_bytes());
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    read_f16(&[b[at], b[at + 1]])
}

/// Whether the importance matrix changes how `ty` is quantized (ggml ignores it for the
/// other types).
pub fn uses_importance(ty: GgmlType) -> bool {
    use GgmlType as T;
    matches!(
        ty,
        T::Q4_0 | T::Q4_1 | T::Q5_0 | T::Q5_1 | T::Q2K | T::Q3K | T::Q4K | T::Q5K | T::Q6K
    ) || matches!(ty, T::IQ4NL | T::IQ4XS)
}

/// Quantizes whole rows of `row_len` values with importance weights `qw` (`row_len` of
/// them), as ggml's `ggml_quantize_chunk(…, imatrix)`. Types the weights do not affect are
/// quantized as [`quantize_row`] does.
pub fn quantize_rows_weighted(
    ty: GgmlType,
    src: &[f32],
    row_len: usize,
    qw: &[f32],
    dst: &mut [u8],
) -> Result<(), QuantError> {
    if !uses_importance(ty) {
        return quantize_row(ty, src, dst);
    }
    if row_len == 0 || !src.len().is_multiple_of(row_len) || qw.len() != row_len {
        return Err(QuantError::BadRowLength {
            n: src.len(),
            row_len,
        });
    }
    let row_size = row_bytes(ty, row_len)?;
    let n_rows = src.len() / row_len;
    if dst.len() != n_rows * row_size {
        return Err(QuantError::ByteLength {
            ty,
            n: src.len(),
            expected: n_rows * row_size,
            actual: dst.len(),
        });
    }
    for (x, out) in src
        .chunks_exact(row_len)
        .zip(dst.chunks_exact_mut(row_size))
    {
        quantize_one_row(ty, x, qw, out);
    }
    Ok(())
}

fn quantize_one_row(ty: GgmlType, x: &[f32], qw: &[f32], out: &mut [u8]) {
    use GgmlType as T;
    let bs = ty.block_size();
    let ts = ty.type_size();
    // The legacy types take σ² over the whole row.
    let row_sigma2 = || x.iter().fold(0f32, |s, &v| s + v * v) / x.len() as f32;
    match ty {
        T::Q4_0 | T::Q4_1 | T::Q5_0 | T::Q5_1 => {
            let sigma2 = row_sigma2();
            for ((xb, wb), b) in x
                .chunks_exact(32)
                .zip(qw.chunks_exact(32))
                .zip(out.chunks_exact_mut(ts))
            {
                let weight: [f32; 32] =
                    std::array::from_fn(|j| wb[j] * (sigma2 + xb[j] * xb[j]).sqrt());
                legacy_block(ty, xb, &weight, b);
            }
        }
        _ => {
            for ((xb, wb), b) in x
                .chunks_exact(bs)
                .zip(qw.chunks_exact(bs))
                .zip(out.chunks_exact_mut(ts))
            {
                match ty {
                    T::Q2K => q2_k(xb, wb, b),
                    T::Q3K => q3_k(xb, wb, b),
                    T::Q4K => q45_k(xb, wb, b, 15),
                    T::Q5K => q45_k(xb, wb, b, 31),
                    T::Q6K => {
                        if let (Ok(xb), Ok(b)) = (xb.try_into(), b.try_into()) {
                            quant_q6_k_weighted(xb, b, Some(wb));
                        }
                    }
                    T::IQ4NL => iq4(xb, wb, b, false),
                    T::IQ4XS => iq4(xb, wb, b, true),
                    _ => unreachable!("uses_importance"),
                }
            }
        }
    }
}

fn legacy_block(ty: GgmlType, xb: &[f32], weight: &[f32; 32], b: &mut [u8]) {
    use GgmlType as T;
    match ty {
        T::Q4_0 | T::Q5_0 => {
            let nmax = if ty == T::Q4_0 { 8 } else { 16 };
            let mut l = [0i8; 32];
            let d = make_qx_quants(xb, nmax, &mut l, 1, Some(weight));
            put_f16(b, 0, d);
            let qs = if ty == T::Q4_0 { 2 } else { 6 };
            let mut qh = 0u32;
            for j in 0..16 {
                let (x0, x1) = (l[j] as u8, l[j + 16] as u8);
                b[qs + j] = (x0 & 0x0f) | ((x1 & 0x0f) << 4);
                qh |= (((x0 & 0x10) >> 4) as u32) << j;
                qh |= (((x1 & 0x10) >> 4) as u32) << (j + 16);
            }
            if ty == T::Q5_0 {
                b[2..6].copy_from_slice(&qh.to_le_bytes());
            }
        }
        _ => {
            let nmax = if ty == T::Q4_1 { 15 } else { 31 };
            let mut l = [0u8; 32];
            let mut laux = [0u8; 32];
            let (d, min) = make_qkx3_quants(xb, nmax, weight, &mut l, &mut laux, -0.9, 0.05, 36);
            put_f16(b, 0, d);
            put_f16(b, 2, -min);
            let qs = if ty == T::Q4_1 { 4 } else { 8 };
            let mut qh = 0u32;
            for j in 0..16 {
                let (x0, x1) = (l[j], l[j + 16]);
                b[qs + j] = (x0 & 0x0f) | ((x1 & 0x0f) << 4);
                qh |= (((x0 & 0x10) >> 4) as u32) << j;
                qh |= (((x1 & 0x10) >> 4) as u32) << (j + 16);
            }
            if ty == T::Q5_1 {
                b[4..8].copy_from_slice(&qh.to_le_bytes());
            }
        }
    }
}

/// ggml's `make_qkx3_quants` (`use_mad` false): asymmetric quants in [0, nmax] with a
/// weighted least-squares scale and min over `nstep + 1` trial scales. Returns (scale,
/// the_min), `the_min` being minus the offset.
#[allow(clippy::too_many_arguments)]
fn make_qkx3_quants(
    x: &[f32],
    nmax: i32,
    weights: &[f32],
    l_out: &mut [u8],
    laux: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    let n = x.len();
    let (mut min, max, sum_w, sum_x) = weighted_range(x, weights);
    if max <= min {
        l_out[..n].fill(0);
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_mad = 0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min));
        l_out[i] = l.clamp(0, nmax) as u8;
        let diff = scale * l_out[i] as f32 + min - x[i];
        let diff = diff * diff;
        best_mad += weights[i] * diff;
    }
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = l as u8;
            let w = weights[i];
            let l = l as f32;
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut mad = 0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                let diff = diff * diff;
                mad += weights[i] * diff;
            }
            if mad < best_mad {
                l_out[..n].copy_from_slice(&laux[..n]);
                best_mad = mad;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// ggml's `make_qp_quants`: non-negative quants in [0, nmax] of non-negative `x` (scales or
/// mins of sub-blocks), weighted by `qw`, refined by coordinate descent. `L` holds bytes as
/// in C (a negative level would wrap, as its `uint8_t` does).
fn make_qp_quants(x: &[f32], nmax: i32, levels: &mut [u8], qw: &[f32]) -> f32 {
    let n = x.len();
    let mut max = 0f32;
    for &v in x {
        max = if max > v { max } else { v };
    }
    if max < GROUP_MAX_EPS {
        levels[..n].fill(0);
        return 0.0;
    }
    let mut iscale = nmax as f32 / max;
    for i in 0..n {
        levels[i] = nearest_int(iscale * x[i]) as u8;
    }
    let scale = 1.0 / iscale;
    let mut best_mse = 0f32;
    for i in 0..n {
        let diff = x[i] - scale * levels[i] as f32;
        best_mse += qw[i] * diff * diff;
    }
    for is in -4..=4 {
        if is == 0 {
            continue;
        }
        let iscale_is = (0.1 * is as f32 + nmax as f32) / max;
        let scale_is = 1.0 / iscale_is;
        let mut mse = 0f32;
        for i in 0..n {
            let l = nearest_int(iscale_is * x[i]).min(nmax);
            let diff = x[i] - scale_is * l as f32;
            mse += qw[i] * diff * diff;
        }
        if mse < best_mse {
            best_mse = mse;
            iscale = iscale_is;
        }
    }
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for i in 0..n {
        let l = nearest_int(iscale * x[i]).min(nmax);
        levels[i] = l as u8;
        let w = qw[i];
        sumlx += w * x[i] * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    for _ in 0..5 {
        let mut n_changed = 0;
        for i in 0..n {
            let w = qw[i];
            let li = levels[i] as f32;
            let mut slx = sumlx - w * x[i] * li;
            let mut sl2 = suml2 - w * li * li;
            if slx > 0.0 && sl2 > 0.0 {
                let new_l = nearest_int(x[i] * sl2 / slx).min(nmax);
                if new_l != levels[i] as i32 {
                    slx += w * x[i] * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if slx * slx * suml2 > sumlx * sumlx * sl2 {
                        levels[i] = new_l as u8;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed += 1;
                    }
                }
            }
        }
        if n_changed == 0 {
            break;
        }
    }
    if suml2 > 0.0 { sumlx / suml2 } else { 0.0 }
}

/// Sum of squares of a super-block, in ggml's order.
fn sum_x2(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |s, &v| s + v * v)
}

/// The `N` groups of `G` values of a super-block as ggml's weighted Q2_K / Q4_K / Q5_K
/// quantizers take them: each value weighted `qw · sqrt(sigma2 + x²)`, then
/// `make_qkx3_quants` to `nmax` levels. Returns each group's scale, min and weight sum.
fn qkx3_groups<const G: usize, const N: usize>(
    x: &[f32],
    qw: &[f32],
    sigma2: f32,
    nmax: i32,
    levels: &mut [u8; QK_K],
) -> ([f32; N], [f32; N], [f32; N]) {
    debug_assert_eq!(G * N, QK_K);
    let (mut scales, mut mins, mut sw) = ([0f32; N], [0f32; N], [0f32; N]);
    let mut laux = [0u8; G];
    for j in 0..N {
        let xs = &x[G * j..G * j + G];
        let weights: [f32; G] =
            std::array::from_fn(|l| qw[G * j + l] * (sigma2 + xs[l] * xs[l]).sqrt());
        let mut sumw = 0f32;
        for &w in &weights {
            sumw += w;
        }
        sw[j] = sumw;
        let (s, m) = make_qkx3_quants(
            xs,
            nmax,
            &weights,
            &mut levels[G * j..G * j + G],
            &mut laux,
            -0.9,
            0.05,
            36,
        );
        scales[j] = s;
        mins[j] = m;
    }
    (scales, mins, sw)
}

/// `quantize_row_q2_K_impl` for one super-block (84 bytes: scales[16], qs[64], d, dmin).
fn q2_k(x: &[f32], qw: &[f32], b: &mut [u8]) {
    let sigma2 = sum_x2(x) / QK_K as f32;
    let mut levels = [0u8; QK_K];
    let (scales, mins, sw) = qkx3_groups::<16, 16>(x, qw, sigma2, 3, &mut levels);
    let mut ls = [0u8; 16];
    let mut lm = [0u8; 16];
    let dm = make_qp_quants(&scales, 15, &mut ls, &sw);
    let mm = make_qp_quants(&mins, 15, &mut lm, &sw);
    put_f16(b, 80, dm);
    put_f16(b, 82, mm);
    let (dm, mm) = (f16_at(b, 80), f16_at(b, 82));
    for j in 0..16 {
        b[j] = ls[j] | (lm[j] << 4);
    }
    for j in 0..16 {
        let d = dm * (b[j] & 0x0f) as f32;
        if d == 0.0 {
            continue;
        }
        let m = mm * (b[j] >> 4) as f32;
        for ii in 0..16 {
            let l = nearest_int((x[16 * j + ii] + m) / d).clamp(0, 3);
            levels[16 * j + ii] = l as u8;
        }
    }
    for j in (0..QK_K).step_by(128) {
        for l in 0..32 {
            b[16 + j / 4 + l] = levels[j + l]
                | (levels[j + l + 32] << 2)
                | (levels[j + l + 64] << 4)
                | (levels[j + l + 96] << 6);
        }
    }
}

/// `quantize_row_q3_K_impl` with weights for one super-block (110 bytes: hmask[32],
/// qs[64], scales[12], d).
fn q3_k(x: &[f32], qw: &[f32], b: &mut [u8]) {
    let sigma2 = 2.0 * sum_x2(x) / QK_K as f32;
    let mut levels = [0i8; QK_K];
    let mut scales = [0f32; 16];
    let mut sw = [0f32; 16];
    for j in 0..16 {
        let xs = &x[16 * j..16 * j + 16];
        let weight: [f32; 16] =
            std::array::from_fn(|l| qw[16 * j + l] * (sigma2 + xs[l] * xs[l]).sqrt());
        let mut sumw = 0f32;
        for &w in &weight {
            sumw += w;
        }
        sw[j] = sumw;
        scales[j] = make_qx_quants(xs, 4, &mut levels[16 * j..16 * j + 16], 1, Some(&weight));
    }
    b.fill(0);
    let mut ls = [0i8; 16];
    let d_block = make_qx_quants(&scales, 32, &mut ls, 1, Some(&sw));
    let sc = &mut b[96..108];
    for j in 0..16 {
        let mut l = ls[j] as i32;
        if j < 8 {
            sc[j] = (l & 0x0f) as u8;
        } else {
            sc[j - 8] |= ((l & 0x0f) << 4) as u8;
        }
        l >>= 4;
        sc[j % 4 + 8] |= (l << (2 * (j / 4))) as u8;
    }
    put_f16(b, 108, d_block);
    let d_all = f16_at(b, 108);
    for j in 0..16 {
        let s = &b[96..108];
        let low = if j < 8 { s[j] & 0x0f } else { s[j - 8] >> 4 };
        let sc = ((low | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) as i32 - 32) as i8;
        let d = d_all * sc as f32;
        if d == 0.0 {
            continue;
        }
        for ii in 0..16 {
            let l = nearest_int(x[16 * j + ii] / d).clamp(-4, 3);
            levels[16 * j + ii] = (l + 4) as i8;
        }
    }
    let mut m = 0;
    let mut hm = 1u8;
    for l in levels.iter_mut() {
        if *l > 3 {
            b[m] |= hm;
            *l -= 4;
        }
        m += 1;
        if m == QK_K / 8 {
            m = 0;
            hm <<= 1;
        }
    }
    for j in (0..QK_K).step_by(128) {
        for l in 0..32 {
            b[32 + j / 4 + l] = (levels[j + l]
                | (levels[j + l + 32] << 2)
                | (levels[j + l + 64] << 4)
                | (levels[j + l + 96] << 6)) as u8;
        }
    }
}

/// `quantize_row_q4_K_impl` / `quantize_row_q5_K_impl` with weights for one super-block
/// (`nmax` 15: Q4_K, 144 bytes; 31: Q5_K, 176 bytes).
fn q45_k(x: &[f32], qw: &[f32], b: &mut [u8], nmax: i32) {
    let sigma2 = 2.0 * sum_x2(x) / QK_K as f32;
    let mut levels = [0u8; QK_K];
    let (scales, mins, sw) = qkx3_groups::<32, 8>(x, qw, sigma2, nmax, &mut levels);
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    let d_block = make_qp_quants(&scales, 63, &mut ls, &sw);
    let m_block = make_qp_quants(&mins, 63, &mut lm, &sw);
    let q5 = nmax == 31;
    {
        let s = &mut b[4..16];
        for j in 0..8 {
            let (mut l_s, mut l_m) = (ls[j], lm[j]);
            if q5 {
                l_s = l_s.min(63);
                l_m = l_m.min(63);
            }
            if j < 4 {
                s[j] = l_s;
                s[j + 4] = l_m;
            } else {
                s[j + 4] = (l_s & 0x0f) | ((l_m & 0x0f) << 4);
                s[j - 4] |= (l_s >> 4) << 6;
                s[j] |= (l_m >> 4) << 6;
            }
        }
    }
    put_f16(b, 0, d_block);
    put_f16(b, 2, m_block);
    let (d_all, m_all) = (f16_at(b, 0), f16_at(b, 2));
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &b[4..16]);
        let d = d_all * sc as f32;
        if d == 0.0 {
            continue;
        }
        let dm = m_all * m as f32;
        for ii in 0..32 {
            let l = nearest_int((x[32 * j + ii] + dm) / d).clamp(0, nmax);
            levels[32 * j + ii] = l as u8;
        }
    }
    if q5 {
        let (qh, ql) = b[16..].split_at_mut(32);
        qh.fill(0);
        let (mut m1, mut m2) = (1u8, 2u8);
        for (c, n) in (0..QK_K).step_by(64).enumerate() {
            for j in 0..32 {
                let mut l1 = levels[n + j];
                if l1 > 15 {
                    l1 -= 16;
                    qh[j] |= m1;
                }
                let mut l2 = levels[n + j + 32];
                if l2 > 15 {
                    l2 -= 16;
                    qh[j] |= m2;
                }
                ql[32 * c + j] = l1 | (l2 << 4);
            }
            m1 <<= 2;
            m2 <<= 2;
        }
    } else {
        for (c, j) in (0..QK_K).step_by(64).enumerate() {
            for l in 0..32 {
                b[16 + 32 * c + l] = levels[j + l] | (levels[j + l + 32] << 4);
            }
        }
    }
}

/// `quantize_row_iq4_nl_impl` with weights (ntry 7): one 32-value block (IQ4_NL, 18 bytes)
/// or one 256-value super-block of eight (IQ4_XS, 136 bytes).
fn iq4(x: &[f32], qw: &[f32], b: &mut [u8], xs: bool) {
    const NTRY: i32 = 7;
    let values = &IQ4NL;
    let sbs = x.len();
    let mut sigma2 = 0f32;
    for &v in x {
        sigma2 += v * v;
    }
    sigma2 *= 2.0 / sbs as f32;
    b.fill(0);
    let mut levels = [0u8; QK_K];
    let mut scales = [0f32; 8];
    let (mut max_scale, mut amax_scale) = (0f32, 0f32);
    for ib in 0..sbs / 32 {
        let xb = &x[32 * ib..32 * ib + 32];
        let weight: [f32; 32] =
            std::array::from_fn(|j| qw[32 * ib + j] * (sigma2 + xb[j] * xb[j]).sqrt());
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax < GROUP_MAX_EPS {
            scales[ib] = 0.0;
            continue;
        }
        let lb = &mut levels[32 * ib..32 * ib + 32];
        let mut d = -max / values[0] as f32;
        let id = 1.0 / d;
        let (mut sumqx, mut sumq2) = (0f32, 0f32);
        for j in 0..32 {
            let l = best_index_int8(values, id * xb[j]);
            lb[j] = l;
            let q = values[l as usize] as f32;
            let w = weight[j];
            sumqx += w * q * xb[j];
            sumq2 += w * q * q;
        }
        d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
        let mut best = d * sumqx;
        for itry in -NTRY..=NTRY {
            let id = (itry as f32 + values[0] as f32) / max;
            let (mut sumqx, mut sumq2) = (0f32, 0f32);
            for j in 0..32 {
                let q = values[best_index_int8(values, id * xb[j]) as usize] as f32;
                let w = weight[j];
                sumqx += w * q * xb[j];
                sumq2 += w * q * q;
            }
            if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
                d = sumqx / sumq2;
                best = d * sumqx;
            }
        }
        scales[ib] = d;
        if d.abs() > amax_scale {
            amax_scale = d.abs();
            max_scale = d;
        }
    }
    let qs_at;
    if xs {
        let d = -max_scale / 32.0;
        put_f16(b, 0, d);
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut scales_h = 0u16;
        for ib in 0..8 {
            let l = nearest_int(id * scales[ib]).clamp(-32, 31);
            let dl = d * l as f32;
            let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
            for j in 0..32 {
                levels[32 * ib + j] = best_index_int8(values, idl * x[32 * ib + j]);
            }
            let l = (l + 32) as u8;
            b[4 + ib / 2] |= (l & 0x0f) << (4 * (ib % 2));
            scales_h |= ((l >> 4) as u16) << (2 * ib);
        }
        b[2..4].copy_from_slice(&scales_h.to_le_bytes());
        qs_at = 8;
    } else {
        put_f16(b, 0, scales[0]);
        let id = if scales[0] != 0.0 {
            1.0 / scales[0]
        } else {
            0.0
        };
        for j in 0..32 {
            levels[j] = best_index_int8(values, id * x[j]);
        }
        qs_at = 2;
    }
    for i in 0..sbs / 32 {
        for j in 0..16 {
            b[qs_at + 16 * i + j] = levels[32 * i + j] | (levels[32 * i + 16 + j] << 4);
        }
    }
}
