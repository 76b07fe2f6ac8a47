//! `kestrel convert`: a Hugging Face checkpoint to GGUF, as llama.cpp's convert_hf_to_gguf.py
//! does it for the architectures Kestrel runs (Llama, Qwen2, Qwen3, Gemma 3): the same tensor
//! names, the same value transformations (Llama's Q/K row permutation, Gemma's `1 + w` norms
//! and vocabulary trim, Llama 3's `rope_freqs`), the same tensor types, the same
//! architecture metadata keys, and the tokenizer from [`crate::vocab`].
//!
//! With a quantized `--type` beyond the converter's own (F32, F16, BF16, Q8_0), the tensors are
//! quantized straight from the checkpoint's values with llama-quantize's per-tensor choices:
//! the same file as converting to the checkpoint's 16-bit type and then quantizing.

use std::path::Path;

use anyhow::{Context, Result, bail};
use indicatif::ProgressBar;
use kestrel_gguf::{GgmlType, GgufWriter, Value};
use kestrel_quant::{f16_to_f32, f32_to_f16, quantize_row, row_bytes};
use rayon::prelude::*;
use safetensors::Dtype;
use serde_json::Value as Json;

use crate::checkpoint::{Checkpoint, TensorRef};
use crate::ftype::{FileType, ModelFacts, choose_types};

/// The architectures `convert` knows: (Hugging Face class, GGUF architecture).
pub const ARCHITECTURES: [(&str, &str); 5] = [
    ("LlamaForCausalLM", "llama"),
    ("MistralForCausalLM", "llama"),
    ("Qwen2ForCausalLM", "qwen2"),
    ("Qwen3ForCausalLM", "qwen3"),
    ("Gemma3ForCausalLM", "gemma3"),
];

/// One output tensor: where its values come from and what is done to them.
struct Planned {
    name: String,
    /// GGUF order: row length first.
    dims: Vec<u64>,
    ty: GgmlType,
    source: Source,
}

enum Source {
    /// A checkpoint tensor and the transformation it needs.
    Checkpoint {
        hf_name: String,
        t: TensorRef,
        fix: Fix,
    },
    /// Values computed by the converter (Llama 3's rope_freqs).
    Generated(Vec<f32>),
}

#[derive(Clone, Copy)]
enum Fix {
    None,
    /// Llama's Q/K rows from Hugging Face's rotate-half layout to GGML's interleaved one.
    Permute {
        n_head: usize,
    },
    /// Gemma's RMSNorm multiplies by `1 + w`; GGUF stores `1 + w`.
    AddOne,
    /// Keep only the first `rows` rows (Gemma 3's embedding beyond the real vocabulary).
    Truncate {
        rows: usize,
    },
}

/// A parsed checkpoint ready to be written.
pub struct Conversion {
    ckpt: Checkpoint,
    pub arch: &'static str,
    pub ftype: FileType,
    metadata: Vec<(String, Value)>,
    tensors: Vec<Planned>,
}

