//! `kestrel convert` against llama.cpp's converter, on small random checkpoints of each
//! supported architecture written here with the `safetensors` crate:
//! - for F32/F16/BF16/Q8_0 the file equals, key for key and tensor byte for byte, the one
//!   `tests/convert_oracle.py expect` writes with gguf-py (convert_hf_to_gguf.py needs torch,
//!   which neither this machine nor CI has; the oracle redoes its steps on gguf-py's parts);
//! - a quantized `--type` equals converting to BF16 then quantizing;
//! - a tokenizer.json rebuilt from the catalog Qwen2.5 model's vocabulary converts back to
//!   the catalog's tokenizer metadata, and tokenizes the reference strings as it does;
//! - malformed or hostile checkpoints give errors, not panics.
//!
//! Needs python3 with `gguf` and `numpy` (requirements-test.txt). KESTREL_TEST_SEED replays.

use std::path::{Path, PathBuf};
use std::process::Command;

use indicatif::ProgressBar;
use kestrel_convert::quantize::{Plan, QuantizeOptions, write_quantized};
use kestrel_convert::{Conversion, FileType};
use kestrel_gguf::GgufFile;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::{Dtype, tensor::TensorView};
use serde_json::{Value, json};

mod common;
use common::seed;

fn oracle(args: &[&str]) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/convert_oracle.py");
    let out = Command::new("python3")
        .arg(script)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run python3 (needed as the oracle): {e}"));
    assert!(
        out.status.success(),
        "convert_oracle.py {args:?} failed ({}); install requirements-test.txt.\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    if stdout.trim().is_empty() {
        return Value::Null;
    }
    serde_json::from_str(&stdout).expect("oracle output is JSON")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn write_json(dir: &Path, name: &str, v: &Value) {
    std::fs::write(dir.join(name), serde_json::to_string_pretty(v).unwrap()).unwrap();
}

/// A small byte-level BPE tokenizer: letters, a few merges, special and user-defined tokens.
fn small_tokenizer(dir: &Path) -> usize {
    let mut vocab = serde_json::Map::new();
    for (i, c) in ('a'..='z').chain(['Ġ', '!']).enumerate() {
        vocab.insert(c.to_string(), json!(i));
    }
    for (i, t) in ["ab", "Ġa", "abc"].iter().enumerate() {
        vocab.insert(t.to_string(), json!(28 + i));
    }
    let added = [
        (31, "<|endoftext|>", true),
        (32, "<|im_start|>", true),
        (33, "<|im_end|>", true),
        (34, "<tool_call>", false),
        (35, "<|fim_pad|>", false),
    ];
    let tok = json!({
        "version": "1.0",
        "added_tokens": added.iter().map(|(id, c, sp)| json!({
            "id": id, "content": c, "special": sp, "normalized": false,
            "lstrip": false, "rstrip": false, "single_word": false})).collect::<Vec<_>>(),
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]},
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [], "special_tokens": {}},
        "model": {"type": "BPE", "vocab": vocab, "merges": [["a", "b"], ["Ġ", "a"], ["ab", "c"]]},
    });
    write_json(dir, "tokenizer.json", &tok);
    write_json(
        dir,
        "tokenizer_config.json",
        &json!({"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"},
                "pad_token": "<|endoftext|>", "add_eos_token": false,
                "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}),
    );
    write_json(
        dir,
        "generation_config.json",
        &json!({"top_k": 20, "top_p": 0.8, "temperature": 0.7}),
    );
    36
}

/// Values of `n` random normals in `dtype`'s bytes.
fn random_bytes(rng: &mut StdRng, n: usize, dtype: Dtype, scale: f32) -> Vec<u8> {
    let mut out = Vec::new();
    for _ in 0..n {
        let v: f32 = (rng.random::<f32>() - 0.5) * 2.0 * scale;
        match dtype {
            Dtype::F32 => out.extend(v.to_le_bytes()),
            Dtype::F16 => out.extend(half::f16::from_f32(v).to_le_bytes()),
            _ => out.extend(half::bf16::from_f32(v).to_le_bytes()),
        }
    }
    out
}

