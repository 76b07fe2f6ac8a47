//! Teacher-forced scoring of a token window: perplexity and the top log-probs of every
//! position, in the schema of llama.cpp's reference files.

use kestrel_model::Backend;
use serde::{Deserialize, Serialize};

use crate::engine::{Engine, Sequence};

/// The most likely next tokens after one position.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PositionScore {
    pub top_ids: Vec<u32>,
    pub top_logprobs: Vec<f64>,
    /// Log-prob of the token that actually follows.
    pub next_logprob: f64,
}

/// Scores of one window of text.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TextScore {
    pub ids: Vec<u32>,
    /// exp of the mean negative log-prob of ids[1..].
    pub ppl: f64,
    /// One entry per predicted token: position i predicts ids[i + 1].
    pub positions: Vec<PositionScore>,
}

/// Log-softmax of `logits` computed in f64.
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    let log_sum = sum.ln() + max;
    logits.iter().map(|&l| l as f64 - log_sum).collect()
}

/// The `n` largest entries, descending (ties: lower id first).
pub fn top_n(values: &[f64], n: usize) -> Vec<(u32, f64)> {
    let mut idx: Vec<u32> = (0..values.len() as u32).collect();
    let n = n.min(idx.len());
    let cmp = |a: &u32, b: &u32| {
        values[*b as usize]
            .total_cmp(&values[*a as usize])
            .then(a.cmp(b))
    };
    if n < idx.len() && n > 0 {
        idx.select_nth_unstable_by(n - 1, cmp);
    }
    idx.truncate(n);
    idx.sort_by(cmp);
    idx.into_iter().map(|i| (i, values[i as usize])).collect()
}

/// Evaluates `ids` as one window from an empty cache and scores every next-token
/// prediction, keeping the `top` most likely tokens of each position.
pub fn score_window<B: Backend>(
    engine: &mut Engine<B>,
    ids: &[u32],
    top: usize,
) -> anyhow::Result<TextScore> {
    score_window_with(engine, ids, top, |_, _| {})
}

/// [`score_window`], also handing each position's full log-softmax to `inspect`.
pub fn score_window_with<B: Backend>(
    engine: &mut Engine<B>,
    ids: &[u32],
    top: usize,
    mut inspect: impl FnMut(usize, &[f64]),
) -> anyhow::Result<TextScore> {
    if ids.len() < 2 {
        anyhow::bail!("need at least 2 tokens to score, got {}", ids.len());
    }
    let mut seq = Sequence::default();
    let mut positions = Vec::with_capacity(ids.len() - 1);
    let result = engine.eval(&mut seq, ids, true, |i, logits| {
        if i + 1 < ids.len() {
            let lp = log_softmax(logits);
            inspect(i, &lp);
            let best = top_n(&lp, top);
            positions.push(PositionScore {
                top_ids: best.iter().map(|b| b.0).collect(),
                top_logprobs: best.iter().map(|b| b.1).collect(),
                next_logprob: lp[ids[i + 1] as usize],
            });
        }
    });
    engine.release(&mut seq);
    result?;
    let nll: f64 = positions.iter().map(|p| -p.next_logprob).sum::<f64>() / positions.len() as f64;
    Ok(TextScore {
        ids: ids.to_vec(),
        ppl: nll.exp(),
        positions,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_normalizes_and_top_n_orders() {
        let l = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let lp = log_softmax(&l);
        let total: f64 = lp.iter().map(|v| v.exp()).sum();
        assert!((total - 1.0).abs() < 1e-12);
        let t = top_n(&lp, 3);
        assert_eq!(t.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3, 2]);
        assert_eq!(top_n(&lp, 10).len(), 5);
    }
}
