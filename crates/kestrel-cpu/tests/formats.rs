//! Products through the codebook formats (IQ4_NL, IQ4_XS, MXFP4): the CPU backend's
//! matmul, on every kernel path and with both numerics, against an f64 product of the
//! dequantized weights (kestrel-quant's dequantizers match gguf-py bit for bit, see its
//! python_oracle test) with the input rounded as each numerics rounds it.

use std::sync::Arc;

use kestrel_cpu::numerics::{activation_type, round_trip};
use kestrel_cpu::{CpuBackend, CpuTensor, Kernels, Numerics};
use kestrel_gguf::{GgmlType, GgufFile, GgufWriter};
use kestrel_model::Backend;
use rand::{Rng, SeedableRng};

/// A file holding one `[rows × k]` matrix of `ty` quantized from random values, and its
/// dequantized values.
fn matrix_file(
    ty: GgmlType,
    rows: usize,
    k: usize,
    rng: &mut impl Rng,
) -> (Arc<GgufFile>, Vec<f32>) {
    let values: Vec<f32> = (0..rows * k)
        .map(|_| rng.random_range(-1.0f32..1.0) * if rng.random_bool(0.02) { 8.0 } else { 0.05 })
        .collect();
    let bytes = kestrel_quant::quantize(ty, &values, k).expect("quantize");
    let deq = kestrel_quant::dequantize(ty, &bytes).expect("dequantize");
    let mut w = GgufWriter::new();
    w.add_tensor_with_data("w", &[k as u64, rows as u64], ty, bytes)
        .expect("tensor");
    let file = GgufFile::from_bytes(w.write_to_vec().expect("write")).expect("parses");
    (Arc::new(file), deq)
}

#[test]
fn codebook_matmuls_match_the_dequantized_product() {
    let seed: u64 = rand::random();
    eprintln!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    // Row counts that fill no whole task or group of 16; row lengths of an odd number of
    // blocks.
    for (ty, rows, k) in [
        (GgmlType::IQ4NL, 37, 32 * 9),
        (GgmlType::IQ4XS, 19, 256 * 3),
        (GgmlType::MXFP4, 53, 32 * 5),
        (GgmlType::MXFP4, 16, 32),
    ] {
        let (file, deq) = matrix_file(ty, rows, k, &mut rng);
        let info = file.tensor("w").expect("tensor").clone();
        for kernels in [Kernels::Scalar, Kernels::Fast] {
            for numerics in [Numerics::F32, Numerics::Ggml] {
                let be = CpuBackend::with_numerics(kernels, numerics);
                let w = be.load_weight(&file, &info).expect("loads");
                for n in [1usize, 3, 7] {
                    let x: Vec<f32> = (0..n * k).map(|_| rng.random_range(-2.0f32..2.0)).collect();
                    let mut out = CpuTensor {
                        data: vec![0.0; n * rows],
                        cols: rows,
                    };
                    let xt = CpuTensor {
                        data: x.clone(),
                        cols: k,
                    };
                    be.matmul(&xt, &w, n, &mut out);
                    // llama.cpp rounds the input to the weight's activation format first.
                    let input = match (numerics, activation_type(ty)) {
                        (Numerics::Ggml, Some(act)) => {
                            let (mut bytes, mut r) = (Vec::new(), Vec::new());
                            round_trip(act, &x, &mut bytes, &mut r);
                            r
                        }
                        _ => x.clone(),
                    };
                    for i in 0..n {
                        for j in 0..rows {
                            let want: f64 = deq[j * k..(j + 1) * k]
                                .iter()
                                .zip(&input[i * k..(i + 1) * k])
                                .map(|(&a, &b)| a as f64 * b as f64)
                                .sum();
                            let mag: f64 = deq[j * k..(j + 1) * k]
                                .iter()
                                .zip(&input[i * k..(i + 1) * k])
                                .map(|(&a, &b)| (a as f64 * b as f64).abs())
                                .sum();
                            let got = out.data[i * rows + j] as f64;
                            assert!(
                                (got - want).abs() <= 1e-5 * mag + 1e-30,
                                "{ty} {kernels:?} {numerics:?} n={n} token {i} row {j}: \
                                 {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// llama.cpp's activation formats for these weights (its `vec_dot_type`).
#[test]
fn codebook_formats_round_their_input_as_llama_cpp() {
    assert_eq!(activation_type(GgmlType::IQ4NL), Some(GgmlType::Q8_0));
    assert_eq!(activation_type(GgmlType::MXFP4), Some(GgmlType::Q8_0));
    assert_eq!(activation_type(GgmlType::IQ4XS), Some(GgmlType::Q8K));
}
