//! `kestrel gpu-check`: the CUDA backend against the CPU backend on tiny synthetic models of
//! every architecture and weight type (teacher-forced logits, then greedy generations).

use std::time::Instant;

use kestrel_cuda::CudaBackend;
use kestrel_gguf::GgmlType;
use kestrel_gpu_check::{
    self as selfcheck, ARCHS, GemvReport, MAX_REL_DIFF, MIN_TOP1_AGREEMENT, Product, TYPES,
};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// GPU to check.
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Positions compared per model (teacher-forced, all logits).
    #[arg(long, default_value_t = 256)]
    pub positions: usize,
    /// Tokens generated greedily in the generation check.
    #[arg(long, default_value_t = 64)]
    pub generate: usize,
    /// Seed of the models and tokens (default: random).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Instead of the checks, time this GGUF model on the GPU: prefill of `--pp` random
    /// tokens in one step, then `--tg` single-token decode steps.
    #[arg(long)]
    pub bench: Option<std::path::PathBuf>,
    #[arg(long, default_value_t = 512)]
    pub pp: usize,
    #[arg(long, default_value_t = 128)]
    pub tg: usize,
    /// Instead of the one-GPU checks, check tensor parallelism over GPUs 0..N: NCCL's
    /// all-reduce (its sums against the host's, its latency at decode sizes), then every
    /// dense architecture's and mixture of experts' (qwen3moe, gpt-oss) logits against the
    /// CPU and one GPU, greedy generations, and decode steps of 37 and 64 sequences
    /// replayed from graphs against eager ones; then the linear-attention hybrids' (qwen35,
    /// qwen3next, qwen35moe). With `--moe`: the all-reduces and the mixtures of experts'
    /// checks only; with `--hybrids`: the all-reduces and the hybrids' only; with `--arch`:
    /// those architectures' only.
    #[arg(long, value_parser = crate::cmd::common::positive)]
    pub tp: Option<usize>,
    /// With `--tp`: only these architectures' checks (comma-separated names, e.g.
    /// `mistral3,phi3,gpt-oss`).
    #[arg(long, value_delimiter = ',', value_parser = parse_arch)]
    pub arch: Vec<kestrel_model::Arch>,
    /// `layer`: instead of the one-GPU checks, check the layer split over `--devices`
    /// (every dense architecture's logits against the CPU and one GPU, greedy ids).
    #[arg(long, value_enum)]
    pub split: Option<crate::cmd::common::SplitMode>,
    /// The stages' GPUs of `--split layer` (a GPU may be named twice).
    #[arg(long, default_value = "cuda:0,cuda:0")]
    pub devices: String,
    /// Only the linear-attention hybrids' checks (qwen35, qwen3next, qwen35moe).
    #[arg(long)]
    pub hybrids: bool,
    /// Only the checks of sampling on the device (`sample_rows`, with and without token
    /// masks; masked also behind queued work on fresh backends).
    #[arg(long)]
    pub sampling: bool,
    /// Only the mixture-of-experts checks (blocks alone, logits, greedy, verification).
    #[arg(long)]
    pub moe: bool,
    /// Only the graph-replay checks: single-token steps and batched decode steps (37 and 64
    /// sequences, their cuBLAS products in the graph) against eager launches, bit for bit.
    #[arg(long)]
    pub graphs: bool,
    /// Only the attention kernels' checks against f64 (every shape and cache type, the deep
    /// f16 and q8_0 caches) and `store_kv_q`'s bytes.
    #[arg(long)]
    pub attention: bool,
    /// Only the speculative-verification checks: products of 2..=8 tokens bit-identical to
    /// single-token ones, and batch-invariant steps' logits and greedy ids.
    #[arg(long)]
    pub verification: bool,
}

/// The run's end: an error counting the failed checks of `what`, else "all `what` checks
/// passed".
fn verdict(failures: usize, what: &str) -> anyhow::Result<()> {
    if failures > 0 {
        anyhow::bail!("{failures} {what} check(s) failed");
    }
    println!("all {what} checks passed");
    Ok(())
}

/// `gpu-check --split layer --devices LIST`.
fn check_split(args: &Args) -> anyhow::Result<()> {
    use crate::cmd::common::{Device, SplitMode};
    let Device::CudaLayers(ordinals) =
        Device::resolve_split(&args.devices, None, Some(SplitMode::Layer))?
    else {
        anyhow::bail!("--split layer takes a list of GPUs in --devices");
    };
    let seed = args.seed.unwrap_or_else(rand::random);
    println!(
        "layer split over cuda:{ordinals:?}, 5-layer models; seed {seed}; pass if vs 1 GPU within the CUDA-vs-CPU bounds (both on 8-bit activations; vs CPU shown) and greedy ids equal one GPU's"
    );
    let mut failures = 0usize;
    for (i, arch) in ARCHS.iter().enumerate() {
        for (j, ty) in ["f32", "q8_0", "q4_k_m", "f16"].iter().enumerate() {
            let s = seed.wrapping_add((i * 10 + j) as u64);
            match selfcheck::compare_split_logits(*arch, ty, args.positions, s, &ordinals) {
                Ok(r) => {
                    failures += usize::from(!r.passed());
                    println!(
                        "split {arch:?} {ty} layers {:?}: vs CPU max |Δ| {:.2e} (bound {:.2e}), top-1 {:.2}%; vs 1 GPU max |Δ| {:.2e} (bound {:.2e}), top-1 {:.2}%{}  {}",
                        r.ranges,
                        r.vs_cpu.max_abs_diff,
                        r.vs_cpu.max_abs_bound(),
                        r.vs_cpu.top1_agreement_ties * 100.0,
                        r.vs_one_gpu.max_abs_diff,
                        r.vs_one_gpu.max_abs_bound(),
                        r.vs_one_gpu.top1_agreement * 100.0,
                        if r.bit_identical {
                            ", bit-identical"
                        } else {
                            ""
                        },
                        if r.passed() { "ok" } else { "FAIL" }
                    );
                }
                Err(e) => {
                    failures += 1;
                    println!("split {arch:?} {ty}: ERROR {e:#}");
                }
            }
        }
        for ty in ["f32", "q4_k_m"] {
            let s = seed.wrapping_add(100 + i as u64);
            match selfcheck::compare_split_greedy(*arch, ty, args.generate, s, &ordinals) {
                Ok(g) => {
                    failures += usize::from(!g.passed());
                    println!(
                        "split {arch:?} {ty} greedy {} tokens: {} one GPU's; vs CPU first difference {:?}  {}",
                        g.split.len(),
                        if g.split == g.one_gpu {
                            "equal to"
                        } else {
                            "DIFFER from"
                        },
                        g.vs_cpu.first_difference,
                        if g.passed() { "ok" } else { "FAIL" }
                    );
                }
                Err(e) => {
                    failures += 1;
                    println!("split {arch:?} {ty} greedy: ERROR {e:#}");
                }
            }
        }
    }
    // Speculative verification: batch-invariant steps, prompt lookup and a draft model.
    for (i, arch) in ARCHS.iter().enumerate() {
        let s = seed.wrapping_add(400 + i as u64);
        let label = format!("split {arch:?} q4_k_m invariant");
        failures += report_invariant(
            &label,
            selfcheck::compare_split_invariant(*arch, "q4_k_m", s, &ordinals),
        );
    }
    // Chained decoding (the last stage's ids copied to the others) against step-by-step.
    let chained = [
        (kestrel_model::Arch::Llama, "q4_k_m"),
        (kestrel_model::Arch::Gemma3, "q8_0"),
        (kestrel_model::Arch::Qwen3Moe, "q4_k_m"),
    ];
    for (i, (arch, ty)) in chained.into_iter().enumerate() {
        let s = seed.wrapping_add(900 + i as u64);
        print_chain_report(
            &mut failures,
            &format!("split {arch:?} {ty} chained"),
            selfcheck::compare_split_chained(arch, ty, args.generate, s, &ordinals),
        );
    }
    // Mixtures of experts, gpt-oss's attention with sinks and the linear-attention hybrids:
    // the stages run the one-GPU kernels, so the logits must be bit-identical to one GPU's.
    let exact_cases = [
        (kestrel_model::Arch::Qwen3Moe, "q4_k_m"),
        (kestrel_model::Arch::Qwen3Moe, "q8_0"),
        (kestrel_model::Arch::GptOss, "mxfp4"),
        (kestrel_model::Arch::GptOss, "f16"),
        (kestrel_model::Arch::Qwen35, "q4_k_m"),
        (kestrel_model::Arch::Qwen35, "f16"),
        (kestrel_model::Arch::Qwen3Next, "q8_0"),
        (kestrel_model::Arch::Qwen35Moe, "q4_k_m"),
    ];
    for (i, (arch, ty)) in exact_cases.into_iter().enumerate() {
        let s = seed.wrapping_add(500 + i as u64);
        match selfcheck::compare_split_exact(arch, ty, args.positions, args.generate, s, &ordinals)
        {
            Ok(r) => {
                failures += usize::from(!r.passed());
                println!(
                    "split {arch:?} {ty} layers {:?}: {} rows, {} not bit-identical to 1 GPU (max |Δ| {:.2e}); greedy {} tokens {} one GPU's  {}",
                    r.ranges,
                    r.rows,
                    r.differing,
                    r.max_abs_diff,
                    r.split.len(),
                    if r.split == r.one_gpu {
                        "equal to"
                    } else {
                        "DIFFER from"
                    },
                    if r.passed() { "ok" } else { "FAIL" }
                );
            }
            Err(e) => {
                failures += 1;
                println!("split {arch:?} {ty}: ERROR {e:#}");
            }
        }
    }
    verdict(failures, "layer-split")
}

/// An architecture by its GGUF name.
fn parse_arch(name: &str) -> Result<kestrel_model::Arch, String> {
    kestrel_model::Arch::from_name(name).map_err(|e| format!("{e}"))
}

/// One TP greedy case (f32 weights) against the CPU; returns its failures (0 or 1).
fn tp_greedy(arch: kestrel_model::Arch, n: usize, seed: u64, ordinals: &[usize]) -> usize {
    let ranks = ordinals.len();
    match selfcheck::compare_tp_greedy(arch, "f32", n, seed, ordinals) {
        Ok(g) => {
            println!(
                "tp{ranks} {arch:?} greedy {} tokens: first difference {:?}  {}",
                g.cpu.len(),
                g.first_difference,
                if g.passed() { "ok" } else { "FAIL" }
            );
            usize::from(!g.passed())
        }
        Err(e) => {
            println!("tp{ranks} {arch:?} greedy: ERROR {e:#}");
            1
        }
    }
}

