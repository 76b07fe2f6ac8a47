//! The KV cache's storage types (f16, bf16, q8_0, q4_0) through the backend trait, on fresh
//! random rows: `store_kv` writes the reference quantizer's bytes (kestrel-quant's, checked
//! against gguf-py in its own tests) into the right slots of scattered block tables, and
//! attention over the stored blocks matches an f64 oracle over the dequantized rows for
//! prefill, multi-token and single-token steps of two sequences batched together, with and
//! without a sliding window, on head sizes of one and of three blocks.

use kestrel_cpu::{CpuBackend, CpuCache, CpuStep, CpuTensor, Kernels, Numerics, numerics};
use kestrel_gguf::GgufFile;
use kestrel_model::synth::{SynthConfig, WeightType, write_synth_to};
use kestrel_model::{Arch, AttnParams, Backend, Batch, KvType, KvTypes, ModelConfig};
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

const BLOCK: usize = 16;

fn config(n_head: u32, n_head_kv: u32, head_dim: u32) -> ModelConfig {
    let cfg = SynthConfig {
        n_head,
        n_head_kv,
        head_dim,
        n_layer: 2,
        ..SynthConfig::tiny(Arch::Llama)
    };
    let (bytes, _) = write_synth_to(Vec::new(), &cfg, WeightType::F32, 1).expect("synth");
    ModelConfig::from_gguf(&GgufFile::from_bytes(bytes).expect("parses")).expect("config")
}

/// Rows of normal values with an occasional outlier (as real keys have).
fn rows(rng: &mut impl Rng, n: usize, cols: usize) -> Vec<f32> {
    let normal = Normal::new(0.0f32, 1.0).expect("normal");
    (0..n * cols)
        .map(|_| {
            let v = normal.sample(rng);
            if rng.random_ratio(1, 50) { v * 8.0 } else { v }
        })
        .collect()
}

/// A row through the quantizer ggml's CPU backend stores it with (the reference one of
/// kestrel-quant for all but Q8_0, whose x86 rounding `numerics::quantize_q8_0` follows)
/// and back: what the cache should hold. The values come back within half a step of the
/// rows (a whole step for Q4_0's clamped top; Q8_0's scale is rounded to f16 too), a bound checked here independently.
fn stored(t: KvType, row: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let mut bytes = vec![0u8; t.bytes(row.len())];
    assert!(numerics::quantize_like_ggml(
        t.ggml().expect("a ggml type"),
        row,
        &mut bytes
    ));
    let mut back = vec![0f32; row.len()];
    kestrel_quant::dequantize_row(t.ggml().expect("a ggml type"), &bytes, &mut back)
        .expect("dequantizes");
    for (x, b) in row.chunks(32).zip(back.chunks(32)) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (x, b) in x.iter().zip(b) {
            let bound = match t {
                KvType::F16 => x.abs() / 2048.0,
                KvType::Bf16 => x.abs() / 256.0,
                // Half a step, plus 127 times the scale's own f16 rounding (2^-11).
                KvType::Q8_0 => amax / 127.0 * 0.57,
                KvType::Q4_0 => amax / 8.0 * 1.01,
                KvType::Fp8 => unreachable!("the CPU has no fp8 cache"),
            };
            assert!((x - b).abs() <= bound + 1e-6, "{t}: {x} stored as {b}");
        }
    }
    (bytes, back)
}

/// Two sequences' block tables, scattered over the cache.
const TABLES: [&[u32]; 2] = [&[5, 1, 3], &[0, 4]];

/// Step 1: sequence 0's 37-token prefill with sequence 1's 20. Step 2: one decode token of
/// sequence 0 with a 3-token step of sequence 1.
fn steps() -> [Batch; 2] {
    let mut a = Batch::default();
    a.push_part(0, &[0; 37], 0, TABLES[0], 1);
    a.push_part(1, &[0; 20], 0, TABLES[1], 1);
    let mut b = Batch::default();
    b.push_part(0, &[0], 37, TABLES[0], 1);
    b.push_part(1, &[0; 3], 20, TABLES[1], 1);
    [a, b]
}

