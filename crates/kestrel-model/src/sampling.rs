//! How a logit row becomes a token once the random draw is made: penalties, top-k, min-p,
//! top-p and temperature in llama.cpp's order, then the draw. This is the one definition
//! every backend follows — [`RowSampler`] on the host (the CPU backend, and any row a
//! backend hands back), CUDA's `sample_rows` kernel on the device — so a sequence's seed
//! gives the same tokens on either, up to rounding at the edge of a token's interval.
//!
//! The definition, for logits `l` (NaN is an impossible token):
//! 0. a row's token mask, when it has one (a grammar's allowed tokens: bit `t % 32` of word
//!    `t / 32` set, words past the mask's end banning), sets every banned token's logit to
//!    `-inf` ([`apply_mask`]);
//! 1. penalties change the logits of the tokens in the window (llama.cpp's repetition,
//!    presence and frequency penalties);
//! 2. greedy (temperature `<= 0`): [`argmax`]. So are rows whose largest logit is `±inf`;
//! 3. `m` = the largest logit; top-k keeps the `k` best (higher logit, then lower id);
//! 4. min-p keeps `l >= m + ln(min_p)`;
//! 5. top-p keeps the shortest prefix, in best-first order, of what survived whose mass
//!    `Σ exp(l - m)` reaches `top_p` times the mass of the top-k set (llama.cpp applies
//!    top-p before min-p; both keep a prefix of one order, and min-p depends only on
//!    probability ratios, so the set is the same);
//! 6. the draw: weights `w = exp((l - m) / T)` (f32, summed in f64) over the survivors;
//!    the token is the first, **in id order**, whose cumulative weight exceeds `u · Σ w`.
//!
//! Drawing in id order (not best-first) lets a GPU draw with one ordered scan of the row
//! instead of a sort.

use std::cmp::Ordering;

use rayon::prelude::*;

/// One row's settings and its uniform draw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowSampling {
    /// `<= 0` (or NaN): greedy (see [`RowSampling::is_greedy`]).
    pub temperature: f32,
    /// Keep the `top_k` best tokens; 0 (or at least the vocabulary) keeps all.
    pub top_k: u32,
    /// `>= 1` disables top-p.
    pub top_p: f32,
    /// `<= 0` disables min-p.
    pub min_p: f32,
    pub repeat_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// The uniform draw, in `[0, 1)`.
    pub u: f64,
    /// This row's penalised tokens: `penalties[penalty_start..][..penalty_len]` of its batch.
    pub penalty_start: u32,
    pub penalty_len: u32,
}

impl RowSampling {
    /// Plain argmax of the row: greedy and nothing penalised.
    pub fn is_argmax(&self) -> bool {
        self.is_greedy() && self.penalty_len == 0
    }

    /// Temperature `<= 0` (or NaN, or so small that its inverse overflows).
    pub fn is_greedy(&self) -> bool {
        !(self.temperature > 0.0 && (1.0 / self.temperature).is_finite())
    }

    /// Whether top-p filters (`top_p < 1`; NaN does not).
    pub fn top_p_active(&self) -> bool {
        self.top_p < 1.0
    }

    /// `ln(min_p)`, the min-p threshold's offset from the largest logit (`-inf`: none).
    pub fn min_p_log(&self) -> f32 {
        if self.min_p > 0.0 {
            self.min_p.ln()
        } else {
            f32::NEG_INFINITY
        }
    }
}

/// The sampling of every logit row of a step, in row order.
#[derive(Debug, Clone, Default)]
pub struct SamplingBatch {
    pub rows: Vec<RowSampling>,
    /// (token id, occurrences in the penalty window), each id once per row.
    pub penalties: Vec<(u32, u32)>,
    window: Vec<u32>,
    /// Token masks (step 0 of the definition), `mask_words` words each, one after another.
    pub masks: Vec<u32>,
    /// Words of each mask: the vocabulary's `div_ceil(32)`.
    pub mask_words: usize,
    /// Row `i`'s mask: its index in `masks`, or [`NO_MASK`]. Empty when no row has one.
    pub mask_of: Vec<u32>,
}

/// A row without a token mask (`SamplingBatch::mask_of`).
pub const NO_MASK: u32 = u32::MAX;