/// Prints one speculative-verification case of several GPUs; returns its failures.
fn report_invariant(label: &str, result: anyhow::Result<selfcheck::InvariantReport>) -> usize {
    match result {
        Ok(r) => {
            println!(
                "{label}: {} rows, {} differ (max |Δ| {:.2e}); {}  {}",
                r.rows,
                r.differing,
                r.max_abs_diff,
                r.ids_summary(),
                if r.passed() { "ok" } else { "FAIL" }
            );
            usize::from(!r.passed())
        }
        Err(e) => {
            println!("{label}: ERROR {e:#}");
            1
        }
    }
}

/// `gpu-check --tp N`.
fn check_tp(args: &Args, ranks: usize) -> anyhow::Result<()> {
    let seed = args.seed.unwrap_or_else(rand::random);
    let ordinals: Vec<usize> = (0..ranks).collect();
    println!(
        "{}; NCCL_NVLS_ENABLE={}; seed {seed}",
        kestrel_cuda::nccl::describe()?,
        std::env::var("NCCL_NVLS_ENABLE").unwrap_or_default()
    );
    let mut failures = 0usize;
    let sizes = [
        4,
        4100,
        8 << 10,
        16 << 10,
        32 << 10,
        64 << 10,
        256 << 10,
        1 << 20,
        2 << 20,
        kestrel_cuda::tp::ONESHOT_MAX_BYTES,
        32 << 20,
    ];
    let (chosen, timings) = kestrel_cuda::tp::all_reduce_latency(&ordinals, &sizes, 200)?;
    println!(
        "the group's all-reduces take the one-shot kernel up to {chosen} bytes (timed against NCCL when the group formed), NCCL above"
    );
    for t in timings {
        let ok = t.nccl_err <= 1e-3;
        failures += usize::from(!ok);
        let bytes = t.bytes;
        println!(
            "all-reduce of {bytes:>8} bytes: NCCL {:7.2} µs per call (back to back), {:6.1} GB/s; max |Δ| vs host sum {:.1e}  {}",
            t.nccl_us,
            bytes as f64 / t.nccl_us / 1e3,
            t.nccl_err,
            if ok { "ok" } else { "FAIL" }
        );
        if let Some((us, err, vs_nccl)) = t.oneshot {
            // Two ranks add the same two numbers either way: identical bits; more ranks
            // sum in another order than NCCL's ring.
            let ok = err <= 1e-3 && (ranks > 2 || vs_nccl == 0.0);
            failures += usize::from(!ok);
            println!(
                "all-reduce of {bytes:>8} bytes: one-shot {us:7.2} µs per call; max |Δ| vs host sum {err:.1e}, vs NCCL {vs_nccl:.1e}  {}",
                if ok { "ok" } else { "FAIL" }
            );
        }
    }
    // `--moe`: the mixtures of experts only; `--hybrids`: the linear-attention hybrids
    // only; `--arch`: those named only.
    let chosen = |a: &&kestrel_model::Arch| args.arch.is_empty() || args.arch.contains(a);
    let pick = |list: &[kestrel_model::Arch], skip: bool| -> Vec<kestrel_model::Arch> {
        if skip {
            Vec::new()
        } else {
            list.iter().filter(chosen).copied().collect()
        }
    };
    let dense = pick(&selfcheck::TP_ARCHS, args.moe || args.hybrids);
    let moe = pick(&selfcheck::TP_MOE_ARCHS, args.hybrids);
    let hybrids = pick(&selfcheck::TP_HYBRID_ARCHS, args.moe);
    for (i, arch) in dense.iter().enumerate() {
        for (j, ty) in selfcheck::tp_types(*arch).iter().enumerate() {
            let s = seed.wrapping_add((i * 10 + j) as u64);
            match selfcheck::compare_tp_logits(*arch, ty, args.positions, s, &ordinals) {
                Ok(r) => {
                    failures += usize::from(!r.passed());
                    println!(
                        "tp{ranks} {arch:?} {ty}: vs CPU max |Δ| {:.2e} (bound {:.2e}), top-1 {:.2}%; vs 1 GPU max |Δ| {:.2e} (bound {:.2e}), top-1 {:.2}% ({:.2}% with near-ties)  {}",
                        r.vs_cpu.max_abs_diff,
                        r.vs_cpu.max_abs_bound(),
                        r.vs_cpu.top1_agreement_ties * 100.0,
                        r.vs_one_gpu.max_abs_diff,
                        r.vs_one_gpu.max_abs_bound(),
                        r.vs_one_gpu.top1_agreement * 100.0,
                        r.vs_one_gpu.top1_agreement_ties * 100.0,
                        if r.passed() { "ok" } else { "FAIL" }
                    );
                }
                Err(e) => {
                    failures += 1;
                    println!("tp{ranks} {arch:?} {ty}: ERROR {e:#}");
                }
            }
        }
        let s = seed.wrapping_add(100 + i as u64);
        failures += tp_greedy(*arch, args.generate, s, &ordinals);
    }
    // Mixtures of experts: each rank its share of every expert, the router replicated;
    // route flips allowed as in the one-GPU MoE checks.
    for (i, arch) in moe.iter().enumerate() {
        for (j, ty) in selfcheck::tp_types(*arch).iter().enumerate() {
            let s = seed.wrapping_add((200 + i * 10 + j) as u64);
            match selfcheck::compare_tp_logits_moe(*arch, ty, args.positions, s, &ordinals) {
                Ok(r) => {
                    failures += usize::from(!r.passed());
                    println!(
                        "tp{ranks} {arch:?} {ty}: {}  {}",
                        r.summary(),
                        if r.passed() { "ok" } else { "FAIL" }
                    );
                }
                Err(e) => {
                    failures += 1;
                    println!("tp{ranks} {arch:?} {ty}: ERROR {e:#}");
                }
            }
        }
        let s = seed.wrapping_add(300 + i as u64);
        failures += tp_greedy(*arch, args.generate, s, &ordinals);
    }
    // The linear-attention hybrids: DeltaNet layers split by heads, their states per rank;
    // the one-GPU hybrid checks' criteria (f32 activations; route flips allowed in the MoE
    // hybrids).
    for (i, arch) in hybrids.iter().enumerate() {
        for (j, ty) in selfcheck::HYBRID_TYPES.iter().enumerate() {
            let s = seed.wrapping_add((600 + i * 10 + j) as u64);
            match selfcheck::compare_tp_logits_hybrid(*arch, ty, args.positions, s, &ordinals) {
                Ok(h) => {
                    failures += usize::from(!h.passed());
                    println!(
                        "tp{ranks} {arch:?} {ty}: {}{}  {}",
                        h.report.summary(),
                        if h.moe {
                            " (route flips allowed)"
                        } else {
                            " (strict)"
                        },
                        if h.passed() { "ok" } else { "FAIL" }
                    );
                }
                Err(e) => {
                    failures += 1;
                    println!("tp{ranks} {arch:?} {ty}: ERROR {e:#}");
                }
            }
        }
        let s = seed.wrapping_add(700 + i as u64);
        failures += tp_greedy(*arch, args.generate, s, &ordinals);
    }
    // Speculative verification on TP: batch-invariant steps against single-token ones,
    // then greedy ids with prompt lookup and with a draft model on the first GPU.
    for (i, arch) in dense.iter().chain(&moe).enumerate() {
        let s = seed.wrapping_add(400 + i as u64);
        let label = format!("tp{} {arch:?} q4_k_m invariant", ordinals.len());
        failures += report_invariant(
            &label,
            selfcheck::compare_tp_invariant(*arch, "q4_k_m", s, &ordinals),
        );
    }
    // Greedy ids merged from each GPU's best of its vocabulary share against the argmax
    // of the gathered logits read back.
    for (i, arch) in dense.iter().chain(&moe).enumerate() {
        let s = seed.wrapping_add(850 + i as u64);
        match selfcheck::compare_tp_argmax(*arch, "q4_k_m", s, &ordinals) {
            Ok((compared, differ)) => {
                let ok = differ == 0;
                failures += usize::from(!ok);
                println!(
                    "tp{ranks} {arch:?} argmax by shares vs gathered logits: {compared} rows, {differ} differ  {}",
                    if ok { "ok" } else { "FAIL" }
                );
            }
            Err(e) => {
                failures += 1;
                println!("tp{ranks} {arch:?} argmax by shares: ERROR {e:#}");
            }
        }
    }
    // Chained greedy decoding (every rank's ids merged from the shares' best pairs) against
    // step-by-step decoding on the same group.
    for (i, arch) in dense.iter().chain(&moe).enumerate() {
        let s = seed.wrapping_add(800 + i as u64);
        let label = format!("tp{} {arch:?} q4_k_m chained", ordinals.len());
        print_chain_report(
            &mut failures,
            &label,
            selfcheck::compare_tp_chained(*arch, "q4_k_m", args.generate, s, &ordinals),
        );
    }
    // Batched decode steps (cuBLAS products and all-reduces in each part's graph) replayed
    // against the same steps launched kernel by kernel.
    const STEPS: usize = 8;
    println!(
        "tp{ranks} graph replay vs eager launches, {STEPS} batched decode steps (cuBLAS in the graphs):"
    );
    let archs = dense.iter().chain(&moe).chain(&hybrids);
    for (i, arch) in archs.enumerate() {
        for (j, ty) in ["f32", "q4_k_m", "q8_0"].iter().enumerate() {
            for seqs in [37, 64] {
                let s = seed.wrapping_add(30_000 + (i * 1_000 + j * 100 + seqs) as u64);
                let what = format!("tp{ranks} {arch:?} {ty} {seqs} seqs:");
                let r = selfcheck::compare_tp_graph_replay_batched(
                    *arch, ty, seqs, STEPS, s, &ordinals,
                );
                failures += usize::from(!print_graph_report(&what, r));
            }
        }
    }
    verdict(failures, "tensor-parallel")
}

