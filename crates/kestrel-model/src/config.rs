//! Model hyper-parameters read from GGUF metadata.

use std::sync::Arc;

use kestrel_gguf::{GgmlType, GgufFile};

use crate::ModelError;

/// Architectures this engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    Gemma3,
    /// Qwen3 attention with a mixture-of-experts feed-forward block in every layer.
    Qwen3Moe,
    /// OpenAI's gpt-oss: attention sinks, alternating sliding-window layers, biases, and
    /// mixture-of-experts blocks with clamped SwiGLU experts.
    GptOss,
    /// Microsoft's Phi-3: Llama's block with fused Q/K/V and gate/up matrices.
    Phi3,
    /// Mistral 3 (Ministral): Llama's block with YaRN and an attention temperature.
    Mistral3,
    /// Qwen3-Next: gated DeltaNet linear-attention layers between gated full-attention
    /// layers, mixture-of-experts blocks with a gated shared expert.
    Qwen3Next,
    /// Qwen3.5: Qwen3-Next's layers with another head pairing in the linear attention,
    /// separate beta/alpha projections, and a dense feed-forward block.
    Qwen35,
    /// Qwen3.5's mixture-of-experts form (with a shared expert).
    Qwen35Moe,
}

impl Arch {
    pub fn from_name(name: &str) -> Result<Arch, ModelError> {
        match name {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "qwen3" => Ok(Arch::Qwen3),
            "gemma3" => Ok(Arch::Gemma3),
            "qwen3moe" => Ok(Arch::Qwen3Moe),
            "gpt-oss" => Ok(Arch::GptOss),
            "phi3" => Ok(Arch::Phi3),
            "mistral3" => Ok(Arch::Mistral3),
            "qwen3next" => Ok(Arch::Qwen3Next),
            "qwen35" => Ok(Arch::Qwen35),
            "qwen35moe" => Ok(Arch::Qwen35Moe),
            other => Err(ModelError::UnsupportedArch(other.to_string())),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::GptOss => "gpt-oss",
            Arch::Phi3 => "phi3",
            Arch::Mistral3 => "mistral3",
            Arch::Qwen3Next => "qwen3next",
            Arch::Qwen35 => "qwen35",
            Arch::Qwen35Moe => "qwen35moe",
        }
    }
}

/// The gated activation of the feed-forward block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SiLU(gate) * up (Llama, Qwen).
    Silu,
    /// GELU with the tanh approximation (Gemma).
    GeluTanh,
}

/// How the final hidden states of a sequence's tokens become one embedding
/// (`<arch>.pooling_type`, numbered as llama.cpp's `llama_pooling_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// 0: no pooling (one vector per token).
    None,
    /// 1: the mean over the sequence's tokens.
    Mean,
    /// 2: the first token's (BERT's `[CLS]`).
    Cls,
    /// 3: the last token's (causal embedding models such as Qwen3-Embedding).
    Last,
    /// 4: a reranker's score (classification head; not supported).
    Rank,
}

impl Pooling {
    /// The pooling of llama.cpp's number `n`; None for an unknown one.
    pub fn from_llama(n: u64) -> Option<Pooling> {
        Some(match n {
            0 => Pooling::None,
            1 => Pooling::Mean,
            2 => Pooling::Cls,
            3 => Pooling::Last,
            4 => Pooling::Rank,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Pooling::None => "none",
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::Last => "last",
            Pooling::Rank => "rank",
        }
    }
}

/// The feed-forward block of every layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FfnKind {
    /// One gated MLP: `down(act(gate(x)) * up(x))`.
    Dense,
    /// A mixture of experts (see [`MoeConfig`]).
    Moe(MoeConfig),
}

/// A mixture-of-experts feed-forward block, as llama.cpp's `build_moe_ffn` computes it:
/// router logits `ffn_gate_inp · x` (plus its bias where the model has one), the
/// `n_expert_used` experts chosen and weighted by `gating`, and the weighted sum of those
/// experts' gated MLPs. Expert weights are 3-D tensors `[n_expert, rows, row length]`
/// (`ffn_{gate,up,down}_exps`); only the selected experts' rows are read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeConfig {
    pub n_expert: usize,
    pub n_expert_used: usize,
    /// Hidden size of one expert (`expert_feed_forward_length`).
    pub n_ff_exp: usize,
    pub gating: Gating,
    /// Renormalize the selected experts' probabilities (`expert_weights_norm`; Qwen3-MoE
    /// does, and llama.cpp assumes it where the key is absent).
    pub norm_top_k: bool,
    /// The experts' activation, if not the model's `activation`: gpt-oss's clamped SwiGLU.
    pub clamped_swiglu: Option<ClampedSwiglu>,
    /// Hidden size of a shared expert every token runs beside its selected ones (Qwen3-Next,
    /// Qwen3.5-MoE: `ffn_{gate,up,down}_shexp`), whose output is scaled by
    /// `sigmoid(ffn_gate_inp_shexp · x)` and added to the experts' sum.
    pub shared_expert: Option<usize>,
}

