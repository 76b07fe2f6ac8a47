//! Both real vocabularies against llama.cpp itself on random inputs: tests/data holds
//! llama.cpp's tokenization of 400 random strings per model (mixed scripts, whitespace
//! of every kind, digits, special-token texts), its detokenization of random id
//! sequences, a digest of its whole token→piece table and its special-token settings.
//! tests/oracle/gen_llamacpp_fixture.py regenerates the files with llama-cpp-python.

mod common;

use serde_json::Value;
use sha2::{Digest, Sha256};

fn fixture(model: &str) -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(format!("llamacpp_fuzz.{model}.json"));
    common::read_json(&path)
}

fn optional_id(v: &Value) -> Option<u32> {
    v.as_u64().map(|x| x as u32)
}

#[test]
fn random_strings_tokenize_like_llama_cpp() {
    for model in common::MODELS {
        let tok = common::tokenizer(model);
        let fixture = fixture(model);
        let cases = fixture["encode"].as_array().expect("encode[]");
        assert!(cases.len() >= 100);
        let mut failures = Vec::new();
        for case in cases {
            let text = common::text(&case["text"]);
            for (key, add_special, parse_special) in [
                ("ids_special", true, true),
                ("ids_plain", false, false),
                ("ids_special_no_bos", false, true),
                ("ids_plain_bos", true, false),
            ] {
                let expected = common::ids(&case[key]);
                let got = tok.encode(text, add_special, parse_special);
                if got != expected {
                    failures.push(format!(
                        "{model} {key} {text:?}\n  expected {}\n  got      {}",
                        common::show(tok, &expected),
                        common::show(tok, &got)
                    ));
                }
            }
        }
        assert!(
            failures.is_empty(),
            "{} of {} mismatches:\n{}",
            failures.len(),
            cases.len() * 4,
            failures.join("\n")
        );
    }
}

#[test]
fn random_ids_detokenize_like_llama_cpp() {
    for model in common::MODELS {
        let tok = common::tokenizer(model);
        let fixture = fixture(model);
        let cases = fixture["detokenize"].as_array().expect("detokenize[]");
        assert!(!cases.is_empty());
        for case in cases {
            let ids = common::ids(&case["ids"]);
            let special = case["special"].as_bool().expect("bool");
            let hex = common::text(&case["bytes_hex"]);
            let expected: Vec<u8> = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
                .collect();
            let got = tok.detokenize(&ids, special);
            assert_eq!(
                got,
                String::from_utf8_lossy(&expected),
                "{model} {ids:?} special={special}"
            );
        }
    }
}

fn piece_digest(tok: &kestrel_tokenizer::Tokenizer, special: bool) -> String {
    let mut hasher = Sha256::new();
    for id in 0..tok.vocab_size() as u32 {
        let piece = tok.token_to_piece(id, special);
        hasher.update((piece.len() as u32).to_le_bytes());
        hasher.update(piece);
    }
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn every_token_piece_matches_llama_cpp() {
    for model in common::MODELS {
        let tok = common::tokenizer(model);
        let fixture = fixture(model);
        assert_eq!(
            tok.vocab_size() as u64,
            fixture["n_vocab"].as_u64().expect("n_vocab")
        );
        assert_eq!(
            piece_digest(tok, true),
            common::text(&fixture["piece_digest_special"]),
            "{model}"
        );
        assert_eq!(
            piece_digest(tok, false),
            common::text(&fixture["piece_digest_plain"]),
            "{model}"
        );
    }
}

#[test]
fn special_tokens_match_llama_cpp() {
    for model in common::MODELS {
        let tok = common::tokenizer(model);
        let fixture = fixture(model);
        assert_eq!(tok.bos_id(), optional_id(&fixture["bos"]), "{model} bos");
        assert_eq!(tok.eos_id(), optional_id(&fixture["eos"]), "{model} eos");
        assert_eq!(tok.eot_id(), optional_id(&fixture["eot"]), "{model} eot");
        assert_eq!(
            tok.add_bos(),
            fixture["add_bos"].as_bool().expect("bool"),
            "{model}"
        );
        assert_eq!(
            tok.add_eos(),
            fixture["add_eos"].as_bool().expect("bool"),
            "{model}"
        );
        assert_eq!(
            tok.eog_ids(),
            common::ids(&fixture["eog"]),
            "{model} end-of-generation"
        );
        let control: Vec<u32> = (0..tok.vocab_size() as u32)
            .filter(|&id| tok.is_control(id))
            .collect();
        assert_eq!(
            control,
            common::ids(&fixture["control"]),
            "{model} control tokens"
        );
    }
}
