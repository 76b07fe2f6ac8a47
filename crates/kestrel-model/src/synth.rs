//! Random-weight ("synthetic") GGUF models for tests and benchmarks.
//!
//! A synthetic file has the metadata keys, tensor names, shapes and types that llama.cpp's
//! converter and `llama-quantize` produce for the architecture, random weights, and
//! `tokenizer.ggml.model = "none"` with `<arch>.vocab_size`, which llama.cpp accepts (it adds
//! dummy tokens), so both engines can load and time the same file.
//!
//! Weights are generated and quantized in parallel, a chunk of whole rows at a time, each chunk
//! from its own RNG seeded by (seed, tensor name, chunk index): the bytes depend only on the
//! seed, never on the thread count. Chunks are streamed to the file in order by a writer
//! thread, so memory stays bounded by a few batches of chunks whatever the model size.

use std::io::Write;
use std::path::Path;
use std::sync::mpsc;

use kestrel_gguf::{FileStream, GgmlType, GgufError, GgufWriter, TensorStream, Value};
use kestrel_quant::QuantError;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, Normal};
use rayon::prelude::*;

use crate::config::Arch;

/// Errors from building or writing a synthetic model.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("quantizing {tensor}: {source}")]
    Quant { tensor: String, source: QuantError },
}

fn invalid(msg: impl Into<String>) -> SynthError {
    SynthError::Invalid(msg.into())
}

/// The weight type asked for (`--type`), which may mix tensor types (`q4_k_m`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q8_0,
    Q4K,
    /// llama-quantize's Q4_K_M mix (see [`SynthConfig::tensor_type`]).
    Q4KM,
    Q5K,
    Q6K,
    Iq4Nl,
    Iq4Xs,
    Mxfp4,
}

impl WeightType {
    pub const ALL: [WeightType; 14] = [
        WeightType::F32,
        WeightType::F16,
        WeightType::Bf16,
        WeightType::Q4_0,
        WeightType::Q4_1,
        WeightType::Q5_0,
        WeightType::Q8_0,
        WeightType::Q4K,
        WeightType::Q4KM,
        WeightType::Q5K,
        WeightType::Q6K,
        WeightType::Iq4Nl,
        WeightType::Iq4Xs,
        WeightType::Mxfp4,
    ];

    pub fn name(self) -> &'static str {
        match self {
            WeightType::F32 => "f32",
            WeightType::F16 => "f16",
            WeightType::Bf16 => "bf16",
            WeightType::Q4_0 => "q4_0",
            WeightType::Q4_1 => "q4_1",
            WeightType::Q5_0 => "q5_0",
            WeightType::Q8_0 => "q8_0",
            WeightType::Q4K => "q4_k",
            WeightType::Q4KM => "q4_k_m",
            WeightType::Q5K => "q5_k",
            WeightType::Q6K => "q6_k",
            WeightType::Iq4Nl => "iq4_nl",
            WeightType::Iq4Xs => "iq4_xs",
            WeightType::Mxfp4 => "mxfp4",
        }
    }

    /// Parses a name as `name()` prints it (case-insensitive).
    pub fn from_name(name: &str) -> Result<WeightType, SynthError> {
        let lower = name.to_ascii_lowercase();
        WeightType::ALL
            .into_iter()
            .find(|t| t.name() == lower)
            .ok_or_else(|| {
                let names: Vec<&str> = WeightType::ALL.iter().map(|t| t.name()).collect();
                invalid(format!(
                    "unknown weight type '{name}' (expected one of {})",
                    names.join(", ")
                ))
            })
    }

    /// llama.cpp's `LLAMA_FTYPE_*` value for `general.file_type`. A file of pure Q4_K / Q5_K
    /// has no type of its own; it gets the `_S` variant, the mix closest to it.
    pub fn file_type(self) -> u32 {
        match self {
            WeightType::F32 => 0,    // LLAMA_FTYPE_ALL_F32
            WeightType::F16 => 1,    // MOSTLY_F16
            WeightType::Q4_0 => 2,   // MOSTLY_Q4_0
            WeightType::Q4_1 => 3,   // MOSTLY_Q4_1
            WeightType::Q8_0 => 7,   // MOSTLY_Q8_0
            WeightType::Q5_0 => 8,   // MOSTLY_Q5_0
            WeightType::Q4K => 14,   // MOSTLY_Q4_K_S
            WeightType::Q4KM => 15,  // MOSTLY_Q4_K_M
            WeightType::Q5K => 16,   // MOSTLY_Q5_K_S
            WeightType::Q6K => 18,   // MOSTLY_Q6_K
            WeightType::Bf16 => 32,  // MOSTLY_BF16
            WeightType::Iq4Nl => 25, // MOSTLY_IQ4_NL
            WeightType::Iq4Xs => 30, // MOSTLY_IQ4_XS
            WeightType::Mxfp4 => 38, // MOSTLY_MXFP4_MOE
        }
    }

    /// The tensor type of most weight matrices.
    pub fn base(self) -> GgmlType {
        match self {
            WeightType::F32 => GgmlType::F32,
            WeightType::F16 => GgmlType::F16,
            WeightType::Bf16 => GgmlType::BF16,
            WeightType::Q4_0 => GgmlType::Q4_0,
            WeightType::Q4_1 => GgmlType::Q4_1,
            WeightType::Q5_0 => GgmlType::Q5_0,
            WeightType::Q8_0 => GgmlType::Q8_0,
            WeightType::Q4K | WeightType::Q4KM => GgmlType::Q4K,
            WeightType::Q5K => GgmlType::Q5K,
            WeightType::Q6K => GgmlType::Q6K,
            WeightType::Iq4Nl => GgmlType::IQ4NL,
            WeightType::Iq4Xs => GgmlType::IQ4XS,
            WeightType::Mxfp4 => GgmlType::MXFP4,
        }
    }
}

impl std::fmt::Display for WeightType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for WeightType {
    type Err = SynthError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        WeightType::from_name(s)
    }
}

/// Shape and hyper-parameters of a synthetic model.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthConfig {
    pub arch: Arch,
    /// `general.name`.
    pub name: String,
    pub n_layer: u32,
    pub n_embd: u32,
    pub n_ff: u32,
    pub n_head: u32,
    pub n_head_kv: u32,
    pub head_dim: u32,
    pub n_vocab: u32,
    pub n_ctx: u32,
    pub rope_freq_base: f32,
    pub rms_eps: f32,
    /// Biases on the Q, K and V projections (Qwen2).
    pub qkv_bias: bool,
    /// The output projection reuses `token_embd.weight` (no `output.weight`).
    pub tied_embeddings: bool,
    /// Sliding-window attention width (Gemma 3 only; 0 elsewhere).
    pub sliding_window: u32,
    /// Experts of each mixture-of-experts block, how many each token uses, and the hidden
    /// size of one (all 0 for dense models).
    pub n_expert: u32,
    pub n_expert_used: u32,
    pub n_ff_exp: u32,
    /// Standard deviation of the weight matrices' values.
    pub weight_std: f32,
    /// YaRN RoPE scaling and Mistral 3's attention temperature (`mistral3` only).
    pub yarn: Option<SynthYarn>,
    /// The linear-attention layers of the hybrids (`qwen3next`, `qwen35`, `qwen35moe`).
    pub hybrid: Option<SynthHybrid>,
}

