//! `/v1/embeddings` against llama.cpp (llama-cpp-python, through the official OpenAI client in
//! `embeddings_client.py`) on the catalog models and on synthetic models declaring their
//! pooling, plus the refusals and the endpoint beside running generations.

mod common;

use std::path::Path;

use common::{Setup, TestServer, real};
use kestrel_gguf::{GgufFile, GgufWriter, Value as GgufValue};
use kestrel_model::Arch;
use kestrel_model::synth::{SynthConfig, WeightType, write_synth_to};
use serde_json::{Value, json};

fn setup() -> Setup {
    Setup {
        ctx: 512,
        max_seqs: 4,
        // Inputs longer than 64 tokens are evaluated in chunks.
        batch: 64,
        api_key: None,
        speculative: false,
        ..Setup::default()
    }
}

/// Runs `embeddings_client.py MODE` against `srv`; fails with its output.
fn oracle(mode: &str, srv: &TestServer, path: &Path, pooling: u32) {
    let seed: u32 = rand::random();
    let out = std::process::Command::new("python3")
        .arg("tests/embeddings_client.py")
        .arg(mode)
        .arg(&srv.url)
        .arg(path)
        .arg(seed.to_string())
        .arg(pooling.to_string())
        .output()
        .expect("running python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(3) {
        eprintln!("{}", stderr.trim());
        return;
    }
    println!("{stdout}");
    assert!(
        out.status.success() && stdout.contains("all checks passed"),
        "embeddings_client.py {mode} (seed {seed}) failed (needs llama-cpp-python, openai, \
         numpy: requirements-test.txt)\n{stdout}\n{stderr}"
    );
}

/// llama.cpp's number for last-token pooling, which Kestrel uses when a model states none.
const LAST: u32 = 3;

#[test]
fn gemma_embeddings_match_llama_cpp() {
    let path = kestrel_hub::resolve_model("gemma-3-270m").expect("gemma-3-270m");
    let srv = real(&path, setup());
    oracle("text", &srv, &path, LAST);
    srv.wait_idle();
}

#[test]
fn qwen_embeddings_match_llama_cpp() {
    let path = kestrel_hub::resolve_model("qwen2.5-coder-1.5b").expect("qwen2.5-coder-1.5b");
    let srv = real(&path, setup());
    oracle("text", &srv, &path, LAST);
    srv.wait_idle();
}

/// A tiny synthetic Qwen2 whose file states `qwen2.pooling_type = pooling`.
fn synthetic_with_pooling(path: &Path, pooling: u32) {
    let cfg = SynthConfig::tiny(Arch::Qwen2);
    let ty: WeightType = "q8_0".parse().expect("type");
    let (bytes, _) = write_synth_to(Vec::new(), &cfg, ty, 7 + pooling as u64).expect("synth");
    let file = GgufFile::from_bytes(bytes).expect("parse");
    let mut writer = GgufWriter::from_gguf(&file).expect("writer");
    writer
        .set_metadata("qwen2.pooling_type", GgufValue::U32(pooling))
        .expect("set");
    let mut stream = writer.stream_to_path(path).expect("create");
    for info in file.tensors() {
        stream.write_tensor(file.tensor_data(info)).expect("data");
    }
    stream.finish().expect("finish");
}

#[test]
fn declared_mean_cls_and_last_pooling_match_llama_cpp() {
    let dir = tempfile::tempdir().expect("tempdir");
    for pooling in [1, 2, 3] {
        let path = dir.path().join(format!("pool{pooling}.gguf"));
        synthetic_with_pooling(&path, pooling);
        let srv = real(&path, setup());
        oracle("ids", &srv, &path, pooling);
        srv.wait_idle();
    }
}

fn error_of(srv: &TestServer, body: Value) -> (u16, Value) {
    let (status, v) = srv.post("/v1/embeddings", &body);
    let err = &v["error"];
    assert!(err["message"].is_string(), "{status}: {v}");
    (status, err.clone())
}