/// Times prefill and decode of a model file on the GPU (random token ids).
fn bench(args: &Args, path: &std::path::Path) -> anyhow::Result<()> {
    use anyhow::Context;
    use kestrel_engine::{Engine, EngineOptions, Sequence};
    use rand::Rng;
    use std::sync::Arc;

    let file = Arc::new(
        kestrel_gguf::GgufFile::open(path)
            .with_context(|| format!("opening {}", path.display()))?,
    );
    let weight_bytes: u64 = file
        .tensors()
        .iter()
        .filter(|t| t.name != "token_embd.weight" || file.tensor("output.weight").is_none())
        .map(|t| t.n_bytes())
        .sum();
    let opts = EngineOptions {
        ctx: args.pp + args.tg + 16,
        max_batch_tokens: args.pp.max(1),
        max_logit_rows: 1,
        block_size: 16,
        max_seqs: 1,
    };
    let t0 = Instant::now();
    let backend = kestrel_cuda::CudaBackend::new(args.gpu)?;
    let replays = backend.replay_counter();
    let mut engine = Engine::new(backend, file.clone(), &opts)?;
    println!(
        "loaded {} in {:.2} s",
        path.display(),
        t0.elapsed().as_secs_f64()
    );
    let vocab = engine.config().vocab_size as u32;
    let mut rng = rand::rng();
    for rep in 0..3 {
        let prompt: Vec<u32> = (0..args.pp.max(1))
            .map(|_| rng.random_range(0..vocab))
            .collect();
        let mut seq = Sequence::default();
        let t = Instant::now();
        engine.eval(&mut seq, &prompt, false, |_, _| {})?;
        let pp_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for _ in 0..args.tg {
            let id = rng.random_range(0..vocab);
            engine.eval(&mut seq, &[id], false, |_, _| {})?;
        }
        let tg_s = t.elapsed().as_secs_f64();
        engine.release(&mut seq);
        let tg_rate = args.tg as f64 / tg_s;
        println!(
            "run {rep}: pp{} {:.1} t/s, tg{} {:.1} t/s ({:.1} GB/s of weights read per decode step; {:.2} GB/token; {} graph replays so far)",
            prompt.len(),
            prompt.len() as f64 / pp_s,
            args.tg,
            tg_rate,
            tg_rate * weight_bytes as f64 / 1e9,
            weight_bytes as f64 / 1e9,
            replays.load(std::sync::atomic::Ordering::Relaxed)
        );
    }
    Ok(())
}

/// The linear-attention hybrids against the CPU: teacher-forced logits in steps of 1 to 100
/// tokens, several sequences per step against each alone, greedy generation, and the
/// per-sequence state's refusals and reuse. Models whose MoE layers the backend refuses are
/// skipped with a notice. Returns the failures.
fn check_hybrids(args: &Args, seed: u64) -> usize {
    let positions = args.positions.clamp(1, 512);
    let mut failures = 0usize;
    println!(
        "linear-attention hybrids (gated DeltaNet + gated attention), {positions} positions, same criteria; then several sequences per step vs alone, greedy generation, state continuity:"
    );
    let skipped = |label: &str, e: &anyhow::Error| {
        let skip = selfcheck::moe_refused(e);
        if skip {
            println!("{label} skipped: {e:#}");
        }
        skip
    };
    for (ia, arch) in selfcheck::HYBRID_ARCHS.into_iter().enumerate() {
        if selfcheck::has_moe(arch) {
            // The MoE hybrids: one token a step on f32 activations (no route moves) held to
            // the strict bound, steps of 1-100 tokens tolerant of route flips (see
            // `compare_logits_moe`); greedy ids one token a step.
            for (it, ty) in selfcheck::HYBRID_TYPES.into_iter().enumerate() {
                let case_seed = seed.wrapping_add(2_000 + (ia * 100 + it) as u64);
                let label = format!("hybrid   {:<9} {ty:<9}", arch.name());
                let shape = (8, 2);
                match selfcheck::compare_logits_moe(arch, ty, shape, positions, case_seed, args.gpu)
                {
                    Ok(r) => {
                        failures += usize::from(!r.passed());
                        println!(
                            "{label} one token a step max|Δ| {:.3e} (bound {:.3e}); in parts top-1 {:.2}% w/ ties, {:.1}% of positions within the bound  {}",
                            r.single.max_abs_diff,
                            r.single.max_abs_bound(),
                            r.logits.top1_agreement_ties * 100.0,
                            r.within * 100.0,
                            if r.passed() { "ok" } else { "FAIL" }
                        );
                    }
                    Err(e) if skipped(&label, &e) => {}
                    Err(e) => {
                        failures += 1;
                        println!("{label} ERROR {e:#}");
                    }
                }
            }
            let case_seed = seed.wrapping_add(2_600 + ia as u64);
            let label = format!("hybrid   {:<9} f16       greedy", arch.name());
            match selfcheck::compare_greedy_moe(
                arch,
                "f16",
                (8, 2),
                args.generate,
                case_seed,
                args.gpu,
            ) {
                Ok(g) => {
                    failures += usize::from(!g.passed());
                    println!(
                        "{label} {} tokens: first difference {:?}  {}",
                        g.cpu.len(),
                        g.first_difference,
                        if g.passed() { "ok" } else { "FAIL" }
                    );
                }
                Err(e) if skipped(&label, &e) => {}
                Err(e) => {
                    failures += 1;
                    println!("{label} ERROR {e:#}");
                }
            }
        } else {
            // f32 activations on the GPU (the strict bound), every type.
            for (it, ty) in selfcheck::HYBRID_TYPES.into_iter().enumerate() {
                let case_seed = seed.wrapping_add(2_000 + (ia * 100 + it) as u64);
                let label = format!("hybrid   {:<9} {ty:<9}", arch.name());
                let r = selfcheck::compare_logits(arch, ty, positions, case_seed, args.gpu, false);
                failures += usize::from(!print_logit_report(&label, r));
            }
            // Awkward linear-attention sizes (heads of 24, 3 q/k and 6 v heads, 3 taps).
            for (it, ty) in ["f32", "f16"].into_iter().enumerate() {
                let case_seed = seed.wrapping_add(2_030 + (ia * 100 + it) as u64);
                let label = format!("hybrid   {:<9} {ty:<9} heads 24, 3/6, 3 taps", arch.name());
                let r = selfcheck::compare_logits_of(
                    selfcheck::tiny_model_awkward_hybrid,
                    arch,
                    ty,
                    positions,
                    case_seed,
                    args.gpu,
                );
                failures += usize::from(!print_logit_report(&label, r));
            }
            // The real models' heads of 128 (four delta_scan blocks a v head).
            for (it, ty) in ["f32", "q4_k_m"].into_iter().enumerate() {
                let case_seed = seed.wrapping_add(2_040 + (ia * 100 + it) as u64);
                let label = format!("hybrid   {:<9} {ty:<9} heads 128", arch.name());
                let r = selfcheck::compare_logits_of(
                    selfcheck::tiny_model_real_heads_hybrid,
                    arch,
                    ty,
                    positions,
                    case_seed,
                    args.gpu,
                );
                failures += usize::from(!print_logit_report(&label, r));
            }
            // 8-bit activations (the default decode path), against the CPU's own 8-bit spread.
            for (it, ty) in selfcheck::HYBRID_TYPES.into_iter().enumerate() {
                if !selfcheck::Q8_TYPES.contains(&ty) {
                    continue;
                }
                let case_seed = seed.wrapping_add(2_050 + (ia * 100 + it) as u64);
                let label = format!("hybrid   {:<9} {:<9}", arch.name(), format!("{ty}+q8"));
                match selfcheck::compare_logits_q8_spread(arch, ty, positions, case_seed, args.gpu)
                {
                    Ok((r, bound)) => {
                        let ok = r.passed_within(bound);
                        failures += usize::from(!ok);
                        println!(
                            "{label} max|Δ| {:.3e} of {:.3e} (bound {bound:.3e}: 2 × the CPU's 8-bit vs f32 spread), top-1 {:.2}% ({:.2}% w/ ties)  {}",
                            r.max_abs_diff,
                            r.max_abs_logit,
                            r.top1_agreement * 100.0,
                            r.top1_agreement_ties * 100.0,
                            if ok { "ok" } else { "FAIL" }
                        );
                    }
                    Err(e) => {
                        failures += 1;
                        println!("{label} ERROR {e:#}");
                    }
                }
            }
            // Several sequences per step vs alone, f32 activations.
            for ty in ["f16", "q4_k_m"] {
                for lens in [[48usize, 16, 36], [1, 2, 70]] {
                    let case_seed = seed.wrapping_add(2_500 + ia as u64);
                    let label = format!("hybrid   {:<9} {ty:<9} batched {lens:?}:", arch.name());
                    let r = selfcheck::compare_batched_f32(arch, ty, &lens, case_seed, args.gpu);
                    failures += usize::from(!print_logit_report(&label, r));
                }
            }
            for ty in ["f32", "f16"] {
                let case_seed = seed.wrapping_add(2_600 + ia as u64);
                let label = format!("hybrid   {:<9} {ty:<9} greedy", arch.name());
                match selfcheck::compare_greedy(arch, ty, args.generate, case_seed, args.gpu) {
                    Ok(g) => {
                        failures += usize::from(!g.passed());
                        println!(
                            "{label} {} tokens: first difference {:?}  {}",
                            g.cpu.len(),
                            g.first_difference,
                            if g.passed() { "ok" } else { "FAIL" }
                        );
                    }
                    Err(e) if skipped(&label, &e) => {}
                    Err(e) => {
                        failures += 1;
                        println!("{label} ERROR {e:#}");
                    }
                }
            }
        }
        let case_seed = seed.wrapping_add(2_650 + ia as u64);
        let label = format!("hybrid   {:<9} q4_k_m    graph replay", arch.name());
        match selfcheck::compare_graph_replay(arch, "q4_k_m", args.generate, case_seed, args.gpu) {
            Err(e) if skipped(&label, &e) => {}
            r => failures += usize::from(!print_graph_report(&format!("{label}:"), r)),
        }
        let label = format!("hybrid   {:<9} state", arch.name());
        match selfcheck::check_state_continuity(
            arch,
            seed.wrapping_add(2_700 + ia as u64),
            args.gpu,
        ) {
            Ok(r) => {
                failures += usize::from(!r.passed());
                println!(
                    "{label}: continuing a cut-back sequence refused: {:?}; reused slot vs fresh max rel |Δ| {:.1e}  {}",
                    r.refused,
                    r.reuse_rel_diff,
                    if r.passed() { "ok" } else { "FAIL" }
                );
            }
            Err(e) if skipped(&label, &e) => {}
            Err(e) => {
                failures += 1;
                println!("{label} ERROR {e:#}");
            }
        }
    }
    failures
}