/// The hybrids' linear-attention shape and layer pattern, and their shared expert.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SynthHybrid {
    /// `ssm.conv_kernel`, `ssm.state_size` (q/k/v head size), `ssm.group_count` (q/k
    /// heads), `ssm.time_step_rank` (v heads).
    pub d_conv: u32,
    pub d_state: u32,
    pub n_group: u32,
    pub n_v_heads: u32,
    /// Every this many layers one is full attention (`full_attention_interval`).
    pub full_attn_interval: u32,
    /// Rotated dimensions of a head (`rope.dimension_count`).
    pub n_rot: u32,
    /// Hidden size of the shared expert (0: none).
    pub n_ff_shexp: u32,
}

impl SynthHybrid {
    fn is_attention(&self, layer: u32) -> bool {
        (layer + 1).is_multiple_of(self.full_attn_interval)
    }
}

/// The RoPE keys of a Mistral 3 file.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SynthYarn {
    pub factor: f32,
    pub orig_ctx: u32,
    /// `rope.scaling.yarn_log_multiplier`.
    pub log_mul: f32,
    /// `attention.temperature_scale` (0: none).
    pub temperature_scale: f32,
}

/// Names accepted by [`SynthConfig::preset`].
pub const PRESETS: [&str; 9] = [
    "tiny",
    "llama3-8b",
    "llama3-70b",
    "qwen2.5-1.5b",
    "qwen2.5-7b",
    "qwen3-30b-a3b",
    "gpt-oss-20b",
    "qwen3-next-80b-a3b",
    "qwen3-next-dense",
];

/// Size overrides on top of a preset (the CLI's `--layers`, `--embd`, ... flags).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SynthOverrides {
    pub n_layer: Option<u32>,
    pub n_embd: Option<u32>,
    pub n_ff: Option<u32>,
    pub n_head: Option<u32>,
    pub n_head_kv: Option<u32>,
    pub head_dim: Option<u32>,
    pub n_vocab: Option<u32>,
    pub n_ctx: Option<u32>,
}

impl SynthConfig {
    /// A few-MB model of `arch`: every quantized row length is a multiple of 256 so that all
    /// types, K-quants included, apply to every matrix.
    pub fn tiny(arch: Arch) -> SynthConfig {
        let (rope_freq_base, rms_eps) = match arch {
            Arch::Llama | Arch::Phi3 => (10_000.0, 1e-5),
            Arch::Mistral3 => (1_000_000.0, 1e-5),
            Arch::Qwen2 | Arch::Qwen3 | Arch::Gemma3 | Arch::Qwen3Moe => (1_000_000.0, 1e-6),
            Arch::GptOss => (150_000.0, 1e-5),
            Arch::Qwen3Next | Arch::Qwen35 | Arch::Qwen35Moe => (10_000_000.0, 1e-6),
        };
        let moe = matches!(
            arch,
            Arch::Qwen3Moe | Arch::GptOss | Arch::Qwen3Next | Arch::Qwen35Moe
        );
        let hybrid = matches!(arch, Arch::Qwen3Next | Arch::Qwen35 | Arch::Qwen35Moe);
        SynthConfig {
            arch,
            name: format!("kestrel synth {} tiny", arch.name()),
            // The hybrids: three linear-attention layers, then one of full attention.
            n_layer: if hybrid { 4 } else { 2 },
            n_embd: 256,
            n_ff: 512,
            n_head: 4,
            n_head_kv: 2,
            head_dim: 64,
            n_vocab: 512,
            n_ctx: 2048,
            rope_freq_base,
            rms_eps,
            qkv_bias: matches!(arch, Arch::Qwen2 | Arch::GptOss),
            // As the small real models of each family: Llama 3 8B unties, Qwen2.5-1.5B,
            // Qwen3-0.6B and Gemma 3 tie; gpt-oss never does (llama.cpp requires output.weight),
            // nor Phi-3.
            tied_embeddings: !matches!(arch, Arch::Llama | Arch::GptOss | Arch::Phi3),
            // gpt-oss's window is 128 too; 16 here, so that the fidelity test's 64 tokens
            // reach past it.
            sliding_window: match arch {
                Arch::Gemma3 => 128,
                Arch::GptOss => 16,
                _ => 0,
            },
            // Eight experts of which each token uses two.
            n_expert: if moe { 8 } else { 0 },
            n_expert_used: if moe { 2 } else { 0 },
            n_ff_exp: if moe { 256 } else { 0 },
            // The newer architectures' weights are at about 1.3 / sqrt(n_embd), so that each
            // product keeps its input's scale: router and output logits spread over several
            // units (with 0.02 they would be almost flat at this width, every expert and
            // token about equally likely, and a fidelity check would compare noise). The
            // older ones keep 0.02, which their reference files were made with.
            weight_std: if moe || hybrid || matches!(arch, Arch::Phi3 | Arch::Mistral3) {
                0.08
            } else {
                Init::WEIGHT.std
            },
            // Mistral 3's keys, with an original context of 16 so that the 64 tokens of the
            // fidelity test see four temperature steps.
            yarn: (arch == Arch::Mistral3).then_some(SynthYarn {
                factor: 4.0,
                orig_ctx: 16,
                log_mul: 1.0,
                temperature_scale: 0.1,
            }),
            // Two q/k heads shared by four v heads (so the pairing of heads matters), a
            // quarter of each attention head rotated, as in the real models.
            hybrid: hybrid.then_some(SynthHybrid {
                d_conv: 4,
                d_state: 64,
                n_group: 2,
                n_v_heads: 4,
                full_attn_interval: 4,
                n_rot: 16,
                n_ff_shexp: if moe { 256 } else { 0 },
            }),
        }
    }

    /// The fields a dense model without sliding windows has, for presets to fill in.
    fn dense() -> SynthConfig {
        SynthConfig {
            sliding_window: 0,
            n_expert: 0,
            n_expert_used: 0,
            n_ff_exp: 0,
            weight_std: Init::WEIGHT.std,
            yarn: None,
            hybrid: None,
            ..SynthConfig::tiny(Arch::Llama)
        }
    }

