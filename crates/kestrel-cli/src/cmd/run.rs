//! `kestrel run`: generate a continuation of a prompt, streamed to stdout. The prompt is
//! an argument, a file (`-f FILE`), stdin (`-` or `-f -`) or raw token ids (`--ids FILE`).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use kestrel_engine::spec::{SpecMode, SpecStats};
use kestrel_engine::{Sequence, StopMatcher};
use kestrel_server::constrain::{Constraint, Grammars};
use kestrel_tokenizer::{ChatMessage, ChatTemplate, StreamDecoder, Tokenizer, TokenizerError};

use super::common::{AnyEngine, ModelArgs, SamplingArgs, SpecArgs, load_any_engine, with_engine};

fn engine_vocab(engine: &AnyEngine) -> usize {
    with_engine!(engine, e => e.config().vocab_size)
}

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Most tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 256)]
    pub n_predict: usize,
    /// Apply the model's chat template to the prompt as a user turn.
    #[arg(long)]
    pub chat: bool,
    /// Chat template: a built-in name (chatml, gemma, llama3) or a Jinja file.
    #[arg(long)]
    pub chat_template: Option<String>,
    /// System message for --chat.
    #[arg(long)]
    pub system: Option<String>,
    /// Stop when the output contains this text (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Print one JSON object {"prompt_ids", "ids", "text", "timings"} at the end instead of
    /// streaming.
    #[arg(long)]
    pub json: bool,
    /// Constrain the output to this JSON Schema (a JSON file).
    #[arg(long, value_name = "FILE", conflicts_with = "grammar")]
    pub json_schema: Option<std::path::PathBuf>,
    /// Constrain the output to this Lark grammar (llguidance's dialect).
    #[arg(long, value_name = "FILE")]
    pub grammar: Option<std::path::PathBuf>,
    /// Also print the speculation's acceptance summary.
    #[arg(short = 'v', long)]
    pub verbose: bool,
    /// Read the prompt from this file (`-` for stdin).
    #[arg(short = 'f', long, conflicts_with_all = ["prompt", "ids"])]
    pub file: Option<PathBuf>,
    /// Evaluate these token ids (a JSON array, `-` for stdin) as the prompt, untokenized.
    #[arg(long, conflicts_with_all = ["prompt", "chat"])]
    pub ids: Option<PathBuf>,
    /// The prompt (`-` reads stdin).
    #[arg(required_unless_present_any = ["file", "ids"])]
    pub prompt: Option<String>,
}

/// Reads `path` (`-` = stdin) as text.
fn read_text(path: &Path) -> anyhow::Result<String> {
    let mut text = String::new();
    if path == Path::new("-") {
        std::io::stdin()
            .read_to_string(&mut text)
            .context("reading the prompt from stdin")?;
    } else {
        text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    }
    Ok(text)
}

