//! Tool calling: `tools` / `tool_choice` checked, the output format of the model's family
//! (Qwen's `<tool_call>` JSON, Mistral's `[TOOL_CALLS]` list, Llama 3's bare JSON object)
//! told from its chat template, a grammar that makes `required` or a named function always
//! produce parseable calls, and the parser that turns the model's text into `tool_calls`.

use serde_json::{Value, json};

use crate::constrain::Constraint;
use crate::error::ApiError;

/// How the model writes a call (told from its chat template's source).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallFormat {
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (Qwen 2.5 / 3, Hermes).
    Qwen,
    /// `[TOOL_CALLS] [{"name": ..., "arguments": {...}}]` (Mistral).
    Mistral,
    /// `{"name": ..., "parameters": {...}}` (Llama 3.x).
    Llama,
}

impl CallFormat {
    pub fn of_template(source: &str) -> CallFormat {
        if source.contains("<tool_call>") {
            CallFormat::Qwen
        } else if source.contains("[TOOL_CALLS]") {
            CallFormat::Mistral
        } else {
            CallFormat::Llama
        }
    }
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    Auto,
    None,
    Required,
    Named(String),
}

/// A request's checked tools.
#[derive(Debug, Clone)]
pub struct Tools {
    /// The `tools` array as given (the chat template renders it).
    pub list: Value,
    pub choice: ToolChoice,
    pub parallel: bool,
}

/// One parsed call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as a JSON text (OpenAI's shape).
    pub arguments: String,
}

impl Tools {
    /// Checks `tools`, `tool_choice` and `parallel_tool_calls`; `None` without tools.
    pub fn parse(
        tools: Option<&Vec<Value>>,
        choice: Option<&Value>,
        parallel: Option<bool>,
    ) -> Result<Option<Tools>, ApiError> {
        let Some(tools) = tools.filter(|t| !t.is_empty()) else {
            return match choice {
                None => Ok(None),
                Some(Value::String(s)) if s == "none" || s == "auto" => Ok(None),
                Some(_) => Err(ApiError::invalid(
                    "tool_choice needs tools",
                    Some("tool_choice"),
                )),
            };
        };
        for (i, t) in tools.iter().enumerate() {
            let param = format!("tools[{i}]");
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(ApiError::invalid(
                    "only function tools are supported",
                    Some(&param),
                ));
            }
            let name = t.pointer("/function/name").and_then(Value::as_str);
            if name.is_none_or(str::is_empty) {
                return Err(ApiError::invalid("function.name is missing", Some(&param)));
            }
            if let Some(p) = t.pointer("/function/parameters")
                && !p.is_object()
            {
                return Err(ApiError::invalid(
                    "function.parameters must be a JSON schema object",
                    Some(&param),
                ));
            }
        }
        let choice = match choice {
            None => ToolChoice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "auto" => ToolChoice::Auto,
                "none" => ToolChoice::None,
                "required" => ToolChoice::Required,
                _ => {
                    return Err(ApiError::invalid(
                        "tool_choice must be auto, none, required or a named function",
                        Some("tool_choice"),
                    ));
                }
            },
            Some(v) => {
                let name = v
                    .pointer("/function/name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "tool_choice must be auto, none, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                            Some("tool_choice"),
                        )
                    })?;
                if !tools.iter().any(|t| function_name(t) == Some(name)) {
                    return Err(ApiError::invalid(
                        format!("tool_choice names '{name}', which is not among the tools"),
                        Some("tool_choice"),
                    ));
                }
                ToolChoice::Named(name.to_string())
            }
        };
        Ok(Some(Tools {
            list: Value::Array(tools.clone()),
            choice,
            parallel: parallel.unwrap_or(true),
        }))
    }

    /// Whether calls are looked for in the output.
    pub fn active(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// For `required` or a named function: a grammar whose every output is one call (or
    /// several, with parallel calls) to an allowed tool with arguments valid under its
    /// parameter schema, in the model's own format.
    pub fn constraint(&self, format: CallFormat) -> Option<Constraint> {
        let allowed: Vec<&Value> = match &self.choice {
            ToolChoice::Auto | ToolChoice::None => return None,
            ToolChoice::Required => self.list.as_array()?.iter().collect(),
            ToolChoice::Named(n) => self
                .list
                .as_array()?
                .iter()
                .filter(|t| function_name(t) == Some(n.as_str()))
                .collect(),
        };
        let args_key = match format {
            CallFormat::Llama => "parameters",
            _ => "arguments",
        };
        let variants: Vec<Value> = allowed
            .iter()
            .map(|t| {
                let params = t
                    .pointer("/function/parameters")
                    .cloned()
                    .unwrap_or_else(|| json!({"type": "object"}));
                json!({
                    "type": "object",
                    "properties": {
                        "name": {"const": function_name(t).unwrap_or_default()},
                        args_key: params,
                    },
                    "required": ["name", args_key],
                    "additionalProperties": false,
                })
            })
            .collect();
        let schema = json!({
            "anyOf": variants,
            "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "lenient": true},
        });
        let many = if self.parallel { "+" } else { "" };
        let grammar = match format {
            CallFormat::Qwen => format!(
                "start: call{many}\ncall: \"<tool_call>\\n\" obj \"\\n</tool_call>\" \"\\n\"?\nobj: %json {schema}\n"
            ),
            CallFormat::Mistral => {
                let rest = if self.parallel { "(\", \" obj)*" } else { "" };
                format!("start: \"[TOOL_CALLS] [\" obj {rest} \"]\"\nobj: %json {schema}\n")
            }
            CallFormat::Llama => {
                let rest = if self.parallel { "(\"; \" obj)*" } else { "" };
                format!("start: obj {rest}\nobj: %json {schema}\n")
            }
        };
        Some(Constraint::Lark(grammar))
    }
}

