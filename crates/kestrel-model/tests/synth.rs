//! Synthetic GGUF models: layout checked against the real llama.cpp files, the written bytes
//! against kestrel-gguf's reader and the Python `gguf` reader, and determinism.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;

use kestrel_gguf::{GgmlType, GgufFile, Value};
use kestrel_model::config::Arch;
use kestrel_model::synth::{
    Role, SynthConfig, SynthOverrides, WeightType, write_synth, write_synth_to,
    write_synth_with_progress,
};

const ARCHES: [Arch; 4] = [Arch::Llama, Arch::Qwen2, Arch::Qwen3, Arch::Gemma3];

fn synth_bytes(cfg: &SynthConfig, ty: WeightType, seed: u64) -> Vec<u8> {
    let (bytes, summary) = write_synth_to(Vec::new(), cfg, ty, seed).expect("synth");
    assert_eq!(summary.file_size, bytes.len() as u64);
    bytes
}

fn u32_of(file: &GgufFile, key: &str) -> u32 {
    file.get_u64(key)
        .unwrap_or_else(|| panic!("missing {key}"))
        .try_into()
        .expect("u32")
}

/// A config with the real file's sizes, read from its metadata.
fn mirror(file: &GgufFile) -> SynthConfig {
    let arch = Arch::from_name(file.architecture().expect("arch")).expect("known arch");
    let a = arch.name();
    let n_embd = u32_of(file, &format!("{a}.embedding_length"));
    let n_head = u32_of(file, &format!("{a}.attention.head_count"));
    let head_dim = file
        .get_u64(&format!("{a}.attention.key_length"))
        .map_or(n_embd / n_head, |v| v as u32);
    let embd = file.tensor("token_embd.weight").expect("token_embd");
    let mut cfg = SynthConfig::tiny(arch);
    cfg.apply(&SynthOverrides {
        n_layer: Some(u32_of(file, &format!("{a}.block_count"))),
        n_embd: Some(n_embd),
        n_ff: Some(u32_of(file, &format!("{a}.feed_forward_length"))),
        n_head: Some(n_head),
        n_head_kv: Some(u32_of(file, &format!("{a}.attention.head_count_kv"))),
        head_dim: Some(head_dim),
        n_vocab: Some(embd.dims[1] as u32),
        n_ctx: Some(u32_of(file, &format!("{a}.context_length"))),
    })
    .expect("apply");
    cfg.rope_freq_base = file.get_f32(&format!("{a}.rope.freq_base")).expect("rope");
    cfg.rms_eps = file
        .get_f32(&format!("{a}.attention.layer_norm_rms_epsilon"))
        .expect("eps");
    cfg.tied_embeddings = file.tensor("output.weight").is_none();
    cfg.qkv_bias = file.tensor("blk.0.attn_q.bias").is_some();
    if let Some(w) = file.get_u64(&format!("{a}.attention.sliding_window")) {
        cfg.sliding_window = w as u32;
    }
    cfg
}

fn real_model(name: &str) -> GgufFile {
    let path = kestrel_hub::resolve_model(name).expect("model");
    GgufFile::open(path).expect("open")
}

