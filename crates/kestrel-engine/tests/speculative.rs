//! Speculative decoding is lossless: greedy output is token for token the plain output
//! (both drafters, gemma-3-270m on the CPU), and sampled output follows the target's
//! distribution (both drafters, a tiny synthetic model: chi-square of the first tokens of
//! many seeded generations against the distribution computed from the model's own rows).

use std::sync::Arc;

use kestrel_cpu::{CpuBackend, Kernels};
use kestrel_engine::sampler::{Sampler, SamplerParams};
use kestrel_engine::spec::{
    DraftModel, Drafter, NgramDrafter, Speculator, check_same_vocabulary, write_truncated,
};
use kestrel_engine::{Engine, EngineOptions, Sequence};
use kestrel_gguf::GgufFile;
use kestrel_model::Arch;
use kestrel_model::synth::{SynthConfig, SynthOverrides, WeightType, write_synth_to};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const DRAFT_MAX: usize = 8;

fn engine(file: &Arc<GgufFile>, ctx: usize) -> Engine<CpuBackend> {
    let opts = EngineOptions {
        ctx,
        max_batch_tokens: 256,
        max_logit_rows: DRAFT_MAX + 1,
        block_size: 16,
        max_seqs: 1,
    };
    Engine::new(CpuBackend::new(Kernels::Fast), file.clone(), &opts).expect("engine")
}

/// Generates `n` tokens after `prompt` from an empty sequence, speculating with `spec`.
fn generate(
    engine: &mut Engine<CpuBackend>,
    prompt: &[u32],
    params: &SamplerParams,
    n: usize,
    spec: Option<&mut Speculator>,
) -> (Vec<u32>, kestrel_engine::spec::SpecStats) {
    let mut seq = Sequence::default();
    let out = engine
        .generate_speculative(&mut seq, prompt, params, n, |_| false, |_| true, spec)
        .expect("generation");
    engine.release(&mut seq);
    assert_eq!(engine.blocks.n_used(), 0, "every block comes back");
    out
}

/// A prompt of random tokens in which a random phrase comes back, so that the model has
/// something to copy (and prompt lookup something to find).
fn copying_prompt(rng: &mut StdRng, vocab: u32) -> Vec<u32> {
    let word = |rng: &mut StdRng| rng.random_range(100..vocab.min(20_000));
    let phrase: Vec<u32> = (0..rng.random_range(8..24)).map(|_| word(rng)).collect();
    let mut prompt = vec![2]; // BOS
    for _ in 0..3 {
        prompt.extend(&phrase);
        prompt.extend((0..rng.random_range(2..8)).map(|_| word(rng)));
    }
    prompt.extend(&phrase[..phrase.len() / 2]);
    prompt
}

#[test]
fn greedy_speculation_matches_plain_decoding_on_gemma() {
    let path = kestrel_hub::resolve_model("gemma-3-270m").expect("gemma-3-270m available");
    let file = Arc::new(GgufFile::open(&path).expect("model opens"));
    let dir = tempfile::tempdir().expect("temp dir");
    let draft_path = dir.path().join("draft.gguf");
    write_truncated(&file, 6, &draft_path).expect("truncated copy");
    let draft_file = Arc::new(GgufFile::open(&draft_path).expect("draft opens"));

    let mut target = engine(&file, 512);
    let draft_engine = engine(&draft_file, 512);
    let mut ngram = Speculator::new(Box::new(NgramDrafter::new(1, 4).unwrap()), 1, DRAFT_MAX);
    let mut draft = Speculator::new(
        Box::new(DraftModel::new(draft_engine, &file, &draft_file).expect("same vocabulary")),
        1,
        DRAFT_MAX,
    );
    let mut rng = StdRng::seed_from_u64(rand::random());
    let vocab = target.config().vocab_size as u32;
    let (mut drafted, mut accepted) = ([0; 2], [0; 2]);
    for i in 0..20 {
        let prompt = copying_prompt(&mut rng, vocab);
        // Plain greedy, and every fifth prompt greedy under a repetition penalty (the rows
        // then go through the sampling path).
        let mut params = SamplerParams::greedy();
        if i % 5 == 4 {
            params.repeat_penalty = 1.3;
        }
        let (plain, stats) = generate(&mut target, &prompt, &params, 128, None);
        assert_eq!(stats.drafted, 0);
        for (d, spec) in [&mut ngram, &mut draft].into_iter().enumerate() {
            let (fast, stats) = generate(&mut target, &prompt, &params, 128, Some(spec));
            assert_eq!(fast, plain, "prompt {i} ({prompt:?}), drafter {d}");
            drafted[d] += stats.drafted;
            accepted[d] += stats.accepted;
        }
    }
    eprintln!("drafted {drafted:?}, accepted {accepted:?}");
    for d in 0..2 {
        assert!(drafted[d] > 0, "drafter {d} drafted nothing");
        assert!(accepted[d] > 0, "drafter {d} had nothing accepted");
        assert!(accepted[d] < drafted[d], "drafter {d} had nothing rejected");
    }
}

fn tiny(vocab: u32, seed: u64, layers: u32) -> Arc<GgufFile> {
    let mut cfg = SynthConfig::tiny(Arch::Qwen2);
    cfg.apply(&SynthOverrides {
        n_vocab: Some(vocab),
        n_layer: Some(layers),
        ..SynthOverrides::default()
    })
    .expect("synth shape");
    let (bytes, _) = write_synth_to(Vec::new(), &cfg, WeightType::F32, seed).expect("synth");
    Arc::new(GgufFile::from_bytes(bytes).expect("synthetic file parses"))
}

