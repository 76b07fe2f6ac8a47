//! `kestrel chat`: an interactive conversation that keeps its KV cache between turns.
//!
//! Lines are edited with rustyline (history kept in `$KESTREL_HOME/chat_history`); a line
//! ending in `\` continues on the next one, and `"""` opens and closes a multi-line block.
//! When the conversation outgrows the context, the oldest turns are dropped (the system
//! prompt stays) and the user is told. `/save FILE` and `/load FILE` keep conversations as
//! JSON arrays of `{"role", "content"}` messages.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, bail};
use kestrel_engine::Sequence;
use kestrel_tokenizer::{ChatMessage, ChatTemplate, StreamDecoder, Tokenizer};
use rustyline::DefaultEditor;
use rustyline::error::ReadlineError;

use crate::interrupt;

use super::common::{ModelArgs, SamplingArgs, SpecArgs, load_any_engine, with_engine};

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

const HELP: &str = "/reset starts over, /save FILE and /load FILE keep a conversation, \
/exit or Ctrl-D quits; end a line with \\ or wrap text in \"\"\" for several lines; \
Ctrl-C stops an answer.";

/// Joins typed lines into one message: a trailing `\` continues, `"""` opens and closes a
/// block.
#[derive(Debug, Default)]
pub struct LineAssembler {
    text: String,
    in_block: bool,
}

impl LineAssembler {
    /// Takes one typed line; returns the message once it is complete.
    pub fn push(&mut self, line: &str) -> Option<String> {
        if line.trim() == "\"\"\"" {
            self.in_block = !self.in_block;
            return if self.in_block {
                None
            } else {
                Some(self.take())
            };
        }
        if self.in_block {
            self.text.push_str(line);
            self.text.push('\n');
            return None;
        }
        if let Some(head) = line.strip_suffix('\\') {
            self.text.push_str(head);
            self.text.push('\n');
            return None;
        }
        self.text.push_str(line);
        Some(self.take())
    }

    /// Whether a message is half typed (the prompt shows `...`).
    pub fn pending(&self) -> bool {
        self.in_block || !self.text.is_empty()
    }

    fn take(&mut self) -> String {
        let text = std::mem::take(&mut self.text);
        text.strip_suffix('\n').map(str::to_string).unwrap_or(text)
    }
}

/// Drops the oldest turns (never a leading system message, never the last message) until
/// `fits` accepts the conversation. Returns how many messages went, or an error when even
/// the last message alone does not fit.
pub fn shift_context(
    messages: &mut Vec<ChatMessage>,
    mut fits: impl FnMut(&[ChatMessage]) -> anyhow::Result<bool>,
) -> anyhow::Result<usize> {
    let keep = usize::from(messages.first().is_some_and(|m| m.role == "system"));
    let mut dropped = 0;
    while !fits(messages)? {
        if messages.len() <= keep + 1 {
            bail!("the message does not fit the context (-c) even alone");
        }
        // A user turn goes with the answer that follows it.
        let n = if messages.len() > keep + 2 && messages[keep + 1].role == "assistant" {
            2
        } else {
            1
        };
        messages.drain(keep..keep + n);
        dropped += n;
    }
    Ok(dropped)
}

fn save(path: &Path, messages: &[ChatMessage]) -> anyhow::Result<()> {
    let json = serde_json::to_string_pretty(messages)?;
    std::fs::write(path, json + "\n").with_context(|| format!("writing {}", path.display()))
}

