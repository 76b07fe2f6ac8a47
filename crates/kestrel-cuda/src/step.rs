//! Per-step state: the step's inputs in one device buffer, the KV cache, and reading
//! results back through a pinned buffer (with the logit rows' read-ahead).

use crate::*;

/// The kernels this module launches (kernels/attention.cu).
pub(crate) const KERNELS: &[&str] = &["gather_rows"];

/// Products whose output is at least this large copy their rows to the host as they are
/// made while the host reads every step's rows (see `gemm_reading_ahead`), in this many
/// column chunks.
pub(crate) const READ_AHEAD_MIN_BYTES: usize = 8 << 20;

pub(crate) const READ_AHEAD_CHUNKS: usize = 4;

impl CudaStep {
    pub(crate) fn at(&self, slot: usize) -> u64 {
        self.ptr + (slot * self.max_tokens * 4) as u64
    }
    pub(crate) fn tokens(&self) -> u64 {
        self.at(0)
    }
    pub(crate) fn positions(&self) -> u64 {
        self.at(1)
    }
    pub(crate) fn seq_of(&self) -> u64 {
        self.at(2)
    }
    pub(crate) fn logit_rows(&self) -> u64 {
        self.at(3)
    }
    pub(crate) fn table_off(&self) -> u64 {
        self.at(4)
    }
    pub(crate) fn tables(&self) -> u64 {
        self.at(6)
    }
    /// What a kernel needs to find each token's KV slot: positions, owning sequence,
    /// each sequence's block-table offset, the block tables.
    pub(crate) fn slot_args(&self) -> [Arg; 4] {
        [
            Arg::P(self.positions()),
            Arg::P(self.seq_of()),
            Arg::P(self.table_off()),
            Arg::P(self.tables()),
        ]
    }
    /// The position of the step's token `i`.
    pub(crate) fn position(&self, i: usize) -> usize {
        let t = self.max_tokens;
        self.host.get(t + i).map_or(0, |&p| p as usize)
    }

    /// The longest sequence (cached positions after this step) among the step's.
    pub(crate) fn max_kv_len(&self) -> usize {
        let t = self.max_tokens;
        self.host
            .get(5 * t..6 * t)
            .and_then(|l| l.iter().max())
            .map_or(0, |&m| m as usize)
    }

    /// (start, length) of each run of consecutive tokens of the same sequence among the
    /// step's first `n` tokens.
    pub(crate) fn sequence_runs(&self, n: usize) -> Vec<(usize, usize)> {
        let t = self.max_tokens;
        let seq_of = self.host.get(2 * t..2 * t + n).unwrap_or(&[]);
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for (i, s) in seq_of.iter().enumerate() {
            match runs.last_mut() {
                Some((start, len)) if seq_of[*start] == *s => *len += 1,
                _ => runs.push((i, 1)),
            }
        }
        runs
    }
}

impl CudaBackend {
    /// Copies the first `n` rows of `x` into the pinned read-back buffer and calls `f` with
    /// them there (under its lock). The copy is queued right behind the step, without a
    /// wait first: launch errors so far are reported before it, the step's and the copy's
    /// by the check after it.
    pub(crate) fn read_pinned<R>(
        &self,
        x: &CudaTensor,
        n: usize,
        f: impl FnOnce(&[f32]) -> R,
    ) -> anyhow::Result<R> {
        if n > x.rows {
            bail!("reading {n} rows of a tensor of {}", x.rows);
        }
        let len = n * x.cols;
        // Rows copied ahead by the product that made them (and untouched since).
        let ahead = self
            .read_ahead
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .filter(|_| {
                self.read_ahead_valid
                    .swap(false, std::sync::atomic::Ordering::Relaxed)
            })
            == Some((x.ptr, n, x.cols));
        self.rows_read_back.store(
            len * 4 >= READ_AHEAD_MIN_BYTES,
            std::sync::atomic::Ordering::Relaxed,
        );
        if len == 0 {
            self.check()?;
            return Ok(f(&[]));
        }
        if ahead {
            // The rows are on their way into the pinned buffer: wait for the step and them.
            self.check()?;
            self.wait_copies()?;
            self.read_ahead_hits
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        } else {
            self.wait_copies()?;
            self.flush();
            if let Some(msg) = self.lock_error().take() {
                bail!("CUDA: {msg}");
            }
        }
        // Pinned: a copy into pageable memory is several times slower (batched decode
        // reads a row of logits per sequence every step).
        let mut pinned = self.pinned.lock().unwrap_or_else(|p| p.into_inner());
        let host = self.pinned_room(&mut pinned, len)?;
        // The driver sees the page-locked address whatever the slice type; cudarc wants
        // equal lengths, so copy into a plain sub-slice of it.
        let values = host
            .as_mut_slice()
            .map_err(|e| anyhow::anyhow!("reading the pinned host buffer: {e:?}"))?;
        if !ahead {
            self.stream
                .memcpy_dtoh(&x.buf.slice(..len), &mut values[..len])
                .map_err(|e| anyhow::anyhow!("copying results from the GPU: {e:?}"))?;
            self.check()?;
        }
        Ok(f(&values[..len]))
    }

