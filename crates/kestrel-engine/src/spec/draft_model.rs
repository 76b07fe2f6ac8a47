//! The draft-model drafter: a second, smaller GGUF with the same vocabulary on the same
//! kind of backend, with its own engine and paged KV. Each round it catches up on the
//! tokens the target accepted (its cache keeps the longest prefix it shares with them, the
//! rest is truncated away) and drafts k tokens one at a time: greedily when the target is
//! greedy, otherwise drawn from its own distribution under the target's sampling settings
//! (penalties, top-k, top-p, min-p, temperature), which it reports for the acceptance rule.
//!
//! [`MultiDraftModel`] is the scheduler's: one draft engine holding a draft sequence per
//! speculating request (a fixed number of slots), each caught up the same way before it
//! drafts greedily, and freed when its request ends.
//!
//! Also here: the vocabulary check made at load, and [`write_truncated`], which makes a
//! same-vocabulary draft from a model by keeping its first layers.

use std::path::Path;

use anyhow::{Context, bail};
use kestrel_gguf::{GgufFile, GgufWriter, Value};
use kestrel_model::Backend;

use super::accept::draw_from;
use super::{Draft, Drafter, MultiDrafter};
use crate::engine::{Engine, Sequence};
use crate::sampler::{Sampler, SamplerParams};

/// Seeds the draft's own draws apart from the target's.
const DRAFT_SEED_SALT: u64 = 0x5eed_d4af_7000_0001;

pub struct DraftModel<B: Backend> {
    engine: Engine<B>,
    seq: Sequence,
    sampler: Sampler,
    /// The logits after the last token of `seq`.
    row: Vec<f32>,
}

impl<B: Backend> DraftModel<B> {
    /// A drafter running `engine`, whose model must share `target`'s vocabulary.
    pub fn new(engine: Engine<B>, target: &GgufFile, draft: &GgufFile) -> anyhow::Result<Self> {
        check_same_vocabulary(target, draft)?;
        Ok(DraftModel {
            engine,
            seq: Sequence::default(),
            sampler: Sampler::new(SamplerParams::greedy()),
            row: Vec::new(),
        })
    }

    /// Makes the cache hold exactly `context` and `row` the logits after it.
    fn catch_up(&mut self, context: &[u32]) -> anyhow::Result<()> {
        if context.is_empty() {
            bail!("the draft model needs at least one token of context");
        }
        let shared = self
            .seq
            .tokens
            .iter()
            .zip(context)
            .take_while(|(a, b)| a == b)
            .count();
        // At least the last token is evaluated again, for its logits.
        let keep = shared.min(context.len() - 1);
        self.engine.truncate(&mut self.seq, keep);
        let row = &mut self.row;
        self.engine
            .eval(&mut self.seq, &context[keep..], false, |_, l| {
                row.clear();
                row.extend_from_slice(l);
            })
    }
}

impl<B: Backend> Drafter for DraftModel<B> {
    fn start(&mut self, context: &[u32], params: &SamplerParams) -> anyhow::Result<()> {
        let mut own = params.clone();
        own.seed = params.seed.map(|s| s ^ DRAFT_SEED_SALT);
        self.sampler = Sampler::new(own);
        if context.len() > self.engine.ctx {
            // Longer than the draft's context: it drafts nothing (the target goes on alone).
            self.engine.release(&mut self.seq);
            return Ok(());
        }
        self.catch_up(context)
    }

    fn draft(&mut self, context: &[u32], max: usize, out: &mut Draft) -> anyhow::Result<()> {
        out.clear();
        if max == 0 || context.len() + max > self.engine.ctx {
            return Ok(());
        }
        self.catch_up(context)?;
        let sampling = !self.sampler.is_argmax();
        for i in 0..max {
            let cands = self.sampler.candidates(&self.row, &self.seq.tokens);
            let token = if sampling {
                let dist = cands.to_vec();
                let token = draw_from(&dist, self.sampler.uniform());
                out.dists.push(dist);
                token
            } else {
                match cands.first() {
                    Some(c) => c.id,
                    None => break,
                }
            };
            out.tokens.push(token);
            if i + 1 < max {
                let row = &mut self.row;
                self.engine.eval(&mut self.seq, &[token], false, |_, l| {
                    row.clear();
                    row.extend_from_slice(l);
                })?;
            }
        }
        Ok(())
    }
}

