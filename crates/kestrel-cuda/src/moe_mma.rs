//! Mixture-of-experts blocks of multi-token steps on the tensor cores (kernels/moe_mma.cu):
//! after `moe_router` and `moe_route` (moe.rs), the (token, slot) pairs are grouped by
//! expert on the device (`moe_mma_group`: counts, each expert's run of places padded to a
//! whole tile, the gather order, the tiles), their inputs gathered and quantized to 8 bits,
//! then per tile of one expert's places int8 products over that expert's rows: gate and up
//! with the activation, the activations quantized again, down scaled by each pair's routing
//! weight, and each token's k outputs added in slot order (`moe_combine`, moe.rs's).
//!
//! Two families of expert formats ([`Family`]):
//! - Q4_K / Q6_K experts (what Q4_K_M files hold) without biases or gpt-oss's clamped
//!   SwiGLU, rows multiples of 256: activations per 256 values (`moe_mma_quantize`, as
//!   `quantize_x_mmk`), the staged products of the `mms_*` kernels (`moe_mms_*`);
//! - Q8_0 / Q4_0 / IQ4_NL / MXFP4 experts (gpt-oss's as published), rows multiples of 32,
//!   with or without gpt-oss's expert biases and clamped SwiGLU: activations per 32 values as
//!   ggml's Q8_0 (`moe_mma_quantize32`), mmq's block products (`moe_mq_*`: MXFP4's doubled
//!   e2m1 levels are integers and its scale a power of two, so each block's int8 product is
//!   exact), the biases, the activation and the routing weight in their epilogues. MXFP4 and
//!   IQ4_NL experts in prompt-sized steps ([`staged`]) take `moe_mqs_*` instead: tiles of 64
//!   places, each 256-value step of the block's weight rows and activations staged in
//!   shared memory for all its warps.
//!
//! Only while 8-bit activations are on (`KESTREL_CUDA_Q8`, as for the dense int8
//! products); other blocks keep moe.rs's kernels. Grids are sized for the worst case of the
//! step's size (tiles past the count exit), so steps record and replay as graphs with no
//! host round trip. A token's result does not depend on the rest of the step (its
//! activations are quantized on their own, its mma column is its own, a row's sums run in
//! an order fixed by the row).

use crate::moe::Experts;
use crate::*;
use kestrel_model::MoeConfig;

/// The kernels this module launches (kernels/moe_mma.cu).
pub(crate) const KERNELS: &[&str] = &[
    "moe_mma_group",
    "moe_mma_quantize",
    "moe_mms_gate_up_t16",
    "moe_mms_gate_up_t32",
    "moe_mms_down_t16",
    "moe_mms_down_t32",
    "moe_mma_quantize32",
    "moe_mq_gate_up_t16",
    "moe_mq_gate_up_t32",
    "moe_mq_down_t16",
    "moe_mq_down_t32",
    "moe_mqs_gate_up",
    "moe_mqs_down",
];

/// Rows a gate/up block takes (of gate and the same of up) and a down block takes
/// (MH_ROWS / 2, MH_ROWS in kernels/mmq.cu).
const GATE_UP_ROWS: usize = 32;
const DOWN_ROWS: usize = 64;
/// Rows a `moe_mq_*` block takes (of gate and the same of up; MQE_ROWS).
const MQ_ROWS: usize = 64;
/// Threads of the `mms_*` blocks (MS_THREADS).
const THREADS: u32 = 256;
/// Places a `moe_mqs_*` tile takes (MQS_TOK), rows a gate/up block takes (of gate and
/// the same of up) and a down block takes.
const MQS_TILE: usize = 64;
const MQS_GATE_UP_ROWS: usize = 64;
const MQS_DOWN_ROWS: usize = 128;
/// Dynamic shared memory of `moe_mqs_*` (MQS_SMEM): two stages of 128 weight rows' quants
/// (144 bytes each) and scales (16), and of 64 places' activations (272 bytes each) and
/// {d, d·Σq} of 8 blocks.
pub(crate) const MQS_SMEM: u32 = 2 * (128 * 144 + 128 * 16 + 64 * 272 + 8 * 64 * 8);
/// The largest tile (places of one expert a block multiplies).
const MAX_TILE: usize = MQS_TILE;

