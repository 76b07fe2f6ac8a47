//! How a model is divided among several devices, as plain data: which rows or columns of
//! each weight a rank of a tensor-parallel group holds (Megatron's split), and which
//! layers each stage of a layer split runs. Backends that drive several GPUs read it;
//! nothing here touches a device.
//!
//! Tensor parallelism over `N` ranks:
//! - Q, K, V (weights and biases) by output rows, whole KV heads per rank (each rank's
//!   query heads are the groups of its KV heads), so attention runs on each rank alone;
//! - gate and up by output rows (the feed-forward width in whole 256-value granules, so
//!   that the down projection's share of each row is whole quantization blocks);
//! - the attention output and down projections by input columns (the same ranges), each
//!   rank's product a partial sum that an all-reduce adds up;
//! - the LM head by vocabulary rows (`ceil(vocab / N)` a rank, the last one shorter), its
//!   logits gathered afterwards;
//! - everything else (embeddings, norms, Q/K norms, RoPE factors) replicated.
//!
//! A mixture-of-experts block (qwen3moe) takes the same rule expert by expert: the router
//! (`ffn_gate_inp`) is replicated, so every rank routes every token alike; each expert's
//! gate and up rows and down columns are split over the same ranges of the expert width
//! (whole 256-value granules), so each rank's block output is a partial sum that one
//! all-reduce adds up, as after a dense down projection.
//!
//! The other attention models by the same rule: mistral3 as llama (its attention
//! temperature scales each query row alone); phi3's fused matrices (`attn_qkv`: Q rows,
//! then K, then V; `ffn_up`: gate rows, then up) load as their sections
//! ([`TpPlan::fused_sections`]), each cut by its own rule, so a rank holds its heads' rows
//! of each of Q, K and V and its feed-forward range of each of gate and up; gpt-oss's
//! attention sinks (one per query head) go with their heads, its Q/K/V biases with their
//! rows, its attention output bias is added on every rank after the all-reduce, its
//! experts' gate/up biases go with their rows and the down biases are added by rank 0
//! alone ([`Role::RankZero`]), and its expert width is cut in 32-value granules where
//! 256-value ones do not divide it ([`OSS_FF_GRANULE`]).
//!
//! The linear-attention hybrids (qwen35, qwen35moe, qwen3next), as vLLM shards Qwen3-Next:
//! - gated full-attention layers as the dense rule, `attn_q`'s rows (each head's query,
//!   then its output gate) taken two head widths a query head;
//! - gated DeltaNet layers by heads: each rank a contiguous range of q/k heads and the v
//!   heads paired with them ([`DeltaNetConfig::k_head`]), ordered so that the rank's own
//!   pairing (a model of its heads) finds them; `attn_qkv` and the convolution's taps by
//!   the q, k and v channel sections of those heads, `attn_gate`, beta / alpha, `ssm_a`
//!   and `ssm_dt` by the v heads, `ssm_out` by the same v-head columns (a partial sum,
//!   all-reduced); the recurrent and convolution states then hold only the rank's heads;
//! - a shared expert split like a dense feed-forward block (its width in granules), its
//!   sigmoid gate (`ffn_gate_inp_shexp`) replicated; its down projection's partial sum
//!   joins the routed experts' before the block's one all-reduce ([`Role::PartialSum`]).

use std::ops::Range;

use kestrel_gguf::GgmlType;

use crate::config::{Arch, DeltaNetConfig, FfnKind, ModelConfig};

/// Feed-forward widths (and an expert's) are split in multiples of this many values: every
/// block format's block (32 or 256 values) divides it, so a rank's share of a
/// down-projection row is whole blocks, and each rank's expert width stays one the
/// tensor-core expert kernels take (rows of whole 256s for K-quant experts).
pub const FF_GRANULE: usize = 256;

/// gpt-oss's expert width is split in multiples of this many values where it does not
/// split into whole [`FF_GRANULE`]s: its 2880 is 90 blocks of 32, and an expert row that
/// is not whole 256s can only be in a 32-value block format (MXFP4 as published, or Q8_0,
/// Q4_0, Q5_0, IQ4_NL). Every expert kernel takes such widths: the 8-bit decode ones
/// (`moe_gate_up_q8`: blocks of 32 rows), `moe_mq_*` and the staged `moe_mqs_*` (rows past
/// the width clamped and dropped, the blocks past a row's end in its last 256-value step
/// skipped) and the f32 ones. Two ranks take 1440 each.
pub const OSS_FF_GRANULE: usize = 32;

/// Which part of a weight one rank holds. Ranges are in values along a GGUF dimension:
/// `Rows` along `dims[1]` (output features; for a 1-D tensor, its elements), `Cols` along
/// `dims[0]` (input features, the row length).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Split {
    Replicated,
    Rows(Range<usize>),
    Cols(Range<usize>),
    /// Rows of several ranges, concatenated in order (a linear-attention layer's q, k and v
    /// channel sections, or Qwen3.5's v heads of a rank's q/k heads).
    RowSets(Vec<Range<usize>>),
    /// Columns of several ranges, each row's concatenated in order (`ssm_out`).
    ColSets(Vec<Range<usize>>),
}

impl Split {
    /// Values of the split dimension a rank holds (None: replicated).
    pub fn shard_len(&self) -> Option<usize> {
        match self {
            Split::Replicated => None,
            Split::Rows(r) | Split::Cols(r) => Some(r.len()),
            Split::RowSets(v) | Split::ColSets(v) => Some(v.iter().map(|r| r.len()).sum()),
        }
    }

    /// Whether the split is along the row length (input features).
    pub fn is_cols(&self) -> bool {
        matches!(self, Split::Cols(_) | Split::ColSets(_))
    }
}

/// What a weight's product needs after each rank has run its share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The same weight on every rank (norms, embeddings).
    Replicated,
    /// Output features split: each rank has its own columns of the result (Q/K/V, gate/up).
    ColumnParallel,
    /// Input features split: each rank's result is a partial sum, all-reduced (attention
    /// output, down).
    RowParallel,
    /// Input features split like [`Role::RowParallel`], but the partial sum joins its
    /// block's before the block's one all-reduce (a shared expert's down projection: the
    /// sigmoid gate scales each rank's partial alike).
    PartialSum,
    /// The LM head split by vocabulary: each rank's logits are gathered.
    Vocab,
    /// Held whole, and added by rank 0 alone into its partial sum of a row-parallel
    /// product, so that the all-reduce adds it once (gpt-oss's experts' down biases).
    RankZero,
}

/// A tensor-parallel plan for one model over `ranks` devices.
#[derive(Debug, Clone, PartialEq)]
pub struct TpPlan {
    pub ranks: usize,
    pub head_dim: usize,
    /// KV heads per rank (the same on every rank).
    pub kv_heads: usize,
    /// Query heads per rank.
    pub q_heads: usize,
    /// Each rank's range of the feed-forward width (of every expert's, for a mixture of
    /// experts).
    pub ff: Vec<Range<usize>>,
    /// Each rank's range of the vocabulary (all `vocab_chunk` long but the last).
    pub vocab: Vec<Range<usize>>,
    /// `ceil(vocab / ranks)`: the logit columns every rank sends when they are gathered.
    pub vocab_chunk: usize,
    /// Whether the LM head is the embedding table (then `token_embd.weight` is held whole
    /// for the lookup and split by vocabulary for the head).
    pub tied_embeddings: bool,
    /// Whether `attn_q` gives each head's query followed by its output gate (the hybrids'
    /// gated attention): a rank's rows of it are then two head widths a query head.
    pub q_gated: bool,
    /// Each rank's range of a shared expert's width (empty without one).
    pub shexp: Vec<Range<usize>>,
    /// The linear-attention layers' whole shape (None without them).
    pub delta: Option<DeltaNetConfig>,
    /// Each rank's range of those layers' q/k heads.
    pub delta_k_heads: Vec<Range<usize>>,
}

/// Splits `0..len` into `parts` ranges of whole `granule`s, as even as possible (the first
/// ones one granule longer); `None` when some range would be empty or `len` is not whole
/// granules.
pub fn granule_ranges(len: usize, parts: usize, granule: usize) -> Option<Vec<Range<usize>>> {
    if parts == 0 || granule == 0 || !len.is_multiple_of(granule) {
        return None;
    }
    let units = len / granule;
    if units < parts {
        return None;
    }
    let (base, extra) = (units / parts, units % parts);
    let mut start = 0;
    Some(
        (0..parts)
            .map(|p| {
                let n = (base + usize::from(p < extra)) * granule;
                let r = start..start + n;
                start += n;
                r
            })
            .collect(),
    )
}

/// The layers of each of `stages` pipeline stages (a layer split): contiguous, as even as
/// possible, the first stages one layer longer. An error when there are fewer layers
/// than stages.
pub fn layer_ranges(n_layer: usize, stages: usize) -> anyhow::Result<Vec<Range<usize>>> {
    if stages == 0 {
        anyhow::bail!("a layer split needs at least one device");
    }
    granule_ranges(n_layer, stages, 1)
        .ok_or_else(|| anyhow::anyhow!("{n_layer} layers cannot be split over {stages} devices"))
}

/// The layers of each stage of a layer split sized by memory: stage `s` may hold
/// `capacity[s]` bytes, layer `i` takes `layer_bytes[i]`, the first stage also the
/// embedding table (`first_extra`) and the last the output norm and LM head
/// (`last_extra`). Each stage gets a contiguous, non-empty range, the ranges in order and
/// covering every layer, the boundaries placed so that each stage's share of all bytes is
/// as near its share of the capacity as whole layers allow. An error names the stage
/// that does not fit (or says there are fewer layers than stages).
pub fn layer_ranges_by_memory(
    layer_bytes: &[u64],
    first_extra: u64,
    last_extra: u64,
    capacity: &[u64],
) -> anyhow::Result<Vec<Range<usize>>> {
    let (n, stages) = (layer_bytes.len(), capacity.len());
    if stages == 0 {
        anyhow::bail!("a layer split needs at least one device");
    }
    if n < stages {
        anyhow::bail!("{n} layers cannot be split over {stages} devices");
    }
    let total: u128 = layer_bytes.iter().map(|&b| u128::from(b)).sum::<u128>()
        + u128::from(first_extra)
        + u128::from(last_extra);
    let cap_total: u128 = capacity.iter().map(|&c| u128::from(c)).sum();
    if cap_total == 0 {
        anyhow::bail!("the devices of the layer split report no free memory");
    }
    // prefix[i]: the bytes of the first stage's extra and layers 0..i.
    let mut prefix = Vec::with_capacity(n + 1);
    prefix.push(u128::from(first_extra));
    for &b in layer_bytes {
        prefix.push(prefix.last().copied().unwrap_or(0) + u128::from(b));
    }
    let mut ranges = Vec::with_capacity(stages);
    let (mut start, mut cap_before) = (0usize, 0u128);
    for (s, &cap) in capacity.iter().enumerate() {
        let end = if s + 1 == stages {
            n
        } else {
            cap_before += u128::from(cap);
            // The boundary nearest to this stage's cumulative share of all bytes, leaving
            // at least one layer for this stage and for each later one.
            let target = total * cap_before / cap_total;
            let (lo, hi) = (start + 1, n - (stages - s - 1));
            (lo..=hi)
                .min_by_key(|&e| prefix[e].abs_diff(target))
                .unwrap_or(lo)
        };
        ranges.push(start..end);
        start = end;
    }
    for (s, r) in ranges.iter().enumerate() {
        let mut need: u128 = layer_bytes[r.clone()].iter().map(|&b| u128::from(b)).sum();
        if s == 0 {
            need += u128::from(first_extra);
        }
        if s + 1 == stages {
            need += u128::from(last_extra);
        }
        if need > u128::from(capacity[s]) {
            let gib = |b: u128| b as f64 / (1u64 << 30) as f64;
            anyhow::bail!(
                "the model does not fit the devices' memory: stage {s} (layers {}..{}) needs \
                 {:.2} GiB of weights, its device has {:.2} GiB free for them ({:.2} GiB \
                 for the whole model, {:.2} GiB free over all devices)",
                r.start,
                r.end,
                gib(need),
                gib(u128::from(capacity[s])),
                gib(total),
                gib(cap_total)
            );
        }
    }
    Ok(ranges)
}

