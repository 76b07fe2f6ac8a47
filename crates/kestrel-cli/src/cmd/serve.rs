//! `kestrel serve`: an OpenAI-compatible HTTP server with continuous batching.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use kestrel_cpu::{CpuBackend, Kernels};
use kestrel_cuda::CudaBackend;
use kestrel_engine::scheduler::{self, SchedulerHandle, SchedulerOptions, SchedulerSpec};
use kestrel_engine::spec::{MultiDraftModel, MultiDrafter, SpecMode};
use kestrel_engine::{Engine, EngineOptions, KvCacheSize};
use kestrel_gguf::GgufFile;
use kestrel_model::{Backend, KvTypes, ModelConfig};
use kestrel_tokenizer::{ChatTemplate, Tokenizer, TokenizerError};

use super::common::{CacheArgs, Device, SplitMode, positive, spec_mode};
use crate::interrupt;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model: a catalog name (pulled if missing), a GGUF path or a URL.
    #[arg(short = 'm', long, default_value = "qwen2.5-coder-1.5b")]
    pub model: String,
    /// Device to run on: `cpu`, `cuda` or `cuda:N`; `cuda:0,cuda:1` (or `--devices`)
    /// tensor-parallel over those GPUs.
    #[arg(long, visible_alias = "devices", default_value = "cpu")]
    pub device: String,
    /// Tensor parallelism over GPUs 0..N.
    #[arg(long, value_parser = positive)]
    pub tp: Option<usize>,
    /// How several GPUs share the model: `tensor` (default) or `layer`.
    #[arg(long, value_enum)]
    pub split: Option<SplitMode>,
    /// Copies of the model, each on its own GPU (or group of GPUs: the list cut into N
    /// equal groups, each under --tp / --split), each with its own KV cache and batch;
    /// requests go to the least loaded (vLLM's --data-parallel-size).
    #[arg(long = "data-parallel", visible_alias = "dp", default_value_t = 1, value_parser = positive)]
    pub data_parallel: usize,
    /// Threads for the CPU backend (default: all cores).
    #[arg(short = 't', long, value_parser = positive)]
    pub threads: Option<usize>,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Most sequences running at once. Without --kv-memory on the CPU, the KV cache holds
    /// this many full contexts.
    #[arg(long, default_value_t = 8)]
    pub max_seqs: usize,
    /// KV cache size, shared by all sequences (`512MiB`, `2G`, `1.5GiB`; K, M, G count in
    /// 1024s): admission waits for free blocks and preempts the newest sequence when they
    /// run out. Default: --max-seqs full contexts on the CPU, --gpu-memory-utilization on
    /// CUDA.
    #[arg(long = "kv-memory", value_parser = bytes, conflicts_with = "gpu_memory_utilization")]
    pub kv_memory: Option<u64>,
    /// CUDA: the fraction of the GPU's memory to use in all; the KV cache takes what the
    /// weights and step buffers leave of it (vLLM's option). Default 0.9.
    #[arg(long = "gpu-memory-utilization", value_parser = fraction)]
    pub gpu_memory_utilization: Option<f64>,
    /// Context size of each sequence (prompt + generation).
    #[arg(
        short = 'c',
        long = "ctx-size",
        visible_alias = "ctx",
        default_value_t = 4096
    )]
    pub ctx: usize,
    /// Most tokens in one forward step (decodes plus prompt chunks).
    #[arg(long, default_value_t = 512, value_parser = positive)]
    pub batch: usize,
    /// Most prompt tokens in one step (the rest of the step is left to decodes).
    #[arg(long, default_value_t = 256)]
    pub max_prefill: usize,
    /// Require `Authorization: Bearer KEY` on /v1 routes.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Chat template: a built-in name (chatml, gemma, llama3) or a Jinja file.
    #[arg(long)]
    pub chat_template: Option<String>,
    /// Model name the API reports and accepts (default: the -m value).
    #[arg(long)]
    pub name: Option<String>,
    /// Do not share the KV blocks of identical prompt prefixes.
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// Allow browsers from this origin (`*`: any) to call the API (CORS).
    #[arg(long)]
    pub cors: Option<String>,
    #[command(flatten)]
    pub cache: CacheArgs,
    /// Speculative decoding for greedy requests: none, ngram (prompt lookup) or draft (a
    /// draft model, --draft); a request opts out with "speculative": false.
    #[arg(long = "spec", default_value = "none")]
    pub spec: String,
    /// Draft model with the target's vocabulary (catalog name, path or URL; alias -md), on
    /// the target's device (the first GPU of a list), drafting for up to --spec-max-seqs
    /// requests at once; implies --spec draft.
    #[arg(long = "draft", alias = "model-draft")]
    pub draft: Option<String>,
    /// Most tokens drafted per sequence and step.
    #[arg(long = "draft-max", default_value_t = 8)]
    pub draft_max: usize,
    /// Fewest drafted tokens worth verifying.
    #[arg(long = "draft-min", default_value_t = 1)]
    pub draft_min: usize,
    /// Prompt lookup's shortest and longest matched suffix, in tokens.
    #[arg(long = "ngram-min", default_value_t = 2)]
    pub ngram_min: usize,
    #[arg(long = "ngram-max", default_value_t = 4)]
    pub ngram_max: usize,
    /// Speculate only while at most this many sequences run.
    #[arg(long = "spec-max-seqs", default_value_t = 4)]
    pub spec_max_seqs: usize,
}