/// Sampling on the device (`sample_rows`, with and without token masks) against the
/// host's definition; returns the failures. "busy": masked batches sampled while the
/// stream runs queued work, each round on a fresh backend of GPU `gpu` (the masks' buffers
/// allocated behind that work).
fn check_sampling(backend: &kestrel_cuda::CudaBackend, gpu: usize, seed: u64) -> usize {
    let mut failures = 0;
    println!(
        "sampling on the device (sample_rows) vs the host's definition, random rows of 1-151,936 words; \"masked\": with token masks, 1-262,145 words; \"busy\": masked behind queued work, a fresh backend a round:"
    );
    for (masks, busy, label, base) in [
        (false, false, "sample", 900),
        (true, false, "masked", 950),
        (true, true, "busy", 980),
    ] {
        for round in 0..3u64 {
            let fresh;
            let backend = if busy {
                match kestrel_cuda::CudaBackend::new(gpu) {
                    Ok(b) => {
                        fresh = b;
                        &fresh
                    }
                    Err(e) => {
                        failures += 1;
                        println!("{label:<8} round {round}: ERROR {e:#}");
                        continue;
                    }
                }
            } else {
                backend
            };
            let seed = seed.wrapping_add(base + round);
            match selfcheck::compare_sampling(backend, seed, masks, busy) {
                Ok(r) => {
                    let ok = r.passed();
                    failures += usize::from(!ok);
                    println!(
                        "{label:<8} round {round}: {} rows, {} at an interval's edge, {} wrong  {}{}",
                        r.rows,
                        r.edge,
                        r.wrong,
                        if ok { "ok" } else { "FAIL" },
                        r.first_wrong
                            .map(|w| format!(" (first: {w})"))
                            .unwrap_or_default()
                    );
                }
                Err(e) => {
                    failures += 1;
                    println!("{label:<8} round {round}: ERROR {e:#}");
                }
            }
        }
    }
    match selfcheck::compare_argmax_shares(backend, seed.wrapping_add(850)) {
        Ok((compared, differ)) => {
            let ok = differ == 0;
            failures += usize::from(!ok);
            println!(
                "argmax   by vocabulary shares (tensor parallelism's LM head) vs whole rows: {compared} rows, {differ} differ  {}",
                if ok { "ok" } else { "FAIL" }
            );
        }
        Err(e) => {
            failures += 1;
            println!("argmax   by vocabulary shares: ERROR {e:#}");
        }
    }
    failures
}

/// Prints one comparison's line (`label`, then max |Δ|, top-1 agreement and ok / FAIL, or
/// the error); true when it passed.
fn print_logit_report(label: &str, result: anyhow::Result<selfcheck::LogitReport>) -> bool {
    match result {
        Ok(r) => {
            let ok = r.passed();
            // A failure names the position of its largest |Δ|: which part of the step
            // sizes (prompt GEMMs or decode GEMVs) produced it.
            let at = if ok {
                String::new()
            } else {
                format!(" at position {}", r.worst_position)
            };
            // f16 / bf16 operands: say when the CPU's own spread under llama.cpp's rounding
            // set the bound.
            let bound = r.max_abs_bound();
            let spread = if r.f16_operands && bound > r.max_rel_diff() * r.max_abs_logit.max(1.0) {
                format!(" (bound {bound:.3e}: 1.5 × the CPU's f16-operand spread)")
            } else {
                String::new()
            };
            println!(
                "{label} max|Δ| {:.3e}{at} of {:.3e}{spread}, top-1 {:.2}% ({:.2}% w/ ties)  {}",
                r.max_abs_diff,
                r.max_abs_logit,
                r.top1_agreement * 100.0,
                r.top1_agreement_ties * 100.0,
                if ok { "ok" } else { "FAIL" }
            );
            ok
        }
        Err(e) => {
            println!("{label} ERROR {e:#}");
            false
        }
    }
}

/// Prints a graph-replay line (replays, whether the logits are bit-identical to eager
/// launches) or the error; returns whether it passed.
fn print_graph_report(what: &str, r: anyhow::Result<selfcheck::GraphReport>) -> bool {
    match r {
        Ok(r) => {
            let ok = r.passed();
            println!(
                "{what} {} replays, logits {}  {}",
                r.replays,
                if r.identical {
                    "bit-identical"
                } else {
                    "DIFFER"
                },
                if ok { "ok" } else { "FAIL" }
            );
            ok
        }
        Err(e) => {
            println!("{what} ERROR {e:#}");
            false
        }
    }
}

