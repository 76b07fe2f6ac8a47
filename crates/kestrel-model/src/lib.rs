//! Model architectures: configuration from GGUF metadata, weight names, and the one
//! forward definition every backend runs.

pub mod backend;
pub mod batch;
pub mod config;
pub mod forward;
pub mod kv_type;
mod load;
pub mod moe;
pub mod sampling;
pub mod shard;
pub mod weights;

pub use backend::{AttnParams, Backend};
pub use batch::{Batch, Output, SeqSlot};
pub use config::{
    Activation, Arch, AttnTemperature, ClampedSwiglu, DeltaNetConfig, FfnKind, Gating, LayerKind,
    ModelConfig, MoeConfig, Pooling, RopeConstants, RopeParams, RopeScaling,
};
pub use forward::{Model, Scratch};
pub use kv_type::{KvType, KvTypes};
pub use sampling::{
    NO_MASK, RowSampler, RowSampling, SamplingBatch, apply_mask, argmax, masked_argmax,
};
pub use shard::{Role, Split, TpPlan};
pub use weights::{DeltaNetWeights, LayerWeights, ModelWeights, SharedExpertWeights};

/// Errors about a model file's contents.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(
        "unsupported architecture {0:?} (supported: llama, qwen2, qwen3, gemma3, qwen3moe, gpt-oss, phi3, mistral3, qwen3next, qwen35, qwen35moe)"
    )]
    UnsupportedArch(String),
    #[error("missing metadata key {0}")]
    MissingKey(String),
    #[error("missing tensor {0}")]
    MissingTensor(String),
    #[error("invalid model: {0}")]
    Invalid(String),
    #[error("backend: {0}")]
    Backend(String),
}
pub mod synth;
