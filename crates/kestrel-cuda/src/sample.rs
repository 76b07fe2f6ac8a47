//! Token choice on the device (kernels/argmax.cu, kernels/sample.cu): greedy `argmax_rows` and
//! `sample_rows` (token masks, temperature, top-k, top-p, min-p, penalties).

use crate::*;
use kestrel_model::{Backend, NO_MASK};

/// The kernels this module launches (kernels/argmax.cu, kernels/sample.cu).
pub(crate) const KERNELS: &[&str] = &[
    "argmax_rows",
    "sample_rows",
    "argmax_share",
    "argmax_shares",
];

/// The token masks' pinned host copies and device copies (`CudaBackend::sample_masks`):
/// two slots, taken in turn, so that a step's upload never writes into masks that an
/// earlier step's copy or sampling may still be reading.
#[derive(Default)]
pub(crate) struct MaskBuffers {
    slots: [MaskSlot; 2],
    next: usize,
}

#[derive(Default)]
struct MaskSlot {
    host: Option<cudarc::driver::PinnedHostSlice<u32>>,
    device: Option<CudaSlice<u32>>,
    /// Recorded on the main stream after the sampling that read this slot: the slot is
    /// written again once it has passed (its copy finished before that sampling began).
    read: Option<cudarc::driver::CudaEvent>,
}

/// Chained decode steps (`Backend::chain_ids`): each step's argmax or sampling writes its
/// ids into the step's token slots, where the next step (a batch with `tokens_on_device`)
/// reads them, and a copy of them into a pinned slot the host reads once it needs them.
#[derive(Default)]
pub(crate) struct Chain {
    /// The step inputs' token slots (set by every `prepare_step`) and their number.
    pub(crate) tokens: u64,
    pub(crate) max_tokens: usize,
    /// Ids the last chained step left in the token slots, for the next step to take.
    pub(crate) ready: Option<usize>,
    slots: Vec<ChainSlot>,
    /// Slots holding a queued step's ids, oldest first, with their count.
    queued: std::collections::VecDeque<(usize, usize)>,
    next: usize,
}

struct ChainSlot {
    host: cudarc::driver::PinnedHostSlice<u32>,
    /// Recorded after the copy into `host`.
    copied: cudarc::driver::CudaEvent,
}

/// Chained steps queued at once at most (the engine keeps two).
const CHAIN_SLOTS: usize = 4;

/// Launches the argmax (or, with `sampling`, the draw) of the first `n` rows of `x` into
/// the step's token slots, starts the step, and queues the ids' copy to the host (see
/// [`Chain`]).
pub(crate) fn chain_ids(
    backend: &CudaBackend,
    x: &CudaTensor,
    n: usize,
    sampling: Option<&SamplingBatch>,
) -> anyhow::Result<()> {
    let sampling = sampling.filter(|s| !s.rows.iter().all(|r| r.is_argmax()));
    if let Some(s) = sampling {
        s.check_rows(n)?;
        if s.has_masks() || !s.penalties.is_empty() {
            bail!("chained steps draw without token masks or penalties");
        }
    }
    if n > x.rows {
        bail!("chain_ids: {n} rows of a tensor of {}", x.rows);
    }
    chain_launch(backend, n, |tokens| {
        match sampling {
            None => backend.launch(
                "argmax_rows",
                (n as u32, 1, 1),
                ARGMAX_THREADS,
                &argmax_args(x, tokens),
            ),
            Some(s) => {
                let params = upload_unmasked(backend, s)?;
                backend.launch(
                    "sample_rows",
                    (n as u32, 1, 1),
                    SAMPLE_THREADS,
                    &sample_args(x, params, tokens, 0, 0),
                );
            }
        }
        Ok(())
    })
}

