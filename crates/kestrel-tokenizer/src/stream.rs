//! The streaming decoder: token ids to text, emitting only complete UTF-8.

use crate::Tokenizer;

/// Turns a stream of token ids into text, emitting only complete UTF-8: bytes of a
/// character split across tokens are held back until the character is complete.
///
/// The concatenation of everything [`push`](Self::push) and [`finish`](Self::finish)
/// return equals [`Tokenizer::decode`] of the whole sequence.
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    special: bool,
    pending: Vec<u8>,
}

impl<'a> StreamDecoder<'a> {
    /// A decoder that renders control tokens as nothing (like [`Tokenizer::decode`]).
    pub fn new(tokenizer: &'a Tokenizer) -> StreamDecoder<'a> {
        StreamDecoder::with_special(tokenizer, false)
    }

    /// A decoder that renders control tokens as their text when `special` is true.
    pub fn with_special(tokenizer: &'a Tokenizer, special: bool) -> StreamDecoder<'a> {
        StreamDecoder {
            tokenizer,
            special,
            pending: Vec::new(),
        }
    }

    /// Adds one token; returns the text that became complete (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        self.pending
            .extend_from_slice(self.tokenizer.token_to_piece(id, self.special));
        self.take_complete()
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending_bytes(&self) -> &[u8] {
        &self.pending
    }

    /// Flushes what is held back; an incomplete character becomes U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// Emits the longest prefix of `pending` that cannot change with more bytes:
    /// valid characters, and invalid sequences (as U+FFFD, the way
    /// `String::from_utf8_lossy` replaces them). Keeps an incomplete tail.
    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix up to `valid` is valid UTF-8 by definition.
                    out.push_str(&String::from_utf8_lossy(
                        &self.pending[start..start + valid],
                    ));
                    match e.error_len() {
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            start += valid + bad;
                        }
                        None => {
                            // Incomplete character at the end: wait for more bytes.
                            start += valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }
}
