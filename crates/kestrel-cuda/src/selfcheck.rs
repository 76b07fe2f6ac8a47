//! The CPU backend as the oracle of the CUDA one: the same tiny synthetic model and the same
//! random tokens through both, compared logit by logit (`kestrel gpu-check` and the tests).

use std::sync::Arc;

use anyhow::Context;
use kestrel_cpu::{CpuBackend, Kernels};
use kestrel_engine::{Engine, EngineOptions, Sequence};
use kestrel_gguf::GgufFile;
use kestrel_model::Arch;
use kestrel_model::synth::{SynthConfig, WeightType, write_synth_to};
use rand::{Rng, SeedableRng};

use crate::CudaBackend;

pub const ARCHS: [Arch; 4] = [Arch::Llama, Arch::Qwen2, Arch::Qwen3, Arch::Gemma3];

/// The weight types every check covers (`q4_k_m` mixes Q4_K, Q6_K and their fallbacks).
pub const TYPES: [&str; 10] = [
    "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q4_k_m", "q5_k", "q6_k",
];

/// Smallest share of positions whose top-1 token must agree.
pub const MIN_TOP1_AGREEMENT: f64 = 0.995;
/// Largest |Δ logit| allowed, relative to max(1, largest |logit|).
pub const MAX_REL_DIFF: f32 = 1e-2;

/// A tiny random-weight model of `arch` with weights of type `ty`, in memory.
pub fn tiny_model(arch: Arch, ty: &str, seed: u64) -> anyhow::Result<Arc<GgufFile>> {
    let cfg = SynthConfig::tiny(arch);
    let ty: WeightType = ty
        .parse()
        .map_err(|e| anyhow::anyhow!("weight type {ty}: {e}"))?;
    let (bytes, _) = write_synth_to(Vec::new(), &cfg, ty, seed).context("synthesizing")?;
    Ok(Arc::new(
        GgufFile::from_bytes(bytes).context("parsing the synthetic model")?,
    ))
}

fn options(max_batch_tokens: usize) -> EngineOptions {
    EngineOptions {
        ctx: 512,
        max_batch_tokens,
        max_logit_rows: 256,
        block_size: 16,
        max_seqs: 1,
    }
}

fn cpu_engine(file: &Arc<GgufFile>) -> anyhow::Result<Engine<CpuBackend>> {
    Engine::new(CpuBackend::new(Kernels::Fast), file.clone(), &options(256))
}

/// The CUDA engine evaluates in chunks of an awkward size (100 tokens), so later chunks
/// attend to keys written by earlier steps.
fn cuda_engine(file: &Arc<GgufFile>, ordinal: usize) -> anyhow::Result<Engine<CudaBackend>> {
    Engine::new(CudaBackend::new(ordinal)?, file.clone(), &options(100))
}

fn all_logits<B: kestrel_model::Backend>(
    engine: &mut Engine<B>,
    tokens: &[u32],
) -> anyhow::Result<Vec<Vec<f32>>> {
    let mut seq = Sequence::default();
    let mut rows = Vec::new();
    engine.eval(&mut seq, tokens, true, |_, l| rows.push(l.to_vec()))?;
    engine.release(&mut seq);
    Ok(rows)
}

/// Index of the largest value (lowest index on ties), as the greedy sampler picks.
pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// Teacher-forced comparison of one model.
#[derive(Debug, Clone)]
pub struct LogitReport {
    pub arch: Arch,
    pub ty: String,
    pub positions: usize,
    pub max_abs_diff: f32,
    pub max_abs_logit: f32,
    pub top1_agreement: f64,
    pub non_finite: usize,
}

impl LogitReport {
    pub fn passed(&self) -> bool {
        self.non_finite == 0
            && self.top1_agreement >= MIN_TOP1_AGREEMENT
            && self.max_abs_diff <= MAX_REL_DIFF * self.max_abs_logit.max(1.0)
    }
}

