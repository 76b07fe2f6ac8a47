//! The tokenizer metadata of a byte-level BPE checkpoint (`tokenizer.json`), as
//! convert_hf_to_gguf.py's `_set_vocab_gpt2` and gguf-py's `SpecialVocab` write it:
//! tokens with their types, merges, the pre-tokenizer name, special token ids, whether to
//! add BOS/EOS, and the chat template.

use std::collections::HashMap;

use anyhow::{Context, Result, bail};
use kestrel_gguf::{Value, ValueType};
use serde_json::Value as Json;

use crate::checkpoint::{Checkpoint, read_json};

// llama.cpp's token types (gguf.TokenType).
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;

/// The special token kinds gguf-py looks for, with the key each is written under.
const SPECIAL: [(&str, &str); 7] = [
    ("bos", "tokenizer.ggml.bos_token_id"),
    ("eos", "tokenizer.ggml.eos_token_id"),
    ("unk", "tokenizer.ggml.unknown_token_id"),
    ("sep", "tokenizer.ggml.seperator_token_id"),
    ("pad", "tokenizer.ggml.padding_token_id"),
    ("cls", "tokenizer.ggml.cls_token_id"),
    ("mask", "tokenizer.ggml.mask_token_id"),
];

/// The pre-tokenizer regexes llama.cpp knows for the supported families, with the name it
/// gives each (convert_hf_to_gguf.py finds it from a hash of a sample's tokenization; the
/// regex in tokenizer.json decides that tokenization).
const PRE_TOKENIZERS: [(&str, &str); 2] = [
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        "llama-bpe",
    ),
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        "qwen2",
    ),
];

/// convert_hf_to_gguf.py's `does_token_look_special`.
pub(crate) fn looks_special(t: &str) -> bool {
    matches!(t, "<pad>" | "<mask>" | "<2mass>" | "[@BOS@]")
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<｜") && t.ends_with("｜>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

/// The pre-tokenizer's split regex, wherever tokenizer.json nests it.
fn split_regex(pre: &Json) -> Option<&str> {
    if pre.get("type").and_then(Json::as_str) == Some("Split") {
        return pre.get("pattern")?.get("Regex")?.as_str();
    }
    pre.get("pretokenizers")?
        .as_array()?
        .iter()
        .find_map(split_regex)
}

/// The tokenizer metadata pairs, in the order convert_hf_to_gguf.py writes them.
/// `arch` is the GGUF architecture: Llama and Gemma 3 checkpoints with a SentencePiece
/// `tokenizer.model` take llama.cpp's SentencePiece path ([`crate::spm`]).
pub fn tokenizer_metadata(ckpt: &Checkpoint, arch: &str) -> Result<Vec<(String, Value)>> {
    let dir = &ckpt.dir;
    if crate::spm::uses_sentencepiece(ckpt, arch) {
        return crate::spm::sentencepiece_metadata(ckpt, arch);
    }
    if dir.join("tokenizer.model").is_file() && !dir.join("tokenizer.json").is_file() {
        bail!(
            "a SentencePiece tokenizer.model converts only for llama and gemma3 checkpoints \
             (as in llama.cpp); this {arch} checkpoint needs tokenizer.json"
        );
    }
    let tok = read_json(dir, "tokenizer.json")?
        .with_context(|| format!("{} has no tokenizer.json", dir.display()))?;
    let model = tok.get("model").context("tokenizer.json has no model")?;
    if model.get("type").and_then(Json::as_str) != Some("BPE") {
        bail!(
            "tokenizer.json: only BPE tokenizers convert (this one is {:?})",
            model.get("type")
        );
    }
    let vocab = model
        .get("vocab")
        .and_then(Json::as_object)
        .context("tokenizer.json has no model.vocab object")?;
    let added: Vec<&Json> = match tok.get("added_tokens") {
        Some(Json::Array(a)) => a.iter().collect(),
        None | Some(Json::Null) => Vec::new(),
        Some(_) => bail!("tokenizer.json: added_tokens is not a list"),
    };

    // id -> (text, is added, is special)
    let mut by_id: HashMap<usize, (String, bool, bool)> = HashMap::new();
    for (text, id) in vocab {
        let id = id
            .as_u64()
            .context("tokenizer.json: vocab ids must be integers")? as usize;
        by_id.insert(id, (text.clone(), false, false));
    }
    let mut added_ids: HashMap<String, usize> = HashMap::new();
    for a in &added {
        let id = a
            .get("id")
            .and_then(Json::as_u64)
            .context("added token without id")? as usize;
        let text = a
            .get("content")
            .and_then(Json::as_str)
            .context("added token without content")?;
        let special = a.get("special").and_then(Json::as_bool).unwrap_or(false);
        by_id.insert(id, (text.to_string(), true, special));
        added_ids.entry(text.to_string()).or_insert(id);
    }
    let max_id = by_id.keys().max().copied().unwrap_or(0);
    let n_vocab = ckpt.opt_usize("vocab_size")?.unwrap_or(by_id.len());
    if max_id >= n_vocab {
        bail!("token id {max_id} is not below config.json's vocab_size {n_vocab}");
    }
    // 256 M tokens is far beyond any real vocabulary; refuse rather than allocate for it.
    if n_vocab > 1 << 28 {
        bail!("vocab_size {n_vocab} is implausibly large");
    }
    let mut tokens = Vec::with_capacity(n_vocab);
    let mut types = Vec::with_capacity(n_vocab);
    for i in 0..n_vocab {
        let (text, ty) = match by_id.get(&i) {
            None => (format!("[PAD{i}]"), UNUSED),
            Some((t, false, _)) => (t.clone(), NORMAL),
            Some((t, true, special)) if *special || looks_special(t) => (t.clone(), CONTROL),
            // User-defined tokens are stored pre-normalized (SentencePiece's ▁ as a space).
            Some((t, true, _)) => (t.replace('\u{2581}', " "), USER_DEFINED),
        };
        tokens.push(Value::String(text));
        types.push(Value::I32(ty));
    }

    let pre_regex = tok.get("pre_tokenizer").and_then(split_regex);
    let pre = match pre_regex.and_then(|r| PRE_TOKENIZERS.iter().find(|(p, _)| *p == r)) {
        Some((_, name)) => *name,
        None => bail!(
            "unrecognized pre-tokenizer in tokenizer.json (split regex {pre_regex:?}); known: {}",
            PRE_TOKENIZERS.map(|(_, n)| n).join(", ")
        ),
    };

    let mut out: Vec<(String, Value)> = vec![
        ("tokenizer.ggml.model".into(), "gpt2".into()),
        ("tokenizer.ggml.pre".into(), pre.into()),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(ValueType::String, tokens),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(ValueType::I32, types),
        ),
    ];
    let merges = merges(model)?;
    if !merges.is_empty() {
        out.push((
            "tokenizer.ggml.merges".into(),
            Value::Array(ValueType::String, merges),
        ));
    }
    out.extend(special_tokens(ckpt, &tok, &added_ids, None)?);
    Ok(out)
}

