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
    pub post_attention_norm: Option<W>,
    pub ffn_norm: W,
    pub ffn_gate: W,
    pub ffn_up: W,
    pub ffn_down: W,
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
