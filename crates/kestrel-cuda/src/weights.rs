//! Weights on the device: matrices uploaded in their GGUF block layout (Q6_K padded, the
//! 32-value formats split into planes), the optional copies the products read instead
//! (dequantized f16 for cuBLAS, Q4_K repacked for `mmw_gated`), and vectors as f32.

use crate::*;

/// The kernels this module launches (kernels/mmw.cu).
pub(crate) const KERNELS: &[&str] = &["repack_q4k_mmw"];

/// A Q6_K block as the GPU stores it (`Q6K_GPU_BYTES` in kernels/quant.cu).
pub(crate) const Q6K_GPU_BLOCK_BYTES: usize = 224;

/// `data` (whole blocks of `from` bytes) with each block followed by zeros up to `to` bytes.
/// The tensors whose f16 copies a leader's copy holds behind its own rows, in order: K and V
/// behind Q, so one cuBLAS product computes all three (`CudaBackend::qkv`), and up behind
/// gate.
pub(crate) fn merged_followers(leader: &str) -> Vec<String> {
    if let Some(prefix) = leader.strip_suffix("attn_q.weight") {
        return vec![
            format!("{prefix}attn_k.weight"),
            format!("{prefix}attn_v.weight"),
        ];
    }
    // Up behind gate: one product for both (`CudaBackend::gate_up_of`).
    match leader.strip_suffix("ffn_gate.weight") {
        Some(prefix) => vec![format!("{prefix}ffn_up.weight")],
        None => Vec::new(),
    }
}

/// Rows of a GGUF matrix (the product of its dimensions after the first).
pub(crate) fn tensor_rows(t: &TensorInfo) -> usize {
    t.dims.iter().skip(1).product::<u64>() as usize
}

pub(crate) fn pad_blocks(data: &[u8], from: usize, to: usize) -> Vec<u8> {
    let mut out = vec![0u8; data.len() / from * to];
    for (src, dst) in data.chunks_exact(from).zip(out.chunks_exact_mut(to)) {
        dst[..from].copy_from_slice(src);
    }
    out
}

/// Rows of `row_bytes` bytes (blocks of `block` bytes) rearranged part by part: for each
/// (offset, length) in `parts`, that slice of every block of the row, in block order; rows
/// of `out_row` ≥ `row_bytes` bytes (zeros after). The layout the kernels read for Q8_0,
/// Q4_0 and Q5_0: the quants of the whole row first, so that they are 16-byte aligned.
pub(crate) fn split_planes(
    data: &[u8],
    row_bytes: usize,
    out_row: usize,
    block: usize,
    parts: &[(usize, usize)],
) -> Vec<u8> {
    let mut out = vec![0u8; data.len() / row_bytes * out_row];
    for (src, dst) in data
        .chunks_exact(row_bytes)
        .zip(out.chunks_exact_mut(out_row))
    {
        let mut at = 0;
        for &(offset, len) in parts {
            for blk in src.chunks_exact(block) {
                dst[at..at + len].copy_from_slice(&blk[offset..offset + len]);
                at += len;
            }
        }
    }
    out
}

/// A host array of RoPE frequency factors, its device copy and that copy's address.
pub(crate) type UploadedFactors = (Arc<[f32]>, CudaSlice<f32>, u64);

impl CudaWeight {
    /// Bytes this weight holds on the device.
    /// Row length of a matrix.
    pub(crate) fn cols(&self) -> Option<usize> {
        match self {
            CudaWeight::Matrix { cols, .. } => Some(*cols),
            CudaWeight::Vector { .. } => None,
        }
    }

    /// Whether prompt-sized products can read this matrix as f16 without dequantizing it.
    pub(crate) fn has_f16(&self) -> bool {
        matches!(self, CudaWeight::Matrix { f16: Some(_), .. })
            || matches!(
                self,
                CudaWeight::Matrix {
                    ty: GgmlType::F16,
                    ..
                }
            )
    }

