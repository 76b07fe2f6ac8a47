//! Bit-exact agreement with llama.cpp's gguf-py (`gguf.quants`), run as a `python3`
//! subprocess through `tests/gguf_oracle.py`:
//! - rows of the real models' tensors, every type they hold, dequantize to the same f32 bits
//!   (kestrel-gguf locates the rows; its own tests check that against gguf-py's reader);
//! - random data quantizes to the same bytes wherever gguf-py has a quantizer;
//! - random valid blocks of every type gguf-py can dequantize give the same f32 bits.
//!
//! These tests need python3 with the `gguf` and `numpy` packages (requirements-test.txt);
//! without them they fail rather than skip. Set KESTREL_TEST_SEED to replay a run.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use kestrel_gguf::GgufFile;
use kestrel_quant::{GgmlType, dequantize, f32_to_f16, quantize};
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

/// gguf-py's name for a type (GGMLQuantizationType member).
fn py_name(ty: GgmlType) -> String {
    ty.name().to_uppercase()
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/gguf_oracle.py")
}

/// Runs the oracle script and returns its stdout; any failure fails the test.
fn oracle(args: &[&str]) -> String {
    let out = Command::new("python3")
        .arg(script())
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run python3 (needed as the gguf-py oracle): {e}"));
    assert!(
        out.status.success(),
        "gguf_oracle.py {args:?} failed ({}); install requirements-test.txt (gguf, numpy).\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn seed() -> u64 {
    let seed = std::env::var("KESTREL_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    eprintln!("KESTREL_TEST_SEED={seed}");
    seed
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn f32_from_bytes(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Runs one oracle command over many (type, input) jobs in a single python3 process.
fn py_batch(dir: &Path, cmd: &str, jobs: &[(GgmlType, Vec<u8>)]) -> Vec<Vec<u8>> {
    let mut args = vec![cmd.to_string()];
    let mut outputs = Vec::new();
    for (i, (ty, input)) in jobs.iter().enumerate() {
        let (src, dst) = (
            dir.join(format!("{cmd}-{i}.in")),
            dir.join(format!("{cmd}-{i}.out")),
        );
        std::fs::write(&src, input).expect("write oracle input");
        args.push(py_name(*ty));
        args.push(src.to_string_lossy().into_owned());
        args.push(dst.to_string_lossy().into_owned());
        outputs.push(dst);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    oracle(&args);
    outputs
        .iter()
        .map(|p| std::fs::read(p).expect("read oracle output"))
        .collect()
}

/// gguf.quants.dequantize of each job's block bytes.
fn py_dequantize(dir: &Path, jobs: &[(GgmlType, Vec<u8>)]) -> Vec<Vec<f32>> {
    py_batch(dir, "dequantize", jobs)
        .iter()
        .map(|b| f32_from_bytes(b))
        .collect()
}

/// gguf.quants.quantize of each job's f32 values.
fn py_quantize(dir: &Path, jobs: &[(GgmlType, &[f32])]) -> Vec<Vec<u8>> {
    let jobs: Vec<(GgmlType, Vec<u8>)> = jobs.iter().map(|&(ty, v)| (ty, f32_bytes(v))).collect();
    py_batch(dir, "quantize", &jobs)
}

/// Asserts two f32 slices are bit-identical, naming the first difference.
fn assert_same_bits(what: &str, ours: &[f32], theirs: &[f32]) {
    assert_eq!(ours.len(), theirs.len(), "{what}: lengths differ");
    if let Some(i) = (0..ours.len()).find(|&i| ours[i].to_bits() != theirs[i].to_bits()) {
        let n = ours
            .iter()
            .zip(theirs)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        panic!(
            "{what}: {n} of {} values differ; first at {i}: ours {:e} ({:#010x}), gguf-py {:e} ({:#010x})",
            ours.len(),
            ours[i],
            ours[i].to_bits(),
            theirs[i],
            theirs[i].to_bits()
        );
    }
}

const ALL_FORMATS: [GgmlType; 18] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q8_1,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::Q8K,
    GgmlType::IQ4NL,
    GgmlType::IQ4XS,
    GgmlType::MXFP4,
];

/// Types gguf-py can dequantize (it has no Q8_1 or Q8_K dequantizer).
const PY_DEQUANTIZABLE: [GgmlType; 16] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::IQ4NL,
    GgmlType::IQ4XS,
    GgmlType::MXFP4,
];

/// Quantizers gguf-py 0.19 has; the test insists on these and also compares any others a
/// newer gguf-py offers.
const PY_QUANTIZABLE_AT_LEAST: [GgmlType; 8] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
];

fn py_quantizable() -> Vec<GgmlType> {
    let names: Vec<String> = ALL_FORMATS.iter().map(|&t| py_name(t)).collect();
    let mut args = vec!["can-quantize"];
    args.extend(names.iter().map(String::as_str));
    let listed: BTreeSet<String> = oracle(&args).lines().map(str::to_string).collect();
    let types: Vec<GgmlType> = ALL_FORMATS
        .into_iter()
        .filter(|&t| listed.contains(&py_name(t)))
        .collect();
    for ty in PY_QUANTIZABLE_AT_LEAST {
        assert!(
            types.contains(&ty),
            "gguf-py cannot quantize {ty}: too old?"
        );
    }
    types
}

/// Test data for quantizers: Gaussian blocks at many scales plus blocks that stress the
/// edge cases (all zero, constant, one spike, ties between largest magnitudes, values
/// that land exactly on rounding boundaries, subnormals, huge values).
fn quantizer_inputs(rng: &mut StdRng, block_size: usize, blocks: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(block_size * blocks);
    for b in 0..blocks {
        let scale = 10f32.powi(rng.random_range(-6..=4));
        let normal = Normal::new(0.0f32, scale).expect("normal");
        let mut block: Vec<f32> = (0..block_size).map(|_| normal.sample(rng)).collect();
        match b % 10 {
            0 => block.fill(0.0),
            1 => block.fill(rng.random_range(-2.0..2.0)),
            2 => {
                block.fill(0.0);
                let i = rng.random_range(0..block_size);
                block[i] = normal.sample(rng);
            }
            3 => {
                // Largest magnitude appears with both signs.
                let m = scale * 3.0;
                let (i, j) = (
                    rng.random_range(0..block_size),
                    rng.random_range(0..block_size),
                );
                block[i] = m;
                block[j] = -m;
            }
            4 => {
                // Small integers times a power of two: many exact .5 boundaries.
                for v in &mut block {
                    *v = rng.random_range(-16i32..=16) as f32 * 0.25;
                }
            }
            5 => {
                for v in &mut block {
                    *v = f32::from_bits(rng.random_range(1u32..0x0080_0000))
                        * if rng.random() { 1.0 } else { -1.0 };
                }
            }
            6 => {
                for v in &mut block {
                    *v *= 1e30;
                }
            }
            7 => {
                // All positive (asymmetric formats keep a min).
                for v in &mut block {
                    *v = v.abs() + scale;
                }
            }
            _ => {}
        }
        out.extend(block);
    }
    out
}

#[test]
fn quantizers_match_gguf_py_byte_for_byte() {
    let mut rng = StdRng::seed_from_u64(seed());
    let dir = tempfile::tempdir().expect("temp dir");
    let types = py_quantizable();
    let inputs: Vec<Vec<f32>> = types
        .iter()
        .map(|ty| {
            let blocks = if ty.block_size() == 1 { 4096 } else { 400 };
            quantizer_inputs(&mut rng, ty.block_size().max(32), blocks)
        })
        .collect();
    let jobs: Vec<(GgmlType, &[f32])> = types
        .iter()
        .copied()
        .zip(inputs.iter().map(Vec::as_slice))
        .collect();
    let py_bytes = py_quantize(dir.path(), &jobs);
    for ((&ty, values), theirs) in types.iter().zip(&inputs).zip(&py_bytes) {
        let ours = quantize(ty, values, values.len()).expect("quantize");
        assert_eq!(ours.len(), theirs.len(), "{ty}: byte lengths differ");
        if let Some(i) = (0..ours.len()).find(|&i| ours[i] != theirs[i]) {
            let block = i / ty.type_size();
            let bs = ty.block_size();
            panic!(
                "{ty}: bytes differ at byte {i} (block {block}): ours {:#04x}, gguf-py {:#04x}; \
                 block input {:?}",
                ours[i],
                theirs[i],
                &values[block * bs..(block + 1) * bs]
            );
        }
    }
    // Dequantizing gguf-py's bytes: same bits on both sides.
    let jobs: Vec<(GgmlType, Vec<u8>)> = types.iter().copied().zip(py_bytes).collect();
    for ((ty, bytes), theirs) in jobs.iter().zip(py_dequantize(dir.path(), &jobs)) {
        let ours = dequantize(*ty, bytes).expect("dequantize");
        assert_same_bits(
            &format!("{ty} dequantize of quantized data"),
            &ours,
            &theirs,
        );
    }
}

/// Random block bytes with every f16 scale field replaced by a finite f16 of moderate size
/// (random bits elsewhere are all valid quants). Float formats get random finite values.
fn random_blocks(rng: &mut StdRng, ty: GgmlType, blocks: usize) -> Vec<u8> {
    let random_f16 = |rng: &mut StdRng| {
        let v = rng.random_range(-1.0f32..1.0) * 10f32.powi(rng.random_range(-7..=2));
        f32_to_f16(v).to_le_bytes()
    };
    match ty {
        GgmlType::F32 => (0..blocks)
            .flat_map(|_| {
                let v = rng.random_range(-1.0f32..1.0) * 10f32.powi(rng.random_range(-40..=38));
                v.to_le_bytes()
            })
            .collect(),
        GgmlType::F16 => (0..blocks)
            .flat_map(|_| {
                // Any finite f16, subnormals included.
                let bits = loop {
                    let b: u16 = rng.random();
                    if b & 0x7c00 != 0x7c00 {
                        break b;
                    }
                };
                bits.to_le_bytes()
            })
            .collect(),
        GgmlType::BF16 => (0..blocks)
            .flat_map(|_| {
                let bits = loop {
                    let b: u16 = rng.random();
                    if b & 0x7f80 != 0x7f80 {
                        break b;
                    }
                };
                bits.to_le_bytes()
            })
            .collect(),
        _ => {
            let scale_fields: &[usize] = match ty {
                GgmlType::Q4_0
                | GgmlType::Q5_0
                | GgmlType::Q8_0
                | GgmlType::IQ4NL
                | GgmlType::IQ4XS => &[0],
                // Every byte is valid: an E8M0 exponent and 4-bit codes.
                GgmlType::MXFP4 => &[],
                GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
                GgmlType::Q2K => &[80, 82],
                GgmlType::Q3K => &[108],
                GgmlType::Q6K => &[208],
                _ => panic!("no random block recipe for {ty}"),
            };
            let mut out = Vec::with_capacity(blocks * ty.type_size());
            for _ in 0..blocks {
                let mut block: Vec<u8> = (0..ty.type_size()).map(|_| rng.random()).collect();
                for &at in scale_fields {
                    block[at..at + 2].copy_from_slice(&random_f16(rng));
                }
                out.extend(block);
            }
            out
        }
    }
}

#[test]
fn dequantizers_match_gguf_py_on_random_blocks() {
    let mut rng = StdRng::seed_from_u64(seed());
    let dir = tempfile::tempdir().expect("temp dir");
    let mut jobs: Vec<(GgmlType, Vec<u8>)> = Vec::new();
    for ty in PY_DEQUANTIZABLE {
        let blocks = if ty.block_size() == 1 { 8192 } else { 300 };
        jobs.push((ty, random_blocks(&mut rng, ty, blocks)));
        // Blocks made by our quantizer (realistic scales and levels) too.
        let values = quantizer_inputs(&mut rng, ty.block_size().max(256), 40);
        jobs.push((ty, quantize(ty, &values, values.len()).expect("quantize")));
    }
    for (i, ((ty, bytes), theirs)) in jobs
        .iter()
        .zip(py_dequantize(dir.path(), &jobs))
        .enumerate()
    {
        let ours = dequantize(*ty, bytes).expect("dequantize");
        let kind = if i % 2 == 0 { "random" } else { "quantized" };
        assert_same_bits(&format!("{ty} {kind} blocks"), &ours, &theirs);
    }
}

/// Per model: the tensor types COMMON.md lists for it (a cross-check of the listing).
const MODELS: [(&str, &[GgmlType]); 2] = [
    (
        "qwen2.5-coder-1.5b",
        &[GgmlType::F32, GgmlType::Q4K, GgmlType::Q6K],
    ),
    (
        "gemma-3-270m",
        &[
            GgmlType::F32,
            GgmlType::Q5_0,
            GgmlType::Q8_0,
            GgmlType::Q4K,
            GgmlType::Q6K,
        ],
    ),
];

#[test]
fn real_model_rows_match_gguf_py() {
    let mut rng = StdRng::seed_from_u64(seed());
    let dir = tempfile::tempdir().expect("temp dir");
    // One job per (model, type): the sampled rows' bytes, concatenated.
    let mut jobs: Vec<(GgmlType, Vec<u8>)> = Vec::new();
    let mut labels: Vec<Vec<String>> = Vec::new();
    for (model, expected_types) in MODELS {
        let path = kestrel_hub::resolve_model(model)
            .unwrap_or_else(|e| panic!("model {model} is needed for this test: {e:#}"));
        let file = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));

        let mut by_type: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
        for (i, t) in file.tensors().iter().enumerate() {
            by_type.entry(t.ty.id()).or_default().push(i);
        }
        let found: BTreeSet<u32> = by_type.keys().copied().collect();
        let expected: BTreeSet<u32> = expected_types.iter().map(|t| t.id()).collect();
        assert_eq!(found, expected, "{model}: tensor types (GGUF ids)");

        // Three random rows from each of up to four random tensors of each type.
        for indices in by_type.values() {
            let ty = file.tensors()[indices[0]].ty;
            let (mut bytes, mut rows) = (Vec::new(), Vec::new());
            for &ti in indices.choose_multiple(&mut rng, 4) {
                let t = &file.tensors()[ti];
                let row_bytes = t.row_bytes() as usize;
                let data = file.tensor_data(t);
                for _ in 0..3 {
                    let row = rng.random_range(0..t.n_rows()) as usize;
                    bytes.extend_from_slice(&data[row * row_bytes..(row + 1) * row_bytes]);
                    for _ in 0..t.row_len() as usize / ty.block_size() {
                        rows.push(format!("{model} {} row {row}", t.name));
                    }
                }
            }
            jobs.push((ty, bytes));
            labels.push(rows);
        }
    }
    let py_values = py_dequantize(dir.path(), &jobs);
    for (((ty, bytes), theirs), blocks) in jobs.iter().zip(&py_values).zip(&labels) {
        let ours = dequantize(*ty, bytes).expect("dequantize");
        let bs = ty.block_size();
        assert_eq!(ours.len(), theirs.len(), "{ty}: lengths differ");
        for (b, label) in blocks.iter().enumerate() {
            let r = b * bs..(b + 1) * bs;
            assert_same_bits(&format!("{label} ({ty})"), &ours[r.clone()], &theirs[r]);
        }
        eprintln!("{ty}: {} blocks compared", blocks.len());
    }
}
