//! The `kestrel` binary end to end: inspect against Python's gguf reader, tokenize against
//! llama.cpp's reference tokenizations, and clean failures on bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value as Json;

fn kestrel(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(args)
        .output()
        .expect("cannot run the kestrel binary")
}

fn stdout(out: &Output) -> String {
    String::from_utf8(out.stdout.clone()).expect("stdout is UTF-8")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn assert_ok(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed ({}): {}",
        out.status,
        stderr(out)
    );
}

/// A user error: exit status 1, an `error:` line, no panic.
fn assert_user_error(out: &Output, must_mention: &str) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(err.starts_with("error: "), "stderr: {err}");
    assert!(
        err.contains(must_mention),
        "stderr should mention {must_mention:?}: {err}"
    );
    assert!(!err.contains("panicked"), "stderr: {err}");
}

fn model_path(name: &str) -> PathBuf {
    kestrel_hub::resolve_model(name).expect("model available")
}

/// Tensors and `<arch>.*` metadata as read by llama.cpp's Python gguf package.
fn python_gguf_summary(path: &Path) -> Json {
    const SCRIPT: &str = r#"
import json, sys
import gguf
r = gguf.GGUFReader(sys.argv[1])
arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
hyper = {}
for name, field in r.fields.items():
    if name.startswith(arch + "."):
        v = field.contents()
        hyper[name] = v
tensors = [
    {"name": t.name, "type": t.tensor_type.name, "shape": [int(d) for d in t.shape],
     "bytes": int(t.n_bytes)}
    for t in r.tensors
]
print(json.dumps({"architecture": arch, "hyper": hyper, "tensors": tensors}))
"#;
    let out = Command::new("python3")
        .args(["-c", SCRIPT])
        .arg(path)
        .output()
        .expect("cannot run python3 (scripts/test.sh installs requirements-test.txt)");
    assert!(
        out.status.success(),
        "python gguf reader failed: {}",
        stderr(&out)
    );
    serde_json::from_slice(&out.stdout).expect("python output is JSON")
}

fn json_numbers_close(a: &Json, b: &Json) -> bool {
    match (a, b) {
        (Json::Number(x), Json::Number(y)) => {
            let (x, y) = (
                x.as_f64().unwrap_or(f64::NAN),
                y.as_f64().unwrap_or(f64::NAN),
            );
            (x - y).abs() <= 1e-6 * x.abs().max(y.abs()).max(1.0)
        }
        (Json::Array(x), Json::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| json_numbers_close(p, q))
        }
        _ => a == b,
    }
}

#[test]
fn inspect_json_matches_python_reader() {
    // Gemma only: gguf-py takes tens of seconds to read Qwen's 151k-entry vocabulary.
    for name in ["gemma-3-270m"] {
        let path = model_path(name);
        let out = kestrel(&["inspect", "--json", name]);
        assert_ok(&out, "inspect --json");
        let ours: Json = serde_json::from_str(&stdout(&out)).expect("inspect --json prints JSON");
        let theirs = python_gguf_summary(&path);

        assert_eq!(ours["architecture"], theirs["architecture"], "{name}");
        let ours_tensors = ours["tensors"].as_array().expect("tensors array");
        let theirs_tensors = theirs["tensors"].as_array().expect("tensors array");
        assert_eq!(
            ours_tensors.len(),
            theirs_tensors.len(),
            "{name}: tensor count"
        );
        assert_eq!(ours["totals"]["n_tensors"], theirs_tensors.len(), "{name}");
        for (o, t) in ours_tensors.iter().zip(theirs_tensors) {
            assert_eq!(o["name"], t["name"]);
            // ggml's names (q4_K) against gguf-py's enum names (Q4_K).
            let upper = |v: &Json| v.as_str().map(str::to_uppercase);
            assert_eq!(upper(&o["type"]), upper(&t["type"]), "{}", t["name"]);
            assert_eq!(o["shape"], t["shape"], "{}", t["name"]);
            assert_eq!(o["bytes"], t["bytes"], "{}", t["name"]);
        }
        let total_bytes: u64 = theirs_tensors
            .iter()
            .map(|t| t["bytes"].as_u64().unwrap_or(0))
            .sum();
        assert_eq!(ours["totals"]["bytes"], total_bytes, "{name}");

        let ours_hyper = ours["hyperparameters"]
            .as_object()
            .expect("hyperparameters object");
        let theirs_hyper = theirs["hyper"].as_object().expect("hyper object");
        let mut ours_keys: Vec<&String> = ours_hyper.keys().collect();
        let mut theirs_keys: Vec<&String> = theirs_hyper.keys().collect();
        ours_keys.sort();
        theirs_keys.sort();
        assert_eq!(ours_keys, theirs_keys, "{name}: hyper-parameter keys");
        for (k, v) in theirs_hyper {
            assert!(
                json_numbers_close(&ours_hyper[k], v),
                "{name} {k}: {} vs {v}",
                ours_hyper[k]
            );
        }
    }
}

