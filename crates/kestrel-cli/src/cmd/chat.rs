//! `kestrel chat`: an interactive conversation that keeps its KV cache between turns.

use std::io::{BufRead, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;
use kestrel_engine::Sequence;
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
    /// Most tokens per answer.
    #[arg(short = 'n', long = "n-predict", default_value_t = 1024)]
    pub n_predict: usize,
    /// Chat template: a built-in name (chatml, gemma, llama3) or a Jinja file.
    #[arg(long)]
    pub chat_template: Option<String>,
    /// System message.
    #[arg(long)]
    pub system: Option<String>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let params = args.sampling.params()?;
    let (mut engine, file) = load_any_engine(&args.model, args.spec.max_logit_rows())?;
    let mut speculator = args.spec.speculator(&engine, &args.model, &file)?;
    let tokenizer = Tokenizer::from_gguf(&file).context("loading the tokenizer")?;
    let template = ChatTemplate::resolve(&file, args.chat_template.as_deref())?;

    // Ctrl-C stops the answer being generated; a second one at the prompt exits.
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let flag = interrupted.clone();
        ctrlc::set_handler(move || {
            if flag.swap(true, Ordering::SeqCst) {
                std::process::exit(130);
            }
        })
        .context("installing the Ctrl-C handler")?;
    }

    let fresh = |system: &Option<String>| -> Vec<ChatMessage> {
        system
            .iter()
            .map(|s| ChatMessage::new("system", s))
            .collect()
    };
    let mut messages = fresh(&args.system);
    let mut seq = Sequence::default();
    eprintln!("/reset starts over, /exit or Ctrl-D quits, Ctrl-C stops an answer.");
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout();
    loop {
        eprint!("> ");
        let mut line = String::new();
        interrupted.store(false, Ordering::SeqCst);
        if stdin.lock().read_line(&mut line)? == 0 {
            eprintln!();
            break;
        }
        let line = line.trim_end_matches(['\n', '\r']);
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages = fresh(&args.system);
                engine.release(&mut seq);
                eprintln!("(conversation cleared)");
                continue;
            }
            _ => {}
        }
        messages.push(ChatMessage::new("user", line));
        let text = template.render(&messages, true)?;
        let ids = tokenizer.encode(&text, false, true);
        // Reuse the cache for the part of the conversation already evaluated.
        let common = seq
            .tokens
            .iter()
            .zip(&ids)
            .take_while(|(a, b)| a == b)
            .count()
            .min(ids.len().saturating_sub(1));
        engine.truncate(&mut seq, common);
        let mut decoder = StreamDecoder::new(&tokenizer);
        let mut answer = String::new();
        let result = engine.generate(
            &mut seq,
            &ids[common..],
            &params,
            args.n_predict,
            |id| tokenizer.is_eog(id),
            |id| {
                if tokenizer.is_eog(id) {
                    return false;
                }
                let piece = decoder.push(id);
                answer.push_str(&piece);
                let _ = stdout.write_all(piece.as_bytes());
                let _ = stdout.flush();
                !interrupted.load(Ordering::SeqCst)
            },
            speculator.as_mut(),
        );
        let tail = decoder.finish();
        answer.push_str(&tail);
        writeln!(stdout, "{tail}")?;
        if let Err(e) = result {
            // A full context ends the conversation's growth, not the program.
            eprintln!("error: {e:#} (use /reset)");
            messages.pop();
            continue;
        }
        messages.push(ChatMessage::new("assistant", answer));
    }
    Ok(())
}