impl TpPlan {
    /// The plan for `cfg` over `ranks` devices, or an error saying what does not divide.
    pub fn new(cfg: &ModelConfig, ranks: usize) -> anyhow::Result<TpPlan> {
        if ranks == 0 {
            anyhow::bail!("tensor parallelism needs at least one device");
        }
        match cfg.arch {
            Arch::Llama
            | Arch::Qwen2
            | Arch::Qwen3
            | Arch::Gemma3
            | Arch::Qwen3Moe
            | Arch::Qwen35
            | Arch::Qwen35Moe
            | Arch::Qwen3Next => {}
            // mistral3 as llama; phi3's fused matrices cut per section; gpt-oss's sinks,
            // biases and 32-value expert granules (see the module's doc).
            Arch::Mistral3 | Arch::Phi3 | Arch::GptOss => {} // No wildcard: a new architecture must say how it splits.
        }
        let (width, what, shared) = match cfg.ffn {
            FfnKind::Dense => (cfg.n_ff, "feed-forward width", None),
            FfnKind::Moe(m) => (m.n_ff_exp, "experts' feed-forward width", m.shared_expert),
        };
        let shexp = match shared {
            None => Vec::new(),
            Some(w) => granule_ranges(w, ranks, FF_GRANULE).ok_or_else(|| {
                anyhow::anyhow!(
                    "the shared expert's width {w} does not split into {ranks} parts of whole {FF_GRANULE}-value blocks"
                )
            })?,
        };
        let (delta, delta_k_heads) = match (cfg.delta_net, cfg.has_recurrent_layers()) {
            (Some(d), true) => {
                if d.n_k_heads == 0 || !d.n_v_heads.is_multiple_of(d.n_k_heads) {
                    anyhow::bail!(
                        "{} linear-attention v heads are not a whole number per each of {} q/k heads",
                        d.n_v_heads,
                        d.n_k_heads
                    );
                }
                let heads = granule_ranges(d.n_k_heads, ranks, 1)
                    .filter(|_| d.n_k_heads.is_multiple_of(ranks))
                    .ok_or_else(|| {
                        anyhow::anyhow!(
                            "the model's {} linear-attention q/k heads do not divide among {ranks} devices (tensor parallelism gives each device whole heads and the v heads paired with them)",
                            d.n_k_heads
                        )
                    })?;
                (Some(d), heads)
            }
            (None, true) => anyhow::bail!("linear-attention layers without their configuration"),
            (_, false) => (None, Vec::new()),
        };
        if cfg.n_head_kv == 0 || !cfg.n_head_kv.is_multiple_of(ranks) {
            anyhow::bail!(
                "the model's {} KV heads do not divide among {ranks} devices (tensor parallelism gives each device whole KV heads)",
                cfg.n_head_kv
            );
        }
        if !cfg.n_head.is_multiple_of(cfg.n_head_kv) {
            anyhow::bail!(
                "{} query heads are not whole groups of the {} KV heads",
                cfg.n_head,
                cfg.n_head_kv
            );
        }
        let ff = match granule_ranges(width, ranks, FF_GRANULE) {
            Some(ff) => ff,
            None if cfg.arch == Arch::GptOss => granule_ranges(width, ranks, OSS_FF_GRANULE)
                .ok_or_else(|| {
                    anyhow::anyhow!(
                        "the {what} {width} does not split into {ranks} parts of whole {FF_GRANULE}- or {OSS_FF_GRANULE}-value blocks"
                    )
                })?,
            None => anyhow::bail!(
                "the {what} {width} does not split into {ranks} parts of whole {FF_GRANULE}-value blocks"
            ),
        };
        let vocab_chunk = cfg.vocab_size.div_ceil(ranks);
        if vocab_chunk * (ranks - 1) >= cfg.vocab_size {
            anyhow::bail!(
                "a vocabulary of {} tokens is too small for {ranks} devices",
                cfg.vocab_size
            );
        }
        let vocab = (0..ranks)
            .map(|r| r * vocab_chunk..((r + 1) * vocab_chunk).min(cfg.vocab_size))
            .collect();
        Ok(TpPlan {
            ranks,
            head_dim: cfg.head_dim,
            kv_heads: cfg.n_head_kv / ranks,
            q_heads: cfg.n_head / ranks,
            ff,
            vocab,
            vocab_chunk,
            tied_embeddings: cfg.tied_embeddings,
            q_gated: cfg.attn_output_gate,
            shexp,
            delta,
            delta_k_heads,
        })
    }

    /// Rank `r`'s query columns (`q_heads · head_dim` values).
    pub fn q_range(&self, r: usize) -> Range<usize> {
        let w = self.q_heads * self.head_dim;
        r * w..(r + 1) * w
    }

    /// Rank `r`'s key (and value) columns.
    pub fn kv_range(&self, r: usize) -> Range<usize> {
        let w = self.kv_heads * self.head_dim;
        r * w..(r + 1) * w
    }

    /// Rank `r`'s linear-attention shape: its q/k heads and the v heads paired with them
    /// (None without linear-attention layers).
    pub fn delta_config(&self, r: usize) -> Option<DeltaNetConfig> {
        let d = self.delta?;
        let k = self.delta_k_heads.get(r)?.len();
        Some(DeltaNetConfig {
            n_k_heads: k,
            n_v_heads: k * (d.n_v_heads / d.n_k_heads),
            ..d
        })
    }

    /// The whole model's v heads rank `r` holds, in the order of its own v heads: local v
    /// head `h` pairs with local q/k head `local.k_head(h)` as global v head `g` pairs with
    /// `d.k_head(g)`. Qwen3-Next groups a q/k head's v heads together (one range); Qwen3.5
    /// interleaves them (`h % n_k`: a range of the rank's q/k heads in each of the
    /// `n_v / n_k` rounds).
    pub fn delta_v_heads(&self, r: usize) -> Vec<Range<usize>> {
        let (Some(d), Some(k)) = (self.delta, self.delta_k_heads.get(r)) else {
            return Vec::new();
        };
        let per = d.n_v_heads / d.n_k_heads.max(1);
        if d.qwen3next_layout {
            std::iter::once(k.start * per..k.end * per).collect()
        } else {
            (0..per)
                .map(|j| j * d.n_k_heads + k.start..j * d.n_k_heads + k.end)
                .collect()
        }
    }

    /// Rank `r`'s channels of the convolution (`attn_qkv`'s rows, `ssm_conv1d`'s): its q
    /// heads, its k heads, then its v heads' values.
    pub fn delta_channels(&self, r: usize) -> Vec<Range<usize>> {
        let (Some(d), Some(k)) = (self.delta, self.delta_k_heads.get(r)) else {
            return Vec::new();
        };
        let hk = d.head_k_dim;
        let mut out = vec![
            k.start * hk..k.end * hk,
            d.key_dim() + k.start * hk..d.key_dim() + k.end * hk,
        ];
        out.extend(
            self.delta_values(r)
                .into_iter()
                .map(|v| 2 * d.key_dim() + v.start..2 * d.key_dim() + v.end),
        );
        out
    }

    /// Rank `r`'s values of the v heads (`attn_gate`'s rows, `ssm_out`'s columns).
    pub fn delta_values(&self, r: usize) -> Vec<Range<usize>> {
        let hv = self.delta.map_or(0, |d| d.head_v_dim);
        self.delta_v_heads(r)
            .into_iter()
            .map(|h| h.start * hv..h.end * hv)
            .collect()
    }

    /// Rank `r`'s rows of Qwen3-Next's `ssm_ba` (beta, then alpha, of each q/k head's v
    /// heads, grouped by q/k head).
    pub fn delta_ba_rows(&self, r: usize) -> Range<usize> {
        let (Some(d), Some(k)) = (self.delta, self.delta_k_heads.get(r)) else {
            return 0..0;
        };
        let per = 2 * (d.n_v_heads / d.n_k_heads.max(1));
        k.start * per..k.end * per
    }

    /// The tensor name without its `blk.N.` prefix.
    fn base(name: &str) -> &str {
        name.rsplit_once("blk.").map_or(name, |(_, rest)| {
            rest.split_once('.').map_or(rest, |(_, t)| t)
        })
    }

    /// The role of a hybrid's linear-attention or shared-expert weight (None: not one).
    fn hybrid_role(&self, base: &str) -> Option<Role> {
        match base {
            "ffn_gate_shexp.weight" | "ffn_up_shexp.weight" if !self.shexp.is_empty() => {
                Some(Role::ColumnParallel)
            }
            "ffn_down_shexp.weight" if !self.shexp.is_empty() => Some(Role::PartialSum),
            _ if self.delta.is_none() => None,
            // Products and per-head vectors split with the heads.
            "attn_qkv.weight" | "attn_gate.weight" | "ssm_beta.weight" | "ssm_alpha.weight"
            | "ssm_ba.weight" | "ssm_conv1d.weight" | "ssm_a" | "ssm_dt.bias" => {
                Some(Role::ColumnParallel)
            }
            "ssm_out.weight" => Some(Role::RowParallel),
            _ => None,
        }
    }

    /// What rank `r` holds of a hybrid's linear-attention or shared-expert weight (None:
    /// not one).
    fn hybrid_split(&self, base: &str, r: usize) -> Option<Split> {
        self.hybrid_role(base)?;
        Some(match base {
            "ffn_gate_shexp.weight" | "ffn_up_shexp.weight" => Split::Rows(self.shexp[r].clone()),
            "ffn_down_shexp.weight" => Split::Cols(self.shexp[r].clone()),
            "attn_qkv.weight" | "ssm_conv1d.weight" => Split::RowSets(self.delta_channels(r)),
            "attn_gate.weight" => Split::RowSets(self.delta_values(r)),
            "ssm_beta.weight" | "ssm_alpha.weight" | "ssm_a" | "ssm_dt.bias" => {
                Split::RowSets(self.delta_v_heads(r))
            }
            "ssm_ba.weight" => Split::Rows(self.delta_ba_rows(r)),
            "ssm_out.weight" => Split::ColSets(self.delta_values(r)),
            _ => return None,
        })
    }

    /// The role of the weight named `name` (a GGUF tensor name).
    pub fn role(&self, name: &str) -> Role {
        let base = Self::base(name);
        if let Some(role) = self.hybrid_role(base) {
            return role;
        }
        match base {
            "attn_q.weight"
            | "attn_k.weight"
            | "attn_v.weight"
            | "attn_q.bias"
            | "attn_k.bias"
            | "attn_v.bias"
            | "ffn_gate.weight"
            | "ffn_up.weight"
            | "ffn_gate_exps.weight"
            | "ffn_up_exps.weight" => Role::ColumnParallel,
            "attn_output.weight" | "ffn_down.weight" | "ffn_down_exps.weight" => Role::RowParallel,
            "output.weight" => Role::Vocab,
            _ => self.role_more(base),
        }
    }