/// Runs `n` random tokens through the CPU and the CUDA engine and compares every logit.
pub fn compare_logits(
    arch: Arch,
    ty: &str,
    n: usize,
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<LogitReport> {
    let file = tiny_model(arch, ty, seed)?;
    let mut cpu = cpu_engine(&file)?;
    let mut gpu = cuda_engine(&file, ordinal)?;
    let vocab = cpu.config().vocab_size as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5eed);
    let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab)).collect();
    let a = all_logits(&mut cpu, &tokens)?;
    let b = all_logits(&mut gpu, &tokens)?;
    anyhow::ensure!(
        a.len() == n && b.len() == n,
        "expected {n} rows of logits, got {} (cpu) and {} (cuda)",
        a.len(),
        b.len()
    );
    let mut report = LogitReport {
        arch,
        ty: ty.to_string(),
        positions: n,
        max_abs_diff: 0.0,
        max_abs_logit: 0.0,
        top1_agreement: 0.0,
        non_finite: 0,
    };
    let mut agree = 0usize;
    for (ra, rb) in a.iter().zip(&b) {
        for (x, y) in ra.iter().zip(rb) {
            if !y.is_finite() {
                report.non_finite += 1;
                continue;
            }
            report.max_abs_diff = report.max_abs_diff.max((x - y).abs());
            report.max_abs_logit = report.max_abs_logit.max(x.abs());
        }
        agree += usize::from(argmax(ra) == argmax(rb));
    }
    report.top1_agreement = agree as f64 / n as f64;
    Ok(report)
}

/// Greedy generation on both engines.
#[derive(Debug, Clone)]
pub struct GreedyReport {
    pub arch: Arch,
    pub ty: String,
    pub cpu: Vec<u32>,
    pub cuda: Vec<u32>,
    /// First position where the two differ, with the CPU's logit gap between its choice and
    /// the GPU's there (a near-tie explains a difference; a large gap is a bug).
    pub first_difference: Option<(usize, f32)>,
}

impl GreedyReport {
    /// Identical, or different only after a near-tie of the CPU's logits.
    pub fn passed(&self) -> bool {
        match self.first_difference {
            None => true,
            Some((_, gap)) => gap < 1e-3,
        }
    }
}

fn greedy<B: kestrel_model::Backend>(
    engine: &mut Engine<B>,
    prompt: &[u32],
    n: usize,
) -> anyhow::Result<(Vec<u32>, Vec<Vec<f32>>)> {
    let mut seq = Sequence::default();
    let mut out = Vec::with_capacity(n);
    let mut logits_seen = Vec::with_capacity(n);
    let mut last = Vec::new();
    engine.eval(&mut seq, prompt, false, |_, l| last = l.to_vec())?;
    for _ in 0..n {
        let id = argmax(&last) as u32;
        out.push(id);
        logits_seen.push(std::mem::take(&mut last));
        engine.eval(&mut seq, &[id], false, |_, l| last = l.to_vec())?;
    }
    engine.release(&mut seq);
    Ok((out, logits_seen))
}

/// Generates `n` tokens greedily after a random prompt on both engines (decode steps of
/// one token each on the GPU).
pub fn compare_greedy(
    arch: Arch,
    ty: &str,
    n: usize,
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<GreedyReport> {
    let file = tiny_model(arch, ty, seed)?;
    let mut cpu = cpu_engine(&file)?;
    let mut gpu = cuda_engine(&file, ordinal)?;
    let vocab = cpu.config().vocab_size as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x9e37);
    let prompt: Vec<u32> = (0..8).map(|_| rng.random_range(0..vocab)).collect();
    let (a, cpu_logits) = greedy(&mut cpu, &prompt, n)?;
    let (b, _) = greedy(&mut gpu, &prompt, n)?;
    let first_difference = a.iter().zip(&b).position(|(x, y)| x != y).map(|i| {
        let l = &cpu_logits[i];
        (i, l[a[i] as usize] - l[b[i] as usize])
    });
    Ok(GreedyReport {
        arch,
        ty: ty.to_string(),
        cpu: a,
        cuda: b,
        first_difference,
    })
}