impl Conversion {
    /// Reads the checkpoint in `dir` and plans the GGUF file of type `ftype`.
    pub fn new(dir: &Path, ftype: FileType) -> Result<Conversion> {
        // The architecture first: an unsupported one is reported before any weight is read.
        let config = crate::checkpoint::read_config(dir)?;
        let hf_arch = config
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Json::as_str)
            .context("config.json has no architectures list")?
            .to_string();
        let Some(&(_, arch)) = ARCHITECTURES.iter().find(|(hf, _)| *hf == hf_arch) else {
            bail!(
                "unsupported architecture {hf_arch}: kestrel convert handles {}",
                ARCHITECTURES.map(|(hf, _)| hf).join(", ")
            );
        };
        let ckpt = Checkpoint::open(dir)?;
        let mut metadata = arch_metadata(&ckpt, arch, ftype)?;
        metadata.extend(crate::vocab::tokenizer_metadata(&ckpt, arch)?);
        let mut tensors = plan_tensors(&ckpt, arch)?;
        assign_types(&ckpt, arch, ftype, &mut tensors)?;
        Ok(Conversion {
            ckpt,
            arch,
            ftype,
            metadata,
            tensors,
        })
    }

    /// Bytes of tensor data to read (for a progress bar).
    pub fn input_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .map(|t| match &t.source {
                Source::Checkpoint { t, .. } => self.ckpt.bytes(t).len() as u64,
                Source::Generated(v) => 4 * v.len() as u64,
            })
            .sum()
    }

    pub fn n_tensors(&self) -> usize {
        self.tensors.len()
    }

    /// Writes the GGUF file (through a temporary file renamed when complete).
    pub fn write(&self, output: &Path, progress: &ProgressBar) -> Result<()> {
        let mut writer = GgufWriter::new();
        for (k, v) in &self.metadata {
            writer.set_metadata(k.clone(), v.clone())?;
        }
        for t in &self.tensors {
            writer.add_tensor(t.name.clone(), &t.dims, t.ty)?;
        }
        let mut stream = writer
            .stream_to_path(output)
            .with_context(|| format!("cannot create {}", output.display()))?;
        for t in &self.tensors {
            let (values, read) = match &t.source {
                Source::Checkpoint { hf_name, t: r, fix } => {
                    let v = self.ckpt.values(hf_name, r)?;
                    let v = apply_fix(v, r, *fix).with_context(|| format!("tensor {hf_name}"))?;
                    (v, self.ckpt.bytes(r).len())
                }
                Source::Generated(v) => (v.clone(), 4 * v.len()),
            };
            stream.write_tensor(&encode(&values, t.dims[0] as usize, t.ty)?)?;
            progress.inc(read as u64);
        }
        stream.finish()?;
        Ok(())
    }
}

/// Values in `ty`, rows spread over rayon's threads.
fn encode(values: &[f32], row_len: usize, ty: GgmlType) -> Result<Vec<u8>> {
    let row = row_bytes(ty, row_len)?;
    let n_rows = values.len() / row_len.max(1);
    let mut out = vec![0u8; n_rows * row];
    let rows_per_task = (1usize << 16).div_ceil(row_len.max(1));
    out.par_chunks_mut(rows_per_task * row)
        .zip(values.par_chunks(rows_per_task * row_len))
        .try_for_each(|(o, v)| quantize_row(ty, v, o))?;
    Ok(out)
}

fn apply_fix(mut v: Vec<f32>, t: &TensorRef, fix: Fix) -> Result<Vec<f32>> {
    let cols: usize = t.shape.iter().skip(1).product();
    match fix {
        Fix::None => {}
        Fix::AddOne => {
            for x in &mut v {
                // The converter adds in the tensor's own dtype: f16 stays f16, others are
                // f32 by then.
                *x = if t.dtype == Dtype::F16 {
                    f16_to_f32(f32_to_f16(*x + 1.0))
                } else {
                    *x + 1.0
                };
            }
        }
        Fix::Truncate { rows } => v.truncate(rows * cols.max(1)),
        Fix::Permute { n_head } => {
            let rows = t.shape[0];
            if n_head == 0 || !rows.is_multiple_of(2 * n_head) {
                bail!("{rows} rows do not split into {n_head} heads of pairs");
            }
            let (hd, cols) = (rows / n_head, cols.max(1));
            let half = hd / 2;
            let mut out = vec![0f32; v.len()];
            // reshape(n_head, 2, hd/2, cols).swapaxes(1, 2): new row h*hd + 2i + s is old
            // row h*hd + s*hd/2 + i.
            for h in 0..n_head {
                for i in 0..half {
                    for s in 0..2 {
                        let (new, old) = (h * hd + 2 * i + s, h * hd + s * half + i);
                        out[new * cols..(new + 1) * cols]
                            .copy_from_slice(&v[old * cols..(old + 1) * cols]);
                    }
                }
            }
            v = out;
        }
    }
    Ok(v)
}

