//! Q4_K, Q6_K, Q8_0, Q5_0 and Q4_0 weights repacked 16 rows at a time, and the integer
//! kernels that read them.
//!
//! The row-by-row kernels of `qdot8` put 64 values of one row in a 512-bit register, so
//! every (row, token) pair ends in a horizontal reduction, and the sub-block scales take
//! extra integer work per token. Here each 32-bit lane is one row: a 64-byte load holds 4
//! quant bytes (8 values: low and high nibbles) of 16 rows, and one `vpdpbusd` against 4
//! activation bytes broadcast to every lane performs 16 rows × 4 multiply-adds. The sums
//! of a 32-value sub-block are scaled in f32 (one convert and one FMA for 16 rows), and
//! nothing is reduced across lanes: a token's 16 results are one vector. The row scales
//! and minimums are unpacked at load so that a whole group shares their conversion. (The
//! 32-value formats' layout is described at `pack_q32_group`.)
//!
//! Layout of one Q4_K group block (16 rows × one 256-value block), [`group_block`] bytes:
//! - d (f16) of the 16 rows, then dmin (f16) of the 16 rows: 64 bytes;
//! - the 6-bit scales as bytes, `[sub-block j][row]`: 128 bytes; the minimums likewise;
//! - the quants: for each 4-byte column c of the 128 quant bytes, the 16 rows' 4 bytes
//!   (row-major within the column): 32 × 64 bytes.
//!
//! A Q6_K group block keeps the format's 210 bytes per row: d (f16) of the 16 rows (32
//! bytes), the 16 signed scales `[sub-block][row]` (256), then 16 steps of 192 bytes in
//! the order the kernel reads them (streaming one block front to back: with the low-bit
//! and high-bit bytes in two regions the hardware prefetchers fell behind, 8.6 against
//! 22 GB/s on one core). Step (h, half, c) holds three 4-byte columns of the 16 rows:
//! quant bytes 64h + l .. + 4 and 64h + 32 + l .. + 4, then high-bit bytes 32h + l .. + 4,
//! where l = 16 half + 4c.
//!
//! Groups follow each other; a group holds all blocks of its 16 rows.

use kestrel_gguf::GgmlType;

/// Rows per group.
pub const ROWS: usize = 16;

/// Bytes of one Q4_K group block (see the module documentation).
const Q4K_GROUP_BLOCK: usize = 64 + 2 * 128 + 2048;
/// Bytes of one Q6_K group block.
const Q6K_GROUP_BLOCK: usize = ROWS * Q6K_BLOCK;

const Q4K_BLOCK: usize = 144;
const Q6K_BLOCK: usize = 210;

/// Bytes of one group block (16 rows × one block of the format) of a repacked `ty`
/// matrix: the format's bytes for 16 rows.
fn group_block(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q6K => Q6K_GROUP_BLOCK,
        GgmlType::Q4K => Q4K_GROUP_BLOCK,
        _ => ROWS * ty.type_size(),
    }
}

/// Bytes of one group (16 rows of `k` values) of a repacked `ty` matrix.
pub fn group_bytes(ty: GgmlType, k: usize) -> usize {
    k / ty.block_size() * group_block(ty)
}

/// Whether matrices of `ty` (`rows` rows of `k` values) are repacked for this CPU.
pub fn applies(ty: GgmlType, rows: usize, k: usize) -> bool {
    // `qdot8::supported`: the five formats, on a CPU with AVX-512 VNNI.
    crate::qdot8::supported(ty)
        && rows >= ROWS
        && k.is_multiple_of(ty.block_size())
        && std::env::var("KESTREL_CPU_PACKED").map_or(true, |v| v != "0")
}

/// Repacks the whole groups of 16 rows of a matrix (`rows` rows of `k` values); the last `rows % 16` rows are left out (the caller keeps the original layout
/// for them). Only for matrices where [`applies`] holds.
pub fn pack(ty: GgmlType, data: &[u8], rows: usize, k: usize) -> Vec<u8> {
    let mut out = vec![0u8; packed_len(ty, rows, k)];
    pack_into(ty, data, rows, k, &mut out);
    out
}

/// Bytes of [`pack`]'s output.
pub fn packed_len(ty: GgmlType, rows: usize, k: usize) -> usize {
    rows / ROWS * group_bytes(ty, k)
}

