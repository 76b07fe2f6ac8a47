//! The HTTP server on a tiny synthetic model: many concurrent streams against single
//! requests, clients hanging up, the prefix cache, log-probabilities, and bad input.

mod common;

use common::{Setup, synthetic};
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

fn ids_of(choice: &Value) -> Vec<u32> {
    choice["token_ids"]
        .as_array()
        .expect("token_ids")
        .iter()
        .map(|v| v.as_u64().expect("id") as u32)
        .collect()
}

#[test]
fn concurrent_streams_equal_single_requests_and_hangups_free_their_blocks() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    let srv = std::sync::Arc::new(synthetic(Setup::default(), rng.random()));
    let n_clients = 64;
    let max_tokens = 24;
    let prompts: Vec<Vec<u32>> = (0..n_clients)
        .map(|_| {
            let len = rng.random_range(1..80);
            (0..len).map(|_| rng.random_range(0..512)).collect()
        })
        .collect();

    let handles: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, prompt)| {
            let srv = srv.clone();
            let body = json!({
                "model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "stream": true,
                "stream_options": {"include_usage": true},
            });
            std::thread::spawn(move || {
                let mut sse = srv.stream("/v1/completions", &body);
                let mut ids = Vec::new();
                let mut finish = None;
                let mut usage = None;
                let mut done = false;
                while let Some(data) = sse.next_data() {
                    if i % 4 == 0 && ids.len() == 3 {
                        return None; // hang up mid-stream
                    }
                    if data == "[DONE]" {
                        done = true;
                        break;
                    }
                    let chunk: Value = serde_json::from_str(&data).expect("chunk is JSON");
                    assert_eq!(chunk["object"], "text_completion");
                    if let Some(c) = chunk["choices"].get(0) {
                        if let Some(f) = c["finish_reason"].as_str() {
                            finish = Some(f.to_string());
                        } else {
                            ids.extend(ids_of(c));
                        }
                    }
                    if !chunk["usage"].is_null() {
                        usage = Some(chunk["usage"].clone());
                    }
                }
                assert!(done, "stream {i} ended without [DONE]");
                Some((ids, finish, usage))
            })
        })
        .collect();
    let results: Vec<_> = handles
        .into_iter()
        .map(|h| h.join().expect("client thread"))
        .collect();

    let mut completed = 0;
    for (i, (prompt, res)) in prompts.iter().zip(&results).enumerate() {
        let Some((ids, finish, usage)) = res else {
            assert_eq!(i % 4, 0, "only the hanging-up clients give up");
            continue;
        };
        completed += 1;
        assert_eq!(finish.as_deref(), Some("length"));
        let usage = usage.as_ref().expect("usage chunk");
        assert_eq!(usage["prompt_tokens"], prompt.len());
        assert_eq!(usage["completion_tokens"], max_tokens);
        // The same prompt alone (nothing else running) gives the same tokens.
        let (status, resp) = srv.post(
            "/v1/completions",
            &json!({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}),
        );
        assert_eq!(status, 200, "{resp}");
        assert_eq!(&ids_of(&resp["choices"][0]), ids, "client {i}");
    }
    assert_eq!(completed, n_clients - n_clients / 4);
    srv.wait_idle();
    let total = srv.metric("kestrel_kv_blocks_total");
    let free = srv.metric("kestrel_kv_blocks_free");
    let cached = srv.metric("kestrel_kv_blocks_cached");
    assert_eq!(
        free + cached,
        total,
        "every block is free or idle in the cache"
    );
    assert!(srv.metric("kestrel_requests_cancelled_total") >= 1.0);
    assert!(srv.metric("kestrel_time_to_first_token_seconds_count") >= completed as f64);
}

