//! kestrel-server: an OpenAI-compatible HTTP API over the continuous-batching scheduler.
//!
//! Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (text or token-id
//! prompts), `POST /v1/embeddings`, `GET /v1/models`, `GET /v1/models/{id}`, `POST
//! /tokenize`, `POST /detokenize`, `GET /health`, `GET /metrics` (Prometheus text). The server knows nothing about
//! backends: it talks to a [`SchedulerHandle`], whose thread owns the engine. Text comes
//! from the model's tokenizer; a model without one (synthetic test models) takes token-id
//! prompts only, and every choice also carries the generated `token_ids` (an extension of
//! the OpenAI shapes). Chat templates, tokenization and grammar compilation run on
//! blocking threads, never on the runtime's few HTTP threads.

pub mod api;
pub mod constrain;
pub mod embeddings;
pub mod error;
pub mod http;
pub mod metrics;
pub mod tools;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Request as HttpRequest, State};
use axum::http::header;
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kestrel_engine::StopMatcher;
use kestrel_engine::sampler::{SamplerParams, TokenFilter};
use kestrel_engine::scheduler::{
    Event, FinishReason, Request, SchedulerHandle, SubmitError, TokenLogprob, TokenSink, Usage,
};
use kestrel_tokenizer::{ChatMessage, ChatTemplate, Tokenizer};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::api::{ChatRequest, CompletionRequest, Prompt, Sampling};
use crate::constrain::{Constraint, Grammars};
use crate::error::ApiError;
use crate::http::{STALLED_CLIENT_TIMEOUT, TokenCounts};
use crate::metrics::Metrics;
use crate::tools::{CallFormat, ToolCall, Tools};

/// Everything the handlers share.
pub struct AppState {
    pub scheduler: SchedulerHandle,
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub template: Option<Arc<ChatTemplate>>,
    /// The name `/v1/models` lists and requests must use (or omit).
    pub model_name: String,
    pub api_key: Option<String>,
    pub metrics: Metrics,
    /// `Access-Control-Allow-Origin` for browsers (`*` for any); none: no CORS headers.
    pub cors: Option<String>,
    grammars: Option<Grammars>,
    call_format: CallFormat,
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
        let tokenizer = tokenizer.map(Arc::new);
        AppState {
            scheduler,
            grammars: tokenizer.clone().map(Grammars::new),
            tokenizer,
            call_format: CallFormat::of_template(template.as_ref().map_or("", |t| t.source())),
            template: template.map(Arc::new),
            model_name: model_name.into(),
            api_key,
            metrics: Metrics::default(),
            cors: None,
            created: unix_time(),
            next_id: AtomicU64::new(0),
        }
    }

    /// Sets the CORS origin (`*` for any).
    pub fn with_cors(mut self, origin: Option<String>) -> AppState {
        self.cors = origin;
        self
    }

    fn new_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:x}{n:06x}", self.created)
    }

    fn check_model(&self, model: &Option<String>) -> Result<(), ApiError> {
        match model {
            Some(m) if !m.is_empty() && *m != self.model_name => Err(self.no_such_model(m)),
            _ => Ok(()),
        }
    }

    fn no_such_model(&self, m: &str) -> ApiError {
        ApiError::not_found(format!(
            "the model '{m}' does not exist; this server serves '{}'",
            self.model_name
        ))
        .with_code("model_not_found")
    }

    fn tokenizer(&self) -> Result<&Arc<Tokenizer>, ApiError> {
        self.tokenizer
            .as_ref()
            .ok_or_else(|| ApiError::invalid("this model has no tokenizer: use token ids", None))
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

    fn model_json(&self) -> Value {
        let info = self.scheduler.info();
        json!({
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kestrel",
            "meta": {
                "arch": info.arch,
                "backend": info.backend,
                "n_ctx": info.ctx,
                "n_vocab": info.vocab_size,
                "max_seqs": info.max_seqs,
            },
        })
    }
}

type Shared = Arc<AppState>;

/// The application's routes over `state`.
pub fn router(state: Shared) -> Router {
    let guarded = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .layer(middleware::from_fn_with_state(state.clone(), authorize));
    let mut app = Router::new()
        .merge(guarded)
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(|| async { ApiError::not_found("no such route") })
        .layer(middleware::from_fn(http::log_and_json_errors))
        .with_state(state.clone());
    if let Some(origin) = &state.cors {
        match http::cors(origin) {
            Ok(layer) => app = app.layer(layer),
            Err(e) => eprintln!("kestrel-server: {e}; CORS is off"),
        }
    }
    app
}