/// What mixes information across positions in a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Softmax attention over the paged K/V cache.
    Attention,
    /// Gated DeltaNet linear attention ([`DeltaNetConfig`]): a short causal convolution and
    /// a recurrent state per sequence instead of a K/V cache.
    DeltaNet,
}

/// Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5), as llama.cpp computes it
/// (`src/models/qwen3next.cpp`, `ggml_ssm_conv`, `ggml_gated_delta_net`). Per token:
/// `attn_qkv · x` gives the `conv_dim()` channels (all q heads, all k heads, all v heads),
/// which pass through a causal depthwise convolution of `d_conv` taps (the previous
/// `d_conv - 1` inputs are the sequence's conv state) and SiLU; q and k heads are
/// L2-normalized. Each v head `h` with its k head (`k_head(h)`) updates its
/// `head_v_dim × head_k_dim` state `S`:
/// `S ← exp(g)·S; S ← S + β (v − S k) kᵀ; o = S q / sqrt(head_k_dim)`, with
/// `β = sigmoid(b)`, `g = softplus(a + ssm_dt) · ssm_a` from the beta/alpha projections.
/// The output is `rms_norm(o) · ssm_norm · silu(attn_gate · x)` per head, then `ssm_out`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaNetConfig {
    /// Convolution taps (`ssm.conv_kernel`).
    pub d_conv: usize,
    /// Size of a q/k head (`ssm.state_size`).
    pub head_k_dim: usize,
    /// Size of a v head (`ssm.inner_size / ssm.time_step_rank`).
    pub head_v_dim: usize,
    /// q/k heads (`ssm.group_count`).
    pub n_k_heads: usize,
    /// v heads (`ssm.time_step_rank`).
    pub n_v_heads: usize,
    /// Qwen3-Next pairs v head `h` with k head `h / (n_v / n_k)` and stores beta and alpha
    /// in one `ssm_ba` matrix grouped by k head; Qwen3.5 pairs it with `h % n_k` and has
    /// `ssm_beta` and `ssm_alpha`.
    pub qwen3next_layout: bool,
}

impl DeltaNetConfig {
    pub fn key_dim(&self) -> usize {
        self.head_k_dim * self.n_k_heads
    }

    pub fn value_dim(&self) -> usize {
        self.head_v_dim * self.n_v_heads
    }

    /// Channels of the convolution: q, k and v of every head.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    /// The k head v head `h` reads.
    pub fn k_head(&self, h: usize) -> usize {
        if self.qwen3next_layout {
            h / (self.n_v_heads / self.n_k_heads)
        } else {
            h % self.n_k_heads
        }
    }

    /// Columns of v head `h`'s beta and alpha in the beta/alpha projections' outputs (one
    /// `[2 · n_v]` row for Qwen3-Next's `ssm_ba`, two `[n_v]` rows for Qwen3.5's).
    pub fn beta_alpha_cols(&self, h: usize) -> (usize, usize) {
        if self.qwen3next_layout {
            let r = self.n_v_heads / self.n_k_heads;
            let (k, j) = (h / r, h % r);
            (k * 2 * r + j, k * 2 * r + r + j)
        } else {
            (h, h)
        }
    }

    /// Values of one layer's recurrent state per sequence.
    pub fn state_len(&self) -> usize {
        self.n_v_heads * self.head_v_dim * self.head_k_dim
    }

    /// Values of one layer's convolution state per sequence.
    pub fn conv_state_len(&self) -> usize {
        (self.d_conv - 1) * self.conv_dim()
    }
}

/// How router logits become expert weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over all experts, then the most probable (Qwen3-MoE).
    Softmax,
    /// The largest logits, then a softmax over just those (gpt-oss).
    TopKSoftmax,
}

/// gpt-oss's expert activation (ggml's `swiglu_oai`): with `g = min(gate, limit)` and
/// `u = clamp(up, -limit, limit)`, `g · sigmoid(alpha · g) · (u + 1)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClampedSwiglu {
    pub alpha: f32,
    pub limit: f32,
}

/// Mistral 3's attention temperature (llama.cpp's "llama 4 scaling"): the queries of a
/// token at position `p` are multiplied by `1 + scale · ln(floor(p / floor_scale) + 1)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnTemperature {
    pub scale: f32,
    /// YaRN's original context length.
    pub floor_scale: u32,
}

