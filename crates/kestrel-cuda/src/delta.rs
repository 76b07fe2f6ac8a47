//! Gated DeltaNet linear attention on the GPU (Qwen3-Next, Qwen3.5; kernels/delta.cu), and
//! gated attention's element-wise operations (the query / gate split, the sigmoid gate of
//! the attention output). A shared expert's sigmoid gate belongs to the MoE block.
//!
//! Each live sequence owns a slot of [`DeltaStates`] in the cache: per linear-attention
//! layer its convolution's last `d_conv - 1` inputs per channel and each v head's
//! `head_v_dim × head_k_dim` state, in the CPU's layout. The kernels find a sequence's slot
//! through the step's block tables (`slot_of_block[first block]`, a device table the host
//! writes when a sequence starts), so a step's launches do not depend on which sequences
//! it holds and decode steps replay as graphs. The host keeps how many tokens each state
//! has taken in, and refuses a step that does not continue a sequence where its state
//! stopped (as the CPU does: the state cannot roll back or be rebuilt from K/V blocks).
//! Prompts run the same token-by-token recurrence as decode steps (`delta_scan`), one block
//! per 32 state rows of a (v head, sequence), its tokens staged 16 at a time in shared
//! memory with their q/k norms. Three launches
//! a layer: the convolution (`delta_conv`, a thread per channel and 16 tokens), the
//! recurrence with the q/k L2 norms (`delta_scan`), the gated norm (`delta_gated_norm`).

use crate::*;

/// The kernels this module launches (kernels/delta.cu).
pub(crate) const KERNELS: &[&str] = &[
    "delta_conv",
    "delta_scan",
    "delta_gated_norm",
    "delta_gated_norm_q8",
    "split_gated_query",
    "sigmoid_mul",
];

/// Largest `head_k_dim` `delta_scan` holds in registers (DN_P · DN_C in kernels/delta.cu).
pub const MAX_HEAD_K_DIM: usize = 128;
/// Largest `head_v_dim` (the largest the models have; `delta_scan` spreads a head's rows
/// over blocks of 32).
pub const MAX_HEAD_V_DIM: usize = 128;
/// Most convolution taps (DN_MAX_TAPS).
pub const MAX_CONV_TAPS: usize = 8;
/// Lanes of a state row (DN_P).
const LANES_PER_ROW: usize = 4;
/// State rows of a v head per `delta_scan` block (DN_ROWS).
const ROWS_PER_BLOCK: usize = 32;

/// No slot (`slot_of_block` of a block that starts no live sequence).
const NO_SLOT: u32 = u32::MAX;

/// The recurrent states of the linear-attention layers of every live sequence.
pub struct DeltaStates {
    /// Index among the linear-attention layers of each layer (None: attention).
    index: Vec<Option<usize>>,
    /// The first linear-attention layer (where a step's bookkeeping happens).
    first_layer: usize,
    conv_len: usize,
    ssm_len: usize,
    /// f32 values of one slot: every linear-attention layer's conv then ssm state.
    slot_len: usize,
    buf: CudaSlice<f32>,
    ptr: u64,
    capacity: usize,
    /// Slot of the sequence whose first block is i (NO_SLOT: none), `n_blocks` entries.
    slot_of_block: CudaSlice<u32>,
    slot_of_block_ptr: u64,
    /// first block → (slot, tokens its state has taken in).
    live: HashMap<u32, (u32, usize)>,
    free: Vec<u32>,
}

impl DeltaStates {
    /// Sequences whose state is held.
    pub fn live(&self) -> usize {
        self.live.len()
    }

    /// (conv state, ssm state) offsets of layer `layer` within a slot.
    fn offsets(&self, layer: usize) -> Option<(usize, usize)> {
        let i = self.index.get(layer).copied().flatten()?;
        let base = i * (self.conv_len + self.ssm_len);
        Some((base, base + self.conv_len))
    }
}

