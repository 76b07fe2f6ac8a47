//! Tensor parallelism over the GPUs of one process: [`TpBackend`] implements the
//! `Backend` trait by running each operation on every rank — one [`CudaBackend`] per GPU,
//! each driven by a thread of its own — with its share of the weights
//! ([`kestrel_model::shard::TpPlan`]). The one forward definition runs unchanged; the
//! products of row-parallel weights (attention output, down) are followed by an NCCL
//! all-reduce, and the LM head's logits, split by vocabulary, are gathered onto rank 0,
//! which samples. The collectives are launch records of each rank's step like its kernels,
//! so a decode step of any number of sequences, NCCL calls and cuBLAS products included, is
//! captured and replayed as CUDA graphs on each GPU (one per part: [`STEP_PARTS`]), by the
//! rule one GPU follows (`step::record_step`).
//!
//! Activations are per-rank tensors allocated at the full width; an operation that writes
//! a rank's share (q, k, v, gate, up, the attention output) reshapes that rank's tensor to
//! the share's width first, so every kernel sees the shapes it would for a model of that
//! rank's heads and feed-forward width.
//!
//! A mixture-of-experts block (qwen3moe, gpt-oss) runs the single-GPU expert kernels on
//! each rank with its shard of every expert (gate/up rows and their biases, down columns:
//! the plan's range of the expert width) and the whole router, so every rank routes every
//! token alike; each rank's block output is a partial sum, all-reduced like a down
//! projection's, and only rank 0's includes the experts' down biases (gpt-oss). gpt-oss's
//! attention runs each rank's query heads with their sinks; its attention output bias is
//! added on every rank after the all-reduce.
//!
//! The linear-attention hybrids (qwen35, qwen35moe, qwen3next) run their gated attention
//! layers by the dense rule and their gated DeltaNet layers by heads: each rank runs the
//! single-GPU kernels on its q/k heads and their v heads (the plan's local
//! `DeltaNetConfig`), with the recurrent and convolution states of those heads only in its
//! cache, and `ssm_out`'s partial sums are all-reduced. A shared expert's down projection
//! ([`Role::PartialSum`]) is not reduced alone: the block's routed and shared partial sums,
//! the latter scaled by the replicated sigmoid gate, take one all-reduce after the gate.

use std::cell::UnsafeCell;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{Context, bail};
use kestrel_gguf::{GgufFile, TensorInfo};
use kestrel_model::shard::{Role, Split, TpPlan, shard_bytes};
use kestrel_model::{
    Activation, AttnParams, Backend, Batch, DeltaNetConfig, DeltaNetWeights, LayerWeights,
    ModelConfig, MoeConfig, RopeParams, SamplingBatch,
};

use crate::launch::{Arg, SPECIAL_ALL_GATHER, SPECIAL_ALL_REDUCE, SPECIAL_COPY_2D};
use crate::weights::{WeightSource, load_weight_from};
use crate::{
    CudaBackend, CudaCache, CudaSlice, CudaStep, CudaTensor, CudaWeight, Prepared, QkvWeights, nccl,
};
use kestrel_model::{KvType, KvTypes};

/// The kernels this module launches.
pub(crate) const KERNELS: &[&str] = &["all_reduce_oneshot"];

/// The one-shot all-reduce (kernels/peer.cu) takes messages up to this size: each half
/// of its double exchange buffer.
pub const ONESHOT_MAX_BYTES: usize = 4 << 20;
/// Values each block of the one-shot all-reduce sums at least (512 threads, 4 values
/// each), and its most blocks and ranks (the kernel's AR_MAX_BLOCKS, AR_MAX_RANKS).
const ONESHOT_BLOCK_VALUES: usize = 2048;
const ONESHOT_MAX_BLOCKS: usize = 64;
const ONESHOT_MAX_RANKS: usize = 8;
/// Message sizes at which [`TpBackend::new`] times the one-shot kernel against NCCL: the
/// one-shot kernel takes messages up to the largest size below which it was faster at
/// every size timed.
const ONESHOT_PROBES: [usize; 6] = [16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20];

/// Runs of each all-reduce whose best time [`TpBackend::choose_oneshot_up_to`] compares.
const ONESHOT_TRIALS: usize = 5;
/// How much slower than NCCL the one-shot kernel may time at a size and still take it.
const ONESHOT_TIE: f64 = 0.10;

/// Whether the one-shot kernel takes a message size at which it timed `oneshot` µs a call
/// against NCCL's `nccl`: unless it was slower by more than [`ONESHOT_TIE`].
fn oneshot_wins(oneshot: f64, nccl: f64) -> bool {
    oneshot <= nccl * (1.0 + ONESHOT_TIE)
}

/// A rank's buffers of the one-shot all-reduce: its exchange buffer and flags (which the
/// other ranks read and write over peer access) and the table of every rank's.
pub(crate) struct OneShot {
    _exch: CudaSlice<f32>,
    _flags: CudaSlice<u32>,
    _table: CudaSlice<u64>,
    table: u64,
    rank: usize,
    ranks: usize,
    /// Messages up to this many bytes take the one-shot kernel, larger ones NCCL.
    up_to: AtomicUsize,
}

// ---- the collectives and shapes a rank needs, on the single-GPU backend ----

impl CudaBackend {
    /// Makes this backend one rank of a group (its NCCL communicator).
    pub fn set_comm(&self, comm: nccl::Comm) -> anyhow::Result<()> {
        self.comm
            .set(comm)
            .map_err(|_| anyhow::anyhow!("this GPU already belongs to a group"))
    }

    /// Sums the first `n` rows of `x` over all ranks, in place (NCCL all-reduce), as a
    /// step's launch.
    pub fn all_reduce_rows(&self, x: &mut CudaTensor, n: usize) {
        let count = (n * x.cols) as i64;
        if let Some(o) = self.oneshot.get()
            && count > 0
            && 4 * count as usize <= o.up_to.load(Ordering::Relaxed)
        {
            let blocks = (count as usize)
                .div_ceil(ONESHOT_BLOCK_VALUES)
                .clamp(1, ONESHOT_MAX_BLOCKS);
            self.launch(
                "all_reduce_oneshot",
                (blocks as u32, 1, 1),
                512,
                &[
                    Arg::P(x.ptr),
                    Arg::P(o.table),
                    Arg::I(o.rank as i32),
                    Arg::I(o.ranks as i32),
                    Arg::I(count as i32),
                    Arg::I((ONESHOT_MAX_BYTES / 4) as i32),
                ],
            );
            return;
        }
        self.enqueue(
            SPECIAL_ALL_REDUCE,
            (1, 1, 1),
            1,
            &[Arg::P(x.ptr), Arg::L(count)],
            0,
        );
    }

    /// Every rank's first `count` values of `send`, in rank order, into `recv`.
    pub fn all_gather(&self, send: &CudaTensor, count: usize, recv: &mut CudaTensor) {
        self.enqueue(
            SPECIAL_ALL_GATHER,
            (1, 1, 1),
            1,
            &[Arg::P(send.ptr), Arg::P(recv.ptr), Arg::L(count as i64)],
            0,
        );
    }

    /// Copies `rows` rows of `width` values from `src` (starting at value `src_at`, rows
    /// `src_pitch` values apart) to `dst` (from `dst_at`, rows `dst_pitch` apart).
    #[allow(clippy::too_many_arguments)]
    pub fn copy_2d(
        &self,
        src: &CudaTensor,
        src_at: usize,
        src_pitch: usize,
        dst: &CudaTensor,
        dst_at: usize,
        dst_pitch: usize,
        width: usize,
        rows: usize,
    ) {
        let fits = |t: &CudaTensor, at: usize, pitch: usize| {
            rows == 0 || at + (rows - 1) * pitch + width <= t.buf.len()
        };
        if !fits(src, src_at, src_pitch) || !fits(dst, dst_at, dst_pitch) {
            self.fail("a strided copy out of its buffers' bounds".into());
            return;
        }
        self.enqueue(
            SPECIAL_COPY_2D,
            (1, 1, 1),
            1,
            &[
                Arg::P(src.ptr + 4 * src_at as u64),
                Arg::L(4 * src_pitch as i64),
                Arg::P(dst.ptr + 4 * dst_at as u64),
                Arg::L(4 * dst_pitch as i64),
                Arg::L(4 * width as i64),
                Arg::L(rows as i64),
            ],
            0,
        );
    }

    /// Issues the step's recorded launches (a graph replay, or the launches themselves)
    /// without waiting for them.
    pub fn issue(&self) {
        self.flush();
    }

    /// Issues the launches the step has recorded so far and goes on recording the rest
    /// (see `flush_part`).
    pub fn issue_part(&self) {
        self.flush_part();
    }

    /// Makes this backend's CUDA context the calling thread's.
    pub fn bind(&self) -> anyhow::Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| anyhow::anyhow!("binding the CUDA context: {e:?}"))
    }

    /// Loads a weight from its bytes (a whole tensor or a rank's shard).
    pub fn load_weight_bytes(&self, src: &WeightSource<'_>) -> anyhow::Result<CudaWeight> {
        load_weight_from(self, src)
    }
}

