//! llama.cpp's file types (`LLAMA_FTYPE_*`, the `TYPE` argument of llama-quantize) and its
//! per-tensor choice of GGML type for each (`llama_tensor_get_type` in llama-quant.cpp).
//!
//! A "mixture" such as Q4_K_M keeps the most sensitive tensors (the output projection, some
//! layers' `attn_v` and `ffn_down`) at a higher precision than its base type. The rules here
//! are llama.cpp's, restricted to the types Kestrel reads; the branches for the IQ types and
//! other file types llama.cpp has are left out.

use anyhow::{Result, bail};
use kestrel_quant::GgmlType;

/// The file types `kestrel quantize` writes, with llama.cpp's ids and names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FileType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q2KS,
    Q3KS,
    Q3KM,
    Q3KL,
    Q4KS,
    Q4KM,
    Q5KS,
    Q5KM,
    Q6K,
}

impl FileType {
    pub const ALL: [FileType; 18] = [
        FileType::F32,
        FileType::F16,
        FileType::BF16,
        FileType::Q4_0,
        FileType::Q4_1,
        FileType::Q5_0,
        FileType::Q5_1,
        FileType::Q8_0,
        FileType::Q2K,
        FileType::Q2KS,
        FileType::Q3KS,
        FileType::Q3KM,
        FileType::Q3KL,
        FileType::Q4KS,
        FileType::Q4KM,
        FileType::Q5KS,
        FileType::Q5KM,
        FileType::Q6K,
    ];

    /// The name llama-quantize takes (upper case).
    pub fn name(self) -> &'static str {
        match self {
            FileType::F32 => "F32",
            FileType::F16 => "F16",
            FileType::BF16 => "BF16",
            FileType::Q4_0 => "Q4_0",
            FileType::Q4_1 => "Q4_1",
            FileType::Q5_0 => "Q5_0",
            FileType::Q5_1 => "Q5_1",
            FileType::Q8_0 => "Q8_0",
            FileType::Q2K => "Q2_K",
            FileType::Q2KS => "Q2_K_S",
            FileType::Q3KS => "Q3_K_S",
            FileType::Q3KM => "Q3_K_M",
            FileType::Q3KL => "Q3_K_L",
            FileType::Q4KS => "Q4_K_S",
            FileType::Q4KM => "Q4_K_M",
            FileType::Q5KS => "Q5_K_S",
            FileType::Q5KM => "Q5_K_M",
            FileType::Q6K => "Q6_K",
        }
    }

    /// Parses a llama-quantize type name (case-insensitive). `Q3_K`, `Q4_K` and `Q5_K` are
    /// aliases of their `_M` mixtures, as in llama-quantize.
    pub fn parse(name: &str) -> Result<FileType> {
        let upper = name.to_ascii_uppercase();
        let alias = match upper.as_str() {
            "Q3_K" => Some(FileType::Q3KM),
            "Q4_K" => Some(FileType::Q4KM),
            "Q5_K" => Some(FileType::Q5KM),
            _ => None,
        };
        if let Some(ty) = alias.or_else(|| Self::ALL.into_iter().find(|t| t.name() == upper)) {
            return Ok(ty);
        }
        let names: Vec<&str> = Self::ALL.iter().map(|t| t.name()).collect();
        bail!(
            "unknown quantization type '{name}' (expected one of {}, or Q3_K, Q4_K, Q5_K)",
            names.join(", ")
        )
    }

    /// `LLAMA_FTYPE_*`, written as `general.file_type`.
    pub fn id(self) -> u32 {
        match self {
            FileType::F32 => 0,
            FileType::F16 => 1,
            FileType::Q4_0 => 2,
            FileType::Q4_1 => 3,
            FileType::Q8_0 => 7,
            FileType::Q5_0 => 8,
            FileType::Q5_1 => 9,
            FileType::Q2K => 10,
            FileType::Q3KS => 11,
            FileType::Q3KM => 12,
            FileType::Q3KL => 13,
            FileType::Q4KS => 14,
            FileType::Q4KM => 15,
            FileType::Q5KS => 16,
            FileType::Q5KM => 17,
            FileType::Q6K => 18,
            FileType::Q2KS => 21,
            FileType::BF16 => 32,
        }
    }

    /// The type of most matrices (`llama_ftype_get_default_type`).
    pub fn default_type(self) -> GgmlType {
        match self {
            FileType::F32 => GgmlType::F32,
            FileType::F16 => GgmlType::F16,
            FileType::BF16 => GgmlType::BF16,
            FileType::Q4_0 => GgmlType::Q4_0,
            FileType::Q4_1 => GgmlType::Q4_1,
            FileType::Q5_0 => GgmlType::Q5_0,
            FileType::Q5_1 => GgmlType::Q5_1,
            FileType::Q8_0 => GgmlType::Q8_0,
            FileType::Q2K | FileType::Q2KS => GgmlType::Q2K,
            FileType::Q3KS | FileType::Q3KM | FileType::Q3KL => GgmlType::Q3K,
            FileType::Q4KS | FileType::Q4KM => GgmlType::Q4K,
            FileType::Q5KS | FileType::Q5KM => GgmlType::Q5K,
            FileType::Q6K => GgmlType::Q6K,
        }
    }
}

