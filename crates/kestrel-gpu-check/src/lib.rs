//! The CPU backend as the oracle of the CUDA one: the same tiny synthetic model and the same
//! random tokens through both, compared logit by logit (`kestrel gpu-check` and the tests).

use std::sync::Arc;

use anyhow::Context;
use kestrel_cpu::{CpuBackend, Kernels, Numerics};
use kestrel_engine::sampler::{Sampler, SamplerParams};
use kestrel_engine::{Engine, EngineOptions, Sequence};
use kestrel_gguf::{GgmlType, GgufFile};
use kestrel_model::synth::{SynthConfig, SynthHybrid, WeightType, write_synth_to};
use kestrel_model::{Arch, Batch, KvType, KvTypes, SeqSlot};
use rand::{Rng, SeedableRng};

use kestrel_cuda::CudaBackend;

pub const ARCHS: [Arch; 6] = [
    Arch::Llama,
    Arch::Qwen2,
    Arch::Qwen3,
    Arch::Gemma3,
    Arch::Phi3,
    Arch::Mistral3,
];

/// The dense architectures tensor parallelism takes (`TpPlan::new`): the TP checks' list.
pub const TP_ARCHS: [Arch; 6] = [
    Arch::Llama,
    Arch::Qwen2,
    Arch::Qwen3,
    Arch::Gemma3,
    Arch::Mistral3,
    Arch::Phi3,
];
/// The mixture-of-experts architectures tensor parallelism runs (checked with MoE's
/// route-flip allowance: [`compare_tp_logits_moe`]).
pub const TP_MOE_ARCHS: [Arch; 2] = [Arch::Qwen3Moe, Arch::GptOss];

/// The weight types of the TP logit checks of `arch`: f32, Q8_0 and Q4_K_M, and gpt-oss's
/// MXFP4 as published (its Q4_K_M holds Q4_K gate/up experts and Q5_0 down ones, whose
/// rows of 832 are not whole 256s).
pub fn tp_types(arch: Arch) -> &'static [&'static str] {
    match arch {
        Arch::GptOss => &["f32", "q8_0", "q4_k_m", "mxfp4"],
        _ => &["f32", "q8_0", "q4_k_m"],
    }
}
/// The linear-attention hybrids tensor parallelism runs (checked by
/// [`compare_tp_logits_hybrid`], with the one-GPU hybrid checks' criteria).
pub const TP_HYBRID_ARCHS: [Arch; 3] = [Arch::Qwen35, Arch::Qwen3Next, Arch::Qwen35Moe];

/// The architectures of the attention-kernel logit checks (attention shapes, quantized
/// caches), whose fixed bounds were measured on their tiny models (weights at 0.02).
/// Phi-3's and Mistral 3's (at ~1.3 / sqrt(n_embd), so more yet at the shapes' wider
/// embeddings) amplify each rounding about three times as much (f32 path: 0.3% of the
/// largest logit against Llama's 0.09%; H100, a q8_0 key cache: 1.6% against the 1% bound);
/// those kernels do not depend on the architecture, whose own checks cover the rest.
pub const KERNEL_ARCHS: [Arch; 4] = [Arch::Llama, Arch::Qwen2, Arch::Qwen3, Arch::Gemma3];

/// The linear-attention hybrids: qwen35 (dense feed-forward) and the two whose
/// feed-forward layers are mixtures of experts (checked once the backend runs those; while
/// it refuses them the check is skipped with a notice, see [`moe_refused`]).
pub const HYBRID_ARCHS: [Arch; 3] = [Arch::Qwen35, Arch::Qwen3Next, Arch::Qwen35Moe];

/// The weight types the hybrids' checks cover.
pub const HYBRID_TYPES: [&str; 3] = ["f16", "q8_0", "q4_k_m"];

/// The tiny hybrid with awkward linear-attention sizes: heads of 24 (not a multiple of the
/// kernels' 4-lane, 32-column layout), three q/k heads for six v heads, three convolution
/// taps. Row lengths are not whole K-quant blocks: f32 / f16 weights only.
pub fn tiny_model_awkward_hybrid(arch: Arch, ty: &str, seed: u64) -> anyhow::Result<Arc<GgufFile>> {
    tiny_hybrid_with(arch, ty, seed, |h| {
        h.d_conv = 3;
        h.d_state = 24;
        h.n_group = 3;
        h.n_v_heads = 6;
    })
}

/// The tiny model of hybrid `arch` with its linear-attention sizes changed by `edit`.
fn tiny_hybrid_with(
    arch: Arch,
    ty: &str,
    seed: u64,
    edit: impl FnOnce(&mut SynthHybrid),
) -> anyhow::Result<Arc<GgufFile>> {
    let mut cfg = SynthConfig::tiny(arch);
    let h = cfg
        .hybrid
        .as_mut()
        .with_context(|| format!("{} has no linear-attention layers", arch.name()))?;
    edit(h);
    model_of(cfg, ty, seed)
}

/// The tiny hybrid with the real models' linear-attention heads: 128 dimensions, so that
/// each v head's state rows spread over four `delta_scan` blocks (of 32 rows) as in
/// Qwen3-Next's and Qwen3.5's layers.
pub fn tiny_model_real_heads_hybrid(
    arch: Arch,
    ty: &str,
    seed: u64,
) -> anyhow::Result<Arc<GgufFile>> {
    tiny_hybrid_with(arch, ty, seed, |h| h.d_state = 128)
}

/// [`compare_logits`] on a model built by `model` (`tiny_model_*(arch, ty, seed)`, e.g.
/// [`tiny_model_awkward_hybrid`]), f32 activations, the strict bound.
pub fn compare_logits_of(
    model: fn(Arch, &str, u64) -> anyhow::Result<Arc<GgufFile>>,
    arch: Arch,
    ty: &str,
    n: usize,
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<LogitReport> {
    let file = model(arch, ty, seed)?;
    compare_logits_in(file, arch, ty, n, seed, ordinal, false, &PARTS)
}

/// Whether the tiny model of `arch` has mixture-of-experts layers.
pub fn has_moe(arch: Arch) -> bool {
    SynthConfig::tiny(arch).n_expert > 0
}

/// Whether `e` is a backend refusing mixture-of-experts layers (a hybrid with MoE layers
/// on a backend without them yet): a check to skip with a notice, not a failure.
pub fn moe_refused(e: &anyhow::Error) -> bool {
    format!("{e:#}").contains("mixture-of-experts layers are not supported")
}

/// The weight types every check covers (`q4_k_m` mixes Q4_K, Q6_K and their fallbacks).
pub const TYPES: [&str; 13] = [
    "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q4_k_m", "q5_k", "q6_k", "iq4_nl",
    "iq4_xs", "mxfp4",
];

/// Smallest share of positions whose top-1 token must agree.
pub const MIN_TOP1_AGREEMENT: f64 = 0.995;
/// Largest |Δ logit| allowed, relative to max(1, largest |logit|).
pub const MAX_REL_DIFF: f32 = 1e-2;
/// The same with 8-bit activations in the single-token GEMVs: each product's input is
/// rounded to 1/254 of its block's largest value (~0.4% noise per product; measured on
/// the tiny models: 0.7–1.1% of the largest logit).
pub const MAX_REL_DIFF_Q8: f32 = 2.5e-2;
/// The same where both sides ran on 8-bit activations, rounded differently (several
/// sequences per step — per-256 blocks in `mmk_t8*` — against each sequence alone — per-32
/// blocks in `gemv_q8`): two independent roundings, √2 × the one-sided bound. Measured on
/// gemma3 q4_k_m, tenth session: 2.0–2.7% against 1.2–1.6% one-sided.
pub const MAX_REL_DIFF_Q8_BOTH: f32 = 3.5e-2;
/// Model types whose single-token GEMVs can run on 8-bit activations.
pub const Q8_TYPES: [&str; 7] = [
    "q8_0", "q4_0", "q4_k_m", "q6_k", "iq4_nl", "iq4_xs", "mxfp4",
];

/// A tiny random-weight model of `arch` with weights of type `ty`, in memory.
pub fn tiny_model(arch: Arch, ty: &str, seed: u64) -> anyhow::Result<Arc<GgufFile>> {
    model_of(SynthConfig::tiny(arch), ty, seed)
}

/// The tiny model with real models' attention shape: 128-dim heads, 4 query heads per kv
/// head (`attention_split_tiled128`, `attention_prefill_mma128`).
pub fn tiny_model_wide_heads(arch: Arch, ty: &str, seed: u64) -> anyhow::Result<Arc<GgufFile>> {
    tiny_model_heads(arch, ty, seed, WIDE_HEADS)
}

/// (query heads, kv heads, head size) of [`tiny_model_wide_heads`].
pub const WIDE_HEADS: (usize, usize, usize) = (4, 1, 128);

/// Attention shapes (query heads, kv heads, head size) the decode-attention check covers:
/// one query head per kv head, 8 per kv head (the most the tiled kernels take) at both head
/// sizes, and an odd group of 3.
pub const ATTN_SHAPES: [(usize, usize, usize); 4] =
    [(4, 4, 64), (8, 1, 64), (6, 2, 128), (8, 1, 128)];

/// The tiny model with `heads` = (query heads, kv heads, head size), the embedding as wide
/// as the query heads together.
pub fn tiny_model_heads(
    arch: Arch,
    ty: &str,
    seed: u64,
    heads: (usize, usize, usize),
) -> anyhow::Result<Arc<GgufFile>> {
    let (n_head, n_head_kv, head_dim) = heads;
    let mut cfg = SynthConfig::tiny(arch);
    cfg.n_embd = (n_head * head_dim) as u32;
    cfg.n_head = n_head as u32;
    cfg.n_head_kv = n_head_kv as u32;
    cfg.head_dim = head_dim as u32;
    model_of(cfg, ty, seed)
}

/// Weight types of the mixture-of-experts checks: every format the expert kernels read
/// (`q4_k_m` mixes Q4_K and Q6_K experts).
pub const MOE_TYPES: [&str; 11] = [
    "q4_k_m", "q8_0", "f16", "q6_k", "q4_0", "q5_0", "bf16", "f32", "mxfp4", "iq4_xs", "iq4_nl",
];

/// (experts, experts per token) of the tiny mixture-of-experts models: the tiny preset's
/// 8 and 2, and 32 and 8 (Qwen3-MoE's top-8).
pub const MOE_SHAPES: [(usize, usize); 2] = [(8, 2), (32, 8)];

/// The tiny Qwen3-MoE model with `shape` = (experts, experts per token).
pub fn tiny_moe_model(
    arch: Arch,
    ty: &str,
    seed: u64,
    shape: (usize, usize),
) -> anyhow::Result<Arc<GgufFile>> {
    let mut cfg = SynthConfig::tiny(arch);
    cfg.n_expert = shape.0 as u32;
    cfg.n_expert_used = shape.1 as u32;
    model_of(cfg, ty, seed)
}

/// [`compare_greedy`] on [`tiny_moe_model`] with the GPU engine taking one token a step
/// (the prompt too) on f32 activations; the ids must agree up to a near-tie of the CPU's
/// logits (a route flip shows as one).
pub fn compare_greedy_moe(
    arch: Arch,
    ty: &str,
    shape: (usize, usize),
    n: usize,
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<GreedyReport> {
    let file = tiny_moe_model(arch, ty, seed, shape)?;
    let mut gpu = Engine::new(CudaBackend::new(ordinal)?, file.clone(), &options(1))?;
    gpu.backend.set_q8_decode(false);
    greedy_against_cpu(arch, ty, &file, &mut gpu, n, seed ^ 0x9e37)
}

/// Least share of positions whose max |Δ logit| must be within the bound: the GPU's dense
/// products round their inputs otherwise than the CPU's (f32 where the CPU rounds to 8 bits
/// as llama.cpp does, f16 or int8 in multi-token steps), and a token whose router logits
/// are near a tie takes another expert than the CPU's, which moves its logits by O(1) and
/// those of later tokens (through attention) by up to a few times the bound. Measured on
/// the H100, 2026-11-26/27: 83.6–100% of positions within in multi-token steps; one token a
/// step on f32 activations also flips routes (max |Δ| up to 1.76 of logits up to 6, top-1
/// still ≥ 99.6%). The block itself is held to f32 agreement by
/// [`compare_moe_block`].
pub const MOE_MIN_WITHIN: f64 = 0.5;

/// MoE's criteria for logit reports paired with their share of positions within the
/// bound: nothing non-finite, top-1 agreement (near-ties counted) at gpu-check's minimum,
/// and at least [`MOE_MIN_WITHIN`] of the positions within.
fn moe_reports_pass(reports: &[(&LogitReport, f64)]) -> bool {
    reports.iter().all(|(r, within)| {
        r.non_finite == 0
            && r.top1_agreement_ties >= MIN_TOP1_AGREEMENT
            && *within >= MOE_MIN_WITHIN
    })
}

/// Result of [`compare_logits_moe`].
#[derive(Debug, Clone)]
pub struct MoeLogitReport {
    /// The GPU one token a step on f32 activations.
    pub single: LogitReport,
    /// Share of those positions whose max |Δ logit| is within the bound.
    pub single_within: f64,
    /// The GPU in steps of 100, 40 and 1 to 8 tokens.
    pub logits: LogitReport,
    /// Share of those positions whose max |Δ logit| is within
    /// [`LogitReport::max_abs_bound`].
    pub within: f64,
}

impl MoeLogitReport {
    pub fn passed(&self) -> bool {
        moe_reports_pass(&[
            (&self.single, self.single_within),
            (&self.logits, self.within),
        ])
    }
}

/// [`compare_logits`] on [`tiny_moe_model`] (the GPU on f32 activations where it has the
/// choice): once one token a step, once in steps of 100 tokens (the grouped expert
/// kernels; K-quant experts: on the tensor cores, 8-bit activations on for that run, held
/// to the CPU's own spread under 8-bit rounding where it is wider), 40, and 1 to 8 (the
/// decode ones); passes by [`MoeLogitReport::passed`].
pub fn compare_logits_moe(
    arch: Arch,
    ty: &str,
    shape: (usize, usize),
    n: usize,
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<MoeLogitReport> {
    let file = tiny_moe_model(arch, ty, seed, shape)?;
    let mut cpu = cpu_engine(&file)?;
    let mut gpu = cuda_engine(&file, ordinal)?;
    gpu.backend.set_q8_decode(false);
    let vocab = cpu.config().vocab_size as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5eed);
    let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab)).collect();
    let a = all_logits(&mut cpu, &tokens)?;
    let one = all_logits_in_parts(&mut gpu, &tokens, &[1])?;
    // The parts run with 8-bit activations on where the MoE blocks then take the tensor
    // cores (K-quant experts, steps past 8 tokens): held to the model's own spread under
    // 8-bit rounding (`LogitReport::q8_spread`), as the 8-bit GEMVs are.
    gpu.backend.set_q8_decode(true);
    let mma = match gpu.model.config.ffn {
        kestrel_model::FfnKind::Moe(m) => gpu
            .model
            .weights
            .layers
            .iter()
            .any(|l| gpu.backend.moe_on_tensor_cores(l, &m, PARTS[0])),
        _ => false,
    };
    gpu.backend.set_q8_decode(mma);
    let b = all_logits_in_parts(&mut gpu, &tokens, &PARTS)?;
    anyhow::ensure!(
        a.len() == n && b.len() == n && one.len() == n,
        "expected {n} rows of logits, got {} (cpu), {} and {} (cuda)",
        a.len(),
        one.len(),
        b.len()
    );
    let single = logit_report(arch, ty, &a, &one);
    let mut logits = logit_report(arch, ty, &a, &b);
    if mma {
        logits.q8 = true;
        logits.q8_spread = cpu_q8_spread(&file, &tokens, &a)?;
    }
    let within = |b: &[Vec<f32>], bound: f32| {
        let ok = a
            .iter()
            .zip(b)
            .filter(|(ra, rb)| {
                ra.iter()
                    .zip(rb.iter())
                    .all(|(x, y)| (x - y).abs() <= bound)
            })
            .count();
        ok as f64 / n.max(1) as f64
    };
    Ok(MoeLogitReport {
        single_within: within(&one, single.max_abs_bound()),
        within: within(&b, logits.max_abs_bound()),
        single,
        logits,
    })
}

fn model_of(cfg: SynthConfig, ty: &str, seed: u64) -> anyhow::Result<Arc<GgufFile>> {
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

/// The oracle computes on f32 activations: the CUDA paths round differently from
/// llama.cpp's CPU path (or not at all), and f32 is the arithmetic they approximate.
fn cpu_engine(file: &Arc<GgufFile>) -> anyhow::Result<Engine<CpuBackend>> {
    let backend = CpuBackend::with_numerics(Kernels::Fast, Numerics::F32);
    Engine::new(backend, file.clone(), &options(256))
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
    all_logits_in_parts(engine, tokens, &[tokens.len().max(1)])
}

/// Chunk sizes the CUDA engine evaluates in: a long prefill chunk, then decode-sized steps
/// (the GEMV kernels and graph replay: runs of equal sizes repeat launch lists), then
/// prefill-sized again.
const PARTS: [usize; 16] = [100, 1, 1, 1, 3, 8, 8, 8, 5, 1, 2, 7, 1, 1, 40, 6];

/// Chunk sizes of the decode-attention check: mostly decode-sized steps (1 to 8 tokens,
/// through the split decode attention) at lengths from 3 to 256, nearly all mid-chunk:
/// short sequences (one split: the tiled kernel writes the output itself), 2 and 4
/// splits, partial last chunks, Gemma's 128-key window; two prompt-sized parts between.
const ATTN_PARTS: [usize; 16] = [3, 1, 1, 8, 5, 1, 2, 40, 1, 7, 1, 3, 100, 1, 1, 8];

/// Teacher-forced logits of every position, evaluating `tokens` in parts of the sizes in
/// `parts` (cycled).
fn all_logits_in_parts<B: kestrel_model::Backend>(
    engine: &mut Engine<B>,
    tokens: &[u32],
    parts: &[usize],
) -> anyhow::Result<Vec<Vec<f32>>> {
    let mut seq = Sequence::default();
    let mut rows = Vec::new();
    let mut start = 0;
    for &size in parts.iter().cycle() {
        if start >= tokens.len() {
            break;
        }
        let end = (start + size.max(1)).min(tokens.len());
        engine.eval(&mut seq, &tokens[start..end], true, |_, l| {
            rows.push(l.to_vec())
        })?;
        start = end;
    }
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
    /// The position (row) of the largest |Δ logit|: with the parts the GPU ran in, it names
    /// the path that produced it (a prompt part's GEMMs or a decode step's GEMVs).
    pub worst_position: usize,
    pub max_abs_logit: f32,
    pub top1_agreement: f64,
    /// Agreement counting a different top-1 as agreeing when the reference's logits of the
    /// two choices are within [`TIE_REL`] · max(1, max |logit|), or within twice the largest
    /// |Δ logit| measured (two logits each off by that much can swap; the |Δ| itself is
    /// bounded separately): random-weight models have many near-ties, and f16 GEMM
    /// operands (prefill) and 8-bit activations (decode) reorder those.
    pub top1_agreement_ties: f64,
    pub non_finite: usize,
    /// Whether the GPU ran single-token GEMVs on 8-bit activations.
    pub q8: bool,
    /// Whether the reference ran on 8-bit activations too (a GPU run against a GPU run).
    pub q8_reference: bool,
    /// For `q8` runs against the f32 CPU: the model's own spread under 8-bit activations,
    /// max |Δ logit| between the CPU with llama.cpp's rounding (matmul inputs to Q8_0 / Q8_K,
    /// or to f16 / bf16 for weights of those types) and the f32 CPU on the same tokens (0
    /// when not measured).
    pub q8_spread: f32,
    /// Whether the GPU's multi-token products rounded their inputs to the weights' f16 /
    /// bf16 (cuBLAS on f16 / bf16 operands) where the f32 CPU rounds nothing: held, like
    /// `q8` runs, to [`Q8_SPREAD_FACTOR`] times the CPU's spread under llama.cpp's rounding,
    /// which rounds those inputs the same way. Tiny hybrids amplify it past the fixed bound:
    /// qwen35 f16 with heads of 24, seed 17587241277375571774, the CPU's own spread 6.27e-2
    /// at position 0 and the H100's 6.68e-2 there, against 5.92e-2 (2026-11-27).
    pub f16_operands: bool,
}

/// How many times the CPU's own 8-bit spread ([`LogitReport::q8_spread`]) a GPU run on
/// 8-bit activations may differ from the f32 CPU, where that exceeds [`MAX_REL_DIFF_Q8`]:
/// no more than llama.cpp's own rounding moves the logits. The models with weights at ~1.3
/// / sqrt(n_embd) (phi3, mistral3 and the newer tiny models) amplify each product's
/// rounding more than the 0.02 ones the fixed bound was measured on: tiny Phi-3 IQ4_XS, the
/// CPU's spread 5.2% of the largest logit and the H100's 8-bit path 2.8% (Llama: 2.1% and
/// 1.0%). 1.5, not 1: the spread is the largest of one rounding's differences and the GPU's
/// another's (with its own rounding scheme), and the largest of such maxima strays past its
/// typical size (an H100 run of fresh tiny Mistral-3 Q6_K models reached 0.301 at largest
/// logits of 6.0, over the bound at 1; 0.239 on other seeds).
pub const Q8_SPREAD_FACTOR: f32 = 1.5;

/// Near-tie width for [`LogitReport::top1_agreement_ties`], relative to max(1, max |logit|).
pub const TIE_REL: f32 = 3e-3;

impl LogitReport {
    /// The |Δ logit| bound, relative to max(1, max |logit|).
    pub fn max_rel_diff(&self) -> f32 {
        match (self.q8, self.q8_reference) {
            (true, true) => MAX_REL_DIFF_Q8_BOTH,
            (true, false) => MAX_REL_DIFF_Q8,
            _ => MAX_REL_DIFF,
        }
    }

    /// The largest |Δ logit| allowed: [`Self::max_rel_diff`] of max(1, max |logit|), or
    /// for 8-bit runs (and f16 / bf16 operands, [`Self::f16_operands`]) [`Q8_SPREAD_FACTOR`]
    /// times the CPU's own spread under llama.cpp's rounding if larger (√2
    /// times that where both sides ran on 8-bit activations, rounded independently).
    pub fn max_abs_bound(&self) -> f32 {
        let fixed = self.max_rel_diff() * self.max_abs_logit.max(1.0);
        let spread = if self.q8_reference {
            std::f32::consts::SQRT_2 * self.q8_spread
        } else {
            self.q8_spread
        };
        if self.q8 || self.f16_operands {
            fixed.max(Q8_SPREAD_FACTOR * spread)
        } else {
            fixed
        }
    }

    pub fn passed(&self) -> bool {
        self.passed_within(self.max_abs_bound())
    }

    /// [`Self::passed`] with `bound` as the largest |Δ logit| allowed.
    pub fn passed_within(&self, bound: f32) -> bool {
        self.non_finite == 0
            && self.top1_agreement_ties >= MIN_TOP1_AGREEMENT
            && self.max_abs_diff <= bound
    }
}

/// Runs `n` random tokens through the CPU and the CUDA engine and compares every logit.
///
/// `q8`: let single-token GEMVs run on 8-bit activations where the format allows (the
/// default on the GPU); false holds the GPU to the CPU's f32 arithmetic.
pub fn compare_logits(
    arch: Arch,
    ty: &str,
    n: usize,
    seed: u64,
    ordinal: usize,
    q8: bool,
) -> anyhow::Result<LogitReport> {
    let file = tiny_model(arch, ty, seed)?;
    compare_logits_in(file, arch, ty, n, seed, ordinal, q8, &PARTS)
}

/// [`compare_logits`] on [`tiny_model_wide_heads`].
pub fn compare_logits_wide_heads(
    arch: Arch,
    ty: &str,
    n: usize,
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<LogitReport> {
    let file = tiny_model_wide_heads(arch, ty, seed)?;
    compare_logits_in(file, arch, ty, n, seed, ordinal, true, &PARTS)
}

/// [`compare_logits`] on [`tiny_model_heads`], in the decode-heavy parts of
/// [`ATTN_PARTS`], with the GPU on f32 activations (the strict |Δ| bound).
pub fn compare_logits_heads(
    arch: Arch,
    ty: &str,
    heads: (usize, usize, usize),
    n: usize,
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<LogitReport> {
    let file = tiny_model_heads(arch, ty, seed, heads)?;
    compare_logits_in(file, arch, ty, n, seed, ordinal, false, &ATTN_PARTS)
}

/// The CPU engine on all of `n` random tokens at once against the CUDA engine on them in
/// parts of the sizes in `parts`.
#[allow(clippy::too_many_arguments)]
fn compare_logits_in(
    file: Arc<GgufFile>,
    arch: Arch,
    ty: &str,
    n: usize,
    seed: u64,
    ordinal: usize,
    q8: bool,
    parts: &[usize],
) -> anyhow::Result<LogitReport> {
    let mut cpu = cpu_engine(&file)?;
    let mut gpu = cuda_engine(&file, ordinal)?;
    gpu.backend.set_q8_decode(q8);
    let vocab = cpu.config().vocab_size as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5eed);
    let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab)).collect();
    let a = all_logits(&mut cpu, &tokens)?;
    let b = all_logits_in_parts(&mut gpu, &tokens, parts)?;
    anyhow::ensure!(
        a.len() == n && b.len() == n,
        "expected {n} rows of logits, got {} (cpu) and {} (cuda)",
        a.len(),
        b.len()
    );
    let mut report = logit_report(arch, ty, &a, &b);
    report.q8 = q8;
    // Steps past one token multiply f16 / bf16 weights on cuBLAS with operands of their type.
    report.f16_operands = matches!(ty, "f16" | "bf16") && parts.iter().any(|&p| p > 1);
    if q8 || report.f16_operands {
        report.q8_spread = cpu_q8_spread(&file, &tokens, &a)?;
    }
    Ok(report)
}

