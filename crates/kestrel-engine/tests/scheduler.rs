//! Continuous batching against single-sequence generation on a tiny synthetic model: the
//! same greedy (and seeded) outputs whatever the mix, under preemption, with prefix sharing
//! and with clients leaving early; every block comes back.

use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use kestrel_cpu::{CpuBackend, Kernels};
use kestrel_engine::sampler::SamplerParams;
use kestrel_engine::scheduler::{
    self, Event, FinishReason, Request, SchedulerHandle, SchedulerOptions, SchedulerSpec,
    SubmitError,
};
use kestrel_engine::spec::{MultiDraftModel, MultiDrafter, write_truncated};
use kestrel_engine::{Engine, EngineOptions, Sequence};
use kestrel_gguf::GgufFile;
use kestrel_model::Arch;
use kestrel_model::synth::{SynthConfig, WeightType, write_synth_to};
use rand::{Rng, SeedableRng};

fn tiny_model(seed: u64) -> Arc<GgufFile> {
    let cfg = SynthConfig::tiny(Arch::Qwen2);
    let ty: WeightType = "q8_0".parse().expect("weight type");
    let (bytes, _) = write_synth_to(Vec::new(), &cfg, ty, seed).expect("synth");
    Arc::new(GgufFile::from_bytes(bytes).expect("synthetic file parses"))
}

fn engine(file: &Arc<GgufFile>, ctx: usize, max_seqs: usize, batch: usize) -> Engine<CpuBackend> {
    engine_with_cache(file, ctx, max_seqs, max_seqs, batch)
}

/// `cache_seqs` full contexts of cache, `max_seqs` logit rows.
fn engine_with_cache(
    file: &Arc<GgufFile>,
    ctx: usize,
    cache_seqs: usize,
    max_seqs: usize,
    batch: usize,
) -> Engine<CpuBackend> {
    let opts = EngineOptions {
        ctx,
        max_batch_tokens: batch,
        max_logit_rows: max_seqs,
        block_size: 16,
        max_seqs: cache_seqs,
    };
    Engine::new(CpuBackend::new(Kernels::Fast), file.clone(), &opts).expect("engine")
}

/// The reference: one sequence alone through `Engine::generate`.
fn alone(file: &Arc<GgufFile>, prompt: &[u32], params: &SamplerParams, n: usize) -> Vec<u32> {
    let mut e = engine(file, 512, 1, 64);
    let mut seq = Sequence::default();
    e.generate(&mut seq, prompt, params, n, |_| false, |_| true)
        .expect("generate")
}

/// Whether `a` and `b` are neighbours in the candidate order the single run's sampler sees
/// after `prompt` + `generated`.
fn adjacent_candidates(
    file: &Arc<GgufFile>,
    prompt: &[u32],
    generated: &[u32],
    params: &SamplerParams,
    a: u32,
    b: u32,
) -> bool {
    let mut e = engine(file, 512, 1, 64);
    let mut seq = Sequence::default();
    let history = [prompt, generated].concat();
    let mut logits = Vec::new();
    e.eval(&mut seq, &history, false, |_, l| logits = l.to_vec())
        .expect("eval");
    let mut sampler = kestrel_engine::sampler::Sampler::new(params.clone());
    let cands = sampler.candidates(&logits, &history);
    let at = |t: u32| cands.iter().position(|c| c.id == t);
    matches!((at(a), at(b)), (Some(i), Some(j)) if i.abs_diff(j) == 1)
}

/// A batched run's ids against the run alone: equal, except that a seeded draw may move to
/// the neighbouring candidate. Batched steps and preemption's recompute change the f32
/// summation order (~1e-5 on the logits), which can move a draw across the boundary between
/// two neighbouring candidates; at the first difference the two tokens must be adjacent in
/// the single run's candidate order (a batching bug would not land there).
fn assert_same_or_neighbour(
    file: &Arc<GgufFile>,
    prompt: &[u32],
    params: &SamplerParams,
    got: &[u32],
    want: &[u32],
) {
    if got == want || params.seed.is_none() {
        assert_eq!(got, want, "prompt of {} tokens", prompt.len());
        return;
    }
    let p = got.iter().zip(want).take_while(|(a, b)| a == b).count();
    assert!(
        p < got.len().min(want.len())
            && adjacent_candidates(file, prompt, &want[..p], params, got[p], want[p]),
        "prompt of {} tokens: sampled {got:?} batched, {want:?} alone, not neighbouring candidates at {p}",
        prompt.len()
    );
}

