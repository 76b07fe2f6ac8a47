//! `kestrel inspect FILE|NAME [--json]`: what is inside a GGUF file.

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::path::Path;

use anyhow::{Context, Result};
use kestrel_gguf::{GgufFile, TensorInfo, Value};
use serde_json::{Map, Value as Json, json};

#[derive(clap::Args)]
pub struct Args {
    /// GGUF file path, catalog model name or URL.
    pub model: String,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Arrays longer than this are summarized (type and length) rather than listed.
const MAX_LISTED_ELEMENTS: usize = 64;

pub fn run(args: Args) -> Result<()> {
    let path = kestrel_hub::resolve_model(&args.model)?;
    let gguf = GgufFile::open(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let report = Report::new(&path, &gguf);
    if args.json {
        let mut out = io::stdout().lock();
        serde_json::to_writer_pretty(&mut out, &report.to_json())?;
        writeln!(out)?;
    } else {
        report.write_text(&mut io::stdout().lock())?;
    }
    Ok(())
}

/// Counts for one tensor type.
#[derive(Default)]
struct TypeTotals {
    tensors: u64,
    params: u64,
    bytes: u64,
}

struct Report<'a> {
    path: &'a Path,
    gguf: &'a GgufFile,
    arch: Option<&'a str>,
    per_type: BTreeMap<&'static str, TypeTotals>,
    params: u64,
    bytes: u64,
}

impl<'a> Report<'a> {
    fn new(path: &'a Path, gguf: &'a GgufFile) -> Self {
        let mut per_type: BTreeMap<&'static str, TypeTotals> = BTreeMap::new();
        let (mut params, mut bytes) = (0u64, 0u64);
        for t in gguf.tensors() {
            let entry = per_type.entry(t.ty.name()).or_default();
            entry.tensors += 1;
            entry.params += t.n_elements();
            entry.bytes += t.n_bytes();
            params += t.n_elements();
            bytes += t.n_bytes();
        }
        Report {
            path,
            gguf,
            arch: gguf.architecture(),
            per_type,
            params,
            bytes,
        }
    }

    /// Metadata entries whose key starts with `prefix`, in file order.
    fn with_prefix(&self, prefix: &str) -> Vec<&'a (String, Value)> {
        self.gguf
            .metadata()
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .collect()
    }

    fn arch_prefix(&self) -> Option<String> {
        self.arch.map(|a| format!("{a}."))
    }