/// The scheduler's draft model: one engine (on the target's device) and up to `slots` draft
/// sequences, each owned by one speculating request until it is released. Greedy only (the
/// scheduler speculates for greedy requests).
pub struct MultiDraftModel<B: Backend> {
    engine: Engine<B>,
    /// Each slot's owner (a request's id) and its draft sequence.
    slots: Vec<(Option<u64>, Sequence)>,
    ids: Vec<u32>,
}

impl<B: Backend> MultiDraftModel<B> {
    /// A drafter running `engine` for up to `slots` sequences at once; its model (`draft`)
    /// must share `target`'s vocabulary and keep no recurrent state (its drafts are rolled
    /// back by truncating its cache). The engine's cache should hold `slots` contexts.
    pub fn new(
        engine: Engine<B>,
        target: &GgufFile,
        draft: &GgufFile,
        slots: usize,
    ) -> anyhow::Result<Self> {
        check_same_vocabulary(target, draft)?;
        if engine.config().has_recurrent_layers() {
            bail!(
                "the draft model ({}) has linear-attention layers, whose recurrent state cannot \
                 be rolled back after a rejected draft: choose a draft without them",
                engine.config().arch.name()
            );
        }
        if slots == 0 {
            bail!("a draft model needs at least one sequence slot");
        }
        Ok(MultiDraftModel {
            engine,
            slots: (0..slots).map(|_| (None, Sequence::default())).collect(),
            ids: Vec::new(),
        })
    }

    /// Slots held by a request.
    pub fn slots_in_use(&self) -> usize {
        self.slots.iter().filter(|s| s.0.is_some()).count()
    }

    /// The draft engine's free KV blocks (all of them once every slot is released).
    pub fn free_blocks(&self) -> (usize, usize) {
        (self.engine.blocks.n_free(), self.engine.blocks.n_blocks())
    }

    fn draft_in(
        &mut self,
        slot: usize,
        context: &[u32],
        max: usize,
        out: &mut Vec<u32>,
    ) -> anyhow::Result<()> {
        let seq = &mut self.slots[slot].1;
        let shared = seq
            .tokens
            .iter()
            .zip(context)
            .take_while(|(a, b)| a == b)
            .count();
        // The last token is evaluated by the first draft step, for the next token's id.
        let last = context.len() - 1;
        let keep = shared.min(last);
        self.engine.truncate(seq, keep);
        if keep < last {
            self.engine
                .eval(seq, &context[keep..last], false, |_, _| {})?;
        }
        let mut token = context[last];
        for _ in 0..max {
            self.engine
                .decode_argmax(std::slice::from_mut(seq), &[token], &mut self.ids)?;
            token = *self
                .ids
                .first()
                .context("the draft step returned no token")?;
            out.push(token);
        }
        Ok(())
    }
}

impl<B: Backend> MultiDrafter for MultiDraftModel<B> {
    fn draft_for(
        &mut self,
        id: u64,
        context: &[u32],
        max: usize,
        out: &mut Vec<u32>,
    ) -> anyhow::Result<()> {
        // Within the draft's context (its last draft is not evaluated).
        let max = max.min((self.engine.ctx + 1).saturating_sub(context.len()));
        if max == 0 || context.is_empty() {
            return Ok(());
        }
        let slot = self
            .slots
            .iter()
            .position(|s| s.0 == Some(id))
            .or_else(|| self.slots.iter().position(|s| s.0.is_none()));
        let Some(slot) = slot else {
            return Ok(()); // every slot is taken: this sequence decodes plainly
        };
        self.slots[slot].0 = Some(id);
        let start = out.len();
        let result = self.draft_in(slot, context, max, out);
        if result.is_err() {
            out.truncate(start);
            self.release(id);
        }
        result
    }

    fn release(&mut self, id: u64) {
        if let Some((owner, seq)) = self.slots.iter_mut().find(|s| s.0 == Some(id)) {
            self.engine.release(seq);
            *owner = None;
        }
    }
}

