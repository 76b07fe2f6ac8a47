//! Continuous batching over the paged KV cache.
//!
//! A [`Scheduler`] owns an [`Engine`] on its own OS thread. Requests come in through a
//! channel ([`SchedulerHandle::submit`]); every step the scheduler
//! 1. admits waiting requests while KV blocks allow (first come, first served),
//! 2. builds one [`Batch`] holding the next token of every decoding sequence and chunks of
//!    prompts still being prefilled (prefill tokens per step are capped so decodes keep
//!    flowing; the engine's `max_batch_tokens` caps the whole step),
//! 3. runs it, samples each sequence that reached the end of its tokens with its own
//!    [`Sampler`], and streams the token to the request's [`TokenSink`].
//!
//! A sequence's blocks are freed the moment it finishes or its sink reports the client gone.
//! When a decoding sequence needs a block and none is free, idle prefix-cache blocks are
//! evicted (least recently used first), then the youngest running sequence is preempted: its
//! blocks are freed and it goes back to the front of the queue, to be recomputed later from
//! its prompt and the tokens it already generated (its sampler state is kept, so the output is
//! the same as if it had never been preempted).
//!
//! Speculative decoding (greedy requests): while few sequences run, a decoding sequence's
//! pending token goes into the step together with the tokens the scheduler's
//! [`MultiDrafter`] proposes for it (prompt lookup, [`NgramDrafter`], or a draft model given
//! to [`spawn_with`]), each with a logit row; the longest prefix of drafts matching the
//! target's own argmax is kept, and the rejected drafts leave the block table before any
//! block can enter the prefix cache. Sequences with different accepted lengths share a step.
//!
//! Prefix caching: every full block a sequence computes is entered in a table keyed by a hash
//! of the block's token ids chained with its predecessor's hash (a block's keys and values
//! depend on every earlier token). A new sequence whose prompt starts with the same whole
//! blocks shares them ([`BlockManager::share`]) instead of recomputing them. The table holds
//! one reference of its own on each entry, so a cached block outlives the sequences that used
//! it until memory is needed. The hash only finds a candidate: each entry keeps its block's
//! token ids and the id of its parent entry, and a hit requires both to match, so a hash
//! collision can never hand a sequence blocks computed from other tokens.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kestrel_model::{Backend, Batch, NO_MASK, Pooling, SamplingBatch, masked_argmax};
use rayon::prelude::*;

use crate::engine::Engine;
use crate::sampler::{Sampler, SamplerParams, TokenFilter, log_softmax, top_n};
use crate::spec::{DraftControl, MultiDrafter, NgramDrafter};

/// Where a request's events go. Implemented for `std::sync::mpsc::Sender<Event>`; the server
/// wraps its async channel in one.
pub trait TokenSink: Send {
    /// Delivers an event; returns false when the receiver is gone (the client disconnected).
    fn send(&mut self, event: Event) -> bool;
    /// Whether the receiver is known to be gone, checked before every step so a disconnected
    /// client's blocks are freed without waiting for its next token.
    fn is_closed(&self) -> bool {
        false
    }
}

impl TokenSink for mpsc::Sender<Event> {
    fn send(&mut self, event: Event) -> bool {
        mpsc::Sender::send(self, event).is_ok()
    }
}

/// Log-probabilities reported with a sampled token (of the model's distribution, before
/// penalties, filters and temperature).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub logprob: f32,
    /// The most likely tokens with their log-probabilities, best first.
    pub top: Vec<(u32, f32)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token (not reported as a token).
    Stop,
    /// `max_tokens` reached or the context is full.
    Length,
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose cache blocks came from the prefix cache.
    pub cached_prompt_tokens: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Token {
        id: u32,
        logprob: Option<TokenLogprob>,
    },
    Done {
        reason: FinishReason,
        usage: Usage,
    },
    Error(String),
}

/// A generation request.
pub struct Request {
    pub prompt: Vec<u32>,
    pub params: SamplerParams,
    /// Most tokens to generate (at least 1).
    pub max_tokens: usize,
    /// Report log-probabilities with this many top alternatives (`Some(0)`: only the chosen
    /// token's).
    pub logprobs: Option<usize>,
    /// Whether this request may speculate (when the scheduler does).
    pub speculative: bool,
    pub sink: Box<dyn TokenSink>,
}

/// An embedding request: one pooled vector per input, computed between generation steps
/// (see [`Engine::embed`]).
pub struct EmbedRequest {
    /// Token ids of each input (each non-empty, within the context).
    pub inputs: Vec<Vec<u32>>,
    pub pooling: Pooling,
    /// Receives one vector per input (not normalized), or why there is none.
    pub reply: Box<dyn FnOnce(EmbedResult) + Send>,
}

/// One vector per input, or why there is none.
pub type EmbedResult = Result<Vec<Vec<f32>>, String>;

/// What the scheduler's channel carries.
enum Job {
    Generate(Request, Option<Box<dyn TokenFilter>>),
    Embed(EmbedRequest),
}

/// Why a request was refused before it reached the queue.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("prompt token {index} has id {id}, the vocabulary has {vocab} tokens")]
    TokenOutOfRange { index: usize, id: u32, vocab: usize },
    #[error("the prompt has {len} tokens, the context holds {ctx}")]
    PromptTooLong { len: usize, ctx: usize },
    #[error(
        "the prompt has {len} tokens, the whole KV cache holds {positions} positions \
         (the server's --kv-memory)"
    )]
    PromptExceedsCache { len: usize, positions: usize },
    #[error("max_tokens must be at least 1")]
    NoTokens,
    #[error("bad sampling parameters: {0}")]
    BadParams(String),
    #[error("the scheduler has stopped")]
    Stopped,
}

/// Scheduling settings.
#[derive(Debug, Clone)]
pub struct SchedulerOptions {
    /// Most sequences running at once (the engine's logit rows must be at least this).
    pub max_seqs: usize,
    /// Most prompt tokens per step; the rest of the step's tokens go to decodes.
    pub max_prefill_tokens: usize,
    /// Share whole blocks of identical prompt prefixes.
    pub prefix_cache: bool,
    /// Token ids that end generation (end of sequence, end of turn).
    pub eog: Vec<u32>,
    /// Speculative decoding for greedy requests (by prompt lookup unless [`spawn_with`] is
    /// given a drafter); None: off.
    pub spec: Option<SchedulerSpec>,
}

/// The scheduler's speculative decoding.
#[derive(Debug, Clone)]
pub struct SchedulerSpec {
    /// N-gram sizes the lookup matches (prompt lookup only).
    pub ngram_min: usize,
    pub ngram_max: usize,
    /// Tokens drafted per sequence and step.
    pub draft_min: usize,
    pub draft_max: usize,
    /// Speculate only while at most this many sequences run (a large batch is already
    /// efficient; drafts would crowd it).
    pub max_seqs: usize,
}

impl Default for SchedulerOptions {
    fn default() -> Self {
        SchedulerOptions {
            max_seqs: 16,
            max_prefill_tokens: 256,
            prefix_cache: true,
            eog: Vec::new(),
            spec: None,
        }
    }
}

/// What the engine holds, for validating requests and reporting.
#[derive(Debug, Clone)]
pub struct SchedulerInfo {
    pub vocab_size: usize,
    /// Most positions of one sequence: the context size, or the whole cache if smaller.
    pub ctx: usize,
    pub n_blocks: usize,
    pub block_size: usize,
    /// Bytes of keys and values one cached position takes over all layers.
    pub kv_bytes_per_token: usize,
    pub max_seqs: usize,
    pub arch: String,
    pub backend: String,
    /// Width of the hidden states (an embedding's length).
    pub n_embd: usize,
    /// `<arch>.pooling_type`, when the model file states it.
    pub pooling: Option<Pooling>,
}

/// Counters and gauges the scheduler thread updates after every step.
#[derive(Debug, Default)]
pub struct SchedulerStats {
    pub waiting: AtomicU64,
    pub running: AtomicU64,
    /// Blocks held by sequences.
    pub blocks_used: AtomicU64,
    /// Prefix-cache blocks no sequence holds (evictable).
    pub blocks_cached_idle: AtomicU64,
    pub blocks_free: AtomicU64,
    pub prefix_hit_blocks: AtomicU64,
    pub prefix_hit_tokens: AtomicU64,
    /// Tokens evaluated (prompt chunks, recomputation and decodes).
    pub tokens_evaluated: AtomicU64,
    pub tokens_generated: AtomicU64,
    pub preemptions: AtomicU64,
    pub steps: AtomicU64,
    /// Steps queued behind the one before, their input tokens left on the device by it
    /// (part of `steps`).
    pub chained_steps: AtomicU64,
    /// Microseconds spent in the model's forward steps (backend work and the logits read)
    /// and in a draft model's drafting.
    pub forward_us: AtomicU64,
    /// Microseconds of the scheduler's own work around them: admission, batch building,
    /// sampling, sending tokens, releasing blocks.
    pub host_us: AtomicU64,
    /// Microseconds the token filters took preparing (grammar masks, written for the
    /// sampler), on the filter pool beside the forward steps.
    pub mask_us: AtomicU64,
    /// Microseconds the scheduler waited for the masks once a step was launched (part of
    /// `forward_us`).
    pub mask_wait_us: AtomicU64,
    pub requests_finished: AtomicU64,
    pub requests_cancelled: AtomicU64,
    /// Speculative decoding: tokens drafted and verified, accepted, and verifications.
    pub spec_drafted: AtomicU64,
    pub spec_accepted: AtomicU64,
    pub spec_rounds: AtomicU64,
}

impl SchedulerStats {
    /// Several schedulers' statistics added up (counters and gauges alike).
    fn sum<'a>(all: impl IntoIterator<Item = &'a SchedulerStats>) -> SchedulerStats {
        let out = SchedulerStats::default();
        let add = |to: &AtomicU64, from: &AtomicU64| {
            to.fetch_add(from.load(Ordering::Relaxed), Ordering::Relaxed);
        };
        for s in all {
            // Every field by name: a field added later must be added up here too.
            let SchedulerStats {
                waiting,
                running,
                blocks_used,
                blocks_cached_idle,
                blocks_free,
                prefix_hit_blocks,
                prefix_hit_tokens,
                tokens_evaluated,
                tokens_generated,
                preemptions,
                steps,
                chained_steps,
                forward_us,
                host_us,
                mask_us,
                mask_wait_us,
                requests_finished,
                requests_cancelled,
                spec_drafted,
                spec_accepted,
                spec_rounds,
            } = s;
            add(&out.waiting, waiting);
            add(&out.running, running);
            add(&out.blocks_used, blocks_used);
            add(&out.blocks_cached_idle, blocks_cached_idle);
            add(&out.blocks_free, blocks_free);
            add(&out.prefix_hit_blocks, prefix_hit_blocks);
            add(&out.prefix_hit_tokens, prefix_hit_tokens);
            add(&out.tokens_evaluated, tokens_evaluated);
            add(&out.tokens_generated, tokens_generated);
            add(&out.preemptions, preemptions);
            add(&out.steps, steps);
            add(&out.chained_steps, chained_steps);
            add(&out.forward_us, forward_us);
            add(&out.host_us, host_us);
            add(&out.mask_us, mask_us);
            add(&out.mask_wait_us, mask_wait_us);
            add(&out.requests_finished, requests_finished);
            add(&out.requests_cancelled, requests_cancelled);
            add(&out.spec_drafted, spec_drafted);
            add(&out.spec_accepted, spec_accepted);
            add(&out.spec_rounds, spec_rounds);
        }
        out
    }
}

