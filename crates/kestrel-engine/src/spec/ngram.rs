//! The prompt-lookup drafter: finds the longest recent earlier occurrence of the context's
//! last n tokens (n from the largest size down to the smallest) in the prompt and the text
//! generated so far, and proposes the tokens that followed it. No model: answers that copy
//! their input (edits of code, quotes) are drafted for free.

use super::{Draft, Drafter, MultiDrafter};
use crate::sampler::SamplerParams;

/// Prompt lookup over n-grams of `min..=max` tokens.
#[derive(Debug, Clone)]
pub struct NgramDrafter {
    min: usize,
    max: usize,
}

impl NgramDrafter {
    /// A drafter matching suffixes of `min..=max` tokens (an error unless `1 <= min <= max`).
    pub fn new(min: usize, max: usize) -> anyhow::Result<NgramDrafter> {
        if min == 0 || min > max {
            anyhow::bail!("n-gram sizes must satisfy 1 <= min <= max, got {min}..={max}");
        }
        Ok(NgramDrafter { min, max })
    }

    /// The tokens that followed the most recent earlier occurrence of the longest suffix of
    /// `context` that occurred before, at most `max_tokens` of them.
    pub fn lookup<'c>(&self, context: &'c [u32], max_tokens: usize) -> &'c [u32] {
        let len = context.len();
        for n in (self.min..=self.max.min(len.saturating_sub(1))).rev() {
            let suffix = &context[len - n..];
            // Most recent first: the occurrence ending just before the suffix itself at the
            // latest, so that at least one token follows it.
            let found = (0..len - n)
                .rev()
                .find(|&start| &context[start..start + n] == suffix);
            if let Some(start) = found {
                let from = start + n;
                return &context[from..(from + max_tokens).min(len)];
            }
        }
        &[]
    }
}

impl Drafter for NgramDrafter {
    fn start(&mut self, _context: &[u32], _params: &SamplerParams) -> anyhow::Result<()> {
        Ok(())
    }

    fn draft(&mut self, context: &[u32], max: usize, out: &mut Draft) -> anyhow::Result<()> {
        out.clear();
        out.tokens.extend_from_slice(self.lookup(context, max));
        Ok(())
    }
}

/// Prompt lookup keeps nothing per sequence: each draft is a lookup in its context.
impl MultiDrafter for NgramDrafter {
    fn draft_for(
        &mut self,
        _id: u64,
        context: &[u32],
        max: usize,
        out: &mut Vec<u32>,
    ) -> anyhow::Result<()> {
        out.extend_from_slice(self.lookup(context, max));
        Ok(())
    }

    fn release(&mut self, _id: u64) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// The definition, checked naively: the largest n whose suffix occurs earlier, its latest
    /// earlier occurrence, and what followed.
    fn naive(context: &[u32], min: usize, max: usize, k: usize) -> Vec<u32> {
        let len = context.len();
        for n in (min..=max).rev() {
            if n >= len {
                continue;
            }
            let suffix = context[len - n..].to_vec();
            let mut best = None;
            for start in 0..len - n {
                if context[start..start + n] == suffix[..] {
                    best = Some(start);
                }
            }
            if let Some(s) = best {
                return context[s + n..].iter().take(k).copied().collect();
            }
        }
        Vec::new()
    }

    #[test]
    fn lookup_matches_the_naive_definition() {
        let mut rng = StdRng::seed_from_u64(rand::random());
        for _ in 0..2000 {
            let len = rng.random_range(0..40);
            let vocab = rng.random_range(1..6);
            let context: Vec<u32> = (0..len).map(|_| rng.random_range(0..vocab)).collect();
            let min = rng.random_range(1..4);
            let max = rng.random_range(min..6);
            let k = rng.random_range(0..10);
            let d = NgramDrafter::new(min, max).unwrap();
            assert_eq!(
                d.lookup(&context, k),
                naive(&context, min, max, k).as_slice(),
                "context {context:?}, sizes {min}..={max}, k {k}"
            );
        }
    }

    #[test]
    fn copies_the_continuation_of_a_repeated_phrase() {
        let d = NgramDrafter::new(2, 3).unwrap();
        let context = [1, 2, 3, 4, 5, 6, 9, 2, 3, 4];
        assert_eq!(d.lookup(&context, 2), &[5, 6]);
        assert!(NgramDrafter::new(0, 3).is_err());
        assert!(NgramDrafter::new(3, 2).is_err());
    }
}