impl AttnTemperature {
    /// The query multiplier at position `pos`, computed as llama.cpp computes it.
    pub fn factor(&self, pos: u32) -> f32 {
        let steps = (pos as f32 / self.floor_scale as f32).floor() as f64;
        ((steps + 1.0).ln() * self.scale as f64 + 1.0) as f32
    }
}

/// RoPE frequency scaling, as `<arch>.rope.scaling.*` asks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// YaRN (ggml's `rope_yarn` with its correction dimensions).
    Yarn {
        factor: f32,
        orig_ctx: u32,
        ext_factor: f32,
        attn_factor: f32,
        beta_fast: f32,
        beta_slow: f32,
    },
}

/// Rotary embedding parameters of one layer (global and sliding-window layers may differ).
#[derive(Debug, Clone, PartialEq)]
pub struct RopeParams {
    /// Rotate pairs (i, i + n_rot/2) (NeoX) instead of adjacent pairs (i, i + 1).
    pub neox: bool,
    /// Number of leading dimensions of each head that rotate.
    pub n_rot: usize,
    pub base: f32,
    pub scaling: RopeScaling,
    /// Per-frequency divisors (`rope_freqs.weight`, how GGUF expresses Llama 3's scaling).
    pub freq_factors: Option<Arc<[f32]>>,
}

/// The constants of ggml's RoPE (`rope_yarn`) for one layer, shared by every backend.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeConstants {
    /// `base^(-2 / n_rot)`: pair i turns by `pos * theta_scale^i`.
    pub theta_scale: f32,
    /// 1 / linear factor.
    pub freq_scale: f32,
    /// YaRN's extrapolation mix (0 = plain interpolation).
    pub ext_factor: f32,
    /// Scale of cos and sin (YaRN's attention factor with its log correction).
    pub mscale: f32,
    /// YaRN's correction dimensions: the ramp runs from pair `corr_lo` to `corr_hi`.
    pub corr_lo: f32,
    pub corr_hi: f32,
}

impl RopeParams {
    /// `freq_scale` of ggml's rope (1 / linear factor).
    pub fn freq_scale(&self) -> f32 {
        match self.scaling {
            RopeScaling::None => 1.0,
            RopeScaling::Linear { factor } | RopeScaling::Yarn { factor, .. } => 1.0 / factor,
        }
    }

    pub fn constants(&self) -> RopeConstants {
        let n_rot = self.n_rot as f32;
        let freq_scale = self.freq_scale();
        let (ext_factor, mut mscale, corr_lo, corr_hi) = match self.scaling {
            RopeScaling::Yarn {
                orig_ctx,
                ext_factor,
                attn_factor,
                beta_fast,
                beta_slow,
                ..
            } => {
                let corr_dim = |n_rotations: f32| {
                    n_rot * (orig_ctx as f32 / (n_rotations * 2.0 * std::f32::consts::PI)).ln()
                        / (2.0 * self.base.ln())
                };
                let lo = corr_dim(beta_fast).floor().max(0.0);
                let hi = corr_dim(beta_slow).ceil().min(n_rot - 1.0);
                (ext_factor, attn_factor, lo, hi)
            }
            _ => (0.0, 1.0, 0.0, 0.0),
        };
        if ext_factor != 0.0 {
            mscale *= 1.0 + 0.1 * (1.0 / freq_scale).ln();
        }
        RopeConstants {
            theta_scale: self.base.powf(-2.0 / n_rot),
            freq_scale,
            ext_factor,
            mscale,
            corr_lo,
            corr_hi,
        }
    }
}