/// Launches (`launch`, given the token slots' address) what writes a chained step's `n`
/// ids into the token slots, starts the step, and queues the ids' copy to the host.
fn chain_launch(
    backend: &CudaBackend,
    n: usize,
    launch: impl FnOnce(u64) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let mut chain = backend.chain.lock().unwrap_or_else(|p| p.into_inner());
    if n == 0 || n > chain.max_tokens {
        bail!(
            "chain_ids: {n} rows (a step holds {} tokens)",
            chain.max_tokens
        );
    }
    if chain.tokens == 0 {
        bail!("chain_ids before any step");
    }
    if chain.queued.len() >= CHAIN_SLOTS {
        bail!("more than {CHAIN_SLOTS} chained steps queued");
    }
    let k = chain.next;
    if chain.slots.len() <= k {
        // SAFETY: the slot is read only after its copy's event has completed.
        let host = unsafe { backend.ctx.alloc_pinned::<u32>(chain.max_tokens) }
            .map_err(|e| anyhow::anyhow!("allocating a pinned id slot: {e:?}"))?;
        let copied = backend
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(|e| anyhow::anyhow!("CUDA: {e:?}"))?;
        chain.slots.push(ChainSlot { host, copied });
    }
    backend
        .rows_read_back
        .store(false, std::sync::atomic::Ordering::Relaxed);
    launch(chain.tokens)?;
    backend.flush();
    let tokens = chain.tokens;
    let slot = &mut chain.slots[k];
    let dst = slot
        .host
        .as_mut_ptr()
        .map_err(|e| anyhow::anyhow!("the pinned id slot: {e:?}"))? as u64;
    // SAFETY: the token slots hold `max_tokens` ids and the pinned slot as many; `n` is at
    // most that (checked above). Unified addressing covers the pinned host memory.
    let r = unsafe { sys::cuMemcpyAsync(dst, tokens, n * 4, backend.stream.cu_stream()) };
    if r != sys::CUresult::CUDA_SUCCESS {
        bail!("copying token ids from the GPU: {r:?}");
    }
    slot.copied
        .record(&backend.stream)
        .map_err(|e| anyhow::anyhow!("CUDA: {e:?}"))?;
    chain.queued.push_back((k, n));
    chain.next = (k + 1) % CHAIN_SLOTS;
    chain.ready = Some(n);
    Ok(())
}

impl CudaBackend {
    /// The current step's token slots (a layer split's last stage copies its chained ids
    /// there).
    pub(crate) fn chain_tokens(&self) -> u64 {
        self.chain.lock().unwrap_or_else(|p| p.into_inner()).tokens
    }

    /// Marks `n` ids as written into this backend's token slots by another stage, for the
    /// next step (`tokens_on_device`) to take.
    pub(crate) fn chain_ready(&self, n: usize) {
        self.chain.lock().unwrap_or_else(|p| p.into_inner()).ready = Some(n);
    }
}

/// Waits for the oldest queued chained step's ids and returns them.
pub(crate) fn read_chained(backend: &CudaBackend, out: &mut Vec<u32>) -> anyhow::Result<()> {
    let mut chain = backend.chain.lock().unwrap_or_else(|p| p.into_inner());
    let (k, n) = chain
        .queued
        .pop_front()
        .context("no chained step to read")?;
    let slot = &chain.slots[k];
    slot.copied
        .synchronize()
        .map_err(|e| anyhow::anyhow!("CUDA: {e:?}"))?;
    if let Some(msg) = backend.lock_error().take() {
        bail!("CUDA: {msg}");
    }
    let ids = slot
        .host
        .as_slice()
        .map_err(|e| anyhow::anyhow!("the pinned id slot: {e:?}"))?;
    out.clear();
    out.extend_from_slice(&ids[..n]);
    Ok(())
}

