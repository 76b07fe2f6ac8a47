//! The CUDA backend against the CPU backend on tiny synthetic models. Needs a GPU: without
//! one (CI) each test prints a notice and returns.

use kestrel_gpu_check::{self as selfcheck, ARCHS, TYPES};
use rand::Rng;

/// True when a CUDA device can be used; otherwise prints why the test is skipped.
fn gpu_present(test: &str) -> bool {
    gpus(test, 1)
}

/// True when at least `need` CUDA devices can be used; otherwise prints why the test is
/// skipped.
fn gpus(test: &str, need: usize) -> bool {
    match kestrel_cuda::device_count() {
        Ok(n) if n >= need => true,
        Ok(0) => {
            eprintln!("{test}: skipped, no CUDA device");
            false
        }
        Ok(n) => {
            eprintln!("{test}: skipped, {n} CUDA device(s) (needs {need})");
            false
        }
        Err(e) => {
            eprintln!("{test}: skipped, {e:#}");
            false
        }
    }
}

#[test]
fn logits_match_cpu_for_every_arch_and_type() {
    if !gpu_present("logits_match_cpu_for_every_arch_and_type") {
        return;
    }
    let mut rng = rand::rng();
    for arch in ARCHS {
        for ty in TYPES {
            // Awkward lengths: not a multiple of the block size or of the 100-token chunks.
            let n = rng.random_range(130..260);
            let seed = rng.random();
            let r =
                selfcheck::compare_logits(arch, ty, n, seed, 0, false).expect("comparison runs");
            eprintln!(
                "{arch:?} {ty}: max |Δ| {:.2e} (max |logit| {:.2e}), top-1 {:.2}% ({:.2}% with near-ties)",
                r.max_abs_diff,
                r.max_abs_logit,
                r.top1_agreement * 100.0,
                r.top1_agreement_ties * 100.0
            );
            assert!(r.passed(), "{arch:?} {ty} (seed {seed}): {r:?}");
        }
    }
}

#[test]
fn greedy_generation_matches_cpu() {
    if !gpu_present("greedy_generation_matches_cpu") {
        return;
    }
    let mut rng = rand::rng();
    for arch in ARCHS {
        for ty in ["f32", "f16"] {
            let seed = rng.random();
            let r = selfcheck::compare_greedy(arch, ty, 64, seed, 0).expect("generation runs");
            assert!(r.passed(), "{arch:?} {ty} (seed {seed}): {r:?}");
        }
    }
}

#[test]
fn embeddings_match_cpu() {
    if !gpu_present("embeddings_match_cpu") {
        return;
    }
    let mut rng = rand::rng();
    for arch in ARCHS {
        let seed = rng.random();
        let r = selfcheck::compare_embeddings(arch, "f16", seed, 0).expect("embeddings run");
        eprintln!(
            "{arch:?}: {} vectors, min cosine {:.7}, max rel diff {:.2e}",
            r.vectors, r.min_cosine, r.max_rel_diff
        );
        assert!(r.passed(), "{arch:?} (seed {seed}): {r:?}");
    }
}

#[test]
fn verification_steps_are_batch_invariant() {
    if !gpu_present("verification_steps_are_batch_invariant") {
        return;
    }
    let mut rng = rand::rng();
    for arch in ARCHS {
        for ty in ["q4_k_m", "q8_0", "f16", "iq4_xs"] {
            let seed = rng.random();
            let r = selfcheck::compare_invariant(arch, ty, seed, 0).expect("steps run");
            assert!(r.passed(), "{arch:?} {ty} (seed {seed}): {r:?}");
        }
    }
}

/// Each verification-step product (plain, gated, added into a residual) of 2..=8 tokens,
/// on fresh random weights and tokens of awkward row counts, equals its tokens' single-token
/// products bit for bit.
#[test]
fn verification_products_are_bit_identical() {
    if !gpu_present("verification_products_are_bit_identical") {
        return;
    }
    use selfcheck::Product;
    let backend = kestrel_cuda::CudaBackend::new(0).expect("backend");
    let mut rng = rand::rng();
    for ty in selfcheck::INVARIANT_TYPES {
        for product in [Product::Plain, Product::Gated, Product::AddInto] {
            for (rows, cols, seed) in selfcheck::invariant_cases(ty, rng.random()) {
                let counts: Vec<usize> = (2..=kestrel_cuda::INVARIANT_MAX_TOKENS).collect();
                let r = selfcheck::compare_gemv_invariant(
                    &backend, ty, rows, cols, &counts, seed, product,
                )
                .expect("products run");
                assert!(
                    r.passed(),
                    "{ty} {product:?} {rows}x{cols} (seed {seed}): {r:?}"
                );
            }
        }
    }
}