    /// Keys that are neither `general.*`, `<arch>.*` nor `tokenizer.*`.
    fn other_metadata(&self) -> Vec<&'a (String, Value)> {
        let arch = self.arch_prefix();
        self.gguf
            .metadata()
            .iter()
            .filter(|(k, _)| {
                !k.starts_with("general.")
                    && !k.starts_with("tokenizer.")
                    && !arch.as_deref().is_some_and(|a| k.starts_with(a))
            })
            .collect()
    }

    fn token_text(&self, id: Option<u64>) -> Option<&'a str> {
        let tokens = self.gguf.get_array("tokenizer.ggml.tokens")?;
        tokens.get(usize::try_from(id?).ok()?)?.as_str()
    }

    fn tokenizer_json(&self) -> Json {
        let g = self.gguf;
        let bos = g.get_u64("tokenizer.ggml.bos_token_id");
        let eos = g.get_u64("tokenizer.ggml.eos_token_id");
        json!({
            "model": g.get_str("tokenizer.ggml.model"),
            "pre": g.get_str("tokenizer.ggml.pre"),
            "vocab_size": g.get_array("tokenizer.ggml.tokens").map(|t| t.len()),
            "n_merges": g.get_array("tokenizer.ggml.merges").map(|t| t.len()),
            "bos_id": bos,
            "bos": self.token_text(bos),
            "eos_id": eos,
            "eos": self.token_text(eos),
            "add_bos": g.get_bool("tokenizer.ggml.add_bos_token"),
            "add_eos": g.get_bool("tokenizer.ggml.add_eos_token"),
            "has_chat_template": self.chat_template().is_some(),
        })
    }

    fn chat_template(&self) -> Option<&'a str> {
        self.gguf.get_str("tokenizer.chat_template")
    }

    fn to_json(&self) -> Json {
        let section = |entries: Vec<&(String, Value)>| -> Json {
            let map: Map<String, Json> = entries
                .into_iter()
                .map(|(k, v)| (k.clone(), value_json(v)))
                .collect();
            Json::Object(map)
        };
        let hyper = match self.arch_prefix() {
            Some(prefix) => section(self.with_prefix(&prefix)),
            None => Json::Object(Map::new()),
        };
        let tensors: Vec<Json> = self.gguf.tensors().iter().map(tensor_json).collect();
        let types: Map<String, Json> = self
            .per_type
            .iter()
            .map(|(name, t)| {
                let v = json!({"tensors": t.tensors, "params": t.params, "bytes": t.bytes});
                (name.to_string(), v)
            })
            .collect();
        json!({
            "file": self.path.display().to_string(),
            "file_size": self.gguf.file_size(),
            "version": self.gguf.version(),
            "alignment": self.gguf.alignment(),
            "data_offset": self.gguf.data_offset(),
            "architecture": self.arch,
            "general": section(self.with_prefix("general.")),
            "hyperparameters": hyper,
            "tokenizer": self.tokenizer_json(),
            "has_chat_template": self.chat_template().is_some(),
            "other_metadata": section(self.other_metadata()),
            "n_metadata": self.gguf.metadata().len(),
            "tensors": tensors,
            "totals": {
                "n_tensors": self.gguf.tensors().len(),
                "n_params": self.params,
                "bytes": self.bytes,
                "types": types,
            },
        })
    }

    fn write_text(&self, out: &mut impl Write) -> io::Result<()> {
        let g = self.gguf;
        writeln!(out, "file:          {}", self.path.display())?;
        writeln!(
            out,
            "format:        GGUF v{}, {} bytes, alignment {}, tensor data at byte {}",
            g.version(),
            g.file_size(),
            g.alignment(),
            g.data_offset()
        )?;
        writeln!(out, "architecture:  {}", self.arch.unwrap_or("(none)"))?;

        write_section(out, "general", &self.with_prefix("general."))?;
        if let Some(prefix) = self.arch_prefix() {
            write_section(out, "hyper-parameters", &self.with_prefix(&prefix))?;
        }

        writeln!(out, "\ntokenizer:")?;
        let opt = |v: Option<&str>| v.unwrap_or("(unset)").to_string();
        writeln!(
            out,
            "  model {}, pre {}",
            opt(g.get_str("tokenizer.ggml.model")),
            opt(g.get_str("tokenizer.ggml.pre"))
        )?;
        if let Some(tokens) = g.get_array("tokenizer.ggml.tokens") {
            let merges = g.get_array("tokenizer.ggml.merges").map_or(0, |m| m.len());
            writeln!(out, "  vocabulary {} tokens, {merges} merges", tokens.len())?;
        }
        for (label, key) in [
            ("bos", "tokenizer.ggml.bos_token_id"),
            ("eos", "tokenizer.ggml.eos_token_id"),
        ] {
            match g.get_u64(key) {
                Some(id) => writeln!(
                    out,
                    "  {label} {id} {:?}",
                    self.token_text(Some(id)).unwrap_or("?")
                ),
                None => writeln!(out, "  {label} (unset)"),
            }?;
        }
        for key in [
            "tokenizer.ggml.add_bos_token",
            "tokenizer.ggml.add_eos_token",
        ] {
            if let Some(b) = g.get_bool(key) {
                writeln!(out, "  {} {b}", key.trim_start_matches("tokenizer.ggml."))?;
            }
        }
        match self.chat_template() {
            Some(t) => writeln!(out, "  chat template: yes ({} chars)", t.chars().count()),
            None => writeln!(out, "  chat template: no"),
        }?;

        let other = self.other_metadata();
        if !other.is_empty() {
            write_section(out, "other metadata", &other)?;
        }

        let tensors = g.tensors();
        writeln!(out, "\ntensors ({}):", tensors.len())?;
        let name_width = tensors
            .iter()
            .map(|t| t.name.len())
            .max()
            .unwrap_or(4)
            // Longer names push their row's columns right instead: a format width is at
            // most 65,535, and a hostile file's tensor name can be longer.
            .clamp(4, MAX_NAME_COLUMN);
        writeln!(
            out,
            "  {:<name_width$}  {:<6}  {:<22}  {:>12}",
            "name", "type", "shape", "bytes"
        )?;
        for t in tensors {
            writeln!(
                out,
                "  {:<name_width$}  {:<6}  {:<22}  {:>12}",
                t.name,
                t.ty.name(),
                shape_text(t),
                t.n_bytes()
            )?;
        }

        writeln!(out, "\ntotals:")?;
        writeln!(
            out,
            "  parameters  {} ({})",
            self.params,
            human_count(self.params)
        )?;
        writeln!(
            out,
            "  bytes       {} ({})",
            self.bytes,
            human_bytes(self.bytes)
        )?;
        for (name, t) in &self.per_type {
            writeln!(
                out,
                "  {name:<6} {:>4} tensors  {:>14} params  {:>12}",
                t.tensors,
                t.params,
                human_bytes(t.bytes)
            )?;
        }
        Ok(())
    }
}