    /// The pinned read-back buffer held in `slot`, grown to at least `len` values (a read-
    /// ahead filled it with `len` values already: it is never grown then).
    pub(crate) fn pinned_room<'a>(
        &self,
        slot: &'a mut Option<cudarc::driver::PinnedHostSlice<f32>>,
        len: usize,
    ) -> anyhow::Result<&'a mut cudarc::driver::PinnedHostSlice<f32>> {
        if slot.as_ref().is_none_or(|p| p.len() < len) {
            *slot = None; // free the old one first
            // SAFETY: the buffer is only read after the copies into it have completed (the
            // synchronize in `check`, `wait_copies` for the read-ahead's).
            let buf = unsafe { self.ctx.alloc_pinned::<f32>(len.next_power_of_two()) }
                .map_err(|e| anyhow::anyhow!("allocating a pinned host buffer: {e:?}"))?;
            *slot = Some(buf);
        }
        slot.as_mut().context("no pinned host buffer")
    }

    /// Waits until no read-ahead copy still writes into the pinned buffer.
    pub(crate) fn wait_copies(&self) -> anyhow::Result<()> {
        if self
            .copy_in_flight
            .swap(false, std::sync::atomic::Ordering::Relaxed)
            && let Some(Some(copy)) = self.copy_stream.get()
        {
            copy.synchronize()
                .map_err(|e| anyhow::anyhow!("CUDA: the read-ahead copy: {e:?}"))?;
        }
        Ok(())
    }

    /// Forgets whether the last large read was of rows (the next product reads nothing
    /// ahead until one is).
    pub fn forget_rows_read_back(&self) {
        self.rows_read_back
            .store(false, std::sync::atomic::Ordering::Relaxed);
    }

    /// Reads of rows served by a read-ahead so far.
    pub fn read_ahead_hits(&self) -> u64 {
        self.read_ahead_hits
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}

pub(crate) fn new_cache(
    backend: &CudaBackend,
    config: &ModelConfig,
    n_blocks: usize,
    block_size: usize,
    types: KvTypes,
) -> anyhow::Result<CudaCache> {
    let kv_dim = config.kv_dim();
    let per_layer = config
        .kv_cache_len(n_blocks, block_size)
        .context("KV cache size overflows")?;
    let mut cache = CudaCache {
        k: Vec::new(),
        v: Vec::new(),
        k_ptr: Vec::new(),
        v_ptr: Vec::new(),
        k_scale: Vec::new(),
        v_scale: Vec::new(),
        types,
        block_size,
        n_blocks,
        kv_dim,
        delta: crate::delta::new_states(backend, config, n_blocks)?,
    };
    // u16 elements of one layer's buffer and where its scales start (bytes): f16 values, or
    // a byte a value then an f16 scale per 32 values (kernels/attention.cu, kv_load).
    let layout = |t: KvType| -> anyhow::Result<(usize, Option<usize>)> {
        match t {
            KvType::F16 => Ok((per_layer, None)),
            KvType::Q8_0 | KvType::Fp8 => Ok((per_layer / 2 + per_layer / 32, Some(per_layer))),
            // Two values a byte, then the scales.
            KvType::Q4_0 => Ok((per_layer / 4 + per_layer / 32, Some(per_layer / 2))),
            other => anyhow::bail!("the CUDA cache has no layout for {other}"),
        }
    };
    let (k_len, k_scales) = layout(types.k)?;
    let (v_len, v_scales) = layout(types.v)?;
    for _ in 0..config.n_layer {
        let k = backend.alloc::<u16>(k_len, "the KV cache")?;
        let v = backend.alloc::<u16>(v_len, "the KV cache")?;
        let (kp, vp) = (backend.ptr(&k), backend.ptr(&v));
        cache.k_ptr.push(kp);
        cache.v_ptr.push(vp);
        cache.k_scale.push(k_scales.map_or(0, |at| kp + at as u64));
        cache.v_scale.push(v_scales.map_or(0, |at| vp + at as u64));
        cache.k.push(k);
        cache.v.push(v);
    }
    Ok(cache)
}

