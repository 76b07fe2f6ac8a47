//! The 256-value "K" super-block formats: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K.
//!
//! Layouts (little-endian, as ggml-common.h, QK_K = 256):
//! - Q2_K (84):  scales[16] (low nibble scale, high nibble min), qs[64] (2 bits), d f16, dmin f16
//! - Q3_K (110): hmask[32], qs[64] (low 2 bits), scales[12] (16 x 6 bits), d f16
//! - Q4_K (144): d f16, dmin f16, scales[12] (8 scales + 8 mins, 6 bits each), qs[128]
//! - Q5_K (176): d f16, dmin f16, scales[12], qh[32], qs[128]
//! - Q6_K (210): ql[128], qh[64], scales[16] i8, d f16
//! - Q8_K (292): d f32, qs[256] i8, bsums[16] i16 (sums of 16 quants)
//!
//! Dequantization performs the same f32 operations in the same order as
//! `dequantize_row_*` in ggml-quants.c (and gguf-py), so results are bit-identical.
//! Quantization follows `quantize_row_*_ref` (make_qx_quants, make_q3_quants,
//! make_qkx2_quants with `nearest_int` rounding), without fused multiply-adds.

use crate::float::{f32_to_f16, read_f16};

pub const QK_K: usize = 256;

/// Below this magnitude a group counts as all zeros (ggml's GROUP_MAX_EPS).
const GROUP_MAX_EPS: f32 = 1e-15;

#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    read_f16(&[b[at], b[at + 1]])
}

#[inline(always)]
fn put_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&f32_to_f16(v).to_le_bytes());
}

/// ggml's `nearest_int`: round half to even through the f32 magic-number trick (valid for
/// |x| < 2^22, which every caller guarantees for finite input).
#[inline(always)]
pub(crate) fn nearest_int(x: f32) -> i32 {
    let bits = (x + 12_582_912.0).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// Scale and min number `j` (0..8) of a Q4_K/Q5_K block's 12 packed scale bytes.
#[inline(always)]
pub fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Signed 6-bit scale number `j` (0..16) of a Q3_K block's 12 packed scale bytes.
#[inline(always)]
fn scale_q3k(j: usize, s: &[u8]) -> i32 {
    let low = if j < 8 { s[j] & 0x0f } else { s[j - 8] >> 4 };
    let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    (low | (high << 4)) as i32 - 32
}

pub fn dequant_q2_k(b: &[u8; 84], out: &mut [f32; QK_K]) {
    let scales = &b[0..16];
    let qs = &b[16..80];
    let d = f16_at(b, 80);
    let dmin = f16_at(b, 82);
    for half in 0..2 {
        let q = &qs[32 * half..32 * half + 32];
        for j in 0..4 {
            let shift = 2 * j;
            for sub in 0..2 {
                let sc = scales[8 * half + 2 * j + sub];
                let dl = d * (sc & 0x0f) as f32;
                let ml = dmin * (sc >> 4) as f32;
                let o = 128 * half + 32 * j + 16 * sub;
                for l in 0..16 {
                    out[o + l] = dl * ((q[16 * sub + l] >> shift) & 3) as f32 - ml;
                }
            }
        }
    }
}

pub fn dequant_q3_k(b: &[u8; 110], out: &mut [f32; QK_K]) {
    let hmask = &b[0..32];
    let qs = &b[32..96];
    let scales = &b[96..108];
    let d = f16_at(b, 108);
    for half in 0..2 {
        let q = &qs[32 * half..32 * half + 32];
        for j in 0..4 {
            let shift = 2 * j;
            let m = 1u8 << (4 * half + j);
            for sub in 0..2 {
                let dl = d * scale_q3k(8 * half + 2 * j + sub, scales) as f32;
                let o = 128 * half + 32 * j + 16 * sub;
                for l in 0..16 {
                    let i = 16 * sub + l;
                    let low = ((q[i] >> shift) & 3) as i32;
                    let q3 = if hmask[i] & m != 0 { low } else { low - 4 };
                    out[o + l] = dl * q3 as f32;
                }
            }
        }
    }
}

pub fn dequant_q4_k(b: &[u8; 144], out: &mut [f32; QK_K]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    for c in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * c, scales);
        let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, min2) = (d * sc2 as f32, dmin * m2 as f32);
        let q = &qs[32 * c..32 * c + 32];
        let (lo, hi) = out[64 * c..64 * c + 64].split_at_mut(32);
        for l in 0..32 {
            lo[l] = d1 * (q[l] & 0x0f) as f32 - min1;
            hi[l] = d2 * (q[l] >> 4) as f32 - min2;
        }
    }
}