/// A submitted request: its prompt, settings, token count and events.
type Job = (Vec<u32>, SamplerParams, usize, mpsc::Receiver<Event>);

/// Every job's tokens against its run alone ([`assert_same_or_neighbour`]), each ended by
/// its length.
fn assert_jobs_match_single_runs(file: &Arc<GgufFile>, jobs: Vec<Job>) {
    for (prompt, params, n, rx) in jobs {
        let got = collect(rx);
        let want = alone(file, &prompt, &params, n);
        assert_eq!(
            got.ids.len(),
            want.len(),
            "prompt of {} tokens",
            prompt.len()
        );
        assert_same_or_neighbour(file, &prompt, &params, &got.ids, &want);
        assert_eq!(got.finish, Some(FinishReason::Length));
    }
}

struct Outcome {
    ids: Vec<u32>,
    finish: Option<FinishReason>,
}

fn collect(rx: mpsc::Receiver<Event>) -> Outcome {
    let mut ids = Vec::new();
    let mut finish = None;
    for ev in rx {
        match ev {
            Event::Token { id, .. } => ids.push(id),
            Event::Done { reason, usage } => {
                assert_eq!(usage.completion_tokens, ids.len());
                finish = Some(reason);
                break;
            }
            Event::Error(e) => panic!("request failed: {e}"),
        }
    }
    Outcome { ids, finish }
}

fn submit(
    h: &SchedulerHandle,
    prompt: Vec<u32>,
    params: SamplerParams,
    n: usize,
) -> mpsc::Receiver<Event> {
    let (tx, rx) = mpsc::channel();
    h.submit(Request {
        prompt,
        params,
        max_tokens: n,
        logprobs: None,
        speculative: true,
        sink: Box::new(tx),
    })
    .expect("submit");
    rx
}

fn wait_idle(h: &SchedulerHandle) {
    for _ in 0..2000 {
        let s = h.stats();
        if s.running.load(Ordering::Relaxed) == 0
            && s.waiting.load(Ordering::Relaxed) == 0
            && s.blocks_used.load(Ordering::Relaxed) == 0
        {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    panic!("scheduler did not go idle");
}

fn check_blocks_accounted(h: &SchedulerHandle) {
    let s = h.stats();
    let used = s.blocks_used.load(Ordering::Relaxed);
    let idle = s.blocks_cached_idle.load(Ordering::Relaxed);
    let free = s.blocks_free.load(Ordering::Relaxed);
    assert_eq!(used, 0, "blocks still held after every request ended");
    assert_eq!(
        idle + free,
        h.info().n_blocks as u64,
        "every block is free or an idle cached block"
    );
}

#[test]
fn batched_generation_equals_single_runs_even_under_preemption() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    let file = tiny_model(rng.random());
    // Small cache: two 128-token contexts (16 blocks) for 4 running sequences of 51 to 128
    // tokens out of 12 requests, so admission waits and decodes preempt.
    let f2 = file.clone();
    let h = scheduler::spawn(
        move || Ok(engine_with_cache(&f2, 128, 2, 4, 48)),
        SchedulerOptions {
            max_seqs: 4,
            max_prefill_tokens: 24,
            prefix_cache: true,
            eog: vec![],
            spec: None,
        },
    )
    .expect("spawn");
    let vocab = h.info().vocab_size as u32;
    let shared: Vec<u32> = (0..40).map(|_| rng.random_range(0..vocab)).collect();
    let mut jobs = Vec::new();
    for k in 0..12 {
        let len = rng.random_range(1..20);
        let mut prompt: Vec<u32> = if k % 3 == 0 {
            shared.clone()
        } else {
            Vec::new()
        };
        prompt.extend((0..len).map(|_| rng.random_range(0..vocab)));
        let n = rng.random_range(50..68);
        let params = if k % 2 == 0 {
            SamplerParams::greedy()
        } else {
            SamplerParams {
                seed: Some(rng.random()),
                presence_penalty: 0.5,
                ..SamplerParams::default()
            }
        };
        let rx = submit(&h, prompt.clone(), params.clone(), n);
        jobs.push((prompt, params, n, rx));
    }
    assert_jobs_match_single_runs(&file, jobs);
    wait_idle(&h);
    check_blocks_accounted(&h);
    let s = h.stats();
    let preemptions = s.preemptions.load(Ordering::Relaxed);
    eprintln!(
        "preemptions {preemptions}, prefix hits {} blocks",
        s.prefix_hit_blocks.load(Ordering::Relaxed)
    );
    assert!(preemptions > 0, "the cache was sized to force preemption");
}

#[test]
fn clients_that_leave_free_their_blocks_and_others_finish() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    let file = tiny_model(rng.random());
    let f2 = file.clone();
    let h = scheduler::spawn(
        move || Ok(engine(&f2, 256, 8, 64)),
        SchedulerOptions {
            max_seqs: 8,
            ..SchedulerOptions::default()
        },
    )
    .expect("spawn");
    let vocab = h.info().vocab_size as u32;
    let mut keep = Vec::new();
    for k in 0..16 {
        let prompt: Vec<u32> = (0..rng.random_range(2..40))
            .map(|_| rng.random_range(0..vocab))
            .collect();
        let rx = submit(&h, prompt.clone(), SamplerParams::greedy(), 40);
        if k % 4 == 0 {
            // Read a couple of tokens, then hang up.
            let _ = rx.recv();
            drop(rx);
        } else {
            keep.push((prompt, rx));
        }
    }
    for (prompt, rx) in keep {
        let got = collect(rx);
        assert_eq!(got.ids, alone(&file, &prompt, &SamplerParams::greedy(), 40));
    }
    wait_idle(&h);
    check_blocks_accounted(&h);
    assert!(h.stats().requests_cancelled.load(Ordering::Relaxed) >= 1);
}

