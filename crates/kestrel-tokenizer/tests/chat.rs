//! Chat templates: the reference renderings of Qwen's template, random conversations
//! against Python's jinja2 (rendering as transformers does), and the built-in templates.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};

use kestrel_tokenizer::chat::builtin_names;
use kestrel_tokenizer::{ChatMessage, ChatTemplate, ChatTemplateError};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

fn messages_from_json(value: &Value) -> Vec<ChatMessage> {
    serde_json::from_value(value.clone()).expect("messages")
}

/// One rendering job. Serialized straight from the structs so that the oracle sees the
/// message keys in the same order (role, content, ...) as the template under test.
#[derive(Debug, Clone, serde::Serialize)]
struct Case {
    messages: Vec<ChatMessage>,
    tools: Option<Value>,
    add_generation_prompt: bool,
    bos_token: String,
    eos_token: String,
}

impl Case {
    fn new(messages: Vec<ChatMessage>, add_generation_prompt: bool) -> Case {
        Case {
            messages,
            tools: None,
            add_generation_prompt,
            bos_token: "<s>".to_string(),
            eos_token: "</s>".to_string(),
        }
    }
}

#[test]
fn qwen_template_matches_reference_renderings() {
    let gguf = common::open_gguf("qwen2.5-coder-1.5b");
    let template = ChatTemplate::from_gguf(&gguf)
        .expect("template compiles")
        .expect("qwen has a chat template");
    let reference =
        common::read_json(&common::reference_dir().join("chat_templates.qwen2.5-coder-1.5b.json"));
    let cases = reference["cases"].as_array().expect("cases[]");
    assert!(!cases.is_empty());
    for case in cases {
        let bos = common::text(&case["bos_token"]);
        let eos = common::text(&case["eos_token"]);
        // The file's own special tokens are the ones the reference used.
        assert_eq!(template.bos_token(), bos);
        assert_eq!(template.eos_token(), eos);
        let messages = messages_from_json(&case["messages"]);
        let add = case["add_generation_prompt"].as_bool().expect("bool");
        let got = template.render(&messages, add).expect("renders");
        assert_eq!(
            got,
            common::text(&case["rendered"]),
            "case {}",
            case["name"]
        );
    }
    eprintln!("{} reference renderings match", cases.len());
}

/// Renders every case with the Python oracle.
fn render_with_jinja2(source: &str, cases: &[Case]) -> Vec<Result<String, String>> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/oracle/render_jinja.py");
    let mut child = Command::new("python3")
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 (with jinja2, see requirements-test.txt) must be available");
    #[derive(serde::Serialize)]
    struct Job<'a> {
        template: &'a str,
        cases: &'a [Case],
    }
    let job = serde_json::to_string(&Job {
        template: source,
        cases,
    })
    .expect("job JSON");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(job.as_bytes())
        .expect("write job");
    let output = child.wait_with_output().expect("python3 runs");
    assert!(
        output.status.success(),
        "jinja2 oracle failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let results: Vec<Value> = serde_json::from_slice(&output.stdout).expect("oracle JSON");
    results
        .into_iter()
        .map(|r| match (r.get("ok"), r.get("error")) {
            (Some(ok), _) => Ok(common::text(ok).to_string()),
            (_, Some(err)) => Err(common::text(err).to_string()),
            _ => panic!("bad oracle result {r}"),
        })
        .collect()
}

const FRAGMENTS: &[&str] = &[
    "hello",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "world",
    "{",
    "}",
    "{{",
    "%}",
    "\"",
    "'",
    "\\",
    "<|im_end|>",
    "<end_of_turn>",
    "é",
    "日本語",
    "🤖",
    "x=1;",
    "  padded  ",
    "tools",
    "None",
];

fn random_text(rng: &mut StdRng) -> String {
    let n = rng.random_range(0..8);
    (0..n)
        .map(|_| FRAGMENTS[rng.random_range(0..FRAGMENTS.len())])
        .collect()
}

