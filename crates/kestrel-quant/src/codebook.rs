//! The 4-bit codebook formats: IQ4_NL, IQ4_XS and MXFP4. Each 4-bit quant indexes a
//! fixed table of 16 levels (not evenly spaced) that a per-block scale multiplies.
//!
//! Layouts (little-endian, as ggml-common.h):
//! - IQ4_NL (32 values, 18 bytes): d f16, qs[16]          value = d * IQ4NL[q]
//! - IQ4_XS (256 values, 136 bytes): d f16, scales_h u16, scales_l[4], qs[128]; sub-block
//!   ib (32 values) has the 6-bit scale ls = low nibble ib of scales_l | bits 2ib..2ib+1 of
//!   scales_h << 4, and value = d * (ls - 32) * IQ4NL[q]
//! - MXFP4 (32 values, 17 bytes): e u8 (E8M0 exponent), qs[16]
//!   value = 2^(e - 128) * MXFP4[q] (the table holds the E2M1 values doubled)
//!
//! In every format byte j of a 32-value group holds value j in its low nibble and value
//! j + 16 in its high one.
//!
//! The quantizers follow ggml-quants.c (`quantize_iq4_nl`, `quantize_iq4_xs` without an
//! importance matrix, `quantize_row_mxfp4_ref`) step for step and give the same bytes
//! (tests/ggml_lib_quantizers.rs checks them against llama.cpp's C code).

use crate::float::{f32_to_f16, read_f16};
use crate::kquants::nearest_int;

/// ggml's `kvalues_iq4nl`.
pub const IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// ggml's `kvalues_mxfp4`: the E2M1 values times two.
pub const MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Below this magnitude a group counts as all zeros (ggml's GROUP_MAX_EPS).
const GROUP_MAX_EPS: f32 = 1e-15;

/// ggml's `GGML_E8M0_TO_FP32_HALF`: 2^(e - 128), as exact f32 bits (subnormal for e < 2).
#[inline(always)]
pub fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        (e as u32 - 1) << 23
    };
    f32::from_bits(bits)
}

/// One 32-value group: `out[j] = d * table[low nibble of qs[j]]`, `out[j + 16]` from the
/// high nibble.
#[inline(always)]
fn dequant_group(d: f32, table: &[i8; 16], qs: &[u8], out: &mut [f32]) {
    let (lo, hi) = out.split_at_mut(16);
    for ((l, h), &q) in lo.iter_mut().zip(hi).zip(qs) {
        *l = d * table[(q & 0x0f) as usize] as f32;
        *h = d * table[(q >> 4) as usize] as f32;
    }
}

pub fn dequant_iq4_nl(b: &[u8; 18], out: &mut [f32; 32]) {
    dequant_group(read_f16(&[b[0], b[1]]), &IQ4NL, &b[2..], out);
}

