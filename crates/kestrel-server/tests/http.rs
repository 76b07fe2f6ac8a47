//! The HTTP layer on a tiny synthetic model: JSON bodies for every error status, unknown
//! fields refused by name, case-insensitive Bearer, CORS, `/v1/models/{id}`, `n > 1`,
//! `logit_bias` checks, the loading phase and the header-read timeout.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{Setup, synthetic};
use serde_json::{Value, json};

/// Sends raw bytes and returns what the server answers until it closes or `wait` passes.
fn raw(addr: std::net::SocketAddr, request: &str, wait: Duration) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(wait)).expect("timeout");
    s.write_all(request.as_bytes()).expect("write");
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
        if out.windows(4).any(|w| w == b"\r\n\r\n") && request.starts_with("OPTIONS") {
            break;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn every_error_has_a_json_body_and_unsupported_fields_are_named() {
    let srv = synthetic(Setup::default(), 7);
    // 405: a GET on a POST route.
    let (status, body) = srv.get("/v1/chat/completions");
    assert_eq!(status, 405);
    let v: Value = serde_json::from_str(&body).expect("405 body is JSON");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("GET"),
        "{v}"
    );
    // 413: a body over the 2 MiB limit.
    let len = (2 << 20) + 1000;
    let resp = raw(
        srv.server.addr,
        &format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n{}",
            " ".repeat(len)
        ),
        Duration::from_secs(5),
    );
    assert!(resp.starts_with("HTTP/1.1 413"), "{resp}");
    assert!(
        resp.contains("\"error\"") && resp.contains("too large"),
        "{resp}"
    );
    // 404 on an unknown route.
    let (status, v) = srv.post("/v2/nothing", &json!({}));
    assert_eq!(
        (status, v["error"]["type"].as_str()),
        (404, Some("invalid_request_error"))
    );
    // Fields Kestrel does not honour are refused by name; `user` is accepted.
    for (field, value) in [
        ("best_of", json!(2)),
        ("suffix", json!("x")),
        ("frobnicate", json!(1)),
    ] {
        let mut body = json!({"prompt": [1, 2], "max_tokens": 1});
        body[field] = value;
        let (status, v) = srv.post("/v1/completions", &body);
        assert_eq!(
            (status, v["error"]["param"].as_str()),
            (400, Some(field)),
            "{v}"
        );
    }
    let (status, _) = srv.post(
        "/v1/completions",
        &json!({"prompt": [1, 2], "max_tokens": 1, "user": "u"}),
    );
    assert_eq!(status, 200);
    // logit_bias must name token ids of the vocabulary, with biases in [-100, 100].
    for bias in [
        json!({"x": 1}),
        json!({"99999999": 1}),
        json!({"5": 500}),
        json!({"5": "a"}),
    ] {
        let body = json!({"prompt": [1, 2], "max_tokens": 1, "logit_bias": bias});
        let (status, v) = srv.post("/v1/completions", &body);
        assert_eq!(
            (status, v["error"]["param"].as_str()),
            (400, Some("logit_bias")),
            "{bias}: {v}"
        );
    }
    // Grammars need a tokenizer, which the synthetic model lacks: a clear 400.
    let (status, v) = srv.post(
        "/v1/completions",
        &json!({"prompt": [1], "max_tokens": 1, "regex": "a+"}),
    );
    assert_eq!(status, 400, "{v}");
    srv.wait_idle();
}

