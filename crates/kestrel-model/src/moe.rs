//! Expert selection of a mixture-of-experts block, the one definition every backend
//! follows (llama.cpp's `build_moe_ffn` with its softmax and softmax-weight gatings).

use crate::config::{Gating, MoeConfig};

/// Chooses a token's experts from its router logits (`moe.n_expert` values) and writes
/// `(expert, weight)` pairs, `moe.n_expert_used` of them, into `out`, in decreasing order
/// (the lower index first among equal ones):
/// - [`Gating::Softmax`]: the most probable experts under the softmax of all logits, their
///   probabilities renormalized to sum 1 when `moe.norm_top_k`;
/// - [`Gating::TopKSoftmax`]: the largest logits, weighted by the softmax of just those.
pub fn route(moe: &MoeConfig, logits: &[f32], out: &mut [(usize, f32)]) {
    debug_assert_eq!(logits.len(), moe.n_expert);
    debug_assert_eq!(out.len(), moe.n_expert_used);
    // Selection by repeated maximum: n_expert_used is small (2 to 8 of up to a few
    // hundred), and no buffer is needed. The softmax is monotonic, so the largest logits
    // are the most probable experts.
    for slot in 0..out.len() {
        let mut best = (usize::MAX, f32::NEG_INFINITY);
        for (e, &l) in logits.iter().enumerate() {
            if out[..slot].iter().any(|&(c, _)| c == e) {
                continue;
            }
            if best.0 == usize::MAX || l > best.1 {
                best = (e, l);
            }
        }
        out[slot] = best;
    }
    // Softmax as ggml computes it: exponentials of `l - max` summed in f64, each scaled
    // by the f32 reciprocal of the sum. The first selected logit is the largest.
    let max = out[0].1;
    let exp_sum =
        |ls: &mut dyn Iterator<Item = f32>| -> f64 { ls.map(|l| (l - max).exp() as f64).sum() };
    let sum = match moe.gating {
        Gating::Softmax => exp_sum(&mut logits.iter().copied()),
        Gating::TopKSoftmax => exp_sum(&mut out.iter().map(|&(_, l)| l)),
    };
    let scale = (1.0 / sum) as f32;
    out.iter_mut()
        .for_each(|(_, w)| *w = (*w - max).exp() * scale);
    if moe.norm_top_k {
        // ggml clamps the sum below at 2^-14 before dividing.
        let sum = out.iter().map(|&(_, w)| w).sum::<f32>().max(6.103_515_6e-5);
        out.iter_mut().for_each(|(_, w)| *w /= sum);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moe(n_expert: usize, n_expert_used: usize, gating: Gating, norm_top_k: bool) -> MoeConfig {
        MoeConfig {
            n_expert,
            n_expert_used,
            n_ff_exp: 1,
            gating,
            norm_top_k,
            clamped_swiglu: None,
            shared_expert: None,
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
            for (gating, norm) in [
                (Gating::Softmax, true),
                (Gating::Softmax, false),
                (Gating::TopKSoftmax, false),
            ] {
                let cfg = moe(n_expert, k, gating, norm);
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
                // Renormalizing the top-k probabilities is the softmax of their logits.
                let total: f64 = if norm || gating == Gating::TopKSoftmax {
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