impl CudaTensor {
    /// Views the buffer as `[rows × cols]` (it keeps its allocation), or an error when that
    /// is larger than the allocation.
    pub fn reshape(&mut self, rows: usize, cols: usize) -> anyhow::Result<()> {
        if rows.checked_mul(cols).is_none_or(|l| l > self.buf.len()) {
            bail!(
                "a {rows}×{cols} view of a buffer of {} values",
                self.buf.len()
            );
        }
        self.rows = rows;
        self.cols = cols;
        Ok(())
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
}

impl CudaWeight {
    /// Output features: a matrix's rows, a vector's length.
    pub fn out_len(&self) -> usize {
        match self {
            CudaWeight::Matrix { rows, .. } => *rows,
            CudaWeight::Vector { len, .. } => *len,
        }
    }
}

// ---- a thread per rank, and fork-join over them ----

type Job = *const (dyn Fn(usize) + Sync);

struct PoolShared {
    generation: AtomicU64,
    job: UnsafeCell<Option<Job>>,
    done: AtomicUsize,
    sleeping: Vec<AtomicBool>,
    stop: AtomicBool,
    panic: Mutex<Option<String>>,
}

// SAFETY: `job` is written only by the thread in `run` while no worker reads it (before the
// generation is bumped, after every worker has finished), and read by workers after they
// see the new generation (acquire).
unsafe impl Sync for PoolShared {}
unsafe impl Send for PoolShared {}

/// One thread per rank; `run` hands every thread the same job and returns when all have
/// finished it. Idle threads spin briefly, then park.
struct Pool {
    shared: Arc<PoolShared>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

const SPINS: u32 = 1 << 16;

impl Pool {
    fn new(n: usize) -> anyhow::Result<Pool> {
        let shared = Arc::new(PoolShared {
            generation: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            done: AtomicUsize::new(0),
            sleeping: (0..n).map(|_| AtomicBool::new(false)).collect(),
            stop: AtomicBool::new(false),
            panic: Mutex::new(None),
        });
        let mut threads = Vec::new();
        for r in 0..n {
            let s = shared.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("kestrel-gpu{r}"))
                    .spawn(move || worker(&s, r))
                    .context("starting a GPU thread")?,
            );
        }
        Ok(Pool { shared, threads })
    }

    fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        let s = &self.shared;
        // SAFETY: the job outlives its use: this call returns only once every worker has
        // finished it. Only the lifetime is erased.
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f) };
        // SAFETY: no worker reads `job` now (all finished the last one).
        unsafe { *s.job.get() = Some(job) };
        s.done.store(0, Ordering::SeqCst);
        s.generation.fetch_add(1, Ordering::SeqCst);
        for (r, t) in self.threads.iter().enumerate() {
            if s.sleeping[r].load(Ordering::SeqCst) {
                t.thread().unpark();
            }
        }
        let mut spins = 0u32;
        while s.done.load(Ordering::Acquire) < self.threads.len() {
            spins += 1;
            if spins < SPINS {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    fn take_panic(&self) -> Option<String> {
        self.shared
            .panic
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }
}

fn worker(s: &PoolShared, r: usize) {
    let mut seen = 0;
    loop {
        let mut spins = 0u32;
        loop {
            let g = s.generation.load(Ordering::Acquire);
            if g != seen {
                seen = g;
                break;
            }
            if s.stop.load(Ordering::Acquire) {
                return;
            }
            spins += 1;
            if spins < SPINS {
                std::hint::spin_loop();
            } else {
                s.sleeping[r].store(true, Ordering::SeqCst);
                if s.generation.load(Ordering::SeqCst) == seen && !s.stop.load(Ordering::SeqCst) {
                    std::thread::park();
                }
                s.sleeping[r].store(false, Ordering::SeqCst);
                spins = 0;
            }
        }
        // SAFETY: written before the generation this thread just saw (acquire).
        if let Some(job) = unsafe { *s.job.get() } {
            // SAFETY: `run` keeps the job alive until `done` counts this thread.
            let f = unsafe { &*job };
            if let Err(p) = std::panic::catch_unwind(AssertUnwindSafe(|| f(r))) {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "a GPU thread panicked".into());
                *s.panic.lock().unwrap_or_else(|p| p.into_inner()) = Some(msg);
            }
        }
        s.done.fetch_add(1, Ordering::Release);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        for t in &self.threads {
            t.thread().unpark();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Rank `r`'s element of a slice whose elements each belong to one rank's thread.
struct PerRank<T>(*mut T, usize);

// SAFETY: each rank's thread touches only its own element (`get(r)` with its own `r`).
unsafe impl<T: Send> Sync for PerRank<T> {}
unsafe impl<T: Send> Send for PerRank<T> {}

impl<T> PerRank<T> {
    fn new(v: &mut [T]) -> Self {
        PerRank(v.as_mut_ptr(), v.len())
    }

    /// SAFETY: only rank `r`'s thread may call this with `r`, once per job.
    #[allow(clippy::mut_from_ref)]
    unsafe fn get(&self, r: usize) -> &mut T {
        assert!(r < self.1);
        // SAFETY: in bounds; exclusive per the contract.
        unsafe { &mut *self.0.add(r) }
    }
}

// ---- the backend ----

/// A weight as the ranks hold it.
pub struct TpWeight {
    ranks: Vec<CudaWeight>,
    role: Role,
    /// The embedding table's vocabulary shards when it doubles as the LM head.
    head: Vec<CudaWeight>,
}

/// One tensor per rank.
pub struct TpTensor(Vec<CudaTensor>);

/// The most GPUs of one tensor-parallel group.
pub const MAX_RANKS: usize = 8;

/// What each rank's operation prepared for the next (see `Backend::Prepared`).
#[derive(Clone, Copy, Debug, Default)]
pub struct TpPrepared([Prepared; MAX_RANKS]);
/// Each rank's KV cache (its KV heads).
pub struct TpCache(Vec<CudaCache>);
/// Each rank's step inputs.
pub struct TpStep(Vec<CudaStep>);

/// The LM head's buffers on each rank: its share of the logits (`local`), every rank's
/// gathered (`gathered`), and for greedy ids each row's best (value, id) of the share
/// (`best`, two values a row) and every rank's (`best_all`).
struct LmBuffers {
    rows: usize,
    local: Vec<CudaTensor>,
    gathered: Vec<CudaTensor>,
    best: Vec<CudaTensor>,
    best_all: Vec<CudaTensor>,
    /// The last LM head's rows, still in `local` only, and the logits tensor they belong
    /// in (its rank 0 address): gathered only when something reads the logits, so that
    /// greedy ids take the shares' best pairs instead (a few bytes a row instead of the
    /// vocabulary's logits).
    pending: Option<(usize, u64)>,
}

impl LmBuffers {
    /// The LM head's rows still in the ranks' shares, if `x` is the logits tensor they
    /// belong in (see [`LmBuffers::pending`]).
    fn pending_rows(&self, x: &TpTensor) -> Option<usize> {
        self.pending
            .filter(|&(_, ptr)| ptr == x.0[0].ptr)
            .map(|(n, _)| n)
    }
}

/// Several GPUs as one backend, by tensor parallelism (see the module's doc).
pub struct TpBackend {
    ranks: Vec<CudaBackend>,
    ordinals: Vec<usize>,
    pool: Pool,
    plan: Mutex<Option<Arc<TpPlan>>>,
    lm: Mutex<Option<LmBuffers>>,
    /// Row-parallel products (all-reduces) of the step so far, and after how many of them
    /// the ranks issue the part recorded so far (a quarter of the layers: see
    /// [`STEP_PARTS`]).
    reduces: AtomicUsize,
    part_every: AtomicUsize,
}

/// Parts a recorded step is issued in: the GPUs run the first while the host records the
/// next (each part a graph of its own once seen twice).
const STEP_PARTS: usize = 4;

impl TpBackend {
    /// Opens the GPUs `ordinals` (rank i on `ordinals[i]`) and joins them by NCCL.
    pub fn new(ordinals: &[usize]) -> anyhow::Result<TpBackend> {
        if ordinals.len() < 2 || ordinals.len() > MAX_RANKS {
            bail!(
                "tensor parallelism takes 2 to {MAX_RANKS} GPUs, not {}",
                ordinals.len()
            );
        }
        let mut seen = ordinals.to_vec();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != ordinals.len() {
            bail!("GPU {ordinals:?}: each GPU may appear once");
        }
        let ranks = ordinals
            .iter()
            .map(|&o| CudaBackend::new(o).with_context(|| format!("opening cuda:{o}")))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let comms = nccl::comms(ordinals)?;
        for (b, c) in ranks.iter().zip(comms) {
            b.set_comm(c)?;
        }
        oneshot_buffers(&ranks)?;
        let pool = Pool::new(ranks.len())?;
        let tp = TpBackend {
            ranks,
            ordinals: ordinals.to_vec(),
            pool,
            plan: Mutex::new(None),
            lm: Mutex::new(None),
            reduces: AtomicUsize::new(0),
            part_every: AtomicUsize::new(usize::MAX),
        };
        tp.each_ok(|_, b| b.bind())?;
        let up_to = tp.choose_oneshot_up_to()?;
        tp.set_oneshot_up_to(up_to);
        Ok(tp)
    }

    /// Times the one-shot all-reduce against NCCL at each of [`ONESHOT_PROBES`] (smallest
    /// first) and returns the largest size up to which the one-shot kernel was never
    /// slower than NCCL by more than [`ONESHOT_TIE`] at a probe: 0 when it lost at the first,
    /// or the GPUs lack peer access. Each side's time is its best of [`ONESHOT_TRIALS`]
    /// runs, alternated. Calls timed back to back outside a graph are bound by their
    /// launches at decode sizes (7.4–12 µs for both on 2× H100), and a single run of each
    /// flipped the choice between groups formed in the same minute (one-shot up to 4 MiB, up
    /// to 16 KiB, or never); within the margin the one-shot kernel is taken, which a step's
    /// graph replays as a kernel of its chain. With two GPUs both add the same two numbers,
    /// so the choice changes no result.
    fn choose_oneshot_up_to(&self) -> anyhow::Result<usize> {
        if !self.set_oneshot_up_to(0) {
            return Ok(0);
        }
        let mut up_to = 0;
        for &bytes in &ONESHOT_PROBES {
            let (mut nccl, mut oneshot) = (f64::INFINITY, f64::INFINITY);
            for _ in 0..ONESHOT_TRIALS {
                nccl = nccl.min(self.time_all_reduce(bytes, 20, false)?);
                oneshot = oneshot.min(self.time_all_reduce(bytes, 20, true)?);
            }
            if !oneshot_wins(oneshot, nccl) {
                break;
            }
            up_to = bytes;
        }
        self.set_oneshot_up_to(0);
        Ok(up_to)
    }

    /// Microseconds per all-reduce of `bytes` through the one-shot kernel or NCCL: the mean
    /// of `iters` back to back (each rank on its own thread), after a warm-up.
    fn time_all_reduce(&self, bytes: usize, iters: usize, oneshot: bool) -> anyhow::Result<f64> {
        let len = (bytes / 4).max(1);
        let mut tensors = self.each_ok(|r, b| {
            let v: Vec<f32> = (0..len).map(|i| ((i * 7 + r * 13) % 101) as f32).collect();
            b.upload_tensor(1, len, &v)
        })?;
        let ts = PerRank::new(&mut tensors);
        let previous = self.oneshot_up_to();
        self.set_oneshot_up_to(if oneshot { ONESHOT_MAX_BYTES } else { 0 });
        let run = |k: usize| {
            self.each_ok(|r, b| {
                // SAFETY: rank r's own tensor.
                let t = unsafe { ts.get(r) };
                for _ in 0..k {
                    b.all_reduce_rows(t, 1);
                }
                b.check()
            })
        };
        let timed = run(3).and_then(|_| {
            let start = std::time::Instant::now();
            run(iters)?;
            Ok(start.elapsed().as_secs_f64() * 1e6 / iters.max(1) as f64)
        });
        self.set_oneshot_up_to(previous);
        timed
    }

    /// The largest all-reduce (bytes) that takes the one-shot kernel (0: all take NCCL).
    pub fn oneshot_up_to(&self) -> usize {
        self.ranks[0]
            .oneshot
            .get()
            .map_or(0, |o| o.up_to.load(Ordering::Relaxed))
    }

    /// Sends all-reduces of up to `bytes` (at most [`ONESHOT_MAX_BYTES`]) through the
    /// one-shot kernel, larger ones through NCCL (0: all through NCCL). False when the GPUs
    /// cannot reach each other's memory (no one-shot buffers).
    pub fn set_oneshot_up_to(&self, bytes: usize) -> bool {
        let mut all = true;
        for b in &self.ranks {
            match b.oneshot.get() {
                Some(o) => o
                    .up_to
                    .store(bytes.min(ONESHOT_MAX_BYTES), Ordering::Relaxed),
                None => all = false,
            }
        }
        all
    }

    /// The number of GPUs.
    pub fn ranks(&self) -> usize {
        self.ranks.len()
    }

    /// Rank `r`'s backend.
    pub fn rank(&self, r: usize) -> &CudaBackend {
        &self.ranks[r]
    }

    fn each(&self, f: impl Fn(usize, &CudaBackend) + Sync) {
        self.pool.run(&|r| f(r, &self.ranks[r]));
    }

    /// [`Self::each`] of an operation returning what it prepared.
    fn each_prep(&self, f: impl Fn(usize, &CudaBackend) -> Prepared + Sync) -> TpPrepared {
        let mut out = TpPrepared::default();
        let o = PerRank::new(&mut out.0[..self.ranks.len()]);
        // SAFETY: rank r's own slot.
        self.pool
            .run(&|r| *unsafe { o.get(r) } = f(r, &self.ranks[r]));
        out
    }

    fn each_ok<T: Send>(
        &self,
        f: impl Fn(usize, &CudaBackend) -> anyhow::Result<T> + Sync,
    ) -> anyhow::Result<Vec<T>> {
        let out: Vec<Mutex<Option<anyhow::Result<T>>>> =
            (0..self.ranks.len()).map(|_| Mutex::new(None)).collect();
        self.pool.run(&|r| {
            let v = f(r, &self.ranks[r]);
            *out[r].lock().unwrap_or_else(|p| p.into_inner()) = Some(v);
        });
        if let Some(p) = self.pool.take_panic() {
            bail!("a GPU thread failed: {p}");
        }
        out.into_iter()
            .enumerate()
            .map(|(r, m)| {
                m.into_inner()
                    .unwrap_or_else(|p| p.into_inner())
                    .unwrap_or_else(|| Err(anyhow::anyhow!("rank {r} did not run")))
                    .with_context(|| format!("cuda:{}", self.ordinals[r]))
            })
            .collect()
    }

    fn plan(&self) -> anyhow::Result<Arc<TpPlan>> {
        self.plan
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .context("the model's configuration is not known yet (check_model first)")
    }

    /// Issues every rank's recorded launches at once (each on its own thread, so that the
    /// collectives of ranks being issued eagerly meet).
    fn issue_all(&self) {
        self.each(|_, b| b.issue());
    }

    /// All-reduces the first `n` rows of a block's partial sums on every rank (counted
    /// among the step's all-reduces: after every [`STEP_PARTS`]-th share of them the ranks
    /// issue the part recorded so far).
    fn reduce_block(&self, x: &mut TpTensor, n: usize) {
        let xs = PerRank::new(&mut x.0);
        let done = self.reduces.fetch_add(1, Ordering::Relaxed) + 1;
        let issue_part = done.is_multiple_of(self.part_every.load(Ordering::Relaxed));
        self.each(|r, b| {
            // SAFETY: rank r's own tensor.
            b.all_reduce_rows(unsafe { xs.get(r) }, n);
            if issue_part {
                b.issue_part();
            }
        });
    }

    /// The LM head split by vocabulary: each rank's logits of its rows, into its share
    /// (`LmBuffers::local`). They reach `out` (every rank's, gathered) when something
    /// reads the logits ([`Self::gather_logits`]); greedy ids merge the shares' best
    /// pairs instead ([`Self::greedy_of_shares`]).
    fn vocab_matmul(
        &self,
        x: &TpTensor,
        x_ready: TpPrepared,
        w: &[CudaWeight],
        n: usize,
        out: &mut TpTensor,
    ) {
        let Ok(plan) = self.plan() else {
            return self.ranks[0].fail("the LM head before the model's plan".into());
        };
        let mut lm = self.lm.lock().unwrap_or_else(|p| p.into_inner());
        let rows = out.0[0].rows;
        if lm.as_ref().is_none_or(|l| l.rows < rows) {
            let made = self.each_ok(|_, b| {
                Ok([
                    b.new_tensor(rows, plan.vocab_chunk)?,
                    b.new_tensor(rows * plan.ranks, plan.vocab_chunk)?,
                    b.new_tensor(rows, 2)?,
                    b.new_tensor(rows * plan.ranks, 2)?,
                ])
            });
            match made {
                Ok(v) => {
                    let mut bufs = LmBuffers {
                        rows,
                        local: Vec::new(),
                        gathered: Vec::new(),
                        best: Vec::new(),
                        best_all: Vec::new(),
                        pending: None,
                    };
                    for [local, gathered, best, best_all] in v {
                        bufs.local.push(local);
                        bufs.gathered.push(gathered);
                        bufs.best.push(best);
                        bufs.best_all.push(best_all);
                    }
                    *lm = Some(bufs);
                }
                Err(e) => return self.ranks[0].fail(format!("{e:#}")),
            }
        }
        let Some(lm) = lm.as_mut() else { return };
        let local = PerRank::new(&mut lm.local);
        let cap = lm.rows;
        self.each(|r, b| {
            // SAFETY: rank r's own element.
            let local = unsafe { local.get(r) };
            if let Err(e) = local.reshape(cap, w[r].out_len()) {
                return b.fail(format!("{e:#}"));
            }
            b.matmul_ready(&x.0[r], x_ready.0[r], &w[r], n, local);
        });
        lm.pending = Some((n, out.0[0].ptr));
    }

    /// Gathers the LM head's pending rows into every rank's `x` (the logits tensor they
    /// belong in), as the step's launches, before anything reads them.
    fn gather_logits(&self, x: &TpTensor) {
        let Ok(plan) = self.plan() else { return };
        let mut lm = self.lm.lock().unwrap_or_else(|p| p.into_inner());
        let Some(lm) = lm.as_mut() else { return };
        let Some(n) = lm.pending_rows(x) else {
            return;
        };
        lm.pending = None;
        let gathered = PerRank::new(&mut lm.gathered);
        let local = &lm.local;
        let vocab = plan.vocab.last().map_or(0, |v| v.end);
        let chunk = plan.vocab_chunk;
        self.each(|r, b| {
            // SAFETY: rank r's own element.
            let gathered = unsafe { gathered.get(r) };
            b.all_gather(&local[r], n * chunk, gathered);
            for (q, range) in plan.vocab.iter().enumerate() {
                b.copy_2d(
                    gathered,
                    q * n * chunk,
                    range.len(),
                    &x.0[r],
                    range.start,
                    vocab,
                    range.len(),
                    n,
                );
            }
        });
    }

    /// Greedy ids of the LM head's first `n` pending rows: each rank's best (value, id) of
    /// its share a row, gathered (8 bytes a row and rank), then merged on each rank by
    /// `on_rank` (given the rank's backend, its gathered pairs and the rank count): ids
    /// equal to `argmax_rows` over the gathered logits. False when `x` has no pending
    /// rows (its logits are whole already).
    fn greedy_of_shares(
        &self,
        x: &TpTensor,
        n: usize,
        on_rank: impl Fn(&CudaBackend, &CudaTensor, usize) -> anyhow::Result<()> + Sync,
    ) -> anyhow::Result<bool> {
        let plan = self.plan()?;
        let mut lm = self.lm.lock().unwrap_or_else(|p| p.into_inner());
        let Some(lm) = lm.as_mut() else {
            return Ok(false);
        };
        let Some(rows) = lm.pending_rows(x) else {
            return Ok(false);
        };
        if n > rows {
            bail!("greedy ids of {n} rows: the LM head computed {rows}");
        }
        let best_all = PerRank::new(&mut lm.best_all);
        let (local, best) = (&lm.local, &lm.best);
        let ranks = self.ranks.len();
        self.each_ok(|r, b| {
            let range = &plan.vocab[r];
            b.argmax_share(
                local[r].ptr,
                local[r].cols,
                range.len(),
                range.start,
                n,
                best[r].ptr,
            );
            // SAFETY: rank r's own element.
            let best_all = unsafe { best_all.get(r) };
            b.all_gather(&best[r], 2 * n, best_all);
            on_rank(b, best_all, ranks)
        })?;
        Ok(true)
    }
}

/// Gives each rank the one-shot all-reduce's buffers, where every pair of GPUs has peer
/// access (else none: every all-reduce goes through NCCL). Off until enabled.
fn oneshot_buffers(ranks: &[CudaBackend]) -> anyhow::Result<()> {
    if ranks.len() > ONESHOT_MAX_RANKS {
        return Ok(());
    }
    for (i, a) in ranks.iter().enumerate() {
        for b in &ranks[i + 1..] {
            if !(a.enable_peer_access(b)? && b.enable_peer_access(a)?) {
                return Ok(());
            }
        }
    }
    let flags_len = ONESHOT_MAX_BLOCKS * (ONESHOT_MAX_RANKS + 1);
    let mut bufs = Vec::new();
    for b in ranks {
        b.bind()?;
        let exch = b.alloc::<f32>(2 * ONESHOT_MAX_BYTES / 4, "the all-reduce exchange buffer")?;
        let flags = b.alloc::<u32>(flags_len, "the all-reduce flags")?;
        bufs.push((exch, flags));
    }
    let table: Vec<u64> = (ranks.iter().zip(&bufs).map(|(b, (e, _))| b.ptr(e)))
        .chain(ranks.iter().zip(&bufs).map(|(b, (_, f))| b.ptr(f)))
        .collect();
    for (r, (b, (exch, flags))) in ranks.iter().zip(bufs).enumerate() {
        b.bind()?;
        let t = b
            .stream
            .clone_htod(&table[..])
            .map_err(|e| anyhow::anyhow!("uploading the all-reduce table: {e:?}"))?;
        b.stream
            .synchronize()
            .map_err(|e| anyhow::anyhow!("CUDA: {e:?}"))?;
        let one = OneShot {
            table: b.ptr(&t),
            _exch: exch,
            _flags: flags,
            _table: t,
            rank: r,
            ranks: ranks.len(),
            up_to: AtomicUsize::new(0),
        };
        if b.oneshot.set(one).is_err() {
            bail!("this GPU already belongs to a group");
        }
    }
    Ok(())
}

/// Bytes of `file`'s weights rank `r` holds (its shards, the replicated tensors, its shard
/// of a tied LM head).
fn rank_weight_bytes(plan: &TpPlan, file: &GgufFile, r: usize) -> u64 {
    file.tensors()
        .iter()
        .map(|t| {
            let n = t.n_bytes();
            let cols = t.dims.first().copied().unwrap_or(1).max(1);
            // Rows split: a vector's elements, a matrix's rows, each stacked expert's.
            let rows = match t.dims.len() {
                0 | 1 => cols,
                _ => t.dims[1].max(1),
            };
            // A fused matrix (Phi-3's) loads as its sections: their shards.
            let sections = plan.fused_sections(&t.name, rows as usize);
            let split = plan.split(&t.name, r);
            let share = match split.shard_len() {
                _ if !sections.is_empty() => sections
                    .iter()
                    .map(|(name, range)| match plan.split(name, r).shard_len() {
                        Some(len) => n * len as u64 / rows,
                        None => n * range.len() as u64 / rows,
                    })
                    .sum(),
                None => n,
                Some(len) if split.is_cols() => n * len as u64 / cols,
                Some(len) => n * len as u64 / rows,
            };
            let head = if t.name == "token_embd.weight" && plan.tied_embeddings {
                n / plan.ranks.max(1) as u64
            } else {
                0
            };
            share + head
        })
        .sum()
}

/// Rank `r`'s part of layer weights, as the single-GPU kernels take them.
/// None for a linear-attention layer (such models are refused at load).
fn qkv_of(layer: &LayerWeights<TpWeight>, r: usize) -> Option<QkvWeights<'_>> {
    QkvWeights::picked(layer, |w| &w.ranks[r])
}

fn reshape_cols(b: &CudaBackend, t: &mut CudaTensor, cols: usize) -> bool {
    match t.reshape(t.rows, cols) {
        Ok(()) => true,
        Err(e) => {
            b.fail(format!("{e:#}"));
            false
        }
    }
}

impl Backend for TpBackend {
    type Weight = TpWeight;
    type Tensor = TpTensor;
    type Cache = TpCache;
    type Step = TpStep;
    type Prepared = TpPrepared;

    fn name(&self) -> String {
        let up_to = self.oneshot_up_to();
        format!(
            "{} × {} (tensor parallel, cuda:{}; {})",
            self.ranks.len(),
            self.ranks[0].name(),
            self.ordinals
                .iter()
                .map(|o| o.to_string())
                .collect::<Vec<_>>()
                .join(","),
            if up_to == 0 {
                "all-reduce by NCCL".to_string()
            } else {
                format!("all-reduce one-shot up to {} KiB, NCCL above", up_to >> 10)
            }
        )
    }

    fn invariant_max_tokens(&self) -> usize {
        // Two ranks' all-reduce adds the same two numbers whatever the message size;
        // more ranks' ring order depends on it.
        match self.ranks.len() {
            2 => self.ranks[0].invariant_max_tokens(),
            _ => 1,
        }
    }

    fn cache_types(&self) -> &'static [KvType] {
        self.ranks[0].cache_types()
    }

    fn new_cache_typed(
        &self,
        config: &ModelConfig,
        n_blocks: usize,
        block_size: usize,
        kv: KvTypes,
    ) -> anyhow::Result<TpCache> {
        let plan = self.plan()?;
        Ok(TpCache(self.each_ok(|r, b| {
            b.new_cache_typed(&plan.rank_config(config, r), n_blocks, block_size, kv)
        })?))
    }

    /// The cache is split evenly over the GPUs, so the memory it may take is the ranks'
    /// smallest free (and total) memory times their number.
    fn device_memory(&self) -> Option<(usize, usize)> {
        let m = self
            .each_ok(|_, b| b.device_memory().context("no memory figure"))
            .ok()?;
        let n = m.len();
        let free = m.iter().map(|x| x.0).min()?;
        let total = m.iter().map(|x| x.1).min()?;
        Some((free * n, total * n))
    }

    fn check_model(&self, cfg: &ModelConfig) -> anyhow::Result<()> {
        self.ranks[0].check_model(cfg)?;
        let plan = TpPlan::new(cfg, self.ranks.len())?;
        *self.plan.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(plan));
        // Two all-reduces a layer (after the attention output, after the down
        // projection or the mixture-of-experts block).
        self.part_every.store(
            (2 * cfg.n_layer).div_ceil(STEP_PARTS).max(1),
            Ordering::Relaxed,
        );
        Ok(())
    }

    fn load_weight(&self, file: &Arc<GgufFile>, info: &TensorInfo) -> anyhow::Result<TpWeight> {
        let plan = self.plan()?;
        for (r, b) in self.ranks.iter().enumerate() {
            b.expect_weights(file, || rank_weight_bytes(&plan, file, r));
        }
        let name = info.name.as_str();
        let data = file.tensor_data(info);
        let shape_of = |r: usize| {
            let plan = plan.clone();
            let file = file.clone();
            move |other: &str| -> Option<(usize, usize)> {
                let t = file.tensor(other).filter(|t| t.dims.len() == 2)?;
                let (cols, rows) = (t.dims[0] as usize, t.dims[1] as usize);
                let split = plan.split(other, r);
                Some(match split.shard_len() {
                    None => (cols, rows),
                    Some(len) if split.is_cols() => (len, rows),
                    Some(len) => (cols, len),
                })
            }
        };
        // The whole embedding table is only gathered from: a tied LM head gets shards of
        // its own (`head`).
        let gathered_only = name == "token_embd.weight";
        let load = |r: usize, b: &CudaBackend, split: &Split, gathered_only: bool| {
            let shape = shape_of(r);
            let (shard_dims, shard_data): (Vec<u64>, Vec<u8>);
            let (dims, data) = match split {
                Split::Replicated => (&info.dims[..], data),
                s => {
                    (shard_dims, shard_data) = shard_bytes(info.ty, &info.dims, data, s)
                        .with_context(|| format!("{name} on rank {r}"))?;
                    (&shard_dims[..], &shard_data[..])
                }
            };
            b.load_weight_bytes(&WeightSource {
                name,
                ty: info.ty,
                dims,
                data,
                gathered_only,
                shape_of: &shape,
            })
        };
        let ranks = self.each_ok(|r, b| load(r, b, &plan.split(name, r), gathered_only))?;
        let head = if name == "token_embd.weight" && plan.tied_embeddings {
            self.each_ok(|r, b| load(r, b, &plan.lm_head_split(r), false))?
        } else {
            Vec::new()
        };
        Ok(TpWeight {
            ranks,
            role: plan.role(name),
            head,
        })
    }

    /// Stacked experts: each rank's rows (gate, up) or columns (down) of every expert; the
    /// router (a 2-D weight) comes through `load_weight`, replicated.
    fn load_experts(&self, file: &Arc<GgufFile>, info: &TensorInfo) -> anyhow::Result<TpWeight> {
        let plan = self.plan()?;
        for (r, b) in self.ranks.iter().enumerate() {
            b.expect_weights(file, || rank_weight_bytes(&plan, file, r));
        }
        let name = info.name.as_str();
        let data = file.tensor_data(info);
        let ranks = self.each_ok(|r, b| match plan.split(name, r) {
            Split::Replicated => crate::moe::load_experts_bytes(b, name, info.ty, &info.dims, data),
            s => {
                let (dims, bytes) = shard_bytes(info.ty, &info.dims, data, &s)
                    .with_context(|| format!("{name} on rank {r}"))?;
                crate::moe::load_experts_bytes(b, name, info.ty, &dims, &bytes)
            }
        })?;
        Ok(TpWeight {
            ranks,
            role: plan.role(name),
            head: Vec::new(),
        })
    }

    /// Each rank's block over its share of every expert (the whole router: the same routes
    /// on every rank), then the partial sums all-reduced into `out` on every rank. The
    /// blocks are recorded on every rank before any all-reduce, so a block refused on one
    /// rank leaves no collective waiting for it on the others. A block with a shared expert
    /// leaves its partial sums for [`Backend::add_sigmoid_gated`], which adds the shared
    /// expert's and then all-reduces (one all-reduce a block).
    fn moe_ffn(
        &self,
        x: &TpTensor,
        layer: &LayerWeights<TpWeight>,
        moe: &MoeConfig,
        act: Activation,
        n: usize,
        out: &mut TpTensor,
    ) -> anyhow::Result<()> {
        let plan = self.plan()?;
        let o = PerRank::new(&mut out.0);
        self.each_ok(|r, b| {
            // SAFETY: rank r's own tensor.
            let out = unsafe { o.get(r) };
            out.reshape(out.rows, x.0[r].cols)?;
            let m = MoeConfig {
                n_ff_exp: plan.ff[r].len(),
                ..*moe
            };
            let mut e = crate::moe::Experts::picked(layer, |w: &TpWeight| &w.ranks[r]);
            // The experts' down biases (gpt-oss) join rank 0's partial sum alone.
            if r > 0
                && let Some(bias) = &layer.ffn_down_exps_bias
                && bias.role == Role::RankZero
            {
                e.down_bias = None;
            }
            crate::moe::moe_ffn(b, &x.0[r], e, &m, act, n, out)
        })?;
        if layer.shared_expert.is_none() {
            self.reduce_block(out, n);
        }
        Ok(())
    }

    /// `out += y · sigmoid(x · w)` on every rank — a shared expert's partial sum `y` scaled
    /// by its gate (`w` replicated, so the same scale on every rank) added to the routed
    /// experts' partial sum `out` — then `out` all-reduced: the block's one all-reduce.
    fn add_sigmoid_gated(
        &self,
        out: &mut TpTensor,
        y: &TpTensor,
        x: &TpTensor,
        w: &TpWeight,
        n: usize,
    ) -> anyhow::Result<()> {
        if w.role != Role::Replicated {
            bail!("a shared expert's gate split among devices");
        }
        let o = PerRank::new(&mut out.0);
        // SAFETY: rank r's own tensor.
        self.each_ok(|r, b| {
            b.add_sigmoid_gated(unsafe { o.get(r) }, &y.0[r], &x.0[r], &w.ranks[r], n)
        })?;
        self.reduce_block(out, n);
        Ok(())
    }

    fn check_linear_attention(&self) -> anyhow::Result<()> {
        self.ranks[0].check_linear_attention()
    }

    fn forget_state(&self, cache: &mut TpCache, first_block: u32) {
        let c = PerRank::new(&mut cache.0);
        // SAFETY: rank r's own cache.
        self.each(|r, b| b.forget_state(unsafe { c.get(r) }, first_block));
    }

    fn split_gated_query(
        &self,
        qg: &TpTensor,
        head_dim: usize,
        n: usize,
        q: &mut TpTensor,
        gate: &mut TpTensor,
    ) -> anyhow::Result<()> {
        let (qs, gs) = (PerRank::new(&mut q.0), PerRank::new(&mut gate.0));
        self.each_ok(|r, b| {
            // SAFETY: rank r's own tensors.
            let (q, g) = unsafe { (qs.get(r), gs.get(r)) };
            // The rank's heads: half its share of each head's query and gate.
            let w = qg.0[r].cols / 2;
            q.reshape(q.rows, w)?;
            g.reshape(g.rows, w)?;
            b.split_gated_query(&qg.0[r], head_dim, n, q, g)
        })?;
        Ok(())
    }

    fn sigmoid_mul(&self, x: &mut TpTensor, gate: &TpTensor, n: usize) -> anyhow::Result<()> {
        let xs = PerRank::new(&mut x.0);
        // SAFETY: rank r's own tensor.
        self.each_ok(|r, b| b.sigmoid_mul(unsafe { xs.get(r) }, &gate.0[r], n))?;
        Ok(())
    }

    /// Each rank's linear-attention core on its heads (the plan's local shape; `mix`, `z`,
    /// beta and alpha are already the rank's columns), writing its v heads' values to
    /// `out` for its rows of `ssm_out`.
    fn delta_net(
        &self,
        cache: &mut TpCache,
        layer: usize,
        cfg: &DeltaNetConfig,
        w: &DeltaNetWeights<TpWeight>,
        mix: &TpTensor,
        z: &TpTensor,
        beta: &TpTensor,
        alpha: &TpTensor,
        eps: f32,
        step: &TpStep,
        n: usize,
        out: &mut TpTensor,
    ) -> anyhow::Result<TpPrepared> {
        let plan = self.plan()?;
        if plan.delta != Some(*cfg) {
            bail!("a linear-attention layer of another shape than the plan's");
        }
        let (cs, os) = (PerRank::new(&mut cache.0), PerRank::new(&mut out.0));
        let prepared = self.each_ok(|r, b| {
            let local = plan
                .delta_config(r)
                .context("the plan has no linear-attention heads for this rank")?;
            // SAFETY: rank r's own cache and tensor.
            let (c, o) = unsafe { (cs.get(r), os.get(r)) };
            o.reshape(o.rows, local.value_dim())?;
            let core = crate::delta::DeltaCore::picked(w, |x: &TpWeight| &x.ranks[r]);
            crate::delta::delta_net(
                b,
                c,
                layer,
                &local,
                core,
                &mix.0[r],
                &z.0[r],
                &beta.0[r],
                &alpha.0[r],
                eps,
                &step.0[r],
                n,
                o,
            )
        })?;
        let mut out = TpPrepared::default();
        out.0[..prepared.len()].copy_from_slice(&prepared);
        Ok(out)
    }

    fn new_tensor(&self, rows: usize, cols: usize) -> anyhow::Result<TpTensor> {
        Ok(TpTensor(self.each_ok(|_, b| b.new_tensor(rows, cols))?))
    }

    fn new_cache(
        &self,
        config: &ModelConfig,
        n_blocks: usize,
        block_size: usize,
    ) -> anyhow::Result<TpCache> {
        let plan = self.plan()?;
        Ok(TpCache(self.each_ok(|r, b| {
            b.new_cache(&plan.rank_config(config, r), n_blocks, block_size)
        })?))
    }

    fn new_step(&self, config: &ModelConfig, max_tokens: usize) -> anyhow::Result<TpStep> {
        let plan = self.plan()?;
        Ok(TpStep(self.each_ok(|r, b| {
            b.new_step(&plan.rank_config(config, r), max_tokens)
        })?))
    }

    fn prepare_step(&self, batch: &Batch, step: &mut TpStep) -> anyhow::Result<()> {
        let steps = PerRank::new(&mut step.0);
        // SAFETY: rank r's own step.
        self.each_ok(|r, b| b.prepare_step(batch, unsafe { steps.get(r) }))?;
        self.reduces.store(0, Ordering::Relaxed);
        Ok(())
    }

    fn embed(&self, table: &TpWeight, step: &TpStep, out: &mut TpTensor) {
        let o = PerRank::new(&mut out.0);
        // SAFETY (every `get` below): rank r's own tensor.
        self.each(|r, b| b.embed(&table.ranks[r], &step.0[r], unsafe { o.get(r) }));
    }

    fn scale(&self, x: &mut TpTensor, n: usize, factor: f32) {
        let x = PerRank::new(&mut x.0);
        self.each(|r, b| b.scale(unsafe { x.get(r) }, n, factor));
    }

    fn rms_norm(
        &self,
        x: &TpTensor,
        weight: &TpWeight,
        eps: f32,
        n: usize,
        out: &mut TpTensor,
    ) -> TpPrepared {
        let o = PerRank::new(&mut out.0);
        self.each_prep(|r, b| b.rms_norm(&x.0[r], &weight.ranks[r], eps, n, unsafe { o.get(r) }))
    }

    fn rms_norm_heads(
        &self,
        x: &mut TpTensor,
        weight: &TpWeight,
        head_dim: usize,
        eps: f32,
        n: usize,
    ) {
        let x = PerRank::new(&mut x.0);
        self.each(|r, b| b.rms_norm_heads(unsafe { x.get(r) }, &weight.ranks[r], head_dim, eps, n));
    }

    fn matmul(&self, x: &TpTensor, w: &TpWeight, n: usize, out: &mut TpTensor) {
        self.matmul_ready(x, TpPrepared::default(), w, n, out)
    }

    fn matmul_ready(
        &self,
        x: &TpTensor,
        x_ready: TpPrepared,
        w: &TpWeight,
        n: usize,
        out: &mut TpTensor,
    ) {
        if !w.head.is_empty() {
            return self.vocab_matmul(x, x_ready, &w.head, n, out);
        }
        if w.role == Role::Vocab {
            return self.vocab_matmul(x, x_ready, &w.ranks, n, out);
        }
        let o = PerRank::new(&mut out.0);
        self.each(|r, b| {
            let out = unsafe { o.get(r) };
            let wr = &w.ranks[r];
            let partial = matches!(w.role, Role::RowParallel | Role::PartialSum);
            if !partial && !reshape_cols(b, out, wr.out_len()) {
                return;
            }
            b.matmul_ready(&x.0[r], x_ready.0[r], wr, n, out);
            if w.role == Role::RowParallel {
                b.all_reduce_rows(out, n);
            }
        });
    }

    fn add_bias(&self, x: &mut TpTensor, bias: &TpWeight, n: usize) {
        let x = PerRank::new(&mut x.0);
        self.each(|r, b| b.add_bias(unsafe { x.get(r) }, &bias.ranks[r], n));
    }

    fn rope(&self, x: &mut TpTensor, head_dim: usize, rope: &RopeParams, step: &TpStep, n: usize) {
        let x = PerRank::new(&mut x.0);
        self.each(|r, b| b.rope(unsafe { x.get(r) }, head_dim, rope, &step.0[r], n));
    }

    fn store_kv(
        &self,
        cache: &mut TpCache,
        layer: usize,
        k: &TpTensor,
        v: &TpTensor,
        step: &TpStep,
        n: usize,
    ) {
        let c = PerRank::new(&mut cache.0);
        self.each(|r, b| b.store_kv(unsafe { c.get(r) }, layer, &k.0[r], &v.0[r], &step.0[r], n));
    }

    fn attention(
        &self,
        q: &TpTensor,
        cache: &TpCache,
        params: &AttnParams,
        step: &TpStep,
        n: usize,
        out: &mut TpTensor,
    ) -> TpPrepared {
        let Ok(plan) = self.plan() else {
            self.ranks[0].fail("attention before the model's plan".into());
            return TpPrepared::default();
        };
        let p = AttnParams {
            n_head: plan.q_heads,
            n_head_kv: plan.kv_heads,
            ..*params
        };
        let o = PerRank::new(&mut out.0);
        self.each_prep(|r, b| {
            let out = unsafe { o.get(r) };
            if !reshape_cols(b, out, q.0[r].cols) {
                return Prepared::Nothing;
            }
            b.attention(&q.0[r], &cache.0[r], &p, &step.0[r], n, out)
        })
    }

    /// Each rank's query heads with their sinks (the plan's share of `sinks`).
    #[allow(clippy::too_many_arguments)]
    fn attention_sinks(
        &self,
        q: &TpTensor,
        cache: &TpCache,
        params: &AttnParams,
        sinks: &TpWeight,
        step: &TpStep,
        n: usize,
        out: &mut TpTensor,
    ) -> anyhow::Result<()> {
        let plan = self.plan()?;
        let p = AttnParams {
            n_head: plan.q_heads,
            n_head_kv: plan.kv_heads,
            ..*params
        };
        let o = PerRank::new(&mut out.0);
        self.each_ok(|r, b| {
            // SAFETY: rank r's own tensor.
            let out = unsafe { o.get(r) };
            out.reshape(out.rows, q.0[r].cols)?;
            b.attention_sinks(
                &q.0[r],
                &cache.0[r],
                &p,
                &sinks.ranks[r],
                &step.0[r],
                n,
                out,
            )
        })?;
        Ok(())
    }

    /// Each rank's query rows (its heads) by their positions' factor (Mistral 3).
    fn scale_by_position(
        &self,
        x: &mut TpTensor,
        temp: &kestrel_model::AttnTemperature,
        step: &TpStep,
        n: usize,
    ) -> anyhow::Result<()> {
        let xs = PerRank::new(&mut x.0);
        // SAFETY: rank r's own tensor.
        self.each_ok(|r, b| b.scale_by_position(unsafe { xs.get(r) }, temp, &step.0[r], n))?;
        Ok(())
    }

    fn gated_activation(
        &self,
        gate: &mut TpTensor,
        up: &TpTensor,
        act: Activation,
        n: usize,
    ) -> TpPrepared {
        let g = PerRank::new(&mut gate.0);
        self.each_prep(|r, b| b.gated_activation(unsafe { g.get(r) }, &up.0[r], act, n))
    }

    fn add(&self, x: &mut TpTensor, y: &TpTensor, n: usize) {
        let x = PerRank::new(&mut x.0);
        self.each(|r, b| b.add(unsafe { x.get(r) }, &y.0[r], n));
    }

    fn gather_logit_rows(&self, x: &TpTensor, step: &TpStep, out: &mut TpTensor) {
        let o = PerRank::new(&mut out.0);
        self.each(|r, b| b.gather_logit_rows(&x.0[r], &step.0[r], unsafe { o.get(r) }));
    }

    fn read_rows(&self, x: &TpTensor, n: usize, out: &mut Vec<f32>) -> anyhow::Result<()> {
        self.gather_logits(x);
        self.issue_all();
        self.ranks[0].read_rows(&x.0[0], n, out)
    }

    fn with_rows(
        &self,
        x: &TpTensor,
        n: usize,
        scratch: &mut Vec<f32>,
        f: &mut dyn FnMut(&[f32]),
    ) -> anyhow::Result<()> {
        self.gather_logits(x);
        self.issue_all();
        self.ranks[0].with_rows(&x.0[0], n, scratch, f)
    }

    fn argmax_rows(
        &self,
        x: &TpTensor,
        n: usize,
        scratch: &mut Vec<f32>,
        out: &mut Vec<u32>,
    ) -> anyhow::Result<()> {
        // Every rank gathers the pairs (a collective); rank 0 merges them once issued.
        if self.greedy_of_shares(x, n, |_, _, _| Ok(()))? {
            self.issue_all();
            let lm = self.lm.lock().unwrap_or_else(|p| p.into_inner());
            let best_all = lm
                .as_ref()
                .map(|l| &l.best_all[0])
                .context("no LM head buffers")?;
            return self.ranks[0].argmax_of_shares(best_all, self.ranks.len(), n, out);
        }
        self.issue_all();
        self.ranks[0].argmax_rows(&x.0[0], n, scratch, out)
    }

    fn can_chain(&self) -> bool {
        true
    }

    /// Each rank takes the same ids into its own step's token slots: greedy ids from the
    /// shares' best pairs, draws (the same draws of the same rows) from the gathered
    /// logits.
    fn chain_ids(
        &self,
        x: &TpTensor,
        n: usize,
        sampling: Option<&SamplingBatch>,
    ) -> anyhow::Result<()> {
        let greedy = sampling.is_none_or(|s| s.rows.iter().all(|r| r.is_argmax()));
        if greedy
            && self.greedy_of_shares(x, n, |b, best_all, ranks| {
                b.chain_argmax_of_shares(best_all, ranks, n)
            })?
        {
            return Ok(());
        }
        self.gather_logits(x);
        self.each_ok(|r, b| b.chain_ids(&x.0[r], n, sampling))?;
        Ok(())
    }

    fn read_chained(&self, out: &mut Vec<u32>) -> anyhow::Result<()> {
        let ids = self.each_ok(|_, b| {
            let mut ids = Vec::new();
            b.read_chained(&mut ids).map(|()| ids)
        })?;
        if ids.iter().any(|v| *v != ids[0]) {
            bail!("the GPUs' greedy ids differ: {ids:?}");
        }
        *out = ids.into_iter().next().unwrap_or_default();
        Ok(())
    }

    fn sample_rows(
        &self,
        x: &TpTensor,
        n: usize,
        sampling: &SamplingBatch,
        scratch: &mut Vec<f32>,
        out: &mut Vec<u32>,
    ) -> anyhow::Result<()> {
        self.gather_logits(x);
        self.issue_all();
        self.ranks[0].sample_rows(&x.0[0], n, sampling, scratch, out)
    }

    fn qkv(
        &self,
        x: &TpTensor,
        x_ready: TpPrepared,
        layer: &LayerWeights<TpWeight>,
        n: usize,
        q: &mut TpTensor,
        k: &mut TpTensor,
        v: &mut TpTensor,
    ) -> TpPrepared {
        let (qs, ks, vs) = (
            PerRank::new(&mut q.0),
            PerRank::new(&mut k.0),
            PerRank::new(&mut v.0),
        );
        self.each_prep(|r, b| {
            let Some(w) = qkv_of(layer, r) else {
                b.fail("qkv: a layer without Q/K/V projections".into());
                return Prepared::Nothing;
            };
            let (q, k, v) = unsafe { (qs.get(r), ks.get(r), vs.get(r)) };
            if !(reshape_cols(b, q, w.attn_q.out_len())
                && reshape_cols(b, k, w.attn_k.out_len())
                && reshape_cols(b, v, w.attn_v.out_len()))
            {
                return Prepared::Nothing;
            }
            crate::matmul::qkv(b, &x.0[r], x_ready.0[r], &w, n, q, k, v)
        })
    }

    fn gate_up(
        &self,
        x: &TpTensor,
        x_ready: TpPrepared,
        layer: &LayerWeights<TpWeight>,
        act: Activation,
        n: usize,
        gate: &mut TpTensor,
        up: &mut TpTensor,
    ) -> TpPrepared {
        self.gate_up_pair(x, x_ready, &layer.ffn_gate, &layer.ffn_up, act, n, gate, up)
    }

    fn gate_up_pair(
        &self,
        x: &TpTensor,
        x_ready: TpPrepared,
        gate_w: &TpWeight,
        up_w: &TpWeight,
        act: Activation,
        n: usize,
        gate: &mut TpTensor,
        up: &mut TpTensor,
    ) -> TpPrepared {
        let (gs, us) = (PerRank::new(&mut gate.0), PerRank::new(&mut up.0));
        self.each_prep(|r, b| {
            // SAFETY: rank r's own tensors.
            let (g, u) = unsafe { (gs.get(r), us.get(r)) };
            let (gw, uw) = (&gate_w.ranks[r], &up_w.ranks[r]);
            if !(reshape_cols(b, g, gw.out_len()) && reshape_cols(b, u, uw.out_len())) {
                return Prepared::Nothing;
            }
            b.gate_up_of(&x.0[r], x_ready.0[r], gw, uw, act, n, g, u)
        })
    }

    /// Column-parallel products of one input (a linear-attention layer's input
    /// projections, a gated attention layer's Q/gate, K and V) as each rank's single-GPU
    /// `matmul_many` on its shards; any other mix one product at a time.
    fn matmul_many(
        &self,
        x: &TpTensor,
        x_ready: TpPrepared,
        ws: &[&TpWeight],
        n: usize,
        outs: &mut [&mut TpTensor],
    ) {
        if ws
            .iter()
            .any(|w| w.role != Role::ColumnParallel || !w.head.is_empty())
        {
            for (i, (w, out)) in ws.iter().zip(outs.iter_mut()).enumerate() {
                let ready = if i == 0 {
                    x_ready
                } else {
                    TpPrepared::default()
                };
                self.matmul_ready(x, ready, w, n, out);
            }
            return;
        }
        let per: Vec<PerRank<CudaTensor>> =
            outs.iter_mut().map(|o| PerRank::new(&mut o.0)).collect();
        self.each(|r, b| {
            // SAFETY: rank r's own element of each output.
            let mut mine: Vec<&mut CudaTensor> = per.iter().map(|p| unsafe { p.get(r) }).collect();
            let wr: Vec<&CudaWeight> = ws.iter().map(|w| &w.ranks[r]).collect();
            for (o, w) in mine.iter_mut().zip(&wr) {
                if !reshape_cols(b, o, w.out_len()) {
                    return;
                }
            }
            b.matmul_many(&x.0[r], x_ready.0[r], &wr, n, &mut mine);
        });
    }

    fn matmul_add(
        &self,
        x: &TpTensor,
        x_ready: TpPrepared,
        w: &TpWeight,
        n: usize,
        tmp: &mut TpTensor,
        residual: &mut TpTensor,
    ) {
        if w.role != Role::RowParallel {
            self.matmul_ready(x, x_ready, w, n, tmp);
            return self.add(residual, tmp, n);
        }
        // Rank 0 adds its partial product into the residual, the others write theirs
        // there; the all-reduce then leaves residual + Σ partial products on every rank.
        let (ts, rs) = (PerRank::new(&mut tmp.0), PerRank::new(&mut residual.0));
        let done = self.reduces.fetch_add(1, Ordering::Relaxed) + 1;
        let issue_part = done.is_multiple_of(self.part_every.load(Ordering::Relaxed));
        self.each(|r, b| {
            let (t, res) = unsafe { (ts.get(r), rs.get(r)) };
            if r == 0 {
                b.matmul_add(&x.0[r], x_ready.0[r], &w.ranks[r], n, t, res);
            } else {
                b.matmul_ready(&x.0[r], x_ready.0[r], &w.ranks[r], n, res);
            }
            b.all_reduce_rows(res, n);
            if issue_part {
                b.issue_part();
            }
        });
    }

    fn rope_store_kv(
        &self,
        q: &mut TpTensor,
        k: &mut TpTensor,
        v: &TpTensor,
        qkv_ready: TpPrepared,
        head_dim: usize,
        rope: &RopeParams,
        cache: &mut TpCache,
        layer: usize,
        step: &TpStep,
        n: usize,
    ) {
        let (qs, ks, cs) = (
            PerRank::new(&mut q.0),
            PerRank::new(&mut k.0),
            PerRank::new(&mut cache.0),
        );
        self.each(|r, b| {
            let (q, k, c) = unsafe { (qs.get(r), ks.get(r), cs.get(r)) };
            b.rope_store_kv(
                q,
                k,
                &v.0[r],
                qkv_ready.0[r],
                head_dim,
                rope,
                c,
                layer,
                &step.0[r],
                n,
            );
        });
    }
}