#[test]
fn n_choices_bias_and_models_by_id() {
    let srv = synthetic(Setup::default(), 11);
    let body = json!({"prompt": [3, 4, 5], "max_tokens": 6, "n": 3, "temperature": 1, "seed": 5});
    let (status, v) = srv.post("/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 3);
    let total: u64 = choices
        .iter()
        .map(|c| c["token_ids"].as_array().unwrap().len() as u64)
        .sum();
    assert_eq!(v["usage"]["completion_tokens"].as_u64(), Some(total));
    assert_eq!(v["usage"]["prompt_tokens"].as_u64(), Some(3));
    // Choice i is seeded with seed + i: choice 1 of seed 5 is choice 0 of seed 6.
    let (_, w) = srv.post(
        "/v1/completions",
        &json!({"prompt": [3, 4, 5], "max_tokens": 6, "temperature": 1, "seed": 6}),
    );
    assert_eq!(w["choices"][0]["token_ids"], choices[1]["token_ids"]);
    // A +100 bias makes a token the greedy pick every step.
    let body =
        json!({"prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0, "logit_bias": {"42": 100}});
    let (_, v) = srv.post("/v1/completions", &body);
    assert_eq!(v["choices"][0]["token_ids"], json!([42, 42, 42, 42]));
    // Streaming n = 2: both indices finish, [DONE] ends the stream.
    let mut sse = srv.stream(
        "/v1/completions",
        &json!({"prompt": [1, 2], "max_tokens": 3, "n": 2, "stream": true}),
    );
    let mut finished = [false; 2];
    let mut done = false;
    while let Some(d) = sse.next_data() {
        if d == "[DONE]" {
            done = true;
            break;
        }
        let c: Value = serde_json::from_str(&d).unwrap();
        if let Some(ch) = c["choices"].get(0)
            && ch["finish_reason"].is_string()
        {
            finished[ch["index"].as_u64().unwrap() as usize] = true;
        }
    }
    assert!(done && finished == [true, true], "{finished:?}");
    let (status, m) = srv.get("/v1/models/tiny");
    assert_eq!(status, 200);
    assert_eq!(serde_json::from_str::<Value>(&m).unwrap()["id"], "tiny");
    let (status, _) = srv.get("/v1/models/other");
    assert_eq!(status, 404);
    srv.wait_idle();
}

#[test]
fn bearer_is_case_insensitive_and_cors_answers_preflights() {
    let srv = synthetic(
        Setup {
            api_key: Some("k3y".into()),
            ..Setup::default()
        },
        3,
    );
    for (auth, want) in [
        ("Bearer k3y", "200"),
        ("bearer k3y", "200"),
        ("BEARER k3y", "200"),
        ("Bearer nope", "401"),
        ("Basic k3y", "401"),
    ] {
        let resp = raw(
            srv.server.addr,
            &format!(
                "GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\nConnection: close\r\n\r\n"
            ),
            Duration::from_secs(5),
        );
        assert!(
            resp.starts_with(&format!("HTTP/1.1 {want}")),
            "{auth}: {resp}"
        );
    }
    let resp = raw(
        srv.server.addr,
        "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: https://app.example\r\nAccess-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: authorization, content-type\r\n\r\n",
        Duration::from_secs(5),
    );
    let lower = resp.to_lowercase();
    assert!(
        lower.contains("access-control-allow-origin: https://app.example"),
        "{resp}"
    );
    // Another origin gets no permission.
    let resp = raw(
        srv.server.addr,
        "GET /health HTTP/1.1\r\nHost: x\r\nOrigin: https://evil.example\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    );
    assert!(
        !resp.to_lowercase().contains("access-control-allow-origin"),
        "{resp}"
    );
}

#[test]
fn a_client_that_never_finishes_its_headers_is_dropped() {
    let srv = synthetic(Setup::default(), 5);
    let started = Instant::now();
    let resp = raw(
        srv.server.addr,
        "GET /health HTTP/1.1\r\nHost: x\r\n",
        Duration::from_secs(30),
    );
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(25),
        "still open after {took:?}: {resp}"
    );
    assert!(took >= Duration::from_secs(5), "closed after {took:?}");
    // The server still answers others.
    assert_eq!(srv.get("/health").0, 200);
}

#[test]
fn the_port_answers_while_the_model_loads() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let slot = kestrel_server::app_slot();
    runtime.spawn(kestrel_server::http::serve_slot(
        listener,
        slot.clone(),
        std::future::pending(),
    ));
    let get = |path: &str| {
        raw(
            addr,
            &format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
            Duration::from_secs(5),
        )
    };
    let health = get("/health");
    assert!(
        health.starts_with("HTTP/1.1 503") && health.contains("\"loading\""),
        "{health}"
    );
    let chat = get("/v1/models");
    assert!(
        chat.starts_with("HTTP/1.1 503") && chat.contains("\"error\""),
        "{chat}"
    );
    // Loaded: the application answers on the same port.
    let srv = synthetic(Setup::default(), 9);
    let _ = slot.set(kestrel_server::router(srv.server.state.clone()));
    let health = get("/health");
    assert!(
        health.starts_with("HTTP/1.1 200") && health.contains("\"ok\""),
        "{health}"
    );
}
