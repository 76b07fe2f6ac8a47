//! Single-thread rates of the repacked kernels (`packed`) against the row-by-row ones
//! (`qdot8`) on a model's real weights, rows resident in L2, for 1 and 4 tokens.
//!
//! `cargo run --release -p kestrel-cpu --example packed_rate -- MODEL.gguf [TENSOR...]`
use std::time::Instant;

use kestrel_cpu::{packed, qdot8};
use kestrel_gguf::{GgmlType, GgufFile};

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .expect("usage: packed_rate MODEL.gguf [TENSOR...]");
    let file = GgufFile::open(&path).expect("open");
    let mut names: Vec<String> = args.collect();
    if names.is_empty() {
        names = [
            "blk.0.ffn_gate.weight",
            "blk.0.ffn_down.weight",
            "blk.1.ffn_down.weight",
        ]
        .map(String::from)
        .to_vec();
    }
    for name in &names {
        let info = file.tensor(name).expect("tensor").clone();
        let data = file.tensor_data(&info);
        let k = info.dims[0] as usize;
        let rows_all = data.len() / info.ty.bytes_for(k as u64).unwrap() as usize;
        if !packed::applies(info.ty, rows_all, k) {
            println!("{name}: {} not repacked here", info.ty);
            continue;
        }
        let row_bytes = info.ty.bytes_for(k as u64).unwrap() as usize;
        // About 256 KiB of rows (whole groups).
        let rows = ((256 * 1024 / row_bytes) / 16 * 16).clamp(16, rows_all / 16 * 16);
        let packed_rows = packed::pack(info.ty, &data[..rows * row_bytes], rows, k);
        let group = packed_rows.len() / (rows / 16);
        let x: Vec<f32> = (0..k)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let mut xq = vec![0u8; qdot8::activation_bytes(GgmlType::Q8K, k)];
        qdot8::quantize_activations(GgmlType::Q8K, &x, &mut xq);
        let reps = 200;
        let time = |f: &dyn Fn() -> f32| {
            let t0 = Instant::now();
            let mut s = 0f32;
            for _ in 0..reps {
                s += f();
            }
            std::hint::black_box(s);
            t0.elapsed().as_secs_f64() * 1e9 / (reps * rows * k / 256) as f64
        };
        let old1 = time(&|| {
            (0..rows)
                .map(|j| qdot8::dot_row(info.ty, &data[j * row_bytes..][..row_bytes], &xq))
                .sum()
        });
        let new1 = time(&|| {
            packed_rows
                .chunks_exact(group)
                .map(|g| packed::dot_rows(info.ty, g, [&xq[..]])[0][0])
                .sum()
        });
        let old4 = time(&|| {
            (0..rows)
                .map(|j| {
                    qdot8::dot_rows(info.ty, &data[j * row_bytes..][..row_bytes], [&xq[..]; 4])[0]
                })
                .sum()
        }) / 4.0;
        let new4 = time(&|| {
            packed_rows
                .chunks_exact(group)
                .map(|g| packed::dot_rows(info.ty, g, [&xq[..]; 4])[0][0])
                .sum()
        }) / 4.0;
        println!(
            "{name} ({}, k {k}, {rows} rows): ns per row-block and token: 1 token {old1:.1} -> {new1:.1}, 4 tokens {old4:.1} -> {new4:.1}",
            info.ty
        );
        // The whole matrix streamed once per pass, one token (decode), GB/s of weights.
        let all_rows = rows_all / 16 * 16;
        let all = packed::pack(info.ty, &data[..all_rows * row_bytes], all_rows, k);
        let touch: u64 = data.iter().step_by(4096).map(|&b| b as u64).sum();
        std::hint::black_box(touch);
        let sweep = |f: &dyn Fn() -> f32| {
            let t0 = Instant::now();
            let mut s = 0f32;
            for _ in 0..3 {
                s += f();
            }
            std::hint::black_box(s);
            (3 * all_rows * row_bytes) as f64 / t0.elapsed().as_secs_f64() / 1e9
        };
        let old_gb = sweep(&|| {
            (0..all_rows)
                .map(|j| qdot8::dot_row(info.ty, &data[j * row_bytes..][..row_bytes], &xq))
                .sum()
        });
        let new_gb = sweep(&|| {
            all.chunks_exact(group)
                .map(|g| packed::dot_rows(info.ty, g, [&xq[..]])[0][0])
                .sum()
        });
        println!("  whole matrix ({all_rows} rows), 1 token: {old_gb:.1} -> {new_gb:.1} GB/s");
    }
}