/// [`pack`] into `out` ([`packed_len`] bytes), on the backend's thread pool.
pub fn pack_into(ty: GgmlType, data: &[u8], rows: usize, k: usize, out: &mut [u8]) {
    let blocks = k / ty.block_size();
    let group_bytes = group_bytes(ty, k);
    assert!(
        out.len() >= rows / ROWS * group_bytes,
        "packed output too small"
    );
    let dst = crate::pool::SharedMut(out.as_mut_ptr());
    crate::pool::pool().run(rows / ROWS, &|g| {
        // SAFETY: group g's bytes of `out` (which holds rows / 16 groups) are written by
        // this task alone.
        let dst = unsafe { std::slice::from_raw_parts_mut(dst.at(g * group_bytes), group_bytes) };
        match ty {
            GgmlType::Q6K => pack_q6k_group(data, g, blocks, dst),
            GgmlType::Q4K => pack_q4k_group(data, g, blocks, dst),
            _ => pack_q32_group(ty, data, g, blocks, dst),
        }
    });
}

/// Group `g` (rows 16g .. 16g + 16) of a Q6_K matrix of `blocks` blocks per row.
fn pack_q6k_group(data: &[u8], g: usize, blocks: usize, dst_group: &mut [u8]) {
    for (b, dst) in dst_group.chunks_exact_mut(Q6K_GROUP_BLOCK).enumerate() {
        for r in 0..ROWS {
            let row = g * ROWS + r;
            // ggml's Q6_K block: ql[128], qh[64], scales[16] (i8), d (f16).
            let src = &data[(row * blocks + b) * Q6K_BLOCK..][..Q6K_BLOCK];
            dst[2 * r..2 * r + 2].copy_from_slice(&src[208..210]);
            for s in 0..16 {
                dst[32 + ROWS * s + r] = src[192 + s];
            }
            for step in 0..16 {
                let (h, l) = (step / 8, 4 * (step % 8));
                let at = 288 + 192 * step + 4 * r;
                let columns = [64 * h + l, 64 * h + 32 + l, 128 + 32 * h + l];
                for (i, col) in columns.into_iter().enumerate() {
                    dst[at + 64 * i..at + 64 * i + 4].copy_from_slice(&src[col..col + 4]);
                }
            }
        }
    }
}