#[test]
fn missing_device_is_an_error_not_a_panic() {
    // Whatever the machine: asking for a device that does not exist must fail cleanly.
    let err = kestrel_cuda::CudaBackend::new(usize::MAX).err();
    assert!(err.is_some(), "device usize::MAX opened");
    eprintln!(
        "expected error: {:#}",
        err.unwrap_or_else(|| anyhow::anyhow!(""))
    );
}

/// Quantized K/V on the GPU: `store_kv_q` writes byte for byte what the CPU backend
/// stores (ggml's Q8_0 rounding; fp8: the reference quantizer), for every decode-attention
/// shape and cache-type pair.
#[test]
fn quantized_cache_store_matches_the_cpu_quantizer() {
    if !gpu_present("quantized_cache_store_matches_the_cpu_quantizer") {
        return;
    }
    let backend = kestrel_cuda::CudaBackend::new(0).expect("backend");
    let mut rng = rand::rng();
    for heads in selfcheck::ATTN_SHAPES {
        for (k, v) in selfcheck::ATTN_CACHE_TYPES {
            let kv = kestrel_model::KvTypes { k, v };
            let (n, seed) = (rng.random_range(1..70), rng.random());
            let r = selfcheck::compare_store_kv(&backend, heads, kv, n, seed).expect("store runs");
            assert!(r.passed(), "{heads:?} {k}/{v} (seed {seed}): {r:?}");
        }
    }
}

/// Attention over f16, q8_0 and fp8 caches (and mixed pairs) in steps of 1, 5 and 40 tokens
/// against f64 attention over the values the cache holds.
#[test]
fn attention_over_every_cache_type_matches_f64() {
    if !gpu_present("attention_over_every_cache_type_matches_f64") {
        return;
    }
    let backend = kestrel_cuda::CudaBackend::new(0).expect("backend");
    let mut rng = rand::rng();
    for heads in selfcheck::ATTN_SHAPES {
        for (k, v) in selfcheck::ATTN_CACHE_TYPES {
            let kv = kestrel_model::KvTypes { k, v };
            // A short cache and long ones (many splits, chunks cut by their ends, an empty
            // last split).
            let empty = selfcheck::ATTN_EMPTY_SPLIT_POSITIONS;
            for range in [
                40..300,
                1_000..selfcheck::ATTN_LONG_POSITIONS,
                empty..empty + 1,
            ] {
                let (n, seed) = (rng.random_range(range), rng.random());
                let r = selfcheck::compare_attention_cache(&backend, heads, kv, n, seed)
                    .expect("attention runs");
                eprintln!(
                    "{heads:?} {k}/{v} {n} positions: max |Δ| {:.2e} (chunk {:.2e}) of {:.2e}",
                    r.max_abs_diff, r.chunk_abs_diff, r.max_abs_out
                );
                assert!(r.passed(), "{heads:?} {k}/{v} (seed {seed}): {r:?}");
            }
        }
    }
}

/// gpt-oss's attention (`attention_sinks`: a logit per head in each softmax's denominator),
/// over all keys and over a sliding window, on every cache type, against f64.
#[test]
fn attention_with_sinks_matches_f64() {
    if !gpu_present("attention_with_sinks_matches_f64") {
        return;
    }
    let backend = kestrel_cuda::CudaBackend::new(0).expect("backend");
    let mut rng = rand::rng();
    for heads in selfcheck::ATTN_SHAPES {
        for (k, v) in selfcheck::ATTN_CACHE_TYPES {
            let kv = kestrel_model::KvTypes { k, v };
            let (n, seed) = (rng.random_range(40..300), rng.random());
            let window = [None, Some(rng.random_range(1..n))][rng.random_range(0..2)];
            let r = selfcheck::compare_attention_sinks(&backend, heads, kv, n, window, seed)
                .expect("attention runs");
            assert!(
                r.passed(),
                "{heads:?} {k}/{v} {window:?} (seed {seed}): {r:?}"
            );
        }
    }
}

