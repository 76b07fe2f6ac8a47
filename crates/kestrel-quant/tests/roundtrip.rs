//! Quantize -> dequantize error bounds, vec_dot against an f64 oracle, and length errors.

use kestrel_quant::{
    GgmlType, QuantError, can_dequantize, can_quantize, dequantize, dequantize_row, quantize,
    quantize_row, row_bytes, try_vec_dot, vec_dot,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

const QUANT_TYPES: [GgmlType; 18] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q8_1,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::Q8K,
    GgmlType::IQ4NL,
    GgmlType::IQ4XS,
    GgmlType::MXFP4,
];

/// Relative RMS error bound (error RMS / data RMS) for Gaussian data. Loose enough for
/// every block's luck, tight enough to catch a wrong layout (which gives errors near 1).
fn rms_bound(ty: GgmlType) -> f64 {
    // About 1.3x the worst case seen with the fixed seeds below.
    match ty {
        GgmlType::F32 => 0.0,
        GgmlType::F16 => 4e-4,
        GgmlType::BF16 => 2.5e-3,
        GgmlType::Q8_0 | GgmlType::Q8_1 => 8e-3,
        GgmlType::Q8K => 0.012,
        GgmlType::Q6K => 0.025,
        GgmlType::Q5K => 0.05,
        GgmlType::Q5_1 => 0.055,
        GgmlType::Q5_0 => 0.07,
        GgmlType::Q4K => 0.095,
        GgmlType::Q4_1 => 0.11,
        GgmlType::Q4_0 => 0.13,
        GgmlType::Q3K => 0.21,
        GgmlType::Q2K => 0.4,
        GgmlType::IQ4NL => 0.115,
        GgmlType::IQ4XS => 0.1,
        GgmlType::MXFP4 => 0.15,
        _ => f64::INFINITY,
    }
}

fn gaussian(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    let normal = Normal::new(0.0f32, scale).expect("valid normal");
    (0..n).map(|_| normal.sample(rng)).collect()
}

fn rel_rms_error(a: &[f32], b: &[f32]) -> f64 {
    let err: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
        .sum();
    let norm: f64 = a.iter().map(|&x| (x as f64).powi(2)).sum();
    (err / norm.max(f64::MIN_POSITIVE)).sqrt()
}

#[test]
fn every_listed_type_is_supported() {
    for ty in QUANT_TYPES {
        assert!(can_quantize(ty), "{ty}");
        assert!(can_dequantize(ty), "{ty}");
    }
    for ty in [GgmlType::I8, GgmlType::I32, GgmlType::F64] {
        assert!(!can_quantize(ty) && !can_dequantize(ty), "{ty}");
    }
}

#[test]
fn quantize_dequantize_error_is_bounded() {
    let mut rng = StdRng::seed_from_u64(0x5eed_0001);
    for ty in QUANT_TYPES {
        let bs = ty.block_size();
        // One block, a few blocks, and rows whose length is an odd number of blocks.
        for (rows, blocks_per_row) in [(1, 1), (1, 3), (3, 7), (2, 12)] {
            let row_len = bs * blocks_per_row;
            let scale = [1e-3f32, 0.02, 1.0, 300.0][rng.random_range(0..4)];
            let data = gaussian(&mut rng, rows * row_len, scale);
            let q = quantize(ty, &data, row_len).expect("quantize");
            assert_eq!(q.len(), rows * row_bytes(ty, row_len).expect("row bytes"));
            let back = dequantize(ty, &q).expect("dequantize");
            assert_eq!(back.len(), data.len());
            let err = rel_rms_error(&data, &back);
            assert!(
                err <= rms_bound(ty),
                "{ty}: rows {rows} x {row_len}, scale {scale}: relative RMS error {err}"
            );
            // Quantizing row by row gives the same bytes as quantizing all rows at once.
            let rb = row_bytes(ty, row_len).expect("row bytes");
            for r in 0..rows {
                let mut one = vec![0u8; rb];
                quantize_row(ty, &data[r * row_len..(r + 1) * row_len], &mut one).expect("row");
                assert_eq!(one, q[r * rb..(r + 1) * rb], "{ty} row {r}");
            }
        }
    }
}

#[test]
fn quantize_handles_zeros_and_constant_blocks() {
    for ty in QUANT_TYPES {
        let n = ty.block_size() * 2;
        for value in [0.0f32, 0.75, -3.5] {
            let data = vec![value; n];
            let q = quantize(ty, &data, n).expect("quantize");
            let back = dequantize(ty, &q).expect("dequantize");
            for (i, &v) in back.iter().enumerate() {
                assert!(v.is_finite(), "{ty} value {value}: element {i} is {v}");
                let tol = (value.abs() * 0.3).max(1e-6);
                assert!(
                    (v - value).abs() <= tol,
                    "{ty} value {value}: element {i} is {v}"
                );
            }
        }
    }
}