/// [`compare_logits`] with 8-bit activations on the GPU for the linear-attention hybrids:
/// returns the report and its bound, max([`MAX_REL_DIFF_Q8`] · max(1, max |logit|),
/// 2 × [`cpu_q8_spread`]). Their tiny models turn the 8-bit rounding into 7–11% of the
/// largest logit on the CPU alone (the dense architectures: 0.7–1.1%; seed 7, 200 tokens,
/// q8_0 and q4_k_m), and the H100's 8-bit path measured 0.6–0.94 × that spread (seeds 8
/// and 9, q8_0 and q4_k_m), so 2 × leaves a margin (the dense bound, √2 · [`Q8_SPREAD_FACTOR`] ×, is about the same).
pub fn compare_logits_q8_spread(
    arch: Arch,
    ty: &str,
    n: usize,
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<(LogitReport, f32)> {
    let report = compare_logits(arch, ty, n, seed, ordinal, true)?;
    let bound = (MAX_REL_DIFF_Q8 * report.max_abs_logit.max(1.0)).max(2.0 * report.q8_spread);
    Ok((report, bound))
}

/// Max |Δ logit| between the CPU with llama.cpp's 8-bit rounding and `f32_logits` (the f32
/// CPU's logits of `tokens`).
pub fn cpu_q8_spread(
    file: &Arc<GgufFile>,
    tokens: &[u32],
    f32_logits: &[Vec<f32>],
) -> anyhow::Result<f32> {
    let backend = CpuBackend::with_numerics(Kernels::Fast, Numerics::Ggml);
    let mut cpu = Engine::new(backend, file.clone(), &options(256))?;
    let c = all_logits(&mut cpu, tokens)?;
    Ok(c.iter()
        .flatten()
        .zip(f32_logits.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max))
}

/// Compares rows of logits (`a` the reference).
fn logit_report(arch: Arch, ty: &str, a: &[Vec<f32>], b: &[Vec<f32>]) -> LogitReport {
    let n = a.len();
    let mut report = LogitReport {
        arch,
        ty: ty.to_string(),
        positions: n,
        max_abs_diff: 0.0,
        worst_position: 0,
        max_abs_logit: 0.0,
        top1_agreement: 0.0,
        top1_agreement_ties: 0.0,
        non_finite: 0,
        q8: false,
        q8_reference: false,
        q8_spread: 0.0,
        f16_operands: false,
    };
    for (pos, (ra, rb)) in a.iter().zip(b).enumerate() {
        for (x, y) in ra.iter().zip(rb) {
            if !y.is_finite() {
                report.non_finite += 1;
                continue;
            }
            if (x - y).abs() > report.max_abs_diff {
                report.max_abs_diff = (x - y).abs();
                report.worst_position = pos;
            }
            report.max_abs_logit = report.max_abs_logit.max(x.abs());
        }
    }
    let tie = (TIE_REL * report.max_abs_logit.max(1.0)).max(2.0 * report.max_abs_diff);
    let mut agree = 0usize;
    let mut near_ties = 0usize;
    for (ra, rb) in a.iter().zip(b) {
        let (ia, ib) = (argmax(ra), argmax(rb));
        if ia == ib {
            agree += 1;
        } else if ra[ia] - ra[ib] <= tie {
            near_ties += 1;
        }
    }
    report.top1_agreement = agree as f64 / n as f64;
    report.top1_agreement_ties = (agree + near_ties) as f64 / n as f64;
    report
}

/// Several sequences of different lengths evaluated together (`Engine::eval_batch`: steps of
/// up to 100 tokens mixing prompt parts of every sequence, then decode steps of one token
/// per sequence) against each sequence evaluated alone, all on the GPU. `lens` = prompt
/// lengths; each sequence then decodes 4 more tokens.
pub fn compare_batched(
    arch: Arch,
    ty: &str,
    lens: &[usize],
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<LogitReport> {
    compare_batched_of(
        tiny_model(arch, ty, seed)?,
        arch,
        ty,
        lens,
        seed,
        ordinal,
        KvTypes::default(),
        true,
    )
}

/// [`compare_batched`] with the GPU on f32 activations (both runs), held to the strict
/// |Δ| bound: the linear-attention hybrids, whose tiny models amplify 8-bit rounding about
/// ten times as much as the dense ones (see [`compare_logits_q8_spread`]).
pub fn compare_batched_f32(
    arch: Arch,
    ty: &str,
    lens: &[usize],
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<LogitReport> {
    let file = tiny_model(arch, ty, seed)?;
    compare_batched_of(
        file,
        arch,
        ty,
        lens,
        seed,
        ordinal,
        KvTypes::default(),
        false,
    )
}

/// [`compare_batched`] on [`tiny_model_heads`].
pub fn compare_batched_heads(
    arch: Arch,
    ty: &str,
    heads: (usize, usize, usize),
    lens: &[usize],
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<LogitReport> {
    let file = tiny_model_heads(arch, ty, seed, heads)?;
    compare_batched_of(
        file,
        arch,
        ty,
        lens,
        seed,
        ordinal,
        KvTypes::default(),
        true,
    )
}

/// [`compare_batched_heads`] with the cache stored as `kv` (both runs on the GPU): the
/// quantized attention of several sequences per step (prompt parts, then batched decode)
/// against each sequence alone.
pub fn compare_batched_cache(
    arch: Arch,
    ty: &str,
    heads: (usize, usize, usize),
    kv: KvTypes,
    lens: &[usize],
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<LogitReport> {
    let file = tiny_model_heads(arch, ty, seed, heads)?;
    compare_batched_of(file, arch, ty, lens, seed, ordinal, kv, true)
}

#[allow(clippy::too_many_arguments)]
fn compare_batched_of(
    file: Arc<GgufFile>,
    arch: Arch,
    ty: &str,
    lens: &[usize],
    seed: u64,
    ordinal: usize,
    kv: KvTypes,
    q8: bool,
) -> anyhow::Result<LogitReport> {
    let opts = EngineOptions {
        max_seqs: lens.len() + 1,
        ..options(100)
    };
    let mut gpu = Engine::with_cache_types(CudaBackend::new(ordinal)?, file.clone(), &opts, kv)?;
    if !q8 {
        gpu.backend.set_q8_decode(false);
    }
    let vocab = gpu.config().vocab_size as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0xba7c);
    const DECODE: usize = 4;
    let prompts: Vec<Vec<u32>> = lens
        .iter()
        .map(|&n| {
            (0..n + DECODE)
                .map(|_| rng.random_range(0..vocab))
                .collect()
        })
        .collect();
    let mut alone = Vec::new();
    for p in &prompts {
        alone.push(all_logits(&mut gpu, p)?);
    }
    let mut seqs = vec![Sequence::default(); lens.len()];
    let mut got: Vec<Vec<Vec<f32>>> = prompts.iter().map(|p| vec![Vec::new(); p.len()]).collect();
    let heads: Vec<&[u32]> = prompts.iter().zip(lens).map(|(p, &n)| &p[..n]).collect();
    gpu.eval_batch(&mut seqs, &heads, true, |i, index, row| {
        got[i][index] = row.to_vec()
    })?;
    for t in 0..DECODE {
        let step: Vec<&[u32]> = prompts
            .iter()
            .zip(lens)
            .map(|(p, &n)| &p[n + t..n + t + 1])
            .collect();
        gpu.eval_batch(&mut seqs, &step, false, |i, _, row| {
            got[i][lens[i] + t] = row.to_vec()
        })?;
    }
    for s in &mut seqs {
        gpu.release(s);
    }
    let a: Vec<Vec<f32>> = alone.into_iter().flatten().collect();
    let b: Vec<Vec<f32>> = got.into_iter().flatten().collect();
    anyhow::ensure!(
        b.iter().all(|r| r.len() == vocab as usize),
        "a batched position returned no logits"
    );
    let mut report = logit_report(arch, ty, &a, &b);
    // Decode steps of several sequences run on 8-bit activations where the format allows,
    // and so do the same steps of each sequence alone.
    report.q8 = gpu.backend.q8_decode();
    report.q8_reference = report.q8;
    if report.q8 {
        // The model's sensitivity to 8-bit rounding, on the first sequence's tokens.
        let mut cpu = cpu_engine(&file)?;
        let f32_logits = all_logits(&mut cpu, &prompts[0])?;
        report.q8_spread = cpu_q8_spread(&file, &prompts[0], &f32_logits)?;
    }
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
    /// The largest gap a near-tie may have there: the logit checks' f32 bound,
    /// [`MAX_REL_DIFF`] of max(1, max |logit|) at that position (a model with larger logits
    /// carries larger rounding, as phi3's tiny models do).
    pub tie_bound: f32,
}

impl GreedyReport {
    /// Identical, or different only after a near-tie of the CPU's logits.
    pub fn passed(&self) -> bool {
        match self.first_difference {
            None => true,
            Some((_, gap)) => gap < self.tie_bound,
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
/// one token each on the GPU, through `Engine::generate`).
pub fn compare_greedy(
    arch: Arch,
    ty: &str,
    n: usize,
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<GreedyReport> {
    let file = tiny_model(arch, ty, seed)?;
    let mut gpu = cuda_engine(&file, ordinal)?;
    greedy_against_cpu(arch, ty, &file, &mut gpu, n, seed ^ 0x9e37)
}

/// `n` greedy tokens after a random 8-token prompt (from `prompt_seed`) on the CPU oracle
/// and on `gpu` through `Engine::generate`, as `kestrel run --temp 0` decodes (each step's
/// argmax on the device, only the id read back); the CPU's logits tell a near-tie from a bug.
fn greedy_against_cpu<B: kestrel_model::Backend>(
    arch: Arch,
    ty: &str,
    file: &Arc<GgufFile>,
    gpu: &mut Engine<B>,
    n: usize,
    prompt_seed: u64,
) -> anyhow::Result<GreedyReport> {
    let mut cpu = cpu_engine(file)?;
    let vocab = cpu.config().vocab_size as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(prompt_seed);
    let prompt: Vec<u32> = (0..8).map(|_| rng.random_range(0..vocab)).collect();
    let (a, cpu_logits) = greedy(&mut cpu, &prompt, n)?;
    let mut seq = Sequence::default();
    let greedy_params = kestrel_engine::sampler::SamplerParams::greedy();
    let b = gpu.generate(&mut seq, &prompt, &greedy_params, n, |_| false, |_| true)?;
    gpu.release(&mut seq);
    let first = a.iter().zip(&b).position(|(x, y)| x != y);
    let first_difference = first.map(|i| {
        let l = &cpu_logits[i];
        (i, l[a[i] as usize] - l[b[i] as usize])
    });
    let tie_bound = first.map_or(0.0, |i| {
        let largest = cpu_logits[i].iter().fold(1f32, |m, x| m.max(x.abs()));
        MAX_REL_DIFF * largest
    });
    Ok(GreedyReport {
        arch,
        ty: ty.to_string(),
        cpu: a,
        cuda: b,
        first_difference,
        tie_bound,
    })
}

/// Largest |Δ logit| (relative to max(1, |logit|)) between a sequence in a reused state slot
/// and on a fresh engine.
pub const MAX_REUSE_REL_DIFF: f32 = 1e-5;

/// Result of [`check_state_continuity`].
#[derive(Debug, Clone)]
pub struct StateReport {
    /// The error of a step that did not continue its sequence's state (None: it ran).
    pub refused: Option<String>,
    /// Largest |Δ logit| between a sequence evaluated after others were released (state
    /// slots reused) and the same tokens on a fresh engine, relative to max(1, |logit|).
    pub reuse_rel_diff: f32,
}

impl StateReport {
    /// The discontinuous step refused with the state's message, and reused slots starting
    /// from a zero state (the same logits up to [`MAX_REUSE_REL_DIFF`]: same kernels, same
    /// inputs; a stale state would differ by whole units).
    pub fn passed(&self) -> bool {
        self.refused
            .as_deref()
            .is_some_and(|m| m.contains("cannot roll back"))
            && self.reuse_rel_diff <= MAX_REUSE_REL_DIFF
    }
}

/// A linear-attention model's per-sequence state on the GPU: a sequence cut back
/// (`Engine::truncate`) and continued must be refused (the state cannot roll back), and
/// after sequences are released their slots, reused by new sequences, start from zero.
pub fn check_state_continuity(
    arch: Arch,
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<StateReport> {
    let file = tiny_model(arch, "f16", seed)?;
    let opts = EngineOptions {
        max_seqs: 4,
        ..options(100)
    };
    let mut gpu = Engine::new(CudaBackend::new(ordinal)?, file.clone(), &opts)?;
    let vocab = gpu.config().vocab_size as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x57a7e);
    let mut tokens =
        |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(0..vocab)).collect() };
    let (a, b, c) = (tokens(37), tokens(21), tokens(29));
    // Two sequences alive at once, then the first cut back and continued.
    let mut s1 = Sequence::default();
    let mut s2 = Sequence::default();
    gpu.eval(&mut s1, &a, false, |_, _| {})?;
    gpu.eval(&mut s2, &b, false, |_, _| {})?;
    gpu.truncate(&mut s1, 20);
    let refused = gpu
        .eval(&mut s1, &c[..3], false, |_, _| {})
        .err()
        .map(|e| format!("{e:#}"));
    gpu.release(&mut s1);
    gpu.release(&mut s2);
    // A new sequence in a reused slot, in parts, against a fresh engine's logits.
    let reused = all_logits_in_parts(&mut gpu, &c, &[5, 1, 1, 9])?;
    drop(gpu);
    let mut fresh = Engine::new(CudaBackend::new(ordinal)?, file, &opts)?;
    let want = all_logits_in_parts(&mut fresh, &c, &[5, 1, 1, 9])?;
    let mut worst = 0f32;
    for (x, y) in reused.iter().zip(&want) {
        let top = y.iter().fold(1f32, |m, v| m.max(v.abs()));
        for (p, q) in x.iter().zip(y) {
            worst = worst.max((p - q).abs() / top);
        }
    }
    anyhow::ensure!(
        reused.len() == want.len(),
        "rows of logits differ in number"
    );
    Ok(StateReport {
        refused,
        reuse_rel_diff: worst,
    })
}

/// Result of [`compare_embeddings`].
#[derive(Debug, Clone, Default)]
pub struct EmbedReport {
    pub vectors: usize,
    /// Lowest cosine between a CPU and a CUDA vector of the same input and pooling.
    pub min_cosine: f64,
    /// Largest |difference| relative to the largest |value| of the CPU vector.
    pub max_rel_diff: f64,
}

impl EmbedReport {
    pub fn passed(&self) -> bool {
        self.vectors > 0 && self.min_cosine > 0.9999 && self.max_rel_diff < 1e-2
    }
}

/// Embeddings (`Engine::embed`: final-norm hidden rows instead of logits, pooled mean,
/// first and last) of random inputs of awkward lengths — some longer than the CUDA
/// engine's 100-token steps, so they come in chunks, others packed several a step — on
/// both engines.
pub fn compare_embeddings(
    arch: Arch,
    ty: &str,
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<EmbedReport> {
    use kestrel_model::Pooling;
    let file = tiny_model(arch, ty, seed)?;
    let mut cpu = cpu_engine(&file)?;
    let mut gpu = cuda_engine(&file, ordinal)?;
    let vocab = cpu.config().vocab_size as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0xe3b);
    let inputs: Vec<Vec<u32>> = [1, 2, 17, 33, 99, 101, 250]
        .iter()
        .map(|&n| (0..n).map(|_| rng.random_range(0..vocab)).collect())
        .collect();
    let refs: Vec<&[u32]> = inputs.iter().map(Vec::as_slice).collect();
    let mut report = EmbedReport {
        min_cosine: 1.0,
        ..EmbedReport::default()
    };
    for pooling in [Pooling::Mean, Pooling::Cls, Pooling::Last] {
        let a = cpu.embed(&refs, pooling)?;
        let b = gpu.embed(&refs, pooling)?;
        for (x, y) in a.iter().zip(&b) {
            let dot: f64 = x.iter().zip(y).map(|(&p, &q)| p as f64 * q as f64).sum();
            let norm = |v: &[f32]| v.iter().map(|&p| p as f64 * p as f64).sum::<f64>().sqrt();
            let cos = dot / (norm(x) * norm(y)).max(f64::MIN_POSITIVE);
            let scale = x
                .iter()
                .fold(0f64, |m, &p| m.max(p.abs() as f64))
                .max(1e-30);
            let diff = x
                .iter()
                .zip(y)
                .fold(0f64, |m, (&p, &q)| m.max((p - q).abs() as f64));
            report.min_cosine = report.min_cosine.min(cos);
            report.max_rel_diff = report.max_rel_diff.max(diff / scale);
            report.vectors += 1;
        }
    }
    Ok(report)
}

/// Result of [`compare_sampled`].
#[derive(Debug, Clone, Default)]
pub struct SampledReport {
    pub tokens: usize,
    /// Positions where the host draws another token, but draws the device's when u or
    /// top-p moves by 1e-6 (rounding at the edge of an interval).
    pub edge: usize,
    /// Positions where it does not.
    pub wrong: usize,
}

impl SampledReport {
    /// No wrong position, and edge cases at most 5% of them.
    pub fn passed(&self) -> bool {
        self.tokens > 0 && self.wrong == 0 && self.edge * 20 <= self.tokens
    }
}

/// Sampled generation on the GPU (`Engine::generate`: each token drawn on the device by
/// `sample_rows`, with penalties) against the host's definition replaying the same seed
/// over the same logits: a second sequence teacher-forced over the drawn tokens one at a
/// time runs the same single-token kernels (bitwise the same logits), and the host's
/// `RowSampler` draws from them with the sampler's `u` at each position.
pub fn compare_sampled(
    arch: Arch,
    ty: &str,
    n: usize,
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<SampledReport> {
    use kestrel_engine::sampler::{Sampler, SamplerParams};
    use kestrel_model::sampling::{RowSampler, RowSampling, SamplingBatch};
    let file = tiny_model(arch, ty, seed)?;
    let mut gpu = cuda_engine(&file, ordinal)?;
    let vocab = gpu.config().vocab_size as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5a5a);
    let prompt: Vec<u32> = (0..8).map(|_| rng.random_range(0..vocab)).collect();
    // llama.cpp's default filters, with every penalty on.
    let params = SamplerParams {
        temperature: 0.9,
        repeat_penalty: 1.1,
        presence_penalty: 0.2,
        frequency_penalty: 0.1,
        seed: Some(rng.random()),
        ..SamplerParams::default()
    };
    let mut seq = Sequence::default();
    let drawn = gpu.generate(&mut seq, &prompt, &params, n, |_| false, |_| true)?;
    gpu.release(&mut seq);
    let mut sampler = Sampler::new(params);
    let (mut batch, mut row) = (SamplingBatch::default(), RowSampler::default());
    let mut last = Vec::new();
    gpu.eval(&mut seq, &prompt, false, |_, l| last = l.to_vec())?;
    let mut report = SampledReport {
        tokens: drawn.len(),
        ..SampledReport::default()
    };
    for &id in &drawn {
        batch.clear();
        sampler.push_row(&mut batch, &seq.tokens);
        let Some((spec, pens)) = batch.row(0) else {
            anyhow::bail!("no sampling row");
        };
        if row.sample(&last, spec, pens) != id {
            let nudges = [(1e-6, 0.0), (-1e-6, 0.0), (0.0, 1e-6), (0.0, -1e-6)];
            let nudged = nudges.iter().any(|&(du, dp)| {
                let s = RowSampling {
                    u: (spec.u + du).clamp(0.0, 1.0 - f64::EPSILON),
                    top_p: spec.top_p + dp as f32,
                    ..*spec
                };
                row.sample(&last, &s, pens) == id
            });
            if nudged {
                report.edge += 1;
            } else {
                report.wrong += 1;
            }
        }
        gpu.eval(&mut seq, &[id], false, |_, l| last = l.to_vec())?;
    }
    gpu.release(&mut seq);
    Ok(report)
}

/// The GEMV kernels (decode-sized matmuls) against an f64 oracle on dequantized weights.
#[derive(Debug, Clone)]
pub struct GemvReport {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub tokens: usize,
    /// ‖out − ref‖ / ‖ref‖.
    pub rel_err: f64,
    /// Outputs left unwritten (still the NaN poison) or non-finite.
    pub non_finite: usize,
    /// Whether the product went through cuBLAS with f16 operands.
    pub via_cublas: bool,
    /// Whether it ran on 8-bit activations (the reference then uses them too).
    pub via_q8: bool,
    /// Whether it ran on `mmw_gated` (4-bit weights repacked, f16 operands; the reference
    /// uses x rounded to f16).
    pub via_mmw: bool,
    /// Whether it ran on activations quantized per 256 values (`mmk_t8*`, `mms_*`; the
    /// reference uses them).
    pub via_mmk: bool,
    /// Whether it ran on the staged int8 kernels `mms_*`.
    pub via_mms: bool,
    /// Whether it ran on the single-token `gemv_ws` (weights staged per warp).
    pub via_ws: bool,
}

/// `x` as the GPU's 8-bit quantization leaves it, back in f32, in blocks of `block` values
/// (32: `quantize_x_q8` / `quantize_x_mmq`; 256: `quantize_x_mmk`, rows a multiple of 256):
/// per block d = max|x| / 127 and q = round-half-even(x / d), clamped to ±127; value d · q.
pub fn quantize_q8_like_gpu(x: &[f32], block: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for values in x.chunks(block) {
        let amax = values.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        for &v in values {
            let q = if d > 0.0 {
                (v / d).round_ties_even().clamp(-127.0, 127.0)
            } else {
                0.0
            };
            // Rounded to f32 (relative 6e-8, far below the GEMV bound).
            out.push((d as f64 * q as f64) as f32);
        }
    }
    out
}

/// Largest relative error allowed for a GEMV (f32 arithmetic over up to a few thousand
/// terms).
pub const MAX_GEMV_REL_ERR: f64 = 1e-5;

/// Largest relative error allowed for a prompt-sized product through cuBLAS: weights and
/// activations are rounded to f16 (2^-11 relative each) before f32 accumulation.
pub const MAX_GEMM_REL_ERR: f64 = 2e-3;

impl GemvReport {
    /// The bound this case is held to (f32 kernels, or f16 operands on the tensor cores).
    pub fn limit(&self) -> f64 {
        if self.via_cublas || self.via_mmw {
            MAX_GEMM_REL_ERR
        } else {
            MAX_GEMV_REL_ERR
        }
    }

    pub fn passed(&self) -> bool {
        self.non_finite == 0 && self.rel_err <= self.limit()
    }
}

/// Types the GEMV kernels read (others use the general matmul kernel).
pub const GEMV_TYPES: [GgmlType; 11] = [
    GgmlType::Q4K,
    GgmlType::Q6K,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q5_0,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::F32,
    GgmlType::IQ4NL,
    GgmlType::IQ4XS,
    GgmlType::MXFP4,
];

/// Types the 8-bit GEMVs read (single-token gate/up launches and residual adds are checked
/// on these): the tensor-core kernels' formats and the 4-bit codebook ones.
pub const Q8_GEMV_TYPES: [GgmlType; 7] = [
    GgmlType::Q4K,
    GgmlType::Q6K,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::IQ4NL,
    GgmlType::IQ4XS,
    GgmlType::MXFP4,
];

/// A random `rows × cols` matrix of type `ty`, uploaded, and its dequantized values.
fn random_matrix(
    backend: &CudaBackend,
    rng: &mut rand::rngs::StdRng,
    ty: GgmlType,
    rows: usize,
    cols: usize,
) -> anyhow::Result<(kestrel_cuda::CudaWeight, Vec<f32>)> {
    let w: Vec<f32> = (0..rows * cols)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let bytes = match ty {
        GgmlType::F32 => w.iter().flat_map(|v| v.to_le_bytes()).collect(),
        _ => kestrel_quant::quantize(ty, &w, cols).with_context(|| format!("quantizing {ty}"))?,
    };
    let wq = match ty {
        GgmlType::F32 => w,
        _ => kestrel_quant::dequantize(ty, &bytes).with_context(|| format!("dequantizing {ty}"))?,
    };
    let mut weight = backend.upload_matrix(ty, rows, cols, &bytes)?;
    backend.add_mmw_copy(&mut weight)?;
    Ok((weight, wq))
}

/// Which product [`compare_gemv`] checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Product {
    /// `out = x · Wᵀ` (the backend's `matmul`).
    Plain,
    /// `silu(x · Gᵀ) * (x · Uᵀ)` for two such matrices (the feed-forward block's gate and
    /// up: `gate_up_of`).
    Gated,
    /// `residual += x · Wᵀ` (`matmul_add`, as the attention output and the down projection
    /// use it), into a random residual.
    AddInto,
}

/// A product of a random `rows × cols` matrix of type `ty` and `n` random token rows on the
/// GPU, compared with f64 dot products of the dequantized rows.
pub fn compare_gemv(
    backend: &CudaBackend,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    n: usize,
    seed: u64,
    product: Product,
) -> anyhow::Result<GemvReport> {
    use kestrel_model::Backend;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (weight, wq) = random_matrix(backend, &mut rng, ty, rows, cols)?;
    let up = if product == Product::Gated {
        Some(random_matrix(backend, &mut rng, ty, rows, cols)?)
    } else {
        None
    };
    let x: Vec<f32> = (0..n * cols)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let residual: Vec<f32> = if product == Product::AddInto {
        (0..n * rows)
            .map(|_| rng.random_range(-4.0f32..4.0))
            .collect()
    } else {
        vec![f32::NAN; n * rows]
    };
    let xt = backend.upload_tensor(n, cols, &x)?;
    let mut out = backend.upload_tensor(n, rows, &residual)?;
    // The tensor-core kernels quantize a multiple of 8 tokens (the staged ones 16 or 32);
    // reserved first, since the kernel choice depends on the room there.
    backend.reserve_q8(n.next_power_of_two().max(8) * cols)?;
    let via_cublas = backend.matmul_uses_cublas(&weight, n);
    let via_q8 = backend.matmul_uses_q8(&weight, n);
    let via_mmw = match &up {
        Some((up_w, _)) => backend.matmul_uses_mmw(&weight, up_w, n),
        None => false,
    };
    let via_mmk = backend.matmul_uses_mmk(&weight, n);
    let via_mms = backend.matmul_uses_mms(&weight, n);
    let via_ws = backend.matmul_uses_ws(&weight, n);
    match &up {
        Some((up_w, _)) => {
            let mut up_out = backend.upload_tensor(n, rows, &vec![f32::NAN; n * rows])?;
            let _gated = backend.gate_up_of(
                &xt,
                kestrel_cuda::Prepared::Nothing,
                &weight,
                up_w,
                kestrel_model::Activation::Silu,
                n,
                &mut out,
                &mut up_out,
            );
        }
        None if product == Product::AddInto => {
            let mut tmp = backend.upload_tensor(n, rows, &vec![f32::NAN; n * rows])?;
            let nothing = kestrel_cuda::Prepared::Nothing;
            backend.matmul_add(&xt, nothing, &weight, n, &mut tmp, &mut out);
        }
        None => backend.matmul(&xt, &weight, n, &mut out),
    }
    // The reference uses the activations the product sees: x rounded as the 8-bit paths'
    // quantization rounds it (`mmk_t8*` per 256 values, the others per 32), or to f16 for
    // the f16 tensor-core products (cuBLAS, `mmw_gated`).
    let x = if via_q8 {
        quantize_q8_like_gpu(&x, if via_mmk { 256 } else { 32 })
    } else if via_cublas || via_mmw {
        x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect()
    } else {
        x
    };
    let mut got = Vec::new();
    backend.read_rows(&out, n, &mut got)?;
    let dot = |m: &[f32], t: usize, r: usize| -> f64 {
        m[r * cols..(r + 1) * cols]
            .iter()
            .zip(&x[t * cols..(t + 1) * cols])
            .map(|(&a, &b)| a as f64 * b as f64)
            .sum()
    };
    let (rel_err, non_finite) = rel_error(&got, n, rows, |t, r| match (&up, product) {
        (Some((_, uq)), _) => {
            let g = dot(&wq, t, r);
            g / (1.0 + (-g).exp()) * dot(uq, t, r)
        }
        (None, Product::AddInto) => residual[t * rows + r] as f64 + dot(&wq, t, r),
        (None, _) => dot(&wq, t, r),
    });
    Ok(GemvReport {
        ty,
        rows,
        cols,
        tokens: n,
        rel_err,
        non_finite,
        via_cublas,
        via_q8,
        via_mmw,
        via_mmk,
        via_mms,
        via_ws,
    })
}

/// Weight types whose verification-step products [`compare_gemv_invariant`] checks: the
/// 8-bit GEMVs' formats (`gemv_v*` on `gemv_ws_r1`'s units or on `gemv_q8*`'s) and two
/// f32-activation ones (`gemv_dec` a token).
pub const INVARIANT_TYPES: [GgmlType; 9] = [
    GgmlType::Q4K,
    GgmlType::Q6K,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::IQ4NL,
    GgmlType::IQ4XS,
    GgmlType::MXFP4,
    GgmlType::Q5_0,
    GgmlType::F16,
];

/// A verification-step product against single-token ones.
#[derive(Debug, Clone)]
pub struct InvariantProductReport {
    /// Output values compared (tokens × rows).
    pub values: usize,
    /// Values not bit-identical to the single-token product's, and the largest |Δ|.
    pub differing: usize,
    pub max_abs_diff: f32,
    /// Values of the verification step left unwritten (NaN poison) or non-finite.
    pub non_finite: usize,
    /// The kernel family a single token of it takes (the verification step runs that
    /// family's multi-token form).
    pub kernel: kestrel_cuda::Kernel,
}

impl InvariantProductReport {
    pub fn passed(&self) -> bool {
        self.values > 0 && self.differing == 0 && self.non_finite == 0
    }
}

/// A product of a random `rows × cols` matrix of type `ty` (two for [`Product::Gated`]) and
/// `n` random token rows computed as a verification step computes it (batch-invariantly,
/// `CudaBackend::set_invariant`), for each `n` of `counts`, against each token's row computed
/// as a single-token product: every value must be bit-identical.
pub fn compare_gemv_invariant(
    backend: &CudaBackend,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    counts: &[usize],
    seed: u64,
    product: Product,
) -> anyhow::Result<InvariantProductReport> {
    use kestrel_model::Backend;
    let most = counts.iter().copied().max().unwrap_or(0);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (weight, _) = random_matrix(backend, &mut rng, ty, rows, cols)?;
    let up = if product == Product::Gated {
        Some(random_matrix(backend, &mut rng, ty, rows, cols)?.0)
    } else {
        None
    };
    let x: Vec<f32> = (0..most * cols)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let residual: Vec<f32> = if product == Product::AddInto {
        (0..most * rows)
            .map(|_| rng.random_range(-4.0f32..4.0))
            .collect()
    } else {
        vec![f32::NAN; most * rows]
    };
    backend.reserve_q8(most.next_power_of_two().max(8) * cols)?;
    // The first `m` token rows through the product (into the residual's rows for AddInto),
    // from token `t0` on.
    let run = |t0: usize, m: usize| -> anyhow::Result<Vec<f32>> {
        let xt = backend.upload_tensor(m, cols, &x[t0 * cols..(t0 + m) * cols])?;
        let mut out = backend.upload_tensor(m, rows, &residual[t0 * rows..(t0 + m) * rows])?;
        let nothing = kestrel_cuda::Prepared::Nothing;
        match &up {
            Some(up_w) => {
                let mut up_out = backend.upload_tensor(m, rows, &vec![f32::NAN; m * rows])?;
                let act = kestrel_model::Activation::Silu;
                let _ =
                    backend.gate_up_of(&xt, nothing, &weight, up_w, act, m, &mut out, &mut up_out);
            }
            None if product == Product::AddInto => {
                let mut tmp = backend.upload_tensor(m, rows, &vec![f32::NAN; m * rows])?;
                backend.matmul_add(&xt, nothing, &weight, m, &mut tmp, &mut out);
            }
            None => backend.matmul(&xt, &weight, m, &mut out),
        }
        let mut got = Vec::new();
        backend.read_rows(&out, m, &mut got)?;
        Ok(got)
    };
    // Each token alone (a single-token product does not depend on the step around it).
    backend.set_invariant(false);
    let mut alone = Vec::with_capacity(most * rows);
    for t in 0..most {
        alone.extend(run(t, 1)?);
    }
    let mut report = InvariantProductReport {
        values: 0,
        differing: 0,
        max_abs_diff: 0.0,
        non_finite: 0,
        kernel: backend.plan_of(&weight, 1),
    };
    for &n in counts {
        backend.set_invariant(true);
        let together = run(0, n);
        backend.set_invariant(false);
        let together = together?;
        report.values += n * rows;
        report.non_finite += together.iter().filter(|v| !v.is_finite()).count();
        for (a, b) in alone.iter().zip(&together) {
            if a.to_bits() != b.to_bits() {
                report.differing += 1;
                report.max_abs_diff = report.max_abs_diff.max((a - b).abs());
            }
        }
    }
    Ok(report)
}

/// Random shapes for [`compare_gemv_invariant`] (each run at 2..=8 tokens): awkward row
/// counts within one wave of one-row warps (single tokens on `gemv_ws_r1` for the K-quants)
/// and beyond it (2,641+ rows: `gemv_q8`), short rows and rows of 35 blocks (8,960 values
/// for the K-quants, as Qwen2.5-1.5B's down projection).
pub fn invariant_cases(ty: GgmlType, seed: u64) -> Vec<(usize, usize, u64)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let unit = if matches!(ty, GgmlType::Q4K | GgmlType::Q6K | GgmlType::IQ4XS) {
        256
    } else {
        32
    };
    [
        (rng.random_range(1..300), 6 * unit),
        (rng.random_range(1..200), 35 * unit),
        (2_641 + rng.random_range(0..400), unit),
    ]
    .into_iter()
    .map(|(rows, cols)| (rows, cols, rng.random()))
    .collect()
}

/// ‖got − want‖ / ‖want‖ over `n` token rows of `rows` values (`want(t, r)`, in f64), the
/// non-finite values of `got` left out and counted.
fn rel_error(
    got: &[f32],
    n: usize,
    rows: usize,
    want: impl Fn(usize, usize) -> f64,
) -> (f64, usize) {
    let (mut err2, mut ref2, mut non_finite) = (0f64, 0f64, 0usize);
    for t in 0..n {
        for r in 0..rows {
            let g = got[t * rows + r];
            if !g.is_finite() {
                non_finite += 1;
                continue;
            }
            let w = want(t, r);
            err2 += (g as f64 - w).powi(2);
            ref2 += w * w;
        }
    }
    ((err2 / ref2.max(f64::MIN_POSITIVE)).sqrt(), non_finite)
}

/// Random GEMV cases for one type: awkward row counts, several row lengths (short rows
/// take the one-warp-per-row path, long ones the four-warps path) and 1..=8 tokens (1 in
/// the first two).
pub fn gemv_cases(ty: GgmlType, seed: u64) -> Vec<(usize, usize, usize, u64)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let unit = if matches!(ty, GgmlType::Q4K | GgmlType::Q6K | GgmlType::IQ4XS) {
        256
    } else {
        32
    };
    // Single-token steps have their own kernels: always cover them, with short rows (one
    // row per warp) and rows past 2,048 values (two rows per warp).
    let long = if unit == 256 { [11, 35] } else { [70, 301] };
    // F16 / BF16 rows of a multiple of 16 values take 32-byte units; one single-token case
    // of 8 · 37 values keeps the 16-byte ones covered.
    let narrow_f16 = matches!(ty, GgmlType::F16 | GgmlType::BF16)
        .then(|| (rng.random_range(1..300), 8 * 37, 1, rng.random()));
    [
        (1usize, true),
        (3, true),
        (6, false),
        (11, false),
        (35, false),
    ]
    .into_iter()
    .chain(long.map(|blocks| (blocks, true)))
    .map(|(blocks, single)| {
        let rows = rng.random_range(1..300);
        let n = if single {
            1
        } else {
            rng.random_range(1..=kestrel_cuda::GEMV_MAX_TOKENS)
        };
        (rows, blocks * unit, n, rng.random())
    })
    .chain(narrow_f16)
    .collect()
}

/// Types the tensor-core kernels for 3..=MMQ_MAX_TOKENS tokens read (`kernels/mmq.cu`).
pub const MMQ_TYPES: [GgmlType; 4] = [GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q8_0, GgmlType::Q4_0];

/// Random cases for `mmq_t8` (3..=8 tokens; Q4_K / Q6_K only where `mmk_t8*` is off, as
/// for the LM head): awkward row counts (not multiples of 16), and for the 32-value formats
/// row lengths that are not multiples of 256 as well as ones that are.
pub fn mmq_cases(ty: GgmlType, seed: u64) -> Vec<(usize, usize, usize, u64)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let lengths: [usize; 5] = if matches!(ty, GgmlType::Q4K | GgmlType::Q6K) {
        [256, 768, 1536, 3584, 512]
    } else {
        [32, 224, 2048, 2080, 4096]
    };
    lengths
        .iter()
        .enumerate()
        .map(|(i, &cols)| {
            let rows = rng.random_range(1..300);
            let n = if i == 0 { 8 } else { rng.random_range(3..=8) };
            (rows, cols, n, rng.random())
        })
        .collect()
}

/// Random cases for `mmk_t8*` (3..=8 tokens, Q4_K / Q6_K): awkward row counts and row
/// lengths of 1 to 14 steps of 256 (fewer steps than a block has warps, and more).
pub fn mmk_cases(seed: u64) -> Vec<(usize, usize, usize, u64)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    [1usize, 3, 8, 9, 14]
        .iter()
        .map(|&steps| {
            let rows = rng.random_range(1..300);
            (rows, steps * 256, rng.random_range(3..=8), rng.random())
        })
        .collect()
}

/// Random cases for `mms_*` (9..=32 tokens, Q4_K / Q6_K): each of its tile sizes (16 and 32
/// tokens, full and partly filled), awkward row counts, and row lengths of 1 to 56 steps of
/// 256 (narrow launches split them across blocks, odd step counts per split included).
pub fn mms_cases(seed: u64) -> Vec<(usize, usize, usize, u64)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    [
        (9, 16, 1),
        (16, 16, 14),
        (17, 32, 3),
        (32, 32, 9),
        (17, 32, 56),
        (9, 16, 16),
    ]
    .iter()
    .map(|&(lo, hi, steps)| {
        let rows = rng.random_range(1..300);
        (rows, steps * 256, rng.random_range(lo..=hi), rng.random())
    })
    .collect()
}

