//! Constrained decoding and logit bias: a request's `response_format` (`json_object`,
//! `json_schema`), `grammar` (Lark) or `regex` becomes an `llguidance` matcher over the
//! model's vocabulary, and `logit_bias` a list of additions; both reach the scheduler as
//! one [`TokenFilter`]. The matcher computes the next token's mask while the step's
//! forward pass runs, the sampler bans every token outside it.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, OnceLock};

use kestrel_engine::sampler::TokenFilter;
use kestrel_tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};

/// What a request constrains its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// A JSON Schema. `strict`: unsupported keywords are an error, not ignored.
    JsonSchema { schema: Value, strict: bool },
    /// A Lark grammar (llguidance's dialect).
    Lark(String),
    /// A regular expression the whole output must match.
    Regex(String),
}

impl Constraint {
    /// Any JSON object.
    pub fn json_object() -> Constraint {
        Constraint::JsonSchema {
            schema: json!({"type": "object"}),
            strict: false,
        }
    }
}

/// The vocabulary as llguidance sees it, built once (on first use) per server.
pub struct Grammars {
    tokenizer: Arc<Tokenizer>,
    factory: OnceLock<Result<Arc<ParserFactory>, String>>,
}

impl Grammars {
    pub fn new(tokenizer: Arc<Tokenizer>) -> Grammars {
        Grammars {
            tokenizer,
            factory: OnceLock::new(),
        }
    }

    fn factory(&self) -> Result<Arc<ParserFactory>, String> {
        self.factory
            .get_or_init(|| build_factory(&self.tokenizer).map(Arc::new))
            .clone()
    }

    /// A filter for `constraint` and `bias` (token id, added logit). Errors name what is
    /// wrong with the grammar or schema.
    pub fn filter(
        &self,
        constraint: &Constraint,
        bias: Vec<(u32, f32)>,
    ) -> Result<Box<dyn TokenFilter>, String> {
        Ok(Box::new(RequestFilter {
            matcher: Some(self.matcher(constraint)?),
            eos: self.eos()?,
            eog: self.tokenizer.eog_ids().to_vec(),
            ..RequestFilter::bias(bias)
        }))
    }

    fn eos(&self) -> Result<u32, String> {
        eos_of(&self.tokenizer)
    }

    fn matcher(&self, constraint: &Constraint) -> Result<Matcher, String> {
        let factory = self.factory()?;
        let grammar = match constraint {
            Constraint::JsonSchema { schema, strict } => {
                let Value::Object(map) = schema else {
                    return Err("the JSON schema must be an object".into());
                };
                let mut map = map.clone();
                // Compact separators without free whitespace: a small model otherwise
                // may fill its budget with blank lines. A schema's own x-guidance wins.
                map.entry("x-guidance").or_insert_with(|| {
                    json!({
                        "whitespace_flexible": false,
                        "item_separator": ", ",
                        "key_separator": ": ",
                        "lenient": !strict,
                    })
                });
                TopLevelGrammar::from_json_schema(Value::Object(map))
            }
            Constraint::Lark(source) => TopLevelGrammar::from_lark(source.clone()),
            Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
        };
        // llguidance reports errors as values; a panic on a hostile input is caught too.
        let parser = catch_unwind(AssertUnwindSafe(|| factory.create_parser(grammar)))
            .map_err(|_| "the grammar compiler failed on this input".to_string())?
            .map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        match matcher.get_error() {
            Some(e) => Err(e),
            None => Ok(matcher),
        }
    }
}

/// The end-of-sequence token llguidance's trie knows.
fn eos_of(tok: &Tokenizer) -> Result<u32, String> {
    tok.eos_id()
        .or_else(|| tok.eog_ids().first().copied())
        .ok_or_else(|| "the model has no end-of-sequence token; grammars need one".to_string())
}

/// llguidance's token trie from the tokenizer's pieces; control tokens are marked as
/// special (grammars name them as `<|...|>`, text never matches them).
fn build_factory(tok: &Tokenizer) -> Result<ParserFactory, String> {
    let n = tok.vocab_size();
    let words: Vec<Vec<u8>> = (0..n as u32)
        .map(|id| {
            if tok.is_control(id) {
                let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                w.extend_from_slice(tok.token_text(id).unwrap_or_default().as_bytes());
                w
            } else {
                tok.token_to_piece(id, false).to_vec()
            }
        })
        .collect();
    let eos = eos_of(tok)?;
    let trie = TokTrie::from(&TokRxInfo::new(n as u32, eos), &words);
    let env: llguidance::toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
    let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
    factory.quiet();
    Ok(factory)
}

/// One request's grammar matcher and logit bias.
struct RequestFilter {
    matcher: Option<Matcher>,
    /// The allowed tokens of the next step, once prepared.
    mask: Option<SimpleVob>,
    error: Option<String>,
    bias: Vec<(u32, f32)>,
    /// The trie's end-of-sequence token: when the grammar allows it, every
    /// end-of-generation token (`eog`) is allowed.
    eos: u32,
    eog: Vec<u32>,
}

/// A filter that only adds `bias` (token id, added logit) to the logits.
pub fn bias_filter(bias: Vec<(u32, f32)>) -> Box<dyn TokenFilter> {
    Box::new(RequestFilter::bias(bias))
}

impl RequestFilter {
    fn bias(bias: Vec<(u32, f32)>) -> RequestFilter {
        RequestFilter {
            matcher: None,
            mask: None,
            error: None,
            bias,
            eos: 0,
            eog: Vec::new(),
        }
    }
}