impl CudaBackend {
    /// Uploads `params` (the sampling settings) and `masks` on the mask stream (from
    /// pinned memory, beside the step the main stream may still be running) and makes the
    /// main stream wait for the copy; returns the device addresses of both and the slot
    /// to mark read ([`Self::masks_read`]) once the sampling is queued.
    fn upload_masks(&self, params: &[u32], masks: &[u32]) -> anyhow::Result<(u64, u64, usize)> {
        let Some(copy) = self
            .mask_stream
            .get_or_init(|| self.ctx.new_stream().ok())
            .clone()
        else {
            bail!("no stream for the token masks");
        };
        let mut bufs = self.sample_masks.lock().unwrap_or_else(|p| p.into_inner());
        let k = bufs.next;
        bufs.next = 1 - k;
        let slot = &mut bufs.slots[k];
        // Settings, then the masks from a 16-byte boundary.
        let at = params.len().next_multiple_of(4);
        let len = at + masks.len();
        // The last sampling that read this slot (two steps ago) has finished, and with it
        // the copy out of its pinned buffer.
        if let Some(read) = &slot.read {
            read.synchronize()
                .map_err(|e| anyhow::anyhow!("CUDA: the token masks' last use: {e:?}"))?;
        }
        if slot.host.as_ref().is_none_or(|h| h.len() < len) {
            slot.host = None;
            // SAFETY: written only here, after the copies out of it finished (above).
            let h = unsafe { self.ctx.alloc_pinned::<u32>(len.next_power_of_two()) }
                .map_err(|e| anyhow::anyhow!("allocating the token masks' host buffer: {e:?}"))?;
            slot.host = Some(h);
        }
        // A new device buffer is allocated and zeroed in the main stream's order, behind
        // the step it may still be running: the copy waits for that (else the zeroing
        // could land after the masks, and the sampling read zeros: every token banned).
        if slot.device.as_ref().is_none_or(|d| d.len() < len) {
            slot.device = Some(self.alloc::<u32>(len.next_power_of_two(), "token masks")?);
            copy.join(&self.stream)
                .map_err(|e| anyhow::anyhow!("CUDA: the token masks' new buffer: {e:?}"))?;
        }
        let (Some(host), Some(device)) = (slot.host.as_mut(), slot.device.as_ref()) else {
            bail!("no token mask buffers");
        };
        let src = host
            .as_mut_slice()
            .map_err(|e| anyhow::anyhow!("the token masks' host buffer: {e:?}"))?;
        src[..params.len()].copy_from_slice(params);
        // Megabytes at 64 rows of a large vocabulary: on every core (a few rows' masks
        // stay on this thread, cheaper than waking the pool).
        const CHUNK: usize = 1 << 15;
        if masks.len() <= 4 * CHUNK {
            src[at..len].copy_from_slice(masks);
        } else {
            src[at..len]
                .par_chunks_mut(CHUNK)
                .zip(masks.par_chunks(CHUNK))
                .for_each(|(d, s)| d.copy_from_slice(s));
        }
        let dst = self.ptr(device);
        self.ctx
            .bind_to_thread()
            .map_err(|e| anyhow::anyhow!("binding the CUDA context: {e:?}"))?;
        // SAFETY: `src` holds `len` words (pinned, alive in `sample_masks`), `dst` at least
        // `len`; the slot is written again only after its `read` event passed.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), len * 4, copy.cu_stream()) }
            .result()
            .map_err(|e| anyhow::anyhow!("copying the token masks to the GPU: {e:?}"))?;
        let done = copy
            .record_event(None)
            .map_err(|e| anyhow::anyhow!("CUDA: {e:?}"))?;
        self.stream
            .wait(&done)
            .map_err(|e| anyhow::anyhow!("CUDA: {e:?}"))?;
        if slot.read.is_none() {
            slot.read = Some(
                self.ctx
                    .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                    .map_err(|e| anyhow::anyhow!("CUDA: {e:?}"))?,
            );
        }
        Ok((dst, dst + at as u64 * 4, k))
    }

    /// Marks mask slot `k` read by the work queued on the main stream so far.
    fn masks_read(&self, k: usize) -> anyhow::Result<()> {
        let bufs = self.sample_masks.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(read) = &bufs.slots[k].read {
            read.record(&self.stream)
                .map_err(|e| anyhow::anyhow!("CUDA: {e:?}"))?;
        }
        Ok(())
    }