/// Logits with a quantized cache on both backends (the GPU reading it through its `_q`
/// attention kernels in decode steps and prompt chunks), within the f16 check's bound.
#[test]
fn quantized_cache_logits_match_cpu() {
    if !gpu_present("quantized_cache_logits_match_cpu") {
        return;
    }
    let mut rng = rand::rng();
    for (ia, arch) in selfcheck::KERNEL_ARCHS.into_iter().enumerate() {
        for (ik, (k, v)) in selfcheck::CACHE_TYPES.into_iter().enumerate() {
            let heads = selfcheck::ATTN_SHAPES[(ia + ik) % selfcheck::ATTN_SHAPES.len()];
            let kv = kestrel_model::KvTypes { k, v };
            let (n, seed) = (rng.random_range(130..260), rng.random());
            let r = selfcheck::compare_logits_cache(arch, "f16", heads, kv, n, seed, 0)
                .expect("comparison runs");
            eprintln!(
                "{arch:?} {heads:?} {k}/{v}: max |Δ| {:.2e} (max |logit| {:.2e}), top-1 {:.2}%",
                r.max_abs_diff,
                r.max_abs_logit,
                r.top1_agreement * 100.0
            );
            assert!(
                r.passed(),
                "{arch:?} {heads:?} {k}/{v} (seed {seed}): {r:?}"
            );
        }
    }
}

/// Several sequences per step over a quantized cache against each alone, on the GPU.
#[test]
fn quantized_cache_batched_equals_alone() {
    if !gpu_present("quantized_cache_batched_equals_alone") {
        return;
    }
    let mut rng = rand::rng();
    for arch in ARCHS {
        for lens in [&[150usize, 2, 33][..], &[1, 2, 3, 5, 8, 13, 21, 34, 55, 89]] {
            let kv = kestrel_model::KvTypes {
                k: kestrel_model::KvType::Q8_0,
                v: kestrel_model::KvType::Q8_0,
            };
            let seed = rng.random();
            let r = selfcheck::compare_batched_cache(
                arch,
                "f16",
                selfcheck::WIDE_HEADS,
                kv,
                lens,
                seed,
                0,
            )
            .expect("comparison runs");
            assert!(r.passed(), "{arch:?} {lens:?} (seed {seed}): {r:?}");
        }
    }
}

/// Tensor parallelism over two GPUs: logits against the CPU and against one GPU, greedy
/// generations against the CPU, for every dense architecture (random seeds, awkward
/// lengths).
#[test]
fn tensor_parallel_matches_one_gpu_and_cpu() {
    if !gpus("tensor_parallel_matches_one_gpu_and_cpu", 2) {
        return;
    }
    let mut rng = rand::rng();
    for arch in selfcheck::TP_ARCHS {
        for &ty in selfcheck::tp_types(arch) {
            let n = rng.random_range(130..260);
            let seed = rng.random();
            let r = selfcheck::compare_tp_logits(arch, ty, n, seed, &[0, 1]).expect("runs");
            eprintln!(
                "tp {arch:?} {ty}: vs CPU max |Δ| {:.2e} top-1 {:.2}%; vs 1 GPU max |Δ| {:.2e} top-1 {:.2}%",
                r.vs_cpu.max_abs_diff,
                r.vs_cpu.top1_agreement_ties * 100.0,
                r.vs_one_gpu.max_abs_diff,
                r.vs_one_gpu.top1_agreement_ties * 100.0
            );
            assert!(r.passed(), "{arch:?} {ty} (seed {seed}): {r:?}");
        }
        let seed = rng.random();
        let g = selfcheck::compare_tp_greedy(arch, "f32", 48, seed, &[0, 1]).expect("runs");
        assert!(g.passed(), "{arch:?} greedy (seed {seed}): {g:?}");
    }
}