impl std::fmt::Display for FileType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether a tensor is a weight that llama.cpp quantizes at all (`tensor_allows_quantization`,
/// the parts that concern the architectures Kestrel runs): matrices named `*weight`, except
/// norms, MoE routers and a few small or positional tables.
pub fn allows_quantization(name: &str, n_dims: usize) -> bool {
    const KEEP: [&str; 6] = [
        "_norm.weight",
        "ffn_gate_inp.weight",
        "altup",
        "laurel",
        "per_layer_model_proj",
        "attn_rel_b.weight",
    ];
    n_dims >= 2
        && name.ends_with("weight")
        && !KEEP.iter().any(|k| name.contains(k))
        && name != "position_embd.weight"
        && name != "token_types.weight"
}

/// llama.cpp's broad tensor categories (`tensor_get_category`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Category {
    Output,
    TokenEmbd,
    /// `attn_v`, and the fused `attn_qkv` / `attn_kv_b` that contain it.
    AttnV,
    AttnK,
    AttnOutput,
    FfnDown,
    Other,
}

fn category(name: &str) -> Category {
    if name == "output.weight" {
        Category::Output
    } else if name == "token_embd.weight" || name == "per_layer_token_embd.weight" {
        Category::TokenEmbd
    } else if ["attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight"]
        .iter()
        .any(|k| name.contains(k))
    {
        Category::AttnV
    } else if name.contains("attn_k.weight") {
        Category::AttnK
    } else if name.contains("attn_output.weight") {
        Category::AttnOutput
    } else if name.contains("ffn_down") {
        Category::FfnDown
    } else {
        Category::Other
    }
}

/// The layer number in a `blk.N.` name, if any.
fn layer_of(name: &str) -> Option<i64> {
    let rest = name.strip_prefix("blk.")?;
    rest[..rest.find('.')?].parse().ok()
}

/// llama.cpp's `use_more_bits`: the first and last eighth of the layers, and every third
/// layer in between.
fn use_more_bits(i: i64, n: i64) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// What the type choice needs to know about the model (from its metadata and tensor list).
#[derive(Debug, Clone, Default)]
pub struct ModelFacts {
    /// `general.architecture`.
    pub arch: String,
    /// `{arch}.block_count`.
    pub n_layer: i64,
    /// Query heads per key/value head (`n_head / n_head_kv`, 1 if unknown).
    pub n_gqa: i64,
    /// `{arch}.expert_count` (0 for dense models).
    pub n_expert: i64,
    /// llama.cpp classifies the model as 70B (80 layers of grouped-query attention).
    pub is_70b: bool,
    /// No `output.weight`: the LM head is `token_embd.weight`.
    pub tied_embeddings: bool,
    /// Number of `attn_v`-like tensors (llama.cpp's `n_attention_wv`).
    pub n_attention_wv: i64,
    /// An importance matrix was given.
    pub has_imatrix: bool,
}