    /// Launches `kernel` with one block of `threads` per row for `n` rows, each writing its
    /// token id into the id buffer (`args` gets its address), and reads the ids into `out`;
    /// `masks`: the mask slot the kernel reads, marked read after it.
    pub(crate) fn launch_for_ids(
        &self,
        kernel: &'static str,
        n: usize,
        threads: u32,
        masks: Option<usize>,
        out: &mut Vec<u32>,
        args: impl FnOnce(u64) -> Vec<Arg>,
    ) -> anyhow::Result<()> {
        // Rows are sampled on the device now: the next logits need no read-ahead.
        self.rows_read_back
            .store(false, std::sync::atomic::Ordering::Relaxed);
        let mut ids = self.argmax_ids.lock().unwrap_or_else(|p| p.into_inner());
        if ids.as_ref().is_none_or(|b| b.len() < n) {
            *ids = Some(self.alloc::<u32>(n.next_power_of_two(), "token ids")?);
        }
        let Some(buf) = ids.as_ref() else {
            bail!("no token id buffer");
        };
        self.launch(kernel, (n as u32, 1, 1), threads, &args(self.ptr(buf)));
        if let Some(k) = masks {
            self.masks_read(k)?;
        }
        self.check()?;
        out.resize(n, 0);
        self.stream
            .memcpy_dtoh(&buf.slice(..n), &mut out[..])
            .map_err(|e| anyhow::anyhow!("copying token ids from the GPU: {e:?}"))?;
        self.check()
    }
}

pub(crate) fn argmax_rows(
    backend: &CudaBackend,
    x: &CudaTensor,
    n: usize,
    _scratch: &mut Vec<f32>,
    out: &mut Vec<u32>,
) -> anyhow::Result<()> {
    if n > x.rows {
        bail!("argmax_rows: {n} rows asked, tensor has {}", x.rows);
    }
    out.clear();
    if n == 0 {
        return backend.check();
    }
    backend.launch_for_ids("argmax_rows", n, ARGMAX_THREADS, None, out, |ids| {
        argmax_args(x, ids)
    })
}

/// Greedy ids of rows whose vocabulary is split into shares (kernels/argmax.cu): tensor
/// parallelism's LM head, where each GPU holds one share's logits. Each share's best
/// (value, id) pair a row goes into a `[shares · n × 2]` tensor, share q's at rows
/// q·n.., as an all-gather of the GPUs' pairs lays them out; `argmax_shares` merges them
/// into the id `argmax_rows` takes over the whole row.
impl CudaBackend {
    /// Launches the best (value, id + `base`) of each of `n` rows of `width` values at
    /// `x` (rows `pitch` values apart) into `best` (two values a row).
    pub(crate) fn argmax_share(
        &self,
        x: u64,
        pitch: usize,
        width: usize,
        base: usize,
        n: usize,
        best: u64,
    ) {
        self.launch(
            "argmax_share",
            (n as u32, 1, 1),
            ARGMAX_THREADS,
            &[
                Arg::P(x),
                Arg::P(best),
                Arg::I(pitch as i32),
                Arg::I(width as i32),
                Arg::I(base as i32),
            ],
        );
    }

    /// `argmax_shares`' arguments: the pairs in `best`, the ids written at `ids`.
    fn shares_args(best: &CudaTensor, shares: usize, n: usize, ids: u64) -> Vec<Arg> {
        vec![
            Arg::P(best.ptr),
            Arg::P(ids),
            Arg::I(n as i32),
            Arg::I(shares as i32),
        ]
    }

