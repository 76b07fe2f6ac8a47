//! `POST /v1/embeddings` in OpenAI's shape: `input` a string, a list of strings, a list of
//! token ids or a list of such lists; `encoding_format` `float` or `base64`; `dimensions`
//! only the model's own. The pooling is the model file's `<arch>.pooling_type` (last token
//! when the file states none), and each vector is L2-normalized as llama-server's
//! OpenAI endpoint returns it.

use base64::Engine as _;
use kestrel_engine::scheduler::{EmbedRequest, EmbedResult, SubmitError};
use kestrel_model::Pooling;
use serde_json::{Value, json};

use crate::api;
use crate::error::ApiError;

/// Fields `/v1/embeddings` takes (plus [`api::IGNORED_FIELDS`]).
const FIELDS: &[&str] = &["model", "input", "encoding_format", "dimensions"];
/// Most inputs one request may hold (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;

/// One input, as text or token ids.
pub enum Input {
    Text(String),
    Ids(Vec<u32>),
}

/// A checked request.
pub struct EmbeddingsRequest {
    pub model: Option<String>,
    pub inputs: Vec<Input>,
    pub base64: bool,
}

/// Parses and checks the body (everything but tokenization and the context length).
pub fn parse(body: &Value, n_embd: usize) -> Result<EmbeddingsRequest, ApiError> {
    let Value::Object(map) = body else {
        return Err(ApiError::invalid(
            "the request body must be a JSON object",
            None,
        ));
    };
    if let Some(key) = map
        .keys()
        .find(|k| !FIELDS.contains(&k.as_str()) && !api::IGNORED_FIELDS.contains(&k.as_str()))
    {
        return Err(
            ApiError::invalid(format!("the field '{key}' is not supported"), Some(key))
                .with_code("unsupported_parameter"),
        );
    }
    let model = match map.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(ApiError::invalid("model must be a string", Some("model"))),
    };
    let base64 = match map.get("encoding_format") {
        None | Some(Value::Null) => false,
        Some(Value::String(s)) if s == "float" => false,
        Some(Value::String(s)) if s == "base64" => true,
        Some(_) => {
            return Err(ApiError::invalid(
                "encoding_format must be \"float\" or \"base64\"",
                Some("encoding_format"),
            ));
        }
    };
    match map.get("dimensions") {
        None | Some(Value::Null) => {}
        Some(d) if d.as_u64() == Some(n_embd as u64) => {}
        Some(d) => {
            return Err(ApiError::invalid(
                format!(
                    "dimensions is {d}: this model's embeddings have {n_embd} dimensions and \
                     cannot be shortened"
                ),
                Some("dimensions"),
            ));
        }
    }
    let inputs = parse_input(map.get("input").unwrap_or(&Value::Null))?;
    Ok(EmbeddingsRequest {
        model,
        inputs,
        base64,
    })
}

fn parse_input(value: &Value) -> Result<Vec<Input>, ApiError> {
    let bad = |m: String| ApiError::invalid(m, Some("input"));
    let ids = |items: &[Value], at: &str| -> Result<Vec<u32>, ApiError> {
        if items.is_empty() {
            return Err(bad(format!("{at} is an empty list of token ids")));
        }
        items
            .iter()
            .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| bad(format!("{at}: token ids must be integers in 0..2^32")))
    };
    let text = |s: &str, at: &str| -> Result<Input, ApiError> {
        if s.is_empty() {
            return Err(bad(format!("{at} is an empty string")));
        }
        Ok(Input::Text(s.to_string()))
    };
    let inputs = match value {
        Value::String(s) => vec![text(s, "input")?],
        Value::Array(items) if items.is_empty() => {
            return Err(bad("input is an empty list".into()));
        }
        Value::Array(items) if items.iter().all(Value::is_number) => {
            vec![Input::Ids(ids(items, "input")?)]
        }
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let at = format!("input[{i}]");
                match item {
                    Value::String(s) => text(s, &at),
                    Value::Array(list) => ids(list, &at).map(Input::Ids),
                    _ => Err(bad(format!("{at} must be a string or a list of token ids"))),
                }
            })
            .collect::<Result<Vec<_>, _>>()?,
        Value::Null => return Err(bad("input is missing".into())),
        _ => {
            return Err(bad(
                "input must be a string, a list of strings, a list of token ids or a list of \
                 such lists"
                    .into(),
            ));
        }
    };
    if inputs.len() > MAX_INPUTS {
        return Err(bad(format!(
            "{} inputs: at most {MAX_INPUTS} per request",
            inputs.len()
        )));
    }
    Ok(inputs)
}

