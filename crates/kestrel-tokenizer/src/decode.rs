//! Token → bytes: the per-token piece table and llama.cpp's space clean-up (the streaming
//! decoder is in `stream`).

use crate::bpe::char_to_byte_map;
use crate::vocab::{TokenAttrs, TokenizerKind};

/// The bytes of every token as llama.cpp's `token_to_piece(special = true)` renders
/// them, stored back to back.
pub(crate) struct Pieces {
    bytes: Vec<u8>,
    /// `offsets[id]..offsets[id + 1]` is the piece of `id`.
    offsets: Vec<usize>,
}

impl Pieces {
    pub(crate) fn build(kind: TokenizerKind, tokens: &[String], attrs: &[TokenAttrs]) -> Pieces {
        let char_to_byte = match kind {
            TokenizerKind::Bpe => Some(char_to_byte_map()),
            TokenizerKind::Spm => None,
        };
        let verbatim = TokenAttrs::UNKNOWN | TokenAttrs::CONTROL | TokenAttrs::USER_DEFINED;
        let mut bytes = Vec::with_capacity(tokens.iter().map(String::len).sum());
        let mut offsets = Vec::with_capacity(tokens.len() + 1);
        offsets.push(0);
        for (text, &attr) in tokens.iter().zip(attrs) {
            if attr.intersects(verbatim) {
                bytes.extend_from_slice(text.as_bytes());
            } else if attr.intersects(TokenAttrs::NORMAL) {
                match &char_to_byte {
                    None => bytes.extend_from_slice(text.replace('▁', " ").as_bytes()),
                    Some(map) => {
                        for c in text.chars() {
                            match map.get(&c) {
                                Some(&b) => bytes.push(b),
                                None => {
                                    // llama.cpp's marker for characters outside the byte table.
                                    bytes.extend_from_slice(b"[UNK_BYTE_0x");
                                    let mut buf = [0u8; 4];
                                    for b in c.encode_utf8(&mut buf).bytes() {
                                        bytes.extend_from_slice(format!("{b:02x}").as_bytes());
                                    }
                                    bytes.extend_from_slice(text.as_bytes());
                                    bytes.push(b']');
                                }
                            }
                        }
                    }
                }
            } else if attr.intersects(TokenAttrs::BYTE) {
                bytes.push(byte_token_value(text));
            }
            // Unused and undefined tokens render as nothing.
            offsets.push(bytes.len());
        }
        Pieces { bytes, offsets }
    }

    pub(crate) fn get(&self, id: u32) -> &[u8] {
        let id = id as usize;
        match (self.offsets.get(id), self.offsets.get(id + 1)) {
            (Some(&start), Some(&end)) => &self.bytes[start..end],
            _ => &[],
        }
    }
}

/// The byte of a `<0xXX>` token, read like llama.cpp does (`strtol` of the two characters
/// after `<0x`: leading hex digits, 0 when there are none).
fn byte_token_value(text: &str) -> u8 {
    let digits = text.as_bytes().get(3..).unwrap_or_default();
    let mut value = 0u8;
    for &d in digits.iter().take(2) {
        let Some(v) = (d as char).to_digit(16) else {
            break;
        };
        value = value.wrapping_mul(16).wrapping_add(v as u8);
    }
    value
}

/// llama.cpp's `clean_up_tokenization_spaces` passes over detokenized bytes: drop the
/// space before `?!.,`, collapse `" ' "` to `"'"`, and drop the space before the
/// contractions `'s 'm 're 've`.
pub(crate) fn clean_up_spaces(input: &[u8]) -> Vec<u8> {
    let mut text = input.to_vec();

    // Pass 1: " ?", " !", " .", " ,".
    let n = text.len();
    let mut total = usize::from(n > 0);
    for i in 1..n {
        let x = text[i];
        if text[i - 1] == b' ' && matches!(x, b'?' | b'!' | b'.' | b',') {
            total -= 1;
        }
        text[total] = x;
        total += 1;
    }
    text.truncate(total);

    // Pass 2: a single apostrophe between spaces.
    let n = text.len();
    let mut total = usize::from(n > 0);
    let mut i = 1;
    while i < n {
        let x = text[i];
        if x == b'\'' && i + 1 < n && text[i - 1] == b' ' && text[i + 1] == b' ' {
            total -= 1;
            i += 1;
            text[i] = 0;
        }
        text[total] = x;
        total += 1;
        i += 1;
    }
    text.truncate(total);

    // Pass 3: contractions.
    let n = text.len();
    let mut total = usize::from(n > 0);
    for i in 1..n {
        let x = text[i];
        if text[i - 1] == b' ' && x == b'\'' && i + 1 < n {
            let x1 = text[i + 1];
            if x1 == b's' || x1 == b'm' {
                total -= 1;
            } else if x1 != b't' && x1 != b'd' && i + 2 < n {
                let x2 = text[i + 2];
                if (x1 == b'r' || x1 == b'v') && x2 == b'e' {
                    total -= 1;
                }
            }
        }
        text[total] = x;
        total += 1;
    }
    text.truncate(total);
    text
}
