//! The official OpenAI Python client against the server on a real model (Gemma 3 270M).

mod common;

use common::{Setup, real};

#[test]
fn official_openai_client_works_against_the_server() {
    let path = kestrel_hub::resolve_model("gemma-3-270m").expect("gemma-3-270m");
    let srv = real(
        &path,
        Setup {
            ctx: 512,
            max_seqs: 4,
            batch: 128,
            api_key: Some("test-key".into()),
            ..Setup::default()
        },
    );
    let out = std::process::Command::new("python3")
        .arg("tests/openai_client.py")
        .arg(&srv.url)
        .arg("test-key")
        .arg("test-model")
        .output()
        .expect("running python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "openai_client.py failed (is the `openai` package installed? see requirements-test.txt)\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("all checks passed"), "{stdout}");
    srv.wait_idle();
}