/// Widest the tensor-name column is padded to.
const MAX_NAME_COLUMN: usize = 96;

fn write_section(
    out: &mut impl Write,
    title: &str,
    entries: &[&(String, Value)],
) -> io::Result<()> {
    writeln!(out, "\n{title}:")?;
    if entries.is_empty() {
        writeln!(out, "  (none)")?;
    }
    for (k, v) in entries {
        writeln!(out, "  {k} = {}", value_text(v))?;
    }
    Ok(())
}

fn tensor_json(t: &TensorInfo) -> Json {
    json!({
        "name": t.name,
        "type": t.ty.name(),
        "shape": t.dims,
        "n_elements": t.n_elements(),
        "bytes": t.n_bytes(),
        "offset": t.offset,
    })
}

fn shape_text(t: &TensorInfo) -> String {
    let dims: Vec<String> = t.dims.iter().map(u64::to_string).collect();
    format!("[{}]", dims.join(", "))
}

/// JSON for a metadata value; long arrays become `{"type", "len"}` summaries.
fn value_json(v: &Value) -> Json {
    match v {
        Value::U8(x) => json!(x),
        Value::I8(x) => json!(x),
        Value::U16(x) => json!(x),
        Value::I16(x) => json!(x),
        Value::U32(x) => json!(x),
        Value::I32(x) => json!(x),
        Value::U64(x) => json!(x),
        Value::I64(x) => json!(x),
        // Non-finite floats have no JSON form: serde_json turns them into null.
        Value::F32(x) => json!(x),
        Value::F64(x) => json!(x),
        Value::Bool(x) => json!(x),
        Value::String(s) => json!(s),
        Value::Array(ty, items) if items.len() > MAX_LISTED_ELEMENTS => {
            json!({"type": ty.name(), "len": items.len()})
        }
        Value::Array(_, items) => Json::Array(items.iter().map(value_json).collect()),
    }
}

/// One-line text for a metadata value.
fn value_text(v: &Value) -> String {
    match v {
        Value::String(s) => {
            let shown: String = s.chars().take(100).collect();
            let more = if s.chars().count() > 100 { "…" } else { "" };
            format!("{shown:?}{more}")
        }
        Value::Array(ty, items) => {
            let shown: Vec<String> = items.iter().take(8).map(value_text).collect();
            let more = if items.len() > 8 { ", …" } else { "" };
            format!("[{ty}; {}] [{}{more}]", items.len(), shown.join(", "))
        }
        Value::F32(x) => x.to_string(),
        Value::F64(x) => x.to_string(),
        other => match (other.as_u64(), other.as_i64(), other.as_bool()) {
            (Some(u), _, _) => u.to_string(),
            (None, Some(i), _) => i.to_string(),
            (_, _, Some(b)) => b.to_string(),
            _ => format!("{other:?}"),
        },
    }
}

fn human_count(n: u64) -> String {
    let x = n as f64;
    if x >= 1e9 {
        format!("{:.2} B", x / 1e9)
    } else if x >= 1e6 {
        format!("{:.1} M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1} K", x / 1e3)
    } else {
        n.to_string()
    }
}

fn human_bytes(n: u64) -> String {
    let x = n as f64;
    const MIB: f64 = 1024.0 * 1024.0;
    if x >= 1024.0 * MIB {
        format!("{:.2} GiB", x / (1024.0 * MIB))
    } else if x >= MIB {
        format!("{:.1} MiB", x / MIB)
    } else if x >= 1024.0 {
        format!("{:.1} KiB", x / 1024.0)
    } else {
        format!("{n} B")
    }
}
