//! The kernel a product runs on, decided once per call from the weights' format, the token
//! count, the matrix shape and what the backend has for this step. Every rule is a pure
//! function of those facts, so the choice is unit-tested as a table (below, and the same
//! table in ARCHITECTURE.md) and the launchers only carry it out.
//!
//! [`plan`] is a single product's choice (`matmul`); [`plan_launch`] is the GEMV-family choice
//! of one launch over up to three matrices sharing the activations (Q/K/V; gated: gate and
//! up), which every matrix of it must allow. Within a family the launcher still picks the
//! variant that suits the launch's size (rows per warp, token tile, `_gated`, byte formats).

use crate::*;

/// The kernel family a product runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// cuBLAS `GemmEx` on f16 operands: the weights' f16 copy (or F16 weights, or a copy
    /// dequantized for the call) and the activations converted to f16.
    Cublas,
    /// `mms_t16` / `mms_t32`: int8 activations per 256 values, weights and activations
    /// staged in shared memory (kernels/mmq.cu).
    Mms,
    /// `mmk_t8_pipe` / `mmk_t8_gated_*`: int8 activations per 256 values, integer sums per
    /// super-block, 8-token tiles (kernels/mmq.cu).
    Mmk,
    /// `mmq_t8` / `mmq_t8_gated`: int8 activations per 32 values, 8-token tiles
    /// (kernels/mmq.cu).
    Mmq,
    /// `gemv_ws_r1`: one row a warp, the weights staged by cp.async (kernels/gemv.cu).
    GemvWs,
    /// `gemv_q8*`: 8-bit activations per 32 values (kernels/gemv.cu).
    GemvQ8,
    /// `gemv_dec` / `gemv_dec_r1`: a single token on f32 activations (kernels/gemv.cu).
    GemvDec,
    /// `gemv`: 2..=8 tokens on f32 activations (kernels/gemv.cu).
    Gemv,
    /// `matmul`: any format and size, the fallback (kernels/quant.cu).
    Matmul,
}

impl Kernel {
    /// Whether the kernel reads 8-bit activations.
    pub fn q8(self) -> bool {
        matches!(
            self,
            Kernel::Mms | Kernel::Mmk | Kernel::Mmq | Kernel::GemvWs | Kernel::GemvQ8
        )
    }

    /// Whether its 8-bit activations are quantized per 256 values (`mmk_t8*`'s layout).
    pub fn per_256(self) -> bool {
        matches!(self, Kernel::Mms | Kernel::Mmk)
    }

    /// Whether it is one of the int8 tensor-core kernels of steps of several tokens.
    pub fn tensor_core(self) -> bool {
        matches!(self, Kernel::Mms | Kernel::Mmk | Kernel::Mmq)
    }
}

/// What the choice depends on besides the matrices and the token count.
#[derive(Clone, Copy, Debug)]
pub struct Context {
    /// cuBLAS is present and the step is not being recorded for graph replay, or is
    /// recorded with its cuBLAS products (`record_step`: larger steps; the small steps the
    /// GEMV and tensor-core kernels take are recorded without cuBLAS).
    pub cublas: bool,
    /// 8-bit activations are on (`KESTREL_CUDA_Q8`).
    pub q8: bool,
    /// `mmk_t8*` takes the K-quant launches of up to 8 tokens (the self-check turns it off).
    pub mmk: bool,
    /// Rows per warp forced on single-token `gemv_q8` launches (0: by launch; the
    /// self-check forces 1 and 2, which keeps them off `gemv_ws_r1`).
    pub forced_rows: usize,
    /// Streaming multiprocessors of the device.
    pub sm_count: usize,
    /// Values the 8-bit activation buffers hold.
    pub q8_capacity: usize,
}

/// One matrix of a product as the choice sees it.
#[derive(Clone, Copy, Debug)]
pub struct Matrix {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    /// Bytes a row takes on the device.
    pub row_bytes: usize,
    /// Rows start 16-byte aligned (cp.async: `gemv_ws_r1`).
    pub aligned: bool,
    /// cuBLAS can read it as f16 without dequantizing it (an f16 copy, or F16 weights).
    pub f16: bool,
}

impl Matrix {
    /// A weight matrix as the choice sees it (None: a vector).
    pub fn of(w: &CudaWeight) -> Option<Matrix> {
        let CudaWeight::Matrix {
            ptr,
            ty,
            rows,
            cols,
            row_bytes,
            ..
        } = w
        else {
            return None;
        };
        Some(Matrix {
            ty: *ty,
            rows: *rows,
            cols: *cols,
            row_bytes: *row_bytes,
            aligned: ptr.is_multiple_of(16) && row_bytes.is_multiple_of(16),
            f16: w.has_f16(),
        })
    }
}