fn function_name(tool: &Value) -> Option<&str> {
    tool.pointer("/function/name").and_then(Value::as_str)
}

impl Tools {
    /// [`parse_calls`], keeping only calls to these tools: text calling an unknown
    /// function stays content.
    pub fn calls_in(&self, text: &str) -> (String, Vec<ToolCall>) {
        let (content, calls) = parse_calls(text);
        let known = |c: &ToolCall| {
            self.list
                .as_array()
                .is_some_and(|l| l.iter().any(|t| function_name(t) == Some(c.name.as_str())))
        };
        if calls.iter().all(known) {
            (content, calls)
        } else {
            (text.trim().to_string(), Vec::new())
        }
    }
}

/// Splits a model's text into its plain content and its tool calls, whichever of the
/// known formats it uses. Text that is not a well-formed call stays content.
pub fn parse_calls(text: &str) -> (String, Vec<ToolCall>) {
    // Qwen / Hermes: any number of <tool_call> blocks among the text.
    if text.contains("<tool_call>") {
        let mut content = String::new();
        let mut calls = Vec::new();
        let mut rest = text;
        while let Some(start) = rest.find("<tool_call>") {
            content.push_str(&rest[..start]);
            let body = &rest[start + "<tool_call>".len()..];
            let (inner, after) = match body.find("</tool_call>") {
                Some(end) => (&body[..end], &body[end + "</tool_call>".len()..]),
                None => (body, ""),
            };
            match call_of(inner.trim(), "arguments") {
                Some(c) => calls.push(c),
                None => content.push_str(&rest[start..rest.len() - after.len()]),
            }
            rest = after;
        }
        content.push_str(rest);
        return (content.trim().to_string(), calls);
    }
    let trimmed = text.trim_start();
    // Mistral: [TOOL_CALLS] followed by a JSON list.
    if let Some(list) = trimmed.strip_prefix("[TOOL_CALLS]") {
        if let Ok(Value::Array(items)) = serde_json::from_str::<Value>(list.trim()) {
            let calls: Option<Vec<ToolCall>> =
                items.iter().map(|v| value_call(v, "arguments")).collect();
            if let Some(calls) = calls {
                return (String::new(), calls);
            }
        }
        return (text.to_string(), Vec::new());
    }
    // Llama 3: one JSON object (or several separated by ';'), maybe after <|python_tag|>.
    // Small models also wrap it in a Markdown code fence.
    let body = trimmed
        .strip_prefix("<|python_tag|>")
        .unwrap_or(trimmed)
        .trim();
    let body = body
        .strip_prefix("```json")
        .or_else(|| body.strip_prefix("```"))
        .and_then(|b| b.trim_end().strip_suffix("```"))
        .unwrap_or(body)
        .trim();
    if body.starts_with('{') {
        let calls: Option<Vec<ToolCall>> = body
            .split(';')
            .map(|part| {
                call_of(part.trim(), "parameters").or_else(|| call_of(part.trim(), "arguments"))
            })
            .collect();
        if let Some(calls) = calls.filter(|c| !c.is_empty()) {
            return (String::new(), calls);
        }
    }
    (text.to_string(), Vec::new())
}