/// The mixture-of-experts checks: the tiny Qwen3-MoE models' logits against the CPU in
/// every format the expert kernels read (steps of 100, 40 and 1–8 tokens), greedy ids, and
/// batch-invariant steps. Returns the failures.
fn moe_checks(args: &Args, seed: u64, positions: usize) -> usize {
    let mut failures = 0;
    println!(
        "mixture of experts (qwen3moe, experts/used), teacher-forced against the CPU, f32 activations: pass if, one token a step and in parts (100, 40, 1-8 tokens), top-1 agreement (w/ ties) >= {:.1}% and >= {:.0}% of positions within the |Δ| bound (activations rounded otherwise than the CPU's flip near-tied routes):",
        MIN_TOP1_AGREEMENT * 100.0,
        selfcheck::MOE_MIN_WITHIN * 100.0
    );
    for (is, &shape) in selfcheck::MOE_SHAPES.iter().enumerate() {
        for (it, &ty) in selfcheck::MOE_TYPES.iter().enumerate() {
            let case_seed = seed.wrapping_add(20_000 + (is * 100 + it) as u64);
            let label = format!("moe      {}/{:<6} {:<8}", shape.0, shape.1, ty);
            match selfcheck::compare_logits_moe(
                kestrel_model::Arch::Qwen3Moe,
                ty,
                shape,
                positions,
                case_seed,
                args.gpu,
            ) {
                Ok(r) => {
                    let ok = r.passed();
                    failures += usize::from(!ok);
                    println!(
                        "{label} 1/step {:.1}% within, max|Δ| {:.3e}, top-1 {:.2}% ({:.2}% w/ ties); parts {:.1}% of positions within {:.2e}, max|Δ| {:.3e} of {:.3e}, top-1 {:.2}% ({:.2}% w/ ties)  {}",
                        r.single_within * 100.0,
                        r.single.max_abs_diff,
                        r.single.top1_agreement * 100.0,
                        r.single.top1_agreement_ties * 100.0,
                        r.within * 100.0,
                        r.logits.max_abs_bound(),
                        r.logits.max_abs_diff,
                        r.logits.max_abs_logit,
                        r.logits.top1_agreement * 100.0,
                        r.logits.top1_agreement_ties * 100.0,
                        if ok { "ok" } else { "FAIL" }
                    );
                }
                Err(e) => {
                    failures += 1;
                    println!("{label} ERROR {e:#}");
                }
            }
        }
    }
    let moe = kestrel_model::Arch::Qwen3Moe;
    println!(
        "mixture-of-experts block alone (random inputs of 1 to 300 tokens, some near-copies of one; then a shared expert's gate), pass if max |Δ| <= {:.0e} of each token's largest output; tensor-core blocks (8-bit activations) against the CPU's ggml numerics: mean <= {:.0e}, <= {:.0}% of tokens over {:.0e}, max <= {:.0e}:",
        selfcheck::MoeBlockReport::LIMIT,
        selfcheck::MoeBlockReport::LIMIT_MMA_MEAN,
        selfcheck::MoeBlockReport::MMA_MAX_TOKENS_OFF * 100.0,
        selfcheck::MoeBlockReport::MMA_TOKEN_BOUND,
        selfcheck::MoeBlockReport::LIMIT_MMA_MAX
    );
    // (label, architecture, wide: the tiny model or the shape of MOE_WIDE (Qwen3-MoE: rows
    // of several 256-value steps, top-8 of 32) / MOE_WIDE_GPT_OSS (rows of whole 32-value
    // blocks only, top-4 of 32), type).
    let mut block_cases = Vec::new();
    for arch in [kestrel_model::Arch::GptOss, moe] {
        for ty in ["q8_0", "f16", "q4_k_m", "q6_k", "q4_0", "mxfp4", "iq4_nl"] {
            block_cases.push((arch.name(), arch, false, ty));
        }
    }
    for ty in ["q4_k_m", "q6_k"] {
        block_cases.push(("qwen3moe-wide", moe, true, ty));
    }
    for ty in ["mxfp4", "q8_0"] {
        block_cases.push(("gpt-oss-wide", kestrel_model::Arch::GptOss, true, ty));
    }
    for (ic, (name, arch, wide, ty)) in block_cases.into_iter().enumerate() {
        let case_seed = seed.wrapping_add(22_000 + ic as u64);
        let result = match wide {
            false => selfcheck::compare_moe_block(arch, ty, case_seed, args.gpu),
            true => selfcheck::compare_moe_block_wide(arch, ty, case_seed, args.gpu),
        };
        match result {
            Ok(r) => {
                let ok = r.passed();
                failures += usize::from(!ok);
                println!(
                    "moe block {name:<13} {ty:<8} {} blocks, max rel |Δ| {:.2e}; {} on tensor cores: mean {:.1e} (f32 oracle {:.1e}), tokens over {}/{}, max {:.1e}  {}",
                    r.blocks,
                    r.max_rel_diff,
                    r.mma_blocks,
                    r.mean_rel_diff_mma,
                    r.mean_rel_diff_mma_f32,
                    r.mma_tokens_off,
                    r.mma_tokens,
                    r.max_rel_diff_mma,
                    if ok { "ok" } else { "FAIL" }
                );
            }
            Err(e) => {
                failures += 1;
                println!("moe block {name:<13} {ty:<8} ERROR {e:#}");
            }
        }
    }
    match selfcheck::compare_moe_routes(seed.wrapping_add(22_900), args.gpu) {
        Ok(r) => {
            let ok = r.passed();
            failures += usize::from(!ok);
            println!(
                "moe routing (moe_route against the CPU's route: {} shapes up to 1024/16, every gating, ties) {} tokens, ids off {}, max rel |Δ| weight {:.1e} (bound {:.0e})  {}",
                selfcheck::MOE_ROUTE_SHAPES.len(),
                r.tokens,
                r.ids_off,
                r.max_rel_diff,
                selfcheck::MoeRouteReport::LIMIT,
                if ok { "ok" } else { "FAIL" }
            );
        }
        Err(e) => {
            failures += 1;
            println!("moe routing ERROR {e:#}");
        }
    }
    println!(
        "mixture-of-experts block on 8-bit activations (moe_gate_up_q8, moe_down_q8; random stacked experts, 1, 2, 5, 8 tokens) against an f64 reference on the same rounded inputs: pass if max |Δ| beyond a boundary rounding's allowance <= {:.0e} of each token's largest output:",
        selfcheck::MoeBlockReport::LIMIT
    );
    match CudaBackend::new(args.gpu) {
        Ok(backend) => {
            for (ic, case) in selfcheck::MOE_Q8_CASES.into_iter().enumerate() {
                let label = format!(
                    "moe q8 block {:?} d {} ff {} experts {}/{}{}",
                    case.types,
                    case.d,
                    case.ff,
                    case.k,
                    case.n_expert,
                    if case.gpt_oss { " gpt-oss" } else { "" }
                );
                let case_seed = seed.wrapping_add(23_000 + ic as u64);
                match selfcheck::compare_moe_block_q8(&backend, case, case_seed) {
                    Ok(r) => {
                        let ok = r.passed();
                        failures += usize::from(!ok);
                        println!(
                            "{label}: {} steps, max rel |Δ| {:.2e}, {} non-finite  {}",
                            r.blocks,
                            r.max_rel_diff,
                            r.non_finite,
                            if ok { "ok" } else { "FAIL" }
                        );
                    }
                    Err(e) => {
                        failures += 1;
                        println!("{label}: ERROR {e:#}");
                    }
                }
            }
        }
        Err(e) => {
            failures += 1;
            println!("moe q8 block: ERROR {e:#}");
        }
    }
    // gpt-oss: sinks, sliding windows, biases and clamped SwiGLU experts, published in MXFP4.
    let greedy_cases = [
        (moe, "f16"),
        (moe, "q4_k_m"),
        (moe, "q8_0"),
        (kestrel_model::Arch::GptOss, "f16"),
        (kestrel_model::Arch::GptOss, "mxfp4"),
    ];
    for (it, (arch, ty)) in greedy_cases.into_iter().enumerate() {
        let case_seed = seed.wrapping_add(21_000 + it as u64);
        // Greedy ids with the GPU on one f32 token a step (no route flips on rounding).
        for shape in selfcheck::MOE_SHAPES {
            match selfcheck::compare_greedy_moe(arch, ty, shape, args.generate, case_seed, args.gpu)
            {
                Ok(r) => {
                    let ok = r.passed();
                    failures += usize::from(!ok);
                    let detail = match r.first_difference {
                        None => "identical".to_string(),
                        Some((i, gap)) => {
                            format!("differ from token {i} (CPU logit gap {gap:.2e})")
                        }
                    };
                    println!(
                        "moe greedy {:<8} {}/{} {ty:<8} {detail}  {}",
                        arch.name(),
                        shape.0,
                        shape.1,
                        if ok { "ok" } else { "FAIL" }
                    );
                }
                Err(e) => {
                    failures += 1;
                    println!(
                        "moe greedy {:<8} {}/{} {ty:<8} ERROR {e:#}",
                        arch.name(),
                        shape.0,
                        shape.1
                    );
                }
            }
        }
        match selfcheck::compare_invariant(arch, ty, case_seed, args.gpu) {
            Ok(r) => {
                let ok = r.passed();
                failures += usize::from(!ok);
                println!(
                    "moe invariant {:<8} {ty:<8} {} rows, {} differ (max |Δ| {:.2e}); ids {}, {} drafted  {}",
                    arch.name(),
                    r.rows,
                    r.differing,
                    r.max_abs_diff,
                    if r.spec == r.plain { "equal" } else { "DIFFER" },
                    r.drafted,
                    if ok { "ok" } else { "FAIL" }
                );
            }
            Err(e) => {
                failures += 1;
                println!("moe invariant {:<8} {ty:<8} ERROR {e:#}", arch.name());
            }
        }
    }
    failures
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if let Some(path) = &args.bench {
        return bench(&args, path);
    }
    if let Some(n) = args.tp.filter(|&n| n > 1) {
        return check_tp(&args, n);
    }
    if args.split == Some(crate::cmd::common::SplitMode::Layer) {
        return check_split(&args);
    }
    let seed = args.seed.unwrap_or_else(rand::random);
    if args.hybrids {
        println!("seed {seed}");
        let failures = check_hybrids(&args, seed);
        return verdict(failures, "hybrid");
    }
    if args.moe {
        println!("seed {seed}");
        let failures = moe_checks(&args, seed, args.positions.clamp(1, 512));
        return verdict(failures, "mixture-of-experts");
    }
    if args.attention {
        println!("seed {seed}");
        let failures = check_attention(&args, seed, args.positions.clamp(1, 512))?;
        return verdict(failures, "attention");
    }
    let start = Instant::now();
    let backend = kestrel_cuda::CudaBackend::new(args.gpu)?;
    println!(
        "device {} ({}), kernels {:?} in {:.2} s; seed {seed}",
        backend.device_name(),
        backend.arch(),
        backend.kernels_origin(),
        start.elapsed().as_secs_f64()
    );
    if args.sampling {
        let failures = check_sampling(&backend, args.gpu, seed);
        return verdict(failures, "sampling");
    }
    if args.graphs {
        drop(backend);
        let failures = check_graphs(&args, seed);
        return verdict(failures, "graph replay");
    }
    if args.verification {
        let mut failures = check_invariant_products(&backend, seed);
        drop(backend);
        failures += check_invariant_steps(&args, seed);
        return verdict(failures, "verification");
    }
    let mut failures = check_products(&backend, seed);
    // Logit rows copied to the host while their product runs (after a large read of rows).
    match selfcheck::compare_read_ahead(&backend, seed.wrapping_add(870)) {
        Ok(r) => {
            failures += usize::from(!r.passed());
            println!(
                "read-ahead of logit rows: identical to a plain read {}, chunked vs single product {:.1e}, used {:?} (want [true, false])  {}",
                r.identical,
                r.chunked_rel_diff,
                r.used,
                if r.passed() { "ok" } else { "FAIL" }
            );
        }
        Err(e) => {
            failures += 1;
            println!("read-ahead of logit rows: ERROR {e:#}");
        }
    }
    failures += check_sampling(&backend, args.gpu, seed);
    drop(backend);
    // Tensor parallelism's one-shot all-reduce kernel, its ranks as streams of this GPU.
    for ranks in [2, 3] {
        let sizes = [
            4,
            12,
            4100,
            16 << 10,
            (60 << 10) + 4,
            (1 << 20) + 12,
            kestrel_cuda::tp::ONESHOT_MAX_BYTES,
        ];
        match kestrel_cuda::tp::oneshot_on_one_gpu(args.gpu, ranks, &sizes) {
            Ok(r) => {
                let ok = r.iter().all(|&(_, e)| e <= 1e-5);
                failures += usize::from(!ok);
                println!(
                    "one-shot all-reduce, {ranks} ranks on one GPU, {:?} bytes: max |Δ| vs host sums {:.1e}  {}",
                    sizes,
                    r.iter().map(|x| x.1).fold(0f32, f32::max),
                    if ok { "ok" } else { "FAIL" }
                );
            }
            Err(e) => {
                failures += 1;
                println!("one-shot all-reduce, {ranks} ranks on one GPU: ERROR {e:#}");
            }
        }
    }
    let positions = args.positions.clamp(1, 512);
    println!(
        "teacher-forced, {positions} positions: pass if top-1 agreement (near-ties of the CPU's logits within {} · max(1, max |logit|) or 2 · max |Δ logit| counted as agreeing) >= {:.1}% and max |Δ logit| <= {MAX_REL_DIFF} · max(1, max |logit|) ({} with 8-bit activations, \"+q8\", or the CPU's own 8-bit spread if larger)",
        selfcheck::TIE_REL,
        MIN_TOP1_AGREEMENT * 100.0,
        selfcheck::MAX_REL_DIFF_Q8,
    );
    println!(
        "{:<8} {:<9} {:>12} {:>12} {:>9} {:>9}  result",
        "arch", "type", "max|Δ|", "max|logit|", "top-1", "w/ ties"
    );
    // Every type with the GPU held to f32 arithmetic, then the types whose single-token
    // GEMVs run on 8-bit activations by default, that way (looser |Δ| bound).
    let cases: Vec<(&str, bool)> = TYPES
        .iter()
        .map(|&t| (t, false))
        .chain(selfcheck::Q8_TYPES.iter().map(|&t| (t, true)))
        .collect();
    for (ia, arch) in ARCHS.into_iter().enumerate() {
        for (it, &(ty, q8)) in cases.iter().enumerate() {
            let case_seed = seed.wrapping_add((ia * 100 + it) as u64);
            let label = if q8 {
                format!("{ty}+q8")
            } else {
                ty.to_string()
            };
            match selfcheck::compare_logits(arch, ty, positions, case_seed, args.gpu, q8) {
                Ok(r) => {
                    let ok = r.passed();
                    failures += usize::from(!ok);
                    println!(
                        "{:<8} {:<9} {:>12.3e} {:>12.3e} {:>8.2}% {:>8.2}%  {}{}",
                        arch.name(),
                        label,
                        r.max_abs_diff,
                        r.max_abs_logit,
                        r.top1_agreement * 100.0,
                        r.top1_agreement_ties * 100.0,
                        if ok { "ok" } else { "FAIL" },
                        if r.non_finite > 0 {
                            format!(" ({} non-finite logits)", r.non_finite)
                        } else {
                            String::new()
                        }
                    );
                }
                Err(e) => {
                    failures += 1;
                    println!("{:<8} {:<9} ERROR {e:#}", arch.name(), label);
                }
            }
        }
    }
    println!(
        "128-dim heads, 4 query heads per kv head (the grouped decode attention), 8-bit decode:"
    );
    for (ia, arch) in ARCHS.into_iter().enumerate() {
        for ty in ["f16", "q4_k_m"] {
            let case_seed = seed.wrapping_add(700 + ia as u64);
            let label = format!("wide     {:<8} {:<8}", arch.name(), ty);
            let result =
                selfcheck::compare_logits_wide_heads(arch, ty, positions, case_seed, args.gpu);
            failures += usize::from(!print_logit_report(&label, result));
        }
    }
    println!(
        "decode attention shapes (query heads/kv heads/head size), f16, f32 activations, steps of 1-8 tokens at lengths 3-{positions}:"
    );
    for (ia, arch) in selfcheck::KERNEL_ARCHS.into_iter().enumerate() {
        for (is, &heads) in selfcheck::ATTN_SHAPES.iter().enumerate() {
            let case_seed = seed.wrapping_add(1_000 + (ia * 10 + is) as u64);
            let (h, kv, d) = heads;
            let label = format!("attn     {:<8} {h}/{kv}/{d:<10}", arch.name());
            let result =
                selfcheck::compare_logits_heads(arch, "f16", heads, positions, case_seed, args.gpu);
            failures += usize::from(!print_logit_report(&label, result));
        }
    }
    println!(
        "several sequences per step (prompts of 48+16+36 and 45+9+70 tokens, then 4 decode steps) vs each alone, same criteria (|Δ| bound {} where both runs use 8-bit activations):",
        selfcheck::MAX_REL_DIFF_Q8_BOTH
    );
    for (ia, arch) in ARCHS.into_iter().enumerate() {
        for ty in ["f16", "q4_k_m"] {
            for lens in [[48usize, 16, 36], [45, 9, 70]] {
                let case_seed = seed.wrapping_add(900 + ia as u64);
                let label = format!("batched {:<8} {:<8} {:?}:", arch.name(), ty, lens);
                let result = selfcheck::compare_batched(arch, ty, &lens, case_seed, args.gpu);
                failures += usize::from(!print_logit_report(&label, result));
            }
        }
    }
    println!(
        "several sequences per step, 128-dim heads, 4 query heads per kv head: a long and two short prompts (empty key ranges), and 10 sequences (decode steps of 10 tokens):"
    );
    for (ia, arch) in ARCHS.into_iter().enumerate() {
        let lens_all: [&[usize]; 2] = [&[150, 2, 33], &[1, 2, 3, 5, 8, 13, 21, 34, 55, 89]];
        for lens in lens_all {
            let case_seed = seed.wrapping_add(950 + ia as u64);
            let label = format!("batched {:<8} wide f16 {:?}:", arch.name(), lens);
            let result = selfcheck::compare_batched_heads(
                arch,
                "f16",
                selfcheck::WIDE_HEADS,
                lens,
                case_seed,
                args.gpu,
            );
            failures += usize::from(!print_logit_report(&label, result));
        }
    }
    println!(
        "quantized K/V: store_kv_q vs the CPU's quantizer (byte for byte; fp8 vs the reference one) and attention vs f64 over the stored values, then logits with the cache stored so on both backends (f32 activations, steps of 1-8 tokens and prompt chunks), then several sequences per step vs alone:"
    );
    // A backend of its own for the kernel-level checks, gone before the engines' checks.
    failures += check_attention(&args, seed, positions)?;
    for (ia, arch) in selfcheck::KERNEL_ARCHS.into_iter().enumerate() {
        for (ik, (k, v)) in selfcheck::CACHE_TYPES.into_iter().enumerate() {
            let heads = selfcheck::ATTN_SHAPES[(ia + ik) % selfcheck::ATTN_SHAPES.len()];
            let case_seed = seed.wrapping_add(1_200 + (ia * 10 + ik) as u64);
            let kv = kestrel_model::KvTypes { k, v };
            let (h, hk, d) = heads;
            let label = format!("kv {k}/{v} {:<8} {h}/{hk}/{d:<6}", arch.name());
            let result = selfcheck::compare_logits_cache(
                arch, "f16", heads, kv, positions, case_seed, args.gpu,
            );
            failures += usize::from(!print_logit_report(&label, result));
        }
        let kv = kestrel_model::KvTypes {
            k: kestrel_model::KvType::Q8_0,
            v: kestrel_model::KvType::Q8_0,
        };
        let lens = [150usize, 2, 33];
        let label = format!("batched {:<8} wide kv q8_0 {:?}:", arch.name(), lens);
        let case_seed = seed.wrapping_add(1_300 + ia as u64);
        let result = selfcheck::compare_batched_cache(
            arch,
            "f16",
            selfcheck::WIDE_HEADS,
            kv,
            &lens,
            case_seed,
            args.gpu,
        );
        failures += usize::from(!print_logit_report(&label, result));
    }
    println!(
        "on-device argmax of logit rows vs the rows read back (eager and graph-replayed steps):"
    );
    for (ia, arch) in ARCHS.into_iter().enumerate() {
        let case_seed = seed.wrapping_add(800 + ia as u64);
        match selfcheck::compare_argmax(arch, "q4_k_m", case_seed, args.gpu) {
            Ok((compared, differ)) => {
                let ok = differ == 0;
                failures += usize::from(!ok);
                println!(
                    "argmax   {:<8} {compared} rows, {differ} differ  {}",
                    arch.name(),
                    if ok { "ok" } else { "FAIL" }
                );
            }
            Err(e) => {
                failures += 1;
                println!("argmax   {:<8} ERROR {e:#}", arch.name());
            }
        }
    }
    println!("embeddings (hidden rows pooled mean/cls/last, CPU f32 vs CUDA):");
    for (ia, arch) in ARCHS.into_iter().enumerate() {
        let case_seed = seed.wrapping_add(20_000 + ia as u64);
        match selfcheck::compare_embeddings(arch, "f16", case_seed, args.gpu) {
            Ok(r) => {
                let ok = r.passed();
                failures += usize::from(!ok);
                println!(
                    "embed    {:<8} {} vectors, min cosine {:.7}, max rel diff {:.2e}  {}",
                    arch.name(),
                    r.vectors,
                    r.min_cosine,
                    r.max_rel_diff,
                    if ok { "ok" } else { "FAIL" }
                );
            }
            Err(e) => {
                failures += 1;
                println!("embed    {:<8} ERROR {e:#}", arch.name());
            }
        }
    }
    println!("greedy generation, {} tokens:", args.generate);
    for (ia, arch) in ARCHS.into_iter().enumerate() {
        for ty in ["f32", "f16"] {
            let case_seed = seed.wrapping_add(10_000 + ia as u64);
            match selfcheck::compare_greedy(arch, ty, args.generate, case_seed, args.gpu) {
                Ok(r) => {
                    let ok = r.passed();
                    failures += usize::from(!ok);
                    let detail = match r.first_difference {
                        None => "identical".to_string(),
                        Some((i, gap)) => {
                            format!("differ from token {i} (CPU logit gap {gap:.2e})")
                        }
                    };
                    println!(
                        "{:<8} {:<8} {detail}  {}",
                        arch.name(),
                        ty,
                        if ok { "ok" } else { "FAIL" }
                    );
                }
                Err(e) => {
                    failures += 1;
                    println!("{:<8} {:<8} ERROR {e:#}", arch.name(), ty);
                }
            }
        }
    }
    failures += check_invariant_steps(&args, seed);
    failures += moe_checks(&args, seed, positions);
    println!(
        "sampled generation, {} tokens drawn on the GPU (t 0.9, top-k 40, top-p 0.95, min-p 0.05, penalties) vs the host's definition on the same logits (teacher-forced, same seed): pass if every other draw is at an interval's edge (u or top-p moved by 1e-6) and those are <= 5%:",
        args.generate
    );
    for (ia, arch) in ARCHS.into_iter().enumerate() {
        for ty in ["f16", "q4_k_m"] {
            let case_seed = seed.wrapping_add(15_000 + ia as u64);
            match selfcheck::compare_sampled(arch, ty, args.generate, case_seed, args.gpu) {
                Ok(r) => {
                    let ok = r.passed();
                    failures += usize::from(!ok);
                    println!(
                        "sampled  {:<8} {:<8} {} tokens, {} at an interval's edge, {} wrong  {}",
                        arch.name(),
                        ty,
                        r.tokens,
                        r.edge,
                        r.wrong,
                        if ok { "ok" } else { "FAIL" }
                    );
                }
                Err(e) => {
                    failures += 1;
                    println!("sampled  {:<8} {:<8} ERROR {e:#}", arch.name(), ty);
                }
            }
        }
    }
    failures += check_graphs(&args, seed);
    failures += check_hybrids(&args, seed);
    println!("total {:.1} s", start.elapsed().as_secs_f64());
    verdict(failures, "GPU")
}

