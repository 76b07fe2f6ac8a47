//! The optimized tokenizers against deliberately simple reimplementations (quadratic
//! merge loops written straight from the algorithm's definition) on random strings,
//! using the real vocabularies read directly from the GGUF files.

mod common;

use std::collections::HashMap;

use fancy_regex::Regex;
use kestrel_gguf::GgufFile;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn strings(gguf: &GgufFile, key: &str) -> Vec<String> {
    gguf.get_array(key)
        .unwrap_or_else(|| panic!("{key} missing"))
        .iter()
        .map(|v| v.as_str().expect("string").to_string())
        .collect()
}

/// GPT-2's byte → character table, built from its definition.
fn gpt2_byte_chars() -> Vec<char> {
    let mut printable: Vec<u32> = (0x21..=0x7E)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars = vec!['\0'; 256];
    for &b in &printable {
        chars[b as usize] = char::from_u32(b).expect("latin-1");
    }
    let mut extra = 256;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            chars[b as usize] = char::from_u32(extra).expect("valid");
            extra += 1;
            printable.push(b);
        }
    }
    chars
}

/// Byte-level BPE by definition: split with the pre-tokenizer regex, then repeatedly
/// merge the adjacent pair with the lowest rank (leftmost on ties).
struct NaiveBpe {
    regex: Regex,
    ranks: HashMap<(String, String), usize>,
    vocab: HashMap<String, u32>,
    byte_chars: Vec<char>,
}

impl NaiveBpe {
    fn new(gguf: &GgufFile, regex: &str) -> NaiveBpe {
        let mut ranks = HashMap::new();
        for (rank, rule) in strings(gguf, "tokenizer.ggml.merges").iter().enumerate() {
            let (left, right) = rule.split_once(' ').expect("merge rule 'a b'");
            ranks
                .entry((left.to_string(), right.to_string()))
                .or_insert(rank);
        }
        let vocab = strings(gguf, "tokenizer.ggml.tokens")
            .into_iter()
            .enumerate()
            .map(|(i, t)| (t, i as u32))
            .collect();
        NaiveBpe {
            regex: Regex::new(regex).expect("regex"),
            ranks,
            vocab,
            byte_chars: gpt2_byte_chars(),
        }
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        let mut words = Vec::new();
        let mut last = 0;
        for m in self.regex.find_iter(text) {
            let m = m.expect("regex match");
            if m.start() > last {
                words.push(&text[last..m.start()]);
            }
            words.push(m.as_str());
            last = m.end();
        }
        if last < text.len() {
            words.push(&text[last..]);
        }
        let mut out = Vec::new();
        for word in words {
            let mut symbols: Vec<String> = word
                .bytes()
                .map(|b| self.byte_chars[b as usize].to_string())
                .collect();
            loop {
                let best = (0..symbols.len().saturating_sub(1))
                    .filter_map(|i| {
                        self.ranks
                            .get(&(symbols[i].clone(), symbols[i + 1].clone()))
                            .map(|&r| (r, i))
                    })
                    .min();
                let Some((_, i)) = best else { break };
                let right = symbols.remove(i + 1);
                symbols[i].push_str(&right);
            }
            for s in symbols {
                out.push(
                    *self
                        .vocab
                        .get(&s)
                        .unwrap_or_else(|| panic!("{s:?} not in vocab")),
                );
            }
        }
        out
    }
}

/// SentencePiece BPE by definition: spaces become ▁, then repeatedly merge the adjacent
/// pair whose concatenation is the vocabulary entry with the highest score (leftmost on
/// ties); leftovers become <0xXX> byte tokens.
struct NaiveSpm {
    vocab: HashMap<String, u32>,
    scores: Vec<f32>,
}