/// Tensor parallelism over two GPUs on the tiny qwen3moe (experts 768 wide: ranks of 512
/// and 256) and gpt-oss (832 wide: 416 each; sinks, biases, clamped SwiGLU): logits
/// against the CPU and one GPU with the MoE checks' route-flip allowance, greedy
/// generation against the CPU, decode steps of 37 sequences replayed from graphs against
/// eager launches (bit for bit).
#[test]
fn tensor_parallel_moe_matches_one_gpu_and_cpu() {
    if !gpus("tensor_parallel_moe_matches_one_gpu_and_cpu", 2) {
        return;
    }
    let mut rng = rand::rng();
    for arch in selfcheck::TP_MOE_ARCHS {
        for &ty in selfcheck::tp_types(arch) {
            let n = rng.random_range(130..260);
            let seed = rng.random();
            let r = selfcheck::compare_tp_logits_moe(arch, ty, n, seed, &[0, 1]).expect("runs");
            eprintln!("tp {arch:?} {ty}: {}", r.summary());
            assert!(r.passed(), "{arch:?} {ty} (seed {seed}): {r:?}");
        }
        tp_greedy_and_graph_replay(arch, &mut rng);
    }
}

/// TP=2 greedy generation of `arch` against the CPU, then decode steps of 37 sequences
/// replayed from graphs against eager launches (bit for bit), on fresh seeds.
fn tp_greedy_and_graph_replay(arch: kestrel_model::Arch, rng: &mut impl rand::Rng) {
    let seed = rng.random();
    let g = selfcheck::compare_tp_greedy(arch, "f32", 48, seed, &[0, 1]).expect("runs");
    assert!(g.passed(), "{arch:?} greedy (seed {seed}): {g:?}");
    let seed = rng.random();
    let r = selfcheck::compare_tp_graph_replay_batched(arch, "q4_k_m", 37, 6, seed, &[0, 1])
        .expect("runs");
    assert!(r.passed(), "{arch:?} 37 seqs (seed {seed}): {r:?}");
}

/// Tensor parallelism over two GPUs on the linear-attention hybrids (qwen35, qwen3next,
/// qwen35moe: DeltaNet layers by q/k heads and their v heads, 2 of 4 a rank; the shared
/// expert split): logits against the CPU and one GPU by the one-GPU hybrid checks'
/// criteria, greedy generation against the CPU, decode steps of 37 sequences replayed
/// from graphs against eager launches (bit for bit).
#[test]
fn tensor_parallel_hybrids_match_one_gpu_and_cpu() {
    if !gpus("tensor_parallel_hybrids_match_one_gpu_and_cpu", 2) {
        return;
    }
    let mut rng = rand::rng();
    for arch in selfcheck::TP_HYBRID_ARCHS {
        for ty in selfcheck::HYBRID_TYPES {
            let n = rng.random_range(130..260);
            let seed = rng.random();
            let h = selfcheck::compare_tp_logits_hybrid(arch, ty, n, seed, &[0, 1]).expect("runs");
            eprintln!("tp {arch:?} {ty}: {}", h.report.summary());
            assert!(h.passed(), "{arch:?} {ty} (seed {seed}): {h:?}");
        }
        tp_greedy_and_graph_replay(arch, &mut rng);
    }
}

/// Tensor-parallel decode steps of 37 and 64 sequences (their cuBLAS products and
/// all-reduces recorded into each part's graph) replayed against the same steps launched
/// kernel by kernel: bit-identical logits, and the graphs replayed.
#[test]
fn tensor_parallel_batched_graphs_match_eager() {
    if !gpus("tensor_parallel_batched_graphs_match_eager", 2) {
        return;
    }
    let mut rng = rand::rng();
    for arch in selfcheck::TP_ARCHS {
        for ty in ["f32", "q4_k_m"] {
            for seqs in [37, 64] {
                let seed = rng.random();
                let r =
                    selfcheck::compare_tp_graph_replay_batched(arch, ty, seqs, 6, seed, &[0, 1])
                        .expect("runs");
                assert!(r.passed(), "{arch:?} {ty} {seqs} seqs (seed {seed}): {r:?}");
            }
        }
    }
}

/// The one-shot all-reduce kernel with 2 and 3 ranks as streams of GPU 0 (each on its own
/// host thread, as a group's ranks), random awkward message sizes up to its largest, three
/// calls each (both halves of its exchange buffer): every rank's result within f32
/// rounding of the host's f64 sums.
#[test]
fn oneshot_all_reduce_matches_host_sums() {
    if !gpus("oneshot_all_reduce_matches_host_sums", 1) {
        return;
    }
    let mut rng = rand::rng();
    for ranks in [2, 3] {
        let sizes: Vec<usize> = (0..4)
            .map(|_| 4 * rng.random_range(1..=kestrel_cuda::tp::ONESHOT_MAX_BYTES / 4))
            .chain([4, 4100])
            .collect();
        let got = kestrel_cuda::tp::oneshot_on_one_gpu(0, ranks, &sizes).expect("runs");
        for (bytes, err) in got {
            assert!(err <= 1e-5, "{ranks} ranks, {bytes} bytes: max |Δ| {err:e}");
        }
    }
}

