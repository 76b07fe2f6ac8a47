//! kestrel-server: an OpenAI-compatible HTTP API over the continuous-batching scheduler.
//!
//! Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (text or token-id
//! prompts), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text). The server
//! knows nothing about backends: it talks to a [`SchedulerHandle`], whose thread owns the
//! engine. Text comes from the model's tokenizer; a model without one (synthetic test
//! models) takes token-id prompts only, and every choice also carries the generated
//! `token_ids` (an extension of the OpenAI shapes).

pub mod api;
pub mod error;
pub mod metrics;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Request as HttpRequest, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kestrel_engine::StopMatcher;
use kestrel_engine::sampler::SamplerParams;
use kestrel_engine::scheduler::{
    Event, FinishReason, Request, SchedulerHandle, SubmitError, TokenLogprob, TokenSink, Usage,
};
use kestrel_tokenizer::{ChatMessage, ChatTemplate, Tokenizer};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::api::{ChatRequest, CompletionRequest, Prompt, Sampling};
use crate::error::ApiError;
use crate::metrics::Metrics;

/// Everything the handlers share.
pub struct AppState {
    pub scheduler: SchedulerHandle,
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub template: Option<Arc<ChatTemplate>>,
    /// The name `/v1/models` lists and requests must use (or omit).
    pub model_name: String,
    pub api_key: Option<String>,
    pub metrics: Metrics,
    created: u64,
    next_id: AtomicU64,
}

impl AppState {
    pub fn new(
        scheduler: SchedulerHandle,
        tokenizer: Option<Tokenizer>,
        template: Option<ChatTemplate>,
        model_name: impl Into<String>,
        api_key: Option<String>,
    ) -> AppState {
        AppState {
            scheduler,
            tokenizer: tokenizer.map(Arc::new),
            template: template.map(Arc::new),
            model_name: model_name.into(),
            api_key,
            metrics: Metrics::default(),
            created: unix_time(),
            next_id: AtomicU64::new(0),
        }
    }

    fn new_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:x}{n:06x}", self.created)
    }

    fn check_model(&self, model: &Option<String>) -> Result<(), ApiError> {
        match model {
            Some(m) if !m.is_empty() && *m != self.model_name => Err(ApiError::not_found(format!(
                "the model '{m}' does not exist; this server serves '{}'",
                self.model_name
            ))
            .with_code("model_not_found")),
            _ => Ok(()),
        }
    }

    /// A token's text for log-probability reports; `<id>` without a tokenizer (so the
    /// completions endpoint's `{token: logprob}` maps keep every entry).
    fn token_text(&self, id: u32) -> String {
        match &self.tokenizer {
            Some(t) => String::from_utf8_lossy(t.token_to_piece(id, false)).into_owned(),
            None => format!("<{id}>"),
        }
    }

    fn token_bytes(&self, id: u32) -> Vec<u8> {
        match &self.tokenizer {
            Some(t) => t.token_to_piece(id, false).to_vec(),
            None => Vec::new(),
        }
    }
}

type Shared = Arc<AppState>;

/// The application's routes over `state`.
pub fn router(state: Shared) -> Router {
    let v1 = Router::new()
        .route("/chat/completions", post(chat_completions))
        .route("/completions", post(completions))
        .route("/models", get(models))
        .layer(middleware::from_fn_with_state(state.clone(), authorize));
    Router::new()
        .nest("/v1", v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(|| async { ApiError::not_found("no such route") })
        .with_state(state)
}

/// Serves until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Shared,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}

/// A server on its own thread and runtime (tests, embedding). Stops when dropped.
pub struct RunningServer {
    pub addr: SocketAddr,
    pub state: Shared,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Binds `addr` (port 0 picks a free one) and serves `state` on a new thread.
pub fn spawn(state: AppState, addr: SocketAddr) -> std::io::Result<RunningServer> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let listener = runtime.block_on(tokio::net::TcpListener::bind(addr))?;
    let addr = listener.local_addr()?;
    let state = Arc::new(state);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = state.clone();
    std::thread::Builder::new()
        .name("kestrel-http".into())
        .spawn(move || {
            let shutdown = async move {
                let _ = stopped.await;
            };
            if let Err(e) = runtime.block_on(serve(listener, served, shutdown)) {
                eprintln!("kestrel-server: {e}");
            }
        })?;
    Ok(RunningServer {
        addr,
        state,
        stop: Some(stop),
    })
}

async fn authorize(State(state): State<Shared>, req: HttpRequest, next: Next) -> Response {
    if let Some(key) = &state.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if given != Some(key.as_str()) {
            state
                .metrics
                .requests_rejected
                .fetch_add(1, Ordering::Relaxed);
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

async fn health() -> impl IntoResponse {
    axum::Json(json!({"status": "ok"}))
}

async fn metrics_text(State(state): State<Shared>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(&state.scheduler),
    )
}

async fn models(State(state): State<Shared>) -> impl IntoResponse {
    let info = state.scheduler.info();
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "kestrel",
            "meta": {
                "arch": info.arch,
                "backend": info.backend,
                "n_ctx": info.ctx,
                "n_vocab": info.vocab_size,
                "max_seqs": info.max_seqs,
            },
        }],
    }))
}

