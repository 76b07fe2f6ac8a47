//! Chat templates: Jinja sources (from `tokenizer.chat_template`, a file, or a built-in
//! one) rendered with minijinja the way Hugging Face transformers renders them with
//! jinja2 (`trim_blocks`, `lstrip_blocks`, loop controls, Python string methods,
//! `raise_exception`, a `tojson` that writes like Python's `json.dumps`). Templates are
//! untrusted: [`limits`] bounds the time, memory and output of every rendering.

mod limits;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kestrel_gguf::GgufFile;
use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value, context};
use serde::{Deserialize, Serialize};

use crate::Tokenizer;

const TEMPLATE_NAME: &str = "chat";
const KEY_CHAT_TEMPLATE: &str = "tokenizer.chat_template";

/// Built-in templates for models whose file has none: (name, Jinja source).
const BUILTINS: &[(&str, &str)] = &[
    ("chatml", include_str!("templates/chatml.jinja")),
    ("gemma", include_str!("templates/gemma.jinja")),
    ("llama3", include_str!("templates/llama3.jinja")),
];

/// Names of the built-in templates.
pub fn builtin_names() -> Vec<&'static str> {
    BUILTINS.iter().map(|(name, _)| *name).collect()
}

/// Errors loading or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    /// The model has no template and none was chosen.
    #[error("model has no chat template; pass --chat-template {}|FILE", builtin_names().join("|"))]
    NoTemplate,
    /// A name that is neither a built-in template nor an existing file.
    #[error(
        "'{name}' is neither a built-in chat template ({builtins}) nor an existing file",
        name = .0,
        builtins = builtin_names().join(", ")
    )]
    UnknownTemplate(String),
    #[error("cannot read chat template file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{KEY_CHAT_TEMPLATE} is not a string")]
    BadMetadata,
    /// The Jinja source does not parse.
    #[error("chat template '{name}' does not compile: {message}")]
    Syntax { name: String, message: String },
    /// Rendering failed (including `raise_exception` called by the template).
    #[error("chat template '{name}' failed to render: {message}")]
    Render { name: String, message: String },
}

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    pub content: String,
    /// Tool calls of an assistant message, in the OpenAI shape the templates expect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A `tool` message's answer to this call id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The name of the tool (`tool` messages) or participant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }

    pub fn system(content: impl Into<String>) -> ChatMessage {
        ChatMessage::new("system", content)
    }

    pub fn user(content: impl Into<String>) -> ChatMessage {
        ChatMessage::new("user", content)
    }

    pub fn assistant(content: impl Into<String>) -> ChatMessage {
        ChatMessage::new("assistant", content)
    }
}

/// A compiled chat template plus the BOS/EOS texts it may refer to.
pub struct ChatTemplate {
    name: String,
    source: String,
    env: Arc<Environment<'static>>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("name", &self.name)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles a Jinja chat template. `name` only appears in error messages.
    pub fn new(
        name: impl Into<String>,
        source: impl Into<String>,
    ) -> Result<ChatTemplate, ChatTemplateError> {
        let name = name.into();
        let source = source.into();
        let env = make_environment(&source).map_err(|e| ChatTemplateError::Syntax {
            name: name.clone(),
            message: describe(&e),
        })?;
        let env = Arc::new(env);
        Ok(ChatTemplate {
            name,
            source,
            env,
            bos_token: String::new(),
            eos_token: String::new(),
        })
    }

    /// A built-in template (`chatml`, `gemma`, `llama3`), or `None` for other names.
    pub fn named(name: &str) -> Option<ChatTemplate> {
        let (name, source) = BUILTINS.iter().find(|(n, _)| *n == name)?;
        // Built-in sources are tested to compile.
        ChatTemplate::new(*name, *source).ok()
    }

