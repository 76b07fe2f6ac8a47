//! Options and loading shared by the commands that run a model.

use std::sync::Arc;

use anyhow::{Context, bail};
use kestrel_cpu::{CpuBackend, Kernels};
use kestrel_cuda::{CudaBackend, SplitBackend, TpBackend};
use kestrel_engine::sampler::SamplerParams;
use kestrel_engine::spec::{DraftModel, Drafter, NgramDrafter, SpecMode, SpecStats, Speculator};
use kestrel_engine::{Engine, EngineOptions, Sequence};
use kestrel_gguf::GgufFile;
use kestrel_model::{Backend, KvType, KvTypes, ModelConfig};

/// Which model and where to run it.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model: a catalog name (pulled if missing), a GGUF path or a URL.
    #[arg(short = 'm', long, default_value = "qwen2.5-coder-1.5b")]
    pub model: String,
    /// Device to run on: `cpu`, `cuda` or `cuda:N` (GPU N); `cuda:0,cuda:1` (or
    /// `--devices`) runs the model tensor-parallel over those GPUs.
    #[arg(long, visible_alias = "devices", default_value = "cpu")]
    pub device: String,
    /// Tensor parallelism over GPUs 0..N (same as `--devices cuda:0,...,cuda:N-1`).
    #[arg(long, value_parser = positive)]
    pub tp: Option<usize>,
    /// How several GPUs share the model: `tensor` (the default: tensor parallelism) or
    /// `layer` (contiguous layers per GPU, sized by memory; a GPU may be named twice).
    #[arg(long, value_enum)]
    pub split: Option<SplitMode>,
    /// Threads for the CPU backend (default: all cores).
    #[arg(short = 't', long, value_parser = positive)]
    pub threads: Option<usize>,
    /// Context size in tokens (prompt + generation); 0 = the model's, as far as memory
    /// allows.
    #[arg(
        short = 'c',
        long = "ctx-size",
        visible_alias = "ctx",
        default_value_t = 4096
    )]
    pub ctx: usize,
    /// Most prompt tokens evaluated in one step.
    #[arg(long = "batch", default_value_t = 256, value_parser = positive)]
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
    /// Storage type of the cached keys: f16, bf16, q8_0 or q4_0 on the CPU; f16, q8_0 or
    /// fp8 on CUDA.
    #[arg(long = "cache-type-k", default_value = "f16")]
    pub cache_type_k: KvType,
    /// Storage type of the cached values: f16, bf16, q8_0 or q4_0 on the CPU; f16, q8_0 or
    /// fp8 on CUDA.
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
    /// Seed of the sampler (same seed, same output); -1 = random, as by default.
    #[arg(long, allow_negative_numbers = true, value_parser = seed)]
    pub seed: Option<Seed>,
}

/// A `--seed` value: `None` for -1 (random).
#[derive(Debug, Clone, Copy)]
pub struct Seed(Option<u64>);

/// A count that must be at least 1 (a usage error otherwise).
pub fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// llama.cpp's seed: a number, or -1 for a random one.
fn seed(s: &str) -> Result<Seed, String> {
    match s {
        "-1" => Ok(Seed(None)),
        _ => s
            .parse::<u64>()
            .map(|n| Seed(Some(n)))
            .map_err(|_| "expected a number from 0 to 2^64-1, or -1 for random".into()),
    }
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
            seed: self.seed.and_then(|s| s.0),
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
    /// Prompt lookup (--spec ngram): the shortest suffix of the text it matches, in tokens
    /// (2: a single matching token guessed badly; on the 20 code tasks, replayed with
    /// scripts/workloads/spec_sim.py, acceptance 78% -> 85% and 5% more speed, predicted).
    #[arg(long = "ngram-min", default_value_t = 2)]
    pub ngram_min: usize,
    /// Prompt lookup: the longest suffix it matches (longer matches are tried first).
    #[arg(long = "ngram-max", default_value_t = 4)]
    pub ngram_max: usize,
}

