//! Integer dot kernels, as llama.cpp computes K-quant matmuls: the activations are
//! quantized once per matmul to Q8_K (one f32 scale per 256 values, i8 quants and sums
//! of 16), and each Q4_K/Q6_K block is multiplied with `vpdpbusd` (AVX-512 VNNI).
//!
//! This is the path of `Numerics::Ggml` (the default, see `numerics.rs`); with
//! `KESTREL_CPU_NUMERICS=f32` the f32 kernels of `qdot.rs` run instead.

use kestrel_gguf::GgmlType;

/// Bytes of one Q8_K block: d f32, qs[256] i8, bsums[16] i16.
pub const Q8K_BLOCK: usize = 292;

/// Bytes of one activation pair of the 32-value kernels: two Q8_0 blocks with their (f16)
/// scales widened to f32, so kernels need not convert them per row, and their quants
/// stored as unsigned bytes y + 128 (the kernels take the weights as the signed operand
/// of `vpdpbusd` and subtract 128 · Σ w once per weight block): d0 f32, d1 f32, u[64].
/// An odd last block has d1 = 0 and y = 0 in the second half.
pub const Q8_0X_PAIR: usize = 72;

/// Quantizes activations (whole 32-value blocks) to [`Q8_0X_PAIR`] pairs: the values of
/// `numerics::quantize_q8_0`, each scale stored as the f32 of its f16.
pub fn quantize_q8_0x(x: &[f32], out: &mut [u8]) {
    for (xp, op) in x.chunks(64).zip(out.chunks_exact_mut(Q8_0X_PAIR)) {
        op[4..8].copy_from_slice(&0f32.to_le_bytes());
        op[40..].fill(0);
        for (h, xb) in xp.chunks_exact(32).enumerate() {
            let d = crate::numerics::q8_0_block(xb, &mut op[8 + 32 * h..8 + 32 * (h + 1)]);
            op[4 * h..4 * (h + 1)].copy_from_slice(&d.to_f32().to_le_bytes());
        }
        for q in &mut op[8..] {
            *q ^= 0x80;
        }
    }
}

/// Bytes of `k` activations (whole blocks) quantized to `act` (Q8_K or Q8_0) in the
/// layout the kernels take.
pub fn activation_bytes(act: GgmlType, k: usize) -> usize {
    match act {
        GgmlType::Q8K => k / 256 * Q8K_BLOCK,
        _ => (k / 32).div_ceil(2) * Q8_0X_PAIR,
    }
}

/// Quantizes one token's activations (whole blocks) to `act`, `numerics::activation_type`
/// of the weight, in the layout the kernels take: [`Q8_0X_PAIR`] pairs for Q8_0,
/// [`Q8K_BLOCK`] blocks for Q8_K.
pub fn quantize_activations(act: GgmlType, x: &[f32], out: &mut [u8]) {
    if act == GgmlType::Q8_0 {
        quantize_q8_0x(x, out);
    } else {
        // Whole 256-value blocks (checked by the callers): this cannot fail.
        let _ = kestrel_quant::quantize_row(act, x, out);
        for block in out[..x.len() / 256 * Q8K_BLOCK].chunks_exact_mut(Q8K_BLOCK) {
            interleave_q8k(block);
        }
    }
}

/// Reorders a Q8_K block's quants the way the kernels read them: in each group of 128
/// values, the 32-value runs go 0, 2, 1, 3 (values 0..32, 64..96, 32..64, 96..128), so
/// that one 64-byte load of Q4_K or Q6_K low nibbles (or high nibbles) meets the 64
/// activations it multiplies. The scale and the sums of 16 keep their order.
fn interleave_q8k(block: &mut [u8]) {
    for g in 0..2 {
        let qs = &mut block[4 + 128 * g..4 + 128 * (g + 1)];
        let mut run = [0u8; 32];
        // Swap runs 1 and 2.
        run.copy_from_slice(&qs[32..64]);
        qs.copy_within(64..96, 32);
        qs[64..96].copy_from_slice(&run);
    }
}

/// Whether the integer kernels can run on this CPU for weights of `ty`.
pub fn supported(ty: GgmlType) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        matches!(
            ty,
            GgmlType::Q4K | GgmlType::Q6K | GgmlType::Q8_0 | GgmlType::Q5_0 | GgmlType::Q4_0
        ) && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = ty;
        false
    }
}

