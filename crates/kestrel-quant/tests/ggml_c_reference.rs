//! Optional check against llama.cpp's own C reference quantizers (`quantize_row_*_ref`),
//! for the formats gguf-py cannot quantize (the K-quants, Q8_1).
//!
//! Ignored by default because it needs a ggml source tree. To run it:
//!   GGML_HARNESS=/path/to/harness cargo test -p kestrel-quant --test ggml_c_reference -- --ignored
//! where `harness` is `tests/ggml_harness.c` built against ggml (build line in that file).
//! Build it with `-ffp-contract=off`: GCC otherwise fuses multiply-adds in the scale
//! searches (make_qkx2_quants, ...), which changes a few blocks' choices from build to build
//! (with FMA fusion about 1% of Q2_K blocks differ); this crate never fuses.

use std::path::Path;
use std::process::Command;

use kestrel_quant::{GgmlType, quantize};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

fn c_quantize(harness: &Path, ty: GgmlType, values: &[f32], dir: &Path) -> Vec<u8> {
    let (src, dst) = (dir.join("in.f32"), dir.join("out.bin"));
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(&src, bytes).expect("write input");
    let name = ty.name().to_uppercase();
    let status = Command::new(harness)
        .args([
            name.as_str(),
            &src.to_string_lossy(),
            &dst.to_string_lossy(),
        ])
        .status()
        .expect("run harness");
    assert!(status.success(), "harness failed for {ty}");
    std::fs::read(&dst).expect("read output")
}

#[test]
#[ignore = "needs GGML_HARNESS built from a ggml source tree"]
fn quantizers_match_ggml_c_reference() {
    let harness = std::env::var("GGML_HARNESS").expect("set GGML_HARNESS");
    let dir = tempfile::tempdir().expect("temp dir");
    let seed: u64 = std::env::var("KESTREL_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(7);
    let mut rng = StdRng::seed_from_u64(seed);
    for ty in [
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
    ] {
        let bs = ty.block_size();
        let mut values = Vec::new();
        for b in 0..400 {
            let scale = 10f32.powi(rng.random_range(-5..=3));
            let normal = Normal::new(0.0f32, scale).expect("normal");
            let mut block: Vec<f32> = (0..bs).map(|_| normal.sample(&mut rng)).collect();
            match b % 8 {
                0 => block.fill(0.0),
                1 => block.iter_mut().for_each(|v| *v = v.abs() + scale),
                2 => block
                    .iter_mut()
                    .for_each(|v| *v = rng.random_range(-16i32..=16) as f32 * 0.125),
                3 => {
                    block.fill(0.0);
                    block[rng.random_range(0..bs)] = scale;
                }
                // Subnormals (1 / scale overflows) and huge values.
                4 => block.iter_mut().for_each(|v| *v *= 1e-38 / scale),
                5 => block.iter_mut().for_each(|v| *v *= 1e30 / scale),
                _ => {}
            }
            values.extend(block);
        }
        let ours = quantize(ty, &values, values.len()).expect("quantize");
        let theirs = c_quantize(Path::new(&harness), ty, &values, dir.path());
        assert_eq!(ours.len(), theirs.len(), "{ty}");
        let bad: Vec<usize> = (0..ours.len() / ty.type_size())
            .filter(|&b| {
                let r = b * ty.type_size()..(b + 1) * ty.type_size();
                ours[r.clone()] != theirs[r]
            })
            .collect();
        assert!(
            bad.is_empty(),
            "{ty}: {} of {} blocks differ, first {:?}",
            bad.len(),
            ours.len() / ty.type_size(),
            bad.first()
        );
    }
}
