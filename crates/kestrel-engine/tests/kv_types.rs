//! The KV cache's storage types on a real model (Gemma-3-270M, the first 256 tokens of the
//! GPL-3 reference text, CPU with llama.cpp's numerics): perplexity with q8_0 and q4_0
//! keys and values against the f16 cache's, and against the change llama.cpp's own q8_0
//! and q4_0 caches make on the same tokens (measured with llama-cpp-python 0.3.36, flash
//! attention on, by `scripts/kv_ppl_llamacpp.py gemma-3-270m.gguf text_gpl3.txt 256 f16
//! q8_0 q4_0`; llama.cpp needs flash attention for a quantized V cache).
//!
//! Then, on a tiny synthetic model, the quantized caches under the engine's block sharing:
//! a prompt's cached prefix blocks, shared read-only with a second request, give the same
//! greedy output as generating alone, and a sequence truncated back (its block table cut,
//! mid-block included) regenerates what it generated.
//!
//! A 270M model over 256 tokens is sensitive to any rounding: llama.cpp's own f16 → q8_0
//! change here is +0.46%, and with only the values in q8_0 +2.2% (only the keys: +0.69%).
//! So q8_0 is held to llama.cpp's spread (3%), q4_0 to 1.2× llama.cpp's change, as the
//! issue asks; the 0.2% for q8_0 is measured on Qwen2.5-1.5B over longer windows
//! (BENCHMARKS.md).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc;

use kestrel_cpu::{CpuBackend, Kernels, Numerics};
use kestrel_engine::perplexity::score_window;
use kestrel_engine::sampler::SamplerParams;
use kestrel_engine::scheduler::{self, Event, Request, SchedulerOptions};
use kestrel_engine::{Engine, EngineOptions, Sequence};
use kestrel_gguf::GgufFile;
use kestrel_model::synth::{SynthConfig, WeightType, write_synth_to};
use kestrel_model::{Arch, KvType, KvTypes};
use rand::{Rng, SeedableRng};

const MODEL: &str = "gemma-3-270m";
const WINDOW: usize = 256;
/// llama.cpp's perplexity of the window with an f16, a q8_0 and a q4_0 cache.
const LLAMA_F16: f64 = 12.9480;
const LLAMA_Q8_0: f64 = 13.0074;
const LLAMA_Q4_0: f64 = 16.3614;

fn ppl(file: &Arc<GgufFile>, ids: &[u32], t: KvType) -> f64 {
    let opts = EngineOptions {
        ctx: WINDOW,
        max_batch_tokens: WINDOW,
        max_logit_rows: WINDOW,
        ..EngineOptions::default()
    };
    let backend = CpuBackend::with_numerics(Kernels::Fast, Numerics::Ggml);
    let mut engine = Engine::with_cache_types(backend, file.clone(), &opts, KvTypes { k: t, v: t })
        .expect("engine");
    score_window(&mut engine, ids, 1).expect("scores").ppl
}

#[test]
fn quantized_caches_cost_what_llama_cpps_cost() {
    let path = kestrel_hub::resolve_model(MODEL).expect("model available");
    let file = Arc::new(GgufFile::open(&path).expect("model opens"));
    let reference = kestrel_hub::reference_dir()
        .expect("reference dir")
        .join(format!("{MODEL}-q4_k_m.llamacpp.json"));
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(reference).expect("reference file"))
            .expect("reference json");
    let ids: Vec<u32> = reference["texts"]["gpl3"]["ids"]
        .as_array()
        .expect("ids")
        .iter()
        .take(WINDOW)
        .map(|v| v.as_u64().expect("id") as u32)
        .collect();
    let f16 = ppl(&file, &ids, KvType::F16);
    let change = |p: f64, base: f64| p / base - 1.0;
    let (llama_q8, llama_q4) = (change(LLAMA_Q8_0, LLAMA_F16), change(LLAMA_Q4_0, LLAMA_F16));
    let q8 = change(ppl(&file, &ids, KvType::Q8_0), f16);
    let q4 = change(ppl(&file, &ids, KvType::Q4_0), f16);
    eprintln!(
        "f16 cache: ppl {f16:.4}; q8_0: {:+.2}% (llama.cpp {:+.2}%); q4_0: {:+.2}% \
         (llama.cpp {:+.2}%)",
        100.0 * q8,
        100.0 * llama_q8,
        100.0 * q4,
        100.0 * llama_q4
    );
    assert!(
        change(f16, LLAMA_F16).abs() < 0.01,
        "f16 cache: ppl {f16} against llama.cpp's {LLAMA_F16}"
    );
    assert!(
        q8.abs() < 0.03,
        "q8_0 cache moves ppl by {:.2}%",
        100.0 * q8
    );
    assert!(
        q4 <= 1.2 * llama_q4,
        "q4_0 cache: {:.2}% against llama.cpp's {:.2}%",
        100.0 * q4,
        100.0 * llama_q4
    );
    // The 4-bit cache must cost something: its blocks are read, not an f16 copy.
    assert!(
        q4 > q8.abs() && q4 > 0.05,
        "q4_0 cache moves ppl by only {:.2}%",
        100.0 * q4
    );
}

