//! Chained decoding (the host a step ahead of the device, each step's id kept on the device
//! as the next step's input) yields step-by-step decoding's ids, greedy or drawn with a
//! seed, and leaves the sequence, its cache blocks and the next step's logits exactly as
//! step-by-step decoding does, wherever it stops. The CPU backend chains too (synchronously), so the engine's loop
//! is checked here; `kestrel gpu-check --chained` checks the CUDA path against the same
//! step-by-step decoding.

use std::sync::Arc;

use kestrel_cpu::{CpuBackend, Kernels};
use kestrel_engine::sampler::{Sampler, SamplerParams};
use kestrel_engine::{Engine, EngineOptions, Sequence};
use kestrel_gguf::GgufFile;
use kestrel_model::synth::{SynthConfig, WeightType, write_synth_to};
use kestrel_model::{Arch, argmax};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn model(arch: Arch, seed: u64) -> Arc<GgufFile> {
    let ty: WeightType = "q8_0".parse().unwrap();
    let (bytes, _) = write_synth_to(Vec::new(), &SynthConfig::tiny(arch), ty, seed).unwrap();
    Arc::new(GgufFile::from_bytes(bytes).unwrap())
}

fn engine(file: &Arc<GgufFile>, ctx: usize) -> Engine<CpuBackend> {
    let opts = EngineOptions {
        ctx,
        max_batch_tokens: 64,
        max_logit_rows: 4,
        block_size: 4,
        max_seqs: 2,
    };
    Engine::new(CpuBackend::new(Kernels::Fast), file.clone(), &opts).expect("engine")
}

/// The prompt's last logit row's argmax: the first token either way decodes from.
fn prefill(e: &mut Engine<CpuBackend>, seq: &mut Sequence, prompt: &[u32]) -> u32 {
    let mut last = Vec::new();
    e.eval(seq, prompt, false, |_, l| last = l.to_vec())
        .expect("prompt");
    argmax(&last)
}

/// Step-by-step greedy decoding from `first`: up to `n` ids, stopping at the context's end.
fn step_by_step(e: &mut Engine<CpuBackend>, seq: &mut Sequence, first: u32, n: usize) -> Vec<u32> {
    let (mut out, mut ids, mut next) = (Vec::new(), Vec::new(), first);
    while out.len() < n && seq.tokens.len() < e.ctx {
        e.decode_argmax(std::slice::from_mut(seq), &[next], &mut ids)
            .expect("decode");
        next = ids[0];
        out.push(next);
    }
    out
}

fn logits_after(e: &mut Engine<CpuBackend>, seq: &mut Sequence, token: u32) -> Vec<f32> {
    let mut row = Vec::new();
    e.eval(seq, &[token], false, |_, l| row = l.to_vec())
        .expect("follow-up step");
    row
}

#[test]
fn chained_decoding_matches_step_by_step_wherever_it_stops() {
    let mut rng = StdRng::seed_from_u64(rand::random());
    for (i, arch) in [Arch::Llama, Arch::Qwen3Moe, Arch::Gemma3]
        .into_iter()
        .enumerate()
    {
        let file = model(arch, rng.random());
        let ctx = 40;
        let mut e = engine(&file, ctx);
        assert!(e.can_chain(), "{arch:?}");
        let vocab = e.config().vocab_size as u32;
        let prompt: Vec<u32> = (0..rng.random_range(3..12))
            .map(|_| rng.random_range(0..vocab))
            .collect();
        let mut reference = Sequence::default();
        let first = prefill(&mut e, &mut reference, &prompt);
        let all = step_by_step(&mut e, &mut reference, first, ctx);
        assert_eq!(reference.tokens.len(), ctx, "decoded to the context's end");
        e.release(&mut reference);
        // Stops by the callback, by `max_new`, and at the context's end (max_new past it).
        let cases = [(1, 1), (1, 7), (2, 7), (5, 7), (7, 7), (3, 100), (100, 100)];
        for (stop_after, max_new) in cases {
            let what = format!("{arch:?} (model {i}), stop after {stop_after}, max {max_new}");
            let mut seq = Sequence::default();
            assert_eq!(prefill(&mut e, &mut seq, &prompt), first, "{what}");
            let mut seen = Vec::new();
            let mut greedy = Sampler::new(SamplerParams::greedy());
            let ids = e
                .decode_chained(&mut seq, first, max_new, &mut greedy, |id| {
                    seen.push(id);
                    seen.len() < stop_after
                })
                .expect("chained decode");
            let want = stop_after.min(max_new).min(all.len());
            assert_eq!(ids, all[..want], "{what}");
            assert_eq!(seen, ids, "{what}: every id passed on, in order");
            // The prompt, `first`, and every id but the last were evaluated; nothing more.
            let mut evaluated = prompt.clone();
            evaluated.push(first);
            evaluated.extend_from_slice(&ids[..ids.len() - 1]);
            assert_eq!(seq.tokens, evaluated, "{what}");
            let blocks = seq.tokens.len().div_ceil(4);
            assert_eq!(
                seq.block_table.len(),
                blocks,
                "{what}: the dropped step's blocks"
            );
            assert_eq!(e.blocks.n_used(), blocks, "{what}");
            // The cache holds what step-by-step decoding writes: the next step agrees.
            if seq.tokens.len() < ctx {
                let last = *ids.last().unwrap();
                let mut plain = Sequence::default();
                e.eval(&mut plain, &evaluated, false, |_, _| {})
                    .expect("reference");
                let a = logits_after(&mut e, &mut seq, last);
                let b = logits_after(&mut e, &mut plain, last);
                assert_eq!(a, b, "{what}: the step after the chain");
                e.release(&mut plain);
            }
            e.release(&mut seq);
            assert_eq!(e.blocks.n_used(), 0, "{what}");
        }
    }
}

