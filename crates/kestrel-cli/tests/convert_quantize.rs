//! `kestrel quantize` and `kestrel convert` end to end: a requantization with its warning
//! gives a file whose tensors have the chosen types, and failures leave no output behind.
//! (The tensors themselves are checked against llama.cpp in kestrel-convert's tests.)

use std::process::{Command, Output};

use serde_json::Value as Json;

fn kestrel(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(args)
        .output()
        .expect("cannot run the kestrel binary")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Exit status 1, an `error:` line mentioning `what`, no panic.
fn assert_user_error(out: &Output, what: &str) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(
        err.starts_with("error: ") && err.contains(what),
        "stderr: {err}"
    );
}

#[test]
fn quantize_requantizes_with_a_warning_and_fails_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).to_string_lossy().into_owned();
    let synth = kestrel(&[
        "synth",
        "--arch",
        "qwen2",
        "--type",
        "q4_0",
        "-o",
        &p("in.gguf"),
    ]);
    assert!(synth.status.success(), "{}", stderr(&synth));

    let out = kestrel(&["quantize", "-t", "2", &p("in.gguf"), &p("out.gguf"), "q8_0"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("warning: requantizing"),
        "{}",
        stderr(&out)
    );
    let inspect = kestrel(&["inspect", &p("out.gguf"), "--json"]);
    assert!(inspect.status.success(), "{}", stderr(&inspect));
    let info: Json = serde_json::from_slice(&inspect.stdout).unwrap();
    let text = info.to_string();
    assert!(text.contains("q8_0") && !text.contains("q4_0"), "{text}");

    for (args, what) in [
        (
            vec![p("in.gguf"), p("bad-type.gguf"), "Q9_K".into()],
            "unknown quantization type",
        ),
        (
            vec![p("missing.gguf"), p("no-input.gguf"), "q8_0".into()],
            "missing.gguf",
        ),
    ] {
        let mut all = vec!["quantize".to_string()];
        all.extend(args.clone());
        let refs: Vec<&str> = all.iter().map(String::as_str).collect();
        assert_user_error(&kestrel(&refs), what);
        assert!(
            !std::path::Path::new(&args[1]).exists(),
            "{} was written",
            args[1]
        );
    }
    // Nothing but the two files (no temporary left over).
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
}

#[test]
fn convert_fails_cleanly_without_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.gguf");
    let o = out.to_string_lossy().into_owned();
    let d = dir.path().to_string_lossy().into_owned();
    assert_user_error(&kestrel(&["convert", &d, "-o", &o]), "config.json");
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"architectures": ["BertModel"]}"#,
    )
    .unwrap();
    assert_user_error(
        &kestrel(&["convert", &d, "-o", &o]),
        "unsupported architecture BertModel",
    );
    assert_user_error(&kestrel(&["convert", &d, "-o", &o, "--type", "q7"]), "q7");
    assert!(!out.exists());
}

/// `--imatrix`: a legacy `.dat` matrix is read (its summary printed) and changes the
/// output; a malformed one is a one-line error that writes nothing.
#[test]
fn quantize_with_an_imatrix_and_a_malformed_one() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).to_string_lossy().into_owned();
    let synth = kestrel(&[
        "synth",
        "--arch",
        "llama",
        "--type",
        "f16",
        "--embd",
        "256",
        "--ff",
        "512",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "-o",
        &p("in.gguf"),
    ]);
    assert!(synth.status.success(), "{}", stderr(&synth));
    // One entry, for blk.0.ffn_down.weight (rows of 512), ncall 2, then chunk count and
    // dataset name.
    let name = b"blk.0.ffn_down.weight";
    let mut dat = 1i32.to_le_bytes().to_vec();
    dat.extend((name.len() as i32).to_le_bytes());
    dat.extend(name);
    dat.extend(2i32.to_le_bytes());
    dat.extend(512i32.to_le_bytes());
    for i in 0..512 {
        dat.extend((1.0f32 + (i % 7) as f32 * 3.0).to_le_bytes());
    }
    dat.extend(5i32.to_le_bytes());
    dat.extend(4i32.to_le_bytes());
    dat.extend(b"wiki");
    std::fs::write(p("m.dat"), &dat).unwrap();
    let with = kestrel(&[
        "quantize",
        &p("in.gguf"),
        &p("with.gguf"),
        "q4_k_m",
        "--imatrix",
        &p("m.dat"),
    ]);
    assert!(with.status.success(), "{}", stderr(&with));
    assert!(
        stderr(&with).contains("1 entries, 5 chunks, dataset wiki"),
        "{}",
        stderr(&with)
    );
    let without = kestrel(&["quantize", &p("in.gguf"), &p("without.gguf"), "q4_k_m"]);
    assert!(without.status.success(), "{}", stderr(&without));
    assert_ne!(
        std::fs::read(p("with.gguf")).unwrap(),
        std::fs::read(p("without.gguf")).unwrap()
    );

    std::fs::write(p("bad.dat"), &dat[..30]).unwrap();
    let out = kestrel(&[
        "quantize",
        &p("in.gguf"),
        &p("bad.gguf"),
        "q4_k_m",
        "--imatrix",
        &p("bad.dat"),
    ]);
    assert_user_error(&out, "bad importance matrix");
    assert_eq!(stderr(&out).lines().count(), 1, "{}", stderr(&out));
    assert!(!std::path::Path::new(&p("bad.gguf")).exists());
}
