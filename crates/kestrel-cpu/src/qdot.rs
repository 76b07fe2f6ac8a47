//! Fused dequantize-and-dot kernels: the dot product of one quantized row with f32
//! activations, decoding each block in registers (no f32 copy of the row).
//!
//! The activations stay f32 (no 8-bit rounding of x, unlike llama.cpp), so the results
//! equal `kestrel_quant::vec_dot` up to the order of the f32 sums.

use kestrel_gguf::GgmlType;

use crate::simd::Isa;

/// Whether [`dot_row`] has a fused kernel for `ty` on `isa`.
pub fn supported(isa: Isa, ty: GgmlType) -> bool {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => matches!(
            ty,
            GgmlType::Q4K
                | GgmlType::Q6K
                | GgmlType::Q8_0
                | GgmlType::Q5_0
                | GgmlType::F32
                | GgmlType::F16
                | GgmlType::BF16
        ),
        _ => false,
    }
}

/// `row · x` for a row of `ty` holding exactly `x.len()` values. Only call it where
/// [`supported`] says so and `row.len()` is the row's byte size (checked at load).
#[inline]
pub fn dot_row(isa: Isa, ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    let _ = (isa, ty, row, x);
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx512` is only chosen when the CPU reports AVX-512F/BW, AVX2 and
        // FMA; the kernels check the slice lengths they read.
        Isa::Avx512 => unsafe {
            match ty {
                GgmlType::Q4K => avx512::q4_k(row, x),
                GgmlType::Q6K => avx512::q6_k(row, x),
                GgmlType::Q8_0 => avx512::q8_0(row, x),
                GgmlType::Q5_0 => avx512::q5_0(row, x),
                GgmlType::F32 => avx512::f32_row(row, x),
                GgmlType::F16 => avx512::f16_row(row, x),
                GgmlType::BF16 => avx512::bf16_row(row, x),
                _ => kestrel_quant::vec_dot(ty, row, x),
            }
        },
        _ => kestrel_quant::vec_dot(ty, row, x),
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use kestrel_quant::f16_to_f32;

    #[inline(always)]
    fn f16_at(b: &[u8], at: usize) -> f32 {
        f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
    }

    /// Sixteen unsigned bytes widened to f32.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
    fn u8x16_to_ps(v: __m128i) -> __m512 {
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v))
    }

    /// Sixteen signed bytes widened to f32.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
    fn i8x16_to_ps(v: __m128i) -> __m512 {
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v))
    }

    /// Sixteen floats of `x` from index `i` (the caller guarantees `i + 16 <= x.len()`).
    #[inline(always)]
    unsafe fn ld(x: &[f32], i: usize) -> __m512 {
        debug_assert!(i + 16 <= x.len());
        // SAFETY: in bounds by the caller's guarantee.
        unsafe { _mm512_loadu_ps(x.as_ptr().add(i)) }
    }

    #[inline(always)]
    unsafe fn ld256(b: &[u8], at: usize) -> __m256i {
        let s = &b[at..at + 32];
        // SAFETY: `s` holds 32 bytes.
        unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
    }

    #[inline(always)]
    unsafe fn ld128(b: &[u8], at: usize) -> __m128i {
        let s = &b[at..at + 16];
        // SAFETY: `s` holds 16 bytes.
        unsafe { _mm_loadu_si128(s.as_ptr().cast()) }
    }

    /// An f16 at byte `at` of `b`, by the F16C instruction.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    fn f16c_at(b: &[u8], at: usize) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
            u16::from_le_bytes([b[at], b[at + 1]]) as i32,
        )))
    }

    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub unsafe fn q4_k(row: &[u8], x: &[f32]) -> f32 {
        let nb = x.len() / 256;
        let mut acc = _mm512_setzero_ps();
        let mut acc_min = _mm512_setzero_ps();
        let mask = _mm256_set1_epi8(0x0f);
        for (b, xb) in row.chunks_exact(144).take(nb).zip(x.chunks_exact(256)) {
            // The block's 8 scales and 8 minimums, times d and dmin, converted to f32 in
            // one vector each (scalar conversions per sub-block dominated this loop).
            let scales = &b[4..16];
            let (mut sc, mut mn) = ([0i32; 8], [0i32; 8]);
            for j in 0..8 {
                let (s, m) = scale_min(j, scales);
                sc[j] = s as i32;
                mn[j] = m as i32;
            }
            let (mut ds, mut dm) = ([0f32; 8], [0f32; 8]);
            // SAFETY: 8-lane loads and stores of 8-element arrays.
            unsafe {
                let d = _mm256_set1_ps(f16c_at(b, 0));
                let dmin = _mm256_set1_ps(f16c_at(b, 2));
                let scv = _mm256_cvtepi32_ps(_mm256_loadu_si256(sc.as_ptr().cast()));
                let mnv = _mm256_cvtepi32_ps(_mm256_loadu_si256(mn.as_ptr().cast()));
                _mm256_storeu_ps(ds.as_mut_ptr(), _mm256_mul_ps(d, scv));
                _mm256_storeu_ps(dm.as_mut_ptr(), _mm256_mul_ps(dmin, mnv));
            }
            for c in 0..4 {
                // SAFETY: 32 quant bytes at 16 + 32c < 144, x offsets below 256.
                unsafe {
                    let q = ld256(b, 16 + 32 * c);
                    let lo = _mm256_and_si256(q, mask);
                    let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
                    let o = 64 * c;
                    let (x0, x1) = (ld(xb, o), ld(xb, o + 16));
                    let (x2, x3) = (ld(xb, o + 32), ld(xb, o + 48));
                    let mut t1 = _mm512_mul_ps(u8x16_to_ps(_mm256_castsi256_si128(lo)), x0);
                    t1 = _mm512_fmadd_ps(u8x16_to_ps(_mm256_extracti128_si256(lo, 1)), x1, t1);
                    let mut t2 = _mm512_mul_ps(u8x16_to_ps(_mm256_castsi256_si128(hi)), x2);
                    t2 = _mm512_fmadd_ps(u8x16_to_ps(_mm256_extracti128_si256(hi, 1)), x3, t2);
                    acc = _mm512_fmadd_ps(_mm512_set1_ps(ds[2 * c]), t1, acc);
                    acc = _mm512_fmadd_ps(_mm512_set1_ps(ds[2 * c + 1]), t2, acc);
                    let m1v = _mm512_set1_ps(dm[2 * c]);
                    let m2v = _mm512_set1_ps(dm[2 * c + 1]);
                    acc_min = _mm512_fmadd_ps(m1v, _mm512_add_ps(x0, x1), acc_min);
                    acc_min = _mm512_fmadd_ps(m2v, _mm512_add_ps(x2, x3), acc_min);
                }
            }
        }
        _mm512_reduce_add_ps(_mm512_sub_ps(acc, acc_min))
    }

    /// Scale and min number `j` of a Q4_K block's packed scale bytes.
    #[inline(always)]
    fn scale_min(j: usize, s: &[u8]) -> (u8, u8) {
        if j < 4 {
            (s[j] & 63, s[j + 4] & 63)
        } else {
            (
                (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
                (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
            )
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub unsafe fn q6_k(row: &[u8], x: &[f32]) -> f32 {
        let nb = x.len() / 256;
        let mut acc = _mm512_setzero_ps();
        let m4 = _mm256_set1_epi8(0x0f);
        let m2 = _mm256_set1_epi8(0x03);
        let off = _mm256_set1_epi8(32);
        for (b, xb) in row.chunks_exact(210).take(nb).zip(x.chunks_exact(256)) {
            // The block's 16 scales times d, converted in one vector.
            let mut ds = [0f32; 16];
            // SAFETY: 16 scale bytes at 192..208; a 16-lane store into a 16-element array.
            unsafe {
                let sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(ld128(b, 192)));
                let d = _mm512_set1_ps(f16c_at(b, 208));
                _mm512_storeu_ps(ds.as_mut_ptr(), _mm512_mul_ps(d, sc));
            }
            for half in 0..2 {
                let sc = &ds[8 * half..8 * half + 8];
                // SAFETY: ql at 64·half (+32) and qh at 128 + 32·half hold 32 bytes each;
                // x offsets stay below 256.
                unsafe {
                    let qla = ld256(b, 64 * half);
                    let qlb = ld256(b, 64 * half + 32);
                    let qh = ld256(b, 128 + 32 * half);
                    let h = |shift: i32| -> __m256i {
                        let v = match shift {
                            0 => qh,
                            2 => _mm256_srli_epi16(qh, 2),
                            4 => _mm256_srli_epi16(qh, 4),
                            _ => _mm256_srli_epi16(qh, 6),
                        };
                        _mm256_slli_epi16(_mm256_and_si256(v, m2), 4)
                    };
                    let q = [
                        _mm256_or_si256(_mm256_and_si256(qla, m4), h(0)),
                        _mm256_or_si256(_mm256_and_si256(qlb, m4), h(2)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qla, 4), m4), h(4)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qlb, 4), m4), h(6)),
                    ];
                    for (k, qk) in q.into_iter().enumerate() {
                        let qk = _mm256_sub_epi8(qk, off);
                        let o = 128 * half + 32 * k;
                        let t0 = _mm512_mul_ps(i8x16_to_ps(_mm256_castsi256_si128(qk)), ld(xb, o));
                        let t1 = _mm512_mul_ps(
                            i8x16_to_ps(_mm256_extracti128_si256(qk, 1)),
                            ld(xb, o + 16),
                        );
                        let (s0, s1) = (sc[2 * k], sc[2 * k + 1]);
                        acc = _mm512_fmadd_ps(_mm512_set1_ps(s0), t0, acc);
                        acc = _mm512_fmadd_ps(_mm512_set1_ps(s1), t1, acc);
                    }
                }
            }
        }
        _mm512_reduce_add_ps(acc)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
    pub unsafe fn q8_0(row: &[u8], x: &[f32]) -> f32 {
        let nb = x.len() / 32;
        let mut acc = _mm512_setzero_ps();
        for (b, xb) in row.chunks_exact(34).take(nb).zip(x.chunks_exact(32)) {
            let d = f16_at(b, 0);
            // SAFETY: quants at 2..34, x within the 32-value block.
            unsafe {
                let t = _mm512_mul_ps(i8x16_to_ps(ld128(b, 2)), ld(xb, 0));
                let t = _mm512_fmadd_ps(i8x16_to_ps(ld128(b, 18)), ld(xb, 16), t);
                acc = _mm512_fmadd_ps(_mm512_set1_ps(d), t, acc);
            }
        }
        _mm512_reduce_add_ps(acc)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
    pub unsafe fn q5_0(row: &[u8], x: &[f32]) -> f32 {
        let nb = x.len() / 32;
        let mut acc = _mm512_setzero_ps();
        let m4 = _mm_set1_epi8(0x0f);
        let sixteen = _mm512_set1_epi32(16);
        for (b, xb) in row.chunks_exact(22).take(nb).zip(x.chunks_exact(32)) {
            let d = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            // SAFETY: quants at 6..22, x within the 32-value block.
            unsafe {
                let q = ld128(b, 6);
                let lo = _mm512_cvtepu8_epi32(_mm_and_si128(q, m4));
                let hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), m4));
                // The fifth bit adds 16; then the offset of 16 comes off.
                let lo = _mm512_mask_add_epi32(lo, (qh & 0xffff) as u16, lo, sixteen);
                let hi = _mm512_mask_add_epi32(hi, (qh >> 16) as u16, hi, sixteen);
                let lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, sixteen));
                let hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, sixteen));
                let t = _mm512_mul_ps(lo, ld(xb, 0));
                let t = _mm512_fmadd_ps(hi, ld(xb, 16), t);
                acc = _mm512_fmadd_ps(_mm512_set1_ps(d), t, acc);
            }
        }
        _mm512_reduce_add_ps(acc)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
    pub unsafe fn f32_row(row: &[u8], x: &[f32]) -> f32 {
        let n = x.len().min(row.len() / 4);
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        // SAFETY: loads read 16 floats below n from both.
        unsafe {
            while i + 16 <= n {
                let w = _mm512_loadu_ps(row.as_ptr().add(4 * i).cast());
                acc = _mm512_fmadd_ps(w, ld(x, i), acc);
                i += 16;
            }
        }
        let mut s = _mm512_reduce_add_ps(acc);
        for j in i..n {
            let b = &row[4 * j..4 * j + 4];
            s += f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * x[j];
        }
        s
    }

    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub unsafe fn f16_row(row: &[u8], x: &[f32]) -> f32 {
        let n = x.len().min(row.len() / 2);
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        // SAFETY: loads read 16 halves below n.
        unsafe {
            while i + 16 <= n {
                let w = _mm512_cvtph_ps(_mm256_loadu_si256(row.as_ptr().add(2 * i).cast()));
                acc = _mm512_fmadd_ps(w, ld(x, i), acc);
                i += 16;
            }
        }
        let mut s = _mm512_reduce_add_ps(acc);
        for (j, xj) in x.iter().enumerate().take(n).skip(i) {
            s += f16_at(row, 2 * j) * xj;
        }
        s
    }

    #[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
    pub unsafe fn bf16_row(row: &[u8], x: &[f32]) -> f32 {
        let n = x.len().min(row.len() / 2);
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        // SAFETY: loads read 16 bf16 values below n.
        unsafe {
            while i + 16 <= n {
                let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(row.as_ptr().add(2 * i).cast()));
                let w = _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
                acc = _mm512_fmadd_ps(w, ld(x, i), acc);
                i += 16;
            }
        }
        let mut s = _mm512_reduce_add_ps(acc);
        for j in i..n {
            let bits = u16::from_le_bytes([row[2 * j], row[2 * j + 1]]);
            s += f32::from_bits((bits as u32) << 16) * x[j];
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn fused_dots_match_the_scalar_reference() {
        let isa = Isa::detect();
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
        let types = [
            GgmlType::Q4K,
            GgmlType::Q6K,
            GgmlType::Q8_0,
            GgmlType::Q5_0,
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::BF16,
        ];
        for ty in types {
            if !supported(isa, ty) {
                continue;
            }
            let bs = ty.block_size();
            for blocks in [1, 2, 3, 7] {
                let k = bs * blocks;
                // F32/F16/BF16 rows of odd lengths exercise the tails.
                let k = if bs == 1 { k * 37 + blocks } else { k };
                for _ in 0..5 {
                    let w: Vec<f32> = (0..k).map(|_| rng.random_range(-2.0..2.0)).collect();
                    let x: Vec<f32> = (0..k).map(|_| rng.random_range(-3.0..3.0)).collect();
                    let row = kestrel_quant::quantize(ty, &w, k).expect("quantize");
                    let want = kestrel_quant::vec_dot(ty, &row, &x);
                    let deq = kestrel_quant::dequantize(ty, &row).expect("dequantize");
                    let mag: f32 = deq.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
                    let got = dot_row(isa, ty, &row, &x);
                    assert!(
                        (got - want).abs() <= 1e-5 * mag + 1e-6,
                        "{ty} k={k}: got {got}, want {want}"
                    );
                }
            }
        }
    }
}