fn parse_json<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        let what = if e.is_syntax() || e.is_eof() {
            "malformed JSON"
        } else {
            "bad request body"
        };
        ApiError::invalid(format!("{what}: {e}"), None)
    })
}

fn reject(state: &AppState, err: ApiError) -> Response {
    state
        .metrics
        .requests_rejected
        .fetch_add(1, Ordering::Relaxed);
    err.into_response()
}

async fn completions(State(state): State<Shared>, body: Bytes) -> Response {
    state.metrics.requests.fetch_add(1, Ordering::Relaxed);
    match start_completion(&state, &body) {
        Ok((job, gen_)) => respond(state, job, gen_).await,
        Err(e) => reject(&state, e),
    }
}

async fn chat_completions(State(state): State<Shared>, body: Bytes) -> Response {
    state.metrics.requests.fetch_add(1, Ordering::Relaxed);
    match start_chat(&state, &body) {
        Ok((job, gen_)) => respond(state, job, gen_).await,
        Err(e) => reject(&state, e),
    }
}

/// What the response writer needs to know about a request.
struct Job {
    chat: bool,
    stream: bool,
    include_usage: bool,
    logprobs: Option<usize>,
    id: String,
}

fn start_completion(state: &Shared, body: &Bytes) -> Result<(Job, Generation), ApiError> {
    let req: CompletionRequest = parse_json(body)?;
    state.check_model(&req.sampling.model)?;
    if req.echo {
        return Err(ApiError::invalid("echo is not supported", Some("echo")));
    }
    let logprobs = match req.logprobs {
        None => None,
        Some(k) if (0..=20).contains(&k) => Some(k as usize),
        Some(k) => {
            return Err(ApiError::invalid(
                format!("logprobs must be in 0..=20, got {k}"),
                Some("logprobs"),
            ));
        }
    };
    let prompt = match api::parse_prompt(&req.prompt)? {
        Prompt::Ids(ids) => ids,
        Prompt::Text(text) => {
            let Some(tok) = &state.tokenizer else {
                return Err(ApiError::invalid(
                    "this model has no tokenizer: send the prompt as a list of token ids",
                    Some("prompt"),
                ));
            };
            tok.encode(&text, true, true)
        }
    };
    let job = Job {
        chat: false,
        stream: req.sampling.stream,
        include_usage: req.sampling.include_usage(),
        logprobs,
        id: state.new_id("cmpl"),
    };
    let gen_ = submit(
        state,
        &req.sampling,
        req.sampling.max_tokens,
        "max_tokens",
        prompt,
        logprobs,
    )?;
    Ok((job, gen_))
}

