//! Times `Sampler::sample` on one row of a 128K-word vocabulary for a few settings.
use kestrel_engine::sampler::{Sampler, SamplerParams};
use rand::{Rng, SeedableRng};
use std::time::Instant;

fn main() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let row: Vec<f32> = (0..128_256).map(|_| rng.random_range(-8.0..8.0)).collect();
    for (name, p) in [
        (
            "openai default (t=1)",
            SamplerParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                ..SamplerParams::default()
            },
        ),
        ("llama.cpp default", SamplerParams::default()),
        (
            "t=0.8 top_p 0.95",
            SamplerParams {
                temperature: 0.8,
                top_k: 0,
                top_p: 0.95,
                min_p: 0.0,
                ..SamplerParams::default()
            },
        ),
    ] {
        let mut s = Sampler::new(SamplerParams { seed: Some(3), ..p });
        let start = Instant::now();
        let n = 50;
        let mut acc = 0u64;
        for _ in 0..n {
            acc += s.sample(&row, &[1, 2, 3]) as u64;
        }
        println!(
            "{name}: {:.3} ms a row ({acc})",
            start.elapsed().as_secs_f64() * 1e3 / n as f64
        );
    }
}
