//! Mixture-of-experts blocks on the device (kernels/moe.cu): the stacked expert matrices
//! uploaded in their block layout, the router's logits in f32 (`moe_router`: as llama.cpp
//! keeps the router, and the same for a token whatever the step's size; the ordinary
//! product rounds a multi-token step's inputs to f16 or int8, which moves near-tied
//! routes), the
//! routing of `kestrel_model::moe::route` per token in a kernel (expert ids and weights
//! stay on the device), then only the selected experts' rows read:
//! - steps of up to [`MOE_DEC_MAX_TOKENS`] tokens: one launch for gate+up (activation
//!   fused) over every (token, slot) pair, one for down (a warp per (row, slot) product,
//!   then each token's row summed over its k experts in slot order by its block; no
//!   atomics);
//!   with 8-bit activations on (the default) and every expert matrix in a format of
//!   [`Q8_EXPERT_TYPES`], the router also quantizes the inputs and `moe_gate_up_q8` /
//!   `moe_down_q8` run gemv_q8's units and dp4a dot products (gate/up quantizes its
//!   activations for down; down takes a token's output rows over all k experts in one warp);
//! - larger steps: the pairs grouped by expert on the device (`moe_group`), their inputs
//!   gathered, tiles of up to 8 pairs of one expert per block (each weight row read once
//!   per tile), and each token's weighted outputs added in slot order.
//!
//! Every launch's grid is fixed by the step's size (the tile grid for the worst case, the
//! tiles past the count exit), so steps record and replay as graphs with no host round
//! trip. A token's result does not depend on the rest of the step (each product is one
//! warp per row accumulating every token on its own), so batch-invariant steps need
//! nothing special.

use crate::*;
use kestrel_model::{Gating, MoeConfig};

/// The kernels this module launches (kernels/moe.cu).
pub(crate) const KERNELS: &[&str] = &[
    "moe_router",
    "moe_route",
    "moe_gate_up",
    "moe_down",
    "moe_gate_up_q8",
    "moe_down_q8",
    "moe_group",
    "moe_gather",
    "moe_gate_up_tiles",
    "moe_down_tiles",
    "moe_combine",
    "moe_shared_gate",
];

/// Steps of at most this many tokens run the per-pair decode kernels.
pub const MOE_DEC_MAX_TOKENS: usize = 8;
/// Most experts a router may have (`MOE_MAX_EXPERT` in kernels/moe.cu).
pub const MOE_MAX_EXPERT: usize = 1024;
/// Most experts a token may use (`MOE_MAX_K`).
pub const MOE_MAX_K: usize = 16;
/// Tokens of one expert a tile takes (`GV_MAX_T` in kernels/gemv.cu).
const TILE: usize = 8;
/// Rows per block of the product kernels (`MOE_ROWS`).
const ROWS: usize = 4;

/// Formats the expert kernels read (`row_dot_any` in kernels/gemv.cu).
pub const EXPERT_TYPES: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q5_0,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q6K,
    GgmlType::IQ4NL,
    GgmlType::IQ4XS,
    GgmlType::MXFP4,
];

/// Formats of the 8-bit decode kernels (`moe_gate_up_q8`, `moe_down_q8`: gemv_q8's units).
pub const Q8_EXPERT_TYPES: &[GgmlType] = &[
    GgmlType::Q4K,
    GgmlType::Q6K,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::IQ4NL,
    GgmlType::IQ4XS,
    GgmlType::MXFP4,
];

/// Rows a `moe_gate_up_q8` block computes (16 warps of 2: one 32-value block of 8-bit
/// activations for down).
const Q8_GATE_UP_ROWS: usize = 32;
/// Rows a `moe_down_q8` block computes (4 warps of `MOE_DOWN_R` = 2).
const Q8_DOWN_ROWS: usize = 8;

/// Launches `moe_route` for `n` tokens: each token's top `k` of `ne` router logits (plus
/// the bias, 0 for none) gated and normalized as `moe` says. `ptrs`: the logits, the bias,
/// the expert ids and the weights written.
fn launch_route(b: &CudaBackend, moe: &MoeConfig, n: usize, k: usize, ne: usize, ptrs: [u64; 4]) {
    let [logits, bias, ids, wts] = ptrs;
    b.launch(
        "moe_route",
        (n as u32, 1, 1),
        route_threads(ne),
        &[
            Arg::P(logits),
            Arg::P(bias),
            Arg::I(ne as i32),
            Arg::I(k as i32),
            Arg::I(match moe.gating {
                Gating::Softmax => 0,
                Gating::TopKSoftmax => 1,
            }),
            Arg::I(moe.norm_top_k as i32),
            Arg::P(ids),
            Arg::P(wts),
        ],
    );
}

