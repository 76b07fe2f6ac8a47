//! The CPU's mixture-of-experts block on the tiny synthetic Qwen3-MoE and gpt-oss models:
//! its output against an f64 evaluation of the definition (Qwen3-MoE: softmax router,
//! top-k, renormalized weights, SwiGLU experts; gpt-oss: biased router, softmax over the
//! top-k logits, biased experts with clamped SwiGLU) from the dequantized weights, and
//! proof that only the selected experts' bytes are read (the others poisoned with NaN
//! change nothing).

use std::sync::Arc;

use kestrel_cpu::{CpuBackend, CpuTensor, CpuWeight, Kernels, Numerics};
use kestrel_gguf::GgufFile;
use kestrel_model::synth::{SynthConfig, WeightType, write_synth_to};
use kestrel_model::{Activation, Arch, Backend, FfnKind, Gating, Model, MoeConfig};
use rand::{Rng, SeedableRng};

fn tiny_moe(arch: Arch, ty: WeightType, seed: u64) -> Vec<u8> {
    let cfg = SynthConfig::tiny(arch);
    write_synth_to(Vec::new(), &cfg, ty, seed).expect("synth").0
}

fn moe_of(model: &Model<CpuBackend>) -> MoeConfig {
    match model.config.ffn {
        FfnKind::Moe(m) => m,
        FfnKind::Dense => panic!("qwen3moe must have an MoE block"),
    }
}

fn deq(file: &GgufFile, name: &str) -> Vec<f32> {
    let info = file.tensor(name).expect(name);
    kestrel_quant::dequantize(info.ty, file.tensor_data(info)).expect("dequantize")
}

fn run_moe(be: &CpuBackend, model: &Model<CpuBackend>, layer: usize, x: &[f32]) -> Vec<f32> {
    let d = model.config.n_embd;
    let n = x.len() / d;
    let xt = CpuTensor {
        data: x.to_vec(),
        cols: d,
    };
    let mut out = CpuTensor {
        data: vec![0.0; n * d],
        cols: d,
    };
    be.moe_ffn(
        &xt,
        &model.weights.layers[layer],
        &moe_of(model),
        Activation::Silu,
        n,
        &mut out,
    )
    .expect("moe_ffn");
    out.data
}

/// The block in f64 from the dequantized weights, written from the definition.
fn reference(file: &GgufFile, moe: &MoeConfig, layer: usize, d: usize, x: &[f32]) -> Vec<f64> {
    let name = |s: &str| format!("blk.{layer}.{s}");
    let router = deq(file, &name("ffn_gate_inp.weight"));
    let (gate, up, down) = (
        deq(file, &name("ffn_gate_exps.weight")),
        deq(file, &name("ffn_up_exps.weight")),
        deq(file, &name("ffn_down_exps.weight")),
    );
    let ff = moe.n_ff_exp;
    // gpt-oss's biases (zeros where the model has none).
    let bias = |s: &str, len: usize| match file.tensor(&name(s)) {
        Some(_) => deq(file, &name(s)),
        None => vec![0.0; len],
    };
    let router_b = bias("ffn_gate_inp.bias", moe.n_expert);
    let (gate_b, up_b, down_b) = (
        bias("ffn_gate_exps.bias", moe.n_expert * ff),
        bias("ffn_up_exps.bias", moe.n_expert * ff),
        bias("ffn_down_exps.bias", moe.n_expert * d),
    );
    let act = |g: f64, u: f64| match moe.clamped_swiglu {
        Some(c) => {
            let (limit, alpha) = (c.limit as f64, c.alpha as f64);
            let x = g.min(limit);
            x / (1.0 + (-alpha * x).exp()) * (u.clamp(-limit, limit) + 1.0)
        }
        None => g / (1.0 + (-g).exp()) * u,
    };
    let dot = |w: &[f32], v: &[f64]| -> f64 { w.iter().zip(v).map(|(&a, &b)| a as f64 * b).sum() };
    let mut out = Vec::new();
    for xt in x.chunks_exact(d) {
        let xt: Vec<f64> = xt.iter().map(|&v| v as f64).collect();
        let logits: Vec<f64> = router
            .chunks_exact(d)
            .zip(&router_b)
            .map(|(r, &b)| dot(r, &xt) + b as f64)
            .collect();
        let mut order: Vec<usize> = (0..moe.n_expert).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        let top = &order[..moe.n_expert_used];
        // Softmax over all experts or over the selected ones, then renormalized or not.
        let pool: &[usize] = match moe.gating {
            Gating::Softmax => &order,
            Gating::TopKSoftmax => top,
        };
        let z: f64 = pool.iter().map(|&e| logits[e].exp()).sum();
        let total: f64 = if moe.norm_top_k {
            top.iter().map(|&e| logits[e].exp() / z).sum()
        } else {
            1.0
        };
        let mut y = vec![0f64; d];
        for &e in top {
            let w = logits[e].exp() / z / total;
            let h: Vec<f64> = (0..ff)
                .map(|j| {
                    let row = (e * ff + j) * d;
                    let g = dot(&gate[row..row + d], &xt) + gate_b[e * ff + j] as f64;
                    let u = dot(&up[row..row + d], &xt) + up_b[e * ff + j] as f64;
                    act(g, u)
                })
                .collect();
            for (i, yi) in y.iter_mut().enumerate() {
                let row = (e * d + i) * ff;
                *yi += w * (dot(&down[row..row + ff], &h) + down_b[e * d + i] as f64);
            }
        }
        out.extend(y);
    }
    out
}

