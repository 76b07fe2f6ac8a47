//! RoPE semantics through the backend trait: rotations preserve norms, q·k depends only on
//! the distance between positions, linear scaling equals dividing positions, and the NeoX
//! and normal layouts are the same rotation on permuted dimensions.

use kestrel_cpu::{CpuBackend, CpuStep, CpuTensor, Kernels};
use kestrel_model::{Backend, Batch, RopeParams, RopeScaling};
use rand::{Rng, SeedableRng};

fn rotate(rope: &RopeParams, head: &[f32], pos: u32) -> Vec<f32> {
    let be = CpuBackend::new(Kernels::Fast);
    let mut x = CpuTensor {
        data: head.to_vec(),
        cols: head.len(),
    };
    let step = CpuStep {
        batch: Batch {
            tokens: vec![0],
            positions: vec![pos],
            seq_of: vec![0],
            ..Batch::default()
        },
    };
    be.rope(&mut x, head.len(), rope, &step, 1);
    x.data
}

fn params(neox: bool, n_rot: usize, scaling: RopeScaling) -> RopeParams {
    RopeParams {
        neox,
        n_rot,
        base: 10000.0,
        scaling,
        freq_factors: None,
    }
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
}

#[test]
fn rope_is_a_relative_position_rotation() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    for neox in [false, true] {
        for (hd, n_rot) in [(64, 64), (128, 64), (6, 6)] {
            let p = params(neox, n_rot, RopeScaling::None);
            let q: Vec<f32> = (0..hd).map(|_| rng.random_range(-1.0..1.0)).collect();
            let k: Vec<f32> = (0..hd).map(|_| rng.random_range(-1.0..1.0)).collect();
            let q5 = rotate(&p, &q, 5);
            assert!((dot(&q5, &q5) - dot(&q, &q)).abs() < 1e-4, "norm preserved");
            // Dimensions past n_rot are untouched.
            assert_eq!(&q5[n_rot..], &q[n_rot..]);
            // Same distance, same score.
            let a = dot(&rotate(&p, &q, 7), &rotate(&p, &k, 3));
            let b = dot(&rotate(&p, &q, 104), &rotate(&p, &k, 100));
            assert!((a - b).abs() < 1e-3, "neox={neox} hd={hd}: {a} vs {b}");
            // Position 0 is the identity.
            assert_eq!(rotate(&p, &q, 0), q);
        }
    }
}

#[test]
fn neox_and_normal_layouts_rotate_the_same_pairs() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    let hd = 16;
    let x: Vec<f32> = (0..hd).map(|_| rng.random_range(-1.0..1.0)).collect();
    // Interleave (i, i + hd/2) pairs into adjacent positions.
    let interleaved: Vec<f32> = (0..hd / 2).flat_map(|i| [x[i], x[i + hd / 2]]).collect();
    let a = rotate(&params(true, hd, RopeScaling::None), &x, 9);
    let b = rotate(&params(false, hd, RopeScaling::None), &interleaved, 9);
    for i in 0..hd / 2 {
        assert!((a[i] - b[2 * i]).abs() < 1e-6);
        assert!((a[i + hd / 2] - b[2 * i + 1]).abs() < 1e-6);
    }
}

#[test]
fn linear_scaling_divides_positions() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    let x: Vec<f32> = (0..64).map(|_| rng.random_range(-1.0..1.0)).collect();
    let scaled = rotate(
        &params(true, 64, RopeScaling::Linear { factor: 4.0 }),
        &x,
        40,
    );
    let plain = rotate(&params(true, 64, RopeScaling::None), &x, 10);
    for (a, b) in scaled.iter().zip(&plain) {
        assert!((a - b).abs() < 1e-4, "{a} vs {b}");
    }
    // YaRN with ext_factor 0 and attn_factor 1 is plain linear interpolation.
    let yarn = RopeScaling::Yarn {
        factor: 4.0,
        orig_ctx: 4096,
        ext_factor: 0.0,
        attn_factor: 1.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
    };
    let y = rotate(&params(true, 64, yarn), &x, 40);
    for (a, b) in y.iter().zip(&scaled) {
        assert!((a - b).abs() < 1e-6);
    }
}
