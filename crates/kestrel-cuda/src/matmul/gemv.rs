//! The GEMV launches (kernels/gemv.cu): up to three matrices sharing the activations in one
//! launch (Q/K/V; gated: gate and up), f32 activations or 8-bit ones (`gemv_q8*`,
//! `gemv_ws_r1`), and the 8-bit activation buffers they and the tensor-core kernels read.

use crate::*;

/// The kernels this module launches (kernels/gemv.cu).
pub(crate) const KERNELS: &[&str] = &[
    "gemv",
    "gemv_dec",
    "gemv_dec_r1",
    "quantize_x_q8",
    "gemv_q8",
    "gemv_q8_r1",
    "gemv_q8_b",
    "gemv_q8_b_r1",
    "gemv_q8_t4",
    "gemv_q8_t8",
    "gemv_v2",
    "gemv_v3",
    "gemv_v4",
    "gemv_v5",
    "gemv_v6",
    "gemv_v7",
    "gemv_v8",
    "gemv_dec_t4",
    "gemv_dec_t8",
    "gemv_ws_r1",
];

/// The verification kernels by token count (2..=GEMV_MAX_TOKENS): kernels/gemv.cu's
/// `gemv_v*`.
const VERIFY_KERNELS: [&str; GEMV_MAX_TOKENS - 1] = [
    "gemv_v2", "gemv_v3", "gemv_v4", "gemv_v5", "gemv_v6", "gemv_v7", "gemv_v8",
];

/// Blocks an SM of a `gemv_v*` launch (kernels/gemv.cu's VT_BLOCKS, its launch bounds).
const VERIFY_BLOCKS_PER_SM: usize = 3;

/// The grid of a `gemv_v*` launch over matrices of `rows` rows (gated: gate and up, the
/// first's rows): a grid row (blockIdx.y) a matrix (gated: one), as many blocks of 4 one-row
/// warps as the largest matrix needs, at most a wave of them (VERIFY_BLOCKS_PER_SM an SM):
/// the warps then walk the rows.
fn verify_grid(rows: &[usize], gated: bool, sm_count: usize) -> (u32, u32, u32) {
    let matrices = if gated { 1 } else { rows.len() };
    let most = rows[..matrices].iter().copied().max().unwrap_or(0);
    let blocks = most
        .div_ceil(4)
        .clamp(1, (sm_count * VERIFY_BLOCKS_PER_SM).max(1));
    (blocks as u32, matrices as u32, 1)
}

/// One matrix of a GEMV launch.
pub(crate) struct GemvSeg {
    pub(crate) ptr: u64,
    pub(crate) row_bytes: usize,
    pub(crate) ty: GgmlType,
    pub(crate) rows: usize,
    pub(crate) out: u64,
    pub(crate) ld: usize,
    pub(crate) bias: u64,
    /// Add into `out` instead of overwriting it (single-token launches, and verification
    /// steps' `gemv_v*` / `gemv_dec_t*`).
    pub(crate) accumulate: bool,
}

impl GemvSeg {
    /// The segment's matrix as the kernel choice sees it (rows of `k` values).
    pub(crate) fn matrix(&self, k: usize) -> Matrix {
        Matrix {
            ty: self.ty,
            rows: self.rows,
            cols: k,
            row_bytes: self.row_bytes,
            aligned: self.ptr.is_multiple_of(16) && self.row_bytes.is_multiple_of(16),
            f16: false,
        }
    }
}

/// Warps of a `gemv_dec` / `gemv_q8` launch at `rows_per_warp`: each matrix's rows in
/// groups (gated launches: gate's rows, each warp reading up's too).
pub(crate) fn gemv_warps(segs: &[GemvSeg], gated: bool, rows_per_warp: usize) -> usize {
    if gated {
        segs[0].rows.div_ceil(rows_per_warp)
    } else {
        segs.iter().map(|s| s.rows.div_ceil(rows_per_warp)).sum()
    }
}

/// Values one lane handles per step of the GEMV loop (see `Fmt<..>::units`).
pub(crate) fn gemv_unit_values(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q4K | GgmlType::Q6K => 32,
        GgmlType::Q8_0
        | GgmlType::Q4_0
        | GgmlType::Q5_0
        | GgmlType::IQ4NL
        | GgmlType::IQ4XS
        | GgmlType::MXFP4 => 16,
        GgmlType::F16 | GgmlType::BF16 => 8,
        _ => 4,
    }
}