fn random_tool(rng: &mut StdRng, i: usize) -> Value {
    json!({
        "type": "function",
        "function": {
            "name": format!("tool_{i}"),
            "description": random_text(rng),
            "parameters": {
                "type": "object",
                "properties": { "city": { "type": "string", "enum": ["Paris", "Zürich"] },
                                "days": { "type": "integer", "minimum": 1 },
                                "ratio": { "type": "number", "default": 0.5 },
                                "flag": { "type": "boolean", "default": true },
                                "nothing": null },
                "required": ["city"]
            }
        }
    })
}

/// A random conversation: optional system prompt, alternating user/assistant turns,
/// sometimes assistant tool calls followed by tool results.
fn random_case(rng: &mut StdRng, with_tools: bool) -> Case {
    let mut messages = Vec::new();
    if rng.random_bool(0.5) {
        messages.push(ChatMessage::system(random_text(rng)));
    }
    let turns = rng.random_range(1..5);
    for t in 0..turns {
        messages.push(ChatMessage::user(random_text(rng)));
        let last = t + 1 == turns;
        if last && rng.random_bool(0.5) {
            break;
        }
        if with_tools && rng.random_bool(0.4) {
            let calls: Vec<Value> = (0..rng.random_range(1..3))
                .map(|i| {
                    json!({"type": "function", "function": {
                        "name": format!("tool_{i}"),
                        "arguments": {"city": random_text(rng), "days": i + 1}
                    }})
                })
                .collect();
            let n_calls = calls.len();
            let mut call_message = ChatMessage::assistant(random_text(rng));
            call_message.tool_calls = Some(Value::Array(calls));
            messages.push(call_message);
            for _ in 0..n_calls {
                messages.push(ChatMessage::new("tool", random_text(rng)));
            }
        }
        messages.push(ChatMessage::assistant(random_text(rng)));
    }
    let mut case = Case::new(messages, rng.random_bool(0.5));
    if with_tools {
        case.tools = Some(Value::Array(
            (0..rng.random_range(1..3))
                .map(|i| random_tool(rng, i))
                .collect(),
        ));
    }
    case
}

/// Compares every case with the oracle; returns how many rendered without error.
fn check_against_jinja2(template: &ChatTemplate, cases: &[Case]) -> usize {
    let expected = render_with_jinja2(template.source(), cases);
    assert_eq!(expected.len(), cases.len());
    let mut rendered = 0;
    for (case, want) in cases.iter().zip(expected) {
        let t = ChatTemplate::new(template.name(), template.source())
            .expect("compiles")
            .with_special_tokens(case.bos_token.as_str(), case.eos_token.as_str());
        let got = t.render_with_tools(
            &case.messages,
            case.tools.as_ref(),
            case.add_generation_prompt,
        );
        match (want, got) {
            (Ok(want), Ok(got)) => {
                assert_eq!(got, want, "{}: case {case:?}", template.name());
                rendered += 1;
            }
            (Err(_), Err(_)) => {}
            (want, got) => panic!("{}: jinja2 {want:?} but kestrel {got:?}", template.name()),
        }
    }
    rendered
}

#[test]
fn random_conversations_render_like_jinja2() {
    let gguf = common::open_gguf("qwen2.5-coder-1.5b");
    let qwen = ChatTemplate::from_gguf(&gguf)
        .expect("compiles")
        .expect("has template");
    let mut rng = StdRng::seed_from_u64(0x5eed_c4a7);
    let cases: Vec<Case> = (0..120)
        .map(|i| random_case(&mut rng, i % 2 == 1))
        .collect();
    assert_eq!(check_against_jinja2(&qwen, &cases), cases.len());
    for name in builtin_names() {
        let template = ChatTemplate::named(name).expect("builtin");
        let cases: Vec<Case> = (0..60).map(|_| random_case(&mut rng, false)).collect();
        assert_eq!(
            check_against_jinja2(&template, &cases),
            cases.len(),
            "{name}"
        );
    }
}