/// The layer split as two stages on GPU 0 (then three), which exercises every boundary
/// copy, event and per-stage cache a split over two GPUs does: logits against the CPU and
/// one GPU, greedy ids equal to one GPU's, for every dense architecture (random seeds,
/// awkward lengths).
#[test]
fn layer_split_matches_one_gpu_and_cpu() {
    if !gpus("layer_split_matches_one_gpu_and_cpu", 1) {
        return;
    }
    let mut rng = rand::rng();
    for (i, arch) in ARCHS.into_iter().enumerate() {
        let stages: &[usize] = if i % 2 == 0 { &[0, 0] } else { &[0, 0, 0] };
        for ty in ["f32", "q4_k_m", "f16"] {
            let n = rng.random_range(130..260);
            let seed = rng.random();
            let r = selfcheck::compare_split_logits(arch, ty, n, seed, stages).expect("runs");
            eprintln!(
                "split {arch:?} {ty} {:?}: vs CPU max |Δ| {:.2e}; vs 1 GPU max |Δ| {:.2e}, bit-identical {}",
                r.ranges, r.vs_cpu.max_abs_diff, r.vs_one_gpu.max_abs_diff, r.bit_identical
            );
            assert_eq!(r.ranges.len(), stages.len());
            assert!(r.passed(), "{arch:?} {ty} (seed {seed}): {r:?}");
        }
        let seed = rng.random();
        let g = selfcheck::compare_split_greedy(arch, "q4_k_m", 40, seed, stages).expect("runs");
        assert!(g.passed(), "{arch:?} greedy (seed {seed}): {g:?}");
    }
}

/// The linear-attention hybrids on the GPU against the CPU: logits in steps of 1 to 100
/// tokens for each weight type (f32 activations; with 8-bit ones against the CPU's own 8-bit
/// spread), several sequences per step against each alone, greedy ids, awkward head sizes,
/// and the per-sequence state refusing a cut-back sequence. Hybrids whose MoE layers the
/// backend refuses are skipped with a notice.
#[test]
fn hybrids_match_cpu() {
    if !gpu_present("hybrids_match_cpu") {
        return;
    }
    let mut rng = rand::rng();
    for arch in selfcheck::HYBRID_ARCHS {
        let skip = |e: &anyhow::Error| {
            let s = selfcheck::moe_refused(e);
            if s {
                eprintln!("{arch:?}: skipped, {e:#}");
            }
            s
        };
        if selfcheck::has_moe(arch) {
            // Route flips on rounding: the MoE checks' criteria (see `compare_logits_moe`).
            for ty in selfcheck::HYBRID_TYPES {
                let n = rng.random_range(130..260);
                let seed = rng.random();
                let r = selfcheck::compare_logits_moe(arch, ty, (8, 2), n, seed, 0)
                    .expect("comparison runs");
                assert!(r.passed(), "{arch:?} {ty} (seed {seed}): {r:?}");
            }
            let seed = rng.random();
            let g = selfcheck::compare_greedy_moe(arch, "f16", (8, 2), 32, seed, 0)
                .expect("generation runs");
            assert!(g.passed(), "{arch:?} greedy (seed {seed}): {g:?}");
            let r = selfcheck::check_state_continuity(arch, seed, 0).expect("state check runs");
            assert!(r.passed(), "{arch:?} state (seed {seed}): {r:?}");
            continue;
        }
        for ty in selfcheck::HYBRID_TYPES {
            let n = rng.random_range(130..260);
            let seed = rng.random();
            let r = match selfcheck::compare_logits(arch, ty, n, seed, 0, false) {
                Err(e) if skip(&e) => break,
                r => r.expect("comparison runs"),
            };
            assert!(r.passed(), "{arch:?} {ty} (seed {seed}): {r:?}");
            let seed = rng.random();
            let r =
                selfcheck::compare_batched_f32(arch, ty, &[48, 1, 37], seed, 0).expect("batched");
            assert!(r.passed(), "{arch:?} {ty} batched (seed {seed}): {r:?}");
            let seed = rng.random();
            if selfcheck::Q8_TYPES.contains(&ty) {
                // The default 8-bit decode path, against the CPU's own 8-bit spread.
                let (r, bound) =
                    selfcheck::compare_logits_q8_spread(arch, ty, n, seed, 0).expect("q8 runs");
                assert!(
                    r.passed_within(bound),
                    "{arch:?} {ty}+q8 (seed {seed}, bound {bound}): {r:?}"
                );
            } else {
                // Greedy ids where decoding keeps f32 activations (a near-tie is the only
                // excuse for a difference).
                let g = selfcheck::compare_greedy(arch, ty, 32, seed, 0).expect("generation runs");
                assert!(g.passed(), "{arch:?} {ty} greedy (seed {seed}): {g:?}");
            }
        }
        for ty in ["f32", "f16"] {
            let seed = rng.random();
            match selfcheck::compare_logits_of(
                selfcheck::tiny_model_awkward_hybrid,
                arch,
                ty,
                150,
                seed,
                0,
            ) {
                Err(e) if skip(&e) => {}
                r => {
                    let r = r.expect("comparison runs");
                    assert!(
                        r.passed(),
                        "{arch:?} {ty} awkward sizes (seed {seed}): {r:?}"
                    );
                }
            }
        }
        let seed = rng.random();
        match selfcheck::check_state_continuity(arch, seed, 0) {
            Err(e) if skip(&e) => {}
            r => {
                let r = r.expect("state check runs");
                assert!(r.passed(), "{arch:?} state (seed {seed}): {r:?}");
            }
        }
    }
}