#[test]
fn gemma_has_236_tensors_and_text_view_works() {
    let out = kestrel(&["inspect", "gemma-3-270m"]);
    assert_ok(&out, "inspect");
    let text = stdout(&out);
    // 236 is what Python's gguf reader counts in this file.
    assert!(text.contains("architecture:  gemma3"), "{text}");
    assert!(text.contains("tensors (236):"), "{text}");
    assert!(text.contains("chat template: no"), "{text}");
}

fn reference(model_file: &str) -> Json {
    let dir = kestrel_hub::reference_dir().expect("reference dir");
    let text = std::fs::read_to_string(dir.join(model_file)).expect("reference file");
    serde_json::from_str(&text).expect("reference JSON")
}

fn tokenize(model: &str, extra: &[&str], text: &str) -> Vec<u64> {
    let mut args = vec!["tokenize", "-m", model];
    args.extend_from_slice(extra);
    args.extend(["--", text]);
    let out = kestrel(&args);
    assert_ok(&out, "tokenize");
    serde_json::from_str(stdout(&out).trim()).expect("tokenize prints a JSON array")
}

fn ids(v: &Json) -> Vec<u64> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| x.as_u64().expect("id"))
        .collect()
}

#[test]
fn tokenize_matches_llama_cpp() {
    for (model, file, every) in [
        ("gemma-3-270m", "gemma-3-270m-q4_k_m.llamacpp.json", 1),
        // One spawn per string loads the 151k-token vocabulary each time: sample every other.
        (
            "qwen2.5-coder-1.5b",
            "qwen2.5-coder-1.5b-q4_k_m.llamacpp.json",
            2,
        ),
    ] {
        let reference = reference(file);
        let entries = reference["tokenize"].as_array().expect("tokenize entries");
        assert!(!entries.is_empty());
        for entry in entries.iter().step_by(every) {
            let text = entry["text"].as_str().expect("text");
            assert_eq!(
                tokenize(model, &[], text),
                ids(&entry["ids_plain"]),
                "{model} plain {text:?}"
            );
            assert_eq!(
                tokenize(model, &["--add-special", "--parse-special"], text),
                ids(&entry["ids_special"]),
                "{model} special {text:?}"
            );
        }
    }
}

#[test]
fn tokenize_pieces_and_file_input() {
    let reference = reference("gemma-3-270m-q4_k_m.llamacpp.json");
    let entry = &reference["tokenize"][0];
    let text = entry["text"].as_str().expect("text");
    let expected = ids(&entry["ids_plain"]);

    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("input.txt");
    std::fs::write(&file, text).expect("write");
    let file = file.to_str().expect("utf-8 path");
    let out = kestrel(&["tokenize", "-m", "gemma-3-270m", "-f", file]);
    assert_ok(&out, "tokenize -f");
    let from_file: Vec<u64> = serde_json::from_str(stdout(&out).trim()).expect("JSON array");
    assert_eq!(from_file, expected);

    let out = kestrel(&["tokenize", "-m", "gemma-3-270m", "--pieces", "-f", file]);
    assert_ok(&out, "tokenize --pieces");
    let listed: Vec<u64> = stdout(&out)
        .lines()
        .map(|l| {
            l.split_whitespace()
                .next()
                .expect("id column")
                .parse()
                .expect("numeric id")
        })
        .collect();
    assert_eq!(listed, expected);
}

#[test]
fn pull_prints_cached_path_last() {
    let out = kestrel(&["pull", "gemma-3-270m"]);
    assert_ok(&out, "pull");
    let text = stdout(&out);
    let last = text.lines().last().expect("a line");
    assert_eq!(Path::new(last), model_path("gemma-3-270m"));
}

