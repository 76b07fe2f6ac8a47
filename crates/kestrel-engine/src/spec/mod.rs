//! Speculative decoding: a drafter proposes the next few tokens, the target model checks
//! them all in one batch (the last accepted token plus the drafts), and the rejected tail is
//! rolled back from the paged KV by truncating the block table. Lossless: greedy output is
//! token for token the plain output; sampled output keeps the target's distribution by the
//! acceptance rule of [`accept`].
//!
//! Two drafters share the [`Drafter`] interface: [`NgramDrafter`] (prompt lookup, no model)
//! and [`DraftModel`] (a smaller GGUF with the same vocabulary, its own engine and KV). The
//! scheduler drafts for many sequences through [`MultiDrafter`]: [`NgramDrafter`] again, or
//! [`MultiDraftModel`] (one draft engine holding a draft sequence per speculating request).
//! [`DraftControl`] sets the number drafted from the recent acceptance and switches
//! speculation off for a sequence while it is a loss.

pub mod accept;
pub mod control;
pub mod draft_model;
pub mod generate;
pub mod ngram;

use std::str::FromStr;

use kestrel_model::sampling::Candidate;

use crate::sampler::SamplerParams;
pub use control::DraftControl;
pub use draft_model::{DraftModel, MultiDraftModel, check_same_vocabulary, write_truncated};
pub use ngram::NgramDrafter;

/// Which drafter, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpecMode {
    #[default]
    None,
    Ngram,
    Draft,
}

impl FromStr for SpecMode {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<SpecMode> {
        match s {
            "none" => Ok(SpecMode::None),
            "ngram" => Ok(SpecMode::Ngram),
            "draft" => Ok(SpecMode::Draft),
            other => anyhow::bail!("unknown speculation {other:?} (expected none, ngram or draft)"),
        }
    }
}

/// What a drafter proposed: tokens, and for each the distribution it was drawn from (none:
/// the drafter chose deterministically, a point mass).
#[derive(Debug, Clone, Default)]
pub struct Draft {
    pub tokens: Vec<u32>,
    /// Empty, or one distribution per token.
    pub dists: Vec<Vec<Candidate>>,
}

impl Draft {
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.dists.clear();
    }
}

/// A source of draft tokens for one sequence at a time.
pub trait Drafter {
    /// A generation starts after `context` (the prompt, already evaluated by the target),
    /// sampled under `params`: a drafter that samples uses the same settings.
    fn start(&mut self, context: &[u32], params: &SamplerParams) -> anyhow::Result<()>;

    /// Proposes up to `max` tokens to follow `context` (every token of the sequence so
    /// far, the one the target evaluates next last) into `out`.
    fn draft(&mut self, context: &[u32], max: usize, out: &mut Draft) -> anyhow::Result<()>;
}

/// A source of greedy draft tokens for many sequences at once (the scheduler's), each known
/// by an id its caller gives it.
pub trait MultiDrafter {
    /// Appends to `out` up to `max` tokens to follow `context` (every token of sequence `id`
    /// so far, the one the target evaluates next last), each the drafter's greedy choice.
    /// Nothing when it has no room for the sequence.
    fn draft_for(
        &mut self,
        id: u64,
        context: &[u32],
        max: usize,
        out: &mut Vec<u32>,
    ) -> anyhow::Result<()>;

    /// Sequence `id` ended (or left the running set): whatever was kept for it is freed.
    fn release(&mut self, id: u64);
}

/// Counts of one generation's speculation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SpecStats {
    /// Tokens proposed and verified.
    pub drafted: usize,
    /// Of those, tokens the target kept.
    pub accepted: usize,
    /// Verification steps (each also emits one token of the target's own).
    pub rounds: usize,
    /// Plain one-token steps.
    pub plain_steps: usize,
    /// Rounds where the drafter had nothing to propose (a plain step instead).
    pub empty_drafts: usize,
    /// Times speculation switched itself off for a while, being a loss.
    pub times_off: usize,
}

impl SpecStats {
    pub fn add(&mut self, other: &SpecStats) {
        self.drafted += other.drafted;
        self.accepted += other.accepted;
        self.rounds += other.rounds;
        self.plain_steps += other.plain_steps;
        self.empty_drafts += other.empty_drafts;
        self.times_off += other.times_off;
    }

    /// Share of drafted tokens accepted (0 when none was drafted).
    pub fn acceptance(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }

    /// Drafted tokens accepted per verification step.
    pub fn mean_accepted(&self) -> f64 {
        self.accepted as f64 / self.rounds.max(1) as f64
    }

    /// One line for `-v` output and logs.
    pub fn summary(&self) -> String {
        format!(
            "speculation: {} drafted, {} accepted ({:.1}%), {} verification steps \
             (mean accepted length {:.2}), {} plain steps ({} for want of a draft); \
             switched off {} times as a loss",
            self.drafted,
            self.accepted,
            100.0 * self.acceptance(),
            self.rounds,
            self.mean_accepted(),
            self.plain_steps,
            self.empty_drafts,
            self.times_off
        )
    }
}

/// A drafter with its length control: what a generation speculates with.
pub struct Speculator<'a> {
    pub drafter: Box<dyn Drafter + 'a>,
    pub control: DraftControl,
}

impl<'a> Speculator<'a> {
    /// `draft_min..=draft_max` tokens per round.
    pub fn new(drafter: Box<dyn Drafter + 'a>, draft_min: usize, draft_max: usize) -> Self {
        Speculator {
            drafter,
            control: DraftControl::new(draft_min, draft_max),
        }
    }
}