/// Threads of a `moe_route` block: one per expert, a power of two of at least a warp (the
/// bitonic sort's width).
fn route_threads(n_expert: usize) -> u32 {
    n_expert.next_power_of_two().max(32) as u32
}

/// Outputs a `moe_shared_gate` block takes (256 threads of `MOE_SG_OUT` = 4).
const SHARED_GATE_COLS: usize = 1024;

/// Buffers of the block, shared by every layer, grown to the largest step seen.
pub(crate) struct MoeScratch {
    /// (tokens, experts, used, n_embd, n_ff_exp) they were sized for.
    dims: (usize, usize, usize, usize, usize),
    logits: CudaSlice<f32>,
    ids: CudaSlice<i32>,
    wts: CudaSlice<f32>,
    /// Gated activations, one row of n_ff_exp per pair.
    act: CudaSlice<f32>,
    /// Grouped steps: each pair's place, the pair at each place, the tiles.
    pos: CudaSlice<i32>,
    order: CudaSlice<i32>,
    tiles: CudaSlice<i32>,
    /// Grouped steps: gathered inputs and weighted outputs, one row of n_embd per place.
    xs: CudaSlice<f32>,
    ys: CudaSlice<f32>,
    /// 8-bit decode: the inputs (n_embd a token) and the gated activations (n_ff_exp a pair)
    /// as int8 values and a scale per 32.
    xq: CudaSlice<i8>,
    xd: CudaSlice<f32>,
    aq: CudaSlice<i8>,
    ad: CudaSlice<f32>,
}

/// Tiles a step of `pairs` (token, slot) pairs over `n_expert` experts can need.
fn max_tiles(pairs: usize, n_expert: usize) -> usize {
    pairs.div_ceil(TILE) + n_expert.min(pairs)
}

impl MoeScratch {
    fn new(b: &CudaBackend, dims: (usize, usize, usize, usize, usize)) -> anyhow::Result<Self> {
        let (n, ne, k, d, ff) = dims;
        let pairs = n * k;
        let grouped = n > MOE_DEC_MAX_TOKENS;
        let big = |len: usize| if grouped { len } else { 1 };
        // Tokens of the largest decode step these buffers serve.
        let dec = n.min(MOE_DEC_MAX_TOKENS);
        Ok(MoeScratch {
            dims,
            logits: b.alloc(n * ne, "router logits")?,
            ids: b.alloc(pairs, "expert ids")?,
            wts: b.alloc(pairs, "expert weights")?,
            act: b.alloc(pairs * ff, "expert activations")?,
            pos: b.alloc(big(pairs), "expert groups")?,
            order: b.alloc(big(pairs), "expert groups")?,
            tiles: b.alloc(big(1 + 3 * max_tiles(pairs, ne)), "expert tiles")?,
            xs: b.alloc(big(pairs * d), "gathered expert inputs")?,
            ys: b.alloc(big(pairs * d), "expert outputs")?,
            xq: b.alloc(dec * d, "8-bit expert inputs")?,
            xd: b.alloc(dec * d / 32, "8-bit expert inputs")?,
            aq: b.alloc(dec * k * ff, "8-bit expert activations")?,
            ad: b.alloc(dec * k * ff / 32, "8-bit expert activations")?,
        })
    }
}

/// The weights of one mixture-of-experts block as the kernels read them: a layer's own
/// ([`Experts::of`]) or one GPU's part of them ([`Experts::picked`]: a tensor-parallel
/// rank's expert shards, each expert's rows `n_ff_exp` of that rank's width).
#[derive(Clone, Copy)]
pub(crate) struct Experts<'a> {
    pub router: Option<&'a CudaWeight>,
    pub router_bias: Option<&'a CudaWeight>,
    pub gate: &'a CudaWeight,
    pub up: &'a CudaWeight,
    pub down: &'a CudaWeight,
    pub gate_bias: Option<&'a CudaWeight>,
    pub up_bias: Option<&'a CudaWeight>,
    pub down_bias: Option<&'a CudaWeight>,
}

