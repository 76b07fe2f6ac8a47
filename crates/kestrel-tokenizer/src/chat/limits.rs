//! Limits that keep an untrusted chat template (it comes from the GGUF file or the user)
//! from hanging or exhausting memory. A template is a program: minijinja's fuel bounds the
//! instructions it runs, the output is capped, and the filters that build a value whose
//! size the template chooses (`indent`, `format`, the ones that collect a sequence, our
//! `tojson`) check that size first, so a hostile template ends in an error instead of an
//! allocation failure that would abort the process. Rendering runs on a thread of its own
//! with a large stack (deep macro recursion) and a deadline.

use std::io;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use minijinja::value::{Rest, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State, Value};

/// Instructions one rendering may run (a chat with tools takes a few thousand).
pub const FUEL: u64 = 5_000_000;
/// Bytes a rendering may write.
pub const MAX_OUTPUT: usize = 8 << 20;
/// Largest width a template may ask of `indent`, `tojson(indent=...)` and format specs.
pub const MAX_WIDTH: usize = 1024;
/// Most items a filter may collect from one sequence (minijinja's `range` makes at most
/// 100,000 too).
pub const MAX_ITEMS: usize = 100_000;
/// Wall-clock deadline of one rendering.
pub const TIMEOUT: Duration = Duration::from_secs(5);
/// Stack of the rendering thread: minijinja's recursion limit (500 frames) fits.
const STACK_BYTES: usize = 64 << 20;

/// Filters that collect their input sequence before doing their work: the input is taken
/// through [`collect_bounded`] first.
const COLLECTING: &[&str] = &[
    "list", "join", "sum", "sort", "reverse", "unique", "last", "min", "max", "batch", "slice",
    "dictsort", "string", "pprint", "groupby", "items",
];

fn limit_error(what: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, what.into())
}

/// Sets the fuel and replaces the size-choosing filters with bounded ones.
pub fn install(env: &mut Environment<'static>) {
    env.set_fuel(Some(FUEL));
    // Printing a value walks it: a lazy `[1] * 10**12` would spin for hours.
    env.set_formatter(|out, state, value| {
        let mut budget = MAX_ITEMS;
        check_size(value, &mut budget)?;
        minijinja::escape_formatter(out, state, value)
    });
    for &name in COLLECTING {
        let Some(builtin) = builtin_filter(name) else {
            continue;
        };
        env.add_filter(name, move |state: &State, args: Rest<Value>| {
            let mut args = args.0;
            if let Some(first) = args.first_mut() {
                *first = collect_bounded(first)?;
            }
            builtin.call(state, &args)
        });
    }
    let indent = Value::from_function(minijinja::filters::indent);
    env.add_filter("indent", move |state: &State, args: Rest<Value>| {
        for v in args.iter().skip(1) {
            check_widths(v)?;
        }
        indent.call(state, &args)
    });
    let format = Value::from_function(minijinja::filters::format);
    env.add_filter("format", move |state: &State, args: Rest<Value>| {
        if let Some(spec) = args.first().and_then(Value::as_str) {
            check_format_spec(spec)?;
        }
        format.call(state, &args)
    });
    env.set_unknown_method_callback(|state, value, method, args| {
        if method == "format"
            && let Some(spec) = value.as_str()
        {
            check_format_spec(spec)?;
        }
        minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
    });
}

/// The built-in filter `name` as a callable value.
fn builtin_filter(name: &str) -> Option<Value> {
    use minijinja::filters as f;
    Some(match name {
        "list" => Value::from_function(f::list),
        "join" => Value::from_function(f::join),
        "sum" => Value::from_function(f::sum),
        "sort" => Value::from_function(f::sort),
        "reverse" => Value::from_function(f::reverse),
        "unique" => Value::from_function(f::unique),
        "last" => Value::from_function(f::last),
        "min" => Value::from_function(f::min),
        "max" => Value::from_function(f::max),
        "batch" => Value::from_function(f::batch),
        "slice" => Value::from_function(f::slice),
        "dictsort" => Value::from_function(f::dictsort),
        "string" => Value::from_function(f::string),
        "pprint" => Value::from_function(f::pprint),
        "groupby" => Value::from_function(f::groupby),
        "items" => Value::from_function(f::items),
        _ => return None,
    })
}

/// A sequence or iterable as a list of at most [`MAX_ITEMS`] items (an error beyond);
/// strings, maps and scalars as they are. A lazy `[1] * 10**12` stops here after
/// `MAX_ITEMS + 1` items instead of being collected whole.
pub fn collect_bounded(value: &Value) -> Result<Value, Error> {
    let items = match value.kind() {
        ValueKind::Seq | ValueKind::Iterable => {
            if value.len().is_some_and(|n| n > MAX_ITEMS) {
                return Err(too_many());
            }
            let items: Vec<Value> = value.try_iter()?.take(MAX_ITEMS + 1).collect();
            if items.len() > MAX_ITEMS {
                return Err(too_many());
            }
            items
        }
        _ => return Ok(value.clone()),
    };
    Ok(Value::from(items))
}