/// Serves until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Shared,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let slot = http::AppSlot::default();
    let _ = slot.set(router(state));
    http::serve_slot(listener, slot, shutdown).await
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
        // RFC 7235: the scheme is case-insensitive.
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim());
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
    axum::Json(json!({"object": "list", "data": [state.model_json()]}))
}

async fn model(State(state): State<Shared>, Path(id): Path<String>) -> Response {
    if id == state.model_name {
        axum::Json(state.model_json()).into_response()
    } else {
        state.no_such_model(&id).into_response()
    }
}

/// llama-server's `/tokenize`: `{"content", "add_special", "parse_special", "with_pieces"}`
/// to `{"tokens": [id, ...]}` (or `[{"id", "piece"}, ...]` with pieces).
async fn tokenize(State(state): State<Shared>, body: Bytes) -> Response {
    let run = move |state: &Shared, body: &Bytes| -> Result<Value, ApiError> {
        let req: Value = parse_json(body)?;
        api::check_keys(
            &req,
            &["content", "add_special", "parse_special", "with_pieces"],
        )?;
        let tok = state.tokenizer()?;
        let content = req
            .get("content")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::invalid("content must be a string", Some("content")))?;
        let flag = |k: &str, default: bool| -> Result<bool, ApiError> {
            match req.get(k) {
                None | Some(Value::Null) => Ok(default),
                Some(Value::Bool(b)) => Ok(*b),
                Some(_) => Err(ApiError::invalid(format!("{k} must be a boolean"), Some(k))),
            }
        };
        let ids = tok.encode(
            content,
            flag("add_special", false)?,
            flag("parse_special", true)?,
        );
        let tokens: Vec<Value> = if flag("with_pieces", false)? {
            ids.iter()
                .map(|&id| {
                    let bytes = tok.token_to_piece(id, true);
                    let piece = match std::str::from_utf8(bytes) {
                        Ok(s) => json!(s),
                        Err(_) => json!(bytes),
                    };
                    json!({"id": id, "piece": piece})
                })
                .collect()
        } else {
            ids.iter().map(|&id| json!(id)).collect()
        };
        Ok(json!({ "tokens": tokens }))
    };
    match off_runtime(&state, body, run).await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => reject(&state, e),
    }
}

/// llama-server's `/detokenize`: `{"tokens": [id, ...]}` to `{"content"}`.
async fn detokenize(State(state): State<Shared>, body: Bytes) -> Response {
    let run = |state: &Shared, body: &Bytes| -> Result<Value, ApiError> {
        let req: Value = parse_json(body)?;
        api::check_keys(&req, &["tokens"])?;
        let tok = state.tokenizer()?;
        let ids = req
            .get("tokens")
            .and_then(Value::as_array)
            .and_then(|a| {
                a.iter()
                    .map(|v| v.as_u64().filter(|&id| (id as usize) < tok.vocab_size()))
                    .map(|id| id.map(|id| id as u32))
                    .collect::<Option<Vec<u32>>>()
            })
            .ok_or_else(|| {
                ApiError::invalid(
                    format!("tokens must be a list of ids below {}", tok.vocab_size()),
                    Some("tokens"),
                )
            })?;
        Ok(json!({ "content": tok.detokenize(&ids, true) }))
    };
    match off_runtime(&state, body, run).await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => reject(&state, e),
    }
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

/// Runs `f` (templates, tokenization, grammar compilation: untrusted, possibly slow work) on
/// a blocking thread, keeping the runtime's threads free for other requests.
async fn off_runtime<T: Send + 'static>(
    state: &Shared,
    body: Bytes,
    f: impl FnOnce(&Shared, &Bytes) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let s = state.clone();
    tokio::task::spawn_blocking(move || f(&s, &body))
        .await
        .map_err(|_| ApiError::internal("preparing the request failed"))?
}