fn load(path: &Path) -> anyhow::Result<Vec<ChatMessage>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| {
        format!(
            "{} is not a conversation (a JSON array of {{\"role\", \"content\"}} messages)",
            path.display()
        )
    })
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let params = args.sampling.params()?;
    let (mut engine, file) = load_any_engine(&args.model, args.spec.max_logit_rows())?;
    let mut speculator = args.spec.speculator(&engine, &args.model, &file)?;
    let tokenizer = Tokenizer::from_gguf(&file).context("loading the tokenizer")?;
    let template = ChatTemplate::resolve(&file, args.chat_template.as_deref())?;
    let ctx = with_engine!(&engine, e => e.ctx);
    // Room kept for the answer when deciding whether the conversation still fits.
    let reserve = args.n_predict.min(ctx / 2);
    let encode = |messages: &[ChatMessage]| -> anyhow::Result<Vec<u32>> {
        let text = template.render(messages, true)?;
        Ok(tokenizer.encode(&text, false, true))
    };

    // Ctrl-C stops the answer being generated; a second one exits.
    interrupt::handle_in_command();
    let mut editor = DefaultEditor::new().context("opening the line editor")?;
    let history = kestrel_hub::kestrel_home().join("chat_history");
    let _ = editor.load_history(&history);

    let fresh = |system: &Option<String>| -> Vec<ChatMessage> {
        system.iter().map(ChatMessage::system).collect()
    };
    let mut messages = fresh(&args.system);
    let mut seq = Sequence::default();
    let mut lines = LineAssembler::default();
    eprintln!("{HELP}");
    let mut stdout = std::io::stdout();
    loop {
        let prompt = if lines.pending() { "... " } else { "> " };
        let line = match editor.readline(prompt) {
            Ok(line) => line,
            Err(ReadlineError::Interrupted) => {
                lines = LineAssembler::default();
                continue;
            }
            Err(ReadlineError::Eof) => break,
            Err(e) => return Err(e).context("reading input"),
        };
        let Some(input) = lines.push(&line) else {
            continue;
        };
        let _ = editor.add_history_entry(input.as_str());
        let command = input.trim();
        if command.is_empty() {
            continue;
        }
        match command.split_once(' ').unwrap_or((command, "")) {
            ("/exit" | "/quit", _) => break,
            ("/help", _) => {
                eprintln!("{HELP}");
                continue;
            }
            ("/reset", _) => {
                messages = fresh(&args.system);
                engine.release(&mut seq);
                eprintln!("(conversation cleared)");
                continue;
            }
            ("/save", path) if !path.trim().is_empty() => {
                match save(Path::new(path.trim()), &messages) {
                    Ok(()) => eprintln!("(saved {} messages)", messages.len()),
                    Err(e) => eprintln!("error: {e:#}"),
                }
                continue;
            }
            ("/load", path) if !path.trim().is_empty() => {
                match load(Path::new(path.trim())) {
                    Ok(loaded) => {
                        messages = loaded;
                        engine.release(&mut seq);
                        eprintln!("(loaded {} messages)", messages.len());
                    }
                    Err(e) => eprintln!("error: {e:#}"),
                }
                continue;
            }
            (c, _) if c.starts_with('/') && !c.contains(char::is_whitespace) => {
                eprintln!("unknown command {c}; {HELP}");
                continue;
            }
            _ => {}
        }
        messages.push(ChatMessage::user(input));
        let fits = |m: &[ChatMessage]| Ok(encode(m)?.len() + reserve <= ctx);
        match shift_context(&mut messages, fits) {
            Ok(0) => {}
            Ok(n) => eprintln!(
                "(context full: dropped the {n} oldest messages{})",
                if args.system.is_some() {
                    "; the system prompt stays"
                } else {
                    ""
                }
            ),
            Err(e) => {
                eprintln!("error: {e:#}");
                messages.pop();
                continue;
            }
        }
        let ids = encode(&messages)?;
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
        interrupt::clear();
        let budget = args.n_predict.min(ctx - ids.len());
        let result = engine.generate(
            &mut seq,
            &ids[common..],
            &params,
            budget,
            |id| tokenizer.is_eog(id),
            |id| {
                if tokenizer.is_eog(id) {
                    return false;
                }
                let piece = decoder.push(id);
                answer.push_str(&piece);
                let _ = stdout.write_all(piece.as_bytes());
                let _ = stdout.flush();
                !interrupt::interrupted()
            },
            speculator.as_mut(),
        );
        let tail = decoder.finish();
        answer.push_str(&tail);
        writeln!(stdout, "{tail}")?;
        if let Err(e) = result {
            eprintln!("error: {e:#} (use /reset)");
            messages.pop();
            continue;
        }
        messages.push(ChatMessage::assistant(answer));
    }
    let _ = editor.save_history(&history);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_join_by_backslash_and_blocks() {
        let mut a = LineAssembler::default();
        assert_eq!(a.push("one"), Some("one".into()));
        assert_eq!(a.push("two \\"), None);
        assert!(a.pending());
        assert_eq!(a.push("three"), Some("two \nthree".into()));
        assert_eq!(a.push("\"\"\""), None);
        assert_eq!(a.push("fn main() {\\"), None);
        assert_eq!(a.push(""), None);
        assert_eq!(a.push("}"), None);
        assert_eq!(a.push("\"\"\""), Some("fn main() {\\\n\n}".into()));
        assert!(!a.pending());
    }

    #[test]
    fn shift_drops_oldest_turns_and_keeps_the_system_prompt() {
        let conv = |n: usize| -> Vec<ChatMessage> {
            let mut m = vec![ChatMessage::system("sys")];
            for i in 0..n {
                m.push(ChatMessage::user(format!("q{i}")));
                m.push(ChatMessage::assistant(format!("a{i}")));
            }
            m.push(ChatMessage::user("last"));
            m
        };
        // "Tokens" = messages; the context holds 4.
        let mut m = conv(3);
        let dropped = shift_context(&mut m, |m| Ok(m.len() <= 4)).expect("fits");
        assert_eq!(dropped, 4);
        let contents: Vec<&str> = m.iter().map(|m| m.content.as_str()).collect();
        assert_eq!(contents, ["sys", "q2", "a2", "last"]);
        let mut m = conv(1);
        assert_eq!(shift_context(&mut m, |_| Ok(true)).expect("fits"), 0);
        assert_eq!(m.len(), 4);
        let mut m = conv(2);
        assert!(shift_context(&mut m, |m| Ok(m.len() <= 1)).is_err());
        // Without a system prompt the first message can go too.
        let mut m = vec![
            ChatMessage::user("a"),
            ChatMessage::assistant("b"),
            ChatMessage::user("c"),
        ];
        assert_eq!(
            shift_context(&mut m, |m| Ok(m.len() <= 1)).expect("fits"),
            2
        );
    }
}