/// Everything the forward pass needs to know about a model's shape.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub arch: Arch,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    pub rms_eps: f32,
    /// RoPE of the global-attention layers.
    pub rope: RopeParams,
    /// RoPE of the sliding-window layers (Gemma 3 uses another base there).
    pub rope_swa: RopeParams,
    /// Window of the sliding-window layers, in tokens.
    pub sliding_window: Option<usize>,
    /// Per layer: does it use sliding-window attention?
    pub layer_is_swa: Vec<bool>,
    /// Multiplier of q·k.
    pub attn_scale: f32,
    /// Multiplier of the token embeddings (Gemma: sqrt(n_embd)).
    pub embed_scale: Option<f32>,
    pub activation: Activation,
    pub qkv_bias: bool,
    pub qk_norm: bool,
    /// Gemma's norms after attention and after the feed-forward block.
    pub post_norms: bool,
    /// The LM head reuses `token_embd.weight`.
    pub tied_embeddings: bool,
    /// Dense or mixture-of-experts feed-forward blocks.
    pub ffn: FfnKind,
    /// gpt-oss: a learned logit per head (`attn_sinks`) joins each softmax's denominator.
    pub attn_sinks: bool,
    /// gpt-oss: a bias on the attention output projection.
    pub attn_out_bias: bool,
    /// Mistral 3: queries scaled by position (`attention.temperature_scale`).
    pub attn_temperature: Option<AttnTemperature>,
    /// Per layer: attention or linear attention (all attention but in the hybrids).
    pub layer_kinds: Vec<LayerKind>,
    /// The linear-attention layers' shape, where the model has such layers.
    pub delta_net: Option<DeltaNetConfig>,
    /// Qwen3-Next / Qwen3.5: `attn_q` gives each head's query followed by a gate of the
    /// same size, and the attention output is multiplied by `sigmoid(gate)`.
    pub attn_output_gate: bool,
    /// `<arch>.pooling_type`, when the file states it.
    pub pooling: Option<Pooling>,
}

impl ModelConfig {
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// Values of keys (or of values) one layer of a paged cache holds, or `None` on overflow.
    pub fn kv_cache_len(&self, n_blocks: usize, block_size: usize) -> Option<usize> {
        n_blocks
            .checked_mul(block_size)
            .and_then(|s| s.checked_mul(self.kv_dim()))
    }

    /// Whether some layer keeps a recurrent state per sequence (which prefix caching and
    /// rollback cannot restore from K/V blocks).
    pub fn has_recurrent_layers(&self) -> bool {
        self.layer_kinds.contains(&LayerKind::DeltaNet)
    }

    /// Bytes of one sequence's recurrent states (f32 convolution and DeltaNet states of
    /// every linear-attention layer); 0 for models without such layers.
    pub fn recurrent_state_bytes(&self) -> usize {
        let Some(d) = &self.delta_net else {
            return 0;
        };
        let layers = self
            .layer_kinds
            .iter()
            .filter(|&&k| k == LayerKind::DeltaNet)
            .count();
        layers * (d.conv_state_len() + d.state_len()) * std::mem::size_of::<f32>()
    }

