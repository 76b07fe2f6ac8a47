//! Splitting special-token text out of the input before tokenization (llama.cpp's
//! `tokenizer_st_partition`).
//!
//! Candidates are the control, user-defined and unknown tokens, tried longest text
//! first; each one splits every remaining text fragment at all its occurrences (leftmost
//! first, non-overlapping). Control and unknown tokens take part only when special tokens
//! are parsed; user-defined tokens always do.

use aho_corasick::{AhoCorasick, AhoCorasickKind, MatchKind};

use crate::vocab::TokenAttrs;

/// A piece of the input after partitioning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fragment {
    /// Byte range of the input still to be tokenized.
    Text(usize, usize),
    /// A special token matched verbatim.
    Token(u32),
}

pub(crate) struct SpecialTokens {
    /// Candidate token ids, longest text first (ties in id order).
    ordered: Vec<u32>,
    /// Whether each candidate (same index as `ordered`) is split out even when special
    /// tokens are not parsed (user-defined tokens).
    always: Vec<bool>,
    /// Finds which candidates occur in an input at all (pattern index = `ordered` index),
    /// so the per-token passes run only for those.
    finder: Option<AhoCorasick>,
}

impl SpecialTokens {
    pub(crate) fn new(tokens: &[String], attrs: &[TokenAttrs]) -> SpecialTokens {
        let candidate = TokenAttrs::CONTROL | TokenAttrs::USER_DEFINED | TokenAttrs::UNKNOWN;
        let mut ordered: Vec<u32> = attrs
            .iter()
            .enumerate()
            .filter(|(_, a)| a.intersects(candidate))
            .map(|(id, _)| id as u32)
            .collect();
        // Stable sort: equal lengths keep id order.
        ordered.sort_by_key(|&id| std::cmp::Reverse(tokens[id as usize].len()));
        // Control and unknown tokens are only split out when special tokens are parsed.
        let parse_only = TokenAttrs::CONTROL | TokenAttrs::UNKNOWN;
        let always = ordered
            .iter()
            .map(|&id| !attrs[id as usize].intersects(parse_only))
            .collect();
        let finder = if ordered.is_empty() {
            None
        } else {
            AhoCorasick::builder()
                .match_kind(MatchKind::Standard)
                // Not the DFA the builder picks for few patterns: its build time and size
                // grow with pattern length × alphabet, so one hostile 25 KB control token
                // took seconds (100 KB, minutes). The NFA builds in linear time.
                .kind(Some(AhoCorasickKind::ContiguousNFA))
                .build(ordered.iter().map(|&id| tokens[id as usize].as_bytes()))
                .ok()
        };
        SpecialTokens {
            ordered,
            always,
            finder,
        }
    }

    /// Splits `text` into fragments. An empty text gives no fragments.
    pub(crate) fn partition(
        &self,
        text: &str,
        tokens: &[String],
        parse_special: bool,
    ) -> Vec<Fragment> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut fragments = vec![Fragment::Text(0, text.len())];
        let present = self.present_candidates(text, parse_special);
        for idx in present {
            let id = self.ordered[idx];
            let needle = tokens[id as usize].as_str();
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for &fragment in &fragments {
                let Fragment::Text(mut start, end) = fragment else {
                    next.push(fragment);
                    continue;
                };
                while let Some(pos) = text[start..end].find(needle) {
                    let at = start + pos;
                    if at > start {
                        next.push(Fragment::Text(start, at));
                    }
                    next.push(Fragment::Token(id));
                    start = at + needle.len();
                }
                if start < end {
                    next.push(Fragment::Text(start, end));
                }
            }
            fragments = next;
        }
        fragments
    }

    /// Indices (into `ordered`, ascending) of candidates that occur in `text` and apply.
    fn present_candidates(&self, text: &str, parse_special: bool) -> Vec<usize> {
        let Some(finder) = &self.finder else {
            return Vec::new();
        };
        let mut seen = vec![false; self.ordered.len()];
        for m in finder.find_overlapping_iter(text) {
            seen[m.pattern().as_usize()] = true;
        }
        seen.iter()
            .enumerate()
            .filter(|&(idx, &s)| s && (parse_special || self.always[idx]))
            .map(|(idx, _)| idx)
            .collect()
    }
}
