//! A server in-process on 127.0.0.1:0 over a tiny synthetic model (or a real one), and a
//! small blocking HTTP client.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::sync::Arc;

use kestrel_cpu::{CpuBackend, Kernels};
use kestrel_engine::scheduler::{self, SchedulerOptions, SchedulerSpec};
use kestrel_engine::spec::{MultiDraftModel, MultiDrafter};
use kestrel_engine::{Engine, EngineOptions, KvCacheSize};
use kestrel_gguf::GgufFile;
use kestrel_model::Arch;
use kestrel_model::synth::{SynthConfig, WeightType, write_synth};
use kestrel_server::{AppState, RunningServer};
use kestrel_tokenizer::{ChatTemplate, Tokenizer};
use serde_json::Value;

pub struct TestServer {
    pub server: RunningServer,
    pub url: String,
    pub agent: ureq::Agent,
    pub api_key: Option<String>,
    _dir: Option<tempfile::TempDir>,
}

pub struct Setup {
    pub ctx: usize,
    pub max_seqs: usize,
    pub batch: usize,
    pub api_key: Option<String>,
    /// Prompt-lookup speculation for greedy requests.
    pub speculative: bool,
    /// Speculation with the model itself as the draft model (`--draft`), instead of
    /// prompt lookup: a draft sequence for each of up to `max_seqs` requests.
    pub draft_itself: bool,
    /// The synthetic model's weight spread (None: the tiny model's 0.02, whose greedy
    /// output soon repeats one token).
    pub weight_std: Option<f32>,
    /// The KV cache in bytes (`--kv-memory`); None: `max_seqs` full contexts.
    pub kv_memory: Option<u64>,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            ctx: 256,
            max_seqs: 16,
            batch: 128,
            api_key: None,
            speculative: false,
            draft_itself: false,
            weight_std: None,
            kv_memory: None,
        }
    }
}

/// A tiny random-weight Qwen2 (no tokenizer) written to a temporary file.
pub fn synthetic(setup: Setup, seed: u64) -> TestServer {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    let mut cfg = SynthConfig::tiny(Arch::Qwen2);
    if let Some(std) = setup.weight_std {
        cfg.weight_std = std;
    }
    let ty: WeightType = "q8_0".parse().expect("type");
    write_synth(&path, &cfg, ty, seed).expect("synth");
    let mut s = start(&path, setup, "tiny");
    s._dir = Some(dir);
    s
}

/// A model file with its tokenizer and chat template.
pub fn real(path: &Path, setup: Setup) -> TestServer {
    start(path, setup, "test-model")
}

/// A model file with its tokenizer and the given chat template.
pub fn real_with_template(path: &Path, setup: Setup, template: ChatTemplate) -> TestServer {
    start_with(path, setup, "test-model", Some(template))
}

fn start(path: &Path, setup: Setup, name: &str) -> TestServer {
    start_with(path, setup, name, None)
}