pub fn dequant_iq4_xs(b: &[u8; 136], out: &mut [f32; 256]) {
    let d = read_f16(&[b[0], b[1]]);
    let scales_h = u16::from_le_bytes([b[2], b[3]]);
    let scales_l = &b[4..8];
    for (ib, (qs, group)) in b[8..]
        .chunks_exact(16)
        .zip(out.chunks_exact_mut(32))
        .enumerate()
    {
        let ls = ((scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0f)
            | (((scales_h >> (2 * ib)) & 3) as u8) << 4;
        dequant_group(d * (ls as i32 - 32) as f32, &IQ4NL, qs, group);
    }
}

pub fn dequant_mxfp4(b: &[u8; 17], out: &mut [f32; 32]) {
    dequant_group(e8m0_to_f32_half(b[0]), &MXFP4, &b[1..], out);
}

/// ggml's `best_index_int8`: the index of the table level nearest `x` (ties to the lower).
pub(crate) fn best_index_int8(values: &[i8; 16], x: f32) -> u8 {
    if x <= values[0] as f32 {
        return 0;
    }
    if x >= values[15] as f32 {
        return 15;
    }
    let (mut ml, mut mu) = (0usize, 15usize);
    while mu - ml > 1 {
        let mav = (ml + mu) / 2;
        if x < values[mav] as f32 {
            mu = mav;
        } else {
            ml = mav;
        }
    }
    if x - (values[mu - 1] as f32) < values[mu] as f32 - x {
        (mu - 1) as u8
    } else {
        mu as u8
    }
}

/// The scale search of ggml's `quantize_row_iq4_nl_impl` for one 32-value group without an
/// importance matrix (weights x²): the best scale over 15 trial scales, 0 for a zero group.
fn iq4_group_scale(xb: &[f32]) -> f32 {
    const NTRY: i32 = 7;
    let values = &IQ4NL;
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in xb {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        return 0.0;
    }
    let sums = |id: f32| {
        let (mut sumqx, mut sumq2) = (0f32, 0f32);
        for &x in xb {
            let q = values[best_index_int8(values, id * x) as usize] as f32;
            let w = x * x;
            sumqx += w * q * x;
            sumq2 += w * q * q;
        }
        (sumqx, sumq2)
    };
    let d0 = -max / values[0] as f32;
    let (sumqx, sumq2) = sums(1.0 / d0);
    let mut d = sumqx / sumq2;
    let mut best = d * sumqx;
    for itry in -NTRY..=NTRY {
        let (sumqx, sumq2) = sums((itry as f32 + values[0] as f32) / max);
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    d
}

/// Packs 32 level indices into 16 bytes (value j low nibble, j + 16 high).
fn pack_group(l: &[u8; 32], qs: &mut [u8]) {
    for (j, q) in qs.iter_mut().enumerate().take(16) {
        *q = l[j] | (l[j + 16] << 4);
    }
}

pub fn quant_iq4_nl(x: &[f32; 32], b: &mut [u8; 18]) {
    let d = iq4_group_scale(x);
    b[0..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let l: [u8; 32] = std::array::from_fn(|j| best_index_int8(&IQ4NL, id * x[j]));
    pack_group(&l, &mut b[2..]);
}

pub fn quant_iq4_xs(x: &[f32; 256], b: &mut [u8; 136]) {
    let scales: [f32; 8] = std::array::from_fn(|ib| iq4_group_scale(&x[32 * ib..32 * ib + 32]));
    // The scale of largest magnitude, with its sign, sets the super-block scale.
    let (mut amax_scale, mut max_scale) = (0f32, 0f32);
    for &s in &scales {
        if s.abs() > amax_scale {
            amax_scale = s.abs();
            max_scale = s;
        }
    }
    let d = -max_scale / 32.0;
    b.fill(0);
    b[0..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut scales_h = 0u16;
    for (ib, &s) in scales.iter().enumerate() {
        let l = nearest_int(id * s).clamp(-32, 31);
        let dl = d * l as f32;
        let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
        let xb = &x[32 * ib..32 * ib + 32];
        let levels: [u8; 32] = std::array::from_fn(|j| best_index_int8(&IQ4NL, idl * xb[j]));
        pack_group(&levels, &mut b[8 + 16 * ib..8 + 16 * ib + 16]);
        let l = (l + 32) as u8;
        b[4 + ib / 2] |= (l & 0x0f) << (4 * (ib % 2));
        scales_h |= ((l >> 4) as u16) << (2 * ib);
    }
    b[2..4].copy_from_slice(&scales_h.to_le_bytes());
}

/// ggml's `best_index_mxfp4`: the first level of least error.
fn best_index_mxfp4(x: f32, e: f32) -> u8 {
    let mut best = 0;
    let mut best_err = (MXFP4[0] as f32 * e - x).abs();
    for (i, &v) in MXFP4.iter().enumerate().skip(1) {
        let err = (v as f32 * e - x).abs();
        if err < best_err {
            best = i as u8;
            best_err = err;
        }
    }
    best
}

pub fn quant_mxfp4(x: &[f32; 32], b: &mut [u8; 17]) {
    let amax = x
        .iter()
        .fold(0f32, |m, v| if m < v.abs() { v.abs() } else { m });
    let e = if amax > 0.0 {
        // Through an int as C converts (an exponent below 2^-127 wraps as in ggml).
        (amax.log2().floor() - 2.0 + 127.0) as i32 as u8
    } else {
        0
    };
    let d = e8m0_to_f32_half(e);
    b[0] = e;
    let l: [u8; 32] = std::array::from_fn(|j| best_index_mxfp4(x[j], d));
    pack_group(&l, &mut b[1..]);
}