pub(crate) fn new_step(
    backend: &CudaBackend,
    config: &ModelConfig,
    max_tokens: usize,
) -> anyhow::Result<CudaStep> {
    let max_tokens = max_tokens.max(1);
    let widest = config
        .n_embd
        .max(config.n_ff)
        .max(config.n_head * config.head_dim)
        .max(config.delta_net.map_or(0, |d| d.value_dim()));
    // Room for the widest input of the largest step the 8-bit kernels take.
    backend.reserve_q8(GEMV_MAX_TOKENS.max(MMQ_MAX_TOKENS) * widest)?;
    // Room for one sequence at full context; grows if a step needs more.
    let table_capacity = config.context_length.div_ceil(16).max(64);
    let buf = backend.alloc::<u32>(6 * max_tokens + table_capacity, "the step inputs")?;
    let ptr = backend.ptr(&buf);
    let attn_part_len = max_tokens.min(SPLIT_ATTN_MAX_TOKENS)
        * config.n_head
        * MAX_ATTN_SPLITS
        * (config.head_dim + 2);
    let attn_part = backend.alloc::<f32>(attn_part_len, "the attention partials")?;
    let attn_part_ptr = backend.ptr(&attn_part);
    let delta_conv = match &config.delta_net {
        Some(d) => Some(backend.alloc::<f32>(
            max_tokens * d.conv_dim(),
            "the linear-attention convolution output",
        )?),
        None => None,
    };
    let delta_conv_ptr = delta_conv.as_ref().map(|b| backend.ptr(b));
    Ok(CudaStep {
        buf,
        ptr,
        _attn_part: attn_part,
        attn_part_ptr,
        attn_part_len,
        max_tokens,
        table_capacity,
        host: Vec::new(),
        n_tokens: 0,
        n_seqs: 0,
        n_logit_rows: 0,
        _delta_conv: delta_conv,
        delta_conv_ptr,
    })
}

