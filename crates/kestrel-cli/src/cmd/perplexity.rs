//! `kestrel perplexity`: llama-perplexity's estimate over a whole file.
//!
//! The text (or the token ids of `--ids`) is cut into windows of `-c` tokens (`--chunks N`
//! keeps the first N). Each window is evaluated from an empty cache, its first token made
//! BOS where the model adds one, and, as llama.cpp does, only the predictions of its second
//! half are scored (the first half gives them context). The estimate is exp of the mean
//! negative log-likelihood over every scored token, ± its standard error.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use kestrel_engine::perplexity::score_window;
use kestrel_tokenizer::Tokenizer;

use super::common::{ModelArgs, load_any_engine, positive, with_engine};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text file to score.
    #[arg(
        short = 'f',
        long,
        required_unless_present = "ids",
        conflicts_with = "ids"
    )]
    pub file: Option<PathBuf>,
    /// Score these token ids (a JSON array) instead of a text file.
    #[arg(long)]
    pub ids: Option<PathBuf>,
    /// Score only the first N windows.
    #[arg(long, value_parser = positive)]
    pub chunks: Option<usize>,
    /// Write the first window's per-position scores as JSON (llama.cpp reference schema).
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Negative log-likelihoods summed as llama.cpp's perplexity does.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Estimate {
    nll: f64,
    nll2: f64,
    count: usize,
}

impl Estimate {
    pub fn add(&mut self, logprob: f64) {
        self.nll -= logprob;
        self.nll2 += logprob * logprob;
        self.count += 1;
    }

    /// Perplexity so far.
    pub fn ppl(&self) -> f64 {
        (self.nll / self.count.max(1) as f64).exp()
    }

    /// Standard error of [`Self::ppl`] (llama.cpp's: ppl × the standard error of the mean
    /// NLL), or `None` with fewer than two tokens.
    pub fn std_error(&self) -> Option<f64> {
        if self.count < 2 {
            return None;
        }
        let n = self.count as f64;
        let mean = self.nll / n;
        let var = self.nll2 / n - mean * mean;
        (var > 0.0).then(|| self.ppl() * (var / (n - 1.0)).sqrt())
    }
}

/// The windows `start..start + ctx` of `n_tokens` tokens, at most `chunks` of them.
pub fn windows(n_tokens: usize, ctx: usize, chunks: Option<usize>) -> Vec<usize> {
    let n = n_tokens / ctx.max(1);
    (0..chunks.map_or(n, |c| c.min(n)))
        .map(|k| k * ctx)
        .collect()
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let ctx = args.model.ctx;
    if ctx < 4 {
        bail!("-c {ctx}: a perplexity window needs at least 4 tokens");
    }
    let (mut engine, file) = load_any_engine(&args.model, 128)?;
    let tokenizer = Tokenizer::from_gguf(&file).ok();
    let ids: Vec<u32> = match (&args.file, &args.ids) {
        (_, Some(path)) => super::run::read_ids(path)?,
        (Some(path), None) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let tokenizer = tokenizer
                .as_ref()
                .context("the model has no tokenizer; use --ids")?;
            // As llama.cpp: BOS where the model asks for one, special-token text not parsed.
            tokenizer.encode(&text, true, false)
        }
        (None, None) => unreachable!("clap requires -f or --ids"),
    };
    let starts = windows(ids.len(), ctx, args.chunks);
    if starts.is_empty() {
        bail!(
            "{} tokens do not fill one window of -c {ctx}; pass a smaller -c",
            ids.len()
        );
    }
    let bos = tokenizer
        .as_ref()
        .filter(|t| t.add_bos())
        .and_then(|t| t.bos_id());
    let first = ctx / 2;
    let mut total = Estimate::default();
    let bar = kestrel_hub::count_bar(starts.len() as u64, "windows");
    bar.set_message("perplexity");
    let started = Instant::now();
    for (k, &start) in starts.iter().enumerate() {
        let mut window = ids[start..start + ctx].to_vec();
        if let Some(bos) = bos {
            window[0] = bos;
        }
        let score = with_engine!(&mut engine, e => score_window(e, &window, 16))?;
        if k == 0
            && let Some(path) = &args.json
        {
            std::fs::write(path, serde_json::to_string(&score)?)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        // Position i predicts token i + 1: the second half's predictions.
        for p in &score.positions[first..] {
            total.add(p.next_logprob);
        }
        bar.inc(1);
        bar.suspend(|| print!("[{}]{:.4},", k + 1, total.ppl()));
    }
    bar.finish_and_clear();
    println!();
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "scored {} windows of {ctx} tokens in {secs:.2} s ({:.1} t/s)",
        starts.len(),
        (starts.len() * ctx) as f64 / secs
    );
    match total.std_error() {
        Some(se) => println!("Final estimate: PPL = {:.4} +/- {se:.5}", total.ppl()),
        None => println!("Final estimate: PPL = {:.4}", total.ppl()),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimate_matches_a_hand_computation() {
        let mut e = Estimate::default();
        for lp in [-1.0, -2.0, -3.0] {
            e.add(lp);
        }
        // Mean NLL 2, sample variance 1 → se of the mean 1/sqrt(3).
        assert!((e.ppl() - 2f64.exp()).abs() < 1e-12);
        let se = e.std_error().expect("three tokens");
        assert!((se - 2f64.exp() / 3f64.sqrt()).abs() < 1e-12, "{se}");
        let mut one = Estimate::default();
        one.add(-0.5);
        assert_eq!(one.std_error(), None);
    }

    #[test]
    fn windows_cover_whole_windows_only() {
        assert_eq!(windows(10, 4, None), [0, 4]);
        assert_eq!(windows(12, 4, None), [0, 4, 8]);
        assert_eq!(windows(12, 4, Some(2)), [0, 4]);
        assert_eq!(windows(12, 4, Some(9)), [0, 4, 8]);
        assert!(windows(3, 4, None).is_empty());
    }
}
