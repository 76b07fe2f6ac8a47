//! `kestrel quantize`: rewrite a GGUF file with its weights in another type, as llama-quantize
//! does: the same per-tensor type choice ([`crate::ftype`]), the same metadata changes
//! (`general.file_type`, `general.quantization_version`), the same quantizers (kestrel-quant
//! ports ggml's reference ones, which llama-quantize uses when it has no importance matrix,
//! and its `quant_weights` ones for `--imatrix`).
//!
//! Each tensor is dequantized to f32 and requantized in slabs of whole rows, the rows of a
//! slab spread over rayon's threads, so memory stays bounded whatever the tensor size. The
//! output goes to a temporary file beside the target, renamed only once complete.

use std::path::Path;

use anyhow::{Context, Result, bail};
use indicatif::ProgressBar;
use kestrel_gguf::{GgmlType, GgufFile, GgufWriter, TensorInfo};
use kestrel_quant::{
    can_dequantize, dequantize_row, quantize_row, quantize_rows_weighted, row_bytes,
    uses_importance,
};
use rayon::prelude::*;

use crate::ftype::{FileType, ModelFacts, choose_types};
use crate::imatrix::Imatrix;

/// Values handled by one rayon task (whole rows; at least one row).
const TASK_VALUES: usize = 1 << 16;
/// Values dequantized and quantized before a slab is written out.
const SLAB_VALUES: usize = 1 << 24;

/// What to quantize to.
#[derive(Debug, Clone)]
pub struct QuantizeOptions {
    pub ftype: FileType,
    /// Importance weights (`--imatrix`), passed to the quantizers as llama-quantize does.
    pub imatrix: Option<Imatrix>,
}

/// The type every tensor will have, decided before anything is written.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Target type of each tensor, in file order.
    pub types: Vec<GgmlType>,
    /// Names of tensors that are already quantized and will be quantized again (a loss of
    /// precision llama-quantize only allows with `--allow-requantize`).
    pub requantized: Vec<String>,
}

/// The facts llama.cpp's type choice reads from a model's metadata and tensor list.
pub fn model_facts(file: &GgufFile, has_imatrix: bool) -> Result<ModelFacts> {
    let arch = file
        .architecture()
        .context("the file has no general.architecture")?
        .to_string();
    let get = |key: &str| file.get_u64(&format!("{arch}.{key}"));
    let n_layer = get("block_count").unwrap_or(0) as i64;
    let n_head = get("attention.head_count").unwrap_or(0) as i64;
    let n_head_kv = get("attention.head_count_kv").map_or(n_head, |v| v as i64);
    let n_gqa = if n_head > 0 && n_head_kv > 0 {
        n_head / n_head_kv
    } else {
        1
    };
    // llama.cpp's model-size classes that the type choice looks at (llm_load_hparams).
    let is_70b = n_layer == 80
        && match arch.as_str() {
            "llama" => n_head != n_head_kv,
            "qwen2" => true,
            _ => false,
        };
    let names = || file.tensors().iter().map(|t| t.name.as_str());
    Ok(ModelFacts {
        n_layer,
        n_gqa,
        n_expert: get("expert_count").unwrap_or(0) as i64,
        is_70b,
        tied_embeddings: !names().any(|n| n == "output.weight"),
        n_attention_wv: names()
            .filter(|n| {
                ["attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight"]
                    .iter()
                    .any(|k| n.contains(k))
            })
            .count() as i64,
        has_imatrix,
        arch,
    })
}