/// The GGUF name of a Hugging Face tensor (`None`: not written), as gguf-py's tensor map.
fn gguf_name(arch: &str, hf: &str) -> Result<Option<String>> {
    if hf.ends_with(".rotary_emb.inv_freq")
        || hf.ends_with(".attention.masked_bias")
        || hf.ends_with(".attention.bias")
    {
        return Ok(None);
    }
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(n) = fixed {
        return Ok(Some(n.to_string()));
    }
    let unknown = || anyhow::anyhow!("cannot map tensor {hf} of a {arch} checkpoint");
    let rest = hf.strip_prefix("model.layers.").ok_or_else(unknown)?;
    let (layer, part) = rest.split_once('.').ok_or_else(unknown)?;
    let layer: usize = layer.parse().map_err(|_| unknown())?;
    let (stem, suffix) = part.rsplit_once('.').ok_or_else(unknown)?;
    let gemma = arch == "gemma3";
    let mapped = match stem {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "post_attention_layernorm" if gemma => "post_attention_norm",
        "post_attention_layernorm" => "ffn_norm",
        "pre_feedforward_layernorm" if gemma => "ffn_norm",
        "post_feedforward_layernorm" if gemma => "post_ffw_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return Err(unknown()),
    };
    if !matches!(suffix, "weight" | "bias") {
        return Err(unknown());
    }
    Ok(Some(format!("blk.{layer}.{mapped}.{suffix}")))
}

/// Every output tensor, in the checkpoint's (name-sorted) order, with Llama 3's generated
/// rope_freqs first as the converter emits it.
fn plan_tensors(ckpt: &Checkpoint, arch: &'static str) -> Result<Vec<Planned>> {
    let mut out = Vec::new();
    if arch == "llama"
        && let Some(factors) = llama3_rope_factors(ckpt)?
    {
        out.push(Planned {
            name: "rope_freqs.weight".into(),
            dims: vec![factors.len() as u64],
            ty: GgmlType::F32,
            source: Source::Generated(factors),
        });
    }
    let n_head = ckpt.usize("num_attention_heads").unwrap_or(0);
    let n_head_kv = ckpt.opt_usize("num_key_value_heads")?.unwrap_or(n_head);
    let n_layer = ckpt.usize("num_hidden_layers")?;
    for (hf, t) in &ckpt.tensors {
        let Some(name) = gguf_name(arch, hf)? else {
            continue;
        };
        if let Some(layer) = name.strip_prefix("blk.").and_then(|r| r.split('.').next())
            && layer.parse::<usize>().is_ok_and(|l| l >= n_layer)
        {
            bail!("tensor {hf} is beyond num_hidden_layers = {n_layer}");
        }
        if !matches!(t.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
            bail!(
                "tensor {hf} has dtype {:?}; only F32, F16 and BF16 convert",
                t.dtype
            );
        }
        if t.shape.is_empty() || t.shape.len() > 2 || t.shape.contains(&0) {
            bail!(
                "tensor {hf} has shape {:?}; expected a vector or a matrix",
                t.shape
            );
        }
        let mut shape = t.shape.clone();
        let fix = if arch == "llama" && (hf.contains("q_proj.") || hf.contains("k_proj.")) {
            let heads = if hf.contains("k_proj.") {
                n_head_kv
            } else {
                n_head
            };
            Fix::Permute { n_head: heads }
        } else if arch == "gemma3" && hf.ends_with("norm.weight") {
            Fix::AddOne
        } else if arch == "gemma3" && hf == "model.embed_tokens.weight" {
            let rows = gemma_vocab_rows(ckpt)?.min(shape[0]);
            shape[0] = rows;
            Fix::Truncate { rows }
        } else {
            Fix::None
        };
        out.push(Planned {
            name,
            dims: shape.iter().rev().map(|&d| d as u64).collect(),
            ty: GgmlType::F32,
            source: Source::Checkpoint {
                hf_name: hf.clone(),
                t: t.clone(),
                fix,
            },
        });
    }
    if !out.iter().any(|t| t.name == "token_embd.weight") {
        bail!("the checkpoint has no model.embed_tokens.weight");
    }
    Ok(out)
}

