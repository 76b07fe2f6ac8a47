//! The speculative-sampling acceptance rule (Leviathan et al. 2023, Chen et al. 2023): a
//! drafted token `x`, proposed under the drafter's distribution `q`, is kept with probability
//! `min(1, p(x) / q(x))` under the target's distribution `p`; otherwise the token is drawn
//! from the residual `max(0, p - q)`, normalised. The tokens that come out follow `p`
//! exactly, whatever `q` is. A deterministic drafter (prompt lookup, a greedy draft model)
//! proposes a point mass, `q(x) = 1`.
//!
//! `p` and `q` are lists of [`Candidate`]s as [`kestrel_model::sampling`] defines them (the
//! tokens surviving penalties and filters, with their probabilities after temperature), so
//! the target's side is exactly what its sampler would draw from.

use kestrel_model::sampling::Candidate;

/// How the drafter proposed one token.
#[derive(Debug, Clone, Copy)]
pub enum Proposal<'a> {
    /// Deterministically: `q` is a point mass on the drafted token.
    PointMass,
    /// Drawn from this distribution.
    Dist(&'a [Candidate]),
}

/// What became of a drafted token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Accept,
    /// Rejected; this token (from the residual) takes its place and ends the round.
    Replace(u32),
}

fn prob_of(dist: &[Candidate], id: u32) -> f64 {
    dist.iter()
        .find(|c| c.id == id)
        .map_or(0.0, |c| c.prob as f64)
}

/// Judges `drafted` against the target's `p` (probabilities summing to 1); `uniform` gives
/// fresh draws in `[0, 1)` and is called only where a draw decides something.
pub fn judge(
    p: &[Candidate],
    proposal: Proposal,
    drafted: u32,
    mut uniform: impl FnMut() -> f64,
) -> Verdict {
    // A token outside the drafter's own support cannot have been drawn from it: read the
    // proposal as the point mass it then was.
    let q = match proposal {
        Proposal::Dist(q) if prob_of(q, drafted) > 0.0 => q,
        _ => &[],
    };
    let q_of = |id: u32| {
        if q.is_empty() {
            f64::from(u8::from(id == drafted))
        } else {
            prob_of(q, id)
        }
    };
    let px = prob_of(p, drafted);
    let qx = q_of(drafted);
    if px >= qx || (px > 0.0 && uniform() < px / qx) {
        return Verdict::Accept;
    }
    let residual = |c: &Candidate| (c.prob as f64 - q_of(c.id)).max(0.0);
    let total: f64 = p.iter().map(residual).sum();
    if total <= 0.0 {
        // Only rounding leaves no residual mass (p equals q): draw from p itself.
        return Verdict::Replace(draw(p, |c| c.prob as f64, uniform()));
    }
    Verdict::Replace(draw(p, residual, uniform()))
}

/// The candidate whose cumulative weight first exceeds `u` times the total.
fn draw(cands: &[Candidate], weight: impl Fn(&Candidate) -> f64, u: f64) -> u32 {
    let total: f64 = cands.iter().map(&weight).sum();
    let target = u * total;
    let mut cumulative = 0.0;
    for c in cands {
        cumulative += weight(c);
        if target < cumulative {
            return c.id;
        }
    }
    // Rounding left the sum just under the target: the last token with weight.
    cands
        .iter()
        .rev()
        .find(|c| weight(c) > 0.0)
        .map_or(0, |c| c.id)
}

