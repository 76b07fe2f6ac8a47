//! f16 / bf16 conversions with ggml's rounding (round to nearest even; NaN stays NaN).

pub use half::{bf16, f16};

/// f16 bits to f32; exact (NaNs come back quiet, payload kept).
///
/// Plain integer code rather than `half::f16::to_f32`, which checks for the F16C
/// instruction at run time on every call and so cannot be inlined or vectorized in
/// dequantization loops.
#[inline(always)]
pub fn f16_to_f32(bits: u16) -> f32 {
    // Every case is computed and one selected, so that loops over many values vectorize.
    let magnitude = (bits & 0x7fff) as u32;
    let sign = ((bits & 0x8000) as u32) << 16;
    // Normal: rebias the exponent from 15 to 127.
    let normal = (magnitude << 13) + ((127 - 15) << 23);
    // Zero or subnormal: magnitude * 2^-24, exact in f32.
    let subnormal = (magnitude as i32 as f32 * (1.0 / 16_777_216.0)).to_bits();
    // Infinity or NaN (made quiet).
    let quiet = if magnitude > 0x7c00 { 0x0040_0000 } else { 0 };
    let special = (magnitude << 13) | 0x7f80_0000 | quiet;
    let out = if magnitude < 0x0400 {
        subnormal
    } else if magnitude >= 0x7c00 {
        special
    } else {
        normal
    };
    f32::from_bits(sign | out)
}

/// f32 to f16 bits, round to nearest even (as `GGML_FP32_TO_FP16` and numpy's `astype(float16)`).
#[inline(always)]
pub fn f32_to_f16(value: f32) -> u16 {
    f16::from_f32(value).to_bits()
}

/// bf16 bits to f32; exact.
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// f32 to bf16 bits as ggml does it: NaN becomes a quiet NaN, everything else rounds to
/// nearest even (overflowing to infinity).
#[inline(always)]
pub fn f32_to_bf16(value: f32) -> u16 {
    let bits = value.to_bits();
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        return ((bits >> 16) | 64) as u16;
    }
    ((bits as u64 + 0x7fff + ((bits >> 16) & 1) as u64) >> 16) as u16
}

/// Converts little-endian f16 bytes to f32 (`src.len() == 2 * dst.len()`), a chunk at a
/// time through `half`'s slice conversion, which uses the CPU's F16C instructions when it
/// has them (4-8x faster than converting value by value).
pub(crate) fn f16_bytes_to_f32(src: &[u8], dst: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    const CHUNK: usize = 256;
    let mut buf = [f16::ZERO; CHUNK];
    for (out, bytes) in dst.chunks_mut(CHUNK).zip(src.chunks(2 * CHUNK)) {
        let halves = &mut buf[..out.len()];
        for (h, b) in halves.iter_mut().zip(bytes.chunks_exact(2)) {
            *h = f16::from_le_bytes([b[0], b[1]]);
        }
        halves.convert_to_f32_slice(out);
    }
}

/// Reads a little-endian f16 at `bytes[0..2]` as f32.
#[inline(always)]
pub(crate) fn read_f16(bytes: &[u8; 2]) -> f32 {
    f16_to_f32(u16::from_le_bytes(*bytes))
}
