//! SentencePiece-only checkpoints (`tokenizer.model`, e.g. Llama 2, Mistral 7B v0.1, Gemma):
//! the vocabulary llama.cpp's `llama` (SPM) tokenizer reads, built as convert_hf_to_gguf.py's
//! `_create_vocab_sentencepiece` builds it: every piece with its score and type (unknown,
//! control, unused and byte pieces keep their kind; normal and user-defined pieces are
//! normal), ids up to config.json's `vocab_size` padded with `[PAD{i}]`, then the ids of
//! `added_tokens.json` and `tokenizer_config.json`'s `added_tokens_decoder` overriding
//! theirs.
//!
//! The model file is a protobuf `ModelProto`; only its `pieces` (field 1: piece, score,
//! type) are read, decoded with `prost` from the hand-written messages below (the
//! generated code of sentencepiece_model.proto would be hundreds of lines for the three
//! fields needed). Unknown fields (trainer and normalizer specs) are skipped by prost.

use std::collections::HashMap;

use anyhow::{Context, Result, bail};
use kestrel_gguf::{Value, ValueType};
use prost::Message;
use serde_json::Value as Json;

use crate::checkpoint::{Checkpoint, read_json};

/// sentencepiece_model.proto's `ModelProto`, the pieces only.
#[derive(Clone, PartialEq, Message)]
struct ModelProto {
    #[prost(message, repeated, tag = "1")]
    pieces: Vec<Piece>,
}

/// `ModelProto.SentencePiece`.
#[derive(Clone, PartialEq, Message)]
struct Piece {
    #[prost(string, optional, tag = "1")]
    piece: Option<String>,
    #[prost(float, optional, tag = "2")]
    score: Option<f32>,
    /// `Type`: NORMAL 1 (the default), UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5,
    /// BYTE 6.
    #[prost(int32, optional, tag = "3")]
    kind: Option<i32>,
}

// gguf-py's SentencePieceTokenTypes.
const NORMAL: i32 = 1;
const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;
const BYTE: i32 = 6;

/// The token list, scores and types `_create_vocab_sentencepiece` returns.
pub struct SpmVocab {
    pub tokens: Vec<String>,
    pub scores: Vec<f32>,
    pub types: Vec<i32>,
}

/// Reads `tokenizer.model` and builds the vocabulary.
pub fn sentencepiece_vocab(ckpt: &Checkpoint) -> Result<SpmVocab> {
    let path = ckpt.dir.join("tokenizer.model");
    let bytes = std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let model = ModelProto::decode(bytes.as_slice()).with_context(|| {
        format!(
            "{} is not a SentencePiece model (protobuf ModelProto)",
            path.display()
        )
    })?;
    if model.pieces.is_empty() {
        bail!("{} holds no pieces", path.display());
    }
    let n_pieces = model.pieces.len();
    let vocab_size = ckpt.opt_usize("vocab_size")?.unwrap_or(n_pieces);
    if vocab_size > 1 << 28 {
        bail!("vocab_size {vocab_size} is implausibly large");
    }
    let mut v = SpmVocab {
        tokens: (0..vocab_size).map(|i| format!("[PAD{i}]")).collect(),
        scores: vec![-10000.0; vocab_size],
        types: vec![UNUSED; vocab_size],
    };
    for (id, p) in model.pieces.iter().enumerate().take(vocab_size) {
        v.tokens[id] = p.piece.clone().unwrap_or_default();
        v.scores[id] = p.score.unwrap_or(0.0);
        v.types[id] = match p.kind.unwrap_or(NORMAL) {
            UNKNOWN => UNKNOWN,
            CONTROL => CONTROL,
            UNUSED => UNUSED,
            BYTE => BYTE,
            _ => NORMAL,
        };
    }
    let id_of = |what: &str, j: &Json| -> Result<Option<usize>> {
        let id = j
            .as_u64()
            .with_context(|| format!("{what}: token ids must be non-negative integers"))?;
        Ok(usize::try_from(id).ok().filter(|&id| id < vocab_size))
    };
    if let Some(added) = read_json(&ckpt.dir, "added_tokens.json")? {
        let added = added
            .as_object()
            .context("added_tokens.json is not an object")?;
        for (text, id) in added {
            if let Some(id) = id_of("added_tokens.json", id)? {
                v.tokens[id] = text.clone();
                v.scores[id] = -1000.0;
                v.types[id] = USER_DEFINED;
            }
        }
    }
    if let Some(cfg) = read_json(&ckpt.dir, "tokenizer_config.json")?
        && let Some(decoder) = cfg.get("added_tokens_decoder")
    {
        let decoder = decoder
            .as_object()
            .context("tokenizer_config.json: added_tokens_decoder is not an object")?;
        for (id, data) in decoder {
            let id: u64 = id.parse().with_context(|| {
                format!("tokenizer_config.json: added_tokens_decoder key {id:?} is not an id")
            })?;
            let Some(id) = usize::try_from(id).ok().filter(|&id| id < vocab_size) else {
                continue;
            };
            let text = data
                .get("content")
                .and_then(Json::as_str)
                .with_context(|| {
                    format!("tokenizer_config.json: added token {id} has no content")
                })?;
            let special = data.get("special").and_then(Json::as_bool).unwrap_or(false);
            if special || crate::vocab::looks_special(text) {
                v.tokens[id] = text.to_string();
                v.types[id] = CONTROL;
            } else {
                v.tokens[id] = text.replace('\u{2581}', " ");
                v.types[id] = USER_DEFINED;
            }
            v.scores[id] = -1000.0;
        }
    }
    Ok(v)
}

