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
    pub(crate) scratch: Scratch<B>,
    logits: Vec<f32>,
    /// The batch `eval_batch` fills and reuses, with its per-sequence progress and the
    /// parts of the current step.
    batch: Batch,
    eval_done: Vec<usize>,
    eval_parts: Vec<(usize, usize, usize, usize)>,
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
        let n_blocks = ctx.div_ceil(opts.block_size) * opts.max_seqs.max(1);
        let cache = backend
            .new_cache_typed(cfg, n_blocks, opts.block_size, kv)
            .context("allocating the KV cache")?;
        let scratch = Scratch::new(&backend, cfg, opts.max_batch_tokens, opts.max_logit_rows)?;
        Ok(Engine {
            blocks: BlockManager::new(n_blocks, opts.block_size),
            backend,
            model,
            cache,
            ctx,
            scratch,
            logits: Vec::new(),
            batch: Batch::default(),
            eval_done: Vec::new(),
            eval_parts: Vec::new(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    pub fn max_batch_tokens(&self) -> usize {
        self.scratch.max_tokens
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
        let result = self.step_argmax(&batch, ids);
        self.batch = batch;
        result?;
        seq.tokens.extend_from_slice(tokens);
        Ok(())
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

    /// Frees a sequence's cache blocks.
    pub fn release(&mut self, seq: &mut Sequence) {
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