/// Fails when `value` holds more than `budget` items in all (nested sequences and maps
/// included), without walking more than that many.
fn check_size(value: &Value, budget: &mut usize) -> Result<(), Error> {
    if !matches!(
        value.kind(),
        ValueKind::Seq | ValueKind::Iterable | ValueKind::Map
    ) {
        return Ok(());
    }
    if value.len().is_some_and(|n| n > *budget) {
        return Err(too_many());
    }
    for item in value.try_iter()? {
        if *budget == 0 {
            return Err(too_many());
        }
        *budget -= 1;
        check_size(&item, budget)?;
    }
    Ok(())
}

fn too_many() -> Error {
    limit_error(format!(
        "chat template limit: a sequence of more than {MAX_ITEMS} items"
    ))
}

/// Rejects a width argument (an integer, or one inside keyword arguments) beyond
/// [`MAX_WIDTH`].
fn check_widths(value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Number => check_width(value),
        ValueKind::Map => {
            for key in value.try_iter()? {
                check_width(&value.get_item(&key)?)?;
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// An integer width must be at most [`MAX_WIDTH`] (strings and other values pass).
pub fn check_width(value: &Value) -> Result<(), Error> {
    if value.kind() != ValueKind::Number {
        return Ok(());
    }
    match value.as_i64() {
        Some(n) if n <= MAX_WIDTH as i64 => Ok(()),
        _ => Err(limit_error(format!(
            "chat template limit: width {value} is more than {MAX_WIDTH}"
        ))),
    }
}

/// Rejects printf (`%10d`) and `str.format` (`{:10}`) specifications whose widths or
/// precisions exceed [`MAX_WIDTH`]. Numbers outside a specification (plain text) are free.
fn check_format_spec(spec: &str) -> Result<(), Error> {
    let (mut in_brace, mut in_percent) = (false, false);
    let mut number: u64 = 0;
    for c in spec.chars() {
        if (in_brace || in_percent) && c.is_ascii_digit() {
            number = number
                .saturating_mul(10)
                .saturating_add(u64::from(c as u8 - b'0'));
            if number > MAX_WIDTH as u64 {
                return Err(limit_error(format!(
                    "chat template limit: a format width or precision of more than {MAX_WIDTH}"
                )));
            }
            continue;
        }
        number = 0;
        match c {
            '{' => in_brace = true,
            '}' => in_brace = false,
            // `%%` is a literal percent sign: the second one closes the first.
            '%' => in_percent = !in_percent,
            c if in_percent && c.is_ascii_alphabetic() => in_percent = false,
            _ => {}
        }
    }
    Ok(())
}

/// An `io::Write` into a string that fails past [`MAX_OUTPUT`] bytes.
struct CappedOutput(Vec<u8>);

impl io::Write for CappedOutput {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.0.len() + buf.len() > MAX_OUTPUT {
            return Err(io::Error::other(format!(
                "chat template limit: output of more than {MAX_OUTPUT} bytes"
            )));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Renders template `name` of `env` with `ctx` on a thread of its own, within the
/// output cap and [`TIMEOUT`]. On a timeout the thread is left to run out of fuel.
pub fn render(
    env: &Arc<Environment<'static>>,
    name: &'static str,
    ctx: Value,
) -> Result<String, String> {
    let env = env.clone();
    let (tx, rx) = mpsc::sync_channel(1);
    let spawned = std::thread::Builder::new()
        .name("chat-template".into())
        .stack_size(STACK_BYTES)
        .spawn(move || {
            let result = env
                .get_template(name)
                .and_then(|t| {
                    let mut out = CappedOutput(Vec::new());
                    t.render_captured_to(ctx, &mut out).map(|_| out.0)
                })
                .map_err(|e| super::describe(&e))
                .and_then(|bytes| {
                    String::from_utf8(bytes).map_err(|_| "output is not UTF-8".to_string())
                });
            let _ = tx.send(result);
        });
    if let Err(e) = spawned {
        return Err(format!("cannot start the rendering thread: {e}"));
    }
    match rx.recv_timeout(TIMEOUT) {
        Ok(result) => result,
        Err(mpsc::RecvTimeoutError::Timeout) => Err(format!(
            "chat template limit: rendering took more than {} s",
            TIMEOUT.as_secs()
        )),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            Err("the rendering thread ended without a result".to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::check_format_spec;

    #[test]
    fn format_widths_are_bounded_only_inside_specifications() {
        for ok in [
            "%5d",
            "%-10.3f",
            "{:>8}",
            "{0:1024}",
            "year 20000 %s",
            "100%% of 99999",
        ] {
            assert!(check_format_spec(ok).is_ok(), "{ok}");
        }
        for bad in [
            "%1025d",
            "%.99999f",
            "{:99999}",
            "{0:>2000}",
            "x %5s %9999999999999999999999d",
        ] {
            assert!(check_format_spec(bad).is_err(), "{bad}");
        }
    }
}
