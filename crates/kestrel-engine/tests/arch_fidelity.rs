//! Fidelity of the newer architectures against llama.cpp on tiny synthetic models:
//! Qwen3-MoE of five weight types (the codebook formats included), gpt-oss (attention
//! sinks, sliding-window layers, biases, clamped SwiGLU experts) of two, Phi-3 (fused
//! Q/K/V and gate/up matrices) and Mistral 3 (YaRN with its log multiplier, attention
//! temperature). Teacher-forced log-probs over a fixed sequence of ids are compared with
//! llama.cpp's in tests/data/tiny_archs.llamacpp.json (made by
//! scripts/tiny_archs_reference.py, which also records how far llama.cpp is from itself
//! when only its batch size changes).
//!
//! Bounds, as in fidelity.rs: top-1 agreement at least llama.cpp's own lowest minus 2
//! points; where our top-1 differs from llama.cpp's, the two are a near-tie in our
//! distribution (at most 0.25 apart; fidelity.rs allows 1.5 on the real models); and mean
//! |Δ log-prob| over the reference's top tokens at most 1.25× llama.cpp's own highest,
//! with a floor of 0.02. On these tiny models llama.cpp's own spread is 0 to 0.011, so the
//! floor is what binds: the real models' spread is 0.11–0.19 (fidelity.rs), and the dense
//! Llama-family path here sits at 0.010–0.015 on Q4_K files (Mistral 3 without its YaRN
//! and temperature keys: 0.0103 against llama.cpp's own 0.0082).
//! Measured: mean |Δ| 0.0002–0.015; two top-1 differences in 567 positions (Qwen3-MoE
//! MXFP4: llama.cpp's own top two 0.06 apart there, ours 0.14, a discrete expert choice
//! amplifying a small difference; Phi-3: 0.02).
//!
//! The linear-attention hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE: three gated DeltaNet
//! layers, then one gated full-attention layer) are held to the same bounds against
//! tests/data/hybrid_archs.llamacpp.json, with the 64 ids evaluated twice: as one prompt
//! batch and token by token (each token a step of its own, through the recurrent and
//! convolution states the previous steps left), both against llama.cpp's one batch.
//! Measured (both ways alike, bit for bit): Qwen3-Next F16 0.0010 (llama.cpp's own 0.0007),
//! Q4_K_M 0.0003 (0.0015); Qwen3.5 Q4_K_M 0.0099 (0.0144), one top-1 difference, a 0.025
//! near-tie; Qwen3.5-MoE Q4_K_M 0.0104 (0.0107). Not covered yet: Q8_0 files of the hybrids,
//! where Kestrel is exact up to some position and then off by 0.02-0.06 mean |Δ| for every
//! later one on some seeds (Qwen3-Next seed 29: 0.023, 58 of 63 top-1, gaps ≤ 0.065; other
//! seeds 0.0001-0.009). Explained (branch `q3n`, llama.cpp's eval-callback tensors): an
//! input block's amax one ulp apart puts amax/127 on the other side of an f16 rounding
//! boundary, so that block's Q8_0 activation scale moves by 2^-11, and the recurrent state
//! carries it to every later token; llama.cpp's own batch-1 run departs from its batch of 64
//! by 0.021 on seed 3 the same way. Removing the ulp differences (f64 RMS sums, ggml's
//! eight-lane Q8_0 reduction, fused conv multiply-adds, ggml's expf) makes them 0.0000, at
//! about half the CPU's Q8_0 prompt speed, so it is not merged.

use std::sync::Arc;

use kestrel_cpu::{CpuBackend, Kernels, Numerics};
use kestrel_engine::perplexity::score_window_with;
use kestrel_engine::{Engine, EngineOptions};
use kestrel_gguf::GgufFile;
use kestrel_model::config::Arch;
use kestrel_model::synth::{SynthConfig, WeightType, write_synth_to};
use serde_json::Value;

