//! Options and loading shared by the commands that run a model.

use std::sync::Arc;

use anyhow::{Context, bail};
use kestrel_cpu::{CpuBackend, Kernels};
use kestrel_engine::sampler::SamplerParams;
use kestrel_engine::{Engine, EngineOptions};
use kestrel_gguf::GgufFile;

/// Which model and where to run it.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model: a catalog name (pulled if missing), a GGUF path or a URL.
    #[arg(short = 'm', long, default_value = "qwen2.5-coder-1.5b")]
    pub model: String,
    /// Device to run on: `cpu` (CUDA arrives with the CUDA backend).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Threads for the CPU backend (default: all cores).
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// Context size in tokens (prompt + generation).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    pub ctx: usize,
    /// Most prompt tokens evaluated in one step.
    #[arg(long = "batch", default_value_t = 256)]
    pub batch: usize,
}

/// Sampling options, named as in llama.cpp.
#[derive(clap::Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Temperature; 0 = greedy.
    #[arg(long = "temp", default_value_t = 0.8)]
    pub temperature: f32,
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    #[arg(long, default_value_t = 64)]
    pub repeat_last_n: usize,
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Seed of the sampler (same seed, same output).
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    pub fn params(&self) -> anyhow::Result<SamplerParams> {
        let p = SamplerParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
        };
        p.validate()
            .map_err(|e| anyhow::anyhow!("bad sampling options: {e}"))?;
        Ok(p)
    }
}

/// Resolves, maps and loads the model; `max_logit_rows` sizes the logits buffer.
pub fn load_engine(
    args: &ModelArgs,
    max_logit_rows: usize,
) -> anyhow::Result<(Engine<CpuBackend>, Arc<GgufFile>)> {
    match args.device.as_str() {
        "cpu" => {}
        d if d.starts_with("cuda") => {
            bail!("device {d:?}: this build has no CUDA backend yet; use --device cpu")
        }
        d => bail!("unknown device {d:?} (expected cpu or cuda[:N])"),
    }
    if let Some(t) = args.threads {
        // Fails only if the pool was already built, which the commands never do first.
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(t.max(1))
            .build_global();
    }
    let path = kestrel_hub::resolve_model(&args.model)?;
    let file =
        Arc::new(GgufFile::open(&path).with_context(|| format!("opening {}", path.display()))?);
    let opts = EngineOptions {
        ctx: args.ctx,
        max_batch_tokens: args.batch.max(1),
        max_logit_rows,
        block_size: 16,
        max_seqs: 1,
    };
    let start = std::time::Instant::now();
    let engine = Engine::new(CpuBackend::new(Kernels::Fast), file.clone(), &opts)
        .with_context(|| format!("loading {}", path.display()))?;
    eprintln!(
        "loaded {} ({}, {} layers) on {} in {:.2} s",
        path.display(),
        engine.config().arch.name(),
        engine.config().n_layer,
        kestrel_model::Backend::name(&engine.backend),
        start.elapsed().as_secs_f64()
    );
    Ok((engine, file))
}