/// Graph replay against eager launches: single-token steps, then batched decode steps of
/// more sequences than the tensor-core kernels take (through cuBLAS, recorded). Returns
/// the failures.
fn print_chain_report(
    failures: &mut usize,
    label: &str,
    r: anyhow::Result<selfcheck::ChainReport>,
) {
    match r {
        Ok(r) => {
            *failures += usize::from(!r.passed());
            println!(
                "{label}: {} ids, {} replays, differing {:?}  {}",
                r.ids,
                r.replays,
                r.differing,
                if r.passed() { "ok" } else { "FAIL" }
            );
        }
        Err(e) => {
            *failures += 1;
            println!("{label}: ERROR {e:#}");
        }
    }
}

fn check_graphs(args: &Args, seed: u64) -> usize {
    let mut failures = 0;
    let row = |failures: &mut usize, what: String, r: anyhow::Result<selfcheck::GraphReport>| {
        *failures += usize::from(!print_graph_report(&what, r));
    };
    println!(
        "graph replay vs eager launches, {} single-token steps:",
        args.generate
    );
    for (ia, arch) in ARCHS.into_iter().enumerate() {
        for ty in ["f32", "q4_k_m", "q8_0"] {
            let case_seed = seed.wrapping_add(20_000 + ia as u64);
            let r = selfcheck::compare_graph_replay(arch, ty, args.generate, case_seed, args.gpu);
            row(&mut failures, format!("{:<8} {:<8}", arch.name(), ty), r);
        }
    }
    println!(
        "chained greedy decoding vs step-by-step, {} steps (ids, tokens, blocks, next logits bit for bit):",
        args.generate
    );
    let chain_cases = ARCHS
        .into_iter()
        .flat_map(|a| [(a, "q4_k_m"), (a, "f32")])
        .chain([
            (kestrel_model::Arch::Qwen3Moe, "q4_k_m"),
            (kestrel_model::Arch::GptOss, "mxfp4"),
        ]);
    for (i, (arch, ty)) in chain_cases.enumerate() {
        let label = format!("{:<8} {:<8} chained", arch.name(), ty);
        let s = seed.wrapping_add(22_000 + i as u64);
        print_chain_report(
            &mut failures,
            &label,
            selfcheck::compare_chained(arch, ty, args.generate, s, args.gpu),
        );
    }
    println!("the scheduler's chained steps vs plain steps (log-probabilities asked), greedy ids:");
    for (i, (arch, ty, seqs)) in [
        (kestrel_model::Arch::Llama, "q4_k_m", 1),
        (kestrel_model::Arch::Llama, "q4_k_m", 3),
        (kestrel_model::Arch::Qwen3Moe, "q4_k_m", 4),
        (kestrel_model::Arch::Gemma3, "q8_0", 8),
    ]
    .into_iter()
    .enumerate()
    {
        let label = format!(
            "{:<8} {:<8} {seqs} requests, scheduler chained",
            arch.name(),
            ty
        );
        let s = seed.wrapping_add(23_000 + i as u64);
        match selfcheck::compare_scheduler_chained(arch, ty, seqs, args.generate, s, args.gpu) {
            Ok(r) => {
                failures += usize::from(!r.passed());
                println!(
                    "{label}: {} chained steps, ids {}  {}",
                    r.chained_steps,
                    if r.chained == r.plain {
                        "equal"
                    } else {
                        "DIFFER"
                    },
                    if r.passed() { "ok" } else { "FAIL" }
                );
            }
            Err(e) => {
                failures += 1;
                println!("{label}: ERROR {e:#}");
            }
        }
    }
    const STEPS: usize = 8;
    println!("graph replay vs eager launches, {STEPS} batched decode steps (cuBLAS in the graph):");
    for (ia, arch) in ARCHS.into_iter().enumerate() {
        for (it, ty) in ["f32", "q4_k_m", "q8_0"].into_iter().enumerate() {
            for seqs in [37, 64] {
                let case_seed = seed.wrapping_add(21_000 + (ia * 10 + it) as u64 + seqs as u64);
                let r = selfcheck::compare_graph_replay_batched(
                    arch, ty, seqs, STEPS, case_seed, args.gpu,
                );
                row(
                    &mut failures,
                    format!("{:<8} {:<8} {seqs:>2} seqs", arch.name(), ty),
                    r,
                );
            }
        }
    }
    failures
}