fn start_with(path: &Path, setup: Setup, name: &str, template: Option<ChatTemplate>) -> TestServer {
    let file = Arc::new(GgufFile::open(path).expect("open model"));
    let tokenizer = Tokenizer::from_gguf(&file).ok();
    // The file's template, else the family's built-in one (as `kestrel serve` does).
    let family = match file.architecture() {
        Some("gemma3") => "gemma",
        Some("llama") => "llama3",
        _ => "chatml",
    };
    let template = template.or_else(|| {
        ChatTemplate::resolve(&file, None)
            .or_else(|_| ChatTemplate::resolve(&file, Some(family)))
            .ok()
    });
    let opts = EngineOptions {
        ctx: setup.ctx,
        max_batch_tokens: setup.batch,
        // Drafts (8 per sequence while speculating) take rows of their own.
        max_logit_rows: setup.max_seqs
            * if setup.speculative || setup.draft_itself {
                9
            } else {
                1
            },
        block_size: 16,
        max_seqs: setup.max_seqs,
    };
    let engine_file = file.clone();
    let size = setup
        .kv_memory
        .map_or(KvCacheSize::PerSequence, KvCacheSize::Bytes);
    let (draft_file, draft_opts) = (file.clone(), opts.clone());
    let draft_itself = setup.draft_itself;
    let sched = scheduler::spawn_with(
        move || {
            let backend = CpuBackend::new(Kernels::Fast);
            Engine::with_cache_size(backend, engine_file, &opts, Default::default(), size)
        },
        move || {
            if !draft_itself {
                return Ok(None);
            }
            let opts = EngineOptions {
                max_logit_rows: 1,
                ..draft_opts
            };
            let engine = Engine::new(CpuBackend::new(Kernels::Fast), draft_file.clone(), &opts)?;
            let slots = opts.max_seqs;
            let d = MultiDraftModel::new(engine, &draft_file, &draft_file, slots)?;
            Ok(Some(Box::new(d) as Box<dyn MultiDrafter>))
        },
        SchedulerOptions {
            max_seqs: setup.max_seqs,
            max_prefill_tokens: setup.batch / 2,
            prefix_cache: true,
            eog: tokenizer
                .as_ref()
                .map(|t| t.eog_ids().to_vec())
                .unwrap_or_default(),
            spec: (setup.speculative || setup.draft_itself).then_some(SchedulerSpec {
                ngram_min: 1,
                ngram_max: 3,
                draft_min: 1,
                draft_max: 8,
                max_seqs: setup.max_seqs,
            }),
        },
    )
    .expect("scheduler");
    let state = AppState::new(sched, tokenizer, template, name, setup.api_key.clone())
        .with_cors(Some("https://app.example".into()));
    let server = kestrel_server::spawn(state, "127.0.0.1:0".parse().unwrap()).expect("bind");
    let url = format!("http://{}", server.addr);
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    TestServer {
        server,
        url,
        agent,
        api_key: setup.api_key,
        _dir: None,
    }
}

impl TestServer {
    /// POSTs raw `body`; returns the status and the body parsed as JSON (Null if it is not).
    pub fn post_raw(&self, path: &str, body: &str) -> (u16, Value) {
        let mut req = self
            .agent
            .post(format!("{}{path}", self.url))
            .header("Content-Type", "application/json");
        if let Some(k) = &self.api_key {
            req = req.header("Authorization", format!("Bearer {k}"));
        }
        let mut resp = req.send(body).expect("request");
        let status = resp.status().as_u16();
        let text = resp.body_mut().read_to_string().expect("body");
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.post_raw(path, &body.to_string())
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        let mut req = self.agent.get(format!("{}{path}", self.url));
        if let Some(k) = &self.api_key {
            req = req.header("Authorization", format!("Bearer {k}"));
        }
        let mut resp = req.call().expect("request");
        let status = resp.status().as_u16();
        (status, resp.body_mut().read_to_string().expect("body"))
    }

    /// Opens a streaming request; returns a reader of its SSE `data:` payloads.
    pub fn stream(&self, path: &str, body: &Value) -> SseReader {
        let mut req = self
            .agent
            .post(format!("{}{path}", self.url))
            .header("Content-Type", "application/json");
        if let Some(k) = &self.api_key {
            req = req.header("Authorization", format!("Bearer {k}"));
        }
        let resp = req.send(body.to_string()).expect("request");
        assert_eq!(resp.status().as_u16(), 200, "stream request refused");
        SseReader {
            lines: BufReader::new(resp.into_body().into_reader()),
        }
    }

    /// A metric's value from /metrics.
    pub fn metric(&self, name: &str) -> f64 {
        let (status, text) = self.get("/metrics");
        assert_eq!(status, 200);
        text.lines()
            .find_map(|l| {
                let (n, v) = l.split_once(' ')?;
                (n == name).then(|| v.parse().ok()).flatten()
            })
            .unwrap_or_else(|| panic!("metric {name} missing"))
    }

    /// Waits until no sequence runs, none waits and no block is held.
    pub fn wait_idle(&self) {
        for _ in 0..1000 {
            if self.metric("kestrel_running_sequences") == 0.0
                && self.metric("kestrel_queue_length") == 0.0
                && self.metric("kestrel_kv_blocks_used") == 0.0
            {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        panic!("the server did not go idle");
    }
}

pub struct SseReader {
    lines: BufReader<ureq::BodyReader<'static>>,
}

impl SseReader {
    /// The next `data:` payload; None at the end of the stream.
    pub fn next_data(&mut self) -> Option<String> {
        let mut line = String::new();
        loop {
            line.clear();
            if self.lines.read_line(&mut line).ok()? == 0 {
                return None;
            }
            if let Some(d) = line.trim_end().strip_prefix("data: ") {
                return Some(d.to_string());
            }
        }
    }
}