    /// A named preset ([`PRESETS`]). `tiny` needs `arch`; the others fix their architecture and
    /// reject a different one.
    pub fn preset(name: &str, arch: Option<Arch>) -> Result<SynthConfig, SynthError> {
        let cfg = match name {
            "tiny" => {
                let arch = arch.ok_or_else(|| invalid("preset 'tiny' needs an architecture"))?;
                return Ok(SynthConfig::tiny(arch));
            }
            "llama3-8b" => SynthConfig {
                arch: Arch::Llama,
                name: "kestrel synth llama3-8b".into(),
                n_layer: 32,
                n_embd: 4096,
                n_ff: 14336,
                n_head: 32,
                n_head_kv: 8,
                head_dim: 128,
                n_vocab: 128_256,
                n_ctx: 8192,
                rope_freq_base: 500_000.0,
                rms_eps: 1e-5,
                qkv_bias: false,
                tied_embeddings: false,
                ..SynthConfig::dense()
            },
            "llama3-70b" => SynthConfig {
                arch: Arch::Llama,
                name: "kestrel synth llama3-70b".into(),
                n_layer: 80,
                n_embd: 8192,
                n_ff: 28672,
                n_head: 64,
                n_head_kv: 8,
                head_dim: 128,
                n_vocab: 128_256,
                n_ctx: 8192,
                rope_freq_base: 500_000.0,
                rms_eps: 1e-5,
                qkv_bias: false,
                tied_embeddings: false,
                ..SynthConfig::dense()
            },
            "qwen2.5-1.5b" => SynthConfig {
                arch: Arch::Qwen2,
                name: "kestrel synth qwen2.5-1.5b".into(),
                n_layer: 28,
                n_embd: 1536,
                n_ff: 8960,
                n_head: 12,
                n_head_kv: 2,
                head_dim: 128,
                n_vocab: 151_936,
                n_ctx: 32768,
                rope_freq_base: 1_000_000.0,
                rms_eps: 1e-6,
                qkv_bias: true,
                tied_embeddings: true,
                ..SynthConfig::dense()
            },
            "qwen2.5-7b" => SynthConfig {
                arch: Arch::Qwen2,
                name: "kestrel synth qwen2.5-7b".into(),
                n_layer: 28,
                n_embd: 3584,
                n_ff: 18944,
                n_head: 28,
                n_head_kv: 4,
                head_dim: 128,
                n_vocab: 152_064,
                n_ctx: 32768,
                rope_freq_base: 1_000_000.0,
                rms_eps: 1e-6,
                qkv_bias: true,
                tied_embeddings: false,
                ..SynthConfig::dense()
            },
            // Qwen3-30B-A3B: 128 experts of 768, 8 used per token.
            "qwen3-30b-a3b" => SynthConfig {
                arch: Arch::Qwen3Moe,
                name: "kestrel synth qwen3-30b-a3b".into(),
                n_layer: 48,
                n_embd: 2048,
                n_ff: 6144,
                n_head: 32,
                n_head_kv: 4,
                head_dim: 128,
                n_vocab: 151_936,
                n_ctx: 40960,
                rope_freq_base: 1_000_000.0,
                rms_eps: 1e-6,
                qkv_bias: false,
                tied_embeddings: false,
                sliding_window: 0,
                n_expert: 128,
                n_expert_used: 8,
                n_ff_exp: 768,
                weight_std: Init::WEIGHT.std,
                yarn: None,
                hybrid: None,
            },
            // gpt-oss-20b (its YaRN keys are not written: RoPE unscaled).
            "gpt-oss-20b" => SynthConfig {
                arch: Arch::GptOss,
                name: "kestrel synth gpt-oss-20b".into(),
                n_layer: 24,
                n_embd: 2880,
                n_ff: 2880,
                n_head: 64,
                n_head_kv: 8,
                head_dim: 64,
                n_vocab: 201_088,
                n_ctx: 131_072,
                rope_freq_base: 150_000.0,
                rms_eps: 1e-5,
                qkv_bias: true,
                tied_embeddings: false,
                sliding_window: 128,
                n_expert: 32,
                n_expert_used: 4,
                n_ff_exp: 2880,
                weight_std: Init::WEIGHT.std,
                yarn: None,
                hybrid: None,
            },
            // Qwen3-Next-80B-A3B (its config.json): 48 layers, every fourth full attention
            // (16 heads of 256, 2 kv heads, a quarter rotated, output gate), the others
            // gated DeltaNet (16 q/k heads and 32 v heads of 128, 4 taps); 512 experts of
            // 512, 10 used, and a shared expert of 512 in every layer.
            "qwen3-next-80b-a3b" => SynthConfig {
                arch: Arch::Qwen3Next,
                name: "kestrel synth qwen3-next-80b-a3b".into(),
                n_layer: 48,
                n_embd: 2048,
                n_ff: 5120,
                n_head: 16,
                n_head_kv: 2,
                head_dim: 256,
                n_vocab: 151_936,
                n_ctx: 262_144,
                rope_freq_base: 10_000_000.0,
                rms_eps: 1e-6,
                qkv_bias: false,
                tied_embeddings: false,
                sliding_window: 0,
                n_expert: 512,
                n_expert_used: 10,
                n_ff_exp: 512,
                weight_std: Init::WEIGHT.std,
                yarn: None,
                hybrid: Some(SynthHybrid {
                    d_conv: 4,
                    d_state: 128,
                    n_group: 16,
                    n_v_heads: 32,
                    full_attn_interval: 4,
                    n_rot: 64,
                    n_ff_shexp: 512,
                }),
            },
            // A dense Qwen3.5 hybrid of Qwen3-Next-80B-A3B's layers: its attention and
            // linear-attention shapes, one dense feed-forward block of 5,120 in place of the
            // experts (a token's active ones come to 5,632: 10 of 512 and the shared one), so
            // that a backend without mixture-of-experts kernels can time the rest.
            "qwen3-next-dense" => SynthConfig {
                arch: Arch::Qwen35,
                name: "kestrel synth qwen3-next-dense".into(),
                n_expert: 0,
                n_expert_used: 0,
                n_ff_exp: 0,
                hybrid: Some(SynthHybrid {
                    n_ff_shexp: 0,
                    ..SynthConfig::preset("qwen3-next-80b-a3b", None)?
                        .hybrid
                        .ok_or_else(|| invalid("qwen3-next-80b-a3b has no hybrid shape"))?
                }),
                ..SynthConfig::preset("qwen3-next-80b-a3b", None)?
            },
            other => {
                return Err(invalid(format!(
                    "unknown preset '{other}' (expected one of {})",
                    PRESETS.join(", ")
                )));
            }
        };
        if let Some(arch) = arch
            && arch != cfg.arch
        {
            return Err(invalid(format!(
                "preset '{name}' is a {} model, not {}",
                cfg.arch.name(),
                arch.name()
            )));
        }
        Ok(cfg)
    }

    /// Applies size overrides. When `--embd` or `--heads` changes and `--head-dim` is not
    /// given, the head size becomes `n_embd / n_head` (the usual layout).
    pub fn apply(&mut self, o: &SynthOverrides) -> Result<(), SynthError> {
        let set = |field: &mut u32, v: Option<u32>| {
            if let Some(v) = v {
                *field = v;
            }
        };
        set(&mut self.n_layer, o.n_layer);
        set(&mut self.n_embd, o.n_embd);
        set(&mut self.n_ff, o.n_ff);
        set(&mut self.n_head, o.n_head);
        set(&mut self.n_head_kv, o.n_head_kv);
        set(&mut self.n_vocab, o.n_vocab);
        set(&mut self.n_ctx, o.n_ctx);
        match o.head_dim {
            Some(d) => self.head_dim = d,
            None if o.n_embd.is_some() || o.n_head.is_some() => {
                if self.n_head == 0 || !self.n_embd.is_multiple_of(self.n_head) {
                    return Err(invalid(format!(
                        "--embd {} is not a multiple of --heads {}; give --head-dim",
                        self.n_embd, self.n_head
                    )));
                }
                self.head_dim = self.n_embd / self.n_head;
            }
            None => {}
        }
        if o != &SynthOverrides::default() {
            self.name.push_str(" (custom)");
        }
        Ok(())
    }