    /// The ids of `n` rows from the shares' pairs in `best` (`shares · n` rows of two
    /// values), read back into `out`.
    pub(crate) fn argmax_of_shares(
        &self,
        best: &CudaTensor,
        shares: usize,
        n: usize,
        out: &mut Vec<u32>,
    ) -> anyhow::Result<()> {
        check_shares(best, shares, n)?;
        out.clear();
        if n == 0 {
            return self.check();
        }
        self.launch_for_ids("argmax_shares", n, 32, None, out, |ids| {
            Self::shares_args(best, shares, n, ids)
        })
    }

    /// [`Self::argmax_of_shares`] into the step's token slots: a chained step's ids
    /// (see [`chain_ids`]).
    pub(crate) fn chain_argmax_of_shares(
        &self,
        best: &CudaTensor,
        shares: usize,
        n: usize,
    ) -> anyhow::Result<()> {
        check_shares(best, shares, n)?;
        chain_launch(self, n, |tokens| {
            self.launch(
                "argmax_shares",
                (n as u32, 1, 1),
                32,
                &Self::shares_args(best, shares, n, tokens),
            );
            Ok(())
        })
    }

    /// The greedy ids of the first `n` rows of `x` taken share by share (`shares`: column
    /// ranges covering the row, in order) and merged, as tensor parallelism takes them
    /// across GPUs: equal to [`Backend::argmax_rows`]'s (gpu-check tests it on one GPU).
    pub fn argmax_rows_in_shares(
        &self,
        x: &CudaTensor,
        n: usize,
        shares: &[std::ops::Range<usize>],
        out: &mut Vec<u32>,
    ) -> anyhow::Result<()> {
        if n > x.rows || shares.iter().any(|s| s.start > s.end || s.end > x.cols) {
            bail!(
                "argmax_rows_in_shares: {n} rows, shares {shares:?} of a {}×{} tensor",
                x.rows,
                x.cols
            );
        }
        let best = self.new_tensor((shares.len() * n).max(1), 2)?;
        for (q, s) in shares.iter().enumerate() {
            self.argmax_share(
                x.ptr + 4 * s.start as u64,
                x.cols,
                s.len(),
                s.start,
                n,
                best.ptr + (8 * q * n) as u64,
            );
        }
        self.argmax_of_shares(&best, shares.len(), n, out)
    }
}

/// Whether `best` holds `shares` × `n` pairs (rows of two values).
fn check_shares(best: &CudaTensor, shares: usize, n: usize) -> anyhow::Result<()> {
    if shares * n > best.rows || best.cols != 2 {
        bail!(
            "argmax_of_shares: {shares} × {n} pairs in a {}×{} tensor",
            best.rows,
            best.cols
        );
    }
    Ok(())
}

/// Threads a row of `argmax_rows` and `sample_rows` (kernels/argmax.cu, kernels/sample.cu).
const ARGMAX_THREADS: u32 = 256;
const SAMPLE_THREADS: u32 = 1024;

/// `argmax_rows`'s arguments: the rows of `x`, their ids written at `ids`.
fn argmax_args(x: &CudaTensor, ids: u64) -> Vec<Arg> {
    vec![Arg::P(x.ptr), Arg::P(ids), Arg::I(x.cols as i32)]
}

/// `sample_rows`'s arguments: the rows of `x` drawn under the settings at `params`, their
/// ids written at `ids`, under the masks at `masks` (`mask_words` each; 0: none).
fn sample_args(x: &CudaTensor, params: u64, ids: u64, masks: u64, mask_words: usize) -> Vec<Arg> {
    vec![
        Arg::P(x.ptr),
        Arg::P(params),
        Arg::P(ids),
        Arg::I(x.cols as i32),
        Arg::P(masks),
        Arg::I(mask_words as i32),
    ]
}

/// The settings of `sampling`'s rows (no masks) on the device, in the main stream's order;
/// returns their address.
fn upload_unmasked(backend: &CudaBackend, sampling: &SamplingBatch) -> anyhow::Result<u64> {
    let mut params = backend
        .sample_params
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let (host, device) = &mut *params;
    settings_words(sampling, host)?;
    upload_settings(backend, host, device)
}