#[test]
fn identical_prompts_reuse_cached_blocks() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    let file = tiny_model(rng.random());
    let f2 = file.clone();
    let h = scheduler::spawn(
        move || Ok(engine(&f2, 256, 2, 64)),
        SchedulerOptions {
            max_seqs: 2,
            ..SchedulerOptions::default()
        },
    )
    .expect("spawn");
    let vocab = h.info().vocab_size as u32;
    let len = rng.random_range(33..100);
    let prompt: Vec<u32> = (0..len).map(|_| rng.random_range(0..vocab)).collect();
    let first = collect(submit(&h, prompt.clone(), SamplerParams::greedy(), 8));
    wait_idle(&h);
    assert_eq!(h.stats().prefix_hit_blocks.load(Ordering::Relaxed), 0);
    let (tx, rx) = mpsc::channel();
    h.submit(Request {
        prompt: prompt.clone(),
        params: SamplerParams::greedy(),
        max_tokens: 8,
        logprobs: Some(3),
        speculative: true,
        sink: Box::new(tx),
    })
    .expect("submit");
    let mut second = Vec::new();
    let mut cached = 0;
    for ev in rx {
        match ev {
            Event::Token { id, logprob } => {
                let lp = logprob.expect("logprobs asked for");
                assert_eq!(lp.top.len(), 3);
                assert!(lp.logprob <= lp.top[0].1 + 1e-6);
                second.push(id);
            }
            Event::Done { usage, .. } => {
                cached = usage.cached_prompt_tokens;
                break;
            }
            Event::Error(e) => panic!("{e}"),
        }
    }
    assert_eq!(first.ids, second, "cached prefix gives the same output");
    // Every whole block before the last prompt token is shared.
    let want_blocks = (len - 1) / 16;
    assert_eq!(cached, want_blocks * 16);
    assert_eq!(
        h.stats().prefix_hit_blocks.load(Ordering::Relaxed),
        want_blocks as u64
    );
    wait_idle(&h);
    check_blocks_accounted(&h);
}

#[test]
fn bad_requests_are_refused() {
    let file = tiny_model(7);
    let h = scheduler::spawn(
        move || Ok(engine(&file, 64, 2, 32)),
        SchedulerOptions {
            max_seqs: 2,
            ..SchedulerOptions::default()
        },
    )
    .expect("spawn");
    let vocab = h.info().vocab_size as u32;
    let req = |prompt: Vec<u32>, max_tokens: usize, temperature: f32| Request {
        prompt,
        params: SamplerParams {
            temperature,
            ..SamplerParams::default()
        },
        max_tokens,
        logprobs: None,
        speculative: true,
        sink: Box::new(mpsc::channel().0),
    };
    assert_eq!(
        h.submit(req(vec![], 4, 0.0)).err(),
        Some(SubmitError::EmptyPrompt)
    );
    assert!(matches!(
        h.submit(req(vec![1, vocab], 4, 0.0)),
        Err(SubmitError::TokenOutOfRange { index: 1, .. })
    ));
    assert!(matches!(
        h.submit(req(vec![1; 65], 4, 0.0)),
        Err(SubmitError::PromptTooLong { len: 65, ctx: 64 })
    ));
    assert_eq!(
        h.submit(req(vec![1], 0, 0.0)).err(),
        Some(SubmitError::NoTokens)
    );
    assert!(matches!(
        h.submit(req(vec![1], 4, -1.0)),
        Err(SubmitError::BadParams(_))
    ));
    // A full-context prompt still gets its one token.
    let (tx, rx) = mpsc::channel();
    h.submit(Request {
        sink: Box::new(tx),
        ..req(vec![3; 64], 10, 0.0)
    })
    .expect("fits");
    let got = collect(rx);
    assert_eq!(got.ids.len(), 1);
    assert_eq!(got.finish, Some(FinishReason::Length));
}