    /// Whether the feed-forward blocks are mixtures of experts.
    pub fn is_moe(&self) -> bool {
        matches!(
            self.arch,
            Arch::Qwen3Moe | Arch::GptOss | Arch::Qwen3Next | Arch::Qwen35Moe
        )
    }

    fn q_dim(&self) -> u64 {
        self.n_head as u64 * self.head_dim as u64
    }

    fn kv_dim(&self) -> u64 {
        self.n_head_kv as u64 * self.head_dim as u64
    }

    /// Checks the sizes; tensor types are checked by [`tensors`](Self::tensors).
    pub fn validate(&self) -> Result<(), SynthError> {
        let sizes = [
            ("layers", self.n_layer),
            ("embd", self.n_embd),
            ("ff", self.n_ff),
            ("heads", self.n_head),
            ("kv-heads", self.n_head_kv),
            ("head-dim", self.head_dim),
            ("vocab", self.n_vocab),
            ("ctx", self.n_ctx),
        ];
        for (name, v) in sizes {
            if v == 0 {
                return Err(invalid(format!("--{name} must be positive")));
            }
        }
        if !self.n_head.is_multiple_of(self.n_head_kv) {
            return Err(invalid(format!(
                "--heads {} must be a multiple of --kv-heads {}",
                self.n_head, self.n_head_kv
            )));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(invalid(format!(
                "--head-dim {} must be even (RoPE rotates pairs)",
                self.head_dim
            )));
        }
        if self.is_moe()
            && (self.n_ff_exp == 0 || self.n_expert_used == 0 || self.n_expert_used > self.n_expert)
        {
            return Err(invalid(format!(
                "a {} model needs experts: {} used of {}, hidden size {}",
                self.arch.name(),
                self.n_expert_used,
                self.n_expert,
                self.n_ff_exp
            )));
        }
        let hybrid_arch = matches!(self.arch, Arch::Qwen3Next | Arch::Qwen35 | Arch::Qwen35Moe);
        match (&self.hybrid, hybrid_arch) {
            (Some(h), true) => {
                if h.d_conv == 0
                    || h.d_state == 0
                    || h.n_group == 0
                    || h.full_attn_interval == 0
                    || !h.n_v_heads.is_multiple_of(h.n_group)
                    || h.n_rot == 0
                    || h.n_rot > self.head_dim
                    || !h.n_rot.is_multiple_of(2)
                {
                    return Err(invalid(format!("bad linear-attention shape {h:?}")));
                }
            }
            (None, true) => {
                return Err(invalid(format!(
                    "a {} model needs its linear-attention shape",
                    self.arch.name()
                )));
            }
            (_, false) => {}
        }
        if !(self.weight_std.is_finite() && self.weight_std > 0.0) {
            return Err(invalid("weight standard deviation must be positive"));
        }
        if !(self.rope_freq_base.is_finite() && self.rope_freq_base > 0.0) {
            return Err(invalid("rope base must be positive"));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0) {
            return Err(invalid("rms epsilon must be positive"));
        }
        Ok(())
    }

    /// The metadata llama.cpp's converter (and llama-quantize) write for this architecture.
    pub fn metadata(&self, ty: WeightType) -> Vec<(String, Value)> {
        let arch = self.arch.name();
        let key = |k: &str| format!("{arch}.{k}");
        let mut m: Vec<(String, Value)> = vec![
            ("general.architecture".into(), arch.into()),
            ("general.type".into(), "model".into()),
            ("general.name".into(), self.name.as_str().into()),
            (key("vocab_size"), self.n_vocab.into()),
            (key("context_length"), self.n_ctx.into()),
            (key("embedding_length"), self.n_embd.into()),
            (key("block_count"), self.n_layer.into()),
            (key("feed_forward_length"), self.n_ff.into()),
            (key("attention.head_count"), self.n_head.into()),
            (key("attention.head_count_kv"), self.n_head_kv.into()),
            (key("rope.freq_base"), self.rope_freq_base.into()),
            (key("attention.layer_norm_rms_epsilon"), self.rms_eps.into()),
        ];
        // Head size: Qwen3 and Gemma 3 always state it; elsewhere llama.cpp derives it from
        // embedding_length / head_count unless the keys say otherwise.
        let default_head =
            self.n_embd.is_multiple_of(self.n_head) && self.n_embd / self.n_head == self.head_dim;
        let states_head = self.hybrid.is_some()
            || matches!(
                self.arch,
                Arch::Qwen3 | Arch::Gemma3 | Arch::Qwen3Moe | Arch::GptOss
            );
        if states_head || !default_head {
            m.push((key("attention.key_length"), self.head_dim.into()));
            m.push((key("attention.value_length"), self.head_dim.into()));
        }
        if let Some(y) = self.yarn {
            m.push((key("rope.scaling.type"), "yarn".into()));
            m.push((key("rope.scaling.factor"), y.factor.into()));
            m.push((
                key("rope.scaling.original_context_length"),
                y.orig_ctx.into(),
            ));
            m.push((key("rope.scaling.yarn_log_multiplier"), y.log_mul.into()));
            if y.temperature_scale != 0.0 {
                m.push((
                    key("attention.temperature_scale"),
                    y.temperature_scale.into(),
                ));
            }
        }
        if matches!(self.arch, Arch::Llama | Arch::Phi3 | Arch::Mistral3) {
            // The Llama, Phi-3 and Mistral 3 converters write the rotary dimension (the
            // whole head).
            m.push((key("rope.dimension_count"), self.head_dim.into()));
        }
        if matches!(self.arch, Arch::Gemma3 | Arch::GptOss) {
            m.push((key("attention.sliding_window"), self.sliding_window.into()));
        }
        if self.is_moe() {
            m.push((key("expert_count"), self.n_expert.into()));
            m.push((key("expert_used_count"), self.n_expert_used.into()));
            m.push((key("expert_feed_forward_length"), self.n_ff_exp.into()));
        }
        if let Some(h) = &self.hybrid {
            // convert_hf_to_gguf.py's Qwen3-Next / Qwen3.5 keys.
            m.push((key("ssm.conv_kernel"), h.d_conv.into()));
            m.push((key("ssm.state_size"), h.d_state.into()));
            m.push((key("ssm.group_count"), h.n_group.into()));
            m.push((key("ssm.time_step_rank"), h.n_v_heads.into()));
            m.push((key("ssm.inner_size"), (h.d_state * h.n_v_heads).into()));
            m.push((key("full_attention_interval"), h.full_attn_interval.into()));
            m.push((key("rope.dimension_count"), h.n_rot.into()));
            if h.n_ff_shexp > 0 {
                m.push((
                    key("expert_shared_feed_forward_length"),
                    h.n_ff_shexp.into(),
                ));
            }
            if self.arch != Arch::Qwen3Next {
                // Qwen3.5's interleaved M-RoPE sections (time, height, width, extra) over
                // the rotated pairs, as its converter splits them.
                let pairs = h.n_rot / 2;
                let (t, hh) = (pairs.div_ceil(3), pairs.div_ceil(3));
                let w = pairs - t - hh;
                let secs = [t, hh, w, 0].map(|v| Value::I32(v as i32)).to_vec();
                m.push((
                    key("rope.dimension_sections"),
                    Value::Array(kestrel_gguf::ValueType::I32, secs),
                ));
            }
        }
        m.push(("general.file_type".into(), ty.file_type().into()));
        m.push(("general.quantization_version".into(), 2u32.into()));
        m.push(("tokenizer.ggml.model".into(), "none".into()));
        m
    }