impl SpecArgs {
    /// The drafter chosen, checking that the options agree.
    pub fn mode(&self) -> anyhow::Result<SpecMode> {
        spec_mode(&self.spec, self.draft.as_deref())
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
                        let (d, file) = build_engine(backend, true, &draft_args, 1)?;
                        Box::new(DraftModel::new(d, target, &file)?)
                    }
                    AnyEngine::Cuda(_) | AnyEngine::Tp(_) | AnyEngine::Split(_) => {
                        let device = Device::resolve_split(&model.device, model.tp, model.split)?;
                        let ordinal = device.draft_ordinal();
                        let backend = CudaBackend::new(ordinal).with_context(|| {
                            format!("opening device cuda:{ordinal} for the draft")
                        })?;
                        let (d, file) = build_engine(backend, false, &draft_args, 1)?;
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

/// The drafter `--spec` and `--draft` choose together (`--draft` implies `draft`).
pub fn spec_mode(spec: &str, draft: Option<&str>) -> anyhow::Result<SpecMode> {
    let mode: SpecMode = spec.parse()?;
    match (mode, draft) {
        (SpecMode::None | SpecMode::Draft, Some(_)) => Ok(SpecMode::Draft),
        (SpecMode::Draft, None) => bail!("--spec draft needs a draft model: --draft MODEL"),
        (SpecMode::Ngram, Some(_)) => bail!("--draft goes with --spec draft, not ngram"),
        (mode, None) => Ok(mode),
    }
}

/// How a model is divided among several GPUs (`--split`, llama.cpp's `-sm` names).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum SplitMode {
    Tensor,
    Layer,
}

/// Where to run: `cpu` or `cuda[:N]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(usize),
    /// Several GPUs, tensor parallel (rank i on the i-th).
    CudaTp(Vec<usize>),
    /// Several GPUs (or stages on one), layer split (stage i on the i-th).
    CudaLayers(Vec<usize>),
}

impl Device {
    /// [`Self::resolve`], then `--split`: `layer` turns a list of GPUs into a layer split.
    pub fn resolve_split(
        s: &str,
        tp: Option<usize>,
        split: Option<SplitMode>,
    ) -> anyhow::Result<Device> {
        match (Device::resolve(s, tp)?, split) {
            (Device::CudaTp(v), Some(SplitMode::Layer)) => Ok(Device::CudaLayers(v)),
            (_, Some(SplitMode::Layer)) => bail!(
                "--split layer needs two or more GPUs (--devices cuda:0,cuda:1, or cuda:0,cuda:0 \
                 for two stages on one, or --tp 2)"
            ),
            (d, _) => Ok(d),
        }
    }

    /// The devices of `replicas` copies of the model (data parallelism): `--device` /
    /// `--tp` / `--split` as [`Self::resolve_split`] reads them for one, or, for more, the
    /// GPU list (`--devices`, else GPUs 0.. for `--device cuda` or `--tp N`) cut into that
    /// many consecutive groups of equal size, each a GPU, a tensor-parallel group or a
    /// layer split.
    pub fn resolve_replicas(
        s: &str,
        tp: Option<usize>,
        split: Option<SplitMode>,
        replicas: usize,
    ) -> anyhow::Result<Vec<Device>> {
        if replicas <= 1 {
            return Ok(vec![Device::resolve_split(s, tp, split)?]);
        }
        let per = tp.unwrap_or(1);
        let gpus: Vec<usize> = match Device::parse(s)? {
            Device::CudaTp(v) | Device::CudaLayers(v) => v,
            // `--tp N` alone means GPUs, as for one copy.
            _ if s == "cuda" || (s == "cpu" && tp.is_some()) => (0..replicas * per).collect(),
            Device::Cuda(n) => bail!(
                "--data-parallel {replicas} and --device cuda:{n}: list the GPUs (--devices \
                 cuda:0,cuda:1)"
            ),
            Device::Cpu => bail!(
                "--data-parallel {replicas} runs a copy of the model on each GPU (or group of \
                 GPUs): give --device cuda or --devices cuda:0,cuda:1"
            ),
        };
        if !gpus.len().is_multiple_of(replicas) || tp.is_some_and(|t| gpus.len() != t * replicas) {
            bail!(
                "--data-parallel {replicas}{}: {} GPUs do not make {replicas} equal groups",
                tp.map(|t| format!(" with --tp {t}")).unwrap_or_default(),
                gpus.len()
            );
        }
        gpus.chunks(gpus.len() / replicas)
            .map(|g| match (g, split) {
                ([_], Some(SplitMode::Layer)) => {
                    bail!("--split layer needs two or more GPUs for each of the {replicas} copies")
                }
                ([one], _) => Ok(Device::Cuda(*one)),
                (g, Some(SplitMode::Layer)) => Ok(Device::CudaLayers(g.to_vec())),
                (g, _) => Ok(Device::CudaTp(g.to_vec())),
            })
            .collect()
    }