    pub fn layer_rope(&self, layer: usize) -> &RopeParams {
        if self.layer_is_swa[layer] {
            &self.rope_swa
        } else {
            &self.rope
        }
    }

    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        if self.layer_is_swa[layer] {
            self.sliding_window
        } else {
            None
        }
    }

    /// Reads the configuration from GGUF metadata.
    pub fn from_gguf(file: &GgufFile) -> Result<ModelConfig, ModelError> {
        let arch_name = file
            .architecture()
            .ok_or_else(|| ModelError::MissingKey("general.architecture".into()))?;
        let arch = Arch::from_name(arch_name)?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let req_u = |k: &str| -> Result<usize, ModelError> {
            let full = key(k);
            file.get_u64(&full)
                .map(|v| v as usize)
                .ok_or(ModelError::MissingKey(full))
        };
        let opt_u = |k: &str| file.get_u64(&key(k)).map(|v| v as usize);
        let opt_f = |k: &str| file.get_f32(&key(k));

        // Multi-token-prediction blocks (`nextn_predict_layers`, Qwen3-Next's) follow the
        // model's own blocks in the file; the forward pass does not run them.
        let n_layer = req_u("block_count")?
            .checked_sub(opt_u("nextn_predict_layers").unwrap_or(0))
            .ok_or_else(|| {
                ModelError::Invalid("nextn_predict_layers exceeds block_count".into())
            })?;
        let n_embd = req_u("embedding_length")?;
        let n_head = req_u("attention.head_count")?;
        let n_head_kv = opt_u("attention.head_count_kv").unwrap_or(n_head);
        let n_ff = req_u("feed_forward_length")?;
        if n_layer == 0 || n_embd == 0 || n_head == 0 || n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(ModelError::Invalid(format!(
                "bad shape: {n_layer} layers, {n_embd} embd, {n_head} heads, {n_head_kv} kv heads"
            )));
        }
        let head_dim = opt_u("attention.key_length").unwrap_or(n_embd / n_head);
        let vocab_size = match opt_u("vocab_size") {
            Some(v) => v,
            None => file
                .get_array("tokenizer.ggml.tokens")
                .map(|a| a.len())
                .or_else(|| file.tensor("token_embd.weight").map(|t| t.dims[1] as usize))
                .ok_or(ModelError::MissingKey(key("vocab_size")))?,
        };
        if head_dim == 0 || n_ff == 0 || vocab_size == 0 {
            return Err(ModelError::Invalid(format!(
                "bad shape: head size {head_dim}, feed-forward {n_ff}, vocabulary {vocab_size}"
            )));
        }
        let context_length = opt_u("context_length").unwrap_or(4096);
        check_against_file(
            file,
            &Shape {
                n_layer,
                n_embd,
                n_head,
                n_head_kv,
                head_dim,
                n_ff,
                vocab_size,
                context_length,
                gated_q: matches!(arch, Arch::Qwen3Next | Arch::Qwen35 | Arch::Qwen35Moe),
            },
        )?;
        let rms_eps = opt_f("attention.layer_norm_rms_epsilon").unwrap_or(1e-5);
        let rope_base = opt_f("rope.freq_base").unwrap_or(10000.0);
        let n_rot = opt_u("rope.dimension_count").unwrap_or(head_dim);

        let scaling = match file.get_str(&key("rope.scaling.type")) {
            None | Some("none") => match opt_f("rope.scale_linear") {
                Some(f) if f != 1.0 => RopeScaling::Linear { factor: f },
                _ => RopeScaling::None,
            },
            Some("linear") => RopeScaling::Linear {
                factor: opt_f("rope.scaling.factor").unwrap_or(1.0),
            },
            Some("yarn") => {
                let factor = opt_f("rope.scaling.factor").unwrap_or(1.0);
                RopeScaling::Yarn {
                    factor,
                    orig_ctx: opt_u("rope.scaling.original_context_length")
                        .unwrap_or(context_length) as u32,
                    ext_factor: opt_f("rope.scaling.yarn_ext_factor").unwrap_or(1.0),
                    // `yarn_log_multiplier` (Mistral 3's `mscale_all_dim`) divides the
                    // magnitude scale, as llama.cpp's context setup does.
                    attn_factor: opt_f("rope.scaling.attn_factor").unwrap_or(1.0)
                        / match opt_f("rope.scaling.yarn_log_multiplier") {
                            Some(m) if m != 0.0 && factor > 1.0 => 1.0 + 0.1 * m * factor.ln(),
                            _ => 1.0,
                        },
                    beta_fast: opt_f("rope.scaling.yarn_beta_fast").unwrap_or(32.0),
                    beta_slow: opt_f("rope.scaling.yarn_beta_slow").unwrap_or(1.0),
                }
            }
            Some(other) => {
                return Err(ModelError::Invalid(format!(
                    "unsupported rope scaling type {other:?}"
                )));
            }
        };
        let factor = match scaling {
            RopeScaling::Linear { factor } | RopeScaling::Yarn { factor, .. } => factor,
            RopeScaling::None => 1.0,
        };
        if !(factor.is_finite() && factor > 0.0) {
            return Err(ModelError::Invalid(format!(
                "bad rope scaling factor {factor}"
            )));
        }
        if file.tensor("rope_factors_long.weight").is_some() {
            return Err(ModelError::Invalid(
                "LongRoPE (rope_factors_long/short, Phi-3's 128k-context models) is not \
                 supported yet"
                    .into(),
            ));
        }
        let freq_factors = match file.tensor("rope_freqs.weight") {
            None => None,
            Some(t) if t.ty == GgmlType::F32 && t.n_elements() as usize == n_rot / 2 => {
                let bytes = file.tensor_data(t);
                Some(
                    bytes
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect::<Arc<[f32]>>(),
                )
            }
            Some(t) => {
                return Err(ModelError::Invalid(format!(
                    "rope_freqs.weight must be f32 with {} values, found {} {:?}",
                    n_rot / 2,
                    t.ty,
                    t.dims
                )));
            }
        };
        let neox = !matches!(arch, Arch::Llama | Arch::Mistral3);
        let rope = RopeParams {
            neox,
            n_rot,
            base: rope_base,
            scaling,
            freq_factors,
        };
        let mut rope_swa = rope.clone();
        let mut sliding_window = None;
        let mut layer_is_swa = vec![false; n_layer];
        let mut attn_scale = 1.0 / (head_dim as f32).sqrt();
        let mut embed_scale = None;
        let mut activation = Activation::Silu;
        let mut post_norms = false;
        let hybrid = matches!(arch, Arch::Qwen3Next | Arch::Qwen35 | Arch::Qwen35Moe);
        let qk_norm = hybrid || matches!(arch, Arch::Qwen3 | Arch::Gemma3 | Arch::Qwen3Moe);
        let qkv_bias = matches!(arch, Arch::Qwen2 | Arch::GptOss);

        if n_rot > head_dim || n_rot % 2 != 0 {
            return Err(ModelError::Invalid(format!(
                "rope dimension {n_rot} must be even and at most the head size {head_dim}"
            )));
        }
        if arch == Arch::Gemma3 {
            // Gemma 3: every sixth layer is global; the others use a 10k-base RoPE
            // without scaling over a sliding window.
            sliding_window = opt_u("attention.sliding_window");
            for (il, swa) in layer_is_swa.iter_mut().enumerate() {
                *swa = sliding_window.is_some() && (il + 1) % 6 != 0;
            }
            rope_swa = RopeParams {
                base: 10000.0,
                scaling: RopeScaling::None,
                freq_factors: None,
                ..rope.clone()
            };
            let q_scalar = opt_f("attention.query_pre_attn_scalar").unwrap_or(head_dim as f32);
            attn_scale = 1.0 / q_scalar.sqrt();
            embed_scale = Some((n_embd as f32).sqrt());
            activation = Activation::GeluTanh;
            post_norms = true;
        }

        if arch == Arch::GptOss {
            // gpt-oss: even layers attend over a sliding window (llama.cpp's swa pattern 2),
            // with the same RoPE as the others.
            sliding_window = opt_u("attention.sliding_window");
            for (il, swa) in layer_is_swa.iter_mut().enumerate() {
                *swa = sliding_window.is_some() && il % 2 == 0;
            }
        }
        let ffn = match arch {
            Arch::Qwen3Moe | Arch::GptOss | Arch::Qwen3Next | Arch::Qwen35Moe => {
                let oss = arch == Arch::GptOss;
                let n_expert_used = req_u("expert_used_count")?;
                let n_ff_exp = match opt_u("expert_feed_forward_length") {
                    Some(v) => v,
                    // llama.cpp's default for the hybrids.
                    None if hybrid => n_ff / n_expert_used.max(1),
                    None => req_u("expert_feed_forward_length")?,
                };
                let moe = MoeConfig {
                    n_expert: req_u("expert_count")?,
                    n_expert_used,
                    n_ff_exp,
                    gating: if oss {
                        Gating::TopKSoftmax
                    } else {
                        Gating::Softmax
                    },
                    // The hybrids' graphs always renormalize.
                    norm_top_k: hybrid
                        || !oss && file.get_bool(&key("expert_weights_norm")).unwrap_or(true),
                    // llama.cpp's constants for gpt-oss.
                    clamped_swiglu: oss.then_some(ClampedSwiglu {
                        alpha: 1.702,
                        limit: 7.0,
                    }),
                    shared_expert: hybrid.then(|| {
                        opt_u("expert_shared_feed_forward_length")
                            .filter(|&v| v > 0)
                            .unwrap_or(n_ff)
                    }),
                };
                if moe.n_ff_exp == 0 || !(1..=moe.n_expert).contains(&moe.n_expert_used) {
                    return Err(ModelError::Invalid(format!(
                        "bad experts: {} used of {}, hidden size {}",
                        moe.n_expert_used, moe.n_expert, moe.n_ff_exp
                    )));
                }
                FfnKind::Moe(moe)
            }
            _ => FfnKind::Dense,
        };
        let attn_temperature = match opt_f("attention.temperature_scale") {
            Some(scale) if arch == Arch::Mistral3 && scale != 0.0 => {
                let floor_scale = opt_u("rope.scaling.original_context_length")
                    .filter(|&n| n > 0)
                    .ok_or_else(|| {
                        ModelError::Invalid(
                            "attention temperature scaling needs \
                             rope.scaling.original_context_length"
                                .into(),
                        )
                    })?;
                Some(AttnTemperature {
                    scale,
                    floor_scale: floor_scale as u32,
                })
            }
            _ => None,
        };
        let (layer_kinds, delta_net) = if hybrid {
            hybrid_layers(file, &key, n_layer)?
        } else {
            (vec![LayerKind::Attention; n_layer], None)
        };
        if hybrid {
            check_rope_sections(file, &key("rope.dimension_sections"), n_rot)?;
        }
        let tied_embeddings = file.tensor("output.weight").is_none();
        let pooling = match file.get(&key("pooling_type")) {
            None => None,
            Some(v) => Some(v.as_u64().and_then(Pooling::from_llama).ok_or_else(|| {
                ModelError::Invalid(format!(
                    "{} is {v:?}: expected a pooling type 0..=4 (none, mean, cls, last, rank)",
                    key("pooling_type")
                ))
            })?),
        };
        Ok(ModelConfig {
            arch,
            n_layer,
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
            n_ff,
            vocab_size,
            context_length,
            rms_eps,
            rope,
            rope_swa,
            sliding_window,
            layer_is_swa,
            attn_scale,
            embed_scale,
            activation,
            qkv_bias,
            qk_norm,
            post_norms,
            tied_embeddings,
            ffn,
            attn_sinks: arch == Arch::GptOss,
            attn_out_bias: arch == Arch::GptOss,
            attn_temperature,
            layer_kinds,
            delta_net,
            attn_output_gate: hybrid,
            pooling,
        })
    }
}