/// The pooling the endpoint uses for a model declaring `declared`: the file's, or the
/// last token's when it states none; an error for pooling that gives no single vector.
pub fn pooling(declared: Option<Pooling>) -> Result<Pooling, ApiError> {
    match declared {
        None => Ok(Pooling::Last),
        Some(p @ (Pooling::Mean | Pooling::Cls | Pooling::Last)) => Ok(p),
        Some(p) => Err(ApiError::invalid(
            format!(
                "this model's pooling type is '{}', which gives no single vector per input: \
                 /v1/embeddings needs mean, cls or last pooling",
                p.name()
            ),
            None,
        )),
    }
}

/// Scales `v` to unit Euclidean length (llama.cpp's `common_embd_normalize` with norm 2:
/// a zero vector stays zero).
pub fn normalize(v: &mut [f32]) {
    let sum: f64 = v.iter().map(|&x| x as f64 * x as f64).sum();
    let scale = if sum > 0.0 { 1.0 / sum.sqrt() } else { 0.0 };
    for x in v {
        *x = (*x as f64 * scale) as f32;
    }
}

/// The response body for `vectors` (already normalized).
pub fn response(model: &str, vectors: &[Vec<f32>], base64: bool, prompt_tokens: usize) -> Value {
    let data: Vec<Value> = vectors
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let embedding = if base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    json!({
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    })
}

/// A submit error as the client's 400 (or 503 when the scheduler is gone).
pub fn submit_error(e: SubmitError) -> ApiError {
    match e {
        SubmitError::PromptTooLong { .. } => {
            ApiError::invalid(e.to_string(), Some("input")).with_code("context_length_exceeded")
        }
        SubmitError::Stopped => ApiError::unavailable(e.to_string()),
        _ => ApiError::invalid(e.to_string(), Some("input")),
    }
}

/// The scheduler's request for `inputs`, replying on a oneshot channel.
pub fn request(
    inputs: Vec<Vec<u32>>,
    pooling: Pooling,
) -> (EmbedRequest, tokio::sync::oneshot::Receiver<EmbedResult>) {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let req = EmbedRequest {
        inputs,
        pooling,
        reply: Box::new(move |r| {
            let _ = tx.send(r);
        }),
    };
    (req, rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(body: Value) -> String {
        match parse(&body, 8) {
            Ok(_) => panic!("accepted {body}"),
            Err(e) => {
                assert_eq!(e.status.as_u16(), 400);
                e.message
            }
        }
    }

    #[test]
    fn input_shapes_and_refusals() {
        let n = |body: Value| parse(&body, 8).map(|r| r.inputs.len()).unwrap();
        assert_eq!(n(json!({"input": "hi"})), 1);
        assert_eq!(n(json!({"input": ["a", "b", "c"]})), 3);
        assert_eq!(n(json!({"input": [1, 2, 3]})), 1);
        assert_eq!(n(json!({"input": [[1, 2], [3], "x"], "dimensions": 8})), 3);
        assert!(
            parse(&json!({"input": "x", "encoding_format": "base64"}), 8)
                .unwrap()
                .base64
        );
        assert!(err(json!({"input": ""})).contains("empty string"));
        assert!(err(json!({"input": []})).contains("empty list"));
        assert!(err(json!({"input": [[]]})).contains("input[0]"));
        assert!(err(json!({"input": ["a", 3]})).contains("input[1]"));
        assert!(err(json!({"input": [1, -2]})).contains("token ids"));
        assert!(err(json!({"input": [[1, 2.5]]})).contains("token ids"));
        assert!(err(json!({"input": {"a": 1}})).contains("input must be"));
        assert!(err(json!({})).contains("missing"));
        assert!(err(json!({"input": "x", "dimensions": 4})).contains("8 dimensions"));
        assert!(err(json!({"input": "x", "encoding_format": "f16"})).contains("base64"));
        assert!(err(json!({"input": "x", "pooling": "mean"})).contains("'pooling'"));
        assert!(err(json!(["x"])).contains("JSON object"));
        let many: Vec<&str> = vec!["x"; MAX_INPUTS + 1];
        assert!(err(json!({ "input": many })).contains("at most"));
    }

    #[test]
    fn normalize_gives_unit_length_and_keeps_zero() {
        let mut v = vec![3.0, -4.0, 0.0];
        normalize(&mut v);
        assert_eq!(v, [0.6, -0.8, 0.0]);
        let mut z = vec![0.0; 4];
        normalize(&mut z);
        assert_eq!(z, [0.0; 4]);
    }
}