#[test]
fn an_engine_that_fails_to_load_is_reported() {
    let res = scheduler::spawn::<CpuBackend, _>(
        || anyhow::bail!("no such model"),
        SchedulerOptions::default(),
    );
    assert!(res.err().unwrap().to_string().contains("no such model"));
    let file = tiny_model(3);
    let res = scheduler::spawn(
        move || Ok(engine(&file, 64, 2, 32)),
        SchedulerOptions {
            max_seqs: 4,
            ..SchedulerOptions::default()
        },
    );
    assert!(
        res.is_err(),
        "4 sequences need 4 logit rows, the engine has 2"
    );
}

#[test]
fn speculating_sequences_in_one_batch_keep_their_outputs() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    let file = tiny_model(rng.random());
    let f2 = file.clone();
    let (max_seqs, draft_max) = (4, 6);
    let h = scheduler::spawn(
        move || {
            Ok(engine_with_cache(
                &f2,
                256,
                4,
                max_seqs + max_seqs * draft_max,
                64,
            ))
        },
        SchedulerOptions {
            max_seqs,
            max_prefill_tokens: 32,
            prefix_cache: true,
            eog: vec![],
            spec: Some(SchedulerSpec {
                ngram_min: 1,
                ngram_max: 3,
                draft_min: 1,
                draft_max,
                max_seqs,
            }),
        },
    )
    .expect("spawn");
    let vocab = h.info().vocab_size as u32;
    // Prompts that repeat a phrase (something to look up), some sharing a prefix.
    let phrase: Vec<u32> = (0..20).map(|_| rng.random_range(0..vocab)).collect();
    let mut jobs = Vec::new();
    for k in 0..8 {
        let mut prompt = phrase.clone();
        prompt.extend((0..rng.random_range(1..12)).map(|_| rng.random_range(0..vocab)));
        prompt.extend(&phrase[..rng.random_range(2..12)]);
        let params = if k == 7 {
            SamplerParams {
                seed: Some(rng.random()),
                ..SamplerParams::default()
            }
        } else {
            SamplerParams::greedy()
        };
        let n = rng.random_range(40..90);
        let (tx, rx) = mpsc::channel();
        h.submit(Request {
            prompt: prompt.clone(),
            params: params.clone(),
            max_tokens: n,
            logprobs: None,
            speculative: k != 6,
            sink: Box::new(tx),
        })
        .expect("submit");
        jobs.push((prompt, params, n, rx));
    }
    for (k, (prompt, params, n, rx)) in jobs.into_iter().enumerate() {
        let got = collect(rx);
        assert_eq!(got.ids, alone(&file, &prompt, &params, n), "request {k}");
        assert_eq!(got.finish, Some(FinishReason::Length));
    }
    let s = h.stats();
    let drafted = s.spec_drafted.load(Ordering::Relaxed);
    let accepted = s.spec_accepted.load(Ordering::Relaxed);
    assert!(
        drafted > 0 && accepted > 0,
        "drafted {drafted}, accepted {accepted}"
    );
    assert!(s.spec_rounds.load(Ordering::Relaxed) > 0);
    wait_idle(&h);
    check_blocks_accounted(&h);
}

/// What a draft model did inside a scheduler, seen from the test.
#[derive(Default)]
struct DraftLog {
    /// Tokens it proposed in all.
    drafted: u64,
    /// Most draft sequences held at once, and how many are held now.
    most_slots: usize,
    slots: usize,
    /// Its free and total KV blocks after the last call.
    blocks: (usize, usize),
    /// Requests that got drafts.
    ids: std::collections::HashSet<u64>,
}