impl SamplingBatch {
    pub fn clear(&mut self) {
        self.rows.clear();
        self.penalties.clear();
        self.masks.clear();
        self.mask_of.clear();
    }

    /// Whether some row has a token mask.
    pub fn has_masks(&self) -> bool {
        self.mask_of.iter().any(|&m| m != NO_MASK)
    }

    /// Row `i`'s token mask, if it has one.
    pub fn mask(&self, i: usize) -> Option<&[u32]> {
        let m = *self.mask_of.get(i)?;
        if m == NO_MASK {
            return None;
        }
        let start = (m as usize).checked_mul(self.mask_words)?;
        self.masks.get(start..start.checked_add(self.mask_words)?)
    }

    /// An error unless the masks fit rows of `cols` logits: `mask_of` empty or one entry a
    /// row, `mask_words` covering `cols`, every index naming a mask of `masks`.
    pub fn check_masks(&self, cols: usize) -> anyhow::Result<()> {
        if self.mask_of.is_empty() {
            return Ok(());
        }
        if self.mask_of.len() != self.rows.len() {
            anyhow::bail!(
                "{} token masks given for {} sampling rows",
                self.mask_of.len(),
                self.rows.len()
            );
        }
        if self.mask_words != cols.div_ceil(32) {
            anyhow::bail!(
                "token masks of {} words for rows of {cols} logits",
                self.mask_words
            );
        }
        let count = self.masks.len().checked_div(self.mask_words).unwrap_or(0);
        if self.masks.len() != count * self.mask_words
            || self
                .mask_of
                .iter()
                .any(|&m| m != NO_MASK && m as usize >= count)
        {
            anyhow::bail!("a token mask index lies outside the batch's masks");
        }
        Ok(())
    }

    /// Adds a row penalising the tokens of `window` (repeats counted; empty: none). The
    /// row's `penalty_start` / `penalty_len` are filled in here.
    pub fn push(&mut self, mut row: RowSampling, window: &[u32]) {
        self.window.clear();
        self.window.extend_from_slice(window);
        self.window.sort_unstable();
        row.penalty_start = self.penalties.len() as u32;
        for run in self.window.chunk_by(|a, b| a == b) {
            self.penalties.push((run[0], run.len() as u32));
        }
        row.penalty_len = self.penalties.len() as u32 - row.penalty_start;
        self.rows.push(row);
    }

    /// An error unless the batch has a row for each of `n` logit rows.
    pub fn check_rows(&self, n: usize) -> anyhow::Result<()> {
        if self.rows.len() != n {
            anyhow::bail!("{n} rows to sample, {} samplings", self.rows.len());
        }
        Ok(())
    }

    /// Row `i`'s settings and penalised tokens.
    pub fn row(&self, i: usize) -> Option<(&RowSampling, &[(u32, u32)])> {
        let row = self.rows.get(i)?;
        let start = row.penalty_start as usize;
        let pens = self
            .penalties
            .get(start..start + row.penalty_len as usize)
            .unwrap_or(&[]);
        Some((row, pens))
    }

    /// Samples `n` rows of `logits` (`n` rows of equal length) on all cores into `out`.
    pub fn sample_host(&self, logits: &[f32], n: usize, out: &mut Vec<u32>) {
        out.clear();
        let Some(cols) = logits.len().checked_div(n).filter(|&c| c > 0) else {
            out.resize(n, 0);
            return;
        };
        logits
            .par_chunks_exact(cols)
            .take(n)
            .enumerate()
            .map_init(RowSampler::default, |sampler, (i, row)| match self.row(i) {
                Some((spec, pens)) => sampler.sample_masked(row, spec, pens, self.mask(i)),
                None => argmax(row),
            })
            .collect_into_vec(out);
    }
}

/// One token that survived the filters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub id: u32,
    /// Logit after penalties (before temperature).
    pub logit: f32,
    /// Probability within the surviving set after temperature (sums to 1 over it).
    pub prob: f32,
}

/// Ordering that puts the better candidate first: higher logit, then lower id. Logits are
/// never NaN here (replaced by -inf), and -0.0 ties with 0.0.
pub fn better(a: &Candidate, b: &Candidate) -> Ordering {
    b.logit
        .partial_cmp(&a.logit)
        .unwrap_or(Ordering::Equal)
        .then(a.id.cmp(&b.id))
}

