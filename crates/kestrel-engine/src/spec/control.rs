//! How many tokens to draft next, and whether speculating pays for this sequence at all.
//!
//! The length follows the recent acceptance: it starts at the minimum, a round whose drafts
//! were all accepted drafts [`GROW`] more next time, a rejection at draft `a` drafts `a + 1`
//! next time (a failed draft costs in proportion to its length), within `min..=max`.
//! Whether speculation pays is measured, not modelled: the seconds per emitted token of
//! speculative rounds (drafting and verification) against those of plain decode steps, each
//! as a ratio of exponentially decayed sums of seconds and tokens. The plain rate is kept
//! fresh (a plain step at least every 16 rounds, the last few counting most), so that a
//! machine whose speed drifts compares like with like. Once speculation is the slower, the
//! sequence decodes plainly for a while (twice as long after each further loss) and then
//! tries again.

/// Decay per sample of the sums of seconds and tokens of speculative rounds (about the last
/// 8 count) and of plain steps (about the last 2).
const SPEC_DECAY: f64 = 0.875;
const PLAIN_DECAY: f64 = 0.5;
/// Speculative rounds between plain steps that refresh the plain rate.
const REFRESH_ROUNDS: usize = 16;
/// Speculative rounds measured before they may be judged a loss.
const PROBE_ROUNDS: usize = 8;
/// Plain steps taken once speculation was a loss, before trying it again (doubling with
/// each further loss, up to 16 times).
///
/// Both this and [`GROW`] were chosen by replaying the greedy outputs of the 20 code tasks
/// (real Qwen2.5-Coder-1.5B, `scripts/workloads/spec_sim.py`) through this control with the
/// measured verification-step costs: a run of rejections in an edit that then copies again
/// switched speculation off for 16 steps 10 times (207 of the 306 plain steps), so 4 steps
/// first; +3 after a fully accepted round reaches the long drafts of a copied stretch one
/// round sooner. Predicted on the H100's step costs 1.69x -> 1.78x of plain decoding, on the
/// CPU's 1.88x -> 1.97x (the losing-sequence test below still holds: it only waits less).
const OFF_STEPS: usize = 4;
/// Tokens added to the draft length after a round whose drafts were all accepted.
const GROW: usize = 3;

/// Exponentially decayed sums of seconds and tokens: their ratio is a recent rate.
#[derive(Debug, Clone, Copy, Default)]
struct Rate {
    secs: f64,
    tokens: f64,
}

impl Rate {
    fn add(&mut self, decay: f64, secs: f64, tokens: usize) {
        self.secs = decay * self.secs + secs;
        self.tokens = decay * self.tokens + tokens as f64;
    }

    /// Seconds per token, if anything was measured.
    fn per_token(&self) -> Option<f64> {
        (self.tokens > 0.0).then(|| self.secs / self.tokens)
    }
}

#[derive(Debug, Clone)]
pub struct DraftControl {
    min: usize,
    max: usize,
    len: usize,
    plain: Rate,
    spec: Rate,
    spec_rounds: usize,
    rounds_since_plain: usize,
    off_steps: usize,
    /// Times speculation was switched off for being a loss.
    pub times_off: usize,
}

impl DraftControl {
    /// Drafts of `min..=max` tokens (`min` at least 1).
    pub fn new(min: usize, max: usize) -> DraftControl {
        let min = min.max(1);
        DraftControl {
            min,
            max: max.max(min),
            len: min,
            plain: Rate::default(),
            spec: Rate::default(),
            spec_rounds: 0,
            rounds_since_plain: 0,
            off_steps: 0,
            times_off: 0,
        }
    }

    /// Forgets everything measured (a new sequence).
    pub fn reset(&mut self) {
        *self = DraftControl::new(self.min, self.max);
    }

