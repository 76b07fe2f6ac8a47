//! "No allocation inside a decode step": counts heap allocations (a counting global
//! allocator, this test binary only) while a warmed-up engine decodes single tokens on the
//! CPU backend, for every architecture.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use kestrel_cpu::{CpuBackend, Kernels};
use kestrel_engine::{Engine, EngineOptions, Sequence};
use kestrel_gguf::GgufFile;
use kestrel_model::Arch;
use kestrel_model::synth::{SynthConfig, WeightType, write_synth_to};

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn decode_steps_do_not_allocate() {
    // One worker thread: each thread's kernel scratch grows on its first use, and with
    // work stealing that first use could fall inside the measured steps.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("thread pool");
    pool.install(decode_steps_do_not_allocate_on_this_pool);
}

fn decode_steps_do_not_allocate_on_this_pool() {
    for arch in [
        Arch::Llama,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Gemma3,
        Arch::Qwen3Moe,
        Arch::GptOss,
        Arch::Phi3,
        Arch::Mistral3,
    ] {
        let cfg = SynthConfig::tiny(arch);
        let ty: WeightType = "q4_k_m".parse().expect("weight type");
        let (bytes, _) = write_synth_to(Vec::new(), &cfg, ty, 7).expect("synth");
        let file = Arc::new(GgufFile::from_bytes(bytes).expect("synthetic file parses"));
        let opts = EngineOptions {
            ctx: 256,
            max_batch_tokens: 64,
            max_logit_rows: 1,
            block_size: 16,
            max_seqs: 1,
        };
        let mut engine = Engine::new(CpuBackend::new(Kernels::Fast), file, &opts).expect("engine");
        let mut seq = Sequence::default();
        // Reserve what the sequence will need, then warm up every buffer.
        seq.tokens.reserve(256);
        // 41 prompt tokens + 8 warm-up steps fill positions 0..=48: the measured steps
        // (49..=60) stay inside the fourth KV block, so the block table does not grow (a
        // new block every 16 positions appends to it: amortized, not per step).
        let prompt: Vec<u32> = (0..41).map(|i| (i * 7 % 50) as u32).collect();
        engine
            .eval(&mut seq, &prompt, false, |_, _| {})
            .expect("prompt");
        for t in 0..8u32 {
            engine
                .eval(&mut seq, &[t], false, |_, _| {})
                .expect("warm-up step");
        }
        let before = ALLOCATIONS.load(Ordering::Relaxed);
        let steps = 12u32;
        for t in 0..steps {
            engine
                .eval(&mut seq, &[t % 50], false, |_, _| {})
                .expect("decode step");
        }
        let per_step = (ALLOCATIONS.load(Ordering::Relaxed) - before) as f64 / steps as f64;
        eprintln!("{arch:?}: {per_step:.1} allocations per decode step");

        assert_eq!(per_step, 0.0, "{arch:?}: decode steps allocate");
    }
}
