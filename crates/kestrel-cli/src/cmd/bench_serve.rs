//! `kestrel bench-serve`: load-tests a running server with concurrent streaming clients.

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rand::Rng;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Server base URL.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// Concurrency levels to run, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
    pub concurrency: Vec<usize>,
    /// Requests per concurrency level.
    #[arg(long, default_value_t = 64)]
    pub requests: usize,
    /// Prompt length in tokens (random ids).
    #[arg(long, default_value_t = 512)]
    pub prompt_len: usize,
    /// Tokens to generate per request.
    #[arg(long, default_value_t = 128)]
    pub gen_len: usize,
    /// Sampling temperature of every request (0: greedy). Without the filters below, a
    /// draw from the whole vocabulary (OpenAI's defaults).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// top_k of every request (llama.cpp's extension of the API; its CLI default is 40).
    #[arg(long)]
    pub top_k: Option<u32>,
    /// top_p of every request.
    #[arg(long)]
    pub top_p: Option<f32>,
    /// min_p of every request (llama.cpp's extension).
    #[arg(long)]
    pub min_p: Option<f32>,
    #[arg(long)]
    pub api_key: Option<String>,
}

struct Sample {
    ttft: Duration,
    itls: Vec<Duration>,
    tokens: usize,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let auth = args.api_key.as_ref().map(|k| format!("Bearer {k}"));
    let mut req = agent.get(format!("{}/v1/models", args.url));
    if let Some(a) = &auth {
        req = req.header("Authorization", a);
    }
    let models: serde_json::Value = serde_json::from_str(
        &req.call()
            .context("contacting the server")?
            .body_mut()
            .read_to_string()?,
    )?;
    let model = models["data"][0]["id"].as_str().unwrap_or("").to_string();
    let vocab = models["data"][0]["meta"]["n_vocab"].as_u64().unwrap_or(256) as u32;
    println!(
        "{:>6} {:>9} {:>12} {:>10} {:>10} {:>10} {:>10}",
        "conc", "requests", "gen tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"
    );
    for &conc in &args.concurrency {
        if conc == 0 {
            bail!("concurrency must be positive");
        }
        let next = std::sync::atomic::AtomicUsize::new(0);
        let start = Instant::now();
        let samples: Vec<Sample> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..conc)
                .map(|_| {
                    s.spawn(|| {
                        let mut rng = rand::rng();
                        let mut out = Vec::new();
                        while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                            < args.requests
                        {
                            let prompt: Vec<u32> = (0..args.prompt_len.max(1))
                                .map(|_| rng.random_range(0..vocab.max(1)))
                                .collect();
                            match one(
                                &agent,
                                &args.url,
                                auth.as_deref(),
                                &model,
                                &prompt,
                                args.gen_len,
                                &args,
                            ) {
                                Ok(sample) => out.push(sample),
                                Err(e) => eprintln!("request failed: {e:#}"),
                            }
                        }
                        out
                    })
                })
                .collect();
            workers
                .into_iter()
                .flat_map(|w| w.join().unwrap_or_default())
                .collect()
        });
        let elapsed = start.elapsed().as_secs_f64();
        let tokens: usize = samples.iter().map(|s| s.tokens).sum();
        let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft.as_secs_f64()).collect();
        let mut itl: Vec<f64> = samples
            .iter()
            .flat_map(|s| s.itls.iter().map(Duration::as_secs_f64))
            .collect();
        println!(
            "{:>6} {:>9} {:>12.1} {:>9.0}ms {:>9.0}ms {:>9.1}ms {:>9.1}ms",
            conc,
            samples.len(),
            tokens as f64 / elapsed,
            pct(&mut ttft, 0.5) * 1e3,
            pct(&mut ttft, 0.99) * 1e3,
            pct(&mut itl, 0.5) * 1e3,
            pct(&mut itl, 0.99) * 1e3,
        );
    }
    Ok(())
}

fn pct(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// One streaming request; times its tokens.
fn one(
    agent: &ureq::Agent,
    url: &str,
    auth: Option<&str>,
    model: &str,
    prompt: &[u32],
    gen_len: usize,
    args: &Args,
) -> anyhow::Result<Sample> {
    let mut body = serde_json::json!({
        "model": model, "prompt": prompt, "max_tokens": gen_len,
        "temperature": args.temperature, "stream": true,
    });
    if let Some(k) = args.top_k {
        body["top_k"] = k.into();
    }
    if let Some(p) = args.top_p {
        body["top_p"] = p.into();
    }
    if let Some(p) = args.min_p {
        body["min_p"] = p.into();
    }
    let start = Instant::now();
    let mut req = agent
        .post(format!("{url}/v1/completions"))
        .header("Content-Type", "application/json");
    if let Some(a) = auth {
        req = req.header("Authorization", a);
    }
    let resp = req.send(body.to_string())?;
    if resp.status().as_u16() != 200 {
        bail!("status {}", resp.status());
    }
    let mut lines = BufReader::new(resp.into_body().into_reader());
    let mut line = String::new();
    let mut last = None;
    let mut sample = Sample {
        ttft: Duration::ZERO,
        itls: Vec::new(),
        tokens: 0,
    };
    while lines.read_line(&mut line)? > 0 {
        if let Some(data) = line.trim_end().strip_prefix("data: ") {
            if data == "[DONE]" {
                break;
            }
            let chunk: serde_json::Value = serde_json::from_str(data)?;
            let n = chunk["choices"][0]["token_ids"]
                .as_array()
                .map_or(0, Vec::len);
            if n > 0 {
                let now = Instant::now();
                match last {
                    None => sample.ttft = now - start,
                    Some(t) => sample.itls.push(now - t),
                }
                last = Some(now);
                sample.tokens += n;
            }
        }
        line.clear();
    }
    Ok(sample)
}
