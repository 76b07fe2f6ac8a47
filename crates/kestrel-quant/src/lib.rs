//! GGML block formats: layouts, dequantization, quantization and reference dot products.
//!
//! Every format is a sequence of fixed-size blocks, each holding `block_size()` values in
//! `type_size()` bytes. Rows of a weight matrix are whole numbers of blocks.
//!
//! The layouts and arithmetic are those of llama.cpp's ggml (ggml-common.h, ggml-quants.c):
//! dequantization gives the same f32 bits as ggml and the `gguf` Python package, and
//! quantization follows ggml's reference (`quantize_row_*_ref`) algorithms.
//!
//! The code here is plain scalar Rust. It is the oracle that faster (SIMD, integer) kernels
//! are tested against, so it favours clarity; it still avoids allocation and per-value
//! bounds checks so that it is usable in hot loops.

mod codebook;
mod error;
mod float;
mod kquants;
mod legacy;
mod types;
mod weighted;

pub use error::QuantError;
pub use float::{bf16, bf16_to_f32, f16, f16_to_f32, f32_to_bf16, f32_to_f16};
pub use kquants::scale_min_k4;
pub use types::GgmlType;
pub use weighted::{quantize_rows_weighted, uses_importance};

use GgmlType as T;

/// Whether [`dequantize_row`] (and [`vec_dot`]) handle this type.
pub fn can_dequantize(ty: GgmlType) -> bool {
    matches!(
        ty,
        T::F32
            | T::F16
            | T::BF16
            | T::Q4_0
            | T::Q4_1
            | T::Q5_0
            | T::Q5_1
            | T::Q8_0
            | T::Q8_1
            | T::Q2K
            | T::Q3K
            | T::Q4K
            | T::Q5K
            | T::Q6K
            | T::Q8K
            | T::IQ4NL
            | T::IQ4XS
            | T::MXFP4
    )
}

/// Whether [`quantize_row`] and [`quantize`] can produce this type.
pub fn can_quantize(ty: GgmlType) -> bool {
    can_dequantize(ty)
}

/// Bytes that `n` values of `ty` take, or an error if `n` is not a whole number of blocks.
pub fn row_bytes(ty: GgmlType, n: usize) -> Result<usize, QuantError> {
    let block_size = ty.block_size();
    if !n.is_multiple_of(block_size) {
        return Err(QuantError::NotWholeBlocks { ty, n, block_size });
    }
    Ok(n / block_size * ty.type_size())
}

fn check_bytes(ty: GgmlType, n: usize, actual: usize) -> Result<(), QuantError> {
    let expected = row_bytes(ty, n)?;
    if expected != actual {
        return Err(QuantError::ByteLength {
            ty,
            n,
            expected,
            actual,
        });
    }
    Ok(())
}

/// Runs `f` on each (block bytes, block values) pair. The `if let` never fails (the chunks
/// have exactly the array sizes); it only turns slices into arrays without a panic path.
#[inline(always)]
fn each_block_mut<const B: usize, const N: usize>(
    src: &[u8],
    dst: &mut [f32],
    f: impl Fn(&[u8; B], &mut [f32; N]),
) {
    for (b, out) in src.chunks_exact(B).zip(dst.chunks_exact_mut(N)) {
        if let (Ok(b), Ok(out)) = (b.try_into(), out.try_into()) {
            f(b, out);
        }
    }
}