/// Softmax attention in f64 over the cached rows each token sees. `ggml`: with llama.cpp's
/// roundings, of the query to the keys' dot-product type and, for f16 values, of the
/// probabilities to f16.
fn oracle(
    q: &[f32],
    k: &[Vec<Vec<f32>>],
    v: &[Vec<Vec<f32>>],
    batch: &Batch,
    p: &AttnParams,
    ggml: Option<KvTypes>,
) -> Vec<f32> {
    let (hd, group) = (p.head_dim, p.n_head / p.n_head_kv);
    let mut out = vec![0f32; batch.len() * p.n_head * hd];
    for i in 0..batch.len() {
        let (s, pos) = (batch.seq_of[i] as usize, batch.positions[i] as usize);
        let lo = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        for h in 0..p.n_head {
            let g = h / group;
            let mut qh = q[(i * p.n_head + h) * hd..][..hd].to_vec();
            if let Some(types) = ggml {
                let act = numerics::activation_type(types.k.ggml().expect("a ggml type"))
                    .expect("a dot-product type");
                let mut bytes = Vec::new();
                numerics::round_trip(
                    act,
                    &q[(i * p.n_head + h) * hd..][..hd],
                    &mut bytes,
                    &mut qh,
                );
            }
            let scores: Vec<f64> = (lo..=pos)
                .map(|kp| {
                    let kh = &k[s][kp][g * hd..][..hd];
                    let dot: f64 = qh.iter().zip(kh).map(|(a, b)| *a as f64 * *b as f64).sum();
                    dot * p.scale as f64
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = w.iter().sum();
            let w: Vec<f64> = w
                .iter()
                .map(|w| match ggml {
                    Some(t) if t.v == KvType::F16 => half::f16::from_f64(w / sum).to_f64(),
                    _ => w / sum,
                })
                .collect();
            for d in 0..hd {
                let o: f64 = (lo..=pos)
                    .zip(&w)
                    .map(|(kp, w)| w * v[s][kp][g * hd + d] as f64)
                    .sum();
                out[(i * p.n_head + h) * hd + d] = o as f32;
            }
        }
    }
    out
}

/// Runs both steps on `be` with the cache in `types`, checking the stored bytes and the
/// attention against the oracle (`tol`: largest difference allowed); returns the outputs.
fn run(
    be: &CpuBackend,
    cfg: &ModelConfig,
    types: KvTypes,
    window: Option<usize>,
    inputs: &[(Vec<f32>, Vec<f32>, Vec<f32>); 2],
    tol: f32,
) -> Vec<f32> {
    let layer = 1;
    let mut cache: CpuCache = be.new_cache_typed(cfg, 6, BLOCK, types).expect("cache");
    let (kv_dim, q_dim) = (cfg.kv_dim(), cfg.q_dim());
    let p = AttnParams {
        layer,
        n_head: cfg.n_head,
        n_head_kv: cfg.n_head_kv,
        head_dim: cfg.head_dim,
        scale: 1.0 / (cfg.head_dim as f32).sqrt(),
        window,
    };
    // The oracle's view of each sequence's cache: the dequantized reference rows.
    let (mut k_ref, mut v_ref) = (vec![Vec::new(); 2], vec![Vec::new(); 2]);
    let mut outputs = Vec::new();
    for (batch, (q, k, v)) in steps().into_iter().zip(inputs) {
        let n = batch.len();
        let step = CpuStep { batch };
        let (kt, vt) = (
            CpuTensor {
                data: k.clone(),
                cols: kv_dim,
            },
            CpuTensor {
                data: v.clone(),
                cols: kv_dim,
            },
        );
        be.store_kv(&mut cache, layer, &kt, &vt, &step, n);
        let (kb, vb) = cache.row_bytes();
        for i in 0..n {
            let (s, pos) = (
                step.batch.seq_of[i] as usize,
                step.batch.positions[i] as usize,
            );
            let slot = TABLES[s][pos / BLOCK] as usize * BLOCK + pos % BLOCK;
            let (k_bytes, k_back) = stored(types.k, &k[i * kv_dim..][..kv_dim]);
            let (v_bytes, v_back) = stored(types.v, &v[i * kv_dim..][..kv_dim]);
            assert!(
                cache.k[layer][slot * kb..][..kb] == k_bytes[..],
                "{types:?} key {i}"
            );
            assert!(
                cache.v[layer][slot * vb..][..vb] == v_bytes[..],
                "{types:?} value {i}"
            );
            assert_eq!(k_ref[s].len(), pos);
            k_ref[s].push(k_back);
            v_ref[s].push(v_back);
        }
        let qt = CpuTensor {
            data: q.clone(),
            cols: q_dim,
        };
        let mut out = CpuTensor {
            data: vec![f32::NAN; n * q_dim],
            cols: q_dim,
        };
        be.attention(&qt, &cache, &p, &step, n, &mut out);
        let ggml = (be.numerics() == Numerics::Ggml).then_some(types);
        let want = oracle(q, &k_ref, &v_ref, &step.batch, &p, ggml);
        let worst = out
            .data
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(
            worst <= tol,
            "{types:?} window {window:?}: off by {worst} (tolerance {tol})"
        );
        outputs.extend(out.data);
    }
    outputs
}

fn rms_diff(a: &[f32], b: &[f32]) -> f32 {
    (a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f32>() / a.len() as f32).sqrt()
}

#[test]
fn stored_blocks_are_the_reference_bytes_and_attention_reads_them() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    // 6 heads of 96 (three blocks) sharing 2 kv heads; 4 heads of 32 (one block), no sharing.
    for (n_head, n_head_kv, head_dim) in [(6, 2, 96), (4, 4, 32)] {
        let cfg = config(n_head, n_head_kv, head_dim);
        let inputs = [37 + 20, 1 + 3].map(|n| {
            (
                rows(&mut rng, n, cfg.q_dim()),
                rows(&mut rng, n, cfg.kv_dim()),
                rows(&mut rng, n, cfg.kv_dim()),
            )
        });
        for window in [None, Some(7)] {
            let mut f16_out = None;
            for k in KvType::ALL {
                for v in KvType::ALL {
                    let types = KvTypes { k, v };
                    for kernels in [Kernels::Scalar, Kernels::Fast] {
                        let be = CpuBackend::with_numerics(kernels, Numerics::F32);
                        let out = run(&be, &cfg, types, window, &inputs, 1e-4);
                        // Next to the f16 cache's output (whose first tokens attend to
                        // themselves only: a value row's own rounding, outliers included).
                        let f16_out: &Vec<f32> = f16_out.get_or_insert(out.clone());
                        // Q4_0's largest rms difference a run (these random inputs):
                        // median 0.24, 99th percentile 0.28 over 150 runs, and 0.311 once
                        // in CI (2026-11-27) against the 0.3 this bound was; the oracle
                        // comparison inside `run` is the exact check.
                        let bound = match (k, v) {
                            (KvType::Q4_0, _) | (_, KvType::Q4_0) => 0.4,
                            (KvType::Q8_0, _) | (_, KvType::Q8_0) => 0.03,
                            _ => 0.01,
                        };
                        let d = rms_diff(&out, f16_out);
                        assert!(d < bound, "{types:?}: {d} from the f16 cache's output");
                    }
                    // With llama.cpp's roundings (a probability's f16 rounding may differ
                    // by one step from the f64 oracle's: ~5e-4 of a value).
                    let be = CpuBackend::with_numerics(Kernels::Fast, Numerics::Ggml);
                    run(&be, &cfg, types, window, &inputs, 0.02);
                }
            }
        }
    }
}

#[test]
fn quantized_types_need_whole_blocks_per_head() {
    let be = CpuBackend::new(Kernels::Fast);
    let cfg = config(4, 2, 48);
    let q8 = KvTypes {
        k: KvType::Q8_0,
        v: KvType::F16,
    };
    let err = be
        .new_cache_typed(&cfg, 4, BLOCK, q8)
        .err()
        .expect("48 is not whole blocks");
    assert!(err.to_string().contains("head size 48"), "{err}");
    let bf = KvTypes {
        k: KvType::Bf16,
        v: KvType::Bf16,
    };
    let cache = be
        .new_cache_typed(&cfg, 4, BLOCK, bf)
        .expect("bf16 takes any head size");
    assert_eq!(cache.row_bytes(), (2 * 96, 2 * 96));
    assert_eq!(cache.k[0].len(), 4 * BLOCK * 2 * 96);
}