#[test]
fn identical_prompts_reuse_cached_blocks() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    let srv = synthetic(Setup::default(), rng.random());
    let len = rng.random_range(40..120);
    let prompt: Vec<u32> = (0..len).map(|_| rng.random_range(0..512)).collect();
    let body = json!({"prompt": prompt, "max_tokens": 6, "temperature": 0});
    let (s1, r1) = srv.post("/v1/completions", &body);
    assert_eq!(s1, 200, "{r1}");
    assert_eq!(r1["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let hits_before = srv.metric("kestrel_prefix_cache_hit_blocks_total");
    let (s2, r2) = srv.post("/v1/completions", &body);
    assert_eq!(s2, 200, "{r2}");
    let hits = srv.metric("kestrel_prefix_cache_hit_blocks_total") - hits_before;
    let whole_blocks = (len - 1) / 16;
    assert_eq!(hits as usize, whole_blocks);
    assert_eq!(
        r2["usage"]["prompt_tokens_details"]["cached_tokens"],
        whole_blocks * 16
    );
    assert_eq!(ids_of(&r1["choices"][0]), ids_of(&r2["choices"][0]));
}

#[test]
fn speculation_keeps_greedy_outputs_opts_out_per_request_and_is_counted() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    let seed = rng.random();
    let plain = synthetic(Setup::default(), seed);
    let fast = synthetic(
        Setup {
            speculative: true,
            ..Setup::default()
        },
        seed,
    );
    // A phrase that comes back: something for prompt lookup to find.
    let phrase: Vec<u32> = (0..12).map(|_| rng.random_range(0..512)).collect();
    let prompt = [&phrase[..], &[7, 8], &phrase[..], &phrase[..6]].concat();
    let body = |speculative: bool| json!({"prompt": prompt, "max_tokens": 48, "temperature": 0, "speculative": speculative});
    let (s, want) = plain.post("/v1/completions", &body(true));
    assert_eq!(s, 200, "{want}");
    let (s, opted_out) = fast.post("/v1/completions", &body(false));
    assert_eq!(s, 200, "{opted_out}");
    assert_eq!(fast.metric("kestrel_spec_drafted_tokens_total"), 0.0);
    let (s, got) = fast.post("/v1/completions", &body(true));
    assert_eq!(s, 200, "{got}");
    let drafted = fast.metric("kestrel_spec_drafted_tokens_total");
    let accepted = fast.metric("kestrel_spec_accepted_tokens_total");
    assert!(drafted > 0.0, "nothing drafted");
    assert!(accepted <= drafted);
    assert!(fast.metric("kestrel_spec_mean_accepted_length") >= 0.0);
    let want = ids_of(&want["choices"][0]);
    assert_eq!(ids_of(&opted_out["choices"][0]), want);
    assert_eq!(ids_of(&got["choices"][0]), want);
}