/// Our Q4_K_M layout for a model with the real file's sizes has the same tensors, shapes,
/// types (including llama-quantize's mix and its fallbacks) and architecture metadata.
fn check_against_real(name: &str) {
    let real = real_model(name);
    assert_eq!(
        real.get_u64("general.file_type"),
        Some(15),
        "{name} is Q4_K_M"
    );
    let cfg = mirror(&real);
    let specs = cfg.tensors(WeightType::Q4KM).expect("tensors");

    let ours: BTreeMap<&str, &Vec<u64>> =
        specs.iter().map(|s| (s.name.as_str(), &s.dims)).collect();
    let theirs: BTreeMap<&str, &Vec<u64>> = real
        .tensors()
        .iter()
        .map(|t| (t.name.as_str(), &t.dims))
        .collect();
    assert_eq!(ours, theirs, "{name}: tensor names and shapes");

    // llama-quantize numbers attn_v / ffn_down tensors in the order it meets them in the file.
    let mut seen: BTreeMap<&str, u32> = BTreeMap::new();
    for t in real.tensors() {
        let kind = t.name.rsplit('.').nth(1).unwrap_or("");
        let role = match (t.name.as_str(), kind) {
            ("output.weight", _) => Role::Output,
            ("token_embd.weight", _) => Role::TokenEmbd,
            (_, "attn_v" | "ffn_down") if t.dims.len() == 2 => {
                let k = seen.entry(kind).or_default();
                *k += 1;
                if kind == "attn_v" {
                    Role::AttnV(*k - 1)
                } else {
                    Role::FfnDown(*k - 1)
                }
            }
            _ => Role::Other,
        };
        let want = if t.dims.len() == 1 {
            GgmlType::F32
        } else {
            cfg.tensor_type(WeightType::Q4KM, role, t.dims[0])
        };
        assert_eq!(t.ty, want, "{name}: type of {}", t.name);
    }
    let meta = cfg.metadata(WeightType::Q4KM);
    let ours: BTreeMap<&str, &Value> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let prefix = format!("{}.", cfg.arch.name());
    let mut checked = 0;
    for (key, value) in real.metadata() {
        if key.starts_with(&prefix) || key == "general.architecture" || key == "general.file_type" {
            assert_eq!(ours.get(key.as_str()), Some(&value), "{name}: {key}");
            checked += 1;
        }
    }
    assert!(checked >= 10, "{name}: only {checked} keys compared");
}

#[test]
fn layout_matches_real_gemma3_file() {
    check_against_real("gemma-3-270m");
}

#[test]
fn layout_matches_real_qwen2_file() {
    check_against_real("qwen2.5-coder-1.5b");
}

