//! StreamDecoder on random id sequences of both real vocabularies: the streamed chunks
//! concatenate to `decode` of the whole sequence, and bytes are held back only while a
//! character is incomplete.

mod common;

use kestrel_tokenizer::{StreamDecoder, Tokenizer};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Tokens whose piece alone is not valid UTF-8 (byte tokens, split characters).
fn partial_tokens(tok: &Tokenizer) -> Vec<u32> {
    (0..tok.vocab_size() as u32)
        .filter(|&id| std::str::from_utf8(tok.token_to_piece(id, false)).is_err())
        .collect()
}

fn random_ids(rng: &mut StdRng, tok: &Tokenizer, partial: &[u32], len: usize) -> Vec<u32> {
    (0..len)
        .map(|_| {
            if !partial.is_empty() && rng.random_bool(0.6) {
                partial[rng.random_range(0..partial.len())]
            } else {
                rng.random_range(0..tok.vocab_size() as u32)
            }
        })
        .collect()
}

fn stream(tok: &Tokenizer, ids: &[u32], special: bool) -> (String, usize) {
    let mut decoder = StreamDecoder::with_special(tok, special);
    let mut out = String::new();
    let mut chunks = 0;
    for &id in ids {
        let chunk = decoder.push(id);
        // Whatever is held back must be the start of one incomplete character.
        let pending = decoder.pending_bytes();
        assert!(pending.len() < 4, "holding {pending:?}");
        if let Err(e) = std::str::from_utf8(pending) {
            assert_eq!(e.valid_up_to(), 0, "held back complete text: {pending:?}");
            assert!(
                e.error_len().is_none(),
                "held back invalid bytes: {pending:?}"
            );
        }
        chunks += usize::from(!chunk.is_empty());
        out.push_str(&chunk);
    }
    out.push_str(&decoder.finish());
    assert!(decoder.pending_bytes().is_empty());
    (out, chunks)
}

#[test]
fn streamed_chunks_concatenate_to_decode() {
    let mut rng = StdRng::seed_from_u64(0xdec0de);
    for model in common::MODELS {
        let tok = common::tokenizer(model);
        let partial = partial_tokens(tok);
        assert!(!partial.is_empty(), "{model}: expected byte-level tokens");
        let mut valid_sequences = 0;
        for round in 0..3000 {
            let len = rng.random_range(0..12);
            let ids = random_ids(&mut rng, tok, &partial, len);
            let special = round % 4 == 0;
            let (streamed, _) = stream(tok, &ids, special);
            let bytes = tok.decode_bytes(&ids, special);
            let whole = String::from_utf8_lossy(&bytes);
            assert_eq!(streamed, whole, "{model}: ids {ids:?}");
            if let Ok(valid) = std::str::from_utf8(&bytes) {
                valid_sequences += 1;
                assert_eq!(streamed, valid);
                if !special {
                    assert_eq!(streamed, tok.decode(&ids));
                }
            }
        }
        // The generator must also produce sequences that are valid as a whole.
        assert!(
            valid_sequences > 300,
            "{model}: only {valid_sequences} valid sequences"
        );
    }
}

#[test]
fn multibyte_characters_split_over_tokens_come_out_whole() {
    for model in common::MODELS {
        let tok = common::tokenizer(model);
        let text = "naïve Zürich — 日本語のテキスト 🤖🚀 ∑∫√ ≠ ≤ 한국어 𓀀𒀀𐌰";
        let ids = tok.encode(text, false, false);
        // Rare characters are split over several tokens (byte fallback in SentencePiece).
        assert!(
            ids.iter()
                .any(|&id| std::str::from_utf8(tok.token_to_piece(id, false)).is_err())
        );
        let (streamed, chunks) = stream(tok, &ids, false);
        assert_eq!(streamed, text, "{model}");
        assert!(chunks > 1);
    }
}

#[test]
fn finish_flushes_an_incomplete_tail_lossily() {
    for model in common::MODELS {
        let tok = common::tokenizer(model);
        let ids = tok.encode("ok 𓀀", false, false);
        // Find a cut inside the last character: a prefix whose pieces end mid-character.
        let cut = (1..ids.len())
            .find(|&n| std::str::from_utf8(&tok.decode_bytes(&ids[..n], false)).is_err())
            .expect("the hieroglyph spans several tokens");
        let mut decoder = StreamDecoder::new(tok);
        let mut out = String::new();
        for &id in &ids[..cut] {
            out.push_str(&decoder.push(id));
        }
        assert!(!decoder.pending_bytes().is_empty());
        assert_eq!(out, "ok ");
        let tail = decoder.finish();
        assert!(tail.ends_with('\u{FFFD}'), "{tail:?}");
        assert_eq!(
            out + &tail,
            String::from_utf8_lossy(&tok.decode_bytes(&ids[..cut], false))
        );
    }
}