    /// Reads a Jinja template from a file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<ChatTemplate, ChatTemplateError> {
        let path = path.as_ref();
        let source = std::fs::read_to_string(path).map_err(|source| ChatTemplateError::Io {
            path: path.to_owned(),
            source,
        })?;
        ChatTemplate::new(path.display().to_string(), source)
    }

    /// The template stored in a GGUF file (`tokenizer.chat_template`), with the file's
    /// BOS/EOS token texts; `Ok(None)` when the file has none.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Option<ChatTemplate>, ChatTemplateError> {
        let Some(value) = gguf.get(KEY_CHAT_TEMPLATE) else {
            return Ok(None);
        };
        let source = value.as_str().ok_or(ChatTemplateError::BadMetadata)?;
        let (bos, eos) = gguf_special_texts(gguf);
        Ok(Some(
            ChatTemplate::new(KEY_CHAT_TEMPLATE, source)?.with_special_tokens(bos, eos),
        ))
    }

    /// The template to use for a model: `choice` (a built-in name, else a file path) if
    /// given, else the model's own. The BOS/EOS texts always come from the model file.
    pub fn resolve(
        gguf: &GgufFile,
        choice: Option<&str>,
    ) -> Result<ChatTemplate, ChatTemplateError> {
        let Some(choice) = choice else {
            return ChatTemplate::from_gguf(gguf)?.ok_or(ChatTemplateError::NoTemplate);
        };
        let template = if let Some(t) = ChatTemplate::named(choice) {
            t
        } else if Path::new(choice).is_file() {
            ChatTemplate::from_file(choice)?
        } else {
            return Err(ChatTemplateError::UnknownTemplate(choice.to_string()));
        };
        let (bos, eos) = gguf_special_texts(gguf);
        Ok(template.with_special_tokens(bos, eos))
    }

    /// Sets the texts the template sees as `bos_token` and `eos_token`.
    pub fn with_special_tokens(
        mut self,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> ChatTemplate {
        self.bos_token = bos_token.into();
        self.eos_token = eos_token.into();
        self
    }

    /// Sets `bos_token`/`eos_token` from a tokenizer's BOS/EOS tokens.
    pub fn with_tokenizer_specials(self, tokenizer: &Tokenizer) -> ChatTemplate {
        let bos = tokenizer.special_text(tokenizer.bos_id());
        let eos = tokenizer.special_text(tokenizer.eos_id());
        self.with_special_tokens(bos, eos)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    /// Renders a conversation (no tools).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// Renders a conversation; `tools` (a JSON array of tool descriptions) is passed to
    /// the template as `tools`, `None` as Python's `None`.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        let ctx = context! {
            messages => Value::from_serialize(messages),
            tools => tools.map(Value::from_serialize).unwrap_or(Value::from(())),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        };
        limits::render(&self.env, TEMPLATE_NAME, ctx).map_err(|message| ChatTemplateError::Render {
            name: self.name.clone(),
            message,
        })
    }

    /// Renders a prompt ready to be encoded with `add_special = true` and
    /// `parse_special = true`: like llama.cpp, a leading BOS text is removed when the
    /// tokenizer adds BOS itself, and a trailing EOS text when it adds EOS.
    pub fn render_prompt(
        &self,
        tokenizer: &Tokenizer,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        let rendered = self.render(messages, add_generation_prompt)?;
        let mut text = rendered.as_str();
        if tokenizer.add_bos() && !self.bos_token.is_empty() {
            text = text.strip_prefix(self.bos_token.as_str()).unwrap_or(text);
        }
        if tokenizer.add_eos() && !self.eos_token.is_empty() {
            text = text.strip_suffix(self.eos_token.as_str()).unwrap_or(text);
        }
        Ok(text.to_string())
    }
}

/// BOS/EOS token texts of a GGUF file (empty when absent).
fn gguf_special_texts(gguf: &GgufFile) -> (String, String) {
    let text = |key: &str| -> String {
        let Some(id) = gguf.get_u64(key) else {
            return String::new();
        };
        gguf.get_array("tokenizer.ggml.tokens")
            .and_then(|tokens| tokens.get(usize::try_from(id).ok()?))
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string()
    };
    (
        text("tokenizer.ggml.bos_token_id"),
        text("tokenizer.ggml.eos_token_id"),
    )
}

/// minijinja's error with its detail and location.
fn describe(e: &Error) -> String {
    let mut message = e.to_string();
    if let Some(detail) = e.detail()
        && !message.contains(detail)
    {
        let _ = write!(message, ": {detail}");
    }
    message
}