/// A weight type and the token-count cases of one product check: (rows, cols, tokens, seed).
type Cases = fn(GgmlType, u64) -> Vec<(usize, usize, usize, u64)>;

/// Why a product check's case fails besides its error bound (it took another kernel than
/// the one the row names): `None` when it ran where it should.
type Expect = fn(&GemvReport, usize) -> Option<String>;

/// One row of the product checks: the weights of `types` times random activations of each
/// case, against an f64 oracle, with the backend's choices set as the row says.
struct ProductCheck {
    kind: &'static str,
    types: &'static [GgmlType],
    cases: Cases,
    product: Product,
    /// 8-bit activations: `Some(false)` forces them off (the f32 GEMVs), `Some(true)` needs
    /// them (the row is left out when they are off by default), `None` as by default.
    q8: Option<bool>,
    /// Whether `mmk_t8*` takes K-quant steps of up to 8 tokens (off: `mmq_t8`, as for the
    /// LM head).
    mmk: bool,
    /// Forced rows per warp of single-token `gemv_q8` launches, each case run once per entry
    /// (0: by launch; small test launches would otherwise all take one row a warp).
    row_variants: &'static [usize],
    expect: Expect,
}

const K_QUANTS: &[GgmlType] = &[GgmlType::Q4K, GgmlType::Q6K];

/// The attention kernels against f64 over the values each cache holds (every shape of
/// `ATTN_SHAPES` and cache type, a short and two long caches; then the deep f16 and q8_0
/// caches of `ATTN_DEEP`), gpt-oss's sinks, and `store_kv_q` against the CPU's quantizer, on a
/// backend of their own: the count of failed checks.
fn check_attention(args: &Args, seed: u64, positions: usize) -> anyhow::Result<usize> {
    let backend = kestrel_cuda::CudaBackend::new(args.gpu)?;
    let mut failures = 0usize;
    for (is, &heads) in selfcheck::ATTN_SHAPES.iter().enumerate() {
        for (ik, (k, v)) in selfcheck::ATTN_CACHE_TYPES.into_iter().enumerate() {
            let case_seed = seed.wrapping_add(1_100 + (is * 10 + ik) as u64);
            let kv = kestrel_model::KvTypes { k, v };
            let (h, hk, d) = heads;
            // A short cache and two long ones (64 splits of 33 keys: chunks cut by the split's
            // end; the last split empty).
            for len in [
                40 + positions,
                selfcheck::ATTN_EMPTY_SPLIT_POSITIONS,
                selfcheck::ATTN_LONG_POSITIONS,
            ] {
                failures += print_attention_report(
                    &format!("attn f64 {h}/{hk}/{d:<6} kv {k}/{v}"),
                    selfcheck::compare_attention_cache(&backend, heads, kv, len, case_seed),
                );
            }
            // gpt-oss's attention: sinks, over all keys, a 16-key window and gpt-oss's
            // 128; a short cache and 301 positions (a 133-token chunk: tiles cut by the
            // window's edge).
            for (window, n) in [None, Some(16), Some(128)]
                .into_iter()
                .flat_map(|w| [(w, 40 + positions), (w, 301)])
            {
                failures += print_attention_report(
                    &format!("sinks    {h}/{hk}/{d:<6} kv {k}/{v} window {window:?}"),
                    selfcheck::compare_attention_sinks(&backend, heads, kv, n, window, case_seed),
                );
            }
            match selfcheck::compare_store_kv(&backend, heads, kv, 37, case_seed) {
                Ok(r) => {
                    failures += usize::from(!r.passed());
                    println!(
                        "store    {h}/{hk}/{d:<6} kv {k}/{v}: {} of {} bytes differ{}  {}",
                        r.differing,
                        r.bytes,
                        r.first
                            .map(|(t, what, b)| format!(" (first: token {t} {what} byte {b})"))
                            .unwrap_or_default(),
                        if r.passed() { "ok" } else { "FAIL" }
                    );
                }
                Err(e) => {
                    failures += 1;
                    println!("store    {h}/{hk}/{d:<6} kv {k}/{v}: ERROR {e:#}");
                }
            }
        }
    }
    // Deep caches, f16 and q8_0: many 16-key chunks a warp (the tiled kernels' rings wrap),
    // 1 to 64 splits, groups of 1, 4 and 8 query heads.
    for (id, &(heads, len)) in selfcheck::ATTN_DEEP.iter().enumerate() {
        for (ik, t) in [kestrel_model::KvType::F16, kestrel_model::KvType::Q8_0]
            .into_iter()
            .enumerate()
        {
            let kv = kestrel_model::KvTypes { k: t, v: t };
            let (h, hk, d) = heads;
            let case_seed = seed.wrapping_add(1_180 + (id * 2 + ik) as u64);
            failures += print_attention_report(
                &format!("attn f64 {h}/{hk}/{d:<6} kv {t}/{t} deep"),
                selfcheck::compare_attention_cache(&backend, heads, kv, len, case_seed),
            );
        }
    }
    Ok(failures)
}

/// Any path.
/// Prints one attention-vs-f64 case under `label`; returns 1 when it failed or errored.
fn print_attention_report(label: &str, result: anyhow::Result<selfcheck::AttnReport>) -> usize {
    match result {
        Ok(r) => {
            println!(
                "{label}: steps {:?} at {} positions, max|Δ| {:.3e} (chunk {:.3e}) of {:.3e}  {}",
                r.steps,
                r.positions,
                r.max_abs_diff,
                r.chunk_abs_diff,
                r.max_abs_out,
                if r.passed() { "ok" } else { "FAIL" }
            );
            usize::from(!r.passed())
        }
        Err(e) => {
            println!("{label}: ERROR {e:#}");
            1
        }
    }
}

fn anywhere(_: &GemvReport, _: usize) -> Option<String> {
    None
}

/// Default single-token products of Q4_K / Q6_K: `gemv_ws`.
fn on_ws(r: &GemvReport, variant: usize) -> Option<String> {
    let k_quant = matches!(r.ty, GgmlType::Q4K | GgmlType::Q6K);
    (variant == 0 && r.tokens == 1 && k_quant && !r.via_ws)
        .then(|| format!("{}x{} n=1 did not run on gemv_ws", r.rows, r.cols))
}

/// On 8-bit activations, quantized per 256 values exactly when `per_256`.
fn on_q8(r: &GemvReport, per_256: bool) -> Option<String> {
    let (rows, cols, n) = (r.rows, r.cols, r.tokens);
    if !r.via_q8 {
        return Some(format!(
            "{rows}x{cols} n={n} did not run on 8-bit activations"
        ));
    }
    (per_256 != r.via_mmk).then(|| {
        format!(
            "{rows}x{cols} n={n}: activations per 256 {} (expected the other way)",
            if r.via_mmk { "ran" } else { "did not run" }
        )
    })
}

fn on_mmq(r: &GemvReport, _: usize) -> Option<String> {
    on_q8(r, false)
}

fn on_mmk(r: &GemvReport, _: usize) -> Option<String> {
    on_q8(r, true)
}

fn on_mms(r: &GemvReport, _: usize) -> Option<String> {
    on_q8(r, true).or_else(|| {
        (!r.via_mms).then(|| format!("{}x{} n={} did not run on mms_*", r.rows, r.cols, r.tokens))
    })
}