#[test]
fn llama_and_qwen3_block_tensors() {
    // llama.cpp's names (LLM_TENSOR_NAMES) for these architectures.
    let common = [
        "attn_norm.weight",
        "attn_q.weight",
        "attn_k.weight",
        "attn_v.weight",
        "attn_output.weight",
        "ffn_norm.weight",
        "ffn_gate.weight",
        "ffn_up.weight",
        "ffn_down.weight",
    ];
    for (arch, extra) in [
        (Arch::Llama, vec![]),
        (
            Arch::Qwen3,
            vec!["attn_q_norm.weight", "attn_k_norm.weight"],
        ),
    ] {
        let cfg = SynthConfig::tiny(arch);
        let specs = cfg.tensors(WeightType::F16).unwrap();
        let names: BTreeSet<String> = specs.iter().map(|s| s.name.clone()).collect();
        let mut want: BTreeSet<String> = ["token_embd.weight", "output_norm.weight"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        if !cfg.tied_embeddings {
            want.insert("output.weight".into());
        }
        for i in 0..cfg.n_layer {
            for s in common.iter().chain(&extra) {
                want.insert(format!("blk.{i}.{s}"));
            }
        }
        assert_eq!(names, want, "{arch:?}");
        let q_norm = specs.iter().find(|s| s.name == "blk.0.attn_q_norm.weight");
        if let Some(q) = q_norm {
            assert_eq!(q.dims, vec![cfg.head_dim as u64]);
        }
    }
}

#[test]
fn presets_have_the_published_parameter_counts() {
    // Published totals (safetensors parameter counts of the released checkpoints).
    let params = |name: &str| -> u64 {
        let cfg = SynthConfig::preset(name, None).unwrap();
        let specs = cfg.tensors(WeightType::Q4KM).unwrap();
        specs.iter().map(|s| s.n_elements()).sum()
    };
    assert_eq!(params("llama3-8b"), 8_030_261_248);
    assert_eq!(params("qwen2.5-1.5b"), 1_543_714_304);
    assert_eq!(params("qwen2.5-7b"), 7_615_616_512);
    // Mixture-of-experts presets: every expert counted (30.5B and 20.9B published).
    assert_eq!(params("qwen3-30b-a3b"), 30_532_122_624);
    assert_eq!(params("gpt-oss-20b"), 20_914_757_184);
}

fn types_under_test() -> [WeightType; 6] {
    [
        WeightType::F32,
        WeightType::Bf16,
        WeightType::Q4_0,
        WeightType::Q8_0,
        WeightType::Q4KM,
        WeightType::Q6K,
    ]
}

#[test]
fn tiny_models_read_back_with_expected_layout_and_values() {
    for arch in ARCHES {
        for ty in types_under_test() {
            let cfg = SynthConfig::tiny(arch);
            let bytes = synth_bytes(&cfg, ty, 7);
            let file = GgufFile::from_bytes(bytes).expect("kestrel-gguf reads it");

            let meta = cfg.metadata(ty);
            assert_eq!(file.metadata(), meta.as_slice());
            assert_eq!(file.architecture(), Some(arch.name()));
            assert_eq!(file.get_str("tokenizer.ggml.model"), Some("none"));
            assert_eq!(
                file.get_u64(&format!("{}.vocab_size", arch.name())),
                Some(cfg.n_vocab as u64)
            );
            assert_eq!(
                file.get_u64("general.file_type"),
                Some(ty.file_type() as u64)
            );

            let specs = cfg.tensors(ty).unwrap();
            assert_eq!(file.tensors().len(), specs.len());
            for (t, s) in file.tensors().iter().zip(&specs) {
                assert_eq!((&t.name, &t.dims, t.ty), (&s.name, &s.dims, s.ty));
                if t.dims.len() == 1 {
                    assert_eq!(t.ty, GgmlType::F32, "{} is 1-D", t.name);
                } else if ty != WeightType::Q4KM {
                    assert_eq!(t.ty, ty.base(), "{}", t.name);
                }
                let values = kestrel_quant::dequantize(t.ty, file.tensor_data(t)).unwrap();
                assert_eq!(values.len() as u64, t.n_elements());
                let n = values.len() as f64;
                let mean = values.iter().map(|&v| v as f64).sum::<f64>() / n;
                let std = (values
                    .iter()
                    .map(|&v| (v as f64 - mean).powi(2))
                    .sum::<f64>()
                    / n)
                    .sqrt();
                let (want_mean, want_std) = (s.init.mean as f64, s.init.std as f64);
                // Quantization error widens the spread a little (Q4_0 the most).
                assert!(
                    (mean - want_mean).abs() < 4.0 * want_std / n.sqrt() + 2e-4,
                    "{arch:?} {ty} {}: mean {mean}",
                    t.name
                );
                assert!(
                    std > want_std * 0.85 && std < want_std * 1.2,
                    "{arch:?} {ty} {}: std {std}",
                    t.name
                );
            }
        }
    }
}

#[test]
fn same_seed_same_bytes_whatever_the_thread_count() {
    let mut cfg = SynthConfig::tiny(Arch::Qwen2);
    // Enough rows that tensors span several chunks and batches.
    cfg.n_vocab = 20_000;
    let ty = WeightType::Q4KM;
    let run = |threads: usize, seed: u64| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| synth_bytes(&cfg, ty, seed))
    };
    let one = run(1, 42);
    assert_eq!(one, run(3, 42));
    assert_eq!(one, run(8, 42));
    let other = run(3, 43);
    assert_eq!(one.len(), other.len());
    assert_ne!(one, other);
}

#[test]
fn file_output_matches_in_memory_output() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("synth-file");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny-gemma3.gguf");
    let cfg = SynthConfig::tiny(Arch::Gemma3);
    let summary = write_synth(&path, &cfg, WeightType::Q5_0, 3).unwrap();
    let on_disk = std::fs::read(&path).unwrap();
    assert_eq!(on_disk.len() as u64, summary.file_size);
    assert_eq!(on_disk, synth_bytes(&cfg, WeightType::Q5_0, 3));
    std::fs::remove_file(&path).unwrap();
}

/// The progress callback (for `kestrel synth`'s bar) counts every tensor byte once, in
/// increasing steps, ending at the total: the file's size less its header and padding.
#[test]
fn progress_counts_every_tensor_byte() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("synth-progress");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny-llama.gguf");
    let mut cfg = SynthConfig::tiny(Arch::Llama);
    cfg.apply(&SynthOverrides {
        n_vocab: Some(1_003),
        ..Default::default()
    })
    .unwrap();
    let calls = std::sync::Mutex::new(Vec::new());
    let summary = write_synth_with_progress(&path, &cfg, WeightType::Q4_0, 5, &|done, total| {
        calls.lock().unwrap().push((done, total))
    })
    .unwrap();
    let calls = calls.into_inner().unwrap();
    assert!(calls.len() >= summary.n_tensors, "{} calls", calls.len());
    let total = calls[0].1;
    assert!(calls.iter().all(|&(_, t)| t == total));
    assert!(calls.windows(2).all(|w| w[0].0 < w[1].0));
    assert_eq!(calls.last().unwrap().0, total);
    let file = GgufFile::open(&path).unwrap();
    let data: u64 = file.tensors().iter().map(|t| t.n_bytes()).sum();
    assert_eq!(total, data);
    assert!(total < summary.file_size);
    std::fs::remove_file(&path).unwrap();
}

