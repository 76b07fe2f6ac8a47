//! The 32-value block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1.
//!
//! Layouts (little-endian, as ggml-common.h):
//! - Q4_0: d f16, qs[16]            value = (q - 8) * d
//! - Q4_1: d f16, m f16, qs[16]     value = q * d + m
//! - Q5_0: d f16, qh u32, qs[16]    value = (q - 16) * d, bit 4 of q from qh
//! - Q5_1: d f16, m f16, qh u32, qs[16]
//! - Q8_0: d f16, qs[32] i8         value = q * d
//! - Q8_1: d f16, s f16 (= d * sum q), qs[32] i8
//!
//! In the 4/5-bit formats byte j holds value j in its low nibble and value j + 16 in its high one.
//!
//! The quantizers follow `quantize_row_*_ref` in ggml-quants.c step for step (same f32
//! operations in the same order), so they give the same bytes.

use crate::float::{f32_to_f16, read_f16};

pub const QK: usize = 32;

#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    read_f16(&[b[at], b[at + 1]])
}

#[inline(always)]
fn put_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&f32_to_f16(v).to_le_bytes());
}

pub fn dequant_q4_0(b: &[u8; 18], out: &mut [f32; QK]) {
    let d = f16_at(b, 0);
    let (lo, hi) = out.split_at_mut(16);
    for (j, &q) in b[2..].iter().enumerate() {
        lo[j] = ((q & 0x0f) as i32 - 8) as f32 * d;
        hi[j] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

pub fn dequant_q4_1(b: &[u8; 20], out: &mut [f32; QK]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let (lo, hi) = out.split_at_mut(16);
    for (j, &q) in b[4..].iter().enumerate() {
        lo[j] = (q & 0x0f) as f32 * d + m;
        hi[j] = (q >> 4) as f32 * d + m;
    }
}

pub fn dequant_q5_0(b: &[u8; 22], out: &mut [f32; QK]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let (lo, hi) = out.split_at_mut(16);
    for (j, &q) in b[6..].iter().enumerate() {
        let h0 = ((qh >> j) & 1) << 4;
        let h1 = ((qh >> (j + 16)) & 1) << 4;
        lo[j] = (((q & 0x0f) as u32 | h0) as i32 - 16) as f32 * d;
        hi[j] = (((q >> 4) as u32 | h1) as i32 - 16) as f32 * d;
    }
}

pub fn dequant_q5_1(b: &[u8; 24], out: &mut [f32; QK]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let (lo, hi) = out.split_at_mut(16);
    for (j, &q) in b[8..].iter().enumerate() {
        let h0 = ((qh >> j) & 1) << 4;
        let h1 = ((qh >> (j + 16)) & 1) << 4;
        lo[j] = ((q & 0x0f) as u32 | h0) as f32 * d + m;
        hi[j] = ((q >> 4) as u32 | h1) as f32 * d + m;
    }
}

pub fn dequant_q8_0(b: &[u8; 34], out: &mut [f32; QK]) {
    let d = f16_at(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[2..]) {
        *o = q as i8 as f32 * d;
    }
}

/// Q8_1 values are `q * d`; the stored sum `s` only serves integer dot products.
pub fn dequant_q8_1(b: &[u8; 36], out: &mut [f32; QK]) {
    let d = f16_at(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[4..]) {
        *o = q as i8 as f32 * d;
    }
}

/// The value of largest magnitude (the first one on ties), and that magnitude.
#[inline(always)]
fn signed_absmax(x: &[f32]) -> (f32, f32) {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    (max, amax)
}

#[inline(always)]
fn min_max(x: &[f32]) -> (f32, f32) {
    let mut min = f32::MAX;
    let mut max = -f32::MAX;
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

/// C's `(int8_t)value` as x86-64 compilers emit it: truncate to a 32-bit integer
/// (`cvttss2si`, which gives 0x8000_0000 for NaN and out-of-range values) and keep the low
/// byte. Ordinary blocks never leave [-128, 127]; degenerate ones do (subnormal inputs whose
/// `1 / d` overflows to infinity), and matching this keeps the bytes equal to ggml's and
/// gguf-py's there too. Rust's saturating `as i8` would differ.
#[inline(always)]
fn c_to_i8(value: f32) -> i8 {
    if (-2_147_483_648.0..2_147_483_648.0).contains(&value) {
        value as i32 as i8
    } else {
        0
    }
}

#[inline(always)]
fn inverse_or_zero(d: f32) -> f32 {
    if d != 0.0 { 1.0 / d } else { 0.0 }
}

/// Packs 32 quants of up to 5 bits: low nibbles into 16 bytes, bit 4 into a u32.
#[inline(always)]
fn pack_low_nibbles(q: &[u8; QK], qs: &mut [u8]) -> u32 {
    let mut qh = 0u32;
    for j in 0..16 {
        let (q0, q1) = (q[j], q[j + 16]);
        qs[j] = (q0 & 0x0f) | ((q1 & 0x0f) << 4);
        qh |= (((q0 & 0x10) >> 4) as u32) << j;
        qh |= (((q1 & 0x10) >> 4) as u32) << (j + 16);
    }
    qh
}

pub fn quant_q4_0(x: &[f32; QK], b: &mut [u8; 18]) {
    let (max, _) = signed_absmax(x);
    let d = max / -8.0;
    let id = inverse_or_zero(d);
    put_f16(b, 0, d);
    for j in 0..16 {
        let q0 = c_to_i8(x[j] * id + 8.5).min(15) as u8;
        let q1 = c_to_i8(x[j + 16] * id + 8.5).min(15) as u8;
        b[2 + j] = q0 | (q1 << 4);
    }
}

pub fn quant_q4_1(x: &[f32; QK], b: &mut [u8; 20]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = inverse_or_zero(d);
    put_f16(b, 0, d);
    put_f16(b, 2, min);
    for j in 0..16 {
        let q0 = c_to_i8((x[j] - min) * id + 0.5).min(15) as u8;
        let q1 = c_to_i8((x[j + 16] - min) * id + 0.5).min(15) as u8;
        b[4 + j] = q0 | (q1 << 4);
    }
}

pub fn quant_q5_0(x: &[f32; QK], b: &mut [u8; 22]) {
    let (max, _) = signed_absmax(x);
    let d = max / -16.0;
    let id = inverse_or_zero(d);
    put_f16(b, 0, d);
    let mut q = [0u8; QK];
    for (q, &v) in q.iter_mut().zip(x) {
        *q = c_to_i8(v * id + 16.5).min(31) as u8;
    }
    let qh = pack_low_nibbles(&q, &mut b[6..]);
    b[2..6].copy_from_slice(&qh.to_le_bytes());
}

pub fn quant_q5_1(x: &[f32; QK], b: &mut [u8; 24]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = inverse_or_zero(d);
    put_f16(b, 0, d);
    put_f16(b, 2, min);
    let mut q = [0u8; QK];
    for (q, &v) in q.iter_mut().zip(x) {
        *q = c_to_i8((v - min) * id + 0.5).min(31) as u8;
    }
    let qh = pack_low_nibbles(&q, &mut b[8..]);
    b[4..8].copy_from_slice(&qh.to_le_bytes());
}

/// `max(|x|)` as ggml's `MAX(amax, fabsf(v))` computes it.
#[inline(always)]
fn absmax(x: &[f32]) -> f32 {
    x.iter().fold(
        0.0f32,
        |amax, &v| if amax > v.abs() { amax } else { v.abs() },
    )
}

pub fn quant_q8_0(x: &[f32; QK], b: &mut [u8; 34]) {
    let d = absmax(x) / 127.0;
    let id = inverse_or_zero(d);
    put_f16(b, 0, d);
    for (q, &v) in b[2..].iter_mut().zip(x) {
        // f32::round rounds half away from zero, like C's roundf.
        *q = c_to_i8((v * id).round()) as u8;
    }
}

pub fn quant_q8_1(x: &[f32; QK], b: &mut [u8; 36]) {
    let d = absmax(x) / 127.0;
    let id = inverse_or_zero(d);
    put_f16(b, 0, d);
    let mut sum = 0i32;
    for (q, &v) in b[4..].iter_mut().zip(x) {
        let qi = c_to_i8((v * id).round());
        sum += qi as i32;
        *q = qi as u8;
    }
    put_f16(b, 2, sum as f32 * d);
}