fn is_quantized(ty: GgmlType) -> bool {
    !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

impl Plan {
    /// Chooses every tensor's type and checks that each conversion is possible.
    pub fn new(file: &GgufFile, opts: &QuantizeOptions) -> Result<Plan> {
        let facts = model_facts(file, opts.imatrix.is_some())?;
        let list: Vec<(&str, &[u64], GgmlType)> = file
            .tensors()
            .iter()
            .map(|t| (t.name.as_str(), t.dims.as_slice(), t.ty))
            .collect();
        let types = choose_types(&facts, opts.ftype, &list)?;
        let mut requantized = Vec::new();
        for (info, &ty) in file.tensors().iter().zip(&types) {
            if info.ty == ty {
                continue;
            }
            if !can_dequantize(info.ty) {
                bail!(
                    "tensor {} is {}, which kestrel cannot dequantize to requantize as {ty}",
                    info.name,
                    info.ty
                );
            }
            if is_quantized(info.ty) {
                requantized.push(info.name.clone());
            }
        }
        if let Some(imatrix) = &opts.imatrix {
            for (info, &ty) in file.tensors().iter().zip(&types) {
                if info.ty == ty || !uses_importance(ty) {
                    continue;
                }
                // An entry of the wrong size is an error before anything is written.
                let weights = imatrix.weights_for(&info.name, &info.dims)?;
                // llama-quantize: Q2_K in a Q2_K_S file needs weights (tensor_requires_imatrix).
                let exempt =
                    info.name.starts_with("token_embd.") || info.name.starts_with("output.");
                if weights.is_none()
                    && ty == GgmlType::Q2K
                    && opts.ftype == FileType::Q2KS
                    && !exempt
                {
                    bail!(
                        "the importance matrix has no entry for {}, which {} quantizes to Q2_K \
                         (only possible with importance weights)",
                        info.name,
                        opts.ftype
                    );
                }
            }
        }
        Ok(Plan { types, requantized })
    }

    /// Bytes the tensor data will take (for the progress bar and the summary).
    pub fn output_bytes(&self, file: &GgufFile) -> u64 {
        file.tensors()
            .iter()
            .zip(&self.types)
            .map(|(t, &ty)| ty.bytes_for(t.n_elements()).unwrap_or(0))
            .sum()
    }
}

/// Writes `file` quantized according to `plan` to `output` (through a temporary file).
/// `progress` advances by the input bytes of each tensor as it is done.
pub fn write_quantized(
    file: &GgufFile,
    plan: &Plan,
    opts: &QuantizeOptions,
    output: &Path,
    progress: &ProgressBar,
) -> Result<()> {
    let mut writer = GgufWriter::new();
    writer.set_version(file.version())?;
    for (key, value) in file.metadata() {
        // A split file's parts become one file.
        if !key.starts_with("split.") {
            writer.add_metadata(key.clone(), value.clone())?;
        }
    }
    writer.set_metadata("general.quantization_version", 2u32)?;
    writer.set_metadata("general.file_type", opts.ftype.id())?;
    if let Some(imatrix) = &opts.imatrix {
        // The keys llama-quantize adds (strings cut to its 127 bytes).
        let cut = |s: &str| {
            let mut end = s.len().min(127);
            while !s.is_char_boundary(end) {
                end -= 1;
            }
            s[..end].to_string()
        };
        writer.set_metadata("quantize.imatrix.file", cut(&imatrix.file))?;
        if let Some(dataset) = imatrix.datasets.first() {
            writer.set_metadata("quantize.imatrix.dataset", cut(dataset))?;
        }
        writer.set_metadata(
            "quantize.imatrix.entries_count",
            imatrix.entries.len() as u32,
        )?;
        if imatrix.chunk_count > 0 {
            writer.set_metadata("quantize.imatrix.chunks_count", imatrix.chunk_count)?;
        }
    }
    for (info, &ty) in file.tensors().iter().zip(&plan.types) {
        writer.add_tensor(info.name.clone(), &info.dims, ty)?;
    }
    let mut stream = writer
        .stream_to_path(output)
        .with_context(|| format!("cannot create {}", output.display()))?;
    for (info, &ty) in file.tensors().iter().zip(&plan.types) {
        let data = file.tensor_data(info);
        if info.ty == ty {
            stream.write_tensor(data)?;
        } else {
            let weights = match &opts.imatrix {
                Some(m) if uses_importance(ty) => m.weights_for(&info.name, &info.dims)?,
                _ => None,
            };
            convert_tensor(info, data, ty, weights, |chunk| {
                stream.write_chunk(chunk)?;
                Ok(())
            })
            .with_context(|| format!("tensor {}", info.name))?;
        }
        progress.inc(data.len() as u64);
    }
    stream.finish()?;
    Ok(())
}

/// Converts one tensor's data from `info.ty` to `to`, handing the output to `sink` in slabs
/// of whole rows. `weights` (importance, `ne0` per expert of a 3-D tensor) go to the
/// quantizer of each row, as llama-quantize passes them to `ggml_quantize_chunk`.
pub fn convert_tensor(
    info: &TensorInfo,
    data: &[u8],
    to: GgmlType,
    weights: Option<&[f32]>,
    mut sink: impl FnMut(&[u8]) -> Result<()>,
) -> Result<()> {
    let row_len = usize::try_from(info.row_len())?;
    let n_rows = usize::try_from(info.n_rows())?;
    let (src_row, dst_row) = (row_bytes(info.ty, row_len)?, row_bytes(to, row_len)?);
    if data.len() != n_rows * src_row {
        bail!(
            "has {} bytes of data, expected {}",
            data.len(),
            n_rows * src_row
        );
    }
    // Rows of one expert of a 3-D tensor (all rows of a matrix).
    let rows_per_expert = usize::try_from(info.dims.get(1).copied().unwrap_or(1))?.max(1);
    if let Some(w) = weights
        && w.len() != n_rows / rows_per_expert * row_len
    {
        bail!(
            "{} importance weights for {} experts of {row_len}",
            w.len(),
            n_rows / rows_per_expert
        );
    }
    let rows_per_task = (TASK_VALUES / row_len).max(1);
    let rows_per_slab = (SLAB_VALUES / row_len).max(1).div_ceil(rows_per_task) * rows_per_task;
    let mut out = vec![0u8; rows_per_slab.min(n_rows) * dst_row];
    for first in (0..n_rows).step_by(rows_per_slab) {
        let rows = rows_per_slab.min(n_rows - first);
        let src = &data[first * src_row..(first + rows) * src_row];
        let dst = &mut out[..rows * dst_row];
        dst.par_chunks_mut(rows_per_task * dst_row)
            .zip(src.par_chunks(rows_per_task * src_row))
            .enumerate()
            .try_for_each(|(task, (dst, src))| -> Result<()> {
                let mut values = vec![0f32; src.len() / src_row * row_len];
                dequantize_row(info.ty, src, &mut values)?;
                match weights {
                    None => quantize_row(to, &values, dst)?,
                    Some(w) => {
                        let first_row = first + task * rows_per_task;
                        for (r, (x, out)) in values
                            .chunks_exact(row_len)
                            .zip(dst.chunks_exact_mut(dst_row))
                            .enumerate()
                        {
                            let expert = (first_row + r) / rows_per_expert;
                            let qw = &w[expert * row_len..(expert + 1) * row_len];
                            quantize_rows_weighted(to, x, row_len, qw, out)?;
                        }
                    }
                }
                Ok(())
            })?;
        sink(dst)?;
    }
    Ok(())
}