/// Dequantizes `dst.len()` values of type `ty` from `src` into `dst`.
///
/// `dst.len()` must be a whole number of blocks and `src.len()` exactly the bytes those
/// blocks take; otherwise (or for a type without a dequantizer) an error is returned.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    if !can_dequantize(ty) {
        return Err(QuantError::DequantizeUnsupported(ty));
    }
    check_bytes(ty, dst.len(), src.len())?;
    match ty {
        T::F32 => {
            for (o, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        T::F16 => float::f16_bytes_to_f32(src, dst),
        T::BF16 => {
            for (o, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        T::Q4_0 => each_block_mut(src, dst, legacy::dequant_q4_0),
        T::Q4_1 => each_block_mut(src, dst, legacy::dequant_q4_1),
        T::Q5_0 => each_block_mut(src, dst, legacy::dequant_q5_0),
        T::Q5_1 => each_block_mut(src, dst, legacy::dequant_q5_1),
        T::Q8_0 => each_block_mut(src, dst, legacy::dequant_q8_0),
        T::Q8_1 => each_block_mut(src, dst, legacy::dequant_q8_1),
        T::Q2K => each_block_mut(src, dst, kquants::dequant_q2_k),
        T::Q3K => each_block_mut(src, dst, kquants::dequant_q3_k),
        T::Q4K => each_block_mut(src, dst, kquants::dequant_q4_k),
        T::Q5K => each_block_mut(src, dst, kquants::dequant_q5_k),
        T::Q6K => each_block_mut(src, dst, kquants::dequant_q6_k),
        T::Q8K => each_block_mut(src, dst, kquants::dequant_q8_k),
        T::IQ4NL => each_block_mut(src, dst, codebook::dequant_iq4_nl),
        T::IQ4XS => each_block_mut(src, dst, codebook::dequant_iq4_xs),
        T::MXFP4 => each_block_mut(src, dst, codebook::dequant_mxfp4),
        T::I8 | T::I16 | T::I32 | T::I64 | T::F64 => {
            return Err(QuantError::DequantizeUnsupported(ty));
        }
    }
    Ok(())
}

/// Dequantizes a whole buffer of `ty` blocks into a new vector.
pub fn dequantize(ty: GgmlType, src: &[u8]) -> Result<Vec<f32>, QuantError> {
    let type_size = ty.type_size();
    if !src.len().is_multiple_of(type_size) {
        return Err(QuantError::NotWholeBlockBytes {
            ty,
            len: src.len(),
            type_size,
        });
    }
    let mut dst = vec![0.0f32; src.len() / type_size * ty.block_size()];
    dequantize_row(ty, src, &mut dst)?;
    Ok(dst)
}

#[inline(always)]
fn each_block_quant<const N: usize, const B: usize>(
    src: &[f32],
    dst: &mut [u8],
    f: impl Fn(&[f32; N], &mut [u8; B]),
) {
    for (x, b) in src.chunks_exact(N).zip(dst.chunks_exact_mut(B)) {
        if let (Ok(x), Ok(b)) = (x.try_into(), b.try_into()) {
            f(x, b);
        }
    }
}

/// Quantizes `src` (a whole number of blocks) into `dst` (exactly the bytes they take).
///
/// Blocks never span rows, so one call may cover many rows.
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    if !can_quantize(ty) {
        return Err(QuantError::QuantizeUnsupported(ty));
    }
    check_bytes(ty, src.len(), dst.len())?;
    match ty {
        T::F32 => {
            for (b, &v) in dst.chunks_exact_mut(4).zip(src) {
                b.copy_from_slice(&v.to_le_bytes());
            }
        }
        T::F16 => {
            for (b, &v) in dst.chunks_exact_mut(2).zip(src) {
                b.copy_from_slice(&f32_to_f16(v).to_le_bytes());
            }
        }
        T::BF16 => {
            for (b, &v) in dst.chunks_exact_mut(2).zip(src) {
                b.copy_from_slice(&f32_to_bf16(v).to_le_bytes());
            }
        }
        T::Q4_0 => each_block_quant(src, dst, legacy::quant_q4_0),
        T::Q4_1 => each_block_quant(src, dst, legacy::quant_q4_1),
        T::Q5_0 => each_block_quant(src, dst, legacy::quant_q5_0),
        T::Q5_1 => each_block_quant(src, dst, legacy::quant_q5_1),
        T::Q8_0 => each_block_quant(src, dst, legacy::quant_q8_0),
        T::Q8_1 => each_block_quant(src, dst, legacy::quant_q8_1),
        T::Q2K => each_block_quant(src, dst, kquants::quant_q2_k),
        T::Q3K => each_block_quant(src, dst, kquants::quant_q3_k),
        T::Q4K => each_block_quant(src, dst, kquants::quant_q4_k),
        T::Q5K => each_block_quant(src, dst, kquants::quant_q5_k),
        T::Q6K => each_block_quant(src, dst, kquants::quant_q6_k),
        T::Q8K => each_block_quant(src, dst, kquants::quant_q8_k),
        T::IQ4NL => each_block_quant(src, dst, codebook::quant_iq4_nl),
        T::IQ4XS => each_block_quant(src, dst, codebook::quant_iq4_xs),
        T::MXFP4 => each_block_quant(src, dst, codebook::quant_mxfp4),
        T::I8 | T::I16 | T::I32 | T::I64 | T::F64 => {
            return Err(QuantError::QuantizeUnsupported(ty));
        }
    }
    Ok(())
}

/// Quantizes a matrix of rows of `row_len` values (stored one after another) into a new
/// buffer. `row_len` must be a whole number of blocks and `src.len()` a whole number of rows.
pub fn quantize(ty: GgmlType, src: &[f32], row_len: usize) -> Result<Vec<u8>, QuantError> {
    if !can_quantize(ty) {
        return Err(QuantError::QuantizeUnsupported(ty));
    }
    if row_len == 0 || !src.len().is_multiple_of(row_len) {
        return Err(QuantError::BadRowLength {
            n: src.len(),
            row_len,
        });
    }
    let row_size = row_bytes(ty, row_len)?;
    let mut dst = vec![0u8; src.len() / row_len * row_size];
    quantize_row(ty, src, &mut dst)?;
    Ok(dst)
}

/// Dot product of two equal-length f32 slices with 8 independent partial sums, so that
/// the compiler can keep them in one vector register (f32 addition is not associative, so
/// a single running sum could not be vectorized).
#[inline(always)]
fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    for (i, (x, y)) in ra.iter().zip(rb).enumerate() {
        acc[i] += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// Values dequantized at a time by [`vec_dot`]: one K-quant block or eight 32-value blocks.
const DOT_CHUNK: usize = 256;

/// Dequantizes up to [`DOT_CHUNK`] values at a time into a stack buffer and accumulates
/// each chunk's dot with `x` (grouping small blocks amortizes the final reduction).
#[inline(always)]
fn dot_blocks<const B: usize, const N: usize>(
    row: &[u8],
    x: &[f32],
    f: impl Fn(&[u8; B], &mut [f32; N]),
) -> f32 {
    let mut buf = [0.0f32; DOT_CHUNK];
    let mut total = 0.0f32;
    let blocks_per_chunk = DOT_CHUNK / N;
    for (bytes, xs) in row.chunks(B * blocks_per_chunk).zip(x.chunks(DOT_CHUNK)) {
        each_block_mut(bytes, &mut buf, &f);
        total += dot_f32(&buf[..xs.len()], xs);
    }
    total
}

/// Same for the one-value-per-element float formats: `convert` turns `SIZE` bytes per
/// value into f32s.
#[inline(always)]
fn dot_elements<const SIZE: usize>(
    row: &[u8],
    x: &[f32],
    convert: impl Fn(&[u8], &mut [f32]),
) -> f32 {
    let mut buf = [0.0f32; DOT_CHUNK];
    let mut total = 0.0f32;
    for (bytes, xs) in row.chunks(SIZE * DOT_CHUNK).zip(x.chunks(DOT_CHUNK)) {
        let values = &mut buf[..xs.len()];
        convert(bytes, values);
        total += dot_f32(values, xs);
    }
    total
}

/// Dot product of one row of `ty` (as stored) with f32 activations, or an error if the
/// lengths disagree or `ty` has no dequantizer.
pub fn try_vec_dot(ty: GgmlType, row: &[u8], x: &[f32]) -> Result<f32, QuantError> {
    if !can_dequantize(ty) {
        return Err(QuantError::DequantizeUnsupported(ty));
    }
    if row_bytes(ty, x.len()).ok() != Some(row.len()) {
        let row_values = row.len() / ty.type_size() * ty.block_size();
        return Err(QuantError::DotLength {
            ty,
            row_values,
            x_len: x.len(),
        });
    }
    Ok(match ty {
        T::F32 => dot_elements::<4>(row, x, |bytes, out| {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }),
        T::F16 => dot_elements::<2>(row, x, float::f16_bytes_to_f32),
        T::BF16 => dot_elements::<2>(row, x, |bytes, out| {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }),
        T::Q4_0 => dot_blocks(row, x, legacy::dequant_q4_0),
        T::Q4_1 => dot_blocks(row, x, legacy::dequant_q4_1),
        T::Q5_0 => dot_blocks(row, x, legacy::dequant_q5_0),
        T::Q5_1 => dot_blocks(row, x, legacy::dequant_q5_1),
        T::Q8_0 => dot_blocks(row, x, legacy::dequant_q8_0),
        T::Q8_1 => dot_blocks(row, x, legacy::dequant_q8_1),
        T::Q2K => dot_blocks(row, x, kquants::dequant_q2_k),
        T::Q3K => dot_blocks(row, x, kquants::dequant_q3_k),
        T::Q4K => dot_blocks(row, x, kquants::dequant_q4_k),
        T::Q5K => dot_blocks(row, x, kquants::dequant_q5_k),
        T::Q6K => dot_blocks(row, x, kquants::dequant_q6_k),
        T::Q8K => dot_blocks(row, x, kquants::dequant_q8_k),
        T::IQ4NL => dot_blocks(row, x, codebook::dequant_iq4_nl),
        T::IQ4XS => dot_blocks(row, x, codebook::dequant_iq4_xs),
        T::MXFP4 => dot_blocks(row, x, codebook::dequant_mxfp4),
        T::I8 | T::I16 | T::I32 | T::I64 | T::F64 => {
            return Err(QuantError::DequantizeUnsupported(ty));
        }
    })
}

/// Dot product of one quantized row with f32 activations: the scalar reference.
///
/// `x.len()` must be the number of values in `row` (`row.len()` is then exactly
/// `row_bytes(ty, x.len())`). Callers in hot loops check shapes once up front; for a
/// mismatch or an unsupported type this returns NaN rather than panicking (use
/// [`try_vec_dot`] to get the reason).
#[inline]
pub fn vec_dot(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    try_vec_dot(ty, row, x).unwrap_or(f32::NAN)
}
