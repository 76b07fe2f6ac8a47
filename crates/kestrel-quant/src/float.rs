//! f16 / bf16 conversions with ggml's rounding (round to nearest even; NaN stays NaN).

pub use half::{bf16, f16};

/// f16 bits (little-endian storage order already decoded) to f32; exact.
#[inline(always)]
pub fn f16_to_f32(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
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

/// Reads a little-endian f16 at `bytes[0..2]` as f32.
#[inline(always)]
pub(crate) fn read_f16(bytes: &[u8; 2]) -> f32 {
    f16_to_f32(u16::from_le_bytes(*bytes))
}
