//! Tokenizers built from small synthetic vocabularies and files: error cases, every
//! pre-tokenizer, SentencePiece space prefix, llama.cpp's space clean-up.

use kestrel_gguf::{GgufFile, GgufWriter, Value, ValueType};
use kestrel_tokenizer::{PreTokenizer, Tokenizer, TokenizerConfig, TokenizerError};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn gguf_with(metadata: Vec<(&str, Value)>) -> GgufFile {
    let mut writer = GgufWriter::new();
    writer
        .add_metadata("general.architecture", Value::String("test".into()))
        .expect("metadata");
    for (key, value) in metadata {
        writer.add_metadata(key, value).expect("metadata");
    }
    GgufFile::from_bytes(writer.write_to_vec().expect("serialize")).expect("parse")
}

fn strings(items: &[&str]) -> Value {
    Value::Array(
        ValueType::String,
        items.iter().map(|s| Value::String(s.to_string())).collect(),
    )
}

#[test]
fn files_without_a_tokenizer_say_so() {
    let none = gguf_with(vec![("tokenizer.ggml.model", Value::String("none".into()))]);
    let err = Tokenizer::from_gguf(&none).expect_err("no tokenizer");
    assert!(matches!(err, TokenizerError::NoTokenizer(_)), "{err}");
    assert!(err.to_string().contains("raw token ids"), "{err}");

    let absent = gguf_with(vec![]);
    let err = Tokenizer::from_gguf(&absent).expect_err("no tokenizer");
    assert!(matches!(err, TokenizerError::NoTokenizer(_)), "{err}");
}

#[test]
fn unknown_models_and_pre_tokenizers_are_named() {
    let bert = gguf_with(vec![
        ("tokenizer.ggml.model", Value::String("bert".into())),
        ("tokenizer.ggml.tokens", strings(&["a", "b"])),
    ]);
    let err = Tokenizer::from_gguf(&bert).expect_err("unsupported");
    assert!(
        matches!(err, TokenizerError::UnknownModel(ref m) if m == "bert"),
        "{err}"
    );
    assert!(err.to_string().contains("'bert'"));

    let odd_pre = gguf_with(vec![
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String("martian".into())),
        ("tokenizer.ggml.tokens", strings(&["a", "b"])),
    ]);
    let err = Tokenizer::from_gguf(&odd_pre).expect_err("unsupported");
    assert!(err.to_string().contains("'martian'"), "{err}");
}

#[test]
fn inconsistent_metadata_is_reported() {
    let bad = gguf_with(vec![
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.tokens", strings(&["a", "b", "c"])),
        (
            "tokenizer.ggml.token_type",
            Value::Array(ValueType::I32, vec![Value::I32(1), Value::I32(1)]),
        ),
    ]);
    let err = Tokenizer::from_gguf(&bad).expect_err("length mismatch");
    assert!(matches!(err, TokenizerError::BadMetadata(_)), "{err}");
    assert!(err.to_string().contains("token_type"), "{err}");

    let wrong_type = gguf_with(vec![
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.tokens", Value::String("abc".into())),
    ]);
    let err = Tokenizer::from_gguf(&wrong_type).expect_err("not an array");
    assert!(err.to_string().contains("tokenizer.ggml.tokens"), "{err}");
}

/// A byte-level vocabulary with one token per byte and no merges: any text encodes.
fn byte_level_config(pre: &str) -> TokenizerConfig {
    let table = byte_chars();
    TokenizerConfig {
        model: "gpt2".into(),
        pre: Some(pre.into()),
        tokens: table.iter().map(|c| c.to_string()).collect(),
        ..TokenizerConfig::default()
    }
}

fn byte_chars() -> Vec<char> {
    let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut next = 256;
    (0..256u32)
        .map(|b| {
            let cp = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            char::from_u32(cp).expect("valid")
        })
        .collect()
}

fn random_text(rng: &mut StdRng) -> String {
    const PARTS: &[&str] = &[
        "word", "Ünï", "日本", " ", "  ", "\n", "\r\n", "\t", "12345", "'s", "'LL", ",", "!?",
        "🤖", "$+<=>^~|", "½", "\u{a0}", "x",
    ];
    let n = rng.random_range(0..30);
    (0..n)
        .map(|_| PARTS[rng.random_range(0..PARTS.len())])
        .collect()
}

