//! Options and loading shared by the commands that run a model.

use std::sync::Arc;

use anyhow::{Context, bail};
use kestrel_cpu::{CpuBackend, Kernels};
use kestrel_cuda::CudaBackend;
use kestrel_engine::sampler::SamplerParams;
use kestrel_engine::spec::{DraftModel, Drafter, NgramDrafter, SpecMode, SpecStats, Speculator};
use kestrel_engine::{Engine, EngineOptions, Sequence};
use kestrel_gguf::GgufFile;
use kestrel_model::Backend;

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

/// Speculative decoding options (as llama.cpp names them where it has them).
#[derive(clap::Args, Debug, Clone)]
pub struct SpecArgs {
    /// Speculative decoding: none, ngram (prompt lookup) or draft (a draft model, --draft).
    /// Lossless: greedy output is unchanged, sampled output keeps its distribution.
    #[arg(long = "spec", default_value = "none")]
    pub spec: String,
    /// Draft model with the target's vocabulary (catalog name, path or URL; alias -md);
    /// implies --spec draft.
    #[arg(long = "draft", alias = "model-draft")]
    pub draft: Option<String>,
    /// Most tokens drafted per step (the number follows the recent acceptance).
    #[arg(long = "draft-max", default_value_t = 8)]
    pub draft_max: usize,
    /// Fewest drafted tokens worth verifying.
    #[arg(long = "draft-min", default_value_t = 1)]
    pub draft_min: usize,
    /// Prompt lookup (--spec ngram): the shortest suffix of the text it matches, in tokens.
    #[arg(long = "ngram-min", default_value_t = 1)]
    pub ngram_min: usize,
    /// Prompt lookup: the longest suffix it matches (longer matches are tried first).
    #[arg(long = "ngram-max", default_value_t = 4)]
    pub ngram_max: usize,
}

impl SpecArgs {
    /// The drafter chosen, checking that the options agree.
    pub fn mode(&self) -> anyhow::Result<SpecMode> {
        let mode: SpecMode = self.spec.parse()?;
        match (mode, &self.draft) {
            (SpecMode::None | SpecMode::Draft, Some(_)) => Ok(SpecMode::Draft),
            (SpecMode::Draft, None) => bail!("--spec draft needs a draft model: --draft MODEL"),
            (SpecMode::Ngram, Some(_)) => bail!("--draft goes with --spec draft, not ngram"),
            (mode, None) => Ok(mode),
        }
    }

    /// Logit rows a step needs: a verification reads one per drafted token and one more.
    pub fn max_logit_rows(&self) -> usize {
        match self.mode() {
            Ok(SpecMode::None) | Err(_) => 1,
            Ok(_) => self.draft_max + 1,
        }
    }

    /// The speculator for `engine` (loaded from `model`, file `target`), or None without
    /// speculation. A draft model loads on the same device, with its vocabulary checked.
    pub fn speculator(
        &self,
        engine: &AnyEngine,
        model: &ModelArgs,
        target: &GgufFile,
    ) -> anyhow::Result<Option<Speculator<'static>>> {
        let mode = self.mode()?;
        if self.draft_max == 0 || self.draft_min > self.draft_max {
            bail!(
                "--draft-min {} and --draft-max {}: need 1 <= max and min <= max",
                self.draft_min,
                self.draft_max
            );
        }
        let drafter: Box<dyn Drafter> = match mode {
            SpecMode::None => return Ok(None),
            SpecMode::Ngram => Box::new(NgramDrafter::new(self.ngram_min, self.ngram_max)?),
            SpecMode::Draft => {
                let draft_args = ModelArgs {
                    model: self.draft.clone().unwrap_or_default(),
                    max_seqs: 1,
                    ..model.clone()
                };
                match engine {
                    AnyEngine::Cpu(_) => {
                        let backend = CpuBackend::new(Kernels::Fast);
                        let (d, file) = build_engine(backend, &draft_args, 1)?;
                        Box::new(DraftModel::new(d, target, &file)?)
                    }
                    AnyEngine::Cuda(_) => {
                        let backend = CudaBackend::new(match Device::parse(&model.device)? {
                            Device::Cuda(n) => n,
                            Device::Cpu => 0,
                        })
                        .with_context(|| {
                            format!("opening device {} for the draft", model.device)
                        })?;
                        let (d, file) = build_engine(backend, &draft_args, 1)?;
                        Box::new(DraftModel::new(d, target, &file)?)
                    }
                }
            }
        };
        Ok(Some(Speculator::new(
            drafter,
            self.draft_min,
            self.draft_max,
        )))
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
    /// [`Engine::generate_speculative`] on whichever backend.
    #[allow(clippy::too_many_arguments)]
    pub fn generate(
        &mut self,
        seq: &mut Sequence,
        prompt: &[u32],
        params: &SamplerParams,
        max_tokens: usize,
        is_eog: impl Fn(u32) -> bool,
        on_token: impl FnMut(u32) -> bool,
        spec: Option<&mut Speculator>,
    ) -> anyhow::Result<(Vec<u32>, SpecStats)> {
        with_engine!(self, e => e.generate_speculative(seq, prompt, params, max_tokens, is_eog, on_token, spec))
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
    let engine = Engine::new(backend, file.clone(), &opts)
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
