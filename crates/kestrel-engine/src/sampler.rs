//! Token sampling settings and the seeded sampler of a sequence, plus helpers for reporting
//! log-probabilities. Penalties, top-k, min-p, top-p, temperature and the draw themselves are
//! defined once in [`kestrel_model::sampling`] (llama.cpp's order; the backends that sample
//! on the device follow the same definition): a [`Sampler`] supplies the settings, the
//! penalty window and the uniform draw of each row.

pub use kestrel_model::argmax;
pub use kestrel_model::sampling::Candidate;
use kestrel_model::sampling::{RowSampler, RowSampling, SamplingBatch};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::cmp::Ordering;

/// Sampling settings. Defaults follow llama.cpp's command-line defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerParams {
    /// Softmax temperature; `<= 0` means greedy (argmax, ties broken by the lowest id).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability sums to at least `top_p`;
    /// 1.0 disables.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the most likely token's; 0 disables.
    pub min_p: f32,
    /// Repetition penalty for tokens in the recent history; 1.0 disables.
    pub repeat_penalty: f32,
    /// How many of the most recent history tokens the penalties look at: 0 disables the
    /// penalties (`usize::MAX` covers the whole history).
    pub repeat_last_n: usize,
    /// Subtracted once from the logit of every token present in the penalty window.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per occurrence in the penalty window.
    pub frequency_penalty: f32,
    /// RNG seed; `None` seeds from the operating system's entropy.
    pub seed: Option<u64>,
}

impl Default for SamplerParams {
    fn default() -> Self {
        SamplerParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
        }
    }
}

impl SamplerParams {
    /// Settings for deterministic argmax decoding.
    pub fn greedy() -> Self {
        SamplerParams {
            temperature: 0.0,
            ..SamplerParams::default()
        }
    }

    /// Checks every field's range, saying which one is wrong.
    pub fn validate(&self) -> Result<(), String> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(format!(
                "temperature must be finite and >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !self.repeat_penalty.is_finite() || self.repeat_penalty <= 0.0 {
            return Err(format!(
                "repeat_penalty must be finite and > 0, got {}",
                self.repeat_penalty
            ));
        }
        if !self.presence_penalty.is_finite() {
            return Err(format!(
                "presence_penalty must be finite, got {}",
                self.presence_penalty
            ));
        }
        if !self.frequency_penalty.is_finite() {
            return Err(format!(
                "frequency_penalty must be finite, got {}",
                self.frequency_penalty
            ));
        }
        Ok(())
    }

    fn is_greedy(&self) -> bool {
        // NaN counts as greedy too: it can only come from unvalidated params.
        self.temperature.is_nan() || self.temperature <= 0.0
    }

    fn penalties_active(&self) -> bool {
        self.repeat_last_n != 0
            && (self.repeat_penalty != 1.0
                || self.presence_penalty != 0.0
                || self.frequency_penalty != 0.0)
    }
}

/// Restricts or biases a sequence's next token beyond the sampling settings: a grammar's
/// token mask (constrained decoding), a logit bias. A filter that is a mask only
/// ([`Self::is_mask`]) is sampled where the logits are (the backend applies the mask, on
/// the device for CUDA); any other is sampled from its logit row on the host.
pub trait TokenFilter: Send {
    /// Prepares the restriction of the next token (e.g. computes a grammar's mask). The
    /// scheduler calls it on another thread beside the step's forward pass, from the
    /// step's start. A failure is kept and reported by the next [`TokenFilter::accept`].
    fn prepare(&mut self);
    /// Adjusts a logit row before penalties and sampling; a banned token gets `-inf`.
    fn apply(&self, logits: &mut [f32]);
    /// Whether [`Self::apply`] only bans tokens (no bias), so that [`Self::mask`] says all
    /// it does. Default: no.
    fn is_mask(&self) -> bool {
        false
    }
    /// Writes the prepared restriction as a token mask into `words` (zeroed, the
    /// vocabulary's `div_ceil(32)` words; bit `t % 32` of word `t / 32`: token `t`
    /// allowed): exactly the tokens [`Self::apply`] leaves alone. False when there is none
    /// (nothing prepared, or the failure [`Self::accept`] will report): the row is then
    /// sampled unrestricted.
    fn mask(&self, _words: &mut [u32]) -> bool {
        false
    }
    /// Records the chosen token. `Ok(true)`: the output is complete, end the generation.
    /// A token drawn under the filter's [`Self::mask`] (which it allows) is recorded on
    /// the preparation's thread just before the next [`Self::prepare`], beside the next
    /// step's forward pass; the token has been sent by then, so the generation ends there.
    fn accept(&mut self, token: u32) -> Result<bool, String>;
}

