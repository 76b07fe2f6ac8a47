//! Attention (kernels/attention.cu): RoPE and the KV-cache store, the split decode kernels
//! (tiled on the tensor cores, grouped, or one block a head) with their combine, and the
//! prefill kernels.

use crate::*;

/// The kernels this module launches (kernels/attention.cu).
pub(crate) const KERNELS: &[&str] = &[
    "store_kv",
    "store_kv_q",
    "rope_store_kv",
    "rope_store_kv_q",
    "attention",
    "attention_q",
    "attention_split",
    "attention_split_q",
    "attention_split_gqa",
    "attention_split_gqa_q",
    "attention_split_tiled64",
    "attention_split_tiled128",
    "attention_split_tiled64_q",
    "attention_split_tiled128_q",
    "attention_split_tiled64_q8",
    "attention_split_tiled128_q8",
    "attention_combine",
    "attention_combine_mmk",
    "attention_prefill",
    "attention_prefill_q",
    "attention_prefill_mma64",
    "attention_prefill_mma128",
    "attention_prefill_mma64_q",
    "attention_prefill_mma128_q",
    "attention_sinks",
];

/// Tokens per block of the prefill attention kernel, and the largest head it handles
/// (`attention_prefill` in kernels/attention.cu: FA_Q and FA_HD); runs of fewer tokens take the
/// split kernels.
pub(crate) const PREFILL_ATTN_TOKENS: usize = 16;

pub(crate) const PREFILL_ATTN_MAX_HEAD_DIM: usize = 128;

/// Tokens per block of the tensor-core prefill attention (`attention_prefill_mma64` and
/// `attention_prefill_mma128` in kernels/attention.cu: FM_Q).
pub(crate) const PREFILL_MMA_TOKENS: usize = 64;

/// Most tokens of a step the split (decode) attention handles.
pub(crate) const SPLIT_ATTN_MAX_TOKENS: usize = 64;

/// Most key ranges the decode attention splits a (token, head) into.
pub(crate) const MAX_ATTN_SPLITS: usize = 64;

/// Most query heads per kv head the tiled decode attention takes (TA_MAX_GROUP).
pub(crate) const TILED_ATTN_MAX_GROUP: usize = 8;

/// Keys one block of the tiled decode attention covers per round (4 warps × 16).
pub(crate) const TILED_ATTN_KEYS_PER_ROUND: usize = 64;

/// Dynamic shared memory of `attention_split_tiled{64,128}` (kernels/attention.cu:
/// TA_SMEM_BYTES): per warp a ring of TA_STAGES (3 for 128-dim heads, 2 for 64-dim ones)
/// stages of a 16-key chunk's f16 K and V rows (`head_dim + 8` halves each), then the query
/// rows.
pub(crate) fn tiled_smem(head_dim: usize) -> u32 {
    let stages = if head_dim == 128 { 3 } else { 2 };
    let row = head_dim + 8;
    ((4 * stages * 2 * 16 * row + 16 * row) * 2) as u32
}

/// Dynamic shared memory of `attention_split_tiled{64,128}_q` (kernels/attention.cu:
/// TQ_WARP_BYTES per warp, then the query rows): per warp the f16 rows of a 16-key chunk,
/// TQ_STAGES = 2 stages of the raw K and V rows (`head_dim` bytes a key each) and their f16
/// scales, the chunk's scales as f32.
pub(crate) fn tiled_q_smem(head_dim: usize) -> u32 {
    const STAGES: usize = 2;
    let keys = 16;
    let nb = head_dim / 32;
    let rows = keys * (head_dim + 8) * 2;
    let stage = 2 * keys * head_dim + 2 * keys * nb * 2;
    let warp = rows + STAGES * stage + 2 * keys * nb * 4;
    (4 * warp + rows) as u32
}

/// Dynamic shared memory of `attention_split_tiled{64,128}_q8` (kernels/attention.cu:
/// TQ8_SMEM_BYTES): per warp a ring of 5 (128-dim heads) or 4 (64-dim) stages of a 16-key
/// chunk's raw q8_0 rows, keys padded by 32 bytes and values by 16, and their f16 scales.
pub(crate) fn tiled_q8_smem(head_dim: usize) -> u32 {
    let stages = if head_dim == 128 { 5 } else { 4 };
    let keys = 16;
    let stage = keys * (head_dim + 32) + keys * (head_dim + 16) + 2 * keys * (head_dim / 32) * 2;
    (4 * stages * stage) as u32
}

