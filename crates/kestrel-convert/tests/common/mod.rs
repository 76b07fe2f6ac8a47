//! Shared by the convert and quantize tests: the seed of a test's random inputs.

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
