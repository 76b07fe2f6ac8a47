//! `kestrel run`: generate a continuation of a prompt, streamed to stdout.

use std::io::Write;
use std::time::Instant;

use anyhow::Context;
use kestrel_engine::{Sequence, StopMatcher};
use kestrel_tokenizer::{ChatMessage, ChatTemplate, StreamDecoder, Tokenizer};

use super::common::{ModelArgs, SamplingArgs, SpecArgs, load_any_engine};

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
    /// Also print the speculation's acceptance summary.
    #[arg(short = 'v', long)]
    pub verbose: bool,
    /// The prompt.
    pub prompt: String,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let params = args.sampling.params()?;
    args.spec.mode()?;
    let (mut engine, file) = load_any_engine(&args.model, args.spec.max_logit_rows())?;
    let mut speculator = args.spec.speculator(&engine, &args.model, &file)?;
    let tokenizer = Tokenizer::from_gguf(&file).context("loading the tokenizer")?;

    let prompt_ids = if args.chat {
        let template = ChatTemplate::resolve(&file, args.chat_template.as_deref())?;
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(ChatMessage::new("system", system));
        }
        messages.push(ChatMessage::new("user", &args.prompt));
        let text = template.render(&messages, true)?;
        // The template writes BOS itself where the model wants one.
        tokenizer.encode(&text, false, true)
    } else {
        tokenizer.encode(&args.prompt, true, true)
    };
    if prompt_ids.is_empty() {
        anyhow::bail!("the prompt is empty after tokenization");
    }

    let mut decoder = StreamDecoder::new(&tokenizer);
    let mut stops = StopMatcher::new(&args.stop);
    let mut text = String::new();
    let mut stdout = std::io::stdout().lock();
    let mut first_token_at = None;
    let start = Instant::now();
    let mut seq = Sequence::default();
    let mut stopped_by_string = false;
    let (ids, spec_stats) = engine.generate(
        &mut seq,
        &prompt_ids,
        &params,
        args.n_predict,
        |id| tokenizer.is_eog(id),
        |id| {
            first_token_at.get_or_insert_with(Instant::now);
            if tokenizer.is_eog(id) {
                return false;
            }
            let piece = decoder.push(id);
            let (out, stop) = stops.push(&piece);
            text.push_str(&out);
            if !args.json {
                let _ = stdout.write_all(out.as_bytes());
                let _ = stdout.flush();
            }
            stopped_by_string = stop;
            !stop
        },
        speculator.as_mut(),
    )?;
    if !stopped_by_string {
        let (out, _) = stops.push(&decoder.finish());
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