/// Refuses a linear-attention shape the kernels do not take.
pub(crate) fn check_config(cfg: &ModelConfig) -> anyhow::Result<()> {
    let Some(d) = &cfg.delta_net else {
        return Ok(());
    };
    if d.head_k_dim == 0 || d.head_k_dim > MAX_HEAD_K_DIM {
        bail!(
            "linear-attention heads of {} key dimensions: the CUDA backend takes 1 to {MAX_HEAD_K_DIM}",
            d.head_k_dim
        );
    }
    if d.head_v_dim == 0 || d.head_v_dim > MAX_HEAD_V_DIM {
        bail!(
            "linear-attention heads of {} value dimensions: the CUDA backend takes 1 to {MAX_HEAD_V_DIM}",
            d.head_v_dim
        );
    }
    if d.d_conv == 0 || d.d_conv > MAX_CONV_TAPS {
        bail!(
            "a convolution of {} taps: the CUDA backend takes 1 to {MAX_CONV_TAPS}",
            d.d_conv
        );
    }
    if d.n_k_heads == 0 || !d.n_v_heads.is_multiple_of(d.n_k_heads) {
        bail!(
            "{} v heads for {} q/k heads: not a whole number per q/k head",
            d.n_v_heads,
            d.n_k_heads
        );
    }
    Ok(())
}

/// The cache's state store for a model with linear-attention layers (None without).
pub(crate) fn new_states(
    backend: &CudaBackend,
    config: &ModelConfig,
    n_blocks: usize,
) -> anyhow::Result<Option<DeltaStates>> {
    let Some(d) = &config.delta_net else {
        return Ok(None);
    };
    check_config(config)?;
    let mut index = Vec::with_capacity(config.n_layer);
    let mut count = 0;
    for il in 0..config.n_layer {
        if config.layer_kinds.get(il) == Some(&kestrel_model::LayerKind::DeltaNet) {
            index.push(Some(count));
            count += 1;
        } else {
            index.push(None);
        }
    }
    let first_layer = index.iter().position(Option::is_some).unwrap_or(0);
    let (conv_len, ssm_len) = (d.conv_state_len(), d.state_len());
    let slot_len = count * (conv_len + ssm_len);
    let buf = backend.alloc::<f32>(slot_len, "the linear-attention states")?;
    let ptr = backend.ptr(&buf);
    let table = vec![NO_SLOT; n_blocks.max(1)];
    let slot_of_block = backend
        .stream
        .clone_htod(&table)
        .map_err(|e| anyhow::anyhow!("uploading the state slot table: {e:?}"))?;
    let slot_of_block_ptr = backend.ptr(&slot_of_block);
    Ok(Some(DeltaStates {
        index,
        first_layer,
        conv_len,
        ssm_len,
        slot_len,
        buf,
        ptr,
        capacity: 1,
        slot_of_block,
        slot_of_block_ptr,
        live: HashMap::new(),
        free: vec![0],
    }))
}

/// Forgets the state of the sequence whose first block is `first_block`.
pub(crate) fn forget(cache: &mut CudaCache, first_block: u32) {
    if let Some(st) = cache.delta.as_mut()
        && let Some((slot, _)) = st.live.remove(&first_block)
    {
        st.free.push(slot);
    }
}

/// Grows the store to at least `want` slots (keeping the states held), doubling.
fn grow(backend: &CudaBackend, st: &mut DeltaStates, want: usize) -> anyhow::Result<()> {
    let cap = want.max(2 * st.capacity);
    let len = cap
        .checked_mul(st.slot_len)
        .context("linear-attention state size overflows")?;
    let mut buf = backend.alloc::<f32>(len, "the linear-attention states")?;
    let old = st.capacity * st.slot_len;
    backend
        .stream
        .memcpy_dtod(&st.buf.slice(..old), &mut buf.slice_mut(..old))
        .map_err(|e| anyhow::anyhow!("copying the linear-attention states: {e:?}"))?;
    st.free.extend((st.capacity..cap).rev().map(|s| s as u32));
    st.ptr = backend.ptr(&buf);
    st.buf = buf;
    st.capacity = cap;
    Ok(())
}