struct Shape {
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ff: usize,
    layers: usize,
}

/// The tokenizer of a test checkpoint.
#[derive(Clone, Copy)]
enum Tok<'a> {
    /// `small_tokenizer`'s tokenizer.json.
    Small,
    /// A tokenizer.json rebuilt from this GGUF model's vocabulary.
    Gguf(&'a Path),
    /// A freshly trained SentencePiece tokenizer.model only (`llama` or `gemma` style);
    /// the oracle's answer (sizes, and strings with sentencepiece's ids) goes here.
    Spm(&'a str, &'a std::cell::RefCell<Value>),
}

/// Writes a random checkpoint of `hf_arch` (sharded over two files when `shards`), with the
/// tokenizer `tok`.
fn checkpoint(
    dir: &Path,
    hf_arch: &str,
    dtype: Dtype,
    seed: u64,
    shards: bool,
    tok: Tok,
) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let mut n_tokens = small_tokenizer(dir);
    let mut special_ids = (json!(32), json!(33));
    if let Tok::Spm(kind, answer) = tok {
        let info = oracle(&["spm", s(dir), kind, &seed.to_string()]);
        n_tokens = info["n_tokens"].as_u64().unwrap() as usize;
        special_ids = (info["bos"].clone(), info["eos"].clone());
        *answer.borrow_mut() = info;
    }
    if let Tok::Gguf(gguf) = tok {
        let info = oracle(&["tokenizer", s(gguf), s(dir), "0"]);
        n_tokens = GgufFile::open(gguf)
            .unwrap()
            .get_array("tokenizer.ggml.tokens")
            .unwrap()
            .len()
            - 3;
        assert!(info["vocab_size"].as_u64().unwrap() as usize <= n_tokens + 3);
        special_ids = (info["bos"].clone(), info["eos"].clone());
    }
    // Rows of 80 values: Q8_0 falls back to F16 for them; 96 and 128 are whole blocks.
    let sh = Shape {
        hidden: 80,
        heads: 5,
        kv_heads: 1,
        head_dim: 16,
        ff: 96,
        layers: 2,
    };
    let vocab = n_tokens + 3; // a few ids with no token: [PAD] entries
    let gemma = hf_arch.starts_with("Gemma3");
    let llama = hf_arch.starts_with("Llama");
    let qwen2 = hf_arch.starts_with("Qwen2");
    let qk_norm = hf_arch.starts_with("Qwen3") || gemma;
    let mut cfg = json!({
        "architectures": [hf_arch],
        "hidden_size": sh.hidden, "intermediate_size": sh.ff,
        "num_attention_heads": sh.heads, "num_key_value_heads": sh.kv_heads,
        "num_hidden_layers": sh.layers, "vocab_size": vocab,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
        "tie_word_embeddings": !llama, "bos_token_id": special_ids.0, "eos_token_id": special_ids.1,
        "torch_dtype": "bfloat16",
    });
    if qk_norm {
        cfg["head_dim"] = json!(sh.head_dim);
    }
    if llama {
        cfg["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
    }
    if gemma {
        // Gemma's converter trims embedding rows beyond the tokenizer's tokens (and writes
        // vocab_size tokens): every id has a token, and the embedding has 8 rows too many.
        cfg["vocab_size"] = json!(n_tokens);
        cfg["sliding_window"] = json!(8);
        cfg["sliding_window_pattern"] = json!(6);
        cfg["rope_local_base_freq"] = json!(10000.0);
        cfg["query_pre_attn_scalar"] = json!(16);
    }
    write_json(dir, "config.json", &cfg);
    let embd_rows = if gemma { n_tokens + 8 } else { vocab };
    let (q, kv) = (sh.heads * sh.head_dim, sh.kv_heads * sh.head_dim);
    let mut specs: Vec<(String, Vec<usize>)> = vec![
        (
            "model.embed_tokens.weight".into(),
            vec![embd_rows, sh.hidden],
        ),
        ("model.norm.weight".into(), vec![sh.hidden]),
    ];
    if llama {
        specs.push(("lm_head.weight".into(), vec![vocab, sh.hidden]));
    }
    for l in 0..sh.layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        specs.push((p("input_layernorm.weight"), vec![sh.hidden]));
        specs.push((p("self_attn.q_proj.weight"), vec![q, sh.hidden]));
        specs.push((p("self_attn.k_proj.weight"), vec![kv, sh.hidden]));
        specs.push((p("self_attn.v_proj.weight"), vec![kv, sh.hidden]));
        specs.push((p("self_attn.o_proj.weight"), vec![sh.hidden, q]));
        if qwen2 {
            specs.push((p("self_attn.q_proj.bias"), vec![q]));
            specs.push((p("self_attn.k_proj.bias"), vec![kv]));
            specs.push((p("self_attn.v_proj.bias"), vec![kv]));
        }
        if qk_norm {
            specs.push((p("self_attn.q_norm.weight"), vec![sh.head_dim]));
            specs.push((p("self_attn.k_norm.weight"), vec![sh.head_dim]));
        }
        specs.push((p("post_attention_layernorm.weight"), vec![sh.hidden]));
        if gemma {
            specs.push((p("pre_feedforward_layernorm.weight"), vec![sh.hidden]));
            specs.push((p("post_feedforward_layernorm.weight"), vec![sh.hidden]));
        }
        specs.push((p("mlp.gate_proj.weight"), vec![sh.ff, sh.hidden]));
        specs.push((p("mlp.up_proj.weight"), vec![sh.ff, sh.hidden]));
        specs.push((p("mlp.down_proj.weight"), vec![sh.hidden, sh.ff]));
        specs.push((p("self_attn.rotary_emb.inv_freq"), vec![sh.head_dim / 2]));
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = specs
        .into_iter()
        .map(|(n, shape)| {
            let count = shape.iter().product();
            let scale = if n.contains("norm") { 1.0 } else { 0.05 };
            let bytes = random_bytes(&mut rng, count, dtype, scale);
            (n, shape, bytes)
        })
        .collect();
    let split = if shards { data.len() / 2 } else { data.len() };
    let mut index = serde_json::Map::new();
    for (part, chunk) in [&data[..split], &data[split..]].iter().enumerate() {
        if chunk.is_empty() {
            continue;
        }
        let file = if shards {
            format!("model-0000{}-of-00002.safetensors", part + 1)
        } else {
            "model.safetensors".to_string()
        };
        let views: Vec<(String, TensorView)> = chunk
            .iter()
            .map(|(n, shape, b)| (n.clone(), TensorView::new(dtype, shape.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(&file)).unwrap();
        for (n, _, _) in chunk.iter() {
            index.insert(n.clone(), json!(file));
        }
    }
    if shards {
        write_json(
            dir,
            "model.safetensors.index.json",
            &json!({"weight_map": index}),
        );
    }
    dir.to_path_buf()
}

fn convert(dir: &Path, out: &Path, ftype: FileType) {
    let c = Conversion::new(dir, ftype).unwrap();
    c.write(out, &ProgressBar::hidden()).unwrap();
}

#[test]
fn matches_the_converter_for_every_architecture_and_type() {
    let tmp = tempfile::tempdir().unwrap();
    let seed = seed();
    let archs = [
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Gemma3ForCausalLM",
    ];
    // Each architecture from one dtype (BF16 twice), into every type the converter writes.
    let dtypes = [Dtype::BF16, Dtype::F16, Dtype::F32, Dtype::BF16];
    for (a, (hf_arch, dtype)) in archs.iter().zip(dtypes).enumerate() {
        let dir = tmp.path().join(hf_arch);
        checkpoint(&dir, hf_arch, dtype, seed + a as u64, a == 1, Tok::Small);
        for (ftype, name) in [
            (FileType::F32, "f32"),
            (FileType::F16, "f16"),
            (FileType::BF16, "bf16"),
            (FileType::Q8_0, "q8_0"),
        ] {
            let ours = tmp.path().join(format!("{hf_arch}-{name}.gguf"));
            convert(&dir, &ours, ftype);
            let r = oracle(&["check", s(&dir), name, "llama-bpe", s(&ours)]);
            assert!(r["n_tensors"].as_u64().unwrap() > 10);
            assert!(
                r["metadata"].as_array().unwrap().is_empty()
                    && r["tensors"].as_array().unwrap().is_empty(),
                "{hf_arch} {dtype:?} -> {name}: {r:#}"
            );
        }
    }
}

#[test]
fn a_quantized_type_equals_converting_then_quantizing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(
        &tmp.path().join("llama"),
        "LlamaForCausalLM",
        Dtype::BF16,
        seed(),
        false,
        Tok::Small,
    );
    let direct = tmp.path().join("direct.gguf");
    let bf16 = tmp.path().join("bf16.gguf");
    let two_step = tmp.path().join("two-step.gguf");
    convert(&dir, &direct, FileType::Q4KM);
    convert(&dir, &bf16, FileType::BF16);
    let file = GgufFile::open(&bf16).unwrap();
    let opts = QuantizeOptions {
        ftype: FileType::Q4KM,
        imatrix: None,
    };
    let plan = Plan::new(&file, &opts).unwrap();
    write_quantized(&file, &plan, &opts, &two_step, &ProgressBar::hidden()).unwrap();
    let r = oracle(&["compare", s(&direct), s(&two_step)]);
    assert!(
        r["metadata"].as_array().unwrap().is_empty() && r["tensors"].as_array().unwrap().is_empty(),
        "{r:#}"
    );
}

#[test]
fn the_catalog_tokenizer_survives_the_round_trip() {
    let catalog = kestrel_hub::models_dir().join("qwen2.5-coder-1.5b.gguf");
    if !catalog.is_file() {
        eprintln!("SKIP: {} is not cached (kestrel pull)", catalog.display());
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("qwen");
    checkpoint(
        &dir,
        "Qwen2ForCausalLM",
        Dtype::F16,
        seed(),
        false,
        Tok::Gguf(&catalog),
    );
    let cat = GgufFile::open(&catalog).unwrap();
    let out = tmp.path().join("qwen.gguf");
    convert(&dir, &out, FileType::F16);
    let ours = GgufFile::open(&out).unwrap();
    for key in [
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.padding_token_id",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.chat_template",
    ] {
        assert_eq!(ours.get(key), cat.get(key), "{key}");
    }
    // The same strings give the same ids.
    let reference = kestrel_hub::reference_dir()
        .unwrap()
        .join("tokenize_strings.json");
    let strings: Value =
        serde_json::from_str(&std::fs::read_to_string(reference).unwrap()).unwrap();
    let texts = collect_strings(&strings);
    assert!(texts.len() >= 5, "reference strings not found");
    let a = kestrel_tokenizer::Tokenizer::from_gguf(&ours).unwrap();
    let b = kestrel_tokenizer::Tokenizer::from_gguf(&cat).unwrap();
    for t in &texts {
        for parse_special in [false, true] {
            let (x, y) = (
                a.encode(t, true, parse_special),
                b.encode(t, true, parse_special),
            );
            assert_eq!(x, y, "{t:?}");
        }
    }
}

/// Every string value in the reference file (whatever its layout).
fn collect_strings(v: &Value) -> Vec<String> {
    match v {
        Value::String(s) => vec![s.clone()],
        Value::Array(a) => a.iter().flat_map(collect_strings).collect(),
        Value::Object(o) => o
            .iter()
            .filter(|(k, _)| !k.contains("token") && !k.contains("id"))
            .flat_map(|(_, v)| collect_strings(v))
            .collect(),
        _ => vec![],
    }
}

#[test]
fn bad_checkpoints_are_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let seed = seed();
    let fresh = |name: &str| {
        let d = tmp.path().join(name);
        checkpoint(&d, "Qwen2ForCausalLM", Dtype::BF16, seed, false, Tok::Small)
    };
    let err = |dir: &Path| -> String {
        match Conversion::new(dir, FileType::F16) {
            Ok(_) => panic!("{} converted", dir.display()),
            Err(e) => format!("{e:#}"),
        }
    };
    let edit_cfg = |dir: &Path, f: &dyn Fn(&mut Value)| {
        let mut v: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        f(&mut v);
        write_json(dir, "config.json", &v);
    };

    let d = fresh("arch");
    edit_cfg(&d, &|v| v["architectures"] = json!(["GPT2LMHeadModel"]));
    assert!(err(&d).contains("unsupported architecture GPT2LMHeadModel"));

    let d = fresh("notjson");
    std::fs::write(d.join("config.json"), "{ not json").unwrap();
    assert!(err(&d).contains("not valid JSON"));

    let d = fresh("hugevocab");
    edit_cfg(&d, &|v| v["vocab_size"] = json!(u64::MAX));
    assert!(!err(&d).is_empty());

    let d = fresh("badtype");
    edit_cfg(&d, &|v| v["num_hidden_layers"] = json!("two"));
    assert!(err(&d).contains("num_hidden_layers"));

    let d = fresh("fewlayers");
    edit_cfg(&d, &|v| v["num_hidden_layers"] = json!(1));
    assert!(err(&d).contains("beyond num_hidden_layers"));

    // A safetensors header claiming more bytes than the file has, or garbage.
    let mut rng = StdRng::seed_from_u64(seed);
    for case in 0..4 {
        let d = fresh(&format!("header{case}"));
        let path = d.join("model.safetensors");
        let mut bytes = std::fs::read(&path).unwrap();
        match case {
            0 => bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes()),
            1 => bytes.truncate(bytes.len() - 7),
            2 => {
                let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
                for b in &mut bytes[8..8 + n] {
                    if rng.random::<f32>() < 0.05 {
                        *b = rng.random();
                    }
                }
            }
            _ => bytes.truncate(5),
        }
        std::fs::write(&path, bytes).unwrap();
        // Random corruption may leave valid JSON; it must still not panic.
        let _ = Conversion::new(&d, FileType::F16);
        if case != 2 {
            assert!(err(&d).contains("safetensors"), "{}", err(&d));
        }
    }

    let d = fresh("escape");
    write_json(
        &d,
        "model.safetensors.index.json",
        &json!({"weight_map": {"x": "../secret.safetensors"}}),
    );
    assert!(err(&d).contains("outside the folder"));

    let d = fresh("notok");
    std::fs::remove_file(d.join("tokenizer.json")).unwrap();
    assert!(err(&d).contains("tokenizer.json"));

    let d = fresh("unknown-tensor");
    let extra = vec![0u8; 8];
    let views = vec![(
        "model.layers.0.mystery.weight".to_string(),
        TensorView::new(Dtype::F32, vec![2], &extra).unwrap(),
    )];
    safetensors::serialize_to_file(views, None, &d.join("extra.safetensors")).unwrap();
    assert!(err(&d).contains("cannot map tensor model.layers.0.mystery.weight"));
}

