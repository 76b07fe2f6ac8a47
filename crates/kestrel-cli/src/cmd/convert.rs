//! `kestrel convert DIR -o OUT.gguf [--type T]`: turn a Hugging Face checkpoint (Llama,
//! Qwen2, Qwen3, Gemma 3; safetensors, config.json, tokenizer.json) into a GGUF file, as
//! llama.cpp's convert_hf_to_gguf.py does; `--type` may also name a quantization.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use kestrel_convert::{Conversion, FileType, progress_bar};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint folder (config.json, *.safetensors, tokenizer.json, tokenizer_config.json).
    pub dir: PathBuf,
    /// Output GGUF file (written to a temporary file, renamed when complete).
    #[arg(short = 'o', long)]
    pub output: PathBuf,
    /// Weight type: f32, f16, bf16, q8_0 (the converter's own), or any `kestrel quantize`
    /// type (q4_k_m, ...), quantized straight from the checkpoint's values.
    #[arg(long = "type", default_value = "f16")]
    pub ty: String,
    /// Worker threads (default: all cores).
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
}

pub fn run(args: Args) -> Result<()> {
    let ftype = FileType::parse(&args.ty)?;
    let start = Instant::now();
    let conversion = Conversion::new(&args.dir, ftype)?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(args.threads.unwrap_or(0))
        .build()?;
    let bar = progress_bar(conversion.input_bytes(), &format!("converting to {ftype}"));
    pool.install(|| conversion.write(&args.output, &bar))?;
    bar.finish_and_clear();
    eprintln!(
        "wrote {} ({}, {ftype}, {} tensors) in {:.1} s",
        args.output.display(),
        conversion.arch,
        conversion.n_tensors(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