/// The step's sequences as (first block, first position, tokens), checked to continue
/// their states; then each state's slot assigned (a new one for a sequence at position 0)
/// and its length advanced.
fn advance(backend: &CudaBackend, st: &mut DeltaStates, step: &CudaStep) -> anyhow::Result<()> {
    let t = step.max_tokens;
    let n = step.n_tokens;
    let h = &step.host;
    // The kernels take each sequence's tokens as one run of the step's.
    for i in 1..n {
        let (a, b) = (h[2 * t + i - 1], h[2 * t + i]);
        if a != b && h[2 * t..2 * t + i - 1].contains(&b) {
            bail!(
                "a step whose sequence {b} has tokens apart: linear-attention layers take each \
                 sequence's tokens together"
            );
        }
    }
    let mut seqs: Vec<(u32, usize, usize)> = Vec::with_capacity(step.n_seqs);
    for s in 0..step.n_seqs {
        let off = h[4 * t + s] as usize;
        let first = *h
            .get(6 * t + off)
            .context("a sequence without cache blocks")?;
        seqs.push((first, usize::MAX, 0));
    }
    for i in 0..n {
        let (s, pos) = (h[2 * t + i] as usize, h[t + i] as usize);
        let e = seqs.get_mut(s).context("a token of no sequence")?;
        if e.2 == 0 {
            e.1 = pos;
        } else if pos != e.1 + e.2 {
            bail!(
                "a sequence's tokens at positions {} and {pos} in one step: linear-attention \
                 layers take each sequence's tokens in order",
                e.1 + e.2 - 1
            );
        }
        e.2 += 1;
    }
    let n_blocks = st.slot_of_block.len();
    for &(first, pos, count) in &seqs {
        if count == 0 {
            continue;
        }
        if first as usize >= n_blocks {
            bail!("block {first} outside the cache of {n_blocks} blocks");
        }
        if pos != 0 {
            let at = st.live.get(&first).map_or(0, |e| e.1);
            if at != pos {
                bail!(
                    "a linear-attention layer's state holds {at} tokens of this sequence but \
                     the step continues at position {pos}: models with recurrent layers cannot \
                     roll back or reuse cached prefixes"
                );
            }
        }
    }
    for &(first, pos, count) in &seqs {
        if count == 0 {
            continue;
        }
        if pos != 0 {
            if let Some(e) = st.live.get_mut(&first) {
                e.1 += count;
            }
            continue;
        }
        let slot = match st.live.get(&first) {
            Some(&(slot, _)) => slot,
            None => {
                if st.free.is_empty() {
                    grow(backend, st, st.live.len() + 1)?;
                }
                st.free.pop().context("no free state slot")?
            }
        };
        st.live.insert(first, (slot, count));
        let at = first as usize;
        backend
            .stream
            .memcpy_htod(&[slot], &mut st.slot_of_block.slice_mut(at..at + 1))
            .map_err(|e| anyhow::anyhow!("writing the state slot table: {e:?}"))?;
    }
    Ok(())
}

fn matrix_f32(w: &CudaWeight, rows: usize, cols: usize, what: &str) -> anyhow::Result<u64> {
    match w {
        CudaWeight::Matrix {
            ptr,
            ty: GgmlType::F32,
            rows: r,
            cols: c,
            ..
        } if *r == rows && *c == cols => Ok(*ptr),
        CudaWeight::Matrix { ty, rows, cols, .. } => {
            bail!("{what}: a {ty} matrix of {rows} × {cols}; the CUDA backend takes f32 taps")
        }
        CudaWeight::Vector { .. } => bail!("{what} must be a matrix"),
    }
}

fn vector_of(w: &CudaWeight, len: usize, what: &str) -> anyhow::Result<u64> {
    match w {
        CudaWeight::Vector { ptr, len: l, .. } if *l == len => Ok(*ptr),
        _ => bail!("{what} must be a vector of {len} values"),
    }
}

