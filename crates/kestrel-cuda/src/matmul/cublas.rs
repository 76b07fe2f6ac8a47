//! cuBLAS products of f16 operands: `cublasGemmEx` with its heuristic's first algorithm.
//! (Timing cuBLASLt's candidates per shape was tried and not kept: `bench --seqs 64` +2.5%
//! in one call and nothing in another, the server at 64 clients −8 to −18% from each new
//! shape's first step; git history has it.)

use crate::*;

/// The kernels this module launches (kernels/quant.cu: the f16 operands).
pub(crate) const KERNELS: &[&str] = &["dequant_f16", "f32_to_f16"];

/// One product shape: rows × cols weights (row-major f16) times n tokens, outputs with
/// leading dimension ld.
#[derive(Clone, Copy, Hash, PartialEq, Eq, Debug)]
pub struct Shape {
    pub rows: usize,
    pub cols: usize,
    pub n: usize,
    pub ld: usize,
}

/// `cublasGemmEx`: out (n × ld, column-major rows × n) = aᵀ · x (+ out with accumulate).
pub fn gemm_ex_raw(
    blas: &cudarc::cublas::CudaBlas,
    s: Shape,
    a: u64,
    x: u64,
    out: u64,
    accumulate: bool,
) -> anyhow::Result<()> {
    use cudarc::cublas::sys::{
        cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType,
    };
    let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
    // SAFETY: a, x and out hold rows×cols, n×cols and n×ld elements (checked by the
    // callers); the handle is bound to the backend's stream.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            s.rows as i32,
            s.n as i32,
            s.cols as i32,
            (&alpha as *const f32).cast(),
            a as *const std::ffi::c_void,
            cudaDataType::CUDA_R_16F,
            s.cols as i32,
            x as *const std::ffi::c_void,
            cudaDataType::CUDA_R_16F,
            s.cols as i32,
            (&beta as *const f32).cast(),
            out as *mut std::ffi::c_void,
            cudaDataType::CUDA_R_32F,
            s.ld as i32,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| anyhow::anyhow!("{e:?}"))
}

/// Device buffers holding a dequantized weight and the converted activations.
#[derive(Default)]
pub(crate) struct GemmScratch {
    pub(crate) w: Option<CudaSlice<u16>>,
    pub(crate) x: Option<CudaSlice<u16>>,
    /// The merged Q/K/V product's f32 output (two u16 a value), split by `split_qkv`.
    pub(crate) qkv: Option<CudaSlice<u16>>,
    /// The merged gate/up product's f32 output (two u16 a value).
    pub(crate) gate_up: Option<CudaSlice<u16>>,
    /// f16 activations written by a kernel that reads others from `x` (`mmw_gated`).
    pub(crate) h: Option<CudaSlice<u16>>,
    /// Buffers replaced while a step was being recorded, freed once it has run.
    pub(crate) retired: Vec<CudaSlice<u16>>,
}

impl CudaBackend {
    /// A scratch buffer of at least `len` f16 values (grown, never shrunk).
    pub(crate) fn scratch_ptr(
        &self,
        which: fn(&mut GemmScratch) -> &mut Option<CudaSlice<u16>>,
        len: usize,
    ) -> Option<u64> {
        let mut s = self.gemm_scratch.lock().unwrap_or_else(|p| p.into_inner());
        if which(&mut s).as_ref().is_none_or(|b| b.len() < len) {
            // Free the old one first, unless launches of the step being recorded (issued
            // later) still read it: then it is kept until the next step's preparation.
            if let Some(old) = which(&mut s).take() {
                if self.lock_recorder().deferring {
                    s.retired.push(old);
                } else {
                    drop(old);
                }
            }
            match self.alloc::<u16>(len, "GEMM scratch") {
                Ok(b) => *which(&mut s) = Some(b),
                Err(e) => {
                    self.fail(format!("{e:#}"));
                    return None;
                }
            }
        }
        let slot = which(&mut s);
        slot.as_ref().map(|b| self.ptr(b))
    }

    /// out[t][r] = W[r]·x[t] for `n` tokens on the tensor cores: W dequantized to f16 (F16
    /// weights are used in place), x converted to f16, products summed in f32 by cuBLAS.
    /// Returns false when cuBLAS is not available.
    pub(crate) fn gemm_f16(
        &self,
        x: &CudaTensor,
        ready: &mut Prepared,
        w: &CudaWeight,
        n: usize,
        out: &CudaTensor,
    ) -> bool {
        if self.blas.is_none() {
            return false;
        }
        match self.x_to_f16(x, n, ready) {
            Some(xh) => self.gemm_f16_from(xh, w, n, out),
            None => true, // the failure is recorded
        }
    }