#[test]
fn greedy_generation_takes_the_chain_and_models_with_state_do_not() {
    let mut rng = StdRng::seed_from_u64(rand::random());
    let greedy = SamplerParams {
        temperature: 0.0,
        ..SamplerParams::default()
    };
    for arch in [Arch::Qwen3, Arch::Qwen35] {
        let file = model(arch, rng.random());
        let mut e = engine(&file, 64);
        let vocab = e.config().vocab_size as u32;
        let prompt: Vec<u32> = (0..6).map(|_| rng.random_range(0..vocab)).collect();
        let mut plain = Sequence::default();
        let first = prefill(&mut e, &mut plain, &prompt);
        let mut want = vec![first];
        want.extend(step_by_step(&mut e, &mut plain, first, 19));
        e.release(&mut plain);
        let mut seq = Sequence::default();
        let got = e
            .generate(&mut seq, &prompt, &greedy, 20, |_| false, |_| true)
            .expect("generation");
        assert_eq!(got, want, "{arch:?}");
        assert_eq!(seq.tokens.len(), prompt.len() + 19, "{arch:?}");
        e.release(&mut seq);
        if arch == Arch::Qwen35 {
            assert!(
                !e.can_chain(),
                "a recurrent state cannot drop a queued step"
            );
            let mut seq = Sequence::default();
            let first = prefill(&mut e, &mut seq, &prompt);
            let mut greedy = Sampler::new(SamplerParams::greedy());
            let err = e
                .decode_chained(&mut seq, first, 4, &mut greedy, |_| true)
                .unwrap_err();
            assert!(format!("{err}").contains("chain"), "{err}");
            assert_eq!(seq.tokens, prompt, "nothing evaluated");
        } else {
            assert!(e.can_chain());
        }
    }
}

/// Step-by-step sampled decoding from `first` with `sampler`: up to `n` ids.
fn sampled_step_by_step(
    e: &mut Engine<CpuBackend>,
    seq: &mut Sequence,
    first: u32,
    n: usize,
    sampler: &mut Sampler,
) -> Vec<u32> {
    let (mut out, mut ids, mut next) = (Vec::new(), Vec::new(), first);
    let mut rows = kestrel_model::SamplingBatch::default();
    while out.len() < n && seq.tokens.len() < e.ctx {
        rows.clear();
        sampler.push_row(&mut rows, &seq.tokens);
        e.decode_sampled(std::slice::from_mut(seq), &[next], &rows, &mut ids)
            .expect("decode");
        next = ids[0];
        out.push(next);
    }
    out
}

#[test]
fn seeded_draws_chain_to_the_same_tokens_and_penalties_do_not_chain() {
    let mut rng = StdRng::seed_from_u64(rand::random());
    let file = model(Arch::Llama, rng.random());
    let mut e = engine(&file, 64);
    let vocab = e.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..5).map(|_| rng.random_range(0..vocab)).collect();
    let seed = rng.random();
    // A hot temperature, so that the draws matter.
    let params = SamplerParams {
        temperature: 1.5,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: Some(seed),
        ..SamplerParams::default()
    };
    let mut plain = Sequence::default();
    let first = prefill(&mut e, &mut plain, &prompt);
    let want = sampled_step_by_step(
        &mut e,
        &mut plain,
        first,
        30,
        &mut Sampler::new(params.clone()),
    );
    e.release(&mut plain);
    let greedy_ids = {
        let mut seq = Sequence::default();
        prefill(&mut e, &mut seq, &prompt);
        let ids = step_by_step(&mut e, &mut seq, first, 30);
        e.release(&mut seq);
        ids
    };
    assert_ne!(
        want, greedy_ids,
        "seed {seed}: the draws should leave the argmax"
    );
    let mut seq = Sequence::default();
    prefill(&mut e, &mut seq, &prompt);
    let got = e
        .decode_chained(
            &mut seq,
            first,
            30,
            &mut Sampler::new(params.clone()),
            |_| true,
        )
        .expect("chained");
    assert_eq!(got, want, "seed {seed}");
    e.release(&mut seq);
    // Penalties read the tokens still on the device: refused, nothing evaluated.
    let penalized = SamplerParams {
        repeat_penalty: 1.3,
        ..params
    };
    let mut seq = Sequence::default();
    prefill(&mut e, &mut seq, &prompt);
    let err = e
        .decode_chained(&mut seq, first, 4, &mut Sampler::new(penalized), |_| true)
        .unwrap_err();
    assert!(format!("{err}").contains("penalties"), "{err}");
    assert_eq!(seq.tokens, prompt);
}