/// Binds the port first (`/health` says `loading` meanwhile), then loads the model on
/// another thread and starts answering once it is ready.
pub fn run(args: Args) -> anyhow::Result<()> {
    let addr: SocketAddr = format!("{}:{}", args.host, args.port)
        .parse()
        .with_context(|| format!("bad address {}:{}", args.host, args.port))?;
    // A bad --spec, device list or cache size is a startup error, reported before binding.
    spec_options(&args)?;
    Device::resolve_replicas(&args.device, args.tp, args.split, args.data_parallel)?;
    cache_size(
        &args,
        matches!(Device::parse(&args.device)?, Device::Cuda(_)),
    )?;
    if let Some(origin) = &args.cors {
        // A bad origin is a startup error, not a silently missing header.
        let _ = kestrel_server::http::cors(origin).map_err(anyhow::Error::msg)?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind(addr))
        .with_context(|| format!("binding {addr}"))?;
    eprintln!(
        "listening on http://{} (loading the model; Ctrl-C stops)",
        listener.local_addr()?
    );
    let slot = kestrel_server::app_slot();
    let loaded = slot.clone();
    std::thread::Builder::new()
        .name("kestrel-load".into())
        .spawn(move || match load(&args) {
            Ok(state) => {
                let name = state.model_name.clone();
                let _ = loaded.set(kestrel_server::router(Arc::new(state)));
                eprintln!("serving '{name}' (OpenAI API under /v1)");
            }
            Err(e) => {
                eprintln!("error: {e:#}");
                std::process::exit(1);
            }
        })?;
    runtime.block_on(async move {
        // The first Ctrl-C (or SIGTERM) shuts down gracefully, a second one exits.
        interrupt::handle_in_command();
        let shutdown = async {
            while !interrupt::interrupted() {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        };
        kestrel_server::http::serve_slot(listener, slot, shutdown).await?;
        anyhow::Ok(())
    })
}

/// Loads the model, its tokenizer and chat template, and starts the scheduler.
fn load(args: &Args) -> anyhow::Result<kestrel_server::AppState> {
    let path = kestrel_hub::resolve_model(&args.model)?;
    let file =
        Arc::new(GgufFile::open(&path).with_context(|| format!("opening {}", path.display()))?);
    let tokenizer = match Tokenizer::from_gguf(&file) {
        Ok(t) => Some(t),
        Err(TokenizerError::NoTokenizer(_)) => {
            eprintln!("the model has no tokenizer: only token-id prompts on /v1/completions");
            None
        }
        Err(e) => return Err(e).context("loading the tokenizer"),
    };
    let template = if tokenizer.is_some() {
        chat_template(&file, args.chat_template.as_deref())
    } else {
        None
    };
    let spec = spec_options(args)?;
    let devices = Device::resolve_replicas(&args.device, args.tp, args.split, args.data_parallel)?;
    // Drafts take the logit rows beyond one per sequence.
    let draft_rows = spec
        .as_ref()
        .map_or(0, |s| s.draft_max * s.max_seqs.min(args.max_seqs));
    let opts = EngineOptions {
        ctx: args.ctx,
        max_batch_tokens: args.batch.max(1),
        max_logit_rows: args.max_seqs.max(1) + draft_rows,
        block_size: 16,
        max_seqs: args.max_seqs.max(1),
    };
    let sched_opts = SchedulerOptions {
        max_seqs: args.max_seqs.max(1),
        max_prefill_tokens: args.max_prefill.max(1),
        prefix_cache: !args.no_prefix_cache,
        eog: tokenizer
            .as_ref()
            .map(|t| t.eog_ids().to_vec())
            .unwrap_or_default(),
        spec,
    };
    let start = std::time::Instant::now();
    // Data parallelism: each copy loads on its own thread, at once.
    let handles = std::thread::scope(|scope| {
        let loads: Vec<_> = devices
            .iter()
            .map(|device| {
                let (file, opts, sched_opts) = (&file, opts.clone(), sched_opts.clone());
                scope.spawn(move || start_on(args, file, device, opts, sched_opts))
            })
            .collect();
        loads
            .into_iter()
            .zip(&devices)
            .map(|(load, device)| {
                load.join()
                    .map_err(|_| anyhow::anyhow!("loading the model on {device:?} panicked"))?
                    .with_context(|| format!("loading the model on {device:?}"))
            })
            .collect::<anyhow::Result<Vec<_>>>()
    })?;
    let sched = SchedulerHandle::data_parallel(handles)?;
    let info = sched.info().clone();
    let positions = info.n_blocks * info.block_size;
    eprintln!(
        "loaded {} ({}) on {} in {:.2} s: ctx {}, up to {} sequences; KV cache {} blocks = {} \
         positions ({:.1} MiB, {} bytes a position)",
        path.display(),
        info.arch,
        info.backend,
        start.elapsed().as_secs_f64(),
        info.ctx,
        info.max_seqs,
        info.n_blocks,
        positions,
        (positions * info.kv_bytes_per_token) as f64 / (1u64 << 20) as f64,
        info.kv_bytes_per_token,
    );
    if info.ctx < args.ctx {
        eprintln!(
            "note: the whole KV cache holds {positions} positions, less than --ctx-size {}: a \
             sequence stops there",
            args.ctx
        );
    }

    let name = args.name.clone().unwrap_or_else(|| args.model.clone());
    Ok(
        kestrel_server::AppState::new(sched, tokenizer, template, name, args.api_key.clone())
            .with_cors(args.cors.clone()),
    )
}

/// Starts a scheduler over a copy of the model on `device`, with its drafter.
fn start_on(
    args: &Args,
    file: &Arc<GgufFile>,
    device: &Device,
    opts: EngineOptions,
    sched_opts: SchedulerOptions,
) -> anyhow::Result<SchedulerHandle> {
    let drafter = match (&sched_opts.spec, &args.draft) {
        (Some(spec), Some(draft)) => draft_maker(args, file, draft, device, spec)?,
        _ => Box::new(|| Ok(None)),
    };
    let size = cache_size(args, !matches!(device, Device::Cpu))?;
    let cache = (args.cache.types(), size);
    match device.clone() {
        Device::CudaLayers(ordinals) => start_scheduler(
            move || kestrel_cuda::SplitBackend::new(&ordinals).context("opening the GPUs"),
            file,
            opts,
            cache,
            sched_opts,
            drafter,
        ),
        Device::CudaTp(ordinals) => start_scheduler(
            move || kestrel_cuda::TpBackend::new(&ordinals).context("opening the GPUs"),
            file,
            opts,
            cache,
            sched_opts,
            drafter,
        ),
        Device::Cpu => {
            if let Some(t) = args.threads {
                let _ = rayon::ThreadPoolBuilder::new()
                    .num_threads(t.max(1))
                    .build_global();
            }
            start_scheduler(
                || Ok(CpuBackend::new(Kernels::Fast)),
                file,
                opts,
                cache,
                sched_opts,
                drafter,
            )
        }
        Device::Cuda(ordinal) => start_scheduler(
            move || CudaBackend::new(ordinal).context("opening the GPU"),
            file,
            opts,
            cache,
            sched_opts,
            drafter,
        ),
    }
}

/// The KV cache's size from `--kv-memory` / `--gpu-memory-utilization` on `cuda` or not.
fn cache_size(args: &Args, cuda: bool) -> anyhow::Result<KvCacheSize> {
    if let (Some(bytes), false, Some(free)) = (args.kv_memory, cuda, kestrel_cpu::mem_available())
        && bytes > free
    {
        anyhow::bail!(
            "--kv-memory {:.0} MiB is more than the {:.0} MiB of memory available",
            bytes as f64 / (1u64 << 20) as f64,
            free as f64 / (1u64 << 20) as f64
        );
    }
    Ok(match (args.kv_memory, args.gpu_memory_utilization) {
        (Some(bytes), _) => KvCacheSize::Bytes(bytes),
        (None, Some(f)) if cuda => KvCacheSize::DeviceFraction(f),
        (None, Some(_)) => {
            anyhow::bail!("--gpu-memory-utilization applies to CUDA; on the CPU use --kv-memory")
        }
        (None, None) if cuda => KvCacheSize::DeviceFraction(DEFAULT_GPU_MEMORY_UTILIZATION),
        (None, None) => KvCacheSize::PerSequence,
    })
}

/// vLLM's default.
const DEFAULT_GPU_MEMORY_UTILIZATION: f64 = 0.9;

/// A size in bytes: a number with an optional unit (K, M, G, T or KiB.., KB..: 1024s).
fn bytes(s: &str) -> Result<u64, String> {
    let n = parse_size::Config::new()
        .with_binary()
        .parse_size(s.trim())
        .map_err(|e| format!("{e} (e.g. 512MiB, 2G)"))?;
    if n == 0 {
        return Err("must be more than 0 bytes".into());
    }
    Ok(n)
}

/// A fraction in (0, 1].
fn fraction(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
        Ok(f) => Err(format!("must be in (0, 1], not {f}")),
        Err(e) => Err(e.to_string()),
    }
}

