//! Options and loading shared by the commands that run a model.

use std::sync::Arc;

use anyhow::{Context, bail};
use kestrel_cpu::{CpuBackend, Kernels};
use kestrel_cuda::CudaBackend;
use kestrel_engine::sampler::SamplerParams;
use kestrel_engine::{Engine, EngineOptions, Sequence};
use kestrel_gguf::GgufFile;
use kestrel_model::{Backend, KvType, KvTypes};

/// Which model and where to run it.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model: a catalog name (pulled if missing), a GGUF path or a URL.
    #[arg(short = 'm', long, default_value = "qwen2.5-coder-1.5b")]
    pub model: String,
    /// Device to run on: `cpu`, `cuda` or `cuda:N` (GPU N).
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
    /// Sequences the KV cache holds at full context (set by commands, not a flag).
    #[arg(skip = 1usize)]
    pub max_seqs: usize,
    #[command(flatten)]
    pub cache: CacheArgs,
}

/// The KV cache's storage types, named as in llama.cpp (`-ctk` / `-ctv` are rewritten to
/// these by `main`).
#[derive(clap::Args, Debug, Clone)]
pub struct CacheArgs {
    /// Storage type of the cached keys: f16, bf16, q8_0 or q4_0 (CPU; CUDA: f16).
    #[arg(long = "cache-type-k", default_value = "f16")]
    pub cache_type_k: KvType,
    /// Storage type of the cached values: f16, bf16, q8_0 or q4_0 (CPU; CUDA: f16).
    #[arg(long = "cache-type-v", default_value = "f16")]
    pub cache_type_v: KvType,
}

impl CacheArgs {
    pub fn types(&self) -> KvTypes {
        KvTypes {
            k: self.cache_type_k,
            v: self.cache_type_v,
        }
    }
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

/// Where to run: `cpu` or `cuda[:N]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

impl Device {
    pub fn parse(s: &str) -> anyhow::Result<Device> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            d => match d.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Device::Cuda(n)),
                _ => bail!("unknown device {d:?} (expected cpu, cuda or cuda:N)"),
            },
        }
    }
}

/// An engine on whichever backend `--device` chose. The methods the commands use are
/// forwarded; anything else goes through [`with_engine!`].
// One engine per process: its size does not matter, and unboxed variants let
// `with_engine!` hand out `&mut Engine<B>` directly.
#[allow(clippy::large_enum_variant)]
pub enum AnyEngine {
    Cpu(Engine<CpuBackend>),
    Cuda(Engine<CudaBackend>),
}

/// Runs `$body` with `$e` bound to the engine inside an [`AnyEngine`] (or a reference to
/// one), whatever its backend: the body is compiled once per backend.
#[macro_export]
macro_rules! with_engine {
    ($any:expr, $e:ident => $body:expr) => {
        match $any {
            $crate::cmd::common::AnyEngine::Cpu($e) => $body,
            $crate::cmd::common::AnyEngine::Cuda($e) => $body,
        }
    };
}
pub use with_engine;

impl AnyEngine {
    pub fn generate(
        &mut self,
        seq: &mut Sequence,
        prompt: &[u32],
        params: &SamplerParams,
        max_tokens: usize,
        is_eog: impl Fn(u32) -> bool,
        on_token: impl FnMut(u32) -> bool,
    ) -> anyhow::Result<Vec<u32>> {
        with_engine!(self, e => e.generate(seq, prompt, params, max_tokens, is_eog, on_token))
    }

    pub fn truncate(&mut self, seq: &mut Sequence, n: usize) {
        with_engine!(self, e => e.truncate(seq, n))
    }

    pub fn release(&mut self, seq: &mut Sequence) {
        with_engine!(self, e => e.release(seq))
    }
}

/// Resolves, maps and loads the model on `--device`; `max_logit_rows` sizes the logits
/// buffer.
pub fn load_any_engine(
    args: &ModelArgs,
    max_logit_rows: usize,
) -> anyhow::Result<(AnyEngine, Arc<GgufFile>)> {
    match Device::parse(&args.device)? {
        Device::Cpu => {
            let (engine, file) = load_engine(args, max_logit_rows)?;
            Ok((AnyEngine::Cpu(engine), file))
        }
        Device::Cuda(ordinal) => {
            let backend = CudaBackend::new(ordinal)
                .with_context(|| format!("opening device {}", args.device))?;
            let (engine, file) = build_engine(backend, args, max_logit_rows)?;
            Ok((AnyEngine::Cuda(engine), file))
        }
    }
}

/// Resolves, maps and loads the model on the CPU; `max_logit_rows` sizes the logits buffer.
/// Commands that run on any device use [`load_any_engine`].
pub fn load_engine(
    args: &ModelArgs,
    max_logit_rows: usize,
) -> anyhow::Result<(Engine<CpuBackend>, Arc<GgufFile>)> {
    match Device::parse(&args.device)? {
        Device::Cpu => {}
        Device::Cuda(_) => bail!(
            "device {:?}: this command runs on the CPU only for now; use --device cpu",
            args.device
        ),
    }
    if let Some(t) = args.threads {
        // Fails only if the pool was already built, which the commands never do first.
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(t.max(1))
            .build_global();
    }
    build_engine(CpuBackend::new(Kernels::Fast), args, max_logit_rows)
}

/// Loads the model onto `backend`.
fn build_engine<B: Backend>(
    backend: B,
    args: &ModelArgs,
    max_logit_rows: usize,
) -> anyhow::Result<(Engine<B>, Arc<GgufFile>)> {
    let path = kestrel_hub::resolve_model(&args.model)?;
    let file =
        Arc::new(GgufFile::open(&path).with_context(|| format!("opening {}", path.display()))?);
    let opts = EngineOptions {
        ctx: args.ctx,
        max_batch_tokens: args.batch.max(1),
        max_logit_rows,
        block_size: 16,
        max_seqs: args.max_seqs.max(1),
    };
    let start = std::time::Instant::now();
    let engine = Engine::with_cache_types(backend, file.clone(), &opts, args.cache.types())
        .with_context(|| format!("loading {}", path.display()))?;
    eprintln!(
        "loaded {} ({}, {} layers) on {} in {:.2} s",
        path.display(),
        engine.config().arch.name(),
        engine.config().n_layer,
        engine.backend.name(),
        start.elapsed().as_secs_f64()
    );
    Ok((engine, file))
}