/// One scheduler thread: its queue and its statistics.
struct Replica {
    tx: mpsc::Sender<Job>,
    stats: Arc<SchedulerStats>,
}

/// The submitting side; cheap to clone. Over several schedulers (data parallelism: each a
/// replica of the model on its own devices, see [`SchedulerHandle::data_parallel`]) a
/// request goes to the one with the fewest requests waiting and running.
#[derive(Clone)]
pub struct SchedulerHandle {
    replicas: Arc<[Replica]>,
    info: Arc<SchedulerInfo>,
    /// Most positions a prompt may take on every replica (its KV cache's, its context's).
    positions: usize,
    /// Where the search for the least loaded replica starts (turns, so ties alternate).
    turn: Arc<std::sync::atomic::AtomicUsize>,
}

impl SchedulerHandle {
    fn single(tx: mpsc::Sender<Job>, info: SchedulerInfo, stats: Arc<SchedulerStats>) -> Self {
        SchedulerHandle {
            positions: info.n_blocks * info.block_size,
            replicas: Arc::from(vec![Replica { tx, stats }]),
            info: Arc::new(info),
            turn: Arc::default(),
        }
    }

    /// One handle over several schedulers of the same model (vLLM's data parallelism: each
    /// runs a whole replica on its own devices): requests go to the least loaded. Its
    /// information adds up the replicas' caches and sequences; a prompt must fit the
    /// smallest cache and context.
    pub fn data_parallel(handles: Vec<SchedulerHandle>) -> anyhow::Result<SchedulerHandle> {
        let Some(first) = handles.first() else {
            anyhow::bail!("data parallelism over no scheduler");
        };
        let mut info = (*first.info).clone();
        let mut positions = first.positions;
        if handles.len() > 1 {
            let mut backends = Vec::new();
            (info.n_blocks, info.max_seqs) = (0, 0);
            for h in &handles {
                let i = &h.info;
                if (i.vocab_size, i.n_embd, &i.arch) != (info.vocab_size, info.n_embd, &info.arch) {
                    anyhow::bail!(
                        "data parallelism over different models ({} and {})",
                        info.arch,
                        i.arch
                    );
                }
                positions = positions.min(h.positions);
                info.ctx = info.ctx.min(i.ctx);
                info.n_blocks += i.n_blocks;
                info.max_seqs += i.max_seqs;
                backends.push(i.backend.as_str());
            }
            info.backend = format!("{} replicas: {}", handles.len(), backends.join("; "));
        }
        let replicas: Vec<Replica> = handles
            .iter()
            .flat_map(|h| h.replicas.iter())
            .map(|r| Replica {
                tx: r.tx.clone(),
                stats: r.stats.clone(),
            })
            .collect();
        Ok(SchedulerHandle {
            replicas: Arc::from(replicas),
            info: Arc::new(info),
            positions,
            turn: Arc::default(),
        })
    }

    pub fn info(&self) -> &SchedulerInfo {
        &self.info
    }

    /// The statistics, added up over the replicas.
    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats::sum(self.replicas.iter().map(|r| &*r.stats))
    }

    /// Schedulers behind this handle (more than one under data parallelism).
    pub fn replicas(&self) -> usize {
        self.replicas.len()
    }

    /// The replica with the fewest requests waiting and running (ties: in turn).
    fn least_loaded(&self) -> &Replica {
        let n = self.replicas.len();
        let start = self.turn.fetch_add(1, Ordering::Relaxed) % n;
        let load = |r: &Replica| {
            r.stats.waiting.load(Ordering::Relaxed) + r.stats.running.load(Ordering::Relaxed)
        };
        (0..n)
            .map(|k| &self.replicas[(start + k) % n])
            .min_by_key(|r| load(r))
            .unwrap_or(&self.replicas[0])
    }

    /// Checks a request and queues it. Its events arrive on its sink.
    pub fn submit(&self, req: Request) -> Result<(), SubmitError> {
        self.submit_filtered(req, None)
    }

    /// [`Self::submit`] with a [`TokenFilter`] restricting the request's tokens.
    pub fn submit_filtered(
        &self,
        req: Request,
        filter: Option<Box<dyn TokenFilter>>,
    ) -> Result<(), SubmitError> {
        let info = &self.info;
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if let Some((index, &id)) = req
            .prompt
            .iter()
            .enumerate()
            .find(|&(_, &id)| id as usize >= info.vocab_size)
        {
            return Err(SubmitError::TokenOutOfRange {
                index,
                id,
                vocab: info.vocab_size,
            });
        }
        let positions = self.positions;
        if req.prompt.len() > positions {
            return Err(SubmitError::PromptExceedsCache {
                len: req.prompt.len(),
                positions,
            });
        }
        if req.prompt.len() > info.ctx {
            return Err(SubmitError::PromptTooLong {
                len: req.prompt.len(),
                ctx: info.ctx,
            });
        }
        if req.max_tokens == 0 {
            return Err(SubmitError::NoTokens);
        }
        req.params.validate().map_err(SubmitError::BadParams)?;
        let replica = self.least_loaded();
        replica.stats.waiting.fetch_add(1, Ordering::Relaxed);
        replica.tx.send(Job::Generate(req, filter)).map_err(|_| {
            replica.stats.waiting.fetch_sub(1, Ordering::Relaxed);
            SubmitError::Stopped
        })
    }

    /// Checks an embedding request and queues it; its vectors arrive through its `reply`.
    pub fn embed(&self, req: EmbedRequest) -> Result<(), SubmitError> {
        let info = &self.info;
        if req.inputs.is_empty() || req.inputs.iter().any(Vec::is_empty) {
            return Err(SubmitError::EmptyPrompt);
        }
        for input in &req.inputs {
            if let Some((index, &id)) = input
                .iter()
                .enumerate()
                .find(|&(_, &id)| id as usize >= info.vocab_size)
            {
                return Err(SubmitError::TokenOutOfRange {
                    index,
                    id,
                    vocab: info.vocab_size,
                });
            }
            if input.len() > info.ctx {
                return Err(SubmitError::PromptTooLong {
                    len: input.len(),
                    ctx: info.ctx,
                });
            }
        }
        self.least_loaded()
            .tx
            .send(Job::Embed(req))
            .map_err(|_| SubmitError::Stopped)
    }
}

/// Starts the scheduler thread. `make_engine` runs on that thread (so backends whose handles
/// may not cross threads work); its error is returned here.
pub fn spawn<B, F>(make_engine: F, opts: SchedulerOptions) -> anyhow::Result<SchedulerHandle>
where
    B: Backend + 'static,
    F: FnOnce() -> anyhow::Result<Engine<B>> + Send + 'static,
{
    spawn_with(make_engine, || Ok(None), opts)
}

/// [`spawn`] with the drafter the scheduler speculates with when `opts.spec` is set (None:
/// prompt lookup). `make_drafter` runs on the scheduler thread before `make_engine` (a
/// draft model's memory is in use when the target's cache is sized); its error is returned
/// here.
pub fn spawn_with<B, F, D>(
    make_engine: F,
    make_drafter: D,
    opts: SchedulerOptions,
) -> anyhow::Result<SchedulerHandle>
where
    B: Backend + 'static,
    F: FnOnce() -> anyhow::Result<Engine<B>> + Send + 'static,
    D: FnOnce() -> anyhow::Result<Option<Box<dyn MultiDrafter>>> + Send + 'static,
{
    let (tx, rx) = mpsc::channel::<Job>();
    let (ready_tx, ready_rx) = mpsc::channel::<anyhow::Result<SchedulerInfo>>();
    let stats = Arc::new(SchedulerStats::default());
    let thread_stats = stats.clone();
    std::thread::Builder::new()
        .name("kestrel-scheduler".into())
        .spawn(move || {
            let made = make_drafter().and_then(|drafter| {
                let engine = Scheduler::check(make_engine()?, &opts)?;
                Ok((engine, drafter))
            });
            let (engine, drafter) = match made {
                Ok(made) => made,
                Err(err) => {
                    let _ = ready_tx.send(Err(err));
                    return;
                }
            };
            let mut s = Scheduler::new(engine, drafter, opts, rx, thread_stats);
            let _ = ready_tx.send(Ok(s.info()));
            s.run();
        })?;
    let info = ready_rx
        .recv()
        .map_err(|_| anyhow::anyhow!("the scheduler thread died while loading the engine"))??;
    Ok(SchedulerHandle::single(tx, info, stats))
}

struct Seq {
    /// Prompt then generated tokens; `tokens[..n_cached]` are in the cache, the rest are
    /// evaluated by coming steps (one pending token while decoding).
    tokens: Vec<u32>,
    prompt_len: usize,
    n_cached: usize,
    block_table: Vec<u32>,
    /// Leading blocks of `block_table` entered in the prefix cache, as links to their entries.
    shared: Vec<Link>,
    /// A block could not be entered (another sequence entered the same prefix first): the
    /// blocks after it are not entered either, keeping the shared blocks a prefix.
    sharing_stopped: bool,
    sampler: Sampler,
    generated: usize,
    max_tokens: usize,
    logprobs: Option<usize>,
    cached_prompt_tokens: Option<usize>,
    sink: Box<dyn TokenSink>,
    /// Grammar mask / logit bias: the sequence is sampled on the host.
    filter: Option<Box<dyn TokenFilter>>,
    /// The last token, sampled under the filter's mask and sent, that the filter has not
    /// yet accepted: the next step's preparation accepts it beside the forward pass (off
    /// the path between one step's token ids and the next step's launch).
    accept_next: Option<u32>,
    /// The request's id with the scheduler's drafter.
    id: u64,
    /// The draft length's control, when this sequence may speculate (never with a filter).
    control: Option<DraftControl>,
    /// Drafts at the end of `tokens` this step (evaluated with the pending token).
    n_drafts: usize,
    /// Seconds the drafter took for this step's drafts (part of the round's cost).
    draft_secs: f64,
}