/// Places of one tile for a step of `pairs` pairs over `n_expert` experts: 16 while an
/// expert gets at most 16 on average, else 32.
pub(crate) fn tile_for(pairs: usize, n_expert: usize) -> usize {
    if pairs <= 16 * n_expert { 16 } else { 32 }
}

/// Places (padded runs) and tiles a step of `pairs` pairs can need with tiles of `tile`:
/// each used expert's run rounds up to a whole tile.
pub(crate) fn worst_case(pairs: usize, n_expert: usize, tile: usize) -> (usize, usize) {
    let used = n_expert.min(pairs);
    (pairs + used * (tile - 1), pairs.div_ceil(tile) + used)
}

/// The kernels a block's experts take on this path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Family {
    /// Q4_K / Q6_K: `moe_mms_*` on activations per 256 values.
    KQuant,
    /// Q8_0 / Q4_0 / IQ4_NL / MXFP4: `moe_mq_*` on activations per 32 values.
    Blocks32,
}

/// Whether a step of `pairs` pairs over `n_expert` experts of this block takes the staged
/// `moe_mqs_*` kernels (tiles of MQS_TILE places): MXFP4 or IQ4_NL experts (gpt-oss's as
/// published) and more than 16 places an expert on average (prompt-sized steps; smaller
/// ones keep `moe_mq_*`'s tiles of 16 or 32).
pub(crate) fn staged(e: &Experts<'_>, pairs: usize, n_expert: usize) -> bool {
    let code4 = |w: &CudaWeight| {
        matches!(
            w,
            CudaWeight::Matrix {
                ty: GgmlType::MXFP4 | GgmlType::IQ4NL,
                ..
            }
        )
    };
    pairs > 16 * n_expert && code4(e.gate) && code4(e.up) && code4(e.down)
}

/// Which family a block takes, if any: gate and up of one type, and Q4_K / Q6_K experts
/// without expert biases and with the plain gated activation, rows multiples of 256; or
/// Q8_0 / Q4_0 / IQ4_NL / MXFP4 experts (biases and the clamped SwiGLU allowed), rows
/// multiples of 32.
pub(crate) fn family(e: &Experts<'_>, moe: &MoeConfig) -> Option<Family> {
    let ty = |w: &CudaWeight| match w {
        CudaWeight::Matrix { ty, cols, .. } => Some((*ty, *cols)),
        CudaWeight::Vector { .. } => None,
    };
    let k_quant = |t: Option<(GgmlType, usize)>| matches!(t, Some((GgmlType::Q4K | GgmlType::Q6K, cols)) if cols % 256 == 0);
    let blocks32 = |t: Option<(GgmlType, usize)>| matches!(t, Some((GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::IQ4NL | GgmlType::MXFP4, cols)) if cols % 32 == 0);
    let (g, u, dn) = (ty(e.gate), ty(e.up), ty(e.down));
    if g.map(|t| t.0) != u.map(|t| t.0) {
        return None;
    }
    let plain = !e.has_biases() && moe.clamped_swiglu.is_none();
    if k_quant(g) && k_quant(u) && k_quant(dn) && plain {
        Some(Family::KQuant)
    } else if blocks32(g) && blocks32(u) && blocks32(dn) {
        Some(Family::Blocks32)
    } else {
        None
    }
}

