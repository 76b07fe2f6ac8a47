//! Shared helpers: load the real models' tokenizers and llama.cpp's reference outputs.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use kestrel_gguf::GgufFile;
use kestrel_tokenizer::Tokenizer;
use serde_json::Value;

/// The two real models the reference data covers.
pub const MODELS: &[&str] = &["qwen2.5-coder-1.5b", "gemma-3-270m"];

pub fn reference_dir() -> PathBuf {
    kestrel_hub::reference_dir().expect("reference folder (shared/reference) not found")
}

pub fn open_gguf(model: &str) -> GgufFile {
    let path = kestrel_hub::resolve_model(model)
        .unwrap_or_else(|e| panic!("cannot resolve model {model}: {e:#}"));
    GgufFile::open(&path).unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()))
}

fn load_tokenizer(model: &str) -> Tokenizer {
    Tokenizer::from_gguf(&open_gguf(model))
        .unwrap_or_else(|e| panic!("cannot build the tokenizer of {model}: {e}"))
}

/// The tokenizer of a model, built once per test binary.
pub fn tokenizer(model: &str) -> &'static Tokenizer {
    static QWEN: OnceLock<Tokenizer> = OnceLock::new();
    static GEMMA: OnceLock<Tokenizer> = OnceLock::new();
    let cell = match model {
        "qwen2.5-coder-1.5b" => &QWEN,
        "gemma-3-270m" => &GEMMA,
        other => panic!("no reference data for model {other}"),
    };
    cell.get_or_init(|| load_tokenizer(model))
}

/// `<model>*.llamacpp.json` from the reference folder.
pub fn reference(model: &str) -> Value {
    let dir = reference_dir();
    let entry = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            name.starts_with(model) && name.ends_with(".llamacpp.json")
        })
        .unwrap_or_else(|| panic!("no {model}*.llamacpp.json in {}", dir.display()));
    read_json(&entry)
}

pub fn read_json(path: &std::path::Path) -> Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("bad JSON in {}: {e}", path.display()))
}

/// The text file behind `texts[name]` (`text_<name>.*` in the reference folder).
pub fn reference_text(name: &str) -> String {
    let dir = reference_dir();
    let prefix = format!("text_{name}.");
    let path = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix))
        })
        .unwrap_or_else(|| panic!("no {prefix}* in {}", dir.display()));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

pub fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .expect("an array of token ids")
        .iter()
        .map(|v| v.as_u64().expect("a token id") as u32)
        .collect()
}

pub fn text(value: &Value) -> &str {
    value.as_str().expect("a string")
}

/// Token ids with their vocabulary texts, for readable failure messages.
pub fn show(tok: &Tokenizer, ids: &[u32]) -> String {
    ids.iter()
        .map(|&id| format!("{id}:{:?}", tok.token_text(id).unwrap_or("?")))
        .collect::<Vec<_>>()
        .join(" ")
}