#[test]
fn bad_input_is_a_clean_error() {
    let out = kestrel(&["inspect", "no-such-model-xyz"]);
    assert_user_error(&out, "no-such-model-xyz");
    assert!(
        stderr(&out).contains("gemma-3-270m"),
        "should list the catalog"
    );

    let out = kestrel(&["inspect", "/nonexistent/dir/model.gguf"]);
    assert_user_error(&out, "/nonexistent/dir/model.gguf");

    let out = kestrel(&["tokenize", "-m", "no-such-model-xyz", "hello"]);
    assert_user_error(&out, "no-such-model-xyz");

    let out = kestrel(&["pull", "no-such-model-xyz"]);
    assert_user_error(&out, "no-such-model-xyz");

    // A file that is not GGUF.
    let dir = tempfile::tempdir().expect("tempdir");
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"this is not a gguf file at all, just some text").expect("write");
    let junk = junk.to_str().expect("utf-8 path");
    assert_user_error(&kestrel(&["inspect", junk]), "junk.gguf");
    assert_user_error(&kestrel(&["tokenize", "-m", junk, "hi"]), "junk.gguf");

    let out = kestrel(&[
        "tokenize",
        "-m",
        "gemma-3-270m",
        "-f",
        "/nonexistent/input.txt",
    ]);
    assert_user_error(&out, "/nonexistent/input.txt");

    // Data parallelism needs GPUs: refused before the server binds or loads anything.
    let out = kestrel(&["serve", "-m", junk, "--data-parallel", "2", "--port", "0"]);
    assert_user_error(&out, "--data-parallel 2");
}

/// `bench -d` with quantized caches given in llama.cpp's spelling (`-ctk` / `-ctv`): one
/// row per depth and test, each naming its depth and cache types; an unknown cache type is
/// refused by name.
#[test]
fn bench_at_depth_with_quantized_caches() {
    let m = model_path("gemma-3-270m");
    let m = m.to_str().expect("UTF-8 path");
    let out = kestrel(&[
        "bench", "-m", m, "-d", "0,40", "-p", "8", "-n", "2", "-r", "1", "-ctk", "q8_0", "-ctv",
        "q4_0", "--json",
    ]);
    assert_ok(&out, "bench -d");
    let rows: Json = serde_json::from_str(&stdout(&out)).expect("bench JSON");
    let rows = rows.as_array().expect("rows");
    let field = |r: &Json, k: &str| r[k].as_u64().expect("count");
    let tests: Vec<_> = rows
        .iter()
        .map(|r| (field(r, "n_depth"), field(r, "n_prompt"), field(r, "n_gen")))
        .collect();
    assert_eq!(tests, [(0, 8, 0), (0, 0, 2), (40, 8, 0), (40, 0, 2)]);
    for r in rows {
        assert_eq!(
            (r["type_k"].as_str(), r["type_v"].as_str()),
            (Some("q8_0"), Some("q4_0"))
        );
        assert!(r["avg_ts"].as_f64().expect("rate") > 0.0);
    }
    let bad = kestrel(&["run", "-m", m, "-ctk", "q5_1", "hi"]);
    assert!(!bad.status.success());
    assert!(
        stderr(&bad).contains("unknown cache type \"q5_1\""),
        "{}",
        stderr(&bad)
    );
}

/// `bench --verify`: a row per step size with its milliseconds and, against the single-token
/// steps, its cost in them; a step of no tokens is refused by name.
#[test]
fn bench_verification_steps() {
    let m = model_path("gemma-3-270m");
    let m = m.to_str().expect("UTF-8 path");
    let out = kestrel(&[
        "bench", "-m", m, "--verify", "1,3", "-d", "10", "-n", "2", "-r", "1",
    ]);
    assert_ok(&out, "bench --verify");
    let text = stdout(&out);
    let rows: Vec<Vec<&str>> = text
        .lines()
        .filter(|l| l.starts_with("| 1 |") || l.starts_with("| 3 |"))
        .map(|l| l.trim_matches('|').split('|').map(str::trim).collect())
        .collect();
    assert_eq!(rows.len(), 2, "{text}");
    let num = |s: &str| {
        s.parse::<f64>()
            .unwrap_or_else(|_| panic!("{s:?} in {text}"))
    };
    assert!(num(rows[0][1]) > 0.0 && num(rows[1][1]) > 0.0, "{text}");
    assert_eq!(num(rows[0][2]), 1.0, "{text}");
    assert!(num(rows[1][2]) > 0.0, "{text}");
    let bad = kestrel(&["bench", "-m", m, "--verify", "0,2", "-n", "2"]);
    assert!(!bad.status.success());
    assert!(
        stderr(&bad).contains("at least 1 token"),
        "{}",
        stderr(&bad)
    );
}