fn fnv1a(bytes: &[u8]) -> String {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

#[test]
fn tiny_models_of_the_newer_architectures_match_llama_cpp() {
    check_against_reference("tiny_archs.llamacpp.json", &[64]);
}

#[test]
fn linear_attention_hybrids_match_llama_cpp_batched_and_token_by_token() {
    check_against_reference("hybrid_archs.llamacpp.json", &[64, 1]);
}

/// Scores the reference's ids on each of its models, in steps of each of `step_tokens`
/// tokens, against llama.cpp's log-probs and spread (bounds above).
fn check_against_reference(file: &str, step_tokens: &[usize]) {
    let path = format!("{}/tests/data/{file}", env!("CARGO_MANIFEST_DIR"));
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("reference file"))
            .expect("reference json");
    let seed = reference["seed"].as_u64().expect("seed");
    let text = ids(&reference["ids"]);
    let mut failures = Vec::new();
    for (case, model) in reference["models"].as_object().expect("models") {
        let (arch, ty) = case.split_once('/').expect("arch/type");
        let wt: WeightType = ty.parse().expect("weight type");
        let cfg = SynthConfig::tiny(Arch::from_name(arch).expect("architecture"));
        let (bytes, _) = write_synth_to(Vec::new(), &cfg, wt, seed).expect("synth");
        assert_eq!(
            fnv1a(&bytes),
            model["fnv1a"].as_str().expect("hash"),
            "{case}: the synthetic model is not the one llama.cpp scored; rerun \
             scripts/tiny_archs_reference.py"
        );
        let file = Arc::new(GgufFile::from_bytes(bytes).expect("parses"));
        for &step in step_tokens {
            if let Err(f) = score_case(case, model, &file, &text, step) {
                failures.extend(f);
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// One model in steps of `step` tokens; the bounds it misses.
fn score_case(
    case: &str,
    model: &Value,
    file: &Arc<GgufFile>,
    text: &[u32],
    step: usize,
) -> Result<(), Vec<String>> {
    let (arch, ty) = case.split_once('/').expect("arch/type");
    let mut failures = Vec::new();
    {
        let opts = EngineOptions {
            ctx: 256,
            max_batch_tokens: step,
            max_logit_rows: step,
            ..EngineOptions::default()
        };
        let backend = CpuBackend::with_numerics(Kernels::Fast, Numerics::Ggml);
        let mut engine = Engine::new(backend, file.clone(), &opts).expect("engine");
        let positions = model["positions"].as_array().expect("positions");
        let (mut agree, mut abs_diff, mut n_diff, mut worst_gap) = (0usize, 0f64, 0usize, 0f64);
        score_window_with(&mut engine, text, 1, |i, lp| {
            let theirs = &positions[i];
            let top = ids(&theirs["top_ids"]);
            for (&id, l) in top.iter().zip(theirs["top_logprobs"].as_array().unwrap()) {
                abs_diff += (lp[id as usize] - l.as_f64().unwrap()).abs();
                n_diff += 1;
            }
            let best = lp.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let gap = best - lp[top[0] as usize];
            agree += usize::from(gap == 0.0);
            worst_gap = worst_gap.max(gap);
        })
        .expect("scoring");
        let agreement = agree as f64 / positions.len() as f64;
        let mean = abs_diff / n_diff as f64;
        let worst = &model["worst"];
        let env_top1 = worst["top1_agreement"].as_f64().expect("top1");
        let env_mean = worst["mean_abs_logprob_diff"].as_f64().expect("mean");
        eprintln!(
            "{arch} tiny {ty}, steps of {step}: top-1 agreement {:.1}% (llama.cpp in small batches: ≥ \
             {:.1}%), mean |Δ logprob| {mean:.4} (llama.cpp: ≤ {env_mean:.4}), largest \
             top-1 gap {worst_gap:.4}",
            agreement * 100.0,
            env_top1 * 100.0
        );
        if agreement < env_top1 - 0.02 {
            failures.push(format!(
                "{case}: top-1 agreement {agreement:.3} < {env_top1:.3}"
            ));
        }
        if mean > (1.25 * env_mean).max(0.02) {
            failures.push(format!(
                "{case}: mean |Δ logprob| {mean:.4} > 1.25 × {env_mean:.4}"
            ));
        }
        if worst_gap > 0.25 {
            failures.push(format!(
                "{case}: llama.cpp's top-1 is {worst_gap:.3} below ours"
            ));
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures
            .into_iter()
            .map(|f| format!("{f} (steps of {step})"))
            .collect())
    }
}
