//! Single-thread quantizer throughput, for comparison with ggml's `ggml_quantize_chunk` on
//! the same values: `cargo run --release -p kestrel-quant --example quant_speed -- IN.f32 ROW_LEN TYPE...`
use std::time::Instant;

use kestrel_quant::{GgmlType, quantize};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let bytes = std::fs::read(&args[1]).expect("input");
    let values: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let row_len: usize = args[2].parse().expect("row length");
    for name in &args[3..] {
        let ty = GgmlType::ALL
            .into_iter()
            .find(|t| t.to_string().eq_ignore_ascii_case(name))
            .expect("type");
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            let out = quantize(ty, &values, row_len).expect("quantize");
            best = best.min(t.elapsed().as_secs_f64());
            std::hint::black_box(out);
        }
        println!("{ty} {:.1} Mvalues/s", values.len() as f64 / best / 1e6);
    }
}
