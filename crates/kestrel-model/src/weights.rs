//! The weights of a model as the forward pass reads them (`load` fills them through a
//! backend).

/// The weights of one transformer block.
pub struct LayerWeights<W> {
    pub attn_norm: W,
    pub attn_q: W,
    pub attn_k: W,
    pub attn_v: W,
    pub attn_q_bias: Option<W>,
    pub attn_k_bias: Option<W>,
    pub attn_v_bias: Option<W>,
    pub attn_q_norm: Option<W>,
    pub attn_k_norm: Option<W>,
    pub attn_output: W,
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
