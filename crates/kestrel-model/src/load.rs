//! Loading a model's weights through a backend: each tensor's GGUF name and shape checked,
//! then uploaded by [`Backend::load_weight`] (apart from `weights`, which only describes
//! them, so that the backend trait and the weights it is given do not import each other).

use std::sync::Arc;

use kestrel_gguf::{GgufFile, TensorInfo};

use crate::ModelError;
use crate::backend::Backend;
use crate::config::{Arch, FfnKind, LayerKind, ModelConfig};
use crate::weights::{DeltaNetWeights, LayerWeights, ModelWeights, SharedExpertWeights};

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
        backend
            .check_model(cfg)
            .map_err(|e| ModelError::Backend(format!("{e:#}")))?;
        if cfg.has_recurrent_layers() {
            backend
                .check_linear_attention()
                .map_err(|e| ModelError::Backend(format!("{e:#}")))?;
        }
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
        let experts = |name: &str, dims: &[usize]| -> Result<W, ModelError> {
            check_shape(file, name, dims)?;
            let info = file
                .tensor(name)
                .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
            backend
                .load_experts(file, info)
                .map_err(|e| ModelError::Backend(format!("loading {name}: {e:#}")))
        };
        // Rows `rows` of a fused matrix (Phi-3's `attn_qkv`, and its `ffn_up` holding gate
        // then up) as a weight of their own, read in place like any matrix.
        let part = |name: &str, dims: &[usize], rows: std::ops::Range<usize>, what: &str| {
            check_shape(file, name, dims)?;
            let info = file
                .tensor(name)
                .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
            let row_bytes = info.ty.bytes_for(dims[0] as u64).ok_or_else(|| {
                ModelError::Invalid(format!("{name}: rows are not whole {} blocks", info.ty))
            })?;
            let slice = TensorInfo {
                name: format!("{name} ({what})"),
                dims: vec![dims[0] as u64, rows.len() as u64],
                ty: info.ty,
                offset: info.offset + rows.start as u64 * row_bytes,
                part: info.part,
            };
            backend
                .load_weight(file, &slice)
                .map_err(|e| ModelError::Backend(format!("loading {}: {e:#}", slice.name)))
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
        // Expert biases are read per expert like the experts; the router's is a vector.
        let (n_expert, n_ff_exp) = match cfg.ffn {
            FfnKind::Moe(m) => (m.n_expert, m.n_ff_exp),
            FfnKind::Dense => (0, 0),
        };
        let moe_bias = |name: &str, dims: &[usize]| -> Result<Option<W>, ModelError> {
            match dims.len() {
                _ if cfg.arch != Arch::GptOss => Ok(None),
                1 => load(name, dims).map(Some),
                _ => experts(name, dims).map(Some),
            }
        };
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for il in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{il}.{s}");
            // gpt-oss and the hybrids name the norm before the feed-forward block the
            // post-attention norm.
            let oss = cfg.arch == Arch::GptOss || cfg.attn_output_gate;
            let fused_up = n("ffn_up.weight");
            let (ffn_gate_inp, ffn_gate, ffn_up, ffn_down) = match cfg.ffn {
                FfnKind::Dense if cfg.arch == Arch::Phi3 => (
                    None,
                    part(&fused_up, &[d, 2 * ff], 0..ff, "gate")?,
                    part(&fused_up, &[d, 2 * ff], ff..2 * ff, "up")?,
                    load(&n("ffn_down.weight"), &[ff, d])?,
                ),
                FfnKind::Dense => (
                    None,
                    load(&n("ffn_gate.weight"), &[d, ff])?,
                    load(&n("ffn_up.weight"), &[d, ff])?,
                    load(&n("ffn_down.weight"), &[ff, d])?,
                ),
                FfnKind::Moe(m) => (
                    Some(load(&n("ffn_gate_inp.weight"), &[d, m.n_expert])?),
                    experts(&n("ffn_gate_exps.weight"), &[d, m.n_ff_exp, m.n_expert])?,
                    experts(&n("ffn_up_exps.weight"), &[d, m.n_ff_exp, m.n_expert])?,
                    experts(&n("ffn_down_exps.weight"), &[m.n_ff_exp, d, m.n_expert])?,
                ),
            };
            let attention = cfg.layer_kinds[il] == LayerKind::Attention;
            let qkv = n("attn_qkv.weight");
            let q_rows = if cfg.attn_output_gate { 2 * q } else { q };
            let (attn_q, attn_k, attn_v) = if !attention {
                (None, None, None)
            } else if file.tensor(&qkv).is_some() && !cfg.attn_output_gate {
                let dims = [d, q + 2 * kv];
                (
                    Some(part(&qkv, &dims, 0..q, "q")?),
                    Some(part(&qkv, &dims, q..q + kv, "k")?),
                    Some(part(&qkv, &dims, q + kv..q + 2 * kv, "v")?),
                )
            } else {
                (
                    Some(load(&n("attn_q.weight"), &[d, q_rows])?),
                    Some(load(&n("attn_k.weight"), &[d, kv])?),
                    Some(load(&n("attn_v.weight"), &[d, kv])?),
                )
            };
            let delta_net = match (&cfg.delta_net, attention) {
                (Some(dn), false) => {
                    if file.tensor(&n("ssm_in.weight")).is_some() && file.tensor(&qkv).is_none() {
                        return Err(ModelError::Invalid(format!(
                            "blk.{il}: the linear-attention input is one fused `ssm_in` matrix \
                             (an older llama.cpp conversion); only the `attn_qkv` + `attn_gate` \
                             layout is supported: convert the model again"
                        )));
                    }
                    let nv = dn.n_v_heads;
                    let (beta, alpha) = if dn.qwen3next_layout {
                        (load(&n("ssm_ba.weight"), &[d, 2 * nv])?, None)
                    } else {
                        (
                            load(&n("ssm_beta.weight"), &[d, nv])?,
                            Some(load(&n("ssm_alpha.weight"), &[d, nv])?),
                        )
                    };
                    Some(DeltaNetWeights {
                        in_qkv: load(&qkv, &[d, dn.conv_dim()])?,
                        gate: load(&n("attn_gate.weight"), &[d, dn.value_dim()])?,
                        beta,
                        alpha,
                        conv: load(&n("ssm_conv1d.weight"), &[dn.d_conv, dn.conv_dim()])?,
                        dt_bias: load(&n("ssm_dt.bias"), &[nv])?,
                        a: load(&n("ssm_a"), &[nv])?,
                        norm: load(&n("ssm_norm.weight"), &[dn.head_v_dim])?,
                        out: load(&n("ssm_out.weight"), &[dn.value_dim(), d])?,
                    })
                }
                (None, false) => {
                    return Err(ModelError::Invalid(format!(
                        "blk.{il} is a linear-attention layer without its configuration"
                    )));
                }
                (_, true) => None,
            };
            let shared_expert = match cfg.ffn {
                FfnKind::Moe(m) => match m.shared_expert {
                    Some(sff) => Some(SharedExpertWeights {
                        gate_inp: load(&n("ffn_gate_inp_shexp.weight"), &[d])?,
                        gate: load(&n("ffn_gate_shexp.weight"), &[d, sff])?,
                        up: load(&n("ffn_up_shexp.weight"), &[d, sff])?,
                        down: load(&n("ffn_down_shexp.weight"), &[sff, d])?,
                    }),
                    None => None,
                },
                FfnKind::Dense => None,
            };
            let attn_opt =
                |name: &str, dims: &[usize], wanted: bool| opt(name, dims, wanted && attention);
            layers.push(LayerWeights {
                attn_norm: load(&n("attn_norm.weight"), &[d])?,
                attn_q,
                attn_k,
                attn_v,
                attn_q_bias: opt(&n("attn_q.bias"), &[q], cfg.qkv_bias)?,
                attn_k_bias: opt(&n("attn_k.bias"), &[kv], cfg.qkv_bias)?,
                attn_v_bias: opt(&n("attn_v.bias"), &[kv], cfg.qkv_bias)?,
                attn_q_norm: attn_opt(&n("attn_q_norm.weight"), &[hd], cfg.qk_norm)?,
                attn_k_norm: attn_opt(&n("attn_k_norm.weight"), &[hd], cfg.qk_norm)?,
                attn_output: attn_opt(&n("attn_output.weight"), &[q, d], true)?,
                delta_net,
                attn_output_bias: opt(&n("attn_output.bias"), &[d], cfg.attn_out_bias)?,
                attn_sinks: opt(&n("attn_sinks.weight"), &[cfg.n_head], cfg.attn_sinks)?,
                post_attention_norm: opt(&n("post_attention_norm.weight"), &[d], cfg.post_norms)?,
                // gpt-oss names the norm before its MoE block the post-attention norm.
                ffn_norm: load(
                    &n(if oss {
                        "post_attention_norm.weight"
                    } else {
                        "ffn_norm.weight"
                    }),
                    &[d],
                )?,
                ffn_gate_inp,
                ffn_gate,
                ffn_up,
                ffn_down,
                ffn_gate_inp_bias: moe_bias(&n("ffn_gate_inp.bias"), &[n_expert])?,
                ffn_gate_exps_bias: moe_bias(&n("ffn_gate_exps.bias"), &[n_ff_exp, n_expert])?,
                ffn_up_exps_bias: moe_bias(&n("ffn_up_exps.bias"), &[n_ff_exp, n_expert])?,
                ffn_down_exps_bias: moe_bias(&n("ffn_down_exps.bias"), &[d, n_expert])?,
                post_ffw_norm: opt(&n("post_ffw_norm.weight"), &[d], cfg.post_norms)?,
                shared_expert,
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
