//! `kestrel chat` end to end on the real Gemma model with piped input: multi-line input,
//! the context shift when the window fills (system prompt kept), /save and /load.

use std::io::Write;
use std::process::{Command, Stdio};

#[test]
fn chat_shifts_saves_and_loads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let first = dir.path().join("first.json");
    let second = dir.path().join("second.json");
    let input = format!(
        "Hi there\n/save {}\n\"\"\"\nline one\nline two\n\"\"\"\nTell me more \\\nabout it\n\
         And more, more, more words now\n/load {}\n/save {}\n/exit\n",
        first.display(),
        first.display(),
        second.display()
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args([
            "chat",
            "-m",
            "gemma-3-270m",
            "--chat-template",
            "gemma",
            "-c",
            "64",
        ])
        .args(["-n", "8", "--temp", "0", "--system", "Be brief."])
        .env("KESTREL_HOME", dir.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input.as_bytes())
        .expect("write");
    let out = child.wait_with_output().expect("wait");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("context full: dropped the 2 oldest messages; the system prompt stays"),
        "{err}"
    );
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&first).expect("saved")).expect("json");
    let roles: Vec<&str> = saved
        .as_array()
        .expect("array")
        .iter()
        .map(|m| m["role"].as_str().expect("role"))
        .collect();
    assert_eq!(roles, ["system", "user", "assistant"]);
    assert_eq!(saved[1]["content"], "Hi there");
    // Loading a conversation and saving it again gives the same file.
    assert_eq!(
        std::fs::read_to_string(&first).expect("first"),
        std::fs::read_to_string(&second).expect("second")
    );
    // The history of typed messages was kept, multi-line ones whole.
    let history = std::fs::read_to_string(dir.path().join("chat_history")).expect("history");
    assert!(history.contains("Hi there"), "{history}");
}