/// A draft model that reports to a [`DraftLog`].
struct Logged {
    inner: MultiDraftModel<CpuBackend>,
    log: Arc<Mutex<DraftLog>>,
}

impl Logged {
    fn record(&self, drafted: usize, id: Option<u64>) {
        let mut log = self.log.lock().unwrap();
        log.drafted += drafted as u64;
        log.slots = self.inner.slots_in_use();
        log.most_slots = log.most_slots.max(log.slots);
        log.blocks = self.inner.free_blocks();
        if let (Some(id), true) = (id, drafted > 0) {
            log.ids.insert(id);
        }
    }
}

impl MultiDrafter for Logged {
    fn draft_for(
        &mut self,
        id: u64,
        context: &[u32],
        max: usize,
        out: &mut Vec<u32>,
    ) -> anyhow::Result<()> {
        let before = out.len();
        let result = self.inner.draft_for(id, context, max, out);
        assert!(out.len() - before <= max, "more drafts than asked for");
        self.record(out.len() - before, Some(id));
        result
    }

    fn release(&mut self, id: u64) {
        self.inner.release(id);
        self.record(0, None);
    }
}

/// Requests of different lengths through a scheduler speculating with `draft` (a draft
/// sequence for each of at most `spec_max_seqs` requests): every output equals the request
/// alone without speculation. Among them: one that ends after 2 tokens, one whose client
/// leaves early, and more than `spec_max_seqs` at once (those beyond it decode plainly).
/// Returns the scheduler's drafted / accepted counters and the draft's log.
fn draft_model_run(
    rng: &mut rand::rngs::StdRng,
    target: &Arc<GgufFile>,
    draft: &Arc<GgufFile>,
) -> (u64, u64, DraftLog) {
    let (max_seqs, spec_max_seqs, draft_max) = (4, 2, 5);
    let log = Arc::new(Mutex::new(DraftLog::default()));
    let (t, t2, d, l) = (target.clone(), target.clone(), draft.clone(), log.clone());
    let h = scheduler::spawn_with(
        move || {
            Ok(engine_with_cache(
                &t,
                256,
                4,
                max_seqs * (1 + draft_max),
                64,
            ))
        },
        move || {
            let engine = engine_with_cache(&d, 256, spec_max_seqs, 1, 64);
            let inner = MultiDraftModel::new(engine, &t2, &d, spec_max_seqs)?;
            Ok(Some(
                Box::new(Logged { inner, log: l }) as Box<dyn MultiDrafter>
            ))
        },
        SchedulerOptions {
            max_seqs,
            max_prefill_tokens: 32,
            prefix_cache: true,
            eog: vec![],
            spec: Some(SchedulerSpec {
                ngram_min: 2,
                ngram_max: 4,
                draft_min: 1,
                draft_max,
                max_seqs: spec_max_seqs,
            }),
        },
    )
    .expect("spawn");
    let vocab = h.info().vocab_size as u32;
    let mut jobs = Vec::new();
    // Six requests, four running at once: speculation waits until at most two run (the
    // last two, both with tokens to go).
    let lens = [2, 25, 40, 100, 110, 120];
    for (k, &n) in lens.iter().enumerate() {
        let prompt: Vec<u32> = (0..rng.random_range(1..40))
            .map(|_| rng.random_range(0..vocab))
            .collect();
        let rx = submit(&h, prompt.clone(), SamplerParams::greedy(), n);
        jobs.push((k, prompt, n, rx));
    }
    // A client that leaves after a few tokens: its draft sequence must be freed too.
    let leaving: Vec<u32> = (0..10).map(|_| rng.random_range(0..vocab)).collect();
    let (tx, rx) = mpsc::channel();
    h.submit(Request {
        prompt: leaving,
        params: SamplerParams::greedy(),
        max_tokens: 200,
        logprobs: None,
        speculative: true,
        sink: Box::new(tx),
    })
    .expect("submit");
    for _ in 0..3 {
        let _ = rx.recv();
    }
    drop(rx);
    for (k, prompt, n, rx) in jobs {
        let got = collect(rx);
        assert_eq!(
            got.ids,
            alone(target, &prompt, &SamplerParams::greedy(), n),
            "request {k}"
        );
        assert_eq!(got.finish, Some(FinishReason::Length), "request {k}");
    }
    wait_idle(&h);
    check_blocks_accounted(&h);
    let s = h.stats();
    let counts = (
        s.spec_drafted.load(Ordering::Relaxed),
        s.spec_accepted.load(Ordering::Relaxed),
    );
    drop(h);
    let log = std::mem::take(&mut *log.lock().unwrap());
    (counts.0, counts.1, log)
}