/// Int8 activations and their per-32 scales for `gemv_q8` (and for `mmq_t*`: scales with
/// the block sums, token-minor).
pub(crate) struct Q8Scratch {
    pub(crate) q: CudaSlice<i8>,
    pub(crate) d: CudaSlice<f32>,
    pub(crate) ds: CudaSlice<f32>,
    /// Split partial sums of the `mms_*` kernels (MMS_WORK_FLOATS) and their per-tile
    /// arrival counters (MMS_MAX_TILES, zero between launches).
    pub(crate) work: CudaSlice<f32>,
    pub(crate) count: CudaSlice<u32>,
    /// Values it holds room for.
    pub(crate) cap: usize,
}

/// Device addresses of a [`Q8Scratch`]'s buffers.
pub(crate) struct Q8Ptrs {
    pub(crate) q: u64,
    pub(crate) d: u64,
    pub(crate) ds: u64,
    pub(crate) work: u64,
    pub(crate) count: u64,
}

impl GemvSeg {
    /// The segment of matrix `w` writing `ld`-float rows at `out` (None: not a matrix).
    pub(crate) fn of(w: &CudaWeight, out: u64, ld: usize, bias: u64) -> Option<GemvSeg> {
        let CudaWeight::Matrix {
            ptr,
            ty,
            rows,
            row_bytes,
            ..
        } = w
        else {
            return None;
        };
        Some(GemvSeg {
            ptr: *ptr,
            row_bytes: *row_bytes,
            ty: *ty,
            rows: *rows,
            out,
            ld,
            bias,
            accumulate: false,
        })
    }
}

impl Q8Ptrs {
    /// Where mmk's layout keeps, in the scale buffer, the per-256 steps and the group sums
    /// of `npad` token rows of `k` values: the steps first, then the sums.
    pub(crate) fn mmk_steps_sums(&self, npad: usize, k: usize) -> (u64, u64) {
        (self.ds, self.ds + 4 * (npad * k / 256) as u64)
    }
}