/// Whether split decode attention runs `attention_split_gqa` (one block per kv head, its
/// query heads together: each key and value row read once per group) where the tiled
/// kernels ([`tiled_split_attention`]) do not: grouped heads, a head of 32 · (1 to 4) dims,
/// at most 8 heads per group.
pub(crate) fn gqa_split_attention(p: &AttnParams) -> bool {
    let group = p.n_head / p.n_head_kv.max(1);
    (2..=8).contains(&group)
        && p.n_head.is_multiple_of(p.n_head_kv)
        && p.head_dim.is_multiple_of(32)
        && p.head_dim <= 128
}

/// The tensor-core prefill attention kernel for `p`'s heads: 64- or 128-dim heads, whole
/// groups of query heads per kv head; `quant`: over a cache with quantized keys and values
/// (the `_q` kernels). `None` keeps `attention_prefill`.
pub(crate) fn prefill_mma_kernel(p: &AttnParams, quant: bool) -> Option<&'static str> {
    if p.n_head_kv == 0 || !p.n_head.is_multiple_of(p.n_head_kv) {
        return None;
    }
    match (p.head_dim, quant) {
        (64, false) => Some("attention_prefill_mma64"),
        (128, false) => Some("attention_prefill_mma128"),
        (64, true) => Some("attention_prefill_mma64_q"),
        (128, true) => Some("attention_prefill_mma128_q"),
        _ => None,
    }
}

/// Whether split decode attention runs `attention_split_tiled64` / `attention_split_tiled128`
/// (tensor cores; one block per kv head and key range, the keys in 16-key chunks through
/// shared memory): heads of 64 or 128 dims, 1 to 8 query heads per kv head. The kernels
/// need sm_80, as the `mmq_*` kernels do.
pub(crate) fn tiled_split_attention(p: &AttnParams) -> bool {
    p.n_head_kv > 0
        && p.n_head.is_multiple_of(p.n_head_kv)
        && (1..=TILED_ATTN_MAX_GROUP).contains(&(p.n_head / p.n_head_kv))
        && matches!(p.head_dim, 64 | 128)
}

/// Buffers and sizes one layer's attention launches share.
pub(crate) struct AttnLaunch {
    pub(crate) q: u64,
    pub(crate) k: u64,
    pub(crate) v: u64,
    pub(crate) out: u64,
    pub(crate) block_size: usize,
    pub(crate) window: i32,
    /// Single-token steps: the 8-bit activation buffers (values, block steps) the output's
    /// quantization goes to as well, for the output projection's gemv_q8.
    pub(crate) q8: Option<(u64, u64)>,
    /// Steps of a few tokens whose output projection reads mmk's layout: the padded row
    /// count and the buffers (values, per-256 steps, group sums) attention_combine_mmk
    /// writes.
    pub(crate) mmk: Option<(usize, [u64; 3])>,
    /// A cache with quantized keys or values: the `_q` kernels' trailing arguments (scales,
    /// kinds). Decode steps then run `attention_split_tiled*_q` where both are quantized
    /// ([`AttnLaunch::tiled_q`]), else `attention_split_q` / `attention_q`.
    pub(crate) quant: Option<[Arg; 4]>,
    /// Keys and values both quantized (q8_0, q4_0 or fp8, in any pair): the tiled kernels
    /// over quantized blocks can take the decode steps.
    pub(crate) tiled_q: bool,
    /// Keys and values both q8_0: the tiled decode kernels reading the quants straight into
    /// their mma fragments (`attention_split_tiled*_q8`) take the decode steps.
    pub(crate) tiled_q8: bool,
    /// The step's token count: each token's keys before its position + 1 − this were
    /// written by earlier steps (the tiled kernels load those before their
    /// grid-dependency wait).
    pub(crate) fresh: usize,
}