/// Whether the GEMV kernels read `ty` with rows of `cols` values.
pub fn gemv_supported(ty: GgmlType, cols: usize) -> bool {
    match ty {
        GgmlType::Q4K | GgmlType::Q6K => cols.is_multiple_of(256),
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::IQ4NL | GgmlType::MXFP4 => {
            cols.is_multiple_of(32)
        }
        GgmlType::IQ4XS => cols.is_multiple_of(256),
        GgmlType::F16 | GgmlType::BF16 => cols.is_multiple_of(8),
        GgmlType::F32 => cols.is_multiple_of(4),
        _ => false,
    }
}

/// Weight types the 8-bit GEMVs read.
pub fn q8_supported(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4K
            | GgmlType::Q6K
            | GgmlType::Q8_0
            | GgmlType::Q4_0
            | GgmlType::IQ4NL
            | GgmlType::IQ4XS
            | GgmlType::MXFP4
    )
}

fn k_quant(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4K | GgmlType::Q6K)
}

/// Whether products of `n` tokens with `ty` weights go through the int8 tensor-core
/// kernels (MMQ_MIN_TOKENS..=MMQ_MAX_TOKENS tokens): Q4_K / Q6_K, and Q8_0 / Q4_0 up to 8
/// tokens (faster than cuBLAS on the f16 copies there since their rows are 16-byte aligned:
/// B = 8, Q4_0 992 → 1,318, Q8_0 926 → 1,126 t/s).
pub fn mmq_reads(ty: GgmlType, n: usize, q8: bool) -> bool {
    q8 && (MMQ_MIN_TOKENS..=MMQ_MAX_TOKENS).contains(&n)
        && match ty {
            GgmlType::Q4K | GgmlType::Q6K => true,
            GgmlType::Q8_0 | GgmlType::Q4_0 => n <= 8,
            _ => false,
        }
}

/// Whether those products take the staged kernels `mms_*`: Q4_K / Q6_K from MMS_MIN_TOKENS.
pub fn mms_reads(ty: GgmlType, n: usize, k: usize, q8: bool) -> bool {
    mmq_reads(ty, n, q8) && n >= MMS_MIN_TOKENS && k.is_multiple_of(256) && k_quant(ty)
}

/// Whether an 8-token int8 launch of `tiles` 16-row tiles over these types goes to
/// `mmk_t8*` rather than `mmq_t8`. Launches of more than MMK_MAX_WAVES waves of 2 blocks a
/// SM (the LM head) stay on `mmq_t8`: on the H100 the Q6_K LM head took 305–370 µs on
/// `mmk_t8` against 261 µs on `mmq_t8` (B = 8).
pub fn mmk_reads(k: usize, tiles: usize, types: &[GgmlType], cx: &Context) -> bool {
    cx.mmk
        && tiles <= MMK_MAX_WAVES * 2 * cx.sm_count
        && k.is_multiple_of(256)
        && types.iter().all(|&ty| k_quant(ty))
}

/// Whether the 8-bit GEMVs (`gemv_q8*`) read `ty` for `n` tokens.
pub fn q8_gemv_reads(ty: GgmlType, n: usize, q8: bool) -> bool {
    q8 && (1..=GEMV_MAX_TOKENS).contains(&n) && q8_supported(ty)
}

/// Whether a single-token 8-bit launch of `warps` warps at one row a warp takes one row a
/// warp: when that still fits in one wave of resident warps (5 blocks of 4 per SM:
/// `gemv_ws_r1` and `gemv_q8_b_r1`; `gemv_q8_r1` fits 4 with its 64-value units — measured
/// at 5 and kept, within the spread). Short rows used to take one row a warp at any size;
/// with one short row a warp, a launch of several waves keeps too few bytes in flight a SM
/// (~1.3 KB a warp): two rows a warp beyond one wave for them too, on Qwen2.5-1.5B's
/// gate/up (3.4 waves) and LM head (58), gave tg128 +3.5% (five alternated pairs).
pub fn one_row_a_warp(warps: usize, sm_count: usize) -> bool {
    warps <= sm_count * 20
}

