//! The linear-attention hybrids' per-sequence state in the engine (tiny synthetic
//! Qwen3-Next): sequences sharing steps give each the logits it gets alone; a sequence
//! that does not continue where its state stopped, and speculative decoding, are clear
//! errors; a released sequence's state is dropped and a new one starts from zero.

use std::sync::Arc;

use kestrel_cpu::{CpuBackend, Kernels, Numerics};
use kestrel_engine::sampler::SamplerParams;
use kestrel_engine::spec::{NgramDrafter, Speculator};
use kestrel_engine::{Engine, EngineOptions, Sequence};
use kestrel_gguf::GgufFile;
use kestrel_model::config::Arch;
use kestrel_model::synth::{SynthConfig, WeightType, write_synth_to};
use rand::{Rng, SeedableRng};

fn engine(max_batch_tokens: usize) -> Engine<CpuBackend> {
    let cfg = SynthConfig::tiny(Arch::Qwen3Next);
    let (bytes, _) = write_synth_to(Vec::new(), &cfg, WeightType::Q4KM, 7).expect("synth");
    let file = Arc::new(GgufFile::from_bytes(bytes).expect("parses"));
    let opts = EngineOptions {
        ctx: 256,
        max_batch_tokens,
        max_logit_rows: max_batch_tokens,
        ..EngineOptions::default()
    };
    let backend = CpuBackend::with_numerics(Kernels::Fast, Numerics::Ggml);
    Engine::new(backend, file, &opts).expect("engine")
}

fn random_ids(rng: &mut impl Rng, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.random_range(0..512)).collect()
}

/// Every logit row of `ids` evaluated alone in steps of `step` tokens.
fn alone(ids: &[u32], step: usize) -> Vec<Vec<f32>> {
    let mut e = engine(step);
    let mut seq = Sequence::default();
    let mut rows = Vec::new();
    e.eval(&mut seq, ids, true, |_, row| rows.push(row.to_vec()))
        .expect("eval");
    rows
}

#[test]
fn sequences_sharing_steps_keep_their_own_state() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(29);
    // Awkward lengths, so that steps cut the prompts at different places.
    let prompts: Vec<Vec<u32>> = [45, 23, 61]
        .iter()
        .map(|&n| random_ids(&mut rng, n))
        .collect();
    let want: Vec<Vec<Vec<f32>>> = prompts.iter().map(|p| alone(p, 64)).collect();
    let mut e = engine(37);
    let mut seqs = vec![
        Sequence::default(),
        Sequence::default(),
        Sequence::default(),
    ];
    // Prompts together, then five decode steps of all three together.
    let mut got: Vec<Vec<Vec<f32>>> = vec![Vec::new(); 3];
    let parts: Vec<&[u32]> = prompts.iter().map(|p| &p[..p.len() - 5]).collect();
    e.eval_batch(&mut seqs, &parts, true, |i, _, row| {
        got[i].push(row.to_vec())
    })
    .expect("prompts");
    for k in (1..=5).rev() {
        let parts: Vec<&[u32]> = prompts
            .iter()
            .map(|p| &p[p.len() - k..p.len() - k + 1])
            .collect();
        e.eval_batch(&mut seqs, &parts, true, |i, _, row| {
            got[i].push(row.to_vec())
        })
        .expect("decode");
    }
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.len(), w.len(), "sequence {i}: rows");
        for (p, (a, b)) in g.iter().zip(w).enumerate() {
            // The CPU's products are batch-invariant: bit for bit.
            assert_eq!(a, b, "sequence {i}, position {p}");
        }
    }
}

#[test]
fn a_state_that_cannot_continue_is_an_error_and_release_starts_afresh() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(30);
    let ids = random_ids(&mut rng, 41);
    let want = alone(&ids, 16);
    let mut e = engine(16);
    let mut seq = Sequence::default();
    e.eval(&mut seq, &ids[..30], false, |_, _| {})
        .expect("eval");
    // Rolling back 5 tokens and going on: the recurrent state is 30 tokens in.
    e.truncate(&mut seq, 25);
    let err = e
        .eval(&mut seq, &ids[25..30], false, |_, _| {})
        .expect_err("continuing at 25 from a state at 30");
    let msg = format!("{err:#}");
    assert!(msg.contains("cannot roll back"), "{msg}");
    // Released and evaluated again from position 0: the same logits as a fresh engine.
    e.release(&mut seq);
    let mut rows = Vec::new();
    e.eval(&mut seq, &ids, true, |_, row| rows.push(row.to_vec()))
        .expect("eval after release");
    assert_eq!(rows, want);
    // Speculative decoding is refused with a reason.
    let drafter = NgramDrafter::new(1, 4).expect("drafter");
    let mut spec = Speculator::new(Box::new(drafter), 1, 8);
    let mut seq2 = Sequence::default();
    let err = e
        .generate_speculative(
            &mut seq2,
            &ids[..8],
            &SamplerParams::default(),
            4,
            |_| false,
            |_| true,
            Some(&mut spec),
        )
        .expect_err("speculation on a hybrid");
    assert!(format!("{err:#}").contains("not supported"), "{err:#}");
}
