//! A model on a backend with its paged KV cache: evaluates sequences and generates.

use std::sync::Arc;

use anyhow::{Context, bail};
use kestrel_gguf::GgufFile;
use kestrel_model::{Backend, Batch, KvTypes, Model, ModelConfig, SamplingBatch, Scratch};

use crate::kv::BlockManager;
use crate::sampler::{Sampler, SamplerParams, TokenFilter};

/// Sizes of the engine's buffers.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Most positions one sequence may hold (prompt + generated); 0 = the model's.
    pub ctx: usize,
    /// Most tokens in one forward step (longer prompts go in chunks).
    pub max_batch_tokens: usize,
    /// Most rows of logits one step returns.
    pub max_logit_rows: usize,
    /// Positions per KV block.
    pub block_size: usize,
    /// Sequences the cache must hold at full context at once.
    pub max_seqs: usize,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            ctx: 4096,
            max_batch_tokens: 512,
            max_logit_rows: 1,
            block_size: 16,
            max_seqs: 1,
        }
    }
}

/// How many blocks the KV cache has.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum KvCacheSize {
    /// `max_seqs` sequences at full context (`kestrel run`, `chat`, `bench`).
    #[default]
    PerSequence,
    /// As many blocks as this many bytes of keys and values hold (`--kv-memory`).
    Bytes(u64),
    /// vLLM's `--gpu-memory-utilization`: the blocks that keep the device's memory in use
    /// at most this fraction of its total once the weights and step buffers are allocated.
    DeviceFraction(f64),
}

/// Bytes of keys and values one position takes over all layers.
pub fn kv_bytes_per_token(cfg: &ModelConfig, kv: KvTypes) -> usize {
    cfg.n_layer * kv.bytes_per_position(cfg.kv_dim())
}

/// The number of KV blocks `size` gives a model whose positions take `bytes_per_token`
/// bytes each. `device`: the device's (free, total) memory in bytes now, with the weights and
/// step buffers allocated, where it has its own.
pub fn kv_cache_blocks(
    size: KvCacheSize,
    bytes_per_token: usize,
    block_size: usize,
    ctx: usize,
    max_seqs: usize,
    device: Option<(usize, usize)>,
) -> anyhow::Result<usize> {
    let block_bytes = (bytes_per_token as u64).saturating_mul(block_size as u64);
    if block_bytes == 0 {
        bail!("a KV block takes no memory: the model has no keys or values");
    }
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let n = match size {
        KvCacheSize::PerSequence => ctx.div_ceil(block_size) as u64 * max_seqs.max(1) as u64,
        KvCacheSize::Bytes(bytes) => {
            let n = bytes / block_bytes;
            if n == 0 {
                bail!(
                    "a KV cache of {bytes} bytes holds no block: one block of {block_size} \
                     positions takes {block_bytes} bytes ({:.2} MiB)",
                    mib(block_bytes)
                );
            }
            n
        }
        KvCacheSize::DeviceFraction(f) => {
            if !(f > 0.0 && f <= 1.0) {
                bail!("the memory fraction must be in (0, 1], not {f}");
            }
            let Some((free, total)) = device else {
                bail!(
                    "this backend has no device memory to take a fraction of; size the KV \
                     cache in bytes instead (--kv-memory)"
                );
            };
            let in_use = total.saturating_sub(free) as u64;
            let allowed = (total as f64 * f) as u64;
            let budget = allowed.saturating_sub(in_use);
            let n = budget / block_bytes;
            if n == 0 {
                bail!(
                    "{:.0}% of the device's {:.0} MiB leaves no room for a KV block of {:.2} \
                     MiB: {:.0} MiB are in use after loading the model (raise the fraction or \
                     size the cache with --kv-memory)",
                    f * 100.0,
                    mib(total as u64),
                    mib(block_bytes),
                    mib(in_use)
                );
            }
            n
        }
    };
    // Slot indices are 32-bit on every backend.
    let most = (i32::MAX as u64) / block_size as u64;
    if n > most {
        bail!(
            "a KV cache of {n} blocks of {block_size} positions is more than the {most} blocks \
             a cache may have"
        );
    }
    Ok(n as usize)
}

/// One sequence's tokens and its place in the cache.
#[derive(Debug, Default, Clone)]
pub struct Sequence {
    /// Every token evaluated so far (their keys and values are in the cache).
    pub tokens: Vec<u32>,
    pub block_table: Vec<u32>,
}