/// Whether a product of `n` tokens with `m` goes through cuBLAS: only where `cx.cublas`;
/// never where the int8 tensor-core kernels take it; from GEMM_MIN_TOKENS tokens, or from 2
/// when `m` needs no dequantizing (f16 copy or F16 weights: one read of 2 bytes per weight
/// beats the GEMV kernels' per-token cost) unless the 8-bit GEMVs take it (up to
/// Q8_GEMV_MAX_TOKENS; measured at 8 tokens, Llama-3-8B Q4_K_M: gemv_q8_t8 575 t/s, cuBLAS
/// on the f16 copies 705).
pub fn prefer_gemm(m: &Matrix, n: usize, cx: &Context) -> bool {
    if mmq_reads(m.ty, n, cx.q8) && gemv_supported(m.ty, m.cols) {
        return false;
    }
    let q8_gemv = n <= Q8_GEMV_MAX_TOKENS && q8_gemv_reads(m.ty, n, cx.q8);
    cx.cublas && (n >= GEMM_MIN_TOKENS || (n >= 2 && m.f16 && !q8_gemv))
}

/// One GEMV-family launch over `mats` (all rows of `k` values) for `n` tokens.
#[derive(Clone, Copy, Debug)]
pub struct Launch<'a> {
    pub mats: &'a [Matrix],
    pub k: usize,
    pub n: usize,
    /// Gate and up (two matrices): `act(gate·x) * (up·x)` into the first's output.
    pub gated: bool,
    /// Adds into the outputs (the residual) instead of overwriting them.
    pub accumulate: bool,
}

impl Launch<'_> {
    /// Warps of the launch at `rows_per_warp` (gated: gate's rows, each warp reading up's).
    fn warps(&self, rows_per_warp: usize) -> usize {
        if self.gated {
            self.mats[0].rows.div_ceil(rows_per_warp)
        } else {
            self.mats
                .iter()
                .map(|m| m.rows.div_ceil(rows_per_warp))
                .sum()
        }
    }

    fn all(&self, f: impl Fn(&Matrix) -> bool) -> bool {
        self.mats.iter().all(f)
    }
}

/// The tokens the int8 tensor-core kernels' activations are quantized for: a power of two
/// (16 or 32) for `mms_*`, 8 for the 8-token kernels.
pub fn mmq_rows(kernel: Kernel, n: usize) -> usize {
    if kernel == Kernel::Mms {
        n.next_power_of_two()
    } else {
        n.next_multiple_of(8)
    }
}

/// The GEMV-family kernel of `l`, or None when none takes it (more than GEMV_MAX_TOKENS
/// tokens outside the tensor-core kernels' range).
pub fn plan_launch(l: &Launch, cx: &Context) -> Option<Kernel> {
    let (k, n) = (l.k, l.n);
    // (On the stack: the choice runs for every product of every step.)
    let mut formats = [GgmlType::F32; 3];
    for (f, m) in formats.iter_mut().zip(l.mats) {
        *f = m.ty;
    }
    let types = &formats[..l.mats.len().min(3)];
    // Gated launches need gate and up of one format and row length.
    let same_pair =
        !l.gated || (types[0] == types[1] && l.mats[0].row_bytes == l.mats[1].row_bytes);
    if k.is_multiple_of(32) && l.all(|m| mmq_reads(m.ty, n, cx.q8)) && same_pair {
        let kernel = if l.all(|m| mms_reads(m.ty, n, k, cx.q8)) {
            Kernel::Mms
        } else if mmk_reads(k, l.warps(16), types, cx) {
            Kernel::Mmk
        } else {
            Kernel::Mmq
        };
        if mmq_rows(kernel, n) * k <= cx.q8_capacity {
            return Some(kernel);
        }
    }
    if n > GEMV_MAX_TOKENS {
        return None;
    }
    let q8 = k.is_multiple_of(32)
        && l.all(|m| q8_gemv_reads(m.ty, n, cx.q8))
        // Only the single-token kernels add into their outputs.
        && (n == 1 || !l.accumulate)
        && n * k <= cx.q8_capacity;
    Some(if q8 {
        let ws_formats = if l.gated {
            types[0] == GgmlType::Q4K && same_pair
        } else {
            types.iter().all(|&ty| k_quant(ty))
        };
        let ws = n == 1
            && cx.forced_rows == 0
            && ws_formats
            && l.all(|m| m.aligned)
            && one_row_a_warp(l.warps(1), cx.sm_count);
        if ws { Kernel::GemvWs } else { Kernel::GemvQ8 }
    } else if n == 1 {
        Kernel::GemvDec
    } else {
        Kernel::Gemv
    })
}