#[test]
fn every_pre_tokenizer_covers_the_whole_text() {
    let mut rng = StdRng::seed_from_u64(1);
    for (pre, kind) in [
        ("default", PreTokenizer::Default),
        ("gpt-2", PreTokenizer::Gpt2),
        ("llama-bpe", PreTokenizer::Llama3),
        ("qwen2", PreTokenizer::Qwen2),
    ] {
        let tok = Tokenizer::from_config(byte_level_config(pre)).expect("builds");
        assert_eq!(tok.pre_tokenizer(), Some(kind));
        // Llama 3 adds BOS by default (token 11 here, as llama.cpp's BPE default).
        assert_eq!(tok.add_bos(), kind == PreTokenizer::Llama3);
        for _ in 0..200 {
            let text = random_text(&mut rng);
            let ids = tok.encode(&text, false, false);
            // One token per byte: no merges, nothing dropped.
            assert_eq!(ids.len(), text.len(), "{pre}: {text:?}");
            assert_eq!(tok.decode(&ids), text, "{pre}");
        }
    }
}

#[test]
fn clean_up_spaces_follows_llama_cpp_rules() {
    // The default pre-tokenizer keeps clean_up_tokenization_spaces; qwen2 turns it off.
    let cleaning = Tokenizer::from_config(byte_level_config("default")).expect("builds");
    let raw = Tokenizer::from_config(byte_level_config("qwen2")).expect("builds");
    for (text, cleaned) in [
        ("Hi , there !", "Hi, there!"),
        ("a . b ?", "a. b?"),
        ("it ' s", "it's"),
        ("he 's", "he's"),
        ("I 'm", "I'm"),
        ("we 're", "we're"),
        ("they 've", "they've"),
        ("don 't", "don 't"),
        ("he 'd", "he 'd"),
        ("we 'll", "we 'll"),
    ] {
        let ids = cleaning.encode(text, false, false);
        assert_eq!(cleaning.detokenize(&ids, false), cleaned, "{text:?}");
        assert_eq!(cleaning.decode(&ids), text, "decode never cleans");
        let ids = raw.encode(text, false, false);
        assert_eq!(raw.detokenize(&ids, false), text, "qwen2 keeps spaces");
    }
}

/// A tiny SentencePiece vocabulary: control tokens, byte fallback for every byte, and a
/// few pieces with scores.
fn spm_config(add_space_prefix: Option<bool>) -> TokenizerConfig {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, 3, 3];
    for b in 0..256 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    for piece in ["▁", "a", "b", "▁a", "ab", "▁ab", "ba", "▁b"] {
        tokens.push(piece.into());
        types.push(1);
    }
    let scores = (0..tokens.len()).map(|i| -(i as f32)).collect();
    TokenizerConfig {
        model: "llama".into(),
        tokens,
        scores: Some(scores),
        token_types: Some(types),
        add_space_prefix,
        ..TokenizerConfig::default()
    }
}

#[test]
fn spm_space_prefix_and_byte_fallback_round_trip() {
    let mut rng = StdRng::seed_from_u64(3);
    for prefix in [None, Some(true), Some(false)] {
        let tok = Tokenizer::from_config(spm_config(prefix)).expect("builds");
        // SentencePiece defaults: BOS = 1 added, space prefix on unless the file says no.
        assert_eq!(tok.add_space_prefix(), prefix.unwrap_or(true));
        assert_eq!(tok.bos_id(), Some(1));
        assert!(tok.is_eog(2));
        for _ in 0..300 {
            let n = rng.random_range(0..12);
            let text: String = (0..n)
                .map(|_| ["a", "b", " ", "é", "\n", "<s>"][rng.random_range(0..6)])
                .collect();
            let ids = tok.encode(&text, true, false);
            assert_eq!(ids[0], 1, "BOS first");
            let body = &ids[1..];
            if tok.add_space_prefix() && !text.is_empty() {
                // The added space is the first piece's leading ▁.
                assert!(
                    tok.token_to_piece(body[0], false).starts_with(b" "),
                    "{text:?}"
                );
                // llama.cpp strips it only from the first token, so not after a BOS.
                assert_eq!(tok.detokenize(body, false), text, "{text:?}");
                assert_eq!(tok.detokenize(&ids, false), format!(" {text}"), "{text:?}");
                assert_eq!(tok.decode(body), format!(" {text}"));
            } else {
                assert_eq!(tok.decode(body), text, "{text:?}");
            }
            // "<s>" in the text is plain text unless special tokens are parsed.
            assert!(!body.contains(&1));
            let parsed = tok.encode(&text, false, true);
            assert_eq!(
                parsed.iter().filter(|&&id| id == 1).count(),
                text.matches("<s>").count()
            );
        }
    }
}