/// Chooses the type of every tensor as llama-quantize does. `tensors` are (name, dims,
/// current type); the result is in the same order.
///
/// llama.cpp walks the tensors sorted by layer number, then name, counting the `attn_v`
/// tensors it has seen; the count (not the layer number) picks the layers that get more bits.
/// The same walk is done here, whatever order the file has.
pub fn choose_types(
    facts: &ModelFacts,
    ftype: FileType,
    tensors: &[(&str, &[u64], GgmlType)],
) -> Result<Vec<GgmlType>> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&a, &b| {
        let key = |i: usize| (layer_of(tensors[i].0).unwrap_or(-1), tensors[i].0);
        key(a).cmp(&key(b))
    });
    let mut out = vec![GgmlType::F32; tensors.len()];
    let mut i_attention_wv = 0i64;
    let mut i_ffn_down = 0i64;
    for i in order {
        let (name, dims, cur) = tensors[i];
        out[i] = if !allows_quantization(name, dims.len()) {
            cur
        } else {
            let default = ftype.default_type();
            let chosen = if is_quantized(default) {
                mixture_type(
                    facts,
                    ftype,
                    name,
                    dims,
                    &mut i_attention_wv,
                    &mut i_ffn_down,
                )?
            } else {
                default
            };
            fallback(chosen, dims[0])
        };
        if out[i] == GgmlType::Q2K && ftype == FileType::Q2KS && !facts.has_imatrix {
            let cat = category(name);
            if cat != Category::Output && cat != Category::TokenEmbd {
                bail!("{ftype} needs an importance matrix (--imatrix) for {name}");
            }
        }
    }
    Ok(out)
}