impl CudaBackend {
    /// Attention of tokens `tok0 .. tok0 + n` of any sequences: split across key ranges
    /// (the count below), in ranges of at most
    /// SPLIT_ATTN_MAX_TOKENS tokens; the one-block-per-(token, head) kernel when the
    /// partials buffer is too small.
    /// Returns whether the launches wrote `a.q8` (the kernels that write the normalized
    /// output do: attention_split_tiled* with one split, attention_combine).
    /// `alone`: the split count of a single-token step whose sequence holds that many keys
    /// (rounded up to a power of two), for every token of the launch (batch-invariant
    /// steps); None: the step's own.
    pub(crate) fn attention_short(
        &self,
        a: &AttnLaunch,
        p: &AttnParams,
        step: &CudaStep,
        tok0: usize,
        n: usize,
        alone: Option<usize>,
    ) -> bool {
        let (max_len, n_split) = match alone {
            Some(len) => (len, 1),
            None => (step.max_kv_len(), n),
        };
        // About ATTN_SPLIT_BLOCKS blocks in all, and at least ~16 keys a split of the
        // longest sequence (its length rounded up to a power of two, so that a recorded graph
        // serves every step until it doubles). Measured on the H100, Llama-3-8B Q4_K_M, ~600
        // keys, decode t/s with 4 / 8 / 16 / 32 / 64 splits: 1 sequence 210 / 242 / 255 /
        // 264 / 265, 8 sequences 1,207 / 1,341 / 1,287 / 1,228 / 1,144: both best at ~512
        // blocks. (Splits used to follow the cache size: 64 for 8 sequences.)
        //
        // The tiled kernels instead take at most one wave of blocks on the H100 (132 SMs ×
        // 2 resident blocks of the f16 128-dim kernel: 256; × 4 of the 64-dim one: 512; a
        // block's warps each keep 2 or 3 chunks of 16 keys in flight, so one wave already
        // keeps enough bytes in flight), the count rounded down to a power of two,
        // and splits of TILED_ATTN_KEYS_PER_ROUND keys or more of the longest length rounded
        // up to a power of two (32 to 64 keys of the longest sequence: a 16-key chunk for
        // 2 to 4 of the block's 4 warps; more, shorter splits would not shorten a block's one
        // round of loads, and each split is one more partial to write and merge). One split
        // (e.g. 64 sequences × 8 kv heads, or no sequence longer than 64) writes the output
        // directly, without attention_combine. The count is a power of two and changes only
        // when the longest length crosses one. The q8_0 kernels (100 / 46 KiB of ring) keep
        // the f16 kernels' 2 / 4 blocks an SM; over other quantized caches the 128-dim kernel
        // (168 registers, 57 KiB of staging) keeps 3: its wave is 396 blocks, so at most 384.
        const ATTN_SPLIT_BLOCKS: usize = 512;
        let tiled = (a.quant.is_none() || a.tiled_q) && tiled_split_attention(p);
        let gqa = gqa_split_attention(p);
        let splits = if tiled {
            let wave = match (a.quant.is_some() && !a.tiled_q8, p.head_dim) {
                (true, 128) => 384,
                (false, 128) => 256,
                _ => ATTN_SPLIT_BLOCKS,
            };
            let by_len = max_len.next_power_of_two() / TILED_ATTN_KEYS_PER_ROUND;
            let pairs = n_split.min(SPLIT_ATTN_MAX_TOKENS) * p.n_head_kv.max(1);
            let by_blocks = (wave / pairs).checked_ilog2().map_or(1, |e| 1 << e);
            by_len.min(by_blocks)
        } else {
            let heads = if gqa { p.n_head_kv } else { p.n_head };
            let by_len = max_len.next_power_of_two().div_ceil(16);
            let by_blocks =
                ATTN_SPLIT_BLOCKS.div_ceil(n_split.min(SPLIT_ATTN_MAX_TOKENS) * heads.max(1));
            by_len.min(by_blocks)
        }
        .clamp(if tiled { 1 } else { 2 }, MAX_ATTN_SPLITS);
        // The kernels' shared leading arguments, writing to `dest`.
        let common = |dest: u64| {
            [
                &[Arg::P(a.q), Arg::P(a.k), Arg::P(a.v), Arg::P(dest)][..],
                &step.slot_args(),
                &[
                    Arg::I(a.block_size as i32),
                    Arg::I(p.n_head as i32),
                    Arg::I(p.n_head_kv as i32),
                    Arg::I(p.head_dim as i32),
                    Arg::F(p.scale),
                    Arg::I(a.window),
                ],
            ]
            .concat()
        };
        let (q8, q8d) = a.q8.unwrap_or((0, 0));
        // The merge kernels' leading arguments: the partials, the output, their geometry.
        let merge = [
            Arg::P(step.attn_part_ptr),
            Arg::P(a.out),
            Arg::I(p.n_head as i32),
            Arg::I(p.head_dim as i32),
            Arg::I(splits as i32),
        ];
        let combine = |m: usize, t: usize| {
            let tail = [Arg::I(t as i32), Arg::P(q8), Arg::P(q8d)];
            let grid = (m as u32, p.n_head as u32, 1);
            self.launch(
                "attention_combine",
                grid,
                128,
                &[&merge[..], &tail].concat(),
            );
        };
        // The merge into mmk's layout: all n tokens in one launch (tok0 = 0).
        let combine_mmk = |npad: usize, [q, xk, xb]: [u64; 3]| {
            let tail = [
                Arg::I(n as i32),
                Arg::I(npad as i32),
                Arg::P(q),
                Arg::P(xk),
                Arg::P(xb),
            ];
            let grid = (npad as u32, (p.n_head * p.head_dim / 256) as u32, 1);
            self.launch(
                "attention_combine_mmk",
                grid,
                256,
                &[&merge[..], &tail].concat(),
            );
        };
        let mmk = a.mmk.filter(|_| tok0 == 0 && n <= SPLIT_ATTN_MAX_TOKENS);
        let mut wrote_q8 = false;
        let mut done = 0;
        while done < n {
            let m = (n - done).min(SPLIT_ATTN_MAX_TOKENS);
            let t = tok0 + done;
            let part_len = m * p.n_head * splits * (p.head_dim + 2);
            let fits = part_len <= step.attn_part_len;
            if tiled && (splits == 1 || fits) {
                let name = match (p.head_dim, a.quant.is_some(), a.tiled_q8) {
                    (64, false, _) => "attention_split_tiled64",
                    (64, true, false) => "attention_split_tiled64_q",
                    (64, true, true) => "attention_split_tiled64_q8",
                    (_, false, _) => "attention_split_tiled128",
                    (_, true, false) => "attention_split_tiled128_q",
                    (_, true, true) => "attention_split_tiled128_q8",
                };
                // One split: the output itself (normalized); otherwise the partials.
                let dest = if splits == 1 {
                    a.out
                } else {
                    step.attn_part_ptr
                };
                let mut args = common(dest);
                args.push(Arg::I(splits as i32));
                args.push(Arg::I(t as i32));
                let (q8, q8d) = if splits == 1 { (q8, q8d) } else { (0, 0) };
                args.extend([Arg::P(q8), Arg::P(q8d)]);
                // Quantized caches: the scales and kinds; then the step's token count.
                if let Some(quant) = a.quant {
                    args.extend(quant);
                }
                args.push(Arg::I(a.fresh as i32));
                self.launch(
                    name,
                    (m as u32, p.n_head_kv as u32, splits as u32),
                    128,
                    &args,
                );
                match mmk {
                    _ if splits == 1 => {}
                    Some((npad, bufs)) => combine_mmk(npad, bufs),
                    None => combine(m, t),
                }
                wrote_q8 = a.q8.is_some() || (mmk.is_some() && splits > 1);
            } else if splits > 1 && fits {
                let mut args = common(step.attn_part_ptr);
                args.push(Arg::I(splits as i32));
                args.push(Arg::I(t as i32));
                // Quantized caches: the `_q` kernels, the scales and kinds last.
                if let Some(quant) = a.quant {
                    args.extend(quant);
                }
                let q = a.quant.is_some();
                if gqa {
                    self.launch(
                        if q {
                            "attention_split_gqa_q"
                        } else {
                            "attention_split_gqa"
                        },
                        (m as u32, p.n_head_kv as u32, splits as u32),
                        128,
                        &args,
                    );
                } else {
                    self.launch(
                        if q {
                            "attention_split_q"
                        } else {
                            "attention_split"
                        },
                        (m as u32, p.n_head as u32, splits as u32),
                        128,
                        &args,
                    );
                }
                match mmk {
                    Some((npad, bufs)) => combine_mmk(npad, bufs),
                    None => combine(m, t),
                }
                wrote_q8 = a.q8.is_some() || mmk.is_some();
            } else {
                let mut args = common(a.out);
                args.push(Arg::I(t as i32));
                let name = match a.quant {
                    Some(quant) => {
                        args.extend(quant);
                        "attention_q"
                    }
                    None => "attention",
                };
                self.launch(name, (m as u32, p.n_head as u32, 1), 128, &args);
                wrote_q8 = false;
            }
            done += m;
        }
        wrote_q8
    }

