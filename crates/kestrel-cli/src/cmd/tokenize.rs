//! `kestrel tokenize -m MODEL [--add-special] [--parse-special] [--pieces] [-f FILE | TEXT]`

use std::io::{Read, Write};
use std::path::PathBuf;

use anyhow::{Context, Result};
use kestrel_gguf::GgufFile;
use kestrel_tokenizer::Tokenizer;

#[derive(clap::Args)]
pub struct Args {
    /// GGUF file path, catalog model name or URL.
    #[arg(short, long, default_value = kestrel_hub::DEFAULT_MODEL)]
    pub model: String,
    /// Add the special tokens the model asks for (BOS/EOS per its tokenizer settings).
    #[arg(long)]
    pub add_special: bool,
    /// Treat special-token text such as `<|im_start|>` as the special token.
    #[arg(long)]
    pub parse_special: bool,
    /// Print one token per line (id and piece) instead of a JSON array.
    #[arg(long)]
    pub pieces: bool,
    /// Read the text from this file.
    #[arg(short, long, conflicts_with = "text")]
    pub file: Option<PathBuf>,
    /// The text (read from stdin when neither TEXT nor --file is given).
    pub text: Option<String>,
}

pub fn run(args: Args) -> Result<()> {
    let text = match (&args.text, &args.file) {
        (Some(text), _) => text.clone(),
        (None, Some(file)) => std::fs::read_to_string(file)
            .with_context(|| format!("cannot read {}", file.display()))?,
        (None, None) => {
            let mut text = String::new();
            std::io::stdin()
                .read_to_string(&mut text)
                .context("cannot read text from stdin")?;
            text
        }
    };
    let path = kestrel_hub::resolve_model(&args.model)?;
    let gguf = GgufFile::open(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let tokenizer = Tokenizer::from_gguf(&gguf)
        .with_context(|| format!("cannot load the tokenizer of {}", path.display()))?;
    let ids = tokenizer.encode(&text, args.add_special, args.parse_special);
    let mut out = std::io::stdout().lock();
    if args.pieces {
        for &id in &ids {
            writeln!(
                out,
                "{id:>7}  {}",
                escape_piece(tokenizer.token_to_piece(id, true))
            )?;
        }
    } else {
        writeln!(out, "{}", serde_json::to_string(&ids)?)?;
    }
    Ok(())
}

/// A token's bytes as a quoted, escaped string; bytes that are not UTF-8 on their own
/// (pieces of a multi-byte character) are shown as `\xNN`.
fn escape_piece(bytes: &[u8]) -> String {
    let mut out = String::from("\"");
    for chunk in bytes.utf8_chunks() {
        for c in chunk.valid().chars() {
            out.extend(c.escape_debug());
        }
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out.push('"');
    out
}