/// The product checks, one row per kernel family (its types, cases and expected path).
const PRODUCT_CHECKS: &[ProductCheck] = &[
    ProductCheck {
        kind: "gemv",
        types: &selfcheck::GEMV_TYPES,
        cases: selfcheck::gemv_cases,
        product: Product::Plain,
        q8: None,
        mmk: true,
        row_variants: &[0, 1, 2],
        expect: on_ws,
    },
    // Single-token products of the Q8-capable formats run on 8-bit activations by default:
    // checked with that path off too.
    ProductCheck {
        kind: "gemv-f32",
        types: &selfcheck::GEMV_TYPES,
        cases: selfcheck::gemv_cases,
        product: Product::Plain,
        q8: Some(false),
        mmk: true,
        row_variants: &[0],
        expect: anywhere,
    },
    // Single-token gate/up launches (gate and up read together; `gemv_ws` for Q4_K).
    ProductCheck {
        kind: "gemv-gated",
        types: &selfcheck::Q8_GEMV_TYPES,
        cases: selfcheck::gemv_cases,
        product: Product::Gated,
        q8: Some(true),
        mmk: true,
        row_variants: &[0, 1, 2],
        expect: anywhere,
    },
    // Steps of 3..=32 tokens of those formats run on the tensor cores: `mmq_t8` (int8 per
    // 32 values), for Q4_K / Q6_K `mmk_t8*` (per 256 values, up to 8 tokens) and `mms_*`
    // (from 9, staged in shared memory); "-gated": gate and up in one launch.
    ProductCheck {
        kind: "mmq",
        types: &selfcheck::MMQ_TYPES,
        cases: selfcheck::mmq_cases,
        product: Product::Plain,
        q8: Some(true),
        mmk: false,
        row_variants: &[0],
        expect: on_mmq,
    },
    ProductCheck {
        kind: "mmq-gated",
        types: &selfcheck::MMQ_TYPES,
        cases: selfcheck::mmq_cases,
        product: Product::Gated,
        q8: Some(true),
        mmk: false,
        row_variants: &[0],
        expect: on_mmq,
    },
    ProductCheck {
        kind: "mmk",
        types: K_QUANTS,
        cases: |_, seed| selfcheck::mmk_cases(seed),
        product: Product::Plain,
        q8: Some(true),
        mmk: true,
        row_variants: &[0],
        expect: on_mmk,
    },
    ProductCheck {
        kind: "mmk-gated",
        types: K_QUANTS,
        cases: |_, seed| selfcheck::mmk_cases(seed),
        product: Product::Gated,
        q8: Some(true),
        mmk: true,
        row_variants: &[0],
        expect: on_mmk,
    },
    ProductCheck {
        kind: "mms",
        types: K_QUANTS,
        cases: |_, seed| selfcheck::mms_cases(seed),
        product: Product::Plain,
        q8: Some(true),
        mmk: true,
        row_variants: &[0],
        expect: on_mms,
    },
    ProductCheck {
        kind: "mms-gated",
        types: K_QUANTS,
        cases: |_, seed| selfcheck::mms_cases(seed),
        product: Product::Gated,
        q8: Some(true),
        mmk: true,
        row_variants: &[0],
        expect: on_mms,
    },
    // Residual adds (the attention output and the down projection): single-token and
    // tensor-core kernels add into the residual themselves, cuBLAS with beta = 1.
    ProductCheck {
        kind: "gemv-add",
        types: &selfcheck::Q8_GEMV_TYPES,
        cases: selfcheck::gemv_cases,
        product: Product::AddInto,
        q8: None,
        mmk: true,
        row_variants: &[0],
        expect: anywhere,
    },
    ProductCheck {
        kind: "mms-add",
        types: K_QUANTS,
        cases: |_, seed| selfcheck::mms_cases(seed),
        product: Product::AddInto,
        q8: Some(true),
        mmk: true,
        row_variants: &[0],
        expect: on_mms,
    },
    ProductCheck {
        kind: "gemm",
        types: kestrel_cuda::SUPPORTED_TYPES,
        cases: selfcheck::gemm_cases,
        product: Product::Plain,
        q8: None,
        mmk: true,
        row_variants: &[0],
        expect: anywhere,
    },
    ProductCheck {
        kind: "gemm-add",
        types: &selfcheck::MMQ_TYPES,
        cases: selfcheck::gemm_cases,
        product: Product::AddInto,
        q8: None,
        mmk: true,
        row_variants: &[0],
        expect: anywhere,
    },
];

/// Batch-invariant steps (speculative verification) of every architecture and type against
/// those tokens one step each, then greedy generation with prompt lookup against plain; the
/// failures.
fn check_invariant_steps(args: &Args, seed: u64) -> usize {
    let mut failures = 0;
    println!(
        "batch-invariant steps (speculative verification): steps of 8, 5, 2 tokens vs those tokens one step each, pass if every logit is bit-identical; then greedy ids with prompt lookup vs plain:"
    );
    for (ia, arch) in ARCHS.into_iter().enumerate() {
        for ty in ["q4_k_m", "q8_0", "q4_0", "f16", "q5_k", "iq4_xs"] {
            let case_seed = seed.wrapping_add(12_000 + 16 * ia as u64);
            match selfcheck::compare_invariant(arch, ty, case_seed, args.gpu) {
                Ok(r) => {
                    let ok = r.passed();
                    failures += usize::from(!ok);
                    let ids = if r.spec == r.plain {
                        "ids equal"
                    } else {
                        "IDS DIFFER"
                    };
                    println!(
                        "{:<8} {:<8} {} rows, {} differ (max |Δ| {:.2e}); {ids}, {} drafted  {}",
                        arch.name(),
                        ty,
                        r.rows,
                        r.differing,
                        r.max_abs_diff,
                        r.drafted,
                        if ok { "ok" } else { "FAIL" }
                    );
                }
                Err(e) => {
                    failures += 1;
                    println!("{:<8} {:<8} ERROR {e:#}", arch.name(), ty);
                }
            }
        }
    }
    failures
}

/// Verification steps' products (batch-invariant, 2..=8 tokens) against each token's row as
/// a single-token product, bit for bit (plain, gated, added into a residual); the failures.
fn check_invariant_products(backend: &CudaBackend, seed: u64) -> usize {
    println!(
        "verification-step products (batch-invariant, 2..=8 tokens) vs each token as a single-token product: pass if every value is bit-identical:"
    );
    let mut failures = 0;
    for (it, &ty) in selfcheck::INVARIANT_TYPES.iter().enumerate() {
        for (kind, product) in [
            ("plain", Product::Plain),
            ("gated", Product::Gated),
            ("add", Product::AddInto),
        ] {
            let (mut values, mut differing, mut max_abs, mut non_finite) = (0, 0, 0.0f32, 0);
            let mut kernels = Vec::new();
            let mut error = None;
            let case_seed = seed.wrapping_add(900 + it as u64);
            let counts: Vec<usize> = (2..=kestrel_cuda::INVARIANT_MAX_TOKENS).collect();
            for (rows, cols, s) in selfcheck::invariant_cases(ty, case_seed) {
                match selfcheck::compare_gemv_invariant(
                    backend, ty, rows, cols, &counts, s, product,
                ) {
                    Ok(r) => {
                        values += r.values;
                        differing += r.differing;
                        non_finite += r.non_finite;
                        max_abs = max_abs.max(r.max_abs_diff);
                        let k = format!("{:?}", r.kernel);
                        if !kernels.contains(&k) {
                            kernels.push(k);
                        }
                    }
                    Err(e) => error = Some(format!("{rows}x{cols}: {e:#}")),
                }
            }
            let ok = error.is_none() && values > 0 && differing == 0 && non_finite == 0;
            failures += usize::from(!ok);
            match error {
                Some(e) => println!("verify-{kind} {:<6} ERROR {e}", ty.name()),
                None => println!(
                    "verify-{kind} {:<6} {values} values (single-token {}): {differing} differ (max |Δ| {max_abs:.2e}), {non_finite} non-finite  {}",
                    ty.name(),
                    kernels.join("/"),
                    if ok { "ok" } else { "FAIL" }
                ),
            }
        }
    }
    failures
}

/// Every row of [`PRODUCT_CHECKS`], then `mmw_gated` (Q4_K gate/up of 33..=64 tokens on the
/// repacked 4-bit copies, 1..=8 warps a block forced on some cases); the failures.
fn check_products(backend: &CudaBackend, seed: u64) -> usize {
    println!(
        "matmul kernels vs f64 oracle: pass if ‖Δ‖/‖ref‖ <= {:.0e} (gemv, ≤ {} tokens) or {:.0e} (gemm, f16 operands{})",
        selfcheck::MAX_GEMV_REL_ERR,
        kestrel_cuda::GEMV_MAX_TOKENS,
        selfcheck::MAX_GEMM_REL_ERR,
        if backend.uses_cublas() {
            ", cuBLAS"
        } else {
            "; cuBLAS absent: matmul kernel"
        }
    );
    let q8_default = backend.q8_decode();
    let mut failures = 0;
    let rows = PRODUCT_CHECKS
        .iter()
        .filter(|c| c.q8 != Some(true) || q8_default)
        .flat_map(|c| c.types.iter().map(move |&ty| (c, ty)));
    for (it, (check, ty)) in rows.enumerate() {
        backend.set_q8_decode(check.q8.unwrap_or(q8_default));
        backend.set_mmk(check.mmk);
        let mut worst: Option<GemvReport> = None;
        let mut error = None;
        let cases = (check.cases)(ty, seed.wrapping_add(500 + it as u64));
        for (rows, cols, n, s) in cases {
            for &variant in check.row_variants {
                backend.set_gemv_q8_rows(variant);
                let result = selfcheck::compare_gemv(backend, ty, rows, cols, n, s, check.product);
                backend.set_gemv_q8_rows(0);
                match result {
                    Ok(r) => {
                        if let Some(e) = (check.expect)(&r, variant) {
                            error = Some(e);
                        }
                        failures += usize::from(!r.passed());
                        if worst
                            .as_ref()
                            .is_none_or(|w| r.rel_err > w.rel_err || !r.passed())
                        {
                            worst = Some(r);
                        }
                    }
                    Err(e) => error = Some(format!("{e:#}")),
                }
            }
        }
        let kind = check.kind;
        if let Some(e) = error {
            failures += 1;
            println!("{kind} {:<6} ERROR {e}", ty.name());
        } else if let Some(r) = worst {
            println!(
                "{kind} {:<6} worst {}x{} n={}{}: rel err {:.2e}{}  {}",
                ty.name(),
                r.rows,
                r.cols,
                r.tokens,
                if r.via_mmk {
                    " (8-bit activations per 256)"
                } else if r.via_q8 {
                    " (8-bit activations)"
                } else if r.via_cublas {
                    " (cuBLAS, f16)"
                } else {
                    ""
                },
                r.rel_err,
                non_finite_note(&r),
                if r.passed() { "ok" } else { "FAIL" }
            );
        }
    }
    backend.set_q8_decode(q8_default);
    backend.set_mmk(true);
    failures += check_invariant_products(backend, seed);
    let ty = GgmlType::Q4K;
    for (rows, cols, n, s, warps) in selfcheck::mmw_cases(seed.wrapping_add(880)) {
        backend.set_mmw_warps(warps);
        let result = selfcheck::compare_gemv(backend, ty, rows, cols, n, s, Product::Gated);
        backend.set_mmw_warps(0);
        let ok = result.as_ref().is_ok_and(|r| r.passed() && r.via_mmw);
        failures += usize::from(!ok);
        match result {
            Ok(r) => println!(
                "mmw-gated Q4_K {rows}x{cols} n={n} warps={warps}: rel err {:.2e}{}{}  {}",
                r.rel_err,
                if r.via_mmw {
                    ""
                } else {
                    " (did not run on mmw_gated)"
                },
                non_finite_note(&r),
                if ok { "ok" } else { "FAIL" }
            ),
            Err(e) => println!("mmw-gated Q4_K {rows}x{cols} n={n}: ERROR {e:#}"),
        }
    }
    failures
}

/// " (N non-finite)" when a product left outputs non-finite.
fn non_finite_note(r: &GemvReport) -> String {
    if r.non_finite > 0 {
        format!(" ({} non-finite)", r.non_finite)
    } else {
        String::new()
    }
}