/// The weights of a linear-attention layer its core reads (the input and output
/// projections run outside it): of one GPU's layer, or of one rank's shards.
pub(crate) struct DeltaCore<'a> {
    pub conv: &'a CudaWeight,
    pub dt_bias: &'a CudaWeight,
    pub a: &'a CudaWeight,
    pub norm: &'a CudaWeight,
}

impl<'a> DeltaCore<'a> {
    /// The core weights of `w`, each through `pick` (a rank's shard of a weight).
    pub fn picked<W>(w: &'a DeltaNetWeights<W>, pick: impl Fn(&'a W) -> &'a CudaWeight) -> Self {
        DeltaCore {
            conv: pick(&w.conv),
            dt_bias: pick(&w.dt_bias),
            a: pick(&w.a),
            norm: pick(&w.norm),
        }
    }
}

/// The layer's core after its input projections (see `Backend::delta_net`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn delta_net(
    backend: &CudaBackend,
    cache: &mut CudaCache,
    layer: usize,
    cfg: &DeltaNetConfig,
    w: DeltaCore<'_>,
    mix: &CudaTensor,
    z: &CudaTensor,
    beta: &CudaTensor,
    alpha: &CudaTensor,
    eps: f32,
    step: &CudaStep,
    n: usize,
    out: &mut CudaTensor,
) -> anyhow::Result<Prepared> {
    let st = cache
        .delta
        .as_mut()
        .context("a linear-attention layer in a cache made without their states")?;
    let (conv_off, ssm_off) = st
        .offsets(layer)
        .with_context(|| format!("layer {layer} is not a linear-attention layer"))?;
    let (hk, hv, nv, nk) = (cfg.head_k_dim, cfg.head_v_dim, cfg.n_v_heads, cfg.n_k_heads);
    let (conv_dim, taps) = (cfg.conv_dim(), cfg.d_conv);
    if n != step.n_tokens {
        bail!("delta_net over {n} tokens of a step of {}", step.n_tokens);
    }
    let ba_cols = if cfg.qwen3next_layout { 2 * nv } else { nv };
    let widths = [
        (mix.cols, conv_dim, "the convolution input"),
        (z.cols, cfg.value_dim(), "the output gate"),
        (out.cols, cfg.value_dim(), "the output"),
        (beta.cols, ba_cols, "beta"),
    ];
    for (got, want, what) in widths {
        if got != want {
            bail!("{what} has {got} columns, expected {want}");
        }
    }
    if alpha.cols != ba_cols {
        bail!("alpha has {} columns, expected {ba_cols}", alpha.cols);
    }
    let conv_w = matrix_f32(w.conv, conv_dim, taps, "ssm_conv1d")?;
    let dt_bias = vector_of(w.dt_bias, nv, "ssm_dt.bias")?;
    let a = vector_of(w.a, nv, "ssm_a")?;
    let norm = vector_of(w.norm, hv, "ssm_norm")?;
    let conv_out = step
        .delta_conv_ptr
        .context("a step made without room for the convolution's output")?;
    if layer == st.first_layer {
        advance(backend, st, step)?;
    }
    let (states, slot_len) = (st.ptr, st.slot_len as i64);
    let slots = st.slot_of_block_ptr;
    let seqs = step.n_seqs as u32;
    let where_args = [
        Arg::P(step.positions()),
        Arg::P(step.seq_of()),
        Arg::P(step.table_off()),
        Arg::P(step.tables()),
        Arg::P(slots),
        Arg::I(n as i32),
    ];
    let conv_args = [
        &[
            Arg::P(mix.ptr),
            Arg::I(mix.cols as i32),
            Arg::P(conv_w),
            Arg::I(conv_dim as i32),
            Arg::I(taps as i32),
            Arg::P(states),
            Arg::L(slot_len),
            Arg::L(conv_off as i64),
        ][..],
        &where_args,
        &[Arg::P(conv_out)],
    ]
    .concat();
    // A thread per channel and DN_CONV_CHUNK (16) tokens of a sequence.
    let conv_grid = (conv_dim.div_ceil(128) as u32, n.div_ceil(16) as u32, seqs);
    backend.launch("delta_conv", conv_grid, 128, &conv_args);
    let scan_args = [
        &[
            Arg::P(conv_out),
            Arg::I(conv_dim as i32),
            Arg::P(beta.ptr),
            Arg::I(beta.cols as i32),
            Arg::P(alpha.ptr),
            Arg::I(alpha.cols as i32),
            Arg::P(dt_bias),
            Arg::P(a),
            Arg::I(hk as i32),
            Arg::I(hv as i32),
            Arg::I(nv as i32),
            Arg::I(nk as i32),
            Arg::I(cfg.qwen3next_layout as i32),
            Arg::P(states),
            Arg::L(slot_len),
            Arg::L(ssm_off as i64),
        ][..],
        &where_args,
        &[Arg::F(eps), Arg::P(out.ptr), Arg::I(out.cols as i32)],
    ]
    .concat();
    // A block per ROWS_PER_BLOCK state rows of a v head and sequence.
    let parts = hv.div_ceil(ROWS_PER_BLOCK) as u32;
    let scan_block = (ROWS_PER_BLOCK * LANES_PER_ROW) as u32;
    backend.launch(
        "delta_scan",
        (nv as u32 * parts, seqs, 1),
        scan_block,
        &scan_args,
    );
    let norm_args = [
        Arg::P(out.ptr),
        Arg::I(out.cols as i32),
        Arg::P(z.ptr),
        Arg::I(z.cols as i32),
        Arg::P(norm),
        Arg::I(hv as i32),
        Arg::F(eps),
    ];
    let (norm_grid, norm_block) = ((n as u32, nv as u32, 1), hv.next_multiple_of(32).min(256));
    // A single-token step whose output projection is a gemv_q8: the norm quantizes its
    // output on the way out (whole 8-bit blocks per head), as rms_norm_q8 does.
    let q8 = if hv.is_multiple_of(32) && !backend.invariant_step() {
        backend.single_q8_buffers(n, out.cols)
    } else {
        None
    };
    if let Some(Q8Ptrs { q, d, .. }) = q8 {
        let args = [&norm_args[..], &[Arg::P(q), Arg::P(d)]].concat();
        backend.launch("delta_gated_norm_q8", norm_grid, norm_block as u32, &args);
        return Ok(Prepared::Q8 { of: out.ptr, n });
    }
    backend.launch("delta_gated_norm", norm_grid, norm_block as u32, &norm_args);
    Ok(Prepared::Nothing)
}

