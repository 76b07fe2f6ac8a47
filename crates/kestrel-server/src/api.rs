//! Request bodies of the OpenAI endpoints and their checks.

use kestrel_engine::sampler::SamplerParams;
use serde::Deserialize;
use serde_json::Value;

use crate::error::ApiError;

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
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    /// A string, a list of `{"type": "text", "text": ...}` parts, or null.
    #[serde(default)]
    pub content: Value,
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

    /// Sampler settings with OpenAI's defaults (temperature 1, no top-k/top-p/min-p).
    pub fn params(&self) -> Result<SamplerParams, ApiError> {
        if let Some(n) = self.n
            && n != 1
        {
            return Err(ApiError::invalid("only n = 1 is supported", Some("n")));
        }
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
