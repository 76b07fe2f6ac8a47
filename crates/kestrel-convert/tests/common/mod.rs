//! Shared by the convert, quantize and imatrix tests: the seed of a test's random inputs and
//! the llama.cpp oracle of quantization.

/// `KESTREL_TEST_SEED` if set, else the clock; printed so a failure can be replayed.
pub fn seed() -> u64 {
    let seed = std::env::var("KESTREL_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    eprintln!("KESTREL_TEST_SEED={seed}");
    seed
}

/// Runs tests/quant_oracle.py (llama.cpp through llama-cpp-python); `None` when it exits 3
/// (llama_cpp missing: a notice is printed). Not every test file uses it.
#[allow(dead_code)]
pub fn quant_oracle(args: &[&str]) -> Option<serde_json::Value> {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/quant_oracle.py");
    let out = std::process::Command::new("python3")
        .arg(script)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run python3 (needed as the oracle): {e}"));
    if out.status.code() == Some(3) {
        eprintln!("{}", String::from_utf8_lossy(&out.stderr).trim());
        return None;
    }
    assert!(
        out.status.success(),
        "quant_oracle.py {args:?} failed ({}); install requirements-test.txt.\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Some(serde_json::from_slice(&out.stdout).expect("oracle output is JSON"))
}
