//! Per-operation timers, on when `KESTREL_CPU_PROFILE=1`: each backend call's wall time
//! is added up by operation (and, for matmuls, by weight type and shape), and the table is
//! printed to stderr when the backend is dropped. Off, a call costs one relaxed load.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Instant;

/// 0: not read yet, 1: off, 2: on.
static STATE: AtomicU8 = AtomicU8::new(0);

/// Whether profiling is on (`KESTREL_CPU_PROFILE` set to anything but `0` or empty).
#[inline]
pub fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            let on = std::env::var("KESTREL_CPU_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0");
            STATE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
    }
}

/// What one table row adds up.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    pub op: &'static str,
    /// Weight type, rows, columns (matmuls), else empty / zero.
    pub ty: String,
    pub rows: usize,
    pub cols: usize,
    /// Tokens in the call.
    pub n: usize,
}

#[derive(Default, Clone, Copy)]
struct Sum {
    calls: u64,
    secs: f64,
    bytes: u64,
}

static TABLE: Mutex<Option<HashMap<Key, Sum>>> = Mutex::new(None);

/// Runs `f`, adding its wall time under `key()` when profiling is on. `bytes` is the
/// weight bytes the call reads (for the GB/s column).
#[inline]
pub fn timed<R>(key: impl FnOnce() -> Key, bytes: u64, f: impl FnOnce() -> R) -> R {
    if !enabled() {
        return f();
    }
    let t0 = Instant::now();
    let r = f();
    let secs = t0.elapsed().as_secs_f64();
    let mut table = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    let s = table
        .get_or_insert_with(HashMap::new)
        .entry(key())
        .or_default();
    s.calls += 1;
    s.secs += secs;
    s.bytes += bytes;
    r
}

/// A key for a non-matmul operation.
pub fn op(op: &'static str, n: usize) -> Key {
    Key {
        op,
        ty: String::new(),
        rows: 0,
        cols: 0,
        n,
    }
}

/// Prints the table (sorted by total time) and clears it.
pub fn report() {
    let Some(table) = TABLE.lock().unwrap_or_else(|e| e.into_inner()).take() else {
        return;
    };
    let mut rows: Vec<(Key, Sum)> = table.into_iter().collect();
    rows.sort_by(|a, b| b.1.secs.total_cmp(&a.1.secs));
    let total: f64 = rows.iter().map(|r| r.1.secs).sum();
    eprintln!(
        "{:<12} {:>6} {:>7} {:>6} {:>5} {:>9} {:>10} {:>9} {:>6} {:>7}",
        "op", "type", "rows", "cols", "n", "calls", "total ms", "us/call", "%", "GB/s"
    );
    for (k, s) in &rows {
        let gbs = if s.bytes > 0 {
            format!("{:.1}", s.bytes as f64 / s.secs / 1e9)
        } else {
            String::new()
        };
        eprintln!(
            "{:<12} {:>6} {:>7} {:>6} {:>5} {:>9} {:>10.1} {:>9.1} {:>6.2} {:>7}",
            k.op,
            k.ty,
            k.rows,
            k.cols,
            k.n,
            s.calls,
            s.secs * 1e3,
            s.secs * 1e6 / s.calls as f64,
            100.0 * s.secs / total,
            gbs
        );
    }
    eprintln!("total in backend calls: {:.1} ms", total * 1e3);
}