    /// The first `n` rows of `x` as f16 in the activation scratch buffer (the B operand of
    /// [`Self::gemm_f16_from`]; valid until the next conversion).
    pub(crate) fn x_to_f16(&self, x: &CudaTensor, n: usize, ready: &mut Prepared) -> Option<u64> {
        let len = n * x.cols;
        let b = self.scratch_ptr(|s| &mut s.x, len)?;
        if let Prepared::F16 { of, n: rows, h } = *ready
            && of == x.ptr
            && rows == n
            && (h == b || h == self.scratch_ptr(|s| &mut s.h, len)?)
        {
            return Some(h);
        }
        *ready = Prepared::F16 { of: x.ptr, n, h: b };
        self.elementwise(
            "f32_to_f16",
            len,
            &[Arg::P(x.ptr), Arg::P(b), Arg::L(len as i64)],
        );
        Some(b)
    }

    /// Where a kernel producing `n` rows of `cols` activations should also write them as
    /// f16 (the GEMM scratch), for the cuBLAS products that read them next: steps above
    /// the tensor-core kernels' token range run on cuBLAS (see `prefer_gemm`). None: not
    /// such a step.
    pub(crate) fn f16_copy_for_gemm(&self, n: usize, cols: usize) -> Option<u64> {
        let gemm_step =
            self.blas.is_some() && n >= GEMM_MIN_TOKENS && n > MMQ_MAX_TOKENS && self.cublas_now();
        gemm_step
            .then(|| self.scratch_ptr(|s| &mut s.x, n * cols))
            .flatten()
    }

    /// A leader's merged f16 copy (its address and rows: the leader's, then each
    /// follower's, see `load_weight`) when it has one, the followers (rows of `cols` values,
    /// as many each) keep none of their own, and `outs[i]` has the columns of part `i`
    /// (leader first); None otherwise.
    pub(crate) fn merged_copy(
        &self,
        leader: &CudaWeight,
        followers: &[&CudaWeight],
        cols: usize,
        outs: &[&CudaTensor],
    ) -> Option<(u64, usize)> {
        let CudaWeight::Matrix {
            f16: Some(copy),
            rows: lead_rows,
            cols: lead_cols,
            ..
        } = leader
        else {
            return None;
        };
        // Each follower's rows, when it is merged (no copy of its own) and fits.
        let follower_rows = |w: &CudaWeight| match w {
            CudaWeight::Matrix {
                f16: None,
                rows,
                cols: c,
                ..
            } if *c == cols => Some(*rows),
            _ => None,
        };
        let each = follower_rows(followers.first()?)?;
        let fits = followers.iter().all(|w| follower_rows(w) == Some(each))
            && outs.len() == followers.len() + 1
            && outs[0].cols == *lead_rows
            && outs[1..].iter().all(|t| t.cols == each);
        let rows = lead_rows + followers.len() * each;
        (fits && *lead_cols == cols && copy.len() == rows * cols).then(|| (self.ptr(copy), rows))
    }

    /// `out = x · wᵀ` through cuBLAS from x already converted to f16 (`xh`, `n` rows of
    /// w's column count). Returns false when cuBLAS is not available.
    pub(crate) fn gemm_f16_from(
        &self,
        xh: u64,
        w: &CudaWeight,
        n: usize,
        out: &CudaTensor,
    ) -> bool {
        self.gemm_f16_into(xh, w, n, out, false)
    }

    /// [`Self::gemm_f16_from`], or with `accumulate` `out += x · wᵀ` (cuBLAS's beta = 1:
    /// the residual add of `matmul_add` without a kernel of its own).
    pub(crate) fn gemm_f16_into(
        &self,
        xh: u64,
        w: &CudaWeight,
        n: usize,
        out: &CudaTensor,
        accumulate: bool,
    ) -> bool {
        if self.blas.is_none() {
            return false;
        }
        let CudaWeight::Matrix {
            ptr: w_ptr,
            ty,
            rows,
            cols,
            row_bytes,
            f16,
            ..
        } = w
        else {
            return false;
        };
        let (w_ptr, ty, rows, cols, row_bytes) = (*w_ptr, *ty, *rows, *cols, *row_bytes);
        if out.cols != rows || n > out.rows {
            self.fail(format!(
                "GEMM: output of {} columns for a {rows}×{cols} weight",
                out.cols
            ));
            return true;
        }
        let a = if ty == GgmlType::F16 && row_bytes == cols * 2 {
            w_ptr
        } else if let Some(copy) = f16 {
            self.ptr(copy)
        } else {
            let Some(p) = self.scratch_ptr(|s| &mut s.w, rows * cols) else {
                return true;
            };
            let groups = rows * cols.div_ceil(32);
            self.launch(
                "dequant_f16",
                grid_1d(groups, 256),
                256,
                &[
                    Arg::P(w_ptr),
                    Arg::I(ty.id() as i32),
                    Arg::L(row_bytes as i64),
                    Arg::I(cols as i32),
                    Arg::I(rows as i32),
                    Arg::P(p),
                ],
            );
            p
        };
        if accumulate || !self.gemm_reading_ahead(a, rows, cols, xh, n, out) {
            self.gemm_f16_raw(a, rows, cols, xh, n, out.ptr, out.cols, accumulate);
        }
        true
    }

