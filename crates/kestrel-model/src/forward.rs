//! The one forward definition shared by every backend.

use std::sync::Arc;

use kestrel_gguf::GgufFile;

use crate::ModelError;
use crate::backend::{AttnParams, Backend};
use crate::batch::{Batch, Output};
use crate::config::{FfnKind, ModelConfig};
use crate::weights::ModelWeights;

/// A loaded model on a backend.
pub struct Model<B: Backend> {
    pub config: ModelConfig,
    pub weights: ModelWeights<B::Weight>,
    /// Keeps the mapped file alive for backends that read weights in place.
    pub file: Arc<GgufFile>,
}

/// Activation buffers for batches of up to `max_tokens` tokens, allocated once.
pub struct Scratch<B: Backend> {
    pub max_tokens: usize,
    pub max_logit_rows: usize,
    step: B::Step,
    x: B::Tensor,
    h: B::Tensor,
    q: B::Tensor,
    k: B::Tensor,
    v: B::Tensor,
    attn: B::Tensor,
    proj: B::Tensor,
    gate: B::Tensor,
    up: B::Tensor,
    last: B::Tensor,
    last_normed: B::Tensor,
    /// Logits of the requested rows, `[logit rows × vocab]`.
    pub logits: B::Tensor,
}

impl<B: Backend> Scratch<B> {
    /// After a step whose batch wanted [`Output::Hidden`]: the final-norm hidden states of
    /// its rows, `[rows × n_embd]` (only the first rows are the step's).
    pub fn hidden(&self) -> &B::Tensor {
        &self.h
    }
}

impl<B: Backend> Scratch<B> {
    /// Buffers for batches of up to `max_tokens` tokens of which at most `max_logit_rows`
    /// want logits (the logits buffer is the largest: keep that number small).
    pub fn new(
        backend: &B,
        cfg: &ModelConfig,
        max_tokens: usize,
        max_logit_rows: usize,
    ) -> anyhow::Result<Self> {
        let t = |cols: usize| backend.new_tensor(max_tokens, cols);
        let max_logit_rows = max_logit_rows.clamp(1, max_tokens);
        Ok(Scratch {
            max_tokens,
            max_logit_rows,
            step: backend.new_step(cfg, max_tokens)?,
            x: t(cfg.n_embd)?,
            h: t(cfg.n_embd)?,
            q: t(cfg.q_dim())?,
            k: t(cfg.kv_dim())?,
            v: t(cfg.kv_dim())?,
            attn: t(cfg.q_dim())?,
            proj: t(cfg.n_embd)?,
            gate: t(cfg.n_ff)?,
            up: t(cfg.n_ff)?,
            last: backend.new_tensor(max_logit_rows, cfg.n_embd)?,
            last_normed: backend.new_tensor(max_logit_rows, cfg.n_embd)?,
            logits: backend.new_tensor(max_logit_rows, cfg.vocab_size)?,
        })
    }
}

impl<B: Backend> Model<B> {
    pub fn load(backend: &B, file: Arc<GgufFile>) -> Result<Model<B>, ModelError> {
        let config = ModelConfig::from_gguf(&file)?;
        let weights = ModelWeights::load(backend, &file, &config)?;
        Ok(Model {
            config,
            weights,
            file,
        })
    }