pub fn dequant_q5_k(b: &[u8; 176], out: &mut [f32; QK_K]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for c in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * c, scales);
        let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, min2) = (d * sc2 as f32, dmin * m2 as f32);
        let (u1, u2) = (1u8 << (2 * c), 2u8 << (2 * c));
        let q = &qs[32 * c..32 * c + 32];
        let (lo, hi) = out[64 * c..64 * c + 64].split_at_mut(32);
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            lo[l] = d1 * ((q[l] & 0x0f) + h1) as f32 - min1;
            hi[l] = d2 * ((q[l] >> 4) + h2) as f32 - min2;
        }
    }
}

pub fn dequant_q6_k(b: &[u8; 210], out: &mut [f32; QK_K]) {
    let d = f16_at(b, 208);
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let sc = &b[192 + 8 * half..192 + 8 * half + 8];
        let o = &mut out[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            o[l] = d * sc[is] as i8 as f32 * q1 as f32;
            o[l + 32] = d * sc[is + 2] as i8 as f32 * q2 as f32;
            o[l + 64] = d * sc[is + 4] as i8 as f32 * q3 as f32;
            o[l + 96] = d * sc[is + 6] as i8 as f32 * q4 as f32;
        }
    }
}

pub fn dequant_q8_k(b: &[u8; 292], out: &mut [f32; QK_K]) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (o, &q) in out.iter_mut().zip(&b[4..260]) {
        *o = d * q as i8 as f32;
    }
}

// ---------------------------------------------------------------------------------------
// Quantization (ggml's reference algorithms)
// ---------------------------------------------------------------------------------------

