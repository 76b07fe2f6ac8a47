//! The int8 tensor-core launches of steps of 3..=32 tokens (kernels/mmq.cu): `mmq_t8`
//! (activations per 32 values), `mmk_t8*` (per 256, up to 8 tokens) and the staged `mms_*`
//! (9..=32 tokens).

use crate::*;

/// The kernels this module launches (kernels/mmq.cu).
pub(crate) const KERNELS: &[&str] = &[
    "quantize_x_mmq",
    "mmq_t8",
    "mmq_t8_gated",
    "quantize_x_mmk",
    "mmk_t8_gated_q4k",
    "mmk_t8_gated_q6k",
    "mmk_t8_pipe",
    "mms_t16",
    "mms_t32",
    "mms_t16_gated",
    "mms_t32_gated",
];

/// Rows a block of `mms_*` owns (MH_ROWS in kernels/mmq.cu; gated launches: half of them
/// of gate, half of up), and the room for their split partial sums and arrival counters.
pub(crate) const MMS_ROWS: usize = 64;

pub(crate) const MMS_WORK_FLOATS: usize = 8 << 20;

pub(crate) const MMS_MAX_TILES: usize = 1 << 16;

/// How many blocks of an `mms_*` launch (`tiles` tiles, rows of `steps` 256-value steps,
/// `npad` tokens) share each tile's row length: enough blocks for `blocks_per_sm` per SM
/// (as many of the kernel's blocks as are resident at once), at
/// least two steps each, and room for the partial sums. Every split gets at least one step
/// (the count is recomputed from the steps per split).
pub(crate) fn mms_splits(
    tiles: usize,
    steps: usize,
    npad: usize,
    sms: usize,
    blocks_per_sm: usize,
) -> usize {
    if tiles == 0 || steps < 4 || tiles > MMS_MAX_TILES {
        return 1;
    }
    let want = (blocks_per_sm * sms).div_ceil(tiles).min(steps / 2);
    if want <= 1 {
        return 1;
    }
    let per = steps.div_ceil(want);
    let splits = steps.div_ceil(per);
    // Floats of partial sums per block: MMS_ROWS rows × npad tokens.
    let per_block = MMS_ROWS * npad;
    if tiles * splits * per_block > MMS_WORK_FLOATS {
        return 1;
    }
    splits
}

/// Token rows the int8 `mmq_*` kernels' activations take for a step of `n` tokens (whole
/// 8-token tiles; `quantize_x_mmq` / `rms_norm_mmq` zero the padding).
pub(crate) fn mmq_int8_rows(n: usize) -> usize {
    n.next_multiple_of(8)
}

impl CudaBackend {
    /// The GEMV launch `args` (see [`Self::gemv`]) on the tensor cores: x quantized to 8 bits
    /// for a multiple of 8 tokens, then one block per 16 rows.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn mmq(
        &self,
        x: &CudaTensor,
        ready: &mut Prepared,
        n: usize,
        segs: &[GemvSeg],
        gated: bool,
        args: &[Arg],
        weight_bytes: u64,
        kernel: Kernel,
    ) {
        let k = x.cols;
        let npad = plan::mmq_rows(kernel, n);
        let Some(bufs) = self.q8_buffers(npad * k) else {
            return;
        };
        let (xk, xb) = bufs.mmk_steps_sums(npad, k);
        let Q8Ptrs {
            q: q_ptr,
            ds: ds_ptr,
            work,
            count,
            ..
        } = bufs;
        // The activations as the kernels read them (8 bits with the block sums; npad rows),
        // then the product: its kernel, grid, block and leading arguments.
        let prep_args = [
            Arg::P(x.ptr),
            Arg::I(k as i32),
            Arg::I(n as i32),
            Arg::I(npad as i32),
        ];
        let (kernel, blocks, threads, mut kernel_args) = match kernel {
            Kernel::Mms => {
                let layout = Prepared::Mmq {
                    of: x.ptr,
                    n,
                    npad,
                    mmk: true,
                };
                if *ready != layout {
                    self.quantize_mmk(&prep_args, k, npad, [q_ptr, xk, xb]);
                    *ready = layout;
                }
                // Kernel names by tile (16, 32 tokens) and gated.
                const MMS: [[&str; 2]; 2] =
                    [["mms_t16", "mms_t16_gated"], ["mms_t32", "mms_t32_gated"]];
                let tile = usize::from(npad > 16);
                let tiles = gemv_warps(segs, gated, if gated { MMS_ROWS / 2 } else { MMS_ROWS });
                let per_sm = 3; // MMS_KERNEL's launch bounds for tiles of up to 32 tokens
                let splits = mms_splits(tiles, k / 256, npad, self.sm_count, per_sm);
                let args = vec![
                    Arg::P(q_ptr),
                    Arg::P(xk),
                    Arg::P(xb),
                    Arg::I(npad as i32),
                    Arg::I(splits as i32),
                    Arg::P(work),
                    Arg::P(count),
                ];
                // MS_THREADS (kernels/mmq.cu): two warps per 16 rows, each half the tokens.
                const MMS_THREADS: u32 = 8 * 32;
                (MMS[tile][gated as usize], tiles * splits, MMS_THREADS, args)
            }
            _ => {
                let tiles = gemv_warps(segs, gated, 16);
                let mmk = kernel == Kernel::Mmk;
                let layout = Prepared::Mmq {
                    of: x.ptr,
                    n,
                    npad,
                    mmk,
                };
                if *ready != layout {
                    *ready = layout;
                    if mmk {
                        self.quantize_mmk(&prep_args, k, npad, [q_ptr, xk, xb]);
                    } else {
                        let outs = [Arg::P(q_ptr), Arg::P(ds_ptr)];
                        self.launch(
                            "quantize_x_mmq",
                            grid_1d(npad * k / 32, 8),
                            256,
                            &[&prep_args[..], &outs].concat(),
                        );
                    }
                }
                // MQ_WARPS / MK_WARPS (kernels/mmq.cu) warps a block, one block per 16 rows.
                const MMQ_THREADS: u32 = 8 * 32;
                if mmk {
                    let name = match gated {
                        true if segs[0].ty == GgmlType::Q4K => "mmk_t8_gated_q4k",
                        true => "mmk_t8_gated_q6k",
                        false => "mmk_t8_pipe",
                    };
                    let args = vec![Arg::P(q_ptr), Arg::P(xk), Arg::P(xb), Arg::I(npad as i32)];
                    (name, tiles, MMQ_THREADS, args)
                } else {
                    let args = vec![Arg::P(q_ptr), Arg::P(ds_ptr), Arg::I(npad as i32)];
                    let name = if gated { "mmq_t8_gated" } else { "mmq_t8" };
                    (name, tiles, MMQ_THREADS, args)
                }
            }
        };
        kernel_args.extend_from_slice(args);
        let grid = (blocks as u32, 1, 1);
        self.launch_reading(kernel, grid, threads, &kernel_args, weight_bytes);
    }

    /// `quantize_x_mmk` of `npad` token rows of `k` values (`prep_args`: x, k, n, npad) into
    /// `outs` (the int8 values, the per-256 steps, the group sums).
    pub(crate) fn quantize_mmk(&self, prep_args: &[Arg], k: usize, npad: usize, outs: [u64; 3]) {
        let outs = outs.map(Arg::P);
        self.launch(
            "quantize_x_mmk",
            ((k / 256) as u32, npad as u32, 1),
            256,
            &[prep_args, &outs].concat(),
        );
    }
}