/// Gemma 3's real vocabulary: the SentencePiece vocabulary's length when there is a
/// tokenizer.model, else tokenizer.json's tokens plus its added tokens.
fn gemma_vocab_rows(ckpt: &Checkpoint) -> Result<usize> {
    if ckpt.dir.join("tokenizer.model").is_file() {
        return Ok(crate::spm::sentencepiece_vocab(ckpt)?.tokens.len());
    }
    let tok =
        crate::checkpoint::read_json(&ckpt.dir, "tokenizer.json")?.context("no tokenizer.json")?;
    let vocab = tok["model"]["vocab"].as_object().map_or(0, |m| m.len());
    let added = tok["added_tokens"].as_array().map_or(0, |a| a.len());
    Ok(vocab + added)
}

/// The converter's type for each tensor: vectors, norms and biases F32; matrices the file
/// type (Q8_0 falling back to F16 for rows that are not whole blocks). Mixtures follow
/// llama-quantize from the checkpoint's 16-bit type.
fn assign_types(
    ckpt: &Checkpoint,
    arch: &str,
    ftype: FileType,
    tensors: &mut [Planned],
) -> Result<()> {
    let is_matrix = |t: &Planned| {
        t.dims.len() >= 2 && t.name.ends_with(".weight") && !t.name.ends_with("_norm.weight")
    };
    if matches!(
        ftype,
        FileType::F32 | FileType::F16 | FileType::BF16 | FileType::Q8_0
    ) {
        for t in tensors.iter_mut() {
            t.ty = if !is_matrix(t) {
                GgmlType::F32
            } else if ftype == FileType::Q8_0 && !t.dims[0].is_multiple_of(32) {
                GgmlType::F16
            } else {
                ftype.default_type()
            };
        }
        return Ok(());
    }
    let source16 = |t: &Planned| match &t.source {
        Source::Checkpoint { t, .. } if t.dtype == Dtype::F16 => GgmlType::F16,
        _ => GgmlType::BF16,
    };
    let list: Vec<(&str, &[u64], GgmlType)> = tensors
        .iter()
        .map(|t| {
            let ty = if is_matrix(t) {
                source16(t)
            } else {
                GgmlType::F32
            };
            (t.name.as_str(), t.dims.as_slice(), ty)
        })
        .collect();
    let n_head = ckpt.opt_usize("num_attention_heads")?.unwrap_or(0) as i64;
    let n_head_kv = ckpt
        .opt_usize("num_key_value_heads")?
        .map_or(n_head, |v| v as i64);
    let n_layer = ckpt.usize("num_hidden_layers")? as i64;
    let facts = ModelFacts {
        arch: arch.to_string(),
        n_layer,
        n_gqa: if n_head > 0 && n_head_kv > 0 {
            n_head / n_head_kv
        } else {
            1
        },
        n_expert: 0,
        is_70b: n_layer == 80 && (arch == "qwen2" || (arch == "llama" && n_head != n_head_kv)),
        tied_embeddings: !list.iter().any(|t| t.0 == "output.weight"),
        n_attention_wv: list
            .iter()
            .filter(|t| t.0.contains("attn_v.weight"))
            .count() as i64,
        has_imatrix: false,
    };
    let types = choose_types(&facts, ftype, &list)?;
    for (t, ty) in tensors.iter_mut().zip(types) {
        t.ty = ty;
    }
    Ok(())
}

