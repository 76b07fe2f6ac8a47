//! Fuzzes the tokenizer builder with hostile vocabularies: any token list, token types,
//! merges and special ids must build a tokenizer or return an error, never panic or take
//! super-linear time (libFuzzer's -timeout catches that); a built tokenizer must encode
//! and decode any text.
//!
//! Input: a header byte (bit 0: BPE or SentencePiece; bit 1: parse special tokens), then
//! NUL-separated fields: the vocabulary (tokens separated by `\n`, each token's type from
//! its first byte), the merges (`\n`-separated), and the text to encode.

#![no_main]

use kestrel_tokenizer::{Tokenizer, TokenizerConfig};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&header, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest);
    let mut fields = text.split('\0');
    let vocab = fields.next().unwrap_or_default();
    let merges = fields.next().unwrap_or_default();
    let input = fields.next().unwrap_or_default();

    let tokens: Vec<String> = vocab.split('\n').map(str::to_string).collect();
    // Types 1..=6 as GGUF has them, plus out-of-range values.
    let token_types: Vec<i32> = tokens
        .iter()
        .map(|t| t.bytes().next().map_or(1, |b| i32::from(b % 9) - 1))
        .collect();
    let n = tokens.len() as u32;
    let config = TokenizerConfig {
        model: if header & 1 == 0 { "gpt2" } else { "llama" }.to_string(),
        pre: None,
        scores: Some((0..tokens.len()).map(|i| -(i as f32)).collect()),
        token_types: Some(token_types),
        merges: merges
            .split('\n')
            .filter(|m| !m.is_empty())
            .map(str::to_string)
            .collect(),
        bos_token_id: Some(u32::from(header) % n.max(1)),
        eos_token_id: Some(u32::from(header >> 4)),
        tokens,
        ..TokenizerConfig::default()
    };
    let Ok(tokenizer) = Tokenizer::from_config(config) else {
        return;
    };
    let ids = tokenizer.encode(input, header & 4 != 0, header & 2 != 0);
    for &id in &ids {
        assert!(
            (id as usize) < tokenizer.vocab_size(),
            "id {id} out of range"
        );
    }
    let _ = tokenizer.detokenize(&ids, true);
    let _ = tokenizer.decode_bytes(&ids, false);
});
