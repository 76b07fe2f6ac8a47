//! Quantize -> dequantize error bounds, vec_dot against an f64 oracle, and length errors.

use kestrel_quant::{
    GgmlType, QuantError, can_dequantize, can_quantize, dequantize, dequantize_row, quantize,
    quantize_row, row_bytes, try_vec_dot, vec_dot,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

const QUANT_TYPES: [GgmlType; 15] = [
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
];

/// Relative RMS error bound (error RMS / data RMS) for Gaussian data. Loose enough for
/// every block's luck, tight enough to catch a wrong layout (which gives errors near 1).
fn rms_bound(ty: GgmlType) -> f64 {
    match ty {
        GgmlType::F32 => 0.0,
        GgmlType::F16 => 1e-3,
        GgmlType::BF16 => 5e-3,
        GgmlType::Q8_0 | GgmlType::Q8_1 | GgmlType::Q8K => 0.01,
        GgmlType::Q6K => 0.03,
        GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q5K => 0.07,
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q4K => 0.14,
        GgmlType::Q3K => 0.25,
        GgmlType::Q2K => 0.5,
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