/// The scheduler's speculation from `--spec` / `--draft` and its sizes.
fn spec_options(args: &Args) -> anyhow::Result<Option<SchedulerSpec>> {
    Ok(match spec_mode(&args.spec, args.draft.as_deref())? {
        SpecMode::None => None,
        SpecMode::Ngram | SpecMode::Draft => Some(SchedulerSpec {
            ngram_min: args.ngram_min,
            ngram_max: args.ngram_max,
            draft_min: args.draft_min,
            draft_max: args.draft_max,
            max_seqs: args.spec_max_seqs,
        }),
    })
}

/// What makes the scheduler's drafter, on its thread.
type DraftMaker = Box<dyn FnOnce() -> anyhow::Result<Option<Box<dyn MultiDrafter>>> + Send>;

/// Opens the draft model `draft` and returns what loads it on the target's device (the
/// first GPU of a list) with a draft sequence for each of `spec.max_seqs` requests, its
/// vocabulary checked against `target`'s. A target with linear-attention layers does not
/// speculate (the scheduler says so): no draft is loaded for it.
fn draft_maker(
    args: &Args,
    target: &Arc<GgufFile>,
    draft: &str,
    device: &Device,
    spec: &SchedulerSpec,
) -> anyhow::Result<DraftMaker> {
    let recurrent = ModelConfig::from_gguf(target).is_ok_and(|c| c.has_recurrent_layers());
    if recurrent {
        return Ok(Box::new(|| Ok(None)));
    }
    let path = kestrel_hub::resolve_model(draft)?;
    let file = Arc::new(
        GgufFile::open(&path).with_context(|| format!("opening the draft {}", path.display()))?,
    );
    let slots = spec.max_seqs.clamp(1, args.max_seqs.max(1));
    let opts = EngineOptions {
        ctx: args.ctx,
        max_batch_tokens: args.batch.max(1),
        max_logit_rows: 1,
        block_size: 16,
        max_seqs: slots,
    };
    let kv = args.cache.types();
    let target = target.clone();
    Ok(match device {
        Device::Cpu => Box::new(move || {
            let backend = CpuBackend::new(Kernels::Fast);
            load_draft(backend, &target, file, &path, &opts, kv)
        }),
        Device::Cuda(_) | Device::CudaTp(_) | Device::CudaLayers(_) => {
            let ordinal = device.draft_ordinal();
            Box::new(move || {
                let backend = CudaBackend::new(ordinal)
                    .with_context(|| format!("opening device cuda:{ordinal} for the draft"))?;
                load_draft(backend, &target, file, &path, &opts, kv)
            })
        }
    })
}