    /// The tensor type of a weight matrix, as llama-quantize picks it.
    ///
    /// For `q4_k_m` (llama.cpp's `llama_tensor_get_type` for LLAMA_FTYPE_MOSTLY_Q4_K_M):
    /// - `output.weight` is Q6_K; so is `token_embd.weight` when embeddings are tied (the
    ///   quantizer treats it as the output then), otherwise `token_embd.weight` is Q4_K;
    /// - `attn_v.weight` and `ffn_down.weight` are Q6_K on the "use more bits" layers — layer
    ///   i of n with i < n/8, or i >= 7n/8, or (i - n/8) % 3 == 2 (integer division) — and
    ///   Q4_K elsewhere (llama.cpp counts these tensors in file order; we write layers in
    ///   order, so the count is the layer index);
    /// - every other matrix is Q4_K.
    ///
    /// Other types are pure: every matrix has the chosen type. As in llama.cpp, a K-quant
    /// whose row length is not a multiple of 256 falls back to a 32-block type of similar
    /// size (Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0, IQ4_XS → IQ4_NL).
    pub fn tensor_type(&self, ty: WeightType, role: Role, row_len: u64) -> GgmlType {
        let chosen = self.preferred_type(ty, role);
        if row_len.is_multiple_of(chosen.block_size() as u64) {
            return chosen;
        }
        match chosen {
            GgmlType::Q4K => GgmlType::Q5_0,
            GgmlType::Q5K => GgmlType::Q5_1,
            GgmlType::Q6K => GgmlType::Q8_0,
            GgmlType::IQ4XS => GgmlType::IQ4NL,
            other => other,
        }
    }

    /// The type before the fallback for row lengths that are not whole K-quant blocks.
    fn preferred_type(&self, ty: WeightType, role: Role) -> GgmlType {
        match (ty, role) {
            (WeightType::Q4KM, Role::Output) => GgmlType::Q6K,
            (WeightType::Q4KM, Role::TokenEmbd) if self.tied_embeddings => GgmlType::Q6K,
            (WeightType::Q4KM, Role::AttnV(i) | Role::FfnDown(i))
                if use_more_bits(i, self.n_layer) =>
            {
                GgmlType::Q6K
            }
            _ => ty.base(),
        }
    }

    /// Every tensor of the model in file order, with its shape (`dims[0]` is the row length),
    /// type and initial distribution. Fails if a row length does not fit the type's blocks.
    pub fn tensors(&self, ty: WeightType) -> Result<Vec<TensorSpec>, SynthError> {
        self.validate()?;
        let (embd, ff, vocab) = (self.n_embd as u64, self.n_ff as u64, self.n_vocab as u64);
        let (q_dim, kv_dim, head) = (self.q_dim(), self.kv_dim(), self.head_dim as u64);
        let mut out =
            vec![self.matrix(ty, "token_embd.weight".into(), embd, vocab, Role::TokenEmbd)?];
        for i in 0..self.n_layer {
            let b = |s: &str| format!("blk.{i}.{s}");
            out.push(vector(b("attn_norm.weight"), embd, Init::NORM));
            let phi3 = self.arch == Arch::Phi3;
            if let Some(h) = &self.hybrid {
                self.hybrid_mixer(ty, h, i, &mut out)?;
            } else if phi3 {
                // Phi-3 keeps Q, K and V in one matrix.
                let rows = q_dim + 2 * kv_dim;
                out.push(self.matrix(ty, b("attn_qkv.weight"), embd, rows, Role::Other)?);
            } else {
                out.push(self.matrix(ty, b("attn_q.weight"), embd, q_dim, Role::Other)?);
                if self.qkv_bias {
                    out.push(vector(b("attn_q.bias"), q_dim, Init::BIAS));
                }
                out.push(self.matrix(ty, b("attn_k.weight"), embd, kv_dim, Role::Other)?);
                if self.qkv_bias {
                    out.push(vector(b("attn_k.bias"), kv_dim, Init::BIAS));
                }
                out.push(self.matrix(ty, b("attn_v.weight"), embd, kv_dim, Role::AttnV(i))?);
                if self.qkv_bias {
                    out.push(vector(b("attn_v.bias"), kv_dim, Init::BIAS));
                }
            }
            if matches!(self.arch, Arch::Qwen3 | Arch::Gemma3 | Arch::Qwen3Moe) {
                out.push(vector(b("attn_q_norm.weight"), head, Init::NORM));
                out.push(vector(b("attn_k_norm.weight"), head, Init::NORM));
            }
            if self.hybrid.is_none() {
                out.push(self.matrix(ty, b("attn_output.weight"), q_dim, embd, Role::Other)?);
            }
            let oss = self.arch == Arch::GptOss;
            if oss {
                out.push(vector(b("attn_output.bias"), embd, Init::BIAS));
                out.push(vector(
                    b("attn_sinks.weight"),
                    self.n_head as u64,
                    Init::SINK,
                ));
            }
            if self.arch == Arch::Gemma3 {
                out.push(vector(b("post_attention_norm.weight"), embd, Init::NORM));
            }
            // gpt-oss calls the norm before its feed-forward block the post-attention norm.
            let ffn_norm = if oss || self.hybrid.is_some() {
                "post_attention_norm.weight"
            } else {
                "ffn_norm.weight"
            };
            out.push(vector(b(ffn_norm), embd, Init::NORM));
            if self.is_moe() {
                // The router stays f32, as llama.cpp's converter and quantizer keep it.
                let (n_exp, ff_exp) = (self.n_expert as u64, self.n_ff_exp as u64);
                let router = self.matrix(
                    WeightType::F32,
                    b("ffn_gate_inp.weight"),
                    embd,
                    n_exp,
                    Role::Other,
                )?;
                out.push(router);
                // gpt-oss biases every expert projection (f32 rows per expert).
                let bias = |name: &str, dims: Vec<u64>| TensorSpec {
                    name: b(name),
                    dims,
                    ty: GgmlType::F32,
                    init: Init::BIAS,
                };
                if oss {
                    out.push(vector(b("ffn_gate_inp.bias"), n_exp, Init::BIAS));
                }
                let gate = self.matrix(ty, b("ffn_gate_exps.weight"), embd, ff_exp, Role::Other)?;
                let up = self.matrix(ty, b("ffn_up_exps.weight"), embd, ff_exp, Role::Other)?;
                let down = self.matrix(
                    ty,
                    b("ffn_down_exps.weight"),
                    ff_exp,
                    embd,
                    Role::FfnDown(i),
                )?;
                let biases = [("gate", ff_exp), ("up", ff_exp), ("down", embd)];
                for (mut spec, (proj, rows)) in [gate, up, down].into_iter().zip(biases) {
                    spec.dims.push(n_exp);
                    out.push(spec);
                    if oss {
                        out.push(bias(&format!("ffn_{proj}_exps.bias"), vec![rows, n_exp]));
                    }
                }
                if let Some(h) = self.hybrid.filter(|h| h.n_ff_shexp > 0) {
                    // The shared expert and its gate (a vector, kept f32).
                    let sff = h.n_ff_shexp as u64;
                    out.push(vector(
                        b("ffn_gate_inp_shexp.weight"),
                        embd,
                        Init {
                            mean: 0.0,
                            std: self.weight_std,
                        },
                    ));
                    out.push(self.matrix(
                        ty,
                        b("ffn_gate_shexp.weight"),
                        embd,
                        sff,
                        Role::Other,
                    )?);
                    out.push(self.matrix(ty, b("ffn_up_shexp.weight"), embd, sff, Role::Other)?);
                    out.push(self.matrix(
                        ty,
                        b("ffn_down_shexp.weight"),
                        sff,
                        embd,
                        Role::FfnDown(i),
                    )?);
                }
            } else if phi3 {
                // Phi-3's up matrix holds the gate rows, then the up rows.
                out.push(self.matrix(ty, b("ffn_up.weight"), embd, 2 * ff, Role::Other)?);
                out.push(self.matrix(ty, b("ffn_down.weight"), ff, embd, Role::FfnDown(i))?);
            } else {
                out.push(self.matrix(ty, b("ffn_gate.weight"), embd, ff, Role::Other)?);
                out.push(self.matrix(ty, b("ffn_up.weight"), embd, ff, Role::Other)?);
                out.push(self.matrix(ty, b("ffn_down.weight"), ff, embd, Role::FfnDown(i))?);
            }
            if self.arch == Arch::Gemma3 {
                out.push(vector(b("post_ffw_norm.weight"), embd, Init::NORM));
            }
        }
        out.push(vector("output_norm.weight".into(), embd, Init::NORM));
        if !self.tied_embeddings {
            out.push(self.matrix(ty, "output.weight".into(), embd, vocab, Role::Output)?);
        }
        Ok(out)
    }