#[test]
fn vec_dot_matches_f64_dot_of_dequantized_row() {
    let mut rng = StdRng::seed_from_u64(0x5eed_0002);
    for ty in QUANT_TYPES {
        for blocks in [1, 2, 5, 9] {
            let n = ty.block_size() * blocks;
            // Awkward lengths for the element formats too.
            let n = if ty.block_size() == 1 { n * 37 + 3 } else { n };
            let data = gaussian(&mut rng, n, 0.5);
            let x = gaussian(&mut rng, n, 2.0);
            let q = quantize(ty, &data, n).expect("quantize");
            let w = dequantize(ty, &q).expect("dequantize");
            let exact: f64 = w.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
            let abs_sum: f64 = w
                .iter()
                .zip(&x)
                .map(|(&a, &b)| (a as f64 * b as f64).abs())
                .sum();
            let got = vec_dot(ty, &q, &x) as f64;
            assert!(
                (got - exact).abs() <= 1e-5 * abs_sum + 1e-30,
                "{ty} n {n}: vec_dot {got}, f64 {exact}"
            );
            assert_eq!(try_vec_dot(ty, &q, &x).ok(), Some(got as f32));
        }
    }
}

#[test]
fn length_errors_are_reported_not_panics() {
    let mut rng = StdRng::seed_from_u64(0x5eed_0003);
    for ty in QUANT_TYPES {
        let bs = ty.block_size();
        let ts = ty.type_size();
        let bytes: Vec<u8> = (0..ts * 3).map(|_| rng.random()).collect();
        let mut out = vec![0.0f32; bs * 3];

        // Too few / too many bytes for the values.
        assert!(matches!(
            dequantize_row(ty, &bytes[..ts * 2], &mut out),
            Err(QuantError::ByteLength { .. })
        ));
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(dequantize_row(ty, &longer, &mut out).is_err(), "{ty}");
        if bs > 1 {
            // Values not a whole number of blocks.
            assert!(matches!(
                dequantize_row(ty, &bytes, &mut out[..bs * 3 - 1]),
                Err(QuantError::NotWholeBlocks { .. })
            ));
            assert!(quantize(ty, &out[..bs + 1], bs + 1).is_err(), "{ty}");
        }
        if ts > 1 {
            assert!(dequantize(ty, &bytes[..ts * 2 + 1]).is_err(), "{ty}");
        }
        // Quantize with a bad destination, bad row lengths.
        let values = vec![0.5f32; bs * 3];
        let mut dst = vec![0u8; ts * 3 - 1];
        assert!(quantize_row(ty, &values, &mut dst).is_err(), "{ty}");
        assert!(quantize(ty, &values, 0).is_err(), "{ty}");
        assert!(quantize(ty, &values, bs * 2).is_err(), "{ty}");
        // vec_dot with mismatched activations.
        assert!(try_vec_dot(ty, &bytes, &values[..bs * 2]).is_err(), "{ty}");
        assert!(vec_dot(ty, &bytes[..ts * 2], &values).is_nan(), "{ty}");
        // Empty input is fine.
        assert_eq!(dequantize_row(ty, &[], &mut []), Ok(()));
        assert_eq!(vec_dot(ty, &[], &[]), 0.0);
    }
    for ty in [GgmlType::I8, GgmlType::I32, GgmlType::F64] {
        let mut out = [0.0f32; 1];
        assert!(dequantize_row(ty, &[0; 8], &mut out).is_err());
        assert!(quantize(ty, &[0.0], 1).is_err());
        assert!(vec_dot(ty, &[0; 8], &[1.0]).is_nan());
    }
}

#[test]
fn f16_and_bf16_helpers_agree_with_the_half_crate() {
    use kestrel_quant::{bf16, bf16_to_f32, f16, f16_to_f32, f32_to_bf16, f32_to_f16};
    // Every f16 bit pattern, one by one and through the row (slice) path.
    let all: Vec<u16> = (0..=u16::MAX).collect();
    let bytes: Vec<u8> = all.iter().flat_map(|h| h.to_le_bytes()).collect();
    let row = dequantize(GgmlType::F16, &bytes).expect("dequantize f16");
    for &h in &all {
        let want = f16::from_bits(h).to_f32();
        for (how, got) in [("scalar", f16_to_f32(h)), ("row", row[h as usize])] {
            if want.is_nan() {
                assert!(got.is_nan(), "{how} f16 {h:#06x}: {got}");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "{how} f16 {h:#06x}");
            }
        }
        // ggml widens bf16 by a plain shift (half quiets signalling NaNs; bits differ there).
        let b = bf16::from_bits(h).to_f32();
        if b.is_nan() {
            assert!(bf16_to_f32(h).is_nan(), "bf16 {h:#06x}");
        } else {
            assert_eq!(bf16_to_f32(h).to_bits(), b.to_bits(), "bf16 {h:#06x}");
        }
    }
    // f32 -> f16/bf16 rounding on random bit patterns plus specials.
    let mut rng = StdRng::seed_from_u64(0x5eed_0004);
    let specials = [
        0.0f32,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        65504.0,
        65520.0,
        1e-8,
        f32::MAX,
    ];
    let randoms = (0..200_000).map(|_| f32::from_bits(rng.random()));
    for v in specials.into_iter().chain(randoms) {
        let want16 = f16::from_f32(v);
        let want_b = bf16::from_f32(v);
        if v.is_nan() {
            assert!(f16::from_bits(f32_to_f16(v)).is_nan());
            assert!(bf16::from_bits(f32_to_bf16(v)).is_nan());
        } else {
            assert_eq!(f32_to_f16(v), want16.to_bits(), "f16 of {v:e}");
            assert_eq!(f32_to_bf16(v), want_b.to_bits(), "bf16 of {v:e}");
        }
    }
}
