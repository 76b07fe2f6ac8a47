//! One module per subcommand.

pub mod bench;
pub mod bench_prompts;
pub mod bench_serve;
pub mod chat;
pub mod common;
pub mod convert;
pub mod gpu_check;
pub mod inspect;
pub mod list;
pub mod perplexity;
pub mod pull;
pub mod quantize;
pub mod rm;
pub mod run;
pub mod serve;
pub mod synth;
pub mod tokenize;
