//! Register-tiled f32 matrix-matrix kernel for prefill: four weight rows times four
//! tokens per call, so each loaded vector feeds four multiply-adds.

use crate::simd::{self, Isa};

/// `out[t][r] = rows[r] · xs[t]` for four rows and four tokens of equal length.
pub fn tile4x4(isa: Isa, rows: [&[f32]; 4], xs: [&[f32]; 4]) -> [[f32; 4]; 4] {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx512` is only chosen when the CPU reports AVX-512F.
        Isa::Avx512 => unsafe { avx512::tile4x4(rows, xs) },
        _ => xs.map(|x| simd::dot4(isa, rows, x)),
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn tile4x4(rows: [&[f32]; 4], xs: [&[f32]; 4]) -> [[f32; 4]; 4] {
        let n = rows
            .iter()
            .chain(xs.iter())
            .map(|s| s.len())
            .min()
            .unwrap_or(0);
        let pr = rows.map(|r| r.as_ptr());
        let px = xs.map(|x| x.as_ptr());
        let mut acc = [[_mm512_setzero_ps(); 4]; 4];
        let mut i = 0;
        // SAFETY: every load reads 16 floats at offsets below n in its slice.
        unsafe {
            while i + 16 <= n {
                let w = pr.map(|p| _mm512_loadu_ps(p.add(i)));
                for t in 0..4 {
                    let xv = _mm512_loadu_ps(px[t].add(i));
                    for r in 0..4 {
                        acc[t][r] = _mm512_fmadd_ps(w[r], xv, acc[t][r]);
                    }
                }
                i += 16;
            }
        }
        let mut out = [[0f32; 4]; 4];
        for t in 0..4 {
            for r in 0..4 {
                let mut s = _mm512_reduce_add_ps(acc[t][r]);
                for j in i..n {
                    s += rows[r][j] * xs[t][j];
                }
                out[t][r] = s;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn tile_matches_scalar_dots_on_awkward_lengths() {
        let isa = Isa::detect();
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
        for n in [0, 1, 15, 16, 17, 33, 100, 256, 1000] {
            let v = |rng: &mut rand::rngs::StdRng| -> Vec<f32> {
                (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
            };
            let rows: Vec<Vec<f32>> = (0..4).map(|_| v(&mut rng)).collect();
            let xs: Vec<Vec<f32>> = (0..4).map(|_| v(&mut rng)).collect();
            let got = tile4x4(
                isa,
                [&rows[0], &rows[1], &rows[2], &rows[3]],
                [&xs[0], &xs[1], &xs[2], &xs[3]],
            );
            for t in 0..4 {
                for r in 0..4 {
                    let want = simd::dot_scalar(&rows[r], &xs[t]);
                    assert!(
                        (got[t][r] - want).abs() <= 1e-5 * (n as f32).max(1.0),
                        "n={n} t={t} r={r}"
                    );
                }
            }
        }
    }
}