/// A stateful sampler: the parameters and a seeded RNG. The filters and the draw are
/// [`kestrel_model::sampling`]'s (shared with the backends that sample on the device): a
/// sampler turns its settings, the history and one uniform draw into a [`RowSampling`].
pub struct Sampler {
    params: SamplerParams,
    rng: StdRng,
    /// Scratch for sampling one row here.
    row: RowSampler,
    own: SamplingBatch,
}

impl Sampler {
    /// Builds a sampler. Call [`SamplerParams::validate`] first to reject bad settings; invalid
    /// values are still handled without panicking (e.g. a NaN temperature samples greedily).
    pub fn new(params: SamplerParams) -> Self {
        let rng = match params.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        Sampler {
            params,
            rng,
            row: RowSampler::default(),
            own: SamplingBatch::default(),
        }
    }

    pub fn params(&self) -> &SamplerParams {
        &self.params
    }

    /// Picks the next token from `logits` (one per vocabulary entry) given the tokens seen so
    /// far. Returns 0 for an empty logit vector.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        if logits.is_empty() {
            return 0;
        }
        if self.is_argmax() {
            return argmax(logits);
        }
        let mut own = std::mem::take(&mut self.own);
        own.clear();
        self.push_row(&mut own, history);
        let id = match own.row(0) {
            Some((spec, penalties)) => self.row.sample(logits, spec, penalties),
            None => argmax(logits),
        };
        self.own = own;
        id
    }

    /// Adds this sampler's next row to `batch`: its settings, the penalty window of
    /// `history` and a fresh uniform draw (greedy rows draw nothing, so a seed gives the
    /// same tokens wherever its rows are sampled).
    pub fn push_row(&mut self, batch: &mut SamplingBatch, history: &[u32]) {
        let u = if self.params.is_greedy() {
            0.0
        } else {
            self.rng.random::<f64>()
        };
        self.push_row_with(batch, history, u);
    }

    /// [`Self::push_row`] with the draw `u` given.
    fn push_row_with(&self, batch: &mut SamplingBatch, history: &[u32], u: f64) {
        let p = &self.params;
        let window = if p.penalties_active() {
            &history[history.len() - p.repeat_last_n.min(history.len())..]
        } else {
            &[]
        };
        batch.push(
            RowSampling {
                temperature: if p.is_greedy() { 0.0 } else { p.temperature },
                top_k: p.top_k.min(u32::MAX as usize) as u32,
                top_p: p.top_p,
                min_p: p.min_p,
                repeat_penalty: p.repeat_penalty,
                presence_penalty: p.presence_penalty,
                frequency_penalty: p.frequency_penalty,
                u,
                penalty_start: 0,
                penalty_len: 0,
            },
            window,
        );
    }

    /// A fresh uniform draw in `[0, 1)` from this sampler's RNG (speculative decoding's
    /// acceptance tests and residual draws).
    pub fn uniform(&mut self) -> f64 {
        self.rng.random::<f64>()
    }

    /// Whether a draw reads the tokens before it (the repetition penalties' window).
    pub fn needs_history(&self) -> bool {
        self.params.penalties_active()
    }

    /// Whether [`Sampler::sample`] is the plain [`argmax`] of the logits (greedy, no
    /// penalties): callers may then compute it themselves, e.g. for many rows in parallel.
    pub fn is_argmax(&self) -> bool {
        self.params.is_greedy() && !self.params.penalties_active()
    }

    /// The tokens that survive penalties and filters, best first, with their probabilities
    /// after temperature. Greedy settings leave a single candidate. Draws nothing.
    pub fn candidates(&mut self, logits: &[f32], history: &[u32]) -> &[Candidate] {
        self.own.clear();
        // The draw does not change which tokens survive: any u will do, and none is taken.
        let mut own = std::mem::take(&mut self.own);
        self.push_row_with(&mut own, history, 0.0);
        self.own = own;
        match self.own.row(0) {
            Some((spec, penalties)) => self.row.candidates(logits, spec, penalties),
            None => &[],
        }
    }
}

