//! `kestrel serve`: an OpenAI-compatible HTTP server with continuous batching.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use kestrel_cpu::{CpuBackend, Kernels};
use kestrel_cuda::CudaBackend;
use kestrel_engine::scheduler::{self, SchedulerHandle, SchedulerOptions, SchedulerSpec};
use kestrel_engine::spec::SpecMode;
use kestrel_engine::{Engine, EngineOptions};
use kestrel_gguf::GgufFile;
use kestrel_model::{Backend, KvTypes};
use kestrel_tokenizer::{ChatTemplate, Tokenizer, TokenizerError};

use super::common::{CacheArgs, Device, positive};
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
    /// Threads for the CPU backend (default: all cores).
    #[arg(short = 't', long, value_parser = positive)]
    pub threads: Option<usize>,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Most sequences decoded at once; the KV cache holds this many full contexts.
    #[arg(long, default_value_t = 8)]
    pub max_seqs: usize,
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
    /// Speculative decoding for greedy requests: none or ngram (prompt lookup; a request
    /// opts out with "speculative": false).
    #[arg(long = "spec", default_value = "none")]
    pub spec: String,
    /// Most tokens drafted per sequence and step.
    #[arg(long = "draft-max", default_value_t = 8)]
    pub draft_max: usize,
    /// Fewest drafted tokens worth verifying.
    #[arg(long = "draft-min", default_value_t = 1)]
    pub draft_min: usize,
    /// Prompt lookup's shortest and longest matched suffix, in tokens.
    #[arg(long = "ngram-min", default_value_t = 1)]
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
    // A bad --spec is a startup error, reported before binding.
    spec_options(&args)?;
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
    let sched = match Device::resolve(&args.device, args.tp)? {
        Device::CudaTp(ordinals) => start_scheduler(
            move || kestrel_cuda::TpBackend::new(&ordinals).context("opening the GPUs"),
            &file,
            opts,
            args.cache.types(),
            sched_opts,
        )?,
        Device::Cpu => {
            if let Some(t) = args.threads {
                let _ = rayon::ThreadPoolBuilder::new()
                    .num_threads(t.max(1))
                    .build_global();
            }
            start_scheduler(
                || Ok(CpuBackend::new(Kernels::Fast)),
                &file,
                opts,
                args.cache.types(),
                sched_opts,
            )?
        }
        Device::Cuda(ordinal) => start_scheduler(
            move || CudaBackend::new(ordinal).context("opening the GPU"),
            &file,
            opts,
            args.cache.types(),
            sched_opts,
        )?,
    };
    let info = sched.info().clone();
    eprintln!(
        "loaded {} ({}) on {} in {:.2} s: ctx {} x {} sequences, {} KV blocks",
        path.display(),
        info.arch,
        info.backend,
        start.elapsed().as_secs_f64(),
        info.ctx,
        info.max_seqs,
        info.n_blocks
    );

    let name = args.name.clone().unwrap_or_else(|| args.model.clone());
    Ok(
        kestrel_server::AppState::new(sched, tokenizer, template, name, args.api_key.clone())
            .with_cors(args.cors.clone()),
    )
}

/// The scheduler's speculation from `--spec` and its sizes.
fn spec_options(args: &Args) -> anyhow::Result<Option<SchedulerSpec>> {
    Ok(match args.spec.parse::<SpecMode>()? {
        SpecMode::None => None,
        SpecMode::Ngram => Some(SchedulerSpec {
            ngram_min: args.ngram_min,
            ngram_max: args.ngram_max,
            draft_min: args.draft_min,
            draft_max: args.draft_max,
            max_seqs: args.spec_max_seqs,
        }),
        SpecMode::Draft => {
            anyhow::bail!("the server speculates by prompt lookup only: --spec ngram")
        }
    })
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
    kv: KvTypes,
    sched_opts: SchedulerOptions,
) -> anyhow::Result<SchedulerHandle> {
    let file = file.clone();
    scheduler::spawn(
        move || Engine::with_cache_types(backend()?, file, &opts, kv).context("loading the model"),
        sched_opts,
    )
}