/// The kernel of `out = x · mᵀ` for `n` tokens, and why.
pub fn plan(m: &Matrix, n: usize, cx: &Context) -> (Kernel, &'static str) {
    if prefer_gemm(m, n, cx) {
        return (
            Kernel::Cublas,
            if n >= GEMM_MIN_TOKENS {
                "prompt-sized: the tensor cores on f16 operands"
            } else {
                "a few tokens with an f16 copy: one 2-byte read a weight for all tokens"
            },
        );
    }
    let single = Launch {
        mats: std::slice::from_ref(m),
        k: m.cols,
        n,
        gated: false,
        accumulate: false,
    };
    let kernel = if gemv_supported(m.ty, m.cols) {
        plan_launch(&single, cx)
    } else {
        None
    };
    let Some(kernel) = kernel else {
        return (
            Kernel::Matmul,
            if gemv_supported(m.ty, m.cols) {
                "more tokens than the GEMVs take, cuBLAS not chosen (recorded step, or no f16 copy below GEMM_MIN_TOKENS)"
            } else {
                "a format or row length the GEMVs do not read"
            },
        );
    };
    let why = match kernel {
        Kernel::Mms => "9..=32 tokens of a K-quant: staged int8 tiles",
        Kernel::Mmk => "3..=8 tokens of a K-quant: int8 per 256 values",
        Kernel::Mmq if k_quant(m.ty) => "3..=8 tokens of a K-quant beyond 8 waves (LM head)",
        Kernel::Mmq => "3..=8 tokens of Q8_0 / Q4_0: int8 per 32 values",
        Kernel::GemvWs => "one token, K-quant rows within one wave: staged weights",
        Kernel::GemvQ8 => "1..=8 tokens of a Q8-capable format: 8-bit activations",
        Kernel::GemvDec => "one token on f32 activations",
        _ => "2..=8 tokens on f32 activations",
    };
    (kernel, why)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An H100 with cuBLAS usable and the buffers a 64-token step reserves.
    fn h100() -> Context {
        Context {
            cublas: true,
            q8: true,
            mmk: true,
            forced_rows: 0,
            sm_count: 132,
            q8_capacity: 64 * 14336,
        }
    }

    fn matrix(ty: GgmlType, rows: usize, cols: usize, f16: bool) -> Matrix {
        let row_bytes = ty.bytes_for(cols as u64).unwrap() as usize;
        Matrix {
            ty,
            rows,
            cols,
            row_bytes,
            aligned: true,
            f16,
        }
    }

    /// Token counts of each class: 1, 2..=8, 9..=32, 33..=64, 65+.
    const CLASSES: [(&str, &[usize]); 5] = [
        ("1", &[1]),
        ("2..8", &[2, 3, 4, 5, 8]),
        ("9..32", &[9, 16, 17, 32]),
        ("33..64", &[33, 64]),
        ("65+", &[65, 512]),
    ];

    /// The dispatch table of ARCHITECTURE.md: per format (a 2048 × 4096 matrix, within one
    /// wave of single-token warps on the H100, with its f16 copy, as the backend keeps when
    /// memory allows) and token class, the kernel of every count of the class. Changing a
    /// rule changes this table and the document together.
    #[test]
    fn dispatch_table() {
        use GgmlType as T;
        use Kernel::*;
        let table: [(GgmlType, [&[Kernel]; 5]); 14] = [
            (
                T::Q4K,
                [
                    &[GemvWs],
                    &[GemvQ8, Mmk, Mmk, Mmk, Mmk],
                    &[Mms; 4],
                    &[Cublas; 2],
                    &[Cublas; 2],
                ],
            ),
            (
                T::Q6K,
                [
                    &[GemvWs],
                    &[GemvQ8, Mmk, Mmk, Mmk, Mmk],
                    &[Mms; 4],
                    &[Cublas; 2],
                    &[Cublas; 2],
                ],
            ),
            (
                T::Q8_0,
                [
                    &[GemvQ8],
                    &[GemvQ8, Mmq, Mmq, Mmq, Mmq],
                    &[Cublas; 4],
                    &[Cublas; 2],
                    &[Cublas; 2],
                ],
            ),
            (
                T::Q4_0,
                [
                    &[GemvQ8],
                    &[GemvQ8, Mmq, Mmq, Mmq, Mmq],
                    &[Cublas; 4],
                    &[Cublas; 2],
                    &[Cublas; 2],
                ],
            ),
            (
                T::IQ4NL,
                [
                    &[GemvQ8],
                    &[GemvQ8, GemvQ8, GemvQ8, Cublas, Cublas],
                    &[Cublas; 4],
                    &[Cublas; 2],
                    &[Cublas; 2],
                ],
            ),
            (
                T::IQ4XS,
                [
                    &[GemvQ8],
                    &[GemvQ8, GemvQ8, GemvQ8, Cublas, Cublas],
                    &[Cublas; 4],
                    &[Cublas; 2],
                    &[Cublas; 2],
                ],
            ),
            (
                T::MXFP4,
                [
                    &[GemvQ8],
                    &[GemvQ8, GemvQ8, GemvQ8, Cublas, Cublas],
                    &[Cublas; 4],
                    &[Cublas; 2],
                    &[Cublas; 2],
                ],
            ),
            (
                T::Q5_0,
                [
                    &[GemvDec],
                    &[Cublas; 5],
                    &[Cublas; 4],
                    &[Cublas; 2],
                    &[Cublas; 2],
                ],
            ),
            (
                T::F16,
                [
                    &[GemvDec],
                    &[Cublas; 5],
                    &[Cublas; 4],
                    &[Cublas; 2],
                    &[Cublas; 2],
                ],
            ),
            (
                T::BF16,
                [
                    &[GemvDec],
                    &[Cublas; 5],
                    &[Cublas; 4],
                    &[Cublas; 2],
                    &[Cublas; 2],
                ],
            ),
            (
                T::F32,
                [
                    &[GemvDec],
                    &[Cublas; 5],
                    &[Cublas; 4],
                    &[Cublas; 2],
                    &[Cublas; 2],
                ],
            ),
            (
                T::Q4_1,
                [
                    &[Matmul],
                    &[Cublas; 5],
                    &[Cublas; 4],
                    &[Cublas; 2],
                    &[Cublas; 2],
                ],
            ),
            (
                T::Q5_1,
                [
                    &[Matmul],
                    &[Cublas; 5],
                    &[Cublas; 4],
                    &[Cublas; 2],
                    &[Cublas; 2],
                ],
            ),
            (
                T::Q5K,
                [
                    &[Matmul],
                    &[Cublas; 5],
                    &[Cublas; 4],
                    &[Cublas; 2],
                    &[Cublas; 2],
                ],
            ),
        ];
        let cx = h100();
        for (ty, row) in table {
            let m = matrix(ty, 2048, 4096, true);
            for ((class, counts), want) in CLASSES.iter().zip(row) {
                for (&n, &want) in counts.iter().zip(want) {
                    let (got, why) = plan(&m, n, &cx);
                    assert_eq!(got, want, "{ty} n={n} ({class}): {why}");
                    assert!(!why.is_empty());
                }
            }
        }
    }

    /// Without f16 copies (memory short) small batches stay on the GEMVs up to 8 tokens and
    /// take cuBLAS from GEMM_MIN_TOKENS (dequantizing per call); in between, outside the
    /// tensor-core kernels' formats, `matmul`.
    #[test]
    fn without_f16_copies() {
        let cx = h100();
        let q5 = matrix(GgmlType::Q5_0, 4096, 4096, false);
        assert_eq!(plan(&q5, 4, &cx).0, Kernel::Gemv);
        assert_eq!(plan(&q5, 9, &cx).0, Kernel::Matmul);
        assert_eq!(plan(&q5, GEMM_MIN_TOKENS, &cx).0, Kernel::Cublas);
        let q8 = matrix(GgmlType::Q8_0, 4096, 4096, false);
        assert_eq!(plan(&q8, 2, &cx).0, Kernel::GemvQ8);
        assert_eq!(plan(&q8, 12, &cx).0, Kernel::Matmul);
    }

    /// A step recorded without cuBLAS (`record_step`): the GEMVs keep up to 8 tokens,
    /// the tensor-core kernels their range, `matmul` the rest.
    #[test]
    fn recorded_steps_never_take_cublas() {
        let cx = Context {
            cublas: false,
            ..h100()
        };
        for ty in [GgmlType::Q4K, GgmlType::Q8_0, GgmlType::F16, GgmlType::Q4_1] {
            let m = matrix(ty, 4096, 4096, true);
            for n in [1, 2, 8, 9, 32, 33, 64, 512] {
                assert_ne!(plan(&m, n, &cx).0, Kernel::Cublas, "{ty} n={n}");
            }
        }
        let q4k = matrix(GgmlType::Q4K, 4096, 4096, true);
        assert_eq!(plan(&q4k, 33, &cx).0, Kernel::Matmul);
        let f16 = matrix(GgmlType::F16, 4096, 4096, true);
        assert_eq!(plan(&f16, 4, &cx).0, Kernel::Gemv);
    }

    /// With 8-bit activations off every product computes on f32 activations.
    #[test]
    fn q8_off_keeps_f32_activations() {
        let cx = Context {
            q8: false,
            ..h100()
        };
        for ty in [GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q8_0, GgmlType::Q4_0] {
            let m = matrix(ty, 4096, 4096, true);
            for n in 1..=64 {
                assert!(!plan(&m, n, &cx).0.q8(), "{ty} n={n}");
            }
            assert_eq!(plan(&m, 1, &cx).0, Kernel::GemvDec);
        }
    }

    /// Shape rules: the LM head (128,256 rows: beyond 8 waves) stays on `mmq_t8` at 3..=8
    /// tokens; single-token launches of more than one wave of warps, unaligned rows or forced
    /// rows per warp leave `gemv_ws_r1`; too small 8-bit buffers leave the 8-bit kernels.
    #[test]
    fn shape_rules() {
        let cx = h100();
        let head = matrix(GgmlType::Q6K, 128_256, 4096, true);
        assert_eq!(plan(&head, 8, &cx).0, Kernel::Mmq);
        assert_eq!(plan(&head, 1, &cx).0, Kernel::GemvQ8);
        let small = matrix(GgmlType::Q4K, 132 * 20, 4096, true);
        assert_eq!(plan(&small, 1, &cx).0, Kernel::GemvWs);
        let wide = matrix(GgmlType::Q4K, 132 * 20 + 1, 4096, true);
        assert_eq!(plan(&wide, 1, &cx).0, Kernel::GemvQ8);
        let unaligned = Matrix {
            aligned: false,
            ..small
        };
        assert_eq!(plan(&unaligned, 1, &cx).0, Kernel::GemvQ8);
        let forced = Context {
            forced_rows: 2,
            ..cx
        };
        assert_eq!(plan(&small, 1, &forced).0, Kernel::GemvQ8);
        let no_mmk = Context { mmk: false, ..cx };
        assert_eq!(plan(&small, 8, &no_mmk).0, Kernel::Mmq);
        let tight = Context {
            q8_capacity: 4096 * 8,
            ..cx
        };
        // 9 tokens quantize 16 rows for mms_*: too many, and too many tokens for the GEMVs
        // (cuBLAS does not take steps the tensor-core kernels read).
        assert_eq!(plan(&small, 9, &tight).0, Kernel::Matmul);
        assert_eq!(plan(&small, 8, &tight).0, Kernel::Mmk);
    }

    /// Launches of several matrices: each must allow the kernel (Q/K/V with a Q8_0 V at 9
    /// tokens leaves the tensor-core kernels; gate and up of different formats leave mmq).
    #[test]
    fn launches_of_several_matrices() {
        let cx = h100();
        let q = matrix(GgmlType::Q4K, 1024, 4096, true);
        let v6 = matrix(GgmlType::Q6K, 256, 4096, true);
        let v8 = matrix(GgmlType::Q8_0, 256, 4096, true);
        let launch = |mats: &[Matrix], n, gated| {
            plan_launch(
                &Launch {
                    mats,
                    k: 4096,
                    n,
                    gated,
                    accumulate: false,
                },
                &cx,
            )
        };
        assert_eq!(launch(&[q, q, v6], 16, false), Some(Kernel::Mms));
        assert_eq!(launch(&[q, q, v8], 16, false), None);
        assert_eq!(launch(&[q, q, v8], 8, false), Some(Kernel::Mmq));
        assert_eq!(launch(&[q, q, v6], 8, false), Some(Kernel::Mmk));
        assert_eq!(launch(&[q, q, v6], 1, false), Some(Kernel::GemvWs));
        assert_eq!(launch(&[q, v6], 1, true), Some(Kernel::GemvQ8));
        assert_eq!(launch(&[q, q], 1, true), Some(Kernel::GemvWs));
        assert_eq!(launch(&[q, v6], 8, true), Some(Kernel::GemvQ8));
        // Residual adds of 2..=8 tokens outside the tensor-core kernels stay on f32.
        let add = Launch {
            mats: &[v8],
            k: 4096,
            n: 2,
            gated: false,
            accumulate: true,
        };
        assert_eq!(plan_launch(&add, &cx), Some(Kernel::Gemv));
    }
}