    /// Attention of one sequence's run of tokens `tok0 .. tok0 + n` (a prompt chunk),
    /// flash style: on the tensor cores in tiles of PREFILL_MMA_TOKENS (grid: heads, then
    /// tiles) where [`prefill_mma_kernel`] has a kernel, else in tiles of
    /// PREFILL_ATTN_TOKENS (grid: tiles, then heads). Same arguments for both; `sinks`:
    /// gpt-oss's sink logits (device address, one a query head; 0: none), which only the
    /// tensor-core kernels take (the caller checked [`prefill_sinks_kernel`]).
    pub(crate) fn attention_prefill(
        &self,
        a: &AttnLaunch,
        p: &AttnParams,
        step: &CudaStep,
        tok0: usize,
        n: usize,
        sinks: u64,
    ) {
        // Quantized keys and values: the tensor-core kernels' `_q` forms (dequantizing each
        // tile into shared memory); a cache mixing f16 and quantized: the SIMT kernel,
        // dequantizing as it stages the tiles.
        let mma = if a.quant.is_none() || a.tiled_q {
            prefill_mma_kernel(p, a.quant.is_some())
        } else {
            None
        };
        let (name, grid) = match (mma, a.quant) {
            (Some(name), _) => (
                name,
                (p.n_head as u32, n.div_ceil(PREFILL_MMA_TOKENS) as u32, 1),
            ),
            (None, quant) => (
                if quant.is_some() {
                    "attention_prefill_q"
                } else {
                    "attention_prefill"
                },
                (n.div_ceil(PREFILL_ATTN_TOKENS) as u32, p.n_head as u32, 1),
            ),
        };
        let quant = a.quant.as_ref().map_or(&[][..], |q| &q[..]);
        // The tensor-core kernels take the sinks (null: none) before the quantized caches'
        // arguments.
        let sinks = if mma.is_some() {
            &[Arg::P(sinks)][..]
        } else {
            &[]
        };
        self.launch(
            name,
            grid,
            128,
            &[
                &[Arg::P(a.q), Arg::P(a.k), Arg::P(a.v), Arg::P(a.out)][..],
                &step.slot_args(),
                &[
                    Arg::I(a.block_size as i32),
                    Arg::I(tok0 as i32),
                    Arg::I(n as i32),
                    Arg::I(p.n_head as i32),
                    Arg::I(p.n_head_kv as i32),
                    Arg::I(p.head_dim as i32),
                    Arg::F(p.scale),
                    Arg::I(a.window),
                ],
                sinks,
                quant,
            ]
            .concat(),
        );
    }
}

