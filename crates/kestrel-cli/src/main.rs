//! `kestrel`: command-line front end of the Kestrel inference engine.
//!
//! Each subcommand lives in `src/cmd/<name>.rs` with `pub struct Args` and `pub fn run`.
//! Adding one: a `mod` line in `cmd/mod.rs`, a variant below, and a dispatch arm.

mod cmd;
mod interrupt;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "kestrel",
    version,
    about = "Run GGUF language models on the CPU or an NVIDIA GPU"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Download a catalog model, ORG/REPO[:QUANT] or a URL into the caches; prints the path.
    Pull(cmd::pull::Args),
    /// Convert a Hugging Face checkpoint (safetensors + config.json + tokenizer) to GGUF.
    Convert(cmd::convert::Args),
    /// Rewrite a GGUF model in another quantization (llama-quantize's types and mixtures).
    Quantize(cmd::quantize::Args),
    /// List the cached models: name, file, size, architecture, quantization, source.
    List(cmd::list::Args),
    /// Remove a cached model by name.
    Rm(cmd::rm::Args),
    /// Show a GGUF file's metadata, tokenizer summary and tensors.
    Inspect(cmd::inspect::Args),
    /// Turn text into token ids with a model's tokenizer.
    Tokenize(cmd::tokenize::Args),
    /// Generate a continuation of a prompt.
    Run(cmd::run::Args),
    /// Chat interactively with a model (keeps the conversation's cache between turns).
    Chat(cmd::chat::Args),
    /// Score a text file: perplexity and per-position top log-probs.
    Perplexity(cmd::perplexity::Args),
    /// Write a random-weight GGUF model (tests, benchmarks; llama.cpp loads it too).
    Synth(cmd::synth::Args),
    /// Check the CUDA backend against the CPU on tiny synthetic models (needs a GPU).
    GpuCheck(cmd::gpu_check::Args),
    /// Measure prompt-processing and generation speed (like llama-bench).
    Bench(cmd::bench::Args),
    /// Serve the model over an OpenAI-compatible HTTP API with continuous batching.
    Serve(cmd::serve::Args),
    /// Load-test a running server: throughput, time to first token, inter-token latency.
    BenchServe(cmd::bench_serve::Args),
}

fn main() {
    let cli = Cli::parse_from(llama_flags(std::env::args_os()));
    interrupt::install();
    let result = match cli.command {
        Command::Pull(args) => cmd::pull::run(args),
        Command::Convert(args) => cmd::convert::run(args),
        Command::Quantize(args) => cmd::quantize::run(args),
        Command::List(args) => cmd::list::run(args),
        Command::Rm(args) => cmd::rm::run(args),
        Command::Inspect(args) => cmd::inspect::run(args),
        Command::Tokenize(args) => cmd::tokenize::run(args),
        Command::Run(args) => cmd::run::run(args),
        Command::Chat(args) => cmd::chat::run(args),
        Command::Perplexity(args) => cmd::perplexity::run(args),
        Command::Synth(args) => cmd::synth::run(args),
        Command::GpuCheck(args) => cmd::gpu_check::run(args),
        Command::Bench(args) => cmd::bench::run(args),
        Command::Serve(args) => cmd::serve::run(args),
        Command::BenchServe(args) => cmd::bench_serve::run(args),
    };
    if let Err(err) = result {
        // Output piped into `head` and closed early is not an error worth reporting.
        if is_broken_pipe(&err) {
            std::process::exit(0);
        }
        eprintln!("error: {err:#}");
        std::process::exit(1);
    }
}

/// The arguments with llama.cpp's single-dash multi-letter flags spelled as [`llama_flag`]
/// does, up to a `--` (what follows it is a prompt or other operand, kept as written).
fn llama_flags(
    args: impl IntoIterator<Item = std::ffi::OsString>,
) -> impl Iterator<Item = std::ffi::OsString> {
    let mut operands = false;
    args.into_iter().map(move |arg| {
        if operands {
            return arg;
        }
        if arg == "--" {
            operands = true;
            return arg;
        }
        llama_flag(arg)
    })
}

/// llama.cpp's single-dash multi-letter flags `-ctk` / `-ctv` (cache types) and `-md` (draft
/// model) as the long ones, which clap's one-letter shorts cannot spell (it would read `-ctk`
/// as `-c tk`).
fn llama_flag(arg: std::ffi::OsString) -> std::ffi::OsString {
    let Some(s) = arg.to_str() else { return arg };
    for (short, long) in [
        ("-ctk", "--cache-type-k"),
        ("-ctv", "--cache-type-v"),
        ("-md", "--draft"),
    ] {
        if let Some(rest) = s
            .strip_prefix(short)
            .filter(|r| r.is_empty() || r.starts_with('='))
        {
            return format!("{long}{rest}").into();
        }
    }
    arg
}

fn is_broken_pipe(err: &anyhow::Error) -> bool {
    use std::io::ErrorKind::BrokenPipe;
    err.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == BrokenPipe)
            || cause
                .downcast_ref::<serde_json::Error>()
                .is_some_and(|e| e.io_error_kind() == Some(BrokenPipe))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rewrite(args: &[&str]) -> Vec<String> {
        llama_flags(args.iter().map(std::ffi::OsString::from))
            .map(|a| a.into_string().unwrap())
            .collect()
    }

    #[test]
    fn llama_flags_are_rewritten_only_before_the_operands() {
        assert_eq!(
            rewrite(&[
                "kestrel",
                "run",
                "-ctk",
                "q8_0",
                "-ctv=q4_0",
                "-md",
                "d.gguf",
                "-c",
                "9"
            ]),
            [
                "kestrel",
                "run",
                "--cache-type-k",
                "q8_0",
                "--cache-type-v=q4_0",
                "--draft",
                "d.gguf",
                "-c",
                "9"
            ]
        );
        // A prompt that happens to read like one of them stays as written after `--`.
        assert_eq!(
            rewrite(&["kestrel", "run", "-ctk", "f16", "--", "-ctk", "-md"]),
            [
                "kestrel",
                "run",
                "--cache-type-k",
                "f16",
                "--",
                "-ctk",
                "-md"
            ]
        );
        // Longer flags that merely begin with the same letters are not touched.
        assert_eq!(rewrite(&["-ctkx", "-mdl"]), ["-ctkx", "-mdl"]);
    }
}