/// The sizes read from metadata, before anything is allocated from them.
struct Shape {
    n_layer: usize,
    n_embd: usize,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    n_ff: usize,
    vocab_size: usize,
    context_length: usize,
    /// `attn_q` holds a gate row behind each head's query rows (twice the width).
    gated_q: bool,
}

/// Most positions a model may claim: ggml stores positions as `i32`.
pub const MAX_CONTEXT_LENGTH: usize = i32::MAX as usize;

/// Checks metadata sizes against each other and against the file's tensor table, so that a
/// hostile header (say `block_count = 2^31`) is an error before any allocation is sized
/// from it. Tensor shapes are bounded by the file itself (the reader checks that every
/// tensor's data lies inside it), so sizes that match them are bounded too.
fn check_against_file(file: &GgufFile, s: &Shape) -> Result<(), ModelError> {
    let bad = |msg: String| Err(ModelError::Invalid(msg));
    // Every block has tensors of its own: more blocks than tensors cannot be.
    let n_tensors = file.tensors().len();
    if s.n_layer > n_tensors {
        return bad(format!(
            "block_count {} is more than the file's {n_tensors} tensors",
            s.n_layer
        ));
    }
    if s.context_length == 0 || s.context_length > MAX_CONTEXT_LENGTH {
        return bad(format!(
            "context_length {} is outside 1..={MAX_CONTEXT_LENGTH}",
            s.context_length
        ));
    }
    let embd = file
        .tensor("token_embd.weight")
        .ok_or_else(|| ModelError::MissingTensor("token_embd.weight".into()))?;
    let embd_dims: Vec<u64> = embd.dims.to_vec();
    if embd_dims != [s.n_embd as u64, s.vocab_size as u64] {
        return bad(format!(
            "token_embd.weight has shape {embd_dims:?}, but the metadata says \
             embedding_length {} and a vocabulary of {}",
            s.n_embd, s.vocab_size
        ));
    }
    if let Some(tokens) = file.get_array("tokenizer.ggml.tokens")
        && tokens.len() > s.vocab_size
    {
        return bad(format!(
            "the tokenizer has {} tokens but the embeddings only {} rows",
            tokens.len(),
            s.vocab_size
        ));
    }
    // Head products must be the attention tensors' widths (and must not overflow). A
    // missing tensor is reported when the weights load.
    let width = |heads: usize, what: &str| {
        heads.checked_mul(s.head_dim).ok_or_else(|| {
            ModelError::Invalid(format!("{heads} {what} of size {} overflow", s.head_dim))
        })
    };
    let q_dim = width(s.n_head, "heads")?;
    let kv_dim = width(s.n_head_kv, "kv heads")?;
    let q_rows = if s.gated_q { 2 * q_dim } else { q_dim };
    for (name, want) in [
        ("blk.0.attn_q.weight", q_rows),
        ("blk.0.attn_k.weight", kv_dim),
    ] {
        if let Some(t) = file.tensor(name)
            && t.dims.to_vec() != [s.n_embd as u64, want as u64]
        {
            return bad(format!(
                "{name} has shape {:?}, but the metadata asks for [{}, {want}]",
                t.dims, s.n_embd
            ));
        }
    }
    // Phi-3 stores gate and up in one `ffn_up` (and no `ffn_gate`): twice the FFN width.
    let fused = file.tensor("blk.0.ffn_gate.weight").is_none();
    if let Some(t) = file.tensor("blk.0.ffn_up.weight") {
        let (d, ff) = (s.n_embd as u64, s.n_ff as u64);
        let dims = t.dims.to_vec();
        let doubled = ff.checked_mul(2).map(|ff2| [d, ff2]);
        if dims != [d, ff] && !(fused && doubled.is_some_and(|w| dims == w)) {
            return bad(format!(
                "blk.0.ffn_up.weight has shape {dims:?}, but the metadata asks for [{d}, {ff}]"
            ));
        }
    }
    Ok(())
}

