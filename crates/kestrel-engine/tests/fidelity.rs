//! Fidelity against llama.cpp's own output on the two real models (../shared/reference):
//! teacher-forced log-probs over 512 tokens of two texts, perplexity, and greedy
//! continuations.

use std::sync::Arc;

use kestrel_cpu::{CpuBackend, Kernels};
use kestrel_engine::perplexity::score_window_with;
use kestrel_engine::sampler::SamplerParams;
use kestrel_engine::{Engine, EngineOptions, Sequence};
use kestrel_gguf::GgufFile;
use serde_json::Value;

fn load(model: &str, max_logit_rows: usize) -> (Engine<CpuBackend>, Value) {
    let path = kestrel_hub::resolve_model(model).expect("model available");
    let file = Arc::new(GgufFile::open(&path).expect("model opens"));
    let opts = EngineOptions {
        ctx: 1024,
        max_batch_tokens: 128,
        max_logit_rows,
        ..EngineOptions::default()
    };
    let engine = Engine::new(CpuBackend::new(Kernels::Fast), file, &opts).expect("engine");
    let reference_file = kestrel_hub::reference_dir()
        .expect("reference dir")
        .join(format!("{model}-q4_k_m.llamacpp.json"));
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(&reference_file).expect("reference file"))
            .expect("reference json");
    (engine, reference)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn teacher_forced(model: &str) {
    let (mut engine, reference) = load(model, 128);
    for (name, text) in reference["texts"].as_object().expect("texts") {
        let ids = ids(&text["ids"]);
        let positions = text["positions"].as_array().expect("positions");
        // Our log-probs of llama.cpp's top-16 tokens at each position.
        let mut our_lp_of_their_top: Vec<Vec<(f64, f64)>> = Vec::new();
        let ours = score_window_with(&mut engine, &ids, 16, |i, lp| {
            let theirs = &positions[i];
            our_lp_of_their_top.push(
                theirs["top_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .zip(theirs["top_logprobs"].as_array().unwrap())
                    .map(|(id, l)| (lp[id.as_u64().unwrap() as usize], l.as_f64().unwrap()))
                    .collect(),
            );
        })
        .expect("scoring");
        assert_eq!(positions.len(), ours.positions.len());
        let mut top1_agree = 0;
        let mut abs_diff = 0.0;
        let mut n_diff = 0;
        for (i, p) in positions.iter().enumerate() {
            if p["top_ids"][0].as_u64().unwrap() as u32 == ours.positions[i].top_ids[0] {
                top1_agree += 1;
            }
            for (ours, theirs) in &our_lp_of_their_top[i] {
                abs_diff += (ours - theirs).abs();
                n_diff += 1;
            }
        }
        if std::env::var_os("KESTREL_DEBUG_BUCKETS").is_some() {
            for i in 0..3 {
                eprintln!("pos {i}: ours/theirs {:?}", &our_lp_of_their_top[i][..8]);
            }
            for (b, chunk) in our_lp_of_their_top.chunks(32).enumerate() {
                let d: f64 = chunk
                    .iter()
                    .flatten()
                    .map(|(o, t)| (o - t).abs())
                    .sum::<f64>()
                    / (chunk.len() * 16) as f64;
                let d1: f64 =
                    chunk.iter().map(|r| (r[0].0 - r[0].1).abs()).sum::<f64>() / chunk.len() as f64;
                eprintln!(
                    "positions {:4}..: mean |Δ| {d:.4}  top1-token |Δ| {d1:.4}",
                    b * 32
                );
            }
        }
        let agreement = top1_agree as f64 / positions.len() as f64;
        let mean_abs = abs_diff / n_diff as f64;
        let ref_ppl = text["ppl"].as_f64().unwrap();
        let ppl_err = (ours.ppl - ref_ppl).abs() / ref_ppl;
        eprintln!(
            "{model} {name}: top-1 agreement {:.2}%, mean |Δ logprob| {mean_abs:.4}, ppl {:.4} vs {ref_ppl:.4} ({:.3}%)",
            agreement * 100.0,
            ours.ppl,
            ppl_err * 100.0
        );
        assert!(
            agreement >= 0.99,
            "{model} {name}: top-1 agreement {agreement}"
        );
        assert!(
            mean_abs <= 0.02,
            "{model} {name}: mean |Δ logprob| {mean_abs}"
        );
        assert!(
            ppl_err <= 0.01,
            "{model} {name}: perplexity off by {ppl_err}"
        );
    }
}

fn greedy(model: &str) {
    let (mut engine, reference) = load(model, 1);
    for case in reference["greedy"].as_array().expect("greedy") {
        let prompt = ids(&case["prompt_ids"]);
        let want = ids(&case["greedy_ids"]);
        let mut seq = Sequence::default();
        let got = engine
            .generate(
                &mut seq,
                &prompt,
                &SamplerParams::greedy(),
                want.len(),
                |_| false,
                |_| true,
            )
            .expect("generate");
        engine.release(&mut seq);
        let same = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
        eprintln!(
            "{model} {:?}: first {same} of {} greedy tokens equal llama.cpp's",
            case["prompt"].as_str().unwrap_or(""),
            want.len()
        );
        assert!(
            same >= 16,
            "{model}: greedy continuation diverges at token {same}"
        );
    }
}

#[test]
fn qwen_teacher_forced_matches_llama_cpp() {
    teacher_forced("qwen2.5-coder-1.5b");
}

#[test]
fn gemma_teacher_forced_matches_llama_cpp() {
    teacher_forced("gemma-3-270m");
}

#[test]
fn qwen_greedy_matches_llama_cpp() {
    greedy("qwen2.5-coder-1.5b");
}

#[test]
fn gemma_greedy_matches_llama_cpp() {
    greedy("gemma-3-270m");
}