    /// [`Self::role`] of mistral3's, phi3's and gpt-oss's own tensors (`base`: the name
    /// without `blk.N.`; a fused matrix's sections as `load.rs` names them).
    fn role_more(&self, base: &str) -> Role {
        match base {
            "attn_qkv.weight (q)"
            | "attn_qkv.weight (k)"
            | "attn_qkv.weight (v)"
            | "ffn_up.weight (gate)"
            | "ffn_up.weight (up)"
            | "attn_sinks.weight"
            | "ffn_gate_exps.bias"
            | "ffn_up_exps.bias" => Role::ColumnParallel,
            "ffn_down_exps.bias" => Role::RankZero,
            // The attention output's bias (gpt-oss) is added after the all-reduce, on every
            // rank to the same sum; the router and its bias route every token alike.
            _ => Role::Replicated,
        }
    }

    /// What rank `r` holds of the weight named `name`. `token_embd.weight` is replicated
    /// here; when it doubles as the LM head, [`Self::lm_head_split`] gives the head's part.
    pub fn split(&self, name: &str, r: usize) -> Split {
        let base = Self::base(name);
        if let Some(split) = self.hybrid_split(base, r) {
            return split;
        }
        match base {
            // Each head's query rows, then its gate's.
            "attn_q.weight" if self.q_gated => {
                let q = self.q_range(r);
                Split::Rows(2 * q.start..2 * q.end)
            }
            "attn_q.weight" | "attn_q.bias" => Split::Rows(self.q_range(r)),
            "attn_k.weight" | "attn_v.weight" | "attn_k.bias" | "attn_v.bias" => {
                Split::Rows(self.kv_range(r))
            }
            // A stacked expert tensor's rows are each expert's (see `shard_bytes`).
            "ffn_gate.weight" | "ffn_up.weight" | "ffn_gate_exps.weight" | "ffn_up_exps.weight" => {
                Split::Rows(self.ff[r].clone())
            }
            "attn_output.weight" => Split::Cols(self.q_range(r)),
            "ffn_down.weight" | "ffn_down_exps.weight" => Split::Cols(self.ff[r].clone()),
            "output.weight" => self.lm_head_split(r),
            _ => self.split_more(base, r),
        }
    }

    /// [`Self::split`] of mistral3's, phi3's and gpt-oss's own tensors (`base` as in
    /// [`Self::role_more`]).
    fn split_more(&self, base: &str, r: usize) -> Split {
        match base {
            // Phi-3's fused matrices, section by section (rows of the section).
            "attn_qkv.weight (q)" => Split::Rows(self.q_range(r)),
            "attn_qkv.weight (k)" | "attn_qkv.weight (v)" => Split::Rows(self.kv_range(r)),
            "ffn_up.weight (gate)" | "ffn_up.weight (up)" => Split::Rows(self.ff[r].clone()),
            // gpt-oss: a sink per query head; each expert's gate/up biases are a row of
            // `n_ff_exp` values (GGUF `[n_ff_exp, n_expert]`), cut like the rows they add to.
            "attn_sinks.weight" => Split::Rows(r * self.q_heads..(r + 1) * self.q_heads),
            "ffn_gate_exps.bias" | "ffn_up_exps.bias" => Split::Cols(self.ff[r].clone()),
            _ => Split::Replicated,
        }
    }

    /// The sections a fused matrix of `rows` rows loads as (`load.rs`: Phi-3's `attn_qkv`
    /// as its Q, K and V rows, its `ffn_up` of twice the feed-forward width as gate, then
    /// up), each by the name [`Self::split`] takes and with its rows in the whole tensor;
    /// empty for any other tensor (for the memory a rank's shards take).
    pub fn fused_sections(&self, name: &str, rows: usize) -> Vec<(String, Range<usize>)> {
        let q = self.q_heads * self.ranks * self.head_dim;
        let kv = self.kv_heads * self.ranks * self.head_dim;
        let ff = self.ff.last().map_or(0, |r| r.end);
        let parts: &[(&str, Range<usize>)] =
            if name.ends_with("attn_qkv.weight") && rows == q + 2 * kv {
                &[("q", 0..q), ("k", q..q + kv), ("v", q + kv..q + 2 * kv)]
            } else if name.ends_with("ffn_up.weight") && ff > 0 && rows == 2 * ff {
                &[("gate", 0..ff), ("up", ff..2 * ff)]
            } else {
                &[]
            };
        parts
            .iter()
            .map(|(what, r)| (format!("{name} ({what})"), r.clone()))
            .collect()
    }

    /// Rank `r`'s rows of the LM head (whichever tensor it is).
    pub fn lm_head_split(&self, r: usize) -> Split {
        Split::Rows(self.vocab[r].clone())
    }

    /// The configuration rank `r` runs: its own heads and feed-forward width (each
    /// expert's, for a mixture of experts; the vocabulary stays whole: the gathered logits
    /// are).
    pub fn rank_config(&self, cfg: &ModelConfig, r: usize) -> ModelConfig {
        let mut c = cfg.clone();
        c.n_head = self.q_heads;
        c.n_head_kv = self.kv_heads;
        match &mut c.ffn {
            FfnKind::Dense => c.n_ff = self.ff[r].len(),
            FfnKind::Moe(m) => {
                m.n_ff_exp = self.ff[r].len();
                if let Some(w) = &mut m.shared_expert {
                    *w = self.shexp[r].len();
                }
            }
        }
        if let Some(d) = self.delta_config(r) {
            c.delta_net = Some(d);
        }
        c
    }
}