/// A token drawn from `dist` with the uniform draw `u` (the draft model's proposal).
pub fn draw_from(dist: &[Candidate], u: f64) -> u32 {
    draw(dist, |c| c.prob as f64, u)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// The chi-square statistic's critical value for `dof` degrees of freedom at the normal
    /// quantile `z` (Wilson–Hilferty; z = 4 is a false-alarm rate of about 3e-5).
    pub(crate) fn chi2_critical(dof: usize, z: f64) -> f64 {
        let k = dof as f64;
        k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
    }

    /// Pearson's statistic of `counts` against the probabilities `expected`, cells with an
    /// expected count under 5 merged into one.
    pub(crate) fn chi2(counts: &[u64], expected: &[f64]) -> (f64, usize) {
        let n: u64 = counts.iter().sum();
        let (mut stat, mut cells) = (0.0, 0usize);
        let (mut small_obs, mut small_exp) = (0.0, 0.0);
        for (&c, &p) in counts.iter().zip(expected) {
            let e = p * n as f64;
            if e < 5.0 {
                small_obs += c as f64;
                small_exp += e;
                continue;
            }
            stat += (c as f64 - e).powi(2) / e;
            cells += 1;
        }
        if small_exp > 0.0 {
            stat += (small_obs - small_exp).powi(2) / small_exp.max(1e-9);
            cells += 1;
        }
        (stat, cells.saturating_sub(1).max(1))
    }

    fn random_dist(rng: &mut StdRng, vocab: u32, sparse: bool) -> Vec<Candidate> {
        let mut d = Vec::new();
        for id in 0..vocab {
            if !sparse || rng.random_bool(0.6) {
                let prob = rng.random_range(0.0f32..1.0).powi(2);
                d.push(Candidate {
                    id,
                    logit: 0.0,
                    prob,
                });
            }
        }
        if d.is_empty() {
            d.push(Candidate {
                id: rng.random_range(0..vocab),
                logit: 0.0,
                prob: 1.0,
            });
        }
        let total: f32 = d.iter().map(|c| c.prob).sum();
        for c in &mut d {
            c.prob /= total;
        }
        d
    }

    /// Counts the tokens a round's first position yields when `x` comes from `q` (or is
    /// the fixed point-mass token) and is judged against `p` by `rule`.
    fn histogram(
        rng: &mut StdRng,
        p: &[Candidate],
        q: Option<&[Candidate]>,
        fixed: u32,
        vocab: u32,
        trials: usize,
        rule: impl Fn(&[Candidate], Proposal, u32, &mut StdRng) -> Verdict,
    ) -> Vec<u64> {
        let mut counts = vec![0u64; vocab as usize];
        for _ in 0..trials {
            let (x, proposal) = match q {
                Some(q) => (draw_from(q, rng.random()), Proposal::Dist(q)),
                None => (fixed, Proposal::PointMass),
            };
            let token = match rule(p, proposal, x, rng) {
                Verdict::Accept => x,
                Verdict::Replace(t) => t,
            };
            counts[token as usize] += 1;
        }
        counts
    }

    fn expected(p: &[Candidate], vocab: u32) -> Vec<f64> {
        let mut e = vec![0.0; vocab as usize];
        for c in p {
            e[c.id as usize] = c.prob as f64;
        }
        e
    }

    #[test]
    fn accepted_and_resampled_tokens_follow_the_target() {
        let mut rng = StdRng::seed_from_u64(rand::random());
        let vocab = 8;
        for case in 0..12 {
            let p = random_dist(&mut rng, vocab, case % 2 == 0);
            let q = random_dist(&mut rng, vocab, case % 3 == 0);
            let fixed = rng.random_range(0..vocab);
            for q in [Some(q.as_slice()), None] {
                let counts = histogram(&mut rng, &p, q, fixed, vocab, 40_000, |p, q, x, r| {
                    judge(p, q, x, || r.random())
                });
                let (stat, dof) = chi2(&counts, &expected(&p, vocab));
                assert!(
                    stat < chi2_critical(dof, 4.0),
                    "case {case}, point mass {}: chi2 {stat:.1} with {dof} dof; p {p:?}, counts {counts:?}",
                    q.is_none()
                );
            }
        }
    }

    #[test]
    fn the_test_catches_a_rule_that_always_accepts() {
        // The oracle has power: keeping every draft yields q, not p.
        let mut rng = StdRng::seed_from_u64(rand::random());
        let vocab = 8;
        let p = random_dist(&mut rng, vocab, false);
        // q puts 0.6 on token 0, p draws it with probability at most 1/2 or so.
        let q: Vec<Candidate> = (0..vocab)
            .map(|id| Candidate {
                id,
                logit: 0.0,
                prob: if id == 0 { 0.6 } else { 0.4 / 7.0 },
            })
            .collect();
        let counts = histogram(&mut rng, &p, Some(&q), 0, vocab, 40_000, |_, _, _, _| {
            Verdict::Accept
        });
        let (stat, dof) = chi2(&counts, &expected(&p, vocab));
        assert!(
            stat > chi2_critical(dof, 4.0),
            "chi2 {stat:.1} missed a biased rule"
        );
    }

    #[test]
    fn greedy_point_masses_need_no_draws() {
        let p = [Candidate {
            id: 3,
            logit: 1.0,
            prob: 1.0,
        }];
        let no_draw = || -> f64 { panic!("a greedy verdict drew a number") };
        assert_eq!(judge(&p, Proposal::PointMass, 3, no_draw), Verdict::Accept);
        assert_eq!(
            judge(&p, Proposal::PointMass, 5, || 0.5),
            Verdict::Replace(3)
        );
    }
}