fn start_chat(state: &Shared, body: &Bytes) -> Result<(Job, Generation), ApiError> {
    let req: ChatRequest = parse_json(body)?;
    state.check_model(&req.sampling.model)?;
    let (Some(tok), Some(template)) = (&state.tokenizer, &state.template) else {
        return Err(ApiError::invalid(
            "this model has no tokenizer or chat template: use /v1/completions with token ids",
            None,
        ));
    };
    if req.messages.is_empty() {
        return Err(ApiError::invalid(
            "messages must not be empty",
            Some("messages"),
        ));
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.iter().enumerate() {
        messages.push(ChatMessage::new(m.role.clone(), m.text(i)?));
    }
    let text = template
        .render(&messages, true)
        .map_err(|e| ApiError::invalid(format!("chat template: {e}"), Some("messages")))?;
    // The template writes BOS itself where the model wants one.
    let prompt = tok.encode(&text, false, true);
    let logprobs = match (req.logprobs, req.top_logprobs) {
        (_, Some(k)) if !(0..=20).contains(&k) => {
            return Err(ApiError::invalid(
                format!("top_logprobs must be in 0..=20, got {k}"),
                Some("top_logprobs"),
            ));
        }
        (true, k) => Some(k.unwrap_or(0) as usize),
        (false, Some(_)) => {
            return Err(ApiError::invalid(
                "top_logprobs needs logprobs = true",
                Some("top_logprobs"),
            ));
        }
        (false, None) => None,
    };
    let (max, param) = match req.max_completion_tokens {
        Some(n) => (Some(n), "max_completion_tokens"),
        None => (req.sampling.max_tokens, "max_tokens"),
    };
    let job = Job {
        chat: true,
        stream: req.sampling.stream,
        include_usage: req.sampling.include_usage(),
        logprobs,
        id: state.new_id("chatcmpl"),
    };
    let gen_ = submit(state, &req.sampling, max, param, prompt, logprobs)?;
    Ok((job, gen_))
}

/// Forwards scheduler events to the request's task; reports a closed channel.
struct ChannelSink(mpsc::UnboundedSender<Event>);

impl TokenSink for ChannelSink {
    fn send(&mut self, event: Event) -> bool {
        self.0.send(event).is_ok()
    }
    fn is_closed(&self) -> bool {
        self.0.is_closed()
    }
}

fn submit(
    state: &Shared,
    sampling: &Sampling,
    max_tokens: Option<i64>,
    max_param: &str,
    prompt: Vec<u32>,
    logprobs: Option<usize>,
) -> Result<Generation, ApiError> {
    let params: SamplerParams = sampling.params()?;
    let info = state.scheduler.info();
    let max_tokens = api::max_tokens(max_tokens, max_param, prompt.len(), info.ctx)?;
    let (tx, rx) = mpsc::unbounded_channel();
    let prompt_len = prompt.len();
    state
        .scheduler
        .submit(Request {
            prompt,
            params,
            max_tokens,
            logprobs,
            speculative: sampling.speculative.unwrap_or(true),
            sink: Box::new(ChannelSink(tx)),
        })
        .map_err(|e| match e {
            SubmitError::PromptTooLong { .. } => ApiError::invalid(e.to_string(), Some("prompt"))
                .with_code("context_length_exceeded"),
            SubmitError::EmptyPrompt | SubmitError::TokenOutOfRange { .. } => {
                ApiError::invalid(e.to_string(), Some("prompt"))
            }
            SubmitError::NoTokens => ApiError::invalid(e.to_string(), Some(max_param)),
            SubmitError::BadParams(m) => ApiError::invalid(m, None),
            SubmitError::Stopped => ApiError::unavailable(e.to_string()),
        })?;
    state
        .metrics
        .prompt_tokens
        .fetch_add(prompt_len as u64, Ordering::Relaxed);
    Ok(Generation {
        state: state.clone(),
        events: rx,
        pending: Vec::new(),
        stops: StopMatcher::new(&sampling.stops()),
        started: Instant::now(),
        last: None,
        received: 0,
        prompt_len,
        finish: None,
    })
}

/// One piece of a generation as the client sees it.
enum Out {
    Token {
        id: u32,
        text: String,
        logprob: Option<TokenLogprob>,
    },
    Finish {
        reason: FinishReason,
        usage: Usage,
        text: String,
    },
    Error(String),
}

/// Turns a request's scheduler events into text: UTF-8 reassembly and stop strings.
struct Generation {
    state: Shared,
    events: mpsc::UnboundedReceiver<Event>,
    pending: Vec<u8>,
    stops: StopMatcher,
    started: Instant,
    last: Option<Instant>,
    received: usize,
    prompt_len: usize,
    /// Set once a stop string ended the text: the next call reports it.
    finish: Option<Out>,
}

impl Generation {
    async fn next(&mut self) -> Option<Out> {
        if let Some(f) = self.finish.take() {
            return Some(f);
        }
        if self.events.is_closed() && self.events.is_empty() {
            return None;
        }
        let Some(event) = self.events.recv().await else {
            return Some(Out::Error("the scheduler stopped".into()));
        };
        match event {
            Event::Token { id, logprob } => {
                let now = Instant::now();
                let m = &self.state.metrics;
                match self.last {
                    None => m.ttft.observe((now - self.started).as_secs_f64()),
                    Some(t) => m.itl.observe((now - t).as_secs_f64()),
                }
                self.last = Some(now);
                m.generated_tokens.fetch_add(1, Ordering::Relaxed);
                self.received += 1;
                self.pending.extend(self.state.token_bytes(id));
                let text = take_utf8(&mut self.pending);
                let (text, stopped) = self.stops.push(&text);
                if stopped {
                    // Hang up: the scheduler frees the sequence before its next step.
                    self.events.close();
                    self.finish = Some(Out::Finish {
                        reason: FinishReason::Stop,
                        usage: Usage {
                            prompt_tokens: self.prompt_len,
                            completion_tokens: self.received,
                            cached_prompt_tokens: 0,
                        },
                        text: String::new(),
                    });
                }
                Some(Out::Token { id, text, logprob })
            }
            Event::Done { reason, usage } => {
                self.events.close();
                let rest = String::from_utf8_lossy(&std::mem::take(&mut self.pending)).into_owned();
                let (mut text, stopped) = self.stops.push(&rest);
                if !stopped {
                    text.push_str(&self.stops.finish());
                }
                let reason = if stopped { FinishReason::Stop } else { reason };
                Some(Out::Finish {
                    reason,
                    usage,
                    text,
                })
            }
            Event::Error(e) => {
                self.events.close();
                Some(Out::Error(e))
            }
        }
    }
}

/// Removes and returns the longest valid UTF-8 prefix of `bytes` (invalid sequences that
/// cannot become valid are replaced).
fn take_utf8(bytes: &mut Vec<u8>) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) => {
            let s = s.to_string();
            bytes.clear();
            s
        }
        Err(e) if e.error_len().is_some() => {
            let s = String::from_utf8_lossy(bytes).into_owned();
            bytes.clear();
            s
        }
        Err(e) => {
            let valid = e.valid_up_to();
            let s = String::from_utf8_lossy(&bytes[..valid]).into_owned();
            bytes.drain(..valid);
            s
        }
    }
}