pub(crate) fn store_kv(
    backend: &CudaBackend,
    cache: &mut CudaCache,
    layer: usize,
    k: &CudaTensor,
    v: &CudaTensor,
    step: &CudaStep,
    n: usize,
) {
    if k.cols != cache.kv_dim || v.cols != cache.kv_dim || layer >= cache.k.len() {
        backend.fail(format!(
            "store_kv: bad geometry (layer {layer}, {} / {} columns, kv_dim {})",
            k.cols, v.cols, cache.kv_dim
        ));
        return;
    }
    let args = [
        &[
            Arg::P(k.ptr),
            Arg::P(v.ptr),
            Arg::P(cache.k_ptr[layer]),
            Arg::P(cache.v_ptr[layer]),
        ][..],
        &step.slot_args(),
        &[Arg::I(cache.block_size as i32), Arg::I(cache.kv_dim as i32)],
    ]
    .concat();
    if cache.quantized() {
        // Quantized on the device: a warp per 32-value block.
        let args = [&args[..], &cache.quant_args(layer)].concat();
        backend.launch("store_kv_q", (n as u32, 1, 1), 128, &args);
    } else {
        backend.launch("store_kv", (n as u32, 1, 1), 128, &args);
    }
}

pub(crate) fn attention(
    backend: &CudaBackend,
    q: &CudaTensor,
    cache: &CudaCache,
    p: &AttnParams,
    step: &CudaStep,
    n: usize,
    out: &mut CudaTensor,
) -> Prepared {
    if p.head_dim > MAX_HEAD_DIM {
        backend.fail(format!(
            "attention: head size {} exceeds the kernel's {MAX_HEAD_DIM}",
            p.head_dim
        ));
        return Prepared::Nothing;
    }
    if p.layer >= cache.k.len() || p.n_head_kv * p.head_dim != cache.kv_dim {
        backend.fail(format!("attention: bad geometry for layer {}", p.layer));
        return Prepared::Nothing;
    }
    let window = p.window.map_or(0, |w| w.min(i32::MAX as usize) as i32);
    let width = p.n_head * p.head_dim;
    // A single token's output feeds the output projection's gemv_q8: quantized by the
    // kernel that writes it (no quantize_x_q8 launch), as rms_norm_q8 does for its rows;
    // so are a verification step's rows (`invariant_step`), each as its own step's.
    let invariant = backend.invariant_step();
    let q8 = if invariant {
        backend
            .single_q8_buffers(1, width)
            .and_then(|_| backend.q8_buffers(n * width))
    } else {
        backend.single_q8_buffers(n, width)
    }
    .filter(|_| p.head_dim.is_multiple_of(32))
    .map(|b| (b.q, b.d));
    // A few tokens whose output projection reads mmk's layout (mmk_t8*, mms_*): the
    // split merge quantizes them (256-value blocks of whole heads).
    let mmk = backend
        .multi_q8_layout(n, width)
        .filter(|l| !invariant && l.mmk && p.head_dim <= 256 && 256 % p.head_dim == 0)
        .map(|l| {
            let (xk, xb) = l.q8.mmk_steps_sums(l.npad, width);
            (l.npad, [l.q8.q, xk, xb])
        });
    let ctx = AttnLaunch {
        q: q.ptr,
        k: cache.k_ptr[p.layer],
        v: cache.v_ptr[p.layer],
        out: out.ptr,
        block_size: cache.block_size,
        window,
        q8,
        mmk,
        quant: cache.quantized().then(|| cache.quant_args(p.layer)),
        tiled_q: cache.types.k != KvType::F16 && cache.types.v != KvType::F16,
        tiled_q8: cache.types.k == KvType::Q8_0 && cache.types.v == KvType::Q8_0,
        fresh: n,
    };
    // After launches that wrote the whole step's quantized output: what the output
    // projection then reads.
    let quantized = match mmk {
        Some((npad, _)) => Prepared::Mmq {
            of: out.ptr,
            n,
            npad,
            mmk: true,
        },
        None => Prepared::Q8 { of: out.ptr, n: 1 },
    };
    if n <= GEMV_MAX_TOKENS {
        // Decode: one launch list whatever the sequences (graph replay).
        if invariant {
            // Each token with the split count its own single-token step would take (the
            // count follows the sequence's length rounded up to a power of two): runs of
            // tokens sharing one, a launch each.
            let bucket = |i: usize| (step.position(i) + 1).next_power_of_two();
            let mut start = 0;
            let mut wrote_q8 = true;
            while start < n {
                let first = bucket(start);
                let len = (start..n).take_while(|&i| bucket(i) == first).count();
                wrote_q8 &= backend.attention_short(&ctx, p, step, start, len, Some(first));
                start += len;
            }
            // Every launch quantized its tokens' rows: the output projection reads them.
            return if wrote_q8 && q8.is_some() {
                Prepared::Q8 { of: out.ptr, n }
            } else {
                Prepared::Nothing
            };
        }
        if backend.attention_short(&ctx, p, step, 0, n, None) {
            return quantized;
        }
        return Prepared::Nothing;
    }
    // Runs of one sequence's tokens (a batch keeps each sequence's tokens together):
    // prompt chunks go to the tiled prefill kernels, the short runs between them (decode
    // tokens of other sequences) to the split kernels, gathered into ranges.
    let prefill_ok = p.head_dim <= PREFILL_ATTN_MAX_HEAD_DIM && p.head_dim.is_multiple_of(4);
    let mut short: Option<(usize, usize)> = None;
    for (start, len) in step.sequence_runs(n) {
        if prefill_ok && len >= PREFILL_ATTN_TOKENS {
            if let Some((a, b)) = short.take() {
                backend.attention_short(&ctx, p, step, a, b - a, None);
            }
            backend.attention_prefill(&ctx, p, step, start, len, 0);
        } else {
            short = match short {
                Some((a, b)) if b == start => Some((a, start + len)),
                Some((a, b)) => {
                    backend.attention_short(&ctx, p, step, a, b - a, None);
                    Some((start, start + len))
                }
                None => Some((start, start + len)),
            };
        }
    }
    if let Some((a, b)) = short
        && backend.attention_short(&ctx, p, step, a, b - a, None)
        && (a, b) == (0, n)
    {
        return quantized;
    }
    Prepared::Nothing
}