impl CudaBackend {
    /// Whether single-token GEMVs run on 8-bit activations where the format allows.
    pub fn q8_decode(&self) -> bool {
        self.q8_decode.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Turns the 8-bit activation GEMVs on or off (the self-check covers both paths).
    pub fn set_q8_decode(&self, on: bool) {
        self.q8_decode
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Makes the Q8 activation buffers hold at least `k` values.
    pub fn reserve_q8(&self, k: usize) -> anyhow::Result<()> {
        let mut s = self.q8_scratch.lock().unwrap_or_else(|p| p.into_inner());
        if s.as_ref().is_some_and(|s| s.cap >= k) {
            return Ok(());
        }
        *s = None;
        let cap = k.next_multiple_of(256);
        *s = Some(Q8Scratch {
            q: self.alloc::<i8>(cap, "the quantized activations")?,
            d: self.alloc::<f32>(cap / 32, "the activation scales")?,
            ds: self.alloc::<f32>(cap / 16, "the activation scales and sums")?,
            work: self.alloc::<f32>(MMS_WORK_FLOATS, "the split partial sums")?,
            count: self.alloc::<u32>(MMS_MAX_TILES, "the split arrival counters")?,
            cap,
        });
        Ok(())
    }

    /// Values the 8-bit activation buffers hold (0: none yet).
    pub(crate) fn q8_capacity(&self) -> usize {
        let s = self.q8_scratch.lock().unwrap_or_else(|p| p.into_inner());
        s.as_ref().map_or(0, |s| s.cap)
    }

    /// Device addresses of the Q8 activation buffers — the int8 values, the per-32 scales
    /// (`gemv_q8`) and the scale-and-sum pairs (`mmq_t*`) — if they hold `values` values.
    pub(crate) fn q8_buffers(&self, values: usize) -> Option<Q8Ptrs> {
        let s = self.q8_scratch.lock().unwrap_or_else(|p| p.into_inner());
        s.as_ref().filter(|s| s.cap >= values).map(|s| Q8Ptrs {
            q: self.ptr(&s.q),
            d: self.ptr(&s.d),
            ds: self.ptr(&s.ds),
            work: self.ptr(&s.work),
            count: self.ptr(&s.count),
        })
    }

    /// The 8-bit activation buffers a kernel that writes a single token's row of `cols`
    /// values fills on the way out for the consuming `gemv_q8` (None: n > 1, the f32 paths,
    /// or rows not of whole 32-value blocks).
    pub(crate) fn single_q8_buffers(&self, n: usize, cols: usize) -> Option<Q8Ptrs> {
        (n == 1 && self.q8_decode() && cols.is_multiple_of(32))
            .then(|| self.q8_buffers(cols))
            .flatten()
    }

    /// Where a kernel that writes `n` token rows of `cols` values for an 8-bit multi-token
    /// product (steps of MMQ_MIN_TOKENS..=8 on `mmq_t8` / `mmk_t8*`, and 9..=MMQ_MAX_TOKENS
    /// on `mms_*`) quantizes them on the way out: the padded row count, whether in
    /// mmk's layout (where a launch of these rows may take `mmk_t8*` or `mms_*`; the
    /// consumer quantizes again if its weights turn out to need the other one) or mmq's,
    /// and the buffers. None where the consumer quantizes its input itself.
    pub(crate) fn multi_q8_layout(&self, n: usize, cols: usize) -> Option<MultiQ8> {
        let staged = n >= MMS_MIN_TOKENS && cols.is_multiple_of(256);
        let npad = if staged {
            n.next_power_of_two()
        } else {
            mmq_int8_rows(n)
        };
        if !((MMQ_MIN_TOKENS..=MMQ_MAX_TOKENS).contains(&n)
            && (n < MMS_MIN_TOKENS || staged)
            && self.q8_decode()
            && cols.is_multiple_of(32))
        {
            return None;
        }
        let mmk = staged || (npad == 8 && self.mmk_on() && cols.is_multiple_of(256));
        let q8 = self.q8_buffers(npad * cols)?;
        Some(MultiQ8 { npad, mmk, q8 })
    }

    /// Forces the rows per warp of single-token `gemv_q8` launches (1 or 2; 0: by
    /// launch). The self-check runs every variant.
    pub fn set_gemv_q8_rows(&self, rows: usize) {
        self.gemv_q8_rows
            .store(rows.min(2), std::sync::atomic::Ordering::Relaxed);
    }

    /// The forced rows per warp of single-token `gemv_q8` launches (0: by launch).
    pub fn gemv_q8_rows(&self) -> usize {
        self.gemv_q8_rows.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A GEMV segment for `w` writing into `out`, if the GEMV kernels handle it.
    pub(crate) fn gemv_seg(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        out: &CudaTensor,
        bias: Option<&CudaWeight>,
    ) -> Option<GemvSeg> {
        let CudaWeight::Matrix { ty, rows, cols, .. } = w else {
            return None;
        };
        if *cols != x.cols || out.cols != *rows || !gemv_supported(*ty, *cols) {
            return None;
        }
        let bias = match bias {
            None => 0,
            Some(CudaWeight::Vector { ptr, len, .. }) if *len == *rows => *ptr,
            Some(_) => return None,
        };
        GemvSeg::of(w, out.ptr, out.cols, bias)
    }

    /// One GEMV launch over up to three matrices sharing `x` (`gated`: two matrices, gate
    /// and up, producing `act(gate·x) * (up·x)` in the first's output).
    pub(crate) fn gemv(
        &self,
        x: &CudaTensor,
        ready: &mut Prepared,
        n: usize,
        segs: &[GemvSeg],
        gated: Option<Activation>,
        family: Kernel,
    ) {
        debug_assert!(!segs.is_empty() && segs.len() <= 3);
        let k = x.cols;
        let weight_bytes: u64 = segs.iter().map(|s| (s.rows * s.row_bytes) as u64).sum();
        let units = segs
            .iter()
            .map(|s| k / gemv_unit_values(s.ty))
            .max()
            .unwrap_or(0);
        // Rows per 4-warp block: short rows get one warp each, long rows all four.
        let rpb: usize = if units <= 48 {
            4
        } else if units <= 96 {
            2
        } else {
            1
        };
        let total = if gated.is_some() {
            segs[0].rows
        } else {
            segs.iter().map(|s| s.rows).sum()
        };
        // gemv_dec reads `act` of a plain (not gated) launch as "add into the output".
        let act = match gated {
            Some(Activation::GeluTanh) => 1,
            Some(_) => 0,
            None => i32::from(segs.iter().any(|s| s.accumulate)),
        };
        // The launch's arguments.
        let mut args = vec![
            Arg::P(x.ptr),
            Arg::I(k as i32),
            Arg::I(n as i32),
            Arg::I(rpb as i32),
            Arg::I(total as i32),
            Arg::I(i32::from(gated.is_some())),
            Arg::I(act),
        ];
        for i in 0..3 {
            let s = segs.get(i).unwrap_or(&segs[0]);
            let rows = if i < segs.len() { s.rows } else { 0 };
            args.push(Arg::P(s.ptr));
            args.push(Arg::L(s.row_bytes as i64));
            args.push(Arg::I(s.ty.id() as i32));
            if i < 2 {
                args.push(Arg::I(rows as i32));
            }
            args.push(Arg::P(s.out));
            args.push(Arg::I(s.ld as i32));
            args.push(Arg::P(s.bias));
        }
        if family.tensor_core() {
            self.mmq(
                x,
                ready,
                n,
                segs,
                gated.is_some(),
                &args,
                weight_bytes,
                family,
            );
            return;
        }
        // Only the single-token kernels, their multi-token forms in verification steps and
        // the mmq_t8 / mmk_t8* / mms_* add into their outputs.
        debug_assert!(n == 1 || self.invariant_step() || segs.iter().all(|s| !s.accumulate));
        debug_assert!(n <= GEMV_MAX_TOKENS);
        if family.q8() {
            let Some(Q8Ptrs {
                q: q_ptr, d: d_ptr, ..
            }) = self.q8_buffers(n * k)
            else {
                return;
            };
            let quantized = *ready == Prepared::Q8 { of: x.ptr, n };
            if !quantized {
                // Rows of k values back to back: n·k/32 blocks of 32.
                self.launch(
                    "quantize_x_q8",
                    grid_1d(n * k / 32, 8),
                    256,
                    &[
                        Arg::P(x.ptr),
                        Arg::I((n * k) as i32),
                        Arg::P(q_ptr),
                        Arg::P(d_ptr),
                    ],
                );
                // The buffers now hold this x's rows, for the next product of it too.
                *ready = Prepared::Q8 { of: x.ptr, n };
            }
            let forced = self.gemv_q8_rows();
            // A verification step (see `invariant_step`): `gemv_v{n}` on the single-token
            // kernel's own units (the wide ones of gemv_q8 / gemv_q8_r1 / gemv_q8_b*, or
            // gemv_ws_r1's plain ones), one row a warp at a time, at most a wave of warps
            // walking the rows, a grid row (blockIdx.y) a matrix.
            if self.invariant_step() && (2..=GEMV_MAX_TOKENS).contains(&n) {
                // gemv_v* read gemv_ws_r1's plain units of Q4_K / Q6_K only (gated: a Q4_K
                // pair), as plan_launch sends them.
                debug_assert!(
                    family == Kernel::GemvQ8
                        || segs
                            .iter()
                            .all(|s| matches!(s.ty, GgmlType::Q4K | GgmlType::Q6K))
                );
                let rows: Vec<usize> = segs.iter().map(|s| s.rows).collect();
                let grid = verify_grid(&rows, gated.is_some(), self.sm_count);
                args[3] = Arg::I(i32::from(family == Kernel::GemvQ8));
                let mut q8_args = vec![Arg::P(q_ptr), Arg::P(d_ptr)];
                q8_args.extend_from_slice(&args);
                self.launch_reading(VERIFY_KERNELS[n - 2], grid, 128, &q8_args, weight_bytes);
                return;
            }
            let (kernel, rows) = match (n, forced) {
                (2..=4, _) => ("gemv_q8_t4", 2),
                (5.., _) => ("gemv_q8_t8", 2),
                (_, 1) => ("gemv_q8_r1", 1),
                (_, 2) => ("gemv_q8", 2),
                // One row per warp for short rows, and where one row per warp still fits
                // in one wave of resident warps (5 blocks of 4 per SM): tg128 Qwen2.5-1.5B
                // (down: 1,536 rows of 8,960) 635 / 636 -> 674 / 680 t/s; Llama-3-8B, whose
                // 4,096-row launches would take 1.6 waves, stays on two (309 / 311 against
                // 282 / 286 with one).
                _ if plan::one_row_a_warp(gemv_warps(segs, gated.is_some(), 1), self.sm_count) => {
                    ("gemv_q8_r1", 1)
                }
                _ => ("gemv_q8", 2),
            };
            // One-row launches on the staged kernel where it reads the formats (tg128 H100,
            // alternated: Qwen2.5-1.5B, all one-row launches, 709 / 679 -> 723 / 724 t/s;
            // Llama-3-8B's two-row launches lost on it, 329 / 325 -> 312 / 316, so they stay).
            // (GemvWs, single-token and unforced, implies the one-row gemv_q8_r1 above.)
            let kernel = if n > 1 {
                kernel
            } else if family == Kernel::GemvWs {
                "gemv_ws_r1"
            } else if n == 1
                && segs
                    .iter()
                    .all(|s| matches!(s.ty, GgmlType::Q8_0 | GgmlType::Q4_0))
            {
                // No K-quant matrix: the byte-format kernels, at 5 blocks per SM where the
                // K-quants' 64-value units need 4.
                if rows == 1 {
                    "gemv_q8_b_r1"
                } else {
                    "gemv_q8_b"
                }
            } else {
                kernel
            };
            let warps = gemv_warps(segs, gated.is_some(), rows);
            let mut q8_args = vec![Arg::P(q_ptr), Arg::P(d_ptr)];
            q8_args.extend_from_slice(&args);
            let grid = grid_1d(warps, 4);
            self.launch_reading(kernel, grid, 128, &q8_args, weight_bytes);
            return;
        }
        if family == Kernel::GemvDec {
            // gemv_dec: `rows` rows per warp, 4 warps per block, per matrix.
            // Rows of at most SHORT_ROW values: one row per warp (a lane then has one or two
            // units of the row, so a second row adds latency instead of bytes in flight).
            // Measured (tg128, H100) with one variant for every launch: r1 413 vs r2 409 t/s
            // on Qwen2.5-1.5B (rows of 1536 but the down projection's 8960), r1 175 vs r2
            // 201 on Llama-3-8B (rows of 4096 and 14336); splitting by launch size instead
            // (< 8192 rows: r1) gave 448 and 192.
            const SHORT_ROW: usize = 2048;
            let (kernel, rows) = if k <= SHORT_ROW {
                ("gemv_dec_r1", 1)
            } else {
                ("gemv_dec", 2)
            };
            // A verification step: gemv_dec's units for all its tokens in one launch, one row
            // a warp (each row's sums do not depend on the rows a warp takes).
            if n > 1 {
                let kernel = if n <= 4 { "gemv_dec_t4" } else { "gemv_dec_t8" };
                let warps = gemv_warps(segs, gated.is_some(), 1);
                self.launch_reading(kernel, grid_1d(warps, 4), 128, &args, weight_bytes);
                return;
            }
            let warps = gemv_warps(segs, gated.is_some(), rows);
            self.launch_reading(kernel, grid_1d(warps, 4), 128, &args, weight_bytes);
            return;
        }
        self.launch_reading("gemv", grid_1d(total, rpb), 128, &args, weight_bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::verify_grid;

    #[test]
    fn verify_grid_covers_each_matrix_within_a_wave() {
        // Q/K/V of Qwen2.5-1.5B on the H100: a grid row a matrix, blocks for the largest.
        assert_eq!(verify_grid(&[1536, 256, 256], false, 132), (384, 3, 1));
        // Gated: one grid row whatever up's rows; the LM head: one wave, the warps walk.
        assert_eq!(verify_grid(&[8960, 8960], true, 132), (396, 1, 1));
        assert_eq!(verify_grid(&[151_936], false, 132), (396, 1, 1));
        // Awkward sizes: a block for a single row, ceil(rows / 4) below a wave.
        assert_eq!(verify_grid(&[1], false, 132), (1, 1, 1));
        assert_eq!(verify_grid(&[7, 3], false, 2), (2, 2, 1));
        assert_eq!(verify_grid(&[1583, 2], false, 132), (396, 2, 1));
    }
}