/// A server drafting with a draft model (here the model itself, so every draft is accepted:
/// the CPU is batch-invariant): concurrent greedy requests of different lengths get the
/// plain server's tokens, and /metrics counts the draft model's tokens.
#[test]
fn a_draft_model_keeps_greedy_outputs_and_is_counted() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    let seed = rng.random();
    let setup = |draft_itself| Setup {
        max_seqs: 4,
        draft_itself,
        weight_std: Some(0.08),
        ..Setup::default()
    };
    let plain = std::sync::Arc::new(synthetic(setup(false), seed));
    let fast = std::sync::Arc::new(synthetic(setup(true), seed));
    let bodies: Vec<Value> = [3, 20, 33, 48, 60]
        .iter()
        .map(|&n| {
            let len = rng.random_range(1..40);
            let prompt: Vec<u32> = (0..len).map(|_| rng.random_range(0..512)).collect();
            json!({"prompt": prompt, "max_tokens": n, "temperature": 0})
        })
        .collect();
    let run = |srv: &std::sync::Arc<common::TestServer>| {
        let threads: Vec<_> = bodies
            .iter()
            .map(|body| {
                let (srv, body) = (srv.clone(), body.clone());
                std::thread::spawn(move || {
                    let (s, r) = srv.post("/v1/completions", &body);
                    assert_eq!(s, 200, "{r}");
                    ids_of(&r["choices"][0])
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("client"))
            .collect::<Vec<_>>()
    };
    let want = run(&plain);
    assert_eq!(plain.metric("kestrel_spec_drafted_tokens_total"), 0.0);
    let got = run(&fast);
    for (k, (w, g)) in want.iter().zip(&got).enumerate() {
        assert_eq!(g, w, "request {k}");
        assert_eq!(w.len(), bodies[k]["max_tokens"].as_u64().unwrap() as usize);
    }
    let drafted = fast.metric("kestrel_spec_drafted_tokens_total");
    let accepted = fast.metric("kestrel_spec_accepted_tokens_total");
    assert!(drafted > 0.0, "nothing drafted");
    assert_eq!(accepted, drafted, "the model drafting for itself");
    assert!(fast.metric("kestrel_spec_mean_accepted_length") > 0.0);
}

/// A request with a logit bias is sampled on the host: on a speculating server it does not
/// speculate (nothing drafted) and gets the same tokens as on a plain one.
#[test]
fn biased_requests_do_not_speculate() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    let seed = rng.random();
    let plain = synthetic(Setup::default(), seed);
    let fast = synthetic(
        Setup {
            speculative: true,
            ..Setup::default()
        },
        seed,
    );
    let phrase: Vec<u32> = (0..12).map(|_| rng.random_range(0..512)).collect();
    let prompt = [&phrase[..], &[7, 8], &phrase[..], &phrase[..6]].concat();
    let (s, unbiased) = plain.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 24, "temperature": 0}),
    );
    assert_eq!(s, 200, "{unbiased}");
    // Ban the first token greedy decoding would pick: the bias must take effect.
    let banned = ids_of(&unbiased["choices"][0])[0];
    let body = json!({"prompt": prompt, "max_tokens": 24, "temperature": 0,
        "logit_bias": {banned.to_string(): -100}});
    let (s, want) = plain.post("/v1/completions", &body);
    assert_eq!(s, 200, "{want}");
    let (s, got) = fast.post("/v1/completions", &body);
    assert_eq!(s, 200, "{got}");
    let want = ids_of(&want["choices"][0]);
    assert_ne!(want[0], banned);
    assert_eq!(ids_of(&got["choices"][0]), want);
    assert_eq!(fast.metric("kestrel_spec_drafted_tokens_total"), 0.0);
}

#[test]
fn logprobs_and_seeded_sampling() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    let srv = synthetic(Setup::default(), rng.random());
    let prompt: Vec<u32> = (0..20).map(|_| rng.random_range(0..512)).collect();
    let (status, r) = srv.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 3}),
    );
    assert_eq!(status, 200, "{r}");
    let lp = &r["choices"][0]["logprobs"];
    let token_lps = lp["token_logprobs"].as_array().expect("token_logprobs");
    assert_eq!(token_lps.len(), 5);
    for (chosen, top) in token_lps.iter().zip(lp["top_logprobs"].as_array().unwrap()) {
        // Greedy picks the most likely token: its log-prob is the best of the top ones.
        let best = top
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::NEG_INFINITY, f64::max);
        let chosen = chosen.as_f64().unwrap();
        assert!(
            chosen <= 0.0 && (chosen - best).abs() < 1e-6,
            "{chosen} vs {best}"
        );
    }
    // Same seed, same sample; the sampled tokens differ from greedy at temperature 1.5.
    let seeded = json!({"prompt": prompt, "max_tokens": 16, "temperature": 1.5, "seed": 42});
    let a = srv.post("/v1/completions", &seeded).1;
    let b = srv.post("/v1/completions", &seeded).1;
    assert_eq!(ids_of(&a["choices"][0]), ids_of(&b["choices"][0]));
}

