//! `kestrel gpu-check`: the CUDA backend against the CPU backend on tiny synthetic models of
//! every architecture and weight type (teacher-forced logits, then greedy generations).

use std::time::Instant;

use kestrel_gpu_check::{self as selfcheck, ARCHS, MAX_REL_DIFF, MIN_TOP1_AGREEMENT, TYPES};

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
    /// Instead of the checks, time plain reads of the byte counts a Llama-3-8B Q4_K_M
    /// decode step's launches stream (the per-launch read ceiling, launch and ramp
    /// included).
    #[arg(long)]
    pub read_bw: bool,
    /// Instead of the checks, only the persistent single-token kernel's: the tiny models,
    /// then each of these GGUF models (real shapes), each against separate launches.
    #[arg(long, num_args = 0.., value_name = "GGUF")]
    pub mega: Option<Vec<std::path::PathBuf>>,
    /// With `--mega FILE`: the CPU backend's logits as the oracle too (slow on large models).
    #[arg(long)]
    pub mega_cpu: bool,
}

/// `--read-bw`: µs and GB/s of a read-only kernel over each size, back to back and alone.
fn read_bw(args: &Args) -> anyhow::Result<()> {
    let backend = kestrel_cuda::CudaBackend::new(args.gpu)?;
    println!(
        "device {}: read-only launches (read_bytes)",
        backend.device_name()
    );
    println!(
        "{:>24} {:>10} {:>14} {:>10} {:>14} {:>10}",
        "bytes", "MB", "µs (b2b)", "GB/s", "µs (alone)", "GB/s"
    );
    // Llama-3-8B Q4_K_M single-token launches: o (Q4_K), QKV, down (Q6_K half the
    // layers), gate/up, LM head (Q6_K, padded); then 1 GB.
    let sizes: [(&str, usize); 7] = [
        ("o 4096x4096 q4_K", 4096 * 16 * 144),
        ("qkv 6144x4096", 5120 * 16 * 144 + 1024 * 16 * 224),
        ("down 4096x14336 q4_K", 4096 * 56 * 144),
        ("down 4096x14336 q6_K", 4096 * 56 * 224),
        ("gate/up 2x14336x4096", 2 * 14336 * 16 * 144),
        ("lm head 128256x4096", 128256 * 16 * 224),
        ("1 GB", 1 << 30),
    ];
    for (name, bytes) in sizes {
        let launches = (2_000_000_000 / bytes).clamp(4, 200);
        let (b2b, alone) = backend.read_launch_us(bytes, launches)?;
        let gbs = |us: f64| bytes as f64 / us / 1e3;
        println!(
            "{name:>24} {:>10.1} {b2b:>14.2} {:>10.0} {alone:>14.2} {:>10.0}",
            bytes as f64 / 1e6,
            gbs(b2b),
            gbs(alone)
        );
    }
    Ok(())
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

/// Prints one comparison's line (`label`, then max |Δ|, top-1 agreement and ok / FAIL, or
/// the error); true when it passed.
fn print_logit_report(label: &str, result: anyhow::Result<selfcheck::LogitReport>) -> bool {
    match result {
        Ok(r) => {
            let ok = r.passed();
            println!(
                "{label} max|Δ| {:.3e} of {:.3e}, top-1 {:.2}% ({:.2}% w/ ties)  {}",
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

pub fn run(args: Args) -> anyhow::Result<()> {
    if args.read_bw {
        return read_bw(&args);
    }
    if let Some(path) = &args.bench {
        return bench(&args, path);
    }
    let seed = args.seed.unwrap_or_else(rand::random);
    if let Some(files) = &args.mega {
        return mega_only(&args, files, seed);
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
    let mut failures = 0;
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
    // Single-token products of the Q8-capable formats run on 8-bit activations by default:
    // check them with that path off too ("gemv-f32").
    let q8_default = backend.q8_decode();
    let gemv = selfcheck::GEMV_TYPES.into_iter().map(|ty| ("gemv", ty));
    let gemv_f32 = selfcheck::GEMV_TYPES
        .into_iter()
        .filter(|_| q8_default)
        .map(|ty| ("gemv-f32", ty));
    // Single-token gate/up launches (gate and up read together; `gemv_ws` for Q4_K).
    let gemv_gated = selfcheck::MMQ_TYPES
        .into_iter()
        .filter(|_| q8_default)
        .map(|ty| ("gemv-gated", ty));
    // Steps of 3..=64 tokens of those formats run on the tensor cores: int8 ("mmq"), or
    // for Q4_K / Q6_K on f16 operands ("mmh") and on int8 with activations quantized per
    // 256 values, up to 8 tokens ("mmk") and from 9 staged in shared memory ("mms");
    // "-gated": the gate and up matrices of a feed-forward block in one launch.
    let mmq = selfcheck::MMQ_TYPES
        .into_iter()
        .filter(|_| q8_default)
        .flat_map(|ty| {
            let mut kinds = vec![("mmq", ty), ("mmq-gated", ty)];
            if matches!(
                ty,
                kestrel_gguf::GgmlType::Q4K | kestrel_gguf::GgmlType::Q6K
            ) {
                kinds.extend([
                    ("mmh", ty),
                    ("mmh-gated", ty),
                    ("mmk", ty),
                    ("mmk-gated", ty),
                    ("mms", ty),
                    ("mms-gated", ty),
                ]);
            }
            kinds
        });
    let gemm = kestrel_cuda::SUPPORTED_TYPES.iter().map(|&ty| ("gemm", ty));
    for (it, (kind, ty)) in gemv
        .chain(gemv_f32)
        .chain(gemv_gated)
        .chain(mmq)
        .chain(gemm)
        .enumerate()
    {
        backend.set_q8_decode(q8_default && kind != "gemv-f32");
        // Gated Q4_K steps of 33..=64 tokens would take mmw_gated (checked below).
        let mmw_default = backend.mmw_min();
        backend.set_mmw_min(usize::MAX);
        let mmq_default = (
            backend.mmq_max(),
            backend.mmq_all_formats(),
            backend.mmh_min(),
            backend.mmk_mode(),
            backend.mms(),
        );
        if kind.starts_with("mm") {
            backend.set_mmq_max(kestrel_cuda::MMQ_MAX_TOKENS);
            backend.set_mmq_all_formats(true);
            backend.set_mmh_min(match kind {
                _ if kind.starts_with("mmh") => 1,
                _ if kind.starts_with("mms") => 9,
                _ => usize::MAX,
            });
            backend.set_mms(kind.starts_with("mms"));
            // "mmq" checks the per-32 int8 kernels, which "mmk" replaces where it applies.
            backend.set_mmk_mode(if kind.starts_with("mmk") { 2 } else { 0 });
        }
        let mut worst: Option<selfcheck::GemvReport> = None;
        let mut error = None;
        let case_seed = seed.wrapping_add(500 + it as u64);
        let cases = if kind.starts_with("gemv") {
            selfcheck::gemv_cases(ty, case_seed)
        } else if kind.starts_with("mmk") {
            selfcheck::mmk_cases(case_seed)
        } else if kind.starts_with("mms") {
            selfcheck::mms_cases(case_seed)
        } else if kind.starts_with("mm") {
            selfcheck::mmq_cases(ty, case_seed)
        } else {
            selfcheck::gemm_cases(ty, case_seed)
        };
        // Single-token 8-bit products: each rows-per-warp variant of gemv_q8 (small test
        // launches would otherwise all take one row a warp).
        let gemv_rows_default = backend.gemv_q8_rows();
        // `mmk_t8`: with and without the next step's weights loaded ahead (variants 1, 2).
        // cuBLAS products (`gemm`): variant 1 on a cuBLASLt algorithm even where
        // cublasGemmEx is faster (small products would otherwise keep it).
        let row_variants: &[usize] = match kind {
            "gemv" | "gemv-gated" => &[0, 1, 2],
            "mmk" => &[1, 2],
            "gemm" if backend.has_cublaslt() => &[0, 1],
            _ => &[0],
        };
        let runs = cases
            .into_iter()
            .flat_map(|case| row_variants.iter().map(move |&v| (case, v)));
        for ((rows, cols, n, s), variant) in runs {
            if kind == "mmk" {
                backend.set_mmk_mode(variant as u8);
            } else if kind == "gemm" {
                backend.set_gemm_force_lt(variant == 1);
            } else if variant != 0 {
                backend.set_gemv_q8_rows(variant);
            }
            let result = selfcheck::compare_gemv(
                &backend,
                ty,
                rows,
                cols,
                n,
                s,
                if kind.ends_with("-gated") {
                    selfcheck::Product::Gated
                } else {
                    selfcheck::Product::Plain
                },
            );
            backend.set_gemv_q8_rows(gemv_rows_default);
            backend.set_gemm_force_lt(false);
            if kind == "mmk" {
                backend.set_mmk_mode(2);
            }
            match result {
                Ok(r) => {
                    // An mmq case that took another path tests nothing it names.
                    if kind.starts_with("mmq") && !r.via_q8 {
                        error = Some(format!(
                            "{rows}x{cols} n={n} did not run on 8-bit activations"
                        ));
                    }
                    let per_256 = kind.starts_with("mmk") || kind.starts_with("mms");
                    if kind.starts_with("mm") && per_256 != r.via_mmk {
                        error = Some(format!(
                            "{rows}x{cols} n={n}: activations per 256 {} (expected the other way)",
                            if r.via_mmk { "ran" } else { "did not run" }
                        ));
                    }
                    // Default single-token products of Q4_K / Q6_K (rows per warp not forced,
                    // e.g. by KESTREL_CUDA_GEMV): gemv_ws.
                    if kind == "gemv"
                        && variant == 0
                        && n == 1
                        && matches!(
                            ty,
                            kestrel_gguf::GgmlType::Q4K | kestrel_gguf::GgmlType::Q6K
                        )
                        && backend.gemv_ws()
                        && backend.gemv_q8_rows() == 0
                        && !r.via_ws
                    {
                        error = Some(format!("{rows}x{cols} n=1 did not run on gemv_ws"));
                    }
                    if kind.starts_with("mms") && !r.via_mms {
                        error = Some(format!("{rows}x{cols} n={n} did not run on mms_*"));
                    }
                    if kind.starts_with("mmh") && !r.via_mmh {
                        error = Some(format!(
                            "{rows}x{cols} n={n} did not run on the f16 tensor-core kernels"
                        ));
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
        backend.set_mmq_max(mmq_default.0);
        backend.set_mmq_all_formats(mmq_default.1);
        backend.set_mmh_min(mmq_default.2);
        backend.set_mmk_mode(mmq_default.3);
        backend.set_mms(mmq_default.4);
        backend.set_mmw_min(mmw_default);
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
                } else if r.via_mmh {
                    " (f16 tensor cores)"
                } else if r.via_cublas {
                    " (cuBLAS, f16)"
                } else {
                    ""
                },
                r.rel_err,
                if r.non_finite > 0 {
                    format!(" ({} non-finite)", r.non_finite)
                } else {
                    String::new()
                },
                if r.passed() { "ok" } else { "FAIL" }
            );
        }
    }
    // Q4_K products of 33..=64 tokens on the mmw layout (4-bit weights repacked for f16
    // mma), with 1..=8 warps a block forced on some cases: gate/up on `mmw_gated`, and the
    // opt-in `mmw_add` into a fresh output and into a residual.
    if backend.mmw_min() <= 64 {
        use selfcheck::Product;
        let ty = kestrel_gguf::GgmlType::Q4K;
        let add_default = backend.mmw_add();
        let groups: [(u64, &[Product]); 2] = [
            (880, &[Product::Gated]),
            (890, &[Product::Plain, Product::AddInto]),
        ];
        for (seed_offset, products) in groups {
            backend.set_mmw_add(products[0] != Product::Gated);
            for (rows, cols, n, s, warps) in selfcheck::mmw_cases(seed.wrapping_add(seed_offset)) {
                backend.set_mmw_warps(warps);
                for &product in products {
                    let result = selfcheck::compare_gemv(&backend, ty, rows, cols, n, s, product);
                    let ok = match &result {
                        Ok(r) => r.passed() && r.via_mmw,
                        Err(_) => false,
                    };
                    failures += usize::from(!ok);
                    let (name, kernel) = match product {
                        Product::Gated => ("mmw-gated", "mmw_gated"),
                        Product::Plain => ("mmw", "mmw_add"),
                        Product::AddInto => ("mmw-add", "mmw_add"),
                    };
                    match result {
                        Ok(r) => println!(
                            "{name} Q4_K {rows}x{cols} n={n} warps={warps}: rel err {:.2e}{}{}  {}",
                            r.rel_err,
                            if r.via_mmw {
                                String::new()
                            } else {
                                format!(" (did not run on {kernel})")
                            },
                            if r.non_finite > 0 {
                                format!(" ({} non-finite)", r.non_finite)
                            } else {
                                String::new()
                            },
                            if ok { "ok" } else { "FAIL" }
                        ),
                        Err(e) => println!("{name} Q4_K {rows}x{cols} n={n}: ERROR {e:#}"),
                    }
                }
                backend.set_mmw_warps(0);
            }
        }
        backend.set_mmw_add(add_default);
    } else {
        println!("mmw-gated: off (KESTREL_CUDA_MMW_MIN above 64)");
    }
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
    println!(
        "sampling on the device (sample_rows) vs the host's definition, random rows of 1-151,936 words:"
    );
    for round in 0..3u64 {
        match selfcheck::compare_sampling(&backend, seed.wrapping_add(900 + round)) {
            Ok(r) => {
                let ok = r.passed();
                failures += usize::from(!ok);
                println!(
                    "sample   round {round}: {} rows, {} at an interval's edge, {} wrong  {}{}",
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
                println!("sample   round {round}: ERROR {e:#}");
            }
        }
    }
    drop(backend);
    let positions = args.positions.clamp(1, 512);
    println!(
        "teacher-forced, {positions} positions: pass if top-1 agreement (near-ties of the CPU's logits within {} · max(1, max |logit|) or 2 · max |Δ logit| counted as agreeing) >= {:.1}% and max |Δ logit| <= {MAX_REL_DIFF} · max(1, max |logit|) ({} with 8-bit activations, \"+q8\")",
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
    for (ia, arch) in ARCHS.into_iter().enumerate() {
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
    println!(
        "graph replay vs eager launches, {} single-token steps:",
        args.generate
    );
    for (ia, arch) in ARCHS.into_iter().enumerate() {
        for ty in ["f32", "q4_k_m", "q8_0"] {
            let case_seed = seed.wrapping_add(20_000 + ia as u64);
            match selfcheck::compare_graph_replay(arch, ty, args.generate, case_seed, args.gpu) {
                Ok(r) => {
                    let ok = r.passed();
                    failures += usize::from(!ok);
                    println!(
                        "{:<8} {:<8} {} replays, logits {}  {}",
                        arch.name(),
                        ty,
                        r.replays,
                        if r.identical {
                            "bit-identical"
                        } else {
                            "DIFFER"
                        },
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
    failures += mega_tiny(&args, seed);
    println!("total {:.1} s", start.elapsed().as_secs_f64());
    if failures > 0 {
        anyhow::bail!("{failures} GPU check(s) failed");
    }
    println!("all GPU checks passed");
    Ok(())
}

/// Prints one mega comparison; whether it passed.
fn mega_line(what: &str, r: anyhow::Result<selfcheck::MegaReport>) -> bool {
    match r {
        Ok(r) => {
            let ok = r.passed();
            let cpu = r.cpu.as_ref().map_or(String::new(), |(m, l)| {
                format!(
                    "; against the CPU: kernel top-1 {:.2}% max |Δ| {:.4}, launches top-1 {:.2}% max |Δ| {:.4}",
                    100.0 * m.top1_agreement_ties,
                    m.max_abs_diff,
                    100.0 * l.top1_agreement_ties,
                    l.max_abs_diff
                )
            });
            println!(
                "mega {what:<28} {} programs, top-1 {:.2}% ({:.2}% with ties), max |Δ| {:.4} of {:.2}{cpu}  {}",
                r.programs,
                100.0 * r.logits.top1_agreement,
                100.0 * r.logits.top1_agreement_ties,
                r.logits.max_abs_diff,
                r.logits.max_abs_logit,
                if ok { "ok" } else { "FAIL" }
            );
            ok
        }
        Err(e) => {
            println!("mega {what:<28} ERROR {e:#}");
            false
        }
    }
}

/// The mega checks on tiny models of the architectures it takes; failures.
fn mega_tiny(args: &Args, seed: u64) -> usize {
    println!(
        "persistent single-token kernel (mega) vs launches, 3 + {0} + 40 + {0} positions:",
        args.generate
    );
    let mut failures = 0;
    for (ia, arch) in [selfcheck::ARCHS[0], selfcheck::ARCHS[1]]
        .into_iter()
        .enumerate()
    {
        for ty in ["q4_k_m", "q8_0", "q4_0"] {
            for (ih, heads) in [(8, 2, 128), (6, 1, 64), (12, 2, 128)]
                .into_iter()
                .enumerate()
            {
                let case_seed = seed.wrapping_add(21_000 + 10 * ia as u64 + ih as u64);
                let r =
                    selfcheck::compare_mega(arch, ty, heads, args.generate, case_seed, args.gpu);
                failures += usize::from(!mega_line(&format!("{} {ty} {heads:?}", arch.name()), r));
            }
        }
    }
    failures
}

/// `--mega`: the tiny models' mega checks, then each file's.
fn mega_only(args: &Args, files: &[std::path::PathBuf], seed: u64) -> anyhow::Result<()> {
    use anyhow::Context;
    let mut failures = mega_tiny(args, seed);
    for path in files {
        let file = std::sync::Arc::new(
            kestrel_gguf::GgufFile::open(path)
                .with_context(|| format!("opening {}", path.display()))?,
        );
        let r = selfcheck::compare_mega_file(
            file,
            kestrel_model::Arch::Llama,
            "file",
            args.generate,
            seed,
            args.gpu,
            args.mega_cpu,
        );
        failures += usize::from(!mega_line(&path.display().to_string(), r));
    }
    if failures > 0 {
        anyhow::bail!("{failures} mega check(s) failed");
    }
    println!("all mega checks passed");
    Ok(())
}