    /// A hybrid's layer `i` before its post-attention norm: gated full attention, or gated
    /// DeltaNet linear attention (llama.cpp's tensor names and shapes).
    fn hybrid_mixer(
        &self,
        ty: WeightType,
        h: &SynthHybrid,
        i: u32,
        out: &mut Vec<TensorSpec>,
    ) -> Result<(), SynthError> {
        let b = |s: &str| format!("blk.{i}.{s}");
        let embd = self.n_embd as u64;
        let (q_dim, kv_dim, head) = (self.q_dim(), self.kv_dim(), self.head_dim as u64);
        if h.is_attention(i) {
            // Each head's query rows, then its gate's.
            out.push(self.matrix(ty, b("attn_q.weight"), embd, 2 * q_dim, Role::Other)?);
            out.push(self.matrix(ty, b("attn_k.weight"), embd, kv_dim, Role::Other)?);
            out.push(self.matrix(ty, b("attn_v.weight"), embd, kv_dim, Role::AttnV(i))?);
            out.push(self.matrix(ty, b("attn_output.weight"), q_dim, embd, Role::Other)?);
            out.push(vector(b("attn_q_norm.weight"), head, Init::NORM));
            out.push(vector(b("attn_k_norm.weight"), head, Init::NORM));
            return Ok(());
        }
        let (ds, nk, nv) = (h.d_state as u64, h.n_group as u64, h.n_v_heads as u64);
        let (key_dim, value_dim) = (ds * nk, ds * nv);
        let conv_dim = 2 * key_dim + value_dim;
        out.push(self.matrix(ty, b("attn_qkv.weight"), embd, conv_dim, Role::Other)?);
        out.push(self.matrix(ty, b("attn_gate.weight"), embd, value_dim, Role::Other)?);
        if self.arch == Arch::Qwen3Next {
            out.push(self.matrix(ty, b("ssm_ba.weight"), embd, 2 * nv, Role::Other)?);
        } else {
            out.push(self.matrix(ty, b("ssm_beta.weight"), embd, nv, Role::Other)?);
            out.push(self.matrix(ty, b("ssm_alpha.weight"), embd, nv, Role::Other)?);
        }
        // The convolution taps, time-step bias and decay rates stay f32 (ggml's
        // convolution reads f32 taps). `ssm_a` is -exp(A_log): slow decays (about 0.9 a
        // token) so that the state carries over many tokens.
        let mut conv = self.matrix(
            WeightType::F32,
            b("ssm_conv1d.weight"),
            h.d_conv as u64,
            conv_dim,
            Role::Other,
        )?;
        conv.init = Init {
            mean: 0.0,
            std: 0.3,
        };
        out.push(conv);
        out.push(vector(
            b("ssm_dt.bias"),
            nv,
            Init {
                mean: 0.0,
                std: 0.5,
            },
        ));
        out.push(vector(
            b("ssm_a"),
            nv,
            Init {
                mean: -0.1,
                std: 0.03,
            },
        ));
        out.push(vector(b("ssm_norm.weight"), ds, Init::NORM));
        out.push(self.matrix(ty, b("ssm_out.weight"), value_dim, embd, Role::Other)?);
        Ok(())
    }

    /// A weight matrix of `rows` rows of `row_len` values.
    fn matrix(
        &self,
        ty: WeightType,
        name: String,
        row_len: u64,
        rows: u64,
        role: Role,
    ) -> Result<TensorSpec, SynthError> {
        let t = self.tensor_type(ty, role, row_len);
        if !row_len.is_multiple_of(t.block_size() as u64) {
            let preferred = self.preferred_type(ty, role);
            let fallback = if preferred == t {
                String::new()
            } else {
                format!(
                    ", the fallback of {} for rows that are not whole 256-blocks",
                    preferred.name()
                )
            };
            return Err(invalid(format!(
                "{name}: row length {row_len} is not a multiple of the {} block size {}{fallback} \
                 (multiples of 256 suit every type)",
                t.name(),
                t.block_size()
            )));
        }
        Ok(TensorSpec {
            name,
            dims: vec![row_len, rows],
            ty: t,
            init: Init {
                mean: 0.0,
                std: self.weight_std,
            },
        })
    }
}