#[test]
fn template_features_render_like_jinja2() {
    // Python string methods, loop controls, raise_exception, tojson options, slicing.
    let source = r#"
{%- for m in messages %}
  {%- if m.content.startswith('skip') %}{% continue %}{% endif %}
  {%- if m.content == 'stop' %}{% break %}{% endif %}
  [{{ m.role.upper() }}|{{ m.content.strip() }}|{{ m.content.split(' ') | length }}|{{ m.content.endswith('!') }}]
{%- endfor %}
{{ messages[-1:] | tojson }}
{{ messages[0] | tojson(indent=2) }}
{{ {'b': 1, 'a': [1, 2.5, none, true]} | tojson(sort_keys=true) }}
{{ 'ÿ<>&' | tojson(ensure_ascii=true) }}
{%- if messages | length > 4 %}{{ raise_exception('too many messages') }}{% endif %}
"#;
    let template = ChatTemplate::new("features", source).expect("compiles");
    let mk =
        |texts: &[&str]| Case::new(texts.iter().map(|t| ChatMessage::user(*t)).collect(), false);
    let cases = vec![
        mk(&["  hi there!  "]),
        mk(&["skip me", "a b c", "stop", "never"]),
        mk(&["one", "two", "three", "four", "five"]),
        mk(&["x"]),
    ];
    assert_eq!(check_against_jinja2(&template, &cases), 3);
    // The error names the template's message.
    match template.render(&cases[2].messages, false) {
        Err(ChatTemplateError::Render { message, .. }) => {
            assert!(message.contains("too many messages"), "{message}")
        }
        other => panic!("expected a render error, got {other:?}"),
    }
}

fn two_turns() -> Vec<ChatMessage> {
    vec![
        ChatMessage::user("Hi!"),
        ChatMessage::assistant("Hello. How can I help?"),
        ChatMessage::user("Tell me a joke."),
    ]
}

