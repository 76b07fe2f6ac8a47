//! `kestrel run --json-schema / --grammar` on Gemma 3 270M: the output always matches the
//! constraint; bad grammars and hostile chat templates end in a clear error, not a hang.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value as Json;

fn kestrel(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(args)
        .output()
        .expect("cannot run the kestrel binary")
}

fn gemma() -> String {
    kestrel_hub::resolve_model("gemma-3-270m")
        .expect("model available")
        .display()
        .to_string()
}

/// The generated text of a `run --json` invocation.
fn run_text(extra: &[&str], prompt: &str) -> String {
    let model = gemma();
    let mut args = vec!["run", "-m", &model, "--temp", "0", "-n", "40", "--json"];
    args.extend_from_slice(extra);
    args.push(prompt);
    let out = kestrel(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "kestrel run failed: {err}");
    let v: Json = serde_json::from_slice(&out.stdout).expect("one JSON object");
    v["text"].as_str().expect("text").to_string()
}

#[test]
fn run_output_follows_the_schema_or_grammar() {
    let dir = tempfile::tempdir().unwrap();
    let schema = dir.path().join("schema.json");
    std::fs::write(
        &schema,
        r#"{"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
            "n": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["color", "n"], "additionalProperties": false}"#,
    )
    .unwrap();
    let text = run_text(
        &["--json-schema", schema.to_str().unwrap()],
        "A color and a digit as JSON:",
    );
    let v: Json = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
    let keys: Vec<&String> = v.as_object().expect("an object").keys().collect();
    assert_eq!(keys, ["color", "n"], "{text}");
    assert!(
        ["red", "green", "blue"].contains(&v["color"].as_str().unwrap_or("")),
        "{text}"
    );
    assert!((1..=9).contains(&v["n"].as_i64().unwrap_or(0)), "{text}");

    let grammar = dir.path().join("yn.lark");
    std::fs::write(&grammar, "start: \"yes\" | \"no\"\n").unwrap();
    let text = run_text(&["--grammar", grammar.to_str().unwrap()], "Is water wet?");
    assert!(text == "yes" || text == "no", "{text}");
}

#[test]
fn bad_grammars_and_hostile_templates_fail_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let model = gemma();
    let bad = dir.path().join("bad.lark");
    std::fs::write(&bad, "start: (\n").unwrap();
    let out = kestrel(&["run", "-m", &model, "--grammar", bad.to_str().unwrap(), "x"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("bad grammar") && !err.contains("panicked"),
        "{err}"
    );

    let hostile = dir.path().join("loop.jinja");
    std::fs::write(
        &hostile,
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    )
    .unwrap();
    let started = Instant::now();
    let out = kestrel(&[
        "run",
        "-m",
        &model,
        "--chat",
        "--chat-template",
        hostile.to_str().unwrap(),
        "hi",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("chat template") && !err.contains("panicked"),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
}