/// The hybrids' layer kinds (`attention.recurrent_layers`, else every
/// `full_attention_interval`-th layer is attention, llama.cpp's default 4) and their
/// linear-attention shape (`ssm.*`), checked against each other.
fn hybrid_layers(
    file: &GgufFile,
    key: &dyn Fn(&str) -> String,
    n_layer: usize,
) -> Result<(Vec<LayerKind>, Option<DeltaNetConfig>), ModelError> {
    let bad = |msg: String| Err(ModelError::Invalid(msg));
    let kinds: Vec<LayerKind> = match file.get_array(&key("attention.recurrent_layers")) {
        Some(flags) => {
            if flags.len() < n_layer {
                return bad(format!(
                    "attention.recurrent_layers has {} entries for {n_layer} layers",
                    flags.len()
                ));
            }
            flags[..n_layer]
                .iter()
                .map(
                    |v| match v.as_bool().or_else(|| v.as_u64().map(|u| u != 0)) {
                        Some(true) => Ok(LayerKind::DeltaNet),
                        Some(false) => Ok(LayerKind::Attention),
                        None => Err(ModelError::Invalid(
                            "attention.recurrent_layers must hold booleans".into(),
                        )),
                    },
                )
                .collect::<Result<_, _>>()?
        }
        None => {
            let interval = file.get_u64(&key("full_attention_interval")).unwrap_or(4) as usize;
            if interval == 0 {
                return bad("full_attention_interval must be at least 1".into());
            }
            (0..n_layer)
                .map(|i| {
                    if (i + 1) % interval != 0 {
                        LayerKind::DeltaNet
                    } else {
                        LayerKind::Attention
                    }
                })
                .collect()
        }
    };
    let req = |k: &str| -> Result<usize, ModelError> {
        let full = key(k);
        file.get_u64(&full)
            .map(|v| v as usize)
            .ok_or(ModelError::MissingKey(full))
    };
    if !kinds.contains(&LayerKind::DeltaNet) {
        return Ok((kinds, None));
    }
    let d_conv = req("ssm.conv_kernel")?;
    let d_inner = req("ssm.inner_size")?;
    let d_state = req("ssm.state_size")?;
    let n_v = req("ssm.time_step_rank")?;
    let n_k = req("ssm.group_count")?;
    if d_conv == 0 || d_state == 0 || n_v == 0 || n_k == 0 || n_v % n_k != 0 {
        return bad(format!(
            "bad linear attention: conv kernel {d_conv}, state size {d_state}, {n_v} value \
             heads, {n_k} key heads (a multiple of the key heads is needed)"
        ));
    }
    // llama.cpp's gated delta rule needs square states (value head size = key head size).
    if d_state.checked_mul(n_v) != Some(d_inner) {
        return bad(format!(
            "linear attention inner size {d_inner} is not state size {d_state} × {n_v} heads"
        ));
    }
    // Every size the states and the convolution are made of, without overflow (each is
    // a tensor width, checked against the file when the weights load).
    let key_dim = d_state.checked_mul(n_k);
    let sizes = key_dim
        .and_then(|k| k.checked_mul(2)?.checked_add(d_inner))
        .and_then(|conv| conv.checked_mul(d_conv))
        .zip(d_inner.checked_mul(d_state));
    if sizes.is_none() {
        return bad("linear attention sizes overflow".into());
    }
    let cfg = DeltaNetConfig {
        d_conv,
        head_k_dim: d_state,
        head_v_dim: d_state,
        n_k_heads: n_k,
        n_v_heads: n_v,
        qwen3next_layout: file.architecture() == Some("qwen3next"),
    };
    Ok((kinds, Some(cfg)))
}