/// A tiny Qwen2 whose weights are large enough (std 0.08, not 0.02) that its greedy output
/// varies (the default tiny model soon repeats one token, which any drafter guesses).
fn varied_model(seed: u64) -> Arc<GgufFile> {
    let mut cfg = SynthConfig::tiny(Arch::Qwen2);
    cfg.weight_std = 0.08;
    let ty: WeightType = "q8_0".parse().expect("weight type");
    let (bytes, _) = write_synth_to(Vec::new(), &cfg, ty, seed).expect("synth");
    Arc::new(GgufFile::from_bytes(bytes).expect("synthetic file parses"))
}

#[test]
fn a_draft_model_keeps_greedy_outputs_and_its_tokens_are_counted() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    let target = varied_model(rng.random());
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("draft.gguf");
    write_truncated(&target, 1, &path).expect("truncated copy");
    let first_layer = Arc::new(GgufFile::open(&path).expect("draft opens"));
    let other = varied_model(rng.random());
    // The target as its own draft (every draft accepted: the CPU is batch-invariant), its
    // first layer, and another model of its shape (drafts rejected and rolled back).
    let drafts = [
        ("itself", &target, Some(true)),
        ("1 layer", &first_layer, None),
        ("another seed", &other, Some(false)),
    ];
    for (name, draft, all_accepted) in drafts {
        let (drafted, accepted, log) = draft_model_run(&mut rng, &target, draft);
        eprintln!("draft {name}: drafted {drafted}, accepted {accepted}");
        assert!(drafted > 0, "draft {name}: nothing drafted");
        // The counters count exactly the draft model's tokens (prompts of random tokens give
        // prompt lookup next to nothing; it is not asked here).
        assert_eq!(drafted, log.drafted, "draft {name}");
        assert!(accepted <= drafted);
        match all_accepted {
            Some(true) => assert_eq!(accepted, drafted, "draft {name}"),
            Some(false) => assert!(accepted < drafted, "draft {name}: nothing rejected"),
            None => {}
        }
        // At most --spec-max-seqs draft sequences, every one freed when its request ended.
        assert_eq!(log.most_slots, 2, "draft {name}: draft sequences at once");
        assert_eq!(log.slots, 0, "draft {name}: draft sequences left");
        assert_eq!(
            log.blocks.0, log.blocks.1,
            "draft {name}: draft KV blocks left"
        );
        assert!(
            log.ids.len() >= 2,
            "draft {name}: {} requests drafted",
            log.ids.len()
        );
    }
}

/// A draft whose vocabulary differs from the target's, or that keeps a recurrent state,
/// is refused when the scheduler starts, with an error saying why.
#[test]
fn a_draft_model_of_another_vocabulary_is_refused_at_load() {
    use kestrel_model::synth::SynthOverrides;
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    let target = varied_model(rng.random());
    let synth = |arch, vocab: u32, seed: u64| {
        let mut cfg = SynthConfig::tiny(arch);
        cfg.apply(&SynthOverrides {
            n_vocab: Some(vocab),
            ..SynthOverrides::default()
        })
        .expect("synth shape");
        let (bytes, _) = write_synth_to(Vec::new(), &cfg, WeightType::F32, seed).expect("synth");
        Arc::new(GgufFile::from_bytes(bytes).expect("synthetic file parses"))
    };
    let vocab = target_vocab(&target);
    let other = rng.random_range(2..vocab);
    let cases = [
        (synth(Arch::Qwen2, other, rng.random()), "vocabulary"),
        (synth(Arch::Qwen35, vocab, rng.random()), "linear-attention"),
    ];
    for (draft, why) in cases {
        let (t, t2) = (target.clone(), target.clone());
        let err = scheduler::spawn_with(
            move || Ok(engine(&t, 128, 2, 16)),
            move || {
                let engine = engine(&draft, 128, 2, 16);
                let d = MultiDraftModel::new(engine, &t2, &draft, 2)?;
                Ok(Some(Box::new(d) as Box<dyn MultiDrafter>))
            },
            SchedulerOptions {
                max_seqs: 2,
                spec: Some(SchedulerSpec {
                    ngram_min: 2,
                    ngram_max: 4,
                    draft_min: 1,
                    draft_max: 4,
                    max_seqs: 2,
                }),
                ..SchedulerOptions::default()
            },
        )
        .err()
        .unwrap_or_else(|| panic!("a draft with {why} trouble was accepted"));
        assert!(err.to_string().contains(why), "{err}");
    }
}

