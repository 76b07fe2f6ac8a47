//! How the CPU backend rounds intermediate values.
//!
//! llama.cpp's CPU path does not compute in f32 throughout: every matmul rounds its input
//! to the weight type's "vec_dot" format (8-bit blocks for quantized weights, f16 for f16
//! weights), attention multiplies f16 keys and values with a query and probabilities
//! rounded to f16, and GELU is read from a table indexed by the f16 input. On small models
//! that rounding moves log-probs by ~0.1 and flips near-tied choices, so giving llama.cpp's
//! answers means rounding where it rounds. [`Numerics::Ggml`] does that; [`Numerics::F32`]
//! keeps activations in f32 (the KV cache is in its storage type in both).

use std::sync::OnceLock;

use half::f16;
use kestrel_gguf::GgmlType;

/// Where the backend rounds activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Numerics {
    /// llama.cpp's CPU rounding (the default): matmul inputs rounded to the weight's
    /// activation format, attention query and probabilities to f16, GELU by f16 table.
    Ggml,
    /// f32 activations everywhere.
    F32,
}

impl Numerics {
    /// The default, or what `KESTREL_CPU_NUMERICS` (`ggml` or `f32`) asks for.
    pub fn from_env() -> Numerics {
        static CHOICE: OnceLock<Numerics> = OnceLock::new();
        *CHOICE.get_or_init(|| match std::env::var("KESTREL_CPU_NUMERICS") {
            Ok(v) if v.eq_ignore_ascii_case("f32") => Numerics::F32,
            Ok(v) if !v.is_empty() && !v.eq_ignore_ascii_case("ggml") => {
                eprintln!("warning: KESTREL_CPU_NUMERICS={v:?} is not `ggml` or `f32`; using ggml");
                Numerics::Ggml
            }
            _ => Numerics::Ggml,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Numerics::Ggml => "ggml numerics",
            Numerics::F32 => "f32 activations",
        }
    }
}

/// The format llama.cpp rounds a matmul's input to for weights of `ty` (its
/// `vec_dot_type`); `None` for f32 weights, which take the input as it is.
pub fn activation_type(ty: GgmlType) -> Option<GgmlType> {
    use GgmlType as T;
    match ty {
        T::Q4_0 | T::Q5_0 | T::Q8_0 | T::IQ4NL | T::MXFP4 => Some(T::Q8_0),
        T::Q4_1 | T::Q5_1 => Some(T::Q8_1),
        T::Q2K | T::Q3K | T::Q4K | T::Q5K | T::Q6K | T::IQ4XS => Some(T::Q8K),
        T::F16 => Some(T::F16),
        T::BF16 => Some(T::BF16),
        _ => None,
    }
}

/// Rounds `x` (rows of whole `act` blocks) to `act` and back into `out`, so f32 kernels
/// then compute what an integer (or f16) dot product on the rounded input computes, up
/// to the order of f32 additions. `bytes` is scratch for the quantized form.
///
/// For Q8_1 the block sum llama.cpp stores is itself rounded to f16; that last rounding
/// is not reproduced (it moves results by ~1e-4 relative; no reference model uses it).
pub fn round_trip(act: GgmlType, x: &[f32], bytes: &mut Vec<u8>, out: &mut Vec<f32>) {
    out.resize(x.len(), 0.0);
    let n_bytes = act.bytes_for(x.len() as u64).unwrap_or(0) as usize;
    bytes.resize(n_bytes, 0);
    // Row lengths were checked against the weight's block size at load, and every
    // activation format here has the same or a dividing block size: these cannot fail.
    let quantized = quantize_like_ggml(act, x, bytes);
    if !(quantized && kestrel_quant::dequantize_row(act, bytes, out).is_ok()) {
        out.copy_from_slice(x);
    }
}

/// Quantizes `x` (whole `ty` blocks) into `out` (exactly their bytes) with the quantizer
/// ggml's CPU backend runs for `ty` (its `from_float`): Q8_0 by [`quantize_q8_0`], every
/// other type by its reference quantizer. False if `ty` has none or the sizes are wrong.
pub fn quantize_like_ggml(ty: GgmlType, x: &[f32], out: &mut [u8]) -> bool {
    if ty == GgmlType::Q8_0 {
        if ty.bytes_for(x.len() as u64) != Some(out.len() as u64) {
            return false;
        }
        quantize_q8_0(x, out);
        true
    } else {
        kestrel_quant::quantize_row(ty, x, out).is_ok()
    }
}

/// Quantizes activations (whole 32-value blocks) to Q8_0 as ggml's x86 code does: scale
/// `amax / 127` stored as f16, quants `round_half_even(x · 127 / amax)` (its AVX path, not
/// the reference `roundf`). `out` holds 34 bytes per block.
pub fn quantize_q8_0(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(32).zip(out.chunks_exact_mut(34)) {
        let d = q8_0_block(xb, &mut ob[2..]);
        ob[..2].copy_from_slice(&d.to_bits().to_le_bytes());
    }
}

/// One block of [`quantize_q8_0`]: writes the 32 quants, returns the scale.
pub fn q8_0_block(xb: &[f32], qs: &mut [u8]) -> f16 {
    let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    // Round half to even by the f32 magic number (exact for |v| < 2^22; |x · id| <= 127),
    // which compiles to adds where `round_ties_even` calls libm without SSE4.1.
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23
    for (q, v) in qs.iter_mut().zip(xb) {
        let r = (v * id + MAGIC) - MAGIC;
        *q = (r as i32).clamp(-127, 127) as i8 as u8;
    }
    f16::from_f32(amax / 127.0)
}

/// Rounds to the nearest f16 (ties to even, as F16C does) and back.
#[inline]
pub fn round_f16(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// GELU (tanh form) in f32, the function both paths start from.
#[inline]
pub fn gelu_f32(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF_A: f32 = 0.044_715;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + COEF_A * x * x)).tanh())
}