pub(crate) fn sample_rows(
    backend: &CudaBackend,
    x: &CudaTensor,
    n: usize,
    sampling: &SamplingBatch,
    scratch: &mut Vec<f32>,
    out: &mut Vec<u32>,
) -> anyhow::Result<()> {
    sampling.check_rows(n)?;
    if n > x.rows {
        bail!("sample_rows: {n} rows asked, tensor has {}", x.rows);
    }
    sampling.check_masks(x.cols)?;
    let masked = sampling.has_masks();
    if !masked && sampling.rows.iter().all(|r| r.is_argmax()) {
        return backend.argmax_rows(x, n, scratch, out);
    }
    out.clear();
    if masked {
        let mut params = backend
            .sample_params
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let host = &mut params.0;
        settings_words(sampling, host)?;
        // The settings go with the masks (the step is already running: nothing waits
        // behind it on the main stream).
        let (params_ptr, masks_ptr, slot) = backend.upload_masks(host, &sampling.masks)?;
        drop(params);
        return backend.launch_for_ids("sample_rows", n, SAMPLE_THREADS, Some(slot), out, |ids| {
            sample_args(x, params_ptr, ids, masks_ptr, sampling.mask_words)
        });
    }
    let params_ptr = upload_unmasked(backend, sampling)?;
    backend.launch_for_ids("sample_rows", n, SAMPLE_THREADS, None, out, |ids| {
        sample_args(x, params_ptr, ids, 0, 0)
    })
}

/// The sampling kernel's settings of `sampling`'s rows (kernels/sample.cu's layout) into
/// `host`.
fn settings_words(sampling: &SamplingBatch, host: &mut Vec<u32>) -> anyhow::Result<()> {
    // The kernel's layout (kernels/sample.cu): SAMPLE_WORDS words a row, then the
    // penalty pairs of every row.
    const SAMPLE_WORDS: usize = 12;
    host.clear();
    for (i, r) in sampling.rows.iter().enumerate() {
        let inv_t = if r.is_greedy() {
            0.0
        } else {
            1.0 / r.temperature
        };
        let u = r.u.to_bits();
        host.extend_from_slice(&[
            inv_t.to_bits(),
            r.top_k,
            r.top_p.to_bits(),
            r.min_p_log().to_bits(),
            r.repeat_penalty.to_bits(),
            r.presence_penalty.to_bits(),
            r.frequency_penalty.to_bits(),
            r.penalty_start,
            r.penalty_len,
            u as u32,
            (u >> 32) as u32,
            sampling.mask_of.get(i).copied().unwrap_or(NO_MASK),
        ]);
    }
    debug_assert_eq!(host.len(), sampling.rows.len() * SAMPLE_WORDS);
    let pairs = sampling.penalties.len();
    if sampling
        .rows
        .iter()
        .any(|r| r.penalty_start as usize + r.penalty_len as usize > pairs)
    {
        bail!("a sampling row's penalties lie outside its batch");
    }
    host.extend(
        sampling
            .penalties
            .iter()
            .flat_map(|&(id, count)| [id, count]),
    );
    Ok(())
}

/// Copies the settings to the device on the main stream (after the work queued so far,
/// which may still read the buffer's last settings); returns their address.
fn upload_settings(
    backend: &CudaBackend,
    host: &[u32],
    device: &mut Option<CudaSlice<u32>>,
) -> anyhow::Result<u64> {
    let len = host.len();
    if device.as_ref().is_none_or(|b| b.len() < len) {
        *device = Some(backend.alloc::<u32>(len.next_power_of_two(), "sampling settings")?);
    }
    let Some(dev) = device.as_mut() else {
        bail!("no sampling buffer");
    };
    backend
        .stream
        .memcpy_htod(host, &mut dev.slice_mut(..len))
        .map_err(|e| anyhow::anyhow!("copying the sampling settings to the GPU: {e:?}"))?;
    Ok(backend.ptr(dev))
}
