//! `kestrel bench --prompts FILE`: generation speed on a workload of real prompts, greedy,
//! with or without speculative decoding (`--spec`). The file holds one JSON object per line,
//! `{"name": ..., "prompt": ...}`, the prompt as the model sees it (chat template applied).
//! Reports per prompt and in total: tokens/s, drafted and accepted tokens, acceptance and
//! mean accepted length.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, bail};
use kestrel_engine::Sequence;
use kestrel_engine::sampler::SamplerParams;
use kestrel_engine::spec::SpecStats;
use kestrel_tokenizer::Tokenizer;
use serde::Serialize;

use super::bench::Args;
use super::common::load_any_engine;

/// One prompt of the workload.
struct Task {
    name: String,
    text: String,
}

fn read_workload(path: &Path) -> anyhow::Result<Vec<Task>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut tasks = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let at = || format!("{} line {}", path.display(), i + 1);
        let v: serde_json::Value = serde_json::from_str(line).with_context(at)?;
        let Some(prompt) = v["prompt"].as_str() else {
            bail!("{}: no \"prompt\" string", at());
        };
        tasks.push(Task {
            name: v["name"].as_str().unwrap_or("").to_string(),
            text: prompt.to_string(),
        });
    }
    if tasks.is_empty() {
        bail!("{}: no prompts", path.display());
    }
    Ok(tasks)
}

/// One prompt's run, or the workload's sum.
#[derive(Serialize, Debug, Default)]
struct Row {
    name: String,
    prompt_tokens: usize,
    prompt_s: f64,
    gen_tokens: usize,
    /// From the first generated token to the last.
    gen_s: f64,
    gen_ts: f64,
    #[serde(flatten)]
    spec: SpecStats,
    acceptance: f64,
    mean_accepted: f64,
}

impl Row {
    /// Fills in the rates; the first token of each of `runs` generations came with its
    /// prefill, not within `gen_s`.
    fn finish(&mut self, runs: usize) {
        let timed = self.gen_tokens.saturating_sub(runs);
        self.gen_ts = timed as f64 / self.gen_s.max(1e-9);
        self.acceptance = self.spec.acceptance();
        self.mean_accepted = self.spec.mean_accepted();
    }

    fn print(&self) {
        println!(
            "| {} | {} | {:.2} | {} | {:.2} | {:.2} | {} | {} | {:.1}% | {:.2} |",
            self.name,
            self.prompt_tokens,
            self.prompt_s,
            self.gen_tokens,
            self.gen_s,
            self.gen_ts,
            self.spec.drafted,
            self.spec.accepted,
            100.0 * self.acceptance,
            self.mean_accepted
        );
    }
}

pub fn run(args: &Args, prompts: &Path) -> anyhow::Result<()> {
    let tasks = read_workload(prompts)?;
    let n_gen = args.n_gen.first().copied().unwrap_or(128);
    if n_gen == 0 {
        bail!("give -n a positive number of tokens to generate per prompt");
    }
    let (mut engine, file) = load_any_engine(&args.model, args.spec.max_logit_rows())?;
    let mut speculator = args.spec.speculator(&engine, &args.model, &file)?;
    let tokenizer = Tokenizer::from_gguf(&file).context("loading the tokenizer")?;
    let params = SamplerParams::greedy();
    if !args.json {
        println!(
            "| prompt | prompt tokens | prompt s | gen tokens | gen s | gen t/s | drafted | accepted | acceptance | mean accepted |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    }
    let mut rows = Vec::new();
    let mut total = Row {
        name: "total".into(),
        ..Row::default()
    };
    for _ in 0..args.repetitions {
        for task in &tasks {
            let ids = tokenizer.encode(&task.text, false, true);
            if ids.is_empty() {
                bail!("prompt {:?} is empty after tokenization", task.name);
            }
            let mut seq = Sequence::default();
            let start = Instant::now();
            let mut first = None;
            let (out, spec) = engine.generate(
                &mut seq,
                &ids,
                &params,
                n_gen,
                |id| tokenizer.is_eog(id),
                |_| {
                    first.get_or_insert_with(Instant::now);
                    true
                },
                speculator.as_mut(),
            )?;
            let end = Instant::now();
            engine.release(&mut seq);
            let first = first.unwrap_or(end);
            let mut row = Row {
                name: task.name.clone(),
                prompt_tokens: ids.len(),
                prompt_s: (first - start).as_secs_f64(),
                gen_tokens: out.len(),
                gen_s: (end - first).as_secs_f64(),
                spec,
                ..Row::default()
            };
            row.finish(1);
            total.prompt_tokens += row.prompt_tokens;
            total.prompt_s += row.prompt_s;
            total.gen_tokens += row.gen_tokens;
            total.gen_s += row.gen_s;
            total.spec.add(&row.spec);
            if !args.json {
                row.print();
            }
            rows.push(row);
        }
    }
    total.finish(rows.len());
    if args.json {
        let obj = serde_json::json!({ "prompts": rows, "total": total });
        println!("{}", serde_json::to_string_pretty(&obj)?);
    } else {
        total.print();
    }
    Ok(())
}
