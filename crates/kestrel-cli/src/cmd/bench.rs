//! `kestrel bench`: prompt-processing and generation throughput, in the spirit of
//! llama-bench. Token ids are random, so no tokenizer is needed (synthetic models work).

use std::time::Instant;

use anyhow::bail;
use kestrel_engine::sampler::{Sampler, SamplerParams};
use kestrel_engine::{Engine, Sequence};
use kestrel_gguf::GgufFile;
use kestrel_model::{Backend, KvTypes};
use serde::Serialize;

use super::common::{AnyEngine, ModelArgs, SpecArgs, load_any_engine, with_engine};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt lengths to test (ppN: N tokens in one batch from an empty cache); 0 = none.
    #[arg(
        short = 'p',
        long = "n-prompt",
        value_delimiter = ',',
        default_value = "512"
    )]
    pub n_prompt: Vec<usize>,
    /// Generation lengths to test (tgN: N single-token steps from an empty cache); 0 = none.
    #[arg(
        short = 'n',
        long = "n-gen",
        value_delimiter = ',',
        default_value = "128"
    )]
    pub n_gen: Vec<usize>,
    /// Depths to test at, as llama-bench's -d: each test runs after this many (random)
    /// tokens are already in the cache, evaluated once per depth untimed; the cache is
    /// truncated back to them after every repetition.
    #[arg(
        short = 'd',
        long = "n-depth",
        value_delimiter = ',',
        default_value = "0"
    )]
    pub n_depth: Vec<usize>,
    /// Timed repetitions of each test (after one untimed warm-up).
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub repetitions: usize,
    /// Batched mode, as llama-batched-bench: for each B, B sequences each get a prompt of
    /// the first -p length (prefilled together, several sequences per step) and then the
    /// first -n length of decode steps of B tokens (one per sequence). Reports prefill,
    /// aggregate decode and total tok/s.
    #[arg(long = "seqs", value_delimiter = ',')]
    pub seqs: Vec<usize>,
    /// Tokens per step in batched mode (prefill chunks mixing sequences).
    #[arg(long = "ubatch", default_value_t = 2048)]
    pub ubatch: usize,
    /// CUDA: time every kernel launch and print, at exit, a per-kernel table (µs per step,
    /// share, achieved GB/s of each GEMV's weights against the ~3.0 TB/s copy ceiling).
    /// Graphs are off while profiling, and each launch carries a few µs of event overhead.
    #[arg(long)]
    pub profile: bool,
    /// Decode steps reduce each new logit row to its argmax on the device and read back only
    /// the token ids (the server's path for greedy requests); single-sequence tests then
    /// decode greedily from their own ids, each id kept on the device as the next step's
    /// input while the host records that step (`run`'s greedy path). By default each step's
    /// logit rows are copied to the host, as llama-bench and llama-batched-bench do.
    #[arg(long)]
    pub argmax: bool,
    /// Print a JSON array (llama-bench field names plus extras) instead of a table.
    #[arg(long)]
    pub json: bool,
    /// A workload of real prompts (JSON lines {"name", "prompt"}, chat template applied):
    /// each is generated greedily for the first -n tokens (-r times), with --spec's
    /// speculation; reports tokens/s, acceptance and mean accepted length.
    #[arg(long)]
    pub prompts: Option<std::path::PathBuf>,
    /// Speculative verification steps: for each T, -n steps of T random tokens computed
    /// batch-invariantly (each token as a single-token step computes it; the greedy id of
    /// each read back) after the first -d depth, each followed by dropping all but its first
    /// token (T = 1: plain single-token steps); reports milliseconds a step and, where 1 is
    /// in the list, the cost in single-token steps.
    #[arg(long = "verify", value_delimiter = ',')]
    pub verify: Vec<usize>,
    #[command(flatten)]
    pub spec: SpecArgs,
}

/// One test's result; the first fields are named as llama-bench names them.
#[derive(Serialize, Debug)]
struct TestResult {
    model_filename: String,
    model_type: String,
    model_size: u64,
    model_n_params: u64,
    backends: String,
    n_threads: usize,
    n_prompt: usize,
    n_gen: usize,
    n_depth: usize,
    type_k: String,
    type_v: String,
    avg_ts: f64,
    stddev_ts: f64,
    /// Nanoseconds of each timed repetition.
    samples_ns: Vec<u64>,
    samples_ts: Vec<f64>,
    /// Weight bytes one decode step reads (every matrix once, one embedding row).
    weight_bytes_per_token: u64,
    /// `weight_bytes_per_token × avg_ts` for generation tests (what decode streams).
    achieved_gb_s: Option<f64>,
    kernels: String,
}