/// Names one prefix-cache entry: its table key and its id (ids are never reused, so a link
/// to an evicted entry never matches a newer one stored under the same key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Link {
    key: u64,
    id: u64,
}

/// The parent of a sequence's first block.
const ROOT: Link = Link { key: 0, id: 0 };

struct CacheEntry {
    block: u32,
    id: u64,
    /// Id of the entry for the block before this one ([`ROOT`]'s for a first block).
    parent: u64,
    /// The block's token ids, compared on lookup so a hash collision is not a hit.
    tokens: Box<[u32]>,
    /// Running sequences holding this block.
    users: u32,
    last_used: u64,
    /// Block index in its sequence (deeper blocks are evicted first among equally old).
    depth: usize,
}

/// Table of cached full blocks keyed by chained hash, verified by token ids on lookup.
struct PrefixCache {
    entries: HashMap<u64, CacheEntry>,
    /// Entries no running sequence holds (evictable).
    idle: usize,
    next_id: u64,
    /// Key of a block from its parent's key and its tokens; replaceable to test collisions.
    hash: fn(u64, &[u32]) -> u64,
}

impl PrefixCache {
    fn new(hash: fn(u64, &[u32]) -> u64) -> Self {
        PrefixCache {
            entries: HashMap::new(),
            idle: 0,
            next_id: ROOT.id + 1,
            hash,
        }
    }

    /// Takes a user reference on the cached entries holding the longest run of `blocks`
    /// (each block's token ids, in order) from the start; returns their links and blocks.
    fn acquire<'a>(
        &mut self,
        blocks: impl Iterator<Item = &'a [u32]>,
        tick: u64,
    ) -> Vec<(Link, u32)> {
        let mut hit = Vec::new();
        let mut parent = ROOT;
        for tokens in blocks {
            let key = (self.hash)(parent.key, tokens);
            let Some(entry) = self.entries.get_mut(&key) else {
                break;
            };
            if entry.parent != parent.id || *entry.tokens != *tokens {
                break;
            }
            if entry.users == 0 {
                self.idle -= 1;
            }
            entry.users += 1;
            entry.last_used = tick;
            parent = Link { key, id: entry.id };
            hit.push((parent, entry.block));
        }
        hit
    }

    /// Enters `block` holding `tokens` after `parent`, with one user; None if its key is
    /// taken (the same prefix entered by another sequence, or a hash collision).
    fn insert(
        &mut self,
        parent: Link,
        tokens: &[u32],
        block: u32,
        tick: u64,
        depth: usize,
    ) -> Option<Link> {
        let key = (self.hash)(parent.key, tokens);
        if self.entries.contains_key(&key) {
            return None;
        }
        let id = self.next_id;
        self.next_id += 1;
        self.entries.insert(
            key,
            CacheEntry {
                block,
                id,
                parent: parent.id,
                tokens: tokens.into(),
                users: 1,
                last_used: tick,
                depth,
            },
        );
        Some(Link { key, id })
    }

    /// Drops one user reference taken by [`Self::acquire`] or [`Self::insert`].
    fn release(&mut self, link: Link, tick: u64) {
        if let Some(entry) = self.entries.get_mut(&link.key)
            && entry.id == link.id
            && entry.users > 0
        {
            entry.users -= 1;
            entry.last_used = tick;
            if entry.users == 0 {
                self.idle += 1;
            }
        }
    }

    /// Removes the least recently used idle entry (deepest first) and returns its block.
    fn evict_lru(&mut self) -> Option<u32> {
        if self.idle == 0 {
            return None;
        }
        let key = self
            .entries
            .iter()
            .filter(|(_, e)| e.users == 0)
            .min_by_key(|(_, e)| (e.last_used, std::cmp::Reverse(e.depth)))
            .map(|(&k, _)| k)?;
        let entry = self.entries.remove(&key)?;
        self.idle -= 1;
        Some(entry.block)
    }
}

struct Scheduler<B: Backend> {
    engine: Engine<B>,
    opts: SchedulerOptions,
    rx: mpsc::Receiver<Job>,
    stats: Arc<SchedulerStats>,
    waiting: VecDeque<Seq>,
    /// Embedding requests, run one per loop between generation steps.
    embeds: VecDeque<EmbedRequest>,
    /// Oldest first: the last one is preempted first.
    running: Vec<Seq>,
    prefix: PrefixCache,
    tick: u64,
    disconnected: bool,
    /// Logits of the current step (reused).
    logits: Vec<f32>,
    /// Microseconds the last step spent in the forward pass.
    last_forward_us: u64,
    /// Token ids of the current step when every row is plain greedy (reused).
    argmax_ids: Vec<u32>,
    /// The sampling rows of the step (reused).
    sampling: SamplingBatch,
    /// What speculating sequences draft with (prompt lookup or a draft model), while
    /// speculation is on.
    drafter: Option<Box<dyn MultiDrafter>>,
    /// The next request's id with the drafter.
    next_id: u64,
    /// Drafts of the current sequence (reused).
    draft_buf: Vec<u32>,
    /// Microseconds the drafter took this loop (model work outside the forward steps).
    draft_us: u64,
    /// A drafter error was reported (once; the sequence then decodes plainly).
    draft_failed: bool,
}

impl<B: Backend> Scheduler<B> {
    fn check(engine: Engine<B>, opts: &SchedulerOptions) -> anyhow::Result<Engine<B>> {
        if opts.max_seqs == 0 {
            anyhow::bail!("max_seqs must be at least 1");
        }
        if engine.max_logit_rows() < opts.max_seqs {
            anyhow::bail!(
                "the engine returns {} logit rows per step, {} sequences need one each",
                engine.max_logit_rows(),
                opts.max_seqs
            );
        }
        if let Some(spec) = &opts.spec {
            NgramDrafter::new(spec.ngram_min, spec.ngram_max)?;
            if spec.draft_max == 0 || spec.draft_min > spec.draft_max {
                anyhow::bail!(
                    "drafts of {}..={} tokens: need 1 <= max and min <= max",
                    spec.draft_min,
                    spec.draft_max
                );
            }
        }
        Ok(engine)
    }

    fn new(
        engine: Engine<B>,
        drafter: Option<Box<dyn MultiDrafter>>,
        opts: SchedulerOptions,
        rx: mpsc::Receiver<Job>,
        stats: Arc<SchedulerStats>,
    ) -> Self {
        let mut opts = opts;
        if engine.config().has_recurrent_layers() && (opts.prefix_cache || opts.spec.is_some()) {
            // A linear-attention layer's state is one per sequence, not per block: shared
            // prefix blocks and rejected drafts could not be restored from the cache.
            eprintln!(
                "note: {} has linear-attention layers: prefix caching and speculative \
                 decoding are off for it",
                engine.config().arch.name()
            );
            opts.prefix_cache = false;
            opts.spec = None;
        }
        let drafter = opts.spec.as_ref().map(|spec| {
            drafter.unwrap_or_else(|| {
                Box::new(
                    NgramDrafter::new(spec.ngram_min, spec.ngram_max)
                        .expect("sizes checked at start"),
                )
            })
        });
        let s = Scheduler {
            engine,
            opts,
            rx,
            stats,
            waiting: VecDeque::new(),
            embeds: VecDeque::new(),
            running: Vec::new(),
            logits: Vec::new(),
            last_forward_us: 0,
            argmax_ids: Vec::new(),
            sampling: SamplingBatch::default(),
            prefix: PrefixCache::new(block_hash),
            tick: 0,
            disconnected: false,
            drafter,
            next_id: 0,
            draft_buf: Vec::new(),
            draft_us: 0,
            draft_failed: false,
        };
        s.publish();
        s
    }

    fn info(&self) -> SchedulerInfo {
        let cfg = self.engine.config();
        SchedulerInfo {
            vocab_size: cfg.vocab_size,
            ctx: self.engine.ctx,
            n_blocks: self.engine.blocks.n_blocks(),
            block_size: self.engine.blocks.block_size(),
            kv_bytes_per_token: self.engine.kv_bytes_per_token,
            max_seqs: self.opts.max_seqs,
            arch: cfg.arch.name().to_string(),
            backend: self.engine.backend.name(),
            n_embd: cfg.n_embd,
            pooling: cfg.pooling,
        }
    }