/// Loads the draft model on `backend`: one engine whose cache holds `opts.max_seqs`
/// contexts, a draft sequence each.
fn load_draft<B: Backend + 'static>(
    backend: B,
    target: &GgufFile,
    file: Arc<GgufFile>,
    path: &std::path::Path,
    opts: &EngineOptions,
    kv: KvTypes,
) -> anyhow::Result<Option<Box<dyn MultiDrafter>>> {
    let engine = Engine::with_cache_size(backend, file.clone(), opts, kv, KvCacheSize::PerSequence)
        .with_context(|| format!("loading the draft {}", path.display()))?;
    let name = engine.backend.name();
    let drafter = MultiDraftModel::new(engine, target, &file, opts.max_seqs)
        .with_context(|| format!("the draft {}", path.display()))?;
    eprintln!(
        "draft model {} on {name}: up to {} requests drafting at once",
        path.display(),
        opts.max_seqs
    );
    Ok(Some(Box::new(drafter)))
}

/// The chosen template, else the file's, else the built-in one of the model's family.
fn chat_template(file: &GgufFile, choice: Option<&str>) -> Option<ChatTemplate> {
    let fallback = match file.architecture() {
        Some("gemma3") => "gemma",
        Some("llama") => "llama3",
        _ => "chatml",
    };
    match ChatTemplate::resolve(file, choice) {
        Ok(t) => Some(t),
        Err(e) if choice.is_none() => {
            eprintln!("{e}; using the built-in '{fallback}' template");
            ChatTemplate::resolve(file, Some(fallback)).ok()
        }
        Err(e) => {
            eprintln!("chat template: {e}; /v1/chat/completions is disabled");
            None
        }
    }
}