/// Sizes read from the file: bytes and parameters of all tensors, and what one decode
/// token reads.
struct ModelSizes {
    size: u64,
    n_params: u64,
    decode_bytes: u64,
}

fn model_sizes(file: &GgufFile) -> ModelSizes {
    let tensors = file.tensors();
    let tied = file.tensor("output.weight").is_none();
    let mut s = ModelSizes {
        size: 0,
        n_params: 0,
        decode_bytes: 0,
    };
    for t in tensors {
        let bytes = t.n_bytes();
        s.size += bytes;
        s.n_params += t.n_elements();
        if t.dims.len() < 2 {
            continue;
        }
        if t.name == "token_embd.weight" {
            // One row per token for the embedding; the whole table again when it is
            // also the LM head.
            let rows = t.n_rows().max(1);
            s.decode_bytes += bytes / rows;
            if tied {
                s.decode_bytes += bytes;
            }
        } else {
            s.decode_bytes += bytes;
        }
    }
    s
}

/// A small deterministic generator for token ids (xorshift64*).
struct Ids(u64);

impl Ids {
    fn next(&mut self, vocab: usize) -> u32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let v = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        ((v >> 32) % vocab.max(1) as u64) as u32
    }
}

/// Fills a new sequence with `depth` random tokens (untimed context for the tests).
fn fill<B: Backend>(
    engine: &mut Engine<B>,
    ids: &mut Ids,
    depth: usize,
) -> anyhow::Result<Sequence> {
    let vocab = engine.config().vocab_size;
    let mut seq = Sequence::default();
    let context: Vec<u32> = (0..depth).map(|_| ids.next(vocab)).collect();
    if !context.is_empty() {
        engine.eval(&mut seq, &context, false, |_, _| {})?;
    }
    Ok(seq)
}