/// A logit-sized product (≥ 8 MB of output) read back three times: plainly, then with its
/// rows copied ahead while it ran (the backend saw a large read last: the product then runs
/// in column chunks, whose cuBLAS algorithms may sum in another order), then copied ahead
/// but written again by a kernel before the read (the copy must not be used). The two
/// chunked reads must be identical bit for bit and within f32 rounding of the plain one;
/// the second read must have used the read-ahead, the third not.
#[derive(Debug, Clone)]
pub struct ReadAheadReport {
    /// The read-ahead against the plain copy of the same (chunked) product.
    pub identical: bool,
    /// Largest |Δ| / max |value| between the chunked and the single product.
    pub chunked_rel_diff: f32,
    pub used: [bool; 2],
}

impl ReadAheadReport {
    pub fn passed(&self) -> bool {
        self.identical && self.chunked_rel_diff <= 1e-5 && self.used == [true, false]
    }
}

pub fn compare_read_ahead(backend: &CudaBackend, seed: u64) -> anyhow::Result<ReadAheadReport> {
    use kestrel_model::Backend;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (rows, cols, n) = (rng.random_range(33_000..40_000), 256, 64);
    let (weight, _) = random_matrix(backend, &mut rng, GgmlType::F16, rows, cols)?;
    let x: Vec<f32> = (0..n * cols)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let xt = backend.upload_tensor(n, cols, &x)?;
    let mut out = backend.upload_tensor(n, rows, &vec![f32::NAN; n * rows])?;
    let mut reads = Vec::new();
    let mut used = Vec::new();
    backend.forget_rows_read_back();
    for round in 0..3 {
        let hits = backend.read_ahead_hits();
        backend.matmul(&xt, &weight, n, &mut out);
        if round == 2 {
            // A kernel writing the rows after the product: scale by 1 (same values), which
            // the read must see through a fresh copy.
            backend.scale(&mut out, n, 1.0);
        }
        let mut got = Vec::new();
        backend.read_rows(&out, n, &mut got)?;
        used.push(backend.read_ahead_hits() > hits);
        reads.push(got);
    }
    let identical = reads[1].len() == reads[2].len()
        && reads[1]
            .iter()
            .zip(&reads[2])
            .all(|(x, y)| x.to_bits() == y.to_bits());
    let scale = reads[0]
        .iter()
        .fold(0f32, |m, v| m.max(v.abs()))
        .max(f32::MIN_POSITIVE);
    let diff = reads[0]
        .iter()
        .zip(&reads[1])
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    Ok(ReadAheadReport {
        identical,
        chunked_rel_diff: if diff.is_finite() {
            diff / scale
        } else {
            f32::INFINITY
        },
        used: [used[1], used[2]],
    })
}

/// Random cases for `mmw_gated` (Q4_K gate/up of 33..=64 tokens): awkward row counts, row
/// lengths of 1 to 56 steps of 256, and the warps per block to force (0: by shape).
pub fn mmw_cases(seed: u64) -> Vec<(usize, usize, usize, u64, usize)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    [(1, 0), (3, 1), (16, 2), (56, 3), (9, 7), (5, 8), (16, 0)]
        .iter()
        .map(|&(steps, warps)| {
            let rows = rng.random_range(1..600);
            (
                rows,
                steps * 256,
                rng.random_range(33..=64),
                rng.random(),
                warps,
            )
        })
        .collect()
}

/// Random prompt-sized cases for one type (every type the backend reads): 16..300 tokens,
/// awkward row counts, and row lengths that are not multiples of 8 for the float types.
pub fn gemm_cases(ty: GgmlType, seed: u64) -> Vec<(usize, usize, usize, u64)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let block = ty.block_size();
    (0..3)
        .map(|i| {
            let rows = rng.random_range(1..700);
            let cols = if block == 1 {
                rng.random_range(1..1200)
            } else {
                block * rng.random_range(1..=(2048 / block).max(1))
            };
            let n = if i == 0 {
                kestrel_cuda::GEMM_MIN_TOKENS
            } else {
                rng.random_range(kestrel_cuda::GEMM_MIN_TOKENS..300)
            };
            (rows, cols, n, rng.random())
        })
        .collect()
}

/// Decode with CUDA graphs against decode without them: logits must be bit-identical.
#[derive(Debug, Clone)]
pub struct GraphReport {
    pub arch: Arch,
    pub ty: String,
    pub steps: usize,
    /// Steps replayed from a graph on the graph engine.
    pub replays: u64,
    pub identical: bool,
}

impl GraphReport {
    pub fn passed(&self) -> bool {
        self.identical && self.replays > 0
    }
}

/// Two backends on GPU `ordinal`: the first replays graphs, the second launches every kernel.
fn graph_pair(ordinal: usize) -> anyhow::Result<(CudaBackend, CudaBackend)> {
    let with = CudaBackend::new(ordinal)?;
    with.set_graphs(true);
    let without = CudaBackend::new(ordinal)?;
    without.set_graphs(false);
    Ok((with, without))
}

/// Whether two runs' logit rows are the same rows, bit for bit.
fn bit_identical_rows(a: &[Vec<f32>], b: &[Vec<f32>]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
        })
}

/// Teacher-forced single-token steps (after a short prompt) on two CUDA engines, one
/// replaying graphs, one launching every kernel.
pub fn compare_graph_replay(
    arch: Arch,
    ty: &str,
    steps: usize,
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<GraphReport> {
    let file = tiny_model(arch, ty, seed)?;
    let (with, without) = graph_pair(ordinal)?;
    let replays = with.replay_counter();
    let mut a = Engine::new(with, file.clone(), &options(100))?;
    let mut b = Engine::new(without, file.clone(), &options(100))?;
    let vocab = a.config().vocab_size as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x6a09);
    let tokens: Vec<u32> = (0..steps + 5).map(|_| rng.random_range(0..vocab)).collect();
    // A 5-token prompt, then one token per step.
    let mut parts = vec![5];
    parts.extend(std::iter::repeat_n(1, steps));
    let la = all_logits_in_parts(&mut a, &tokens, &parts)?;
    let lb = all_logits_in_parts(&mut b, &tokens, &parts)?;
    let identical = bit_identical_rows(&la, &lb);
    Ok(GraphReport {
        arch,
        ty: ty.to_string(),
        steps,
        replays: replays.load(std::sync::atomic::Ordering::Relaxed),
        identical,
    })
}

/// Chained decoding (`Engine::decode_chained`: the host records step t + 1 while the GPU
/// runs step t, each step's token left on the device as the next step's input) against
/// step-by-step decoding on the same GPU. Greedy: ids, evaluated tokens and the logits of a
/// step after the chain must be identical, bit for bit, wherever the chain stops (its
/// callback at 1, 2 and 5 ids, `max_new`, the context's end). Drawn (temperature 1.5, a
/// seed): the ids of `decode_sampled` step by step with the same seed.
#[derive(Debug, Clone)]
pub struct ChainReport {
    pub arch: Arch,
    pub ty: String,
    /// Ids of step-by-step decoding.
    pub ids: usize,
    /// Stop cases whose ids, tokens, blocks or next logits differed.
    pub differing: Vec<String>,
    /// Steps replayed from a graph during the chained runs.
    pub replays: u64,
}