/// The 4-bit codebook formats (IQ4_NL, IQ4_XS, MXFP4) in every GEMV-family product (plain,
/// gate/up, residual add; 1..=8 tokens, awkward sizes) and through cuBLAS (prompt-sized)
/// against f64 over their dequantized rows; then every architecture's logits in those
/// formats against the CPU, on f32 and on 8-bit activations.
#[test]
fn codebook_formats_match_f64_and_cpu() {
    if !gpu_present("codebook_formats_match_f64_and_cpu") {
        return;
    }
    use kestrel_gguf::GgmlType;
    use selfcheck::Product;
    let backend = kestrel_cuda::CudaBackend::new(0).expect("backend");
    let mut rng = rand::rng();
    for ty in [GgmlType::IQ4NL, GgmlType::IQ4XS, GgmlType::MXFP4] {
        for product in [Product::Plain, Product::Gated, Product::AddInto] {
            for (rows, cols, n, seed) in selfcheck::gemv_cases(ty, rng.random()) {
                let r = selfcheck::compare_gemv(&backend, ty, rows, cols, n, seed, product)
                    .expect("product runs");
                assert!(r.passed(), "{ty} {product:?} (seed {seed}): {r:?}");
            }
        }
        for (rows, cols, n, seed) in selfcheck::gemm_cases(ty, rng.random()) {
            let r = selfcheck::compare_gemv(&backend, ty, rows, cols, n, seed, Product::Plain)
                .expect("product runs");
            assert!(r.passed(), "{ty} gemm (seed {seed}): {r:?}");
        }
    }
    drop(backend);
    for arch in ARCHS {
        for ty in ["iq4_nl", "iq4_xs", "mxfp4"] {
            for q8 in [false, true] {
                let n = rng.random_range(130..260);
                let seed = rng.random();
                let r =
                    selfcheck::compare_logits(arch, ty, n, seed, 0, q8).expect("comparison runs");
                eprintln!(
                    "{arch:?} {ty} q8 {q8}: max |Δ| {:.2e} (bound {:.2e}, 8-bit spread {:.2e}), top-1 {:.2}% ({:.2}% with near-ties)",
                    r.max_abs_diff,
                    r.max_abs_bound(),
                    r.q8_spread,
                    r.top1_agreement * 100.0,
                    r.top1_agreement_ties * 100.0
                );
                assert!(r.passed(), "{arch:?} {ty} q8 {q8} (seed {seed}): {r:?}");
            }
        }
    }
}