/// A 1-D tensor (norm scale or bias): always F32, as llama.cpp's converter writes them.
fn vector(name: String, len: u64, init: Init) -> TensorSpec {
    TensorSpec {
        name,
        dims: vec![len],
        ty: GgmlType::F32,
        init,
    }
}

/// llama.cpp's `use_more_bits`: the first and last eighth of the layers, and every third
/// layer in between.
fn use_more_bits(i: u32, n: u32) -> bool {
    let (i, n) = (i as i64, n as i64);
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// What a weight matrix is, for the Q4_K_M type choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    TokenEmbd,
    Output,
    /// `attn_v.weight` of a layer.
    AttnV(u32),
    /// `ffn_down.weight` of a layer.
    FfnDown(u32),
    Other,
}

/// The normal distribution a tensor's values are drawn from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Init {
    pub mean: f32,
    pub std: f32,
}

impl Init {
    /// Weight matrices: N(0, 0.02), the usual initializer scale.
    pub const WEIGHT: Init = Init {
        mean: 0.0,
        std: 0.02,
    };
    /// RMSNorm scales: around 1. (Gemma's converter stores `1 + w`, so ~1 is right there too.)
    pub const NORM: Init = Init {
        mean: 1.0,
        std: 0.02,
    };
    /// Biases: small.
    pub const BIAS: Init = Init {
        mean: 0.0,
        std: 0.02,
    };
    /// Attention sink logits (gpt-oss): of the order of the attention scores.
    pub const SINK: Init = Init {
        mean: 0.0,
        std: 1.0,
    };
}

/// One tensor to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    pub init: Init,
}

impl TensorSpec {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// What was written.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthSummary {
    pub n_tensors: usize,
    pub n_params: u64,
    pub file_size: u64,
}

/// Values generated (and quantized) per task: whole rows, about this many values.
const CHUNK_VALUES: u64 = 1 << 18;
/// Chunks generated in parallel before they are handed to the writer.
const BATCH_CHUNKS: usize = 32;
/// Models of more parameters than this are generated from pools: each block-quantized
/// tensor's blocks are drawn at random from [`POOL_BLOCKS`] blocks quantized from its
/// distribution once (valid blocks of the same values' distribution, written at about disk
/// speed; quantizing every value of a 70B model takes minutes).
pub const POOLED_ABOVE_PARAMS: u64 = 16_000_000_000;
/// Blocks quantized per tensor for the pooled generation.
pub const POOL_BLOCKS: usize = 4096;

/// Writes a synthetic model to `path` (through a temporary file renamed at the end).
pub fn write_synth(
    path: impl AsRef<Path>,
    cfg: &SynthConfig,
    ty: WeightType,
    seed: u64,
) -> Result<SynthSummary, SynthError> {
    write_synth_with_progress(path, cfg, ty, seed, &|_, _| {})
}

