//! `kestrel run`'s inputs and llama.cpp idioms on the real Gemma model: the prompt from an
//! argument, a file, stdin or token ids gives the same greedy tokens; nonsense values are
//! usage errors (exit 2) and doubtful ones warnings.

use std::io::Write;
use std::process::{Command, Output, Stdio};

use serde_json::Value as Json;

const PROMPT: &str = "The capital of France is";

fn kestrel(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run kestrel");
    let mut pipe = child.stdin.take().expect("stdin");
    pipe.write_all(stdin.unwrap_or("").as_bytes())
        .expect("write stdin");
    drop(pipe);
    child.wait_with_output().expect("wait")
}

fn greedy(extra: &[&str], stdin: Option<&str>) -> Json {
    let mut args = vec![
        "run",
        "-m",
        "gemma-3-270m",
        "--temp",
        "0",
        "-n",
        "4",
        "--json",
    ];
    args.extend_from_slice(extra);
    let out = kestrel(&args, stdin);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    // The measured times differ from run to run; the counts in "timings" stay compared.
    let timings = json["timings"].as_object_mut().expect("timings");
    for key in ["prompt_s", "gen_s"] {
        assert!(timings.remove(key).is_some_and(|t| t.is_f64()), "{key}");
    }
    json
}

#[test]
fn every_prompt_source_gives_the_same_tokens() {
    let reference = greedy(&[PROMPT], None);
    assert_eq!(reference["ids"].as_array().expect("ids").len(), 4);
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("prompt.txt");
    std::fs::write(&file, PROMPT).expect("write");
    let file = file.to_str().expect("utf-8");
    assert_eq!(greedy(&["-f", file], None), reference);
    assert_eq!(greedy(&["-"], Some(PROMPT)), reference);
    assert_eq!(greedy(&["-f", "-"], Some(PROMPT)), reference);
    // The prompt's ids, given raw, continue the same way.
    let ids = dir.path().join("ids.json");
    std::fs::write(&ids, reference["prompt_ids"].to_string()).expect("write");
    let from_ids = greedy(&["--ids", ids.to_str().expect("utf-8")], None);
    assert_eq!(from_ids["ids"], reference["ids"]);
    // -c 0 takes the model's context; --seed -1 is llama.cpp's random seed.
    assert_eq!(
        greedy(&["-c", "0", "--seed", "-1", PROMPT], None)["ids"],
        reference["ids"]
    );

    std::fs::write(dir.path().join("bad.json"), "[1, -2]").expect("write");
    let bad = dir.path().join("bad.json");
    let out = kestrel(
        &[
            "run",
            "-m",
            "gemma-3-270m",
            "--ids",
            bad.to_str().expect("utf-8"),
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("JSON array of token ids"));
}

#[test]
fn nonsense_is_a_usage_error_and_doubt_a_warning() {
    for (args, flag) in [
        (&["run", "--batch", "0", "hi"][..], "--batch"),
        (&["run", "-t", "0", "hi"][..], "--threads"),
        (&["run", "--seed", "-2", "hi"][..], "--seed"),
        (&["run"][..], "PROMPT"),
        (&["run", "-f", "a.txt", "hi"][..], "--file"),
        (&["perplexity", "-m", "gemma-3-270m"][..], "--file"),
        (
            &["perplexity", "-f", "x.txt", "--chunks", "0"][..],
            "--chunks",
        ),
    ] {
        let out = kestrel(args, None);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.starts_with("error: ") && err.contains(flag),
            "{args:?}: {err}"
        );
    }
    let out = kestrel(
        &[
            "run",
            "-m",
            "gemma-3-270m",
            "-n",
            "1",
            "-t",
            "64",
            "--chat-template",
            "chatml",
            PROMPT,
        ],
        None,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("warning: -t 64"), "{err}");
    assert!(
        err.contains("warning: --chat-template has no effect"),
        "{err}"
    );
}

/// A model without a tokenizer (`kestrel synth`) runs from token ids and prints ids; the
/// ids are the same with prompt lookup on, and a text prompt is a clear error.
#[test]
fn a_tokenizer_less_model_runs_on_ids() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("tiny.gguf");
    let model = model.to_str().expect("utf-8 path");
    let out = kestrel(
        &["synth", "--arch", "llama", "--type", "q8_0", "-o", model],
        None,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ids = dir.path().join("ids.json");
    std::fs::write(&ids, "[1, 5, 9, 200, 31, 7, 64, 12]").expect("write");
    let ids = ids.to_str().expect("utf-8 path");
    let run = |extra: &[&str]| {
        let mut args = vec!["run", "-m", model, "--ids", ids, "--temp", "0", "-n", "24"];
        args.extend_from_slice(extra);
        kestrel(&args, None)
    };
    let generated = |out: &Output| -> Vec<u64> {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let json: Json = serde_json::from_slice(&out.stdout).expect("json");
        json["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|v| v.as_u64().expect("id"))
            .collect()
    };
    let plain = generated(&run(&["--json"]));
    assert_eq!(plain.len(), 24);
    assert_eq!(generated(&run(&["--json", "--spec", "ngram"])), plain);
    // Without --json the ids are printed, space-separated.
    let printed = run(&[]);
    assert!(printed.status.success());
    let shown: Vec<u64> = String::from_utf8_lossy(&printed.stdout)
        .split_whitespace()
        .map(|t| t.parse().expect("an id"))
        .collect();
    assert_eq!(shown, plain);
    let text = kestrel(&["run", "-m", model, "hello"], None);
    assert_eq!(text.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&text.stderr).contains("no tokenizer"));
}