    fn run(&mut self) {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() && self.embeds.is_empty() {
                if self.disconnected {
                    return;
                }
                match self.rx.recv() {
                    Ok(req) => self.enqueue(req),
                    Err(_) => return,
                }
            }
            loop {
                match self.rx.try_recv() {
                    Ok(req) => self.enqueue(req),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        self.disconnected = true;
                        break;
                    }
                }
            }
            let started = Instant::now();
            self.drop_cancelled();
            let embed_us = self.run_embed();
            self.admit();
            let worked = self.step();
            self.publish();
            let total = started.elapsed().as_micros() as u64;
            let forward = std::mem::take(&mut self.last_forward_us)
                + embed_us
                + std::mem::take(&mut self.draft_us);
            self.stats
                .host_us
                .fetch_add(total.saturating_sub(forward), Ordering::Relaxed);
            if !worked && !self.waiting.is_empty() {
                // Nothing could run (should not happen: a lone sequence always fits). Wait
                // for new requests instead of spinning.
                if let Ok(req) = self.rx.recv_timeout(Duration::from_millis(5)) {
                    self.enqueue(req);
                }
            }
        }
    }

    /// Runs the oldest embedding request, if any: its blocks come from idle prefix-cache
    /// blocks, then from preempting the youngest running sequences. Returns the
    /// microseconds it took.
    fn run_embed(&mut self) -> u64 {
        let Some(req) = self.embeds.pop_front() else {
            return 0;
        };
        let lens: Vec<usize> = req.inputs.iter().map(Vec::len).collect();
        let needed = self.engine.embed_blocks(&lens);
        let total = self.engine.blocks.n_blocks();
        if needed > total {
            (req.reply)(Err(format!(
                "the inputs need {needed} KV blocks at once, the cache has {total}"
            )));
            return 0;
        }
        while self.engine.blocks.n_free() < needed && self.evict_one() {}
        while self.engine.blocks.n_free() < needed && !self.running.is_empty() {
            self.preempt_youngest();
        }
        let started = Instant::now();
        let inputs: Vec<&[u32]> = req.inputs.iter().map(Vec::as_slice).collect();
        let result = self
            .engine
            .embed(&inputs, req.pooling)
            .map_err(|e| format!("embedding failed: {e:#}"));
        let us = started.elapsed().as_micros() as u64;
        self.stats.forward_us.fetch_add(us, Ordering::Relaxed);
        self.stats
            .tokens_evaluated
            .fetch_add(lens.iter().sum::<usize>() as u64, Ordering::Relaxed);
        (req.reply)(result);
        us
    }

    fn enqueue(&mut self, job: Job) {
        let (req, filter) = match job {
            Job::Generate(req, filter) => (req, filter),
            Job::Embed(req) => {
                self.embeds.push_back(req);
                return;
            }
        };
        self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
        let prompt_len = req.prompt.len();
        let control = self
            .opts
            .spec
            .as_ref()
            // A filtered sequence (grammar, logit bias) is sampled on the host: no drafts.
            .filter(|_| req.speculative && filter.is_none())
            .map(|spec| DraftControl::new(spec.draft_min, spec.draft_max));
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back(Seq {
            tokens: req.prompt,
            prompt_len,
            n_cached: 0,
            block_table: Vec::new(),
            shared: Vec::new(),
            sharing_stopped: false,
            sampler: Sampler::new(req.params),
            generated: 0,
            max_tokens: req.max_tokens,
            logprobs: req.logprobs,
            cached_prompt_tokens: None,
            sink: req.sink,
            filter,
            accept_next: None,
            id,
            control,
            n_drafts: 0,
            draft_secs: 0.0,
        });
    }

    /// Frees the sequences whose clients are gone.
    fn drop_cancelled(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].sink.is_closed() {
                let mut seq = self.running.remove(i);
                self.release(&mut seq);
                self.stats
                    .requests_cancelled
                    .fetch_add(1, Ordering::Relaxed);
            } else {
                i += 1;
            }
        }
        let before = self.waiting.len();
        self.waiting.retain(|s| !s.sink.is_closed());
        let gone = before - self.waiting.len();
        self.stats
            .requests_cancelled
            .fetch_add(gone as u64, Ordering::Relaxed);
    }

    /// Moves waiting sequences to running while their tokens' blocks can be had, keeping one
    /// block per running sequence in reserve for their next decode.
    fn admit(&mut self) {
        while self.running.len() < self.opts.max_seqs {
            let Some(mut seq) = self.waiting.pop_front() else {
                return;
            };
            self.adopt_cached_prefix(&mut seq);
            let needed = self
                .engine
                .blocks
                .blocks_for(seq.tokens.len())
                .saturating_sub(seq.block_table.len());
            let reserve = self.running.len();
            while self.engine.blocks.n_free() < needed + reserve && self.evict_one() {}
            let ok = self.engine.blocks.n_free() >= needed + reserve
                && self
                    .engine
                    .blocks
                    .ensure(&mut seq.block_table, seq.tokens.len())
                    .is_ok();
            if !ok {
                self.release(&mut seq);
                self.waiting.push_front(seq);
                return;
            }
            if seq.cached_prompt_tokens.is_none() {
                seq.cached_prompt_tokens = Some(seq.n_cached);
            }
            self.running.push(seq);
        }
    }

    /// Points `seq`'s first blocks at cached blocks holding the same tokens. At least the
    /// last token is always left to compute: its logits are needed.
    fn adopt_cached_prefix(&mut self, seq: &mut Seq) {
        if !self.opts.prefix_cache || !seq.block_table.is_empty() {
            return;
        }
        let bs = self.engine.blocks.block_size();
        let full = (seq.tokens.len() - 1) / bs;
        self.tick += 1;
        let hit = self
            .prefix
            .acquire(seq.tokens[..full * bs].chunks_exact(bs), self.tick);
        for &(link, block) in &hit {
            self.engine.blocks.share(&[block]);
            seq.block_table.push(block);
            seq.shared.push(link);
        }
        let hit = hit.len();
        seq.n_cached = hit * bs;
        self.stats
            .prefix_hit_blocks
            .fetch_add(hit as u64, Ordering::Relaxed);
        self.stats
            .prefix_hit_tokens
            .fetch_add((hit * bs) as u64, Ordering::Relaxed);
    }

    /// Enters `seq`'s newly completed blocks in the prefix cache.
    fn register_blocks(&mut self, seq: &mut Seq) {
        if !self.opts.prefix_cache || seq.sharing_stopped {
            return;
        }
        let bs = self.engine.blocks.block_size();
        let full = seq.n_cached / bs;
        while seq.shared.len() < full {
            let i = seq.shared.len();
            let parent = seq.shared.last().copied().unwrap_or(ROOT);
            let tokens = &seq.tokens[i * bs..(i + 1) * bs];
            let block = seq.block_table[i];
            let Some(link) = self.prefix.insert(parent, tokens, block, self.tick, i) else {
                seq.sharing_stopped = true;
                return;
            };
            self.engine.blocks.share(&[block]);
            seq.shared.push(link);
        }
    }

    /// Gives back one idle cached block (least recently used, deepest first); false if none.
    fn evict_one(&mut self) -> bool {
        match self.prefix.evict_lru() {
            Some(block) => {
                self.engine.blocks.release(&mut vec![block]);
                true
            }
            None => false,
        }
    }

    /// Returns a sequence's blocks (the prefix cache keeps its own references).
    fn release(&mut self, seq: &mut Seq) {
        self.tick += 1;
        for link in seq.shared.drain(..) {
            self.prefix.release(link, self.tick);
        }
        self.engine.forget_state(&seq.block_table);
        self.engine.blocks.release(&mut seq.block_table);
        if let Some(drafter) = self.drafter.as_mut() {
            drafter.release(seq.id);
        }
        seq.n_cached = 0;
        seq.sharing_stopped = false;
    }

    /// Frees the youngest running sequence and puts it back at the front of the queue.
    fn preempt_youngest(&mut self) {
        if let Some(mut seq) = self.running.pop() {
            self.release(&mut seq);
            self.stats.preemptions.fetch_add(1, Ordering::Relaxed);
            self.waiting.push_front(seq);
        }
    }

    /// Builds and runs one batch; false if there was nothing to run.
    fn step(&mut self) -> bool {
        if self.may_chain()
            && let Some(worked) = self.chain_steps()
        {
            return worked;
        }
        let budget = self.engine.max_batch_tokens();
        let mut prefill_budget = self.opts.max_prefill_tokens.clamp(1, budget);
        // (index into running, tokens this step), decodes first then prefill chunks.
        let mut plan: Vec<(usize, usize)> = Vec::new();
        let mut used = 0;

        // Speculation: only while few sequences run and none needs its logit rows on the
        // host (log-probabilities, a filter); drafts use the logit rows beyond one per
        // running sequence.
        let spec_max_seqs = self.opts.spec.as_ref().map_or(0, |s| s.max_seqs);
        let may_speculate = self.running.len() <= spec_max_seqs
            && self
                .running
                .iter()
                .all(|s| s.logprobs.is_none() && s.filter.is_none());
        let mut spare_rows = self
            .engine
            .max_logit_rows()
            .saturating_sub(self.running.len());

        // Decodes: one pending token each (and its drafts); may need a new block.
        let mut i = 0;
        while i < self.running.len() && used < budget {
            let seq = &self.running[i];
            if seq.tokens.len() - seq.n_cached != 1 {
                i += 1;
                continue;
            }
            let positions = seq.tokens.len();
            if !self.reserve(i, positions) {
                // `i` itself was preempted (it was the youngest): nothing after it remains.
                break;
            }
            plan.push((i, 1));
            used += 1;
            if may_speculate {
                let d = self.draft(i, (budget - used).min(spare_rows));
                if let Some(last) = plan.last_mut() {
                    last.1 += d;
                }
                used += d;
                spare_rows -= d;
            }
            i += 1;
        }
        // Prefill chunks (their blocks were taken at admission).
        for (i, seq) in self.running.iter().enumerate() {
            let remaining = seq.tokens.len() - seq.n_cached;
            if remaining <= 1 + seq.n_drafts {
                continue;
            }
            let n = remaining.min(budget - used).min(prefill_budget);
            if n == 0 {
                break;
            }
            plan.push((i, n));
            used += n;
            prefill_budget -= n;
        }
        if plan.is_empty() {
            return false;
        }
        // Sort by sequence so each sequence's slot index is its plan index.
        plan.sort_unstable_by_key(|&(i, _)| i);

        let mut batch = Batch::default();
        // Whether every sequence sampling this step takes the plain argmax, and whether one
        // needs its logit row on the host (log-probabilities, a filter that is not a token
        // mask). Otherwise the backend samples the rows itself (on the device for CUDA),
        // under the masks of the sequences whose filter is one, and returns token ids only.
        let mut all_plain = true;
        let mut rows_needed = false;
        let mut any_masked = false;
        let mut draws = std::mem::take(&mut self.sampling);
        draws.clear();
        for (slot, &(i, n)) in plan.iter().enumerate() {
            let seq = &self.running[i];
            let start = seq.n_cached;
            // The part ending the sequence's tokens samples: one logit row.
            let samples = start + n == seq.tokens.len();
            // A speculating sequence has a row after its pending token and after each draft.
            let rows = if samples { 1 + seq.n_drafts } else { 0 };
            batch.push_part(
                slot,
                &seq.tokens[start..start + n],
                start,
                &seq.block_table,
                rows,
            );
            if samples {
                let masked =
                    seq.logprobs.is_none() && seq.filter.as_ref().is_some_and(|f| f.is_mask());
                let host = seq.logprobs.is_some() || (seq.filter.is_some() && !masked);
                all_plain &= seq.sampler.is_argmax() && !host && !masked;
                rows_needed |= host;
                any_masked |= masked;
            }
        }
        let sample_rows = !all_plain && !rows_needed;
        let masked_step = sample_rows && any_masked;
        if sample_rows {
            // Each sampling sequence's row, in logit-row order (plan order), with its draw.
            for &(i, n) in &plan {
                let seq = &mut self.running[i];
                if seq.n_cached + n == seq.tokens.len() {
                    // Speculating sequences are greedy: their rows draw nothing.
                    for _ in 0..=seq.n_drafts {
                        seq.sampler.push_row(&mut draws, &seq.tokens);
                    }
                }
            }
        }

        let vocab = self.engine.config().vocab_size;
        // The scheduler's own logits buffer (sampling needs `self` while reading them): the
        // backend writes into it, no copy and no allocation per step.
        let mut logits = std::mem::take(&mut self.logits);
        let forward_started = Instant::now();
        let mut argmax_ids = std::mem::take(&mut self.argmax_ids);
        // The filters of the sequences sampling this step prepare their next token's
        // restriction on the filter pool beside the forward pass, from the step's start
        // (on the H100, starting them once a 64-row step was launched left the forward
        // waiting 0.43 ms for masks: the launch itself takes 1.6 ms of host time), each
        // first accepting the token it was left last step.
        // In a masked step each also writes its mask (one chunk of `words` a filter),
        // which the backend applies once they are ready.
        let mut filters: Vec<StepFilter> = Vec::new();
        let mut plan_at = plan.iter().peekable();
        let mut row = 0;
        for (i, seq) in self.running.iter_mut().enumerate() {
            let Some(&(_, n)) = plan_at.next_if(|p| p.0 == i) else {
                continue;
            };
            if seq.n_cached + n == seq.tokens.len() {
                if let Some(f) = seq.filter.as_mut() {
                    filters.push((f, seq.accept_next.take(), row, i));
                }
                row += 1 + seq.n_drafts;
            }
        }
        let words = vocab.div_ceil(32).max(1);
        let filters_empty = filters.is_empty();
        let mut mask_buf = std::mem::take(&mut draws.masks);
        let (mut mask_us, mut mask_wait_us, mut launch_us) = (0, 0, 0);
        let engine = &mut self.engine;
        // The filters' work, run on the filter pool beside the forward pass; what it made
        // comes back through `done`.
        let (done, made) = mpsc::sync_channel(1);
        let prepare = move || {
            let started = Instant::now();
            // The token left last step first: a filter it ends (output complete, or an
            // error) prepares nothing more, and this step's token is dropped.
            let settle = |f: &mut Box<dyn TokenFilter>, token: Option<u32>| match token
                .map(|t| f.accept(t))
            {
                None | Some(Ok(false)) => {
                    f.prepare();
                    None
                }
                end => end,
            };
            if !masked_step {
                let ends = filters
                    .par_iter_mut()
                    .filter_map(|(f, token, _, i)| Some((*i, settle(f, token.take())?)))
                    .collect();
                let _ = done.send(Prepared {
                    masks: mask_buf,
                    written: Vec::new(),
                    ends,
                    took: started.elapsed(),
                });
                return;
            }
            // Every word is written by `mask` or belongs to no mask: no clearing.
            mask_buf.resize(filters.len() * words, 0);
            mask_buf.truncate(filters.len() * words);
            let (written, ends): (Vec<(usize, bool)>, Vec<Option<FilterEnd>>) = filters
                .par_iter_mut()
                .zip(mask_buf.par_chunks_mut(words))
                .map(|((f, token, row, i), m)| match settle(f, token.take()) {
                    None => ((*row, f.is_mask() && f.mask(m)), None),
                    Some(end) => ((*row, false), Some((*i, end))),
                })
                .unzip();
            let _ = done.send(Prepared {
                masks: mask_buf,
                written,
                ends: ends.into_iter().flatten().collect(),
                took: started.elapsed(),
            });
        };
        let mut prepared: Option<Prepared> = None;
        let mut step = || {
            if all_plain {
                // (No filter samples in such a step; were one to, it prepares after it.)
                engine.step_argmax(&batch, &mut argmax_ids)
            } else if masked_step {
                let masks = |draws: &mut SamplingBatch| {
                    launch_us = forward_started.elapsed().as_micros() as u64;
                    let waiting = Instant::now();
                    let Ok(mut p) = made.recv() else {
                        return; // the preparation panicked: the scope re-raises it
                    };
                    mask_wait_us = waiting.elapsed().as_micros() as u64;
                    draws.masks = std::mem::take(&mut p.masks);
                    draws.mask_words = words;
                    draws.mask_of.clear();
                    draws.mask_of.resize(draws.rows.len(), NO_MASK);
                    for (k, &(row, ok)) in p.written.iter().enumerate() {
                        if let (true, Some(m)) = (ok, draws.mask_of.get_mut(row)) {
                            *m = k as u32;
                        }
                    }
                    prepared = Some(p);
                };
                engine.step_sample_masked(&batch, &mut draws, masks, &mut argmax_ids)
            } else if sample_rows {
                engine.step_sample(&batch, &draws, &mut argmax_ids)
            } else {
                engine.step_into(&batch, &mut logits)
            }
        };
        let result = if filters_empty {
            step()
        } else {
            // Beside the forward pass, on rayon's global pool where the filter pool could
            // not start.
            match filter_pool() {
                Some(pool) => pool.in_place_scope(|scope| {
                    scope.spawn(move |_| prepare());
                    step()
                }),
                None => rayon::in_place_scope(|scope| {
                    scope.spawn(move |_| prepare());
                    step()
                }),
            }
        };
        if prepared.is_none()
            && !filters_empty
            && let Ok(p) = made.recv()
        {
            prepared = Some(p);
        }
        // Filters that ended on the token they were left: by sampling slot, below.
        let mut ends = Vec::new();
        if let Some(mut p) = prepared {
            mask_us = p.took.as_micros() as u64;
            if draws.masks.capacity() == 0 {
                draws.masks = std::mem::take(&mut p.masks);
            }
            ends = p.ends;
        }
        self.stats.mask_us.fetch_add(mask_us, Ordering::Relaxed);
        self.stats
            .mask_wait_us
            .fetch_add(mask_wait_us, Ordering::Relaxed);
        self.last_forward_us = forward_started.elapsed().as_micros() as u64;
        if step_log() {
            let prefill: usize = plan.iter().filter(|p| p.1 > 1).map(|p| p.1).sum();
            eprintln!(
                "step tokens {} seqs {} prefill_tokens {prefill} forward_us {} launch_us {launch_us} masks_us {mask_us} mask_wait_us {mask_wait_us}",
                batch.len(),
                plan.len(),
                self.last_forward_us
            );
        }
        self.stats
            .forward_us
            .fetch_add(self.last_forward_us, Ordering::Relaxed);
        match result {
            Ok(()) => {}
            Err(err) => {
                self.logits = logits;
                self.argmax_ids = argmax_ids;
                self.sampling = draws;
                let msg = format!("evaluation failed: {err:#}");
                let mut failed: Vec<usize> = plan.iter().map(|&(i, _)| i).collect();
                failed.sort_unstable();
                for &i in failed.iter().rev() {
                    let mut seq = self.running.remove(i);
                    seq.sink.send(Event::Error(msg.clone()));
                    self.release(&mut seq);
                }
                return true;
            }
        }
        self.stats
            .tokens_evaluated
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        self.stats.steps.fetch_add(1, Ordering::Relaxed);

        // The sequences sampling this step, in logit-row order. Their tokens came from the
        // backend unless some row's log-probabilities need the rows here; then every row is
        // sampled here, each on its own core.
        let step_secs = self.last_forward_us as f64 * 1e-6;
        let mut sampling = Vec::with_capacity(batch.logit_rows.len());
        // Where each sampling sequence's rows start (a speculating one has 1 + drafts).
        let mut first_row = Vec::with_capacity(batch.logit_rows.len());
        let mut next_row = 0;
        for &(i, n) in &plan {
            let seq = &mut self.running[i];
            seq.n_cached += n;
            if seq.n_cached == seq.tokens.len() {
                sampling.push(i);
                first_row.push(next_row);
                next_row += 1 + seq.n_drafts;
            }
            if let (1, Some(control)) = (n, &mut seq.control) {
                control.record_plain(step_secs);
            }
        }
        let (rows, picks): (Vec<&[f32]>, Vec<Option<u32>>) = if all_plain || sample_rows {
            (
                vec![&[][..]; sampling.len()],
                first_row
                    .iter()
                    .map(|&r| argmax_ids.get(r).copied())
                    .collect(),
            )
        } else {
            // Every sampling sequence's filter and sampler with its history, in `sampling`
            // order: each row is filtered and sampled on its own core. One thread took ~0.5
            // ms a row with top-k over a 128K-word vocabulary, tens of ms a step at 64
            // sequences. A greedy row's filter picks the best allowed token by walking its
            // mask, without a pass writing the row (unless the row's log-probs are wanted).
            let mut slot_of = vec![usize::MAX; self.running.len()];
            for (k, &i) in sampling.iter().enumerate() {
                slot_of[i] = k;
            }
            type Work<'a> = (
                &'a mut Sampler,
                &'a [u32],
                Option<&'a mut Box<dyn TokenFilter>>,
                bool,
            );
            let mut work: Vec<Option<Work>> = (0..sampling.len()).map(|_| None).collect();
            for (seq, &k) in self.running.iter_mut().zip(&slot_of) {
                if let Some(slot) = work.get_mut(k) {
                    *slot = Some((
                        &mut seq.sampler,
                        seq.tokens.as_slice(),
                        seq.filter.as_mut(),
                        seq.logprobs.is_some(),
                    ));
                }
            }
            let picks = work
                .par_iter_mut()
                .zip(logits.par_chunks_exact_mut(vocab))
                .map_init(Vec::new, |words, (slot, row)| {
                    let (sampler, history, filter, logprobs) = slot.as_mut()?;
                    if let Some(f) = filter {
                        if sampler.is_argmax() && !*logprobs && f.is_mask() {
                            words.clear();
                            words.resize(vocab.div_ceil(32), 0);
                            if f.mask(words) {
                                return Some(masked_argmax(row, words));
                            }
                        }
                        f.apply(row);
                    }
                    Some(sampler.sample(row, history))
                })
                .collect();
            let rows: Vec<&[f32]> = logits.chunks_exact(vocab).take(sampling.len()).collect();
            (rows, picks)
        };
        // The filters record their chosen tokens first, on the filter pool when there are
        // many (a grammar's step takes microseconds a row). An end-of-generation token is
        // never shown to a filter. A token drawn under the filter's mask on the device is
        // left for the next step's preparation to accept (`accept_next`) unless it may end
        // the sequence by length (whether the filter completes there decides the reason).
        let mut accepted: Vec<Option<Result<bool, String>>> = Vec::new();
        let mut defer = Vec::new();
        // Filters that ended beside this step on the token they were left: their sequence
        // ends and this step's token is dropped.
        let mut ended: Vec<Option<Result<bool, String>>> = Vec::new();
        if self.running.iter().any(|s| s.filter.is_some()) {
            accepted.resize(sampling.len(), None);
            defer.resize(sampling.len(), false);
            ended.resize(sampling.len(), None);
            let mut slot_of = vec![usize::MAX; self.running.len()];
            for (k, &i) in sampling.iter().enumerate() {
                slot_of[i] = k;
            }
            for (i, end) in ends {
                if let Some(e) = slot_of.get(i).and_then(|&k| ended.get_mut(k)) {
                    *e = Some(end);
                }
            }
            let eog = &self.opts.eog;
            let ctx = self.engine.ctx;
            let mut work: Vec<(usize, &mut Box<dyn TokenFilter>, u32)> = Vec::new();
            for (seq, &k) in self.running.iter_mut().zip(&slot_of) {
                let (Some(Some(id)), Some(f)) = (picks.get(k), seq.filter.as_mut()) else {
                    continue;
                };
                if seq.n_drafts > 0 || eog.contains(id) || ended[k].is_some() {
                    continue;
                }
                let masked = draws
                    .mask_of
                    .get(first_row[k])
                    .is_some_and(|&m| m != NO_MASK);
                let may_end = seq.generated + 1 >= seq.max_tokens || seq.tokens.len() + 1 > ctx;
                if masked_step && masked && !may_end {
                    defer[k] = true;
                } else {
                    work.push((k, f, *id));
                }
            }
            // Few rows stay on this thread: waking the pool costs more than they do.
            let results: Vec<(usize, Result<bool, String>)> = if work.len() < PARALLEL_ACCEPT {
                work.into_iter()
                    .map(|(k, f, id)| (k, f.accept(id)))
                    .collect()
            } else {
                let accept = || {
                    work.into_par_iter()
                        .map(|(k, f, id)| (k, f.accept(id)))
                        .collect()
                };
                match filter_pool() {
                    Some(pool) => pool.install(accept),
                    None => accept(),
                }
            };
            for (k, r) in results {
                accepted[k] = Some(r);
            }
        }
        let mut finished = Vec::new();
        for (k, ((&i, row), pick)) in sampling.iter().zip(&rows).zip(picks).enumerate() {
            let drafts = self.running[i].n_drafts;
            let done = if let Some(end) = ended.get_mut(k).and_then(Option::take) {
                match end {
                    Ok(_) => Some(Some(FinishReason::Stop)),
                    Err(e) => {
                        self.running[i].sink.send(Event::Error(e));
                        Some(None)
                    }
                }
            } else if drafts > 0 {
                let ids = argmax_ids.get(first_row[k]..first_row[k] + 1 + drafts);
                let secs = step_secs + self.running[i].draft_secs;
                self.verify(i, ids.unwrap_or(&[]), secs)
            } else {
                let accepted = accepted.get_mut(k).and_then(Option::take);
                let defer = defer.get(k).copied().unwrap_or(false);
                self.sample_into(i, row, pick, accepted, defer)
            };
            if let Some(reason) = done {
                finished.push((i, reason));
            }
        }
        drop(rows);
        self.argmax_ids = argmax_ids;
        self.sampling = draws;
        self.logits = logits;
        self.settle(finished);
        true
    }

    /// After a step: enters the running sequences' completed blocks in the prefix cache,
    /// then ends the `finished` ones (by index into `running`: `Some(reason)` done, `None`
    /// its client gone).
    fn settle(&mut self, mut finished: Vec<(usize, Option<FinishReason>)>) {
        let mut running = std::mem::take(&mut self.running);
        for seq in &mut running {
            self.register_blocks(seq);
        }
        self.running = running;
        finished.sort_unstable_by_key(|&(i, _)| i);
        for &(i, reason) in finished.iter().rev() {
            let mut seq = self.running.remove(i);
            if let Some(reason) = reason {
                let usage = Usage {
                    prompt_tokens: seq.prompt_len,
                    completion_tokens: seq.generated,
                    cached_prompt_tokens: seq.cached_prompt_tokens.unwrap_or(0),
                };
                seq.sink.send(Event::Done { reason, usage });
                self.stats.requests_finished.fetch_add(1, Ordering::Relaxed);
            } else {
                self.stats
                    .requests_cancelled
                    .fetch_add(1, Ordering::Relaxed);
            }
            self.release(&mut seq);
        }
    }

    /// Whether the next steps may be chained (the host a step ahead of the device,
    /// `Engine::step_chained`): every running sequence decodes its one pending token
    /// without drafts, a filter, log-probabilities or penalties, and nothing waits.
    fn may_chain(&self) -> bool {
        self.opts.spec.is_none()
            && self.waiting.is_empty()
            && self.embeds.is_empty()
            && !self.running.is_empty()
            && self.engine.can_chain()
            && self.running.iter().all(|s| {
                s.tokens.len() == s.n_cached + 1
                    && s.filter.is_none()
                    && s.logprobs.is_none()
                    && s.accept_next.is_none()
                    && s.n_drafts == 0
                    && !s.sampler.needs_history()
            })
    }

    /// Decode steps chained on the device while the running sequences stay the same: each
    /// step is recorded and queued before the ids of the one before are read, its input
    /// tokens being those ids where the device left them. The chain ends when a sequence
    /// finishes, may finish with its next token, a request arrives, a client leaves or a
    /// block is short; the step already queued then is read like the others (a finished
    /// sequence's row in it is dropped), and the sequences are left with one pending token
    /// each, as after a plain step. None: not even the first step's blocks were free
    /// without preempting (the caller runs a plain step).
    fn chain_steps(&mut self) -> Option<bool> {
        for seq in &mut self.running {
            let positions = seq.tokens.len();
            if self
                .engine
                .blocks
                .ensure(&mut seq.block_table, positions)
                .is_err()
            {
                return None;
            }
        }
        let started = Instant::now();
        let order: Vec<u64> = self.running.iter().map(|s| s.id).collect();
        let mut batch = Batch::default();
        let mut draws = std::mem::take(&mut self.sampling);
        let mut ids = std::mem::take(&mut self.argmax_ids);
        let mut result = self.queue_chained(&mut batch, &mut draws, false);
        let mut queued = usize::from(result.is_ok());
        let mut chaining = result.is_ok();
        while result.is_ok() && queued > 0 {
            if chaining {
                chaining = self.chain_may_go_on();
            }
            if chaining {
                result = self.queue_chained(&mut batch, &mut draws, true);
                if result.is_err() {
                    break;
                }
                queued += 1;
                self.stats.chained_steps.fetch_add(1, Ordering::Relaxed);
            }
            result = self.engine.read_chained(&mut ids);
            if result.is_err() {
                break;
            }
            queued -= 1;
            self.stats
                .tokens_evaluated
                .fetch_add(order.len() as u64, Ordering::Relaxed);
            self.stats.steps.fetch_add(1, Ordering::Relaxed);
            let mut finished = Vec::new();
            for (&sid, &id) in order.iter().zip(&ids) {
                let Some(i) = self.running.iter().position(|s| s.id == sid) else {
                    continue; // finished earlier in the chain: its row is dropped
                };
                match self.sample_into(i, &[], Some(id), None, false) {
                    // The queued step evaluates the new token.
                    None if queued > 0 => self.running[i].n_cached += 1,
                    None => {}
                    Some(reason) => finished.push((i, reason)),
                }
            }
            if !finished.is_empty() {
                chaining = false;
            }
            self.settle(finished);
            self.publish();
        }
        self.sampling = draws;
        self.argmax_ids = ids;
        let forward_us = started.elapsed().as_micros() as u64;
        self.last_forward_us = forward_us;
        self.stats
            .forward_us
            .fetch_add(forward_us, Ordering::Relaxed);
        if let Err(err) = result {
            // Steps still queued are waited for (their ids are not left to a later chain).
            for _ in 0..queued {
                let _ = self.engine.read_chained(&mut self.argmax_ids);
            }
            let msg = format!("evaluation failed: {err:#}");
            for mut seq in std::mem::take(&mut self.running) {
                seq.sink.send(Event::Error(msg.clone()));
                self.release(&mut seq);
            }
        }
        Some(true)
    }

    /// Whether another chained step may be queued: no request waits (one that arrived is
    /// queued now), no client left, and every sequence has room for its next token's step
    /// (within its length and the context, a block free without preempting).
    fn chain_may_go_on(&mut self) -> bool {
        match self.rx.try_recv() {
            Ok(job) => {
                self.enqueue(job);
                return false;
            }
            Err(mpsc::TryRecvError::Empty) => {}
            Err(mpsc::TryRecvError::Disconnected) => self.disconnected = true,
        }
        let ctx = self.engine.ctx;
        for seq in &mut self.running {
            // The next step evaluates the token being read now, at `tokens.len()`.
            if seq.sink.is_closed()
                || seq.generated + 1 >= seq.max_tokens
                || seq.tokens.len() + 1 >= ctx
                || self
                    .engine
                    .blocks
                    .ensure(&mut seq.block_table, seq.tokens.len() + 1)
                    .is_err()
            {
                return false;
            }
        }
        true
    }

    /// Queues one chained step of every running sequence: its pending token from the host
    /// (`on_device` false), or the id the step before chose, still on the device.
    fn queue_chained(
        &mut self,
        batch: &mut Batch,
        draws: &mut SamplingBatch,
        on_device: bool,
    ) -> anyhow::Result<()> {
        batch.clear_tokens();
        draws.clear();
        let all_argmax = self.running.iter().all(|s| s.sampler.is_argmax());
        for (slot, seq) in self.running.iter_mut().enumerate() {
            let (token, start) = if on_device {
                (0, seq.tokens.len())
            } else {
                (seq.tokens[seq.n_cached], seq.n_cached)
            };
            batch.push_part(slot, &[token], start, &seq.block_table, 1);
            if !all_argmax {
                seq.sampler.push_row(draws, &seq.tokens);
            }
        }
        batch.seqs.truncate(self.running.len());
        batch.tokens_on_device = on_device;
        self.engine
            .step_chained(batch, (!all_argmax).then_some(&*draws))?;
        if !on_device {
            for seq in &mut self.running {
                seq.n_cached += 1;
            }
        }
        Ok(())
    }

    /// Samples the next token of running sequence `i` from its logits and sends it. Returns
    /// `Some(Some(reason))` when the sequence is done, `Some(None)` when its client is gone.
    /// `pick`: the token already chosen (a plain greedy row's argmax), if any; `accepted`:
    /// what the sequence's filter said of it, where it was already asked; `defer`: the
    /// filter accepts the token at the next step's preparation instead (`accept_next`).
    fn sample_into(
        &mut self,
        i: usize,
        row: &[f32],
        pick: Option<u32>,
        accepted: Option<Result<bool, String>>,
        defer: bool,
    ) -> Option<Option<FinishReason>> {
        let ctx = self.engine.ctx;
        let eog = &self.opts.eog;
        let seq = &mut self.running[i];
        let id = pick.unwrap_or_else(|| seq.sampler.sample(row, &seq.tokens));
        seq.generated += 1;
        self.stats.tokens_generated.fetch_add(1, Ordering::Relaxed);
        if eog.contains(&id) {
            return Some(Some(FinishReason::Stop));
        }
        // A filter that rejects the token (or failed preparing) ends the request.
        let asked = if defer {
            None
        } else {
            accepted.or_else(|| seq.filter.as_mut().map(|f| f.accept(id)))
        };
        let complete = match asked {
            Some(Err(e)) => {
                seq.sink.send(Event::Error(e));
                return Some(None);
            }
            Some(Ok(complete)) => complete,
            None => false,
        };
        let logprob = seq.logprobs.map(|k| {
            let lp = log_softmax(row);
            TokenLogprob {
                logprob: lp.get(id as usize).copied().unwrap_or(f32::NEG_INFINITY),
                top: top_n(&lp, k),
            }
        });
        if !seq.sink.send(Event::Token { id, logprob }) {
            return Some(None);
        }
        if complete {
            return Some(Some(FinishReason::Stop));
        }
        if seq.generated >= seq.max_tokens || seq.tokens.len() + 1 > ctx {
            return Some(Some(FinishReason::Length));
        }
        seq.tokens.push(id);
        if defer {
            seq.accept_next = Some(id);
        }
        None
    }

    /// Appends up to `room` drafts to decoding sequence `i`'s tokens when it speculates and
    /// their blocks are free (speculation never evicts or preempts); returns how many.
    fn draft(&mut self, i: usize, room: usize) -> usize {
        let ctx = self.engine.ctx;
        let seq = &mut self.running[i];
        seq.draft_secs = 0.0;
        let (Some(drafter), Some(control)) = (self.drafter.as_mut(), &seq.control) else {
            return 0;
        };
        if !seq.sampler.is_argmax() {
            return 0;
        }
        // Within the context and the tokens still wanted (the target adds one of its own).
        let room = room
            .min(ctx - seq.tokens.len())
            .min(seq.max_tokens.saturating_sub(seq.generated + 1))
            .min(control.draft_len());
        if room == 0 || room < control.min_len() {
            return 0;
        }
        let mut drafts = std::mem::take(&mut self.draft_buf);
        drafts.clear();
        let started = Instant::now();
        if let Err(e) = drafter.draft_for(seq.id, &seq.tokens, room, &mut drafts) {
            // The sequence goes on without drafts (this step; the drafter freed its state).
            if !std::mem::replace(&mut self.draft_failed, true) {
                eprintln!("warning: drafting failed, decoding plainly instead: {e:#}");
            }
            drafts.clear();
        }
        let took = started.elapsed();
        seq.draft_secs = took.as_secs_f64();
        self.draft_us += took.as_micros() as u64;
        self.stats
            .forward_us
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
        drafts.truncate(room);
        let n = self.append_drafts(i, &drafts);
        self.draft_buf = drafts;
        n
    }

    /// Appends `drafts` to running sequence `i`'s tokens if their blocks are free; returns
    /// how many were appended.
    fn append_drafts(&mut self, i: usize, drafts: &[u32]) -> usize {
        let seq = &mut self.running[i];
        let min_len = seq.control.as_ref().map_or(1, DraftControl::min_len);
        if drafts.is_empty() || drafts.len() < min_len {
            return 0;
        }
        let blocks = &mut self.engine.blocks;
        let needed = blocks
            .blocks_for(seq.tokens.len() + drafts.len())
            .saturating_sub(seq.block_table.len());
        if needed > blocks.n_free()
            || blocks
                .ensure(&mut seq.block_table, seq.tokens.len() + drafts.len())
                .is_err()
        {
            return 0;
        }
        seq.n_drafts = drafts.len();
        seq.tokens.extend_from_slice(drafts);
        drafts.len()
    }

    /// Keeps the drafts of running sequence `i` that match the target's greedy `ids` (its
    /// rows' argmax: after the pending token and after each draft), emits them and the
    /// target's next token as plain decoding would, and gives back the blocks past the kept
    /// tokens. Returns as [`Self::sample_into`] does.
    fn verify(&mut self, i: usize, ids: &[u32], secs: f64) -> Option<Option<FinishReason>> {
        let seq = &mut self.running[i];
        let d = std::mem::take(&mut seq.n_drafts);
        let base = seq.tokens.len() - d;
        let drafts = seq.tokens.split_off(base);
        let accepted = drafts.iter().zip(ids).take_while(|(a, b)| a == b).count();
        // The pending token is in the cache; the drafts are re-entered one by one below.
        seq.n_cached = base;
        if let Some(control) = &mut seq.control {
            control.record_round(d, accepted, secs);
        }
        self.stats
            .spec_drafted
            .fetch_add(d as u64, Ordering::Relaxed);
        self.stats
            .spec_accepted
            .fetch_add(accepted as u64, Ordering::Relaxed);
        self.stats.spec_rounds.fetch_add(1, Ordering::Relaxed);
        let Some(&next) = ids.get(accepted) else {
            return Some(Some(FinishReason::Length));
        };
        for (k, &id) in drafts[..accepted].iter().chain([&next]).enumerate() {
            if let Some(done) = self.sample_into(i, &[], Some(id), None, false) {
                return Some(done);
            }
            if k < accepted {
                // An accepted draft's key and value are in the cache already.
                self.running[i].n_cached += 1;
            }
        }
        let seq = &mut self.running[i];
        let keep = self.engine.blocks.blocks_for(seq.tokens.len());
        if keep < seq.block_table.len() {
            let mut dropped = seq.block_table.split_off(keep);
            self.engine.blocks.release(&mut dropped);
        }
        None
    }

    /// Makes sure running sequence `i` has blocks for `positions` positions, evicting idle
    /// cached blocks and then preempting the youngest sequences. False if `i` itself had to
    /// be preempted.
    fn reserve(&mut self, i: usize, positions: usize) -> bool {
        loop {
            let seq = &mut self.running[i];
            if self
                .engine
                .blocks
                .ensure(&mut seq.block_table, positions)
                .is_ok()
            {
                return true;
            }
            if self.evict_one() {
                continue;
            }
            let youngest = self.running.len() - 1;
            self.preempt_youngest();
            if youngest == i {
                return false;
            }
        }
    }

    fn publish(&self) {
        let s = &self.stats;
        let blocks = &self.engine.blocks;
        s.running
            .store(self.running.len() as u64, Ordering::Relaxed);
        s.blocks_free
            .store(blocks.n_free() as u64, Ordering::Relaxed);
        s.blocks_cached_idle
            .store(self.prefix.idle as u64, Ordering::Relaxed);
        s.blocks_used.store(
            blocks.n_used().saturating_sub(self.prefix.idle) as u64,
            Ordering::Relaxed,
        );
    }
}

