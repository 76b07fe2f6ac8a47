//! The operations a backend provides. The forward pass (`forward.rs`) is written once
//! against this trait; fused operations have default bodies composed from the basic ones,
//! which a backend overrides where it has a faster kernel.

use std::sync::Arc;

use kestrel_gguf::{GgufFile, TensorInfo};

use crate::batch::Batch;
use crate::config::{
    Activation, AttnTemperature, DeltaNetConfig, ModelConfig, MoeConfig, RopeParams,
};
use crate::kv_type::{KvType, KvTypes};
use crate::sampling::{SamplingBatch, argmax};
use crate::weights::{DeltaNetWeights, LayerWeights};

/// Attention geometry of one layer.
#[derive(Debug, Clone, Copy)]
pub struct AttnParams {
    pub layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Multiplier of q·k before the softmax.
    pub scale: f32,
    /// Sliding window: a query at position p sees keys at positions > p - window.
    pub window: Option<usize>,
}

/// A compute backend. Tensors are row-major `[rows × cols]` f32 activations; every op
/// takes the number of rows `n` it should process (a tensor is allocated once for the
/// largest batch and reused).
pub trait Backend: Sync {
    /// A weight tensor in the backend's preferred layout.
    type Weight: Send + Sync;
    /// An activation buffer.
    type Tensor;
    /// The paged KV cache of all layers.
    type Cache;
    /// Per-step inputs (token ids, positions, block tables) as the backend keeps them.
    type Step;
    /// What an operation leaves beside its output for the one operation that reads that
    /// output next (on CUDA: the output already in the input format of the product's kernel,
    /// or a Q/K/V product not yet split into q, k and v). The forward pass hands it from
    /// the producer to that consumer, so every fused pair is visible where it is used;
    /// `Default::default()` is "nothing prepared". Backends that fuse nothing use `()`.
    type Prepared: Copy + Default + std::fmt::Debug;

    fn name(&self) -> String;

    /// The most tokens of a step this backend computes batch-invariantly when the batch
    /// asks (`Batch::invariant`): a speculative verification never verifies more. Default:
    /// any number (the CPU's products are batch-invariant anyway).
    fn invariant_max_tokens(&self) -> usize {
        usize::MAX
    }

    /// Refuses a model this backend cannot yet run correctly, before any weight loads.
    /// Default: every model.
    fn check_model(&self, _cfg: &ModelConfig) -> anyhow::Result<()> {
        Ok(())
    }

    /// Prepares a weight from the file (zero-copy where the backend can read the blocks).
    fn load_weight(&self, file: &Arc<GgufFile>, info: &TensorInfo) -> anyhow::Result<Self::Weight>;

    /// Prepares a 3-D tensor of stacked expert matrices (`ffn_*_exps`) for
    /// [`Self::moe_ffn`]. Default: an error, for backends without mixture-of-experts
    /// kernels (so such a model fails to load there rather than running wrongly).
    fn load_experts(
        &self,
        _file: &Arc<GgufFile>,
        _info: &TensorInfo,
    ) -> anyhow::Result<Self::Weight> {
        anyhow::bail!(
            "mixture-of-experts layers are not supported on the {} backend yet",
            self.name()
        )
    }

    fn new_tensor(&self, rows: usize, cols: usize) -> anyhow::Result<Self::Tensor>;

    fn new_cache(
        &self,
        config: &ModelConfig,
        n_blocks: usize,
        block_size: usize,
    ) -> anyhow::Result<Self::Cache>;

    /// The device's free and total memory in bytes, for sizing the KV cache by a fraction
    /// of it (`--gpu-memory-utilization`); `None` (the default) where the backend has no
    /// memory of its own (the CPU).
    fn device_memory(&self) -> Option<(usize, usize)> {
        None
    }