/// Group `g` of a Q8_0, Q5_0 or Q4_0 matrix (32-value blocks: d, then for Q5_0 the 32
/// fifth bits, then the quants). Group block layout: d (f16) of the 16 rows; for Q5_0 the
/// fifth bits of each row rearranged so that byte b holds, in bit j, the fifth bit of value
/// 4j + b (the kernel then moves a column's four bits into place with one shift); then the
/// quants in 4-byte columns of the 16 rows (Q8_0: 8 columns, values 4c..; Q5_0 / Q4_0: 4
/// columns, low nibbles values 4c.., high nibbles 16 + 4c..).
fn pack_q32_group(ty: GgmlType, data: &[u8], g: usize, blocks: usize, dst_group: &mut [u8]) {
    let bytes = ty.type_size();
    let (qs, columns) = match ty {
        GgmlType::Q8_0 => (2, 8),
        GgmlType::Q5_0 => (6, 4),
        _ => (2, 4),
    };
    // Where the quant columns start in a group block.
    let at_qs = if ty == GgmlType::Q5_0 { 96 } else { 32 };
    for (b, dst) in dst_group.chunks_exact_mut(ROWS * bytes).enumerate() {
        for r in 0..ROWS {
            let src = &data[((g * ROWS + r) * blocks + b) * bytes..][..bytes];
            dst[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
            if ty == GgmlType::Q5_0 {
                let qh = u32::from_le_bytes([src[2], src[3], src[4], src[5]]);
                let mut spread = 0u32;
                for v in 0..32 {
                    let (j, byte) = (v / 4, v % 4);
                    spread |= ((qh >> v) & 1) << (8 * byte + j);
                }
                dst[32 + 4 * r..32 + 4 * r + 4].copy_from_slice(&spread.to_le_bytes());
            }
            for c in 0..columns {
                let at = at_qs + 64 * c + 4 * r;
                dst[at..at + 4].copy_from_slice(&src[qs + 4 * c..qs + 4 * c + 4]);
            }
        }
    }
}

/// Group `g` of a Q4_K matrix of `blocks` blocks per row.
fn pack_q4k_group(data: &[u8], g: usize, blocks: usize, dst_group: &mut [u8]) {
    for (b, dst) in dst_group.chunks_exact_mut(Q4K_GROUP_BLOCK).enumerate() {
        for r in 0..ROWS {
            let row = g * ROWS + r;
            let src = &data[(row * blocks + b) * Q4K_BLOCK..][..Q4K_BLOCK];
            dst[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
            dst[32 + 2 * r..32 + 2 * r + 2].copy_from_slice(&src[2..4]);
            for j in 0..8 {
                let (sc, m) = kestrel_quant::scale_min_k4(j, &src[4..16]);
                dst[64 + ROWS * j + r] = sc;
                dst[192 + ROWS * j + r] = m;
            }
            for c in 0..32 {
                let at = 320 + 64 * c + 4 * r;
                dst[at..at + 4].copy_from_slice(&src[16 + 4 * c..16 + 4 * c + 4]);
            }
        }
    }
}

/// The 16 rows of `group` (one group of [`pack`]'s output for `ty`: a group block per
/// block of the rows) times the activations of `N` tokens (`ys[t]`, as `qdot8` lays them
/// out for `ty`: Q8_K blocks, or Q8_0 pairs): `out[t][r] = row_r · x_t`. Each token's
/// results are the same whatever `N` is, and are the row-by-row kernels' products up to
/// the order of the float additions. Only call where [`applies`] is true.
#[inline]
pub fn dot_rows<const N: usize>(ty: GgmlType, group: &[u8], ys: [&[u8]; N]) -> [[f32; ROWS]; N] {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `applies` checked AVX-512F/BW and VNNI (through `qdot8::supported`);
        // the kernels bound their reads by the slices.
        unsafe {
            match ty {
                GgmlType::Q6K => vnni::q6k_rows(group, ys),
                GgmlType::Q4K => vnni::q4k_rows(group, ys),
                GgmlType::Q8_0 => vnni::q32_rows::<{ vnni::Q8_0 }, N>(group, ys),
                GgmlType::Q5_0 => vnni::q32_rows::<{ vnni::Q5_0 }, N>(group, ys),
                _ => vnni::q32_rows::<{ vnni::Q4_0 }, N>(group, ys),
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ty, group, ys);
        [[f32::NAN; ROWS]; N]
    }
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    use std::arch::x86_64::*;

    use super::{Q4K_GROUP_BLOCK as GROUP_BLOCK, Q6K_GROUP_BLOCK, ROWS};
    use crate::qdot8::Q8K_BLOCK;

    /// Offset in a Q8_K block (as `qdot8` interleaves it: runs of 32 values in the order
    /// 0, 2, 1, 3 within each 128) of value `v`.
    #[inline(always)]
    const fn y_offset(v: usize) -> usize {
        4 + 128 * (v / 128) + 32 * stored_run((v % 128) / 32) + v % 32
    }

    /// Where run `run` (< 4) of a group of 128 values is stored: 0, 2, 1, 3 (arithmetic,
    /// not a table: LLVM rebuilt a table on the stack at every use).
    #[inline(always)]
    const fn stored_run(run: usize) -> usize {
        ((run & 1) << 1) | (run >> 1)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn q4k_rows<const N: usize>(group: &[u8], ys: [&[u8]; N]) -> [[f32; ROWS]; N] {
        let n_blocks = ys
            .iter()
            .map(|y| y.len() / Q8K_BLOCK)
            .fold(group.len() / GROUP_BLOCK, usize::min);
        let yp = ys.map(|y| y.as_ptr());
        let m4 = _mm512_set1_epi8(0x0f);
        let mut acc = [_mm512_setzero_ps(); N];
        for blk in 0..n_blocks {
            let gb = &group[GROUP_BLOCK * blk..GROUP_BLOCK * (blk + 1)];
            let yo = Q8K_BLOCK * blk;
            // SAFETY: every load below reads inside this group block (GROUP_BLOCK bytes)
            // or inside block `blk` of each token's activations (Q8K_BLOCK bytes: d at 0,
            // quants at 4..260, sums of 16 at 260..292); n_blocks bounds both.
            unsafe {
                let p = gb.as_ptr();
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()));
                let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(32).cast()));
                // Per-row scales and minimums of the 8 sub-blocks as f32 vectors.
                let row_f32 = |at: usize| {
                    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(at).cast())))
                };
                let sc: [__m512; 8] = std::array::from_fn(|j| row_f32(64 + ROWS * j));
                let mut sums = [_mm512_setzero_ps(); N];
                for j in 0..4 {
                    let mut lo = [_mm512_setzero_si512(); N];
                    let mut hi = [_mm512_setzero_si512(); N];
                    for c in 0..8 {
                        let at = p.add(320 + 64 * (8 * j + c));
                        if N == 1 {
                            // As in q6k_half.
                            _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(2 * GROUP_BLOCK).cast());
                        }
                        let w = _mm512_loadu_si512(at.cast());
                        let wl = _mm512_and_si512(w, m4);
                        let wh = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
                        // Low nibbles are values 64j + 4c .. + 4 (sub-block 2j), high
                        // nibbles the same + 32 (sub-block 2j + 1).
                        let (ol, oh) = (y_offset(64 * j + 4 * c), y_offset(64 * j + 32 + 4 * c));
                        for t in 0..N {
                            let y = yp[t].add(yo);
                            let yl = _mm512_set1_epi32(std::ptr::read_unaligned(y.add(ol).cast()));
                            let yh = _mm512_set1_epi32(std::ptr::read_unaligned(y.add(oh).cast()));
                            lo[t] = _mm512_dpbusd_epi32(lo[t], wl, yl);
                            hi[t] = _mm512_dpbusd_epi32(hi[t], wh, yh);
                        }
                    }
                    for t in 0..N {
                        sums[t] = _mm512_fmadd_ps(sc[2 * j], _mm512_cvtepi32_ps(lo[t]), sums[t]);
                        sums[t] =
                            _mm512_fmadd_ps(sc[2 * j + 1], _mm512_cvtepi32_ps(hi[t]), sums[t]);
                    }
                }
                let mins: [__m512; 8] = std::array::from_fn(|j| row_f32(192 + ROWS * j));
                for t in 0..N {
                    let y = yp[t].add(yo);
                    // Σ_j min_j · (sum of the 32 y of sub-block j): exact in f32 (each
                    // product < 2^18, the total < 2^21).
                    let bsums = _mm256_loadu_si256(y.add(260).cast());
                    let pair_sums = _mm256_madd_epi16(bsums, _mm256_set1_epi16(1));
                    let mut ysum = [0i32; 8];
                    _mm256_storeu_si256(ysum.as_mut_ptr().cast(), pair_sums);
                    let mut m = _mm512_setzero_ps();
                    for j in 0..8 {
                        m = _mm512_fmadd_ps(mins[j], _mm512_set1_ps(ysum[j] as f32), m);
                    }
                    let dy = _mm512_set1_ps(std::ptr::read_unaligned(y.cast::<f32>()));
                    let block = _mm512_fmsub_ps(d, sums[t], _mm512_mul_ps(dmin, m));
                    acc[t] = _mm512_fmadd_ps(dy, block, acc[t]);
                }
            }
        }
        store_rows(acc)
    }

    /// Formats of [`q32_rows`] (its const parameter).
    pub const Q8_0: u8 = 0;
    pub const Q5_0: u8 = 1;
    pub const Q4_0: u8 = 2;

    /// Q8_0 / Q5_0 / Q4_0 group blocks (see `pack_q32_group`) · Q8_0 activations laid out
    /// as `qdot8::Q8_0X_PAIR` pairs (unsigned bytes u = y + 128). The block's 32 weights
    /// of the 16 rows are decoded once to signed bytes w (8 vectors of 4 per row); each
    /// token's sum starts from −128 · Σ w (one set of `vpdpbusd` per block, shared by the
    /// tokens) and takes 8 `vpdpbusd` of 4 broadcast bytes of u against w: Σ y · w exactly,
    /// then scaled by d_w · d_y in f32.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn q32_rows<const KIND: u8, const N: usize>(
        group: &[u8],
        ys: [&[u8]; N],
    ) -> [[f32; ROWS]; N] {
        const YP: usize = crate::qdot8::Q8_0X_PAIR;
        let gb_bytes = ROWS
            * match KIND {
                Q8_0 => 34,
                Q5_0 => 22,
                _ => 18,
            };
        let n_blocks = ys
            .iter()
            .map(|y| y.len() / YP * 2)
            .fold(group.len() / gb_bytes, usize::min);
        let mut acc = [_mm512_setzero_ps(); N];
        let m4 = _mm512_set1_epi8(0x0f);
        let m10 = _mm512_set1_epi8(0x10);
        let offset = _mm512_set1_epi8(-128);
        for blk in 0..n_blocks {
            let gb = &group[gb_bytes * blk..gb_bytes * (blk + 1)];
            // SAFETY: the loads read inside this group block and inside each token's
            // activation pair blk / 2 (n_blocks bounds both).
            unsafe {
                let p = gb.as_ptr();
                if N == 1 {
                    // As in q6k_half: decode streams, so ask for two group blocks ahead.
                    for i in 0..gb_bytes.div_ceil(64) {
                        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(2 * gb_bytes + 64 * i).cast());
                    }
                }
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()));
                // w[i]: the signed weights of column i (Q8_0), or of the low (i < 4) and
                // high (i >= 4) nibbles of column i % 4.
                let w: [__m512i; 8] = std::array::from_fn(|i| {
                    let ld = |c: usize, at: usize| _mm512_loadu_si512(p.add(at + 64 * c).cast());
                    match KIND {
                        Q8_0 => ld(i, 32),
                        _ => {
                            let (c, high) = (i % 4, i >= 4);
                            let q = ld(c, if KIND == Q5_0 { 96 } else { 32 });
                            let nib = if high {
                                _mm512_and_si512(_mm512_srli_epi16(q, 4), m4)
                            } else {
                                _mm512_and_si512(q, m4)
                            };
                            if KIND == Q5_0 {
                                // Fifth bits: bit c (low) or 4 + c (high) of each byte,
                                // moved to bit 4.
                                let h = _mm512_loadu_si512(p.add(32).cast());
                                let h = if high {
                                    _mm512_srlv_epi32(h, _mm512_set1_epi32(c as i32))
                                } else {
                                    _mm512_sllv_epi32(h, _mm512_set1_epi32(4 - c as i32))
                                };
                                _mm512_sub_epi8(
                                    _mm512_ternarylogic_epi32(nib, h, m10, 0xf8),
                                    _mm512_set1_epi8(16),
                                )
                            } else {
                                _mm512_sub_epi8(nib, _mm512_set1_epi8(8))
                            }
                        }
                    }
                });
                let mut corr = _mm512_setzero_si512();
                for wi in &w {
                    corr = _mm512_dpbusd_epi32(corr, offset, *wi);
                }
                let start = _mm512_sub_epi32(_mm512_setzero_si512(), corr);
                for t in 0..N {
                    let y = ys[t].as_ptr().add(YP * (blk / 2));
                    let u = y.add(8 + 32 * (blk % 2));
                    let mut dp = start;
                    for (i, wi) in w.iter().enumerate() {
                        // Values 4i.. (Q8_0); low nibbles 4i.., high 16 + 4(i - 4)..
                        let off = if KIND == Q8_0 || i < 4 {
                            4 * i
                        } else {
                            16 + 4 * (i - 4)
                        };
                        let ub = _mm512_set1_epi32(std::ptr::read_unaligned(u.add(off).cast()));
                        dp = _mm512_dpbusd_epi32(dp, ub, *wi);
                    }
                    let dy = std::ptr::read_unaligned(y.add(4 * (blk % 2)).cast::<f32>());
                    let scale = _mm512_mul_ps(dw, _mm512_set1_ps(dy));
                    acc[t] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dp), acc[t]);
                }
            }
        }
        store_rows(acc)
    }

    fn store_rows<const N: usize>(acc: [__m512; N]) -> [[f32; ROWS]; N] {
        let mut out = [[0f32; ROWS]; N];
        for t in 0..N {
            // SAFETY: out[t] holds 16 floats; AVX-512F is enabled by every caller.
            unsafe { _mm512_storeu_ps(out[t].as_mut_ptr(), acc[t]) };
        }
        out
    }

    /// Q6_K: value 128h + 32f + l (h < 2, f < 4, l < 32) is the low (f < 2) or high
    /// nibble of quant byte 64h + 32 (f % 2) + l, with bits 2f, 2f + 1 of high-bit byte
    /// 32h + l above them, minus 32. Each 16-value sub-block's sums take the unsigned 6-bit
    /// values (`vpdpbusd`); the 32 · Σ scale · (sum of 16 y) comes off once per block, in
    /// f32 (exact: each product < 2^18, the total < 2^22).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn q6k_rows<const N: usize>(group: &[u8], ys: [&[u8]; N]) -> [[f32; ROWS]; N] {
        let n_blocks = ys
            .iter()
            .map(|y| y.len() / Q8K_BLOCK)
            .fold(group.len() / Q6K_GROUP_BLOCK, usize::min);
        let mut acc = [_mm512_setzero_ps(); N];
        for blk in 0..n_blocks {
            let gb = &group[Q6K_GROUP_BLOCK * blk..Q6K_GROUP_BLOCK * (blk + 1)];
            // SAFETY: every load below reads inside this group block or inside block
            // `blk` of each token's activations; n_blocks bounds both.
            unsafe {
                let p = gb.as_ptr();
                let y: [*const u8; N] =
                    std::array::from_fn(|t| ys[t].as_ptr().add(Q8K_BLOCK * blk));
                let mut sums = [_mm512_setzero_ps(); N];
                for h in 0..2 {
                    q6k_half::<0, N>(p, &y, h, &mut sums);
                    q6k_half::<1, N>(p, &y, h, &mut sums);
                }
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()));
                for t in 0..N {
                    let bsums = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm256_loadu_si256(
                        y[t].add(260).cast(),
                    )));
                    let mut ysum = [0f32; 16];
                    _mm512_storeu_ps(ysum.as_mut_ptr(), bsums);
                    let mut corr = _mm512_setzero_ps();
                    for (s, &ys) in ysum.iter().enumerate() {
                        corr = _mm512_fmadd_ps(q6k_scale(p, s), _mm512_set1_ps(ys), corr);
                    }
                    let block =
                        _mm512_mul_ps(d, _mm512_fnmadd_ps(_mm512_set1_ps(32.0), corr, sums[t]));
                    let dy = _mm512_set1_ps(std::ptr::read_unaligned(y[t].cast::<f32>()));
                    acc[t] = _mm512_fmadd_ps(dy, block, acc[t]);
                }
            }
        }
        store_rows(acc)
    }

    /// The 16 rows' scales of Q6_K sub-block `s` as f32.
    ///
    /// # Safety
    /// `p` must point to a Q6_K group block.
    #[inline(always)]
    unsafe fn q6k_scale(p: *const u8, s: usize) -> __m512 {
        // SAFETY: the scales lie at 32..288 of the group block.
        unsafe {
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                p.add(32 + ROWS * s).cast(),
            )))
        }
    }

    /// `sums[t] += Σ` over the four sub-blocks 8h + 2f + HALF (f < 4: values 128h + 32f +
    /// 16 HALF .. + 16) of their scale · (6-bit values · token t's activations), for the 16
    /// rows of group block `p`: the four steps (h, HALF, c), each three loads decoded into
    /// the four sub-blocks' 4 values.
    ///
    /// # Safety
    /// `p` must point to a Q6_K group block and each `y[t]` to a Q8_K block.
    #[inline(always)]
    unsafe fn q6k_half<const HALF: usize, const N: usize>(
        p: *const u8,
        y: &[*const u8; N],
        h: usize,
        sums: &mut [__m512; N],
    ) {
        // SAFETY: the loads read inside the group block (steps at 288..3360) and inside
        // each token's Q8_K block (quants at 4..260).
        unsafe {
            let m4 = _mm512_set1_epi8(0x0f);
            let m30 = _mm512_set1_epi8(0x30);
            let mut dp = [[_mm512_setzero_si512(); N]; 4];
            for c in 0..4 {
                let l = 16 * HALF + 4 * c;
                let at = p.add(288 + 192 * (8 * h + 4 * HALF + c));
                if N == 1 {
                    // Decode streams from memory: ask for two group blocks ahead (maybe
                    // past the group: a prefetch never faults). Prefill, compute-bound,
                    // measured slower with it.
                    let ahead = at.wrapping_add(2 * Q6K_GROUP_BLOCK);
                    for i in 0..3 {
                        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * i).cast());
                    }
                }
                let qa = _mm512_loadu_si512(at.cast());
                let qb = _mm512_loadu_si512(at.add(64).cast());
                let qh = _mm512_loadu_si512(at.add(128).cast());
                // (nibble & 0x0f) | (high bits moved to 4, 5 & 0x30), for f = 0..3.
                let w = [
                    _mm512_ternarylogic_epi32(
                        _mm512_and_si512(qa, m4),
                        _mm512_slli_epi16(qh, 4),
                        m30,
                        0xf8,
                    ),
                    _mm512_ternarylogic_epi32(
                        _mm512_and_si512(qb, m4),
                        _mm512_slli_epi16(qh, 2),
                        m30,
                        0xf8,
                    ),
                    _mm512_ternarylogic_epi32(
                        _mm512_and_si512(_mm512_srli_epi16(qa, 4), m4),
                        qh,
                        m30,
                        0xf8,
                    ),
                    _mm512_ternarylogic_epi32(
                        _mm512_and_si512(_mm512_srli_epi16(qb, 4), m4),
                        _mm512_srli_epi16(qh, 2),
                        m30,
                        0xf8,
                    ),
                ];
                for (f, &wf) in w.iter().enumerate() {
                    // Run f of 32 values in an interleaved Q8_K block (see `y_offset`).
                    let off = 4 + 128 * h + 32 * stored_run(f) + l;
                    for t in 0..N {
                        let yv = std::ptr::read_unaligned(y[t].add(off).cast::<i32>());
                        dp[f][t] = _mm512_dpbusd_epi32(dp[f][t], wf, _mm512_set1_epi32(yv));
                    }
                }
            }
            for (f, dpf) in dp.iter().enumerate() {
                let sc = q6k_scale(p, 8 * h + 2 * f + HALF);
                for t in 0..N {
                    sums[t] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(dpf[t]), sums[t]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Against the scalar dot of each row with the dequantized activations (the values
    /// the integer kernels multiply), and every token alone against the same token among
    /// others (batch invariance).
    #[test]
    fn packed_kernels_match_the_oracle_and_are_batch_invariant() {
        if !crate::qdot8::supported(GgmlType::Q4K) {
            eprintln!("no AVX-512 VNNI here: packed kernels not tested");
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
        let types = [
            GgmlType::Q4K,
            GgmlType::Q6K,
            GgmlType::Q8_0,
            GgmlType::Q5_0,
            GgmlType::Q4_0,
        ];
        for (ty, blocks) in types
            .into_iter()
            .flat_map(|ty| [1usize, 2, 3, 7].map(|b| (ty, b)))
        {
            let k = ty.block_size() * blocks;
            let act = crate::numerics::activation_type(ty).expect("a quantized type");
            let rows = ROWS * rng.random_range(1..4) + rng.random_range(0..ROWS);
            let w: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-2.0..2.0)).collect();
            let data = kestrel_quant::quantize(ty, &w, k).expect("quantize w");
            let packed = pack(ty, &data, rows, k);
            assert_eq!(packed.len(), rows / ROWS * blocks * group_block(ty));
            let xs: Vec<Vec<f32>> = (0..5)
                .map(|_| (0..k).map(|_| rng.random_range(-3.0..3.0)).collect())
                .collect();
            let xq: Vec<Vec<u8>> = xs
                .iter()
                .map(|x| {
                    let mut q = vec![0u8; crate::qdot8::activation_bytes(act, k)];
                    crate::qdot8::quantize_activations(act, x, &mut q);
                    q
                })
                .collect();
            let xd: Vec<Vec<f32>> = xs
                .iter()
                .map(|x| {
                    let (mut bytes, mut out) = (Vec::new(), Vec::new());
                    crate::numerics::round_trip(act, x, &mut bytes, &mut out);
                    out
                })
                .collect();
            let row_bytes = data.len() / rows;
            for (g, group) in packed.chunks_exact(blocks * group_block(ty)).enumerate() {
                let four = dot_rows(ty, group, [&xq[0][..], &xq[1], &xq[2], &xq[3]]);
                for t in 0..5 {
                    let one = dot_rows(ty, group, [&xq[t][..]])[0];
                    if t < 4 {
                        assert_eq!(one, four[t], "{ty} k={k} group {g} token {t}: N=1 vs N=4");
                    }
                    for (r, &got) in one.iter().enumerate() {
                        let row = &data[(g * ROWS + r) * row_bytes..][..row_bytes];
                        let want = kestrel_quant::vec_dot(ty, row, &xd[t]);
                        let wd = kestrel_quant::dequantize(ty, row).expect("deq");
                        let mag: f32 = wd.iter().zip(&xd[t]).map(|(a, b)| (a * b).abs()).sum();
                        assert!(
                            (got - want).abs() <= 1e-5 * mag + 1e-6,
                            "{ty} k={k} row {} token {t}: got {got}, want {want}",
                            g * ROWS + r
                        );
                    }
                }
            }
        }
    }
}