/// `row · x` where `xq` is `x` quantized to `numerics::activation_type(ty)` (Q8_K, or
/// Q8_0 laid out as [`Q8_0X_PAIR`] pairs; `row` and `xq` must hold the same number of
/// blocks). Only call where [`supported`] is true.
#[inline]
pub fn dot_row(ty: GgmlType, row: &[u8], xq: &[u8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `supported` checked AVX-512F/BW and VNNI; the kernels bound their reads
        // by the slices.
        unsafe {
            match ty {
                GgmlType::Q4K => vnni::q4_k(row, [xq])[0],
                GgmlType::Q6K => vnni::q6_k(row, [xq])[0],
                GgmlType::Q8_0 => vnni::q32::<{ vnni::Q8_0 }, 1>(row, [xq])[0],
                GgmlType::Q5_0 => vnni::q32::<{ vnni::Q5_0 }, 1>(row, [xq])[0],
                GgmlType::Q4_0 => vnni::q32::<{ vnni::Q4_0 }, 1>(row, [xq])[0],
                _ => f32::NAN,
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ty, row, xq);
        f32::NAN
    }
}

/// `[row · x_t]` for four tokens' activations (see [`dot_row`]).
#[inline]
pub fn dot_row_x4(ty: GgmlType, row: &[u8], ys: [&[u8]; 4]) -> [f32; 4] {
    dot_rows(ty, row, ys)
}

/// `[row · x_t]` for `N` tokens' activations (see [`dot_row`]), each weight block decoded
/// once for all of them. Each token's result is bitwise the same as [`dot_row`]'s.
#[inline]
pub fn dot_rows<const N: usize>(ty: GgmlType, row: &[u8], ys: [&[u8]; N]) -> [f32; N] {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: as in `dot_row`.
        unsafe {
            match ty {
                GgmlType::Q4K => vnni::q4_k(row, ys),
                GgmlType::Q6K => vnni::q6_k(row, ys),
                GgmlType::Q8_0 => vnni::q32::<{ vnni::Q8_0 }, N>(row, ys),
                GgmlType::Q5_0 => vnni::q32::<{ vnni::Q5_0 }, N>(row, ys),
                GgmlType::Q4_0 => vnni::q32::<{ vnni::Q4_0 }, N>(row, ys),
                _ => [f32::NAN; N],
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ty, row, ys);
        [f32::NAN; N]
    }
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    use std::arch::x86_64::*;

    use super::Q8K_BLOCK;

    #[inline(always)]
    unsafe fn ld256(b: &[u8], at: usize) -> __m256i {
        let s = &b[at..at + 32];
        // SAFETY: `s` holds 32 bytes.
        unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
    }

    /// Q4_K (144-byte blocks) · Q8_K (interleaved, see `interleave_q8k`), for `N` tokens
    /// at once (each weight block is decoded once and multiplied with every token's
    /// activations). Per 128 values, one 64-byte load gives the low nibbles of two 32-value
    /// runs and the high nibbles of the other two; `vpmaddubsw` multiplies them with the
    /// activations into pairs of 16 bits and `vpdpwssd` scales and sums them into 32-bit
    /// lanes (exact integers: the order of these additions does not matter).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn q4_k<const N: usize>(row: &[u8], ys: [&[u8]; N]) -> [f32; N] {
        let m4 = _mm512_set1_epi8(0x0f);
        // Low nibbles of group g hold sub-blocks 4g and 4g + 2 (32-bit lanes 0-7, 8-15 of
        // their sums), high nibbles 4g + 1, 4g + 3.
        // After `pack_sums`, 32-bit lane r of group g holds values of sub-block
        // 4g + 2·(r / 8) + (r % 4) / 2: these lanes of `sc` give each its scale.
        let spread: [__m512i; 2] =
            std::array::from_fn(|g| lanes(|r| 4 * g as i32 + 2 * (r / 8) + (r % 4) / 2));
        let mut acc = [_mm512_setzero_ps(); N];
        let mut acc_min = [_mm256_setzero_ps(); N];
        let n_blocks = ys
            .iter()
            .map(|y| y.len() / Q8K_BLOCK)
            .fold(row.len() / 144, usize::min);
        let yp = ys.map(|y| y.as_ptr());
        for blk in 0..n_blocks {
            let b = &row[144 * blk..144 * (blk + 1)];
            let yo = Q8K_BLOCK * blk;
            let (sc, mins) = scales_mins(&b[4..16]);
            // SAFETY: the loads below read inside the 144-byte block (d and dmin at 0..4,
            // quants at 16..144) and the 292-byte Q8_K blocks (quants at 4..260, sums at
            // 260..292) of every token, which hold at least `n_blocks` blocks.
            unsafe {
                let dd = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from_le_bytes([
                    b[0], b[1], b[2], b[3],
                ])));
                let dw = _mm_cvtss_f32(dd);
                let dmw = _mm_cvtss_f32(_mm_movehdup_ps(dd));
                // Each 6-bit scale in both 16-bit halves of its 32-bit lane.
                let sc = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(sc as i64));
                let sc = _mm512_castsi256_si512(_mm256_or_si256(sc, _mm256_slli_epi32(sc, 16)));
                // Each min likewise, against the sums of 16 (pairs of which are a sub-block).
                let mins = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(mins as i64));
                let mins = _mm256_or_si256(mins, _mm256_slli_epi32(mins, 16));
                let mut isum = [_mm512_setzero_si512(); N];
                for (g, &spread) in spread.iter().enumerate() {
                    let q = _mm512_loadu_si512(b.as_ptr().add(16 + 64 * g).cast());
                    let lo = _mm512_and_si512(q, m4);
                    let hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
                    let s = _mm512_permutexvar_epi32(spread, sc);
                    dot128_tokens(&mut isum, &yp, yo + 4 + 128 * g, lo, hi, s);
                }
                for t in 0..N {
                    let dy = std::ptr::read_unaligned(yp[t].add(yo).cast::<f32>());
                    acc[t] = _mm512_fmadd_ps(
                        _mm512_set1_ps(dw * dy),
                        _mm512_cvtepi32_ps(isum[t]),
                        acc[t],
                    );
                    // The min term: Σ_j m_j · Σ_{i in sub-block j} y_i, from the sums of 16.
                    let bsums = _mm256_loadu_si256(yp[t].add(yo + 260).cast());
                    let msum = _mm256_cvtepi32_ps(_mm256_madd_epi16(bsums, mins));
                    acc_min[t] = _mm256_fmadd_ps(_mm256_set1_ps(dmw * dy), msum, acc_min[t]);
                }
            }
        }
        let mut out = [0f32; N];
        for t in 0..N {
            out[t] = _mm512_reduce_add_ps(acc[t]) - hsum256(acc_min[t]);
        }
        out
    }

    /// `acc + Σ pairs a·b` (`vpdpwssd`). Through inline assembly because LLVM splits the
    /// intrinsic into `vpmaddwd` + `vpaddd` (one more instruction per use) for this CPU.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vnni")]
    unsafe fn dpwssd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
        let mut acc = acc;
        // SAFETY: the callers enable AVX-512 VNNI; register operands only.
        unsafe {
            std::arch::asm!(
                "vpdpwssd {acc}, {a}, {b}",
                acc = inout(zmm_reg) acc,
                a = in(zmm_reg) a,
                b = in(zmm_reg) b,
                options(pure, nomem, nostack, preserves_flags),
            );
        }
        acc
    }

    /// The sums of four products (unsigned × signed bytes, `vpdpbusd`) of each 32-bit lane
    /// of `a · ya` and of `b · yb`, packed to 16 bits (`vpackssdw`: 128-bit lane k holds
    /// lanes 4k..4k + 4 of the first, then those of the second) for `vpmaddwd` to scale:
    /// three multiplying instructions where two `vpmaddubsw` + two `vpdpwssd` were four.
    /// Each sum must fit 16 bits: 4 · 63 · 128 does (Q6_K's 6-bit quants, Q4_K's 4-bit),
    /// so the packing never saturates and the integers are exact.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn pack_sums(a: __m512i, ya: __m512i, b: __m512i, yb: __m512i) -> __m512i {
        let zero = _mm512_setzero_si512();
        _mm512_packs_epi32(
            _mm512_dpbusd_epi32(zero, a, ya),
            _mm512_dpbusd_epi32(zero, b, yb),
        )
    }

    /// For each token t: `isum[t] += s ·` the packed sums (see [`pack_sums`]) of weights `a`
    /// and `b` with the token's 128 activation bytes at `off` of its row (`a` meets the first
    /// 64, `b` the next 64).
    ///
    /// # Safety
    /// Each `yp[t]` must point to at least `off + 128` readable bytes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn dot128_tokens<const N: usize>(
        isum: &mut [__m512i; N],
        yp: &[*const u8; N],
        off: usize,
        a: __m512i,
        b: __m512i,
        s: __m512i,
    ) {
        for t in 0..N {
            // SAFETY: in bounds by the caller's guarantee; AVX-512 enabled above.
            unsafe {
                let y = yp[t].add(off);
                let ya = _mm512_loadu_si512(y.cast());
                let yb = _mm512_loadu_si512(y.add(64).cast());
                isum[t] = dpwssd(isum[t], pack_sums(a, ya, b, yb), s);
            }
        }
    }

    /// A vector of 16 lane indices (`f(r)` in lane r).
    #[inline(always)]
    fn lanes(f: impl Fn(i32) -> i32) -> __m512i {
        let v: [i32; 16] = std::array::from_fn(|r| f(r as i32));
        // SAFETY: `v` holds 64 bytes; AVX-512F is enabled by every caller.
        unsafe { _mm512_loadu_si512(v.as_ptr().cast()) }
    }

    /// f16 → f32 with one F16C instruction.
    #[inline(always)]
    unsafe fn h2f(b: &[u8], at: usize) -> f32 {
        let bits = u16::from_le_bytes([b[at], b[at + 1]]);
        // SAFETY: the callers enable F16C.
        unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32))) }
    }

    /// The 32 signed values of weight block `b` (format `KIND`) in one 256-bit register.
    #[inline(always)]
    unsafe fn q32_values<const KIND: u8>(b: &[u8]) -> __m256i {
        // SAFETY: the loads read inside the block (its length is checked by the caller).
        unsafe {
            let mask = _mm_set1_epi8(0x0f);
            match KIND {
                Q8_0 => ld256(b, 2),
                Q5_0 => {
                    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                    let nib = _mm_loadu_si128(b[6..22].as_ptr().cast());
                    let lo = _mm_and_si128(nib, mask);
                    let hi = _mm_and_si128(_mm_srli_epi16(nib, 4), mask);
                    let v = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
                    // Bit j of qh is the fifth bit of value j; values are q - 16.
                    let high = _mm256_maskz_mov_epi8(qh, _mm256_set1_epi8(0x10));
                    _mm256_sub_epi8(_mm256_or_si256(v, high), _mm256_set1_epi8(16))
                }
                _ => {
                    let nib = _mm_loadu_si128(b[2..18].as_ptr().cast());
                    let lo = _mm_and_si128(nib, mask);
                    let hi = _mm_and_si128(_mm_srli_epi16(nib, 4), mask);
                    let v = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
                    _mm256_sub_epi8(v, _mm256_set1_epi8(8))
                }
            }
        }
    }

    /// Weight formats of [`q32`] (its const parameter).
    pub const Q8_0: u8 = 0;
    pub const Q5_0: u8 = 1;
    pub const Q4_0: u8 = 2;

    /// Q8_0 / Q5_0 / Q4_0 (32-value blocks) · Q8_0 activations for `N` tokens. Weight
    /// blocks go in pairs, decoded once to 64 signed bytes w; each token's pair, stored as
    /// u = y + 128 (see [`super::Q8_0X_PAIR`]), is multiplied by one `vpdpbusd` that starts
    /// from -128 · Σ w (computed once per pair for all tokens), giving Σ y · w per 32-bit
    /// lane, and the 16 lane sums (8 per block) are scaled by d_w · d_y into 16 float
    /// lanes. Every token's result takes the same operations in the same order whatever
    /// `N` is (batch-invariant).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn q32<const KIND: u8, const N: usize>(row: &[u8], ys: [&[u8]; N]) -> [f32; N] {
        const YP: usize = super::Q8_0X_PAIR;
        let block_bytes = match KIND {
            Q8_0 => 34,
            Q5_0 => 22,
            _ => 18,
        };
        let mut acc = [_mm512_setzero_ps(); N];
        let n_blocks = ys
            .iter()
            .map(|y| y.len() / YP * 2)
            .fold(row.len() / block_bytes, usize::min);
        let yp = ys.map(|y| y.as_ptr());
        let zero = _mm512_setzero_si512();
        let offset = _mm512_set1_epi8(-128);
        let mut blk = 0;
        while blk < n_blocks {
            // A pair of blocks, or the last one alone (upper half zero).
            let pair = blk + 1 < n_blocks;
            let b0 = &row[block_bytes * blk..block_bytes * (blk + 1)];
            // SAFETY: every load reads inside weight blocks blk (and blk + 1 when `pair`)
            // and inside each token's activation pair blk / 2 (n_blocks bounds them all).
            unsafe {
                let (q, dw0, dw1) = if pair {
                    let b1 = &row[block_bytes * (blk + 1)..block_bytes * (blk + 2)];
                    let q = _mm512_inserti64x4(
                        _mm512_castsi256_si512(q32_values::<KIND>(b0)),
                        q32_values::<KIND>(b1),
                        1,
                    );
                    (q, h2f(b0, 0), h2f(b1, 0))
                } else {
                    let q = _mm512_zextsi256_si512(q32_values::<KIND>(b0));
                    (q, h2f(b0, 0), 0.0)
                };
                // -128 · Σ w over each lane's four weights.
                let corr = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, offset, q));
                // (`_mm512_insertf32x8` is AVX-512DQ, not enabled here.)
                let dw = _mm512_castpd_ps(_mm512_insertf64x4(
                    _mm512_castps_pd(_mm512_set1_ps(dw0)),
                    _mm256_castps_pd(_mm256_set1_ps(dw1)),
                    1,
                ));
                for t in 0..N {
                    let y = yp[t].add(YP * (blk / 2));
                    let u = _mm512_loadu_si512(y.add(8).cast());
                    let dp = _mm512_dpbusd_epi32(corr, u, q);
                    let dy = _mm512_mask_broadcastss_ps(
                        _mm512_set1_ps(std::ptr::read_unaligned(y.cast::<f32>())),
                        0xff00,
                        _mm_set_ss(std::ptr::read_unaligned(y.add(4).cast::<f32>())),
                    );
                    // d_w · d_y per lane: the same products the scalar code formed.
                    let scale = _mm512_mul_ps(dw, dy);
                    acc[t] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dp), acc[t]);
                }
            }
            blk += 2;
        }
        let mut out = [0f32; N];
        for t in 0..N {
            out[t] = _mm512_reduce_add_ps(acc[t]);
        }
        out
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum256(v: __m256) -> f32 {
        let m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let m = _mm_add_ps(m, _mm_movehl_ps(m, m));
        _mm_cvtss_f32(_mm_add_ss(m, _mm_shuffle_ps(m, m, 1)))
    }

    /// The eight 6-bit scales and eight 6-bit mins of a Q4_K block's 12 packed bytes,
    /// one per byte: scales 0-3 sit in the low 6 bits of bytes 0-3 (mins: bytes 4-7);
    /// scales 4-7 take their low 4 bits from bytes 8-11 and their top 2 bits from the
    /// top of bytes 0-3 (mins: high nibbles of 8-11, top bits of 4-7).
    #[inline(always)]
    fn scales_mins(s: &[u8]) -> (u64, u64) {
        let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
        let (w0, w1, w2) = (w(0), w(1), w(2));
        const LOW6: u32 = 0x3f3f_3f3f;
        const LOW4: u32 = 0x0f0f_0f0f;
        const LOW2: u32 = 0x0303_0303;
        let sc_lo = w0 & LOW6;
        let sc_hi = (w2 & LOW4) | (((w0 >> 6) & LOW2) << 4);
        let m_lo = w1 & LOW6;
        let m_hi = ((w2 >> 4) & LOW4) | (((w1 >> 6) & LOW2) << 4);
        (
            sc_lo as u64 | (sc_hi as u64) << 32,
            m_lo as u64 | (m_hi as u64) << 32,
        )
    }

    /// Q6_K (210-byte blocks) · Q8_K (interleaved, see `interleave_q8k`) for `N` tokens.
    /// The 6-bit quants are used unsigned (q + 32) and 32 · Σ y comes off afterwards. Per
    /// 128 values, the low 32 bytes of `ql` give values 0..32 (low nibbles) and 64..96
    /// (high nibbles), the next 32 give 32..64 and 96..128, each with two bits of `qh`;
    /// products as in [`q4_k`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn q6_k<const N: usize>(row: &[u8], ys: [&[u8]; N]) -> [f32; N] {
        let m4 = _mm512_set1_epi8(0x0f);
        let m30 = _mm512_set1_epi8(0x30);
        let halves =
            |a: i16, b: i16| _mm512_inserti64x4(_mm512_set1_epi16(a), _mm256_set1_epi16(b), 1);
        // Low 256 bits: low nibbles / qh bits 0-1 (2-3 after the shift right by 2),
        // high 256 bits: high nibbles / qh bits 4-5 (6-7), all moved to bits 4-5.
        let ql_shift = halves(0, 4);
        let qh_shift = halves(4, 0);
        // `qa` of half h holds the 16-value groups 8h + [0, 1, 4, 5] (4 lanes of sums
        // each), `qb` 8h + [2, 3, 6, 7]; after `pack_sums`, 32-bit lane r holds values of
        // `qa`'s group r / 4 where r % 4 < 2, else `qb`'s: these lanes of `sc` give the
        // scales.
        let spread: [__m512i; 2] = std::array::from_fn(|h| {
            lanes(|r| {
                let k = (r / 4) as usize;
                8 * h as i32
                    + if r % 4 < 2 {
                        [0, 1, 4, 5][k]
                    } else {
                        [2, 3, 6, 7][k]
                    }
            })
        });
        let mut acc = [_mm512_setzero_ps(); N];
        let mut acc_corr = [_mm256_setzero_ps(); N];
        let n_blocks = ys
            .iter()
            .map(|y| y.len() / Q8K_BLOCK)
            .fold(row.len() / 210, usize::min);
        let yp = ys.map(|y| y.as_ptr());
        for blk in 0..n_blocks {
            let b = &row[210 * blk..210 * (blk + 1)];
            let yo = Q8K_BLOCK * blk;
            // SAFETY: ql (64 bytes at 64·half), qh (32 bytes at 128 + 32·half), the scales
            // (16 bytes at 192) and d (208..210) lie inside the block; each token's Q8_K
            // block `blk` exists (n_blocks bounds it): quants at 4..260, sums at 260..292.
            unsafe {
                let bp = b.as_ptr();
                let dw = h2f(b, 208);
                let sc8 = _mm_loadu_si128(bp.add(192).cast());
                // Each signed scale in both 16-bit halves of its 32-bit lane.
                let sc = _mm512_cvtepi8_epi32(sc8);
                let sc = _mm512_or_si512(
                    _mm512_and_si512(sc, _mm512_set1_epi32(0xffff)),
                    _mm512_slli_epi32(sc, 16),
                );
                let mut isum = [_mm512_setzero_si512(); N];
                for (half, &spread) in spread.iter().enumerate() {
                    let qla = _mm512_broadcast_i64x4(_mm256_loadu_si256(bp.add(64 * half).cast()));
                    let qlb =
                        _mm512_broadcast_i64x4(_mm256_loadu_si256(bp.add(64 * half + 32).cast()));
                    let qh =
                        _mm512_broadcast_i64x4(_mm256_loadu_si256(bp.add(128 + 32 * half).cast()));
                    let ha = _mm512_and_si512(_mm512_sllv_epi16(qh, qh_shift), m30);
                    let hb = _mm512_and_si512(
                        _mm512_sllv_epi16(_mm512_srli_epi16(qh, 2), qh_shift),
                        m30,
                    );
                    // (ql >> shift) & 0x0f | h
                    let qa =
                        _mm512_ternarylogic_epi32(_mm512_srlv_epi16(qla, ql_shift), m4, ha, 0xea);
                    let qb =
                        _mm512_ternarylogic_epi32(_mm512_srlv_epi16(qlb, ql_shift), m4, hb, 0xea);
                    let s = _mm512_permutexvar_epi32(spread, sc);
                    dot128_tokens(&mut isum, &yp, yo + 4 + 128 * half, qa, qb, s);
                }
                let sc16 = _mm256_cvtepi8_epi16(sc8);
                for t in 0..N {
                    let d = dw * std::ptr::read_unaligned(yp[t].add(yo).cast::<f32>());
                    acc[t] =
                        _mm512_fmadd_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(isum[t]), acc[t]);
                    // 32 · Σ_g scale_g · (sum of the 16 y in group g) comes off.
                    let bsums = _mm256_loadu_si256(yp[t].add(yo + 260).cast());
                    let corr = _mm256_cvtepi32_ps(_mm256_madd_epi16(bsums, sc16));
                    acc_corr[t] = _mm256_fmadd_ps(_mm256_set1_ps(32.0 * d), corr, acc_corr[t]);
                }
            }
        }
        let mut out = [0f32; N];
        for t in 0..N {
            out[t] = _mm512_reduce_add_ps(acc[t]) - hsum256(acc_corr[t]);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn activation_type(ty: GgmlType) -> GgmlType {
        crate::numerics::activation_type(ty).expect("a quantized type")
    }

    /// Activations quantized to the format the kernels take for `ty`.
    fn quantize_x(ty: GgmlType, x: &[f32]) -> Vec<u8> {
        let act = activation_type(ty);
        let mut out = vec![0u8; activation_bytes(act, x.len())];
        quantize_activations(act, x, &mut out);
        out
    }

    /// The values the kernels multiply for activations `x` (as `numerics::round_trip`).
    fn dequantized_x(ty: GgmlType, x: &[f32]) -> Vec<f32> {
        let (mut bytes, mut out) = (Vec::new(), Vec::new());
        crate::numerics::round_trip(activation_type(ty), x, &mut bytes, &mut out);
        out
    }

    /// Oracle: the scalar dot of the weight row with the dequantized activations (exactly
    /// the values the integer kernels multiply).
    #[test]
    fn integer_dots_match_the_dequantized_oracle() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
        for ty in [
            GgmlType::Q4K,
            GgmlType::Q6K,
            GgmlType::Q8_0,
            GgmlType::Q5_0,
            GgmlType::Q4_0,
        ] {
            if !supported(ty) {
                continue;
            }
            let block = activation_type(ty).block_size();
            for blocks in [1, 2, 3, 5, 19, 20] {
                let k = block * blocks;
                for _ in 0..5 {
                    let w: Vec<f32> = (0..k).map(|_| rng.random_range(-2.0..2.0)).collect();
                    // Mixed magnitudes, some exact zeros.
                    let x: Vec<f32> = (0..k)
                        .map(|i| {
                            if i % 13 == 0 {
                                0.0
                            } else {
                                rng.random_range(-3.0..3.0)
                            }
                        })
                        .collect();
                    let row = kestrel_quant::quantize(ty, &w, k).expect("quantize w");
                    let xq = quantize_x(ty, &x);
                    let xd = dequantized_x(ty, &x);
                    let want = kestrel_quant::vec_dot(ty, &row, &xd);
                    let wd = kestrel_quant::dequantize(ty, &row).expect("deq w");
                    let mag: f32 = wd.iter().zip(&xd).map(|(a, b)| (a * b).abs()).sum();
                    let got = dot_row(ty, &row, &xq);
                    assert!(
                        (got - want).abs() <= 1e-5 * mag + 1e-6,
                        "{ty} k={k}: got {got}, want {want}"
                    );
                    // Four tokens at once: this one in each slot, the others random.
                    let others: Vec<Vec<u8>> = (0..3)
                        .map(|_| {
                            let o: Vec<f32> = (0..k).map(|_| rng.random_range(-1.0..1.0)).collect();
                            quantize_x(ty, &o)
                        })
                        .collect();
                    for slot in 0..4 {
                        let mut ys: [&[u8]; 4] = [&others[0], &others[1], &others[2], &xq];
                        ys.swap(slot, 3);
                        let got4 = dot_row_x4(ty, &row, ys);
                        for (t, y) in ys.iter().enumerate() {
                            assert_eq!(got4[t], dot_row(ty, &row, y), "{ty} x4 slot {t}");
                        }
                    }
                    // Eight at once: this one in each slot.
                    for slot in 0..8 {
                        let mut ys: [&[u8]; 8] = std::array::from_fn(|i| &others[i % 3][..]);
                        ys[slot] = &xq;
                        let got8 = dot_rows(ty, &row, ys);
                        assert_eq!(got8[slot], dot_row(ty, &row, &xq), "{ty} x8 slot {slot}");
                        for (t, y) in ys.iter().enumerate() {
                            assert_eq!(got8[t], dot_row(ty, &row, y), "{ty} x8 slot {t}");
                        }
                    }
                }
            }
        }
    }
}