fn finish_name(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    })
}

/// Log-probabilities of tokens in the chat shape (`content: [{token, logprob, bytes,
/// top_logprobs}]`).
fn chat_logprob(state: &AppState, id: u32, lp: &TokenLogprob) -> Value {
    let top: Vec<Value> = lp
        .top
        .iter()
        .map(|&(t, l)| json!({"token": state.token_text(t), "logprob": l, "bytes": state.token_bytes(t)}))
        .collect();
    json!({
        "token": state.token_text(id),
        "logprob": lp.logprob,
        "bytes": state.token_bytes(id),
        "top_logprobs": top,
    })
}

/// Log-probabilities in the legacy completions shape, for a run of tokens.
#[derive(Default)]
struct CompletionLogprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<f32>,
    top: Vec<Value>,
    offsets: Vec<usize>,
}

impl CompletionLogprobs {
    fn push(&mut self, state: &AppState, id: u32, lp: &TokenLogprob, offset: usize) {
        self.tokens.push(state.token_text(id));
        self.token_logprobs.push(lp.logprob);
        let mut top = serde_json::Map::new();
        for &(t, l) in &lp.top {
            top.insert(state.token_text(t), json!(l));
        }
        self.top.push(Value::Object(top));
        self.offsets.push(offset);
    }

    fn json(&self) -> Value {
        json!({
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top,
            "text_offset": self.offsets,
        })
    }
}

async fn respond(state: Shared, job: Job, gen_: Generation) -> Response {
    if job.stream {
        stream_response(state, job, gen_)
    } else {
        match collect(&state, &job, gen_).await {
            Ok(v) => axum::Json(v).into_response(),
            Err(e) => e.into_response(),
        }
    }
}

