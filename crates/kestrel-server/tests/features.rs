//! Structured output, tool calls and the API's extras driven by the official OpenAI Python
//! client on real models (`features_client.py` validates every output), and hostile chat
//! templates against a live server.

mod common;

use std::time::{Duration, Instant};

use common::{Setup, real, real_with_template};
use kestrel_tokenizer::ChatTemplate;
use serde_json::json;

fn run_client(srv: &common::TestServer, group: &str, model: &std::path::Path) {
    let out = std::process::Command::new("python3")
        .arg("tests/features_client.py")
        .arg(&srv.url)
        .arg("test-key")
        .arg("test-model")
        .arg(group)
        .arg(model)
        .output()
        .expect("running python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "features_client.py {group} failed (are `openai` and `jsonschema` installed? see requirements-test.txt)\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("all checks passed"), "{stdout}");
    srv.wait_idle();
}

fn setup() -> Setup {
    Setup {
        ctx: 1024,
        max_seqs: 8,
        batch: 256,
        api_key: Some("test-key".into()),
        ..Setup::default()
    }
}

#[test]
fn structured_output_and_api_extras_through_the_openai_client() {
    let path = kestrel_hub::resolve_model("gemma-3-270m").expect("gemma-3-270m");
    run_client(&real(&path, setup()), "structured", &path);
}

#[test]
fn tool_calls_through_the_openai_client() {
    let path = kestrel_hub::resolve_model("qwen2.5-coder-1.5b").expect("qwen2.5-coder-1.5b");
    run_client(&real(&path, setup()), "tools", &path);
}

#[test]
fn hostile_templates_fail_the_request_and_the_server_keeps_answering() {
    let path = kestrel_hub::resolve_model("gemma-3-270m").expect("gemma-3-270m");
    // One of each kind (the tokenizer's tests cover every limit): a loop, an allocation,
    // a walk of a huge lazy list, recursion.
    let hostile = [
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{{ 'a\nb' | indent(2**62) }}",
        "{{ [1] * 10**12 }}",
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    ];
    for source in hostile {
        let template = ChatTemplate::new("hostile", source).expect("compiles");
        let srv = real_with_template(&path, setup(), template);
        let started = Instant::now();
        let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        let (status, err) = srv.post("/v1/chat/completions", &body);
        assert_eq!(status, 400, "{source}: {err}");
        let message = err["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("chat template"), "{source}: {message}");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{source}: took {:?}",
            started.elapsed()
        );
        let (status, health) = srv.get("/health");
        assert_eq!((status, health.contains("ok")), (200, true), "{source}");
    }
}