/// The host's sampler of one row at a time, with reusable scratch (no allocation per row
/// once grown).
#[derive(Debug, Default)]
pub struct RowSampler {
    /// The row after penalties (only rows with penalised tokens are copied).
    penalised: Vec<f32>,
    candidates: Vec<Candidate>,
    /// The row after its token mask (masked rows that are not a plain argmax).
    masked: Vec<f32>,
}

impl RowSampler {
    /// [`Self::sample`] of the row after `mask` ([`apply_mask`]), when it has one. A plain
    /// argmax row walks the mask's allowed tokens ([`masked_argmax`]) without a copy.
    pub fn sample_masked(
        &mut self,
        row: &[f32],
        spec: &RowSampling,
        penalties: &[(u32, u32)],
        mask: Option<&[u32]>,
    ) -> u32 {
        let Some(mask) = mask else {
            return self.sample(row, spec, penalties);
        };
        if row.is_empty() {
            return 0;
        }
        if spec.is_argmax() {
            return masked_argmax(row, mask);
        }
        let mut masked = std::mem::take(&mut self.masked);
        masked.clear();
        masked.extend_from_slice(row);
        apply_mask(&mut masked, mask);
        let id = self.sample(&masked, spec, penalties);
        self.masked = masked;
        id
    }

    /// The token `spec` draws from `row` (0 for an empty row).
    pub fn sample(&mut self, row: &[f32], spec: &RowSampling, penalties: &[(u32, u32)]) -> u32 {
        if row.is_empty() {
            return 0;
        }
        let logits = penalise(row, spec, penalties, &mut self.penalised);
        if spec.is_greedy() {
            return argmax(logits);
        }
        let Some(max) = finite_max(logits) else {
            return argmax(logits);
        };
        let inv_t = 1.0 / spec.temperature;
        let floor = max + spec.min_p_log();
        let top_k = spec.top_k as usize;
        if (top_k == 0 || top_k >= logits.len()) && !spec.top_p_active() {
            // Only min-p (or nothing) filters: draw straight from the row.
            let weight = |l: f32| {
                if l >= floor {
                    draw_weight(l, max, inv_t)
                } else {
                    0.0
                }
            };
            let total: f64 = logits.iter().map(|&l| weight(l)).sum();
            let target = spec.u * total;
            let mut cumulative = 0.0f64;
            for (i, &l) in logits.iter().enumerate() {
                cumulative += weight(l);
                if target < cumulative {
                    return i as u32;
                }
            }
            // Rounding left the sum just under the target: the last possible token.
            return logits.iter().rposition(|&l| weight(l) > 0.0).unwrap_or(0) as u32;
        }
        let cands = &mut self.candidates;
        survivors(logits, spec, max, cands);
        cands.sort_unstable_by_key(|c| c.id);
        let total: f64 = cands.iter().map(|c| draw_weight(c.logit, max, inv_t)).sum();
        let target = spec.u * total;
        let mut cumulative = 0.0f64;
        for c in cands.iter() {
            cumulative += draw_weight(c.logit, max, inv_t);
            if target < cumulative {
                return c.id;
            }
        }
        cands
            .iter()
            .rev()
            .find(|c| draw_weight(c.logit, max, inv_t) > 0.0)
            .map_or(0, |c| c.id)
    }

    /// The tokens `spec` may draw from `row`, best first, with their probabilities after
    /// temperature. Greedy settings (and rows whose largest logit is infinite) leave one.
    pub fn candidates(
        &mut self,
        row: &[f32],
        spec: &RowSampling,
        penalties: &[(u32, u32)],
    ) -> &[Candidate] {
        self.candidates.clear();
        if row.is_empty() {
            return &self.candidates;
        }
        let logits = penalise(row, spec, penalties, &mut self.penalised);
        let max = finite_max(logits);
        let (Some(max), false) = (max, spec.is_greedy()) else {
            let id = argmax(logits);
            let logit = logits[id as usize];
            self.candidates.push(Candidate {
                id,
                logit: if logit.is_nan() {
                    f32::NEG_INFINITY
                } else {
                    logit
                },
                prob: 1.0,
            });
            return &self.candidates;
        };
        let cands = &mut self.candidates;
        survivors(logits, spec, max, cands);
        cands.sort_unstable_by(better);
        let inv_t = 1.0 / spec.temperature;
        let total: f64 = cands.iter().map(|c| draw_weight(c.logit, max, inv_t)).sum();
        for c in cands.iter_mut() {
            c.prob = (draw_weight(c.logit, max, inv_t) / total) as f32;
        }
        cands
    }
}