fn target_vocab(file: &GgufFile) -> u32 {
    kestrel_model::ModelConfig::from_gguf(file)
        .expect("config")
        .vocab_size as u32
}

/// Draft sequences are slots: a request without a free one gets no drafts (it decodes
/// plainly), and one released is caught up from nothing by the next request.
#[test]
fn draft_slots_are_held_per_request_and_freed() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    let file = varied_model(rng.random());
    let mut d = MultiDraftModel::new(engine(&file, 128, 1, 16), &file, &file, 1).expect("draft");
    let vocab = target_vocab(&file);
    let a: Vec<u32> = (0..rng.random_range(1..40))
        .map(|_| rng.random_range(0..vocab))
        .collect();
    let b: Vec<u32> = (0..rng.random_range(1..40))
        .map(|_| rng.random_range(0..vocab))
        .collect();
    let k = rng.random_range(1..6);
    let mut out = Vec::new();
    d.draft_for(1, &a, k, &mut out).expect("draft");
    // The draft's greedy continuation, as the model alone gives it.
    assert_eq!(out, alone(&file, &a, &SamplerParams::greedy(), k));
    out.clear();
    d.draft_for(2, &b, k, &mut out).expect("draft");
    assert!(out.is_empty(), "the one slot is request 1's");
    assert_eq!(d.slots_in_use(), 1);
    // Request 1 goes on after a rejection: its sequence is rolled back and caught up.
    let mut a2 = a.clone();
    a2.extend((0..3).map(|_| rng.random_range(0..vocab)));
    d.draft_for(1, &a2, k, &mut out).expect("draft");
    assert_eq!(out, alone(&file, &a2, &SamplerParams::greedy(), k));
    d.release(1);
    assert_eq!(d.slots_in_use(), 0);
    let (free, total) = d.free_blocks();
    assert_eq!(free, total, "a released draft sequence keeps no block");
    out.clear();
    d.draft_for(2, &b, k, &mut out).expect("draft");
    assert_eq!(out, alone(&file, &b, &SamplerParams::greedy(), k));
    // Past the draft's context: nothing, not an error.
    out.clear();
    let long: Vec<u32> = (0..130).map(|_| rng.random_range(0..vocab)).collect();
    d.release(2);
    d.draft_for(3, &long, k, &mut out)
        .expect("no room is not an error");
    assert!(out.is_empty());
}

/// Decode steps chained on the device (no drafts, filters, log-probabilities or penalties):
/// greedy and seeded requests arriving while others decode, one of them ending early at an
/// end-of-generation token mid-chain, each give what it gives alone.
#[test]
fn chained_steps_keep_every_output() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    let file = tiny_model(rng.random());
    let vocab = {
        let e = engine(&file, 64, 1, 16);
        e.config().vocab_size as u32
    };
    let prompts: Vec<Vec<u32>> = (0..6)
        .map(|_| {
            (0..rng.random_range(2..12))
                .map(|_| rng.random_range(0..vocab))
                .collect()
        })
        .collect();
    // An end-of-generation token the first greedy request meets after a few tokens.
    let first_greedy = alone(&file, &prompts[0], &SamplerParams::greedy(), 40);
    let eog = first_greedy[7];
    let reference = |prompt: &[u32], params: &SamplerParams, n: usize| {
        let mut e = engine(&file, 512, 1, 64);
        let mut seq = Sequence::default();
        e.generate(&mut seq, prompt, params, n, |t| t == eog, |_| true)
            .expect("generate")
    };
    let f2 = file.clone();
    let h = scheduler::spawn(
        move || Ok(engine(&f2, 512, 3, 64)),
        SchedulerOptions {
            max_seqs: 3,
            max_prefill_tokens: 64,
            prefix_cache: true,
            eog: vec![eog],
            spec: None,
        },
    )
    .expect("spawn");
    let mut jobs = Vec::new();
    for (k, prompt) in prompts.iter().enumerate() {
        let params = if k % 2 == 0 {
            SamplerParams::greedy()
        } else {
            SamplerParams {
                seed: Some(rng.random()),
                temperature: 1.2,
                ..SamplerParams::default()
            }
        };
        let n = rng.random_range(20..40);
        jobs.push((
            prompt.clone(),
            params.clone(),
            n,
            submit(&h, prompt.clone(), params, n),
        ));
        // Later requests arrive while the first ones decode.
        std::thread::sleep(std::time::Duration::from_millis(rng.random_range(0..20)));
    }
    for (prompt, params, n, rx) in jobs {
        // (Usage counts an end-of-generation token, which is not sent: no usage check.)
        let mut got = Outcome {
            ids: Vec::new(),
            finish: None,
        };
        for ev in rx {
            match ev {
                Event::Token { id, .. } => got.ids.push(id),
                Event::Done { reason, .. } => {
                    got.finish = Some(reason);
                    break;
                }
                Event::Error(e) => panic!("request failed: {e}"),
            }
        }
        assert!(got.finish.is_some(), "prompt {prompt:?}: no end");
        let mut want = reference(&prompt, &params, n);
        // The scheduler does not send the end-of-generation token.
        if want.last() == Some(&eog) {
            want.pop();
        }
        assert_same_or_neighbour(&file, &prompt, &params, &got.ids, &want);
    }
    wait_idle(&h);
    check_blocks_accounted(&h);
    assert!(
        h.stats().chained_steps.load(Ordering::Relaxed) > 0,
        "no step was chained"
    );
}