/// Merges as "a b" strings; the list-of-pairs form (transformers >= 4.45) has its spaces
/// encoded as U+0120 + 256, as gguf-py does.
fn merges(model: &Json) -> Result<Vec<Value>> {
    let Some(list) = model.get("merges").and_then(Json::as_array) else {
        return Ok(Vec::new());
    };
    list.iter()
        .map(|m| match m {
            Json::String(s) => Ok(Value::String(s.clone())),
            Json::Array(pair) if pair.len() == 2 => {
                let part = |p: &Json| -> Result<String> {
                    let s = p.as_str().context("merge parts must be strings")?;
                    Ok(s.chars()
                        .map(|c| if c == ' ' { '\u{120}' } else { c })
                        .collect())
                };
                Ok(Value::String(format!(
                    "{} {}",
                    part(&pair[0])?,
                    part(&pair[1])?
                )))
            }
            _ => bail!("tokenizer.json: unknown merges format"),
        })
        .collect()
}

/// gguf-py's `SpecialVocab`: special ids from tokenizer_config.json (resolved through the
/// added tokens) and config.json, add-BOS/EOS flags from the post-processor and
/// tokenizer_config.json, and the chat template.
/// With `n_vocab` (SentencePiece's `SpecialVocab(n_vocab=…)`), ids not below it are skipped.
pub(crate) fn special_tokens(
    ckpt: &Checkpoint,
    tok: &Json,
    added_ids: &HashMap<String, usize>,
    n_vocab: Option<usize>,
) -> Result<Vec<(String, Value)>> {
    let in_range = |id: usize| n_vocab.is_none_or(|n| id < n);
    let cfg = read_json(&ckpt.dir, "tokenizer_config.json")?.unwrap_or(Json::Null);
    let content = |kind: &str| -> Option<String> {
        match cfg.get(format!("{kind}_token"))? {
            Json::String(s) => Some(s.clone()),
            Json::Object(o) => o.get("content")?.as_str().map(str::to_string),
            _ => None,
        }
    };
    let mut add: Vec<(&str, bool)> = Vec::new();
    let set_add = |add: &mut Vec<(&str, bool)>, kind: &'static str, v: bool, force: bool| match add
        .iter_mut()
        .find(|(k, _)| *k == kind)
    {
        Some(slot) if force => slot.1 = v,
        Some(_) => {}
        None => add.push((kind, v)),
    };
    if let Some(post) = tok.get("post_processor").filter(|p| !p.is_null()) {
        let list = match post.get("processors").and_then(Json::as_array) {
            Some(l) => l.iter().collect::<Vec<_>>(),
            None => vec![post],
        };
        for p in list {
            match p.get("type").and_then(Json::as_str) {
                Some("ByteLevel") => {
                    set_add(&mut add, "bos", false, false);
                    set_add(&mut add, "eos", false, false);
                }
                Some("TemplateProcessing") => {
                    let single = p.get("single").and_then(Json::as_array);
                    let special_id = |t: Option<&Json>| -> Option<String> {
                        t?.get("SpecialToken")?
                            .get("id")?
                            .as_str()
                            .map(str::to_string)
                    };
                    if let Some(single) = single.filter(|s| s.len() > 1) {
                        if let Some(first) = special_id(single.first()) {
                            let is_bos = Some(&first) == content("bos").as_ref()
                                || Some(&first) == content("cls").as_ref();
                            set_add(&mut add, "bos", is_bos, true);
                        }
                        if let Some(last) = special_id(single.last()) {
                            set_add(&mut add, "eos", Some(last) == content("eos"), true);
                        }
                    }
                }
                _ => {}
            }
        }
    }
    let mut ids: Vec<(&str, usize)> = Vec::new();
    for (kind, _) in SPECIAL {
        if let Some(v) = cfg.get(format!("add_{kind}_token")).and_then(Json::as_bool) {
            set_add(&mut add, kind, v, false);
        }
        if let Some(id) = content(kind)
            .and_then(|c| added_ids.get(&c).copied())
            .filter(|&id| in_range(id))
        {
            ids.push((kind, id));
        }
    }
    for (kind, _) in SPECIAL {
        if ids.iter().any(|(k, _)| *k == kind) {
            continue;
        }
        if let Some(id) = ckpt
            .config
            .get(format!("{kind}_token_id"))
            .and_then(Json::as_u64)
            .filter(|&id| usize::try_from(id).is_ok_and(in_range))
        {
            ids.push((kind, id as usize));
        }
    }
    let mut out = Vec::new();
    for (kind, id) in ids {
        let key = SPECIAL
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|(_, key)| *key);
        out.push((
            key.unwrap_or_default().to_string(),
            Value::U32(u32::try_from(id)?),
        ));
    }
    for (kind, v) in add {
        if matches!(kind, "bos" | "eos" | "sep") {
            out.push((format!("tokenizer.ggml.add_{kind}_token"), Value::Bool(v)));
        }
    }
    if let Some(template) = chat_template(ckpt, &cfg)? {
        out.push(("tokenizer.chat_template".into(), template.into()));
    }
    Ok(out)
}

/// The chat template: tokenizer_config.json's, else chat_template.jinja or
/// chat_template.json. (A list of named templates keeps only the default one.)
fn chat_template(ckpt: &Checkpoint, cfg: &Json) -> Result<Option<String>> {
    let pick = |v: &Json| -> Option<String> {
        match v {
            Json::String(s) => Some(s.clone()),
            Json::Array(list) => list
                .iter()
                .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
            _ => None,
        }
    };
    if let Some(t) = cfg.get("chat_template").and_then(pick) {
        return Ok(Some(t));
    }
    let jinja = ckpt.dir.join("chat_template.jinja");
    if jinja.is_file() {
        return Ok(Some(
            std::fs::read_to_string(&jinja)
                .with_context(|| format!("cannot read {}", jinja.display()))?,
        ));
    }
    Ok(read_json(&ckpt.dir, "chat_template.json")?
        .and_then(|v| v.get("chat_template").and_then(pick)))
}
