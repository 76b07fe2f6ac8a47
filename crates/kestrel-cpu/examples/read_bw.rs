//! Read bandwidth of this machine: T threads (default 2) each sum their own 512 MiB
//! buffer of u64 (a vectorized read-only stream) in memory advised to use transparent huge
//! pages, as the CPU backend keeps its weights; best of 5, in GB/s. The floor of decode
//! is the weight bytes per token over this rate.
//!
//! `cargo run --release -p kestrel-cpu --example read_bw -- [THREADS]`
use std::time::Instant;

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|t| t.parse().ok())
        .unwrap_or(2);
    let len = 512 << 20;
    let bufs: Vec<memmap2::MmapMut> = (0..threads)
        .map(|i| {
            let mut m = memmap2::MmapMut::map_anon(len).expect("map");
            #[cfg(target_os = "linux")]
            m.advise(memmap2::Advice::HugePage).expect("advise");
            m.fill(i as u8 + 1);
            m
        })
        .collect();
    let mut best = 0f64;
    for _ in 0..5 {
        let t0 = Instant::now();
        std::thread::scope(|s| {
            for b in &bufs {
                s.spawn(move || {
                    let words = b
                        .chunks_exact(8)
                        .map(|c| u64::from_le_bytes(c.try_into().unwrap()));
                    std::hint::black_box(words.fold(0u64, |a, v| a.wrapping_add(v)))
                });
            }
        });
        best = best.max((threads * len) as f64 / t0.elapsed().as_secs_f64() / 1e9);
    }
    println!("{threads} threads: read {best:.1} GB/s");
}
