//! `kestrel quantize IN.gguf OUT.gguf TYPE`: rewrite a GGUF model in another quantization,
//! with llama-quantize's per-tensor choices for the mixtures (Q4_K_M, ...).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use kestrel_convert::FileType;
use kestrel_convert::quantize::{Plan, QuantizeOptions, write_quantized};
use kestrel_gguf::GgufFile;

use kestrel_convert::progress_bar;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Input GGUF model: a file, a catalog name or a URL (F32/F16/BF16, or already
    /// quantized: requantizing loses precision).
    pub input: String,
    /// Output GGUF file (written to a temporary file, renamed when complete).
    pub output: PathBuf,
    /// Type, as llama-quantize names it: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q2_K_S, Q3_K_S,
    /// Q3_K_M, Q3_K_L, Q4_K_S, Q4_K_M, Q5_K_S, Q5_K_M, Q6_K, F16, BF16, F32 (Q3_K, Q4_K and
    /// Q5_K mean their _M mixtures).
    #[arg(value_name = "TYPE")]
    pub ty: String,
    /// Importance matrix from llama-imatrix (GGUF or legacy .dat): per-column weights for
    /// the quantizers and llama-quantize's imatrix-dependent type choices.
    #[arg(long, value_name = "FILE")]
    pub imatrix: Option<PathBuf>,
    /// Worker threads (default: all cores).
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
}

pub fn run(args: Args) -> Result<()> {
    let ftype = FileType::parse(&args.ty)?;
    let input = kestrel_hub::resolve_model(&args.input)?;
    let file = GgufFile::open(&input)?;
    let imatrix = args
        .imatrix
        .as_deref()
        .map(kestrel_convert::Imatrix::load)
        .transpose()?;
    if let Some(m) = &imatrix {
        eprintln!(
            "importance matrix {}: {} entries, {} chunks{}",
            m.file,
            m.entries.len(),
            m.chunk_count,
            m.datasets
                .first()
                .map(|d| format!(", dataset {d}"))
                .unwrap_or_default()
        );
    }
    let opts = QuantizeOptions { ftype, imatrix };
    let plan = Plan::new(&file, &opts)?;
    if !plan.requantized.is_empty() {
        eprintln!(
            "warning: requantizing {} already-quantized tensors (e.g. {}); quality is lower than \
             quantizing from F16/BF16/F32",
            plan.requantized.len(),
            plan.requantized[0]
        );
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(args.threads.unwrap_or(0))
        .build()?;
    let start = Instant::now();
    let total: u64 = file.tensors().iter().map(|t| t.n_bytes()).sum();
    let bar = progress_bar(total, &format!("quantizing to {ftype}"));
    pool.install(|| write_quantized(&file, &plan, &opts, &args.output, &bar))?;
    bar.finish_and_clear();
    eprintln!(
        "wrote {} ({ftype}, {} tensors, {:.1} MiB -> {:.1} MiB) in {:.1} s",
        args.output.display(),
        file.tensors().len(),
        total as f64 / 1048576.0,
        plan.output_bytes(&file) as f64 / 1048576.0,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
