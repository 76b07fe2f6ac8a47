//! `kestrel perplexity`: teacher-forced scoring of the first window of a text file.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use kestrel_engine::perplexity::score_window;
use kestrel_tokenizer::Tokenizer;

use super::common::{ModelArgs, load_any_engine, with_engine};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text file to score.
    #[arg(short = 'f', long)]
    pub file: PathBuf,
    /// Tokens in the scored window.
    #[arg(long = "ctx", default_value_t = 512)]
    pub window: usize,
    /// Write the scores as JSON (llama.cpp reference schema) to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let mut model_args = args.model.clone();
    model_args.ctx = model_args.ctx.max(args.window);
    let (mut engine, file) = load_any_engine(&model_args, 128)?;
    let tokenizer = Tokenizer::from_gguf(&file).context("loading the tokenizer")?;
    // As llama.cpp: BOS where the model asks for one, special-token text not parsed.
    let mut ids = tokenizer.encode(&text, true, false);
    ids.truncate(args.window);
    if ids.len() < 2 {
        anyhow::bail!("{} holds fewer than 2 tokens", args.file.display());
    }
    let start = Instant::now();
    let score = with_engine!(&mut engine, e => score_window(e, &ids, 16))?;
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "scored {} tokens in {secs:.2} s ({:.1} t/s)",
        ids.len(),
        ids.len() as f64 / secs
    );
    println!("perplexity over {} tokens: {:.4}", ids.len(), score.ppl);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string(&score)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