#[test]
fn long_runs_do_not_hit_regex_limits() {
    let runs = [
        " ".repeat(200_000) + "x",
        "\n ".repeat(50_000) + "x",
        "a".repeat(100_000),
        "1".repeat(100_000),
        "!?".repeat(50_000) + "\n",
        " \u{a0}".repeat(50_000),
    ];
    for pre in ["default", "gpt-2", "llama-bpe", "qwen2"] {
        let tok = Tokenizer::from_config(byte_level_config(pre)).expect("builds");
        for text in &runs {
            let start = std::time::Instant::now();
            let ids = tok.encode(text, false, false);
            assert_eq!(ids.len(), text.len(), "{pre}");
            assert_eq!(tok.decode(&ids), *text, "{pre}");
            assert!(
                start.elapsed().as_secs_f64() < 5.0,
                "{pre}: {:?}",
                start.elapsed()
            );
        }
    }
}

fn tiny_bpe(extra: &[&str]) -> Tokenizer {
    let mut config = byte_level_config("qwen2");
    config.tokens.extend(extra.iter().map(|s| s.to_string()));
    Tokenizer::from_config(config).expect("builds")
}

#[test]
fn end_of_generation_tokens_follow_llama_cpp_rules() {
    let tok = tiny_bpe(&["<|im_end|>", "</s>", "<unused7>", "<|fim_pad|>", "<|end|>"]);
    let id = |t: &str| tok.token_id(t).expect("in vocab");
    // Recognised by text: end of generation, and promoted to control tokens.
    for text in ["<|im_end|>", "</s>", "<|fim_pad|>", "<|end|>"] {
        assert!(tok.is_eog(id(text)), "{text}");
        assert!(tok.is_control(id(text)), "{text}");
        // Control tokens are not split out of plain text...
        assert_ne!(tok.encode(text, false, false), vec![id(text)]);
        // ...but are when special tokens are parsed.
        assert_eq!(tok.encode(text, false, true), vec![id(text)]);
        assert!(tok.token_to_piece(id(text), false).is_empty());
        assert_eq!(tok.token_to_piece(id(text), true), text.as_bytes());
    }
    assert_eq!(tok.eot_id(), Some(id("<|im_end|>")));
    // "<unused7>" is a normal token here (only control tokens get the unused flag).
    assert!(!tok.is_eog(id("<unused7>")));

    // Harmony vocabularies end turns with <|return|>/<|call|>: <|end|> is ordinary.
    let harmony = tiny_bpe(&["<|return|>", "<|call|>", "<|end|>"]);
    let end = harmony.token_id("<|end|>").expect("in vocab");
    assert!(!harmony.is_eog(end));
    assert!(!harmony.is_control(end));
    assert_eq!(
        harmony.encode("<|end|>", false, false),
        vec![end],
        "user-defined"
    );
    assert!(harmony.is_eog(harmony.token_id("<|return|>").expect("in vocab")));

    // With <|tool_response>, </s> is ordinary text again.
    let gemma4_like = tiny_bpe(&["<|tool_response>", "</s>"]);
    let s = gemma4_like.token_id("</s>").expect("in vocab");
    assert!(!gemma4_like.is_eog(s));
    assert_eq!(gemma4_like.token_to_piece(s, false), b"</s>");
}
