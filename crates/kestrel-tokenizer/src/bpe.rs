//! Byte-level BPE (GPT-2 style, `tokenizer.ggml.model = "gpt2"`).
//!
//! Text is split into pre-tokens by the regexes of the [`PreTokenizer`]; each pre-token's
//! bytes are mapped to printable characters (the GPT-2 byte↔unicode table) and merged
//! pairwise, lowest merge rank first, as llama.cpp's `llm_tokenizer_bpe_session` does.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use fancy_regex::Regex;

use crate::TokenizerError;
use crate::vocab::PreTokenizer;

/// Marks a symbol whose text is neither a vocabulary entry nor part of any merge.
const NO_SYMBOL: u32 = u32::MAX;

/// The GPT-2 table: byte → printable character. Printable Latin-1 bytes map to
/// themselves, the others to U+0100 and up, in byte order.
pub(crate) fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next_extra = 256u32;
    for (byte, slot) in table.iter_mut().enumerate() {
        let b = byte as u32;
        let printable = (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        let cp = if printable {
            b
        } else {
            let cp = next_extra;
            next_extra += 1;
            cp
        };
        // Every value is below 0x144, a valid scalar value.
        *slot = char::from_u32(cp).unwrap_or('\u{FFFD}');
    }
    table
}

/// The inverse table: printable character → byte.
pub(crate) fn char_to_byte_map() -> HashMap<char, u8> {
    byte_to_char_table()
        .iter()
        .enumerate()
        .map(|(byte, &c)| (c, byte as u8))
        .collect()
}

/// A mergeable adjacent pair waiting in the queue. The derived order compares the rank
/// first, then the left index: llama.cpp's order (lowest rank, ties to the leftmost pair).
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Candidate {
    rank: u32,
    left: usize,
    right: usize,
    /// Symbol ids when queued, to recognise pairs that changed since.
    left_id: u32,
    right_id: u32,
}

/// Merge rules and the pre-tokenizer of one vocabulary.
pub(crate) struct BpeModel {
    pre: PreTokenizer,
    regexes: Vec<Regex>,
    /// (Llama 3) a pre-token that is itself a vocabulary entry is emitted without merging.
    ignore_merges: bool,
    /// (left symbol, right symbol) → (rank, merged symbol). Symbol ids below the vocabulary
    /// size are token ids; larger ids name strings that only occur inside merges.
    merges: HashMap<(u32, u32), (u32, u32)>,
    /// Strings taking part in merges that are not vocabulary entries.
    extra_ids: HashMap<String, u32>,
    n_extra: u32,
    n_vocab: u32,
    byte_to_char: [char; 256],
}

