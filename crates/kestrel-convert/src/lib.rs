//! From a Hugging Face checkpoint to any GGUF quantization, as llama.cpp's tools do it:
//! - [`convert`]: a Hugging Face checkpoint ([`checkpoint`]: safetensors + config.json;
//!   [`vocab`]: tokenizer.json; [`spm`]: SentencePiece tokenizer.model) to GGUF
//!   (`kestrel convert`);
//! - [`ftype`]: llama-quantize's file types and per-tensor type choice;
//! - [`quantize`]: rewriting a GGUF file in another type (`kestrel quantize`).

pub mod checkpoint;
pub mod convert;
pub mod ftype;
pub mod imatrix;
pub mod quantize;
pub mod spm;
pub mod vocab;

pub use convert::Conversion;
pub use ftype::FileType;
pub use imatrix::Imatrix;
pub use quantize::{Plan, QuantizeOptions, write_quantized};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A progress bar on stderr counting `total` bytes (hidden unless both stdout and stderr
/// are terminals, as kestrel-hub's bars).
pub fn progress_bar(total: u64, message: &str) -> ProgressBar {
    use std::io::IsTerminal;
    if !(std::io::stderr().is_terminal() && std::io::stdout().is_terminal()) {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template(
        "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    )
    .map(|s| s.progress_chars("=> "))
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar.set_message(message.to_string());
    bar
}
