//! Sequences over the paged KV cache, the sampler, the generation loop (with speculative
//! decoding) and the scheduler.

pub mod embed;
pub mod engine;
pub mod kv;
pub mod perplexity;
pub mod sampler;
pub mod scheduler;
pub mod spec;
pub mod stop;

pub use engine::{
    Engine, EngineOptions, KvCacheSize, Sequence, kv_bytes_per_token, kv_cache_blocks,
};
pub use kv::{BlockManager, OutOfBlocks};
pub use stop::StopMatcher;