#[test]
fn bad_requests_are_400s_with_json_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("mean.gguf");
    synthetic_with_pooling(&path, 1);
    let srv = real(&path, setup());
    let long = vec![1u32; 513];
    for (body, param) in [
        (json!({"input": []}), "input"),
        (json!({"input": ""}), "input"),
        (json!({"input": [[]]}), "input"),
        (json!({"input": [[1, 2], "x", 3]}), "input"),
        (json!({"input": [1.5]}), "input"),
        (json!({"input": [-1]}), "input"),
        (json!({"input": {"text": "x"}}), "input"),
        (json!({"input": null}), "input"),
        (json!({"input": [[1, 512]]}), "input"),
        (json!({ "input": [long] }), "input"),
        // No tokenizer: text cannot be embedded.
        (json!({"input": "hello"}), "input"),
        (json!({"input": [1], "dimensions": 255}), "dimensions"),
        (json!({"input": [1], "dimensions": "256"}), "dimensions"),
        (
            json!({"input": [1], "encoding_format": "int8"}),
            "encoding_format",
        ),
        (json!({"input": [1], "pooling": "cls"}), "pooling"),
        (json!({"input": [1], "model": 3}), "model"),
    ] {
        let (status, err) = error_of(&srv, body.clone());
        assert_eq!(status, 400, "{body}: {err}");
        assert_eq!(err["param"], param, "{body}: {err}");
    }
    let (_, err) = error_of(&srv, json!({ "input": [long] }));
    assert_eq!(err["code"], "context_length_exceeded");
    let (status, _) = error_of(&srv, json!({"input": [1], "model": "other"}));
    assert_eq!(status, 404);
    let (status, _) = srv.post_raw("/v1/embeddings", "{\"input\": [1,");
    assert_eq!(status, 400);
    // The model's own width is accepted; `user` is harmless.
    let (status, v) = srv.post(
        "/v1/embeddings",
        &json!({"input": [1, 2], "dimensions": 256, "user": "u"}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["data"][0]["embedding"].as_array().map(Vec::len),
        Some(256)
    );
    assert_eq!(v["usage"]["prompt_tokens"], 2);
    srv.wait_idle();
}

#[test]
fn pooling_none_and_rank_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    for pooling in [0, 4] {
        let path = dir.path().join(format!("p{pooling}.gguf"));
        synthetic_with_pooling(&path, pooling);
        let srv = real(&path, setup());
        let (status, err) = error_of(&srv, json!({"input": [1, 2, 3]}));
        assert_eq!(status, 400);
        assert!(
            err["message"].as_str().unwrap_or("").contains("pooling"),
            "{err}"
        );
    }
    // An unknown pooling number is a load error naming the key.
    let path = dir.path().join("p9.gguf");
    synthetic_with_pooling(&path, 9);
    let file = GgufFile::open(&path).expect("open");
    let err = kestrel_model::ModelConfig::from_gguf(&file).expect_err("pooling 9 accepted");
    assert!(err.to_string().contains("pooling_type"), "{err}");
}

/// Embeddings between running generations: each side gets what it gets alone (the
/// CPU's products are batch-invariant, and embedding steps hold only embedding inputs).
#[test]
fn embeddings_beside_generations_change_neither() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("mean.gguf");
    synthetic_with_pooling(&path, 1);
    let srv = real(&path, setup());
    let inputs = json!([
        [5, 6, 7],
        (0..150).map(|i| (i * 7) % 512).collect::<Vec<_>>(),
        [9]
    ]);
    let embed = |srv: &TestServer| {
        let (status, v) = srv.post("/v1/embeddings", &json!({"input": inputs}));
        assert_eq!(status, 200, "{v}");
        v["data"].clone()
    };
    let gen_body = json!({"prompt": [1, 2, 3, 4, 5], "max_tokens": 40, "temperature": 0});
    let generate = |srv: &TestServer| {
        let (status, v) = srv.post("/v1/completions", &gen_body);
        assert_eq!(status, 200, "{v}");
        v["choices"][0]["token_ids"].clone()
    };
    let alone_embed = embed(&srv);
    let alone_gen = generate(&srv);
    std::thread::scope(|s| {
        let gens: Vec<_> = (0..3).map(|_| s.spawn(|| generate(&srv))).collect();
        let embeds: Vec<_> = (0..3).map(|_| s.spawn(|| embed(&srv))).collect();
        for g in gens {
            assert_eq!(g.join().expect("generation"), alone_gen);
        }
        for e in embeds {
            assert_eq!(e.join().expect("embedding"), alone_embed);
        }
    });
    srv.wait_idle();
}