#[test]
fn bad_input_gets_openai_errors_and_the_server_keeps_serving() {
    let srv = synthetic(Setup::default(), 11);
    let long: Vec<u32> = vec![1; 300];
    let cases: Vec<(&str, String, u16)> = vec![
        ("/v1/completions", "{not json".into(), 400),
        ("/v1/completions", "".into(), 400),
        ("/v1/completions", "[1,2]".into(), 400),
        (
            "/v1/completions",
            json!({"prompt": [1, 2], "max_tokens": "ten"}).to_string(),
            400,
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 2], "max_tokens": -5}).to_string(),
            400,
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 2], "max_tokens": 0}).to_string(),
            400,
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 2], "max_tokens": 1_000_000_000_000i64}).to_string(),
            400,
        ),
        (
            "/v1/completions",
            json!({"prompt": long, "max_tokens": 4}).to_string(),
            400,
        ),
        (
            "/v1/completions",
            json!({"model": "gpt-4", "prompt": [1, 2]}).to_string(),
            404,
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 512]}).to_string(),
            400,
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, -2]}).to_string(),
            400,
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 2.5]}).to_string(),
            400,
        ),
        ("/v1/completions", json!({"prompt": []}).to_string(), 400),
        (
            "/v1/completions",
            json!({"prompt": [[1], [2]]}).to_string(),
            400,
        ),
        (
            "/v1/completions",
            json!({"prompt": {"a": 1}}).to_string(),
            400,
        ),
        ("/v1/completions", json!({"max_tokens": 3}).to_string(), 400),
        (
            "/v1/completions",
            json!({"prompt": "text needs a tokenizer"}).to_string(),
            400,
        ),
        (
            "/v1/completions",
            json!({"prompt": [1], "n": 17}).to_string(),
            400,
        ),
        (
            "/v1/completions",
            json!({"prompt": [1], "temperature": -1}).to_string(),
            400,
        ),
        (
            "/v1/completions",
            json!({"prompt": [1], "top_p": 0}).to_string(),
            400,
        ),
        (
            "/v1/completions",
            json!({"prompt": [1], "top_k": -3}).to_string(),
            400,
        ),
        (
            "/v1/completions",
            json!({"prompt": [1], "min_p": 2}).to_string(),
            400,
        ),
        (
            "/v1/completions",
            json!({"prompt": [1], "logprobs": 99}).to_string(),
            400,
        ),
        (
            "/v1/completions",
            json!({"prompt": [1], "stop": ["a", "b", "c", "d", "e"]}).to_string(),
            400,
        ),
        (
            "/v1/completions",
            json!({"prompt": [1], "stop": 7}).to_string(),
            400,
        ),
        (
            "/v1/completions",
            json!({"prompt": [1], "stream": "yes"}).to_string(),
            400,
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}]}).to_string(),
            400,
        ),
        (
            "/v1/chat/completions",
            json!({"messages": "hi"}).to_string(),
            400,
        ),
        ("/v1/nothing", "{}".into(), 404),
    ];
    for (path, body, want) in &cases {
        let (status, err) = srv.post_raw(path, body);
        assert_eq!(status, *want, "{path} {body}: {err}");
        let e = &err["error"];
        assert!(
            e["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{body}: {err}"
        );
        assert!(e["type"].is_string(), "{body}: {err}");
        assert!(e.get("param").is_some() && e.get("code").is_some(), "{err}");
    }
    let (_, err) = srv.post_raw("/v1/completions", &cases[7].1);
    assert_eq!(err["error"]["code"], "context_length_exceeded");
    assert_eq!(err["error"]["param"], "prompt");

    // Still serving, and nothing leaked.
    let (status, ok) = srv.post(
        "/v1/completions",
        &json!({"prompt": [1, 2, 3], "max_tokens": 2}),
    );
    assert_eq!(status, 200, "{ok}");
    assert_eq!(ok["choices"][0]["finish_reason"], "length");
    assert_eq!(ok["usage"]["completion_tokens"], 2);
    srv.wait_idle();
    assert!(srv.metric("kestrel_requests_rejected_total") >= (cases.len() - 1) as f64);
}

#[test]
fn api_key_is_required_on_v1_routes() {
    let srv = synthetic(
        Setup {
            api_key: Some("sekrit".into()),
            ..Setup::default()
        },
        5,
    );
    let url = format!("{}/v1/models", srv.url);
    let no_key = srv.agent.get(&url).call().unwrap();
    assert_eq!(no_key.status().as_u16(), 401);
    let wrong = srv
        .agent
        .get(&url)
        .header("Authorization", "Bearer nope")
        .call()
        .unwrap();
    assert_eq!(wrong.status().as_u16(), 401);
    let mut body = srv
        .agent
        .post(format!("{}/v1/completions", srv.url))
        .send(json!({"prompt": [1]}).to_string())
        .unwrap();
    assert_eq!(body.status().as_u16(), 401);
    let err: Value = serde_json::from_str(&body.body_mut().read_to_string().unwrap()).unwrap();
    assert_eq!(err["error"]["code"], "invalid_api_key");
    // With the key (the helper sends it) everything works; /health needs none.
    let (status, models) = srv.get("/v1/models");
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], "tiny");
    let health = srv.agent.get(format!("{}/health", srv.url)).call().unwrap();
    assert_eq!(health.status().as_u16(), 200);
    let (status, r) = srv.post("/v1/completions", &json!({"prompt": [1], "max_tokens": 1}));
    assert_eq!(status, 200, "{r}");
}