pub(crate) fn prepare_step(
    backend: &CudaBackend,
    batch: &Batch,
    step: &mut CudaStep,
) -> anyhow::Result<()> {
    let chained = batch.tokens_on_device;
    if chained {
        // The step before is still running: its argmax writes this step's tokens (in
        // stream order, before this step's inputs are copied). Its errors surface when
        // its ids are read.
        let ready = backend
            .chain
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .ready
            .take();
        if ready != Some(batch.len()) {
            bail!(
                "a step of {} tokens on the device must follow a chained step of as many",
                batch.len()
            );
        }
        if let Some(msg) = backend.lock_error().take() {
            bail!("CUDA: {msg}");
        }
    } else {
        // Errors of the previous step surface here at the latest.
        backend.check()?;
        // The step has run: scratch buffers it replaced while recorded are free now.
        backend
            .gemm_scratch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retired
            .clear();
        backend
            .chain
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .ready = None;
    }
    if let Some(p) = &backend.profile {
        p.lock().unwrap_or_else(|e| e.into_inner()).steps += 1;
    }
    let t = step.max_tokens;
    let n = batch.len();
    if n > t || batch.seqs.len() > t || batch.logit_rows.len() > t {
        bail!(
            "batch of {n} tokens, {} sequences, {} logit rows exceeds the step size {t}",
            batch.seqs.len(),
            batch.logit_rows.len()
        );
    }
    if batch.positions.len() != n || batch.seq_of.len() != n {
        bail!("bad batch: tokens, positions and seq_of differ in length");
    }
    let tables: usize = batch.seqs.iter().map(|s| s.block_table.len()).sum();
    if tables > step.table_capacity {
        let cap = tables.next_power_of_two();
        let old = std::mem::replace(
            &mut step.buf,
            backend.alloc::<u32>(6 * t + cap, "the step inputs")?,
        );
        if chained {
            // The chained tokens move with the inputs (the old buffer is freed in stream
            // order, after this copy).
            backend
                .stream
                .memcpy_dtod(&old.slice(..n), &mut step.buf.slice_mut(..n))
                .map_err(|e| anyhow::anyhow!("moving the chained tokens: {e:?}"))?;
        }
        step.ptr = backend.ptr(&step.buf);
        step.table_capacity = cap;
    }
    let h = &mut step.host;
    h.clear();
    h.resize(6 * t + tables, 0);
    h[..n].copy_from_slice(&batch.tokens);
    h[t..t + n].copy_from_slice(&batch.positions);
    h[2 * t..2 * t + n].copy_from_slice(&batch.seq_of);
    h[3 * t..3 * t + batch.logit_rows.len()].copy_from_slice(&batch.logit_rows);
    let mut off = 0usize;
    for (s, seq) in batch.seqs.iter().enumerate() {
        h[4 * t + s] = off as u32;
        h[5 * t + s] = seq.kv_len as u32;
        h[6 * t + off..6 * t + off + seq.block_table.len()].copy_from_slice(&seq.block_table);
        off += seq.block_table.len();
    }
    let len = h.len();
    // A chained step's tokens are on the device already: the rest follows them.
    let from = if chained { t } else { 0 };
    backend
        .stream
        .memcpy_htod(&h[from..], &mut step.buf.slice_mut(from..len))
        .map_err(|e| anyhow::anyhow!("copying the step inputs to the GPU: {e:?}"))?;
    {
        let mut chain = backend.chain.lock().unwrap_or_else(|p| p.into_inner());
        chain.tokens = step.tokens();
        chain.max_tokens = t;
    }
    step.n_tokens = n;
    step.n_seqs = batch.seqs.len();
    step.n_logit_rows = batch.logit_rows.len();
    backend.invariant.store(
        batch.invariant && (2..=INVARIANT_MAX_TOKENS).contains(&n),
        std::sync::atomic::Ordering::Relaxed,
    );
    // Whether the step's products would go through cuBLAS (see `prefer_gemm`).
    let relaxed = std::sync::atomic::Ordering::Relaxed;
    let copies_q8 = backend.f16_copies_q8.load(relaxed);
    let q8_kernels_take = |ty: GgmlType| {
        plan::mmq_reads(ty, n, backend.q8_decode())
            || (n <= Q8_GEMV_MAX_TOKENS && backend.q8_decode())
    };
    let uses_cublas = backend.blas.is_some()
        && n >= 2
        && (backend.f16_copies.load(relaxed)
            || SUPPORTED_TYPES
                .iter()
                .filter(|&&ty| plan::q8_supported(ty))
                .any(|&ty| copies_q8 & (1 << ty.id()) != 0 && !q8_kernels_take(ty)));
    // (A rank of a tensor-parallel group never reads ahead: see `gemm_reading_ahead`.)
    let reads_ahead = backend.options.read_ahead
        && backend.rows_read_back.load(relaxed)
        && backend.comm.get().is_none();
    let record = record_step(n, batch.seqs.len(), uses_cublas, reads_ahead);
    if let Some(gemms) = record
        && backend.graphs.load(relaxed)
    {
        let mut rec = backend.lock_recorder();
        rec.deferring = true;
        rec.gemms = gemms;
    }
    Ok(())
}

/// Whether a step of `n` tokens of `seqs` sequences is recorded for graph replay, and then
/// whether with its cuBLAS products (recorded as `SPECIAL_GEMM`, `Some(true)`: the kernels
/// an eager step takes) or with kernels chosen without cuBLAS (`Some(false)`); None:
/// launched kernel by kernel. Steps of up to GRAPH_MAX_TOKENS / MMQ_MAX_TOKENS tokens that
/// take no cuBLAS are recorded as before; those that would, and decode steps of one token a
/// sequence of any size, are recorded with their cuBLAS products, unless the step's logit
/// rows are read ahead (`reads_ahead`: those copies wait on another stream's events). On the
/// H100, 64 clients of the server launched their 64-row steps kernel by kernel, 1.9 ms of
/// host time a step, and the grammars of structured output (#30) slowed that launch by 0.3
/// ms.
///
/// The ranks of a tensor-parallel group take the same rule (their steps' cuBLAS products
/// are recorded beside the all-reduces, as in a step of up to 32 tokens) and never read
/// ahead; whether a step is recorded then does not depend on `uses_cublas`, which may
/// differ between ranks (their f16 copies depend on each GPU's free memory): every rank
/// records the same steps, so no rank issues a collective eagerly, inside a fork-join,
/// that a recording rank issues only later (a collective that connects lazily blocks
/// until its peers arrive).
pub(crate) fn record_step(
    n: usize,
    seqs: usize,
    uses_cublas: bool,
    reads_ahead: bool,
) -> Option<bool> {
    let graph_max = GRAPH_MAX_TOKENS.max(MMQ_MAX_TOKENS);
    if n <= graph_max && !uses_cublas {
        Some(false)
    } else if !reads_ahead && (n <= graph_max || n == seqs) {
        Some(true)
    } else {
        None
    }
}

