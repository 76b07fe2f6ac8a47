//! `mmw_gated` (kernels/mmw.cu): Q4_K gate/up of 33..=64 tokens on f16 mma from a repacked
//! 4-bit copy of the weights.

use crate::*;

/// The kernels this module launches (kernels/mmw.cu).
pub(crate) const KERNELS: &[&str] = &["mmw_gated"];

/// `mmw_*` (kernels/mmw.cu): bytes of one 16-row tile's 256-value step in the mmw layout,
/// the most warps (tiles) a block takes, and its staged steps (dynamic shared memory).
pub(crate) const MW_TILE_BYTES: usize = 2560;

pub(crate) const MW_MAX_WARPS: usize = 8;

pub(crate) const MW_STAGES: u32 = 3;

pub(crate) const MW_XBYTES: u32 = 64 * 528;

/// The token range of `mmw_gated`: steps of 33..=64 tokens (below, the int8 kernels keep
/// them).
pub(crate) const MMW_MIN_TOKENS: usize = 33;

pub(crate) const MMW_MAX_TOKENS: usize = 64;

impl CudaBackend {
    /// Whether gate and up of `n` tokens go to `mmw_gated` (both Q4_K with mmw copies, as
    /// many rows, n in MMW_MIN_TOKENS..=MMW_MAX_TOKENS).
    pub fn matmul_uses_mmw(&self, gate_w: &CudaWeight, up_w: &CudaWeight, n: usize) -> bool {
        let shape = |w: &CudaWeight| match w {
            CudaWeight::Matrix {
                mmw: Some(_),
                rows,
                cols,
                ..
            } => Some((*rows, *cols)),
            _ => None,
        };
        (MMW_MIN_TOKENS..=MMW_MAX_TOKENS).contains(&n) && {
            let g = shape(gate_w);
            g.is_some() && g == shape(up_w)
        }
    }

    /// `gate = act(gate_w·x) * (up_w·x)` on `mmw_gated` when [`Self::matmul_uses_mmw`]
    /// (None: not taken); the f16 copy of the result, for the down projection's cuBLAS
    /// product, is what it returns.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gate_up_mmw(
        &self,
        x: &CudaTensor,
        ready: &mut Prepared,
        gate_w: &CudaWeight,
        up_w: &CudaWeight,
        act: Activation,
        n: usize,
        gate: &mut CudaTensor,
    ) -> Option<Prepared> {
        if !self.matmul_uses_mmw(gate_w, up_w, n) {
            return None;
        }
        let (
            CudaWeight::Matrix {
                mmw: Some(wg),
                rows,
                cols,
                ..
            },
            CudaWeight::Matrix { mmw: Some(wu), .. },
        ) = (gate_w, up_w)
        else {
            return None;
        };
        if x.cols != *cols || gate.cols != *rows || n > x.rows || n > gate.rows {
            return None;
        }
        // (A failure below is recorded: the step reports it.)
        let xh = self.x_to_f16(x, n, ready)?;
        let h = self.scratch_ptr(|s| &mut s.h, n * rows)?;
        let tiles = rows.div_ceil(16);
        // Tiles a block: the fewest warps that still fill every SM once (one block a SM).
        let warps = match self.mmw_warps.load(std::sync::atomic::Ordering::Relaxed) {
            0 => tiles.div_ceil(self.sm_count.max(1)),
            w => w,
        }
        .clamp(1, MW_MAX_WARPS);
        self.launch(
            "mmw_gated",
            (tiles.div_ceil(warps) as u32, 1, 1),
            (warps * 32) as u32,
            &[
                Arg::P(xh),
                Arg::I(n as i32),
                Arg::I(*cols as i32),
                Arg::P(self.ptr(wg)),
                Arg::P(self.ptr(wu)),
                Arg::I(*rows as i32),
                Arg::I(activation_id(act)),
                Arg::P(gate.ptr),
                Arg::P(h),
            ],
        );
        // The down projection's input, as gated_act_f16 leaves it.
        Some(Prepared::F16 { of: gate.ptr, n, h })
    }

    /// Forces the warps per block of `mmw_*` (0: chosen by shape; the self-check's small
    /// matrices would otherwise only see one).
    pub fn set_mmw_warps(&self, warps: usize) {
        self.mmw_warps
            .store(warps, std::sync::atomic::Ordering::Relaxed);
    }
}
