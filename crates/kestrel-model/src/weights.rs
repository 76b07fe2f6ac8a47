//! The weights of a model as the forward pass reads them (`load` fills them through a
//! backend).

/// The weights of one transformer block.
pub struct LayerWeights<W> {
    pub attn_norm: W,
    /// Q, K, V and output projections: every attention layer has them, a linear-attention
    /// layer ([`Self::delta_net`]) has none (the forward pass never asks it for them).
    /// Qwen3-Next's `attn_q` has a gate row block behind each head's query rows.
    pub attn_q: Option<W>,
    pub attn_k: Option<W>,
    pub attn_v: Option<W>,
    pub attn_q_bias: Option<W>,
    pub attn_k_bias: Option<W>,
    pub attn_v_bias: Option<W>,
    pub attn_q_norm: Option<W>,
    pub attn_k_norm: Option<W>,
    pub attn_output: Option<W>,
    /// A gated DeltaNet layer's weights, in place of attention.
    pub delta_net: Option<DeltaNetWeights<W>>,
    /// gpt-oss: the output projection's bias and each head's sink logit.
    pub attn_output_bias: Option<W>,
    pub attn_sinks: Option<W>,
    pub post_attention_norm: Option<W>,
    pub ffn_norm: W,
    /// The router of a mixture-of-experts block (`ffn_gate_inp`, `[n_expert × n_embd]`).
    pub ffn_gate_inp: Option<W>,
    /// Gate, up and down projections: `[n_ff × n_embd]` matrices of a dense block, or
    /// every expert's stacked into a 3-D `[n_expert × n_ff_exp × n_embd]` tensor
    /// (`ffn_*_exps`) in a mixture-of-experts block.
    pub ffn_gate: W,
    pub ffn_up: W,
    pub ffn_down: W,
    /// gpt-oss: biases of the router and of each expert's projections (rows of
    /// `[n_expert × rows]` tensors for the experts).
    pub ffn_gate_inp_bias: Option<W>,
    pub ffn_gate_exps_bias: Option<W>,
    pub ffn_up_exps_bias: Option<W>,
    pub ffn_down_exps_bias: Option<W>,
    pub post_ffw_norm: Option<W>,
    /// The shared expert of a mixture-of-experts block (Qwen3-Next).
    pub shared_expert: Option<SharedExpertWeights<W>>,
}

impl<W> LayerWeights<W> {
    /// The Q, K and V projections of an attention layer.
    pub fn qkv_weights(&self) -> Option<(&W, &W, &W)> {
        Some((
            self.attn_q.as_ref()?,
            self.attn_k.as_ref()?,
            self.attn_v.as_ref()?,
        ))
    }
}

/// A gated DeltaNet layer ([`crate::DeltaNetConfig`]), llama.cpp's tensor names.
pub struct DeltaNetWeights<W> {
    /// `attn_qkv`: `[conv_dim × n_embd]`, the convolution's input channels.
    pub in_qkv: W,
    /// `attn_gate`: `[value_dim × n_embd]`, the output gate `z`.
    pub gate: W,
    /// `ssm_ba` (Qwen3-Next, `[2·n_v × n_embd]`, beta and alpha grouped by k head), or
    /// `ssm_beta` and `ssm_alpha` (Qwen3.5, `[n_v × n_embd]` each; `alpha` is `Some`).
    pub beta: W,
    pub alpha: Option<W>,
    /// `ssm_conv1d`: `[conv_dim × d_conv]` taps (f32).
    pub conv: W,
    /// `ssm_dt.bias` and `ssm_a` (`-exp(A_log)`), one value per v head.
    pub dt_bias: W,
    pub a: W,
    /// `ssm_norm`: the gated output norm's weight, `[head_v_dim]`.
    pub norm: W,
    /// `ssm_out`: `[n_embd × value_dim]`.
    pub out: W,
}

/// A shared expert: a gated MLP every token runs, scaled by `sigmoid(gate_inp · x)`.
pub struct SharedExpertWeights<W> {
    /// `ffn_gate_inp_shexp`, `[n_embd]`.
    pub gate_inp: W,
    pub gate: W,
    pub up: W,
    pub down: W,
}

/// All weights of a model.
pub struct ModelWeights<W> {
    pub token_embd: W,
    pub layers: Vec<LayerWeights<W>>,
    pub output_norm: W,
    /// `None` when the LM head is tied to `token_embd`.
    pub output: Option<W>,
}

impl<W> ModelWeights<W> {
    /// The LM head matrix.
    pub fn lm_head(&self) -> &W {
        self.output.as_ref().unwrap_or(&self.token_embd)
    }
}