impl BpeModel {
    pub(crate) fn new(
        pre: PreTokenizer,
        ignore_merges: bool,
        merges: &[String],
        token_to_id: &HashMap<String, u32>,
        n_vocab: u32,
    ) -> Result<BpeModel, TokenizerError> {
        let regexes = pre
            .regexes()
            .iter()
            .map(|src| {
                Regex::new(src).map_err(|e| {
                    TokenizerError::BadMetadata(format!(
                        "pre-tokenizer regex {src:?} does not compile: {e}"
                    ))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut model = BpeModel {
            pre,
            regexes,
            ignore_merges,
            merges: HashMap::with_capacity(merges.len()),
            extra_ids: HashMap::new(),
            n_extra: 0,
            n_vocab,
            byte_to_char: byte_to_char_table(),
        };
        for (rank, rule) in merges.iter().enumerate() {
            // llama.cpp splits at the first space after the first byte; a rule without
            // one becomes the pair ("", "") which can never match.
            let Some(pos) = rule.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1) else {
                continue;
            };
            let (left, right) = (&rule[..pos], &rule[pos + 1..]);
            let merged = format!("{left}{right}");
            let l = model.intern(left, token_to_id);
            let r = model.intern(right, token_to_id);
            let m = model.intern(&merged, token_to_id);
            // The first occurrence of a pair keeps its rank.
            model.merges.entry((l, r)).or_insert((rank as u32, m));
        }
        Ok(model)
    }

    pub(crate) fn pre_tokenizer(&self) -> PreTokenizer {
        self.pre
    }

    fn intern(&mut self, text: &str, token_to_id: &HashMap<String, u32>) -> u32 {
        if let Some(&id) = token_to_id.get(text) {
            return id;
        }
        if let Some(&id) = self.extra_ids.get(text) {
            return id;
        }
        let id = self.n_vocab + self.n_extra;
        self.n_extra += 1;
        self.extra_ids.insert(text.to_string(), id);
        id
    }

    fn symbol_id(&self, text: &str, token_to_id: &HashMap<String, u32>) -> u32 {
        token_to_id
            .get(text)
            .or_else(|| self.extra_ids.get(text))
            .copied()
            .unwrap_or(NO_SYMBOL)
    }

    /// Splits `text` into pre-tokens (byte ranges), applying each regex to the pieces the
    /// previous one produced; both matches and the text between them become pieces.
    pub(crate) fn split(&self, text: &str) -> Vec<(usize, usize)> {
        let mut pieces = vec![(0, text.len())];
        for re in &self.regexes {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for &(start, end) in &pieces {
                let piece = &text[start..end];
                let mut last = 0;
                for m in re.find_iter(piece) {
                    let Ok(m) = m else {
                        // The backtracking limit was hit: keep the rest as one piece.
                        break;
                    };
                    if m.start() > last {
                        next.push((start + last, start + m.start()));
                    }
                    if m.end() > m.start() {
                        next.push((start + m.start(), start + m.end()));
                    }
                    last = m.end();
                }
                if last < piece.len() {
                    next.push((start + last, end));
                }
            }
            pieces = next;
        }
        pieces
    }

    /// Tokenizes plain text (no special tokens) and appends the ids to `out`.
    pub(crate) fn encode(
        &self,
        text: &str,
        token_to_id: &HashMap<String, u32>,
        out: &mut Vec<u32>,
    ) {
        let mut word = String::new();
        for (start, end) in self.split(text) {
            word.clear();
            for &b in &text.as_bytes()[start..end] {
                word.push(self.byte_to_char[b as usize]);
            }
            self.encode_word(&word, token_to_id, out);
        }
    }

    /// Merges one byte-encoded pre-token.
    fn encode_word(&self, word: &str, token_to_id: &HashMap<String, u32>, out: &mut Vec<u32>) {
        if word.is_empty() {
            return;
        }
        if self.ignore_merges
            && let Some(&id) = token_to_id.get(word)
        {
            out.push(id);
            return;
        }

        struct Symbol {
            start: usize,
            len: usize,
            id: u32,
            prev: usize,
            next: usize,
        }
        const NONE: usize = usize::MAX;

        let mut symbols: Vec<Symbol> = Vec::with_capacity(word.len());
        for (start, c) in word.char_indices() {
            let len = c.len_utf8();
            let idx = symbols.len();
            symbols.push(Symbol {
                start,
                len,
                id: self.symbol_id(&word[start..start + len], token_to_id),
                prev: if idx == 0 { NONE } else { idx - 1 },
                next: idx + 1,
            });
        }
        if let Some(last) = symbols.last_mut() {
            last.next = NONE;
        }

        let mut queue: BinaryHeap<Reverse<Candidate>> = BinaryHeap::new();
        let push_pair =
            |queue: &mut BinaryHeap<_>, symbols: &[Symbol], left: usize, right: usize| {
                if left == NONE || right == NONE {
                    return;
                }
                let (l, r) = (symbols[left].id, symbols[right].id);
                if l == NO_SYMBOL || r == NO_SYMBOL {
                    return;
                }
                if let Some(&(rank, _)) = self.merges.get(&(l, r)) {
                    queue.push(Reverse(Candidate {
                        rank,
                        left,
                        right,
                        left_id: l,
                        right_id: r,
                    }));
                }
            };
        for i in 1..symbols.len() {
            push_pair(&mut queue, &symbols, i - 1, i);
        }

        while let Some(Reverse(Candidate {
            left,
            right,
            left_id: l_id,
            right_id: r_id,
            ..
        })) = queue.pop()
        {
            // Skip pairs whose symbols changed since they were queued.
            if symbols[left].len == 0
                || symbols[right].len == 0
                || symbols[left].id != l_id
                || symbols[right].id != r_id
                || symbols[left].next != right
            {
                continue;
            }
            let Some(&(_, merged)) = self.merges.get(&(l_id, r_id)) else {
                continue;
            };
            let right_len = symbols[right].len;
            let right_next = symbols[right].next;
            symbols[left].len += right_len;
            symbols[left].id = merged;
            symbols[left].next = right_next;
            symbols[right].len = 0;
            if right_next != NONE {
                symbols[right_next].prev = left;
            }
            let prev = symbols[left].prev;
            push_pair(&mut queue, &symbols, prev, left);
            push_pair(&mut queue, &symbols, left, right_next);
        }

        let mut i = 0;
        while i != NONE {
            let sym = &symbols[i];
            if sym.len > 0 {
                if sym.id < self.n_vocab {
                    out.push(sym.id);
                } else {
                    // Not a vocabulary entry: llama.cpp falls back to single-byte tokens
                    // and drops bytes that have none.
                    let text = &word[sym.start..sym.start + sym.len];
                    for b in text.bytes() {
                        let mut buf = [0u8; 4];
                        let single = (b as char).encode_utf8(&mut buf);
                        if b.is_ascii()
                            && let Some(&id) = token_to_id.get(&*single)
                        {
                            out.push(id);
                        }
                    }
                }
            }
            i = sym.next;
        }
    }
}
