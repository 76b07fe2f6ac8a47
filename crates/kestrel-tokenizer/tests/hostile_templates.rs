//! Untrusted chat templates: each hostile template must end in a render error (never a
//! hang, a stack overflow or an aborting allocation) within a few seconds, and a
//! well-behaved template must still render afterwards.

use std::time::{Duration, Instant};

use kestrel_tokenizer::{ChatMessage, ChatTemplate, ChatTemplateError};

/// (what it does, template source, a word the error message must contain).
const HOSTILE: &[(&str, &str, &str)] = &[
    (
        "nested loops of 10^10 iterations",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "fuel",
    ),
    ("indent of 2^62", "{{ 'a\nb' | indent(2**62) }}", "width"),
    (
        "indent width keyword",
        "{{ 'a\nb' | indent(width=10**9) }}",
        "width",
    ),
    (
        "tojson indent of 2^62",
        "{{ messages | tojson(indent=2**62) }}",
        "width",
    ),
    (
        "printf width",
        "{{ '%999999999999d' | format(1) }}",
        "width",
    ),
    (
        "str.format width",
        "{{ '{:999999999999}'.format(1) }}",
        "width",
    ),
    (
        "list of 10^12 items",
        "{{ ([1] * 10**12) | list | length }}",
        "items",
    ),
    (
        "join of 10^12 items",
        "{{ ([1] * 10**12) | join(',') }}",
        "items",
    ),
    (
        "tojson of 10^12 items",
        "{{ ([1] * 10**12) | tojson }}",
        "items",
    ),
    ("printing 10^12 items", "{{ [1] * 10**12 }}", "items"),
    (
        "printing nested 10^12 items",
        "{{ [[1] * 10**12] }}",
        "items",
    ),
    (
        "string of 10^12 items",
        "{{ ([1] * 10**12) | string }}",
        "items",
    ),
    (
        "deep recursion",
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "recursion",
    ),
    (
        "output of 10^12 bytes",
        "{% for i in range(100000) %}{{ 'x' * 100000000 }}{% endfor %}",
        "output",
    ),
    (
        "tojson of a doubling nest",
        "{% set ns = namespace(v=[1, 2]) %}{% for i in range(40) %}{% set ns.v = [ns.v, ns.v] %}{% endfor %}{{ ns.v | tojson(indent=1000) }}",
        "tojson output",
    ),
];

#[test]
fn hostile_templates_end_in_an_error_within_seconds() {
    let messages = [ChatMessage::user("hi")];
    for (what, source, needle) in HOSTILE {
        let template = ChatTemplate::new("hostile", *source).expect("compiles");
        let started = Instant::now();
        let result = template.render(&messages, true);
        let took = started.elapsed();
        match result {
            Err(ChatTemplateError::Render { message, .. }) => {
                assert!(
                    message.to_lowercase().contains(needle),
                    "{what}: error '{message}' does not mention '{needle}'"
                );
            }
            Err(other) => panic!("{what}: expected a render error, got {other}"),
            Ok(text) => panic!("{what}: rendered {} bytes", text.len()),
        }
        assert!(took < Duration::from_secs(10), "{what}: took {took:?}");
    }
    // The limits do not get in the way of an ordinary template.
    let ok = ChatTemplate::new(
        "ok",
        "{% for m in messages %}{{ m.role }}: {{ m.content | indent(2) }}{{ '%3d' | format(7) }}{{ [1,2] | tojson(indent=2) }}{% endfor %}",
    )
    .expect("compiles");
    assert_eq!(
        ok.render(&messages, true).expect("renders"),
        "user: hi  7[\n  1,\n  2\n]"
    );
}