fn tiny_engine(file: &Arc<GgufFile>, kv: KvTypes, max_seqs: usize) -> Engine<CpuBackend> {
    let opts = EngineOptions {
        ctx: 256,
        max_batch_tokens: 64,
        max_logit_rows: max_seqs,
        block_size: 16,
        max_seqs,
    };
    Engine::with_cache_types(CpuBackend::new(Kernels::Fast), file.clone(), &opts, kv)
        .expect("engine")
}

/// Greedy ids and cached prompt tokens of one request through the scheduler.
fn request(h: &scheduler::SchedulerHandle, prompt: &[u32], n: usize) -> (Vec<u32>, usize) {
    let (tx, rx) = mpsc::channel();
    h.submit(Request {
        prompt: prompt.to_vec(),
        params: SamplerParams::greedy(),
        max_tokens: n,
        logprobs: None,
        speculative: true,
        sink: Box::new(tx),
    })
    .expect("submit");
    let mut ids = Vec::new();
    for ev in rx {
        match ev {
            Event::Token { id, .. } => ids.push(id),
            Event::Done { usage, .. } => return (ids, usage.cached_prompt_tokens),
            Event::Error(e) => panic!("request failed: {e}"),
        }
    }
    panic!("no Done event")
}

#[test]
fn quantized_blocks_are_shared_and_rolled_back() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    let cfg = SynthConfig::tiny(Arch::Qwen2);
    let (bytes, _) =
        write_synth_to(Vec::new(), &cfg, WeightType::Q8_0, rng.random()).expect("synth");
    let file = Arc::new(GgufFile::from_bytes(bytes).expect("parses"));
    let vocab = cfg.n_vocab;
    for kv in [
        KvTypes {
            k: KvType::Q8_0,
            v: KvType::Q8_0,
        },
        KvTypes {
            k: KvType::Q8_0,
            v: KvType::Q4_0,
        },
        KvTypes {
            k: KvType::Q4_0,
            v: KvType::Bf16,
        },
    ] {
        let len = rng.random_range(40..90);
        let prompt: Vec<u32> = (0..len).map(|_| rng.random_range(0..vocab)).collect();
        // Alone, then rolled back to the prompt and to mid-block points, and regenerated.
        let mut e = tiny_engine(&file, kv, 1);
        let mut seq = Sequence::default();
        let generate = |e: &mut Engine<CpuBackend>, seq: &mut Sequence, p: &[u32], n| {
            e.generate(seq, p, &SamplerParams::greedy(), n, |_| false, |_| true)
                .expect("generate")
        };
        let alone = generate(&mut e, &mut seq, &prompt, 12);
        let history = [&prompt[..], &alone[..]].concat();
        // Back into the generated part, then into the prompt (both mid-block), and on
        // again from the same history: the same last 6 tokens.
        for keep in [len + 5, len - 7] {
            e.truncate(&mut seq, keep);
            assert_eq!(seq.tokens.len(), keep);
            let redo = generate(&mut e, &mut seq, &history[keep..len + 6], 6);
            assert_eq!(redo, alone[6..], "{kv:?}: rolled back to {keep}");
        }
        e.release(&mut seq);
        // Through the scheduler with prefix caching: the second request reads the first's
        // blocks.
        let f2 = file.clone();
        let h = scheduler::spawn(
            move || Ok(tiny_engine(&f2, kv, 2)),
            SchedulerOptions {
                max_seqs: 2,
                ..SchedulerOptions::default()
            },
        )
        .expect("spawn");
        let (first, _) = request(&h, &prompt, 12);
        let (second, cached) = request(&h, &prompt, 12);
        assert_eq!(first, alone, "{kv:?}: scheduler against alone");
        assert_eq!(second, alone, "{kv:?}: with the cached prefix");
        assert_eq!(cached, (len - 1) / 16 * 16, "{kv:?}: prefix blocks shared");
        assert!(h.stats().prefix_hit_blocks.load(Ordering::Relaxed) > 0);
    }
}