impl CudaBackend {
    /// Whether `moe_ffn` of `n` tokens on this layer runs on the tensor cores (8-bit
    /// activations, so only while those are on: [`Self::q8_decode`], as the dense int8
    /// products) rather than moe.rs's f32 kernels.
    pub fn moe_on_tensor_cores(
        &self,
        layer: &LayerWeights<CudaWeight>,
        moe: &MoeConfig,
        n: usize,
    ) -> bool {
        on_tensor_cores(self, &Experts::of(layer), moe, n)
    }
}

/// [`CudaBackend::moe_on_tensor_cores`] for the experts `e`.
pub(crate) fn on_tensor_cores(b: &CudaBackend, e: &Experts<'_>, moe: &MoeConfig, n: usize) -> bool {
    n > crate::moe::MOE_DEC_MAX_TOKENS && b.q8_decode() && family(e, moe).is_some()
}

/// Buffers of the path, shared by every layer, grown to the largest step seen.
pub(crate) struct MoeMmaScratch {
    /// (pairs, experts, n_embd, n_ff_exp) they were sized for.
    dims: (usize, usize, usize, usize),
    /// Activation rows of the quantized layouts (the worst case's places and a tile).
    npad: usize,
    pos: CudaSlice<i32>,
    order: CudaSlice<i32>,
    info: CudaSlice<i32>,
    /// Gathered inputs (npad × n_embd), gated activations (npad × n_ff_exp), quantized.
    xq: CudaSlice<i8>,
    xk: CudaSlice<f32>,
    xb: CudaSlice<i8>,
    a: CudaSlice<f32>,
    aq: CudaSlice<i8>,
    ak: CudaSlice<f32>,
    ab: CudaSlice<i8>,
    /// The per-32 layouts' scales ({d, d·Σq} per block and place) of the inputs and the
    /// activations (their values in `xq` / `aq`).
    xd: CudaSlice<f32>,
    ad: CudaSlice<f32>,
    /// Weighted outputs, one row of n_embd per place.
    ys: CudaSlice<f32>,
}

impl MoeMmaScratch {
    fn new(b: &CudaBackend, dims: (usize, usize, usize, usize)) -> anyhow::Result<Self> {
        let (pairs, ne, d, ff) = dims;
        // Sized for either tile: the larger pads more places, the smaller cuts more tiles.
        let cap = worst_case(pairs, ne, MAX_TILE).0;
        let tiles = worst_case(pairs, ne, 16).1;
        let npad = (cap + MAX_TILE).next_multiple_of(32);
        Ok(MoeMmaScratch {
            dims,
            npad,
            pos: b.alloc(pairs, "expert places")?,
            order: b.alloc(npad, "expert places")?,
            info: b.alloc(2 + 3 * tiles, "expert tiles")?,
            xq: b.alloc(npad * d, "quantized expert inputs")?,
            xk: b.alloc(npad * d / 256, "quantized expert inputs")?,
            xb: b.alloc(npad * d / 8, "quantized expert inputs")?,
            a: b.alloc(npad * ff, "expert activations")?,
            aq: b.alloc(npad * ff, "quantized expert activations")?,
            ak: b.alloc(npad * ff / 256, "quantized expert activations")?,
            ab: b.alloc(npad * ff / 8, "quantized expert activations")?,
            xd: b.alloc(npad * d / 32 * 2, "quantized expert inputs")?,
            ad: b.alloc(npad * ff / 32 * 2, "quantized expert activations")?,
            ys: b.alloc(npad * d, "expert outputs")?,
        })
    }
}

/// gpt-oss's expert epilogue: the device addresses of the gate, up and down biases (0:
/// none) and the clamped SwiGLU's alpha and limit (limit 0: the plain activation).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Epilogue {
    pub bg: u64,
    pub bu: u64,
    pub bd: u64,
    pub alpha: f32,
    pub limit: f32,
}

