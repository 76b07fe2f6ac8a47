//! `kestrel pull` end to end against servers on 127.0.0.1: an interrupted download leaves
//! nothing behind.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Serves the first `sent` bytes of a `total`-byte body, then stalls (until the test ends).
fn stalling_server(total: usize, sent: usize) -> String {
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
            let _ = stream.write_all(&vec![0u8; sent]);
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
        let url = stalling_server(1 << 20, 4096);
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
