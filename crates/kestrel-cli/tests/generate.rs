//! `kestrel run` and `kestrel perplexity` end to end on the real Gemma model, against
//! llama.cpp's reference output.

use std::process::Command;

fn kestrel() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kestrel"))
}

fn reference() -> serde_json::Value {
    let dir = kestrel_hub::reference_dir().expect("reference dir");
    let text = std::fs::read_to_string(dir.join("gemma-3-270m-q4_k_m.llamacpp.json"))
        .expect("reference file");
    serde_json::from_str(&text).expect("json")
}

#[test]
fn run_json_gives_the_reference_prompt_ids_and_greedy_start() {
    let reference = reference();
    let case = &reference["greedy"][0];
    let out = kestrel()
        .args([
            "run",
            "-m",
            "gemma-3-270m",
            "--temp",
            "0",
            "-n",
            "8",
            "--json",
        ])
        .arg(case["prompt"].as_str().unwrap())
        .output()
        .expect("kestrel runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).expect("utf-8");
    let obj: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON object");
    assert_eq!(obj["prompt_ids"], case["prompt_ids"]);
    let ids = obj["ids"].as_array().expect("ids");
    assert_eq!(ids.len(), 8);
    // llama.cpp's greedy continuation of this prompt agrees with ours for 15 tokens.
    assert_eq!(ids[..8], case["greedy_ids"].as_array().unwrap()[..8]);
    assert!(!obj["text"].as_str().unwrap().is_empty());
}

#[test]
fn run_streams_text_and_honours_stop_strings() {
    let out = kestrel()
        .args([
            "run",
            "-m",
            "gemma-3-270m",
            "--temp",
            "0",
            "-n",
            "32",
            "--stop",
            ".",
        ])
        .arg("The capital of France is")
        .output()
        .expect("kestrel runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(!text.trim().is_empty());
    assert!(
        !text.contains('.'),
        "output runs past the stop string: {text:?}"
    );
}

#[test]
fn perplexity_json_has_the_reference_schema_and_value() {
    let reference = reference();
    let dir = kestrel_hub::reference_dir().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let json_path = tmp.path().join("scores.json");
    let out = kestrel()
        .args(["perplexity", "-m", "gemma-3-270m", "--ctx", "128", "-f"])
        .arg(dir.join("text_json_decoder.py.txt"))
        .arg("--json")
        .arg(&json_path)
        .output()
        .expect("kestrel runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ours: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    let theirs = &reference["texts"]["json_decoder"];
    assert_eq!(
        ours["ids"].as_array().unwrap()[..],
        theirs["ids"].as_array().unwrap()[..128]
    );
    let positions = ours["positions"].as_array().unwrap();
    assert_eq!(positions.len(), 127);
    for p in positions {
        assert_eq!(p["top_ids"].as_array().unwrap().len(), 16);
        assert_eq!(p["top_logprobs"].as_array().unwrap().len(), 16);
        assert!(p["next_logprob"].as_f64().unwrap() <= 0.0);
    }
    assert!(ours["ppl"].as_f64().unwrap() > 1.0);
}

#[test]
fn prompts_longer_than_the_context_are_a_clear_error() {
    let out = kestrel()
        .args(["run", "-m", "gemma-3-270m", "-c", "8", "-n", "4"])
        .arg("one two three four five six seven eight nine ten eleven twelve")
        .output()
        .expect("kestrel runs");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("context"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