/// [`write_synth`], calling `progress(bytes_written, total_bytes)` (tensor data) after each
/// chunk written, from the writer thread: for a progress bar.
pub fn write_synth_with_progress(
    path: impl AsRef<Path>,
    cfg: &SynthConfig,
    ty: WeightType,
    seed: u64,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<SynthSummary, SynthError> {
    let (writer, specs) = prepare(cfg, ty)?;
    let file_size = writer.file_size();
    let total = data_bytes(&specs);
    let mut stream = writer.stream_to_path(path)?;
    generate(&mut stream, &specs, seed, total, progress)?;
    stream.finish()?;
    Ok(summary(&specs, file_size))
}

/// Writes a synthetic model to any sink (e.g. a `Vec<u8>` for tests) and returns the sink.
pub fn write_synth_to<W: Write + Send>(
    sink: W,
    cfg: &SynthConfig,
    ty: WeightType,
    seed: u64,
) -> Result<(W, SynthSummary), SynthError> {
    let (writer, specs) = prepare(cfg, ty)?;
    let file_size = writer.file_size();
    let total = data_bytes(&specs);
    let mut stream = writer.stream_to(sink)?;
    generate(&mut stream, &specs, seed, total, &|_, _| {})?;
    Ok((stream.finish()?, summary(&specs, file_size)))
}

/// Bytes of tensor data (without the alignment padding between tensors).
fn data_bytes(specs: &[TensorSpec]) -> u64 {
    specs
        .iter()
        .map(|s| s.n_elements() / s.ty.block_size() as u64 * s.ty.type_size() as u64)
        .sum()
}

fn summary(specs: &[TensorSpec], file_size: u64) -> SynthSummary {
    SynthSummary {
        n_tensors: specs.len(),
        n_params: specs.iter().map(TensorSpec::n_elements).sum(),
        file_size,
    }
}

fn prepare(cfg: &SynthConfig, ty: WeightType) -> Result<(GgufWriter, Vec<TensorSpec>), SynthError> {
    let specs = cfg.tensors(ty)?;
    let mut writer = GgufWriter::new();
    for (k, v) in cfg.metadata(ty) {
        writer.add_metadata(k, v)?;
    }
    for s in &specs {
        writer.add_tensor(s.name.as_str(), &s.dims, s.ty)?;
    }
    Ok((writer, specs))
}

/// The two stream types of kestrel-gguf, seen as one.
trait ChunkSink {
    fn write_chunk(&mut self, chunk: &[u8]) -> Result<(), GgufError>;
}

impl ChunkSink for FileStream {
    fn write_chunk(&mut self, chunk: &[u8]) -> Result<(), GgufError> {
        FileStream::write_chunk(self, chunk)
    }
}

impl<W: Write> ChunkSink for TensorStream<W> {
    fn write_chunk(&mut self, chunk: &[u8]) -> Result<(), GgufError> {
        TensorStream::write_chunk(self, chunk)
    }
}

/// Generates every tensor's data in parallel and streams it, in order, to `sink` from a
/// writer thread fed through a bounded channel.
fn generate<S: ChunkSink + Send>(
    sink: &mut S,
    specs: &[TensorSpec],
    seed: u64,
    total: u64,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<(), SynthError> {
    let pooled = specs.iter().map(TensorSpec::n_elements).sum::<u64>() > POOLED_ABOVE_PARAMS;
    let (tx, rx) = mpsc::sync_channel::<Vec<Vec<u8>>>(2);
    std::thread::scope(|scope| {
        let writer = scope.spawn(move || -> Result<(), GgufError> {
            let mut done = 0u64;
            for batch in rx {
                for chunk in &batch {
                    sink.write_chunk(chunk)?;
                    done += chunk.len() as u64;
                    progress(done, total);
                }
            }
            Ok(())
        });
        let produced = (|| -> Result<(), SynthError> {
            for spec in specs {
                let row_len = spec.dims[0];
                let n_rows = spec.n_elements() / row_len;
                let rows_per_chunk = (CHUNK_VALUES / row_len).max(1);
                let n_chunks = n_rows.div_ceil(rows_per_chunk);
                let name_hash = fnv1a(spec.name.as_bytes());
                let pool = match pooled && spec.ty.block_size() > 1 {
                    true => Some(block_pool(spec, mix(seed, name_hash, u64::MAX))?),
                    false => None,
                };
                let mut start = 0u64;
                while start < n_chunks {
                    let end = (start + BATCH_CHUNKS as u64).min(n_chunks);
                    let batch = (start..end)
                        .into_par_iter()
                        .map(|c| {
                            let rows = rows_per_chunk.min(n_rows - c * rows_per_chunk);
                            let n = (rows * row_len) as usize;
                            let chunk_seed = mix(seed, name_hash, c);
                            match &pool {
                                Some(pool) => Ok(pooled_chunk(spec.ty, pool, n, chunk_seed)),
                                None => chunk_bytes(spec, n, chunk_seed),
                            }
                        })
                        .collect::<Result<Vec<Vec<u8>>, SynthError>>()?;
                    if tx.send(batch).is_err() {
                        // The writer stopped on an error; it reports it below.
                        return Ok(());
                    }
                    start = end;
                }
            }
            Ok(())
        })();
        drop(tx);
        let written = writer
            .join()
            .map_err(|_| invalid("the writer thread panicked"))?;
        produced?;
        written?;
        Ok(())
    })
}

/// `n` values of `spec`'s distribution from an RNG seeded with `seed`, encoded as `spec.ty`.
fn chunk_bytes(spec: &TensorSpec, n: usize, seed: u64) -> Result<Vec<u8>, SynthError> {
    let dist = Normal::new(spec.init.mean, spec.init.std)
        .map_err(|e| invalid(format!("{}: bad distribution: {e}", spec.name)))?;
    let mut rng = StdRng::seed_from_u64(seed);
    let values: Vec<f32> = (0..n).map(|_| dist.sample(&mut rng)).collect();
    kestrel_quant::quantize(spec.ty, &values, spec.dims[0] as usize).map_err(|source| {
        SynthError::Quant {
            tensor: spec.name.clone(),
            source,
        }
    })
}

/// [`POOL_BLOCKS`] blocks of `spec`'s type quantized from its distribution.
fn block_pool(spec: &TensorSpec, seed: u64) -> Result<Vec<u8>, SynthError> {
    let bs = spec.ty.block_size();
    let dist = Normal::new(spec.init.mean, spec.init.std)
        .map_err(|e| invalid(format!("{}: bad distribution: {e}", spec.name)))?;
    let mut rng = StdRng::seed_from_u64(seed);
    let values: Vec<f32> = (0..POOL_BLOCKS * bs)
        .map(|_| dist.sample(&mut rng))
        .collect();
    kestrel_quant::quantize(spec.ty, &values, bs).map_err(|source| SynthError::Quant {
        tensor: spec.name.clone(),
        source,
    })
}

/// `n` values (whole blocks) of type `ty` as blocks drawn from `pool` by a generator
/// seeded with `seed`.
fn pooled_chunk(ty: GgmlType, pool: &[u8], n: usize, seed: u64) -> Vec<u8> {
    let (bs, size) = (ty.block_size(), ty.type_size());
    let blocks = pool.len() / size;
    let mut out = Vec::with_capacity(n / bs * size);
    let mut state = seed;
    for _ in 0..n / bs {
        state = splitmix(state);
        let b = (state % blocks as u64) as usize;
        out.extend_from_slice(&pool[b * size..(b + 1) * size]);
    }
    out
}

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// SplitMix64's finalizer: spreads every input bit over the output.
fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The seed of one chunk of one tensor.
fn mix(seed: u64, name_hash: u64, chunk: u64) -> u64 {
    splitmix(splitmix(splitmix(seed) ^ name_hash) ^ chunk)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model's recurrent state bytes per sequence (the reserve a device-sized KV cache
    /// leaves) against the synthetic file's own shape: each linear-attention layer keeps
    /// `(d_conv - 1) × (2 · groups + v heads) × head size` convolution values and `v heads ×
    /// head size²` DeltaNet values, f32; a dense model none.
    #[test]
    fn recurrent_state_bytes_follow_the_hybrid_shape() {
        for arch in [Arch::Qwen35, Arch::Qwen3Next, Arch::Qwen35Moe, Arch::Llama] {
            let synth = SynthConfig::tiny(arch);
            let (bytes, _) = write_synth_to(Vec::new(), &synth, "f32".parse().unwrap(), 3).unwrap();
            let file = kestrel_gguf::GgufFile::from_bytes(bytes).unwrap();
            let cfg = crate::config::ModelConfig::from_gguf(&file).unwrap();
            let want = match synth.hybrid {
                None => 0,
                Some(h) => {
                    let layers = (0..synth.n_layer).filter(|&l| !h.is_attention(l)).count();
                    let (hs, conv) = (h.d_state as usize, h.d_conv as usize - 1);
                    let heads = 2 * h.n_group as usize + h.n_v_heads as usize;
                    layers * (conv * heads * hs + h.n_v_heads as usize * hs * hs) * 4
                }
            };
            assert_eq!(cfg.recurrent_state_bytes(), want, "{arch:?}");
            assert_eq!(want > 0, arch != Arch::Llama, "{arch:?}");
        }
    }

    /// Pooled chunks are whole valid blocks whose values follow the tensor's distribution
    /// (the oracle: kestrel-quant's dequantizer and the spec's mean and deviation), and
    /// differ between chunks.
    #[test]
    fn pooled_chunks_are_valid_blocks_of_the_distribution() {
        for ty in [GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q8_0] {
            let spec = TensorSpec {
                name: "blk.0.ffn_up.weight".into(),
                dims: vec![1024, 96],
                ty,
                init: Init::WEIGHT,
            };
            let pool = block_pool(&spec, 7).unwrap();
            assert_eq!(pool.len(), POOL_BLOCKS * ty.type_size());
            let n = 1024 * 96;
            let a = pooled_chunk(ty, &pool, n, 1);
            let b = pooled_chunk(ty, &pool, n, 2);
            assert_eq!(a.len(), n / ty.block_size() * ty.type_size());
            assert_ne!(a, b);
            assert_eq!(a, pooled_chunk(ty, &pool, n, 1));
            let mut v = vec![0f32; n];
            kestrel_quant::dequantize_row(ty, &a, &mut v).unwrap();
            assert!(v.iter().all(|x| x.is_finite()));
            let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n as f64;
            let var = v
                .iter()
                .map(|&x| (f64::from(x) - mean).powi(2))
                .sum::<f64>()
                / n as f64;
            assert!(mean.abs() < 2e-3, "{ty}: mean {mean}");
            assert!((var.sqrt() - 0.02).abs() < 3e-3, "{ty}: std {}", var.sqrt());
        }
    }

    #[test]
    fn seeds_differ_per_chunk_and_tensor() {
        let a = mix(1, fnv1a(b"a"), 0);
        assert_ne!(a, mix(1, fnv1a(b"a"), 1));
        assert_ne!(a, mix(1, fnv1a(b"b"), 0));
        assert_ne!(a, mix(2, fnv1a(b"a"), 0));
    }
}