#[test]
fn builtin_chatml_has_the_chatml_format() {
    let t = ChatTemplate::named("chatml").expect("builtin");
    let [u1, a1, u2] = ["Hi!", "Hello. How can I help?", "Tell me a joke."];
    let want = format!(
        "<|im_start|>user\n{u1}<|im_end|>\n<|im_start|>assistant\n{a1}<|im_end|>\n\
         <|im_start|>user\n{u2}<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(t.render(&two_turns(), true).expect("renders"), want);
    let without = want
        .strip_suffix("<|im_start|>assistant\n")
        .expect("suffix");
    assert_eq!(t.render(&two_turns(), false).expect("renders"), without);
}

#[test]
fn builtin_gemma_has_the_gemma_format() {
    let t = ChatTemplate::named("gemma")
        .expect("builtin")
        .with_special_tokens("<bos>", "<eos>");
    let [u1, a1, u2] = ["Hi!", "Hello. How can I help?", "Tell me a joke."];
    let want = format!(
        "<bos><start_of_turn>user\n{u1}<end_of_turn>\n<start_of_turn>model\n{a1}<end_of_turn>\n\
         <start_of_turn>user\n{u2}<end_of_turn>\n<start_of_turn>model\n"
    );
    assert_eq!(t.render(&two_turns(), true).expect("renders"), want);
    // A system prompt joins the first user turn.
    let mut with_system = vec![ChatMessage::system("Be brief.")];
    with_system.extend(two_turns());
    let rendered = t.render(&with_system, true).expect("renders");
    assert!(rendered.starts_with("<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n"));
}

#[test]
fn builtin_llama3_has_the_llama3_format() {
    let t = ChatTemplate::named("llama3")
        .expect("builtin")
        .with_special_tokens("<|begin_of_text|>", "<|eot_id|>");
    let [u1, a1, u2] = ["Hi!", "Hello. How can I help?", "Tell me a joke."];
    let h = |role: &str| format!("<|start_header_id|>{role}<|end_header_id|>\n\n");
    let want = format!(
        "<|begin_of_text|>{}{u1}<|eot_id|>{}{a1}<|eot_id|>{}{u2}<|eot_id|>{}",
        h("user"),
        h("assistant"),
        h("user"),
        h("assistant")
    );
    assert_eq!(t.render(&two_turns(), true).expect("renders"), want);
}

#[test]
fn resolve_picks_model_builtin_or_file() {
    let gemma = common::open_gguf("gemma-3-270m");
    // Gemma 3 270M is a base model without a template.
    assert!(ChatTemplate::from_gguf(&gemma).expect("reads").is_none());
    let err = ChatTemplate::resolve(&gemma, None).expect_err("no template");
    assert!(matches!(err, ChatTemplateError::NoTemplate));
    let message = err.to_string();
    assert!(
        message.contains("--chat-template chatml|gemma|llama3|FILE"),
        "{message}"
    );

    let t = ChatTemplate::resolve(&gemma, Some("gemma")).expect("builtin");
    assert_eq!(t.name(), "gemma");
    assert_eq!(t.bos_token(), "<bos>");
    assert_eq!(t.eos_token(), "<eos>");

    let dir = std::env::temp_dir().join(format!("kestrel-chat-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let file = dir.join("custom.jinja");
    std::fs::write(
        &file,
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
    )
    .expect("write template");
    let t = ChatTemplate::resolve(&gemma, file.to_str()).expect("file");
    assert_eq!(
        t.render(&two_turns()[..1], false).expect("renders"),
        "user: Hi!\n"
    );
    std::fs::remove_dir_all(&dir).ok();

    let err = ChatTemplate::resolve(&gemma, Some("no-such-template")).expect_err("unknown");
    assert!(
        matches!(err, ChatTemplateError::UnknownTemplate(_)),
        "{err}"
    );

    let qwen = common::open_gguf("qwen2.5-coder-1.5b");
    let t = ChatTemplate::resolve(&qwen, None).expect("model template");
    assert_eq!(t.name(), "tokenizer.chat_template");
}

#[test]
fn render_prompt_drops_bos_text_the_tokenizer_adds() {
    let gemma = common::open_gguf("gemma-3-270m");
    let tok = common::tokenizer("gemma-3-270m");
    let t = ChatTemplate::resolve(&gemma, Some("gemma")).expect("builtin");
    let prompt = t.render_prompt(tok, &two_turns(), true).expect("renders");
    assert!(prompt.starts_with("<start_of_turn>user\n"), "{prompt:?}");
    let ids = tok.encode(&prompt, true, true);
    // Exactly one BOS, then the control token <start_of_turn>.
    assert_eq!(ids[0], tok.bos_id().expect("bos"));
    assert_ne!(ids[1], ids[0]);
    assert_eq!(Some(ids[1]), tok.token_id("<start_of_turn>"));
}

#[test]
fn syntax_errors_are_reported() {
    let err = ChatTemplate::new("broken", "{% for m in messages %}").expect_err("unclosed for");
    assert!(matches!(err, ChatTemplateError::Syntax { .. }), "{err}");
}

#[test]
fn builtins_match_llama_cpp_builtin_formats() {
    // llama.cpp's own chat formats leave BOS to the tokenizer; ours emit `bos_token`
    // first, which `render_prompt` drops when the tokenizer adds BOS.
    let fixture = common::read_json(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/llamacpp_chat_builtins.json"),
    );
    let cases = fixture["cases"].as_array().expect("cases[]");
    assert!(!cases.is_empty());
    for case in cases {
        let name = common::text(&case["template"]);
        let bos = match name {
            "gemma" => "<bos>",
            "llama3" => "<|begin_of_text|>",
            _ => "",
        };
        let template = ChatTemplate::named(name)
            .expect("builtin")
            .with_special_tokens(bos, "<eos>");
        let messages = messages_from_json(&case["messages"]);
        let add = case["add_generation_prompt"].as_bool().expect("bool");
        let rendered = template.render(&messages, add).expect("renders");
        let without_bos = rendered.strip_prefix(bos).expect("starts with BOS text");
        assert_eq!(
            without_bos,
            common::text(&case["rendered"]),
            "{name} {messages:?}"
        );
    }
}