impl ChainReport {
    pub fn passed(&self) -> bool {
        self.differing.is_empty() && self.replays > 0
    }
}

pub fn compare_chained(
    arch: Arch,
    ty: &str,
    steps: usize,
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<ChainReport> {
    let file = if has_moe(arch) {
        tiny_moe_model(arch, ty, seed, MOE_SHAPES[1])?
    } else {
        tiny_model(arch, ty, seed)?
    };
    let backend = CudaBackend::new(ordinal)?;
    backend.set_graphs(true);
    let replays = backend.replay_counter();
    chain_report(arch, ty, backend, &file, steps, seed, &replays)
}

/// [`compare_chained`] on a tensor-parallel group over `ordinals` (every rank takes the
/// ids from its own copy of the gathered logits); `replays` counts the first rank's.
pub fn compare_tp_chained(
    arch: Arch,
    ty: &str,
    steps: usize,
    seed: u64,
    ordinals: &[usize],
) -> anyhow::Result<ChainReport> {
    let file = tp_model(arch, ty, seed)?;
    let backend = kestrel_cuda::TpBackend::new(ordinals)?;
    let replays = backend.rank(0).replay_counter();
    chain_report(arch, ty, backend, &file, steps, seed, &replays)
}

/// [`compare_chained`] under a layer split over `ordinals` (the last stage chooses the ids
/// and copies them to the others); `replays` counts the first stage's.
pub fn compare_split_chained(
    arch: Arch,
    ty: &str,
    steps: usize,
    seed: u64,
    ordinals: &[usize],
) -> anyhow::Result<ChainReport> {
    let file = split_model(arch, ty, seed)?;
    let backend = kestrel_cuda::SplitBackend::new(ordinals)?;
    let replays = backend.stage(0).replay_counter();
    chain_report(arch, ty, backend, &file, steps, seed, &replays)
}

/// The server's scheduler chaining decode steps on the GPU: `seqs` greedy requests
/// submitted together decode in lockstep, each step queued before the previous one's ids
/// are read (`chained`: the steps chained); the same requests asking for log-probabilities
/// take plain steps, their rows read back and reduced on the host. The ids must be equal.
#[derive(Debug, Clone)]
pub struct SchedulerChainReport {
    pub chained: Vec<Vec<u32>>,
    pub plain: Vec<Vec<u32>>,
    pub chained_steps: u64,
}

impl SchedulerChainReport {
    pub fn passed(&self) -> bool {
        self.chained == self.plain && self.chained_steps > 0
    }
}

pub fn compare_scheduler_chained(
    arch: Arch,
    ty: &str,
    seqs: usize,
    steps: usize,
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<SchedulerChainReport> {
    use kestrel_engine::scheduler::{self, Event, Request, SchedulerOptions};
    let file = tiny_model(arch, ty, seed)?;
    let f2 = file.clone();
    let h = scheduler::spawn(
        move || {
            let opts = EngineOptions {
                ctx: 256,
                max_batch_tokens: 128,
                max_logit_rows: seqs.max(1),
                block_size: 16,
                max_seqs: seqs.max(1),
            };
            Engine::new(CudaBackend::new(ordinal)?, f2, &opts)
        },
        SchedulerOptions {
            max_seqs: seqs.max(1),
            max_prefill_tokens: 128,
            prefix_cache: false,
            eog: vec![],
            spec: None,
        },
    )?;
    let vocab = h.info().vocab_size as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5c4e);
    let prompts: Vec<Vec<u32>> = (0..seqs)
        .map(|_| (0..8).map(|_| rng.random_range(0..vocab)).collect())
        .collect();
    let run = |logprobs: Option<usize>| -> anyhow::Result<Vec<Vec<u32>>> {
        let rxs = prompts
            .iter()
            .map(|p| {
                let (tx, rx) = std::sync::mpsc::channel();
                h.submit(Request {
                    prompt: p.clone(),
                    params: SamplerParams::greedy(),
                    max_tokens: steps,
                    logprobs,
                    speculative: false,
                    sink: Box::new(tx),
                })
                .map_err(|e| anyhow::anyhow!("{e}"))?;
                Ok(rx)
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        rxs.into_iter()
            .map(|rx| {
                let mut ids = Vec::new();
                for ev in rx {
                    match ev {
                        Event::Token { id, .. } => ids.push(id),
                        Event::Done { .. } => break,
                        Event::Error(e) => anyhow::bail!("request failed: {e}"),
                    }
                }
                Ok(ids)
            })
            .collect()
    };
    let chained = run(None)?;
    let chained_steps = h
        .stats()
        .chained_steps
        .load(std::sync::atomic::Ordering::Relaxed);
    let plain = run(Some(0))?;
    Ok(SchedulerChainReport {
        chained,
        plain,
        chained_steps,
    })
}

fn chain_report<B: kestrel_model::Backend>(
    arch: Arch,
    ty: &str,
    backend: B,
    file: &Arc<GgufFile>,
    steps: usize,
    seed: u64,
    replays: &std::sync::atomic::AtomicU64,
) -> anyhow::Result<ChainReport> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0xc4a1);
    let prompt_len = rng.random_range(3..12);
    // The context ends inside the longest chain.
    let ctx = prompt_len + steps;
    let opts = EngineOptions {
        ctx,
        max_batch_tokens: 64,
        max_logit_rows: 4,
        block_size: 16,
        max_seqs: 2,
    };
    let mut e = Engine::new(backend, file.clone(), &opts)?;
    anyhow::ensure!(e.can_chain(), "the backend does not chain {arch:?}");
    let vocab = e.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..prompt_len)
        .map(|_| rng.random_range(0..vocab))
        .collect();
    let prefill = |e: &mut Engine<B>, seq: &mut Sequence| -> anyhow::Result<u32> {
        let mut last = Vec::new();
        e.eval(seq, &prompt, false, |_, l| last = l.to_vec())?;
        Ok(argmax(&last) as u32)
    };
    let mut reference = Sequence::default();
    let first = prefill(&mut e, &mut reference)?;
    let (mut all, mut ids, mut next) = (Vec::new(), Vec::new(), first);
    while reference.tokens.len() < ctx {
        e.decode_argmax(std::slice::from_mut(&mut reference), &[next], &mut ids)?;
        next = ids[0];
        all.push(next);
    }
    e.release(&mut reference);
    let before = replays.load(std::sync::atomic::Ordering::Relaxed);
    let mut differing = Vec::new();
    for (stop_after, max_new) in [
        (1, 1),
        (1, 9),
        (2, 9),
        (5, 9),
        (9, 9),
        (3, 1000),
        (1000, 1000),
    ] {
        let what = format!("stop {stop_after} max {max_new}");
        let mut seq = Sequence::default();
        if prefill(&mut e, &mut seq)? != first {
            differing.push(format!("{what}: prompt"));
        }
        let mut count = 0;
        let mut greedy = Sampler::new(SamplerParams::greedy());
        let got = e.decode_chained(&mut seq, first, max_new, &mut greedy, |_| {
            count += 1;
            count < stop_after
        })?;
        let want = stop_after.min(max_new).min(all.len());
        let mut evaluated = prompt.clone();
        evaluated.push(first);
        evaluated.extend_from_slice(&all[..want.saturating_sub(1)]);
        if got != all[..want] {
            differing.push(format!("{what}: ids {got:?}, want {:?}", &all[..want]));
        } else if seq.tokens != evaluated || seq.block_table.len() != evaluated.len().div_ceil(16) {
            differing.push(format!(
                "{what}: {} tokens evaluated, want {}",
                seq.tokens.len(),
                evaluated.len()
            ));
        } else if seq.tokens.len() < ctx {
            let last = all[want - 1];
            // The reference takes the same single-token steps (a prompt-sized step rounds
            // differently on the GPU).
            let mut plain = Sequence::default();
            e.eval(&mut plain, &prompt, false, |_, _| {})?;
            for &t in &evaluated[prompt.len()..] {
                e.eval(&mut plain, &[t], false, |_, _| {})?;
            }
            let (mut a, mut b) = (Vec::new(), Vec::new());
            e.eval(&mut seq, &[last], false, |_, l| a = l.to_vec())?;
            e.eval(&mut plain, &[last], false, |_, l| b = l.to_vec())?;
            e.release(&mut plain);
            if !bit_identical_rows(&[a], &[b]) {
                differing.push(format!("{what}: the next step's logits"));
            }
        }
        e.release(&mut seq);
        if e.blocks.n_used() != 0 {
            differing.push(format!("{what}: {} blocks not returned", e.blocks.n_used()));
        }
    }
    // Seeded draws: the same tokens step by step and chained.
    let params = SamplerParams {
        temperature: 1.5,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: Some(seed),
        ..SamplerParams::default()
    };
    let mut drawn = [Vec::new(), Vec::new()];
    for (chained, out) in drawn.iter_mut().enumerate() {
        let mut sampler = Sampler::new(params.clone());
        let mut seq = Sequence::default();
        prefill(&mut e, &mut seq)?;
        if chained == 1 {
            *out = e.decode_chained(&mut seq, first, steps, &mut sampler, |_| true)?;
        } else {
            let (mut next, mut rows) = (first, kestrel_model::SamplingBatch::default());
            while out.len() < steps && seq.tokens.len() < ctx {
                rows.clear();
                sampler.push_row(&mut rows, &seq.tokens);
                e.decode_sampled(std::slice::from_mut(&mut seq), &[next], &rows, &mut ids)?;
                next = ids[0];
                out.push(next);
            }
        }
        e.release(&mut seq);
    }
    if drawn[0] != drawn[1] {
        differing.push(format!(
            "drawn: chained {:?}, step by step {:?}",
            drawn[1], drawn[0]
        ));
    } else if drawn[0] == all {
        differing.push("drawn: the draws never left the argmax".into());
    }
    Ok(ChainReport {
        arch,
        ty: ty.to_string(),
        ids: all.len(),
        differing,
        replays: replays.load(std::sync::atomic::Ordering::Relaxed) - before,
    })
}

/// Batched decode with CUDA graphs against decode without them: `seqs` sequences (prompts
/// of 1-7 tokens, evaluated together), then `steps` decode steps of one token a sequence
/// (teacher-forced, all logits read back); every logit must be bit-identical. Decode steps
/// of more than 32 sequences go through cuBLAS, recorded into the step's graph.
/// `replays` counts the graph engine's replays during the decode steps only.
pub fn compare_graph_replay_batched(
    arch: Arch,
    ty: &str,
    seqs: usize,
    steps: usize,
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<GraphReport> {
    let file = tiny_model(arch, ty, seed)?;
    let (with, without) = graph_pair(ordinal)?;
    let replays = with.replay_counter();
    let opts = batched_options(seqs);
    let mut a = Engine::new(with, file.clone(), &opts)?;
    let mut b = Engine::new(without, file.clone(), &opts)?;
    let inputs = BatchedInputs::new(a.config().vocab_size, seqs, steps, seed);
    let (la, replays) = inputs.decode(&mut a, &replays)?;
    let (lb, _) = inputs.decode(&mut b, &replays_unused())?;
    Ok(inputs.report(arch, ty, replays, &la, &lb))
}

/// [`compare_graph_replay_batched`] tensor parallel over `ordinals`, on [`tp_model`]: the
/// batch decoded by one group replaying graphs (each rank its steps' parts, all-reduces and
/// cuBLAS products inside), then by the same group launching every kernel (the same
/// all-reduce choices). `replays` counts rank 0's replays of a step's first part.
pub fn compare_tp_graph_replay_batched(
    arch: Arch,
    ty: &str,
    seqs: usize,
    steps: usize,
    seed: u64,
    ordinals: &[usize],
) -> anyhow::Result<GraphReport> {
    let file = tp_model(arch, ty, seed)?;
    let tp = kestrel_cuda::TpBackend::new(ordinals)?;
    let set_graphs = |tp: &kestrel_cuda::TpBackend, on: bool| {
        for r in 0..tp.ranks() {
            tp.rank(r).set_graphs(on);
        }
    };
    set_graphs(&tp, true);
    let replays = tp.rank(0).replay_counter();
    let mut engine = Engine::new(tp, file.clone(), &batched_options(seqs))?;
    let inputs = BatchedInputs::new(engine.config().vocab_size, seqs, steps, seed);
    let (la, replays) = inputs.decode(&mut engine, &replays)?;
    set_graphs(&engine.backend, false);
    let (lb, _) = inputs.decode(&mut engine, &replays_unused())?;
    Ok(inputs.report(arch, ty, replays, &la, &lb))
}

/// Engine options of the batched graph checks: room for `seqs` sequences.
fn batched_options(seqs: usize) -> EngineOptions {
    EngineOptions {
        max_seqs: seqs + 1,
        ..options(256)
    }
}

/// A counter no backend advances (for a run whose replays are not counted).
fn replays_unused() -> Arc<std::sync::atomic::AtomicU64> {
    Arc::default()
}

/// The batched graph checks' tokens: each sequence's prompt length (1-7) and its prompt
/// followed by one token for each decode step.
struct BatchedInputs {
    lens: Vec<usize>,
    tokens: Vec<Vec<u32>>,
    steps: usize,
}

impl BatchedInputs {
    fn new(vocab: usize, seqs: usize, steps: usize, seed: u64) -> BatchedInputs {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x64b7);
        let vocab = vocab as u32;
        let lens: Vec<usize> = (0..seqs).map(|_| rng.random_range(1..8)).collect();
        let tokens = lens
            .iter()
            .map(|&n| (0..n + steps).map(|_| rng.random_range(0..vocab)).collect())
            .collect();
        BatchedInputs {
            lens,
            tokens,
            steps,
        }
    }

    /// The report of `graphs` (logit rows decoded replaying graphs, `replays` of them)
    /// against `eager` (the same decoded launch by launch): every row there and bit-identical.
    fn report(
        &self,
        arch: Arch,
        ty: &str,
        replays: u64,
        graphs: &[Vec<f32>],
        eager: &[Vec<f32>],
    ) -> GraphReport {
        GraphReport {
            arch,
            ty: ty.to_string(),
            steps: self.steps,
            replays,
            identical: graphs.len() == self.lens.len() * (self.steps + 1)
                && bit_identical_rows(graphs, eager),
        }
    }

    /// The prompts evaluated together, then the decode steps (teacher-forced); every logit
    /// row, and how far `replays` advanced during the decode steps. The sequences are
    /// released at the end.
    fn decode<B: kestrel_model::Backend>(
        &self,
        engine: &mut Engine<B>,
        replays: &std::sync::atomic::AtomicU64,
    ) -> anyhow::Result<(Vec<Vec<f32>>, u64)> {
        let relaxed = std::sync::atomic::Ordering::Relaxed;
        let mut out = Vec::new();
        let mut state = vec![Sequence::default(); self.lens.len()];
        let heads: Vec<&[u32]> = (self.tokens.iter().zip(&self.lens))
            .map(|(t, &n)| &t[..n])
            .collect();
        engine.eval_batch(&mut state, &heads, false, |_, _, row| {
            out.push(row.to_vec())
        })?;
        let before = replays.load(relaxed);
        for t in 0..self.steps {
            let step: Vec<&[u32]> = (self.tokens.iter().zip(&self.lens))
                .map(|(p, &n)| &p[n + t..n + t + 1])
                .collect();
            engine.eval_batch(&mut state, &step, false, |_, _, row| out.push(row.to_vec()))?;
        }
        let replayed = replays.load(relaxed) - before;
        for s in &mut state {
            engine.release(s);
        }
        Ok((out, replayed))
    }
}

/// On-device greedy sampling (`argmax_rows`) against the argmax of the logits read back,
/// for a prompt-sized step (eager) and a decode-sized one run three times (recorded into
/// a CUDA graph, then replayed). Returns (rows compared, rows that differ).
pub fn compare_argmax(
    arch: Arch,
    ty: &str,
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<(usize, usize)> {
    let file = tiny_model(arch, ty, seed)?;
    argmax_against_logits(cuda_engine(&file, ordinal)?, seed)
}

/// [`compare_argmax`] under tensor parallelism: the greedy ids merged from each GPU's best
/// of its vocabulary share against the argmax of the gathered logits.
pub fn compare_tp_argmax(
    arch: Arch,
    ty: &str,
    seed: u64,
    ordinals: &[usize],
) -> anyhow::Result<(usize, usize)> {
    let file = tp_model(arch, ty, seed)?;
    argmax_against_logits(tp_engine(&file, ordinals)?, seed)
}

fn argmax_against_logits<B: kestrel_model::Backend>(
    mut gpu: Engine<B>,
    seed: u64,
) -> anyhow::Result<(usize, usize)> {
    let vocab = gpu.config().vocab_size;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0xa7a7);
    let n = 40;
    let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab as u32)).collect();
    let mut table = Vec::new();
    gpu.blocks.ensure(&mut table, n)?;
    let batch_of = |from: usize| Batch {
        tokens: tokens[from..].to_vec(),
        positions: (from as u32..n as u32).collect(),
        seq_of: vec![0; n - from],
        seqs: vec![SeqSlot {
            block_table: table.clone(),
            kv_len: n,
        }],
        logit_rows: (0..(n - from) as u32).collect(),
        invariant: false,
        ..Batch::default()
    };
    let (mut compared, mut differ) = (0, 0);
    let mut logits = Vec::new();
    let mut ids = Vec::new();
    for (from, repeats) in [(0, 1), (n - 4, 3)] {
        let batch = batch_of(from);
        gpu.step_into(&batch, &mut logits)?;
        for _ in 0..repeats {
            gpu.step_argmax(&batch, &mut ids)?;
            anyhow::ensure!(
                ids.len() == n - from,
                "{} ids for {} rows",
                ids.len(),
                n - from
            );
            for (row, &id) in logits.chunks_exact(vocab).zip(&ids) {
                compared += 1;
                differ += usize::from(kestrel_model::argmax(row) != id);
            }
        }
    }
    gpu.blocks.release(&mut table);
    Ok((compared, differ))
}

/// Greedy ids taken share by share and merged (`argmax_rows_in_shares`, tensor
/// parallelism's LM head on one GPU) against `argmax_rows` over whole rows, on fresh random
/// rows: vocabularies of 1 to 151,936 words in 1 to 4 shares (empty and one-word shares
/// too), the row's best value repeated across share boundaries, NaN, ±inf and all-NaN rows.
/// Returns (rows compared, rows that differ).
pub fn compare_argmax_shares(backend: &CudaBackend, seed: u64) -> anyhow::Result<(usize, usize)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5a5e);
    let (mut compared, mut differ) = (0, 0);
    let (mut whole, mut shared) = (Vec::new(), Vec::new());
    let mut scratch = Vec::new();
    for &cols in &[1usize, 2, 7, 33, 1000, 32_000, 151_936] {
        for &n in &[1usize, 5, 64] {
            let mut rows = vec![0f32; n * cols];
            for (r, row) in rows.chunks_exact_mut(cols).enumerate() {
                for v in row.iter_mut() {
                    *v = rng.random_range(-8.0f32..8.0);
                }
                let best = rng.random_range(0..cols);
                let top = 9.0 + rng.random_range(0..3) as f32;
                match r % 6 {
                    // The best value again later in the row (often in another share).
                    0 | 1 => {
                        row[best] = top;
                        row[rng.random_range(best..cols)] = top;
                    }
                    2 => row[best] = f32::NAN,
                    3 => row.fill(f32::NAN),
                    4 => {
                        row.fill(f32::NEG_INFINITY);
                        row[rng.random_range(0..cols)] = f32::NAN;
                    }
                    _ => row[best] = f32::INFINITY,
                }
            }
            let x = backend.upload_tensor(n, cols, &rows)?;
            // 1 to 4 shares at random cuts (empty shares allowed).
            let k = rng.random_range(1..=4usize);
            let mut cuts: Vec<usize> = (0..k - 1).map(|_| rng.random_range(0..=cols)).collect();
            cuts.sort_unstable();
            let mut shares = Vec::with_capacity(k);
            let mut start = 0;
            for c in cuts.into_iter().chain([cols]) {
                shares.push(start..c);
                start = c;
            }
            kestrel_model::Backend::argmax_rows(backend, &x, n, &mut scratch, &mut whole)?;
            backend.argmax_rows_in_shares(&x, n, &shares, &mut shared)?;
            anyhow::ensure!(
                whole.len() == n && shared.len() == n,
                "{} and {} ids for {n} rows",
                whole.len(),
                shared.len()
            );
            compared += n;
            differ += whole.iter().zip(&shared).filter(|(a, b)| a != b).count();
        }
    }
    Ok((compared, differ))
}

/// Result of [`compare_sampling`].
#[derive(Debug, Clone, Default)]
pub struct SamplingReport {
    pub rows: usize,
    /// Rows where the device drew another token than the host, but one the host draws too
    /// when the draw or top-p moves by 1e-6 (rounding at the edge of an interval).
    pub edge: usize,
    /// Rows where the device drew a token the host would not.
    pub wrong: usize,
    /// The first wrong row, described.
    pub first_wrong: Option<String>,
}

impl SamplingReport {
    /// No wrong row, and edge cases at most 1% of the rows.
    pub fn passed(&self) -> bool {
        self.wrong == 0 && self.edge * 100 <= self.rows
    }
}

