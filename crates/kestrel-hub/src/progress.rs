//! Progress bars for long steps (downloads, hashing, loading): on stderr, and only when
//! both stdout and stderr are terminals, so logs and pipes stay clean.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Whether progress bars are drawn at all.
pub fn stderr_is_terminal() -> bool {
    std::io::stderr().is_terminal() && std::io::stdout().is_terminal()
}

fn bar(len: Option<u64>, template: &str) -> ProgressBar {
    if !stderr_is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(len, ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template(template)
        .map(|s| s.progress_chars("=> "))
        .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar
}

/// A bar counting bytes (of `len`, when known).
pub fn bytes_bar(len: Option<u64>) -> ProgressBar {
    bar(
        len,
        "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    )
}

/// A bar counting items (tokens, tensors, windows) of `len`.
pub fn count_bar(len: u64, unit: &str) -> ProgressBar {
    bar(
        Some(len),
        &format!("{{msg}} [{{bar:30}}] {{pos}}/{{len}} {unit} eta {{eta}}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_are_hidden_without_a_terminal() {
        let drawn = std::io::stdout().is_terminal() && std::io::stderr().is_terminal();
        assert_eq!(bytes_bar(Some(10)).is_hidden(), !drawn);
        assert_eq!(count_bar(10, "windows").is_hidden(), !drawn);
    }
}