/// `POST /v1/embeddings` (see [`embeddings`]): tokenized off the runtime, pooled by the
/// scheduler between generation steps, L2-normalized here.
async fn embeddings(State(state): State<Shared>, body: Bytes) -> Response {
    state.metrics.requests.fetch_add(1, Ordering::Relaxed);
    let prepare = |state: &Shared, body: &Bytes| -> Result<(bool, Vec<Vec<u32>>), ApiError> {
        let raw: Value = parse_json(body)?;
        let info = state.scheduler.info();
        let req = embeddings::parse(&raw, info.n_embd)?;
        state.check_model(&req.model)?;
        let inputs = req
            .inputs
            .into_iter()
            .enumerate()
            .map(|(i, input)| {
                let ids = match input {
                    embeddings::Input::Ids(ids) => ids,
                    embeddings::Input::Text(text) => {
                        let Some(tok) = &state.tokenizer else {
                            return Err(ApiError::invalid(
                                "this model has no tokenizer: send token ids",
                                Some("input"),
                            ));
                        };
                        // As llama-server: the model's special tokens added, special
                        // tokens in the text parsed.
                        tok.encode(&text, true, true)
                    }
                };
                let at = format!("input[{i}]");
                if ids.is_empty() {
                    return Err(ApiError::invalid(
                        format!("{at} has no tokens"),
                        Some("input"),
                    ));
                }
                if ids.len() > info.ctx {
                    return Err(ApiError::invalid(
                        format!(
                            "{at} has {} tokens, the context holds {}",
                            ids.len(),
                            info.ctx
                        ),
                        Some("input"),
                    )
                    .with_code("context_length_exceeded"));
                }
                if let Some(&id) = ids.iter().find(|&&id| id as usize >= info.vocab_size) {
                    return Err(ApiError::invalid(
                        format!(
                            "{at} has token id {id}, the vocabulary has {} tokens",
                            info.vocab_size
                        ),
                        Some("input"),
                    ));
                }
                Ok(ids)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok((req.base64, inputs))
    };
    let (base64, inputs) = match off_runtime(&state, body, prepare).await {
        Ok(r) => r,
        Err(e) => return reject(&state, e),
    };
    let pooling = match embeddings::pooling(state.scheduler.info().pooling) {
        Ok(p) => p,
        Err(e) => return reject(&state, e),
    };
    let n_tokens: usize = inputs.iter().map(Vec::len).sum();
    let (req, reply) = embeddings::request(inputs, pooling);
    if let Err(e) = state.scheduler.embed(req) {
        return reject(&state, embeddings::submit_error(e));
    }
    state
        .metrics
        .prompt_tokens
        .fetch_add(n_tokens as u64, Ordering::Relaxed);
    let mut vectors = match reply.await {
        Ok(Ok(v)) => v,
        Ok(Err(msg)) => return ApiError::internal(msg).into_response(),
        Err(_) => return ApiError::unavailable("the scheduler stopped").into_response(),
    };
    for v in &mut vectors {
        embeddings::normalize(v);
    }
    let body = embeddings::response(&state.model_name, &vectors, base64, n_tokens);
    let counts = TokenCounts::default();
    counts.prompt.store(n_tokens, Ordering::Relaxed);
    let mut resp = axum::Json(body).into_response();
    resp.extensions_mut().insert(Arc::new(counts));
    resp
}

async fn completions(State(state): State<Shared>, body: Bytes) -> Response {
    state.metrics.requests.fetch_add(1, Ordering::Relaxed);
    match off_runtime(&state, body, start_completion).await {
        Ok((job, gens)) => respond(state, job, gens).await,
        Err(e) => reject(&state, e),
    }
}

async fn chat_completions(State(state): State<Shared>, body: Bytes) -> Response {
    state.metrics.requests.fetch_add(1, Ordering::Relaxed);
    match off_runtime(&state, body, start_chat).await {
        Ok((job, gens)) => respond(state, job, gens).await,
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
    /// Tools whose calls are parsed out of the output.
    tools: Option<Tools>,
    counts: Arc<TokenCounts>,
}

fn start_completion(state: &Shared, body: &Bytes) -> Result<(Job, Vec<Generation>), ApiError> {
    let raw: Value = parse_json(body)?;
    api::check_fields(&raw, api::COMPLETION_FIELDS)?;
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
        tools: None,
        counts: Arc::default(),
    };
    let constraint = req.sampling.constraint()?;
    let gens = submit(
        state,
        &job,
        &req.sampling,
        (req.sampling.max_tokens, "max_tokens"),
        prompt,
        constraint,
    )?;
    Ok((job, gens))
}

fn start_chat(state: &Shared, body: &Bytes) -> Result<(Job, Vec<Generation>), ApiError> {
    let raw: Value = parse_json(body)?;
    api::check_fields(&raw, api::CHAT_FIELDS)?;
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
    let tools = Tools::parse(
        req.tools.as_ref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
    )?;
    let mut messages = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.iter().enumerate() {
        // OpenAI's `developer` role is the system role of older models and templates.
        let role = if m.role == "developer" {
            "system"
        } else {
            m.role.as_str()
        };
        let mut msg = ChatMessage::new(role, m.text(i)?);
        msg.tool_calls = m.tool_calls.as_ref().map(tools::calls_for_template);
        msg.tool_call_id = m.tool_call_id.clone();
        msg.name = m.name.clone();
        messages.push(msg);
    }
    // `tool_choice: none` still shows the tools to the template, as OpenAI does.
    let text = template
        .render_with_tools(&messages, tools.as_ref().map(|t| &t.list), true)
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
    let max = match req.max_completion_tokens {
        Some(n) => (Some(n), "max_completion_tokens"),
        None => (req.sampling.max_tokens, "max_tokens"),
    };
    let mut constraint = req.sampling.constraint()?;
    if let Some(forced) = tools.as_ref().and_then(|t| t.constraint(state.call_format)) {
        if constraint.is_some() {
            return Err(ApiError::invalid(
                "tool_choice required or a named function cannot be combined with response_format, grammar or regex",
                Some("tool_choice"),
            ));
        }
        constraint = Some(forced);
    }
    let job = Job {
        chat: true,
        stream: req.sampling.stream,
        include_usage: req.sampling.include_usage(),
        logprobs,
        id: state.new_id("chatcmpl"),
        tools: tools.filter(Tools::active),
        counts: Arc::default(),
    };
    let gens = submit(state, &job, &req.sampling, max, prompt, constraint)?;
    Ok((job, gens))
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

/// Queues the request's `n` generations (choice `i` seeded with `seed + i`).
fn submit(
    state: &Shared,
    job: &Job,
    sampling: &Sampling,
    (max_tokens, max_param): (Option<i64>, &str),
    prompt: Vec<u32>,
    constraint: Option<Constraint>,
) -> Result<Vec<Generation>, ApiError> {
    let params: SamplerParams = sampling.params()?;
    let n = sampling.choices()?;
    let info = state.scheduler.info();
    let max_tokens = api::max_tokens(max_tokens, max_param, prompt.len(), info.ctx)?;
    let bias = sampling.logit_bias(info.vocab_size)?;
    let make_filter = || -> Result<Option<Box<dyn TokenFilter>>, ApiError> {
        let Some(constraint) = &constraint else {
            return Ok((!bias.is_empty()).then(|| constrain::bias_filter(bias.clone())));
        };
        let Some(grammars) = &state.grammars else {
            return Err(ApiError::invalid(
                "this model has no tokenizer: output constraints need one",
                None,
            ));
        };
        grammars
            .filter(constraint, bias.clone())
            .map(Some)
            .map_err(|e| ApiError::invalid(format!("bad grammar or schema: {e}"), None))
    };
    let prompt_len = prompt.len();
    let mut gens = Vec::with_capacity(n);
    for i in 0..n {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut params = params.clone();
        params.seed = params.seed.map(|s| s.wrapping_add(i as u64));
        state
            .scheduler
            .submit_filtered(
                Request {
                    prompt: prompt.clone(),
                    params,
                    max_tokens,
                    logprobs: job.logprobs,
                    // A request with a grammar or logit bias never speculates (the scheduler
                    // samples it on the host).
                    speculative: sampling.speculative.unwrap_or(true),
                    sink: Box::new(ChannelSink(tx)),
                },
                make_filter()?,
            )
            .map_err(|e| match e {
                SubmitError::PromptTooLong { .. } | SubmitError::PromptExceedsCache { .. } => {
                    ApiError::invalid(e.to_string(), Some("prompt"))
                        .with_code("context_length_exceeded")
                }
                SubmitError::EmptyPrompt | SubmitError::TokenOutOfRange { .. } => {
                    ApiError::invalid(e.to_string(), Some("prompt"))
                }
                SubmitError::NoTokens => ApiError::invalid(e.to_string(), Some(max_param)),
                SubmitError::BadParams(m) => ApiError::invalid(m, None),
                SubmitError::Stopped => ApiError::unavailable(e.to_string()),
            })?;
        gens.push(Generation {
            state: state.clone(),
            events: rx,
            pending: Vec::new(),
            stops: StopMatcher::new(&sampling.stops()),
            started: Instant::now(),
            last: None,
            received: 0,
            prompt_len,
            counts: job.counts.clone(),
            finish: None,
        });
    }
    state
        .metrics
        .prompt_tokens
        .fetch_add(prompt_len as u64, Ordering::Relaxed);
    job.counts.prompt.store(prompt_len, Ordering::Relaxed);
    Ok(gens)
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
    counts: Arc<TokenCounts>,
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
                self.counts.completion.fetch_add(1, Ordering::Relaxed);
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

/// Usage of a request's choices: the prompt counted once, the completions summed.
fn usage_json(usages: &[Usage]) -> Value {
    let prompt = usages.first().map_or(0, |u| u.prompt_tokens);
    let cached = usages.first().map_or(0, |u| u.cached_prompt_tokens);
    let completion: usize = usages.iter().map(|u| u.completion_tokens).sum();
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// Tool calls in OpenAI's message shape (`index` is added for streaming deltas).
fn tool_calls_json(job: &Job, calls: &[ToolCall], with_index: bool) -> Value {
    let list: Vec<Value> = calls
        .iter()
        .enumerate()
        .map(|(k, c)| {
            let mut v = json!({
                "id": format!("call_{}_{k}", job.id),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            });
            if with_index {
                v["index"] = json!(k);
            }
            v
        })
        .collect();
    Value::Array(list)
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

async fn respond(state: Shared, job: Job, gens: Vec<Generation>) -> Response {
    let counts = job.counts.clone();
    let mut resp = if job.stream {
        stream_response(state, job, gens)
    } else {
        match collect(&state, &job, gens).await {
            Ok(v) => axum::Json(v).into_response(),
            Err(e) => e.into_response(),
        }
    };
    resp.extensions_mut().insert(counts);
    resp
}

/// One finished choice of a non-streaming response.
async fn collect_one(
    state: &Shared,
    job: &Job,
    index: usize,
    mut gen_: Generation,
) -> Result<(Value, Usage), ApiError> {
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
                let mut finish = finish_name(reason);
                let choice = if job.chat {
                    let mut message = json!({"role": "assistant", "content": text});
                    if let Some(tools) = &job.tools {
                        let (content, calls) = tools.calls_in(&text);
                        if !calls.is_empty() {
                            message["content"] = if content.is_empty() {
                                Value::Null
                            } else {
                                json!(content)
                            };
                            message["tool_calls"] = tool_calls_json(job, &calls, false);
                            finish = "tool_calls";
                        }
                    }
                    json!({
                        "index": index,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                        "token_ids": ids,
                    })
                } else {
                    json!({
                        "index": index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                        "token_ids": ids,
                    })
                };
                return Ok((choice, usage));
            }
            Some(Out::Error(e)) => return Err(ApiError::internal(e)),
            None => return Err(ApiError::internal("the generation ended without a result")),
        }
    }
}

async fn collect(state: &Shared, job: &Job, gens: Vec<Generation>) -> Result<Value, ApiError> {
    let results = futures_util::future::join_all(
        gens.into_iter()
            .enumerate()
            .map(|(i, g)| collect_one(state, job, i, g)),
    )
    .await;
    let mut choices = Vec::with_capacity(results.len());
    let mut usages = Vec::with_capacity(results.len());
    for r in results {
        let (choice, usage) = r?;
        choices.push(choice);
        usages.push(usage);
    }
    Ok(json!({
        "id": job.id,
        "object": if job.chat { "chat.completion" } else { "text_completion" },
        "created": unix_time(),
        "model": state.model_name,
        "choices": choices,
        "usage": usage_json(&usages),
    }))
}

/// Streams the request's choices as server-sent events: each generation runs in its own
/// task feeding one channel; a client gone (or not reading for
/// [`STALLED_CLIENT_TIMEOUT`]) drops the generations, which cancels them.
fn stream_response(state: Shared, job: Job, gens: Vec<Generation>) -> Response {
    let (tx, mut rx) = mpsc::channel::<SseEvent>(64);
    let n = gens.len();
    let (out_tx, mut out_rx) = mpsc::channel::<(usize, Option<Out>)>(64);
    for (index, mut gen_) in gens.into_iter().enumerate() {
        let out_tx = out_tx.clone();
        tokio::spawn(async move {
            loop {
                let out = tokio::select! {
                    _ = out_tx.closed() => return,
                    out = gen_.next() => out,
                };
                let last = !matches!(out, Some(Out::Token { .. }));
                if out_tx.send((index, out)).await.is_err() || last {
                    return;
                }
            }
        });
    }
    drop(out_tx);
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
        // A client that stops reading fills the channel: give up after a while.
        let send = |event: SseEvent| {
            let tx = tx.clone();
            async move {
                matches!(
                    tokio::time::timeout(STALLED_CLIENT_TIMEOUT, tx.send(event)).await,
                    Ok(Ok(()))
                )
            }
        };
        if job.chat {
            for index in 0..n {
                let first = json!([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]);
                if !send(chunk(first, None)).await {
                    return;
                }
            }
        }
        let mut offsets = vec![0; n];
        // Text held back per choice while it may still become a tool call.
        let mut held: Vec<Option<String>> = vec![job.tools.as_ref().map(|_| String::new()); n];
        let mut usages = Vec::new();
        let mut open = n;
        while open > 0 {
            let out = tokio::select! {
                _ = tx.closed() => return, // client gone: dropping out_rx cancels the tasks
                out = out_rx.recv() => out,
            };
            let Some((index, out)) = out else { return };
            let event = match out {
                Some(Out::Token { id, text, logprob }) => {
                    let choice = if job.chat {
                        let lps = logprob
                            .as_ref()
                            .map(|lp| json!({"content": [chat_logprob(&state, id, lp)]}));
                        let text = match &mut held[index] {
                            Some(h) => {
                                h.push_str(&text);
                                if tools::may_be_call(h) {
                                    String::new()
                                } else {
                                    held[index].take().unwrap_or_default()
                                }
                            }
                            None => text,
                        };
                        json!({"index": index, "delta": {"content": text}, "logprobs": lps, "finish_reason": null, "token_ids": [id]})
                    } else {
                        let lps = logprob.as_ref().map(|lp| {
                            let mut l = CompletionLogprobs::default();
                            l.push(&state, id, lp, offsets[index]);
                            l.json()
                        });
                        offsets[index] += text.len();
                        json!({"index": index, "text": text, "logprobs": lps, "finish_reason": null, "token_ids": [id]})
                    };
                    chunk(json!([choice]), None)
                }
                Some(Out::Finish {
                    reason,
                    usage,
                    text,
                }) => {
                    open -= 1;
                    usages.push(usage);
                    let mut finish = finish_name(reason);
                    let choice = if job.chat {
                        let mut delta = if text.is_empty() {
                            json!({})
                        } else {
                            json!({"content": text})
                        };
                        if let (Some(h), Some(tools)) = (held[index].take(), &job.tools) {
                            let all = h + &text;
                            let (content, calls) = tools.calls_in(&all);
                            if calls.is_empty() {
                                delta = json!({"content": all});
                            } else {
                                delta = json!({"tool_calls": tool_calls_json(&job, &calls, true)});
                                if !content.is_empty() {
                                    delta["content"] = json!(content);
                                }
                                finish = "tool_calls";
                            }
                        }
                        json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": finish})
                    } else {
                        json!({"index": index, "text": text, "logprobs": null, "finish_reason": finish})
                    };
                    chunk(json!([choice]), None)
                }
                Some(Out::Error(e)) => {
                    let err = ApiError::internal(e).body();
                    let _ = send(SseEvent::default().data(err.to_string())).await;
                    let _ = send(SseEvent::default().data("[DONE]")).await;
                    return;
                }
                None => return,
            };
            if !send(event).await {
                return;
            }
        }
        if job.include_usage {
            let _ = send(chunk(json!([]), Some(usage_json(&usages)))).await;
        }
        let _ = send(SseEvent::default().data("[DONE]")).await;
    });
    let stream = futures_util::stream::poll_fn(move |cx| {
        rx.poll_recv(cx).map(|e| e.map(Ok::<_, Infallible>))
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

fn unix_time() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The loading phase: a slot to put the application in once the model is loaded.
pub fn app_slot() -> http::AppSlot {
    Arc::new(OnceLock::new())
}