/// `sample_rows` on the device against the host's definition ([`kestrel_model::sampling`])
/// on fresh random rows: vocabularies from 1 to 151,936 words, ties, NaN and ±inf logits,
/// every filter and the penalties, in batches of 1 to 64 rows. With `masks`, token masks
/// too (vocabularies mostly not multiples of 32): rows without one mixed with rows
/// allowing one token, a few, half, or all but the best, and greedy-only batches. With
/// `busy`, each batch is sampled while the stream still runs ~10 ms of queued work (as a
/// step's forward pass runs when its masks go up): on a fresh backend, the masks' first
/// buffers and each growth are then allocated behind that work.
pub fn compare_sampling(
    backend: &CudaBackend,
    seed: u64,
    masks: bool,
    busy: bool,
) -> anyhow::Result<SamplingReport> {
    use kestrel_model::Backend;
    use kestrel_model::sampling::{NO_MASK, RowSampler, RowSampling, SamplingBatch};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut report = SamplingReport::default();
    // (rows, vocabulary, greedy rows only)
    let shapes: &[(usize, usize, bool)] = if masks {
        &[
            (5, 1, false),
            (8, 7, true),
            (8, 100, false),
            (16, 1001, false),
            (8, 5003, true),
            (4, 32_001, false),
            (64, 151_936, true),
            (64, 151_936, false),
            (8, 262_145, false),
        ]
    } else {
        &[
            (5, 1, false),
            (8, 7, false),
            (8, 100, false),
            (16, 1000, false),
            (8, 5003, false),
            (4, 32_000, false),
            (64, 128_256, false),
            (8, 151_936, false),
        ]
    };
    let mut host = RowSampler::default();
    // The queued work: adds over 256 MiB tensors (~0.25 ms each on an H100).
    let mut work = if busy {
        let (rows, cols) = (4096, 16_384);
        Some((
            backend.new_tensor(rows, cols)?,
            backend.new_tensor(rows, cols)?,
        ))
    } else {
        None
    };
    for &(rows, cols, greedy_only) in shapes {
        let mut logits: Vec<f32> = Vec::with_capacity(rows * cols);
        for r in 0..rows {
            let scale = [1.0f32, 4.0, 12.0][r % 3];
            let start = logits.len();
            logits.extend((0..cols).map(|_| rng.random_range(-scale..scale)));
            let row = &mut logits[start..];
            match r % 8 {
                1 => row.iter_mut().for_each(|l| *l = (*l * 2.0).round() / 2.0), // ties
                2 => {
                    for _ in 0..3 {
                        row[rng.random_range(0..cols)] = f32::NAN;
                        row[rng.random_range(0..cols)] = f32::NEG_INFINITY;
                    }
                }
                3 if r % 16 == 3 => row[rng.random_range(0..cols)] = f32::INFINITY,
                _ => {}
            }
        }
        let mut batch = SamplingBatch::default();
        for _ in 0..rows {
            let penalised = rng.random_range(0..3) == 0;
            let spec = RowSampling {
                temperature: if greedy_only {
                    0.0
                } else {
                    [0.0, 0.5, 1.0, 1.5][rng.random_range(0..4)]
                },
                top_k: [0, 1, 40, 1000, cols as u32][rng.random_range(0..5)],
                top_p: [1.0, 0.95, 0.5][rng.random_range(0..3)],
                min_p: [0.0, 0.05][rng.random_range(0..2)],
                repeat_penalty: if penalised { 1.3 } else { 1.0 },
                presence_penalty: if penalised { 0.5 } else { 0.0 },
                frequency_penalty: if penalised { 0.2 } else { 0.0 },
                u: rng.random(),
                penalty_start: 0,
                penalty_len: 0,
            };
            let window: Vec<u32> = if penalised {
                (0..64)
                    .map(|_| rng.random_range(0..cols as u32 + 8)) // some beyond the vocabulary
                    .collect()
            } else {
                Vec::new()
            };
            batch.push(spec, &window);
        }
        if masks {
            let words = cols.div_ceil(32);
            batch.mask_words = words;
            for (r, row) in logits.chunks_exact(cols).enumerate() {
                let kind = (r + rng.random_range(0..2)) % 6;
                if kind == 0 {
                    batch.mask_of.push(NO_MASK);
                    continue;
                }
                batch.mask_of.push((batch.masks.len() / words) as u32);
                let mut m = vec![0u32; words];
                let mut allow = |t: usize| m[t / 32] |= 1 << (t % 32);
                match kind {
                    // all but one banned
                    1 => allow(rng.random_range(0..cols)),
                    // a few (a grammar's digits), some at the vocabulary's end
                    2 => {
                        for _ in 0..12 {
                            allow(rng.random_range(0..cols));
                        }
                        allow(cols - 1);
                    }
                    // about half
                    3 => (0..cols).filter(|_| rng.random_bool(0.5)).for_each(allow),
                    // all but the best token
                    4 => {
                        let best = kestrel_model::argmax(row) as usize;
                        (0..cols).filter(|&t| t != best).for_each(allow);
                    }
                    // everything (bits past the vocabulary set too)
                    _ => m.iter_mut().for_each(|w| *w = u32::MAX),
                }
                batch.masks.extend_from_slice(&m);
            }
        }
        let mut want = Vec::new();
        batch.sample_host(&logits, rows, &mut want);
        let tensor = backend.upload_tensor(rows, cols, &logits)?;
        let (mut got, mut scratch) = (Vec::new(), Vec::new());
        if let Some((x, y)) = work.as_mut() {
            for _ in 0..40 {
                backend.add(x, y, 4096);
            }
        }
        backend.sample_rows(&tensor, rows, &batch, &mut scratch, &mut got)?;
        anyhow::ensure!(got.len() == rows, "{} ids for {rows} rows", got.len());
        for (r, row) in logits.chunks_exact(cols).enumerate() {
            report.rows += 1;
            if got[r] == want[r] {
                continue;
            }
            let Some((spec, pens)) = batch.row(r) else {
                anyhow::bail!("no sampling row {r}");
            };
            let nudged = [(1e-6, 0.0), (-1e-6, 0.0), (0.0, 1e-6), (0.0, -1e-6)]
                .iter()
                .any(|&(du, dp)| {
                    let s = RowSampling {
                        u: (spec.u + du).clamp(0.0, 1.0 - f64::EPSILON),
                        top_p: spec.top_p + dp as f32,
                        ..*spec
                    };
                    host.sample_masked(row, &s, pens, batch.mask(r)) == got[r]
                });
            if nudged {
                report.edge += 1;
            } else {
                report.wrong += 1;
                report.first_wrong.get_or_insert_with(|| {
                    format!(
                        "{cols} words, row {r}: device {} host {} ({spec:?}, mask {:?})",
                        got[r],
                        want[r],
                        batch.mask_of.get(r)
                    )
                });
            }
        }
    }
    Ok(report)
}

/// Result of [`compare_invariant`] and [`compare_tp_invariant`].
#[derive(Debug, Clone)]
pub struct InvariantReport {
    pub arch: Arch,
    pub ty: String,
    /// Logit rows compared (tokens of the batch-invariant steps).
    pub rows: usize,
    /// Rows with any logit not bit-identical to the single-token step's, and the largest
    /// |Δ| among them.
    pub differing: usize,
    pub max_abs_diff: f32,
    /// Greedy ids of speculative generation (prompt lookup) and of plain generation, and
    /// the drafts that were verified.
    pub spec: Vec<u32>,
    pub plain: Vec<u32>,
    pub drafted: usize,
    /// With a draft model (the same file on one GPU): its greedy ids and drafts verified.
    pub with_draft: Option<(Vec<u32>, usize)>,
}

impl InvariantReport {
    pub fn passed(&self) -> bool {
        self.rows > 0
            && self.differing == 0
            && self.spec == self.plain
            && self.drafted > 0
            && self
                .with_draft
                .as_ref()
                .is_none_or(|(ids, drafted)| *ids == self.plain && *drafted > 0)
    }

    /// "ids equal, N drafted" or what differed, for a report line.
    pub fn ids_summary(&self) -> String {
        let mut s = format!(
            "prompt lookup ids {}, {} drafted",
            if self.spec == self.plain {
                "equal"
            } else {
                "DIFFER"
            },
            self.drafted
        );
        if let Some((ids, drafted)) = &self.with_draft {
            let same = if *ids == self.plain {
                "equal"
            } else {
                "DIFFER"
            };
            s += &format!("; draft model ids {same}, {drafted} drafted");
        }
        s
    }
}

/// Batch-invariant steps (speculative verification) on the GPU: after a random prompt,
/// steps of 8, 5 and 2 tokens evaluated as one invariant step each must give every token's
/// logits bit for bit as single-token steps over the same tokens do (the first step's
/// positions cross a power of two, where attention's split count changes); then greedy
/// generation with prompt lookup must give the ids plain generation gives.
pub fn compare_invariant(
    arch: Arch,
    ty: &str,
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<InvariantReport> {
    let file = tiny_model(arch, ty, seed)?;
    let mut gpu = cuda_engine(&file, ordinal)?;
    invariant_report(arch, ty, &mut gpu, seed, None)
}

/// [`compare_invariant`] on a tensor-parallel engine over `ordinals`, plus greedy
/// generation with a draft model (the same file on `ordinals[0]` alone, as `--draft` runs
/// beside `--tp`): its ids must equal plain generation's too.
pub fn compare_tp_invariant(
    arch: Arch,
    ty: &str,
    seed: u64,
    ordinals: &[usize],
) -> anyhow::Result<InvariantReport> {
    let file = tp_model(arch, ty, seed)?;
    let mut tp = tp_engine(&file, ordinals)?;
    let draft = cuda_engine(&file, ordinals[0])?;
    let drafter = kestrel_engine::spec::DraftModel::new(draft, &file, &file)?;
    invariant_report(arch, ty, &mut tp, seed, Some(Box::new(drafter)))
}

/// [`compare_tp_invariant`] under a layer split over `ordinals` (the draft model alone on
/// the first stage's GPU).
pub fn compare_split_invariant(
    arch: Arch,
    ty: &str,
    seed: u64,
    ordinals: &[usize],
) -> anyhow::Result<InvariantReport> {
    let file = split_model(arch, ty, seed)?;
    let mut split = split_engine(&file, ordinals)?;
    let draft = cuda_engine(&file, ordinals[0])?;
    let drafter = kestrel_engine::spec::DraftModel::new(draft, &file, &file)?;
    invariant_report(arch, ty, &mut split, seed, Some(Box::new(drafter)))
}

fn invariant_report<B: kestrel_model::Backend>(
    arch: Arch,
    ty: &str,
    gpu: &mut Engine<B>,
    seed: u64,
    draft_model: Option<Box<dyn kestrel_engine::spec::Drafter + '_>>,
) -> anyhow::Result<InvariantReport> {
    let vocab = gpu.config().vocab_size as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5bd1);
    let mut random =
        |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(0..vocab)).collect() };
    let prompt = random(29);
    let steps = [random(8), random(5), random(2)];

    let mut one = Sequence::default();
    let mut together = Sequence::default();
    gpu.eval(&mut one, &prompt, false, |_, _| {})?;
    gpu.eval(&mut together, &prompt, false, |_, _| {})?;
    let (mut rows, mut differing, mut max_abs_diff) = (0, 0, 0.0f32);
    for tokens in &steps {
        let mut alone = Vec::new();
        for &t in tokens {
            gpu.eval(&mut one, &[t], false, |_, l| alone.push(l.to_vec()))?;
        }
        let mut batched = Vec::new();
        gpu.eval_invariant(&mut together, tokens, |_, l| batched.push(l.to_vec()))?;
        anyhow::ensure!(
            batched.len() == alone.len(),
            "{} rows for {}",
            batched.len(),
            alone.len()
        );
        for (a, b) in alone.iter().zip(&batched) {
            rows += 1;
            let d = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0f32, f32::max);
            let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            if !same {
                differing += 1;
                max_abs_diff = max_abs_diff.max(d);
            }
        }
    }
    gpu.release(&mut one);
    gpu.release(&mut together);

    // A prompt that repeats itself, so prompt lookup drafts; greedy either way.
    let mut prompt = random(24);
    prompt.extend_from_within(..20);
    let params = kestrel_engine::sampler::SamplerParams::greedy();
    let mut generate = |spec: Option<&mut kestrel_engine::spec::Speculator>| {
        let mut seq = Sequence::default();
        let out =
            gpu.generate_speculative(&mut seq, &prompt, &params, 48, |_| false, |_| true, spec);
        gpu.release(&mut seq);
        out
    };
    let (plain, _) = generate(None)?;
    let drafter = kestrel_engine::spec::NgramDrafter::new(1, 4)?;
    let mut lookup = kestrel_engine::spec::Speculator::new(Box::new(drafter), 1, 7);
    let (fast, stats) = generate(Some(&mut lookup))?;
    let with_draft = match draft_model {
        Some(drafter) => {
            let mut spec = kestrel_engine::spec::Speculator::new(drafter, 1, 7);
            let (ids, stats) = generate(Some(&mut spec))?;
            Some((ids, stats.drafted))
        }
        None => None,
    };
    Ok(InvariantReport {
        arch,
        ty: ty.to_string(),
        rows,
        differing,
        max_abs_diff,
        spec: fast,
        plain,
        drafted: stats.drafted,
        with_draft,
    })
}

/// The cache storage types (keys, values) the CUDA attention reads besides f16/f16: both
/// quantized, and each alone (a launch mixing an f16 and a quantized tensor).
pub const CACHE_TYPES: [(KvType, KvType); 4] = [
    (KvType::Q8_0, KvType::Q8_0),
    (KvType::F16, KvType::Q8_0),
    (KvType::Q8_0, KvType::F16),
    (KvType::Q4_0, KvType::Q4_0),
];

/// The cache types of the attention check against f64 ([`compare_attention_cache`]):
/// f16 (the existing kernels, as a control), q8_0, fp8 (the CPU has no fp8: this is its
/// only oracle) and mixed pairs.
pub const ATTN_CACHE_TYPES: [(KvType, KvType); 7] = [
    (KvType::F16, KvType::F16),
    (KvType::Q8_0, KvType::Q8_0),
    (KvType::Fp8, KvType::Fp8),
    (KvType::Q4_0, KvType::Q4_0),
    (KvType::Fp8, KvType::F16),
    (KvType::Q8_0, KvType::Fp8),
    (KvType::Q4_0, KvType::Q8_0),
];

/// A long cache for the attention check: the decode steps split it 64 ways (ranges of 33
/// keys, so the tiled kernels' 16-key chunks end inside a split), not a multiple of a block.
pub const ATTN_LONG_POSITIONS: usize = 2_085;

/// A cache whose last decode step's 64 splits leave the last one empty (2,049 keys in
/// ranges of 33): the merge of the splits must weigh an empty partial as nothing.
pub const ATTN_EMPTY_SPLIT_POSITIONS: usize = 2_049;

/// Deep caches of the attention check (f16 and q8_0) ((query heads, kv heads, head size), cached
/// positions): steps of 1 and 5 tokens at the end split them (128-dim heads: at most 256
/// blocks; 64-dim: 512) into ranges of many 16-key chunks a warp, so the tiled kernels' ring
/// of stages wraps, at odd lengths. Group 1: 8 splits of 376 keys, then one split of all
/// 3,001 (the output written directly); group 4: 32 splits of 94, then 4 of 751; group 8 at
/// both head sizes: 64 splits of 193, then 32 of 386 (64-dim: 64); group 2 of 64-dim heads:
/// 64 splits of 313 (the 4-stage q8_0 ring wraps), then 32 of 626.
pub const ATTN_DEEP: [((usize, usize, usize), usize); 5] = [
    ((32, 32, 128), 3_001),
    ((32, 8, 128), 3_001),
    ((8, 1, 128), 12_345),
    ((8, 1, 64), 12_345),
    ((4, 2, 64), 20_011),
];

/// E4M3's value of code `c` (0x7f and 0xff are NaN and never written).
pub fn e4m3_value(c: u8) -> f64 {
    let e = i32::from((c >> 3) & 15);
    let m = f64::from(c & 7);
    let a = if e == 0 {
        m / 8.0 * 2f64.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f64.powi(e - 7)
    };
    if c & 0x80 != 0 { -a } else { a }
}

/// The E4M3 code nearest `x` (saturating at ±448; on a tie the even code), found by
/// searching all codes: the reference of the GPU's bit-twiddling encoder.
pub fn e4m3_nearest(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = f64::from(x.abs()).min(448.0);
    let mut best = 0u8;
    for c in 1..=0x7eu8 {
        let (d, db) = ((e4m3_value(c) - a).abs(), (e4m3_value(best) - a).abs());
        if d < db || (d == db && c % 2 == 0) {
            best = c;
        }
    }
    sign | best
}

/// `x` (whole 32-value blocks) as the GPU stores fp8 K/V, in the CPU layout of
/// [`CudaBackend::read_cache_layer`]: per block the f16 scale `amax / 448`, then the 32
/// codes of `x · (448 / amax)` (f32 arithmetic, as the kernel).
pub fn quantize_fp8_blocks(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(32).zip(out.chunks_exact_mut(34)) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let id = if amax != 0.0 { 448.0 / amax } else { 0.0 };
        let d = half::f16::from_f32(amax / 448.0);
        ob[..2].copy_from_slice(&d.to_bits().to_le_bytes());
        for (o, &v) in ob[2..].iter_mut().zip(xb) {
            *o = e4m3_nearest(v * id);
        }
    }
}

/// Values of one row stored as `t` in the CPU layout (f16, or blocks of an f16 scale and
/// 32 Q8_0 / fp8 quants or 16 bytes of Q4_0 nibbles), in f64.
fn dequantize_row(t: KvType, bytes: &[u8], out: &mut Vec<f64>) -> anyhow::Result<()> {
    out.clear();
    let f16 = |b: &[u8]| f64::from(half::f16::from_le_bytes([b[0], b[1]]).to_f32());
    match t {
        KvType::F16 => out.extend(bytes.chunks_exact(2).map(f16)),
        KvType::Q8_0 | KvType::Fp8 => {
            for blk in bytes.chunks_exact(34) {
                let d = f16(&blk[..2]);
                out.extend(blk[2..].iter().map(|&q| {
                    d * if t == KvType::Q8_0 {
                        f64::from(q as i8)
                    } else {
                        e4m3_value(q)
                    }
                }));
            }
        }
        KvType::Q4_0 => {
            for blk in bytes.chunks_exact(18) {
                let d = f16(&blk[..2]);
                let q = |j: usize| f64::from(blk[2 + (j & 15)] >> (4 * (j >> 4)) & 15) - 8.0;
                out.extend((0..32).map(|j| d * q(j)));
            }
        }
        other => anyhow::bail!("no CUDA cache layout for {other}"),
    }
    Ok(())
}

/// The GPU's attention over a cache of one type pair against f64 attention over the very
/// values that cache holds (read back and dequantized here), so only the kernels' own
/// arithmetic is measured.
#[derive(Debug, Clone)]
pub struct AttnReport {
    pub kv: KvTypes,
    pub heads: (usize, usize, usize),
    /// Cached positions, and the step sizes checked at its end.
    pub positions: usize,
    pub steps: Vec<usize>,
    /// Largest |Δ| of the decode steps (1 and 5 tokens), and of the prompt chunks (40, and
    /// 133 in the sinks check of long enough caches).
    pub max_abs_diff: f64,
    pub chunk_abs_diff: f64,
    pub max_abs_out: f64,
    pub non_finite: usize,
}

/// Largest |Δ| of the quantized caches' kernels (f32 arithmetic, or on the tensor cores
/// with the exact quants in f16 and q and p split into f16 and remainder: sums of a few
/// hundred terms and `expf`, ~1e-5), relative to max(1, max |output|); a wrong offset,
/// scale or kind is off by the size of the output itself.
pub const MAX_ATTN_REL_DIFF: f64 = 1e-3;
/// The same for the f16 cache (the control), and for prompt chunks on the tensor cores
/// (keys and values both f16, or both quantized: dequantized into f16 tiles): the queries,
/// the probabilities (and quantized values) rounded to f16 (11 bits, ~5e-4 each).
pub const MAX_ATTN_REL_DIFF_F16: f64 = 5e-3;

impl AttnReport {
    pub fn passed(&self) -> bool {
        let f16 = self.kv == KvTypes::default();
        let decode = if f16 {
            MAX_ATTN_REL_DIFF_F16
        } else {
            MAX_ATTN_REL_DIFF
        };
        let chunk = if (self.kv.k == KvType::F16) == (self.kv.v == KvType::F16) {
            MAX_ATTN_REL_DIFF_F16
        } else {
            MAX_ATTN_REL_DIFF
        };
        let out = self.max_abs_out.max(1.0);
        self.non_finite == 0
            && self.max_abs_out > 0.0
            && self.max_abs_diff <= decode * out
            && self.chunk_abs_diff <= chunk * out
    }
}

/// Stores `positions` random key and value rows of one sequence (shuffled block table)
/// through `store_kv` into a GPU cache of types `kv`, then runs `Backend::attention` for
/// steps of 1, 5 and 40 tokens at the sequence's end (split decode, multi-token decode,
/// a prompt chunk) with random queries, and compares each output with f64 causal attention
/// over the stored values read back from the GPU. `heads` = (query heads, kv heads, head
/// size).
pub fn compare_attention_cache(
    backend: &CudaBackend,
    heads: (usize, usize, usize),
    kv: KvTypes,
    positions: usize,
    seed: u64,
) -> anyhow::Result<AttnReport> {
    attention_against_f64(backend, heads, kv, positions, seed, None)
}

/// [`compare_attention_cache`] for gpt-oss's attention (`Backend::attention_sinks`): a
/// random logit per query head (of the scores' order) joins each softmax's denominator, over
/// a sliding window of `window` positions (None: all). Prompt chunks (40 tokens, and 133
/// from 173 positions) take the tensor-core prefill kernels where the cache allows.
pub fn compare_attention_sinks(
    backend: &CudaBackend,
    heads: (usize, usize, usize),
    kv: KvTypes,
    positions: usize,
    window: Option<usize>,
    seed: u64,
) -> anyhow::Result<AttnReport> {
    attention_against_f64(backend, heads, kv, positions, seed, Some(window))
}

/// `sinks`: None for plain attention; Some(window) for attention with sinks over that window.
fn attention_against_f64(
    backend: &CudaBackend,
    heads: (usize, usize, usize),
    kv: KvTypes,
    positions: usize,
    seed: u64,
    sinks: Option<Option<usize>>,
) -> anyhow::Result<AttnReport> {
    use kestrel_model::{AttnParams, Backend, ModelConfig};
    let file = tiny_model_heads(Arch::Llama, "f16", seed, heads)?;
    let cfg = ModelConfig::from_gguf(&file)?;
    let (n_head, n_head_kv, hd) = heads;
    let kv_dim = cfg.kv_dim();
    // Decode steps of 1 and 5 tokens, and a prompt chunk (the prefill kernels); with sinks
    // and enough positions also a chunk of two 64-token tiles and a part, whose rows see
    // window edges inside tiles.
    const CHUNK: usize = 40;
    const LONG_CHUNK: usize = 133;
    let mut steps = vec![1usize, 5, CHUNK];
    if sinks.is_some() && positions >= LONG_CHUNK + CHUNK {
        steps.push(LONG_CHUNK);
    }
    anyhow::ensure!(positions >= 40, "at least 40 positions");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0xa77e);
    let n_blocks = positions.div_ceil(16) + 2;
    let mut cache = backend.new_cache_typed(&cfg, n_blocks, 16, kv)?;
    let mut table: Vec<u32> = (0..n_blocks as u32).collect();
    for i in (1..table.len()).rev() {
        table.swap(i, rng.random_range(0..=i));
    }
    table.truncate(positions.div_ceil(16));
    let rows = |n: usize, rng: &mut rand::rngs::StdRng| -> Vec<f32> {
        (0..n * kv_dim / 32)
            .flat_map(|_| {
                let scale = rng.random_range(0.1f32..3.0);
                (0..32)
                    .map(|_| rng.random_range(-scale..scale))
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let k = rows(positions, &mut rng);
    let v = rows(positions, &mut rng);
    let mut step = backend.new_step(&cfg, positions)?;
    let mut batch = Batch::default();
    batch.push_part(0, &vec![0u32; positions], 0, &table, 0);
    backend.prepare_step(&batch, &mut step)?;
    let kt = backend.upload_tensor(positions, kv_dim, &k)?;
    let vt = backend.upload_tensor(positions, kv_dim, &v)?;
    backend.store_kv(&mut cache, 0, &kt, &vt, &step, positions);
    let (gk, gv) = backend.read_cache_layer(&cache, 0)?;
    let (kb, vb) = (kv.k.bytes(kv_dim), kv.v.bytes(kv_dim));
    // The stored keys and values of every position, dequantized (position-major).
    let (mut kf, mut vf) = (Vec::new(), Vec::new());
    let mut row = Vec::new();
    for pos in 0..positions {
        let slot = table[pos / 16] as usize * 16 + pos % 16;
        dequantize_row(kv.k, &gk[slot * kb..(slot + 1) * kb], &mut row)?;
        kf.extend_from_slice(&row);
        dequantize_row(kv.v, &gv[slot * vb..(slot + 1) * vb], &mut row)?;
        vf.extend_from_slice(&row);
    }
    let p = AttnParams {
        layer: 0,
        n_head,
        n_head_kv,
        head_dim: hd,
        scale: 1.0 / (hd as f32).sqrt(),
        window: sinks.flatten(),
    };
    let sink_logits: Vec<f32> = (0..n_head)
        .map(|_| rng.random_range(-3.0f32..3.0))
        .collect();
    let sink_weight = match sinks {
        Some(_) => {
            let bytes: Vec<u8> = sink_logits.iter().flat_map(|v| v.to_le_bytes()).collect();
            Some(backend.load_weight_bytes(&kestrel_cuda::WeightSource {
                name: "blk.0.attn_sinks.weight",
                ty: GgmlType::F32,
                dims: &[n_head as u64],
                data: &bytes,
                gathered_only: false,
                shape_of: &|_| None,
            })?)
        }
        None => None,
    };
    let mut report = AttnReport {
        kv,
        heads,
        positions,
        steps: steps.clone(),
        max_abs_diff: 0.0,
        chunk_abs_diff: 0.0,
        max_abs_out: 0.0,
        non_finite: 0,
    };
    let width = n_head * hd;
    for &n in &steps {
        let start = positions - n;
        let mut batch = Batch::default();
        batch.push_part(0, &vec![0u32; n], start, &table, 0);
        backend.prepare_step(&batch, &mut step)?;
        let q: Vec<f32> = (0..n * width)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let qt = backend.upload_tensor(n, width, &q)?;
        let mut out = backend.upload_tensor(n, width, &vec![f32::NAN; n * width])?;
        match &sink_weight {
            Some(w) => backend.attention_sinks(&qt, &cache, &p, w, &step, n, &mut out)?,
            None => {
                backend.attention(&qt, &cache, &p, &step, n, &mut out);
            }
        }
        let mut got = Vec::new();
        backend.read_rows(&out, n, &mut got)?;
        for i in 0..n {
            let pos = start + i;
            for h in 0..n_head {
                let g = h / (n_head / n_head_kv);
                let qh = &q[i * width + h * hd..i * width + (h + 1) * hd];
                let lo = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
                let scores: Vec<f64> = (lo..=pos)
                    .map(|t| {
                        let kr = &kf[t * kv_dim + g * hd..t * kv_dim + (g + 1) * hd];
                        qh.iter()
                            .zip(kr)
                            .map(|(&a, &b)| f64::from(a) * b)
                            .sum::<f64>()
                            * f64::from(p.scale)
                    })
                    .collect();
                let sink = sink_weight.as_ref().map(|_| f64::from(sink_logits[h]));
                let max = scores
                    .iter()
                    .copied()
                    .chain(sink)
                    .fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = w.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - max).exp());
                for d in 0..hd {
                    let want: f64 = w
                        .iter()
                        .enumerate()
                        .map(|(t, wt)| wt * vf[(lo + t) * kv_dim + g * hd + d])
                        .sum::<f64>()
                        / sum;
                    let have = got[i * width + h * hd + d];
                    if !have.is_finite() {
                        report.non_finite += 1;
                        continue;
                    }
                    let diff = (want - f64::from(have)).abs();
                    if n >= CHUNK {
                        report.chunk_abs_diff = report.chunk_abs_diff.max(diff);
                    } else {
                        report.max_abs_diff = report.max_abs_diff.max(diff);
                    }
                    report.max_abs_out = report.max_abs_out.max(want.abs());
                }
            }
        }
    }
    Ok(report)
}