/// The dense families added to the GPU, phi3 (fused Q/K/V and gate/up) and mistral3 (YaRN,
/// attention temperature): logits on f32 and 8-bit activations, and greedy generations.
#[test]
fn phi3_and_mistral3_match_cpu() {
    if !gpu_present("phi3_and_mistral3_match_cpu") {
        return;
    }
    use kestrel_model::Arch;
    let mut rng = rand::rng();
    for arch in [Arch::Phi3, Arch::Mistral3] {
        for (ty, q8) in [
            ("f32", false),
            ("q8_0", false),
            ("q4_k_m", false),
            ("q4_k_m", true),
        ] {
            let n = rng.random_range(130..260);
            let seed = rng.random();
            let r = selfcheck::compare_logits(arch, ty, n, seed, 0, q8).expect("comparison runs");
            eprintln!(
                "{arch:?} {ty} q8 {q8}: max |Δ| {:.2e} (bound {:.2e}), top-1 {:.2}% ({:.2}% with near-ties)",
                r.max_abs_diff,
                r.max_abs_bound(),
                r.top1_agreement * 100.0,
                r.top1_agreement_ties * 100.0
            );
            assert!(r.passed(), "{arch:?} {ty} q8 {q8} (seed {seed}): {r:?}");
        }
    }
    let mut failed = Vec::new();
    for arch in [Arch::Phi3, Arch::Mistral3, Arch::Llama] {
        for ty in ["f32", "f16"] {
            for _ in 0..3 {
                let seed = rng.random();
                let r = selfcheck::compare_greedy(arch, ty, 64, seed, 0).expect("generation runs");
                eprintln!(
                    "{arch:?} {ty} greedy (seed {seed}): first difference {:?}",
                    r.first_difference
                );
                if !r.passed() {
                    failed.push(format!("{arch:?} {ty} (seed {seed}): {r:?}"));
                }
            }
        }
    }
    assert!(failed.is_empty(), "{failed:#?}");
}

/// Mixture of experts: the tiny Qwen3-MoE models (8 experts of which 2, 32 of which 8) in
/// every format the expert kernels read, in steps of 100, 40 and 1–8 tokens.
#[test]
fn moe_logits_match_cpu() {
    if !gpu_present("moe_logits_match_cpu") {
        return;
    }
    let mut rng = rand::rng();
    for shape in selfcheck::MOE_SHAPES {
        for ty in selfcheck::MOE_TYPES {
            let n = rng.random_range(130..260);
            let seed = rng.random();
            let r =
                selfcheck::compare_logits_moe(kestrel_model::Arch::Qwen3Moe, ty, shape, n, seed, 0)
                    .expect("comparison runs");
            eprintln!(
                "moe {shape:?} {ty}: one token a step: {:.1}% within, max |Δ| {:.2e}, top-1 {:.2}%; in parts: {:.1}% of positions within {:.2e}, max |Δ| {:.2e} (max |logit| {:.2e}), top-1 {:.2}% ({:.2}% with near-ties)",
                r.single_within * 100.0,
                r.single.max_abs_diff,
                r.single.top1_agreement * 100.0,
                r.within * 100.0,
                r.logits.max_abs_bound(),
                r.logits.max_abs_diff,
                r.logits.max_abs_logit,
                r.logits.top1_agreement * 100.0,
                r.logits.top1_agreement_ties * 100.0
            );
            assert!(r.passed(), "moe {shape:?} {ty} (seed {seed}): {r:?}");
        }
    }
}

/// The 8-bit expert decode kernels (`moe_gate_up_q8`, `moe_down_q8`) against an f64
/// reference on random stacked experts of every format they read, awkward sizes, 1 to 8
/// tokens.
#[test]
fn moe_q8_block_matches_f64() {
    if !gpu_present("moe_q8_block_matches_f64") {
        return;
    }
    let backend = kestrel_cuda::CudaBackend::new(0).expect("backend");
    let mut rng = rand::rng();
    for case in selfcheck::MOE_Q8_CASES {
        let seed = rng.random();
        let r = selfcheck::compare_moe_block_q8(&backend, case, seed).expect("block runs");
        assert!(r.passed(), "{case:?} (seed {seed}): {r:?}");
    }
}

