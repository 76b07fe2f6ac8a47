//! Fuzzes chat-template compilation and rendering: a template from a model file is
//! untrusted, so any source must compile or return an error and any compiled template must
//! render or return an error, never panic.
//!
//! Input: the template source, a NUL, then message contents separated by NULs (roles
//! cycle through system, user, assistant).

#![no_main]

use kestrel_tokenizer::{ChatMessage, ChatTemplate};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.split('\0');
    let source = parts.next().unwrap_or_default();
    let roles = ["system", "user", "assistant"];
    let messages: Vec<ChatMessage> = parts
        .take(8)
        .zip(roles.iter().cycle())
        .map(|(content, role)| ChatMessage::new(*role, content))
        .collect();
    let Ok(template) = ChatTemplate::new("fuzz", source) else {
        return;
    };
    let _ = template.render(&messages, true);
    let _ = template.render(&messages, false);
});