/// `store_kv` on the GPU into a cache of `kv`'s types against the CPU backend's quantizer
/// (fp8: [`quantize_fp8_blocks`]).
#[derive(Debug, Clone)]
pub struct StoreReport {
    pub kv: KvTypes,
    pub kv_dim: usize,
    pub tokens: usize,
    /// Bytes of every written slot's key and value rows (CPU layout) compared.
    pub bytes: usize,
    /// Bytes that differ. The GPU quantizes with the same IEEE operations as the CPU
    /// (`amax`, `127 / amax` as f32, `x · id` rounded half to even, the scale `amax / 127`
    /// rounded to f16; fp8 likewise with 448 and the nearest E4M3 code), so the rows must
    /// be identical.
    pub differing: usize,
    /// The first differing (token, keys or values, byte in its row), if any.
    pub first: Option<(usize, &'static str, usize)>,
}

impl StoreReport {
    pub fn passed(&self) -> bool {
        self.differing == 0 && self.bytes > 0
    }
}

/// Writes `n` random key and value rows (`heads` = (query heads, kv heads, head size)) at
/// scattered positions of one sequence (a shuffled block table, positions not from 0)
/// through `Backend::store_kv` into a GPU cache of types `kv`, reads the written slots back
/// in the CPU's layout and compares them byte for byte with
/// `kestrel_cpu::numerics::quantize_like_ggml` (what the CPU backend stores) of the same
/// rows. The rows mix scales (1e-3 to 1e2), all-zero blocks and blocks with a single
/// non-zero value, where rounding ties and the zero scale show.
pub fn compare_store_kv(
    backend: &CudaBackend,
    heads: (usize, usize, usize),
    kv: KvTypes,
    n: usize,
    seed: u64,
) -> anyhow::Result<StoreReport> {
    use kestrel_model::{Backend, ModelConfig};
    let file = tiny_model_heads(Arch::Llama, "f16", seed, heads)?;
    let cfg = ModelConfig::from_gguf(&file)?;
    let kv_dim = cfg.kv_dim();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x570e);
    let start = rng.random_range(0..40);
    let n_blocks = (start + n).div_ceil(16) + 3;
    let mut cache = backend.new_cache_typed(&cfg, n_blocks, 16, kv)?;
    let mut table: Vec<u32> = (0..n_blocks as u32).collect();
    for i in (1..table.len()).rev() {
        table.swap(i, rng.random_range(0..=i));
    }
    table.truncate((start + n).div_ceil(16));
    let row = |rng: &mut rand::rngs::StdRng| -> Vec<f32> {
        let mut x = Vec::with_capacity(kv_dim);
        for _ in 0..kv_dim / 32 {
            let scale = 10f32.powf(rng.random_range(-3.0..2.0));
            match rng.random_range(0..8) {
                0 => x.extend([0.0; 32]),
                1 => {
                    let at = rng.random_range(0..32);
                    x.extend((0..32).map(|j| if j == at { -scale } else { 0.0 }));
                }
                _ => x.extend((0..32).map(|_| rng.random_range(-scale..scale))),
            }
        }
        x
    };
    let k: Vec<f32> = (0..n).flat_map(|_| row(&mut rng)).collect();
    let v: Vec<f32> = (0..n).flat_map(|_| row(&mut rng)).collect();
    let mut batch = Batch::default();
    let tokens = vec![0u32; n];
    batch.push_part(0, &tokens, start, &table, 0);
    let mut step = backend.new_step(&cfg, n)?;
    backend.prepare_step(&batch, &mut step)?;
    let kt = backend.upload_tensor(n, kv_dim, &k)?;
    let vt = backend.upload_tensor(n, kv_dim, &v)?;
    backend.store_kv(&mut cache, 0, &kt, &vt, &step, n);
    let (gk, gv) = backend.read_cache_layer(&cache, 0)?;
    let mut report = StoreReport {
        kv,
        kv_dim,
        tokens: n,
        bytes: 0,
        differing: 0,
        first: None,
    };
    for (what, t, src, got) in [("keys", kv.k, &k, &gk), ("values", kv.v, &v, &gv)] {
        let row_bytes = t.bytes(kv_dim);
        let mut want = vec![0u8; row_bytes];
        for i in 0..n {
            let pos = start + i;
            let slot = table[pos / 16] as usize * 16 + pos % 16;
            let x = &src[i * kv_dim..(i + 1) * kv_dim];
            match t.ggml() {
                Some(g) => anyhow::ensure!(
                    kestrel_cpu::numerics::quantize_like_ggml(g, x, &mut want),
                    "the CPU quantizer refused a row of {kv_dim} values as {t}"
                ),
                // fp8: no CPU type; the reference quantizer here.
                None => quantize_fp8_blocks(x, &mut want),
            }
            let have = &got[slot * row_bytes..(slot + 1) * row_bytes];
            report.bytes += row_bytes;
            for (b, (x, y)) in want.iter().zip(have).enumerate() {
                if x != y {
                    report.differing += 1;
                    report.first.get_or_insert((i, what, b));
                }
            }
        }
    }
    Ok(report)
}

/// [`compare_logits_heads`] with both engines' caches stored as `kv`: the CPU (f32
/// activations) stores its keys and values with the quantizer [`compare_store_kv`] checks
/// the GPU's against, so the two caches differ only where a key or value computed on the
/// GPU lands on the other side of a rounding boundary; every step shape goes through the
/// GPU's `_q` attention kernels (decode steps, 40- and 100-token chunks in 64-token split
/// launches). Same bound as the f16 check (GPU on f32 activations), but for 4-bit caches
/// that of a one-sided 8-bit rounding (`MAX_REL_DIFF_Q8`): where a key or value computed
/// on the GPU crosses a rounding boundary, a Q4_0 block moves it by a sixteenth of its
/// range, not Q8_0's 1/255 (H100, 2026-11-26: q4_0 caches 1.1% and 1.3% of the largest
/// logit, q8_0 and fp8 within 1%).
pub fn compare_logits_cache(
    arch: Arch,
    ty: &str,
    heads: (usize, usize, usize),
    kv: KvTypes,
    n: usize,
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<LogitReport> {
    let file = tiny_model_heads(arch, ty, seed, heads)?;
    let cpu_backend = CpuBackend::with_numerics(Kernels::Fast, Numerics::F32);
    let mut cpu = Engine::with_cache_types(cpu_backend, file.clone(), &options(256), kv)?;
    let mut gpu = Engine::with_cache_types(CudaBackend::new(ordinal)?, file, &options(100), kv)?;
    gpu.backend.set_q8_decode(false);
    let vocab = cpu.config().vocab_size as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5eed);
    let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab)).collect();
    let a = all_logits(&mut cpu, &tokens)?;
    let b = all_logits_in_parts(&mut gpu, &tokens, &ATTN_PARTS)?;
    anyhow::ensure!(
        a.len() == n && b.len() == n,
        "expected {n} rows of logits, got {} (cpu) and {} (cuda)",
        a.len(),
        b.len()
    );
    let mut report = logit_report(arch, &format!("{ty} kv {}/{}", kv.k, kv.v), &a, &b);
    report.q8 = [kv.k, kv.v].contains(&KvType::Q4_0);
    Ok(report)
}

#[cfg(test)]
mod tests {
    /// The TP checks' models split over 2 GPUs (so `gpu-check --tp 2` finds no refusal):
    /// every dense architecture, mixture of experts and hybrid in each type the checks use
    /// (and f16); qwen3moe's experts 512 and 256 wide on the two ranks, gpt-oss's 416 each,
    /// and each rank's shard of every expert tensor cut in whole blocks with the rank's
    /// width; every tensor of a hybrid cut (its v-head columns of `ssm_out` whole blocks),
    /// each rank 2 of the 4 q/k heads and 4 of the 8 v heads, a shared expert 256 wide.
    #[test]
    fn tp_models_split_over_two_gpus() {
        use kestrel_model::shard::{Split, TpPlan, shard_bytes};
        for arch in TP_ARCHS.iter().chain(&TP_MOE_ARCHS).chain(&TP_HYBRID_ARCHS) {
            for ty in tp_types(*arch).iter().chain(&["f16"]) {
                let file = tp_model(*arch, ty, 3).unwrap();
                let cfg = kestrel_model::ModelConfig::from_gguf(&file).unwrap();
                let plan = TpPlan::new(&cfg, 2).unwrap_or_else(|e| panic!("{arch:?} {ty}: {e:#}"));
                if cfg.has_recurrent_layers() {
                    let mut split = 0;
                    for t in file.tensors() {
                        for r in 0..2 {
                            let s = plan.split(&t.name, r);
                            split += usize::from(s != Split::Replicated);
                            shard_bytes(t.ty, &t.dims, file.tensor_data(t), &s)
                                .unwrap_or_else(|e| panic!("{} {ty} rank {r}: {e:#}", t.name));
                        }
                    }
                    assert!(split > 0);
                    for r in 0..2 {
                        let d = plan.delta_config(r).unwrap();
                        assert_eq!((d.n_k_heads, d.n_v_heads, d.head_v_dim), (2, 4, 128));
                    }
                    if let kestrel_model::FfnKind::Moe(m) = cfg.ffn {
                        assert_eq!(m.shared_expert, Some(512));
                        assert_eq!(plan.shexp, vec![0..256, 256..512]);
                    }
                    continue;
                }
                let kestrel_model::FfnKind::Moe(m) = cfg.ffn else {
                    continue;
                };
                let (ff, used, split) = match arch {
                    Arch::GptOss => (832, 4, 416),
                    _ => (768, 8, 512),
                };
                assert_eq!(plan.ff, vec![0..split, split..ff], "{ty}");
                assert_eq!((m.n_expert, m.n_expert_used, m.n_ff_exp), (32, used, ff));
                let mut experts = 0;
                for t in file.tensors() {
                    if !t.name.contains("_exps.weight") {
                        continue;
                    }
                    experts += 1;
                    for r in 0..2 {
                        let split = plan.split(&t.name, r);
                        assert_ne!(split, Split::Replicated, "{}", t.name);
                        let (dims, bytes) = shard_bytes(t.ty, &t.dims, file.tensor_data(t), &split)
                            .unwrap_or_else(|e| panic!("{} {ty} rank {r}: {e:#}", t.name));
                        let w = plan.ff[r].len() as u64;
                        let want = if t.name.contains("down") {
                            [w, t.dims[1], t.dims[2]]
                        } else {
                            [t.dims[0], w, t.dims[2]]
                        };
                        assert_eq!(dims, want, "{}", t.name);
                        assert_eq!(
                            bytes.len() as u64 * ff as u64,
                            t.n_bytes() * w,
                            "{}",
                            t.name
                        );
                    }
                }
                assert_eq!(experts, 3 * cfg.n_layer, "{ty}");
            }
        }
    }

    /// The CPU's 8-bit spread is measured (rounding changes the logits, by less than they
    /// are large) and is the larger on the models with wider weights.
    #[test]
    fn cpu_q8_spread_is_measured_and_grows_with_the_weights() {
        let spread = |arch, ty| {
            let file = tiny_model(arch, ty, 7).unwrap();
            let mut cpu = cpu_engine(&file).unwrap();
            let mut rng = rand::rngs::StdRng::seed_from_u64(11);
            let tokens: Vec<u32> = (0..150).map(|_| rng.random_range(0..512)).collect();
            let a = all_logits(&mut cpu, &tokens).unwrap();
            let max = a.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
            let s = cpu_q8_spread(&file, &tokens, &a).unwrap();
            eprintln!(
                "{arch:?} {ty}: 8-bit spread {s:.3e} of {max:.3e} ({:.2}%)",
                100.0 * s / max
            );
            assert!(
                s.is_finite() && s > 0.0 && s < max,
                "{arch:?} {ty}: {s} of {max}"
            );
            s / max
        };
        let phi3 = spread(Arch::Phi3, "iq4_xs");
        let llama = spread(Arch::Llama, "iq4_xs");
        spread(Arch::Phi3, "q4_k_m");
        spread(Arch::Mistral3, "iq4_nl");
        assert!(phi3 > llama, "phi3 {phi3} vs llama {llama}");
    }

    /// f16 weights: llama.cpp's rounding (the matmul inputs to f16) moves the logits, less
    /// than 8-bit activations do on the same random weights, and a report of f16 operands
    /// takes 1.5 × that spread as its bound only where it exceeds the fixed one.
    #[test]
    fn f16_operand_spread_is_measured_and_bounds_f16_reports() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
        let seed: u64 = rng.random();
        let tokens: Vec<u32> = (0..120).map(|_| rng.random_range(0..512)).collect();
        let spread = |ty| {
            let file = tiny_model(Arch::Qwen35, ty, seed).unwrap();
            let mut cpu = cpu_engine(&file).unwrap();
            let a = all_logits(&mut cpu, &tokens).unwrap();
            (cpu_q8_spread(&file, &tokens, &a).unwrap(), a)
        };
        let (f16, a) = spread("f16");
        let (q8, _) = spread("q8_0");
        assert!(
            f16 > 0.0 && f16 < q8,
            "seed {seed}: f16 spread {f16}, q8_0 {q8}"
        );
        let mut r = logit_report(Arch::Qwen35, "f16", &a, &a);
        let fixed = r.max_abs_bound();
        r.q8_spread = 2.0 * fixed;
        assert_eq!(r.max_abs_bound(), fixed, "no f16 operands: the fixed bound");
        r.f16_operands = true;
        assert_eq!(r.max_abs_bound(), Q8_SPREAD_FACTOR * 2.0 * fixed);
        r.q8_spread = 0.1 * fixed;
        assert_eq!(
            r.max_abs_bound(),
            fixed,
            "a small spread keeps the fixed bound"
        );
    }

    use super::*;

    /// kernels/attention.cu's `f32_to_e4m3`, transcribed, to check its bit arithmetic
    /// against the search over all codes.
    fn e4m3_like_the_kernel(x: f32) -> u8 {
        let sign = ((x.to_bits() >> 24) & 0x80) as u8;
        let a = x.abs().min(448.0);
        if a < 0.015625 {
            return sign | (a * 512.0).round_ties_even() as u8;
        }
        let mut b = a.to_bits();
        b += 0x7ffff + ((b >> 20) & 1);
        let e = (b >> 23) as i32 - 127;
        sign | (((e + 7) << 3) as u8 | ((b >> 20) & 7) as u8)
    }

    #[test]
    fn e4m3_codes_round_trip_and_the_kernel_encoder_agrees() {
        for c in (0..=0xffu8).filter(|c| c & 0x7f != 0x7f) {
            let x = e4m3_value(c) as f32;
            let want = if c == 0x80 { 0x80 } else { c };
            assert_eq!(e4m3_nearest(x), want, "code {c:#x} = {x}");
            assert_eq!(e4m3_like_the_kernel(x), want, "code {c:#x} = {x}");
        }
        assert_eq!(e4m3_nearest(1e9), 0x7e);
        assert_eq!(e4m3_nearest(-500.0), 0xfe);
        // Halfway between 1 (0x38) and 1.125 (0x39): the even code.
        assert_eq!(e4m3_nearest(1.0625), 0x38);
        assert_eq!(e4m3_nearest(1.1875), 0x3a);
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for _ in 0..200_000 {
            let x = rng.random_range(-1.0f32..1.0) * 2f32.powi(rng.random_range(-12..10));
            assert_eq!(e4m3_like_the_kernel(x), e4m3_nearest(x), "{x:e}");
        }
        // Midpoints exactly: every tie between neighbouring codes.
        for c in 0..0x7du8 {
            let mid = ((e4m3_value(c) + e4m3_value(c + 1)) / 2.0) as f32;
            assert_eq!(e4m3_like_the_kernel(mid), e4m3_nearest(mid), "{mid:e}");
            assert_eq!(e4m3_nearest(mid) % 2, 0, "{mid:e}");
        }
    }

    /// The f64 reference's decoder of the CPU-layout rows against kestrel-quant's.
    #[test]
    fn the_reference_decodes_ggml_rows_as_kestrel_quant() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(13);
        for t in [KvType::F16, KvType::Q8_0, KvType::Q4_0] {
            let g = t.ggml().unwrap();
            let x: Vec<f32> = (0..128).map(|_| rng.random_range(-3.0f32..3.0)).collect();
            let mut bytes = vec![0u8; t.bytes(128)];
            kestrel_quant::quantize_row(g, &x, &mut bytes).unwrap();
            let mut want = vec![0f32; 128];
            kestrel_quant::dequantize_row(g, &bytes, &mut want).unwrap();
            let mut got = Vec::new();
            dequantize_row(t, &bytes, &mut got).unwrap();
            for (a, b) in want.iter().zip(&got) {
                assert!(
                    (f64::from(*a) - b).abs() <= 1e-6 * b.abs().max(1.0),
                    "{t}: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn fp8_blocks_dequantize_within_half_a_step() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(12);
        for _ in 0..200 {
            let scale = 10f32.powf(rng.random_range(-1.0..2.0));
            let x: Vec<f32> = (0..64).map(|_| rng.random_range(-scale..scale)).collect();
            let mut bytes = vec![0u8; 68];
            quantize_fp8_blocks(&x, &mut bytes);
            let mut back = Vec::new();
            dequantize_row(KvType::Fp8, &bytes, &mut back).unwrap();
            for (b, xb) in back.chunks(32).zip(x.chunks(32)) {
                let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
                for (&y, &v) in b.iter().zip(xb) {
                    // 3 mantissa bits: half a step is 1/16 of the value, plus the f16 scale's
                    // rounding (2^-11) and the subnormal step (2^-10 of amax / 448).
                    let err = (y - v as f64).abs();
                    let bound =
                        (v.abs() as f64) * (1.0 / 16.0 + 1e-3) + amax / 448.0 * 2f64.powi(-9);
                    assert!(err <= bound, "{v} -> {y} (amax {amax})");
                }
            }
        }
    }
}
/// Teacher-forced logits of `n` random tokens (drawn from `seed`) on `engine`, a backend
/// over several GPUs, against the CPU oracle and against one GPU (`ordinal`) running the
/// whole model, in the parts of [`PARTS`]: the two reports (both sides of the second on
/// 8-bit decode activations) and whether the logits equal one GPU's bit for bit. Both
/// reports carry the model's own spread under 8-bit rounding ([`cpu_q8_spread`]), as the
/// one-GPU checks of 8-bit runs do: Phi-3's and Mistral 3's weights amplify each rounding
/// past the fixed bound (H200, 2026-11-27, TP=2 of the 512-wide models: 0.198 and 0.229
/// from the CPU against a fixed 0.139 and 0.145, while within 0.083 of one GPU).
#[allow(clippy::too_many_arguments)]
fn against_cpu_and_one_gpu<B: kestrel_model::Backend>(
    arch: Arch,
    ty: &str,
    file: &Arc<GgufFile>,
    engine: &mut Engine<B>,
    ordinal: usize,
    n: usize,
    seed: u64,
    what: &str,
) -> anyhow::Result<(LogitReport, LogitReport, bool)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let vocab = file
        .tensor("token_embd.weight")
        .map_or(1, |t| t.dims[1] as u32);
    let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab)).collect();
    let cpu = all_logits(&mut cpu_engine(file)?, &tokens)?;
    let one = all_logits_in_parts(&mut cuda_engine(file, ordinal)?, &tokens, &PARTS)?;
    let many = all_logits_in_parts(engine, &tokens, &PARTS)?;
    anyhow::ensure!(
        cpu.len() == n && one.len() == n && many.len() == n,
        "expected {n} rows of logits, got {} (cpu), {} (one GPU), {} ({what})",
        cpu.len(),
        one.len(),
        many.len()
    );
    let mut vs_cpu = logit_report(arch, ty, &cpu, &many);
    vs_cpu.q8 = true;
    vs_cpu.q8_spread = cpu_q8_spread(file, &tokens, &cpu)?;
    let mut vs_one_gpu = logit_report(arch, ty, &one, &many);
    vs_one_gpu.q8 = true;
    vs_one_gpu.q8_reference = true;
    vs_one_gpu.q8_spread = vs_cpu.q8_spread;
    Ok((vs_cpu, vs_one_gpu, one == many))
}

// ---- tensor parallelism ----

/// The tiny model reshaped so that it splits over 2 GPUs with whole quantization blocks
/// (8 query heads and 2 KV heads of 64 values, feed-forward 1,024): each rank's share of
/// the attention output's and down projection's rows is 256 values. A mixture of experts
/// gets Qwen3-30B-A3B's expert width 768 (ranks of 512 and 256, as the 30B splits) and 32
/// experts of which each token uses 8. gpt-oss gets gpt-oss-20b's 32 experts of which
/// each token uses 4, 832 wide: 416 a rank, 13 blocks of 32, 256 + 160 values as its real
/// 1440 = 5·256 + 160 a rank (a width not whole 256s, cut in 32-value granules). Phi-3's,
/// Mistral 3's and gpt-oss's weights, at 1.3 / sqrt(256) in the tiny models, are scaled to
/// 1.3 / sqrt(512) here, so that each product keeps its input's scale as there. A hybrid's linear-attention layers get 4 q/k heads
/// and 8 v heads of 128 (the real models' head size; each rank 2 q/k heads, so that its
/// `ssm_out` columns are whole 256-value blocks even where Qwen3.5 interleaves the v
/// heads), its shared expert a width of 512 (256 a rank).
pub fn tp_model(arch: Arch, ty: &str, seed: u64) -> anyhow::Result<Arc<GgufFile>> {
    let mut cfg = SynthConfig::tiny(arch);
    cfg.n_embd = 512;
    cfg.n_head = 8;
    cfg.n_head_kv = 2;
    cfg.head_dim = 64;
    cfg.n_ff = 1024;
    if cfg.n_expert > 0 {
        cfg.n_expert = 32;
        cfg.n_expert_used = 8;
        cfg.n_ff_exp = 768;
    }
    if arch == Arch::GptOss {
        cfg.n_expert_used = 4;
        cfg.n_ff_exp = 832;
    }
    if matches!(arch, Arch::Phi3 | Arch::Mistral3 | Arch::GptOss) {
        cfg.weight_std *= std::f32::consts::FRAC_1_SQRT_2;
    }
    if let Some(h) = cfg.hybrid.as_mut() {
        (h.n_group, h.n_v_heads, h.d_state) = (4, 8, 128);
        if h.n_ff_shexp > 0 {
            h.n_ff_shexp = 512;
        }
    }
    model_of(cfg, ty, seed)
}