fn call_of(json_text: &str, args_key: &str) -> Option<ToolCall> {
    value_call(&serde_json::from_str(json_text).ok()?, args_key)
}

fn value_call(v: &Value, args_key: &str) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?.to_string();
    let args = v.get(args_key).or_else(|| v.get("arguments"))?;
    let arguments = match args {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    Some(ToolCall { name, arguments })
}

/// Whether `text` (what the model wrote so far) may still become a tool call, so a
/// streaming response holds it back instead of sending it as content.
pub fn may_be_call(text: &str) -> bool {
    let t = text.trim_start();
    ["<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "{", "```"]
        .iter()
        .any(|m| t.starts_with(m) || m.starts_with(t))
}

/// An assistant message's `tool_calls` as chat templates expect them: `arguments` a JSON
/// object rather than the text OpenAI clients send.
pub fn calls_for_template(calls: &Value) -> Value {
    let mut calls = calls.clone();
    if let Some(list) = calls.as_array_mut() {
        for call in list {
            if let Some(args) = call.pointer_mut("/function/arguments")
                && let Some(parsed) = args
                    .as_str()
                    .and_then(|s| serde_json::from_str::<Value>(s).ok())
            {
                *args = parsed;
            }
        }
    }
    calls
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    #[test]
    fn parses_each_family_s_calls() {
        let qwen = "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"t\", \"arguments\": {}}\n</tool_call>";
        assert_eq!(
            parse_calls(qwen),
            (
                "Sure.".to_string(),
                vec![call("get_weather", "{\"city\":\"Paris\"}"), call("t", "{}")]
            )
        );
        let mistral = "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {\"x\": 1}}]";
        assert_eq!(
            parse_calls(mistral),
            (String::new(), vec![call("f", "{\"x\":1}")])
        );
        let llama = "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"x\": 2}}";
        assert_eq!(
            parse_calls(llama),
            (String::new(), vec![call("f", "{\"x\":2}")])
        );
        let fenced = "```json\n{\"name\": \"f\", \"arguments\": {\"x\": 3}}\n```";
        assert_eq!(
            parse_calls(fenced),
            (String::new(), vec![call("f", "{\"x\":3}")])
        );
        // Not calls: stays content.
        for text in ["hello", "{\"a\": 1}", "<tool_call>\nnot json\n</tool_call>"] {
            let (content, calls) = parse_calls(text);
            assert!(calls.is_empty(), "{text}");
            assert_eq!(content, text.trim());
        }
    }

    #[test]
    fn calls_to_unknown_tools_stay_content() {
        let tools = vec![json!({"type": "function", "function": {"name": "f"}})];
        let t = Tools::parse(Some(&tools), None, None).unwrap().unwrap();
        let text = "{\"name\": \"g\", \"arguments\": {}}";
        assert_eq!(t.calls_in(text), (text.to_string(), Vec::new()));
        assert_eq!(
            t.calls_in("{\"name\": \"f\", \"arguments\": {}}").1,
            vec![call("f", "{}")]
        );
    }

    #[test]
    fn tool_choice_is_checked() {
        let tools = vec![
            json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}),
        ];
        let named = json!({"type": "function", "function": {"name": "f"}});
        let t = Tools::parse(Some(&tools), Some(&named), None)
            .unwrap()
            .unwrap();
        assert_eq!(t.choice, ToolChoice::Named("f".into()));
        let other = json!({"type": "function", "function": {"name": "g"}});
        assert!(Tools::parse(Some(&tools), Some(&other), None).is_err());
        assert!(Tools::parse(Some(&tools), Some(&json!("sometimes")), None).is_err());
        assert!(Tools::parse(None, Some(&json!("required")), None).is_err());
        let bad = vec![json!({"type": "retrieval"})];
        assert!(Tools::parse(Some(&bad), None, None).is_err());
    }

    #[test]
    fn streaming_holds_back_only_possible_calls() {
        assert!(may_be_call(""));
        assert!(may_be_call("  <tool"));
        assert!(may_be_call("<tool_call>\n{\"na"));
        assert!(may_be_call("[TOOL"));
        assert!(!may_be_call("Hello"));
        assert!(!may_be_call("<b>"));
    }
}