/// Data parallelism: two schedulers (each a copy of the model with its own cache) behind
/// one handle. Every request gives its single run's tokens, both copies serve requests, the
/// statistics add up, and every block of both caches comes back.
#[test]
fn data_parallel_copies_share_the_requests_and_match_single_runs() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    let file = tiny_model(rng.random());
    let copy = |cache_seqs: usize| {
        let f = file.clone();
        scheduler::spawn(
            move || Ok(engine_with_cache(&f, 128, cache_seqs, 3, 48)),
            SchedulerOptions {
                max_seqs: 3,
                max_prefill_tokens: 24,
                prefix_cache: true,
                eog: vec![],
                spec: None,
            },
        )
        .expect("spawn")
    };
    // Caches of 2 and 3 contexts: the handle reports 5 contexts' blocks and 6 sequences,
    // and takes prompts the smaller cache holds.
    let (a, b) = (copy(2), copy(3));
    let h = SchedulerHandle::data_parallel(vec![a.clone(), b.clone()]).expect("joined");
    assert_eq!(h.replicas(), 2);
    assert_eq!(h.info().n_blocks, a.info().n_blocks + b.info().n_blocks);
    assert_eq!(h.info().max_seqs, 6);
    assert!(
        h.info().backend.starts_with("2 replicas: "),
        "{}",
        h.info().backend
    );
    let vocab = h.info().vocab_size as u32;
    let mut jobs = Vec::new();
    for k in 0..10 {
        let prompt: Vec<u32> = (0..rng.random_range(1..30))
            .map(|_| rng.random_range(0..vocab))
            .collect();
        let n = rng.random_range(20..40);
        let params = if k % 2 == 0 {
            SamplerParams::greedy()
        } else {
            SamplerParams {
                seed: Some(rng.random()),
                ..SamplerParams::default()
            }
        };
        let rx = submit(&h, prompt.clone(), params.clone(), n);
        jobs.push((prompt, params, n, rx));
    }
    assert_jobs_match_single_runs(&file, jobs);
    wait_idle(&h);
    check_blocks_accounted(&h);
    let finished = |h: &SchedulerHandle| h.stats().requests_finished.load(Ordering::Relaxed);
    assert!(
        finished(&a) > 0 && finished(&b) > 0,
        "both copies served requests ({} and {})",
        finished(&a),
        finished(&b)
    );
    assert_eq!(finished(&a) + finished(&b), 10);
    assert_eq!(finished(&h), 10);
    // A prompt too long for the smaller cache is refused up front.
    let long = vec![1u32; a.info().n_blocks * a.info().block_size + 1];
    let (tx, _rx) = mpsc::channel();
    let refused = h.submit(Request {
        prompt: long,
        params: SamplerParams::greedy(),
        max_tokens: 1,
        logprobs: None,
        speculative: true,
        sink: Box::new(tx),
    });
    assert!(
        matches!(
            refused,
            Err(SubmitError::PromptExceedsCache { .. } | SubmitError::PromptTooLong { .. })
        ),
        "{refused:?}"
    );
    assert!(SchedulerHandle::data_parallel(Vec::new()).is_err());
}
