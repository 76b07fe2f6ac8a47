//! Hostile vocabularies: tokenizers built from adversarial metadata stay fast.

use std::time::{Duration, Instant};

use kestrel_gguf::{GgufFile, GgufWriter, Value, ValueType};
use kestrel_tokenizer::Tokenizer;

fn vocab_with_control(text: String) -> GgufFile {
    let mut tokens: Vec<String> = (0u8..=255).map(|b| format!("<0x{b:02X}>")).collect();
    tokens.push("a".into());
    tokens.push(text);
    let n = tokens.len();
    let mut types = vec![6i32; 256];
    types.push(1);
    types.push(3);
    let mut writer = GgufWriter::new();
    let meta = [
        ("general.architecture", Value::String("test".into())),
        ("tokenizer.ggml.model", Value::String("llama".into())),
        (
            "tokenizer.ggml.tokens",
            Value::Array(
                ValueType::String,
                tokens.into_iter().map(Value::String).collect(),
            ),
        ),
        (
            "tokenizer.ggml.token_type",
            Value::Array(ValueType::I32, types.into_iter().map(Value::I32).collect()),
        ),
        (
            "tokenizer.ggml.scores",
            Value::Array(ValueType::F32, vec![Value::F32(0.0); n]),
        ),
    ];
    for (k, v) in meta {
        writer.add_metadata(k, v).expect("metadata");
    }
    GgufFile::from_bytes(writer.write_to_vec().expect("serialize")).expect("parse")
}

#[test]
fn huge_control_token_builds_fast() {
    // Before the fix the matcher's build was quadratic: 25 KB took seconds, 100 KB minutes.
    let shapes: [fn(usize) -> char; 3] = [
        |_| 'a',
        |i| (b'a' + (i % 26) as u8) as char,
        |i| char::from_u32(0x4e00 + (i as u32 * 7919) % 20000).unwrap_or('x'),
    ];
    for (shape, len) in shapes.iter().flat_map(|s| [(s, 25_000usize), (s, 100_000)]) {
        let text: String = (0..len).map(shape).collect();
        let gguf = vocab_with_control(text.clone());
        let start = Instant::now();
        let tok = Tokenizer::from_gguf(&gguf).expect("tokenizer");
        let took = start.elapsed();
        let ids = tok.encode(&format!("x{text}x"), false, true);
        // The control token is split out whole, with the two x's around it.
        assert_eq!(ids.iter().filter(|&&id| id == 257).count(), 1, "{len}");
        assert!(took < Duration::from_secs(1), "{len} chars took {took:?}");
    }
}
