//! Hostile GGUF files through the `kestrel` binary: each is refused with one clear error
//! (exit 1, no panic, no abort) or, where it is merely odd, handled.

use std::path::Path;
use std::process::{Command, Output};

use kestrel_gguf::{GgufFile, GgufWriter, Value};
use kestrel_model::config::Arch;
use kestrel_model::synth::{SynthConfig, WeightType, write_synth_to};

fn kestrel(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(args)
        .output()
        .expect("cannot run the kestrel binary")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn assert_refused(out: &Output, must_mention: &str) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(err.contains(must_mention), "want {must_mention:?}: {err}");
    assert!(!err.contains("panicked"), "stderr: {err}");
}

/// A tiny synthetic Llama with one metadata value replaced.
fn tiny_with(path: &Path, key: &str, value: Value) {
    let cfg = SynthConfig::tiny(Arch::Llama);
    let (bytes, _) = write_synth_to(Vec::new(), &cfg, WeightType::F32, 1).expect("synth");
    let file = GgufFile::from_bytes(bytes).expect("parse");
    let mut writer = GgufWriter::from_gguf(&file).expect("writer");
    writer.set_metadata(key, value).expect("set");
    let mut stream = writer.stream_to_path(path).expect("create");
    for info in file.tensors() {
        stream.write_tensor(file.tensor_data(info)).expect("data");
    }
    stream.finish().expect("finish");
}

#[test]
fn absurd_sizes_are_refused_before_allocating() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("m.gguf");
    let p = path.to_str().expect("utf-8");
    // Each of these used to abort on a multi-terabyte allocation.
    tiny_with(&path, "llama.block_count", Value::U32(1 << 31));
    assert_refused(&kestrel(&["run", "-m", p, "hi"]), "block_count");
    tiny_with(&path, "llama.context_length", Value::U64(1 << 40));
    assert_refused(
        &kestrel(&["run", "-m", p, "-c", "0", "hi"]),
        "context_length",
    );
    // A possible context whose cache cannot fit memory (2 TiB): the most that fits is named.
    tiny_with(&path, "llama.context_length", Value::U32(i32::MAX as u32));
    let out = kestrel(&["run", "-m", p, "-c", "2000000000", "hi"]);
    assert_refused(&out, "pass a smaller -c (at most");
}

/// GGUF v3 bytes by hand (the writer refuses names longer than llama.cpp's 63 bytes, which
/// is the point here): one string key, then `f32` tensors of 4 values each.
fn raw_gguf(names: &[&str]) -> Vec<u8> {
    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }
    let mut out = b"GGUF".to_vec();
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(names.len() as u64).to_le_bytes());
    out.extend_from_slice(&1u64.to_le_bytes());
    string(&mut out, "general.architecture");
    out.extend_from_slice(&8u32.to_le_bytes()); // string
    string(&mut out, "llama");
    for (i, name) in names.iter().enumerate() {
        string(&mut out, name);
        out.extend_from_slice(&1u32.to_le_bytes()); // n_dims
        out.extend_from_slice(&4u64.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes()); // f32
        out.extend_from_slice(&(i as u64 * 32).to_le_bytes());
    }
    out.resize(out.len().next_multiple_of(32), 0);
    out.resize(out.len() + names.len() * 32, 0);
    out
}

#[test]
fn inspect_prints_tensor_names_of_any_length() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("long.gguf");
    // Format widths stop at 65,535: a longer name used to panic the table.
    let long = "t".repeat(70_000);
    std::fs::write(&path, raw_gguf(&[&long, "short"])).expect("write");
    let out = kestrel(&["inspect", path.to_str().expect("utf-8")]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let row = text.lines().find(|l| l.contains(&long)).expect("long row");
    assert!(row.ends_with(" 16"), "{}", &row[row.len() - 60..]);
    assert!(text.lines().any(|l| l.trim_start().starts_with("short ")));
}