    /// Tokens to draft in the next round; 0: take a plain step (speculation is off for now,
    /// or the plain rate needs a fresh measurement before speculation can be judged).
    pub fn draft_len(&self) -> usize {
        let unmeasured = self.plain.per_token().is_none() && self.spec_rounds >= PROBE_ROUNDS;
        if unmeasured || self.off_steps > 0 || self.rounds_since_plain >= REFRESH_ROUNDS {
            0
        } else {
            self.len
        }
    }

    /// The least number of drafts worth verifying.
    pub fn min_len(&self) -> usize {
        self.min
    }

    /// A plain decode step took `secs`.
    pub fn record_plain(&mut self, secs: f64) {
        self.plain.add(PLAIN_DECAY, secs, 1);
        self.rounds_since_plain = 0;
        self.off_steps = self.off_steps.saturating_sub(1);
    }

    /// A round drafted `drafted` tokens, `accepted` of them were kept, and it took `secs`
    /// (it emitted `accepted + 1` tokens).
    pub fn record_round(&mut self, drafted: usize, accepted: usize, secs: f64) {
        self.len = if accepted >= drafted {
            self.len + GROW
        } else {
            accepted + 1
        }
        .clamp(self.min, self.max);
        self.spec.add(SPEC_DECAY, secs, accepted + 1);
        self.spec_rounds += 1;
        self.rounds_since_plain += 1;
        if let (Some(spec), Some(plain)) = (self.spec.per_token(), self.plain.per_token())
            && self.spec_rounds >= PROBE_ROUNDS
            && spec > plain
        {
            // Each further loss keeps it off twice as long (up to 16 times).
            self.off_steps = OFF_STEPS << self.times_off.min(4);
            self.spec_rounds = 0;
            self.spec = Rate::default();
            self.len = self.min;
            self.times_off += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn length_follows_acceptance_within_bounds() {
        let mut rng = StdRng::seed_from_u64(rand::random());
        for _ in 0..200 {
            let min = rng.random_range(1..4);
            let max = rng.random_range(min..12);
            let mut c = DraftControl::new(min, max);
            let mut expected = min;
            for round in 0..50 {
                if round % REFRESH_ROUNDS == 0 {
                    assert!(
                        round == 0 || c.draft_len() == 0,
                        "a plain step refreshes the rate"
                    );
                    c.record_plain(1.0);
                }
                let drafted = c.draft_len();
                assert_eq!(drafted, expected);
                let accepted = rng.random_range(0..=drafted);
                // Fast rounds: speculation never turns off here.
                c.record_round(drafted, accepted, 0.01);
                expected = if accepted == drafted {
                    (expected + GROW).min(max)
                } else {
                    (accepted + 1).max(min)
                };
            }
            assert_eq!(c.times_off, 0);
        }
    }

    #[test]
    fn a_losing_sequence_decodes_plainly_then_tries_again() {
        let mut c = DraftControl::new(1, 8);
        // Rounds that emit one token for three plain steps' time.
        for _ in 0..PROBE_ROUNDS {
            assert!(c.draft_len() > 0);
            c.record_round(c.draft_len(), 0, 0.3);
        }
        assert_eq!(c.draft_len(), 0, "a plain step is measured before judging");
        c.record_plain(0.1);
        assert!(c.draft_len() > 0);
        c.record_round(c.draft_len(), 0, 0.3);
        assert_eq!(c.times_off, 1);
        for _ in 0..OFF_STEPS {
            assert_eq!(c.draft_len(), 0);
            c.record_plain(0.1);
        }
        assert_eq!(c.draft_len(), 1, "back on, at the shortest draft");
        // Rounds that pay keep it on (with a plain step whenever one is due).
        for _ in 0..20 {
            if c.draft_len() == 0 {
                c.record_plain(0.1);
            }
            c.record_round(c.draft_len(), c.draft_len(), 0.15);
        }
        assert_eq!(c.times_off, 1);
        assert_eq!(c.draft_len(), 8, "grown back to the longest draft");
    }
}