impl Drop for TpBackend {
    fn drop(&mut self) {
        // Let every rank's queued work (collectives included) finish before the
        // communicators go.
        self.issue_all();
        let _ = self.each_ok(|_, b| b.check());
    }
}

/// One message size of [`all_reduce_latency`]: microseconds per call and the largest
/// |difference| of any rank's sum from the host's, through NCCL and (at most
/// [`ONESHOT_MAX_BYTES`], where the GPUs have peer access) through the one-shot kernel,
/// with the one-shot sums' largest |difference| from NCCL's (three calls in a row: both
/// halves of its exchange buffer).
#[derive(Debug, Clone)]
pub struct AllReduceTiming {
    pub bytes: usize,
    pub nccl_us: f64,
    pub nccl_err: f32,
    pub oneshot: Option<(f64, f32, f32)>,
}

/// `ranks` messages of `len` values in [-8, 8) from an LCG advancing `seed` (the checks'
/// fresh inputs for every size and call).
fn random_messages(seed: &mut u64, ranks: usize, len: usize) -> Vec<Vec<f32>> {
    (0..ranks)
        .map(|_| {
            (0..len)
                .map(|_| {
                    *seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 16.0 - 8.0
                })
                .collect()
        })
        .collect()
}

/// The all-reduce latency of messages of each of `sizes` bytes on `ordinals` (the mean of
/// `iters` calls back to back, each rank on its own thread, after a warm-up), and its sums
/// against the host's, through NCCL and through the one-shot kernel; also the size up to
/// which the group chose the one-shot kernel ([`TpBackend::oneshot_up_to`]).
pub fn all_reduce_latency(
    ordinals: &[usize],
    sizes: &[usize],
    iters: usize,
) -> anyhow::Result<(usize, Vec<AllReduceTiming>)> {
    let tp = TpBackend::new(ordinals)?;
    let chosen = tp.oneshot_up_to();
    let mut out = Vec::new();
    let mut seed = 0x5eedu64 ^ ordinals.len() as u64;
    for &bytes in sizes {
        let len = (bytes / 4).max(1);
        // Fresh random values for every size and call.
        let mut inputs = || random_messages(&mut seed, tp.ranks(), len);
        // One all-reduce of `inputs`; every rank's result.
        let once = |inputs: &[Vec<f32>], oneshot: bool| -> anyhow::Result<Vec<Vec<f32>>> {
            tp.set_oneshot_up_to(if oneshot { ONESHOT_MAX_BYTES } else { 0 });
            let mut tensors = tp.each_ok(|r, b| b.upload_tensor(1, len, &inputs[r]))?;
            let ts = PerRank::new(&mut tensors);
            // SAFETY: rank r's own tensor.
            tp.each_ok(|r, b| {
                b.all_reduce_rows(unsafe { ts.get(r) }, 1);
                b.check()
            })?;
            let mut all = Vec::new();
            for (r, t) in tensors.iter().enumerate() {
                let mut got = Vec::new();
                tp.ranks[r].bind()?;
                tp.ranks[r].read_rows(t, 1, &mut got)?;
                all.push(got);
            }
            Ok(all)
        };
        let max_diff = |a: &[Vec<f32>], b: &dyn Fn(usize, usize) -> f32| {
            a.iter()
                .enumerate()
                .flat_map(|(r, v)| v.iter().enumerate().map(move |(i, x)| (x - b(r, i)).abs()))
                .fold(
                    0f32,
                    |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
                )
        };
        let sum = |inputs: &[Vec<f32>]| -> Vec<f32> {
            (0..len)
                .map(|i| inputs.iter().map(|v| f64::from(v[i])).sum::<f64>() as f32)
                .collect()
        };
        let x = inputs();
        let want = sum(&x);
        let nccl = once(&x, false)?;
        let nccl_err = max_diff(&nccl, &|_, i| want[i]);
        let nccl_us = tp.time_all_reduce(bytes, iters, false)?;
        let oneshot = if bytes <= ONESHOT_MAX_BYTES && tp.set_oneshot_up_to(ONESHOT_MAX_BYTES) {
            let (mut err, mut vs_nccl) = (0f32, 0f32);
            for call in 0..3 {
                let (x, nccl) = if call == 0 {
                    (x.clone(), nccl.clone())
                } else {
                    let x = inputs();
                    let nccl = once(&x, false)?;
                    (x, nccl)
                };
                let want = sum(&x);
                let got = once(&x, true)?;
                err = err.max(max_diff(&got, &|_, i| want[i]));
                vs_nccl = vs_nccl.max(max_diff(&got, &|r, i| nccl[r][i]));
            }
            Some((tp.time_all_reduce(bytes, iters, true)?, err, vs_nccl))
        } else {
            None
        };
        tp.set_oneshot_up_to(chosen);
        out.push(AllReduceTiming {
            bytes,
            nccl_us,
            nccl_err,
            oneshot,
        });
    }
    Ok((chosen, out))
}