fn is_quantized(ty: GgmlType) -> bool {
    !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// `tensor_type_fallback`: a row length that is not a whole number of blocks of the chosen
/// type gets a 32-value type of similar size, or F16 if even that does not fit.
fn fallback(ty: GgmlType, row_len: u64) -> GgmlType {
    if row_len.is_multiple_of(ty.block_size() as u64) {
        return ty;
    }
    let smaller = match ty {
        GgmlType::Q2K | GgmlType::Q3K => GgmlType::Q4_0,
        GgmlType::Q4K => GgmlType::Q5_0,
        GgmlType::Q5K => GgmlType::Q5_1,
        GgmlType::Q6K => GgmlType::Q8_0,
        other => other,
    };
    if row_len.is_multiple_of(smaller.block_size() as u64) {
        smaller
    } else {
        GgmlType::F16
    }
}

/// `llama_tensor_get_type_impl` for the file types of [`FileType`].
fn mixture_type(
    facts: &ModelFacts,
    ftype: FileType,
    name: &str,
    dims: &[u64],
    i_attention_wv: &mut i64,
    i_ffn_down: &mut i64,
) -> Result<GgmlType> {
    use FileType as F;
    use GgmlType as T;
    let mut ty = ftype.default_type();
    let cat = category(name);
    let falcon = facts.arch == "falcon";
    if cat == Category::Output || (facts.tied_embeddings && cat == Category::TokenEmbd) {
        // The LM head (also when it is the tied token embedding) gets Q6_K.
        if falcon || !dims[0].is_multiple_of(ty.block_size() as u64) {
            ty = T::Q8_0;
        } else if ty != T::Q8_0 {
            ty = T::Q6K;
        }
    } else if cat == Category::TokenEmbd {
        // Untied embeddings keep the base type.
    } else if cat == Category::AttnV {
        let i = *i_attention_wv;
        ty = match ftype {
            F::Q2K if facts.n_gqa >= 4 => T::Q4K,
            F::Q2K => T::Q3K,
            F::Q2KS if facts.n_gqa >= 4 => T::Q4K,
            F::Q3KM if i < 2 => T::Q5K,
            F::Q3KM => T::Q4K,
            F::Q3KL => T::Q5K,
            F::Q4KM | F::Q5KM if use_more_bits(i, facts.n_attention_wv) => T::Q6K,
            F::Q4KS if i < 4 => T::Q5K,
            _ => ty,
        };
        if facts.is_70b && matches!(ty, T::Q3K | T::Q4K) {
            ty = T::Q5K;
        }
        if facts.n_expert == 8 {
            ty = T::Q8_0;
        }
        *i_attention_wv += 1;
    } else if cat == Category::AttnK {
        if facts.n_expert == 8 {
            ty = T::Q8_0;
        }
    } else if cat == Category::FfnDown {
        let (i, n) = layer_info(facts, *i_ffn_down, name)?;
        ty = match ftype {
            F::Q2K => T::Q3K,
            F::Q2KS if i < n / 8 => T::Q4K,
            F::Q3KM if i < n / 16 => T::Q5K,
            F::Q3KM if !falcon || use_more_bits(i, n) => T::Q4K,
            F::Q3KM => T::Q3K,
            F::Q3KL if falcon => T::Q4K,
            F::Q3KL => T::Q5K,
            F::Q4KM if falcon && i < n / 16 => T::Q6K,
            F::Q4KM if falcon && use_more_bits(i, n) => T::Q5K,
            F::Q4KM if falcon => T::Q4K,
            F::Q4KM if use_more_bits(i, n) => T::Q6K,
            F::Q5KM if use_more_bits(i, n) => T::Q6K,
            F::Q4KS if !falcon && i < n / 8 => T::Q5K,
            F::Q4_0 if facts.has_imatrix && i < n / 8 => T::Q4_1,
            F::Q5_0 if facts.has_imatrix && i < n / 8 => T::Q5_1,
            _ => ty,
        };
        *i_ffn_down += 1;
    } else if cat == Category::AttnOutput {
        if !falcon {
            if facts.n_expert == 8 {
                if matches!(ftype, F::Q2K | F::Q3KS | F::Q3KM | F::Q4KS | F::Q4KM) {
                    ty = T::Q5K;
                }
            } else {
                ty = match ftype {
                    F::Q2K => T::Q3K,
                    F::Q3KM => T::Q4K,
                    F::Q3KL => T::Q5K,
                    _ => ty,
                };
            }
        } else if ftype == F::Q3KL {
            ty = T::Q4K;
        }
    }
    Ok(ty)
}

/// llama.cpp's `layer_info`: (layer, layer count) of an `ffn_down` tensor. Dense models count
/// the tensors in walk order; MoE models (whose expert tensors need not be consecutive) read
/// the layer from the name.
fn layer_info(facts: &ModelFacts, counter: i64, name: &str) -> Result<(i64, i64)> {
    if facts.n_expert <= 1 {
        return Ok((counter, facts.n_layer));
    }
    match layer_of(name) {
        Some(i) if (0..facts.n_layer).contains(&i) => Ok((i, facts.n_layer)),
        _ => bail!(
            "cannot tell the layer (of {}) of tensor {name}",
            facts.n_layer
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_as_llama_quantize_takes_them() {
        for t in FileType::ALL {
            assert_eq!(FileType::parse(t.name()).unwrap(), t);
            assert_eq!(FileType::parse(&t.name().to_lowercase()).unwrap(), t);
        }
        assert_eq!(FileType::parse("q4_k").unwrap(), FileType::Q4KM);
        assert_eq!(FileType::parse("Q3_K").unwrap(), FileType::Q3KM);
        assert!(FileType::parse("Q4_K_X").is_err());
        assert!(FileType::parse("").is_err());
    }

    #[test]
    fn fallbacks_follow_tensor_type_fallback() {
        use GgmlType as T;
        // Whole blocks: unchanged.
        for ty in [T::Q2K, T::Q4K, T::Q6K, T::Q8_0] {
            assert_eq!(fallback(ty, 512), ty);
        }
        assert_eq!(fallback(T::Q2K, 96), T::Q4_0);
        assert_eq!(fallback(T::Q3K, 96), T::Q4_0);
        assert_eq!(fallback(T::Q4K, 96), T::Q5_0);
        assert_eq!(fallback(T::Q5K, 96), T::Q5_1);
        assert_eq!(fallback(T::Q6K, 96), T::Q8_0);
        // Not even whole 32-blocks: F16.
        assert_eq!(fallback(T::Q4K, 100), T::F16);
        assert_eq!(fallback(T::Q8_0, 100), T::F16);
    }

    #[test]
    fn use_more_bits_matches_llama_cpp_on_32_layers() {
        // Layers llama.cpp gives more bits in a 32-layer model (n/8 = 4, 7n/8 = 28).
        let more: Vec<i64> = (0..32).filter(|&i| use_more_bits(i, 32)).collect();
        assert_eq!(
            more,
            [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
        );
    }

    #[test]
    fn vectors_and_norms_are_never_quantized() {
        assert!(!allows_quantization("blk.0.attn_norm.weight", 1));
        assert!(!allows_quantization("blk.0.attn_q_norm.weight", 2));
        assert!(!allows_quantization("blk.0.attn_q.bias", 2));
        assert!(!allows_quantization("blk.0.ffn_gate_inp.weight", 2));
        assert!(allows_quantization("blk.0.attn_q.weight", 2));
        assert!(allows_quantization("token_embd.weight", 2));
    }
}