impl<'a> Experts<'a> {
    pub(crate) fn of(layer: &'a LayerWeights<CudaWeight>) -> Self {
        Self::picked(layer, |w| w)
    }

    /// [`Self::of`] for the weights of a backend over several GPUs: `pick` gives the one
    /// GPU's part of each weight.
    pub(crate) fn picked<W>(
        layer: &'a LayerWeights<W>,
        pick: impl Fn(&'a W) -> &'a CudaWeight,
    ) -> Self {
        Experts {
            router: layer.ffn_gate_inp.as_ref().map(&pick),
            router_bias: layer.ffn_gate_inp_bias.as_ref().map(&pick),
            gate: pick(&layer.ffn_gate),
            up: pick(&layer.ffn_up),
            down: pick(&layer.ffn_down),
            gate_bias: layer.ffn_gate_exps_bias.as_ref().map(&pick),
            up_bias: layer.ffn_up_exps_bias.as_ref().map(&pick),
            down_bias: layer.ffn_down_exps_bias.as_ref().map(&pick),
        }
    }

    /// Whether the block has expert biases (gpt-oss).
    pub(crate) fn has_biases(&self) -> bool {
        self.gate_bias.is_some() || self.up_bias.is_some() || self.down_bias.is_some()
    }
}

/// A stacked expert tensor (`[n_embd or n_ff_exp] × rows × n_expert`) as one matrix of
/// `n_expert · rows` rows; gpt-oss's expert biases (`[rows × n_expert]`) as an f32 matrix
/// of one row per expert.
pub(crate) fn load_experts(
    b: &CudaBackend,
    file: &Arc<GgufFile>,
    info: &TensorInfo,
) -> anyhow::Result<CudaWeight> {
    load_experts_bytes(b, &info.name, info.ty, &info.dims, file.tensor_data(info))
}

/// [`load_experts`] from a tensor's bytes (a tensor-parallel rank's shard of it, whose
/// dims are the shard's).
pub(crate) fn load_experts_bytes(
    b: &CudaBackend,
    name: &str,
    ty: GgmlType,
    dims: &[u64],
    data: &[u8],
) -> anyhow::Result<CudaWeight> {
    let cols = dims.first().copied().unwrap_or(0) as usize;
    let rows = dims.iter().skip(1).product::<u64>() as usize;
    if dims.len() == 2 {
        // Biases: dequantized to f32 (rows × cols values).
        let mut v = vec![0f32; rows * cols];
        for (src, dst) in data
            .chunks_exact(data.len() / rows.max(1))
            .zip(v.chunks_exact_mut(cols.max(1)))
        {
            kestrel_quant::dequantize_row(ty, src, dst)
                .with_context(|| format!("tensor {name}"))?;
        }
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        return b
            .upload_matrix(GgmlType::F32, rows, cols, &bytes)
            .with_context(|| format!("tensor {name}"));
    }
    if dims.len() != 3 {
        bail!(
            "{name}: expert tensors are 3-D, this one has {} dimensions",
            dims.len()
        );
    }
    if !EXPERT_TYPES.contains(&ty) {
        bail!(
            "{name}: experts of type {ty} are not supported by the CUDA backend yet (supported: {})",
            EXPERT_TYPES
                .iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    b.upload_matrix(ty, rows, cols, data)
        .with_context(|| format!("tensor {name}"))
}

/// (pointer, format id, row bytes) of a stacked expert matrix of `rows` × `cols`.
fn expert_matrix(
    w: &CudaWeight,
    rows: usize,
    cols: usize,
    what: &str,
) -> anyhow::Result<(u64, i32, i64)> {
    match w {
        CudaWeight::Matrix {
            ptr,
            ty,
            rows: r,
            cols: c,
            row_bytes,
            ..
        } if *r == rows && *c == cols && EXPERT_TYPES.contains(ty) => {
            Ok((*ptr, ty.id() as i32, *row_bytes as i64))
        }
        CudaWeight::Matrix {
            ty,
            rows: r,
            cols: c,
            ..
        } => {
            bail!("{what}: a {r}×{c} {ty} matrix where {rows}×{cols} stacked experts were expected")
        }
        CudaWeight::Vector { .. } => bail!("{what}: a vector where stacked experts were expected"),
    }
}

/// The device address of an expert bias (`n_expert` rows of `cols` f32), or 0 without one.
fn expert_bias(
    w: Option<&CudaWeight>,
    n_expert: usize,
    cols: usize,
    what: &str,
) -> anyhow::Result<u64> {
    match w {
        None => Ok(0),
        Some(CudaWeight::Matrix {
            ptr,
            ty: GgmlType::F32,
            rows,
            cols: c,
            ..
        }) if *rows == n_expert && *c == cols => Ok(*ptr),
        Some(_) => bail!("{what}: not {n_expert} f32 rows of {cols}"),
    }
}

/// Whether a decode step's expert products run on 8-bit activations (`moe_gate_up_q8`,
/// `moe_down_q8`): the backend's 8-bit decode on, every matrix (format ids `tys`) of
/// [`Q8_EXPERT_TYPES`], and rows of whole 32-value blocks (n_embd `d`, n_ff_exp `ff`:
/// the quantization blocks; the K-quants' 256 hold by their format).
fn q8_experts(b: &CudaBackend, tys: &[i32], d: usize, ff: usize) -> bool {
    b.q8_decode()
        && d.is_multiple_of(32)
        && ff.is_multiple_of(Q8_GATE_UP_ROWS)
        && tys
            .iter()
            .all(|&t| Q8_EXPERT_TYPES.iter().any(|q| q.id() as i32 == t))
}

impl CudaBackend {
    /// Whether a step of `n` tokens through a mixture-of-experts block of this shape (and
    /// expert formats) runs the 8-bit decode kernels (for the checks' references).
    pub fn moe_uses_q8(&self, tys: [GgmlType; 3], d: usize, ff: usize, n: usize) -> bool {
        n <= MOE_DEC_MAX_TOKENS && q8_experts(self, &tys.map(|t| t.id() as i32), d, ff)
    }
}

/// The block of `n` tokens at `x` into `out`, with the experts `e` of `moe.n_ff_exp` rows
/// each (a tensor-parallel rank's width: its `out` is then a partial sum).
#[allow(clippy::too_many_arguments)]
pub(crate) fn moe_ffn(
    b: &CudaBackend,
    x: &CudaTensor,
    e: Experts<'_>,
    moe: &MoeConfig,
    act: Activation,
    n: usize,
    out: &mut CudaTensor,
) -> anyhow::Result<()> {
    let router = e
        .router
        .context("a mixture-of-experts layer without its router (ffn_gate_inp)")?;
    let (ne, k, ff, d) = (moe.n_expert, moe.n_expert_used, moe.n_ff_exp, x.cols);
    if ne == 0 || ne > MOE_MAX_EXPERT {
        bail!("{ne} experts: the CUDA backend takes 1 to {MOE_MAX_EXPERT}");
    }
    if k == 0 || k > ne || k > MOE_MAX_K {
        bail!("{k} experts per token of {ne}: the CUDA backend takes 1 to {MOE_MAX_K}");
    }
    if n == 0 {
        return Ok(());
    }
    if n > x.rows || n > out.rows || out.cols != d {
        bail!(
            "moe_ffn: {n} tokens of {d} values into a {}×{} output ({} input rows)",
            out.rows,
            out.cols,
            x.rows
        );
    }
    let (wr, tyr, rbr) = expert_matrix(router, ne, d, "the router (ffn_gate_inp)")?;
    let (wg, tyg, rbg) = expert_matrix(e.gate, ne * ff, d, "ffn_gate_exps")?;
    let (wu, tyu, rbu) = expert_matrix(e.up, ne * ff, d, "ffn_up_exps")?;
    let (wd, tyd, rbd) = expert_matrix(e.down, ne * d, ff, "ffn_down_exps")?;
    let bg = expert_bias(e.gate_bias, ne, ff, "ffn_gate_exps.bias")?;
    let bu = expert_bias(e.up_bias, ne, ff, "ffn_up_exps.bias")?;
    let bd = expert_bias(e.down_bias, ne, d, "ffn_down_exps.bias")?;
    let router_bias = match e.router_bias {
        None => 0,
        Some(CudaWeight::Vector { ptr, len, .. }) if *len == ne => *ptr,
        Some(_) => bail!("the router bias (ffn_gate_inp.bias) is not {ne} values"),
    };
    let (alpha, limit) = match moe.clamped_swiglu {
        Some(c) => {
            if c.limit.is_nan() || c.limit <= 0.0 {
                bail!("clamped SwiGLU limit {} (must be positive)", c.limit);
            }
            (c.alpha, c.limit)
        }
        None => (0.0, 0.0),
    };

    let mut guard = b.moe_scratch.lock().unwrap_or_else(|p| p.into_inner());
    let fits = guard.as_ref().is_some_and(|s| {
        let (sn, sne, sk, sd, sff) = s.dims;
        let grouped_ok = n <= MOE_DEC_MAX_TOKENS || sn > MOE_DEC_MAX_TOKENS;
        sn >= n && sne == ne && sk == k && sd == d && sff == ff && grouped_ok
    });
    if !fits {
        let prev = guard.as_ref().map_or(0, |s| s.dims.0);
        *guard = None; // frees the old buffers first
        *guard = Some(MoeScratch::new(b, (n.max(prev), ne, k, d, ff))?);
    }
    let s = guard.as_mut().expect("allocated above");

    let (logits, ids, wts, a) = (
        b.ptr(&s.logits),
        b.ptr(&s.ids),
        b.ptr(&s.wts),
        b.ptr(&s.act),
    );
    // The 8-bit decode kernels: the inputs are quantized by the router's launch.
    let q8 = n <= MOE_DEC_MAX_TOKENS && q8_experts(b, &[tyg, tyu, tyd], d, ff);
    let (xq, xd, aq, ad) = if q8 {
        (b.ptr(&s.xq), b.ptr(&s.xd), b.ptr(&s.aq), b.ptr(&s.ad))
    } else {
        (0, 0, 0, 0)
    };
    b.launch_reading(
        "moe_router",
        (ne as u32, n.div_ceil(TILE) as u32, 1),
        128,
        &[
            Arg::P(x.ptr),
            Arg::I(d as i32),
            Arg::I(n as i32),
            Arg::P(wr),
            Arg::L(rbr),
            Arg::I(tyr),
            Arg::I(ne as i32),
            Arg::P(logits),
            Arg::P(xq),
            Arg::P(xd),
        ],
        (ne * rbr as usize) as u64,
    );
    launch_route(b, moe, n, k, ne, [logits, router_bias, ids, wts]);
    if crate::moe_mma::on_tensor_cores(b, &e, moe, n) {
        let epi = crate::moe_mma::Epilogue {
            bg,
            bu,
            bd,
            alpha,
            limit,
        };
        return crate::moe_mma::moe_ffn_mma(b, x, &e, moe, act, n, ids, wts, epi, out);
    }
    let gate_up = [
        Arg::I(d as i32),
        Arg::I(ff as i32),
        Arg::P(wg),
        Arg::L(rbg),
        Arg::I(tyg),
        Arg::P(wu),
        Arg::L(rbu),
        Arg::I(tyu),
        Arg::P(bg),
        Arg::P(bu),
        Arg::I(activation_id(act)),
        Arg::F(alpha),
        Arg::F(limit),
    ];
    let pairs = n * k;
    // Bytes of the selected experts' rows, for the profiler.
    let gate_up_bytes = (pairs * ff) as u64 * (rbg + rbu) as u64;
    let down_bytes = (pairs * d) as u64 * rbd as u64;
    let row_groups = |rows: usize| rows.div_ceil(ROWS) as u32;
    if q8 {
        let mut args = vec![
            Arg::P(xq),
            Arg::P(xd),
            Arg::I(k as i32),
            Arg::P(ids),
            Arg::P(aq),
            Arg::P(ad),
        ];
        args.extend_from_slice(&gate_up);
        b.launch_reading(
            "moe_gate_up_q8",
            ((ff / Q8_GATE_UP_ROWS) as u32, pairs as u32, 1),
            (Q8_GATE_UP_ROWS / 2 * 32) as u32,
            &args,
            gate_up_bytes,
        );
        b.launch_reading(
            "moe_down_q8",
            (d.div_ceil(Q8_DOWN_ROWS) as u32, n as u32, 1),
            128,
            &[
                Arg::P(aq),
                Arg::P(ad),
                Arg::I(ff as i32),
                Arg::I(d as i32),
                Arg::I(k as i32),
                Arg::P(ids),
                Arg::P(wts),
                Arg::P(wd),
                Arg::L(rbd),
                Arg::I(tyd),
                Arg::P(bd),
                Arg::P(out.ptr),
            ],
            down_bytes,
        );
        return Ok(());
    }
    if n <= MOE_DEC_MAX_TOKENS {
        let mut args = vec![Arg::P(x.ptr), Arg::I(k as i32), Arg::P(ids), Arg::P(a)];
        args.extend_from_slice(&gate_up);
        b.launch_reading(
            "moe_gate_up",
            (row_groups(ff), pairs as u32, 1),
            128,
            &args,
            gate_up_bytes,
        );
        // Rows a `moe_down` block takes (8 warps, one per (row, slot)).
        let down_rows = if k <= 8 { 8 / k } else { 1 };
        b.launch_reading(
            "moe_down",
            (d.div_ceil(down_rows) as u32, n as u32, 1),
            256,
            &[
                Arg::P(a),
                Arg::I(ff as i32),
                Arg::I(d as i32),
                Arg::I(k as i32),
                Arg::P(ids),
                Arg::P(wts),
                Arg::P(wd),
                Arg::L(rbd),
                Arg::I(tyd),
                Arg::P(bd),
                Arg::P(out.ptr),
            ],
            down_bytes,
        );
        return Ok(());
    }
    let (pos, order, tiles) = (b.ptr(&s.pos), b.ptr(&s.order), b.ptr(&s.tiles));
    let (xs, ys) = (b.ptr(&s.xs), b.ptr(&s.ys));
    let grid_tiles = max_tiles(pairs, ne) as u32;
    b.launch(
        "moe_group",
        (1, 1, 1),
        1024,
        &[
            Arg::P(ids),
            Arg::I(pairs as i32),
            Arg::I(ne as i32),
            Arg::P(pos),
            Arg::P(order),
            Arg::P(tiles),
        ],
    );
    b.launch(
        "moe_gather",
        (pairs as u32, 1, 1),
        256,
        &[
            Arg::P(x.ptr),
            Arg::I(d as i32),
            Arg::I(k as i32),
            Arg::P(order),
            Arg::P(xs),
        ],
    );
    let mut args = vec![Arg::P(xs), Arg::P(tiles), Arg::P(a)];
    args.extend_from_slice(&gate_up);
    b.launch_reading(
        "moe_gate_up_tiles",
        (row_groups(ff), grid_tiles, 1),
        128,
        &args,
        gate_up_bytes / TILE as u64,
    );
    b.launch_reading(
        "moe_down_tiles",
        (row_groups(d), grid_tiles, 1),
        128,
        &[
            Arg::P(a),
            Arg::I(ff as i32),
            Arg::I(d as i32),
            Arg::P(tiles),
            Arg::P(order),
            Arg::P(wts),
            Arg::P(wd),
            Arg::L(rbd),
            Arg::I(tyd),
            Arg::P(bd),
            Arg::P(ys),
        ],
        down_bytes / TILE as u64,
    );
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

impl CudaBackend {
    /// A vector weight holding `v` (for checks of the operations that take one).
    pub fn upload_vector(&self, v: &[f32]) -> anyhow::Result<CudaWeight> {
        let buf = self
            .stream
            .clone_htod(v)
            .map_err(|e| anyhow::anyhow!("uploading a vector: {e:?}"))?;
        let ptr = self.ptr(&buf);
        Ok(CudaWeight::Vector {
            buf,
            ptr,
            len: v.len(),
        })
    }
}

impl CudaBackend {
    /// The routing kernel alone (`moe_route`) on `n` tokens' router logits (`n` rows of
    /// `moe.n_expert`) and an optional router bias: each token's `moe.n_expert_used`
    /// (expert, weight) pairs in slot order, for the checks against
    /// `kestrel_model::moe::route`.
    pub fn moe_route_rows(
        &self,
        logits: &[f32],
        bias: Option<&[f32]>,
        moe: &MoeConfig,
        n: usize,
    ) -> anyhow::Result<Vec<(usize, f32)>> {
        let (ne, k) = (moe.n_expert, moe.n_expert_used);
        if ne == 0 || ne > MOE_MAX_EXPERT || k == 0 || k > ne || k > MOE_MAX_K {
            bail!(
                "{k} of {ne} experts: the CUDA backend takes 1 to {MOE_MAX_K} of up to {MOE_MAX_EXPERT}"
            );
        }
        if n == 0 || logits.len() != n * ne || bias.is_some_and(|b| b.len() != ne) {
            bail!(
                "moe_route_rows: {} logits and a bias of {:?} for {n} tokens of {ne} experts",
                logits.len(),
                bias.map(|b| b.len())
            );
        }
        let up = |v: &[f32]| {
            self.stream
                .clone_htod(v)
                .map_err(|e| anyhow::anyhow!("uploading router logits: {e:?}"))
        };
        let dl = up(logits)?;
        let db = bias.map(up).transpose()?;
        // Poisoned: an unwritten slot reads as no expert and a NaN weight.
        let ids = self
            .stream
            .clone_htod(&vec![-1i32; n * k])
            .map_err(|e| anyhow::anyhow!("uploading expert ids: {e:?}"))?;
        let wts = up(&vec![f32::NAN; n * k])?;
        let bias_ptr = db.as_ref().map_or(0, |b| self.ptr(b));
        let ptrs = [self.ptr(&dl), bias_ptr, self.ptr(&ids), self.ptr(&wts)];
        launch_route(self, moe, n, k, ne, ptrs);
        self.check()?;
        let (mut hi, mut hw) = (vec![0i32; n * k], vec![0f32; n * k]);
        self.stream
            .memcpy_dtoh(&ids, &mut hi[..])
            .map_err(|e| anyhow::anyhow!("copying expert ids from the GPU: {e:?}"))?;
        self.stream
            .memcpy_dtoh(&wts, &mut hw[..])
            .map_err(|e| anyhow::anyhow!("copying expert weights from the GPU: {e:?}"))?;
        self.check()?;
        Ok(hi.iter().map(|&i| i as usize).zip(hw).collect())
    }
}

/// `out += y · sigmoid(x · w)` per token (a shared expert's gate).
pub(crate) fn add_sigmoid_gated(
    b: &CudaBackend,
    out: &mut CudaTensor,
    y: &CudaTensor,
    x: &CudaTensor,
    w: &CudaWeight,
    n: usize,
) -> anyhow::Result<()> {
    let w = match w {
        CudaWeight::Vector { ptr, len, .. } if *len == x.cols => *ptr,
        _ => bail!("the shared expert's gate is not a vector of {}", x.cols),
    };
    if out.cols != y.cols || n > out.rows || n > y.rows || n > x.rows {
        bail!(
            "add_sigmoid_gated: {n} rows of {} columns into {}×{}",
            y.cols,
            out.rows,
            out.cols
        );
    }
    b.launch(
        "moe_shared_gate",
        (n as u32, y.cols.div_ceil(SHARED_GATE_COLS).max(1) as u32, 1),
        256,
        &[
            Arg::P(out.ptr),
            Arg::P(y.ptr),
            Arg::P(x.ptr),
            Arg::P(w),
            Arg::I(x.cols as i32),
            Arg::I(y.cols as i32),
        ],
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tile grid is sized by `max_tiles` before the routes exist: it must cover the
    /// tiles `moe_group` cuts (⌈count / 8⌉ per expert) for any routes, including every pair
    /// on one expert, every expert used once, and random ones of awkward sizes.
    #[test]
    fn the_tile_grid_covers_every_grouping() {
        let tiles = |counts: &[usize]| -> usize { counts.iter().map(|c| c.div_ceil(TILE)).sum() };
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |m: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % m as u64) as usize
        };
        for (n, k, ne) in [
            (9, 2, 8),
            (77, 8, 128),
            (512, 8, 128),
            (33, 4, 32),
            (100, 16, 1024),
        ] {
            let pairs = n * k;
            let bound = max_tiles(pairs, ne);
            let mut all_one = vec![0; ne];
            all_one[ne - 1] = pairs;
            assert!(tiles(&all_one) <= bound);
            let spread: Vec<usize> = (0..ne)
                .map(|e| pairs / ne + usize::from(e < pairs % ne))
                .collect();
            assert!(tiles(&spread) <= bound, "{n}×{k} over {ne}");
            for _ in 0..200 {
                let mut counts = vec![0; ne];
                for _ in 0..pairs {
                    counts[next(ne)] += 1;
                }
                assert!(tiles(&counts) <= bound, "{n}×{k} over {ne}: {counts:?}");
            }
        }
    }
}
