//! Expert selection of a mixture-of-experts block, the one definition every backend
//! follows (llama.cpp's `build_moe_ffn` with softmax gating).

use crate::config::MoeConfig;

/// Chooses a token's experts from its router logits (`moe.n_expert` values): the softmax
/// probabilities, the `moe.n_expert_used` largest in decreasing order (the lower index
/// first among equal ones), renormalized to sum 1 when `moe.norm_top_k`. Writes
/// `(expert, weight)` pairs into `out` (`moe.n_expert_used` long).
pub fn route(moe: &MoeConfig, logits: &[f32], out: &mut [(usize, f32)]) {
    debug_assert_eq!(logits.len(), moe.n_expert);
    debug_assert_eq!(out.len(), moe.n_expert_used);
    // Softmax as ggml computes it: exponentials of x - max summed in f64, then scaled by
    // the f32 reciprocal of the sum.
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let sum: f64 = logits.iter().map(|&v| (v - max).exp() as f64).sum();
    let scale = (1.0 / sum) as f32;
    let prob = |e: usize| (logits[e] - max).exp() * scale;
    // Selection by repeated maximum: n_expert_used is small (2 to 8 of up to a few
    // hundred), and no buffer is needed.
    for slot in 0..out.len() {
        let mut best = (usize::MAX, f32::NEG_INFINITY);
        for e in 0..moe.n_expert {
            if out[..slot].iter().any(|&(c, _)| c == e) {
                continue;
            }
            let p = prob(e);
            if best.0 == usize::MAX || p > best.1 {
                best = (e, p);
            }
        }
        out[slot] = best;
    }
    if moe.norm_top_k {
        // ggml clamps the sum below at 2^-14 before dividing.
        let sum = out.iter().map(|&(_, w)| w).sum::<f32>().max(6.103_515_6e-5);
        out.iter_mut().for_each(|(_, w)| *w /= sum);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moe(n_expert: usize, n_expert_used: usize, norm_top_k: bool) -> MoeConfig {
        MoeConfig {
            n_expert,
            n_expert_used,
            n_ff_exp: 1,
            norm_top_k,
        }
    }

    /// Against a direct f64 computation: sort all probabilities, take the first k.
    #[test]
    fn routes_are_the_renormalized_top_k_of_the_softmax() {
        let mut state = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 * 8.0 - 4.0
        };
        for (n_expert, k) in [(8, 2), (128, 8), (5, 5), (3, 1), (60, 4)] {
            for norm in [true, false] {
                let cfg = moe(n_expert, k, norm);
                let logits: Vec<f32> = (0..n_expert).map(|_| next()).collect();
                let mut out = vec![(0, 0.0); k];
                route(&cfg, &logits, &mut out);
                let z: f64 = logits.iter().map(|&v| (v as f64).exp()).sum();
                let mut probs: Vec<(usize, f64)> = logits
                    .iter()
                    .enumerate()
                    .map(|(e, &v)| (e, (v as f64).exp() / z))
                    .collect();
                probs.sort_by(|a, b| b.1.total_cmp(&a.1));
                let top = &probs[..k];
                let total: f64 = if norm {
                    top.iter().map(|p| p.1).sum()
                } else {
                    1.0
                };
                for (&(e, w), &(want_e, want_p)) in out.iter().zip(top) {
                    assert_eq!(e, want_e, "{n_expert} experts, top {k}: {out:?}");
                    let want = want_p / total;
                    assert!((w as f64 - want).abs() < 1e-6, "{w} vs {want}");
                }
            }
        }
    }
}