/// GELU as ggml's CPU path computes it: 0 below -10, identity above 10, and otherwise
/// the f16-rounded GELU of the f16-rounded input (a 64 K-entry table).
#[inline]
pub fn gelu_ggml(x: f32) -> f32 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        gelu_table()[f16::from_f32(x).to_bits() as usize]
    }
}

fn gelu_table() -> &'static [f32] {
    static TABLE: OnceLock<Vec<f32>> = OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|bits| round_f16(gelu_f32(f16::from_bits(bits).to_f32())))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_table_is_the_f16_rounded_gelu() {
        for &x in &[
            -12.0f32, -10.0, -3.3, -0.001, 0.0, 0.37, 1.0, 9.99, 10.0, 40.0,
        ] {
            let want = if x <= -10.0 {
                0.0
            } else if x >= 10.0 {
                x
            } else {
                round_f16(gelu_f32(round_f16(x)))
            };
            assert_eq!(gelu_ggml(x), want, "x = {x}");
        }
        // Rounding is visible: the table is not the f32 function.
        assert_ne!(gelu_ggml(0.123_456), gelu_f32(0.123_456));
    }

    #[test]
    fn round_trip_q8_0_keeps_block_maximum_and_eight_bits() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.173)
            .collect();
        let (mut b, mut out) = (Vec::new(), Vec::new());
        round_trip(GgmlType::Q8_0, &x, &mut b, &mut out);
        for (blk_x, blk_o) in x.chunks(32).zip(out.chunks(32)) {
            let amax = blk_x.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = round_f16(amax / 127.0);
            for (a, o) in blk_x.iter().zip(blk_o) {
                let q = o / d;
                assert!((q - q.round()).abs() < 1e-3, "not a multiple of the scale");
                assert!((a - o).abs() <= 0.5 * d + 1e-3 * amax, "{a} -> {o}");
            }
        }
    }
}