/// Log-probabilities of every token: `logits - logsumexp(logits)`, accumulated in f64.
/// NaN logits give NaN; an all `-inf` vector gives all `-inf`.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits
        .iter()
        .copied()
        .filter(|l| !l.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    if max.is_infinite() {
        // Degenerate: no finite mass (all -inf) or infinite logits; keep the obvious answer
        // per element (a +inf token gets log-prob 0, everything else -inf).
        return logits
            .iter()
            .map(|&l| {
                if l.is_nan() {
                    f32::NAN
                } else if max == f32::INFINITY && l == f32::INFINITY {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
    }
    let max = max as f64;
    let sum: f64 = logits
        .iter()
        .filter(|l| !l.is_nan())
        .map(|&l| (l as f64 - max).exp())
        .sum();
    let lse = max + sum.ln();
    logits.iter().map(|&l| (l as f64 - lse) as f32).collect()
}

/// The `n` largest values with their ids, in descending order, ties by ascending id. NaN values
/// are ranked below everything else.
pub fn top_n(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let n = n.min(logits.len());
    if n == 0 {
        return Vec::new();
    }
    let key = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { v };
    let order = |a: &(u32, f32), b: &(u32, f32)| {
        key(b.1)
            .partial_cmp(&key(a.1))
            .unwrap_or(Ordering::Equal)
            .then(a.0.cmp(&b.0))
    };
    let mut all: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &v)| (i as u32, v))
        .collect();
    if n < all.len() {
        all.select_nth_unstable_by(n - 1, order);
        all.truncate(n);
    }
    all.sort_unstable_by(order);
    all
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    fn random_logits(rng: &mut StdRng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-6.0f32..6.0)).collect()
    }

    fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplerParams {
        SamplerParams {
            temperature,
            top_k,
            top_p,
            min_p,
            seed: Some(1),
            ..SamplerParams::default()
        }
    }

    /// Softmax in f64 over all entries.
    fn softmax(logits: &[f32]) -> Vec<f64> {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let e: Vec<f64> = logits.iter().map(|&l| (l as f64 - max).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|x| x / s).collect()
    }

    /// Naive oracle of llama.cpp's chain: full sort, top-k, softmax, top-p prefix, softmax
    /// again, min-p against the new maximum. Returns the surviving ids in order.
    fn oracle_set(logits: &[f32], top_k: usize, top_p: f32, min_p: f32) -> Vec<u32> {
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        ids.sort_by(|&a, &b| {
            logits[b as usize]
                .partial_cmp(&logits[a as usize])
                .unwrap()
                .then(a.cmp(&b))
        });
        if top_k > 0 {
            ids.truncate(top_k);
        }
        let sub: Vec<f32> = ids.iter().map(|&i| logits[i as usize]).collect();
        let probs = softmax(&sub);
        if top_p < 1.0 {
            let mut cum = 0.0;
            let mut keep = ids.len();
            for (i, p) in probs.iter().enumerate() {
                cum += p;
                if cum >= top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            ids.truncate(keep);
        }
        if min_p > 0.0 {
            let sub: Vec<f32> = ids.iter().map(|&i| logits[i as usize]).collect();
            let probs = softmax(&sub);
            let pmax = probs[0];
            ids = ids
                .iter()
                .zip(&probs)
                .filter(|&(_, &p)| p >= min_p as f64 * pmax)
                .map(|(&i, _)| i)
                .collect();
        }
        ids
    }

    #[test]
    fn defaults_validate_and_bad_values_are_named() {
        assert!(SamplerParams::default().validate().is_ok());
        let bad = [
            SamplerParams {
                temperature: -0.1,
                ..Default::default()
            },
            SamplerParams {
                temperature: f32::NAN,
                ..Default::default()
            },
            SamplerParams {
                top_p: 0.0,
                ..Default::default()
            },
            SamplerParams {
                top_p: 1.5,
                ..Default::default()
            },
            SamplerParams {
                min_p: -0.1,
                ..Default::default()
            },
            SamplerParams {
                repeat_penalty: 0.0,
                ..Default::default()
            },
            SamplerParams {
                frequency_penalty: f32::INFINITY,
                ..Default::default()
            },
        ];
        let fields = [
            "temperature",
            "temperature",
            "top_p",
            "top_p",
            "min_p",
            "repeat_penalty",
            "frequency_penalty",
        ];
        for (p, field) in bad.iter().zip(fields) {
            let err = p.validate().expect_err(field);
            assert!(err.contains(field), "{err}");
        }
    }

    #[test]
    fn greedy_is_argmax_with_lowest_id_on_ties() {
        let mut rng = StdRng::seed_from_u64(7);
        let mut s = Sampler::new(SamplerParams::greedy());
        for n in [1, 2, 3, 17, 1000] {
            let mut logits = random_logits(&mut rng, n);
            // Duplicate the maximum at a later index: the earlier one must win.
            let (imax, &vmax) = logits
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.partial_cmp(b.1).unwrap().then(b.0.cmp(&a.0)))
                .unwrap();
            if imax + 1 < n {
                logits[n - 1] = vmax;
            }
            assert_eq!(s.sample(&logits, &[]), imax as u32);
            assert_eq!(argmax(&logits), imax as u32);
        }
    }

    #[test]
    fn argmax_matches_a_plain_scan_with_nan_infinities_and_ties() {
        // The first index of the largest non-NaN value; 0 when every value is NaN.
        fn plain(v: &[f32]) -> u32 {
            let mut best: Option<usize> = None;
            for (i, &x) in v.iter().enumerate() {
                if !x.is_nan() && best.is_none_or(|b| x > v[b]) {
                    best = Some(i);
                }
            }
            best.unwrap_or(0) as u32
        }
        let mut rng = StdRng::seed_from_u64(rand::random());
        for n in [1usize, 5, 15, 16, 17, 31, 33, 100, 1027] {
            for _ in 0..50 {
                let mut v: Vec<f32> = (0..n)
                    .map(|_| match rng.random_range(0..10) {
                        0 => f32::NAN,
                        1 => f32::NEG_INFINITY,
                        2 => 3.0, // ties
                        _ => rng.random_range(-5.0..3.0),
                    })
                    .collect();
                assert_eq!(argmax(&v), plain(&v), "{v:?}");
                v.iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
                assert_eq!(argmax(&v), 0);
                v.iter_mut().for_each(|x| *x = f32::NAN);
                assert_eq!(argmax(&v), 0);
            }
        }
    }

    #[test]
    fn top_k_one_equals_greedy() {
        let mut rng = StdRng::seed_from_u64(8);
        for seed in 0..20 {
            let mut s = Sampler::new(SamplerParams {
                seed: Some(seed),
                ..params(1.5, 1, 1.0, 0.0)
            });
            let logits = random_logits(&mut rng, 300);
            assert_eq!(s.sample(&logits, &[]), argmax(&logits));
        }
    }

    #[test]
    fn same_seed_same_sequence_different_seed_differs() {
        let mut rng = StdRng::seed_from_u64(9);
        let rows: Vec<Vec<f32>> = (0..64).map(|_| random_logits(&mut rng, 50)).collect();
        let run = |seed| {
            let mut s = Sampler::new(params(1.0, 0, 1.0, 0.0).clone_with_seed(seed));
            rows.iter().map(|r| s.sample(r, &[])).collect::<Vec<u32>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
    }

    impl SamplerParams {
        fn clone_with_seed(&self, seed: u64) -> Self {
            SamplerParams {
                seed: Some(seed),
                ..self.clone()
            }
        }
    }

    #[test]
    fn frequencies_match_softmax() {
        let logits = [1.0f32, 0.5, -0.3, 2.0, 0.0, -1.5];
        let expected = softmax(&logits);
        let mut s = Sampler::new(params(1.0, 0, 1.0, 0.0));
        let draws = 200_000;
        let mut counts = [0usize; 6];
        for _ in 0..draws {
            counts[s.sample(&logits, &[]) as usize] += 1;
        }
        for (i, (&c, &p)) in counts.iter().zip(&expected).enumerate() {
            let freq = c as f64 / draws as f64;
            let sigma = (p * (1.0 - p) / draws as f64).sqrt();
            assert!(
                (freq - p).abs() < 5.0 * sigma,
                "token {i}: frequency {freq}, softmax {p}"
            );
        }
    }

    #[test]
    fn temperature_scales_distribution() {
        let logits = [1.0f32, 0.5, -0.3, 2.0];
        let t = 0.5;
        let scaled: Vec<f32> = logits.iter().map(|l| l / t).collect();
        let expected = softmax(&scaled);
        let mut s = Sampler::new(params(t, 0, 1.0, 0.0));
        let cands = s.candidates(&logits, &[]).to_vec();
        assert_eq!(cands.len(), 4);
        for c in cands {
            assert!((c.prob as f64 - expected[c.id as usize]).abs() < 1e-6);
        }
    }

    #[test]
    fn filters_match_naive_oracle() {
        let mut rng = StdRng::seed_from_u64(10);
        for case in 0..400 {
            // Some long rows: top-p sorts a growing prefix (64, 256, 1024, ...) of them.
            let n = if case % 5 == 0 {
                rng.random_range(300..5000)
            } else {
                rng.random_range(1..300)
            };
            let mut logits = random_logits(&mut rng, n);
            if case % 4 == 0 {
                // Quantise to create ties.
                for l in logits.iter_mut() {
                    *l = (*l * 2.0).round() / 2.0;
                }
            }
            let top_k = [0, 1, 5, 40, 1000][rng.random_range(0..5)];
            let top_p = [1.0, 0.95, 0.5, 0.1, 0.999][rng.random_range(0..5)];
            let min_p = [0.0, 0.05, 0.2, 0.9][rng.random_range(0..4)];
            let mut s = Sampler::new(params(0.7, top_k, top_p, min_p));
            let got: Vec<u32> = s.candidates(&logits, &[]).iter().map(|c| c.id).collect();
            let want = oracle_set(&logits, top_k, top_p, min_p);
            assert_eq!(
                got, want,
                "case {case}: n {n} k {top_k} p {top_p} min_p {min_p}"
            );
            let total: f32 = s.candidates(&logits, &[]).iter().map(|c| c.prob).sum();
            assert!((total - 1.0).abs() < 1e-4);
            // Every draw comes from the surviving set.
            for _ in 0..20 {
                let id = s.sample(&logits, &[]);
                assert!(want.contains(&id));
            }
        }
    }

    #[test]
    fn top_p_keeps_smallest_set_reaching_p() {
        // probs ~ 0.64, 0.24, 0.09, 0.03 for logits 3,2,1,0 (descending).
        let logits = [0.0f32, 2.0, 3.0, 1.0];
        let probs = softmax(&logits);
        let mut s = Sampler::new(params(1.0, 0, 0.8, 0.0));
        let got: Vec<u32> = s.candidates(&logits, &[]).iter().map(|c| c.id).collect();
        // Smallest set with cumulative >= 0.8: {2, 1} since p2 < 0.8 <= p2 + p1.
        assert!(probs[2] < 0.8 && probs[2] + probs[1] >= 0.8);
        assert_eq!(got, vec![2, 1]);
    }

    #[test]
    fn min_p_drops_tokens_below_fraction_of_max() {
        let mut rng = StdRng::seed_from_u64(11);
        let logits = random_logits(&mut rng, 200);
        let probs = softmax(&logits);
        let pmax = probs.iter().copied().fold(0.0, f64::max);
        let min_p = 0.1;
        let mut s = Sampler::new(params(1.0, 0, 1.0, min_p));
        let mut got: Vec<u32> = s.candidates(&logits, &[]).iter().map(|c| c.id).collect();
        got.sort();
        let want: Vec<u32> = (0..200u32)
            .filter(|&i| probs[i as usize] >= min_p as f64 * pmax)
            .collect();
        assert_eq!(got, want);
        assert!(want.len() < 200);
    }

    #[test]
    fn penalties_change_exactly_the_tokens_in_the_window() {
        let mut rng = StdRng::seed_from_u64(12);
        for _ in 0..50 {
            let vocab = 64;
            let logits = random_logits(&mut rng, vocab);
            let history: Vec<u32> = (0..rng.random_range(0..100))
                .map(|_| rng.random_range(0..vocab as u32 + 4)) // some ids beyond the vocab
                .collect();
            let last_n = [usize::MAX, 0, 1, 16, 64][rng.random_range(0..5)];
            let p = SamplerParams {
                repeat_penalty: 1.3,
                repeat_last_n: last_n,
                presence_penalty: 0.4,
                frequency_penalty: 0.25,
                ..params(1.0, 0, 1.0, 0.0)
            };
            let mut s = Sampler::new(p.clone());
            let mut got = vec![f32::NAN; vocab];
            for c in s.candidates(&logits, &history) {
                got[c.id as usize] = c.logit;
            }
            let n = last_n.min(history.len());
            let window = &history[history.len() - n..];
            for (id, (&g, &l)) in got.iter().zip(&logits).enumerate() {
                let count = window.iter().filter(|&&t| t as usize == id).count();
                if count == 0 {
                    assert_eq!(g.to_bits(), l.to_bits(), "token {id} not in window changed");
                } else {
                    let r = if l <= 0.0 {
                        l * p.repeat_penalty
                    } else {
                        l / p.repeat_penalty
                    };
                    let want = r - (count as f32 * p.frequency_penalty + p.presence_penalty);
                    assert!((g - want).abs() < 1e-5, "token {id}: {g} vs {want}");
                    assert_ne!(g, l);
                }
            }
        }
    }

    #[test]
    fn greedy_applies_penalties() {
        let logits = [1.0f32, 3.0, 2.0];
        let mut s = Sampler::new(SamplerParams {
            repeat_penalty: 2.0,
            ..SamplerParams::greedy()
        });
        assert_eq!(s.sample(&logits, &[]), 1);
        // 3.0 / 2 = 1.5 < 2.0: token 2 wins once token 1 was seen.
        assert_eq!(s.sample(&logits, &[1]), 2);
    }

    #[test]
    fn degenerate_inputs_do_not_panic() {
        let mut s = Sampler::new(params(1.0, 10, 0.9, 0.1));
        assert_eq!(s.sample(&[], &[]), 0);
        let all_neg_inf = [f32::NEG_INFINITY; 5];
        assert!(s.sample(&all_neg_inf, &[]) < 5);
        let with_nan = [f32::NAN, 0.0, f32::NAN];
        for _ in 0..10 {
            assert_eq!(s.sample(&with_nan, &[]), 1);
        }
        // The same on the plain temperature path (no filters).
        let mut s = Sampler::new(params(1.0, 0, 1.0, 0.0));
        assert_eq!(s.sample(&[], &[]), 0);
        assert!(s.sample(&all_neg_inf, &[]) < 5);
        for _ in 0..10 {
            assert_eq!(s.sample(&with_nan, &[]), 1);
        }
        let with_inf = [0.0, f32::INFINITY, 1.0, f32::INFINITY];
        assert_eq!(s.sample(&with_inf, &[]), 1);
    }

    #[test]
    fn log_softmax_matches_f64_oracle() {
        let mut rng = StdRng::seed_from_u64(13);
        for n in [1usize, 2, 7, 300, 5000] {
            let mut logits = random_logits(&mut rng, n);
            // Large offsets would overflow a naive exp.
            for l in logits.iter_mut() {
                *l += 500.0;
            }
            let got = log_softmax(&logits);
            let want: Vec<f64> = softmax(&logits).iter().map(|p| p.ln()).collect();
            for (g, w) in got.iter().zip(&want) {
                assert!((*g as f64 - w).abs() < 1e-4, "{g} vs {w}");
            }
            let mass: f64 = got.iter().map(|&g| (g as f64).exp()).sum();
            assert!((mass - 1.0).abs() < 1e-4);
        }
    }

    #[test]
    fn top_n_matches_full_sort() {
        let mut rng = StdRng::seed_from_u64(14);
        for _ in 0..100 {
            let len = rng.random_range(0..200);
            let logits: Vec<f32> = (0..len)
                .map(|_| rng.random_range(-4i32..4) as f32 * 0.5)
                .collect();
            let n = rng.random_range(0..250);
            let mut want: Vec<(u32, f32)> = logits
                .iter()
                .enumerate()
                .map(|(i, &v)| (i as u32, v))
                .collect();
            want.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then(a.0.cmp(&b.0)));
            want.truncate(n);
            assert_eq!(top_n(&logits, n), want);
        }
    }
}
