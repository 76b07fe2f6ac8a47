//! Request bodies of the OpenAI endpoints and their checks.

use kestrel_engine::sampler::SamplerParams;
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::constrain::Constraint;
use crate::error::ApiError;

/// Fields both generation endpoints take.
const SAMPLING_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repeat_penalty",
    "seed",
    "n",
    "stop",
    "stream",
    "stream_options",
    "logit_bias",
    "response_format",
    "grammar",
    "regex",
    "speculative",
];
/// Fields only `/v1/chat/completions` takes.
pub const CHAT_FIELDS: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
];
/// Fields only `/v1/completions` takes.
pub const COMPLETION_FIELDS: &[&str] = &["prompt", "logprobs", "echo"];
/// Fields accepted and ignored: they change nothing in the output.
pub const IGNORED_FIELDS: &[&str] = &["user", "metadata", "store"];

/// A 400 naming the first field of `body` not in `known` (endpoints outside the OpenAI
/// API, which have no ignored fields).
pub fn check_keys(body: &Value, known: &[&str]) -> Result<(), ApiError> {
    let Value::Object(map) = body else {
        return Err(ApiError::invalid(
            "the request body must be a JSON object",
            None,
        ));
    };
    match map.keys().find(|k| !known.contains(&k.as_str())) {
        Some(key) => Err(ApiError::invalid(
            format!("the field '{key}' is not supported"),
            Some(key),
        )
        .with_code("unsupported_parameter")),
        None => Ok(()),
    }
}

/// A 400 naming the first top-level field that is neither taken by the endpoint nor in
/// [`IGNORED_FIELDS`]: a setting Kestrel does not honour is never silently dropped.
pub fn check_fields(body: &Value, endpoint: &[&str]) -> Result<(), ApiError> {
    let Value::Object(map) = body else {
        return Err(ApiError::invalid(
            "the request body must be a JSON object",
            None,
        ));
    };
    for key in map.keys() {
        let k = key.as_str();
        if !SAMPLING_FIELDS.contains(&k) && !endpoint.contains(&k) && !IGNORED_FIELDS.contains(&k) {
            return Err(ApiError::invalid(
                format!("the field '{key}' is not supported"),
                Some(key),
            )
            .with_code("unsupported_parameter"));
        }
    }
    Ok(())
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Fields shared by both generation endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Sampling {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// llama.cpp extension.
    pub repeat_penalty: Option<f32>,
    pub seed: Option<u64>,
    /// Kestrel extension: `false` opts this request out of speculative decoding.
    pub speculative: Option<bool>,
    pub n: Option<i64>,
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    /// Token id (as a string) to a bias in [-100, 100] added to its logit.
    pub logit_bias: Option<Map<String, Value>>,
    /// `{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}`.
    pub response_format: Option<Value>,
    /// Extension: a Lark grammar the output must follow (llguidance's dialect).
    pub grammar: Option<String>,
    /// Extension: a regular expression the output must match.
    pub regex: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    #[serde(flatten)]
    pub sampling: Sampling,
    pub prompt: Value,
    /// Number of top alternatives per token (0..=20).
    pub logprobs: Option<i64>,
    #[serde(default)]
    pub echo: bool,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    #[serde(flatten)]
    pub sampling: Sampling,
    pub messages: Vec<ChatMessageIn>,
    pub max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<i64>,
    /// Function tools: `[{"type": "function", "function": {name, description, parameters}}]`.
    pub tools: Option<Vec<Value>>,
    /// `"auto"`, `"none"`, `"required"` or `{"type": "function", "function": {"name"}}`.
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    /// A string, a list of `{"type": "text", "text": ...}` parts, or null.
    #[serde(default)]
    pub content: Value,
    /// An assistant message's tool calls (OpenAI's shape).
    pub tool_calls: Option<Value>,
    /// A tool message's answer to this call id.
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

impl ChatMessageIn {
    pub fn text(&self, index: usize) -> Result<String, ApiError> {
        let param = format!("messages[{index}].content");
        match &self.content {
            Value::String(s) => Ok(s.clone()),
            Value::Null => Ok(String::new()),
            Value::Array(parts) => {
                let mut text = String::new();
                for part in parts {
                    match (part.get("type").and_then(Value::as_str), part.get("text")) {
                        (Some("text"), Some(Value::String(t))) => text.push_str(t),
                        _ => {
                            return Err(ApiError::invalid(
                                "only text content parts are supported",
                                Some(&param),
                            ));
                        }
                    }
                }
                Ok(text)
            }
            _ => Err(ApiError::invalid(
                "content must be a string or a list of text parts",
                Some(&param),
            )),
        }
    }
}

impl Sampling {
    pub fn stops(&self) -> Vec<String> {
        match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        }
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }

    /// `n`: how many choices to generate (1..=16).
    pub fn choices(&self) -> Result<usize, ApiError> {
        match self.n {
            None => Ok(1),
            Some(n) if (1..=MAX_CHOICES as i64).contains(&n) => Ok(n as usize),
            Some(n) => Err(ApiError::invalid(
                format!("n must be in 1..={MAX_CHOICES}, got {n}"),
                Some("n"),
            )),
        }
    }

    /// `logit_bias` as (token id, bias) pairs, checked against the vocabulary size.
    pub fn logit_bias(&self, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
        let bad = |m: String| ApiError::invalid(m, Some("logit_bias"));
        let Some(map) = &self.logit_bias else {
            return Ok(Vec::new());
        };
        map.iter()
            .map(|(k, v)| {
                let id: u32 = k
                    .parse()
                    .ok()
                    .filter(|&id| (id as usize) < vocab)
                    .ok_or_else(|| bad(format!("'{k}' is not a token id below {vocab}")))?;
                let b = v
                    .as_f64()
                    .filter(|b| (-100.0..=100.0).contains(b))
                    .ok_or_else(|| {
                        bad(format!("the bias of {k} must be a number in [-100, 100]"))
                    })?;
                Ok((id, b as f32))
            })
            .collect()
    }

    /// The output constraint of `response_format`, `grammar` or `regex` (at most one).
    pub fn constraint(&self) -> Result<Option<Constraint>, ApiError> {
        let from_format = match &self.response_format {
            None => None,
            Some(f) => response_format(f)?,
        };
        let mut given = [
            from_format.map(|c| ("response_format", c)),
            self.grammar
                .clone()
                .map(|g| ("grammar", Constraint::Lark(g))),
            self.regex.clone().map(|r| ("regex", Constraint::Regex(r))),
        ]
        .into_iter()
        .flatten();
        let first = given.next();
        if let Some((name, _)) = given.next() {
            return Err(ApiError::invalid(
                "response_format, grammar and regex exclude one another",
                Some(name),
            ));
        }
        Ok(first.map(|(_, c)| c))
    }

    /// Sampler settings with OpenAI's defaults (temperature 1, no top-k/top-p/min-p).
    pub fn params(&self) -> Result<SamplerParams, ApiError> {
        if self.stops().len() > 4 {
            return Err(ApiError::invalid("at most 4 stop sequences", Some("stop")));
        }
        let top_k = match self.top_k {
            None => 0,
            Some(k) if k >= 0 => k as usize,
            Some(k) => {
                return Err(ApiError::invalid(
                    format!("top_k must be >= 0, got {k}"),
                    Some("top_k"),
                ));
            }
        };
        let p = SamplerParams {
            temperature: self.temperature.unwrap_or(1.0),
            top_k,
            top_p: self.top_p.unwrap_or(1.0),
            min_p: self.min_p.unwrap_or(0.0),
            repeat_penalty: self.repeat_penalty.unwrap_or(1.0),
            repeat_last_n: 64,
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            seed: self.seed,
        };
        if let Err(msg) = p.validate() {
            let param = msg.split_whitespace().next().map(str::to_string);
            return Err(ApiError::invalid(msg, param.as_deref()));
        }
        Ok(p)
    }
}

/// Most choices (`n`) one request may ask for.
pub const MAX_CHOICES: usize = 16;

/// `response_format`: `text` (no constraint), `json_object`, or `json_schema` with its
/// `schema` and `strict`.
fn response_format(f: &Value) -> Result<Option<Constraint>, ApiError> {
    let bad = |m: &str| ApiError::invalid(m, Some("response_format"));
    match f.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::json_object())),
        Some("json_schema") => {
            let js = f
                .get("json_schema")
                .ok_or_else(|| bad("json_schema is missing"))?;
            let schema = match js.get("schema") {
                Some(s @ Value::Object(_)) => s.clone(),
                Some(_) => return Err(bad("json_schema.schema must be an object")),
                None => return Err(bad("json_schema.schema is missing")),
            };
            let strict = match js.get("strict") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => return Err(bad("json_schema.strict must be a boolean")),
            };
            Ok(Some(Constraint::JsonSchema { schema, strict }))
        }
        _ => Err(bad(
            "response_format.type must be text, json_object or json_schema",
        )),
    }
}