/// The Python `gguf` package (llama.cpp's gguf-py) reads our files the same way.
#[test]
fn python_gguf_reader_agrees() {
    const SCRIPT: &str = r#"
import sys, gguf
r = gguf.GGUFReader(sys.argv[1])
print("count", len(r.tensors))
for t in r.tensors:
    print("tensor", t.name, ",".join(str(int(d)) for d in t.shape), t.tensor_type.name)
for key in sys.argv[2:]:
    print("meta", key, r.fields[key].contents())
"#;
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("synth-python");
    std::fs::create_dir_all(&dir).unwrap();
    for arch in ARCHES {
        for ty in [WeightType::F16, WeightType::Q4KM, WeightType::Q4_1] {
            let cfg = SynthConfig::tiny(arch);
            let path = dir.join(format!("{}-{ty}.gguf", arch.name()));
            write_synth(&path, &cfg, ty, 11).unwrap();
            let a = arch.name();
            let keys = [
                "general.architecture".to_string(),
                format!("{a}.block_count"),
                format!("{a}.embedding_length"),
                format!("{a}.vocab_size"),
                "general.file_type".to_string(),
                "tokenizer.ggml.model".to_string(),
            ];
            let out = Command::new("python3")
                .arg("-c")
                .arg(SCRIPT)
                .arg(&path)
                .args(&keys)
                .output()
                .expect("python3 must be installed (see requirements-test.txt)");
            assert!(
                out.status.success(),
                "python gguf reader failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let stdout = String::from_utf8(out.stdout).unwrap();

            let specs = cfg.tensors(ty).unwrap();
            let mut want = vec![format!("count {}", specs.len())];
            for s in &specs {
                let dims: Vec<String> = s.dims.iter().map(|d| d.to_string()).collect();
                want.push(format!(
                    "tensor {} {} {}",
                    s.name,
                    dims.join(","),
                    s.ty.name().to_ascii_uppercase()
                ));
            }
            let meta = cfg.metadata(ty);
            for key in &keys {
                let v = &meta.iter().find(|(k, _)| k == key).unwrap().1;
                let text = match v {
                    Value::String(s) => s.clone(),
                    other => other.as_u64().unwrap().to_string(),
                };
                want.push(format!("meta {key} {text}"));
            }
            let got: Vec<&str> = stdout.lines().collect();
            assert_eq!(got, want, "{}", path.display());
            std::fs::remove_file(&path).unwrap();
        }
    }
}

#[test]
fn bad_requests_are_explained() {
    let err = SynthConfig::preset("llama3-8b", Some(Arch::Gemma3)).unwrap_err();
    assert!(err.to_string().contains("llama"), "{err}");
    let err = SynthConfig::preset("nope", None).unwrap_err();
    assert!(err.to_string().contains("tiny"), "{err}");
    assert!(SynthConfig::preset("tiny", None).is_err());
    assert!(WeightType::from_name("q3_k_xl").is_err());
    assert_eq!(WeightType::from_name("Q4_K_M").unwrap(), WeightType::Q4KM);

    // 200 is not a multiple of 32, so not even the Q4_K fallback (Q5_0) fits.
    let mut cfg = SynthConfig::tiny(Arch::Llama);
    cfg.apply(&SynthOverrides {
        n_embd: Some(200),
        n_head: Some(4),
        ..Default::default()
    })
    .unwrap();
    let err = cfg.tensors(WeightType::Q4K).unwrap_err();
    assert!(err.to_string().contains("200"), "{err}");
    assert!(cfg.tensors(WeightType::F16).is_ok());

    let mut cfg = SynthConfig::tiny(Arch::Llama);
    cfg.n_head_kv = 3;
    assert!(cfg.tensors(WeightType::F32).is_err());
    cfg.n_head_kv = 0;
    assert!(cfg.tensors(WeightType::F32).is_err());
}