/// `row` with the penalties applied (a copy in `scratch` when there are any).
fn penalise<'a>(
    row: &'a [f32],
    spec: &RowSampling,
    penalties: &[(u32, u32)],
    scratch: &'a mut Vec<f32>,
) -> &'a [f32] {
    if penalties.is_empty() {
        return row;
    }
    scratch.clear();
    scratch.extend_from_slice(row);
    for &(id, count) in penalties {
        // Ids beyond the vocabulary have no logit to penalise.
        if let Some(l) = scratch.get_mut(id as usize) {
            *l = penalised_logit(*l, count, spec);
        }
    }
    scratch
}

/// llama.cpp's repetition penalty (divides positive logits, multiplies negative ones), then
/// the frequency penalty per occurrence and the presence penalty once.
pub fn penalised_logit(l: f32, count: u32, spec: &RowSampling) -> f32 {
    let l = if l <= 0.0 {
        l * spec.repeat_penalty
    } else {
        l / spec.repeat_penalty
    };
    l - (count as f32 * spec.frequency_penalty + spec.presence_penalty)
}

/// The largest logit when it is finite (NaN ignored); None for ±inf or no number at all.
fn finite_max(logits: &[f32]) -> Option<f32> {
    let max = logits
        .iter()
        .copied()
        .filter(|l| !l.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    max.is_finite().then_some(max)
}

/// A survivor's weight in the draw: `exp((l - max) / T)`, in f32 as the GPU computes it.
fn draw_weight(l: f32, max: f32, inv_t: f32) -> f64 {
    ((l - max) * inv_t).exp() as f64
}

/// A token's mass for top-p: its probability at temperature 1, unnormalised.
fn top_p_mass(l: f32, max: f32) -> f64 {
    (l - max).exp() as f64
}

/// Fills `cands` with the tokens surviving top-k, min-p and top-p, in no particular order.
/// `max` is the largest (finite) logit.
fn survivors(logits: &[f32], spec: &RowSampling, max: f32, cands: &mut Vec<Candidate>) {
    cands.clear();
    // NaN logits are impossible tokens.
    let candidate = |(i, &l): (usize, &f32)| Candidate {
        id: i as u32,
        logit: if l.is_nan() { f32::NEG_INFINITY } else { l },
        prob: 0.0,
    };
    let k = spec.top_k as usize;
    if k > 0 && k < logits.len() {
        // top-k while reading the row: a candidate enters only if it beats the k-th best
        // kept so far; at 2k kept, the best k stay. No list of the whole vocabulary.
        let mut kth: Option<Candidate> = None;
        for c in logits.iter().enumerate().map(candidate) {
            if kth.is_some_and(|t| better(&c, &t) != Ordering::Less) {
                continue;
            }
            cands.push(c);
            if cands.len() == 2 * k {
                cands.select_nth_unstable_by(k - 1, better);
                cands.truncate(k);
                kth = Some(cands[k - 1]);
            }
        }
        if cands.len() > k {
            cands.select_nth_unstable_by(k - 1, better);
            cands.truncate(k);
        }
    } else {
        cands.extend(logits.iter().enumerate().map(candidate));
    }
    // The mass of the top-k set, against which top-p is measured.
    let total: f64 = if spec.top_p_active() {
        cands.iter().map(|c| top_p_mass(c.logit, max)).sum()
    } else {
        0.0
    };
    let floor = max + spec.min_p_log();
    if floor > f32::NEG_INFINITY {
        cands.retain(|c| c.logit >= floor);
    }
    if !spec.top_p_active() {
        return;
    }
    // top-p: the shortest best-first prefix reaching top_p of the mass. Only that prefix
    // needs sorting: the best `m` are selected and sorted, `m` growing until they hold it.
    let target = spec.top_p as f64 * total;
    let mut m = 64.min(cands.len());
    loop {
        if m < cands.len() {
            cands.select_nth_unstable_by(m - 1, better);
        }
        cands[..m].sort_unstable_by(better);
        let mut cumulative = 0.0f64;
        let reached = cands[..m].iter().position(|c| {
            cumulative += top_p_mass(c.logit, max);
            cumulative >= target
        });
        if let Some(i) = reached {
            cands.truncate(i + 1);
            return;
        }
        if m == cands.len() {
            return; // the mass stays under top_p (min-p removed it, or rounding): keep all
        }
        m = (m * 4).min(cands.len());
    }
}

/// Whether token `t` is allowed by `mask` (bit `t % 32` of word `t / 32`; past the end: no).
pub fn mask_allows(mask: &[u32], t: usize) -> bool {
    mask.get(t / 32).is_some_and(|w| (w >> (t % 32)) & 1 == 1)
}

/// Step 0 of the definition: every token of `row` that `mask` does not allow gets `-inf`.
pub fn apply_mask(row: &mut [f32], mask: &[u32]) {
    for (chunk, w) in row.chunks_mut(32).enumerate() {
        let bits = mask.get(chunk).copied().unwrap_or(0);
        if bits == u32::MAX {
            continue;
        }
        for (b, l) in w.iter_mut().enumerate() {
            if (bits >> b) & 1 == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

/// [`argmax`] of `row` after [`apply_mask`], without writing it: the allowed tokens are
/// walked in id order (a grammar allows few tokens of a large vocabulary).
pub fn masked_argmax(row: &[f32], mask: &[u32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    'words: for (w, &bits) in mask.iter().enumerate() {
        let mut bits = bits;
        while bits != 0 {
            let t = w * 32 + bits.trailing_zeros() as usize;
            bits &= bits - 1;
            let Some(&v) = row.get(t) else {
                break 'words;
            };
            // NaN never wins; ties keep the lower id (walked first).
            if !v.is_nan() && best.is_none_or(|(_, m)| v > m) {
                best = Some((t, v));
            }
        }
    }
    match best {
        Some((t, v)) if v > f32::NEG_INFINITY => t as u32,
        // Every allowed value is -inf or NaN: the masked row's largest value is -inf when
        // a token is banned or -inf, its first index wins; all NaN gives 0, as `argmax`.
        _ => (0..row.len())
            .find(|&t| !mask_allows(mask, t) || row[t] == f32::NEG_INFINITY)
            .unwrap_or(0) as u32,
    }
}

/// Index of the largest logit, the lowest index among ties; NaN never wins unless every value
/// is NaN (then 0).
pub fn argmax(logits: &[f32]) -> u32 {
    // Two passes the compiler vectorizes (a 128K vocabulary per row, dozens of rows per
    // server step): the largest non-NaN value (`v > m` is false for NaN), then its first
    // index. All NaN: no index matches, 0.
    const LANES: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (m, &v) in lanes.iter_mut().zip(chunk) {
            *m = if v > *m { v } else { *m };
        }
    }
    let mut max = lanes
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, |m, v| if v > m { v } else { m });
    for &v in rest {
        max = if v > max { v } else { max };
    }
    logits.iter().position(|&v| v == max).unwrap_or(0) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(temperature: f32, top_k: u32, top_p: f32, min_p: f32, u: f64) -> RowSampling {
        RowSampling {
            temperature,
            top_k,
            top_p,
            min_p,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            u,
            penalty_start: 0,
            penalty_len: 0,
        }
    }

    /// The definition followed literally: full sort, filters, then the id-ordered draw.
    fn oracle(row: &[f32], s: &RowSampling) -> u32 {
        if s.is_greedy() {
            return argmax(row);
        }
        let key = |l: f32| if l.is_nan() { f32::NEG_INFINITY } else { l };
        let max = row
            .iter()
            .map(|&l| key(l))
            .fold(f32::NEG_INFINITY, f32::max);
        if !max.is_finite() {
            return argmax(row);
        }
        let mut order: Vec<u32> = (0..row.len() as u32).collect();
        order.sort_by(|&a, &b| {
            key(row[b as usize])
                .partial_cmp(&key(row[a as usize]))
                .unwrap()
                .then(a.cmp(&b))
        });
        if s.top_k > 0 {
            order.truncate(s.top_k as usize);
        }
        let total: f64 = order
            .iter()
            .map(|&i| top_p_mass(key(row[i as usize]), max))
            .sum();
        let floor = max + s.min_p_log();
        order.retain(|&i| key(row[i as usize]) >= floor);
        if s.top_p < 1.0 {
            let mut cumulative = 0.0;
            if let Some(cut) = order.iter().position(|&i| {
                cumulative += top_p_mass(key(row[i as usize]), max);
                cumulative >= s.top_p as f64 * total
            }) {
                order.truncate(cut + 1);
            }
        }
        order.sort_unstable();
        let inv_t = 1.0 / s.temperature;
        let w = |i: u32| draw_weight(key(row[i as usize]), max, inv_t);
        let total: f64 = order.iter().map(|&i| w(i)).sum();
        let mut cumulative = 0.0;
        for &i in &order {
            cumulative += w(i);
            if s.u * total < cumulative {
                return i;
            }
        }
        *order.iter().rev().find(|&&i| w(i) > 0.0).unwrap()
    }

    #[test]
    fn the_row_sampler_follows_the_definition() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
        let mut sampler = RowSampler::default();
        for case in 0..3000 {
            let n = if case % 7 == 0 {
                rng.random_range(300..3000)
            } else {
                rng.random_range(1..200)
            };
            let mut row: Vec<f32> = (0..n).map(|_| rng.random_range(-6.0f32..6.0)).collect();
            if case % 3 == 0 {
                row.iter_mut().for_each(|l| *l = (*l * 2.0).round() / 2.0); // ties
            }
            if case % 11 == 0 {
                row[rng.random_range(0..n)] = f32::NAN;
                row[rng.random_range(0..n)] = f32::NEG_INFINITY;
            }
            let s = spec(
                [0.0, 0.3, 1.0, 1.7][rng.random_range(0..4)],
                [0, 1, 5, 40, 1000][rng.random_range(0..5)],
                [1.0, 0.95, 0.5, 0.1][rng.random_range(0..4)],
                [0.0, 0.05, 0.3][rng.random_range(0..3)],
                rng.random(),
            );
            assert_eq!(
                sampler.sample(&row, &s, &[]),
                oracle(&row, &s),
                "case {case}: n {n} {s:?}"
            );
        }
    }

    /// A random mask of `words` words over `cols` tokens: empty, sparse, dense, full, or
    /// all but one token banned.
    fn random_mask(rng: &mut impl rand::Rng, cols: usize, words: usize, kind: usize) -> Vec<u32> {
        let mut m = vec![0u32; words];
        let density = [0.0, 0.002, 0.05, 0.5, 1.0, -1.0][kind % 6];
        if density < 0.0 {
            let t = rng.random_range(0..cols.max(1));
            if t / 32 < words {
                m[t / 32] |= 1 << (t % 32);
            }
            return m;
        }
        for t in 0..(words * 32) {
            if rng.random_bool(density) {
                m[t / 32] |= 1 << (t % 32);
            }
        }
        m
    }

    /// The mask walk picks what masking the row and taking `argmax` picks, on random rows
    /// (ties, NaN, ±inf) and masks (empty, sparse, dense, all but one banned, shorter or
    /// longer than the row).
    #[test]
    fn masked_argmax_equals_masking_then_argmax() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for case in 0..4000 {
            let cols: usize = rng.random_range(1..300);
            let words = match case % 4 {
                0 => rng.random_range(0..=cols.div_ceil(32) + 1),
                _ => cols.div_ceil(32),
            };
            let mask = random_mask(&mut rng, cols, words, case);
            let row: Vec<f32> = (0..cols)
                .map(|_| match rng.random_range(0..20) {
                    0 => f32::NAN,
                    1 => f32::NEG_INFINITY,
                    2 => f32::INFINITY,
                    3 => 1.0,
                    _ => rng.random_range(-8..8) as f32 * 0.5,
                })
                .collect();
            let mut applied = row.clone();
            apply_mask(&mut applied, &mask);
            assert_eq!(
                masked_argmax(&row, &mask),
                argmax(&applied),
                "case {case}, seed {seed}: {row:?} {mask:?}"
            );
            for (t, &l) in applied.iter().enumerate() {
                if !mask_allows(&mask, t) {
                    assert_eq!(l, f32::NEG_INFINITY);
                } else {
                    assert!(l.to_bits() == row[t].to_bits());
                }
            }
        }
    }

    /// Masked rows sampled in a batch (greedy, penalised, top-k/top-p; rows without masks
    /// between them) draw what the unmasked sampler draws from the masked row.
    #[test]
    fn masked_batches_sample_the_masked_rows() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (rows, cols) = (12, 1001usize);
        let words = cols.div_ceil(32);
        let logits: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-4.0f32..4.0))
            .collect();
        let mut batch = SamplingBatch {
            mask_words: words,
            ..SamplingBatch::default()
        };
        for r in 0..rows {
            let t = [0.0, 0.7, 1.0][r % 3];
            let mut s = spec(t, [0, 5, 50][r % 3] as u32, 0.9, 0.02, rng.random());
            let window: &[u32] = if r % 4 == 1 {
                s.repeat_penalty = 1.3;
                s.presence_penalty = 0.5;
                &[1, 2, 2, 7, 1000]
            } else {
                &[]
            };
            batch.push(s, window);
            if r % 5 == 4 {
                batch.mask_of.push(NO_MASK);
            } else {
                batch.mask_of.push((batch.masks.len() / words) as u32);
                let kind = rng.random_range(1..6);
                let mask = random_mask(&mut rng, cols, words, kind);
                batch.masks.extend_from_slice(&mask);
            }
        }
        batch.check_masks(cols).unwrap();
        assert!(batch.has_masks());
        let mut out = Vec::new();
        batch.sample_host(&logits, rows, &mut out);
        let mut one = RowSampler::default();
        for (r, row) in logits.chunks_exact(cols).enumerate() {
            let (s, pens) = batch.row(r).unwrap();
            let mut masked = row.to_vec();
            if let Some(m) = batch.mask(r) {
                apply_mask(&mut masked, m);
                // A mask may allow nothing of the row (its set bits all past the row's end).
                let none = (0..cols).all(|t| !mask_allows(m, t));
                assert!(
                    mask_allows(m, out[r] as usize) || none,
                    "row {r}, seed {seed}"
                );
            }
            assert_eq!(out[r], one.sample(&masked, s, pens), "row {r}, seed {seed}");
        }
        // Masks that do not fit are an error, not a panic.
        batch.mask_words = words + 1;
        assert!(batch.check_masks(cols).is_err());
        batch.mask_words = words;
        batch.mask_of[0] = 1000;
        assert!(batch.check_masks(cols).is_err());
        batch.mask_of.pop();
        assert!(batch.check_masks(cols).is_err());
    }

    #[test]
    fn a_batch_counts_each_window_token_once_with_its_occurrences() {
        let mut batch = SamplingBatch::default();
        let s = spec(1.0, 0, 1.0, 0.0, 0.5);
        batch.push(s, &[5, 3, 5, 9, 5]);
        batch.push(s, &[]);
        batch.push(s, &[2, 2]);
        assert_eq!(batch.row(0).unwrap().1, &[(3, 1), (5, 3), (9, 1)]);
        assert_eq!(batch.row(1).unwrap().1, &[]);
        assert_eq!(batch.row(2).unwrap().1, &[(2, 2)]);
        assert!(batch.row(3).is_none());
        batch.clear();
        assert!(batch.rows.is_empty() && batch.penalties.is_empty());
    }

    #[test]
    fn sampling_on_the_host_matches_one_row_at_a_time() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let (rows, cols) = (9, 500);
        let logits: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-4.0f32..4.0))
            .collect();
        let mut batch = SamplingBatch::default();
        for r in 0..rows {
            let mut s = spec(0.2 * r as f32, (r * 7) as u32, 0.9, 0.02, rng.random());
            s.repeat_penalty = 1.3;
            s.frequency_penalty = 0.2;
            batch.push(s, &[1, 2, 2, r as u32]);
        }
        let mut out = Vec::new();
        batch.sample_host(&logits, rows, &mut out);
        let mut one = RowSampler::default();
        for (r, row) in logits.chunks_exact(cols).enumerate() {
            let (s, pens) = batch.row(r).unwrap();
            assert_eq!(out[r], one.sample(row, s, pens), "row {r}");
        }
    }
}