    /// The cache storage types this backend's attention reads (default: f16 only).
    fn cache_types(&self) -> &'static [KvType] {
        &[KvType::F16]
    }

    /// [`Self::new_cache`] with keys and values stored as `kv`; an error names the types
    /// the backend supports when it lacks one. The default serves f16 only.
    fn new_cache_typed(
        &self,
        config: &ModelConfig,
        n_blocks: usize,
        block_size: usize,
        kv: KvTypes,
    ) -> anyhow::Result<Self::Cache> {
        kv.check(self.cache_types(), config.head_dim, &self.name())?;
        if kv != KvTypes::default() {
            anyhow::bail!("{}: new_cache_typed is not implemented", self.name());
        }
        self.new_cache(config, n_blocks, block_size)
    }

    fn new_step(&self, config: &ModelConfig, max_tokens: usize) -> anyhow::Result<Self::Step>;

    /// Loads this step's batch description into `step`.
    fn prepare_step(&self, batch: &Batch, step: &mut Self::Step) -> anyhow::Result<()>;

    /// `out[i] = table[token i]` for every token of the step.
    fn embed(&self, table: &Self::Weight, step: &Self::Step, out: &mut Self::Tensor);

    fn scale(&self, x: &mut Self::Tensor, n: usize, factor: f32);

    /// Row-wise RMS normalization times `weight`; returns what it prepared for a product
    /// reading `out` next.
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        weight: &Self::Weight,
        eps: f32,
        n: usize,
        out: &mut Self::Tensor,
    ) -> Self::Prepared;

    /// RMS normalization of each `head_dim`-sized head in place (Q/K norm).
    fn rms_norm_heads(
        &self,
        x: &mut Self::Tensor,
        weight: &Self::Weight,
        head_dim: usize,
        eps: f32,
        n: usize,
    );

    /// `out = x · Wᵀ` where W is `[out_features × in_features]` (GGUF dims `[in, out]`).
    fn matmul(&self, x: &Self::Tensor, w: &Self::Weight, n: usize, out: &mut Self::Tensor);

    fn add_bias(&self, x: &mut Self::Tensor, bias: &Self::Weight, n: usize);

    /// Rotary embedding of every head of `x` at each token's position.
    fn rope(
        &self,
        x: &mut Self::Tensor,
        head_dim: usize,
        rope: &RopeParams,
        step: &Self::Step,
        n: usize,
    );

    /// Writes each token's key and value into its cache slot.
    fn store_kv(
        &self,
        cache: &mut Self::Cache,
        layer: usize,
        k: &Self::Tensor,
        v: &Self::Tensor,
        step: &Self::Step,
        n: usize,
    );

    /// Causal attention of each token over its sequence's cached keys and values; returns
    /// what it prepared for the output projection.
    fn attention(
        &self,
        q: &Self::Tensor,
        cache: &Self::Cache,
        params: &AttnParams,
        step: &Self::Step,
        n: usize,
        out: &mut Self::Tensor,
    ) -> Self::Prepared;

    /// [`Self::attention`] with a learned logit per query head (`sinks`, `n_head` values)
    /// joining each softmax's denominator (gpt-oss). Default: an error, for backends
    /// without it.
    #[allow(clippy::too_many_arguments)]
    fn attention_sinks(
        &self,
        _q: &Self::Tensor,
        _cache: &Self::Cache,
        _params: &AttnParams,
        _sinks: &Self::Weight,
        _step: &Self::Step,
        _n: usize,
        _out: &mut Self::Tensor,
    ) -> anyhow::Result<()> {
        anyhow::bail!(
            "attention sinks are not supported on the {} backend yet",
            self.name()
        )
    }

    /// Multiplies each token's row of `x` by `temp.factor(its position)` (Mistral 3's
    /// attention temperature). Default: an error, for backends without it.
    fn scale_by_position(
        &self,
        _x: &mut Self::Tensor,
        _temp: &AttnTemperature,
        _step: &Self::Step,
        _n: usize,
    ) -> anyhow::Result<()> {
        anyhow::bail!(
            "attention temperature scaling is not supported on the {} backend yet",
            self.name()
        )
    }

    /// `gate = act(gate) * up`, element-wise; returns what it prepared for the down
    /// projection.
    fn gated_activation(
        &self,
        gate: &mut Self::Tensor,
        up: &Self::Tensor,
        act: Activation,
        n: usize,
    ) -> Self::Prepared;

    /// `x += y`.
    fn add(&self, x: &mut Self::Tensor, y: &Self::Tensor, n: usize);

    /// Copies the rows listed in the step's `logit_rows` to the front of `out`.
    fn gather_logit_rows(&self, x: &Self::Tensor, step: &Self::Step, out: &mut Self::Tensor);

    /// Reads the first `n` rows back to the host.
    fn read_rows(&self, x: &Self::Tensor, n: usize, out: &mut Vec<f32>) -> anyhow::Result<()>;

    /// Calls `f` with the first `n` rows on the host, lent from the backend's own memory
    /// where it has them there (the CPU's tensor, CUDA's pinned read-back buffer) instead
    /// of copied into a caller's vector. Default: [`Self::read_rows`] into `scratch`.
    fn with_rows(
        &self,
        x: &Self::Tensor,
        n: usize,
        scratch: &mut Vec<f32>,
        f: &mut dyn FnMut(&[f32]),
    ) -> anyhow::Result<()> {
        self.read_rows(x, n, scratch)?;
        f(scratch);
        Ok(())
    }

    /// The [`argmax`] of each of the first `n` rows (greedy sampling without reading the
    /// rows back; a GPU reduces them where they are). `scratch` may receive the rows.
    fn argmax_rows(
        &self,
        x: &Self::Tensor,
        n: usize,
        scratch: &mut Vec<f32>,
        out: &mut Vec<u32>,
    ) -> anyhow::Result<()> {
        self.read_rows(x, n, scratch)?;
        out.clear();
        if let Some(cols) = scratch.len().checked_div(n).filter(|&c| c > 0) {
            out.extend(scratch.chunks_exact(cols).map(argmax));
        }
        Ok(())
    }

    /// The token each of the first `n` rows draws under `sampling`'s row of the same index
    /// (the definition in [`crate::sampling`], token masks included), without reading the
    /// rows back where the backend can sample them where they are. Default: the host
    /// samples the rows lent by [`Self::with_rows`], on all cores.
    fn sample_rows(
        &self,
        x: &Self::Tensor,
        n: usize,
        sampling: &SamplingBatch,
        scratch: &mut Vec<f32>,
        out: &mut Vec<u32>,
    ) -> anyhow::Result<()> {
        sampling.check_rows(n)?;
        let mut checked = Ok(());
        self.with_rows(x, n, scratch, &mut |rows| {
            let cols = rows.len().checked_div(n).unwrap_or(0);
            checked = sampling.check_masks(cols);
            if checked.is_ok() {
                sampling.sample_host(rows, n, out)
            }
        })?;
        checked
    }

    /// Whether this backend chains decode steps ([`Self::chain_ids`]).
    fn can_chain(&self) -> bool {
        false
    }

    /// Decoding with the host a step ahead: the token each of the first `n` rows takes
    /// (its [`argmax`], or drawn under `sampling`'s row of the same index, which must
    /// carry no penalties or masks) stays where the backend keeps the next step's input
    /// tokens (the next batch says so with `tokens_on_device`), and the step's work is
    /// started without waiting for it. [`Self::read_chained`] returns the ids of the
    /// oldest such step not yet read, so the host can record and queue step t + 1 while
    /// the device runs step t. Backends that cannot ([`Self::can_chain`] false) return an
    /// error.
    fn chain_ids(
        &self,
        _x: &Self::Tensor,
        _n: usize,
        _sampling: Option<&SamplingBatch>,
    ) -> anyhow::Result<()> {
        anyhow::bail!("this backend does not chain decode steps")
    }

    /// The ids of the oldest [`Self::chain_ids`] step not read yet (waiting for it).
    fn read_chained(&self, _out: &mut Vec<u32>) -> anyhow::Result<()> {
        anyhow::bail!("this backend does not chain decode steps")
    }

    /// Starts the work queued so far without waiting for it: the caller is about to wait
    /// for something else (a step's token masks) before sampling. Default: nothing (work
    /// is done when its call returns).
    fn submit(&self) {}

    /// The mixture-of-experts block ([`MoeConfig`] defines it): `out = Σ w_e · down_e(
    /// act(gate_e(x)) * up_e(x))` over each token's selected experts `e`. Default: an
    /// error (see [`Self::load_experts`]).
    #[allow(clippy::too_many_arguments)]
    fn moe_ffn(
        &self,
        _x: &Self::Tensor,
        _layer: &LayerWeights<Self::Weight>,
        _moe: &MoeConfig,
        _act: Activation,
        _n: usize,
        _out: &mut Self::Tensor,
    ) -> anyhow::Result<()> {
        anyhow::bail!(
            "mixture-of-experts layers are not supported on the {} backend yet",
            self.name()
        )
    }

    /// Refuses, at load, a model with gated DeltaNet linear-attention layers where the
    /// backend lacks [`Self::delta_net`] and the other hybrid-model operations below.
    /// Default: refused.
    fn check_linear_attention(&self) -> anyhow::Result<()> {
        anyhow::bail!(
            "linear-attention (gated DeltaNet) layers are not supported on the {} backend yet",
            self.name()
        )
    }

    /// Forgets the linear-attention state of the sequence whose first cache block is
    /// `first_block` (it finished). Default: nothing to forget.
    fn forget_state(&self, _cache: &mut Self::Cache, _first_block: u32) {}

    /// Splits each token's `[n_head × 2·head_dim]` row of `qg` (each head's query, then its
    /// gate) into `q` and `gate` (`[n_head × head_dim]` each; Qwen3-Next's gated attention).
    /// Default: an error.
    fn split_gated_query(
        &self,
        _qg: &Self::Tensor,
        _head_dim: usize,
        _n: usize,
        _q: &mut Self::Tensor,
        _gate: &mut Self::Tensor,
    ) -> anyhow::Result<()> {
        anyhow::bail!(
            "gated attention is not supported on the {} backend yet",
            self.name()
        )
    }

    /// `x *= sigmoid(gate)`, element-wise. Default: an error.
    fn sigmoid_mul(
        &self,
        _x: &mut Self::Tensor,
        _gate: &Self::Tensor,
        _n: usize,
    ) -> anyhow::Result<()> {
        anyhow::bail!(
            "gated attention is not supported on the {} backend yet",
            self.name()
        )
    }

    /// `out += y · sigmoid(x · w)` per token, `w` a vector (a shared expert's gate).
    /// Default: an error.
    fn add_sigmoid_gated(
        &self,
        _out: &mut Self::Tensor,
        _y: &Self::Tensor,
        _x: &Self::Tensor,
        _w: &Self::Weight,
        _n: usize,
    ) -> anyhow::Result<()> {
        anyhow::bail!(
            "shared experts are not supported on the {} backend yet",
            self.name()
        )
    }

    /// The core of a gated DeltaNet layer ([`DeltaNetConfig`] defines it) after its input
    /// projections: `mix` (`[n × conv_dim]`, `attn_qkv · x`), `z` (`[n × value_dim]`),
    /// `beta` and `alpha` (the beta/alpha projections; the same tensor for Qwen3-Next's
    /// fused `ssm_ba`). Runs the causal convolution and the gated delta rule token by token
    /// in each sequence's state (kept in `cache`; a sequence's state starts from zero at
    /// position 0 and must continue where it stopped), and writes the gated, normalized
    /// output `[n × value_dim]` to `out` for `ssm_out`; returns what it prepared for that
    /// product. Default: an error.
    #[allow(clippy::too_many_arguments)]
    fn delta_net(
        &self,
        _cache: &mut Self::Cache,
        _layer: usize,
        _cfg: &DeltaNetConfig,
        _w: &DeltaNetWeights<Self::Weight>,
        _mix: &Self::Tensor,
        _z: &Self::Tensor,
        _beta: &Self::Tensor,
        _alpha: &Self::Tensor,
        _eps: f32,
        _step: &Self::Step,
        _n: usize,
        _out: &mut Self::Tensor,
    ) -> anyhow::Result<Self::Prepared> {
        self.check_linear_attention()
            .map(|()| Self::Prepared::default())
    }

    // ---- fused operations; the defaults compose the basic ones ----
    // Each takes the `Prepared` its input's producer returned (`x_ready`), and those
    // whose output feeds one operation next return what they prepared for it.

    /// Q, K and V projections (with bias where the layer has one) of an attention layer
    /// (nothing for a layer without them). The result must go to
    /// [`Self::rope_store_kv`] where the layer has no Q/K norm: q, k and v may be written
    /// only there (CUDA splits a merged product on the way).
    #[allow(clippy::too_many_arguments)]
    #[must_use]
    fn qkv(
        &self,
        x: &Self::Tensor,
        x_ready: Self::Prepared,
        layer: &LayerWeights<Self::Weight>,
        n: usize,
        q: &mut Self::Tensor,
        k: &mut Self::Tensor,
        v: &mut Self::Tensor,
    ) -> Self::Prepared {
        let _ = x_ready;
        // The forward pass calls this for attention layers only, which have all three.
        if let Some((wq, wk, wv)) = layer.qkv_weights() {
            self.matmul(x, wq, n, q);
            self.matmul(x, wk, n, k);
            self.matmul(x, wv, n, v);
            self.add_qkv_biases(layer, n, q, k, v);
        }
        Self::Prepared::default()
    }

    /// Adds the layer's Q, K and V biases (those it has) to the first `n` rows of q, k, v.
    fn add_qkv_biases(
        &self,
        layer: &LayerWeights<Self::Weight>,
        n: usize,
        q: &mut Self::Tensor,
        k: &mut Self::Tensor,
        v: &mut Self::Tensor,
    ) {
        for (t, b) in [
            (q, &layer.attn_q_bias),
            (k, &layer.attn_k_bias),
            (v, &layer.attn_v_bias),
        ] {
            if let Some(b) = b {
                self.add_bias(t, b, n);
            }
        }
    }

    /// The gated half of the feed-forward block: `gate = act(gate(x)) * up(x)`; returns
    /// what it prepared for the down projection.
    #[allow(clippy::too_many_arguments)]
    fn gate_up(
        &self,
        x: &Self::Tensor,
        x_ready: Self::Prepared,
        layer: &LayerWeights<Self::Weight>,
        act: Activation,
        n: usize,
        gate: &mut Self::Tensor,
        up: &mut Self::Tensor,
    ) -> Self::Prepared {
        self.gate_up_pair(x, x_ready, &layer.ffn_gate, &layer.ffn_up, act, n, gate, up)
    }

    /// [`Self::gate_up`] of any pair of weights (a shared expert's): `gate = act(x ·
    /// gate_wᵀ) * (x · up_wᵀ)`; returns what it prepared for the down projection.
    #[allow(clippy::too_many_arguments)]
    fn gate_up_pair(
        &self,
        x: &Self::Tensor,
        x_ready: Self::Prepared,
        gate_w: &Self::Weight,
        up_w: &Self::Weight,
        act: Activation,
        n: usize,
        gate: &mut Self::Tensor,
        up: &mut Self::Tensor,
    ) -> Self::Prepared {
        let _ = x_ready;
        self.matmul(x, gate_w, n, gate);
        self.matmul(x, up_w, n, up);
        self.gated_activation(gate, up, act, n)
    }

    /// The gated feed-forward block: `down(act(gate(x)) * up(x))`.
    #[allow(clippy::too_many_arguments)]
    fn feed_forward(
        &self,
        x: &Self::Tensor,
        x_ready: Self::Prepared,
        layer: &LayerWeights<Self::Weight>,
        act: Activation,
        n: usize,
        gate: &mut Self::Tensor,
        up: &mut Self::Tensor,
        out: &mut Self::Tensor,
    ) {
        let gated = self.gate_up(x, x_ready, layer, act, n, gate, up);
        self.matmul_ready(gate, gated, &layer.ffn_down, n, out);
    }

    /// [`Self::matmul`] of an input whose producer prepared it (the LM head after the
    /// final norm, the down projection after the activation).
    fn matmul_ready(
        &self,
        x: &Self::Tensor,
        x_ready: Self::Prepared,
        w: &Self::Weight,
        n: usize,
        out: &mut Self::Tensor,
    ) {
        let _ = x_ready;
        self.matmul(x, w, n, out);
    }

    /// Several products of one input, `outs[i] = x · ws[i]ᵀ` (a linear-attention layer's
    /// input projections, a gated attention layer's Q/gate, K and V): a backend may run
    /// them as one launch, or prepare `x` once for all. Default: [`Self::matmul_ready`]
    /// for the first, [`Self::matmul`] for the others.
    fn matmul_many(
        &self,
        x: &Self::Tensor,
        x_ready: Self::Prepared,
        ws: &[&Self::Weight],
        n: usize,
        outs: &mut [&mut Self::Tensor],
    ) {
        for (i, (w, out)) in ws.iter().zip(outs.iter_mut()).enumerate() {
            if i == 0 {
                self.matmul_ready(x, x_ready, w, n, out);
            } else {
                self.matmul(x, w, n, out);
            }
        }
    }

    /// `residual += x · wᵀ` (`tmp` receives the product where the backend needs it).
    fn matmul_add(
        &self,
        x: &Self::Tensor,
        x_ready: Self::Prepared,
        w: &Self::Weight,
        n: usize,
        tmp: &mut Self::Tensor,
        residual: &mut Self::Tensor,
    ) {
        self.matmul_ready(x, x_ready, w, n, tmp);
        self.add(residual, tmp, n);
    }

    /// RoPE on the query and key heads, then the keys and values into the cache
    /// (`qkv_ready`: what [`Self::qkv`] returned, where nothing ran in between).
    #[allow(clippy::too_many_arguments)]
    fn rope_store_kv(
        &self,
        q: &mut Self::Tensor,
        k: &mut Self::Tensor,
        v: &Self::Tensor,
        qkv_ready: Self::Prepared,
        head_dim: usize,
        rope: &RopeParams,
        cache: &mut Self::Cache,
        layer: usize,
        step: &Self::Step,
        n: usize,
    ) {
        let _ = qkv_ready;
        self.rope(q, head_dim, rope, step, n);
        self.rope(k, head_dim, rope, step, n);
        self.store_kv(cache, layer, k, v, step, n);
    }
}

/// The shapes [`Backend::split_gated_query`] takes: `qg` rows of `2 · q` columns, `gate` as
/// wide as `q`, whole heads of `head_dim`; every backend checks them alike.
pub fn check_gated_query_split(
    qg_cols: usize,
    q_cols: usize,
    gate_cols: usize,
    head_dim: usize,
) -> anyhow::Result<()> {
    if qg_cols != 2 * q_cols || gate_cols != q_cols || !q_cols.is_multiple_of(head_dim) {
        anyhow::bail!(
            "gated query of {qg_cols} columns does not split into {q_cols} + {gate_cols}"
        );
    }
    Ok(())
}