    /// The GPU a draft model runs on (alone): the target's, or the first of its list.
    pub fn draft_ordinal(&self) -> usize {
        match self {
            Device::Cuda(n) => *n,
            Device::CudaTp(v) | Device::CudaLayers(v) => v.first().copied().unwrap_or(0),
            Device::Cpu => 0,
        }
    }

    /// `--device` (`cpu`, `cuda`, `cuda:N`, or a comma-separated list of GPUs) with `--tp N`.
    pub fn resolve(s: &str, tp: Option<usize>) -> anyhow::Result<Device> {
        let d = Device::parse(s)?;
        match (tp, &d) {
            (None, _) => Ok(d),
            (Some(1), Device::Cpu) => Ok(Device::Cuda(0)),
            (Some(1), Device::Cuda(_)) => Ok(d),
            (Some(n), Device::Cuda(_) | Device::Cpu) if s == "cpu" || s == "cuda" => {
                Ok(Device::CudaTp((0..n).collect()))
            }
            (Some(n), Device::CudaTp(v)) if v.len() == n => Ok(d),
            (Some(n), _) => bail!("--tp {n} and --device {s} disagree: give one of them"),
        }
    }

    pub fn parse(s: &str) -> anyhow::Result<Device> {
        if s.contains(',') {
            let list = s
                .split(',')
                .map(|d| match Device::parse(d.trim())? {
                    Device::Cuda(n) => Ok(n),
                    _ => bail!("{d:?} in --devices {s:?}: expected cuda:N"),
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            return Ok(Device::CudaTp(list));
        }
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
    Tp(Engine<TpBackend>),
    Split(Engine<SplitBackend>),
}

/// Runs `$body` with `$e` bound to the engine inside an [`AnyEngine`] (or a reference to
/// one), whatever its backend: the body is compiled once per backend.
#[macro_export]
macro_rules! with_engine {
    ($any:expr, $e:ident => $body:expr) => {
        match $any {
            $crate::cmd::common::AnyEngine::Cpu($e) => $body,
            $crate::cmd::common::AnyEngine::Cuda($e) => $body,
            $crate::cmd::common::AnyEngine::Tp($e) => $body,
            $crate::cmd::common::AnyEngine::Split($e) => $body,
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
    match Device::resolve_split(&args.device, args.tp, args.split)? {
        Device::CudaLayers(ordinals) => {
            let backend = SplitBackend::new(&ordinals)
                .with_context(|| format!("opening GPUs {ordinals:?}"))?;
            let (engine, file) = build_engine(backend, false, args, max_logit_rows)?;
            Ok((AnyEngine::Split(engine), file))
        }
        Device::CudaTp(ordinals) => {
            let backend =
                TpBackend::new(&ordinals).with_context(|| format!("opening GPUs {ordinals:?}"))?;
            let (engine, file) = build_engine(backend, false, args, max_logit_rows)?;
            Ok((AnyEngine::Tp(engine), file))
        }
        Device::Cpu => {
            let (engine, file) = load_engine(args, max_logit_rows)?;
            Ok((AnyEngine::Cpu(engine), file))
        }
        Device::Cuda(ordinal) => {
            let backend = CudaBackend::new(ordinal)
                .with_context(|| format!("opening device {}", args.device))?;
            let (engine, file) = build_engine(backend, false, args, max_logit_rows)?;
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
    match Device::resolve_split(&args.device, args.tp, args.split)? {
        Device::Cpu => {}
        Device::Cuda(_) | Device::CudaTp(_) | Device::CudaLayers(_) => bail!(
            "device {:?}: this command runs on the CPU only for now; use --device cpu",
            args.device
        ),
    }
    if let Some(t) = args.threads {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if t > cores {
            eprintln!("kestrel: warning: -t {t} is more threads than the {cores} cores here");
        }
        // Fails only if the pool was already built, which the commands never do first.
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build_global();
    }
    build_engine(CpuBackend::new(Kernels::Fast), true, args, max_logit_rows)
}

/// Loads the model onto `backend`; `cache_on_host` when its KV cache is in host memory
/// (then the context is fitted to the memory available).
fn build_engine<B: Backend>(
    backend: B,
    cache_on_host: bool,
    args: &ModelArgs,
    max_logit_rows: usize,
) -> anyhow::Result<(Engine<B>, Arc<GgufFile>)> {
    let path = kestrel_hub::resolve_model(&args.model)?;
    let file =
        Arc::new(GgufFile::open(&path).with_context(|| format!("opening {}", path.display()))?);
    let ctx = match host_memory_for_cache(cache_on_host) {
        Some(available) => {
            let cfg = ModelConfig::from_gguf(&file)
                .with_context(|| format!("loading {}", path.display()))?;
            fit_context(&cfg, args.ctx, args.max_seqs.max(1), available)?
        }
        None => args.ctx,
    };
    let opts = EngineOptions {
        ctx,
        max_batch_tokens: args.batch.max(1),
        max_logit_rows,
        block_size: 16,
        max_seqs: args.max_seqs.max(1),
    };
    let start = std::time::Instant::now();
    read_with_progress(&file);
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

/// Reads every tensor's pages once under a progress bar (bytes), so that a model coming
/// from disk shows its progress; the load that follows finds the pages in memory. Does
/// nothing where no bar is drawn.
fn read_with_progress(file: &GgufFile) {
    if !kestrel_hub::stderr_is_terminal() {
        return;
    }
    let total: u64 = file.tensors().iter().map(|t| t.n_bytes()).sum();
    let bar = kestrel_hub::bytes_bar(Some(total));
    bar.set_message("loading");
    let mut checksum = 0u8;
    for t in file.tensors() {
        let data = file.tensor_data(t);
        // One byte per page brings the page in.
        for chunk in data.chunks(1 << 20) {
            checksum ^= chunk.iter().step_by(4096).fold(0, |a, &b| a ^ b);
            bar.inc(chunk.len() as u64);
        }
    }
    std::hint::black_box(checksum);
    bar.finish_and_clear();
}

/// Bytes of host memory the KV cache may use (`MemAvailable`), or `None` when the cache
/// does not live in host memory or the amount is unknown.
fn host_memory_for_cache(cache_on_host: bool) -> Option<u64> {
    if !cache_on_host {
        return None;
    }
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

/// Bytes of the f16 KV cache (keys and values of every layer) for `ctx` positions of
/// `seqs` sequences, or `None` on overflow.
fn kv_bytes(cfg: &ModelConfig, ctx: usize, seqs: usize) -> Option<u64> {
    [
        cfg.n_layer,
        cfg.kv_dim(),
        ctx,
        seqs,
        2, /* k and v */
        2, /* f16 */
    ]
    .iter()
    .try_fold(1u64, |acc, &x| acc.checked_mul(x as u64))
}

/// Shortest context `-c 0` may shrink to before it is an error instead.
const MIN_AUTO_CTX: usize = 256;

/// The context the engine gets: `requested`, or the model's with `0` (as llama.cpp's
/// `-c 0`), never more than the model's. `-c 0` is shrunk to what `available` bytes hold
/// (with a notice); an explicit size whose cache cannot fit is an error, as is `-c 0` when
/// not even [`MIN_AUTO_CTX`] positions fit.
pub fn fit_context(
    cfg: &ModelConfig,
    requested: usize,
    seqs: usize,
    available: u64,
) -> anyhow::Result<usize> {
    let ctx = match requested {
        0 => cfg.context_length,
        n => n.min(cfg.context_length),
    };
    let per_position = kv_bytes(cfg, 1, seqs).unwrap_or(u64::MAX).max(1);
    let fits = usize::try_from(available / per_position).unwrap_or(usize::MAX);
    if ctx <= fits {
        return Ok(ctx);
    }
    let need = kv_bytes(cfg, ctx, seqs).map_or("more than 16 EiB".into(), gib);
    let have = gib(available);
    if requested != 0 {
        bail!(
            "a context of {ctx} tokens needs a {need} KV cache but only {have} of memory is \
             available; pass a smaller -c (at most {fits})"
        );
    }
    let capped = fits / MIN_AUTO_CTX * MIN_AUTO_CTX;
    if capped < MIN_AUTO_CTX {
        bail!(
            "-c 0: even {MIN_AUTO_CTX} tokens of context do not fit the {have} of memory \
             available (the model's {ctx} would need {need})"
        );
    }
    eprintln!(
        "kestrel: -c 0: the model's context of {ctx} tokens needs a {need} KV cache, more \
         than the {have} available; using {capped}"
    );
    Ok(capped)
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kestrel_model::config::Arch;
    use kestrel_model::synth::{SynthConfig, WeightType, write_synth_to};

    fn tiny_config(n_ctx: u32) -> ModelConfig {
        let mut synth = SynthConfig::tiny(Arch::Llama);
        synth.n_ctx = n_ctx;
        let (bytes, _) = write_synth_to(Vec::new(), &synth, WeightType::F32, 1).expect("synth");
        ModelConfig::from_gguf(&GgufFile::from_bytes(bytes).expect("parse")).expect("config")
    }

    #[test]
    fn context_fits_memory_or_says_why() {
        let cfg = tiny_config(1 << 20);
        // 2 layers × 128 kv values × k and v × 2 bytes = 1 KiB per position.
        assert_eq!(kv_bytes(&cfg, 1, 1), Some(1024));
        let plenty = u64::MAX;
        assert_eq!(fit_context(&cfg, 0, 1, plenty).expect("fits"), 1 << 20);
        assert_eq!(fit_context(&cfg, 4096, 1, plenty).expect("fits"), 4096);
        // Asking beyond the model's context gives the model's.
        assert_eq!(
            fit_context(&cfg, 1 << 30, 1, plenty).expect("fits"),
            1 << 20
        );
        // -c 0 shrinks to what 1 MiB holds (1024 positions, a multiple of 256)...
        assert_eq!(
            fit_context(&cfg, 0, 1, (1 << 20) + 5).expect("capped"),
            1024
        );
        // ...an explicit size that does not fit is an error naming the most that does.
        let err = fit_context(&cfg, 4096, 1, 1 << 20).expect_err("too big");
        assert!(err.to_string().contains("at most 1024"), "{err}");
        // Two sequences need twice the memory.
        let err = fit_context(&cfg, 1024, 2, 1 << 20).expect_err("too big");
        assert!(err.to_string().contains("at most 512"), "{err}");
        let err = fit_context(&cfg, 0, 1, 1000).expect_err("nothing fits");
        assert!(err.to_string().contains("-c 0"), "{err}");
    }
}

#[cfg(test)]
mod device_tests {
    use super::Device;

    #[test]
    fn devices_and_tp_resolve_or_are_refused() {
        let r = |d: &str, tp| Device::resolve(d, tp).map_err(|e| e.to_string());
        assert_eq!(r("cpu", None), Ok(Device::Cpu));
        assert_eq!(r("cuda:3", None), Ok(Device::Cuda(3)));
        assert_eq!(r("cuda:0,cuda:1", None), Ok(Device::CudaTp(vec![0, 1])));
        assert_eq!(r("cuda:1, cuda:0", Some(2)), Ok(Device::CudaTp(vec![1, 0])));
        assert_eq!(r("cpu", Some(2)), Ok(Device::CudaTp(vec![0, 1])));
        assert_eq!(r("cuda", Some(4)), Ok(Device::CudaTp(vec![0, 1, 2, 3])));
        assert_eq!(r("cuda:1", Some(1)), Ok(Device::Cuda(1)));
        assert_eq!(r("cpu", Some(1)), Ok(Device::Cuda(0)));
        assert!(r("cuda:1", Some(2)).unwrap_err().contains("disagree"));
        assert!(
            r("cuda:0,cuda:1", Some(3))
                .unwrap_err()
                .contains("disagree")
        );
        assert!(
            r("cuda:0,cpu", None)
                .unwrap_err()
                .contains("expected cuda:N")
        );
        assert!(r("cuda:0,", None).is_err());
        assert!(r("gpu", None).is_err());
    }

    #[test]
    fn data_parallel_copies_take_equal_groups_of_gpus() {
        use super::SplitMode::{Layer, Tensor};
        let r = |d: &str, tp, split, n| {
            Device::resolve_replicas(d, tp, split, n).map_err(|e| e.to_string())
        };
        // One copy: exactly --device / --tp / --split.
        assert_eq!(r("cpu", None, None, 1), Ok(vec![Device::Cpu]));
        assert_eq!(
            r("cuda:0,cuda:1", None, None, 1),
            Ok(vec![Device::CudaTp(vec![0, 1])])
        );
        assert_eq!(
            r("cuda", None, None, 2),
            Ok(vec![Device::Cuda(0), Device::Cuda(1)])
        );
        assert_eq!(
            r("cuda:2,cuda:3", None, None, 2),
            Ok(vec![Device::Cuda(2), Device::Cuda(3)])
        );
        assert_eq!(
            r("cpu", Some(2), None, 2),
            Ok(vec![Device::CudaTp(vec![0, 1]), Device::CudaTp(vec![2, 3])])
        );
        assert_eq!(
            r("cuda:3,cuda:2,cuda:1,cuda:0", None, Some(Layer), 2),
            Ok(vec![
                Device::CudaLayers(vec![3, 2]),
                Device::CudaLayers(vec![1, 0])
            ])
        );
        assert_eq!(
            r("cuda:0,cuda:1,cuda:2,cuda:3", Some(2), Some(Tensor), 2),
            Ok(vec![Device::CudaTp(vec![0, 1]), Device::CudaTp(vec![2, 3])])
        );
        for (d, tp, split, n, says) in [
            ("cpu", None, None, 2, "each GPU"),
            ("cuda:1", None, None, 2, "list the GPUs"),
            ("cuda:0,cuda:1,cuda:2", None, None, 2, "equal groups"),
            ("cuda:0,cuda:1", Some(2), None, 2, "equal groups"),
            ("cuda:0,cuda:1", None, Some(Layer), 2, "two or more GPUs"),
            ("gpu", None, None, 2, "unknown device"),
        ] {
            let err = r(d, tp, split, n).expect_err(d);
            assert!(err.contains(says), "{d} --dp {n}: {err}");
        }
    }

    #[test]
    fn a_draft_model_runs_on_the_targets_first_gpu() {
        let on = |d: &str, tp, split| Device::resolve_split(d, tp, split).unwrap().draft_ordinal();
        assert_eq!(on("cuda:3", None, None), 3);
        assert_eq!(on("cuda:2,cuda:1", None, None), 2);
        assert_eq!(on("cuda:1,cuda:0", None, Some(super::SplitMode::Layer)), 1);
        assert_eq!(on("cuda", Some(2), None), 0);
        assert_eq!(on("cpu", None, None), 0);
    }

    #[test]
    fn split_layer_takes_a_list_of_gpus() {
        use super::SplitMode::{Layer, Tensor};
        let r = |d: &str, tp, split| Device::resolve_split(d, tp, split).map_err(|e| e.to_string());
        assert_eq!(
            r("cuda:0,cuda:1", None, Some(Layer)),
            Ok(Device::CudaLayers(vec![0, 1]))
        );
        assert_eq!(
            r("cuda:0,cuda:0", None, Some(Layer)),
            Ok(Device::CudaLayers(vec![0, 0]))
        );
        assert_eq!(
            r("cpu", Some(2), Some(Layer)),
            Ok(Device::CudaLayers(vec![0, 1]))
        );
        assert_eq!(
            r("cuda:0,cuda:1", None, Some(Tensor)),
            Ok(Device::CudaTp(vec![0, 1]))
        );
        assert_eq!(
            r("cuda:0,cuda:1", None, None),
            Ok(Device::CudaTp(vec![0, 1]))
        );
        assert_eq!(r("cuda:2", None, Some(Tensor)), Ok(Device::Cuda(2)));
        for one in ["cuda:0", "cpu"] {
            let e = r(one, None, Some(Layer)).unwrap_err();
            assert!(e.contains("--split layer needs two or more GPUs"), "{e}");
        }
        assert!(r("cuda:0,cuda:1", Some(3), Some(Layer)).is_err());
    }
}