/// The one-shot all-reduce's kernel checked on one GPU: `ranks` backends on `ordinal`
/// (each on its own stream and host thread, as the ranks of a group) sum random messages
/// of each of `sizes` bytes, three rounds each (the flags' epochs advance); returns each
/// size's largest |difference| of any rank's result from the host's sum over all rounds.
pub fn oneshot_on_one_gpu(
    ordinal: usize,
    ranks: usize,
    sizes: &[usize],
) -> anyhow::Result<Vec<(usize, f32)>> {
    let backends = (0..ranks)
        .map(|_| CudaBackend::new(ordinal))
        .collect::<anyhow::Result<Vec<_>>>()?;
    oneshot_buffers(&backends)?;
    for b in &backends {
        b.oneshot
            .get()
            .context("no one-shot buffers")?
            .up_to
            .store(ONESHOT_MAX_BYTES, Ordering::Relaxed);
    }
    let mut seed = 0xa11ce ^ ordinal as u64;
    let mut out = Vec::new();
    for &bytes in sizes {
        let len = (bytes / 4).clamp(1, ONESHOT_MAX_BYTES / 4);
        let mut worst = 0f32;
        for _round in 0..3 {
            let inputs = random_messages(&mut seed, ranks, len);
            let results: Vec<anyhow::Result<Vec<f32>>> = std::thread::scope(|sc| {
                let handles: Vec<_> = backends
                    .iter()
                    .zip(&inputs)
                    .map(|(b, x)| {
                        sc.spawn(move || -> anyhow::Result<Vec<f32>> {
                            b.bind()?;
                            let mut t = b.upload_tensor(1, len, x)?;
                            b.all_reduce_rows(&mut t, 1);
                            b.check()?;
                            let mut got = Vec::new();
                            b.read_rows(&t, 1, &mut got)?;
                            Ok(got)
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join()
                            .unwrap_or_else(|_| Err(anyhow::anyhow!("a rank's thread panicked")))
                    })
                    .collect()
            });
            for got in results {
                let got = got?;
                anyhow::ensure!(got.len() == len, "{} values back of {len}", got.len());
                for (i, g) in got.iter().enumerate() {
                    let want: f64 = inputs.iter().map(|v| f64::from(v[i])).sum();
                    let d = (f64::from(*g) - want).abs() as f32;
                    worst = if d.is_nan() {
                        f32::INFINITY
                    } else {
                        worst.max(d)
                    };
                }
            }
        }
        out.push((bytes, worst));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The weight bytes planned per rank: over the ranks, every split tensor once (Phi-3's
    /// fused matrices by their sections' shards, not whole on each rank), every replicated
    /// one (gpt-oss's sinks excepted, its down biases included) on each rank, and a tied
    /// LM head's vocabulary shards besides; Phi-3's fused Q/K/V and gate/up halved.
    #[test]
    fn rank_weight_bytes_count_each_split_tensor_once() {
        use kestrel_model::synth::{SynthConfig, WeightType, write_synth_to};
        use kestrel_model::{Arch, ModelConfig};
        for arch in [Arch::Phi3, Arch::Mistral3, Arch::GptOss, Arch::Llama] {
            let mut c = SynthConfig::tiny(arch);
            (c.n_embd, c.n_head, c.n_head_kv, c.n_ff) = (512, 8, 2, 1024);
            let (bytes, _) = write_synth_to(Vec::new(), &c, WeightType::Q8_0, 1).unwrap();
            let file = GgufFile::from_bytes(bytes).unwrap();
            let cfg = ModelConfig::from_gguf(&file).unwrap();
            let plan = TpPlan::new(&cfg, 2).unwrap();
            let per_rank: Vec<u64> = (0..2).map(|r| rank_weight_bytes(&plan, &file, r)).collect();
            let rows = |t: &TensorInfo| match t.dims.len() {
                0 | 1 => t.dims.first().copied().unwrap_or(1) as usize,
                _ => t.dims[1] as usize,
            };
            let (mut whole, mut replicated, mut fused) = (0u64, 0u64, 0u64);
            for t in file.tensors() {
                whole += t.n_bytes();
                let sections = plan.fused_sections(&t.name, rows(t));
                fused += u64::from(!sections.is_empty());
                if sections.is_empty() && plan.split(&t.name, 0) == Split::Replicated {
                    replicated += t.n_bytes();
                }
            }
            let head = match file.tensor("token_embd.weight") {
                Some(t) if plan.tied_embeddings => t.n_bytes(),
                _ => 0,
            };
            assert_eq!(
                per_rank.iter().sum::<u64>(),
                whole + replicated + head,
                "{arch:?}"
            );
            assert_eq!(
                fused,
                if arch == Arch::Phi3 { 2 * 2 } else { 0 },
                "{arch:?}"
            );
        }
    }

    /// The one-shot kernel takes ties and near-ties (within 10%), not clear losses.
    #[test]
    fn oneshot_takes_near_ties() {
        assert!(oneshot_wins(7.5, 10.2));
        assert!(oneshot_wins(7.64, 7.39));
        assert!(oneshot_wins(8.0, 8.0));
        assert!(!oneshot_wins(9.0, 7.39));
        assert!(!oneshot_wins(f64::INFINITY, 7.0));
    }

    /// Every job runs exactly once on every rank's thread, with its own element, also after
    /// the threads have gone to sleep; a panicking job is reported, not lost.
    #[test]
    fn pool_runs_each_job_once_per_rank() {
        for ranks in [1, 2, 3] {
            let pool = Pool::new(ranks).unwrap();
            let mut counts = vec![0u64; ranks];
            let hits = AtomicUsize::new(0);
            for round in 0..300u64 {
                let c = PerRank::new(&mut counts);
                pool.run(&|r| {
                    // SAFETY: rank r's own element.
                    *unsafe { c.get(r) } += round + 1;
                    hits.fetch_add(1, Ordering::Relaxed);
                });
                if round == 150 {
                    // Long enough for the threads to park.
                    std::thread::sleep(std::time::Duration::from_millis(200));
                }
            }
            let want: u64 = (1..=300).sum();
            assert!(counts.iter().all(|&c| c == want), "{counts:?}");
            assert_eq!(hits.load(Ordering::Relaxed), 300 * ranks);
            pool.run(&|r| {
                if r + 1 == ranks {
                    panic!("rank {r} failed");
                }
            });
            assert_eq!(
                pool.take_panic().as_deref(),
                Some(&*format!("rank {} failed", ranks - 1))
            );
            assert!(pool.take_panic().is_none());
        }
    }
}
