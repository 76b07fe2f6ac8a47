//! Kernel launches: the launch record, recording a step for CUDA graph replay, the graph
//! cache, programmatic dependent launch, the per-kernel profiler, and the deferred error
//! every operation reports through.

use crate::*;

/// A kernel argument.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    /// A device pointer.
    P(u64),
    I(i32),
    L(i64),
    F(f32),
}

/// What a launcher left beside its output for the one product that reads that output next
/// (this backend's `Backend::Prepared`): the normalization, activation or attention that
/// writes a tensor also writes the copy its consumer's kernel needs, the forward pass hands
/// this over, and the consumer then converts nothing. Each copy names the tensor it stands
/// for (`of`, its device address): a consumer uses it only for that tensor.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Prepared {
    #[default]
    Nothing,
    /// `n` token rows in 8 bits, row after row, in the step's Q8 buffers (the `gemv_q8`
    /// family; one row but in verification steps).
    Q8 { of: u64, n: usize },
    /// `n` tokens (`npad` rows) in the Q8 buffers in the int8 tensor-core layout: that of
    /// `mmk_t8*` / `mms_*` (`mmk`, 256-value steps) or of `mmq_t*`.
    Mmq {
        of: u64,
        n: usize,
        npad: usize,
        mmk: bool,
    },
    /// `n` rows in f16 at `h` (a GEMM scratch buffer), for cuBLAS.
    F16 { of: u64, n: usize, h: u64 },
    /// A merged Q/K/V product not yet split into q, k and v: `rope_store_kv` reads its
    /// heads straight from it (see [`PendingSplit`]).
    Split(PendingSplit),
}

/// One kernel launch, as recorded for a step.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Launch {
    pub(crate) func: usize,
    pub(crate) grid: (u32, u32, u32),
    pub(crate) block: u32,
    pub(crate) args: Vec<Arg>,
    /// Weight bytes the launch streams (GEMVs; 0 otherwise), for the profiler's GB/s.
    pub(crate) weight_bytes: u64,
}

/// Launch records from this index on are not kernels but operations on other devices'
/// data, recorded and captured like kernels (`run_special`): an NCCL all-reduce
/// (`[P(buffer), L(count)]`), an NCCL all-gather (`[P(send), P(recv), L(count)]`) and a
/// strided copy (`[P(src), L(src pitch), P(dst), L(dst pitch), L(width bytes), L(rows)]`),
/// a copy to another device's memory (`[P(dst), P(src), L(bytes)]`, a layer split's
/// activations where the devices lack peer access) and a cuBLAS product
/// (`[P(a), L(rows), L(cols), P(x), L(n), P(out), L(ld), I(accumulate)]`, see
/// `gemm_f16_raw`).
pub(crate) const SPECIAL_BASE: usize = usize::MAX - 4;
pub(crate) const SPECIAL_ALL_REDUCE: usize = usize::MAX;
pub(crate) const SPECIAL_ALL_GATHER: usize = usize::MAX - 1;
pub(crate) const SPECIAL_COPY_2D: usize = usize::MAX - 2;
pub(crate) const SPECIAL_PEER_COPY: usize = usize::MAX - 3;
pub(crate) const SPECIAL_GEMM: usize = usize::MAX - 4;