pub(crate) fn gather_logit_rows(
    backend: &CudaBackend,
    x: &CudaTensor,
    step: &CudaStep,
    out: &mut CudaTensor,
) {
    backend.launch(
        "gather_rows",
        (step.n_logit_rows as u32, 1, 1),
        256,
        &[
            Arg::P(x.ptr),
            Arg::P(out.ptr),
            Arg::P(step.logit_rows()),
            Arg::I(x.cols as i32),
        ],
    );
}

pub(crate) fn read_rows(
    backend: &CudaBackend,
    x: &CudaTensor,
    n: usize,
    out: &mut Vec<f32>,
) -> anyhow::Result<()> {
    backend.read_pinned(x, n, |values| {
        // Large reads out of the pinned buffer on every core: one thread moved ~8 GB/s
        // on the H100 host, ~4 ms a step for the 33 MB of logits 64 sequences of a
        // 128K-word vocabulary return (Llama-3-8B `bench --seqs 64`: 4,235 / 4,315 ->
        // 5,787 / 5,681 t/s). Small ones stay on this thread: waking the pool cost
        // single-token decode of Qwen2.5-1.5B (608 KB of logits) 7-13%.
        const CHUNK: usize = 1 << 16;
        const PARALLEL_FROM: usize = 1 << 20;
        if out.len() != values.len() {
            out.clear();
            out.resize(values.len(), 0.0);
        }
        if values.len() < PARALLEL_FROM {
            out.copy_from_slice(values);
        } else {
            out.par_chunks_mut(CHUNK)
                .zip(values.par_chunks(CHUNK))
                .for_each(|(d, s)| d.copy_from_slice(s));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_step_keeps_small_steps_and_takes_decode_steps_with_cublas() {
        let graph_max = GRAPH_MAX_TOKENS.max(MMQ_MAX_TOKENS);
        for n in 1..=graph_max {
            // As before: small steps without cuBLAS, reading ahead or not.
            for ahead in [false, true] {
                assert_eq!(record_step(n, 1, false, ahead), Some(false), "n {n}");
            }
            // Small steps through cuBLAS: recorded with it, unless reading ahead.
            assert_eq!(record_step(n, 1, true, false), Some(true), "n {n}");
            assert_eq!(record_step(n, 1, true, true), None, "n {n}");
        }
        for n in [graph_max + 1, 37, 64, 100, 257] {
            for cublas in [false, true] {
                // Decode steps, one token a sequence.
                assert_eq!(record_step(n, n, cublas, false), Some(true), "n {n}");
                assert_eq!(record_step(n, n, cublas, true), None, "n {n}");
                // Prompt parts: launched kernel by kernel.
                assert_eq!(record_step(n, n - 1, cublas, false), None, "n {n}");
                assert_eq!(record_step(n, 1, cublas, false), None, "n {n}");
            }
        }
    }

    /// The ranks of a tensor-parallel group (which never read ahead) record the same steps
    /// whether or not each would call cuBLAS: only how they record may differ.
    #[test]
    fn ranks_agree_on_recording_whatever_their_cublas() {
        for seqs in 1..=300 {
            for n in [1, 2, 7, 8, 9, 16, 31, 32, 33, 37, 64, 65, 128, 300] {
                let (without, with) = (
                    record_step(n, seqs, false, false),
                    record_step(n, seqs, true, false),
                );
                assert_eq!(without.is_some(), with.is_some(), "n {n}, {seqs} seqs");
                // And a decode step (one token a sequence) is always recorded.
                if n == seqs {
                    assert!(with.is_some(), "n {n}");
                }
            }
        }
    }
}
