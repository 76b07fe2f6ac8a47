//! Loading a model's weights through a backend: each tensor's GGUF name and shape checked,
//! then uploaded by [`Backend::load_weight`] (apart from `weights`, which only describes
//! them, so that the backend trait and the weights it is given do not import each other).

use std::sync::Arc;

use kestrel_gguf::GgufFile;

use crate::ModelError;
use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::weights::{LayerWeights, ModelWeights};

/// Checks that a tensor exists with the expected shape (GGUF order: row length first).
fn check_shape(file: &GgufFile, name: &str, dims: &[usize]) -> Result<(), ModelError> {
    let info = file
        .tensor(name)
        .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
    let have: Vec<usize> = info.dims.iter().map(|&d| d as usize).collect();
    if have != dims {
        return Err(ModelError::Invalid(format!(
            "tensor {name} has shape {have:?}, expected {dims:?}"
        )));
    }
    Ok(())
}

impl<W> ModelWeights<W> {
    /// Loads every tensor the configuration needs through `backend`.
    pub fn load<B: Backend<Weight = W>>(
        backend: &B,
        file: &Arc<GgufFile>,
        cfg: &ModelConfig,
    ) -> Result<ModelWeights<W>, ModelError> {
        let (d, q, kv, ff, vocab, hd) = (
            cfg.n_embd,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.n_ff,
            cfg.vocab_size,
            cfg.head_dim,
        );
        let load = |name: &str, dims: &[usize]| -> Result<W, ModelError> {
            check_shape(file, name, dims)?;
            let info = file
                .tensor(name)
                .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
            backend
                .load_weight(file, info)
                .map_err(|e| ModelError::Backend(format!("loading {name}: {e:#}")))
        };
        let opt = |name: &str, dims: &[usize], wanted: bool| -> Result<Option<W>, ModelError> {
            if wanted {
                load(name, dims).map(Some)
            } else {
                Ok(None)
            }
        };

        let token_embd = load("token_embd.weight", &[d, vocab])?;
        let output_norm = load("output_norm.weight", &[d])?;
        let output = if cfg.tied_embeddings {
            None
        } else {
            Some(load("output.weight", &[d, vocab])?)
        };
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for il in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{il}.{s}");
            layers.push(LayerWeights {
                attn_norm: load(&n("attn_norm.weight"), &[d])?,
                attn_q: load(&n("attn_q.weight"), &[d, q])?,
                attn_k: load(&n("attn_k.weight"), &[d, kv])?,
                attn_v: load(&n("attn_v.weight"), &[d, kv])?,
                attn_q_bias: opt(&n("attn_q.bias"), &[q], cfg.qkv_bias)?,
                attn_k_bias: opt(&n("attn_k.bias"), &[kv], cfg.qkv_bias)?,
                attn_v_bias: opt(&n("attn_v.bias"), &[kv], cfg.qkv_bias)?,
                attn_q_norm: opt(&n("attn_q_norm.weight"), &[hd], cfg.qk_norm)?,
                attn_k_norm: opt(&n("attn_k_norm.weight"), &[hd], cfg.qk_norm)?,
                attn_output: load(&n("attn_output.weight"), &[q, d])?,
                post_attention_norm: opt(&n("post_attention_norm.weight"), &[d], cfg.post_norms)?,
                ffn_norm: load(&n("ffn_norm.weight"), &[d])?,
                ffn_gate: load(&n("ffn_gate.weight"), &[d, ff])?,
                ffn_up: load(&n("ffn_up.weight"), &[d, ff])?,
                ffn_down: load(&n("ffn_down.weight"), &[ff, d])?,
                post_ffw_norm: opt(&n("post_ffw_norm.weight"), &[d], cfg.post_norms)?,
            });
        }
        Ok(ModelWeights {
            token_embd,
            layers,
            output_norm,
            output,
        })
    }
}
