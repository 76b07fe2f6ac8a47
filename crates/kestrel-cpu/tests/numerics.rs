//! llama.cpp's rounding (`Numerics::Ggml`) in the matmul: the fast kernels must compute
//! what the scalar f32 path computes on the input rounded to the weight's activation
//! format (the rounding placed where llama.cpp places it, for every weight type), and a
//! token's result must not depend on the other tokens of the step (bitwise), since with
//! 8-bit rounding downstream a last-bit difference can grow.

use std::sync::Arc;

use kestrel_cpu::numerics::{activation_type, round_trip};
use kestrel_cpu::{CpuBackend, CpuTensor, CpuWeight, Kernels, Numerics};
use kestrel_gguf::GgufFile;
use kestrel_model::synth::{SynthConfig, WeightType, write_synth_to};
use kestrel_model::{Arch, Backend};
use rand::{Rng, SeedableRng};

fn matrices(ty: &str, seed: u64) -> (Arc<GgufFile>, Vec<kestrel_gguf::TensorInfo>) {
    let mut cfg = SynthConfig::tiny(Arch::Llama);
    // An output matrix of 520 rows: whole groups of 16 repacked rows and 8 rows left in
    // the file's layout (`packed.rs`), in one product.
    cfg.n_vocab = 520;
    let wt: WeightType = ty.parse().expect("weight type");
    let (bytes, _) = write_synth_to(Vec::new(), &cfg, wt, seed).expect("synth");
    let file = Arc::new(GgufFile::from_bytes(bytes).expect("parses"));
    let infos = file
        .tensors()
        .iter()
        .filter(|t| {
            t.dims.len() == 2 && (t.name.starts_with("blk.0.") || t.name == "output.weight")
        })
        .cloned()
        .collect();
    (file, infos)
}

fn matmul(be: &CpuBackend, w: &CpuWeight, x: &[f32], k: usize, n_out: usize) -> Vec<f32> {
    let n = x.len() / k;
    let xt = CpuTensor {
        data: x.to_vec(),
        cols: k,
    };
    let mut out = CpuTensor {
        data: vec![0.0; n * n_out],
        cols: n_out,
    };
    be.matmul(&xt, w, n, &mut out);
    out.data
}

fn largest_difference(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

#[test]
fn ggml_matmul_is_the_f32_product_of_the_rounded_input_and_batch_invariant() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    let fast = CpuBackend::with_numerics(Kernels::Fast, Numerics::Ggml);
    let scalar_f32 = CpuBackend::with_numerics(Kernels::Scalar, Numerics::F32);
    let mut checked = std::collections::BTreeSet::new();
    for ty in [
        "f32", "f16", "bf16", "q8_0", "q4_0", "q5_0", "q4_k_m", "q6_k", "iq4_nl", "iq4_xs", "mxfp4",
    ] {
        let (file, infos) = matrices(ty, rng.random());
        for info in infos {
            let w = fast.load_weight(&file, &info).expect("weight");
            let (k, n_out) = (info.dims[0] as usize, info.dims[1] as usize);
            // 1 and 4 tokens take the decode kernels, 9 the prompt ones.
            for n in [1usize, 4, 9] {
                // Activations of mixed magnitude, as residual streams have.
                let x: Vec<f32> = (0..n * k)
                    .map(|_| {
                        rng.random_range(-1.0f32..1.0)
                            * if rng.random_bool(0.05) { 30.0 } else { 1.0 }
                    })
                    .collect();
                let got = matmul(&fast, &w, &x, k, n_out);
                let rounded = match activation_type(info.ty) {
                    Some(act) => {
                        let (mut bytes, mut r) = (Vec::new(), Vec::new());
                        round_trip(act, &x, &mut bytes, &mut r);
                        r
                    }
                    None => x.clone(),
                };
                let want = matmul(&scalar_f32, &w, &rounded, k, n_out);
                let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
                let worst = largest_difference(&got, &want) / scale;
                assert!(
                    worst <= 2e-6,
                    "{} ({}), {n} tokens: {worst:e} of the largest output off the rounded \
                     product",
                    info.name,
                    info.ty
                );
                // The unrounded product is measurably different, so the check above can
                // tell whether the rounding happened (f32 weights take no rounding).
                if activation_type(info.ty).is_some() {
                    let unrounded = matmul(&scalar_f32, &w, &x, k, n_out);
                    let moved = largest_difference(&unrounded, &want) / scale;
                    assert!(
                        moved > 1e-5,
                        "{}: rounding changes nothing ({moved:e})",
                        info.name
                    );
                }
                // Token by token, the same bits.
                for i in 0..n {
                    let alone = matmul(&fast, &w, &x[i * k..(i + 1) * k], k, n_out);
                    assert!(
                        alone == got[i * n_out..(i + 1) * n_out],
                        "{} ({}): token {i} of {n} differs from the same token alone",
                        info.name,
                        info.ty
                    );
                }
                checked.insert(info.ty.to_string());
            }
        }
    }
    eprintln!("weight types checked: {checked:?}");
    assert!(
        checked.len() >= 7,
        "too few weight types reached: {checked:?}"
    );
}