/// A tensor-parallel engine over `ordinals`, evaluating in the same awkward chunks as
/// [`cuda_engine`].
fn tp_engine(
    file: &Arc<GgufFile>,
    ordinals: &[usize],
) -> anyhow::Result<Engine<kestrel_cuda::TpBackend>> {
    Engine::new(
        kestrel_cuda::TpBackend::new(ordinals)?,
        file.clone(),
        &options(100),
    )
}

/// Tensor parallelism checked twice on the same tokens: against the CPU oracle (f32
/// activations: [`MAX_REL_DIFF_Q8`], as one GPU's check) and against one GPU running the
/// whole model ([`MAX_REL_DIFF_Q8_BOTH`]: both on 8-bit decode activations, summed in
/// other orders).
#[derive(Debug, Clone)]
pub struct TpReport {
    pub vs_cpu: LogitReport,
    pub vs_one_gpu: LogitReport,
}

impl TpReport {
    pub fn passed(&self) -> bool {
        self.vs_cpu.passed() && self.vs_one_gpu.passed()
    }
}

/// Teacher-forced logits of `n` random tokens: tensor parallel over `ordinals` against the
/// CPU and against one GPU (`ordinals[0]`), in the parts of [`PARTS`] (prefill chunks,
/// graph-replayed decode steps, a mix).
pub fn compare_tp_logits(
    arch: Arch,
    ty: &str,
    n: usize,
    seed: u64,
    ordinals: &[usize],
) -> anyhow::Result<TpReport> {
    let file = tp_model(arch, ty, seed)?;
    let mut engine = tp_engine(&file, ordinals)?;
    let (vs_cpu, vs_one_gpu, _) = against_cpu_and_one_gpu(
        arch,
        ty,
        &file,
        &mut engine,
        ordinals[0],
        n,
        seed ^ 0x7e9a,
        "tensor parallel",
    )?;
    Ok(TpReport { vs_cpu, vs_one_gpu })
}

/// Tensor parallelism on a mixture of experts ([`tp_model`] of a [`TP_MOE_ARCHS`]
/// architecture), against the CPU and one GPU as [`compare_tp_logits`], with the MoE
/// checks' allowance for route flips ([`compare_logits_moe`]): a token whose router logits
/// are near a tie takes another expert when its input differs in the last bits (one GPU
/// sums the block's rows in one order, the ranks' partial sums in another), which moves
/// its logits by O(1). Passes when no logit is non-finite, top-1 agreement (near-ties
/// counted) is at least [`MIN_TOP1_AGREEMENT`], and at least [`MOE_MIN_WITHIN`] of the
/// positions are within the bound, each against both references.
#[derive(Debug, Clone)]
pub struct TpMoeReport {
    pub vs_cpu: LogitReport,
    /// Share of positions whose max |Δ logit| against the CPU is within its bound.
    pub vs_cpu_within: f64,
    pub vs_one_gpu: LogitReport,
    /// The same against one GPU.
    pub vs_one_gpu_within: f64,
}

impl TpMoeReport {
    /// Both comparisons for a report line: max |Δ| against its bound, the share of
    /// positions within, top-1 agreement.
    pub fn summary(&self) -> String {
        let (c, g) = (&self.vs_cpu, &self.vs_one_gpu);
        format!(
            "vs CPU max |Δ| {:.2e} (bound {:.2e}), {:.1}% of positions within, top-1 {:.2}% with near-ties; vs 1 GPU max |Δ| {:.2e} (bound {:.2e}), {:.1}% within, top-1 {:.2}% ({:.2}% with near-ties)",
            c.max_abs_diff,
            c.max_abs_bound(),
            self.vs_cpu_within * 100.0,
            c.top1_agreement_ties * 100.0,
            g.max_abs_diff,
            g.max_abs_bound(),
            self.vs_one_gpu_within * 100.0,
            g.top1_agreement * 100.0,
            g.top1_agreement_ties * 100.0,
        )
    }

    pub fn passed(&self) -> bool {
        moe_reports_pass(&[
            (&self.vs_cpu, self.vs_cpu_within),
            (&self.vs_one_gpu, self.vs_one_gpu_within),
        ])
    }
}

/// Share of the rows of `b` whose every logit is within `bound` of `a`'s.
fn share_within(a: &[Vec<f32>], b: &[Vec<f32>], bound: f32) -> f64 {
    let ok = a
        .iter()
        .zip(b)
        .filter(|(ra, rb)| {
            ra.iter()
                .zip(rb.iter())
                .all(|(x, y)| (x - y).abs() <= bound)
        })
        .count();
    ok as f64 / a.len().max(1) as f64
}

/// Teacher-forced logits of `n` random tokens of [`tp_model`] (a mixture of experts):
/// tensor parallel over `ordinals` against the CPU oracle and against one GPU
/// (`ordinals[0]`), in the parts of [`PARTS`], every engine on its default activations
/// (8-bit decode on). Where the experts take the tensor cores (K-quants, steps past 8
/// tokens), the bound against the f32 CPU includes the model's own spread under 8-bit
/// rounding, as [`compare_logits_moe`]'s does.
pub fn compare_tp_logits_moe(
    arch: Arch,
    ty: &str,
    n: usize,
    seed: u64,
    ordinals: &[usize],
) -> anyhow::Result<TpMoeReport> {
    let file = tp_model(arch, ty, seed)?;
    let mut engine = tp_engine(&file, ordinals)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x7e9b);
    let vocab = engine.config().vocab_size as u32;
    let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab)).collect();
    let cpu = all_logits(&mut cpu_engine(&file)?, &tokens)?;
    let (one, mma) = {
        let mut gpu = cuda_engine(&file, ordinals[0])?;
        let kestrel_model::FfnKind::Moe(m) = gpu.model.config.ffn else {
            anyhow::bail!("{arch:?} has no mixture-of-experts blocks");
        };
        let mma = gpu
            .model
            .weights
            .layers
            .iter()
            .any(|l| gpu.backend.moe_on_tensor_cores(l, &m, PARTS[0]));
        (all_logits_in_parts(&mut gpu, &tokens, &PARTS)?, mma)
    };
    let many = all_logits_in_parts(&mut engine, &tokens, &PARTS)?;
    anyhow::ensure!(
        cpu.len() == n && one.len() == n && many.len() == n,
        "expected {n} rows of logits, got {} (cpu), {} (one GPU), {} (tensor parallel)",
        cpu.len(),
        one.len(),
        many.len()
    );
    let mut vs_cpu = logit_report(arch, ty, &cpu, &many);
    vs_cpu.q8 = true;
    if mma {
        vs_cpu.q8_spread = cpu_q8_spread(&file, &tokens, &cpu)?;
    }
    let mut vs_one_gpu = logit_report(arch, ty, &one, &many);
    vs_one_gpu.q8 = true;
    vs_one_gpu.q8_reference = true;
    vs_one_gpu.q8_spread = vs_cpu.q8_spread;
    Ok(TpMoeReport {
        vs_cpu_within: share_within(&cpu, &many, vs_cpu.max_abs_bound()),
        vs_one_gpu_within: share_within(&one, &many, vs_one_gpu.max_abs_bound()),
        vs_cpu,
        vs_one_gpu,
    })
}

/// Tensor parallelism on a linear-attention hybrid ([`tp_model`] of a [`TP_HYBRID_ARCHS`]
/// architecture) against the CPU and one GPU, by the one-GPU hybrid checks' criteria: f32
/// activations (8-bit on only where the experts then take the tensor cores, held to the
/// model's own spread under 8-bit rounding, as [`compare_logits_moe`] does), the strict
/// bound for qwen35 (dense feed-forward: [`LogitReport::passed`] against both), and for the
/// MoE hybrids the route-flip allowance ([`TpMoeReport::passed`]).
#[derive(Debug, Clone)]
pub struct TpHybridReport {
    pub moe: bool,
    pub report: TpMoeReport,
}

impl TpHybridReport {
    pub fn passed(&self) -> bool {
        if self.moe {
            self.report.passed()
        } else {
            self.report.vs_cpu.passed() && self.report.vs_one_gpu.passed()
        }
    }
}

/// Teacher-forced logits of `n` random tokens of [`tp_model`] (a hybrid) in the parts of
/// [`PARTS`]: tensor parallel over `ordinals` against the CPU oracle and one GPU
/// (`ordinals[0]`); see [`TpHybridReport`].
pub fn compare_tp_logits_hybrid(
    arch: Arch,
    ty: &str,
    n: usize,
    seed: u64,
    ordinals: &[usize],
) -> anyhow::Result<TpHybridReport> {
    let file = tp_model(arch, ty, seed)?;
    let mut engine = tp_engine(&file, ordinals)?;
    anyhow::ensure!(
        engine.config().has_recurrent_layers(),
        "{arch:?} has no linear-attention layers"
    );
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x7e9c);
    let vocab = engine.config().vocab_size as u32;
    let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab)).collect();
    let cpu = all_logits(&mut cpu_engine(&file)?, &tokens)?;
    let (one, mma, moe) = {
        let mut gpu = cuda_engine(&file, ordinals[0])?;
        let (mma, moe) = match gpu.model.config.ffn {
            kestrel_model::FfnKind::Moe(m) => (
                gpu.model
                    .weights
                    .layers
                    .iter()
                    .any(|l| gpu.backend.moe_on_tensor_cores(l, &m, PARTS[0])),
                true,
            ),
            kestrel_model::FfnKind::Dense => (false, false),
        };
        gpu.backend.set_q8_decode(mma);
        (all_logits_in_parts(&mut gpu, &tokens, &PARTS)?, mma, moe)
    };
    for r in 0..engine.backend.ranks() {
        engine.backend.rank(r).set_q8_decode(mma);
    }
    let many = all_logits_in_parts(&mut engine, &tokens, &PARTS)?;
    anyhow::ensure!(
        cpu.len() == n && one.len() == n && many.len() == n,
        "expected {n} rows of logits, got {} (cpu), {} (one GPU), {} (tensor parallel)",
        cpu.len(),
        one.len(),
        many.len()
    );
    // Steps past one token multiply f16 / bf16 weights with operands of their type.
    let f16 = matches!(ty, "f16" | "bf16");
    let spread = if mma || f16 {
        cpu_q8_spread(&file, &tokens, &cpu)?
    } else {
        0.0
    };
    let mut vs_cpu = logit_report(arch, ty, &cpu, &many);
    (vs_cpu.q8, vs_cpu.f16_operands, vs_cpu.q8_spread) = (mma, f16, spread);
    let mut vs_one_gpu = logit_report(arch, ty, &one, &many);
    (vs_one_gpu.q8, vs_one_gpu.q8_reference) = (mma, mma);
    (vs_one_gpu.f16_operands, vs_one_gpu.q8_spread) = (f16, spread);
    Ok(TpHybridReport {
        moe,
        report: TpMoeReport {
            vs_cpu_within: share_within(&cpu, &many, vs_cpu.max_abs_bound()),
            vs_one_gpu_within: share_within(&one, &many, vs_one_gpu.max_abs_bound()),
            vs_cpu,
            vs_one_gpu,
        },
    })
}

/// Greedy generation of `n` tokens after a random prompt, tensor parallel (through
/// `Engine::generate`: the argmax on rank 0's device) against the CPU oracle (its logits
/// tell a near-tie from a bug). A mixture of experts runs as [`compare_greedy_moe`] on one
/// GPU: one token a step (the prompt too) on f32 activations, so that a route differs from
/// the CPU's only at a near-tie of the router (a prompt taken in one multi-token step
/// rounds its products otherwise, and a route flipped there moves every later token's
/// logits by more than a near-tie).
pub fn compare_tp_greedy(
    arch: Arch,
    ty: &str,
    n: usize,
    seed: u64,
    ordinals: &[usize],
) -> anyhow::Result<GreedyReport> {
    let file = tp_model(arch, ty, seed)?;
    let moe = matches!(
        kestrel_model::ModelConfig::from_gguf(&file)?.ffn,
        kestrel_model::FfnKind::Moe(_)
    );
    let backend = kestrel_cuda::TpBackend::new(ordinals)?;
    let mut tp = Engine::new(backend, file.clone(), &options(if moe { 1 } else { 100 }))?;
    if moe {
        for r in 0..tp.backend.ranks() {
            tp.backend.rank(r).set_q8_decode(false);
        }
    }
    greedy_against_cpu(arch, ty, &file, &mut tp, n, seed ^ 0x9e38)
}

// ---- layer split ----

/// The tiny model with 5 layers, so that the stages of a split hold unequal ranges.
pub fn split_model(arch: Arch, ty: &str, seed: u64) -> anyhow::Result<Arc<GgufFile>> {
    let mut cfg = SynthConfig::tiny(arch);
    cfg.n_layer = 5;
    model_of(cfg, ty, seed)
}

/// A layer-split engine over `ordinals` (a GPU may hold several stages), evaluating in the
/// same awkward chunks as [`cuda_engine`].
fn split_engine(
    file: &Arc<GgufFile>,
    ordinals: &[usize],
) -> anyhow::Result<Engine<kestrel_cuda::SplitBackend>> {
    Engine::new(
        kestrel_cuda::SplitBackend::new(ordinals)?,
        file.clone(),
        &options(100),
    )
}

/// The layer split against one GPU running the whole model, in gpu-check's CUDA-vs-CPU
/// tolerances (both on 8-bit decode activations: [`MAX_REL_DIFF_Q8_BOTH`]); each stage runs
/// the single-GPU kernels on its layers, so the logits are expected bit-identical to one
/// GPU's (reported, not required). Against the CPU oracle for information: that is one
/// GPU's own deviation, checked by the one-GPU checks.
#[derive(Debug, Clone)]
pub struct SplitReport {
    pub vs_cpu: LogitReport,
    pub vs_one_gpu: LogitReport,
    pub bit_identical: bool,
    /// Each stage's layers.
    pub ranges: Vec<std::ops::Range<usize>>,
}

impl SplitReport {
    pub fn passed(&self) -> bool {
        self.vs_one_gpu.passed()
    }
}

/// Teacher-forced logits of `n` random tokens of [`split_model`]: layer split over
/// `ordinals` against the CPU and one GPU (`ordinals[0]`), in the parts of [`PARTS`].
pub fn compare_split_logits(
    arch: Arch,
    ty: &str,
    n: usize,
    seed: u64,
    ordinals: &[usize],
) -> anyhow::Result<SplitReport> {
    let file = split_model(arch, ty, seed)?;
    let mut engine = split_engine(&file, ordinals)?;
    let ranges = engine.backend.layer_ranges().unwrap_or_default();
    let (vs_cpu, vs_one_gpu, bit_identical) = against_cpu_and_one_gpu(
        arch,
        ty,
        &file,
        &mut engine,
        ordinals[0],
        n,
        seed ^ 0x5b17,
        "layer split",
    )?;
    Ok(SplitReport {
        vs_cpu,
        vs_one_gpu,
        bit_identical,
        ranges,
    })
}

/// Greedy generation under a layer split against one GPU and the CPU.
#[derive(Debug, Clone)]
pub struct SplitGreedyReport {
    pub one_gpu: Vec<u32>,
    pub split: Vec<u32>,
    /// The split against the CPU oracle (near-ties allowed).
    pub vs_cpu: GreedyReport,
}

impl SplitGreedyReport {
    /// The split's ids equal one GPU's (and, for f32 weights, where the GPU keeps f32
    /// activations too, the CPU's but after near-ties).
    pub fn passed(&self) -> bool {
        self.one_gpu == self.split && (self.vs_cpu.ty != "f32" || self.vs_cpu.passed())
    }
}

/// `n` greedy tokens (through `Engine::generate`, the argmax on the last stage's device)
/// after a random prompt, on one GPU and on the layer split over `ordinals`.
pub fn compare_split_greedy(
    arch: Arch,
    ty: &str,
    n: usize,
    seed: u64,
    ordinals: &[usize],
) -> anyhow::Result<SplitGreedyReport> {
    let file = split_model(arch, ty, seed)?;
    let mut one = cuda_engine(&file, ordinals[0])?;
    let prompt_seed = seed ^ 0x9e39;
    let one_gpu = greedy_against_cpu(arch, ty, &file, &mut one, n, prompt_seed)?.cuda;
    drop(one);
    let mut split = split_engine(&file, ordinals)?;
    let vs_cpu = greedy_against_cpu(arch, ty, &file, &mut split, n, prompt_seed)?;
    Ok(SplitGreedyReport {
        one_gpu,
        split: vs_cpu.cuda.clone(),
        vs_cpu,
    })
}

/// A mixture of experts (gpt-oss's attention with sinks, a hybrid's linear-attention
/// layers and their states) under a layer split against one GPU. Each stage runs the
/// one-GPU kernels on its layers (same routes, same sums, each stage the states of its own
/// layers), so every logit must be bit-identical and the greedy ids equal.
#[derive(Debug, Clone)]
pub struct SplitExactReport {
    /// Logit rows compared (teacher-forced tokens in [`PARTS`]), those not bit-identical,
    /// and their largest |Δ|.
    pub rows: usize,
    pub differing: usize,
    pub max_abs_diff: f32,
    pub ranges: Vec<std::ops::Range<usize>>,
    pub one_gpu: Vec<u32>,
    pub split: Vec<u32>,
}

impl SplitExactReport {
    pub fn passed(&self) -> bool {
        self.rows > 0 && self.differing == 0 && !self.split.is_empty() && self.split == self.one_gpu
    }
}

/// Teacher-forced logits of `tokens` (in [`PARTS`]), then `generate` greedy ids after the
/// first 8 of them.
fn logits_and_greedy<B: kestrel_model::Backend>(
    engine: &mut Engine<B>,
    tokens: &[u32],
    generate: usize,
) -> anyhow::Result<(Vec<Vec<f32>>, Vec<u32>)> {
    let logits = all_logits_in_parts(engine, tokens, &PARTS)?;
    let params = kestrel_engine::sampler::SamplerParams::greedy();
    let mut seq = Sequence::default();
    let ids = engine.generate(
        &mut seq,
        &tokens[..8],
        &params,
        generate,
        |_| false,
        |_| true,
    )?;
    engine.release(&mut seq);
    Ok((logits, ids))
}

pub fn compare_split_exact(
    arch: Arch,
    ty: &str,
    n: usize,
    generate: usize,
    seed: u64,
    ordinals: &[usize],
) -> anyhow::Result<SplitExactReport> {
    let file = split_model(arch, ty, seed)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5b18);
    let vocab = kestrel_model::ModelConfig::from_gguf(&file)?.vocab_size as u32;
    let tokens: Vec<u32> = (0..n.max(8)).map(|_| rng.random_range(0..vocab)).collect();
    let (a, one_gpu) = logits_and_greedy(&mut cuda_engine(&file, ordinals[0])?, &tokens, generate)?;
    let mut split = split_engine(&file, ordinals)?;
    let ranges = split.backend.layer_ranges().unwrap_or_default();
    let (b, split_ids) = logits_and_greedy(&mut split, &tokens, generate)?;
    let (mut rows, mut differing, mut max_abs_diff) = (0, 0, 0f32);
    for (x, y) in a.iter().zip(&b) {
        rows += 1;
        if x.len() != y.len() || x.iter().zip(y).any(|(p, q)| p.to_bits() != q.to_bits()) {
            differing += 1;
            let d = x
                .iter()
                .zip(y)
                .map(|(p, q)| (p - q).abs())
                .fold(0f32, f32::max);
            max_abs_diff = max_abs_diff.max(d);
        }
    }
    anyhow::ensure!(a.len() == b.len(), "{} rows against {}", b.len(), a.len());
    Ok(SplitExactReport {
        rows,
        differing,
        max_abs_diff,
        ranges,
        one_gpu,
        split: split_ids,
    })
}

/// Result of [`compare_moe_block`].
#[derive(Debug, Clone, Default)]
pub struct MoeBlockReport {
    /// Blocks compared (layers × step sizes) against the CPU on f32 activations, the GPU
    /// on f32 activations too.
    pub blocks: usize,
    /// Largest |Δ| of an output, relative to max(1e-3, largest |output|) of its token.
    pub max_rel_diff: f32,
    /// The same blocks run again with 8-bit activations on where the GPU takes them on the
    /// tensor cores (`moe_mms_*`, rounded as llama.cpp's CPU path rounds them), compared
    /// against the CPU with ggml's numerics.
    pub mma_blocks: usize,
    /// Their largest and mean relative |Δ| (as `max_rel_diff`), and their tokens whose
    /// largest relative |Δ| is over [`Self::MMA_TOKEN_BOUND`], of how many.
    pub max_rel_diff_mma: f32,
    pub mean_rel_diff_mma: f64,
    pub mma_tokens_off: usize,
    pub mma_tokens: usize,
    /// The same GPU outputs' mean relative |Δ| against the CPU on f32 activations: what
    /// the 8-bit rounding alone moves (the mean bound must be far below it).
    pub mean_rel_diff_mma_f32: f64,
    pub non_finite: usize,
}

impl MoeBlockReport {
    /// The bound of [`Self::max_rel_diff`]: both sides compute in f32 from the same weights
    /// and inputs, the router included (only the order of the sums differs).
    pub const LIMIT: f32 = 1e-4;
    /// Tensor-core blocks against ggml's numerics: both sides round the activations to 8
    /// bits per 256 values and sum the integer products exactly, so most outputs agree to
    /// f32 rounding, but an activation an ulp from a rounding edge (the GPU's sums and SiLU
    /// differ from the CPU's by ulps) moves its token's outputs by up to ~1e-2. The CPU
    /// against itself on inputs moved by ±1 ulp (qwen3moe 256/256 8/2 and 512/768 32/8,
    /// Q4_K_M and Q6_K, 17 and 300 tokens): max 8.9e-3, mean ≤ 7.9e-6, ≤ 3 of 300 tokens
    /// over 1e-3; the CPU on f32 activations against ggml's: max 3.4e-2, mean ~4e-3, every
    /// token over 1e-3. Bounds: the mean, the share of tokens over MMA_TOKEN_BOUND, and the
    /// largest (a misrouted or misplaced row moves by O(1)).
    pub const LIMIT_MMA_MEAN: f64 = 1e-4;
    pub const MMA_TOKEN_BOUND: f32 = 1e-3;
    pub const MMA_MAX_TOKENS_OFF: f64 = 0.05;
    pub const LIMIT_MMA_MAX: f32 = 5e-2;

    pub fn passed(&self) -> bool {
        self.blocks + self.mma_blocks > 0
            && self.non_finite == 0
            && self.max_rel_diff <= Self::LIMIT
            && self.max_rel_diff_mma <= Self::LIMIT_MMA_MAX
            && self.mean_rel_diff_mma <= Self::LIMIT_MMA_MEAN
            && self.mma_tokens_off as f64 <= Self::MMA_MAX_TOKENS_OFF * self.mma_tokens as f64
    }
}

/// (experts, experts per token) of [`compare_moe_routes`]: gpt-oss-20b's 32 / 4, Qwen3-30B's
/// 128 / 8, Qwen3-Next's 512 / 10, the most the backend takes (1,024 / 16), every expert
/// taken, and awkward counts that pad the routing kernel's sort.
pub const MOE_ROUTE_SHAPES: [(usize, usize); 10] = [
    (32, 4),
    (128, 8),
    (512, 10),
    (1024, 16),
    (5, 5),
    (3, 1),
    (60, 4),
    (257, 16),
    (700, 3),
    (33, 2),
];

