//! Token filters (grammar masks, logit bias) in the continuous-batching scheduler: a
//! filtered sequence only ever gets allowed tokens, is prepared before each of its samples,
//! ends when its filter says the output is complete, and leaves unfiltered neighbours in
//! the same batches exactly as they are alone.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};

use kestrel_cpu::{CpuBackend, Kernels};
use kestrel_engine::sampler::{SamplerParams, TokenFilter};
use kestrel_engine::scheduler::{
    self, Event, FinishReason, Request, SchedulerHandle, SchedulerOptions, SchedulerSpec,
};
use kestrel_engine::{Engine, EngineOptions};
use kestrel_gguf::GgufFile;
use kestrel_model::Arch;
use kestrel_model::synth::{SynthConfig, WeightType, write_synth_to};

/// Allows only `allowed` (in this order: the i-th sample must be `allowed[i % len]`, a
/// cycle a grammar would impose); complete after `len` tokens. Counts prepares.
struct Cycle {
    allowed: Vec<u32>,
    at: usize,
    prepared: Arc<AtomicUsize>,
    ready: bool,
}

impl TokenFilter for Cycle {
    fn prepare(&mut self) {
        self.prepared.fetch_add(1, Ordering::Relaxed);
        self.ready = true;
    }
    fn apply(&self, logits: &mut [f32]) {
        assert!(self.ready, "apply before prepare");
        let want = self.allowed[self.at % self.allowed.len()] as usize;
        for (id, l) in logits.iter_mut().enumerate() {
            if id != want {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    fn accept(&mut self, token: u32) -> Result<bool, String> {
        if !self.ready {
            return Err("accept before prepare".into());
        }
        self.ready = false;
        if token != self.allowed[self.at % self.allowed.len()] {
            return Err(format!("token {token} is not allowed"));
        }
        self.at += 1;
        Ok(self.at == 2 * self.allowed.len())
    }
}

/// Allows the tokens `t` with `t % 5 == step % 5` (many tokens, so the draw matters), as a
/// token mask the backend applies (`as_mask`) or through `apply` on the host.
struct EveryFifth {
    step: usize,
    as_mask: bool,
    ready: bool,
}

impl EveryFifth {
    fn allows(&self, t: usize) -> bool {
        t % 5 == self.step % 5
    }
}

impl TokenFilter for EveryFifth {
    fn prepare(&mut self) {
        self.ready = true;
    }
    fn apply(&self, logits: &mut [f32]) {
        for (t, l) in logits.iter_mut().enumerate() {
            if !self.allows(t) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    fn is_mask(&self) -> bool {
        self.as_mask
    }
    fn mask(&self, words: &mut [u32]) -> bool {
        if !self.ready {
            return false;
        }
        for t in 0..words.len() * 32 {
            if self.allows(t) {
                words[t / 32] |= 1 << (t % 32);
            }
        }
        true
    }
    fn accept(&mut self, token: u32) -> Result<bool, String> {
        if !self.ready || !self.allows(token as usize) {
            return Err(format!("token {token} is not allowed"));
        }
        self.ready = false;
        self.step += 1;
        Ok(false)
    }
}

/// A scheduler over the tiny Qwen2 model (Q8_0, synthesized from `seed`) on the CPU, with
/// `max_seqs` sequences and `max_logit_rows` logit rows a step, prefix caching off.
fn tiny_scheduler(
    seed: u64,
    max_seqs: usize,
    max_logit_rows: usize,
    spec: Option<SchedulerSpec>,
) -> SchedulerHandle {
    let cfg = SynthConfig::tiny(Arch::Qwen2);
    let ty: WeightType = "q8_0".parse().expect("weight type");
    let (bytes, _) = write_synth_to(Vec::new(), &cfg, ty, seed).expect("synth");
    let file = Arc::new(GgufFile::from_bytes(bytes).expect("parses"));
    let opts = EngineOptions {
        ctx: 256,
        max_batch_tokens: 64,
        max_logit_rows,
        block_size: 16,
        max_seqs,
    };
    scheduler::spawn(
        move || Engine::new(CpuBackend::new(Kernels::Fast), file, &opts),
        SchedulerOptions {
            max_seqs,
            max_prefill_tokens: 32,
            prefix_cache: false,
            eog: Vec::new(),
            spec,
        },
    )
    .expect("scheduler")
}

fn events(rx: &mpsc::Receiver<Event>) -> (Vec<u32>, Event) {
    let mut ids = Vec::new();
    loop {
        match rx.recv().expect("event") {
            Event::Token { id, .. } => ids.push(id),
            done => return (ids, done),
        }
    }
}

#[test]
fn filtered_sequences_follow_their_filter_beside_unfiltered_ones() {
    let h = tiny_scheduler(3, 8, 8, None);
    let submit = |prompt: Vec<u32>, params: SamplerParams, filter: Option<Box<dyn TokenFilter>>| {
        let (tx, rx) = mpsc::channel();
        h.submit_filtered(
            Request {
                prompt,
                params,
                max_tokens: 40,
                logprobs: None,
                speculative: true,
                sink: Box::new(tx),
            },
            filter,
        )
        .expect("submit");
        rx
    };
    // The unfiltered reference, alone.
    let prompt: Vec<u32> = (1..40).collect();
    let (alone, _) = events(&submit(prompt.clone(), SamplerParams::greedy(), None));

    let prepared = Arc::new(AtomicUsize::new(0));
    let mut filtered = Vec::new();
    let cycles = [vec![7u32, 9, 11], vec![100, 3], vec![5]];
    for (k, allowed) in cycles.iter().enumerate() {
        let filter = Cycle {
            allowed: allowed.clone(),
            at: 0,
            prepared: prepared.clone(),
            ready: false,
        };
        // Sampled at temperature 1: the mask, not the sampler's luck, must pick.
        let params = SamplerParams {
            seed: Some(k as u64),
            ..SamplerParams::default()
        };
        filtered.push(submit(
            vec![2, 3, 4 + k as u32],
            params,
            Some(Box::new(filter)),
        ));
    }
    let beside = submit(prompt, SamplerParams::greedy(), None);
    let mut total = 0;
    for (rx, allowed) in filtered.iter().zip(&cycles) {
        let (ids, done) = events(rx);
        let want: Vec<u32> = allowed.iter().chain(allowed).copied().collect();
        assert_eq!(ids, want);
        assert!(
            matches!(
                done,
                Event::Done {
                    reason: FinishReason::Stop,
                    ..
                }
            ),
            "{done:?}"
        );
        total += ids.len();
    }
    assert_eq!(prepared.load(Ordering::Relaxed), total);
    let (ids, _) = events(&beside);
    assert_eq!(ids, alone, "an unfiltered neighbour changed");

    // A filter that rejects the sampled token ends its request with an error.
    struct Reject;
    impl TokenFilter for Reject {
        fn prepare(&mut self) {}
        fn apply(&self, _: &mut [f32]) {}
        fn accept(&mut self, _: u32) -> Result<bool, String> {
            Err("no token fits".into())
        }
    }
    let (ids, done) = events(&submit(
        vec![1, 2],
        SamplerParams::greedy(),
        Some(Box::new(Reject)),
    ));
    assert!(ids.is_empty());
    assert_eq!(done, Event::Error("no token fits".into()));
}

/// With prompt-lookup speculation on, a filtered greedy sequence (whose repetitive prompt
/// would give the drafter plenty to propose) still follows its filter token by token, and a
/// speculating neighbour keeps its output.
#[test]
fn filtered_sequences_do_not_speculate() {
    let spec = SchedulerSpec {
        ngram_min: 1,
        ngram_max: 3,
        draft_min: 1,
        draft_max: 4,
        max_seqs: 2,
    };
    let h = tiny_scheduler(3, 2, 16, Some(spec));
    let submit = |prompt: Vec<u32>, filter: Option<Box<dyn TokenFilter>>| {
        let (tx, rx) = mpsc::channel();
        h.submit_filtered(
            Request {
                prompt,
                params: SamplerParams::greedy(),
                max_tokens: 24,
                logprobs: None,
                speculative: true,
                sink: Box::new(tx),
            },
            filter,
        )
        .expect("submit");
        rx
    };
    let prompt: Vec<u32> = [7u32, 9, 11].repeat(8);
    let (alone, _) = events(&submit(prompt.clone(), None));

    let prepared = Arc::new(AtomicUsize::new(0));
    let allowed = vec![9u32, 7, 11, 5];
    let filter = Cycle {
        allowed: allowed.clone(),
        at: 0,
        prepared: prepared.clone(),
        ready: false,
    };
    let filtered = submit(prompt.clone(), Some(Box::new(filter)));
    let beside = submit(prompt, None);
    let (ids, done) = events(&filtered);
    let want: Vec<u32> = allowed.iter().chain(&allowed).copied().collect();
    assert_eq!(ids, want);
    assert!(
        matches!(
            done,
            Event::Done {
                reason: FinishReason::Stop,
                ..
            }
        ),
        "{done:?}"
    );
    assert_eq!(prepared.load(Ordering::Relaxed), ids.len());
    let (ids, _) = events(&beside);
    assert_eq!(ids, alone, "a speculating neighbour changed");
}

/// Filters that are token masks are sampled by the backend under their masks (greedy,
/// sampled, penalised; beside unfiltered sequences in the same steps) and
/// give exactly the tokens the same filters applied on the host give.
#[test]
fn mask_filters_give_the_tokens_of_host_filtering() {
    let h = tiny_scheduler(5, 8, 8, None);
    let submit = |prompt: Vec<u32>, params: SamplerParams, filter: Option<Box<dyn TokenFilter>>| {
        let (tx, rx) = mpsc::channel();
        h.submit_filtered(
            Request {
                prompt,
                params,
                max_tokens: 24,
                logprobs: None,
                speculative: false,
                sink: Box::new(tx),
            },
            filter,
        )
        .expect("submit");
        rx
    };
    let seed: u64 = rand::random();
    let params = |k: usize| match k % 3 {
        0 => SamplerParams::greedy(),
        1 => SamplerParams {
            seed: Some(seed + k as u64),
            ..SamplerParams::default()
        },
        _ => SamplerParams {
            seed: Some(seed + k as u64),
            top_k: 7,
            repeat_penalty: 1.3,
            presence_penalty: 0.4,
            ..SamplerParams::default()
        },
    };
    let run = |as_mask: bool| -> Vec<Vec<u32>> {
        let mut rxs = Vec::new();
        for k in 0..6 {
            let filter = EveryFifth {
                step: k,
                as_mask,
                ready: false,
            };
            rxs.push(submit(
                vec![3, 1 + k as u32, 4],
                params(k),
                Some(Box::new(filter)),
            ));
            rxs.push(submit(vec![2, 7, k as u32], params(k + 1), None));
        }
        rxs.iter()
            .map(|rx| {
                let (ids, done) = events(rx);
                assert!(
                    matches!(
                        done,
                        Event::Done {
                            reason: FinishReason::Length,
                            ..
                        }
                    ),
                    "{done:?}"
                );
                ids
            })
            .collect()
    };
    let host = run(false);
    let masked = run(true);
    assert_eq!(masked, host, "seed {seed}");
    for (k, ids) in host.iter().step_by(2).enumerate() {
        assert_eq!(ids.len(), 24);
        for (i, &t) in ids.iter().enumerate() {
            assert_eq!(t as usize % 5, (k + i) % 5, "sequence {k}, token {i}");
        }
    }
}

/// Allows the tokens `t` with `t % 3 == 0` as a token mask; complete after `len` tokens, or
/// failing on the `fail_at`-th. Records what it prepared and accepted.
struct Countdown {
    len: usize,
    fail_at: Option<usize>,
    ready: bool,
    accepted: Arc<std::sync::Mutex<Vec<u32>>>,
    prepared: Arc<AtomicUsize>,
}

impl TokenFilter for Countdown {
    fn prepare(&mut self) {
        self.prepared.fetch_add(1, Ordering::Relaxed);
        self.ready = true;
    }
    fn apply(&self, logits: &mut [f32]) {
        for (t, l) in logits.iter_mut().enumerate() {
            if t % 3 != 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    fn is_mask(&self) -> bool {
        true
    }
    fn mask(&self, words: &mut [u32]) -> bool {
        if !self.ready {
            return false;
        }
        for (w, word) in words.iter_mut().enumerate() {
            *word = (0..32)
                .filter(|b| (32 * w + b) % 3 == 0)
                .fold(0, |m, b| m | 1 << b);
        }
        true
    }
    fn accept(&mut self, token: u32) -> Result<bool, String> {
        if !self.ready || !token.is_multiple_of(3) {
            return Err(format!("token {token} is not allowed"));
        }
        self.ready = false;
        let mut accepted = self.accepted.lock().unwrap();
        accepted.push(token);
        if self.fail_at == Some(accepted.len()) {
            return Err("the grammar failed".into());
        }
        Ok(accepted.len() == self.len)
    }
}

/// Mask filters whose tokens are accepted beside the next step end where their grammar
/// says: after exactly the token that completes it (no token more, nothing prepared after
/// it), with `Stop` also when that token is the last `max_tokens` allows; a grammar failing
/// on an allowed token ends its request with the error. Every sent token was accepted, in
/// order, and unfiltered neighbours keep their output.
#[test]
fn mask_filters_end_where_their_grammar_ends() {
    let h = tiny_scheduler(7, 8, 8, None);
    let submit = |prompt: Vec<u32>, max_tokens: usize, filter: Option<Box<dyn TokenFilter>>| {
        let (tx, rx) = mpsc::channel();
        h.submit_filtered(
            Request {
                prompt,
                params: SamplerParams::greedy(),
                max_tokens,
                logprobs: None,
                speculative: false,
                sink: Box::new(tx),
            },
            filter,
        )
        .expect("submit");
        rx
    };
    let prompt: Vec<u32> = (5..30).collect();
    let (alone, _) = events(&submit(prompt.clone(), 30, None));
    // (grammar length, fail at, max_tokens)
    let cases = [
        (5, None, 40),
        (1, None, 40),
        (7, None, 7),
        (9, None, 8),
        (12, Some(4), 40),
        (12, Some(1), 40),
    ];
    let mut runs = Vec::new();
    for (k, &(len, fail_at, max_tokens)) in cases.iter().enumerate() {
        let accepted = Arc::new(std::sync::Mutex::new(Vec::new()));
        let prepared = Arc::new(AtomicUsize::new(0));
        let filter = Countdown {
            len,
            fail_at,
            ready: false,
            accepted: accepted.clone(),
            prepared: prepared.clone(),
        };
        let rx = submit(
            vec![3, 1 + k as u32, 4, 1],
            max_tokens,
            Some(Box::new(filter)),
        );
        runs.push((rx, accepted, prepared));
    }
    let beside = submit(prompt, 30, None);
    for ((rx, accepted, prepared), &(len, fail_at, max_tokens)) in runs.iter().zip(&cases) {
        let (ids, done) = events(rx);
        let accepted = accepted.lock().unwrap().clone();
        assert!(ids.iter().all(|t| t % 3 == 0), "{ids:?}");
        match fail_at {
            Some(at) => {
                assert_eq!(done, Event::Error("the grammar failed".into()));
                assert_eq!(ids.len(), at, "the failing token was sent, no token after");
                assert_eq!(accepted, ids);
            }
            None if len <= max_tokens => {
                assert!(
                    matches!(
                        done,
                        Event::Done {
                            reason: FinishReason::Stop,
                            ..
                        }
                    ),
                    "{done:?}"
                );
                assert_eq!(ids.len(), len);
                assert_eq!(accepted, ids);
                assert_eq!(prepared.load(Ordering::Relaxed), len);
            }
            None => {
                assert!(
                    matches!(
                        done,
                        Event::Done {
                            reason: FinishReason::Length,
                            ..
                        }
                    ),
                    "{done:?}"
                );
                assert_eq!(ids.len(), max_tokens);
                assert_eq!(accepted, ids);
            }
        }
    }
    let (ids, _) = events(&beside);
    assert_eq!(ids, alone, "an unfiltered neighbour changed");
}

/// A mask filter whose last token waits to be accepted keeps its output when the next step
/// samples every row on the host (a neighbour asking for log-probabilities arrives): the
/// token is accepted there as in a masked step, and the output equals the run alone.
#[test]
fn mask_filters_keep_their_tokens_across_host_sampled_steps() {
    let h = tiny_scheduler(11, 8, 8, None);
    let submit = |prompt: Vec<u32>,
                  max_tokens: usize,
                  logprobs: Option<usize>,
                  filter: Option<Box<dyn TokenFilter>>| {
        let (tx, rx) = mpsc::channel();
        h.submit_filtered(
            Request {
                prompt,
                params: SamplerParams::greedy(),
                max_tokens,
                logprobs,
                speculative: false,
                sink: Box::new(tx),
            },
            filter,
        )
        .expect("submit");
        rx
    };
    let run = |neighbour: bool| {
        let accepted = Arc::new(std::sync::Mutex::new(Vec::new()));
        let filter = Countdown {
            len: 30,
            fail_at: None,
            ready: false,
            accepted: accepted.clone(),
            prepared: Arc::new(AtomicUsize::new(0)),
        };
        let rx = submit(vec![9, 2, 6], 40, None, Some(Box::new(filter)));
        let mut ids = Vec::new();
        let mut others = Vec::new();
        let done = loop {
            match rx.recv().expect("event") {
                Event::Token { id, .. } => ids.push(id),
                done => break done,
            }
            // Log-probability neighbours arriving while the filtered sequence decodes.
            if neighbour && ids.len() % 6 == 3 {
                others.push(submit(vec![4, ids.len() as u32], 4, Some(2), None));
            }
        };
        assert!(
            matches!(
                done,
                Event::Done {
                    reason: FinishReason::Stop,
                    ..
                }
            ),
            "{done:?}"
        );
        for rx in &others {
            let (got, _) = events(rx);
            assert_eq!(got.len(), 4);
        }
        assert_eq!(*accepted.lock().unwrap(), ids);
        (ids, others.len())
    };
    let (alone, _) = run(false);
    let (beside, neighbours) = run(true);
    assert_eq!(alone.len(), 30);
    assert!(neighbours >= 4, "{neighbours} neighbours");
    assert_eq!(beside, alone);
}