impl NaiveSpm {
    fn new(gguf: &GgufFile) -> NaiveSpm {
        let vocab = strings(gguf, "tokenizer.ggml.tokens")
            .into_iter()
            .enumerate()
            .map(|(i, t)| (t, i as u32))
            .collect();
        let scores = gguf
            .get_array("tokenizer.ggml.scores")
            .expect("scores")
            .iter()
            .map(|v| v.as_f32().expect("f32"))
            .collect();
        NaiveSpm { vocab, scores }
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        let escaped = text.replace(' ', "▁");
        let mut symbols: Vec<String> = escaped.chars().map(String::from).collect();
        loop {
            let mut best: Option<(f32, usize)> = None;
            for i in 0..symbols.len().saturating_sub(1) {
                let joined = format!("{}{}", symbols[i], symbols[i + 1]);
                if let Some(&id) = self.vocab.get(&joined) {
                    let score = self.scores[id as usize];
                    if best.is_none_or(|(s, _)| score > s) {
                        best = Some((score, i));
                    }
                }
            }
            let Some((_, i)) = best else { break };
            let right = symbols.remove(i + 1);
            symbols[i].push_str(&right);
        }
        let mut out = Vec::new();
        for s in symbols {
            match self.vocab.get(&s) {
                Some(&id) => out.push(id),
                None => {
                    for b in s.bytes() {
                        out.push(self.vocab[&format!("<0x{b:02X}>")]);
                    }
                }
            }
        }
        out
    }
}

const COMMON_FRAGMENTS: &[&str] = &[
    "the",
    "The",
    "quick",
    "don",
    "'t",
    "'s",
    "'RE",
    "'ll",
    "'Ve",
    "hello",
    "WORLD",
    "Zürich",
    "naïve",
    "日本",
    "語",
    "한국",
    "русский",
    "Ελλ",
    "🤖",
    "🚀",
    "∑",
    "≠",
    "1",
    "23",
    "456",
    "7890",
    "3.14",
    ",",
    ".",
    "!",
    "?",
    "-",
    "_",
    "(",
    ")",
    "{",
    "}",
    "\"",
    "'",
    "é",
    "e\u{301}",
    "Ⅻ",
    "½",
    "٣",
    "ǅ",
    "ﬁ",
    "x²",
    "$",
    "+",
    "=",
    "|",
    "^",
    "~",
    "`",
    "@",
    "#",
    "%",
    "&",
    "*",
    "\u{200b}",
    "\u{feff}",
    "ß",
    "İ",
    "ﷺ",
    "𓀀",
    "a",
    "b",
    " ",
    "\u{a0}",
    "\u{3000}",
];
/// Whitespace and markup that the SentencePiece vocabulary has user-defined tokens for
/// (split out before merging, so kept out of the SPM comparison).
const BPE_ONLY_FRAGMENTS: &[&str] = &[
    "  ", "   ", "\n", "\n\n", "\r\n", "\t", " \n", "\u{2003}", "<", ">",
];

fn random_text(rng: &mut StdRng, fragments: &[&[&str]]) -> String {
    let all: Vec<&str> = fragments.iter().flat_map(|f| f.iter().copied()).collect();
    let n = rng.random_range(0..40);
    (0..n)
        .map(|_| all[rng.random_range(0..all.len())])
        .collect()
}

#[test]
fn qwen_bpe_matches_the_naive_definition() {
    let gguf = common::open_gguf("qwen2.5-coder-1.5b");
    let naive = NaiveBpe::new(
        &gguf,
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    );
    let tok = common::tokenizer("qwen2.5-coder-1.5b");
    let mut rng = StdRng::seed_from_u64(42);
    for _ in 0..400 {
        let text = random_text(&mut rng, &[COMMON_FRAGMENTS, BPE_ONLY_FRAGMENTS]);
        assert_eq!(
            tok.encode(&text, false, false),
            naive.encode(&text),
            "{text:?}"
        );
    }
    // Plain text of the reference files too.
    let gpl = common::reference_text("gpl3");
    let sample: String = gpl.chars().take(4000).collect();
    assert_eq!(tok.encode(&sample, false, false), naive.encode(&sample));
}

#[test]
fn gemma_spm_matches_the_naive_definition() {
    let gguf = common::open_gguf("gemma-3-270m");
    let naive = NaiveSpm::new(&gguf);
    let tok = common::tokenizer("gemma-3-270m");
    assert!(!tok.add_space_prefix());
    let mut rng = StdRng::seed_from_u64(7);
    for _ in 0..400 {
        let text = random_text(&mut rng, &[COMMON_FRAGMENTS]);
        // Runs of spaces are user-defined tokens in Gemma's vocabulary; keep single ones.
        let mut text = text;
        while text.contains("  ") {
            text = text.replace("  ", " ");
        }
        assert_eq!(
            tok.encode(&text, false, false),
            naive.encode(&text),
            "{text:?}"
        );
    }
}