/// The number of logits a model produces: `<arch>.vocab_size`, else its token list's length.
fn vocab_size(file: &GgufFile) -> Option<u64> {
    let arch = file.architecture()?;
    file.get_u64(&format!("{arch}.vocab_size")).or_else(|| {
        file.get_array("tokenizer.ggml.tokens")
            .map(|t| t.len() as u64)
    })
}

/// An error unless `draft` has `target`'s vocabulary: the same tokens (or, for tokenizer-less
/// synthetic models, the same vocabulary size) and the same special token ids.
pub fn check_same_vocabulary(target: &GgufFile, draft: &GgufFile) -> anyhow::Result<()> {
    let (t_size, d_size) = (vocab_size(target), vocab_size(draft));
    if t_size != d_size {
        bail!(
            "the draft model's vocabulary has {} tokens, the target's {}",
            d_size.map_or("no".into(), |n| n.to_string()),
            t_size.map_or("no".into(), |n| n.to_string())
        );
    }
    const TOKENS: &str = "tokenizer.ggml.tokens";
    match (target.get_array(TOKENS), draft.get_array(TOKENS)) {
        (Some(t), Some(d)) => {
            if let Some(i) = (0..t.len().max(d.len())).find(|&i| t.get(i) != d.get(i)) {
                let show = |v: Option<&Value>| {
                    v.and_then(Value::as_str)
                        .map_or("nothing".to_string(), |s| format!("{s:?}"))
                };
                bail!(
                    "the draft model's vocabulary differs from the target's: token {i} is {} \
                     in the draft, {} in the target",
                    show(d.get(i)),
                    show(t.get(i))
                );
            }
        }
        (None, None) => {}
        _ => bail!("one of the target and draft models has a token list, the other none"),
    }
    let special_keys = |f: &GgufFile| {
        f.metadata()
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer.ggml.") && k.ends_with("_token_id"))
            .map(|(k, _)| k.clone())
            .collect::<Vec<_>>()
    };
    let mut keys = special_keys(target);
    keys.extend(special_keys(draft));
    keys.sort();
    keys.dedup();
    for key in keys {
        let (t, d) = (target.get_u64(&key), draft.get_u64(&key));
        if t != d {
            let show = |v: Option<u64>| v.map_or("unset".to_string(), |v| v.to_string());
            bail!(
                "the draft model's {key} is {}, the target's {}",
                show(d),
                show(t)
            );
        }
    }
    Ok(())
}

/// Writes to `path` a copy of `file` keeping only its first `layers` transformer blocks: a
/// draft model with the same vocabulary (weak, but free to make).
pub fn write_truncated(file: &GgufFile, layers: u64, path: &Path) -> anyhow::Result<()> {
    let arch = file
        .architecture()
        .context("the model names no architecture")?;
    let count_key = format!("{arch}.block_count");
    let blocks = file
        .get_u64(&count_key)
        .with_context(|| format!("the model has no {count_key}"))?;
    if layers == 0 || layers > blocks {
        bail!("cannot keep {layers} of {blocks} layers (1 to {blocks})");
    }
    let mut writer = GgufWriter::new();
    writer.set_version(file.version())?;
    for (key, value) in file.metadata() {
        let value = if *key == count_key {
            Value::U32(u32::try_from(layers)?)
        } else {
            value.clone()
        };
        writer.add_metadata(key.clone(), value)?;
    }
    let kept = |name: &str| match name.strip_prefix("blk.") {
        Some(rest) => rest
            .split('.')
            .next()
            .and_then(|n| n.parse::<u64>().ok())
            .is_none_or(|n| n < layers),
        None => true,
    };
    let infos: Vec<_> = file.tensors().iter().filter(|t| kept(&t.name)).collect();
    for info in &infos {
        writer.add_tensor(info.name.clone(), &info.dims, info.ty)?;
    }
    let mut stream = writer
        .stream_to_path(path)
        .with_context(|| format!("creating {}", path.display()))?;
    for info in &infos {
        stream.write_tensor(file.tensor_data(info))?;
    }
    stream.finish()?;
    Ok(())
}