/// Whether a prompt run with sinks takes the tensor-core prefill kernel
/// ([`prefill_mma_kernel`]: 64- or 128-dim heads, whole groups, keys and values both f16
/// or both quantized), with the sinks in its softmax.
pub(crate) fn prefill_sinks_kernel(p: &AttnParams, cache: &CudaCache) -> bool {
    let f16 = (cache.types.k == KvType::F16, cache.types.v == KvType::F16);
    f16.0 == f16.1 && prefill_mma_kernel(p, !f16.0).is_some()
}

/// Attention with a learned logit per query head joining each softmax's denominator
/// (gpt-oss's sinks): prompt runs of PREFILL_ATTN_TOKENS or more of one sequence on the
/// tensor-core prefill kernels where [`prefill_sinks_kernel`] allows, everything else
/// (decode steps, short runs) on `attention_sinks`, one block per (token, head) over any
/// cache.
#[allow(clippy::too_many_arguments)] // the trait method's arguments and the backend
pub(crate) fn attention_sinks(
    backend: &CudaBackend,
    q: &CudaTensor,
    cache: &CudaCache,
    p: &AttnParams,
    sinks: &CudaWeight,
    step: &CudaStep,
    n: usize,
    out: &mut CudaTensor,
) -> anyhow::Result<()> {
    let CudaWeight::Vector { ptr, len, .. } = sinks else {
        bail!("attention sinks: expected a vector weight, got a matrix");
    };
    if *len != p.n_head {
        bail!("{len} attention sinks for {} heads", p.n_head);
    }
    if p.head_dim > MAX_HEAD_DIM {
        bail!(
            "attention: head size {} exceeds the kernel's {MAX_HEAD_DIM}",
            p.head_dim
        );
    }
    if p.layer >= cache.k.len() || p.n_head_kv * p.head_dim != cache.kv_dim {
        bail!("attention: bad geometry for layer {}", p.layer);
    }
    if n == 0 {
        return Ok(());
    }
    let window = p.window.map_or(0, |w| w.min(i32::MAX as usize) as i32);
    let quant = if cache.quantized() {
        cache.quant_args(p.layer)
    } else {
        [Arg::P(0), Arg::P(0), Arg::I(0), Arg::I(0)]
    };
    // Tokens tok0 .. tok0 + len on the SIMT kernel.
    let simt = |tok0: usize, len: usize| {
        let args = [
            &[
                Arg::P(q.ptr),
                Arg::P(cache.k_ptr[p.layer]),
                Arg::P(cache.v_ptr[p.layer]),
                Arg::P(out.ptr),
            ][..],
            &step.slot_args(),
            &[
                Arg::I(cache.block_size as i32),
                Arg::I(p.n_head as i32),
                Arg::I(p.n_head_kv as i32),
                Arg::I(p.head_dim as i32),
                Arg::F(p.scale),
                Arg::I(window),
                Arg::I(tok0 as i32),
            ],
            &quant,
            &[Arg::P(*ptr)],
        ]
        .concat();
        backend.launch(
            "attention_sinks",
            (len as u32, p.n_head as u32, 1),
            128,
            &args,
        );
    };
    if n <= GEMV_MAX_TOKENS || !prefill_sinks_kernel(p, cache) {
        simt(0, n);
        return Ok(());
    }
    let ctx = AttnLaunch {
        q: q.ptr,
        k: cache.k_ptr[p.layer],
        v: cache.v_ptr[p.layer],
        out: out.ptr,
        block_size: cache.block_size,
        window,
        q8: None,
        mmk: None,
        quant: cache.quantized().then(|| cache.quant_args(p.layer)),
        tiled_q: cache.types.k != KvType::F16 && cache.types.v != KvType::F16,
        tiled_q8: false,
        fresh: n,
    };
    // Runs of one sequence's tokens: prompt chunks on the tensor cores, the short runs
    // between them gathered into ranges for the SIMT kernel.
    let mut short: Option<(usize, usize)> = None;
    for (start, len) in step.sequence_runs(n) {
        if len >= PREFILL_ATTN_TOKENS {
            if let Some((a, b)) = short.take() {
                simt(a, b - a);
            }
            backend.attention_prefill(&ctx, p, step, start, len, *ptr);
        } else {
            short = match short {
                Some((a, b)) if b == start => Some((a, start + len)),
                Some((a, b)) => {
                    simt(a, b - a);
                    Some((start, start + len))
                }
                None => Some((start, start + len)),
            };
        }
    }
    if let Some((a, b)) = short {
        simt(a, b - a);
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)] // the trait method's arguments and the backend
pub(crate) fn rope_store_kv(
    backend: &CudaBackend,
    q: &mut CudaTensor,
    k: &mut CudaTensor,
    v: &CudaTensor,
    qkv_ready: Prepared,
    head_dim: usize,
    rope: &RopeParams,
    cache: &mut CudaCache,
    layer: usize,
    step: &CudaStep,
    n: usize,
) {
    // The merged product of exactly these q, k and v, if `qkv` left it unsplit: the kernel
    // splits it on the way (the product and the three biases), else it reads q, k and v.
    let split = match qkv_ready {
        Prepared::Split(p) => Some(p),
        _ => None,
    };
    let ours = split.filter(|p| {
        p.n == n
            && p.args[1] == Arg::P(q.ptr)
            && p.args[2] == Arg::P(k.ptr)
            && p.args[3] == Arg::P(v.ptr)
    });
    if let Some(p) = split
        && ours.is_none()
    {
        backend.split_qkv(&p);
    }
    if k.cols != cache.kv_dim || v.cols != cache.kv_dim || layer >= cache.k.len() {
        backend.fail(format!(
            "rope_store_kv: bad geometry (layer {layer}, {} / {} columns, kv_dim {})",
            k.cols, v.cols, cache.kv_dim
        ));
        return;
    }
    if cache.quantized() && !head_dim.is_multiple_of(32) {
        // The fused kernel quantizes whole 32-value blocks of a head: split (if the product
        // waits), rotate, then quantize on the store.
        if let Some(p) = &ours {
            backend.split_qkv(p);
        }
        norm_rope::rope(backend, q, head_dim, rope, step, n);
        norm_rope::rope(backend, k, head_dim, rope, step, n);
        store_kv(backend, cache, layer, k, v, step, n);
        return;
    }
    let Some(rope_args) = backend.rope_args(head_dim, rope) else {
        return;
    };
    let heads = q.cols / head_dim + k.cols / head_dim;
    let threads = (head_dim / 2).next_multiple_of(32).clamp(32, 256) as u32;
    let source = match ours {
        Some(p) => [p.args[0], p.args[4], p.args[5], p.args[6]],
        None => [Arg::P(0); 4],
    };
    let args = [
        &source[..],
        &[
            Arg::P(q.ptr),
            Arg::P(k.ptr),
            Arg::P(v.ptr),
            Arg::P(cache.k_ptr[layer]),
            Arg::P(cache.v_ptr[layer]),
        ],
        &step.slot_args(),
        &[
            Arg::I(cache.block_size as i32),
            Arg::I((q.cols / head_dim) as i32),
            Arg::I((k.cols / head_dim) as i32),
        ],
        &rope_args,
    ]
    .concat();
    // One block per (token, query or key head); a thread per rotated pair. Quantized
    // caches: the same, each key head's block quantizing its rows a warp a block.
    let grid = (n as u32, heads as u32, 1);
    if cache.quantized() {
        let args = [&args[..], &cache.quant_args(layer)].concat();
        backend.launch("rope_store_kv_q", grid, threads, &args);
    } else {
        backend.launch("rope_store_kv", grid, threads, &args);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The split counts assume one wave of the f16 tiled kernels: 2 blocks of the 128-dim
    /// kernel an SM and 4 of the 64-dim one (an H100 SM: 228 KiB of shared memory, 1 KiB
    /// of it reserved per block), and the rings' space holds the warps' f32 outputs at the
    /// end (TA_WARPS · TA_MAX_GROUP · head_dim floats).
    #[test]
    fn tiled_smem_fits_the_wave() {
        let sm = 228 << 10;
        for (hd, blocks) in [(128usize, 2u32), (64, 4)] {
            let smem = tiled_smem(hd);
            assert!(blocks * (smem + 1024) <= sm, "{hd}: {smem} B × {blocks}");
            let queries = (16 * (hd + 8) * 2) as u32;
            assert!(smem - queries >= (4 * TILED_ATTN_MAX_GROUP * hd * 4) as u32);
        }
        // Three stages of a 128-dim head's 16-key chunk (K and V) a warp: 106.25 KiB.
        assert_eq!(tiled_smem(128), 108_800);
        // The q8_0 kernels: the same blocks an SM, the merge in their rings.
        for (hd, blocks) in [(128usize, 2u32), (64, 4)] {
            let smem = tiled_q8_smem(hd);
            assert!(blocks * (smem + 1024) <= sm, "q8 {hd}: {smem} B × {blocks}");
            assert!(smem >= (4 * TILED_ATTN_MAX_GROUP * hd * 4) as u32);
        }
        // Five stages of 16 keys × (160 + 144) bytes and 256 bytes of scales a warp: 100 KiB.
        assert_eq!(tiled_q8_smem(128), 102_400);
    }
}
