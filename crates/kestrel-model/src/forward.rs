//! The one forward definition shared by every backend.

use std::sync::Arc;

use anyhow::Context;
use kestrel_gguf::GgufFile;

use crate::ModelError;
use crate::backend::{AttnParams, Backend};
use crate::batch::{Batch, Output};
use crate::config::{Activation, FfnKind, ModelConfig};
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
    /// Gated attention: each head's query and gate, and the gates (0 wide without).
    qg: B::Tensor,
    ogate: B::Tensor,
    /// Linear attention: the convolution's input channels, the output gate, beta and
    /// alpha, and the output before `ssm_out` (0 wide without).
    mix: B::Tensor,
    z: B::Tensor,
    beta: B::Tensor,
    alpha: B::Tensor,
    dn: B::Tensor,
    /// A shared expert's gate and up products and its output (0 wide without).
    sh_gate: B::Tensor,
    sh_up: B::Tensor,
    shexp: B::Tensor,
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
        let gated = if cfg.attn_output_gate { cfg.q_dim() } else { 0 };
        let dn = cfg.delta_net.as_ref();
        let dn_cols = |f: &dyn Fn(&crate::config::DeltaNetConfig) -> usize| dn.map_or(0, f);
        let shared = match cfg.ffn {
            FfnKind::Moe(m) => m.shared_expert.unwrap_or(0),
            FfnKind::Dense => 0,
        };
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
            sh_gate: t(shared)?,
            sh_up: t(shared)?,
            qg: t(2 * gated)?,
            ogate: t(gated)?,
            mix: t(dn_cols(&|d| d.conv_dim()))?,
            z: t(dn_cols(&|d| d.value_dim()))?,
            // Qwen3-Next's `ssm_ba` gives beta and alpha in one row.
            beta: t(dn_cols(&|d| {
                if d.qwen3next_layout {
                    2 * d.n_v_heads
                } else {
                    d.n_v_heads
                }
            }))?,
            alpha: t(dn_cols(&|d| d.n_v_heads))?,
            dn: t(dn_cols(&|d| d.value_dim()))?,
            shexp: t(if shared > 0 { cfg.n_embd } else { 0 })?,
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
            // Attention block (or linear attention). Each `*_ready` is what an operation
            // prepared for the one that reads its output next (see `Backend::Prepared`).
            let h_ready = backend.rms_norm(&s.x, &layer.attn_norm, cfg.rms_eps, n, &mut s.h);
            if let Some(dw) = &layer.delta_net {
                // Gated DeltaNet linear attention (see `DeltaNetConfig`).
                let dn = cfg
                    .delta_net
                    .as_ref()
                    .context("a linear-attention layer without its configuration")?;
                let alpha = match &dw.alpha {
                    Some(a) => {
                        let ws = [&dw.in_qkv, &dw.gate, &dw.beta, a];
                        let mut outs = [&mut s.mix, &mut s.z, &mut s.beta, &mut s.alpha];
                        backend.matmul_many(&s.h, h_ready, &ws, n, &mut outs);
                        &s.alpha
                    }
                    None => {
                        let ws = [&dw.in_qkv, &dw.gate, &dw.beta];
                        let mut outs = [&mut s.mix, &mut s.z, &mut s.beta];
                        backend.matmul_many(&s.h, h_ready, &ws, n, &mut outs);
                        &s.beta
                    }
                };
                let ready = backend.delta_net(
                    cache,
                    il,
                    dn,
                    dw,
                    &s.mix,
                    &s.z,
                    &s.beta,
                    alpha,
                    cfg.rms_eps,
                    &s.step,
                    n,
                    &mut s.dn,
                )?;
                backend.matmul_add(&s.dn, ready, &dw.out, n, &mut s.proj, &mut s.x);
            } else {
                self.attention_block(backend, cache, layer, il, h_ready, s, n)?;
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
                    // The shared expert first: its gate/up product reads what the norm
                    // prepared (one launch on CUDA decode steps, x not quantized again).
                    if let Some(se) = &layer.shared_expert {
                        let (gate, up) = (&mut s.sh_gate, &mut s.sh_up);
                        let act = Activation::Silu;
                        let r =
                            backend.gate_up_pair(&s.h, h_ready, &se.gate, &se.up, act, n, gate, up);
                        backend.matmul_ready(&s.sh_gate, r, &se.down, n, &mut s.shexp);
                    }
                    backend.moe_ffn(&s.h, layer, moe, cfg.activation, n, &mut s.proj)?;
                    if let Some(se) = &layer.shared_expert {
                        backend.add_sigmoid_gated(&mut s.proj, &s.shexp, &s.h, &se.gate_inp, n)?;
                    }
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

    /// The attention block of layer `il` (its input, normalized, in `s.h`): its output is
    /// added into the residual `s.x`.
    #[allow(clippy::too_many_arguments)]
    fn attention_block(
        &self,
        backend: &B,
        cache: &mut B::Cache,
        layer: &crate::weights::LayerWeights<B::Weight>,
        il: usize,
        h_ready: B::Prepared,
        s: &mut Scratch<B>,
        n: usize,
    ) -> anyhow::Result<()> {
        let cfg = &self.config;
        let mut qkv_ready = if cfg.attn_output_gate {
            // Each head's query and its output gate come from one product.
            let (wq, wk, wv) = layer
                .qkv_weights()
                .with_context(|| format!("layer {il} has no attention weights"))?;
            let mut outs = [&mut s.qg, &mut s.k, &mut s.v];
            backend.matmul_many(&s.h, h_ready, &[wq, wk, wv], n, &mut outs);
            backend.split_gated_query(&s.qg, cfg.head_dim, n, &mut s.q, &mut s.ogate)?;
            B::Prepared::default()
        } else {
            backend.qkv(&s.h, h_ready, layer, n, &mut s.q, &mut s.k, &mut s.v)
        };
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
        let mut attn_ready = match &layer.attn_sinks {
            Some(sinks) => {
                backend.attention_sinks(&s.q, cache, &params, sinks, &s.step, n, &mut s.attn)?;
                B::Prepared::default()
            }
            None => backend.attention(&s.q, cache, &params, &s.step, n, &mut s.attn),
        };
        if cfg.attn_output_gate {
            backend.sigmoid_mul(&mut s.attn, &s.ogate, n)?;
            attn_ready = B::Prepared::default();
        }
        let wo = layer
            .attn_output
            .as_ref()
            .with_context(|| format!("layer {il} has no attention output"))?;
        if let Some(pn) = &layer.post_attention_norm {
            backend.matmul_ready(&s.attn, attn_ready, wo, n, &mut s.proj);
            backend.rms_norm(&s.proj, pn, cfg.rms_eps, n, &mut s.h);
            backend.add(&mut s.x, &s.h, n);
        } else if let Some(bias) = &layer.attn_output_bias {
            backend.matmul_ready(&s.attn, attn_ready, wo, n, &mut s.proj);
            backend.add_bias(&mut s.proj, bias, n);
            backend.add(&mut s.x, &s.proj, n);
        } else {
            backend.matmul_add(&s.attn, attn_ready, wo, n, &mut s.proj, &mut s.x);
        }
        Ok(())
    }
}