/// Whether llama.cpp's converter takes the SentencePiece path for this checkpoint: Llama
/// (and Mistral) try `tokenizer.model` first, Gemma 3 uses it whenever it is there.
pub fn uses_sentencepiece(ckpt: &Checkpoint, arch: &str) -> bool {
    matches!(arch, "llama" | "gemma3") && ckpt.dir.join("tokenizer.model").is_file()
}

/// The tokenizer keys of `_set_vocab_sentencepiece` (plus Llama's `add_prefix_space` and
/// Gemma 3's `add_space_prefix = false`).
pub fn sentencepiece_metadata(ckpt: &Checkpoint, arch: &str) -> Result<Vec<(String, Value)>> {
    let v = sentencepiece_vocab(ckpt)?;
    let cfg = read_json(&ckpt.dir, "tokenizer_config.json")?.unwrap_or(Json::Null);
    let mut out: Vec<(String, Value)> = Vec::new();
    if arch == "llama"
        && let Some(add) = cfg.get("add_prefix_space").and_then(Json::as_bool)
    {
        out.push(("tokenizer.ggml.add_space_prefix".into(), Value::Bool(add)));
    }
    let n_vocab = v.tokens.len();
    out.push(("tokenizer.ggml.model".into(), "llama".into()));
    out.push(("tokenizer.ggml.pre".into(), "default".into()));
    out.push((
        "tokenizer.ggml.tokens".into(),
        Value::Array(
            ValueType::String,
            v.tokens.into_iter().map(Value::String).collect(),
        ),
    ));
    out.push((
        "tokenizer.ggml.scores".into(),
        Value::Array(
            ValueType::F32,
            v.scores.into_iter().map(Value::F32).collect(),
        ),
    ));
    out.push((
        "tokenizer.ggml.token_type".into(),
        Value::Array(
            ValueType::I32,
            v.types.into_iter().map(Value::I32).collect(),
        ),
    ));
    // gguf-py's SpecialVocab (no merges): tokenizer.json, when present, still gives the
    // special ids of its added tokens and the post-processor's add-BOS/EOS.
    let tok = read_json(&ckpt.dir, "tokenizer.json")?.unwrap_or(Json::Null);
    let mut added_ids: HashMap<String, usize> = HashMap::new();
    if let Some(added) = tok.get("added_tokens").and_then(Json::as_array) {
        for a in added {
            if let (Some(text), Some(id)) = (
                a.get("content").and_then(Json::as_str),
                a.get("id").and_then(Json::as_u64),
            ) {
                added_ids
                    .entry(text.to_string())
                    .or_insert(usize::try_from(id)?);
            }
        }
    }
    out.extend(crate::vocab::special_tokens(
        ckpt,
        &tok,
        &added_ids,
        Some(n_vocab),
    )?);
    if arch == "gemma3" {
        out.push(("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false)));
    }
    Ok(out)
}