    /// Runs one step over `batch`, writing its keys and values into `cache`, and leaves
    /// the logits of `batch.logit_rows` in `scratch.logits` (one row each, in order), or
    /// their final-norm hidden states in `scratch.hidden()` when the batch asks for
    /// [`Output::Hidden`].
    pub fn forward(
        &self,
        backend: &B,
        cache: &mut B::Cache,
        batch: &Batch,
        scratch: &mut Scratch<B>,
    ) -> anyhow::Result<()> {
        let cfg = &self.config;
        let n = batch.len();
        if n == 0 {
            anyhow::bail!("empty batch");
        }
        if n > scratch.max_tokens {
            anyhow::bail!(
                "batch of {n} tokens exceeds the scratch size {}",
                scratch.max_tokens
            );
        }
        if batch.output == Output::Logits && batch.logit_rows.len() > scratch.max_logit_rows {
            anyhow::bail!(
                "batch wants logits for {} rows, scratch holds {}",
                batch.logit_rows.len(),
                scratch.max_logit_rows
            );
        }
        let w = &self.weights;
        let s = scratch;
        backend.prepare_step(batch, &mut s.step)?;

        backend.embed(&w.token_embd, &s.step, &mut s.x);
        if let Some(factor) = cfg.embed_scale {
            backend.scale(&mut s.x, n, factor);
        }

        for (il, layer) in w.layers.iter().enumerate() {
            // Attention block. Each `*_ready` is what an operation prepared for the one that
            // reads its output next (see `Backend::Prepared`).
            let h_ready = backend.rms_norm(&s.x, &layer.attn_norm, cfg.rms_eps, n, &mut s.h);
            let mut qkv_ready = backend.qkv(&s.h, h_ready, layer, n, &mut s.q, &mut s.k, &mut s.v);
            if let (Some(qn), Some(kn)) = (&layer.attn_q_norm, &layer.attn_k_norm) {
                backend.rms_norm_heads(&mut s.q, qn, cfg.head_dim, cfg.rms_eps, n);
                backend.rms_norm_heads(&mut s.k, kn, cfg.head_dim, cfg.rms_eps, n);
                qkv_ready = B::Prepared::default();
            }
            let rope = cfg.layer_rope(il);
            backend.rope_store_kv(
                &mut s.q,
                &mut s.k,
                &s.v,
                qkv_ready,
                cfg.head_dim,
                rope,
                cache,
                il,
                &s.step,
                n,
            );
            if let Some(temp) = &cfg.attn_temperature {
                backend.scale_by_position(&mut s.q, temp, &s.step, n)?;
            }
            let params = AttnParams {
                layer: il,
                n_head: cfg.n_head,
                n_head_kv: cfg.n_head_kv,
                head_dim: cfg.head_dim,
                scale: cfg.attn_scale,
                window: cfg.layer_window(il),
            };
            let attn_ready = match &layer.attn_sinks {
                Some(sinks) => {
                    backend.attention_sinks(
                        &s.q,
                        cache,
                        &params,
                        sinks,
                        &s.step,
                        n,
                        &mut s.attn,
                    )?;
                    B::Prepared::default()
                }
                None => backend.attention(&s.q, cache, &params, &s.step, n, &mut s.attn),
            };
            if let Some(pn) = &layer.post_attention_norm {
                backend.matmul_ready(&s.attn, attn_ready, &layer.attn_output, n, &mut s.proj);
                backend.rms_norm(&s.proj, pn, cfg.rms_eps, n, &mut s.h);
                backend.add(&mut s.x, &s.h, n);
            } else if let Some(bias) = &layer.attn_output_bias {
                backend.matmul_ready(&s.attn, attn_ready, &layer.attn_output, n, &mut s.proj);
                backend.add_bias(&mut s.proj, bias, n);
                backend.add(&mut s.x, &s.proj, n);
            } else {
                let (attn, wo) = (&s.attn, &layer.attn_output);
                backend.matmul_add(attn, attn_ready, wo, n, &mut s.proj, &mut s.x);
            }

            // Feed-forward block: its output goes to `s.proj` unless it is a dense block
            // without a post-norm, whose down projection adds into the residual directly.
            let h_ready = backend.rms_norm(&s.x, &layer.ffn_norm, cfg.rms_eps, n, &mut s.h);
            match (&cfg.ffn, &layer.post_ffw_norm) {
                (FfnKind::Dense, None) => {
                    let act = cfg.activation;
                    let (gate, up) = (&mut s.gate, &mut s.up);
                    let gated = backend.gate_up(&s.h, h_ready, layer, act, n, gate, up);
                    let down = &layer.ffn_down;
                    backend.matmul_add(&s.gate, gated, down, n, &mut s.proj, &mut s.x);
                    continue;
                }
                (FfnKind::Dense, Some(_)) => backend.feed_forward(
                    &s.h,
                    h_ready,
                    layer,
                    cfg.activation,
                    n,
                    &mut s.gate,
                    &mut s.up,
                    &mut s.proj,
                ),
                (FfnKind::Moe(moe), _) => {
                    backend.moe_ffn(&s.h, layer, moe, cfg.activation, n, &mut s.proj)?
                }
            }
            if let Some(pn) = &layer.post_ffw_norm {
                backend.rms_norm(&s.proj, pn, cfg.rms_eps, n, &mut s.h);
                backend.add(&mut s.x, &s.h, n);
            } else {
                backend.add(&mut s.x, &s.proj, n);
            }
        }

        // Only the rows that need logits go through the final norm and the LM head.
        let n_out = batch.logit_rows.len();
        if n_out == 0 {
            return Ok(());
        }
        if batch.output == Output::Hidden {
            // Embeddings: the rows' final-norm hidden states, into `h` (as many rows as
            // the step has tokens).
            backend.gather_logit_rows(&s.x, &s.step, &mut s.proj);
            backend.rms_norm(&s.proj, &w.output_norm, cfg.rms_eps, n_out, &mut s.h);
            return Ok(());
        }
        backend.gather_logit_rows(&s.x, &s.step, &mut s.last);
        let normed = &mut s.last_normed;
        let ready = backend.rms_norm(&s.last, &w.output_norm, cfg.rms_eps, n_out, normed);
        backend.matmul_ready(&s.last_normed, ready, w.lm_head(), n_out, &mut s.logits);
        Ok(())
    }
}