/// What the filters' preparation of a step hands back: the mask buffer (written in a
/// masked step), each filter's logit row and whether it wrote its mask, the filters that
/// ended on the token they were left (running index, `accept`'s answer), and its time.
struct Prepared {
    masks: Vec<u32>,
    written: Vec<(usize, bool)>,
    ends: Vec<FilterEnd>,
    took: Duration,
}

/// A sampling sequence's filter in a step's preparation: the filter, the token it was left
/// to accept, its logit row, and the sequence's index in `running`.
type StepFilter<'a> = (&'a mut Box<dyn TokenFilter>, Option<u32>, usize, usize);

/// A filter that ended on the token it was left: the sequence's index in `running` and
/// `accept`'s answer.
type FilterEnd = (usize, Result<bool, String>);

/// Filters accepting their tokens in one step from which the filter pool takes them.
const PARALLEL_ACCEPT: usize = 16;

/// The threads the token filters prepare and accept on, beside the forward pass: two
/// cores fewer than the machine's (at least one), so that the thread driving the backend
/// (and the server's) keep a core each while up to 64 grammars run (sharing every core made
/// a descheduled worker hold a step's masks back by milliseconds).
fn filter_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        rayon::ThreadPoolBuilder::new()
            .num_threads(cores.saturating_sub(2).max(1))
            .thread_name(|i| format!("kestrel-filter-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// `KESTREL_STEP_LOG=1`: one stderr line per step (tokens, sequences, prompt tokens,
/// forward time, the token filters' preparation and how long the sampler waited for their
/// masks), to see where a server's time goes.
fn step_log() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KESTREL_STEP_LOG").is_ok_and(|v| !v.is_empty() && v != "0"))
}

/// Hash of a block's token ids chained with the hash of the blocks before it.
fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every block collides with every other.
    fn constant_hash(_parent: u64, _tokens: &[u32]) -> u64 {
        42
    }

    /// Blocks at the same depth collide whatever their tokens.
    fn depth_hash(parent: u64, _tokens: &[u32]) -> u64 {
        parent + 1
    }

    fn blocks_of(hit: &[(Link, u32)]) -> Vec<u32> {
        hit.iter().map(|&(_, block)| block).collect()
    }

    #[test]
    fn a_colliding_block_with_other_tokens_is_not_a_hit() {
        let mut cache = PrefixCache::new(constant_hash);
        let first = [1, 2, 3, 4];
        let second = [5, 6, 7, 8];
        assert!(cache.insert(ROOT, &first, 10, 1, 0).is_some());
        // Same key, other tokens: no hit, and it cannot take the occupied slot either.
        assert!(cache.acquire([&second[..]].into_iter(), 2).is_empty());
        assert!(cache.insert(ROOT, &second, 11, 2, 0).is_none());
        assert_eq!(blocks_of(&cache.acquire([&first[..]].into_iter(), 3)), [10]);
    }

    #[test]
    fn a_child_of_an_evicted_parent_is_not_a_hit_under_a_new_parent() {
        let mut cache = PrefixCache::new(depth_hash);
        let a = cache.insert(ROOT, &[1, 1], 10, 1, 0).unwrap();
        let b = cache.insert(a, &[2, 2], 11, 1, 1).unwrap();
        // Make the parent the older idle entry so it is evicted first.
        cache.release(a, 2);
        cache.release(b, 3);
        assert_eq!(cache.evict_lru(), Some(10));
        // Other tokens now sit at the parent's key; the old child's KV was computed after
        // [1, 1], so it must not follow [3, 3] even though its own tokens match.
        let a2 = cache.insert(ROOT, &[3, 3], 12, 4, 0).unwrap();
        assert_eq!(a2.key, a.key);
        let query = [3, 3, 2, 2];
        assert_eq!(blocks_of(&cache.acquire(query.chunks_exact(2), 5)), [12]);
    }

    struct Rng(u64);
    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            // splitmix64
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            (z ^ (z >> 31)) % n
        }
    }

    /// Registers random prompts the way the scheduler does (reuse the hit, enter the rest
    /// until a key is taken), releasing and evicting at random, and checks each hit block
    /// against the full token prefix it was entered with. With the real hash and no
    /// eviction the hit must also be the longest whole-block prefix seen before.
    fn random_prompts(hash: fn(u64, &[u32]) -> u64, evict: bool, seed: u64) {
        let mut rng = Rng(seed);
        let bs = 1 + rng.below(4) as usize;
        let mut cache = PrefixCache::new(hash);
        let mut prefix_of_block: HashMap<u32, Vec<u32>> = HashMap::new();
        let mut seen: Vec<Vec<u32>> = Vec::new();
        let mut held: Vec<Vec<Link>> = Vec::new();
        let mut next_block = 0u32;
        for tick in 1..200u64 {
            // A small vocabulary and a shared start make real prefix matches common.
            let len = rng.below(6 * bs as u64 + 1) as usize;
            let prompt: Vec<u32> = (0..len)
                .map(|i| {
                    if i < bs && rng.below(2) == 0 {
                        0
                    } else {
                        rng.below(3) as u32
                    }
                })
                .collect();
            let n_full = prompt.len() / bs;
            let hit = cache.acquire(prompt.chunks_exact(bs), tick);
            for (i, &(_, block)) in hit.iter().enumerate() {
                assert_eq!(
                    prefix_of_block[&block][..],
                    prompt[..(i + 1) * bs],
                    "block {block} reused for other tokens (block size {bs}, seed {seed})"
                );
            }
            if !evict {
                let longest = seen
                    .iter()
                    .map(|p| p.iter().zip(&prompt).take_while(|(a, b)| a == b).count() / bs)
                    .max()
                    .unwrap_or(0);
                assert_eq!(hit.len(), longest.min(n_full), "seed {seed}");
            }
            let mut links: Vec<Link> = hit.iter().map(|&(link, _)| link).collect();
            for i in links.len()..n_full {
                let parent = links.last().copied().unwrap_or(ROOT);
                let block = next_block;
                next_block += 1;
                let Some(link) =
                    cache.insert(parent, &prompt[i * bs..(i + 1) * bs], block, tick, i)
                else {
                    break;
                };
                prefix_of_block.insert(block, prompt[..(i + 1) * bs].to_vec());
                links.push(link);
            }
            seen.push(prompt);
            held.push(links);
            if evict && rng.below(2) == 0 {
                let idx = rng.below(held.len() as u64) as usize;
                for link in held.swap_remove(idx) {
                    cache.release(link, tick);
                }
                for _ in 0..rng.below(3) {
                    cache.evict_lru();
                }
            }
        }
    }

    fn tiny_file(seed: u64) -> std::sync::Arc<kestrel_gguf::GgufFile> {
        use kestrel_model::synth::{SynthConfig, WeightType, write_synth_to};
        let cfg = SynthConfig::tiny(kestrel_model::Arch::Qwen2);
        let ty: WeightType = "q8_0".parse().unwrap();
        let (bytes, _) = write_synth_to(Vec::new(), &cfg, ty, seed).unwrap();
        std::sync::Arc::new(kestrel_gguf::GgufFile::from_bytes(bytes).unwrap())
    }

    /// An engine whose cache holds `blocks` blocks of 16 positions, sized in bytes.
    fn engine_of_blocks(
        file: &std::sync::Arc<kestrel_gguf::GgufFile>,
        ctx: usize,
        blocks: usize,
        max_seqs: usize,
    ) -> Engine<kestrel_cpu::CpuBackend> {
        use crate::engine::{EngineOptions, KvCacheSize, kv_bytes_per_token};
        let opts = EngineOptions {
            ctx,
            max_batch_tokens: 64,
            max_logit_rows: max_seqs,
            block_size: 16,
            max_seqs,
        };
        let cfg = kestrel_model::ModelConfig::from_gguf(file).unwrap();
        let kv = kestrel_model::KvTypes::default();
        // A few bytes short of one more block: the count is rounded down.
        let bytes = (blocks * 16 * kv_bytes_per_token(&cfg, kv) + 100) as u64;
        let backend = kestrel_cpu::CpuBackend::new(kestrel_cpu::Kernels::Fast);
        let e =
            Engine::with_cache_size(backend, file.clone(), &opts, kv, KvCacheSize::Bytes(bytes))
                .unwrap();
        assert_eq!(e.blocks.n_blocks(), blocks);
        e
    }

    /// What the scheduler's channel carries.
    type Submission = (Request, Option<Box<dyn TokenFilter>>);

    /// A request's tokens all arrive on this channel, then `Done`.
    fn request(prompt: Vec<u32>, max_tokens: usize) -> (Submission, mpsc::Receiver<Event>) {
        let (tx, rx) = mpsc::channel();
        let req = Request {
            prompt,
            params: SamplerParams::greedy(),
            max_tokens,
            logprobs: None,
            speculative: false,
            sink: Box::new(tx),
        };
        ((req, None), rx)
    }

    /// Drives the scheduler step by step over a cache of a few blocks and checks the policy
    /// at every step: admission first come first served, only while the request's blocks
    /// plus one block per running sequence are free (and it stops only when they are not);
    /// preemption takes the newest running sequences, which go back to the front of the
    /// queue; every block is free or held by exactly the running sequences; and every request
    /// completes with the greedy tokens it gets alone. Without the prefix cache, so blocks
    /// are counted exactly.
    #[test]
    fn admission_by_free_blocks_and_preemption_of_the_newest() {
        use rand::{Rng, SeedableRng};
        let mut total_preemptions = 0;
        for seed in 0..4u64 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let file = tiny_file(seed);
            let n_blocks = rng.random_range(9..14);
            let max_seqs = rng.random_range(3..7);
            let engine = engine_of_blocks(&file, 512, n_blocks, max_seqs);
            // The whole cache is less than the context: a sequence stops at the cache's end.
            assert_eq!(engine.ctx, n_blocks * 16);
            let vocab = engine.config().vocab_size as u32;
            let (_tx, rx) = mpsc::channel();
            let opts = SchedulerOptions {
                max_seqs,
                max_prefill_tokens: 40,
                prefix_cache: false,
                ..SchedulerOptions::default()
            };
            let stats = Arc::new(SchedulerStats::default());
            let mut s = Scheduler::new(engine, None, opts, rx, stats.clone());
            let n_req = 10;
            let mut jobs = Vec::new();
            for k in 0..n_req {
                // The first token names the request.
                let len = rng.random_range(1..70);
                let prompt: Vec<u32> = std::iter::once(k as u32)
                    .chain((1..len).map(|_| rng.random_range(n_req as u32..vocab)))
                    .collect();
                // One request runs into the end of the whole cache.
                let n = if k == 3 {
                    10_000
                } else {
                    rng.random_range(5..60)
                };
                let (req, events) = request(prompt.clone(), n);
                s.stats.waiting.fetch_add(1, Ordering::Relaxed);
                s.enqueue(Job::Generate(req.0, req.1));
                jobs.push((prompt, n, events));
            }
            let id = |q: &Seq| q.tokens[0];
            let mut steps = 0;
            while !s.running.is_empty() || !s.waiting.is_empty() {
                steps += 1;
                assert!(steps < 5000, "seed {seed}: no progress");
                let waiting_before: Vec<u32> = s.waiting.iter().map(id).collect();
                let n_running = s.running.len();
                s.admit();
                let admitted: Vec<u32> = s.running[n_running..].iter().map(id).collect();
                assert_eq!(
                    admitted[..],
                    waiting_before[..admitted.len()],
                    "seed {seed}: first come, first served"
                );
                let blocks = &s.engine.blocks;
                if !admitted.is_empty() {
                    // The last admitted took its blocks with one per earlier sequence left.
                    assert!(blocks.n_free() >= s.running.len() - 1, "seed {seed}");
                }
                if let Some(front) = s.waiting.front()
                    && s.running.len() < max_seqs
                {
                    let needed = blocks.blocks_for(front.tokens.len());
                    assert!(
                        needed + s.running.len() > blocks.n_free(),
                        "seed {seed}: request {} left waiting with {needed} blocks needed, \
                         {} free, {} running",
                        id(front),
                        blocks.n_free(),
                        s.running.len()
                    );
                }
                let running_before: Vec<u32> = s.running.iter().map(id).collect();
                let preempted_before = stats.preemptions.load(Ordering::Relaxed);
                let waiting_len = s.waiting.len();
                s.step();
                let preempted =
                    (stats.preemptions.load(Ordering::Relaxed) - preempted_before) as usize;
                let requeued: Vec<u32> = s.waiting.iter().take(preempted).map(id).collect();
                assert_eq!(s.waiting.len(), waiting_len + preempted, "seed {seed}");
                // The newest first: the queue's front is the oldest of those preempted.
                let newest: Vec<u32> = running_before[running_before.len() - preempted..].to_vec();
                assert_eq!(
                    requeued, newest,
                    "seed {seed}: preempted the newest sequences"
                );
                for q in s.waiting.iter().take(preempted) {
                    assert!(
                        q.block_table.is_empty(),
                        "a preempted sequence keeps no block"
                    );
                }
                let held: usize = s.running.iter().map(|q| q.block_table.len()).sum();
                let blocks = &s.engine.blocks;
                assert_eq!(held + blocks.n_free(), blocks.n_blocks(), "seed {seed}");
            }
            let got_preempted = stats.preemptions.load(Ordering::Relaxed);
            total_preemptions += got_preempted;
            let mut alone = engine_of_blocks(&file, 512, n_blocks, 1);
            for (prompt, n, events) in jobs {
                let mut ids = Vec::new();
                let mut done = None;
                for ev in events.try_iter() {
                    match ev {
                        Event::Token { id, .. } => ids.push(id),
                        Event::Done { reason, .. } => done = Some(reason),
                        Event::Error(e) => panic!("seed {seed}: {e}"),
                    }
                }
                let mut seq = crate::Sequence::default();
                let want = alone
                    .generate(
                        &mut seq,
                        &prompt,
                        &SamplerParams::greedy(),
                        n,
                        |_| false,
                        |_| true,
                    )
                    .unwrap();
                alone.release(&mut seq);
                assert_eq!(
                    ids, want,
                    "seed {seed}: request {} (preempted {got_preempted})",
                    prompt[0]
                );
                assert_eq!(done, Some(FinishReason::Length), "seed {seed}");
                if n == 10_000 {
                    assert_eq!(
                        prompt.len() + ids.len(),
                        n_blocks * 16 + 1,
                        "stops at the cache's end"
                    );
                }
            }
        }
        assert!(
            total_preemptions > 0,
            "the caches were sized to force preemption"
        );
    }

    #[test]
    fn random_prompts_only_reuse_blocks_of_identical_prefixes() {
        for seed in 0..20 {
            random_prompts(block_hash, false, seed);
            random_prompts(block_hash, true, seed);
            random_prompts(depth_hash, true, seed);
            random_prompts(|parent, tokens| (parent ^ tokens[0] as u64) % 3, true, seed);
        }
    }
}