/// Probability of each sequence of `depth` tokens after `prompt` under `params`, computed
/// from the model's rows with the sampler's own candidates (the one definition of a row's
/// distribution); index = Σ token_i · vocab^i.
fn exact_joint(
    engine: &mut Engine<CpuBackend>,
    prompt: &[u32],
    params: &SamplerParams,
    depth: u32,
) -> Vec<f64> {
    let vocab = engine.config().vocab_size;
    let mut sampler = Sampler::new(params.clone());
    let mut joint = vec![0.0; vocab.pow(depth)];
    for (index, p) in joint.iter_mut().enumerate() {
        let tokens: Vec<u32> = (0..depth)
            .map(|i| (index / vocab.pow(i)) % vocab)
            .map(|t| t as u32)
            .collect();
        let mut history = prompt.to_vec();
        let mut prob = 1.0;
        for &t in &tokens {
            let mut seq = Sequence::default();
            let mut row = Vec::new();
            engine
                .eval(&mut seq, &history, false, |_, l| row = l.to_vec())
                .expect("eval");
            engine.release(&mut seq);
            let cands = sampler.candidates(&row, &history);
            prob *= cands
                .iter()
                .find(|c| c.id == t)
                .map_or(0.0, |c| c.prob as f64);
            history.push(t);
            if prob == 0.0 {
                break;
            }
        }
        *p = prob;
    }
    joint
}

/// Pearson's chi-square of `counts` against `expected` probabilities (cells expected under
/// 5 merged), and its critical value at z = 4 (Wilson–Hilferty; a false alarm about 3e-5).
fn chi_square(counts: &[u64], expected: &[f64]) -> (f64, f64) {
    let n: u64 = counts.iter().sum();
    let (mut stat, mut cells) = (0.0, 0usize);
    let (mut small_obs, mut small_exp) = (0.0, 0.0);
    for (&c, &p) in counts.iter().zip(expected) {
        let e = p * n as f64;
        if e < 5.0 {
            small_obs += c as f64;
            small_exp += e;
        } else {
            stat += (c as f64 - e).powi(2) / e;
            cells += 1;
        }
    }
    if small_exp > 0.0 {
        stat += (small_obs - small_exp).powi(2) / small_exp;
        cells += 1;
    }
    let k = cells.saturating_sub(1).max(1) as f64;
    let critical = k * (1.0 - 2.0 / (9.0 * k) + 4.0 * (2.0 / (9.0 * k)).sqrt()).powi(3);
    (stat, critical)
}

#[test]
fn sampled_speculation_keeps_the_target_distribution() {
    let mut rng = StdRng::seed_from_u64(rand::random());
    let vocab = 6u32;
    let target_file = tiny(vocab, rng.random(), 2);
    let draft_file = tiny(vocab, rng.random(), 1);
    check_same_vocabulary(&target_file, &draft_file).expect("same vocabulary");
    let mut target = engine(&target_file, 64);
    let params = SamplerParams {
        temperature: 0.8,
        top_k: 4,
        top_p: 0.9,
        min_p: 0.02,
        repeat_penalty: 1.3,
        repeat_last_n: 8,
        presence_penalty: 0.2,
        frequency_penalty: 0.1,
        seed: None,
    };
    let prompt: Vec<u32> = (0..6).map(|_| rng.random_range(0..vocab)).collect();
    let depth = 3;
    let expected = exact_joint(&mut target, &prompt, &params, depth);
    let drafters: Vec<(&str, Box<dyn Drafter>)> = vec![
        ("ngram", Box::new(NgramDrafter::new(1, 2).unwrap())),
        (
            "draft",
            Box::new(
                DraftModel::new(engine(&draft_file, 64), &target_file, &draft_file)
                    .expect("same vocabulary"),
            ),
        ),
    ];
    for (name, drafter) in drafters {
        let mut spec = Speculator::new(drafter, 1, 4);
        let mut counts = vec![0u64; expected.len()];
        let mut stats = kestrel_engine::spec::SpecStats::default();
        for _ in 0..10_000 {
            let params = SamplerParams {
                seed: Some(rng.random()),
                ..params.clone()
            };
            // Longer than the tokens counted, so that drafts run past them.
            let (out, s) = generate(&mut target, &prompt, &params, 6, Some(&mut spec));
            stats.add(&s);
            let index: usize = out[..depth as usize]
                .iter()
                .enumerate()
                .map(|(i, &t)| t as usize * (vocab as usize).pow(i as u32))
                .sum();
            counts[index] += 1;
        }
        let (stat, critical) = chi_square(&counts, &expected);
        eprintln!(
            "{name}: chi2 {stat:.1} (critical {critical:.1}), {}",
            stats.summary()
        );
        assert!(
            stats.rounds > 0 && stats.accepted > 0,
            "{name}: nothing speculated"
        );
        assert!(stats.accepted < stats.drafted, "{name}: nothing rejected");
        assert!(stat < critical, "{name}: chi2 {stat:.1} over {critical:.1}");
    }
}

#[test]
fn a_draft_with_another_vocabulary_is_refused() {
    let target = tiny(32, 1, 1);
    let other = tiny(33, 1, 1);
    let err = check_same_vocabulary(&target, &other).unwrap_err();
    assert!(err.to_string().contains("33 tokens"), "{err}");
    let path = kestrel_hub::resolve_model("gemma-3-270m").expect("gemma-3-270m available");
    let gemma = GgufFile::open(&path).expect("model opens");
    let err = check_same_vocabulary(&gemma, &target).unwrap_err();
    assert!(err.to_string().contains("vocabulary"), "{err}");
    let dir = tempfile::tempdir().expect("temp dir");
    let err = write_truncated(&target, 5, &dir.path().join("x.gguf")).unwrap_err();
    assert!(err.to_string().contains("cannot keep 5"), "{err}");
}
