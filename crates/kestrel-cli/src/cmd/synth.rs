//! `kestrel synth`: write a random-weight GGUF model of a supported architecture, for tests
//! and benchmarks. llama.cpp loads the same file (tokenizer "none" with `<arch>.vocab_size`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use kestrel_model::config::Arch;
use kestrel_model::synth::{self, SynthConfig, SynthOverrides, WeightType};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Architecture: llama, qwen2, qwen3, gemma3, qwen3moe, gpt-oss, phi3 or mistral3. Needed
    /// for `tiny`; the other presets imply theirs.
    #[arg(long)]
    pub arch: Option<String>,
    /// Model shape: tiny, llama3-8b, llama3-70b, qwen2.5-1.5b, qwen2.5-7b, qwen3-30b-a3b or
    /// gpt-oss-20b (models over 16B parameters draw each tensor's blocks from a pool of 4,096
    /// quantized random blocks: valid blocks, about disk speed).
    #[arg(long, default_value = "tiny")]
    pub preset: String,
    /// Weight type: f32, f16, bf16, q4_0, q4_1, q5_0, q8_0, q4_k, q4_k_m, q5_k, q6_k,
    /// iq4_nl, iq4_xs or mxfp4.
    #[arg(long = "type", required_unless_present = "from")]
    pub ty: Option<String>,
    /// Instead of random weights: copy this model (name, path or URL) keeping its first
    /// --layers blocks, a same-vocabulary draft model for `--spec draft`.
    #[arg(long, requires = "layers")]
    pub from: Option<String>,
    /// Output file.
    #[arg(short = 'o', long)]
    pub output: PathBuf,
    /// Seed of the random weights: the same seed gives the same file.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Number of transformer blocks.
    #[arg(long)]
    pub layers: Option<u32>,
    /// Embedding width.
    #[arg(long)]
    pub embd: Option<u32>,
    /// Feed-forward width.
    #[arg(long)]
    pub ff: Option<u32>,
    /// Attention (query) heads.
    #[arg(long)]
    pub heads: Option<u32>,
    /// Key/value heads.
    #[arg(long)]
    pub kv_heads: Option<u32>,
    /// Head size (default: the preset's, or embd / heads when either is overridden).
    #[arg(long)]
    pub head_dim: Option<u32>,
    /// Vocabulary size.
    #[arg(long)]
    pub vocab: Option<u32>,
    /// Training context length written to the metadata.
    #[arg(long)]
    pub ctx: Option<u32>,
}

pub fn run(args: Args) -> Result<()> {
    if let Some(from) = &args.from {
        let path = kestrel_hub::resolve_model(from)?;
        let file = kestrel_gguf::GgufFile::open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        let layers = args.layers.context("--from needs --layers")?;
        kestrel_engine::spec::write_truncated(&file, layers.into(), &args.output)
            .with_context(|| format!("writing {}", args.output.display()))?;
        println!("{}", args.output.display());
        return Ok(());
    }
    let arch = args
        .arch
        .as_deref()
        .map(Arch::from_name)
        .transpose()
        .context("--arch")?;
    let ty = WeightType::from_name(args.ty.as_deref().unwrap_or_default()).context("--type")?;
    let mut cfg = SynthConfig::preset(&args.preset, arch)?;
    cfg.apply(&SynthOverrides {
        n_layer: args.layers,
        n_embd: args.embd,
        n_ff: args.ff,
        n_head: args.heads,
        n_head_kv: args.kv_heads,
        head_dim: args.head_dim,
        n_vocab: args.vocab,
        n_ctx: args.ctx,
    })?;
    if args.output.is_dir() {
        bail!("{} is a directory; give a file name", args.output.display());
    }

    let start = Instant::now();
    let bar = kestrel_hub::bytes_bar(None);
    bar.set_message("synth");
    let summary =
        synth::write_synth_with_progress(&args.output, &cfg, ty, args.seed, &|done, total| {
            bar.set_length(total);
            bar.set_position(done);
        })
        .with_context(|| format!("writing {}", args.output.display()));
    bar.finish_and_clear();
    let summary = summary?;
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "{} {} ({} layers, embd {}, ff {}, heads {}/{}, head dim {}, vocab {}), {}: \
         {} tensors, {:.3}B parameters, {:.1} MiB in {:.1} s",
        cfg.arch.name(),
        args.preset,
        cfg.n_layer,
        cfg.n_embd,
        cfg.n_ff,
        cfg.n_head,
        cfg.n_head_kv,
        cfg.head_dim,
        cfg.n_vocab,
        ty,
        summary.n_tensors,
        summary.n_params as f64 / 1e9,
        summary.file_size as f64 / (1024.0 * 1024.0),
        secs
    );
    // The last line of stdout is the path, for scripts.
    println!("{}", args.output.display());
    Ok(())
}
