//! The CUDA backend against the CPU backend on tiny synthetic models. Needs a GPU: without
//! one (CI) each test prints a notice and returns.

use kestrel_gpu_check::{self as selfcheck, ARCHS, TYPES};
use rand::Rng;

/// True when a CUDA device can be used; otherwise prints why the test is skipped.
fn gpu_present(test: &str) -> bool {
    match kestrel_cuda::device_count() {
        Ok(n) if n > 0 => true,
        Ok(_) => {
            eprintln!("{test}: skipped, no CUDA device");
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
fn missing_device_is_an_error_not_a_panic() {
    // Whatever the machine: asking for a device that does not exist must fail cleanly.
    let err = kestrel_cuda::CudaBackend::new(usize::MAX).err();
    assert!(err.is_some(), "device usize::MAX opened");
    eprintln!(
        "expected error: {:#}",
        err.unwrap_or_else(|| anyhow::anyhow!(""))
    );
}