pub struct Engine<B: Backend> {
    pub backend: B,
    pub model: Model<B>,
    pub cache: B::Cache,
    pub blocks: BlockManager,
    pub ctx: usize,
    /// Bytes of keys and values one cached position takes over all layers.
    pub kv_bytes_per_token: usize,
    pub(crate) scratch: Scratch<B>,
    logits: Vec<f32>,
    /// The batch `eval_batch` fills and reuses, with its per-sequence progress and the
    /// parts of the current step.
    batch: Batch,
    eval_done: Vec<usize>,
    eval_parts: Vec<(usize, usize, usize, usize)>,
    /// Whether `eval_batch`'s steps are batch-invariant (`Batch::invariant`; see
    /// [`Engine::eval_invariant`]).
    invariant: bool,
}

impl<B: Backend> Engine<B> {
    /// An engine whose KV cache stores keys and values as f16.
    pub fn new(backend: B, file: Arc<GgufFile>, opts: &EngineOptions) -> anyhow::Result<Self> {
        Self::with_cache_types(backend, file, opts, KvTypes::default())
    }

    /// An engine whose KV cache stores keys and values as `kv`; an error names the types
    /// the backend supports when it lacks one.
    pub fn with_cache_types(
        backend: B,
        file: Arc<GgufFile>,
        opts: &EngineOptions,
        kv: KvTypes,
    ) -> anyhow::Result<Self> {
        Self::with_cache_size(backend, file, opts, kv, KvCacheSize::PerSequence)
    }