#[test]
fn moe_block_matches_the_f64_definition() {
    let seed: u64 = rand::random();
    eprintln!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for (arch, ty) in [
        (Arch::Qwen3Moe, WeightType::F32),
        (Arch::Qwen3Moe, WeightType::Q8_0),
        (Arch::Qwen3Moe, WeightType::Q4KM),
        (Arch::GptOss, WeightType::F32),
        (Arch::GptOss, WeightType::Mxfp4),
    ] {
        let bytes = tiny_moe(arch, ty, rng.random());
        let file = Arc::new(GgufFile::from_bytes(bytes).expect("parses"));
        for kernels in [Kernels::Scalar, Kernels::Fast] {
            let be = CpuBackend::with_numerics(kernels, Numerics::F32);
            let model = Model::load(&be, file.clone()).expect("loads");
            let (d, moe) = (model.config.n_embd, moe_of(&model));
            assert_eq!(
                moe.norm_top_k,
                arch == Arch::Qwen3Moe,
                "Qwen3-MoE renormalizes its top-k weights"
            );
            for n in [1usize, 2, 7] {
                let x: Vec<f32> = (0..n * d).map(|_| rng.random_range(-2.0f32..2.0)).collect();
                let got = run_moe(&be, &model, 1, &x);
                let want = reference(&file, &moe, 1, d, &x);
                let scale = want.iter().fold(1e-9f64, |m, v| m.max(v.abs()));
                let worst = got
                    .iter()
                    .zip(&want)
                    .map(|(&g, w)| (g as f64 - w).abs())
                    .fold(0f64, f64::max);
                assert!(
                    worst <= 1e-4 * scale,
                    "{arch:?} {ty} {kernels:?} n={n}: off by {worst:e} of {scale:e}"
                );
            }
        }
    }
}

#[test]
fn only_the_selected_experts_are_read() {
    let seed: u64 = rand::random();
    eprintln!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let bytes = tiny_moe(Arch::Qwen3Moe, WeightType::F32, rng.random());
    let file = Arc::new(GgufFile::from_bytes(bytes.clone()).expect("parses"));
    let be = CpuBackend::with_numerics(Kernels::Fast, Numerics::Ggml);
    let model = Model::load(&be, file.clone()).expect("loads");
    let (d, moe) = (model.config.n_embd, moe_of(&model));
    let layer = 0;
    let n = 3;
    let x: Vec<f32> = (0..n * d).map(|_| rng.random_range(-2.0f32..2.0)).collect();
    let before = run_moe(&be, &model, layer, &x);

    // The experts these tokens select, by the router product and rule the block uses.
    let router: &CpuWeight = model.weights.layers[layer]
        .ffn_gate_inp
        .as_ref()
        .expect("router");
    let mut logits = CpuTensor {
        data: vec![0.0; n * moe.n_expert],
        cols: moe.n_expert,
    };
    let xt = CpuTensor {
        data: x.clone(),
        cols: d,
    };
    be.matmul(&xt, router, n, &mut logits);
    let mut used = vec![false; moe.n_expert];
    for l in logits.data.chunks_exact(moe.n_expert) {
        let mut routes = vec![(0, 0.0); moe.n_expert_used];
        kestrel_model::moe::route(&moe, l, &mut routes);
        routes.iter().for_each(|&(e, _)| used[e] = true);
    }
    assert!(
        used.iter().any(|u| !u),
        "every expert selected: nothing to poison"
    );

    // NaN in every other expert's rows of the three stacked tensors.
    drop(model);
    let mut poisoned = bytes;
    for s in ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"] {
        let info = file
            .tensor(&format!("blk.{layer}.{s}.weight"))
            .expect("experts");
        let start = file.tensor_data(info).as_ptr() as usize - file.as_bytes().as_ptr() as usize;
        let per_expert = info.n_bytes() as usize / moe.n_expert;
        for e in (0..moe.n_expert).filter(|&e| !used[e]) {
            let at = start + e * per_expert;
            for v in poisoned[at..at + per_expert].chunks_exact_mut(4) {
                v.copy_from_slice(&f32::NAN.to_le_bytes());
            }
        }
    }
    let file2 = Arc::new(GgufFile::from_bytes(poisoned).expect("parses"));
    let model2 = Model::load(&be, file2).expect("loads");
    let after = run_moe(&be, &model2, layer, &x);
    assert!(
        after.iter().all(|v| v.is_finite()),
        "a poisoned expert was read"
    );
    assert!(
        before == after,
        "outputs differ after poisoning unused experts"
    );
}