/// ggml's `make_qx_quants` for symmetric quants in [-nmax, nmax): returns the scale and
/// writes `L[i] = q + nmax`. `rmse_type` 1 weights errors by x², then tries 18 nearby scales.
pub(crate) fn make_qx_quants(
    x: &[f32],
    nmax: i32,
    levels: &mut [i8],
    rmse_type: i32,
    qw: Option<&[f32]>,
) -> f32 {
    let n = x.len();
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in x {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        levels[..n].fill(0);
        return 0.0;
    }
    let mut iscale = -(nmax as f32) / max;
    let clamp = |l: i32| l.clamp(-nmax, nmax - 1);
    if rmse_type == 0 {
        for (lv, &v) in levels.iter_mut().zip(x) {
            *lv = (nmax + clamp(nearest_int(iscale * v))) as i8;
        }
        return 1.0 / iscale;
    }
    let weight = |i: usize, v: f32| match (qw, rmse_type) {
        (Some(qw), _) => qw[i],
        (None, 1) => v * v,
        (None, 2) => 1.0,
        (None, 3) => v.abs(),
        (None, _) => v.abs().sqrt(),
    };
    let mut sumlx = 0.0f32;
    let mut suml2 = 0.0f32;
    for (i, (lv, &v)) in levels.iter_mut().zip(x).enumerate() {
        let l = clamp(nearest_int(iscale * v));
        *lv = (l + nmax) as i8;
        let w = weight(i, v);
        sumlx += w * v * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for (i, &v) in x.iter().enumerate() {
            let l = clamp(nearest_int(iscale * v));
            let w = weight(i, v);
            sumlx += w * v * l as f32;
            suml2 += w * l as f32 * l as f32;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (lv, &v) in levels.iter_mut().zip(x) {
                *lv = (nmax + clamp(nearest_int(iscale * v))) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// ggml's `make_q3_quants` with `do_rmse`: symmetric quants in [-nmax, nmax), refined by
/// coordinate descent on the x²-weighted error. Writes `L[i] = q + nmax`, returns the scale.
fn make_q3_quants(x: &[f32], nmax: i32, levels: &mut [i8]) -> f32 {
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in x {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        levels[..x.len()].fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let mut sumlx = 0.0f32;
    let mut suml2 = 0.0f32;
    for (lv, &v) in levels.iter_mut().zip(x) {
        let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        *lv = l as i8;
        let w = v * v;
        sumlx += w * v * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    for _ in 0..5 {
        let mut changed = 0;
        for (lv, &v) in levels.iter_mut().zip(x) {
            let w = v * v;
            let cur = *lv as f32;
            let mut slx = sumlx - w * v * cur;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * cur * cur;
                let new_l = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != *lv as i32 {
                    slx += w * v * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        *lv = new_l as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        changed += 1;
                    }
                }
            }
        }
        if changed == 0 {
            break;
        }
    }
    for lv in levels.iter_mut().take(x.len()) {
        *lv += nmax as i8;
    }
    sumlx / suml2
}

/// ggml's `make_qkx2_quants`: asymmetric quants in [0, nmax] with a scale and a min (both
/// searched over `nstep` + 1 candidate scales to minimize the weighted error). Returns
/// `(scale, -min)`.
/// The opening of ggml's `make_qkx2_quants` / `make_qkx3_quants`: x's minimum (at most 0)
/// and maximum, Σw and Σw·x, in ggml's order of operations.
pub(crate) fn weighted_range(x: &[f32], weights: &[f32]) -> (f32, f32, f32, f32) {
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..x.len() {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    (min, max, sum_w, sum_x)
}

#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    x: &[f32],
    weights: &[f32],
    nmax: i32,
    levels: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> (f32, f32) {
    let n = x.len();
    let (mut min, max, sum_w, sum_x) = weighted_range(x, weights);
    if max == min {
        levels[..n].fill(0);
        return (0.0, -min);
    }
    let err = |diff: f32| if use_mad { diff.abs() } else { diff * diff };
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        levels[i] = l as u8;
        let diff = scale * l as f32 + min - x[i];
        best_error += weights[i] * err(diff);
    }
    if nstep < 1 {
        return (scale, -min);
    }
    let mut aux = [0u8; 32];
    let aux = &mut aux[..n];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let mut sum_l = 0.0f32;
        let mut sum_l2 = 0.0f32;
        let mut sum_xl = 0.0f32;
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            aux[i] = l as u8;
            let w = weights[i];
            let lf = l as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * aux[i] as f32 + this_min - x[i];
                error += weights[i] * err(diff);
            }
            if error < best_error {
                levels[..n].copy_from_slice(aux);
                best_error = error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

pub fn quant_q2_k(x: &[f32; QK_K], b: &mut [u8; 84]) {
    const Q4SCALE: f32 = 15.0;
    let mut levels = [0u8; QK_K];
    let mut scales = [0.0f32; 16];
    let mut mins = [0.0f32; 16];
    let mut weights = [0.0f32; 16];
    let mut max_scale = 0.0f32;
    let mut max_min = 0.0f32;
    for j in 0..16 {
        let xs = &x[16 * j..16 * j + 16];
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = v.abs();
        }
        let (scale, min) = make_qkx2_quants(
            xs,
            &weights,
            3,
            &mut levels[16 * j..16 * j + 16],
            -0.5,
            0.1,
            15,
            true,
        );
        scales[j] = scale;
        mins[j] = min;
        if scale > max_scale {
            max_scale = scale;
        }
        if min > max_min {
            max_min = min;
        }
    }
    b.fill(0);
    if max_scale > 0.0 {
        let iscale = Q4SCALE / max_scale;
        for j in 0..16 {
            b[j] = nearest_int(iscale * scales[j]) as u8;
        }
        put_f16(b, 80, max_scale / Q4SCALE);
    }
    if max_min > 0.0 {
        let iscale = Q4SCALE / max_min;
        for j in 0..16 {
            b[j] |= (nearest_int(iscale * mins[j]) << 4) as u8;
        }
        put_f16(b, 82, max_min / Q4SCALE);
    }
    let d_all = f16_at(b, 80);
    let dmin_all = f16_at(b, 82);
    for j in 0..16 {
        let d = d_all * (b[j] & 0x0f) as f32;
        if d == 0.0 {
            continue;
        }
        let dm = dmin_all * (b[j] >> 4) as f32;
        for i in 0..16 {
            levels[16 * j + i] = nearest_int((x[16 * j + i] + dm) / d).clamp(0, 3) as u8;
        }
    }
    for half in 0..2 {
        let l = &levels[128 * half..128 * half + 128];
        for i in 0..32 {
            b[16 + 32 * half + i] = l[i] | (l[i + 32] << 2) | (l[i + 64] << 4) | (l[i + 96] << 6);
        }
    }
}

pub fn quant_q3_k(x: &[f32; QK_K], b: &mut [u8; 110]) {
    let mut levels = [0i8; QK_K];
    let mut scales = [0.0f32; 16];
    let mut max_scale = 0.0f32;
    let mut amax = 0.0f32;
    for j in 0..16 {
        scales[j] = make_q3_quants(&x[16 * j..16 * j + 16], 4, &mut levels[16 * j..16 * j + 16]);
        let scale = scales[j].abs();
        if scale > amax {
            amax = scale;
            max_scale = scales[j];
        }
    }
    b.fill(0);
    if max_scale != 0.0 {
        let iscale = -32.0 / max_scale;
        let packed = &mut b[96..108];
        for j in 0..16 {
            // The C code stores nearest_int's result in an int8_t before clamping.
            let l = (nearest_int(iscale * scales[j]) as i8).clamp(-32, 31) as i32 + 32;
            if j < 8 {
                packed[j] = (l & 0x0f) as u8;
            } else {
                packed[j - 8] |= ((l & 0x0f) << 4) as u8;
            }
            packed[8 + j % 4] |= ((l >> 4) << (2 * (j / 4))) as u8;
        }
        put_f16(b, 108, 1.0 / iscale);
    }
    let d_all = f16_at(b, 108);
    for j in 0..16 {
        let d = d_all * scale_q3k(j, &b[96..108]) as f32;
        if d == 0.0 {
            continue;
        }
        for i in 0..16 {
            levels[16 * j + i] = (nearest_int(x[16 * j + i] / d).clamp(-4, 3) + 4) as i8;
        }
    }
    // The high bit of quant j goes to hmask[j % 32], bit j / 32.
    for (j, l) in levels.iter_mut().enumerate() {
        if *l > 3 {
            b[j % 32] |= 1 << (j / 32);
            *l -= 4;
        }
    }
    for half in 0..2 {
        let l = &levels[128 * half..128 * half + 128];
        for i in 0..32 {
            let (q1, q2, q3, q4) = (
                l[i] as u8,
                l[i + 32] as u8,
                l[i + 64] as u8,
                l[i + 96] as u8,
            );
            b[32 + 32 * half + i] = q1 | (q2 << 2) | (q3 << 4) | (q4 << 6);
        }
    }
}

/// `make_qkx2_quants` (`use_mad` false) of the eight 32-value groups of a super-block at
/// once, group `k` in lane `k`: every lane performs exactly the scalar function's f32
/// operations in the scalar order (the lanes only run side by side, so the compiler can
/// keep them in vector registers), hence the same bits. `xt[i][k]` is value `i` of group
/// `k`, `wt` its weight. Returns each group's (scale, -min) and writes its levels.
#[inline(always)]
fn qkx2_x8_body(
    xt: &[[f32; 8]; 32],
    wt: &[[f32; 8]; 32],
    nmax: i32,
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    levels: &mut [[f32; 8]; 32],
) -> ([f32; 8], [f32; 8]) {
    const K: usize = 8;
    let mut min = xt[0];
    let mut max = xt[0];
    let mut sum_w = wt[0];
    let mut sum_x = [0f32; K];
    for k in 0..K {
        sum_x[k] = sum_w[k] * xt[0][k];
    }
    for i in 1..32 {
        for k in 0..K {
            let v = xt[i][k];
            if v < min[k] {
                min[k] = v;
            }
            if v > max[k] {
                max[k] = v;
            }
            let w = wt[i][k];
            sum_w[k] += w;
            sum_x[k] += w * v;
        }
    }
    let mut flat = [false; K];
    let mut iscale = [0f32; K];
    let mut scale = [0f32; K];
    for k in 0..K {
        if min[k] > 0.0 {
            min[k] = 0.0;
        }
        flat[k] = max[k] == min[k];
        iscale[k] = nmax as f32 / (max[k] - min[k]);
        scale[k] = 1.0 / iscale[k];
    }
    let mut best = [0f32; K];
    for i in 0..32 {
        for k in 0..K {
            let l = nearest_int(iscale[k] * (xt[i][k] - min[k])).clamp(0, nmax) as f32;
            levels[i][k] = l;
            let diff = scale[k] * l + min[k] - xt[i][k];
            best[k] += wt[i][k] * (diff * diff);
        }
    }
    let mut aux = [[0f32; K]; 32];
    for is in 0..=nstep {
        let mut isc = [0f32; K];
        for k in 0..K {
            isc[k] = (rmin + rdelta * is as f32 + nmax as f32) / (max[k] - min[k]);
        }
        let (mut sl, mut sl2, mut sxl) = ([0f32; K], [0f32; K], [0f32; K]);
        for i in 0..32 {
            for k in 0..K {
                let l = nearest_int(isc[k] * (xt[i][k] - min[k])).clamp(0, nmax) as f32;
                aux[i][k] = l;
                let w = wt[i][k];
                sl[k] += w * l;
                sl2[k] += w * l * l;
                sxl[k] += w * l * xt[i][k];
            }
        }
        let (mut ts, mut tm, mut det) = ([0f32; K], [0f32; K], [0f32; K]);
        for k in 0..K {
            det[k] = sum_w[k] * sl2[k] - sl[k] * sl[k];
            ts[k] = (sum_w[k] * sxl[k] - sum_x[k] * sl[k]) / det[k];
            tm[k] = (sl2[k] * sum_x[k] - sl[k] * sxl[k]) / det[k];
            if tm[k] > 0.0 {
                tm[k] = 0.0;
                ts[k] = sxl[k] / sl2[k];
            }
        }
        let mut err = [0f32; K];
        for i in 0..32 {
            for k in 0..K {
                let diff = ts[k] * aux[i][k] + tm[k] - xt[i][k];
                err[k] += wt[i][k] * (diff * diff);
            }
        }
        let mut take = [false; K];
        for k in 0..K {
            take[k] = !flat[k] && det[k] > 0.0 && err[k] < best[k];
            if take[k] {
                best[k] = err[k];
                scale[k] = ts[k];
                min[k] = tm[k];
            }
        }
        for i in 0..32 {
            for k in 0..K {
                if take[k] {
                    levels[i][k] = aux[i][k];
                }
            }
        }
    }
    let mut neg_min = [0f32; K];
    for k in 0..K {
        if flat[k] {
            scale[k] = 0.0;
            for row in levels.iter_mut() {
                row[k] = 0.0;
            }
        }
        neg_min[k] = -min[k];
    }
    (scale, neg_min)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn qkx2_x8_avx2(
    xt: &[[f32; 8]; 32],
    wt: &[[f32; 8]; 32],
    nmax: i32,
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    levels: &mut [[f32; 8]; 32],
) -> ([f32; 8], [f32; 8]) {
    qkx2_x8_body(xt, wt, nmax, rmin, rdelta, nstep, levels)
}

/// [`qkx2_x8_body`] with AVX2 where the CPU has it (no FMA: the products and sums stay
/// separately rounded, as in ggml's C).
fn qkx2_x8(
    xt: &[[f32; 8]; 32],
    wt: &[[f32; 8]; 32],
    nmax: i32,
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    levels: &mut [[f32; 8]; 32],
) -> ([f32; 8], [f32; 8]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { qkx2_x8_avx2(xt, wt, nmax, rmin, rdelta, nstep, levels) };
    }
    qkx2_x8_body(xt, wt, nmax, rmin, rdelta, nstep, levels)
}

/// One rounding pass of [`qx_x16_body`] at `iscale` (per lane): each value's level
/// (`q + nmax`) into `levels`, and Σ w·v·q, Σ w·q² with the weights w = v².
#[inline(always)]
fn qx_x16_round(
    xt: &[[f32; 16]; 16],
    iscale: &[f32; 16],
    nmax: i32,
    levels: &mut [[i32; 16]; 16],
) -> ([f32; 16], [f32; 16]) {
    let (mut sumlx, mut suml2) = ([0f32; 16], [0f32; 16]);
    for i in 0..16 {
        for k in 0..16 {
            let v = xt[i][k];
            let l = nearest_int(iscale[k] * v).clamp(-nmax, nmax - 1);
            levels[i][k] = l + nmax;
            let w = v * v;
            let lf = l as f32;
            sumlx[k] += w * v * lf;
            suml2[k] += w * lf * lf;
        }
    }
    (sumlx, suml2)
}

/// `make_qx_quants(16, nmax, x, L, 1, NULL)` of the sixteen 16-value groups of a Q6_K
/// super-block at once, group `k` in lane `k`, each lane doing the scalar function's f32
/// operations in its order (so the same bits). `xt[i][k]` is value `i` of group `k`;
/// `levels` gets `q + nmax`; returns the scales.
#[inline(always)]
fn qx_x16_body(xt: &[[f32; 16]; 16], nmax: i32, levels: &mut [[i32; 16]; 16]) -> [f32; 16] {
    const K: usize = 16;
    let (mut max, mut amax) = ([0f32; K], [0f32; K]);
    for row in xt {
        for k in 0..K {
            let ax = row[k].abs();
            if ax > amax[k] {
                amax[k] = ax;
                max[k] = row[k];
            }
        }
    }
    let mut iscale = [0f32; K];
    for k in 0..K {
        iscale[k] = -(nmax as f32) / max[k];
    }
    let (sumlx, suml2) = qx_x16_round(xt, &iscale, nmax, levels);
    let (mut scale, mut best) = ([0f32; K], [0f32; K]);
    for k in 0..K {
        scale[k] = if suml2[k] != 0.0 {
            sumlx[k] / suml2[k]
        } else {
            0.0
        };
        best[k] = scale[k] * sumlx[k];
    }
    let mut aux = [[0i32; K]; 16];
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        for k in 0..K {
            iscale[k] = -(nmax as f32 + 0.1 * is as f32) / max[k];
        }
        let (sumlx, suml2) = qx_x16_round(xt, &iscale, nmax, &mut aux);
        let mut take = [false; K];
        for k in 0..K {
            take[k] = suml2[k] > 0.0 && sumlx[k] * sumlx[k] > best[k] * suml2[k];
            if take[k] {
                scale[k] = sumlx[k] / suml2[k];
                best[k] = scale[k] * sumlx[k];
            }
        }
        for i in 0..16 {
            for k in 0..K {
                if take[k] {
                    levels[i][k] = aux[i][k];
                }
            }
        }
    }
    for k in 0..K {
        if amax[k] < GROUP_MAX_EPS {
            scale[k] = 0.0;
            for row in levels.iter_mut() {
                row[k] = 0;
            }
        }
    }
    scale
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn qx_x16_avx2(xt: &[[f32; 16]; 16], nmax: i32, levels: &mut [[i32; 16]; 16]) -> [f32; 16] {
    qx_x16_body(xt, nmax, levels)
}

/// [`qx_x16_body`] with AVX2 where the CPU has it (no FMA).
fn qx_x16(xt: &[[f32; 16]; 16], nmax: i32, levels: &mut [[i32; 16]; 16]) -> [f32; 16] {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { qx_x16_avx2(xt, nmax, levels) };
    }
    qx_x16_body(xt, nmax, levels)
}

/// The shared first half of Q4_K and Q5_K: per 32-value group scale and min, packed into
/// 6 bits each with the super-block's d and dmin, then the levels requantized with them.
/// Writes d, dmin and the 12 scale bytes into `b[0..16]` and returns the levels.
fn quant_k4_scales(x: &[f32; QK_K], nmax: i32, rmin: f32, nstep: i32, b: &mut [u8]) -> [u8; QK_K] {
    let mut levels = [0u8; QK_K];
    let mut max_scale = 0.0f32;
    let mut max_min = 0.0f32;
    // The eight groups side by side (value i of group k at [i][k]), each weighted by
    // av_x + |x| as in quantize_row_q4_K_ref.
    let mut xt = [[0f32; 8]; 32];
    let mut wt = [[0f32; 8]; 32];
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0.0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        for (i, &v) in xs.iter().enumerate() {
            xt[i][j] = v;
            wt[i][j] = av_x + v.abs();
        }
    }
    let mut lv = [[0f32; 8]; 32];
    let (scales, mins) = qkx2_x8(&xt, &wt, nmax, rmin, 0.1, nstep, &mut lv);
    for j in 0..8 {
        for i in 0..32 {
            levels[32 * j + i] = lv[i][j] as u8;
        }
    }
    for j in 0..8 {
        let (scale, min) = (scales[j], mins[j]);
        if scale > max_scale {
            max_scale = scale;
        }
        if min > max_min {
            max_min = min;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let packed = &mut b[4..16];
    packed.fill(0);
    for j in 0..8 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0x0f) | ((lm & 0x0f) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    put_f16(b, 0, max_scale / 63.0);
    put_f16(b, 2, max_min / 63.0);
    let d_all = f16_at(b, 0);
    let dmin_all = f16_at(b, 2);
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &b[4..16]);
        let d = d_all * sc as f32;
        if d == 0.0 {
            continue;
        }
        let dm = dmin_all * m as f32;
        for i in 0..32 {
            levels[32 * j + i] = nearest_int((x[32 * j + i] + dm) / d).clamp(0, nmax) as u8;
        }
    }
    levels
}

pub fn quant_q4_k(x: &[f32; QK_K], b: &mut [u8; 144]) {
    let levels = quant_k4_scales(x, 15, -1.0, 20, b);
    for c in 0..4 {
        for l in 0..32 {
            b[16 + 32 * c + l] = levels[64 * c + l] | (levels[64 * c + 32 + l] << 4);
        }
    }
}

pub fn quant_q5_k(x: &[f32; QK_K], b: &mut [u8; 176]) {
    let levels = quant_k4_scales(x, 31, -0.5, 15, b);
    let (qh, qs) = b[16..176].split_at_mut(32);
    qh.fill(0);
    for c in 0..4 {
        let (m1, m2) = (1u8 << (2 * c), 2u8 << (2 * c));
        for j in 0..32 {
            let mut l1 = levels[64 * c + j];
            if l1 > 15 {
                l1 -= 16;
                qh[j] |= m1;
            }
            let mut l2 = levels[64 * c + 32 + j];
            if l2 > 15 {
                l2 -= 16;
                qh[j] |= m2;
            }
            qs[32 * c + j] = l1 | (l2 << 4);
        }
    }
}

pub fn quant_q6_k(x: &[f32; QK_K], b: &mut [u8; 210]) {
    quant_q6_k_weighted(x, b, None)
}

/// Q6_K as ggml's `quantize_row_q6_K_impl`: with importance weights `qw` (256, this
/// super-block's columns) each group's scale search weights its errors by them, else by x².
pub(crate) fn quant_q6_k_weighted(x: &[f32; QK_K], b: &mut [u8; 210], qw: Option<&[f32]>) {
    let mut levels = [0i8; QK_K];
    let mut scales = [0.0f32; 16];
    let mut max_scale = 0.0f32;
    let mut max_abs_scale = 0.0f32;
    if qw.is_none() {
        // The sixteen groups' searches side by side (same bits as one by one).
        let mut xt = [[0f32; 16]; 16];
        for j in 0..16 {
            for i in 0..16 {
                xt[i][j] = x[16 * j + i];
            }
        }
        let mut lv = [[0i32; 16]; 16];
        scales = qx_x16(&xt, 32, &mut lv);
        for j in 0..16 {
            for i in 0..16 {
                levels[16 * j + i] = lv[i][j] as i8;
            }
        }
    }
    for j in 0..16 {
        let scale = match qw {
            None => scales[j],
            Some(w) => make_qx_quants(
                &x[16 * j..16 * j + 16],
                32,
                &mut levels[16 * j..16 * j + 16],
                1,
                Some(&w[16 * j..16 * j + 16]),
            ),
        };
        scales[j] = scale;
        if scale.abs() > max_abs_scale {
            max_abs_scale = scale.abs();
            max_scale = scale;
        }
    }
    b.fill(0);
    if max_abs_scale < GROUP_MAX_EPS {
        return;
    }
    let iscale = -128.0 / max_scale;
    put_f16(b, 208, 1.0 / iscale);
    for j in 0..16 {
        b[192 + j] = nearest_int(iscale * scales[j]).min(127) as i8 as u8;
    }
    let d_all = f16_at(b, 208);
    for j in 0..16 {
        let d = d_all * b[192 + j] as i8 as f32;
        if d == 0.0 {
            continue;
        }
        for i in 0..16 {
            levels[16 * j + i] = (nearest_int(x[16 * j + i] / d).clamp(-32, 31) + 32) as i8;
        }
    }
    for half in 0..2 {
        let l = &levels[128 * half..128 * half + 128];
        for i in 0..32 {
            let (q1, q2, q3, q4) = (
                l[i] as u8,
                l[i + 32] as u8,
                l[i + 64] as u8,
                l[i + 96] as u8,
            );
            b[64 * half + i] = (q1 & 0x0f) | ((q3 & 0x0f) << 4);
            b[64 * half + 32 + i] = (q2 & 0x0f) | ((q4 & 0x0f) << 4);
            b[128 + 32 * half + i] =
                (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
        }
    }
}

pub fn quant_q8_k(x: &[f32; QK_K], b: &mut [u8; 292]) {
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    b.fill(0);
    if amax == 0.0 {
        return;
    }
    let iscale = -127.0 / max;
    for (q, &v) in b[4..260].iter_mut().zip(x) {
        *q = nearest_int(iscale * v).min(127) as i8 as u8;
    }
    for j in 0..16 {
        let sum: i32 = b[4 + 16 * j..4 + 16 * j + 16]
            .iter()
            .map(|&q| q as i8 as i32)
            .sum();
        b[260 + 2 * j..262 + 2 * j].copy_from_slice(&(sum as i16).to_le_bytes());
    }
    b[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
}
