//! SentencePiece-style BPE (`tokenizer.ggml.model = "llama"`).
//!
//! The text (spaces already replaced by `▁`) starts as one symbol per character; the
//! adjacent pair whose concatenation is the vocabulary entry with the highest score is
//! merged first (ties: leftmost), until no adjacent pair forms an entry. Symbols that are
//! not entries are emitted as `<0xXX>` byte tokens. This is llama.cpp's
//! `llm_tokenizer_spm_session`.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    /// Byte length of the merged text when queued (detects stale entries).
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// Max-heap order: higher score first, then the smaller left index.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .partial_cmp(&other.score)
            .unwrap_or(Ordering::Equal)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// Vocabulary lookups the SPM merge loop needs.
pub(crate) struct SpmVocab<'a> {
    pub token_to_id: &'a HashMap<String, u32>,
    pub scores: &'a [f32],
    /// Token of each byte value (`<0xXX>`, else the byte as a one-character entry).
    pub byte_tokens: &'a [Option<u32>; 256],
    /// Used for bytes that have no token at all.
    pub unk_id: Option<u32>,
}

/// Tokenizes `text` (whitespace already escaped) and appends the ids to `out`.
pub(crate) fn encode(vocab: &SpmVocab<'_>, text: &str, out: &mut Vec<u32>) {
    struct Symbol {
        start: usize,
        len: usize,
        prev: usize,
        next: usize,
    }
    const NONE: usize = usize::MAX;

    let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
    for (start, c) in text.char_indices() {
        let idx = symbols.len();
        symbols.push(Symbol {
            start,
            len: c.len_utf8(),
            prev: if idx == 0 { NONE } else { idx - 1 },
            next: idx + 1,
        });
    }
    let Some(last) = symbols.last_mut() else {
        return;
    };
    last.next = NONE;

    let mut queue = BinaryHeap::new();
    let try_add =
        |queue: &mut BinaryHeap<Bigram>, symbols: &[Symbol], left: usize, right: usize| {
            if left == NONE || right == NONE {
                return;
            }
            let start = symbols[left].start;
            let size = symbols[left].len + symbols[right].len;
            let Some(&id) = vocab.token_to_id.get(&text[start..start + size]) else {
                return;
            };
            let score = vocab.scores.get(id as usize).copied().unwrap_or(0.0);
            queue.push(Bigram {
                score,
                left,
                right,
                size,
            });
        };
    for i in 1..symbols.len() {
        try_add(&mut queue, &symbols, i - 1, i);
    }

    while let Some(bigram) = queue.pop() {
        let (left, right) = (bigram.left, bigram.right);
        if symbols[left].len == 0
            || symbols[right].len == 0
            || symbols[left].len + symbols[right].len != bigram.size
        {
            continue;
        }
        let right_len = symbols[right].len;
        let right_next = symbols[right].next;
        symbols[left].len += right_len;
        symbols[left].next = right_next;
        symbols[right].len = 0;
        if right_next != NONE {
            symbols[right_next].prev = left;
        }
        let prev = symbols[left].prev;
        try_add(&mut queue, &symbols, prev, left);
        try_add(&mut queue, &symbols, left, right_next);
    }

    let mut i = 0;
    while i != NONE {
        let sym = &symbols[i];
        let piece = &text[sym.start..sym.start + sym.len];
        match vocab.token_to_id.get(piece) {
            Some(&id) => out.push(id),
            None => {
                for b in piece.bytes() {
                    if let Some(id) = vocab.byte_tokens[b as usize].or(vocab.unk_id) {
                        out.push(id);
                    }
                }
            }
        }
        i = sym.next;
    }
}
