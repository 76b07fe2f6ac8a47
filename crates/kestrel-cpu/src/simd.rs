//! Vectorized f32 kernels with runtime CPU-feature dispatch. Each has a scalar twin that
//! stays as the oracle and runs on CPUs without the features.

/// Which instruction set the kernels use, decided once at start-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2Fma,
    /// AVX-512F/BW on top of AVX2+FMA: the fused quantized dot kernels (`qdot`).
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Isa {
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c");
            let avx512 = std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw");
            // KESTREL_NO_AVX512 keeps the AVX2 kernels (comparisons, debugging).
            if avx2 && avx512 && std::env::var_os("KESTREL_NO_AVX512").is_none() {
                return Isa::Avx512;
            }
            if avx2 {
                return Isa::Avx2Fma;
            }
        }
        Isa::Scalar
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => "avx2+fma",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => "avx512",
        }
    }
}

/// Plain dot product, accumulated in order (the oracle).
pub fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Dot product of `x` with four rows at once: `out[r] = rows[r] · x`.
pub fn dot4(isa: Isa, rows: [&[f32]; 4], x: &[f32]) -> [f32; 4] {
    match isa {
        Isa::Scalar => rows.map(|r| dot_scalar(r, x)),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2Fma` and `Isa::Avx512` are only chosen when the CPU reports
        // AVX2 and FMA.
        Isa::Avx2Fma | Isa::Avx512 => unsafe { avx2::dot4(rows, x) },
    }
}

/// Dot product of two slices of equal length.
pub fn dot(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    match isa {
        Isa::Scalar => dot_scalar(a, b),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2Fma | Isa::Avx512 => unsafe { avx2::dot(a, b) },
    }
}

/// `y += a * x`.
pub fn axpy(isa: Isa, a: f32, x: &[f32], y: &mut [f32]) {
    match isa {
        Isa::Scalar => y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2Fma | Isa::Avx512 => unsafe { avx2::axpy(a, x, y) },
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut i = 0;
        // SAFETY: every load reads 8 floats at i < n - 7 (or n - 15) within both slices.
        unsafe {
            while i + 16 <= n {
                acc0 =
                    _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
                acc1 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(pa.add(i + 8)),
                    _mm256_loadu_ps(pb.add(i + 8)),
                    acc1,
                );
                i += 16;
            }
            while i + 8 <= n {
                acc0 =
                    _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
                i += 8;
            }
        }
        let mut s = hsum(_mm256_add_ps(acc0, acc1));
        for j in i..n {
            s += a[j] * b[j];
        }
        s
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot4(rows: [&[f32]; 4], x: &[f32]) -> [f32; 4] {
        let n = rows.iter().map(|r| r.len()).min().unwrap_or(0).min(x.len());
        let px = x.as_ptr();
        let p = rows.map(|r| r.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: loads read 8 floats at offsets below n in every slice.
        unsafe {
            while i + 8 <= n {
                let xv = _mm256_loadu_ps(px.add(i));
                for r in 0..4 {
                    acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(p[r].add(i)), xv, acc[r]);
                }
                i += 8;
            }
        }
        let mut out = [hsum(acc[0]), hsum(acc[1]), hsum(acc[2]), hsum(acc[3])];
        for j in i..n {
            for r in 0..4 {
                out[r] += rows[r][j] * x[j];
            }
        }
        out
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len().min(y.len());
        let av = _mm256_set1_ps(a);
        let mut i = 0;
        // SAFETY: loads and stores touch 8 floats below n.
        unsafe {
            while i + 8 <= n {
                let yv = _mm256_loadu_ps(y.as_ptr().add(i));
                let r = _mm256_fmadd_ps(av, _mm256_loadu_ps(x.as_ptr().add(i)), yv);
                _mm256_storeu_ps(y.as_mut_ptr().add(i), r);
                i += 8;
            }
        }
        for j in i..n {
            y[j] += a * x[j];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn rand_vec(rng: &mut impl Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
    }

    #[test]
    fn simd_kernels_match_scalar_on_awkward_lengths() {
        let isa = Isa::detect();
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
        for n in [0, 1, 7, 8, 9, 15, 16, 17, 31, 100, 257, 1000] {
            let x = rand_vec(&mut rng, n);
            let rows: Vec<Vec<f32>> = (0..4).map(|_| rand_vec(&mut rng, n)).collect();
            let want: Vec<f64> = rows
                .iter()
                .map(|r| r.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum())
                .collect();
            let got4 = dot4(isa, [&rows[0], &rows[1], &rows[2], &rows[3]], &x);
            for r in 0..4 {
                let tol = 1e-5 * (n as f64).max(1.0);
                assert!((got4[r] as f64 - want[r]).abs() < tol, "dot4 n={n}");
                assert!(
                    (dot(isa, &rows[r], &x) as f64 - want[r]).abs() < tol,
                    "dot n={n}"
                );
            }
            let mut y = rand_vec(&mut rng, n);
            let mut y_ref = y.clone();
            axpy(isa, 0.37, &x, &mut y);
            axpy(Isa::Scalar, 0.37, &x, &mut y_ref);
            for (a, b) in y.iter().zip(&y_ref) {
                assert!((a - b).abs() < 1e-6);
            }
        }
    }
}
