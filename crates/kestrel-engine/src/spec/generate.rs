//! The generation loop, with or without speculation. Each round either takes a plain step
//! (one token) or verifies a draft: the target evaluates the pending token and the drafts
//! as one batch with a logit row per token, keeps the longest accepted prefix plus one
//! token of its own, and truncates the rejected tail from the sequence's KV blocks.

use std::time::Instant;

use kestrel_model::Backend;
use kestrel_model::sampling::{Candidate, SamplingBatch};

use super::accept::{Proposal, Verdict, judge};
use super::{Draft, SpecStats, Speculator};
use crate::engine::{Engine, Sequence};
use crate::sampler::{Sampler, SamplerParams};

impl<B: Backend> Engine<B> {
    /// Generates up to `max_tokens` after `prompt` (appended to `seq`), calling `on_token`
    /// with each sampled id; generation stops when it returns false or at an
    /// end-of-generation token (`is_eog`; that token is passed to `on_token` but not
    /// evaluated). With `spec`, rounds verify its drafter's proposals: the same tokens as
    /// without when greedy, the same distribution when sampling. Returns the generated ids
    /// and the speculation's counts.
    #[allow(clippy::too_many_arguments)]
    pub fn generate_speculative(
        &mut self,
        seq: &mut Sequence,
        prompt: &[u32],
        params: &SamplerParams,
        max_tokens: usize,
        is_eog: impl Fn(u32) -> bool,
        mut on_token: impl FnMut(u32) -> bool,
        mut spec: Option<&mut Speculator>,
    ) -> anyhow::Result<(Vec<u32>, SpecStats)> {
        if spec.is_some() && self.config().has_recurrent_layers() {
            anyhow::bail!(
                "speculative decoding is not supported for {} models: their linear-attention \
                 layers keep one recurrent state per sequence, which rejected drafts cannot be \
                 rolled back from",
                self.config().arch.name()
            );
        }
        let mut sampler = Sampler::new(params.clone());
        let mut stats = SpecStats::default();
        let mut out = Vec::new();
        let mut rows = Vec::new();
        self.eval(seq, prompt, false, |_, l| {
            rows.clear();
            rows.extend_from_slice(l);
        })?;
        if max_tokens == 0 {
            return Ok((out, stats));
        }
        if let Some(s) = spec.as_deref_mut() {
            s.control.reset();
            s.drafter.start(&seq.tokens, params)?;
        }
        // Emits one token; false once generation is over.
        let mut emit = |id: u32, out: &mut Vec<u32>| {
            out.push(id);
            let go_on = on_token(id);
            go_on && !is_eog(id) && out.len() < max_tokens
        };
        let mut pending = sampler.sample(&rows, &seq.tokens);
        if !emit(pending, &mut out) {
            return Ok((out, finish(stats, spec)));
        }
        // Without speculation or penalties: the host records each step while the device
        // runs the one before.
        if spec.is_none() && !sampler.needs_history() && self.can_chain() {
            if seq.tokens.len() < self.ctx {
                let room = max_tokens - out.len();
                let mut ids = Vec::new();
                let generated = self.decode_chained(seq, pending, room, &mut sampler, |id| {
                    ids.push(id);
                    emit(id, &mut out)
                });
                stats.plain_steps += ids.len();
                generated?;
            }
            return Ok((out, stats));
        }
        // Every evaluated token and then the pending one: the drafter's context and, with
        // the drafts after it, the penalty windows of the verified rows.
        let mut history = seq.tokens.clone();
        let mut draft = Draft::default();
        let mut step_tokens = Vec::new();
        let mut ids = Vec::new();
        let mut sampling = SamplingBatch::default();
        let mut target = Vec::<Candidate>::new();
        let vocab = self.config().vocab_size;
        let mut emitted = Vec::new();
        while seq.tokens.len() < self.ctx {
            let base = seq.tokens.len();
            history.truncate(base);
            history.push(pending);
            // Drafts must fit the context, the tokens still wanted, one step's rows and the
            // tokens the backend verifies batch-invariantly.
            let room = (self.ctx - base - 1)
                .min(max_tokens - out.len() - 1)
                .min(self.max_logit_rows() - 1)
                .min(self.max_batch_tokens() - 1)
                .min(self.invariant_max_tokens() - 1);
            // A round's cost includes its drafting.
            let started = Instant::now();
            draft.clear();
            if let Some(s) = spec.as_deref_mut() {
                let want = s.control.draft_len().min(room);
                if want >= s.control.min_len() {
                    s.drafter.draft(&history, want, &mut draft)?;
                    // Ids the target cannot produce end the draft.
                    let valid = draft.tokens.iter().take_while(|&&t| (t as usize) < vocab);
                    let n = valid.count().min(want);
                    draft.tokens.truncate(n);
                    draft.dists.truncate(n);
                    if n < s.control.min_len() {
                        draft.clear();
                        stats.empty_drafts += 1;
                    }
                }
            }
            emitted.clear();
            if draft.tokens.is_empty() {
                let id = if sampler.is_argmax() {
                    self.decode_argmax(std::slice::from_mut(seq), &[pending], &mut ids)?;
                    first_id(&ids)?
                } else {
                    sampling.clear();
                    sampler.push_row(&mut sampling, &history);
                    self.decode_sampled(
                        std::slice::from_mut(seq),
                        &[pending],
                        &sampling,
                        &mut ids,
                    )?;
                    first_id(&ids)?
                };
                emitted.push(id);
                stats.plain_steps += 1;
                if let Some(s) = spec.as_deref_mut() {
                    s.control.record_plain(started.elapsed().as_secs_f64());
                }
            } else {
                let d = draft.tokens.len();
                step_tokens.clear();
                step_tokens.push(pending);
                step_tokens.extend_from_slice(&draft.tokens);
                history.extend_from_slice(&draft.tokens);
                let accepted;
                if sampler.is_argmax() {
                    self.eval_argmax_each(seq, &step_tokens, &mut ids)?;
                    accepted = draft
                        .tokens
                        .iter()
                        .zip(&ids)
                        .take_while(|(a, b)| a == b)
                        .count();
                    emitted.extend_from_slice(&draft.tokens[..accepted]);
                    emitted.push(*ids.get(accepted).ok_or_else(|| {
                        anyhow::anyhow!("a verification step returned too few token ids")
                    })?);
                } else {
                    rows.clear();
                    self.eval_invariant(seq, &step_tokens, |_, l| rows.extend_from_slice(l))?;
                    let row = |i: usize| &rows[i * vocab..(i + 1) * vocab];
                    let mut replaced = None;
                    for (i, &x) in draft.tokens.iter().enumerate() {
                        target.clear();
                        target.extend_from_slice(sampler.candidates(row(i), &history[..=base + i]));
                        let proposal = match draft.dists.get(i) {
                            Some(q) => Proposal::Dist(q),
                            None => Proposal::PointMass,
                        };
                        match judge(&target, proposal, x, || sampler.uniform()) {
                            Verdict::Accept => emitted.push(x),
                            Verdict::Replace(t) => {
                                replaced = Some(t);
                                break;
                            }
                        }
                    }
                    accepted = emitted.len();
                    let next = match replaced {
                        Some(t) => t,
                        // Every draft kept: the target's own token after the last.
                        None => sampler.sample(row(d), &history[..=base + d]),
                    };
                    emitted.push(next);
                }
                // The rejected drafts leave the cache: the pending token and the accepted
                // drafts stay.
                self.truncate(seq, base + 1 + accepted);
                stats.drafted += d;
                stats.accepted += accepted;
                stats.rounds += 1;
                if let Some(s) = spec.as_deref_mut() {
                    s.control
                        .record_round(d, accepted, started.elapsed().as_secs_f64());
                }
            }
            // `history` again holds the evaluated tokens, the new pending one follows.
            history.truncate(base + 1);
            let (&next, kept) = emitted.split_last().expect("a round emits a token");
            history.extend_from_slice(kept);
            pending = next;
            for &id in emitted.iter() {
                if !emit(id, &mut out) {
                    return Ok((out, finish(stats, spec)));
                }
            }
        }
        Ok((out, finish(stats, spec)))
    }
}

/// The counts with the control's own added.
fn finish(mut stats: SpecStats, spec: Option<&mut Speculator>) -> SpecStats {
    if let Some(s) = spec {
        stats.times_off = s.control.times_off;
    }
    stats
}

fn first_id(ids: &[u32]) -> anyhow::Result<u32> {
    ids.first()
        .copied()
        .ok_or_else(|| anyhow::anyhow!("a decode step returned no token id"))
}