pub(crate) fn split_gated_query(
    backend: &CudaBackend,
    qg: &CudaTensor,
    head_dim: usize,
    n: usize,
    q: &mut CudaTensor,
    gate: &mut CudaTensor,
) -> anyhow::Result<()> {
    kestrel_model::backend::check_gated_query_split(qg.cols, q.cols, gate.cols, head_dim)?;
    let len = n * q.cols;
    backend.elementwise(
        "split_gated_query",
        len,
        &[
            Arg::P(qg.ptr),
            Arg::P(q.ptr),
            Arg::P(gate.ptr),
            Arg::I(q.cols as i32),
            Arg::I(head_dim as i32),
            Arg::I(len as i32),
        ],
    );
    Ok(())
}

pub(crate) fn sigmoid_mul(
    backend: &CudaBackend,
    x: &mut CudaTensor,
    gate: &CudaTensor,
    n: usize,
) -> anyhow::Result<()> {
    if x.cols != gate.cols {
        bail!("sigmoid_mul: {} columns against {}", x.cols, gate.cols);
    }
    let len = n * x.cols;
    backend.elementwise(
        "sigmoid_mul",
        len,
        &[Arg::P(x.ptr), Arg::P(gate.ptr), Arg::I(len as i32)],
    );
    Ok(())
}