/// Runs one repetition of a test after the tokens already in `seq`, then truncates it
/// back to them; returns the seconds the test took.
fn run_once<B: Backend>(
    engine: &mut Engine<B>,
    seq: &mut Sequence,
    ids: &mut Ids,
    n_prompt: usize,
    n_gen: usize,
    argmax: bool,
) -> anyhow::Result<f64> {
    let vocab = engine.config().vocab_size;
    let depth = seq.tokens.len();
    let prompt: Vec<u32> = (0..n_prompt).map(|_| ids.next(vocab)).collect();
    let gen_ids: Vec<u32> = (0..n_gen).map(|_| ids.next(vocab)).collect();
    let start = Instant::now();
    if !prompt.is_empty() {
        engine.eval(seq, &prompt, false, |_, _| {})?;
    }
    let mut next = Vec::new();
    if argmax && engine.can_chain() && n_gen > 0 {
        // Greedy generation as `run` does it: each step's id feeds the next on the device
        // while the host records that next step.
        let mut greedy = Sampler::new(SamplerParams::greedy());
        engine.decode_chained(seq, gen_ids[0], n_gen, &mut greedy, |_| true)?;
    } else {
        for &id in &gen_ids {
            if argmax {
                engine.decode_argmax(std::slice::from_mut(seq), &[id], &mut next)?;
            } else {
                engine.eval(seq, &[id], false, |_, _| {})?;
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    engine.truncate(seq, depth);
    Ok(secs)
}

fn mean_stddev(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    if v.len() < 2 {
        return (mean, 0.0);
    }
    let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt())
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if args.repetitions == 0 {
        bail!("--repetitions must be at least 1");
    }
    if args.profile {
        if args.model.device == "cpu" {
            bail!("--profile times CUDA kernels: use it with --device cuda");
        }
        kestrel_cuda::request_profile();
    }
    if let Some(prompts) = &args.prompts {
        return super::bench_prompts::run(&args, prompts);
    }
    if args.spec.mode()? != kestrel_engine::spec::SpecMode::None {
        bail!("--spec measures generation on real prompts: give --prompts FILE");
    }
    if !args.seqs.is_empty() {
        return run_batched(args);
    }
    if !args.verify.is_empty() {
        return run_verify(args);
    }
    let tests: Vec<(usize, usize)> = args
        .n_prompt
        .iter()
        .filter(|&&p| p > 0)
        .map(|&p| (p, 0))
        .chain(args.n_gen.iter().filter(|&&g| g > 0).map(|&g| (0, g)))
        .collect();
    if tests.is_empty() {
        bail!("nothing to run: give -p and/or -n a positive length");
    }
    let longest = tests.iter().map(|&(p, g)| p + g).max().unwrap_or(1);
    let deepest = args.n_depth.iter().copied().max().unwrap_or(0);
    let mut model_args = args.model.clone();
    model_args.ctx = model_args.ctx.max(deepest + longest);
    // A prompt test evaluates its whole prompt as one batch.
    model_args.batch = model_args
        .batch
        .max(args.n_prompt.iter().copied().max().unwrap_or(1));
    let (mut engine, file) = load_any_engine(&model_args, 1)?;
    let sizes = model_sizes(&file);
    let threads = rayon::current_num_threads();
    // e.g. "cpu (avx512, 2 threads)" or "cuda (NVIDIA H100 80GB HBM3, sm_90)".
    let backend = with_engine!(&engine, e => e.backend.name());
    let backends = match engine {
        AnyEngine::Cpu(_) => "CPU",
        AnyEngine::Cuda(_) => "CUDA",
        AnyEngine::Tp(_) => "CUDA TP",
        AnyEngine::Split(_) => "CUDA layer split",
    };
    let arch = with_engine!(&engine, e => e.config().arch.name());
    let filename = kestrel_hub::resolve_model(&args.model.model)?
        .display()
        .to_string();
    let model_type = format!(
        "{} {}",
        arch,
        file.get_str("general.size_label").unwrap_or("")
    )
    .trim()
    .to_string();

    let mut ids = Ids(0x9e37_79b9_7f4a_7c15);
    let mut results = Vec::new();
    if !args.json {
        println!(
            "| model | size | params | backend | threads | test | t/s | weights/token | GB/s |"
        );
        println!("|---|---:|---:|---|---:|---|---:|---:|---:|");
    }
    let cache = args.model.cache.types();
    for (depth, n_prompt, n_gen) in args
        .n_depth
        .iter()
        .flat_map(|&d| tests.iter().map(move |&(p, g)| (d, p, g)))
    {
        let mut seq = with_engine!(&mut engine, e => fill(e, &mut ids, depth))?;
        let mut secs = Vec::with_capacity(args.repetitions);
        // One untimed warm-up, then the timed repetitions.
        for rep in 0..=args.repetitions {
            let s = with_engine!(&mut engine, e => run_once(e, &mut seq, &mut ids, n_prompt, n_gen, args.argmax))?;
            if rep > 0 {
                secs.push(s);
            }
        }
        engine.release(&mut seq);
        let tokens = (n_prompt + n_gen) as f64;
        let ts: Vec<f64> = secs.iter().map(|s| tokens / s).collect();
        let (avg, sd) = mean_stddev(&ts);
        let gbs = (n_gen > 0).then(|| sizes.decode_bytes as f64 * avg / 1e9);
        let r = TestResult {
            model_filename: filename.clone(),
            model_type: model_type.clone(),
            model_size: sizes.size,
            model_n_params: sizes.n_params,
            backends: backends.into(),
            n_threads: threads,
            n_prompt,
            n_gen,
            n_depth: depth,
            type_k: cache.k.name().into(),
            type_v: cache.v.name().into(),
            avg_ts: avg,
            stddev_ts: sd,
            samples_ns: secs.iter().map(|s| (s * 1e9) as u64).collect(),
            samples_ts: ts,
            weight_bytes_per_token: sizes.decode_bytes,
            achieved_gb_s: gbs,
            kernels: backend.clone(),
        };
        if !args.json {
            let mut test = if n_prompt > 0 {
                format!("pp{n_prompt}")
            } else {
                format!("tg{n_gen}")
            };
            if depth > 0 {
                test += &format!(" @ d{depth}");
            }
            if cache != KvTypes::default() {
                test += &format!(" ({}/{} cache)", cache.k, cache.v);
            }
            println!(
                "| {} | {:.2} MiB | {:.2} M | {} | {} | {} | {:.2} ± {:.2} | {:.1} MiB | {} |",
                r.model_type,
                r.model_size as f64 / (1024.0 * 1024.0),
                r.model_n_params as f64 / 1e6,
                backend,
                threads,
                test,
                avg,
                sd,
                sizes.decode_bytes as f64 / (1024.0 * 1024.0),
                gbs.map_or("-".to_string(), |g| format!("{g:.2}")),
            );
        }
        results.push(r);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    }
    Ok(())
}

/// `--verify T1,T2,...`: the cost of batch-invariant steps of T tokens in single-token steps.
fn run_verify(args: Args) -> anyhow::Result<()> {
    let n_gen = args.n_gen.first().copied().unwrap_or(0);
    if n_gen == 0 {
        bail!("--verify needs a positive -n (steps per test)");
    }
    let depth = args.n_depth.first().copied().unwrap_or(0);
    let most = args.verify.iter().copied().max().unwrap_or(1);
    if args.verify.contains(&0) {
        bail!("--verify: every step must hold at least 1 token");
    }
    let mut model_args = args.model.clone();
    model_args.ctx = model_args.ctx.max(depth + n_gen + most + 1);
    model_args.batch = model_args.batch.max(most);
    // A verification step reads back a row (its greedy id) for every token.
    let (mut engine, _file) = load_any_engine(&model_args, most)?;
    let limit = with_engine!(&engine, e => e.invariant_max_tokens());
    if most > limit {
        bail!("--verify: this backend verifies at most {limit} tokens a step (asked {most})");
    }
    let backend = with_engine!(&engine, e => e.backend.name());
    let mut ids = Ids(0x853c_49e6_748f_ea9b);
    println!(
        "{backend}, depth {depth}, {n_gen} steps a test, best of {} runs",
        args.repetitions
    );
    println!("| tokens a step | ms a step | single-token steps | tokens/s verified |");
    println!("|---:|---:|---:|---:|");
    let single = args.verify.contains(&1);
    let mut single_ms = None;
    for &t in &args.verify {
        let mut best = f64::INFINITY;
        // One untimed warm-up, then the timed repetitions (the fastest counts).
        for rep in 0..=args.repetitions {
            let s = with_engine!(&mut engine, e => verify_once(e, &mut ids, depth, t, n_gen))?;
            if rep > 0 {
                best = best.min(s);
            }
        }
        let ms = best * 1e3 / n_gen as f64;
        if t == 1 {
            single_ms = Some(ms);
        }
        let cost = match single_ms {
            Some(base) => format!("{:.2}", ms / base),
            None if single => "(1 later in the list)".into(),
            None => "-".into(),
        };
        println!("| {t} | {ms:.3} | {cost} | {:.0} |", t as f64 * 1e3 / ms);
    }
    Ok(())
}

/// `n_gen` steps of `t` tokens after `depth` random ones (a single-token step for t = 1),
/// each keeping only its first token, as a verification that accepts no draft; returns the
/// seconds the steps took.
fn verify_once<B: Backend>(
    engine: &mut Engine<B>,
    ids: &mut Ids,
    depth: usize,
    t: usize,
    n_gen: usize,
) -> anyhow::Result<f64> {
    let vocab = engine.config().vocab_size;
    let mut seq = fill(engine, ids, depth)?;
    let steps: Vec<Vec<u32>> = (0..n_gen)
        .map(|_| (0..t).map(|_| ids.next(vocab)).collect())
        .collect();
    let mut next = Vec::new();
    let start = Instant::now();
    let result = (|| {
        for step in &steps {
            let base = seq.tokens.len();
            if t == 1 {
                engine.decode_argmax(std::slice::from_mut(&mut seq), step, &mut next)?;
            } else {
                engine.eval_argmax_each(&mut seq, step, &mut next)?;
                engine.truncate(&mut seq, base + 1);
            }
        }
        Ok(start.elapsed().as_secs_f64())
    })();
    engine.release(&mut seq);
    result
}

/// One row of the batched benchmark (llama-batched-bench's columns).
#[derive(Serialize, Debug)]
struct BatchedResult {
    model_filename: String,
    backends: String,
    kernels: String,
    n_prompt: usize,
    n_gen: usize,
    n_seqs: usize,
    /// Mean seconds of the prefill (all prompts) and of the decode (all steps).
    prefill_s: f64,
    decode_s: f64,
    prefill_ts: f64,
    decode_ts: f64,
    total_ts: f64,
}

/// `--seqs B1,B2,...`: B sequences prefilled together, then decoded together.
fn run_batched(args: Args) -> anyhow::Result<()> {
    let n_prompt = args.n_prompt.first().copied().unwrap_or(0);
    let n_gen = args.n_gen.first().copied().unwrap_or(0);
    if n_prompt == 0 || n_gen == 0 {
        bail!("batched mode needs a positive -p and -n");
    }
    if args.seqs.contains(&0) {
        bail!("--seqs: every sequence count must be at least 1");
    }
    let most = args.seqs.iter().copied().max().unwrap_or(1);
    let mut model_args = args.model.clone();
    model_args.ctx = model_args.ctx.max(n_prompt + n_gen);
    model_args.max_seqs = most;
    model_args.batch = args.ubatch.max(most);
    let (mut engine, _file) = load_any_engine(&model_args, most)?;
    let backend = with_engine!(&engine, e => e.backend.name());
    let backends = match engine {
        AnyEngine::Cpu(_) => "CPU",
        AnyEngine::Cuda(_) => "CUDA",
        AnyEngine::Tp(_) => "CUDA TP",
        AnyEngine::Split(_) => "CUDA layer split",
    };
    let filename = kestrel_hub::resolve_model(&args.model.model)?
        .display()
        .to_string();
    let mut ids = Ids(0x2545_f491_4f6c_dd1d);
    let mut results = Vec::new();
    if !args.json {
        println!("| PP | TG | B | prefill s | prefill t/s | decode s | decode t/s | total t/s |");
        println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    }
    for &b in &args.seqs {
        with_engine!(&mut engine, e => run_batched_once(e, &mut ids, b, n_prompt, n_gen.min(4), args.argmax))?;
        let (mut pre, mut dec) = (Vec::new(), Vec::new());
        for _ in 0..args.repetitions {
            let (p, d) = with_engine!(&mut engine, e => run_batched_once(e, &mut ids, b, n_prompt, n_gen, args.argmax))?;
            pre.push(p);
            dec.push(d);
        }
        let (prefill_s, _) = mean_stddev(&pre);
        let (decode_s, _) = mean_stddev(&dec);
        let r = BatchedResult {
            model_filename: filename.clone(),
            backends: backends.into(),
            kernels: backend.clone(),
            n_prompt,
            n_gen,
            n_seqs: b,
            prefill_s,
            decode_s,
            prefill_ts: (b * n_prompt) as f64 / prefill_s,
            decode_ts: (b * n_gen) as f64 / decode_s,
            total_ts: (b * (n_prompt + n_gen)) as f64 / (prefill_s + decode_s),
        };
        if !args.json {
            println!(
                "| {} | {} | {} | {:.3} | {:.1} | {:.3} | {:.1} | {:.1} |",
                n_prompt, n_gen, b, r.prefill_s, r.prefill_ts, r.decode_s, r.decode_ts, r.total_ts
            );
        }
        results.push(r);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    }
    Ok(())
}

/// B sequences from an empty cache: returns the seconds of the prefill and of the decode.
fn run_batched_once<B: Backend>(
    engine: &mut Engine<B>,
    ids: &mut Ids,
    b: usize,
    n_prompt: usize,
    n_gen: usize,
    argmax: bool,
) -> anyhow::Result<(f64, f64)> {
    let vocab = engine.config().vocab_size;
    let prompts: Vec<Vec<u32>> = (0..b)
        .map(|_| (0..n_prompt).map(|_| ids.next(vocab)).collect())
        .collect();
    let gen_ids: Vec<Vec<u32>> = (0..n_gen)
        .map(|_| (0..b).map(|_| ids.next(vocab)).collect())
        .collect();
    let mut seqs = vec![Sequence::default(); b];
    let start = Instant::now();
    let lists: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
    let result = (|| {
        engine.eval_batch(&mut seqs, &lists, false, |_, _, _| {})?;
        let prefill = start.elapsed().as_secs_f64();
        let start = Instant::now();
        let mut next = Vec::new();
        for step in &gen_ids {
            if argmax {
                engine.decode_argmax(&mut seqs, step, &mut next)?;
            } else {
                let lists: Vec<&[u32]> = step.chunks(1).collect();
                engine.eval_batch(&mut seqs, &lists, false, |_, _, _| {})?;
            }
        }
        Ok((prefill, start.elapsed().as_secs_f64()))
    })();
    for s in &mut seqs {
        engine.release(s);
    }
    result
}