impl TokenFilter for RequestFilter {
    fn prepare(&mut self) {
        let (Some(m), None, None) = (&mut self.matcher, &self.mask, &self.error) else {
            return;
        };
        match catch_unwind(AssertUnwindSafe(|| m.compute_mask())) {
            Ok(Ok(mask)) => self.mask = Some(mask),
            Ok(Err(e)) => self.error = Some(format!("constrained decoding: {e}")),
            Err(_) => self.error = Some("constrained decoding failed".into()),
        }
    }

    fn apply(&self, logits: &mut [f32]) {
        for &(id, b) in &self.bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += b;
            }
        }
        let Some(mask) = &self.mask else {
            return;
        };
        let eos_ok = (self.eos as usize) < mask.len() && mask.is_allowed(self.eos);
        // Every end-of-generation token is allowed with the grammar's EOS.
        let saved: Vec<(usize, f32)> = if eos_ok {
            let row = &*logits;
            self.eog
                .iter()
                .filter_map(|&t| row.get(t as usize).map(|&l| (t as usize, l)))
                .collect()
        } else {
            Vec::new()
        };
        // A word of the mask covers 32 tokens: whole words are allowed or banned at once.
        let words = mask.as_slice();
        for (chunk, w) in logits.chunks_mut(32).enumerate() {
            let bits = words.get(chunk).copied().unwrap_or(0);
            if bits == u32::MAX {
                continue;
            }
            for (b, l) in w.iter_mut().enumerate() {
                if bits & (1 << b) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        for (t, l) in saved {
            logits[t] = l;
        }
    }

    fn is_mask(&self) -> bool {
        self.matcher.is_some() && self.bias.is_empty()
    }

    fn mask(&self, words: &mut [u32]) -> bool {
        let Some(mask) = &self.mask else {
            return false;
        };
        // Word for word what `apply` reads (the words past the mask's end ban).
        let bits = mask.as_slice();
        for (i, w) in words.iter_mut().enumerate() {
            *w = bits.get(i).copied().unwrap_or(0);
        }
        // Every end-of-generation token is allowed with the grammar's EOS (as `apply`).
        if (self.eos as usize) < mask.len() && mask.is_allowed(self.eos) {
            for &t in &self.eog {
                if let Some(w) = words.get_mut(t as usize / 32) {
                    *w |= 1 << (t % 32);
                }
            }
        }
        true
    }

    fn accept(&mut self, token: u32) -> Result<bool, String> {
        if let Some(e) = &self.error {
            return Err(e.clone());
        }
        let Some(m) = &mut self.matcher else {
            return Ok(false);
        };
        if self.mask.take().is_none() {
            return Err("constrained decoding: no mask was prepared".into());
        }
        match catch_unwind(AssertUnwindSafe(|| m.consume_token(token))) {
            Ok(Ok(())) => Ok(m.is_stopped()),
            Ok(Err(e)) => Err(format!("constrained decoding: {e}")),
            Err(_) => Err("constrained decoding failed".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The mask a filter hands the sampler bans exactly what `apply` bans, on random rows
    /// (NaN, ±inf), masks (empty, sparse, dense, shorter than the row, bits past the
    /// vocabulary) and end-of-generation sets; masked greedy sampling then picks what
    /// `apply` followed by the plain argmax picks.
    #[test]
    fn the_mask_bans_what_apply_bans() {
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for case in 0..3000 {
            let vocab: usize = rng.random_range(1..300);
            let density = [0.0, 0.01, 0.1, 0.5, 1.0][case % 5];
            let mask_len = match case % 7 {
                0 => rng.random_range(0..=vocab),
                1 => vocab + rng.random_range(1..40),
                _ => vocab,
            };
            let mut mask = SimpleVob::alloc(mask_len);
            for t in 0..mask_len {
                if rng.random_bool(density) {
                    mask.allow_token(t as u32);
                }
            }
            let row: Vec<f32> = (0..vocab)
                .map(|_| match rng.random_range(0..20) {
                    0 => f32::NAN,
                    1 => f32::NEG_INFINITY,
                    2 => f32::INFINITY,
                    _ => rng.random_range(-8..8) as f32 * 0.5,
                })
                .collect();
            let eog: Vec<u32> = (0..rng.random_range(0..3))
                .map(|_| rng.random_range(0..vocab as u32 + 2))
                .collect();
            let filter = RequestFilter {
                matcher: None,
                mask: Some(mask),
                error: None,
                bias: Vec::new(),
                eos: rng.random_range(0..vocab as u32 + 1),
                eog,
            };
            let mut applied = row.clone();
            filter.apply(&mut applied);
            let mut words = vec![0u32; vocab.div_ceil(32)];
            assert!(filter.mask(&mut words));
            let mut masked = row.clone();
            kestrel_model::apply_mask(&mut masked, &words);
            let bits = |v: &[f32]| v.iter().map(|l| l.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&masked), bits(&applied), "case {case}, seed {seed}");
            assert_eq!(
                kestrel_model::masked_argmax(&row, &words),
                kestrel_engine::sampler::argmax(&applied),
                "case {case}, seed {seed}"
            );
        }
        // Not prepared: no mask. A bias or no grammar: not a mask filter.
        let unprepared = RequestFilter::bias(Vec::new());
        assert!(!unprepared.mask(&mut [0u32; 4]));
        assert!(!unprepared.is_mask());
        assert!(!RequestFilter::bias(vec![(0, 1.0)]).is_mask());
    }
}