/// The grouped block of `n` tokens at x into out, given `moe_route`'s ids and weights
/// (device addresses, n · k each). The caller checked [`family`] and the shapes.
#[allow(clippy::too_many_arguments)]
pub(crate) fn moe_ffn_mma(
    b: &CudaBackend,
    x: &CudaTensor,
    e: &Experts<'_>,
    moe: &MoeConfig,
    act: Activation,
    n: usize,
    ids: u64,
    wts: u64,
    epi: Epilogue,
    out: &mut CudaTensor,
) -> anyhow::Result<()> {
    let (ne, k, ff, d) = (moe.n_expert, moe.n_expert_used, moe.n_ff_exp, x.cols);
    let pairs = n * k;
    let fam = family(e, moe).context("experts the tensor-core path does not take")?;
    let matrix = |w: &CudaWeight| match w {
        CudaWeight::Matrix {
            ptr, ty, row_bytes, ..
        } => Ok((*ptr, ty.id() as i32, *row_bytes as i64)),
        CudaWeight::Vector { .. } => bail!("a vector where stacked experts were expected"),
    };
    let (wg, tyg, rbg) = matrix(e.gate)?;
    let (wu, _, rbu) = matrix(e.up)?;
    let (wd, tyd, rbd) = matrix(e.down)?;

    let mut guard = b.moe_mma_scratch.lock().unwrap_or_else(|p| p.into_inner());
    let fits = guard.as_ref().is_some_and(|s| {
        let (sp, sne, sd, sff) = s.dims;
        sp >= pairs && sne == ne && sd == d && sff == ff
    });
    if !fits {
        let prev = guard.as_ref().map_or(0, |s| s.dims.0);
        *guard = None; // frees the old buffers first
        *guard = Some(MoeMmaScratch::new(b, (pairs.max(prev), ne, d, ff))?);
    }
    let s = guard.as_mut().expect("allocated above");
    let npad = s.npad;
    let [pos, order, info] = [b.ptr(&s.pos), b.ptr(&s.order), b.ptr(&s.info)];
    let [xq, xk, xb, xd] = [b.ptr(&s.xq), b.ptr(&s.xk), b.ptr(&s.xb), b.ptr(&s.xd)];
    let [a, aq, ak, ab, ad] = [
        b.ptr(&s.a),
        b.ptr(&s.aq),
        b.ptr(&s.ak),
        b.ptr(&s.ab),
        b.ptr(&s.ad),
    ];
    let ys = b.ptr(&s.ys);

    let mqs = fam == Family::Blocks32 && staged(e, pairs, ne);
    let tile = if mqs { MQS_TILE } else { tile_for(pairs, ne) };
    let (cap, tiles) = worst_case(pairs, ne, tile);
    b.launch(
        "moe_mma_group",
        (1, 1, 1),
        1024,
        &[
            Arg::P(ids),
            Arg::I(pairs as i32),
            Arg::I(ne as i32),
            Arg::I(tile as i32),
            Arg::I(cap as i32),
            Arg::P(pos),
            Arg::P(order),
            Arg::P(info),
        ],
    );
    // Bytes of the experts a step can read, for the profiler.
    let used = ne.min(pairs) as u64;
    let gate_up_bytes = used * (ff as u64) * (rbg + rbu) as u64;
    let down_bytes = used * (d as u64) * rbd as u64;
    let t16 = tile == 16;
    match fam {
        Family::KQuant => {
            let quantize =
                |src: u64, cols: usize, kk: usize, ord: u64, q: u64, qk: u64, qb: u64| {
                    b.launch(
                        "moe_mma_quantize",
                        (cap as u32, (cols / 256) as u32, 1),
                        256,
                        &[
                            Arg::P(src),
                            Arg::I(cols as i32),
                            Arg::I(kk as i32),
                            Arg::P(ord),
                            Arg::P(info),
                            Arg::I(npad as i32),
                            Arg::P(q),
                            Arg::P(qk),
                            Arg::P(qb),
                        ],
                    )
                };
            quantize(x.ptr, d, k, order, xq, xk, xb);
            b.launch_reading(
                if t16 {
                    "moe_mms_gate_up_t16"
                } else {
                    "moe_mms_gate_up_t32"
                },
                (ff.div_ceil(GATE_UP_ROWS) as u32, tiles as u32, 1),
                THREADS,
                &[
                    Arg::P(xq),
                    Arg::P(xk),
                    Arg::P(xb),
                    Arg::I(npad as i32),
                    Arg::P(info),
                    Arg::I(d as i32),
                    Arg::I(ff as i32),
                    Arg::P(wg),
                    Arg::L(rbg),
                    Arg::P(wu),
                    Arg::L(rbu),
                    Arg::I(tyg),
                    Arg::I(activation_id(act)),
                    Arg::P(a),
                ],
                gate_up_bytes,
            );
            quantize(a, ff, 1, 0, aq, ak, ab);
            b.launch_reading(
                if t16 {
                    "moe_mms_down_t16"
                } else {
                    "moe_mms_down_t32"
                },
                (d.div_ceil(DOWN_ROWS) as u32, tiles as u32, 1),
                THREADS,
                &[
                    Arg::P(aq),
                    Arg::P(ak),
                    Arg::P(ab),
                    Arg::I(npad as i32),
                    Arg::P(info),
                    Arg::I(ff as i32),
                    Arg::I(d as i32),
                    Arg::P(wd),
                    Arg::L(rbd),
                    Arg::I(tyd),
                    Arg::P(order),
                    Arg::P(wts),
                    Arg::P(ys),
                ],
                down_bytes,
            );
        }
        Family::Blocks32 => {
            let quantize = |src: u64, cols: usize, kk: usize, ord: u64, q: u64, qd: u64| {
                b.launch(
                    "moe_mma_quantize32",
                    (cap as u32, (cols / 32).div_ceil(8) as u32, 1),
                    256,
                    &[
                        Arg::P(src),
                        Arg::I(cols as i32),
                        Arg::I(kk as i32),
                        Arg::P(ord),
                        Arg::P(info),
                        Arg::I(npad as i32),
                        Arg::P(q),
                        Arg::P(qd),
                    ],
                )
            };
            quantize(x.ptr, d, k, order, xq, xd);
            let (gate_up, down, gate_up_rows, down_rows) = match (mqs, t16) {
                (true, _) => (
                    "moe_mqs_gate_up",
                    "moe_mqs_down",
                    MQS_GATE_UP_ROWS,
                    MQS_DOWN_ROWS,
                ),
                (false, true) => ("moe_mq_gate_up_t16", "moe_mq_down_t16", MQ_ROWS, MQ_ROWS),
                (false, false) => ("moe_mq_gate_up_t32", "moe_mq_down_t32", MQ_ROWS, MQ_ROWS),
            };
            b.launch_reading(
                gate_up,
                (ff.div_ceil(gate_up_rows) as u32, tiles as u32, 1),
                THREADS,
                &[
                    Arg::P(xq),
                    Arg::P(xd),
                    Arg::I(npad as i32),
                    Arg::P(info),
                    Arg::I(d as i32),
                    Arg::I(ff as i32),
                    Arg::P(wg),
                    Arg::L(rbg),
                    Arg::P(wu),
                    Arg::L(rbu),
                    Arg::I(tyg),
                    Arg::P(epi.bg),
                    Arg::P(epi.bu),
                    Arg::I(activation_id(act)),
                    Arg::F(epi.alpha),
                    Arg::F(epi.limit),
                    Arg::P(a),
                ],
                gate_up_bytes,
            );
            quantize(a, ff, 1, 0, aq, ad);
            b.launch_reading(
                down,
                (d.div_ceil(down_rows) as u32, tiles as u32, 1),
                THREADS,
                &[
                    Arg::P(aq),
                    Arg::P(ad),
                    Arg::I(npad as i32),
                    Arg::P(info),
                    Arg::I(ff as i32),
                    Arg::I(d as i32),
                    Arg::P(wd),
                    Arg::L(rbd),
                    Arg::I(tyd),
                    Arg::P(epi.bd),
                    Arg::P(order),
                    Arg::P(wts),
                    Arg::P(ys),
                ],
                down_bytes,
            );
        }
    }
    b.elementwise(
        "moe_combine",
        n * d,
        &[
            Arg::P(ys),
            Arg::P(pos),
            Arg::I(d as i32),
            Arg::I(k as i32),
            Arg::I(n as i32),
            Arg::P(out.ptr),
        ],
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `worst_case` sizes the grids and buffers before the routes exist: it must cover the
    /// places and tiles `moe_mma_group` lays out (each expert's run rounded up to whole
    /// tiles) for any routes: every pair on one expert, every expert used, some experts
    /// idle and one taking most, and random ones of awkward sizes.
    #[test]
    fn the_worst_case_covers_every_grouping() {
        let layout = |counts: &[usize], tile: usize| -> (usize, usize) {
            let tiles: usize = counts.iter().map(|c| c.div_ceil(tile)).sum();
            (tiles * tile, tiles)
        };
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = |m: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % m as u64) as usize
        };
        for (n, k, ne) in [
            (9, 2, 8),
            (17, 8, 128),
            (64, 8, 128),
            (300, 8, 32),
            (512, 8, 128),
            (2048, 8, 128),
            (100, 16, 1024),
        ] {
            let pairs = n * k;
            for tile in [16, 32, MQS_TILE] {
                let bound = worst_case(pairs, ne, tile);
                let fits = |c: &[usize]| {
                    let (places, tiles) = layout(c, tile);
                    places <= bound.0 && tiles <= bound.1
                };
                let mut one = vec![0; ne];
                one[ne - 1] = pairs;
                assert!(fits(&one), "{n}×{k} over {ne}, tile {tile}: one expert");
                let spread: Vec<usize> = (0..ne)
                    .map(|e| pairs / ne + usize::from(e < pairs % ne))
                    .collect();
                assert!(fits(&spread), "{n}×{k} over {ne}, tile {tile}: spread");
                // Each token's k experts distinct: k experts with n pairs each, or
                // singletons (1 pair each) beside one heavy expert.
                let mut skew = vec![0; ne];
                for (e, c) in skew.iter_mut().enumerate().take(ne.min(pairs)) {
                    *c = 1 + usize::from(e == 0) * (pairs - ne.min(pairs));
                }
                assert!(
                    fits(&skew),
                    "{n}×{k} over {ne}, tile {tile}: skewed {skew:?}"
                );
                for _ in 0..200 {
                    let mut counts = vec![0; ne];
                    for _ in 0..pairs {
                        counts[next(ne)] += 1;
                    }
                    assert!(fits(&counts), "{n}×{k} over {ne}, tile {tile}: {counts:?}");
                }
            }
        }
    }

    /// Two `moe_mqs_*` blocks fit an H100 SM (228 KiB of shared memory, 1 KiB reserved a
    /// block), as their launch bounds ask.
    #[test]
    fn staged_blocks_fit_twice_an_sm() {
        for name in ["moe_mqs_gate_up", "moe_mqs_down"] {
            let smem = crate::launch::dynamic_smem(name);
            assert_eq!(smem, 83_968, "{name}");
            assert!(2 * (smem + 1024) <= 228 << 10, "{name}: {smem}");
        }
    }

    /// The tile follows the mean places per expert.
    #[test]
    fn tiles_follow_the_mean_count() {
        assert_eq!(tile_for(64 * 8, 128), 16);
        assert_eq!(tile_for(16 * 128, 128), 16);
        assert_eq!(tile_for(16 * 128 + 1, 128), 32);
        assert_eq!(tile_for(512 * 8, 128), 32);
    }
}
