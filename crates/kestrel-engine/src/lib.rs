//! Sequences over the paged KV cache, the sampler and the generation loop.

pub mod engine;
pub mod kv;
pub mod perplexity;
pub mod sampler;
pub mod scheduler;
pub mod stop;

pub use engine::{Engine, EngineOptions, Sequence};
pub use kv::{BlockManager, OutOfBlocks};
pub use stop::StopMatcher;