/// `max_tokens` checked against the context: absent means "until the context is full".
pub fn max_tokens(
    value: Option<i64>,
    param: &str,
    prompt_len: usize,
    ctx: usize,
) -> Result<usize, ApiError> {
    let room = ctx.saturating_sub(prompt_len).max(1);
    match value {
        None => Ok(room),
        Some(n) if n < 1 => Err(ApiError::invalid(
            format!("{param} must be at least 1, got {n}"),
            Some(param),
        )),
        Some(n) if n as u64 > ctx as u64 => Err(ApiError::invalid(
            format!("{param} is {n}, more than the context size {ctx}"),
            Some(param),
        )),
        Some(n) => Ok(n as usize),
    }
}

/// A completion prompt: text, or token ids (a list of integers, or a list of one of either).
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

pub fn parse_prompt(value: &Value) -> Result<Prompt, ApiError> {
    let bad = |m: &str| ApiError::invalid(m, Some("prompt"));
    match value {
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(items) if items.iter().all(Value::is_number) && !items.is_empty() => {
            let ids = items
                .iter()
                .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| bad("token ids must be integers in 0..2^32"))?;
            Ok(Prompt::Ids(ids))
        }
        Value::Array(items) if items.len() == 1 => parse_prompt(&items[0]),
        Value::Array(items) if items.len() > 1 => {
            Err(bad("only one prompt per request is supported"))
        }
        _ => Err(bad(
            "prompt must be a string or a non-empty list of token ids",
        )),
    }
}