/// Qwen3.5's interleaved M-RoPE (`rope.dimension_sections`) turns text positions (the same
/// in its three sections) exactly as NeoX RoPE does, as long as every rotated pair falls in
/// one of those sections; a pair left to the fourth (image) section would not turn.
fn check_rope_sections(file: &GgufFile, key: &str, n_rot: usize) -> Result<(), ModelError> {
    let Some(values) = file.get_array(key) else {
        return Ok(());
    };
    let s: Vec<usize> = values
        .iter()
        .map(|v| v.as_u64().map(|u| u as usize))
        .collect::<Option<_>>()
        .ok_or_else(|| ModelError::Invalid(format!("{key} must hold integers")))?;
    let sec = |i: usize| s.get(i).copied().unwrap_or(0);
    let total = s
        .iter()
        .try_fold(0usize, |a, &b| a.checked_add(b))
        .unwrap_or(0);
    let covered = total > 0
        && (0..n_rot / 2).all(|i| {
            let sector = i % total;
            (sector % 3 == 1 && sector < 3 * sec(1))
                || (sector % 3 == 2 && sector < 3 * sec(2))
                || (sector % 3 == 0 && sector < 3 * sec(0))
        });
    if !covered {
        return Err(ModelError::Invalid(format!(
            "{key} {s:?} leaves rotated dimensions to the image section; only text \
             positions are supported"
        )));
    }
    Ok(())
}