/// The profiler's name for launch `func`: its kernel's, or its special record's.
fn launch_name(kernels: &[&'static str], func: usize) -> &'static str {
    match func {
        SPECIAL_ALL_REDUCE => "nccl_all_reduce",
        SPECIAL_ALL_GATHER => "nccl_all_gather",
        SPECIAL_COPY_2D => "copy_2d",
        SPECIAL_PEER_COPY => "copy_to_device",
        SPECIAL_GEMM => "cublas_gemm",
        f => kernels.get(f).copied().unwrap_or("?"),
    }
}

/// What the profiler totals a launch's time by besides its kernel: the grid, or a cuBLAS
/// product's rows × cols × tokens (its launches' grids are cuBLAS's own).
fn profile_shape(l: &Launch) -> (u32, u32, u32) {
    let arg = |i: usize| match l.args.get(i) {
        Some(Arg::L(v)) => *v as u32,
        _ => 0,
    };
    if l.func == SPECIAL_GEMM {
        (arg(1), arg(2), arg(4))
    } else {
        l.grid
    }
}

/// A captured step.
pub(crate) struct StepGraph(CudaGraph);

/// Launches of the step being recorded, the last list run eagerly, and the graphs.
#[derive(Default)]
pub(crate) struct Recorder {
    /// Whether launches are being recorded instead of issued.
    pub(crate) deferring: bool,
    /// Whether the step being recorded takes cuBLAS where an eager one would (its products
    /// recorded as [`SPECIAL_GEMM`]); false: the step's kernels are chosen without cuBLAS.
    pub(crate) gemms: bool,
    pub(crate) pending: Vec<Launch>,
    /// The list each part of the last step ran eagerly (a step is issued in parts when its
    /// owner calls `issue_part` while recording: see [`CudaBackend::flush_part`]).
    pub(crate) previous: Vec<Vec<Launch>>,
    /// The part of the step being recorded (0 until the step's first `flush_part`).
    pub(crate) part: usize,
    pub(crate) graphs: Vec<(Vec<Launch>, StepGraph)>,
    pub(crate) captures: u64,
}

/// Launches bracketed by timing events, and the totals per (kernel, grid).
/// A (kernel, grid) pair the profiler totals by.
pub(crate) type KernelKey = (usize, (u32, u32, u32));

/// A launch bracketed by two timing events.
pub(crate) type TimedLaunch = (
    KernelKey,
    u64,
    cudarc::driver::CudaEvent,
    cudarc::driver::CudaEvent,
);

#[derive(Default)]
pub(crate) struct Profiler {
    pub(crate) pending: Vec<TimedLaunch>,
    /// Milliseconds, calls and weight bytes per (kernel, grid).
    pub(crate) totals: HashMap<KernelKey, (f64, u64, u64)>,
    /// Steps run (prepare_step calls), for per-step times.
    pub(crate) steps: u64,
}

pub(crate) fn grid_1d(len: usize, block: usize) -> (u32, u32, u32) {
    (len.div_ceil(block) as u32, 1, 1)
}

/// Dynamic shared memory of a kernel's launches: `mms_*` (and `moe_mms_*`) stage MS_STAGES
/// (3) steps of their block's 64 weight rows (MS_WROW = 224 bytes each) and of the
/// activations of their 8·J tokens (MS_XROW = 288 bytes each and a 4-byte step;
/// kernels/mmq.cu); the tiled decode attention its staging (`attention::tiled_smem`,
/// `attention::tiled_q_smem`, `attention::tiled_q8_smem`); others use none.
pub(crate) fn dynamic_smem(name: &str) -> u32 {
    match name {
        "attention_split_tiled64" => return crate::attention::tiled_smem(64),
        "attention_split_tiled128" => return crate::attention::tiled_smem(128),
        "attention_split_tiled64_q" => return crate::attention::tiled_q_smem(64),
        "attention_split_tiled128_q" => return crate::attention::tiled_q_smem(128),
        "attention_split_tiled64_q8" => return crate::attention::tiled_q8_smem(64),
        "attention_split_tiled128_q8" => return crate::attention::tiled_q8_smem(128),
        "moe_mqs_gate_up" | "moe_mqs_down" => return crate::moe_mma::MQS_SMEM,
        _ => {}
    }
    if name == "mmw_gated" {
        return MW_STAGES * (MW_XBYTES + (MW_MAX_WARPS * 2 * MW_TILE_BYTES) as u32);
    }
    let tokens = match name.strip_suffix("_gated").unwrap_or(name) {
        "mms_t16" | "moe_mms_gate_up_t16" | "moe_mms_down_t16" => 16,
        "mms_t32" | "moe_mms_gate_up_t32" | "moe_mms_down_t32" => 32,
        _ => return 0,
    };
    3 * (MMS_ROWS as u32 * 224 + tokens * (288 + 4))
}

/// Graphs kept (one per distinct launch list: per batch size, and per part of a step issued
/// in parts).
pub(crate) const MAX_GRAPHS: usize = 32;

impl PartialEq for Arg {
    fn eq(&self, other: &Arg) -> bool {
        match (self, other) {
            (Arg::P(a), Arg::P(b)) => a == b,
            (Arg::I(a), Arg::I(b)) => a == b,
            (Arg::L(a), Arg::L(b)) => a == b,
            // Bit equality: a graph replays exactly the recorded value.
            (Arg::F(a), Arg::F(b)) => a.to_bits() == b.to_bits(),
            _ => false,
        }
    }
}

// SAFETY: a CUDA graph exec handle may be launched from any thread; the backend only
// touches it under the recorder's mutex.
unsafe impl Send for StepGraph {}

impl CudaBackend {
    /// The profiler's per-kernel table on stderr (when profiling; the backend is dropped).
    pub(crate) fn print_profile(&self) {
        let Some(p) = &self.profile else {
            return;
        };
        let _ = self.stream.synchronize();
        self.profile_collect();
        let p = p.lock().unwrap_or_else(|e| e.into_inner());
        let mut rows: Vec<_> = p.totals.iter().collect();
        rows.sort_by(|a, b| b.1.0.total_cmp(&a.1.0));
        let all: f64 = rows.iter().map(|r| r.1.0).sum();
        let steps = p.steps.max(1) as f64;
        eprintln!(
            "kernel profile (KESTREL_CUDA_PROFILE=1): {all:.2} ms in kernels over {} steps ({:.3} ms per step; events add a few µs per launch)",
            p.steps,
            all / steps
        );
        eprintln!(
            "{:<20} {:>18} {:>8} {:>10} {:>9} {:>11} {:>6} {:>8}",
            "kernel", "grid", "calls", "total ms", "avg µs", "µs / step", "share", "GB/s"
        );
        for ((func, grid), (ms, calls, bytes)) in rows.into_iter().take(40) {
            // Weight bytes over kernel time: against the ~3.0 TB/s device-copy ceiling.
            let gbs = if *bytes > 0 {
                format!("{:.0}", *bytes as f64 / (ms * 1e6))
            } else {
                "-".into()
            };
            eprintln!(
                "{:<20} {:>18} {:>8} {:>10.3} {:>9.2} {:>11.2} {:>5.1}% {:>8}",
                launch_name(&self.func_names, *func),
                format!("{}x{}x{}", grid.0, grid.1, grid.2),
                calls,
                ms,
                ms * 1e3 / *calls as f64,
                ms * 1e3 / steps,
                100.0 * ms / all.max(1e-12),
                gbs
            );
        }
    }

    /// Turns graph capture and replay of decode steps on or off (on by default; the
    /// environment variable `KESTREL_CUDA_GRAPHS=0` turns it off).
    pub fn set_graphs(&self, on: bool) {
        self.flush();
        self.graphs.store(on, std::sync::atomic::Ordering::Relaxed);
        let mut rec = self.lock_recorder();
        rec.graphs.clear();
        rec.previous.clear();
    }

    /// Graphs captured so far.
    pub fn graphs_captured(&self) -> u64 {
        self.lock_recorder().captures
    }

    /// A counter of the steps replayed from a graph, readable after the backend has moved
    /// into an engine.
    pub fn replay_counter(&self) -> Arc<std::sync::atomic::AtomicU64> {
        self.replays.clone()
    }

    pub(crate) fn lock_recorder(&self) -> std::sync::MutexGuard<'_, Recorder> {
        self.recorder.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn launch_now(&self, l: &Launch) {
        let timing = self.profile.as_ref().and_then(|_| {
            let ev = || {
                self.ctx
                    .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .ok()
            };
            let (a, b) = (ev()?, ev()?);
            a.record(&self.stream).ok()?;
            Some((a, b))
        });
        if l.func >= SPECIAL_BASE {
            self.run_special(l);
        } else {
            self.launch_raw(l);
        }
        if let (Some(p), Some((a, b))) = (&self.profile, timing)
            && b.record(&self.stream).is_ok()
        {
            let mut p = p.lock().unwrap_or_else(|e| e.into_inner());
            p.pending
                .push(((l.func, profile_shape(l)), l.weight_bytes, a, b));
        }
    }

    /// Drains the profiler's finished launches into its totals (after a synchronize).
    pub(crate) fn profile_collect(&self) {
        if let Some(p) = &self.profile {
            let mut p = p.lock().unwrap_or_else(|e| e.into_inner());
            let pending = std::mem::take(&mut p.pending);
            for (key, bytes, a, b) in pending {
                if let Ok(ms) = a.elapsed_ms(&b) {
                    let e = p.totals.entry(key).or_default();
                    e.0 += ms as f64;
                    e.1 += 1;
                    e.2 += bytes;
                }
            }
        }
    }

    /// Issues a special record (see [`SPECIAL_BASE`]) on the stream.
    fn run_special(&self, l: &Launch) {
        let arg = |i: usize| match l.args.get(i) {
            Some(Arg::P(v)) => *v,
            Some(Arg::L(v)) => *v as u64,
            _ => 0,
        };
        if let Err(e) = self.ctx.bind_to_thread() {
            self.fail(format!("binding the CUDA context: {e:?}"));
            return;
        }
        let stream = self.stream.cu_stream() as *mut std::ffi::c_void;
        let r = match l.func {
            SPECIAL_GEMM => match &self.blas {
                None => Err(anyhow::anyhow!("a GEMM without cuBLAS")),
                Some(blas) => {
                    let shape = crate::matmul::cublas::Shape {
                        rows: arg(1) as usize,
                        cols: arg(2) as usize,
                        n: arg(4) as usize,
                        ld: arg(6) as usize,
                    };
                    let accumulate = matches!(l.args.get(7), Some(Arg::I(1)));
                    crate::matmul::cublas::gemm_ex_raw(
                        blas,
                        shape,
                        arg(0),
                        arg(3),
                        arg(5),
                        accumulate,
                    )
                    .map_err(|e| {
                        anyhow::anyhow!(
                            "cuBLAS GEMM ({}×{} by {} tokens): {e}",
                            shape.rows,
                            shape.cols,
                            shape.n
                        )
                    })
                }
            },
            SPECIAL_ALL_REDUCE | SPECIAL_ALL_GATHER => match self.comm.get() {
                None => Err(anyhow::anyhow!(
                    "a collective on a backend without a communicator"
                )),
                Some(c) if l.func == SPECIAL_ALL_REDUCE => {
                    c.all_reduce_sum(arg(0), arg(1) as usize, stream)
                }
                Some(c) => c.all_gather(arg(0), arg(1), arg(2) as usize, stream),
            },
            SPECIAL_PEER_COPY => {
                // SAFETY: both regions lie in live device buffers (unified addresses, this
                // device's or a peer's), sized by the caller (`split.rs`, `push_values`).
                let r = unsafe {
                    sys::cuMemcpyAsync(arg(0), arg(1), arg(2) as usize, self.stream.cu_stream())
                };
                if r == sys::CUresult::CUDA_SUCCESS {
                    Ok(())
                } else {
                    Err(anyhow::anyhow!("copy to another device: {r:?}"))
                }
            }
            _ => {
                let m = sys::CUDA_MEMCPY2D {
                    srcXInBytes: 0,
                    srcY: 0,
                    srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                    srcHost: std::ptr::null(),
                    srcDevice: arg(0),
                    srcArray: std::ptr::null_mut(),
                    srcPitch: arg(1) as usize,
                    dstXInBytes: 0,
                    dstY: 0,
                    dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                    dstHost: std::ptr::null_mut(),
                    dstDevice: arg(2),
                    dstArray: std::ptr::null_mut(),
                    dstPitch: arg(3) as usize,
                    WidthInBytes: arg(4) as usize,
                    Height: arg(5) as usize,
                };
                // SAFETY: both regions lie in live device buffers of this context, sized
                // by the caller (`copy_2d`) from the same geometry.
                let r = unsafe { sys::cuMemcpy2DAsync_v2(&m, self.stream.cu_stream()) };
                if r == sys::CUresult::CUDA_SUCCESS {
                    Ok(())
                } else {
                    Err(anyhow::anyhow!("strided copy: {r:?}"))
                }
            }
        };
        if let Err(e) = r {
            self.fail(format!("{e:#}"));
        }
    }

    /// Issues one launch on the stream, with programmatic stream serialization unless
    /// `KESTREL_CUDA_PDL=0`: the kernel may be scheduled while the previous one runs, and
    /// waits for it in `pdl_enter` (kernels/common.cuh), which hides the launch latency
    /// between the step's kernels.
    pub(crate) fn launch_raw(&self, l: &Launch) {
        // Each argument in an 8-byte slot (little-endian: a 4-byte argument is the low
        // half); the driver reads each parameter's size from the kernel's signature.
        let mut slots: Vec<u64> = l
            .args
            .iter()
            .map(|a| match *a {
                Arg::P(v) => v,
                Arg::I(v) => u64::from(v as u32),
                Arg::L(v) => v as u64,
                Arg::F(v) => u64::from(v.to_bits()),
            })
            .collect();
        let mut params: Vec<*mut std::ffi::c_void> =
            slots.iter_mut().map(|s| (s as *mut u64).cast()).collect();
        // SAFETY: the union is plain data; all-zero is a valid value of every member.
        let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        value.programmaticStreamSerializationAllowed = 1;
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value,
        };
        let cfg = sys::CUlaunchConfig {
            gridDimX: l.grid.0,
            gridDimY: l.grid.1,
            gridDimZ: l.grid.2,
            blockDimX: l.block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: self.func_smem[l.func],
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(self.pdl),
        };
        if let Err(e) = self.ctx.bind_to_thread() {
            self.fail(format!("binding the CUDA context: {e:?}"));
            return;
        }
        // SAFETY: every kernel's arguments are built by the matching method below, with
        // pointers to live buffers sized by the same geometry the kernel uses; `params`
        // points into `slots`, both alive across the call (the driver copies them).
        let r = unsafe {
            sys::cuLaunchKernelEx(
                &cfg,
                self.funcs[l.func].cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            self.fail(format!("launching {}: {r:?}", self.func_names[l.func]));
        }
    }

    /// Issues the recorded launches of the current step: from a graph when the same list
    /// was seen before, eagerly otherwise.
    pub(crate) fn flush(&self) {
        self.flush_inner(true);
    }

    /// Issues what the step has recorded so far (its next part: from a graph when that
    /// part's list was seen before, eagerly otherwise) and goes on recording the rest, so
    /// that the GPU runs the first parts while the host records the last. Nothing when the
    /// step is not being recorded.
    pub(crate) fn flush_part(&self) {
        self.flush_inner(false);
    }

    fn flush_inner(&self, step_end: bool) {
        let mut rec = self.lock_recorder();
        if !rec.deferring {
            return;
        }
        let part = rec.part;
        if step_end {
            rec.deferring = false;
            rec.gemms = false;
            rec.part = 0;
        }
        if rec.pending.is_empty() {
            return;
        }
        if !step_end {
            rec.part += 1;
        }
        let pending = std::mem::take(&mut rec.pending);
        let count_step = |b: &CudaBackend| {
            if part == 0 {
                b.replays.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        };
        if let Some(i) = rec.graphs.iter().position(|(l, _)| *l == pending) {
            if let Err(e) = rec.graphs[i].1.0.launch() {
                self.fail(format!("launching a CUDA graph: {e:?}"));
            }
            count_step(self);
            rec.pending = pending;
            rec.pending.clear();
            return;
        }
        if rec.previous.get(part) == Some(&pending) {
            match self.capture(&pending) {
                Ok(graph) => {
                    if let Err(e) = graph.launch() {
                        self.fail(format!("launching a CUDA graph: {e:?}"));
                    }
                    rec.captures += 1;
                    count_step(self);
                    if rec.graphs.len() >= MAX_GRAPHS {
                        rec.graphs.remove(0);
                    }
                    rec.graphs.push((pending, StepGraph(graph)));
                    rec.previous[part].clear();
                    return;
                }
                Err(e) => {
                    // Run the step eagerly and stop trying.
                    self.graphs
                        .store(false, std::sync::atomic::Ordering::Relaxed);
                    self.fail(format!("capturing a CUDA graph: {e}"));
                }
            }
        }
        for l in &pending {
            self.launch_now(l);
        }
        if rec.previous.len() <= part {
            rec.previous.resize_with(part + 1, Vec::new);
        }
        rec.previous[part] = pending;
    }

    /// Captures `launches` on the stream into an instantiated graph.
    pub(crate) fn capture(&self, launches: &[Launch]) -> anyhow::Result<CudaGraph> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(|e| anyhow::anyhow!("begin capture: {e:?}"))?;
        for l in launches {
            self.launch_now(l);
        }
        let graph = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(|e| anyhow::anyhow!("end capture: {e:?}"))?;
        if let Some(msg) = self.lock_error().clone() {
            bail!("a launch failed during capture: {msg}");
        }
        graph.context("the capture produced no graph")
    }

    /// Waits for the queued work; returns the first error of any operation since the last
    /// check.
    pub fn check(&self) -> anyhow::Result<()> {
        self.flush();
        let sync = self.stream.synchronize();
        self.profile_collect();
        if let Some(msg) = self.lock_error().take() {
            bail!("CUDA: {msg}");
        }
        sync.map_err(|e| anyhow::anyhow!("CUDA: {e:?}"))?;
        self.ctx
            .check_err()
            .map_err(|e| anyhow::anyhow!("CUDA: {e:?}"))?;
        Ok(())
    }

    pub(crate) fn lock_error(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        // A poisoned lock still holds a usable Option.
        self.error.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn fail(&self, msg: String) {
        let mut e = self.lock_error();
        if e.is_none() {
            *e = Some(msg);
        }
    }

    pub(crate) fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _sync) = s.device_ptr(&self.stream);
        p
    }

    pub(crate) fn launch(
        &self,
        name: &'static str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) {
        self.launch_reading(name, grid, block, args, 0);
    }

    /// [`Self::launch`] of a kernel that streams `weight_bytes` of weights (the profiler
    /// reports its GB/s).
    pub(crate) fn launch_reading(
        &self,
        name: &'static str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
        weight_bytes: u64,
    ) {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return;
        }
        let Some(&func) = self.func_index.get(name) else {
            self.fail(format!("kernel {name} not loaded"));
            return;
        };
        self.enqueue(func, grid, block, args, weight_bytes);
    }

    /// Records (or issues) launch `func`, kernel or [special](SPECIAL_BASE).
    pub(crate) fn enqueue(
        &self,
        func: usize,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
        weight_bytes: u64,
    ) {
        // Any launch may write the rows a read-ahead copied: it no longer stands for them.
        self.read_ahead_valid
            .store(false, std::sync::atomic::Ordering::Relaxed);
        let l = Launch {
            func,
            grid,
            block,
            args: args.to_vec(),
            weight_bytes,
        };
        let mut rec = self.lock_recorder();
        if rec.deferring {
            rec.pending.push(l);
        } else {
            drop(rec);
            self.launch_now(&l);
        }
    }

    pub(crate) fn elementwise(&self, name: &'static str, len: usize, args: &[Arg]) {
        self.launch(name, grid_1d(len, 256), 256, args);
    }

    pub(crate) fn alloc<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        len: usize,
        what: &str,
    ) -> anyhow::Result<CudaSlice<T>> {
        self.stream
            .alloc_zeros::<T>(len.max(1))
            .map_err(|e| anyhow::anyhow!("allocating {what} ({len} elements) on the GPU: {e:?}"))
    }
}