/// Builds the engine on the scheduler's thread (backends need not cross threads).
fn start_scheduler<B: Backend + 'static>(
    backend: impl FnOnce() -> anyhow::Result<B> + Send + 'static,
    file: &Arc<GgufFile>,
    opts: EngineOptions,
    (kv, size): (KvTypes, KvCacheSize),
    sched_opts: SchedulerOptions,
    drafter: DraftMaker,
) -> anyhow::Result<SchedulerHandle> {
    let file = file.clone();
    scheduler::spawn_with(
        move || {
            Engine::with_cache_size(backend()?, file, &opts, kv, size).context("loading the model")
        },
        drafter,
        sched_opts,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        serve: Args,
    }

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Cli::try_parse_from(std::iter::once("serve").chain(args.iter().copied())).map(|c| c.serve)
    }

    #[test]
    fn sizes_count_in_1024s() {
        let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(3);
        for _ in 0..500 {
            let n: u64 = rand::Rng::random_range(&mut rng, 1..100_000);
            let (pow, units) = [
                (0, &["", "B"][..]),
                (1, &["K", "KiB", "KB", "k"][..]),
                (2, &["M", "MiB", "MB", "m"][..]),
                (3, &["G", "GiB", "GB", "g"][..]),
            ][rand::Rng::random_range(&mut rng, 0..4)];
            let unit = units[rand::Rng::random_range(&mut rng, 0..units.len())];
            assert_eq!(
                bytes(&format!("{n}{unit}")),
                Ok(n << (10 * pow)),
                "{n}{unit}"
            );
        }
        assert_eq!(bytes("1.5GiB"), Ok(3 << 29));
        for bad in ["", "0", "0MiB", "-1G", "lots", "2 parsecs"] {
            assert!(bytes(bad).is_err(), "{bad:?}");
        }
        for bad in ["0", "-0.5", "1.01", "nan", "inf", "x"] {
            assert!(fraction(bad).is_err(), "{bad:?}");
        }
        assert_eq!(fraction("0.9"), Ok(0.9));
        assert_eq!(fraction("1"), Ok(1.0));
    }

    #[test]
    fn the_cache_size_follows_the_options_and_the_device() {
        let size = |args: &[&str], cuda| cache_size(&parse(args).unwrap(), cuda);
        assert_eq!(size(&[], false).unwrap(), KvCacheSize::PerSequence);
        assert_eq!(
            size(&[], true).unwrap(),
            KvCacheSize::DeviceFraction(DEFAULT_GPU_MEMORY_UTILIZATION)
        );
        for cuda in [false, true] {
            assert_eq!(
                size(&["--kv-memory", "512MiB"], cuda).unwrap(),
                KvCacheSize::Bytes(512 << 20)
            );
        }
        assert_eq!(
            size(&["--gpu-memory-utilization", "0.5"], true).unwrap(),
            KvCacheSize::DeviceFraction(0.5)
        );
        let cpu = size(&["--gpu-memory-utilization", "0.5"], false).unwrap_err();
        assert!(cpu.to_string().contains("--kv-memory"), "{cpu}");
        assert!(parse(&["--kv-memory", "1G", "--gpu-memory-utilization", "0.5"]).is_err());
        // More than the machine has: refused on the CPU, not left to fail an allocation.
        let huge = size(&["--kv-memory", "1000000T"], false).unwrap_err();
        assert!(huge.to_string().contains("available"), "{huge}");
        assert!(parse(&["--kv-memory", "0"]).is_err());
        assert!(parse(&["--gpu-memory-utilization", "1.5"]).is_err());
    }

    #[test]
    fn draft_implies_spec_draft_and_conflicts_with_ngram() {
        let spec = |args: &[&str]| spec_options(&parse(args).unwrap()).map_err(|e| e.to_string());
        for args in [
            &["--draft", "d.gguf"][..],
            &["--spec", "draft", "--draft", "d.gguf"],
        ] {
            let s = spec(args).unwrap().expect("speculation on");
            assert_eq!((s.draft_max, s.max_seqs), (8, 4));
        }
        let s = spec(&[
            "--draft",
            "d.gguf",
            "--draft-max",
            "5",
            "--spec-max-seqs",
            "3",
        ])
        .unwrap()
        .expect("on");
        assert_eq!((s.draft_max, s.max_seqs), (5, 3));
        assert!(spec(&["--spec", "ngram"]).unwrap().is_some());
        assert!(spec(&[]).unwrap().is_none());
        let e = spec(&["--spec", "draft"]).unwrap_err();
        assert!(e.contains("needs a draft model"), "{e}");
        let e = spec(&["--spec", "ngram", "--draft", "d.gguf"]).unwrap_err();
        assert!(e.contains("goes with --spec draft"), "{e}");
    }

    /// `load` with a draft model: one of the target's vocabulary serves (the scheduler
    /// drafts with it), one of another vocabulary is a load error saying so.
    #[test]
    fn a_draft_of_another_vocabulary_is_a_load_error() {
        use kestrel_model::Arch;
        use kestrel_model::synth::{SynthConfig, SynthOverrides, WeightType, write_synth};
        let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(rand::random());
        let dir = tempfile::tempdir().expect("temp dir");
        let write = |name: &str, vocab: u32, seed: u64| {
            let mut cfg = SynthConfig::tiny(Arch::Qwen2);
            cfg.apply(&SynthOverrides {
                n_vocab: Some(vocab),
                ..SynthOverrides::default()
            })
            .expect("shape");
            let path = dir.path().join(name);
            write_synth(&path, &cfg, WeightType::F32, seed).expect("synth");
            path.to_string_lossy().into_owned()
        };
        let vocab = rand::Rng::random_range(&mut rng, 64..600);
        let target = write("target.gguf", vocab, rand::Rng::random(&mut rng));
        let same = write("same.gguf", vocab, rand::Rng::random(&mut rng));
        let other_vocab = vocab + rand::Rng::random_range(&mut rng, 1..50);
        let other = write("other.gguf", other_vocab, rand::Rng::random(&mut rng));
        let args = |draft: &str| {
            parse(&[
                "-m",
                &target,
                "--draft",
                draft,
                "-c",
                "128",
                "--max-seqs",
                "2",
                "-t",
                "1",
            ])
            .unwrap()
        };
        let state = load(&args(&same)).expect("a draft of the same vocabulary loads");
        drop(state);
        let err = format!("{:#}", load(&args(&other)).err().expect("refused"));
        assert!(err.contains("vocabulary"), "{err}");
        assert!(err.contains(&other_vocab.to_string()), "{err}");
        let missing = dir.path().join("missing.gguf");
        assert!(load(&args(&missing.to_string_lossy())).is_err());
    }
}