/// The bytes of `split` of a tensor of type `ty` with GGUF dims `dims` (row length first)
/// whose data is `data`, and the shard's dims. Rows are contiguous byte ranges; a column
/// range takes each row's blocks in it, so its ends must fall on block boundaries. A 3-D
/// tensor is stacked matrices (`[cols, rows, n_expert]`): `Rows` takes those rows of each
/// matrix, `Cols` those columns of every row. `RowSets` / `ColSets` take each range's rows
/// (columns) in turn, concatenated.
pub fn shard_bytes(
    ty: GgmlType,
    dims: &[u64],
    data: &[u8],
    split: &Split,
) -> anyhow::Result<(Vec<u64>, Vec<u8>)> {
    let cols = *dims.first().unwrap_or(&1) as usize;
    let rows = dims.iter().skip(1).product::<u64>() as usize;
    let row_bytes = ty
        .bytes_for(cols as u64)
        .ok_or_else(|| anyhow::anyhow!("rows of {cols} values are not whole {ty} blocks"))?
        as usize;
    if data.len() != row_bytes * rows {
        anyhow::bail!("{} bytes for a {ty} tensor of {dims:?}", data.len());
    }
    let bs = ty.block_size();
    let block_bytes = ty.type_size();
    match split {
        Split::Replicated => Ok((dims.to_vec(), data.to_vec())),
        Split::Rows(r) if dims.len() <= 1 => {
            if r.end > cols || !r.start.is_multiple_of(bs) || !r.end.is_multiple_of(bs) {
                anyhow::bail!("elements {r:?} of a {ty} vector of {cols} are not whole blocks");
            }
            let (a, b) = (r.start / bs * block_bytes, r.end / bs * block_bytes);
            Ok((vec![r.len() as u64], data[a..b].to_vec()))
        }
        Split::Rows(r) => {
            // Rows of each stacked matrix (one matrix for a 2-D tensor).
            let per = *dims.get(1).unwrap_or(&1) as usize;
            if dims.len() > 3 || r.end > per || r.is_empty() {
                anyhow::bail!("rows {r:?} of a tensor of {dims:?}");
            }
            let mut out = Vec::with_capacity(r.len() * row_bytes * (rows / per.max(1)));
            for m in data.chunks_exact(per * row_bytes) {
                out.extend_from_slice(&m[r.start * row_bytes..r.end * row_bytes]);
            }
            let mut d = dims.to_vec();
            d[1] = r.len() as u64;
            Ok((d, out))
        }
        Split::Cols(c) => {
            if dims.is_empty() || dims.len() > 3 || c.end > cols || c.is_empty() {
                anyhow::bail!("columns {c:?} of a tensor of {dims:?}");
            }
            if !c.start.is_multiple_of(bs) || !c.end.is_multiple_of(bs) {
                anyhow::bail!(
                    "columns {c:?} of a {ty} matrix do not fall on its {bs}-value block boundaries"
                );
            }
            let (a, b) = (c.start / bs * block_bytes, c.end / bs * block_bytes);
            let mut out = Vec::with_capacity((b - a) * rows);
            for row in data.chunks_exact(row_bytes) {
                out.extend_from_slice(&row[a..b]);
            }
            let mut d = dims.to_vec();
            d[0] = c.len() as u64;
            Ok((d, out))
        }
        Split::RowSets(sets) if (1..=2).contains(&dims.len()) => {
            let mut out = Vec::new();
            let mut n = 0;
            for r in sets {
                let (_, b) = shard_bytes(ty, dims, data, &Split::Rows(r.clone()))?;
                out.extend_from_slice(&b);
                n += r.len();
            }
            if n == 0 {
                anyhow::bail!("no rows of a tensor of {dims:?}");
            }
            let mut d = dims.to_vec();
            d[dims.len().saturating_sub(1).min(1)] = n as u64;
            Ok((d, out))
        }
        Split::ColSets(sets) if dims.len() == 2 => {
            let parts = sets
                .iter()
                .map(|c| shard_bytes(ty, dims, data, &Split::Cols(c.clone())))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let n: usize = sets.iter().map(|c| c.len()).sum();
            if n == 0 {
                anyhow::bail!("no columns of a tensor of {dims:?}");
            }
            let mut out = Vec::with_capacity(parts.iter().map(|p| p.1.len()).sum());
            for row in 0..rows {
                for (d, b) in &parts {
                    let len = d[0] as usize / bs * block_bytes;
                    out.extend_from_slice(&b[row * len..(row + 1) * len]);
                }
            }
            Ok((vec![n as u64, dims[1]], out))
        }
        Split::RowSets(_) | Split::ColSets(_) => {
            anyhow::bail!("row or column sets of a tensor of {dims:?} (1-D or 2-D only)")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{SynthConfig, WeightType, write_synth_to};

    /// The configuration of a tiny synthetic model of `arch` (read back from its file),
    /// reshaped to `preset`'s head counts and widths ("tiny" keeps it).
    fn config(arch: Arch, preset: &str) -> ModelConfig {
        let (bytes, _) =
            write_synth_to(Vec::new(), &SynthConfig::tiny(arch), WeightType::F32, 1).unwrap();
        let file = kestrel_gguf::GgufFile::from_bytes(bytes).unwrap();
        let mut cfg = ModelConfig::from_gguf(&file).unwrap();
        if preset != "tiny" {
            let p = SynthConfig::preset(preset, Some(arch)).unwrap();
            cfg.n_layer = p.n_layer as usize;
            cfg.n_embd = p.n_embd as usize;
            cfg.n_head = p.n_head as usize;
            cfg.n_head_kv = p.n_head_kv as usize;
            cfg.head_dim = p.head_dim as usize;
            cfg.n_ff = p.n_ff as usize;
            cfg.vocab_size = p.n_vocab as usize;
        }
        cfg
    }

    /// Every column of every weight is held by exactly one rank (or by all, replicated),
    /// for each dense architecture and 1, 2, 4 ranks where the heads divide.
    #[test]
    fn column_and_row_splits_cover_each_weight_once() {
        for (arch, preset) in [
            (Arch::Llama, "llama3-8b"),
            (Arch::Qwen2, "qwen2.5-1.5b"),
            (Arch::Qwen3, "tiny"),
            (Arch::Gemma3, "tiny"),
            (Arch::Mistral3, "tiny"),
        ] {
            let cfg = config(arch, preset);
            for ranks in [1, 2, 4] {
                let Ok(plan) = TpPlan::new(&cfg, ranks) else {
                    assert!(
                        !cfg.n_head_kv.is_multiple_of(ranks)
                            || granule_ranges(cfg.n_ff, ranks, FF_GRANULE).is_none(),
                        "{arch:?} {ranks}: refused although heads and width divide"
                    );
                    continue;
                };
                let sizes = [
                    ("blk.3.attn_q.weight", cfg.q_dim()),
                    ("blk.3.attn_k.weight", cfg.kv_dim()),
                    ("blk.0.attn_v.bias", cfg.kv_dim()),
                    ("blk.1.ffn_up.weight", cfg.n_ff),
                    ("blk.1.ffn_gate.weight", cfg.n_ff),
                    ("blk.2.attn_output.weight", cfg.q_dim()),
                    ("blk.2.ffn_down.weight", cfg.n_ff),
                    ("output.weight", cfg.vocab_size),
                ];
                for (name, len) in sizes {
                    let mut seen = vec![0u8; len];
                    for r in 0..ranks {
                        let range = match plan.split(name, r) {
                            Split::Rows(x) | Split::Cols(x) => x,
                            other => panic!("{name}: {other:?}"),
                        };
                        seen[range].iter_mut().for_each(|s| *s += 1);
                    }
                    assert!(seen.iter().all(|&s| s == 1), "{arch:?} {ranks} {name}");
                }
                for name in [
                    "token_embd.weight",
                    "output_norm.weight",
                    "blk.0.attn_norm.weight",
                    "blk.0.attn_q_norm.weight",
                    "blk.0.post_attention_norm.weight",
                    "rope_freqs.weight",
                ] {
                    assert_eq!(plan.split(name, ranks - 1), Split::Replicated, "{name}");
                    assert_eq!(plan.role(name), Role::Replicated, "{name}");
                }
                assert_eq!(plan.role("blk.9.ffn_down.weight"), Role::RowParallel);
                assert_eq!(plan.role("blk.9.attn_k.bias"), Role::ColumnParallel);
                assert_eq!(plan.role("output.weight"), Role::Vocab);
                // A rank's query heads are exactly the groups of its KV heads, and the
                // attention output's input columns are its query columns.
                let group = cfg.n_head / cfg.n_head_kv;
                for r in 0..ranks {
                    let q = plan.q_range(r);
                    let kv = plan.kv_range(r);
                    assert_eq!(q.start / cfg.head_dim, kv.start / cfg.head_dim * group);
                    assert_eq!(q.len(), kv.len() * group);
                    assert_eq!(
                        plan.split("blk.0.attn_output.weight", r),
                        Split::Cols(q.clone())
                    );
                    let rc = plan.rank_config(&cfg, r);
                    assert_eq!(rc.q_dim(), q.len());
                    assert_eq!(rc.kv_dim(), kv.len());
                    assert_eq!(rc.n_ff, plan.ff[r].len());
                    assert!(plan.ff[r].len().is_multiple_of(FF_GRANULE));
                    assert_eq!(rc.vocab_size, cfg.vocab_size);
                }
                let chunk = cfg.vocab_size.div_ceil(ranks);
                assert_eq!(plan.vocab_chunk, chunk);
                assert!(plan.vocab.iter().all(|v| v.len() <= chunk && !v.is_empty()));
            }
        }
    }

    #[test]
    fn heads_that_do_not_divide_are_a_clear_error() {
        let mut cfg = config(Arch::Llama, "llama3-8b");
        let e = TpPlan::new(&cfg, 3).unwrap_err().to_string();
        assert!(
            e.contains("8 KV heads do not divide among 3 devices"),
            "{e}"
        );
        cfg.n_ff = 256 * 3;
        let e = TpPlan::new(&cfg, 4).unwrap_err().to_string();
        assert!(e.contains("feed-forward width 768"), "{e}");
        assert!(TpPlan::new(&cfg, 0).is_err());
        // The tiny qwen3moe's experts are 256 wide: one granule, not two.
        let moe = config(Arch::Qwen3Moe, "tiny");
        let e = TpPlan::new(&moe, 2).unwrap_err().to_string();
        assert!(
            e.contains("experts' feed-forward width 256 does not split into 2 parts"),
            "{e}"
        );
        assert!(TpPlan::new(&moe, 1).is_ok());
    }

    #[test]
    fn granules_and_layers_split_evenly() {
        assert_eq!(
            granule_ranges(14336, 2, 256).unwrap(),
            vec![0..7168, 7168..14336]
        );
        assert_eq!(granule_ranges(768, 2, 256).unwrap(), vec![0..512, 512..768]);
        assert!(granule_ranges(256, 2, 256).is_none());
        assert!(granule_ranges(300, 1, 256).is_none());
        assert_eq!(layer_ranges(80, 2).unwrap(), vec![0..40, 40..80]);
        assert_eq!(layer_ranges(5, 3).unwrap(), vec![0..2, 2..4, 4..5]);
        assert!(layer_ranges(2, 3).is_err());
        assert!(layer_ranges(2, 0).is_err());
    }

    /// The memory-sized layer plan against a brute-force oracle: for random layer sizes,
    /// extras and capacities, the ranges are contiguous, non-empty and cover every layer,
    /// and no other split into contiguous non-empty ranges comes nearer to the capacity
    /// shares at any boundary (each boundary is the best one given the targets); a plan
    /// that does not fit is refused, naming the stage.
    #[test]
    fn layer_ranges_by_memory_follow_the_capacities() {
        use rand::{Rng, SeedableRng};
        let b = |v: &[u64]| v.to_vec();
        // Equal layers, equal devices: halves; a device three times larger: a quarter.
        assert_eq!(
            layer_ranges_by_memory(&[10; 80], 0, 0, &[1000, 1000]).unwrap(),
            vec![0..40, 40..80]
        );
        assert_eq!(
            layer_ranges_by_memory(&[10; 80], 0, 0, &[1000, 3000]).unwrap(),
            vec![0..20, 20..80]
        );
        // The embedding on the first stage and the head on the last move the boundary.
        assert_eq!(
            layer_ranges_by_memory(&[10; 8], 40, 0, &[1000, 1000]).unwrap(),
            vec![0..2, 2..8]
        );
        assert_eq!(
            layer_ranges_by_memory(&[10; 8], 0, 40, &[1000, 1000]).unwrap(),
            vec![0..6, 6..8]
        );
        // Every stage keeps a layer even when its share would be none, and is refused
        // when that layer does not fit.
        let e = layer_ranges_by_memory(&[10; 3], 0, 0, &[1, 1000, 1]).unwrap_err();
        assert!(e.to_string().contains("stage 0 (layers 0..1)"), "{e}");
        assert_eq!(
            layer_ranges_by_memory(&[10; 3], 0, 0, &[100, 1000, 100]).unwrap(),
            vec![0..1, 1..2, 2..3]
        );
        let e = layer_ranges_by_memory(&[10; 8], 0, 0, &[30, 30]).unwrap_err();
        assert!(e.to_string().contains("stage 0 (layers 0..4)"), "{e}");
        assert!(layer_ranges_by_memory(&b(&[1, 2]), 0, 0, &[9, 9, 9]).is_err());
        assert!(layer_ranges_by_memory(&b(&[1, 2]), 0, 0, &[]).is_err());
        assert!(layer_ranges_by_memory(&b(&[1, 2]), 0, 0, &[0, 0]).is_err());

        let mut rng = rand::rngs::StdRng::seed_from_u64(0x1a7e);
        for _ in 0..300 {
            let n = rng.random_range(1..40usize);
            let stages = rng.random_range(1..=n.min(5));
            let layers: Vec<u64> = (0..n).map(|_| rng.random_range(1..1000u64)).collect();
            let (first, last) = (rng.random_range(0..3000u64), rng.random_range(0..3000u64));
            let total: u64 = layers.iter().sum::<u64>() + first + last;
            let caps: Vec<u64> = (0..stages)
                .map(|_| rng.random_range(total / stages as u64..=2 * total))
                .collect();
            let got = match layer_ranges_by_memory(&layers, first, last, &caps) {
                Ok(r) => r,
                Err(e) => {
                    // Refused only when some stage of the nearest split truly overflows.
                    assert!(e.to_string().contains("does not fit"), "{e}");
                    continue;
                }
            };
            assert_eq!(got.len(), stages);
            assert_eq!(got[0].start, 0);
            assert_eq!(got[stages - 1].end, n);
            for w in got.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
            assert!(got.iter().all(|r| !r.is_empty()), "{got:?}");
            // Oracle: each boundary minimizes |bytes before it - target| over the
            // boundaries allowed after the previous one.
            let cap_total: u64 = caps.iter().sum();
            let mut cap_before = 0u64;
            for s in 0..stages - 1 {
                cap_before += caps[s];
                let target = u128::from(total) * u128::from(cap_before) / u128::from(cap_total);
                let before = |e: usize| u128::from(first + layers[..e].iter().sum::<u64>());
                let lo = got[s].start + 1;
                let hi = n - (stages - s - 1);
                let best = (lo..=hi).map(|e| before(e).abs_diff(target)).min().unwrap();
                assert_eq!(before(got[s].end).abs_diff(target), best, "{got:?}");
            }
            // And each stage fits its device.
            for (s, r) in got.iter().enumerate() {
                let mut need: u64 = layers[r.clone()].iter().sum();
                need += if s == 0 { first } else { 0 } + if s + 1 == stages { last } else { 0 };
                assert!(need <= caps[s]);
            }
        }
    }

    /// A shard's dequantized values are the same slice of the whole tensor's dequantized
    /// values (the oracle: kestrel-quant's dequantizer on the unsplit rows), for random
    /// rows of block formats and random block-aligned ranges.
    #[test]
    fn shard_bytes_match_slices_of_the_dequantized_tensor() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x7a11);
        for ty in [
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4K,
            GgmlType::Q6K,
        ] {
            let bs = ty.block_size();
            let (cols, rows) = (
                bs * rng.random_range(2..6usize),
                rng.random_range(3..9usize),
            );
            let values: Vec<f32> = (0..cols * rows)
                .map(|_| rng.random_range(-2.0..2.0))
                .collect();
            let data = kestrel_quant::quantize(ty, &values, cols).unwrap();
            let mut full = vec![0f32; cols * rows];
            kestrel_quant::dequantize_row(ty, &data, &mut full).unwrap();
            let dims = [cols as u64, rows as u64];
            let r0 = rng.random_range(0..rows - 1);
            let r1 = rng.random_range(r0 + 1..=rows);
            let (d, b) = shard_bytes(ty, &dims, &data, &Split::Rows(r0..r1)).unwrap();
            assert_eq!(d, vec![cols as u64, (r1 - r0) as u64]);
            let mut got = vec![0f32; cols * (r1 - r0)];
            kestrel_quant::dequantize_row(ty, &b, &mut got).unwrap();
            assert_eq!(got, full[r0 * cols..r1 * cols], "{ty} rows");
            let c0 = bs * rng.random_range(0..cols / bs - 1);
            let c1 = bs * rng.random_range(c0 / bs + 1..=cols / bs);
            let (d, b) = shard_bytes(ty, &dims, &data, &Split::Cols(c0..c1)).unwrap();
            assert_eq!(d, vec![(c1 - c0) as u64, rows as u64]);
            let mut got = vec![0f32; (c1 - c0) * rows];
            kestrel_quant::dequantize_row(ty, &b, &mut got).unwrap();
            let want: Vec<f32> = full
                .chunks_exact(cols)
                .flat_map(|row| row[c0..c1].iter().copied())
                .collect();
            assert_eq!(got, want, "{ty} cols {c0}..{c1}");
            if bs > 1 {
                let e = shard_bytes(ty, &dims, &data, &Split::Cols(1..bs + 1)).unwrap_err();
                assert!(e.to_string().contains("block boundaries"), "{e}");
            }
        }
        assert!(shard_bytes(GgmlType::F32, &[4, 2], &[0u8; 31], &Split::Replicated).is_err());
    }

    /// The tiny qwen3moe reshaped as Qwen3-30B-A3B (128 experts of 768, 4 KV heads).
    fn qwen3_30b() -> ModelConfig {
        let mut cfg = config(Arch::Qwen3Moe, "qwen3-30b-a3b");
        let FfnKind::Moe(m) = &mut cfg.ffn else {
            panic!("qwen3moe without experts")
        };
        m.n_expert = 128;
        m.n_expert_used = 8;
        m.n_ff_exp = 768;
        cfg
    }

    /// Qwen3-30B-A3B over 2 ranks: the expert width 768 in 256-value granules gives 512
    /// and 256; gate/up experts are column-parallel by each expert's rows, down experts
    /// row-parallel by their columns (the same ranges), the router replicated; each rank
    /// runs its own expert width; 3 ranks take a granule each, 4 are refused.
    #[test]
    fn qwen3moe_experts_split_by_the_expert_width() {
        let cfg = qwen3_30b();
        let plan = TpPlan::new(&cfg, 2).unwrap();
        assert_eq!(plan.ff, vec![0..512, 512..768]);
        assert_eq!((plan.kv_heads, plan.q_heads), (2, 16));
        for (name, role) in [
            ("blk.0.ffn_gate_exps.weight", Role::ColumnParallel),
            ("blk.47.ffn_up_exps.weight", Role::ColumnParallel),
            ("blk.5.ffn_down_exps.weight", Role::RowParallel),
            ("blk.5.ffn_gate_inp.weight", Role::Replicated),
            ("blk.5.ffn_norm.weight", Role::Replicated),
            ("blk.5.attn_output.weight", Role::RowParallel),
        ] {
            assert_eq!(plan.role(name), role, "{name}");
        }
        for r in 0..2 {
            let ff = plan.ff[r].clone();
            assert_eq!(
                plan.split("blk.3.ffn_gate_exps.weight", r),
                Split::Rows(ff.clone())
            );
            assert_eq!(
                plan.split("blk.3.ffn_up_exps.weight", r),
                Split::Rows(ff.clone())
            );
            assert_eq!(
                plan.split("blk.3.ffn_down_exps.weight", r),
                Split::Cols(ff.clone())
            );
            assert_eq!(
                plan.split("blk.3.ffn_gate_inp.weight", r),
                Split::Replicated
            );
            let rc = plan.rank_config(&cfg, r);
            let FfnKind::Moe(m) = rc.ffn else {
                panic!("rank config without experts")
            };
            assert_eq!(m.n_ff_exp, ff.len());
            assert_eq!((m.n_expert, m.n_expert_used), (128, 8));
            assert_eq!(rc.n_ff, cfg.n_ff, "the dense width is not the experts'");
            assert!(m.n_ff_exp.is_multiple_of(FF_GRANULE));
        }
        let e = TpPlan::new(&cfg, 3).unwrap_err().to_string();
        assert!(e.contains("4 KV heads do not divide among 3"), "{e}");
        let mut six = cfg.clone();
        (six.n_head, six.n_head_kv) = (12, 6);
        let three = TpPlan::new(&six, 3).unwrap();
        assert_eq!(three.ff, vec![0..256, 256..512, 512..768]);
        // 4 KV heads divide among 4, 3 granules do not.
        let e = TpPlan::new(&cfg, 4).unwrap_err().to_string();
        assert!(
            e.contains("experts' feed-forward width 768 does not split into 4 parts"),
            "{e}"
        );
    }

    /// What tensor parallelism refuses, each with a message that says why: experts or a
    /// shared expert whose width is not whole granules, a hybrid whose q/k heads do not
    /// divide.
    #[test]
    fn unsupported_models_are_refused_clearly() {
        let mut cfg = qwen3_30b();
        if let FfnKind::Moe(m) = &mut cfg.ffn {
            m.n_ff_exp = 800;
        }
        let e = TpPlan::new(&cfg, 2).unwrap_err().to_string();
        assert!(e.contains("width 800"), "{e}");
        // A shared expert splits like a dense block: in whole granules.
        let mut cfg = qwen3_30b();
        if let FfnKind::Moe(m) = &mut cfg.ffn {
            m.shared_expert = Some(512);
        }
        assert_eq!(TpPlan::new(&cfg, 2).unwrap().shexp, vec![0..256, 256..512]);
        let e = TpPlan::new(&cfg, 4).unwrap_err().to_string();
        assert!(
            e.contains("shared expert's width 512 does not split into 4"),
            "{e}"
        );
        // A hybrid's q/k heads must divide among the ranks (its KV heads do here).
        let mut cfg = hybrid(Arch::Qwen35, 3, 6, 64);
        (cfg.n_head, cfg.n_head_kv, cfg.n_ff) = (8, 4, 3 * FF_GRANULE);
        let e = TpPlan::new(&cfg, 2).unwrap_err().to_string();
        assert!(
            e.contains("3 linear-attention q/k heads do not divide among 2 devices"),
            "{e}"
        );
        assert!(TpPlan::new(&cfg, 3).is_err(), "4 KV heads among 3");
        (cfg.n_head, cfg.n_head_kv) = (6, 3);
        assert!(TpPlan::new(&cfg, 3).is_ok());
    }

    /// The tiny hybrid of `arch` (qwen35, qwen35moe, qwen3next) with `nk` q/k heads, `nv` v
    /// heads of `hd` dimensions, written as `ty` (its configuration and file).
    fn hybrid_file(
        arch: Arch,
        nk: u32,
        nv: u32,
        hd: u32,
        ty: WeightType,
    ) -> (ModelConfig, kestrel_gguf::GgufFile) {
        let mut sc = SynthConfig::tiny(arch);
        (sc.n_head, sc.n_head_kv) = (8, 2);
        if sc.n_expert > 0 {
            sc.n_ff_exp = 512;
        }
        let h = sc.hybrid.as_mut().unwrap();
        (h.n_group, h.n_v_heads, h.d_state) = (nk, nv, hd);
        if h.n_ff_shexp > 0 {
            h.n_ff_shexp = 512;
        }
        let (bytes, _) = write_synth_to(Vec::new(), &sc, ty, 7).unwrap();
        let file = kestrel_gguf::GgufFile::from_bytes(bytes).unwrap();
        (ModelConfig::from_gguf(&file).unwrap(), file)
    }

    fn hybrid(arch: Arch, nk: u32, nv: u32, hd: u32) -> ModelConfig {
        hybrid_file(arch, nk, nv, hd, WeightType::F32).0
    }

    /// The whole model's v head behind each of rank `r`'s v heads, found independently of
    /// the plan's formulas: rank r's local v head `h` pairs with its local q/k head
    /// `local.k_head(h)`; it is the m-th of its local heads paired with that head, so it is
    /// the m-th global v head (in order) paired with the global q/k head it stands for.
    fn v_heads_oracle(d: &DeltaNetConfig, local: &DeltaNetConfig, k0: usize) -> Vec<usize> {
        let mut seen = vec![0usize; local.n_k_heads];
        (0..local.n_v_heads)
            .map(|h| {
                let lk = local.k_head(h);
                let m = seen[lk];
                seen[lk] += 1;
                (0..d.n_v_heads)
                    .filter(|&g| d.k_head(g) == k0 + lk)
                    .nth(m)
                    .expect("as many v heads per q/k head")
            })
            .collect()
    }

    /// The hybrids' linear-attention heads over 1-4 ranks, for both pairings (Qwen3-Next's
    /// grouped, Qwen3.5's interleaved) and several head counts: each rank holds whole q/k
    /// heads and exactly the v heads paired with them, in the order its own pairing reads
    /// them (against [`v_heads_oracle`]); every v head, channel and beta/alpha column is
    /// held by exactly one rank; each rank's state is 1/N of the whole; what does not
    /// divide is refused.
    #[test]
    fn hybrid_heads_split_with_their_pairs() {
        for arch in [Arch::Qwen35, Arch::Qwen3Next, Arch::Qwen35Moe] {
            for (nk, nv) in [(2, 4), (4, 8), (4, 4), (6, 12), (16, 32), (3, 6)] {
                let mut cfg = hybrid(arch, nk, nv, 32);
                (cfg.n_head, cfg.n_head_kv) = (24, 12);
                cfg.n_ff = 12 * FF_GRANULE;
                if let FfnKind::Moe(m) = &mut cfg.ffn {
                    m.n_ff_exp = 12 * FF_GRANULE;
                    m.shared_expert = Some(12 * FF_GRANULE);
                }
                let d = cfg.delta_net.unwrap();
                for ranks in 1..=4 {
                    let plan = match TpPlan::new(&cfg, ranks) {
                        Ok(p) => p,
                        Err(e) => {
                            assert!(
                                !d.n_k_heads.is_multiple_of(ranks),
                                "{arch:?} {nk}/{nv}: {e}"
                            );
                            assert!(e.to_string().contains("q/k heads do not divide"), "{e}");
                            continue;
                        }
                    };
                    assert!(d.n_k_heads.is_multiple_of(ranks));
                    let (mut v_seen, mut ch_seen) = (vec![0; nv as usize], vec![0; d.conv_dim()]);
                    let mut ba_seen = vec![0; 2 * nv as usize];
                    for r in 0..ranks {
                        let local = plan.delta_config(r).unwrap();
                        let k = plan.delta_k_heads[r].clone();
                        assert_eq!(local.n_k_heads, d.n_k_heads / ranks);
                        assert_eq!(local.n_v_heads, d.n_v_heads / ranks);
                        assert_eq!(local.state_len() * ranks, d.state_len());
                        assert_eq!(local.conv_state_len() * ranks, d.conv_state_len());
                        let heads: Vec<usize> =
                            plan.delta_v_heads(r).into_iter().flatten().collect();
                        assert_eq!(heads, v_heads_oracle(&d, &local, k.start), "{arch:?} {r}");
                        for (h, &g) in heads.iter().enumerate() {
                            assert_eq!(d.k_head(g), k.start + local.k_head(h));
                            v_seen[g] += 1;
                        }
                        let ch: Vec<usize> = plan.delta_channels(r).into_iter().flatten().collect();
                        assert_eq!(ch.len(), local.conv_dim());
                        ch.iter().for_each(|&c| ch_seen[c] += 1);
                        if d.qwen3next_layout {
                            let ba = plan.delta_ba_rows(r);
                            for (h, &g) in heads.iter().enumerate() {
                                let (b, a) = local.beta_alpha_cols(h);
                                assert_eq!((ba.start + b, ba.start + a), d.beta_alpha_cols(g));
                            }
                            ba_seen[ba].iter_mut().for_each(|s| *s += 1);
                        }
                        let rc = plan.rank_config(&cfg, r);
                        assert_eq!(rc.delta_net, Some(local));
                        assert!(rc.recurrent_state_bytes() * ranks == cfg.recurrent_state_bytes());
                    }
                    assert!(v_seen.iter().all(|&s| s == 1), "{arch:?} {nk}/{nv} {ranks}");
                    assert!(
                        ch_seen.iter().all(|&s| s == 1),
                        "{arch:?} {nk}/{nv} {ranks}"
                    );
                    if d.qwen3next_layout {
                        assert!(ba_seen.iter().all(|&s| s == 1));
                    }
                }
            }
        }
    }

    /// Every tensor of a hybrid file (qwen35, qwen35moe, qwen3next; F32, Q8_0 and Q4_K_M
    /// weights) cut for each of 2 ranks against slicing the whole dequantized tensor on the
    /// host, the slice built from each section's own index map (q, k and v channels of
    /// `attn_qkv` and the convolution; v heads of `attn_gate`, beta / alpha, `ssm_a`,
    /// `ssm_dt`; columns of `ssm_out`; each gated query head's rows of `attn_q`; the shared
    /// expert's rows and columns), with the v heads from [`v_heads_oracle`]; the roles say
    /// what follows each product.
    #[test]
    fn hybrid_shards_match_slices_of_the_dequantized_tensors() {
        let deq = |ty: GgmlType, b: &[u8], len: usize| {
            let mut v = vec![0f32; len];
            kestrel_quant::dequantize_row(ty, b, &mut v).unwrap();
            v
        };
        for (arch, ty) in [
            (Arch::Qwen35, WeightType::Q4KM),
            (Arch::Qwen35, WeightType::F32),
            (Arch::Qwen3Next, WeightType::Q8_0),
            (Arch::Qwen35Moe, WeightType::Q4KM),
            (Arch::Qwen3Next, WeightType::Q4KM),
        ] {
            // 4 q/k heads, 8 v heads of 128: 2 q/k heads a rank, whole 256-value blocks of
            // v-head columns.
            let (cfg, file) = hybrid_file(arch, 4, 8, 128, ty);
            let plan = TpPlan::new(&cfg, 2).unwrap();
            let d = cfg.delta_net.unwrap();
            let (hk, hv, hd) = (d.head_k_dim, d.head_v_dim, cfg.head_dim);
            let mut cut = 0;
            for t in file.tensors() {
                let base = TpPlan::base(&t.name).to_string();
                let cols = t.dims[0] as usize;
                let rows = t.dims.iter().skip(1).product::<u64>() as usize;
                if t.dims.len() > 2 {
                    assert!(t.name.contains("_exps."), "{}", t.name);
                    continue;
                }
                let full = deq(t.ty, file.tensor_data(t), cols * rows);
                for r in 0..2 {
                    let local = plan.delta_config(r).unwrap();
                    let k0 = plan.delta_k_heads[r].start;
                    let vh = v_heads_oracle(&d, &local, k0);
                    let (kl, vl) = (local.n_k_heads, local.n_v_heads);
                    // Local index → global index along the split dimension.
                    let v_value = |i: usize| vh[i / hv] * hv + i % hv;
                    let map: Option<Box<dyn Fn(usize) -> usize>> = match base.as_str() {
                        "attn_qkv.weight" | "ssm_conv1d.weight" => Some(Box::new(move |c| {
                            if c < kl * hk {
                                k0 * hk + c
                            } else if c < 2 * kl * hk {
                                d.key_dim() + k0 * hk + c - kl * hk
                            } else {
                                2 * d.key_dim() + v_value(c - 2 * kl * hk)
                            }
                        })),
                        "attn_gate.weight" | "ssm_out.weight" => Some(Box::new(v_value)),
                        "ssm_beta.weight" | "ssm_alpha.weight" | "ssm_a" | "ssm_dt.bias" => {
                            Some(Box::new(|h| vh[h]))
                        }
                        // Beta then alpha of each q/k head's v heads.
                        "ssm_ba.weight" => Some(Box::new(move |c| {
                            let per = 2 * (vl / kl);
                            (k0 + c / per) * per + c % per
                        })),
                        "attn_q.weight" => {
                            let q0 = plan.q_range(r).start / hd;
                            Some(Box::new(move |i| {
                                (q0 + i / (2 * hd)) * 2 * hd + i % (2 * hd)
                            }))
                        }
                        "attn_k.weight" | "attn_v.weight" => {
                            let k = plan.kv_range(r).start;
                            Some(Box::new(move |i| k + i))
                        }
                        "attn_output.weight" => {
                            let q = plan.q_range(r).start;
                            Some(Box::new(move |i| q + i))
                        }
                        "ffn_gate_shexp.weight"
                        | "ffn_up_shexp.weight"
                        | "ffn_down_shexp.weight" => {
                            let s = plan.shexp[r].start;
                            Some(Box::new(move |i| s + i))
                        }
                        "ffn_gate.weight" | "ffn_up.weight" | "ffn_down.weight" => {
                            let s = plan.ff[r].start;
                            Some(Box::new(move |i| s + i))
                        }
                        "output.weight" => {
                            let s = plan.vocab[r].start;
                            Some(Box::new(move |i| s + i))
                        }
                        _ => None,
                    };
                    let split = plan.split(&t.name, r);
                    let Some(map) = map else {
                        assert_eq!(split, Split::Replicated, "{}", t.name);
                        assert_eq!(plan.role(&t.name), Role::Replicated, "{}", t.name);
                        continue;
                    };
                    let (dims, bytes) = shard_bytes(t.ty, &t.dims, file.tensor_data(t), &split)
                        .unwrap_or_else(|e| panic!("{} {ty:?} rank {r}: {e:#}", t.name));
                    let n = split.shard_len().unwrap();
                    let got = deq(t.ty, &bytes, dims.iter().product::<u64>() as usize);
                    let want: Vec<f32> = if split.is_cols() {
                        assert_eq!(dims, vec![n as u64, rows as u64]);
                        (0..rows)
                            .flat_map(|row| (0..n).map(move |c| (row, c)))
                            .map(|(row, c)| full[row * cols + map(c)])
                            .collect()
                    } else if t.dims.len() == 1 {
                        assert_eq!(dims, vec![n as u64]);
                        (0..n).map(|i| full[map(i)]).collect()
                    } else {
                        assert_eq!(dims, vec![cols as u64, n as u64]);
                        (0..n)
                            .flat_map(|i| full[map(i) * cols..(map(i) + 1) * cols].iter().copied())
                            .collect()
                    };
                    assert_eq!(got, want, "{} {ty:?} rank {r}", t.name);
                    let role = plan.role(&t.name);
                    let want_role = match base.as_str() {
                        "ssm_out.weight" | "attn_output.weight" | "ffn_down.weight" => {
                            Role::RowParallel
                        }
                        "ffn_down_shexp.weight" => Role::PartialSum,
                        "output.weight" => Role::Vocab,
                        _ => Role::ColumnParallel,
                    };
                    assert_eq!(role, want_role, "{}", t.name);
                    cut += 1;
                }
            }
            // Per linear-attention layer: qkv, gate, beta/alpha (1 or 2), conv, a, dt, out.
            let dn_layers = cfg.n_layer - cfg.n_layer / 4;
            let per = if d.qwen3next_layout { 7 } else { 8 };
            assert!(cut >= 2 * dn_layers * per, "{arch:?}: {cut} shards checked");
            // And a rank's config reads its shards' shapes.
            let rc = plan.rank_config(&cfg, 1);
            assert_eq!(rc.q_dim(), plan.q_range(1).len());
            if let FfnKind::Moe(m) = rc.ffn {
                assert_eq!(m.shared_expert, Some(256));
                assert_eq!(m.n_ff_exp, 256);
            }
        }
    }

    /// The 3-D cut of stacked experts against slicing the dequantized tensor on the host,
    /// per expert, for random shapes of each expert format; then the split's arithmetic
    /// against an f64 oracle: for random inputs, one expert's SwiGLU MLP over the whole
    /// tensors equals the sum of the ranks' MLPs over their shards (gate/up rows, down
    /// columns of the plan's ranges), which is what the all-reduce adds up.
    #[test]
    fn stacked_experts_cut_per_expert_and_partial_sums_add_up() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x3e77);
        let deq = |ty: GgmlType, b: &[u8], len: usize| {
            let mut v = vec![0f32; len];
            kestrel_quant::dequantize_row(ty, b, &mut v).unwrap();
            v
        };
        for ty in [
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4K,
            GgmlType::Q6K,
        ] {
            let bs = ty.block_size();
            let ne = rng.random_range(2..6usize);
            let (cols, rows) = (
                bs * rng.random_range(2..5usize),
                rng.random_range(3..11usize),
            );
            let values: Vec<f32> = (0..cols * rows * ne)
                .map(|_| rng.random_range(-2.0..2.0))
                .collect();
            let data = kestrel_quant::quantize(ty, &values, cols).unwrap();
            let full = deq(ty, &data, values.len());
            let dims = [cols as u64, rows as u64, ne as u64];
            let r0 = rng.random_range(0..rows - 1);
            let r1 = rng.random_range(r0 + 1..=rows);
            let (d, b) = shard_bytes(ty, &dims, &data, &Split::Rows(r0..r1)).unwrap();
            assert_eq!(d, vec![cols as u64, (r1 - r0) as u64, ne as u64]);
            let want: Vec<f32> = full
                .chunks_exact(rows * cols)
                .flat_map(|m| m[r0 * cols..r1 * cols].iter().copied())
                .collect();
            assert_eq!(deq(ty, &b, want.len()), want, "{ty} rows {r0}..{r1}");
            let c0 = bs * rng.random_range(0..cols / bs - 1);
            let c1 = bs * rng.random_range(c0 / bs + 1..=cols / bs);
            let (d, b) = shard_bytes(ty, &dims, &data, &Split::Cols(c0..c1)).unwrap();
            assert_eq!(d, vec![(c1 - c0) as u64, rows as u64, ne as u64]);
            let want: Vec<f32> = full
                .chunks_exact(cols)
                .flat_map(|row| row[c0..c1].iter().copied())
                .collect();
            assert_eq!(deq(ty, &b, want.len()), want, "{ty} cols {c0}..{c1}");
            assert!(shard_bytes(ty, &dims, &data, &Split::Rows(0..rows + 1)).is_err());
            if bs > 1 {
                let e = shard_bytes(ty, &dims, &data, &Split::Cols(1..bs + 1)).unwrap_err();
                assert!(e.to_string().contains("block boundaries"), "{e}");
            }
        }

        // The plan's split of a small qwen3moe (n_embd 64, 3 experts of 768 over 2 and 3
        // ranks), Q8_0 experts: Σ over ranks of down_r · (silu(gate_r x) ⊙ up_r x) against
        // the whole expert's output, all in f64 from the dequantized shards.
        let mut cfg = qwen3_30b();
        cfg.n_embd = 64;
        (cfg.n_head, cfg.n_head_kv) = (12, 6);
        let FfnKind::Moe(m) = &mut cfg.ffn else {
            unreachable!()
        };
        m.n_expert = 3;
        let (d, ff, ne) = (cfg.n_embd, 768usize, 3usize);
        let ty = GgmlType::Q8_0;
        let mut tensor = |cols: usize, rows: usize| {
            let v: Vec<f32> = (0..cols * rows * ne)
                .map(|_| rng.random_range(-0.5..0.5))
                .collect();
            kestrel_quant::quantize(ty, &v, cols).unwrap()
        };
        let (gate, up, down) = (tensor(d, ff), tensor(d, ff), tensor(ff, d));
        let x: Vec<f64> = (0..d).map(|i| ((i * 7 % 13) as f64 - 6.0) / 5.0).collect();
        // One expert's MLP from dequantized [ff × d] gate/up and [d × ff'] down (any width).
        let mlp = |g: &[f32], u: &[f32], dn: &[f32], width: usize, e: usize| -> Vec<f64> {
            let (g, u) = (&g[e * width * d..], &u[e * width * d..]);
            let dn = &dn[e * d * width..];
            let act: Vec<f64> = (0..width)
                .map(|j| {
                    let dot = |w: &[f32]| -> f64 {
                        (0..d).map(|i| w[j * d + i] as f64 * x[i]).sum::<f64>()
                    };
                    let gv = dot(g);
                    gv / (1.0 + (-gv).exp()) * dot(u)
                })
                .collect();
            (0..d)
                .map(|o| (0..width).map(|j| dn[o * width + j] as f64 * act[j]).sum())
                .collect()
        };
        let deq_all = |b: &[u8], len: usize| deq(ty, b, len);
        let (gf, uf, df) = (
            deq_all(&gate, d * ff * ne),
            deq_all(&up, d * ff * ne),
            deq_all(&down, d * ff * ne),
        );
        for ranks in [2, 3] {
            let plan = TpPlan::new(&cfg, ranks).unwrap();
            let shard = |name: &str, data: &[u8], dims: [u64; 3], r: usize| {
                let (sd, b) = shard_bytes(ty, &dims, data, &plan.split(name, r)).unwrap();
                let len = sd.iter().product::<u64>() as usize;
                deq(ty, &b, len)
            };
            for e in 0..ne {
                let whole = mlp(&gf, &uf, &df, ff, e);
                let mut sum = vec![0f64; d];
                for r in 0..ranks {
                    let w = plan.ff[r].len();
                    let dims_gu = [d as u64, ff as u64, ne as u64];
                    let g = shard("blk.0.ffn_gate_exps.weight", &gate, dims_gu, r);
                    let u = shard("blk.0.ffn_up_exps.weight", &up, dims_gu, r);
                    let dn = shard(
                        "blk.0.ffn_down_exps.weight",
                        &down,
                        [ff as u64, d as u64, ne as u64],
                        r,
                    );
                    assert_eq!((g.len(), dn.len()), (w * d * ne, w * d * ne));
                    for (s, p) in sum.iter_mut().zip(mlp(&g, &u, &dn, w, e)) {
                        *s += p;
                    }
                }
                for (o, (a, b)) in whole.iter().zip(&sum).enumerate() {
                    assert!(
                        (a - b).abs() <= 1e-9 * (1.0 + a.abs()),
                        "{ranks} ranks, expert {e}, output {o}: {a} vs {b}"
                    );
                }
            }
        }
    }

    /// Random values in [-a, a) quantized as `ty` rows of `cols`, and their dequantized
    /// values (the oracle the shards are sliced from).
    fn random_tensor(
        rng: &mut rand::rngs::StdRng,
        ty: GgmlType,
        cols: usize,
        rows: usize,
        a: f32,
    ) -> (Vec<u8>, Vec<f32>) {
        use rand::Rng;
        let v: Vec<f32> = (0..cols * rows).map(|_| rng.random_range(-a..a)).collect();
        let data = kestrel_quant::quantize(ty, &v, cols).unwrap();
        let mut full = vec![0f32; v.len()];
        kestrel_quant::dequantize_row(ty, &data, &mut full).unwrap();
        (data, full)
    }

    /// The dequantized values of `bytes` (`len` values of `ty`).
    fn deq(ty: GgmlType, bytes: &[u8], len: usize) -> Vec<f32> {
        let mut v = vec![0f32; len];
        kestrel_quant::dequantize_row(ty, bytes, &mut v).unwrap();
        v
    }

    /// Rank `r`'s shard of fused section `name` (rows `sec` of a fused matrix of `cols`
    /// values a row in `data`, sliced as `load.rs` slices it), dequantized, with the rows
    /// of the whole tensor it holds.
    fn section_shard(
        plan: &TpPlan,
        ty: GgmlType,
        cols: usize,
        data: &[u8],
        name: &str,
        sec: &Range<usize>,
        r: usize,
    ) -> (Vec<f32>, Range<usize>) {
        let row_bytes = ty.bytes_for(cols as u64).unwrap() as usize;
        let part = &data[sec.start * row_bytes..sec.end * row_bytes];
        let dims = [cols as u64, sec.len() as u64];
        let Split::Rows(x) = plan.split(name, r) else {
            panic!("{name}: not split by rows")
        };
        assert_eq!(plan.role(name), Role::ColumnParallel, "{name}");
        let (d, b) = shard_bytes(ty, &dims, part, &Split::Rows(x.clone())).unwrap();
        assert_eq!(d, vec![cols as u64, x.len() as u64], "{name}");
        (
            deq(ty, &b, cols * x.len()),
            sec.start + x.start..sec.start + x.end,
        )
    }

    /// Phi-3's fused matrices over 2 and 3 ranks: `attn_qkv` loads as its Q, K and V
    /// sections and `ffn_up` as gate then up (`fused_sections`), each cut by its own rule,
    /// so each rank's shard of each section is its heads' rows (its feed-forward range);
    /// every shard against the same rows sliced from the dequantized whole tensor, every
    /// row of both tensors held by exactly one rank; then, in f64, the ranks' partial
    /// sums of the MLP over their shards of the fused gate/up add up to the whole MLP.
    #[test]
    fn phi3_fused_matrices_are_cut_per_section() {
        use rand::SeedableRng;
        let mut rng = rand::rngs::StdRng::seed_from_u64(0xf13);
        let mut cfg = config(Arch::Phi3, "tiny");
        (cfg.n_head, cfg.n_head_kv, cfg.n_ff) = (12, 6, 768);
        let (d, q, kv, ff) = (cfg.n_embd, cfg.q_dim(), cfg.kv_dim(), cfg.n_ff);
        for ty in [
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::Q8_0,
            GgmlType::Q4K,
            GgmlType::Q6K,
        ] {
            let (qkv, qkv_full) = random_tensor(&mut rng, ty, d, q + 2 * kv, 1.0);
            let (up, up_full) = random_tensor(&mut rng, ty, d, 2 * ff, 1.0);
            for ranks in [2, 3] {
                let plan = TpPlan::new(&cfg, ranks).unwrap();
                let qkv_secs = plan.fused_sections("blk.1.attn_qkv.weight", q + 2 * kv);
                let up_secs = plan.fused_sections("blk.1.ffn_up.weight", 2 * ff);
                assert_eq!(
                    qkv_secs.iter().map(|s| s.1.clone()).collect::<Vec<_>>(),
                    vec![0..q, q..q + kv, q + kv..q + 2 * kv]
                );
                assert_eq!(
                    up_secs.iter().map(|s| s.1.clone()).collect::<Vec<_>>(),
                    vec![0..ff, ff..2 * ff]
                );
                for (secs, data, full, rows, is_up) in [
                    (&qkv_secs, &qkv, &qkv_full, q + 2 * kv, false),
                    (&up_secs, &up, &up_full, 2 * ff, true),
                ] {
                    let mut seen = vec![0u8; rows];
                    for r in 0..ranks {
                        for (k, (name, sec)) in secs.iter().enumerate() {
                            let (got, held) = section_shard(&plan, ty, d, data, name, sec, r);
                            assert_eq!(got, full[held.start * d..held.end * d], "{ty} {name} {r}");
                            seen[held.clone()].iter_mut().for_each(|s| *s += 1);
                            // Q: the query heads of the rank's KV heads; K, V: those heads;
                            // gate and up: the rank's feed-forward range of each half.
                            let want = match (is_up, k) {
                                (false, 0) => plan.q_range(r),
                                (false, _) => plan.kv_range(r),
                                (true, _) => plan.ff[r].clone(),
                            };
                            assert_eq!(held.start - sec.start..held.end - sec.start, want);
                        }
                    }
                    assert!(seen.iter().all(|&s| s == 1), "{ty} {ranks}: {seen:?}");
                }
            }
        }
        // Unfused tensors have no sections.
        let plan = TpPlan::new(&cfg, 2).unwrap();
        assert!(plan.fused_sections("blk.0.ffn_up.weight", ff).is_empty());
        assert!(plan.fused_sections("blk.0.attn_q.weight", q).is_empty());
        assert!(
            plan.fused_sections("blk.0.attn_qkv.weight", q + kv)
                .is_empty()
        );

        // The MLP's partial sums: Σ_r down_r · (silu(gate_r x) ⊙ up_r x), gate_r and up_r
        // the rank's shards of the fused matrix's sections, against the whole MLP.
        let ty = GgmlType::Q8_0;
        let (up, up_full) = random_tensor(&mut rng, ty, d, 2 * ff, 0.5);
        let (down, down_full) = random_tensor(&mut rng, ty, ff, d, 0.5);
        let x: Vec<f64> = (0..d).map(|i| ((i * 5 % 11) as f64 - 5.0) / 4.0).collect();
        let mlp = |g: &[f32], u: &[f32], dn: &[f32], width: usize| -> Vec<f64> {
            let dot = |w: &[f32], j: usize| (0..d).map(|i| w[j * d + i] as f64 * x[i]).sum::<f64>();
            let act: Vec<f64> = (0..width)
                .map(|j| {
                    let gv = dot(g, j);
                    gv / (1.0 + (-gv).exp()) * dot(u, j)
                })
                .collect();
            (0..d)
                .map(|o| (0..width).map(|j| dn[o * width + j] as f64 * act[j]).sum())
                .collect()
        };
        let whole = mlp(&up_full[..ff * d], &up_full[ff * d..], &down_full, ff);
        for ranks in [2, 3] {
            let plan = TpPlan::new(&cfg, ranks).unwrap();
            let secs = plan.fused_sections("blk.0.ffn_up.weight", 2 * ff);
            let mut sum = vec![0f64; d];
            for r in 0..ranks {
                let (g, _) = section_shard(&plan, ty, d, &up, &secs[0].0, &secs[0].1, r);
                let (u, _) = section_shard(&plan, ty, d, &up, &secs[1].0, &secs[1].1, r);
                let split = plan.split("blk.0.ffn_down.weight", r);
                let (_, dn) = shard_bytes(ty, &[ff as u64, d as u64], &down, &split).unwrap();
                let w = plan.ff[r].len();
                for (s, p) in sum.iter_mut().zip(mlp(&g, &u, &deq(ty, &dn, w * d), w)) {
                    *s += p;
                }
            }
            for (o, (a, b)) in whole.iter().zip(&sum).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-9 * (1.0 + a.abs()),
                    "{ranks} ranks, output {o}: {a} vs {b}"
                );
            }
        }
    }

    /// The tiny gpt-oss reshaped as gpt-oss-20b (64 query heads and 8 KV heads of 64, 32
    /// experts of 2880, 4 a token).
    fn gpt_oss_20b() -> ModelConfig {
        let mut cfg = config(Arch::GptOss, "gpt-oss-20b");
        let FfnKind::Moe(m) = &mut cfg.ffn else {
            panic!("gpt-oss without experts")
        };
        (m.n_expert, m.n_expert_used, m.n_ff_exp) = (32, 4, 2880);
        cfg
    }

    /// gpt-oss-20b's plan: the expert width 2880 (not whole 256s) in 32-value granules,
    /// 1440 a rank over 2 (uneven over 4), 256-value granules where they divide; the sinks
    /// with their query heads, Q/K/V biases with their rows, the attention output bias and
    /// the router replicated, the experts' gate/up biases by the rank's range of each
    /// expert's row, the down biases on rank 0 alone; a width not whole 32s refused.
    #[test]
    fn gpt_oss_splits_sinks_biases_and_experts() {
        let cfg = gpt_oss_20b();
        let plan = TpPlan::new(&cfg, 2).unwrap();
        assert_eq!(plan.ff, vec![0..1440, 1440..2880]);
        assert_eq!((plan.q_heads, plan.kv_heads), (32, 4));
        let four = TpPlan::new(&cfg, 4).unwrap();
        assert_eq!(four.ff, vec![0..736, 736..1472, 1472..2176, 2176..2880]);
        assert!(four.ff.iter().all(|r| r.len() % OSS_FF_GRANULE == 0));
        assert_eq!(TpPlan::new(&cfg, 8).unwrap().kv_heads, 1);
        let e = TpPlan::new(&cfg, 3).unwrap_err().to_string();
        assert!(e.contains("8 KV heads do not divide among 3"), "{e}");
        for (name, role) in [
            ("blk.0.attn_sinks.weight", Role::ColumnParallel),
            ("blk.0.attn_q.bias", Role::ColumnParallel),
            ("blk.0.attn_v.bias", Role::ColumnParallel),
            ("blk.0.attn_output.weight", Role::RowParallel),
            ("blk.0.attn_output.bias", Role::Replicated),
            ("blk.0.post_attention_norm.weight", Role::Replicated),
            ("blk.0.ffn_gate_inp.weight", Role::Replicated),
            ("blk.0.ffn_gate_inp.bias", Role::Replicated),
            ("blk.0.ffn_gate_exps.weight", Role::ColumnParallel),
            ("blk.0.ffn_up_exps.bias", Role::ColumnParallel),
            ("blk.0.ffn_gate_exps.bias", Role::ColumnParallel),
            ("blk.0.ffn_down_exps.weight", Role::RowParallel),
            ("blk.0.ffn_down_exps.bias", Role::RankZero),
        ] {
            assert_eq!(plan.role(name), role, "{name}");
        }
        for r in 0..2 {
            let ff = plan.ff[r].clone();
            for (name, split) in [
                ("blk.3.attn_sinks.weight", Split::Rows(32 * r..32 * (r + 1))),
                ("blk.3.attn_q.bias", Split::Rows(plan.q_range(r))),
                ("blk.3.attn_k.bias", Split::Rows(plan.kv_range(r))),
                ("blk.3.attn_output.bias", Split::Replicated),
                ("blk.3.ffn_gate_inp.bias", Split::Replicated),
                ("blk.3.ffn_gate_exps.bias", Split::Cols(ff.clone())),
                ("blk.3.ffn_up_exps.bias", Split::Cols(ff.clone())),
                ("blk.3.ffn_down_exps.bias", Split::Replicated),
                ("blk.3.ffn_up_exps.weight", Split::Rows(ff.clone())),
                ("blk.3.ffn_down_exps.weight", Split::Cols(ff.clone())),
            ] {
                assert_eq!(plan.split(name, r), split, "{name} rank {r}");
            }
            let rc = plan.rank_config(&cfg, r);
            let FfnKind::Moe(m) = rc.ffn else {
                panic!("rank config without experts")
            };
            assert_eq!(m.n_ff_exp, 1440);
            assert!(m.clamped_swiglu.is_some());
            assert_eq!(rc.layer_is_swa, cfg.layer_is_swa);
            assert_eq!(rc.sliding_window, cfg.sliding_window);
        }
        // 256-value granules where the width takes them (K-quant experts need them).
        let mut k = cfg.clone();
        if let FfnKind::Moe(m) = &mut k.ffn {
            m.n_ff_exp = 768;
        }
        assert_eq!(TpPlan::new(&k, 2).unwrap().ff, vec![0..512, 512..768]);
        for width in [2896, 32] {
            if let FfnKind::Moe(m) = &mut k.ffn {
                m.n_ff_exp = width;
            }
            let e = TpPlan::new(&k, 2).unwrap_err().to_string();
            assert!(
                e.contains(&format!(
                    "width {width} does not split into 2 parts of whole 256- or 32-value blocks"
                )),
                "{e}"
            );
        }
        // A cut the experts' format cannot take is an error naming the block boundary.
        let (data, _) = random_tensor(
            &mut <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(5),
            GgmlType::Q4K,
            768,
            4,
            1.0,
        );
        let e = shard_bytes(GgmlType::Q4K, &[768, 2, 2], &data, &Split::Cols(0..384))
            .unwrap_err()
            .to_string();
        assert!(e.contains("256-value block boundaries"), "{e}");
    }

    /// A gpt-oss expert block split over 2 and 3 ranks, in f64 from the dequantized
    /// shards of random MXFP4 experts (width 2·416: each rank's share 416 = 256 + 160,
    /// as 1440 = 5·256 + 160, and 13 blocks, an odd count) and f32 biases cut by
    /// `shard_bytes`: for each routed expert, Σ_r w · (down_r · swiglu_oai(gate_r x + bg_r,
    /// up_r x + bu_r) + [r = 0] bd) equals the whole expert's w · (down · swiglu_oai(...) +
    /// bd); the sinks' shards are the rank's heads' values.
    #[test]
    fn gpt_oss_expert_partial_sums_add_up() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x0551);
        let mut cfg = gpt_oss_20b();
        cfg.n_embd = 64;
        (cfg.n_head, cfg.n_head_kv) = (12, 6);
        let (d, ff, ne) = (64usize, 832usize, 3usize);
        let FfnKind::Moe(m) = &mut cfg.ffn else {
            unreachable!()
        };
        (m.n_expert, m.n_ff_exp) = (ne, ff);
        let c = m.clamped_swiglu.unwrap();
        let ty = GgmlType::MXFP4;
        let (gate, gf) = random_tensor(&mut rng, ty, d, ff * ne, 0.5);
        let (up, uf) = random_tensor(&mut rng, ty, d, ff * ne, 0.5);
        let (down, df) = random_tensor(&mut rng, ty, ff, d * ne, 0.5);
        let (bg, bgf) = random_tensor(&mut rng, GgmlType::F32, ff, ne, 0.5);
        let (bu, buf) = random_tensor(&mut rng, GgmlType::F32, ff, ne, 0.5);
        let (bd, bdf) = random_tensor(&mut rng, GgmlType::F32, d, ne, 0.5);
        let x: Vec<f64> = (0..d).map(|_| rng.random_range(-2.0..2.0)).collect();
        let w = 0.375f64;
        // One expert's weighted output from [width × d] gate/up, [d × width] down, biases
        // of `width` (and `d`, or none).
        let expert = |g: &[f32],
                      u: &[f32],
                      dn: &[f32],
                      bg: &[f32],
                      bu: &[f32],
                      bd: Option<&[f32]>,
                      width: usize,
                      e: usize|
         -> Vec<f64> {
            let (g, u, dn) = (
                &g[e * width * d..],
                &u[e * width * d..],
                &dn[e * d * width..],
            );
            let (bg, bu) = (&bg[e * width..], &bu[e * width..]);
            let dot = |m: &[f32], j: usize| (0..d).map(|i| m[j * d + i] as f64 * x[i]).sum::<f64>();
            let (alpha, limit) = (c.alpha as f64, c.limit as f64);
            let act: Vec<f64> = (0..width)
                .map(|j| {
                    let gv = (dot(g, j) + bg[j] as f64).min(limit);
                    let uv = (dot(u, j) + bu[j] as f64).clamp(-limit, limit);
                    gv / (1.0 + (-alpha * gv).exp()) * (uv + 1.0)
                })
                .collect();
            (0..d)
                .map(|o| {
                    let b = bd.map_or(0.0, |b| b[e * d + o] as f64);
                    w * ((0..width)
                        .map(|j| dn[o * width + j] as f64 * act[j])
                        .sum::<f64>()
                        + b)
                })
                .collect()
        };
        for ranks in [2, 3] {
            let plan = TpPlan::new(&cfg, ranks).unwrap();
            assert!(plan.ff.iter().all(|r| r.len() % OSS_FF_GRANULE == 0));
            if ranks == 2 {
                assert_eq!(plan.ff, vec![0..416, 416..832]);
            }
            let shard = |name: &str, ty: GgmlType, data: &[u8], dims: &[u64], r: usize| {
                let (sd, b) = shard_bytes(ty, dims, data, &plan.split(name, r)).unwrap();
                deq(ty, &b, sd.iter().product::<u64>() as usize)
            };
            let (nd, nf, nn) = (d as u64, ff as u64, ne as u64);
            for e in 0..ne {
                let whole = expert(&gf, &uf, &df, &bgf, &buf, Some(&bdf), ff, e);
                let mut sum = vec![0f64; d];
                for r in 0..ranks {
                    let g = shard("blk.0.ffn_gate_exps.weight", ty, &gate, &[nd, nf, nn], r);
                    let u = shard("blk.0.ffn_up_exps.weight", ty, &up, &[nd, nf, nn], r);
                    let dn = shard("blk.0.ffn_down_exps.weight", ty, &down, &[nf, nd, nn], r);
                    let f32 = GgmlType::F32;
                    let sbg = shard("blk.0.ffn_gate_exps.bias", f32, &bg, &[nf, nn], r);
                    let sbu = shard("blk.0.ffn_up_exps.bias", f32, &bu, &[nf, nn], r);
                    let sbd = shard("blk.0.ffn_down_exps.bias", f32, &bd, &[nd, nn], r);
                    let once = plan.role("blk.0.ffn_down_exps.bias") == Role::RankZero;
                    let bd = (r == 0 || !once).then_some(&sbd[..]);
                    let width = plan.ff[r].len();
                    for (s, p) in sum
                        .iter_mut()
                        .zip(expert(&g, &u, &dn, &sbg, &sbu, bd, width, e))
                    {
                        *s += p;
                    }
                }
                for (o, (a, b)) in whole.iter().zip(&sum).enumerate() {
                    assert!(
                        (a - b).abs() <= 1e-9 * (1.0 + a.abs()),
                        "{ranks} ranks, expert {e}, output {o}: {a} vs {b}"
                    );
                }
            }
            // Sinks: the rank's query heads' values.
            let sinks: Vec<f32> = (0..cfg.n_head).map(|i| i as f32 - 3.5).collect();
            let bytes: Vec<u8> = sinks.iter().flat_map(|v| v.to_le_bytes()).collect();
            for r in 0..ranks {
                let got = shard(
                    "blk.0.attn_sinks.weight",
                    GgmlType::F32,
                    &bytes,
                    &[cfg.n_head as u64],
                    r,
                );
                let h = plan.q_heads;
                assert_eq!(got, sinks[r * h..(r + 1) * h]);
            }
        }
    }
}
