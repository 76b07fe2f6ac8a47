//! The codebook quantizers (IQ4_NL, IQ4_XS, MXFP4), the K-quantizers, and every quantizer
//! with an importance matrix, against llama.cpp's own C code: the
//! `ggml_quantize_chunk` of the libggml-base that llama-cpp-python ships, called through
//! ctypes by `tests/ggml_lib_oracle.py`. Same bytes on Gaussian rows at many scales and on
//! rows that stress the edge cases (zeros, one spike, largest magnitude with both signs,
//! values on rounding boundaries). Skipped, with a notice, where llama-cpp-python is not
//! installed (CI installs only requirements-test.txt). Set KESTREL_TEST_SEED to replay.

use std::path::Path;
use std::process::Command;

use kestrel_quant::{GgmlType, quantize, quantize_rows_weighted, row_bytes};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

/// The test's random source: `KESTREL_TEST_SEED`, else a fresh seed (printed, to repeat a
/// failure).
fn seeded_rng() -> StdRng {
    let seed = std::env::var("KESTREL_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("KESTREL_TEST_SEED={seed}");
    StdRng::seed_from_u64(seed)
}

fn rows(rng: &mut StdRng, row_len: usize, n_rows: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(row_len * n_rows);
    for r in 0..n_rows {
        let scale = 10f32.powi(rng.random_range(-4..=3));
        let normal = Normal::new(0.0f32, scale).expect("normal");
        let mut row: Vec<f32> = (0..row_len).map(|_| normal.sample(rng)).collect();
        match r % 6 {
            0 => row[..row_len / 2].fill(0.0),
            1 => {
                row.fill(0.0);
                row[rng.random_range(0..row_len)] = scale;
            }
            2 => {
                let (i, j) = (rng.random_range(0..row_len), rng.random_range(0..row_len));
                row[i] = 4.0 * scale;
                row[j] = -4.0 * scale;
            }
            3 => row
                .iter_mut()
                .for_each(|v| *v = rng.random_range(-12i32..=12) as f32 * 0.5),
            _ => {}
        }
        out.extend(row);
    }
    out
}

#[test]
fn codebook_quantizers_match_llama_cpp_c_code() {
    let mut rng = seeded_rng();
    let dir = tempfile::tempdir().expect("temp dir");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ggml_lib_oracle.py");
    let cases = [
        (GgmlType::IQ4NL, 32 * 7),
        (GgmlType::IQ4XS, 256 * 2),
        (GgmlType::MXFP4, 32 * 9),
        // Without an imatrix ggml takes the reference K-quantizers.
        (GgmlType::Q2K, 256 * 3),
        (GgmlType::Q3K, 256 * 2),
        (GgmlType::Q4K, 256 * 5),
        (GgmlType::Q5K, 256 * 3),
        (GgmlType::Q6K, 256 * 3),
    ];
    let mut args = Vec::new();
    let mut jobs = Vec::new();
    for (i, &(ty, row_len)) in cases.iter().enumerate() {
        let values = rows(&mut rng, row_len, 60);
        let (src, dst) = (
            dir.path().join(format!("{i}.f32")),
            dir.path().join(format!("{i}.q")),
        );
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(&src, bytes).expect("write input");
        args.extend([
            ty.id().to_string(),
            row_len.to_string(),
            src.to_string_lossy().into_owned(),
            dst.to_string_lossy().into_owned(),
        ]);
        jobs.push((ty, row_len, values, dst));
    }
    let out = Command::new("python3")
        .arg(&script)
        .args(&args)
        .output()
        .expect("run python3");
    if out.status.code() == Some(3) {
        eprintln!("SKIPPED: llama-cpp-python is not installed (the C quantizers' oracle)");
        return;
    }
    assert!(
        out.status.success(),
        "ggml_lib_oracle.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (ty, row_len, values, dst) in jobs {
        let theirs = std::fs::read(dst).expect("oracle output");
        let ours = quantize(ty, &values, row_len).expect("quantize");
        assert_eq!(ours.len(), theirs.len(), "{ty}: lengths");
        let block = ty.type_size();
        let differing: Vec<usize> = (0..ours.len() / block)
            .filter(|&b| ours[b * block..(b + 1) * block] != theirs[b * block..(b + 1) * block])
            .collect();
        assert!(
            differing.is_empty(),
            "{ty}: {} of {} blocks differ from llama.cpp's, first {}",
            differing.len(),
            ours.len() / block,
            differing[0]
        );
    }
}

/// Importance weights as llama-imatrix writes them (mean squared activations per column):
/// log-normal over several decades, with some exact zeros and one all-zero block.
fn importance(rng: &mut StdRng, row_len: usize) -> Vec<f32> {
    let normal = Normal::new(0.0f32, 1.5).expect("normal");
    let mut w: Vec<f32> = (0..row_len)
        .map(|_| {
            if rng.random_range(0..20) == 0 {
                0.0
            } else {
                normal.sample(rng).exp()
            }
        })
        .collect();
    let start = 32 * rng.random_range(0..row_len / 32);
    w[start..start + 32].fill(0.0);
    w
}

/// `--imatrix` quantization (ggml's `quant_weights` paths) for every type llama-quantize
/// passes the weights to: the same bytes as `ggml_quantize_chunk` with the same imatrix, on
/// random rows of awkward lengths with random weights.
#[test]
fn weighted_quantizers_match_llama_cpp_c_code() {
    let mut rng = seeded_rng();
    let dir = tempfile::tempdir().expect("temp dir");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ggml_lib_oracle.py");
    let cases = [
        (GgmlType::Q4_0, 32 * 11),
        (GgmlType::Q4_1, 32 * 7),
        (GgmlType::Q5_0, 32 * 9),
        (GgmlType::Q5_1, 32 * 5),
        (GgmlType::Q8_0, 32 * 3),
        (GgmlType::Q2K, 256 * 3),
        (GgmlType::Q3K, 256 * 2),
        (GgmlType::Q4K, 256 * 3),
        (GgmlType::Q5K, 256 * 2),
        (GgmlType::Q6K, 256 * 3),
        (GgmlType::IQ4NL, 32 * 7),
        (GgmlType::IQ4XS, 256 * 2),
    ];
    let mut args = vec!["--imatrix".to_string()];
    let mut jobs = Vec::new();
    for (i, &(ty, row_len)) in cases.iter().enumerate() {
        let values = rows(&mut rng, row_len, 48);
        let weights = importance(&mut rng, row_len);
        let path = |ext: &str| dir.path().join(format!("{i}.{ext}"));
        let le = |v: &[f32]| v.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
        std::fs::write(path("f32"), le(&values)).expect("write input");
        std::fs::write(path("w"), le(&weights)).expect("write weights");
        args.extend([
            ty.id().to_string(),
            row_len.to_string(),
            path("f32").to_string_lossy().into_owned(),
            path("w").to_string_lossy().into_owned(),
            path("q").to_string_lossy().into_owned(),
        ]);
        jobs.push((ty, row_len, values, weights, path("q")));
    }
    let out = Command::new("python3")
        .arg(&script)
        .args(&args)
        .output()
        .expect("run python3");
    if out.status.code() == Some(3) {
        eprintln!("SKIPPED: llama-cpp-python is not installed (the C quantizers' oracle)");
        return;
    }
    assert!(
        out.status.success(),
        "ggml_lib_oracle.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut changed = 0;
    for (ty, row_len, values, weights, dst) in jobs {
        let theirs = std::fs::read(dst).expect("oracle output");
        let mut ours = vec![0u8; row_bytes(ty, values.len()).expect("size")];
        quantize_rows_weighted(ty, &values, row_len, &weights, &mut ours).expect("quantize");
        assert_eq!(ours.len(), theirs.len(), "{ty}: lengths");
        let block = ty.type_size();
        let differing: Vec<usize> = (0..ours.len() / block)
            .filter(|&b| ours[b * block..(b + 1) * block] != theirs[b * block..(b + 1) * block])
            .collect();
        assert!(
            differing.is_empty(),
            "{ty}: {} of {} blocks differ from llama.cpp's, first {}",
            differing.len(),
            ours.len() / block,
            differing[0]
        );
        // The weights matter: without them most types give other bytes.
        if quantize(ty, &values, row_len).expect("plain") != ours {
            changed += 1;
        }
    }
    assert!(
        changed >= 10,
        "only {changed} types changed with the imatrix"
    );
}

/// Weights of the wrong length are an error, not a panic.
#[test]
fn weighted_quantizer_rejects_wrong_weight_length() {
    let values = vec![0.5f32; 512];
    let mut out = vec![0u8; row_bytes(GgmlType::Q4K, 512).expect("size")];
    assert!(quantize_rows_weighted(GgmlType::Q4K, &values, 256, &[1.0; 255], &mut out).is_err());
    assert!(quantize_rows_weighted(GgmlType::Q4K, &values, 256, &[1.0; 256], &mut out).is_ok());
}