async fn collect(state: &Shared, job: &Job, mut gen_: Generation) -> Result<Value, ApiError> {
    let mut text = String::new();
    let mut ids = Vec::new();
    let mut chat_lps = Vec::new();
    let mut cmpl_lps = CompletionLogprobs::default();
    loop {
        match gen_.next().await {
            Some(Out::Token {
                id,
                text: t,
                logprob,
            }) => {
                if let Some(lp) = &logprob {
                    if job.chat {
                        chat_lps.push(chat_logprob(state, id, lp));
                    } else {
                        cmpl_lps.push(state, id, lp, text.len());
                    }
                }
                ids.push(id);
                text.push_str(&t);
            }
            Some(Out::Finish {
                reason,
                usage,
                text: t,
            }) => {
                text.push_str(&t);
                let logprobs = job.logprobs.map(|_| {
                    if job.chat {
                        json!({ "content": chat_lps })
                    } else {
                        cmpl_lps.json()
                    }
                });
                let choice = if job.chat {
                    json!({
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": logprobs,
                        "finish_reason": finish_name(reason),
                        "token_ids": ids,
                    })
                } else {
                    json!({
                        "index": 0,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": finish_name(reason),
                        "token_ids": ids,
                    })
                };
                return Ok(json!({
                    "id": job.id,
                    "object": if job.chat { "chat.completion" } else { "text_completion" },
                    "created": unix_time(),
                    "model": state.model_name,
                    "choices": [choice],
                    "usage": usage_json(&usage),
                }));
            }
            Some(Out::Error(e)) => return Err(ApiError::internal(e)),
            None => return Err(ApiError::internal("the generation ended without a result")),
        }
    }
}

fn stream_response(state: Shared, job: Job, mut gen_: Generation) -> Response {
    let (tx, mut rx) = mpsc::channel::<SseEvent>(64);
    tokio::spawn(async move {
        let created = unix_time();
        let object = if job.chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let chunk = |choices: Value, usage: Option<Value>| {
            let mut v = json!({
                "id": job.id,
                "object": object,
                "created": created,
                "model": state.model_name,
                "choices": choices,
            });
            if let Some(u) = usage {
                v["usage"] = u;
            }
            SseEvent::default().data(v.to_string())
        };
        if job.chat {
            let first = json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]);
            if tx.send(chunk(first, None)).await.is_err() {
                return;
            }
        }
        let mut offset = 0;
        loop {
            let out = tokio::select! {
                _ = tx.closed() => return, // client gone: dropping `gen_` frees the sequence
                out = gen_.next() => out,
            };
            let event = match out {
                Some(Out::Token { id, text, logprob }) => {
                    let choice = if job.chat {
                        let lps = logprob
                            .as_ref()
                            .map(|lp| json!({"content": [chat_logprob(&state, id, lp)]}));
                        json!({"index": 0, "delta": {"content": text}, "logprobs": lps, "finish_reason": null, "token_ids": [id]})
                    } else {
                        let lps = logprob.as_ref().map(|lp| {
                            let mut l = CompletionLogprobs::default();
                            l.push(&state, id, lp, offset);
                            l.json()
                        });
                        json!({"index": 0, "text": text, "logprobs": lps, "finish_reason": null, "token_ids": [id]})
                    };
                    offset += text.len();
                    chunk(json!([choice]), None)
                }
                Some(Out::Finish {
                    reason,
                    usage,
                    text,
                }) => {
                    let choice = if job.chat {
                        json!({"index": 0, "delta": if text.is_empty() { json!({}) } else { json!({"content": text}) }, "logprobs": null, "finish_reason": finish_name(reason)})
                    } else {
                        json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish_name(reason)})
                    };
                    let _ = tx.send(chunk(json!([choice]), None)).await;
                    if job.include_usage {
                        let _ = tx.send(chunk(json!([]), Some(usage_json(&usage)))).await;
                    }
                    let _ = tx.send(SseEvent::default().data("[DONE]")).await;
                    return;
                }
                Some(Out::Error(e)) => {
                    let err = ApiError::internal(e).body();
                    let _ = tx.send(SseEvent::default().data(err.to_string())).await;
                    let _ = tx.send(SseEvent::default().data("[DONE]")).await;
                    return;
                }
                None => return,
            };
            if tx.send(event).await.is_err() {
                return;
            }
        }
    });
    let stream = futures_util::stream::poll_fn(move |cx| {
        rx.poll_recv(cx).map(|e| e.map(Ok::<_, Infallible>))
    });
    let mut resp = Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response();
    *resp.status_mut() = StatusCode::OK;
    resp
}

fn unix_time() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
