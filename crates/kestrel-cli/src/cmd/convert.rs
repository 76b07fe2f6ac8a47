//! `kestrel convert DIR -o OUT.gguf`: turn a Hugging Face checkpoint into a GGUF file.

use std::path::PathBuf;

use anyhow::{Result, bail};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint folder (config.json, *.safetensors, tokenizer.json).
    pub dir: PathBuf,
    /// Output GGUF file.
    #[arg(short = 'o', long)]
    pub output: PathBuf,
}

pub fn run(_args: Args) -> Result<()> {
    bail!("not yet")
}