/// Result of [`compare_moe_routes`].
#[derive(Debug, Clone, Default)]
pub struct MoeRouteReport {
    /// Tokens routed, and those whose expert ids (in slot order) differ from the CPU's.
    pub tokens: usize,
    pub ids_off: usize,
    /// Largest |Δ| of a weight relative to the CPU's; non-finite weights counted apart.
    pub max_rel_diff: f32,
    pub non_finite: usize,
}

impl MoeRouteReport {
    /// Both sides compare the same f32 logits (bias added by the same f32 addition), so the
    /// ids must agree exactly, ties included; the weights differ only by the two sides'
    /// `exp` (CUDA's `expf` is within 2 ulps) and the order of the f64 sum.
    pub const LIMIT: f32 = 1e-5;

    pub fn passed(&self) -> bool {
        self.tokens > 0
            && self.ids_off == 0
            && self.non_finite == 0
            && self.max_rel_diff <= Self::LIMIT
    }
}

/// The routing kernel alone (`CudaBackend::moe_route_rows`) against `kestrel_model::moe::
/// route` on random router logits of each of [`MOE_ROUTE_SHAPES`], every gating (softmax
/// over all, renormalized or not; softmax over the chosen), with and without a router bias,
/// 1, 7 and 33 tokens: some tokens' logits on a coarse grid (many exact ties, −0 beside +0)
/// and one token's all equal.
pub fn compare_moe_routes(seed: u64, ordinal: usize) -> anyhow::Result<MoeRouteReport> {
    use kestrel_model::{Gating, MoeConfig};
    let gpu = CudaBackend::new(ordinal)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x7007e);
    let mut report = MoeRouteReport::default();
    for (ne, k) in MOE_ROUTE_SHAPES {
        for (gating, norm) in [
            (Gating::Softmax, true),
            (Gating::Softmax, false),
            (Gating::TopKSoftmax, false),
        ] {
            for (n, biased) in [(1, false), (7, true), (33, false)] {
                let moe = MoeConfig {
                    n_expert: ne,
                    n_expert_used: k,
                    n_ff_exp: 1,
                    gating,
                    norm_top_k: norm,
                    clamped_swiglu: None,
                    shared_expert: None,
                };
                let mut logits = Vec::with_capacity(n * ne);
                for t in 0..n {
                    for _ in 0..ne {
                        logits.push(match t % 3 {
                            // Coarse: few distinct values, zeros of both signs.
                            1 => {
                                let v = rng.random_range(-3i32..=3) as f32 * 0.5;
                                if v == 0.0 && rng.random_bool(0.5) {
                                    -0.0
                                } else {
                                    v
                                }
                            }
                            2 if t == 2 => 0.25,
                            _ => rng.random_range(-8.0f32..8.0),
                        });
                    }
                }
                let bias: Option<Vec<f32>> =
                    biased.then(|| (0..ne).map(|_| rng.random_range(-1.0f32..1.0)).collect());
                let got = gpu.moe_route_rows(&logits, bias.as_deref(), &moe, n)?;
                let mut want = vec![(0usize, 0f32); k];
                for (t, g) in got.chunks_exact(k).enumerate() {
                    let mut l = logits[t * ne..(t + 1) * ne].to_vec();
                    if let Some(b) = &bias {
                        l.iter_mut().zip(b).for_each(|(v, b)| *v += b);
                    }
                    kestrel_model::moe::route(&moe, &l, &mut want);
                    report.tokens += 1;
                    if g.iter().zip(&want).any(|(g, w)| g.0 != w.0) {
                        report.ids_off += 1;
                    }
                    for (g, w) in g.iter().zip(&want) {
                        if !g.1.is_finite() {
                            report.non_finite += 1;
                        } else {
                            let r = (g.1 - w.1).abs() / w.1.abs().max(1e-30);
                            report.max_rel_diff = report.max_rel_diff.max(r);
                        }
                    }
                }
            }
        }
    }
    Ok(report)
}

/// A case of [`compare_moe_block_q8`]: expert formats (gate, up, down), n_embd, n_ff_exp,
/// experts, experts per token, and gpt-oss's clamped SwiGLU with router and expert biases.
#[derive(Debug, Clone, Copy)]
pub struct MoeQ8Case {
    pub types: [GgmlType; 3],
    pub d: usize,
    pub ff: usize,
    pub n_expert: usize,
    pub k: usize,
    pub gpt_oss: bool,
}

/// The 8-bit decode kernels' cases: every format they read, gate and up of different
/// formats, row lengths of odd numbers of 32- and 256-value blocks, rows longer than one
/// round of a lane's units (gate/up rows of 2,304 values of Q4_K / Q6_K and 1,056 of MXFP4;
/// down's (slot, unit) pairs a row past the units a lane has in flight: 3 × 36 K-quant
/// units, 4 × 34 Q8_0 blocks, 12 × 17 MXFP4 blocks), 1 to 16 experts a token (all of them in
/// one case), Qwen3-MoE's softmax-and-renormalize and gpt-oss's biased, clamped one.
pub const MOE_Q8_CASES: [MoeQ8Case; 10] = {
    use GgmlType::*;
    const fn c(
        types: [GgmlType; 3],
        d: usize,
        ff: usize,
        n_expert: usize,
        k: usize,
        gpt_oss: bool,
    ) -> MoeQ8Case {
        MoeQ8Case {
            types,
            d,
            ff,
            n_expert,
            k,
            gpt_oss,
        }
    }
    [
        c([Q4K, Q4K, Q6K], 768, 512, 13, 3, false),
        c([Q4K, Q4K, Q4K], 1280, 768, 20, 8, false),
        c([Q6K, Q6K, Q4K], 256, 256, 16, 16, false),
        c([Q8_0, Q8_0, Q8_0], 416, 1088, 11, 4, true),
        c([MXFP4, MXFP4, MXFP4], 352, 96, 9, 4, true),
        c([Q4_0, IQ4NL, Q4_0], 224, 64, 7, 2, false),
        c([IQ4XS, IQ4XS, IQ4XS], 512, 256, 10, 10, false),
        c([Q4K, Q4K, Q6K], 2304, 2304, 4, 3, false),
        c([Q6K, Q6K, Q4K], 2304, 2304, 4, 3, false),
        c([MXFP4, MXFP4, MXFP4], 1056, 544, 12, 12, true),
    ]
};

/// Step sizes of [`compare_moe_block_q8`] (the decode kernels' 1 to 8 tokens).
pub const MOE_Q8_STEPS: [usize; 4] = [1, 2, 5, 8];

/// The mixture-of-experts block on 8-bit activations (`moe_gate_up_q8`, `moe_down_q8`)
/// against an f64 reference on random stacked experts of `case`: the router in f64 and
/// `kestrel_model::moe::route`, each token's input rounded as the GPU rounds it
/// ([`quantize_q8_like_gpu`]), gate/up and the activation in f64, the activations rounded to
/// 8 bits again, down, the slots' weighted sum. An activation within 1e-3 of a rounding
/// boundary may round either way on the GPU (its f32 sums): the bound of each output adds
/// what that one step can move it (weight × |down| × step), so every other difference is
/// held to f32 agreement. `max_rel_diff` is the largest |Δ| beyond that allowance,
/// relative to max(1e-3, the token's largest output).
pub fn compare_moe_block_q8(
    backend: &CudaBackend,
    case: MoeQ8Case,
    seed: u64,
) -> anyhow::Result<MoeBlockReport> {
    use kestrel_model::{
        Activation, Backend, ClampedSwiglu, Gating, LayerWeights, MoeConfig, moe::route,
    };
    let MoeQ8Case {
        types,
        d,
        ff,
        n_expert: ne,
        k,
        gpt_oss,
    } = case;
    backend.set_q8_decode(true);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (router, rw) = random_matrix(backend, &mut rng, GgmlType::F32, ne, d)?;
    let (gate, gw) = random_matrix(backend, &mut rng, types[0], ne * ff, d)?;
    let (up, uw) = random_matrix(backend, &mut rng, types[1], ne * ff, d)?;
    let (down, dw) = random_matrix(backend, &mut rng, types[2], ne * d, ff)?;
    let mut random =
        |len: usize, r: f32| -> Vec<f32> { (0..len).map(|_| rng.random_range(-r..r)).collect() };
    let (rb, gb, ub, db) = if gpt_oss {
        (
            random(ne, 1.0),
            random(ne * ff, 0.5),
            random(ne * ff, 0.5),
            random(ne * d, 0.5),
        )
    } else {
        (
            vec![0.0; ne],
            vec![0.0; ne * ff],
            vec![0.0; ne * ff],
            vec![0.0; ne * d],
        )
    };
    let bias_matrix = |v: &[f32], cols: usize| -> anyhow::Result<kestrel_cuda::CudaWeight> {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        backend.upload_matrix(GgmlType::F32, ne, cols, &bytes)
    };
    // gpt-oss's expert biases (none otherwise).
    let bias = |v: &[f32], cols: usize| gpt_oss.then(|| bias_matrix(v, cols)).transpose();
    let one = || backend.upload_vector(&[1.0]);
    let layer = LayerWeights {
        attn_norm: one()?,
        attn_q: None,
        attn_k: None,
        attn_v: None,
        attn_q_bias: None,
        attn_k_bias: None,
        attn_v_bias: None,
        attn_q_norm: None,
        attn_k_norm: None,
        attn_output: None,
        delta_net: None,
        attn_output_bias: None,
        attn_sinks: None,
        post_attention_norm: None,
        ffn_norm: one()?,
        ffn_gate_inp: Some(router),
        ffn_gate: gate,
        ffn_up: up,
        ffn_down: down,
        ffn_gate_inp_bias: if gpt_oss {
            Some(backend.upload_vector(&rb)?)
        } else {
            None
        },
        ffn_gate_exps_bias: bias(&gb, ff)?,
        ffn_up_exps_bias: bias(&ub, ff)?,
        ffn_down_exps_bias: bias(&db, d)?,
        post_ffw_norm: None,
        shared_expert: None,
    };
    let clamp = ClampedSwiglu {
        alpha: 1.702,
        limit: 7.0,
    };
    let moe = MoeConfig {
        n_expert: ne,
        n_expert_used: k,
        n_ff_exp: ff,
        gating: if gpt_oss {
            Gating::TopKSoftmax
        } else {
            Gating::Softmax
        },
        norm_top_k: !gpt_oss,
        clamped_swiglu: gpt_oss.then_some(clamp),
        shared_expert: None,
    };
    let act = |g: f64, u: f64| -> f64 {
        if gpt_oss {
            let (lim, alpha) = (clamp.limit as f64, clamp.alpha as f64);
            let x = g.min(lim);
            let y = u.clamp(-lim, lim);
            x / (1.0 + (-alpha * x).exp()) * (y + 1.0)
        } else {
            g / (1.0 + (-g).exp()) * u
        }
    };
    let dot = |w: &[f32], row: usize, x: &[f32]| -> f64 {
        let len = x.len();
        w[row * len..(row + 1) * len]
            .iter()
            .zip(x)
            .map(|(&a, &b)| a as f64 * b as f64)
            .sum()
    };
    let mut report = MoeBlockReport::default();
    for n in MOE_Q8_STEPS {
        anyhow::ensure!(
            backend.moe_uses_q8(types, d, ff, n),
            "the 8-bit expert kernels do not take {types:?} with n_embd {d}, n_ff_exp {ff}"
        );
        // Inputs at the scale of a normalized hidden state (gate/up sums of a few units).
        let x: Vec<f32> = random(n * d, 0.2);
        let gx = backend.upload_tensor(n, d, &x)?;
        let mut gout = backend.upload_tensor(n, d, &vec![f32::NAN; n * d])?;
        backend.moe_ffn(&gx, &layer, &moe, Activation::Silu, n, &mut gout)?;
        let mut got = Vec::new();
        backend.read_rows(&gout, n, &mut got)?;
        for t in 0..n {
            let xt = &x[t * d..(t + 1) * d];
            let logits: Vec<f32> = (0..ne)
                .map(|e| (dot(&rw, e, xt) + rb[e] as f64) as f32)
                .collect();
            // route adds no bias: the logits above carry the router's.
            let mut sel = vec![(0usize, 0f32); k];
            route(&moe, &logits, &mut sel);
            let xq = quantize_q8_like_gpu(xt, 32);
            let mut want = vec![0f64; d];
            let mut allow = vec![0f64; d];
            for &(e, w) in &sel {
                let a: Vec<f32> = (0..ff)
                    .map(|r| {
                        let g = dot(&gw, e * ff + r, &xq) + gb[e * ff + r] as f64;
                        let u = dot(&uw, e * ff + r, &xq) + ub[e * ff + r] as f64;
                        act(g, u) as f32
                    })
                    .collect();
                let aq = quantize_q8_like_gpu(&a, 32);
                // Activations near a rounding boundary (either way on the GPU).
                let mut near = Vec::new();
                for (c, block) in a.chunks(32).enumerate() {
                    let step = block.iter().fold(0f32, |m, v| m.max(v.abs())) as f64 / 127.0;
                    for (j, &v) in block.iter().enumerate() {
                        let frac = if step > 0.0 { v as f64 / step } else { 0.0 };
                        if (frac - frac.floor() - 0.5).abs() < 1e-3 {
                            near.push((c * 32 + j, step));
                        }
                    }
                }
                for r in 0..d {
                    let row = e * d + r;
                    want[r] += w as f64 * (dot(&dw, row, &aq) + db[row] as f64);
                    for &(c, step) in &near {
                        allow[r] += (w as f64 * dw[row * ff + c] as f64 * step).abs();
                    }
                }
            }
            let out = &got[t * d..(t + 1) * d];
            let scale = want.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
            for r in 0..d {
                if !out[r].is_finite() {
                    report.non_finite += 1;
                } else {
                    let excess = ((out[r] as f64 - want[r]).abs() - allow[r]).max(0.0);
                    report.max_rel_diff = report.max_rel_diff.max((excess / scale) as f32);
                }
            }
        }
        report.blocks += 1;
    }
    Ok(report)
}

/// Step sizes of [`compare_moe_block`] (tokens, of which near-copies of one input): the
/// decode kernels (1 to 8 tokens) and the grouped ones (on the tensor cores for Q4_K /
/// Q6_K and Q8_0 / Q4_0 / IQ4_NL / MXFP4 experts); the near-copies all take the same experts, so that most experts get
/// none (64 tokens) or one expert takes most of the step (300).
pub const MOE_BLOCK_STEPS: [(usize, usize); 9] = [
    (1, 0),
    (3, 0),
    (8, 0),
    (9, 0),
    (17, 0),
    (77, 0),
    (64, 64),
    (300, 0),
    (300, 225),
];

/// (n_embd, n_ff_exp, experts, experts per token) of [`compare_moe_block_wide`]: rows of
/// several 256-value steps (768 = 3 of them, as Qwen3-30B-A3B's experts) and top-8 of 32.
pub const MOE_WIDE: (usize, usize, usize, usize) = (512, 768, 32, 8);

/// The same for gpt-oss blocks ([`compare_moe_block_wide`] with `Arch::GptOss`): rows of
/// whole 32-value blocks but not of 256-value steps (as gpt-oss-20b's 2,880: 608 = 2.375
/// steps, 352 = 1.375), top-4 of 32 as gpt-oss-20b.
pub const MOE_WIDE_GPT_OSS: (usize, usize, usize, usize) = (608, 352, 32, 4);

/// The mixture-of-experts block alone (`Backend::moe_ffn`), CPU against CUDA, on every
/// layer of the tiny model of `arch` (gpt-oss: router and expert biases, the clamped
/// SwiGLU, the softmax over the chosen logits; qwen3moe: the softmax over all, renormalized)
/// with random inputs of each of [`MOE_BLOCK_STEPS`]; then a shared expert's gate
/// (`Backend::add_sigmoid_gated`) on random rows.
pub fn compare_moe_block(
    arch: Arch,
    ty: &str,
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<MoeBlockReport> {
    compare_moe_block_on(tiny_model(arch, ty, seed)?, seed, ordinal)
}

/// [`compare_moe_block`] on blocks of the shape [`MOE_WIDE`] (Qwen3-MoE) or
/// [`MOE_WIDE_GPT_OSS`] (gpt-oss).
pub fn compare_moe_block_wide(
    arch: Arch,
    ty: &str,
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<MoeBlockReport> {
    let mut cfg = SynthConfig::tiny(arch);
    let (d, ff, ne, k) = match arch {
        Arch::GptOss => MOE_WIDE_GPT_OSS,
        _ => MOE_WIDE,
    };
    cfg.n_embd = d as u32;
    cfg.n_ff_exp = ff as u32;
    cfg.n_expert = ne as u32;
    cfg.n_expert_used = k as u32;
    compare_moe_block_on(model_of(cfg, ty, seed)?, seed, ordinal)
}

fn compare_moe_block_on(
    file: Arc<GgufFile>,
    seed: u64,
    ordinal: usize,
) -> anyhow::Result<MoeBlockReport> {
    use kestrel_model::{Backend, FfnKind, Model};
    let cpu = CpuBackend::with_numerics(Kernels::Fast, Numerics::F32);
    // The tensor-core path's oracle: 8-bit activations as ggml's CPU path rounds them.
    let cpu_q8 = CpuBackend::with_numerics(Kernels::Fast, Numerics::Ggml);
    let gpu = CudaBackend::new(ordinal)?;
    // f32 activations in the router's product too (8-bit ones move its logits by ~0.4%).
    gpu.set_q8_decode(false);
    let cm = Model::load(&cpu, file.clone()).context("loading on the CPU")?;
    let qm = Model::load(&cpu_q8, file.clone()).context("loading on the CPU")?;
    let gm = Model::load(&gpu, file).context("loading on the GPU")?;
    let FfnKind::Moe(moe) = cm.config.ffn else {
        anyhow::bail!("the model has no mixture-of-experts blocks");
    };
    let (d, act) = (cm.config.n_embd, cm.config.activation);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x30e);
    let mut report = MoeBlockReport::default();
    // Sums of the tensor-core blocks' relative |Δ| (ggml oracle), their count, and the sum
    // against the f32 oracle.
    let mut mma_sums = [0f64; 3];
    // Relative |Δ| of `got` against `want` (rows of `cols`), each to max(1e-3, the row's
    // largest |want|): (largest, sum, count, rows whose largest is over `bound`);
    // non-finite ones counted apart.
    let rel_diff = |want: &[f32], got: &[f32], cols: usize, bound: f32, non_finite: &mut usize| {
        let (mut max, mut sum, mut count, mut rows_off) = (0f32, 0f64, 0usize, 0usize);
        for (w, g) in want.chunks_exact(cols).zip(got.chunks_exact(cols)) {
            let scale = w.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
            let mut row_max = 0f32;
            for (a, b) in w.iter().zip(g) {
                if !b.is_finite() {
                    *non_finite += 1;
                } else {
                    let r = (a - b).abs() / scale;
                    row_max = row_max.max(r);
                    sum += r as f64;
                    count += 1;
                }
            }
            max = max.max(row_max);
            rows_off += usize::from(row_max > bound);
        }
        (max, sum, count, rows_off)
    };
    let run_cpu = |be: &CpuBackend,
                   layer: &kestrel_model::LayerWeights<kestrel_cpu::CpuWeight>,
                   x: &[f32],
                   n: usize|
     -> anyhow::Result<Vec<f32>> {
        let cx = kestrel_cpu::CpuTensor {
            data: x.to_vec(),
            cols: d,
        };
        let mut out = be.new_tensor(n, d)?;
        be.moe_ffn(&cx, layer, &moe, act, n, &mut out)?;
        out.data.truncate(n * d);
        Ok(out.data)
    };
    for ((cl, ql), gl) in cm
        .weights
        .layers
        .iter()
        .zip(&qm.weights.layers)
        .zip(&gm.weights.layers)
    {
        for (n, copies) in MOE_BLOCK_STEPS {
            let base: Vec<f32> = (0..d).map(|_| rng.random_range(-2.0..2.0)).collect();
            let x: Vec<f32> = (0..n * d)
                .map(|i| match i / d < copies {
                    true => base[i % d] + rng.random_range(-0.01..0.01),
                    false => rng.random_range(-2.0..2.0),
                })
                .collect();
            // The GPU on f32 activations (moe.rs's kernels), then, where the block takes
            // them, on the tensor cores with 8-bit activations on.
            let gx = gpu.upload_tensor(n, d, &x)?;
            let run_gpu = |q8: bool| -> anyhow::Result<Vec<f32>> {
                gpu.set_q8_decode(q8);
                let mut gout = gpu.upload_tensor(n, d, &vec![f32::NAN; n * d])?;
                let r = gpu.moe_ffn(&gx, gl, &moe, act, n, &mut gout);
                gpu.set_q8_decode(false);
                r?;
                let mut got = Vec::new();
                gpu.read_rows(&gout, n, &mut got)?;
                Ok(got)
            };
            let want = run_cpu(&cpu, cl, &x, n)?;
            let bound = MoeBlockReport::MMA_TOKEN_BOUND;
            let got = run_gpu(false)?;
            let (max, ..) = rel_diff(&want, &got, d, bound, &mut report.non_finite);
            report.max_rel_diff = report.max_rel_diff.max(max);
            report.blocks += 1;
            gpu.set_q8_decode(true);
            let mma = gpu.moe_on_tensor_cores(gl, &moe, n);
            gpu.set_q8_decode(false);
            if mma {
                let got = run_gpu(true)?;
                let (_, f32_sum, ..) = rel_diff(&want, &got, d, bound, &mut report.non_finite);
                let want = run_cpu(&cpu_q8, ql, &x, n)?;
                let (max, sum, count, off) = rel_diff(&want, &got, d, bound, &mut 0);
                report.max_rel_diff_mma = report.max_rel_diff_mma.max(max);
                mma_sums[0] += sum;
                mma_sums[1] += count as f64;
                mma_sums[2] += f32_sum;
                report.mma_tokens_off += off;
                report.mma_tokens += n;
                report.mma_blocks += 1;
            }
        }
    }
    if mma_sums[1] > 0.0 {
        report.mean_rel_diff_mma = mma_sums[0] / mma_sums[1];
        report.mean_rel_diff_mma_f32 = mma_sums[2] / mma_sums[1];
    }
    let mut compare = |want: &[f32], got: &[f32], cols: usize| {
        let (max, ..) = rel_diff(want, got, cols, f32::INFINITY, &mut report.non_finite);
        report.max_rel_diff = report.max_rel_diff.max(max);
    };
    // A shared expert's gate: out += y · sigmoid(x · w); the block's width, then wider
    // rows (several output groups of the kernel, rows past its registers).
    for (n, d) in [(1, d), (6, d), (33, d), (2, 2048), (3, 4133)] {
        let mut random =
            |len: usize| -> Vec<f32> { (0..len).map(|_| rng.random_range(-1.0..1.0)).collect() };
        let (x, y, o, w) = (random(n * d), random(n * d), random(n * d), random(d));
        let mut want = o.clone();
        for t in 0..n {
            let z: f32 = (0..d).map(|i| x[t * d + i] * w[i]).sum();
            let g = 1.0 / (1.0 + (-z).exp());
            for i in 0..d {
                want[t * d + i] += y[t * d + i] * g;
            }
        }
        let mut go = gpu.upload_tensor(n, d, &o)?;
        let gw = gpu.upload_vector(&w)?;
        gpu.add_sigmoid_gated(
            &mut go,
            &gpu.upload_tensor(n, d, &y)?,
            &gpu.upload_tensor(n, d, &x)?,
            &gw,
            n,
        )?;
        let mut got = Vec::new();
        gpu.read_rows(&go, n, &mut got)?;
        compare(&want, &got, d);
        report.blocks += 1;
    }
    Ok(report)
}