/// The converted files load in Kestrel (the architecture's metadata and tensor shapes are
/// what its loader expects), also in a mixture whose rows fall back to 32-value blocks.
#[test]
fn converted_models_load_in_kestrel() {
    let tmp = tempfile::tempdir().unwrap();
    let backend = kestrel_cpu::CpuBackend::new(kestrel_cpu::Kernels::Scalar);
    for (k, hf_arch) in [
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Gemma3ForCausalLM",
    ]
    .iter()
    .enumerate()
    {
        let dir = checkpoint(
            &tmp.path().join(hf_arch),
            hf_arch,
            Dtype::BF16,
            k as u64,
            false,
            Tok::Small,
        );
        for ftype in [FileType::F16, FileType::Q4KM] {
            let out = tmp.path().join(format!("{hf_arch}-{ftype}.gguf"));
            convert(&dir, &out, ftype);
            let file = std::sync::Arc::new(GgufFile::open(&out).unwrap());
            if let Err(e) = kestrel_model::Model::load(&backend, file) {
                panic!("{hf_arch} {ftype}: {e}");
            }
        }
    }
}

/// SentencePiece-only checkpoints (tokenizer.model, no tokenizer.json), Llama 2 and Gemma
/// style, with a tokenizer freshly trained by the `sentencepiece` package: the file equals
/// what convert_hf_to_gguf.py's `_set_vocab_sentencepiece` writes (the oracle runs its
/// `_create_vocab_sentencepiece` on sentencepiece itself), and Kestrel's tokenizer on the
/// converted file gives sentencepiece's ids for random strings.
#[test]
fn sentencepiece_checkpoints_convert_and_tokenize_as_sentencepiece() {
    let tmp = tempfile::tempdir().unwrap();
    let seed = seed();
    for (k, (hf_arch, kind)) in [
        ("LlamaForCausalLM", "llama"),
        ("Gemma3ForCausalLM", "gemma"),
    ]
    .into_iter()
    .enumerate()
    {
        let answer = std::cell::RefCell::new(Value::Null);
        let dir = checkpoint(
            &tmp.path().join(kind),
            hf_arch,
            Dtype::BF16,
            seed + k as u64,
            false,
            Tok::Spm(kind, &answer),
        );
        assert!(!dir.join("tokenizer.json").exists());
        let ours = tmp.path().join(format!("{kind}.gguf"));
        convert(&dir, &ours, FileType::F16);
        let r = oracle(&["check", s(&dir), "f16", "default", s(&ours)]);
        assert!(
            r["metadata"].as_array().unwrap().is_empty()
                && r["tensors"].as_array().unwrap().is_empty(),
            "{kind}: {r:#}"
        );
        let file = GgufFile::open(&ours).unwrap();
        assert_eq!(file.get_str("tokenizer.ggml.model"), Some("llama"));
        let types: Vec<i64> = file
            .get_array("tokenizer.ggml.token_type")
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect();
        // Unknown, control, user-defined and byte tokens are all there (and unused
        // [PAD] ids where config.json's vocab_size is larger: Llama here).
        let want: &[i64] = if kind == "llama" {
            &[2, 3, 4, 5, 6]
        } else {
            &[2, 3, 4, 6]
        };
        for ty in want {
            assert!(types.contains(ty), "{kind}: no token of type {ty}");
        }
        let tokenizer = kestrel_tokenizer::Tokenizer::from_gguf(&file).unwrap();
        let answer = answer.into_inner();
        let cases = answer["cases"].as_array().unwrap();
        assert!(cases.len() >= 50);
        let mut bytes_used = false;
        for case in cases {
            let text = case[0].as_str().unwrap();
            let expected: Vec<u32> = case[1]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            bytes_used |= expected.iter().any(|&id| types[id as usize] == 6);
            let ids = tokenizer.encode(text, false, false);
            assert_eq!(ids, expected, "{kind}: {text:?}");
        }
        assert!(bytes_used, "{kind}: no string needed byte fallback");
    }
}

/// A tokenizer.model that is not a SentencePiece model is a clear error.
#[test]
fn a_broken_tokenizer_model_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let answer = std::cell::RefCell::new(Value::Null);
    let dir = checkpoint(
        &tmp.path().join("m"),
        "LlamaForCausalLM",
        Dtype::BF16,
        seed(),
        false,
        Tok::Spm("llama", &answer),
    );
    for junk in [
        &b"\xff\xff\xff\xff not protobuf"[..],
        b"",
        b"\x0a\xff\xff\xff\x7f",
    ] {
        std::fs::write(dir.join("tokenizer.model"), junk).unwrap();
        let err = format!(
            "{:#}",
            Conversion::new(&dir, FileType::F16).err().expect("junk")
        );
        assert!(err.contains("tokenizer.model"), "{err}");
    }
}
