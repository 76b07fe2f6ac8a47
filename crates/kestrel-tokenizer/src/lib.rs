//! kestrel-tokenizer: tokenizers built from GGUF metadata, a streaming detokenizer and
//! chat templates.
//!
//! The tokenizers reproduce llama.cpp's behaviour token for token:
//! - `tokenizer.ggml.model = "gpt2"`: byte-level BPE with merge ranks, preceded by the
//!   pre-tokenizer regexes that `tokenizer.ggml.pre` selects ([`PreTokenizer`]).
//! - `tokenizer.ggml.model = "llama"`: SentencePiece-style BPE driven by token scores,
//!   with `<0xXX>` byte fallback and `▁` standing for spaces.
//!
//! Special tokens (control, user-defined) are split out of the text first, longest text
//! first, as llama.cpp's `tokenizer_st_partition` does.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let gguf = kestrel_gguf::GgufFile::open("model.gguf")?;
//! let tok = kestrel_tokenizer::Tokenizer::from_gguf(&gguf)?;
//! let ids = tok.encode("Hello, world!", true, true);
//! assert_eq!(tok.decode(&ids), "Hello, world!");
//! # Ok(()) }
//! ```

mod bpe;
pub mod chat;
mod decode;
mod special;
mod spm;
mod stream;
mod tokenizer;
mod vocab;

pub use chat::{ChatMessage, ChatTemplate, ChatTemplateError};
pub use stream::StreamDecoder;
pub use tokenizer::Tokenizer;
pub use vocab::{PreTokenizer, TokenAttrs, TokenType, TokenizerConfig, TokenizerKind};

/// Errors building a tokenizer from metadata.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// The file carries no tokenizer (`tokenizer.ggml.model` is `none` or absent):
    /// callers work with raw token ids.
    #[error(
        "the model file has no tokenizer (tokenizer.ggml.model is {0}); only raw token ids can be used"
    )]
    NoTokenizer(String),
    /// `tokenizer.ggml.model` names a tokenizer this crate does not implement.
    #[error("unsupported tokenizer model '{0}' in tokenizer.ggml.model (supported: gpt2, llama)")]
    UnknownModel(String),
    /// `tokenizer.ggml.pre` names a pre-tokenizer this crate does not implement.
    #[error(
        "unsupported pre-tokenizer '{0}' in tokenizer.ggml.pre (supported: default, gpt-2, llama3/llama-bpe, qwen2)"
    )]
    UnknownPreTokenizer(String),
    /// A metadata key is missing, has the wrong type or inconsistent contents.
    #[error("bad tokenizer metadata: {0}")]
    BadMetadata(String),
}