/// Llama 3's RoPE frequency factors (`rope_scaling.rope_type == "llama3"`), computed in f32
/// as the converter does.
fn llama3_rope_factors(ckpt: &Checkpoint) -> Result<Option<Vec<f32>>> {
    let params = rope_params(&ckpt.config);
    let ty = params.get("rope_type").and_then(Json::as_str).unwrap_or("");
    if !ty.eq_ignore_ascii_case("llama3") {
        return Ok(None);
    }
    let num = |k: &str, d: f64| params.get(k).and_then(Json::as_f64).unwrap_or(d);
    let base = num("rope_theta", 10000.0) as f32;
    let dim = match ckpt.opt_usize("head_dim")? {
        Some(d) => d,
        None => ckpt.usize("hidden_size")? / ckpt.usize("num_attention_heads")?.max(1),
    };
    let factor = num("factor", 8.0) as f32;
    let low = num("low_freq_factor", 1.0) as f32;
    let high = num("high_freq_factor", 4.0) as f32;
    let old_ctx = num("original_max_position_embeddings", 8192.0) as f32;
    let (low_wavelen, high_wavelen) = (old_ctx / low, old_ctx / high);
    let factors = (0..dim)
        .step_by(2)
        .map(|i| {
            let freq = 1.0 / base.powf(i as f32 / dim as f32);
            let wavelen = 2.0 * std::f32::consts::PI / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (old_ctx / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect();
    Ok(Some(factors))
}

/// The RoPE parameters: `rope_parameters` (newer configs) or `rope_scaling`, with the
/// top-level `rope_theta` mirrored in, as the converter does.
fn rope_params(config: &Json) -> serde_json::Map<String, Json> {
    let mut p = config
        .get("rope_parameters")
        .or_else(|| config.get("rope_scaling"))
        .and_then(Json::as_object)
        .cloned()
        .unwrap_or_default();
    if !p.contains_key("rope_theta")
        && let Some(theta) = config.get("rope_theta").filter(|v| v.is_number())
    {
        p.insert("rope_theta".into(), theta.clone());
    }
    if !p.contains_key("rope_type")
        && let Some(ty) = p.get("type").cloned()
    {
        p.insert("rope_type".into(), ty);
    }
    p
}

/// `general.*` and the architecture's hyper-parameters, as convert_hf_to_gguf.py writes them.
fn arch_metadata(ckpt: &Checkpoint, arch: &str, ftype: FileType) -> Result<Vec<(String, Value)>> {
    let mut m: Vec<(String, Value)> = Vec::new();
    let mut put = |k: &str, v: Value| {
        let key = if k.starts_with("general.") {
            k.to_string()
        } else {
            format!("{arch}.{k}")
        };
        match m.iter_mut().find(|(have, _)| *have == key) {
            Some(slot) => slot.1 = v,
            None => m.push((key, v)),
        }
    };
    let u32v = |v: usize| -> Result<Value> { Ok(Value::U32(u32::try_from(v)?)) };
    put("general.architecture", arch.into());
    put("general.type", "model".into());
    let name = ckpt
        .dir
        .canonicalize()
        .ok()
        .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "model".into());
    put("general.name", name.into());
    put("block_count", u32v(ckpt.usize("num_hidden_layers")?)?);
    if let Some(n) = ckpt.opt_usize("max_position_embeddings")? {
        put("context_length", u32v(n)?);
    }
    put("embedding_length", u32v(ckpt.usize("hidden_size")?)?);
    if let Some(n) = ckpt.opt_usize("intermediate_size")? {
        put("feed_forward_length", u32v(n)?);
    }
    if let Some(n) = ckpt.opt_usize("num_attention_heads")? {
        put("attention.head_count", u32v(n)?);
    }
    if let Some(n) = ckpt.opt_usize("num_key_value_heads")? {
        put("attention.head_count_kv", u32v(n)?);
    }
    let rope = rope_params(&ckpt.config);
    let rope_factor = rope.get("factor").and_then(Json::as_f64);
    match (rope.get("rope_type").and_then(Json::as_str), rope_factor) {
        (Some("linear"), Some(f)) => {
            put("rope.scaling.type", "linear".into());
            put("rope.scaling.factor", Value::F32(f as f32));
        }
        (Some("yarn"), Some(f)) => {
            put("rope.scaling.type", "yarn".into());
            put("rope.scaling.factor", Value::F32(f as f32));
            let orig = rope
                .get("original_max_position_embeddings")
                .and_then(Json::as_u64)
                .context("yarn rope scaling without original_max_position_embeddings")?;
            put("rope.scaling.original_context_length", u32v(orig as usize)?);
        }
        _ => {}
    }
    if let Some(theta) = rope.get("rope_theta").and_then(Json::as_f64) {
        put("rope.freq_base", Value::F32(theta as f32));
    }
    let local_theta = ["local_rope_theta", "rope_local_base_freq"]
        .iter()
        .find_map(|k| ckpt.config.get(*k).and_then(Json::as_f64));
    if let Some(theta) = local_theta {
        put("rope.freq_base_swa", Value::F32(theta as f32));
    }
    if let Some(eps) = ckpt.opt_f64("rms_norm_eps")? {
        put("attention.layer_norm_rms_epsilon", Value::F32(eps as f32));
    }
    if let Some(hd) = ckpt.opt_usize("head_dim")? {
        put("attention.key_length", u32v(hd)?);
        put("attention.value_length", u32v(hd)?);
    }
    put("general.file_type", Value::U32(ftype.id()));
    match arch {
        "llama" => {
            put("vocab_size", u32v(ckpt.usize("vocab_size")?)?);
            let rope_dim = match ckpt.opt_usize("head_dim")? {
                Some(d) => d,
                None => ckpt.usize("hidden_size")? / ckpt.usize("num_attention_heads")?.max(1),
            };
            put("rope.dimension_count", u32v(rope_dim)?);
        }
        "gemma3" => {
            // Gemma3Model.set_gguf_parameters: its defaults where config.json is silent.
            let or = |k: &str, d: usize| -> Result<usize> { Ok(ckpt.opt_usize(k)?.unwrap_or(d)) };
            put(
                "context_length",
                u32v(or("max_position_embeddings", 131072)?)?,
            );
            put("attention.head_count", u32v(or("num_attention_heads", 8)?)?);
            let eps = ckpt.opt_f64("rms_norm_eps")?.unwrap_or(1e-6);
            put("attention.layer_norm_rms_epsilon", Value::F32(eps as f32));
            put("attention.key_length", u32v(or("head_dim", 256)?)?);
            put("attention.value_length", u32v(or("head_dim", 256)?)?);
            let theta = rope.get("rope_theta").and_then(Json::as_f64).unwrap_or(1e6);
            put("rope.freq_base", Value::F32(theta as f32));
            if let Some(cap) = ckpt
                .opt_f64("final_logit_softcapping")?
                .filter(|&c| c != 0.0)
            {
                put("final_logit_softcapping", Value::F32(cap as f32));
            }
            if ckpt.opt_usize("sliding_window_pattern")? != Some(1) {
                put(
                    "attention.sliding_window",
                    u32v(ckpt.usize("sliding_window")?)?,
                );
            }
            put(
                "attention.head_count_kv",
                u32v(or("num_key_value_heads", 4)?)?,
            );
        }
        _ => {}
    }
    put("general.quantization_version", Value::U32(2));
    // Sampling defaults from generation_config.json, as gguf-py's metadata does.
    if let Some(generation) = crate::checkpoint::read_json(&ckpt.dir, "generation_config.json")
        .ok()
        .flatten()
    {
        for (hf, key) in [("top_k", "general.sampling.top_k")] {
            if let Some(v) = generation.get(hf).and_then(Json::as_i64) {
                put(key, Value::I32(i32::try_from(v)?));
            }
        }
        for (hf, key) in [
            ("top_p", "general.sampling.top_p"),
            ("min_p", "general.sampling.min_p"),
            ("temperature", "general.sampling.temp"),
            ("repetition_penalty", "general.sampling.penalty_repeat"),
        ] {
            if let Some(v) = generation.get(hf).and_then(Json::as_f64) {
                put(key, Value::F32(v as f32));
            }
        }
    }
    Ok(m)
}