/// Reads token ids: a JSON array of non-negative integers, from `path` (`-` = stdin).
pub fn read_ids(path: &Path) -> anyhow::Result<Vec<u32>> {
    let text = read_text(path)?;
    serde_json::from_str::<Vec<u32>>(&text).with_context(|| {
        format!(
            "{} is not a JSON array of token ids (integers from 0 to 2^32-1)",
            path.display()
        )
    })
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let params = args.sampling.params()?;
    if args.chat_template.is_some() && !args.chat {
        eprintln!("kestrel: warning: --chat-template has no effect without --chat");
    }
    if args.system.is_some() && !args.chat {
        eprintln!("kestrel: warning: --system has no effect without --chat");
    }
    // Read the prompt before loading: a missing file is reported at once.
    let prompt = match (&args.file, args.prompt.as_deref()) {
        (Some(path), _) => Some(read_text(path)?),
        (None, Some("-")) => Some(read_text(Path::new("-"))?),
        (None, p) => p.map(str::to_string),
    };
    let constraint = constraint(&args)?;
    let given_ids = args.ids.as_deref().map(read_ids).transpose()?;
    // A constrained output is sampled token by token on the host: no speculation.
    let spec_mode = args.spec.mode()?;
    let speculate = constraint.is_none() && spec_mode != SpecMode::None;
    if constraint.is_some() && spec_mode != SpecMode::None {
        eprintln!("kestrel: warning: --spec has no effect with --json-schema or --grammar");
    }
    let logit_rows = if speculate {
        args.spec.max_logit_rows()
    } else {
        1
    };
    let (mut engine, file) = load_any_engine(&args.model, logit_rows)?;
    let mut speculator = if speculate {
        args.spec.speculator(&engine, &args.model, &file)?
    } else {
        None
    };
    let tokenizer = match Tokenizer::from_gguf(&file) {
        Ok(t) => Some(Arc::new(t)),
        // A model without a tokenizer (a synthetic one) runs on token ids and prints ids.
        Err(TokenizerError::NoTokenizer(_)) if given_ids.is_some() && constraint.is_none() => None,
        Err(e) => return Err(e).context("loading the tokenizer"),
    };
    let vocab = engine_vocab(&engine);
    let mut filter = match (&constraint, &tokenizer) {
        (Some(c), Some(t)) => Some(
            Grammars::new(t.clone())
                .filter(c, Vec::new())
                .map_err(|e| anyhow::anyhow!("bad grammar or schema: {e}"))?,
        ),
        _ => None,
    };

    let prompt_ids = if let Some(ids) = given_ids {
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            bail!("token id {bad} is outside the vocabulary (0..{vocab})");
        }
        ids
    } else if args.chat {
        let tokenizer = tokenizer.as_ref().context("the model has no tokenizer")?;
        let prompt = prompt.as_deref().unwrap_or_default();
        let template = ChatTemplate::resolve(&file, args.chat_template.as_deref())?;
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(ChatMessage::new("system", system));
        }
        messages.push(ChatMessage::new("user", prompt));
        let text = template.render(&messages, true)?;
        // The template writes BOS itself where the model wants one.
        tokenizer.encode(&text, false, true)
    } else {
        let tokenizer = tokenizer.as_ref().context("the model has no tokenizer")?;
        tokenizer.encode(prompt.as_deref().unwrap_or_default(), true, true)
    };
    if prompt_ids.is_empty() {
        anyhow::bail!("the prompt is empty after tokenization");
    }

    let mut decoder = tokenizer.as_deref().map(StreamDecoder::new);
    let mut stops = StopMatcher::new(&args.stop);
    let mut text = String::new();
    let mut stdout = std::io::stdout().lock();
    let mut first_token_at = None;
    let start = Instant::now();
    let mut seq = Sequence::default();
    let mut stopped_by_string = false;
    let is_eog = |id: u32| tokenizer.as_ref().is_some_and(|t| t.is_eog(id));
    let on_token = |id: u32| {
        first_token_at.get_or_insert_with(Instant::now);
        if tokenizer.as_ref().is_some_and(|t| t.is_eog(id)) {
            return false;
        }
        let Some(decoder) = decoder.as_mut() else {
            if !args.json {
                let _ = write!(stdout, "{id} ");
                let _ = stdout.flush();
            }
            return true;
        };
        let piece = decoder.push(id);
        let (out, stop) = stops.push(&piece);
        text.push_str(&out);
        if !args.json {
            let _ = stdout.write_all(out.as_bytes());
            let _ = stdout.flush();
        }
        stopped_by_string = stop;
        !stop
    };
    let (ids, spec_stats) = match &mut filter {
        Some(f) => {
            let ids = with_engine!(&mut engine, e => e.generate_filtered(
                &mut seq,
                &prompt_ids,
                &params,
                args.n_predict,
                f.as_mut(),
                is_eog,
                on_token,
            ))?;
            (ids, SpecStats::default())
        }
        None => engine.generate(
            &mut seq,
            &prompt_ids,
            &params,
            args.n_predict,
            is_eog,
            on_token,
            speculator.as_mut(),
        )?,
    };
    if !stopped_by_string {
        let rest = decoder
            .as_mut()
            .map(StreamDecoder::finish)
            .unwrap_or_default();
        let (out, _) = stops.push(&rest);
        let tail = out + &stops.finish();
        text.push_str(&tail);
        if !args.json {
            stdout.write_all(tail.as_bytes())?;
        }
    }
    let end = Instant::now();
    let first = first_token_at.unwrap_or(end);
    let prefill_s = (first - start).as_secs_f64();
    let decode_s = (end - first).as_secs_f64();
    if args.json {
        let obj = serde_json::json!({
            "prompt_ids": prompt_ids,
            "ids": ids,
            "text": text,
            "timings": {
                "prompt_tokens": prompt_ids.len(),
                "prompt_s": prefill_s,
                "gen_tokens": ids.len(),
                "gen_s": decode_s,
                "drafted": spec_stats.drafted,
                "accepted": spec_stats.accepted,
            },
        });
        writeln!(stdout, "{obj}")?;
    } else {
        writeln!(stdout)?;
    }
    eprintln!(
        "prompt: {} tokens in {:.2} s ({:.1} t/s); generated: {} tokens in {:.2} s ({:.1} t/s)",
        prompt_ids.len(),
        prefill_s,
        prompt_ids.len() as f64 / prefill_s.max(1e-9),
        ids.len(),
        decode_s,
        ids.len().saturating_sub(1) as f64 / decode_s.max(1e-9),
    );
    if args.verbose && speculator.is_some() {
        eprintln!("{}", spec_stats.summary());
    }
    Ok(())
}

/// The output constraint of `--json-schema` or `--grammar`, read from its file.
fn constraint(args: &Args) -> anyhow::Result<Option<Constraint>> {
    let read = |path: &std::path::Path| {
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
    };
    if let Some(path) = &args.json_schema {
        let schema: serde_json::Value = serde_json::from_str(&read(path)?)
            .with_context(|| format!("{} is not JSON", path.display()))?;
        return Ok(Some(Constraint::JsonSchema {
            schema,
            strict: true,
        }));
    }
    match &args.grammar {
        Some(path) => Ok(Some(Constraint::Lark(read(path)?))),
        None => Ok(None),
    }
}
