//! `kestrel pull`, `list` and `rm` end to end against servers on 127.0.0.1: names, an
//! interrupted download leaving nothing behind, the Hugging Face endpoint honoured.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Serves `body` announced as `total` bytes, then holds the connection a minute (a stalled
/// transfer when `body` is shorter).
fn server(body: Vec<u8>, total: usize) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!(
        "http://{}/m/model.gguf",
        listener.local_addr().expect("addr")
    );
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let mut reader = BufReader::new(stream.try_clone().expect("clone"));
            let mut line = String::new();
            while reader.read_line(&mut line).is_ok_and(|n| n > 0) && line != "\r\n" {
                line.clear();
            }
            let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {total}\r\n\r\n");
            let _ = stream.write_all(head.as_bytes());
            let _ = stream.write_all(&body);
            let _ = stream.flush();
            std::thread::sleep(Duration::from_secs(60));
        }
    });
    url
}

fn wait_for(path: &Path, limit: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if path.exists() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

#[cfg(unix)]
#[test]
fn interrupted_pull_leaves_nothing() {
    for signal in ["INT", "TERM"] {
        let home = tempfile::tempdir().expect("tempdir");
        let url = server(vec![0u8; 4096], 1 << 20);
        let child = Command::new(env!("CARGO_BIN_EXE_kestrel"))
            .args(["pull", &url])
            .env("KESTREL_HOME", home.path())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        let models = home.path().join("models");
        let partial = models.join("model.gguf.partial");
        assert!(
            wait_for(&partial, Duration::from_secs(20)),
            "no partial file"
        );
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
        let out = child.wait_with_output().expect("wait");
        assert_eq!(out.status.code(), Some(130), "SIG{signal}");
        let left: Vec<_> = std::fs::read_dir(&models).expect("ls").collect();
        assert!(left.is_empty(), "SIG{signal} left {left:?}");
    }
}

fn kestrel(home: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(args)
        .env("KESTREL_HOME", home)
        .env("HF_HOME", home.join("hf"))
        .output()
        .expect("run kestrel")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn url_models_are_named_listed_used_and_removed() {
    let mut writer = kestrel_gguf::GgufWriter::new();
    writer
        .add_metadata(
            "general.architecture",
            kestrel_gguf::Value::String("llama".into()),
        )
        .expect("meta");
    writer
        .add_tensor_with_data("w", &[32, 2], kestrel_gguf::GgmlType::F32, vec![0; 256])
        .expect("tensor");
    let body = writer.write_to_vec().expect("gguf");
    let len = body.len();
    let url = server(body, len);
    let home = tempfile::tempdir().expect("tempdir");
    let h = home.path();

    let out = kestrel(h, &["pull", &url, "--name", "tiny"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    // No progress bar when the output is not a terminal.
    assert!(
        !text(&out.stderr).contains(['\r', '\x1b']),
        "{:?}",
        text(&out.stderr)
    );
    let path = h.join("models/tiny.gguf");
    assert_eq!(
        text(&out.stdout).lines().last(),
        Some(path.to_str().expect("utf-8"))
    );

    let out = kestrel(h, &["list"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let listing = text(&out.stdout);
    let row = listing
        .lines()
        .find(|l| l.starts_with("tiny "))
        .expect("row");
    for cell in ["llama", "f32", url.as_str()] {
        assert!(row.contains(cell), "{cell}: {row}");
    }
    // The name works wherever a model is expected.
    let out = kestrel(h, &["inspect", "tiny"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("llama"));

    // A catalog name is never given to a URL's model.
    let out = kestrel(h, &["pull", &url, "--name", "gemma-3-270m"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("catalog"),
        "{}",
        text(&out.stderr)
    );

    let out = kestrel(h, &["rm", "tiny"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(!path.exists());
    let out = kestrel(h, &["rm", "tiny"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).starts_with("error: no model 'tiny'"));
    let out = kestrel(h, &["list"]);
    assert!(
        text(&out.stdout).starts_with("no models"),
        "{}",
        text(&out.stdout)
    );

    // file:// is refused with the path to use instead.
    let out = kestrel(h, &["pull", "file:///tmp/x.gguf"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("use /tmp/x.gguf"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn hugging_face_names_use_hf_endpoint() {
    // A port nobody listens on: the error names it, so HF_ENDPOINT was used.
    let dead = {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        format!("http://{}", l.local_addr().expect("addr"))
    };
    let home = tempfile::tempdir().expect("tempdir");
    let out = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(["pull", "some-org/some-model-GGUF:Q4_K_M"])
        .env("KESTREL_HOME", home.path())
        .env("HF_HOME", home.path().join("hf"))
        .env("HF_ENDPOINT", &dead)
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("cannot list some-org/some-model-GGUF"),
        "{err}"
    );
    assert!(err.contains(&dead), "{err}");
}