    /// [`Self::with_cache_types`] with the cache's number of blocks given by `size`. A
    /// sequence's context is at most what the whole cache holds.
    pub fn with_cache_size(
        backend: B,
        file: Arc<GgufFile>,
        opts: &EngineOptions,
        kv: KvTypes,
        size: KvCacheSize,
    ) -> anyhow::Result<Self> {
        let model = Model::load(&backend, file)?;
        let cfg = &model.config;
        let ctx = if opts.ctx == 0 {
            cfg.context_length
        } else {
            opts.ctx.min(cfg.context_length.max(1))
        };
        if opts.block_size == 0 || opts.max_batch_tokens == 0 {
            bail!("block size and batch size must be positive");
        }
        // The step buffers first: a cache sized by the device's memory takes what they leave.
        let scratch = Scratch::new(&backend, cfg, opts.max_batch_tokens, opts.max_logit_rows)?;
        let bytes_per_token = kv_bytes_per_token(cfg, kv);
        // A hybrid's recurrent states grow with the sequences the device holds (up to
        // max_seqs of them, ~79 MB each at Qwen3-Next-80B's shape): a cache sized by a
        // fraction of the device leaves them their room.
        let states = cfg
            .recurrent_state_bytes()
            .saturating_mul(opts.max_seqs.max(1));
        let device = backend
            .device_memory()
            .map(|(free, total)| (free.saturating_sub(states), total));
        let n_blocks = kv_cache_blocks(
            size,
            bytes_per_token,
            opts.block_size,
            ctx,
            opts.max_seqs,
            device,
        )?;
        let ctx = ctx.min(n_blocks * opts.block_size);
        let cache = backend
            .new_cache_typed(cfg, n_blocks, opts.block_size, kv)
            .context("allocating the KV cache")?;
        Ok(Engine {
            blocks: BlockManager::new(n_blocks, opts.block_size),
            backend,
            model,
            cache,
            ctx,
            kv_bytes_per_token: bytes_per_token,
            scratch,
            logits: Vec::new(),
            batch: Batch::default(),
            eval_done: Vec::new(),
            eval_parts: Vec::new(),
            invariant: false,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    pub fn max_batch_tokens(&self) -> usize {
        self.scratch.max_tokens
    }

    /// The most tokens a verification step may hold (see `Backend::invariant_max_tokens`).
    pub fn invariant_max_tokens(&self) -> usize {
        self.backend.invariant_max_tokens().max(1)
    }

    pub fn max_logit_rows(&self) -> usize {
        self.scratch.max_logit_rows
    }

    /// Runs one step; returns the logits of `batch.logit_rows`, `vocab` values per row.
    pub fn step(&mut self, batch: &Batch) -> anyhow::Result<&[f32]> {
        let mut logits = std::mem::take(&mut self.logits);
        let result = self.step_into(batch, &mut logits);
        self.logits = logits;
        result.map(|()| &self.logits[..])
    }

    /// [`Self::step`] writing the logits into the caller's buffer (resized; its capacity is
    /// reused, so a caller that keeps one buffer allocates nothing per step).
    pub fn step_into(&mut self, batch: &Batch, logits: &mut Vec<f32>) -> anyhow::Result<()> {
        self.forward(batch)?;
        self.backend
            .read_rows(&self.scratch.logits, batch.logit_rows.len(), logits)
    }

    /// Checks `batch` against the cache and runs the model over it; the logits stay in
    /// the scratch on the backend.
    pub(crate) fn forward(&mut self, batch: &Batch) -> anyhow::Result<()> {
        batch.validate(
            self.blocks.block_size(),
            self.blocks.n_blocks(),
            self.model.config.vocab_size,
        )?;
        self.model
            .forward(&self.backend, &mut self.cache, batch, &mut self.scratch)
    }

    /// [`Engine::step_into`], keeping only each logit row's argmax (greedy sampling): the
    /// backend reduces the rows where they are instead of returning them.
    pub fn step_argmax(&mut self, batch: &Batch, ids: &mut Vec<u32>) -> anyhow::Result<()> {
        self.forward(batch)?;
        self.backend.argmax_rows(
            &self.scratch.logits,
            batch.logit_rows.len(),
            &mut self.logits,
            ids,
        )
    }

    /// [`Engine::step_into`], keeping only the token each logit row draws under the row of
    /// `sampling` with its index: the backend samples the rows where they are.
    pub fn step_sample(
        &mut self,
        batch: &Batch,
        sampling: &SamplingBatch,
        ids: &mut Vec<u32>,
    ) -> anyhow::Result<()> {
        self.forward(batch)?;
        self.backend.sample_rows(
            &self.scratch.logits,
            batch.logit_rows.len(),
            sampling,
            &mut self.logits,
            ids,
        )
    }

    /// [`Engine::step_sample`] whose token masks are known only once the forward pass is
    /// under way: the backend starts the step's work ([`Backend::submit`]), `masks` then
    /// fills `sampling`'s masks (e.g. waiting for a grammar on another thread while the
    /// device computes), and the rows are sampled under them where they are.
    pub fn step_sample_masked(
        &mut self,
        batch: &Batch,
        sampling: &mut SamplingBatch,
        masks: impl FnOnce(&mut SamplingBatch),
        ids: &mut Vec<u32>,
    ) -> anyhow::Result<()> {
        self.forward(batch)?;
        self.backend.submit();
        masks(sampling);
        self.backend.sample_rows(
            &self.scratch.logits,
            batch.logit_rows.len(),
            sampling,
            &mut self.logits,
            ids,
        )
    }

    /// Appends `tokens` to `seq`, evaluating them in chunks. Returns the logits of the
    /// last token, or of every new token when `all_logits` (then `tokens` must fit the
    /// logit rows of one step per chunk; chunks shrink to `max_logit_rows`).
    pub fn eval(
        &mut self,
        seq: &mut Sequence,
        tokens: &[u32],
        all_logits: bool,
        mut on_logits: impl FnMut(usize, &[f32]),
    ) -> anyhow::Result<()> {
        self.eval_batch(
            std::slice::from_mut(seq),
            &[tokens],
            all_logits,
            |_, index, row| on_logits(index, row),
        )
    }

    /// Appends `tokens[i]` to `seqs[i]` for every `i`, the sequences sharing each step (a
    /// batch holds parts of several sequences, each part contiguous, as a server's
    /// continuous batching does). Calls `on_logits(i, index, row)` for the last new token
    /// of each sequence, or for every new token when `all_logits`.
    pub fn eval_batch(
        &mut self,
        seqs: &mut [Sequence],
        tokens: &[&[u32]],
        all_logits: bool,
        mut on_logits: impl FnMut(usize, usize, &[f32]),
    ) -> anyhow::Result<()> {
        if seqs.len() != tokens.len() {
            bail!("{} sequences but {} token lists", seqs.len(), tokens.len());
        }
        self.reserve(seqs, |i| tokens[i].len())?;
        let vocab = self.model.config.vocab_size;
        let (max_tokens, max_rows) = (self.max_batch_tokens(), self.max_logit_rows());
        // The engine's batch and bookkeeping are refilled in place: a decode step
        // allocates nothing once they have grown.
        let mut batch = std::mem::take(&mut self.batch);
        let mut done = std::mem::take(&mut self.eval_done);
        // Per part of a step: (sequence, first new-token index, length, logit rows).
        let mut parts = std::mem::take(&mut self.eval_parts);
        done.clear();
        done.resize(seqs.len(), 0);
        let mut result = Ok(());
        while done.iter().zip(tokens).any(|(&d, t)| d < t.len()) {
            batch.clear_tokens();
            batch.invariant = self.invariant;
            let mut n_slots = 0;
            parts.clear();
            for (i, toks) in tokens.iter().enumerate() {
                let (room, rows_left) =
                    (max_tokens - batch.len(), max_rows - batch.logit_rows.len());
                let rest = toks.len() - done[i];
                if rest == 0 || room == 0 {
                    continue;
                }
                let mut len = rest.min(room);
                if all_logits {
                    len = len.min(rows_left);
                }
                // A part ending the sequence's tokens needs a logit row.
                if len == 0 || (len == rest && rows_left == 0) {
                    continue;
                }
                let rows = if all_logits {
                    len
                } else if len == rest {
                    1
                } else {
                    0
                };
                // seqs[i].tokens grows by each finished step's part.
                batch.push_part(
                    n_slots,
                    &toks[done[i]..done[i] + len],
                    seqs[i].tokens.len(),
                    &seqs[i].block_table,
                    rows,
                );
                n_slots += 1;
                parts.push((i, done[i], len, rows));
            }
            batch.seqs.truncate(n_slots);
            if batch.is_empty() {
                result = Err(anyhow::anyhow!(
                    "a step of {max_tokens} tokens and {max_rows} logit rows cannot make progress"
                ));
                break;
            }
            if let Err(e) = self.forward(&batch) {
                result = Err(e);
                break;
            }
            // The rows as the backend lends them (no copy into self.logits where it can).
            let read = self.backend.with_rows(
                &self.scratch.logits,
                batch.logit_rows.len(),
                &mut self.logits,
                &mut |logits: &[f32]| {
                    let mut rows = logits.chunks_exact(vocab);
                    for &(i, first, _, n_rows) in &parts {
                        for r in 0..n_rows {
                            let index = if all_logits {
                                first + r
                            } else {
                                tokens[i].len() - 1
                            };
                            if let Some(row) = rows.next() {
                                on_logits(i, index, row);
                            }
                        }
                    }
                },
            );
            if let Err(e) = read {
                result = Err(e);
                break;
            }
            for &(i, _, len, _) in &parts {
                let d = done[i];
                seqs[i].tokens.extend_from_slice(&tokens[i][d..d + len]);
                done[i] += len;
            }
        }
        self.batch = batch;
        self.eval_done = done;
        self.eval_parts = parts;
        result
    }

    /// Checks that `len_of(i)` more tokens fit `seqs[i]` (at least one, within the context)
    /// and gives each sequence the cache blocks they need. Allocates nothing.
    fn reserve(
        &mut self,
        seqs: &mut [Sequence],
        len_of: impl Fn(usize) -> usize,
    ) -> anyhow::Result<()> {
        let several = seqs.len() > 1;
        let which = |i: usize| {
            if several {
                format!("sequence {i}: ")
            } else {
                String::new()
            }
        };
        for (i, seq) in seqs.iter().enumerate() {
            let len = len_of(i);
            if len == 0 {
                bail!("{}nothing to evaluate", which(i));
            }
            let total = seq.tokens.len() + len;
            if total > self.ctx {
                bail!(
                    "{}{total} tokens exceed the context size {} (prompt too long?)",
                    which(i),
                    self.ctx
                );
            }
        }
        for (i, seq) in seqs.iter_mut().enumerate() {
            let total = seq.tokens.len() + len_of(i);
            if let Err(e) = self.blocks.ensure(&mut seq.block_table, total) {
                let e = anyhow::Error::from(e);
                return Err(if several {
                    e.context(format!("sequence {i}"))
                } else {
                    e
                });
            }
        }
        Ok(())
    }

    /// One decode step: appends `tokens[i]` to `seqs[i]` for every `i` (all in one step) and
    /// writes each sequence's greedy next token into `ids`. Only the ids leave the device
    /// (the scheduler's path for greedy requests), not the logit rows.
    pub fn decode_argmax(
        &mut self,
        seqs: &mut [Sequence],
        tokens: &[u32],
        ids: &mut Vec<u32>,
    ) -> anyhow::Result<()> {
        self.decode(seqs, tokens, None, ids)
    }

    /// [`Self::decode_argmax`] drawing each sequence's next token under row `i` of
    /// `sampling` instead (on the device where the backend samples there).
    pub fn decode_sampled(
        &mut self,
        seqs: &mut [Sequence],
        tokens: &[u32],
        sampling: &SamplingBatch,
        ids: &mut Vec<u32>,
    ) -> anyhow::Result<()> {
        sampling.check_rows(seqs.len())?;
        self.decode(seqs, tokens, Some(sampling), ids)
    }

    fn decode(
        &mut self,
        seqs: &mut [Sequence],
        tokens: &[u32],
        sampling: Option<&SamplingBatch>,
        ids: &mut Vec<u32>,
    ) -> anyhow::Result<()> {
        if seqs.len() != tokens.len() {
            bail!("{} sequences but {} tokens", seqs.len(), tokens.len());
        }
        if tokens.len() > self.max_batch_tokens() || tokens.len() > self.max_logit_rows() {
            bail!(
                "{} sequences in one step: at most {} tokens and {} logit rows",
                tokens.len(),
                self.max_batch_tokens(),
                self.max_logit_rows()
            );
        }
        self.reserve(seqs, |_| 1)?;
        let mut batch = std::mem::take(&mut self.batch);
        batch.clear_tokens();
        for (i, (seq, &token)) in seqs.iter().zip(tokens).enumerate() {
            batch.push_part(i, &[token], seq.tokens.len(), &seq.block_table, 1);
        }
        batch.seqs.truncate(seqs.len());
        let result = match sampling {
            Some(sampling) => self.step_sample(&batch, sampling, ids),
            None => self.step_argmax(&batch, ids),
        };
        self.batch = batch;
        result?;
        for (seq, &token) in seqs.iter_mut().zip(tokens) {
            seq.tokens.push(token);
        }
        Ok(())
    }

    /// Whether [`Self::decode_chained`] runs here: the backend chains decode steps and the
    /// model keeps no recurrent state (a chained step queued past the last token is
    /// dropped, which a linear-attention state cannot be rolled back from).
    pub fn can_chain(&self) -> bool {
        self.backend.can_chain() && !self.config().has_recurrent_layers()
    }

    /// Decoding of one sequence with the host a step ahead of the device. `first` (the
    /// token chosen after `seq`) is appended and evaluated; the token each step chooses
    /// (`sampler`'s argmax or draw, without penalties: they would need the tokens still on
    /// the device) then stays on the device as the next step's input
    /// ([`Backend::chain_ids`]) while the host records and queues that step, so the device
    /// does not wait for the host between steps. The draws are the sampler's in order, so
    /// a seed gives the tokens step-by-step decoding ([`Self::decode_sampled`]) gives.
    /// `on_token` gets each new id in order and returns whether to go on; decoding also
    /// ends after `max_new` ids or at the end of the context. The last id is not
    /// evaluated, as in [`Self::generate`]: a step already queued for it is dropped, and
    /// `seq` ends as step-by-step decoding would leave it. Returns the ids.
    pub fn decode_chained(
        &mut self,
        seq: &mut Sequence,
        first: u32,
        max_new: usize,
        sampler: &mut Sampler,
        mut on_token: impl FnMut(u32) -> bool,
    ) -> anyhow::Result<Vec<u32>> {
        if !self.can_chain() {
            bail!("this backend or model does not chain decode steps");
        }
        if sampler.needs_history() {
            bail!("chained decoding draws without repetition penalties");
        }
        let mut out = Vec::new();
        if max_new == 0 {
            return Ok(out);
        }
        self.queue_chained(seq, Some(first), sampler)?;
        // Steps queued and not read yet; `seq.tokens` ends with a placeholder for the input
        // of each but the oldest (its input is the id the step before it returns).
        let mut queued = 1usize;
        let mut ids = Vec::new();
        let result = loop {
            if out.len() + queued < max_new && seq.tokens.len() < self.ctx {
                if let Err(e) = self.queue_chained(seq, None, sampler) {
                    break Err(e);
                }
                queued += 1;
            }
            // The oldest step is taken off the queue whether or not its ids are good.
            let read = self.read_chained(&mut ids);
            queued -= 1;
            if let Err(e) = read {
                break Err(e);
            }
            let Some(&id) = ids.first() else {
                break Err(anyhow::anyhow!("a chained step returned no token id"));
            };
            if queued > 0 {
                let at = seq.tokens.len() - queued;
                seq.tokens[at] = id;
            }
            out.push(id);
            if !on_token(id) || out.len() >= max_new || queued == 0 {
                break Ok(());
            }
        };
        // Steps queued past the last id: wait for them, then drop their tokens.
        let mut drained = Ok(());
        for _ in 0..queued {
            if let Err(e) = self.backend.read_chained(&mut ids) {
                drained = Err(e);
            }
        }
        let keep = seq.tokens.len() - queued;
        self.truncate(seq, keep);
        result.and(drained).map(|()| out)
    }

    /// Runs `batch` and leaves the token each of its logit rows chooses (the argmax, or
    /// drawn under `sampling`'s row) on the device as the next step's input, without waiting
    /// for the step ([`Backend::chain_ids`]; the next batch sets `tokens_on_device`). The
    /// scheduler's path; [`Self::decode_chained`] is one sequence's.
    pub fn step_chained(
        &mut self,
        batch: &Batch,
        sampling: Option<&SamplingBatch>,
    ) -> anyhow::Result<()> {
        self.forward(batch)?;
        self.backend
            .chain_ids(&self.scratch.logits, batch.logit_rows.len(), sampling)
    }

    /// The ids of the oldest [`Self::step_chained`] step not read yet, each checked against
    /// the vocabulary (an all-NaN row has no argmax).
    pub fn read_chained(&mut self, ids: &mut Vec<u32>) -> anyhow::Result<()> {
        self.backend.read_chained(ids)?;
        let vocab = self.model.config.vocab_size;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            bail!("a decode step chose token {id}, past the vocabulary (non-finite logits?)");
        }
        Ok(())
    }

    /// Queues one chained step of `seq`: its input is `token`, or with None the id the
    /// step before returns (a placeholder in `seq.tokens` until it is read).
    fn queue_chained(
        &mut self,
        seq: &mut Sequence,
        token: Option<u32>,
        sampler: &mut Sampler,
    ) -> anyhow::Result<()> {
        self.reserve(std::slice::from_mut(seq), |_| 1)?;
        let input = token.unwrap_or(0);
        let sampling = (!sampler.is_argmax()).then(|| {
            let mut rows = SamplingBatch::default();
            sampler.push_row(&mut rows, &[]);
            rows
        });
        let mut batch = std::mem::take(&mut self.batch);
        batch.clear_tokens();
        batch.push_part(0, &[input], seq.tokens.len(), &seq.block_table, 1);
        batch.seqs.truncate(1);
        batch.tokens_on_device = token.is_none();
        let result = self.step_chained(&batch, sampling.as_ref());
        self.batch = batch;
        result?;
        seq.tokens.push(input);
        Ok(())
    }

    /// [`Engine::eval`] with every logit row, each token's row computed exactly as a step of
    /// that token alone would compute it (`Batch::invariant`): the verification of a
    /// speculative draft, so that accepting a draft changes no number.
    pub fn eval_invariant(
        &mut self,
        seq: &mut Sequence,
        tokens: &[u32],
        on_logits: impl FnMut(usize, &[f32]),
    ) -> anyhow::Result<()> {
        self.invariant = true;
        let result = self.eval(seq, tokens, true, on_logits);
        self.invariant = false;
        result
    }

    /// Appends `tokens` to `seq` in one step and writes into `ids` the greedy next token after
    /// each of them (speculative verification: one batch, only the ids leave the device).
    pub fn eval_argmax_each(
        &mut self,
        seq: &mut Sequence,
        tokens: &[u32],
        ids: &mut Vec<u32>,
    ) -> anyhow::Result<()> {
        if tokens.len() > self.max_batch_tokens() || tokens.len() > self.max_logit_rows() {
            bail!(
                "{} tokens in one step: at most {} tokens and {} logit rows",
                tokens.len(),
                self.max_batch_tokens(),
                self.max_logit_rows()
            );
        }
        self.reserve(std::slice::from_mut(seq), |_| tokens.len())?;
        let mut batch = std::mem::take(&mut self.batch);
        batch.clear_tokens();
        batch.push_part(0, tokens, seq.tokens.len(), &seq.block_table, tokens.len());
        batch.seqs.truncate(1);
        // Each token's id as decoding it alone would give (lossless verification).
        batch.invariant = true;
        let result = self.step_argmax(&batch, ids);
        self.batch = batch;
        result?;
        seq.tokens.extend_from_slice(tokens);
        Ok(())
    }

    /// Drops the per-sequence state of the sequence holding `block_table` (its
    /// linear-attention layers' state; nothing for other models).
    pub fn forget_state(&mut self, block_table: &[u32]) {
        if let Some(&first) = block_table.first()
            && self.model.config.has_recurrent_layers()
        {
            self.backend.forget_state(&mut self.cache, first);
        }
    }

    /// Keeps only the first `n` tokens of `seq` (a later `eval` overwrites the rest of the
    /// cache), giving back blocks no longer needed.
    pub fn truncate(&mut self, seq: &mut Sequence, n: usize) {
        if n >= seq.tokens.len() {
            return;
        }
        seq.tokens.truncate(n);
        let keep = self.blocks.blocks_for(n);
        let mut dropped = seq.block_table.split_off(keep.min(seq.block_table.len()));
        self.blocks.release(&mut dropped);
    }

    /// Frees a sequence's cache blocks (and its linear-attention state, where the model
    /// has one).
    pub fn release(&mut self, seq: &mut Sequence) {
        self.forget_state(&seq.block_table);
        self.blocks.release(&mut seq.block_table);
        seq.tokens.clear();
    }

    /// Generates up to `max_tokens` after `prompt` (appended to `seq`), calling `on_token`
    /// with each sampled id; generation stops when it returns false or at an
    /// end-of-generation token (`is_eog`; that token is passed to `on_token` but not
    /// evaluated). Returns the generated ids. [`Engine::generate_speculative`] with no
    /// speculation.
    pub fn generate(
        &mut self,
        seq: &mut Sequence,
        prompt: &[u32],
        params: &SamplerParams,
        max_tokens: usize,
        is_eog: impl Fn(u32) -> bool,
        on_token: impl FnMut(u32) -> bool,
    ) -> anyhow::Result<Vec<u32>> {
        self.generate_speculative(seq, prompt, params, max_tokens, is_eog, on_token, None)
            .map(|(ids, _)| ids)
    }

    /// [`Engine::generate`] with every token restricted by `filter` (a grammar's mask, a
    /// logit bias): each step's logit row comes to the host, the filter adjusts it, and the
    /// sampler picks from what is left. Stops when the filter says the output is complete;
    /// a token the filter rejects is an error.
    #[allow(clippy::too_many_arguments)]
    pub fn generate_filtered(
        &mut self,
        seq: &mut Sequence,
        prompt: &[u32],
        params: &SamplerParams,
        max_tokens: usize,
        filter: &mut dyn TokenFilter,
        is_eog: impl Fn(u32) -> bool,
        mut on_token: impl FnMut(u32) -> bool,
    ) -> anyhow::Result<Vec<u32>> {
        let mut sampler = Sampler::new(params.clone());
        let mut out = Vec::new();
        let mut logits = Vec::new();
        let mut feed = prompt.to_vec();
        while out.len() < max_tokens {
            self.eval(seq, &feed, false, |_, l| {
                logits.clear();
                logits.extend_from_slice(l);
            })?;
            filter.prepare();
            filter.apply(&mut logits);
            let id = sampler.sample(&logits, &seq.tokens);
            out.push(id);
            let eog = is_eog(id);
            let complete = !eog && filter.accept(id).map_err(anyhow::Error::msg)?;
            let go_on = on_token(id);
            if eog || complete || !go_on || seq.tokens.len() + 1 > self.ctx {
                break;
            }
            feed = vec![id];
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kestrel_model::{Arch, KvType};
    use rand::{Rng, SeedableRng};

    const MIB: u64 = 1 << 20;

    #[test]
    fn bytes_per_token_is_what_the_cpu_cache_allocates() {
        use kestrel_model::synth::{SynthConfig, WeightType, write_synth_to};
        for (seed, arch) in [Arch::Qwen2, Arch::Llama, Arch::Gemma3]
            .into_iter()
            .enumerate()
        {
            let cfg = SynthConfig::tiny(arch);
            let ty: WeightType = "q8_0".parse().unwrap();
            let (bytes, _) = write_synth_to(Vec::new(), &cfg, ty, seed as u64).unwrap();
            let file = Arc::new(GgufFile::from_bytes(bytes).unwrap());
            for k in KvType::ALL {
                for v in KvType::ALL {
                    let kv = KvTypes { k, v };
                    let opts = EngineOptions {
                        ctx: 64,
                        max_batch_tokens: 16,
                        ..EngineOptions::default()
                    };
                    let backend = kestrel_cpu::CpuBackend::new(kestrel_cpu::Kernels::Scalar);
                    let e = Engine::with_cache_size(
                        backend,
                        file.clone(),
                        &opts,
                        kv,
                        KvCacheSize::Bytes(5 * MIB / 4),
                    )
                    .unwrap();
                    let held: usize = e.cache.k.iter().chain(&e.cache.v).map(Vec::len).sum();
                    let positions = e.blocks.n_blocks() * e.blocks.block_size();
                    assert_eq!(held, positions * e.kv_bytes_per_token, "{arch:?} {k}/{v}");
                    assert!(held as u64 <= 5 * MIB / 4, "{arch:?} {k}/{v}: {held} bytes");
                    let one_more = held + e.blocks.block_size() * e.kv_bytes_per_token;
                    assert!(one_more as u64 > 5 * MIB / 4, "{arch:?} {k}/{v}");
                    assert_eq!(e.ctx, 64.min(positions), "context is at most the cache");
                }
            }
            // fp8 is CUDA's: the CPU refuses it by name.
            let fp8 = KvTypes {
                k: KvType::Fp8,
                v: KvType::F16,
            };
            let backend = kestrel_cpu::CpuBackend::new(kestrel_cpu::Kernels::Scalar);
            let opts = EngineOptions::default();
            let err = Engine::with_cache_types(backend, file.clone(), &opts, fp8)
                .err()
                .expect("the CPU has no fp8 cache");
            let err = format!("{err:#}");
            assert!(err.contains("fp8"), "{err}");
        }
    }

    #[test]
    fn blocks_fill_the_byte_budget() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..2000 {
            let bpt = rng.random_range(1..100_000usize);
            let bs = rng.random_range(1..64usize);
            let bytes = rng.random_range(0..1u64 << 36);
            let block = (bpt * bs) as u64;
            match kv_cache_blocks(KvCacheSize::Bytes(bytes), bpt, bs, 4096, 8, None) {
                Ok(n) => {
                    let n = n as u64;
                    assert!(n >= 1 && n * block <= bytes && (n + 1) * block > bytes);
                }
                Err(e) => assert!(
                    bytes < block || bytes / block > (i32::MAX as u64) / bs as u64,
                    "{e}"
                ),
            }
        }
    }

    #[test]
    fn a_device_fraction_leaves_the_rest_of_the_memory() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(8);
        for _ in 0..2000 {
            let total = rng.random_range(1u64 << 30..1u64 << 38) as usize;
            let free = rng.random_range(0..=total);
            let f: f64 = rng.random_range(0.05..=1.0);
            let bpt = rng.random_range(1_000..300_000usize);
            let bs = 16;
            let block = (bpt * bs) as f64;
            let dev = Some((free, total));
            let size = KvCacheSize::DeviceFraction(f);
            // f64 reference: in use afterwards at most f × total, one more block would pass it.
            let in_use = (total - free) as f64;
            let room = (total as f64 * f - in_use) / block;
            match kv_cache_blocks(size, bpt, bs, 4096, 8, dev) {
                Ok(n) => {
                    let after = in_use + n as f64 * block;
                    assert!(after <= total as f64 * f + 1.0, "{after} > {f} × {total}");
                    assert!(after + block > total as f64 * f - 1.0);
                    assert!((room.floor() - n as f64).abs() <= 1.0);
                }
                Err(e) => {
                    let msg = e.to_string();
                    assert!(
                        room < 1.0 + 1e-9 || room > (i32::MAX / bs as i32) as f64,
                        "{msg}"
                    );
                }
            }
        }
    }

    #[test]
    fn bad_sizes_are_clear_errors() {
        let err = |size, dev| {
            kv_cache_blocks(size, 1024, 16, 4096, 8, dev)
                .unwrap_err()
                .to_string()
        };
        assert!(err(KvCacheSize::Bytes(1000), None).contains("holds no block"));
        assert!(err(KvCacheSize::Bytes(u64::MAX), None).contains("more than"));
        for f in [0.0, -0.5, 1.5, f64::NAN, f64::INFINITY] {
            let msg = err(KvCacheSize::DeviceFraction(f), Some((1 << 30, 1 << 31)));
            assert!(msg.contains("fraction"), "{f}: {msg}");
        }
        let cpu = err(KvCacheSize::DeviceFraction(0.9), None);
        assert!(cpu.contains("--kv-memory"), "{cpu}");
        // Half the memory already in use, a 40% budget: nothing left.
        let full = err(KvCacheSize::DeviceFraction(0.4), Some((1 << 30, 1 << 31)));
        assert!(full.contains("no room"), "{full}");
        assert_eq!(
            kv_cache_blocks(KvCacheSize::PerSequence, 1024, 16, 100, 3, None).unwrap(),
            7 * 3
        );
    }
}
