//! Single-thread rates of the integer dot kernels (`qdot8`) on a model's real weights:
//! rows resident in L2 (the kernel's compute-bound rate) and the whole matrix swept
//! (L3 or memory, by size). Every page is touched first (the file is memory-mapped).
//!
//! `cargo run --release -p kestrel-cpu --example kernel_rate -- MODEL.gguf [TENSOR...]`
use std::time::Instant;

use kestrel_cpu::qdot8;
use kestrel_gguf::GgufFile;

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .expect("usage: kernel_rate MODEL.gguf [TENSOR...]");
    let file = GgufFile::open(&path).expect("open");
    let mut names: Vec<String> = args.collect();
    if names.is_empty() {
        names = ["attn_k", "attn_v", "ffn_gate", "ffn_down"]
            .iter()
            .flat_map(|t| (0..2).map(move |l| format!("blk.{l}.{t}.weight")))
            .collect();
    }
    for name in &names {
        let info = file.tensor(name).expect("tensor").clone();
        let data = file.tensor_data(&info);
        if !qdot8::supported(info.ty) {
            println!("{name}: {} has no integer kernel here", info.ty);
            continue;
        }
        let cols = info.dims[0] as usize;
        let row_bytes = info.ty.bytes_for(cols as u64).unwrap() as usize;
        let rows = data.len() / row_bytes;
        let x: Vec<f32> = (0..cols)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let act = kestrel_cpu::numerics::activation_type(info.ty).unwrap();
        let mut xq = vec![0u8; qdot8::activation_bytes(act, cols)];
        qdot8::quantize_activations(act, &x, &mut xq);
        let touch: u64 = data.iter().step_by(4096).map(|&b| b as u64).sum();
        std::hint::black_box(touch);
        let dot =
            |j: usize| qdot8::dot_row(info.ty, &data[j * row_bytes..(j + 1) * row_bytes], &xq);
        let rate = |n_rows: usize, reps: usize| {
            let mut s = 0f32;
            let t0 = Instant::now();
            for _ in 0..reps {
                for j in 0..n_rows {
                    s += dot(j);
                }
            }
            std::hint::black_box(s);
            let dt = t0.elapsed().as_secs_f64();
            (
                (reps * n_rows * row_bytes) as f64 / dt / 1e9,
                dt * 1e9 / (reps * n_rows * cols / 256) as f64,
            )
        };
        let (l2, ns) = rate((256 * 1024 / row_bytes).min(rows), 200);
        let (whole, _) = rate(rows, 5);
        // Prefill's kernel: four and eight tokens per decoded weight block, rows from
        // L1/L2, timed in this thread's CPU time (the machine may be shared).
        let n_rows = (16 * 1024 / row_bytes).clamp(1, rows);
        let reps = 20000;
        let t0 = thread_cpu_secs();
        let mut s = 0f32;
        for _ in 0..reps {
            for j in 0..n_rows {
                let row = &data[j * row_bytes..(j + 1) * row_bytes];
                s += qdot8::dot_rows(info.ty, row, [&xq[..]; 4])[3];
            }
        }
        let t1 = thread_cpu_secs();
        for _ in 0..reps / 2 {
            for j in 0..n_rows {
                let row = &data[j * row_bytes..(j + 1) * row_bytes];
                s += qdot8::dot_rows(info.ty, row, [&xq[..]; 8])[7];
            }
        }
        let t2 = thread_cpu_secs();
        std::hint::black_box(s);
        let macs = (reps * n_rows * cols * 4) as f64;
        let (x4, x8) = (macs / (t1 - t0) / 1e9, macs / (t2 - t1) / 1e9);
        println!(
            "{name:24} {:5} {rows:6} x {cols:5}  L2-resident {l2:6.2} GB/s ({ns:.1} ns per 256 values)  whole {whole:6.2} GB/s  x4 {x4:6.2} x8 {x8:6.2} GMAC/s",
            info.ty.to_string()
        );
    }
}

/// This thread's CPU time in seconds (`CLOCK_THREAD_CPUTIME_ID`).
fn thread_cpu_secs() -> f64 {
    #[repr(C)]
    struct Timespec {
        sec: i64,
        nsec: i64,
    }
    unsafe extern "C" {
        fn clock_gettime(clock: i32, ts: *mut Timespec) -> i32;
    }
    let mut ts = Timespec { sec: 0, nsec: 0 };
    // SAFETY: a valid clock id and a pointer to a timespec we own.
    unsafe { clock_gettime(3, &mut ts) };
    ts.sec as f64 + ts.nsec as f64 * 1e-9
}