    pub fn device_bytes(&self) -> usize {
        match self {
            CudaWeight::Matrix { buf, f16, .. } => {
                buf.len() + f16.as_ref().map_or(0, |c| c.len() * 2)
            }
            CudaWeight::Vector { buf, len, .. } => {
                debug_assert_eq!(buf.len(), *len);
                len * 4
            }
        }
    }
}

impl CudaBackend {
    /// A `rows × cols` matrix of type `ty` from its GGUF block bytes.
    pub fn upload_matrix(
        &self,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> anyhow::Result<CudaWeight> {
        if !SUPPORTED_TYPES.contains(&ty) {
            bail!("type {ty} is not supported by the CUDA backend yet");
        }
        let _ = self.weights_to_come.fetch_update(
            std::sync::atomic::Ordering::Relaxed,
            std::sync::atomic::Ordering::Relaxed,
            |b| Some(b.saturating_sub(data.len() as u64)),
        );
        let row_bytes = ty
            .bytes_for(cols as u64)
            .with_context(|| format!("rows of {cols} values are not whole {ty} blocks"))?
            as usize;
        if data.len() != row_bytes * rows {
            bail!("{} bytes, expected {}", data.len(), row_bytes * rows);
        }
        // Q6_K blocks are padded to 16-byte-aligned ones (Q6K_GPU_BYTES in kernels/quant.cu):
        // their 210 bytes otherwise allow only 2-byte loads, which bound the kernels reading
        // them on load instructions (ncu: L1/TEX 78% busy against DRAM 32%).
        // Q8_0 / Q4_0 / Q5_0 (and the codebook formats) rows keep all quants first, then (Q5_0) the fifth bits, then
        // the f16 scales, each row padded to a multiple of 16 bytes (nothing to pad when it
        // holds a multiple of 8 blocks, as in every real model): aligned loads for all.
        let converted;
        let (data, row_bytes) = match ty {
            GgmlType::Q6K => {
                converted = pad_blocks(data, ty.type_size(), Q6K_GPU_BLOCK_BYTES);
                (&converted[..], cols / 256 * Q6K_GPU_BLOCK_BYTES)
            }
            GgmlType::Q8_0
            | GgmlType::Q4_0
            | GgmlType::Q5_0
            | GgmlType::IQ4NL
            | GgmlType::MXFP4
            | GgmlType::IQ4XS => {
                // (offset, length) of each block's parts, in the order the row keeps them.
                // IQ4_NL and MXFP4 as Q4_0 (MXFP4's scale is one E8M0 byte); IQ4_XS keeps
                // its 128 quant bytes, then its 8 header bytes (d, scales_h, scales_l).
                let parts: &[(usize, usize)] = match ty {
                    GgmlType::Q8_0 => &[(2, 32), (0, 2)],
                    GgmlType::Q4_0 | GgmlType::IQ4NL => &[(2, 16), (0, 2)],
                    GgmlType::MXFP4 => &[(1, 16), (0, 1)],
                    GgmlType::IQ4XS => &[(8, 128), (0, 8)],
                    _ => &[(6, 16), (2, 4), (0, 2)],
                };
                let gpu_row_bytes = row_bytes.next_multiple_of(16);
                converted = split_planes(data, row_bytes, gpu_row_bytes, ty.type_size(), parts);
                (&converted[..], gpu_row_bytes)
            }
            _ => (data, row_bytes),
        };
        let buf = self
            .stream
            .clone_htod(data)
            .map_err(|e| anyhow::anyhow!("uploading a matrix: {e:?}"))?;
        let ptr = self.ptr(&buf);
        Ok(CudaWeight::Matrix {
            buf,
            ptr,
            ty,
            rows,
            cols,
            row_bytes,
            f16: None,
            mmw: None,
        })
    }

    /// Adds the mmw copy (kernels/mmw.cu) to a Q4_K matrix when [`Self::keep_mmw_copy`]
    /// allows it; other matrices are left as they are.
    pub fn add_mmw_copy(&self, w: &mut CudaWeight) -> anyhow::Result<()> {
        if let CudaWeight::Matrix {
            ptr,
            ty,
            rows,
            cols,
            row_bytes,
            mmw,
            ..
        } = w
            && mmw.is_none()
            && self.keep_mmw_copy(*ty, *rows, *cols)
        {
            *mmw = Some(self.repack_mmw(*ptr, *row_bytes, *rows, *cols)?);
        }
        Ok(())
    }

    /// Bytes of a `rows × cols` Q4_K matrix in the mmw layout.
    pub(crate) fn mmw_bytes(rows: usize, cols: usize) -> usize {
        rows.div_ceil(16) * (cols / 256) * MW_TILE_BYTES
    }

    /// Whether to keep the mmw copy of a `ty` matrix (Q4_K, rows of whole 256-value
    /// blocks): unless `KESTREL_CUDA_MMW=0`, when it leaves at least 40% of the GPU's memory
    /// (and 8 GiB) free, as the f16 copies.
    pub(crate) fn keep_mmw_copy(&self, ty: GgmlType, rows: usize, cols: usize) -> bool {
        if ty != GgmlType::Q4K || !cols.is_multiple_of(256) || cols == 0 {
            return false;
        }
        self.options.mmw_copies && self.leaves_room_for_cache(Self::mmw_bytes(rows, cols))
    }

    /// The mmw copy of the Q4_K matrix at `ptr` (kernels/mmw.cu: `repack_q4k_mmw`).
    pub(crate) fn repack_mmw(
        &self,
        ptr: u64,
        row_bytes: usize,
        rows: usize,
        cols: usize,
    ) -> anyhow::Result<CudaSlice<u8>> {
        let copy = self.alloc::<u8>(Self::mmw_bytes(rows, cols), "an mmw weight copy")?;
        let threads = rows.div_ceil(16) * (cols / 256) * 32;
        self.launch(
            "repack_q4k_mmw",
            grid_1d(threads, 256),
            256,
            &[
                Arg::P(ptr),
                Arg::L(row_bytes as i64),
                Arg::I(rows as i32),
                Arg::I(cols as i32),
                Arg::P(self.ptr(&copy)),
            ],
        );
        self.check()?;
        Ok(copy)
    }

    /// A `rows × cols` activation tensor holding `data` (row-major).
    pub fn upload_tensor(
        &self,
        rows: usize,
        cols: usize,
        data: &[f32],
    ) -> anyhow::Result<CudaTensor> {
        if data.len() != rows * cols {
            bail!("{} values for a {rows}×{cols} tensor", data.len());
        }
        let buf = self
            .stream
            .clone_htod(data)
            .map_err(|e| anyhow::anyhow!("uploading a tensor: {e:?}"))?;
        let ptr = self.ptr(&buf);
        Ok(CudaTensor {
            buf,
            ptr,
            rows,
            cols,
        })
    }

    /// Whether to keep an f16 copy of a `ty` matrix of `len` values next to its blocks, so
    /// prompt-sized products skip dequantizing it each time. `KESTREL_CUDA_F16_WEIGHTS=1`
    /// always, `=0` never; by default when cuBLAS is present and the copy leaves at least
    /// 40% of the GPU's memory (and 8 GiB) free for the KV cache and activations. F16
    /// weights need no copy.
    pub(crate) fn keep_f16_copy(&self, ty: GgmlType, len: usize) -> bool {
        if self.blas.is_none() || ty == GgmlType::F16 {
            return false;
        }
        match self.options.f16_copies {
            F16Copies::Never => false,
            F16Copies::Always => true,
            F16Copies::ByMemory => self.leaves_room_for_cache(len * 2),
        }
    }

    /// Whether `bytes` more of weight copies still leave at least 40% of the GPU's memory
    /// (and 8 GiB) free for the KV cache and activations once the weights the load has
    /// still to upload are in (the rule for every optional copy; [`copy_fits`]).
    pub(crate) fn leaves_room_for_cache(&self, bytes: usize) -> bool {
        match cudarc::driver::result::mem_get_info() {
            Ok((free, total)) => copy_fits(
                free as u64,
                total as u64,
                bytes as u64,
                self.weights_to_come
                    .load(std::sync::atomic::Ordering::Relaxed),
            ),
            Err(_) => false,
        }
    }

    /// Tells this device that loading `file` uploads `bytes()` of weights to it in all
    /// (counted down by each upload), so that the optional copies made while the first
    /// tensors load leave room for the last; only the first call for a file counts.
    pub fn expect_weights(&self, file: &Arc<GgufFile>, bytes: impl FnOnce() -> u64) {
        let key = Arc::as_ptr(file) as usize;
        let mut planned = self.weights_file.lock().unwrap_or_else(|p| p.into_inner());
        if *planned != key {
            *planned = key;
            self.weights_to_come
                .store(bytes(), std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Adds the dequantized f16 copy to a matrix, in a buffer of `room_rows` rows (at least
    /// its own; the rest for the matrices merged behind it).
    pub(crate) fn add_f16_copy(&self, w: &mut CudaWeight, room_rows: usize) -> anyhow::Result<()> {
        let CudaWeight::Matrix { rows, cols, .. } = w else {
            return Ok(());
        };
        let copy = self.alloc::<u16>(room_rows.max(*rows) * *cols, "an f16 weight copy")?;
        let at = self.ptr(&copy);
        self.dequant_f16_into(w, at)?;
        let CudaWeight::Matrix { ty, f16, .. } = w else {
            return Ok(());
        };
        *f16 = Some(copy);
        self.note_f16_copy(*ty);
        Ok(())
    }

    /// Records that a `ty` matrix has an f16 copy: small batches of it will use cuBLAS
    /// unless the 8-bit GEMVs read it.
    pub(crate) fn note_f16_copy(&self, ty: GgmlType) {
        if q8_supported(ty) {
            self.f16_copies_q8
                .fetch_or(1 << ty.id(), std::sync::atomic::Ordering::Relaxed);
        } else {
            self.f16_copies
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Rows to allocate for the f16 copy of `info` (`rows` × `cols`): its own, plus those of
    /// the matrices merged behind it ([`merged_followers`]) when all of them are in the
    /// file with rows of `cols` values and the whole copy fits [`Self::keep_f16_copy`].
    pub(crate) fn merge_f16_behind(
        &self,
        name: &str,
        ty: GgmlType,
        shape_of: &(dyn Fn(&str) -> Option<(usize, usize)> + Sync),
        rows: usize,
        cols: usize,
    ) -> usize {
        let mut total = rows;
        let followers = merged_followers(name);
        for f in &followers {
            match shape_of(f) {
                Some((c, r)) if c == cols => total += r,
                _ => return rows,
            }
        }
        if followers.is_empty() || !self.keep_f16_copy(ty, total * cols) {
            return rows;
        }
        total
    }

    /// Dequantizes matrix `w` to f16 rows at device address `at`.
    pub(crate) fn dequant_f16_into(&self, w: &CudaWeight, at: u64) -> anyhow::Result<()> {
        let CudaWeight::Matrix {
            ptr,
            ty,
            rows,
            cols,
            row_bytes,
            ..
        } = w
        else {
            return Ok(());
        };
        self.launch(
            "dequant_f16",
            grid_1d(*rows * cols.div_ceil(32), 256),
            256,
            &[
                Arg::P(*ptr),
                Arg::I(ty.id() as i32),
                Arg::L(*row_bytes as i64),
                Arg::I(*cols as i32),
                Arg::I(*rows as i32),
                Arg::P(at),
            ],
        );
        self.check()
    }

    pub(crate) fn vector_ptr(&self, w: &CudaWeight, what: &str) -> Option<u64> {
        match w {
            CudaWeight::Vector { ptr, .. } => Some(*ptr),
            CudaWeight::Matrix { .. } => {
                self.fail(format!("{what}: expected a vector weight, got a matrix"));
                None
            }
        }
    }

    pub(crate) fn freq_factors_ptr(&self, f: &Arc<[f32]>) -> Option<u64> {
        let mut cache = self.freq_factors.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, _, p)) = cache.iter().find(|(a, _, _)| Arc::ptr_eq(a, f)) {
            return Some(*p);
        }
        match self.stream.clone_htod(&f[..]) {
            Ok(buf) => {
                let p = self.ptr(&buf);
                cache.push((f.clone(), buf, p));
                Some(p)
            }
            Err(e) => {
                self.fail(format!("uploading rope frequency factors: {e:?}"));
                None
            }
        }
    }
}

/// Whether optional weight copies of `bytes` more leave at least 40% of a device of
/// `total` bytes (and 8 GiB) free, with `free` free now and `to_come` bytes of weights
/// still to be uploaded. (Counting only what is free now, the first layers' copies took
/// the room of the last layers' weights: Llama-3-70B Q4_K_M on an 80 GB H100 left no room
/// for the GEMM scratch of a prompt.)
pub(crate) fn copy_fits(free: u64, total: u64, bytes: u64, to_come: u64) -> bool {
    let reserve = (total / 10 * 4).max(8 << 30);
    free.saturating_sub(bytes).saturating_sub(to_come) >= reserve
}

pub(crate) fn load_weight(
    backend: &CudaBackend,
    file: &Arc<GgufFile>,
    info: &TensorInfo,
) -> anyhow::Result<CudaWeight> {
    backend.expect_weights(file, || file.tensors().iter().map(|t| t.n_bytes()).sum());
    let gathered_only = info.name == "token_embd.weight" && file.tensor("output.weight").is_some();
    load_weight_from(
        backend,
        &WeightSource {
            name: &info.name,
            ty: info.ty,
            dims: &info.dims,
            data: file.tensor_data(info),
            gathered_only,
            shape_of: &|name| {
                file.tensor(name)
                    .filter(|t| t.dims.len() == 2)
                    .map(|t| (t.dims[0] as usize, tensor_rows(t)))
            },
        },
    )
}

/// A weight's bytes and what its upload needs to know besides (a whole GGUF tensor, or one
/// rank's shard of it).
pub struct WeightSource<'a> {
    pub name: &'a str,
    pub ty: GgmlType,
    /// GGUF dims, row length first.
    pub dims: &'a [u64],
    pub data: &'a [u8],
    /// The embedding table when a separate LM head exists: only gathered from.
    pub gathered_only: bool,
    /// (row length, rows) of another matrix of the same model (as this rank holds it),
    /// for the merged f16 copies.
    pub shape_of: &'a (dyn Fn(&str) -> Option<(usize, usize)> + Sync),
}

pub(crate) fn load_weight_from(
    backend: &CudaBackend,
    src: &WeightSource<'_>,
) -> anyhow::Result<CudaWeight> {
    let info = src;
    let cols = info.dims.first().copied().unwrap_or(1) as usize;
    let rows = info.dims.iter().skip(1).product::<u64>() as usize;
    if info.dims.len() <= 1 {
        let mut v = vec![0f32; cols];
        kestrel_quant::dequantize_row(info.ty, info.data, &mut v)
            .with_context(|| format!("tensor {}", info.name))?;
        let buf = backend
            .stream
            .clone_htod(&v)
            .map_err(|e| anyhow::anyhow!("uploading {}: {e:?}", info.name))?;
        let ptr = backend.ptr(&buf);
        return Ok(CudaWeight::Vector {
            buf,
            ptr,
            len: cols,
        });
    }
    let mut w = backend
        .upload_matrix(info.ty, rows, cols, info.data)
        .with_context(|| format!("tensor {}", info.name))?;
    // The embedding table is only gathered from, unless it doubles as the LM head.
    if info.ty == GgmlType::F16 {
        backend
            .f16_copies
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }
    let gathered_only = info.gathered_only;
    // The 4-bit tensor-core copy of gate and up (mmw_gated).
    let gate_or_up = info.name.ends_with("ffn_gate.weight") || info.name.ends_with("ffn_up.weight");
    if !gathered_only && gate_or_up {
        backend
            .add_mmw_copy(&mut w)
            .with_context(|| format!("tensor {}", info.name))?;
    }
    let merged_at = backend
        .merged_f16_rows
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(info.name);
    if let Some(at) = merged_at {
        // K or V: rows of the merged copy Q's load allocated.
        backend
            .dequant_f16_into(&w, at)
            .with_context(|| format!("tensor {}", info.name))?;
        backend.note_f16_copy(info.ty);
    } else if !gathered_only && backend.keep_f16_copy(info.ty, rows * cols) {
        let room = backend.merge_f16_behind(info.name, info.ty, info.shape_of, rows, cols);
        backend
            .add_f16_copy(&mut w, room)
            .with_context(|| format!("tensor {}", info.name))?;
        if room > rows
            && let CudaWeight::Matrix {
                f16: Some(copy), ..
            } = &w
        {
            // K's and V's rows follow Q's; they fill them as they load (next).
            let mut at = backend.ptr(copy) + (rows * cols * 2) as u64;
            let mut pending = backend
                .merged_f16_rows
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            pending.clear();
            for name in merged_followers(info.name) {
                let follower_rows = (info.shape_of)(&name).map_or(0, |s| s.1);
                pending.insert(name, at);
                at += (follower_rows * cols * 2) as u64;
            }
        }
    }
    Ok(w)
}

pub(crate) fn new_tensor(
    backend: &CudaBackend,
    rows: usize,
    cols: usize,
) -> anyhow::Result<CudaTensor> {
    let len = rows.checked_mul(cols).context("tensor size overflows")?;
    let buf = backend.alloc::<f32>(len, "an activation buffer")?;
    let ptr = backend.ptr(&buf);
    Ok(CudaTensor {
        buf,
        ptr,
        rows,
        cols,
    })
}

#[cfg(test)]
mod layout_tests {
    use super::{pad_blocks, split_planes};

    /// Two rows of three 22-byte blocks (Q5_0's shape), every byte distinct: each part of
    /// every block must land in its plane, in block order, with the row's padding zero.
    #[test]
    fn split_planes_keeps_every_part_of_every_block() {
        let data: Vec<u8> = (0..2 * 3 * 22).map(|i| i as u8).collect();
        let out = split_planes(&data, 66, 80, 22, &[(6, 16), (2, 4), (0, 2)]);
        assert_eq!(out.len(), 160);
        for row in 0..2 {
            let o = &out[row * 80..(row + 1) * 80];
            for b in 0..3 {
                let blk = &data[row * 66 + b * 22..row * 66 + (b + 1) * 22];
                assert_eq!(&o[16 * b..16 * b + 16], &blk[6..22]);
                assert_eq!(&o[48 + 4 * b..48 + 4 * b + 4], &blk[2..6]);
                assert_eq!(&o[60 + 2 * b..60 + 2 * b + 2], &blk[..2]);
            }
            assert!(o[66..].iter().all(|&x| x == 0));
        }
    }

    /// The codebook tables the kernels hold as words (`IQ4NL_T*`, `MXFP4_T*` in
    /// kernels/quant.cu) against the levels kestrel-quant dequantizes: a block with scale 1
    /// whose byte j holds nibble j (low) and 15 - j (high).
    #[test]
    fn kernel_codebook_tables_are_the_quantizers_levels() {
        let source = include_str!("../kernels/quant.cu");
        let table = |name: &str| -> Vec<f32> {
            (0..4)
                .flat_map(|i| {
                    let key = format!("#define {name}_T{i} 0x");
                    let line = source.lines().find(|l| l.starts_with(&key)).unwrap();
                    let hex = line[key.len()..].trim_end_matches('u');
                    u32::from_str_radix(hex, 16).unwrap().to_le_bytes()
                })
                .map(|b| b as i8 as f32)
                .collect()
        };
        let qs: Vec<u8> = (0..16u8).map(|j| j | ((15 - j) << 4)).collect();
        for (name, ty, head) in [
            ("IQ4NL", kestrel_gguf::GgmlType::IQ4NL, vec![0x00, 0x3c]), // f16 1.0
            ("MXFP4", kestrel_gguf::GgmlType::MXFP4, vec![128]),        // 2^(128 - 128)
        ] {
            let block = [head, qs.clone()].concat();
            let values = kestrel_quant::dequantize(ty, &block).unwrap();
            let levels = table(name);
            for j in 0..16 {
                assert_eq!(levels[j], values[j], "{name} level {j}");
                assert_eq!(levels[15 - j], values[16 + j], "{name} level {}", 15 - j);
            }
        }
    }

    #[test]
    fn pad_blocks_appends_zeros_to_each_block() {
        let data: Vec<u8> = (1..=2 * 210).map(|i| (i % 251) as u8 + 1).collect();
        let out = pad_blocks(&data, 210, 224);
        assert_eq!(out.len(), 448);
        for b in 0..2 {
            assert_eq!(&out[224 * b..224 * b + 210], &data[210 * b..210 * (b + 1)]);
            assert!(out[224 * b + 210..224 * (b + 1)].iter().all(|&x| x == 0));
        }
    }
}

#[cfg(test)]
mod room_tests {
    use super::copy_fits;

    /// Free memory left after loading a model whose tensors (in load order) are
    /// `(weight bytes, optional copy bytes)`, each copy made when [`copy_fits`] allows it,
    /// counting `to_come` (the bytes still to be uploaded) or, as before, nothing.
    fn load(total: u64, tensors: &[(u64, u64)], count_to_come: bool) -> (u64, u64) {
        let mut free = total - (1 << 30); // the context
        let mut to_come: u64 = tensors.iter().map(|t| t.0).sum();
        let mut copies = 0;
        for &(w, copy) in tensors {
            free = free.checked_sub(w).expect("the weights themselves fit");
            to_come -= w;
            if copy_fits(free, total, copy, if count_to_come { to_come } else { 0 }) {
                free -= copy;
                copies += copy;
            }
        }
        (free, copies)
    }

    /// Llama-3-70B's shape in Q4_K (~4.5 bits a weight) with f16 copies (2 bytes a weight),
    /// on an 80 GB device; and random shapes. Counting the weights still to come, a load
    /// ends with at least the reserve free (the cache's and the prompts' scratch); counting
    /// only what is free at each tensor, the 70B load leaves nearly nothing.
    #[test]
    fn copies_leave_the_reserve_for_the_weights_still_to_come() {
        let total: u64 = 81_559 << 20;
        let reserve = (total / 10 * 4).max(8 << 30);
        let q4k = |n: u64| n * 144 / 256;
        let mut tensors = vec![(q4k(128_256 * 8192), 0)];
        for _ in 0..80 {
            for (rows, cols) in [
                (8192, 8192),
                (1024, 8192),
                (1024, 8192),
                (8192, 8192),
                (28_672, 8192),
                (28_672, 8192),
                (8192, 28_672),
            ] {
                tensors.push((q4k(rows * cols), 2 * rows * cols));
            }
        }
        tensors.push((128_256 * 8192 * 210 / 256, 0));
        let (free, copies) = load(total, &tensors, true);
        assert!(free >= reserve, "{free} free of a {reserve} reserve");
        assert!(copies > 0, "room for some copies was left unused");
        let (old_free, _) = load(total, &tensors, false);
        assert!(old_free < reserve / 4, "the old rule left {old_free}");

        let mut seed = 0x1234_5678_9abc_def0u64;
        let mut next = |m: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % m
        };
        for _ in 0..200 {
            let total = (16 + next(128)) << 30;
            let n = 1 + next(400) as usize;
            let mut tensors: Vec<(u64, u64)> = (0..n)
                .map(|_| {
                    let w = 1 + next(1 << 28);
                    (w, w * next(5))
                })
                .collect();
            // Scale the weights to fill 10-90% of the device.
            let sum: u64 = tensors.iter().map(|t| t.0).sum();
            let want = (total - (1 << 30)) / 100 * (10 + next(81));
            for t in &mut tensors {
                t.0 = (t.0 as u128 * want as u128 / sum as u128) as u64;
            }
            let start_free = total - (1 << 30) - tensors.iter().map(|t| t.0).sum::<u64>();
            let (free, copies) = load(total, &tensors, true);
            let reserve = (total / 10 * 4).max(8 << 30);
            if copies > 0 {
                assert!(free >= reserve, "{free} free of a {reserve} reserve");
            }
            assert_eq!(free + copies, start_free);
        }
    }
}