    /// Logit-sized products (at least READ_AHEAD_MIN_BYTES of output) while the host reads
    /// every step's rows back (`kestrel bench --seqs` without `--argmax`, llama-batched-bench's
    /// way): the product in READ_AHEAD_CHUNKS column chunks, each chunk's columns copied into
    /// the pinned read-back buffer on a second stream while the next chunk computes, so that
    /// the PCIe copy (33 MB a step at 64 sequences of a 128K vocabulary, ~0.6 ms) overlaps
    /// the product instead of following it. `read_pinned` then only waits. False: not such a
    /// product (nothing was queued).
    pub(crate) fn gemm_reading_ahead(
        &self,
        a: u64,
        rows: usize,
        cols: usize,
        xh: u64,
        n: usize,
        out: &CudaTensor,
    ) -> bool {
        let len = n * out.cols;
        // (Its copies wait on events of another stream: not a step's recorded launches. A
        // rank of a tensor-parallel group never reads ahead: the rows read back are the
        // all-gathered logits, never one rank's product.)
        if !self.options.read_ahead
            || self.comm.get().is_some()
            || self.lock_recorder().deferring
            || !self
                .rows_read_back
                .load(std::sync::atomic::Ordering::Relaxed)
            || len * 4 < READ_AHEAD_MIN_BYTES
            || out.cols != rows
            || rows < READ_AHEAD_CHUNKS
        {
            return false;
        }
        let Some(copy) = self
            .copy_stream
            .get_or_init(|| self.ctx.new_stream().ok())
            .clone()
        else {
            return false;
        };
        // The pinned buffer: large enough, and not still being written by an earlier copy.
        if self.wait_copies().is_err() {
            return false;
        }
        let host = {
            let mut pinned = self.pinned.lock().unwrap_or_else(|p| p.into_inner());
            match self.pinned_room(&mut pinned, len).map(|p| p.as_mut_ptr()) {
                Ok(Ok(p)) => p as u64,
                _ => return false,
            }
        };
        self.copy_in_flight
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let pitch = out.cols * 4;
        for c in 0..READ_AHEAD_CHUNKS {
            let (c0, c1) = (
                rows * c / READ_AHEAD_CHUNKS,
                rows * (c + 1) / READ_AHEAD_CHUNKS,
            );
            self.gemm_f16_raw(
                a + (c0 * cols * 2) as u64,
                c1 - c0,
                cols,
                xh,
                n,
                out.ptr + (c0 * 4) as u64,
                out.cols,
                false,
            );
            let queued = self
                .stream
                .record_event(None)
                .and_then(|ev| copy.wait(&ev))
                .map_err(|e| format!("{e:?}"))
                .and_then(|()| {
                    let params = sys::CUDA_MEMCPY2D {
                        srcXInBytes: c0 * 4,
                        srcY: 0,
                        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                        srcHost: std::ptr::null(),
                        srcDevice: out.ptr,
                        srcArray: std::ptr::null_mut(),
                        srcPitch: pitch,
                        dstXInBytes: c0 * 4,
                        dstY: 0,
                        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_HOST,
                        dstHost: host as *mut std::ffi::c_void,
                        dstDevice: 0,
                        dstArray: std::ptr::null_mut(),
                        dstPitch: pitch,
                        WidthInBytes: (c1 - c0) * 4,
                        Height: n,
                    };
                    // SAFETY: both regions hold n rows of `pitch` bytes (checked by the
                    // caller for `out`, allocated above for the pinned buffer).
                    unsafe { sys::cuMemcpy2DAsync_v2(&params, copy.cu_stream()) }
                        .result()
                        .map_err(|e| format!("{e:?}"))
                });
            if let Err(e) = queued {
                self.fail(format!("queuing the read-ahead copy: {e}"));
                return true;
            }
        }
        *self.read_ahead.lock().unwrap_or_else(|p| p.into_inner()) = Some((out.ptr, n, out.cols));
        self.read_ahead_valid
            .store(true, std::sync::atomic::Ordering::Relaxed);
        true
    }

    /// cuBLAS: `out` (n rows of `ld` floats; the first `rows` of each written) = x · aᵀ, or
    /// += with `accumulate`, for f16 `a` (rows × cols, row-major) and f16 x (n × cols). The
    /// caller has checked that the buffers hold that much.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm_f16_raw(
        &self,
        a: u64,
        rows: usize,
        cols: usize,
        xh: u64,
        n: usize,
        out: u64,
        ld: usize,
        accumulate: bool,
    ) {
        if self.blas.is_none() {
            self.fail("GEMM without cuBLAS".into());
            return;
        }
        // Issued now, or recorded with the step (`run_special` issues it, also into a graph).
        let args = [
            Arg::P(a),
            Arg::L(rows as i64),
            Arg::L(cols as i64),
            Arg::P(xh),
            Arg::L(n as i64),
            Arg::P(out),
            Arg::L(ld as i64),
            Arg::I(i32::from(accumulate)),
        ];
        self.enqueue(SPECIAL_GEMM, (1, 1, 1), 0, &args, 0);
    }

    /// Whether products may go through cuBLAS now: it is loaded, and no step is being
    /// recorded or the recorded one takes cuBLAS (see `record_step`).
    pub(crate) fn cublas_now(&self) -> bool {
        self.blas.is_some() && {
            let rec = self.lock_recorder();
            !rec.deferring || rec.gemms
        }
    }
}