/// A cache of a dozen blocks (`--kv-memory`) under 20 concurrent requests that together need
/// ten times that: admission waits, decodes preempt the newest sequences (the
/// preemption counter on /metrics moves), and every request still completes with the greedy
/// tokens it gets alone. A prompt longer than the whole cache is a 400.
#[test]
fn a_tiny_kv_memory_preempts_and_every_request_completes_unchanged() {
    use kestrel_model::Arch;
    use kestrel_model::synth::SynthConfig;
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    // The tiny model's cache bytes per position: f16 keys and values of every layer.
    let cfg = SynthConfig::tiny(Arch::Qwen2);
    let bytes_per_token = (cfg.n_layer * 2 * cfg.n_head_kv * cfg.head_dim * 2) as usize;
    let blocks: usize = rng.random_range(10..14);
    let kv_memory =
        (blocks * 16 * bytes_per_token + rng.random_range(0..16 * bytes_per_token)) as u64;
    let srv = std::sync::Arc::new(synthetic(
        Setup {
            ctx: 512,
            max_seqs: 8,
            kv_memory: Some(kv_memory),
            ..Setup::default()
        },
        rng.random(),
    ));
    assert_eq!(srv.metric("kestrel_kv_blocks_total") as usize, blocks);
    assert_eq!(
        srv.metric("kestrel_kv_cache_bytes_per_token") as usize,
        bytes_per_token
    );
    let positions = blocks * 16;

    // Longer than the whole cache: refused at once.
    let too_long: Vec<u32> = (0..positions + 1)
        .map(|_| rng.random_range(0..512))
        .collect();
    let (status, resp) = srv.post(
        "/v1/completions",
        &json!({"prompt": too_long, "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(status, 400, "{resp}");
    assert_eq!(resp["error"]["code"], "context_length_exceeded", "{resp}");
    let msg = resp["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("KV cache"), "{msg}");

    let jobs: Vec<(Vec<u32>, usize)> = (0..20)
        .map(|_| {
            let len = rng.random_range(5..70);
            let prompt = (0..len).map(|_| rng.random_range(0..512)).collect();
            (prompt, rng.random_range(20..50))
        })
        .collect();
    let handles: Vec<_> = jobs
        .iter()
        .cloned()
        .map(|(prompt, n)| {
            let srv = srv.clone();
            std::thread::spawn(move || {
                let body = json!({"prompt": prompt, "max_tokens": n, "temperature": 0});
                srv.post("/v1/completions", &body)
            })
        })
        .collect();
    let results: Vec<(u16, Value)> = handles
        .into_iter()
        .map(|h| h.join().expect("client thread"))
        .collect();
    let preemptions = srv.metric("kestrel_preemptions_total");
    assert!(preemptions > 0.0, "the cache was sized to force preemption");
    for (i, ((prompt, n), (status, resp))) in jobs.iter().zip(&results).enumerate() {
        assert_eq!(*status, 200, "request {i}: {resp}");
        assert_eq!(resp["choices"][0]["finish_reason"], "length", "request {i}");
        assert_eq!(resp["usage"]["completion_tokens"], *n, "request {i}");
        // Alone: nothing else runs now.
        let (status, single) = srv.post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": n, "temperature": 0}),
        );
        assert_eq!(status, 200, "{single}");
        assert_eq!(
            ids_of(&resp["choices"][0]),
            ids_of(&single["choices"][0]),
            "request {i} ({} prompt tokens, {preemptions} preemptions)",
            prompt.len()
        );
    }
    srv.wait_idle();
    let free = srv.metric("kestrel_kv_blocks_free");
    let cached = srv.metric("kestrel_kv_blocks_cached");
    assert_eq!(
        free + cached,
        blocks as f64,
        "every block is free or idle in the cache"
    );
}