fn make_environment(source: &str) -> Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    limits::install(&mut env);
    env.add_function("raise_exception", raise_exception);
    env.add_filter("tojson", tojson);
    env.add_template_owned(TEMPLATE_NAME, source.to_string())?;
    Ok(env)
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// transformers' `tojson`: Python's `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, with those keyword arguments honoured.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;

    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => {
                limits::check_width(&v)?;
                Some(" ".repeat(usize::try_from(n).unwrap_or(0)))
            }
            (None, Some(s)) if s.len() <= limits::MAX_WIDTH => Some(s.to_string()),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ));
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() && !v.is_undefined() => {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|p| p.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    )
                })?;
            match <[String; 2]>::try_from(parts) {
                Ok([a, b]) => (a, b),
                Err(_) => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ));
                }
            }
        }
        // Python's defaults: (", ", ": "), or (",", ": ") when indenting.
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let opts = JsonOptions {
        indent,
        item_sep,
        key_sep,
        ensure_ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    write_json(&mut out, &value, &opts, 0)?;
    if out.len() > limits::MAX_OUTPUT {
        return Err(too_long_json());
    }
    Ok(Value::from(out))
}

struct JsonOptions {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

fn too_long_json() -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!(
            "chat template limit: tojson output of more than {} bytes",
            limits::MAX_OUTPUT
        ),
    )
}

fn write_json(
    out: &mut String,
    value: &Value,
    opts: &JsonOptions,
    depth: usize,
) -> Result<(), Error> {
    // Checked as the text grows: indentation multiplies with depth.
    if out.len() > limits::MAX_OUTPUT {
        return Err(too_long_json());
    }
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(i) = value.as_i64().filter(|_| value.is_integer()) {
                let _ = write!(out, "{i}");
            } else {
                let f = f64::try_from(value.clone())?;
                out.push_str(&python_float(f));
            }
        }
        ValueKind::String => {
            write_json_string(out, value.as_str().unwrap_or_default(), opts.ensure_ascii)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = limits::collect_bounded(value)?.try_iter()?.collect();
            write_container(out, '[', ']', &items, opts, depth, |out, item, depth| {
                write_json(out, item, opts, depth)
            })?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = limits::collect_bounded(&Value::from_iter(
                value.try_iter()?.take(limits::MAX_ITEMS + 1),
            ))?
            .try_iter()?
            .collect();
            if opts.sort_keys {
                keys.sort_by_key(|k| k.to_string());
            }
            write_container(out, '{', '}', &keys, opts, depth, |out, key, depth| {
                match key.as_str() {
                    Some(s) => write_json_string(out, s, opts.ensure_ascii),
                    None => write_json_string(out, &key.to_string(), opts.ensure_ascii),
                }
                out.push_str(&opts.key_sep);
                write_json(out, &value.get_item(key)?, opts, depth)
            })?;
        }
        _ => write_json_string(out, &value.to_string(), opts.ensure_ascii),
    }
    Ok(())
}

fn write_container<T>(
    out: &mut String,
    open: char,
    close: char,
    items: &[T],
    opts: &JsonOptions,
    depth: usize,
    mut write_item: impl FnMut(&mut String, &T, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return Ok(());
    }
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(&opts.item_sep);
        }
        if let Some(indent) = &opts.indent {
            out.push('\n');
            out.push_str(&indent.repeat(depth + 1));
        }
        write_item(out, item, depth + 1)?;
    }
    if let Some(indent) = &opts.indent {
        out.push('\n');
        out.push_str(&indent.repeat(depth));
    }
    out.push(close);
    Ok(())
}

/// Python's `repr(float)` for the common cases (`1.0`, `0.5`, `1e-05`, `inf`).
fn python_float(f: f64) -> String {
    if f.is_nan() {
        "NaN".to_string()
    } else if f.is_infinite() {
        if f > 0.0 { "Infinity" } else { "-Infinity" }.to_string()
    } else if f.fract() == 0.0 && f.abs() < 1e16 {
        format!("{f:.1}")
    } else {
        format!("{f}")
    }
}

fn write_json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}