#[test]
fn moe_greedy_generation_matches_cpu() {
    if !gpu_present("moe_greedy_generation_matches_cpu") {
        return;
    }
    let mut rng = rand::rng();
    use kestrel_model::Arch;
    for (arch, ty) in [
        (Arch::Qwen3Moe, "f16"),
        (Arch::Qwen3Moe, "q4_k_m"),
        (Arch::Qwen3Moe, "q8_0"),
        (Arch::GptOss, "f16"),
        (Arch::GptOss, "mxfp4"),
    ] {
        for shape in selfcheck::MOE_SHAPES {
            let seed = rng.random();
            let r = selfcheck::compare_greedy_moe(arch, ty, shape, 64, seed, 0)
                .expect("generation runs");
            assert!(r.passed(), "{arch:?} {shape:?} {ty} (seed {seed}): {r:?}");
        }
    }
}

#[test]
fn moe_verification_steps_are_batch_invariant() {
    if !gpu_present("moe_verification_steps_are_batch_invariant") {
        return;
    }
    let mut rng = rand::rng();
    for ty in ["q4_k_m", "q8_0", "f16"] {
        let seed = rng.random();
        let r = selfcheck::compare_invariant(kestrel_model::Arch::Qwen3Moe, ty, seed, 0)
            .expect("steps run");
        assert!(r.passed(), "qwen3moe {ty} (seed {seed}): {r:?}");
    }
}

/// The block alone: gpt-oss's biases, clamped SwiGLU and top-k softmax, Qwen3-MoE's
/// renormalized softmax, at decode and grouped step sizes; a shared expert's gate.
#[test]
fn moe_block_matches_cpu() {
    if !gpu_present("moe_block_matches_cpu") {
        return;
    }
    let mut rng = rand::rng();
    for arch in [kestrel_model::Arch::GptOss, kestrel_model::Arch::Qwen3Moe] {
        for ty in ["q8_0", "f16", "q4_k_m", "q6_k", "mxfp4", "q4_0"] {
            let seed = rng.random();
            let r = selfcheck::compare_moe_block(arch, ty, seed, 0).expect("blocks run");
            eprintln!("moe block {arch:?} {ty}: {r:?}");
            assert!(r.passed(), "{arch:?} {ty} (seed {seed}): {r:?}");
            // Qwen3-MoE's K-quant experts take the tensor cores past 8 tokens, and so do
            // Q8_0 / MXFP4 experts of either (gpt-oss's biases and clamped SwiGLU too).
            let kq =
                arch == kestrel_model::Arch::Qwen3Moe && ty.starts_with('q') && ty.contains("_k");
            if ty != "q4_0" {
                let mma = kq || ty == "q8_0" || ty == "mxfp4";
                assert_eq!(r.mma_blocks > 0, mma, "{arch:?} {ty}: {r:?}");
            }
        }
    }
    for (arch, ty) in [
        (kestrel_model::Arch::Qwen3Moe, "q4_k_m"),
        (kestrel_model::Arch::Qwen3Moe, "q6_k"),
        (kestrel_model::Arch::GptOss, "mxfp4"),
    ] {
        let seed = rng.random();
        let r = selfcheck::compare_moe_block_wide(arch, ty, seed, 0).expect("blocks run");
        eprintln!("moe block wide {arch:?} {ty}: {r:?}");
        assert!(
            r.passed() && r.mma_blocks > 0,
            "wide {ty} (seed {seed}): {r:?}"
        );
    }
}

/// The routing kernel against the CPU's route: every shape and gating, ties included.
#[test]
fn moe_routes_match_cpu() {
    if !gpu_present("moe_routes_match_cpu") {
        return;
    }
    let seed = rand::rng().random();
    let r = selfcheck::compare_moe_routes(seed, 0).expect("routes run");
    assert!(r.passed(), "seed {seed}: {r:?}");
}

/// Masked sampling on a fresh backend while the stream still runs queued work (as a
/// step's forward pass runs when its masks go up): the masks' first buffers and each
/// growth are allocated behind that work, and every row draws what the host draws.
#[test]
fn masked_sampling_behind_queued_work_matches_host() {
    if !gpu_present("masked_sampling_behind_queued_work_matches_host") {
        return;
    }
    let seed = rand::rng().random();
    let backend = kestrel_cuda::CudaBackend::new(0).expect("backend");
    let r = selfcheck::compare_sampling(&backend, seed, true, true).expect("comparison runs");
    assert!(r.passed(), "seed {seed}: {r:?}");
}
