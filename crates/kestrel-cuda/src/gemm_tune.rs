//! cuBLASLt algorithms for the f16 products, chosen per product shape by timing (opt-in:
//! `KESTREL_CUDA_GEMM_TUNE=1`, or `print` to show each shape's timings).
//!
//! `cublasGemmEx` takes its heuristic's first algorithm. On the H100 that is not always the
//! fastest for the skinny products of batched decode (64 tokens: the down projection 48.0
//! against 44.8 µs for another of the heuristic's candidates, the LM head 395 against 382;
//! `scripts/cublaslt_search.py`, fourteenth session). With tuning on, the first product of
//! each shape times the candidates (and `cublasGemmEx`) on the real operands into a scratch
//! output, keeps the fastest, and later products of that shape run it directly.
//! Measured: `bench --seqs 64 --argmax` +2.5% and pp512 +1.5% in one call, no gain in
//! another; `kestrel serve` at 64 clients −8 to −18% (each newly timed shape stalls its
//! first step; a short run pays them all). Hence off by default; the self-check forces the
//! cuBLASLt path on its cuBLAS cases either way.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::sys as lt;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, sys};

/// Workspace offered to the candidates (split-K algorithms need some).
const WORKSPACE: usize = 32 << 20;
/// Candidates asked of the heuristic.
const CANDIDATES: usize = 16;
/// Timed calls per candidate (after two to warm up).
const TIMED_CALLS: usize = 5;
/// Largest scratch output a shape is timed into; larger products keep `cublasGemmEx`.
const MAX_SCRATCH: usize = 64 << 20;

/// One product shape: rows × cols weights (row-major f16) times n tokens, outputs with
/// leading dimension ld.
#[derive(Clone, Copy, Hash, PartialEq, Eq, Debug)]
pub struct Shape {
    pub rows: usize,
    pub cols: usize,
    pub n: usize,
    pub ld: usize,
}

/// A chosen cuBLASLt algorithm with the descriptors it runs with.
struct Plan {
    desc: lt::cublasLtMatmulDesc_t,
    a: lt::cublasLtMatrixLayout_t,
    b: lt::cublasLtMatrixLayout_t,
    c: lt::cublasLtMatrixLayout_t,
    algo: lt::cublasLtMatmulAlgo_t,
    workspace: usize,
}

// SAFETY: the descriptors are plain host objects, only used under the tuner's mutex.
unsafe impl Send for Plan {}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created by `Tuner::plan`, destroyed once.
        unsafe {
            lt::cublasLtMatmulDescDestroy(self.desc);
            lt::cublasLtMatrixLayoutDestroy(self.a);
            lt::cublasLtMatrixLayoutDestroy(self.b);
            lt::cublasLtMatrixLayoutDestroy(self.c);
        }
    }
}

pub struct Tuner {
    handle: lt::cublasLtHandle_t,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    /// Allocated with the first timed shape (tuning is off by default: no GPU memory then).
    workspace: std::sync::OnceLock<CudaSlice<u8>>,
    /// By shape and whether a candidate was forced: None when `cublasGemmEx` was fastest
    /// (or the shape was not timed).
    plans: Mutex<HashMap<(Shape, bool), Option<Plan>>>,
    /// Take the fastest candidate even where `cublasGemmEx` is faster (the self-check's
    /// way to run the cuBLASLt path on small products).
    force: std::sync::atomic::AtomicBool,
    /// `KESTREL_CUDA_GEMM_TUNE=print`: each shape's timings on stderr.
    verbose: bool,
    /// `KESTREL_CUDA_GEMM_TUNE=1` or `print`: time shapes (otherwise only forced runs use
    /// cuBLASLt).
    enabled: bool,
}

// SAFETY: the handle is used only with `stream`; plans under the mutex.
unsafe impl Send for Tuner {}
unsafe impl Sync for Tuner {}

impl Drop for Tuner {
    fn drop(&mut self) {
        self.plans.lock().unwrap_or_else(|e| e.into_inner()).clear();
        // SAFETY: created in `new`, destroyed once.
        unsafe {
            lt::cublasLtDestroy(self.handle);
        }
    }
}

fn ok(status: lt::cublasStatus_t, what: &str) -> anyhow::Result<()> {
    if status == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        anyhow::bail!("cuBLASLt {what}: {status:?}")
    }
}

impl Tuner {
    /// None when cuBLASLt is missing.
    pub fn new(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>) -> Option<Tuner> {
        // SAFETY: only probes whether the shared library can be opened.
        if !unsafe { lt::is_culib_present() } {
            return None;
        }
        let mode = std::env::var("KESTREL_CUDA_GEMM_TUNE").unwrap_or_default();
        let mut handle = std::ptr::null_mut();
        // SAFETY: an out-pointer for the new handle.
        ok(unsafe { lt::cublasLtCreate(&mut handle) }, "create").ok()?;
        Some(Tuner {
            handle,
            stream: stream.clone(),
            ctx: ctx.clone(),
            workspace: Default::default(),
            plans: Mutex::new(HashMap::new()),
            force: Default::default(),
            verbose: mode == "print",
            enabled: mode == "1" || mode == "print",
        })
    }

    /// out (n rows of ld floats) = x · aᵀ (+ out with `accumulate`) by the shape's chosen
    /// cuBLASLt algorithm; false when `cublasGemmEx` should run it instead (fastest, or
    /// untimed). Times the shape first if it is new: call only outside graph recording.
    pub fn run(
        &self,
        blas: &cudarc::cublas::CudaBlas,
        s: Shape,
        a: u64,
        x: u64,
        out: u64,
        accumulate: bool,
    ) -> bool {
        let force = self.force.load(std::sync::atomic::Ordering::Relaxed);
        if !(self.enabled || force) {
            return false;
        }
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        let plan = plans.entry((s, force)).or_insert_with(|| {
            self.tune(blas, s, a, x, force).unwrap_or_else(|e| {
                eprintln!("timing cuBLASLt algorithms for {s:?}: {e:#}; using cublasGemmEx");
                None
            })
        });
        match plan {
            Some(p) => self.matmul(p, a, x, out, accumulate).is_ok(),
            None => false,
        }
    }

    /// Whether new shapes take the fastest candidate even where `cublasGemmEx` is faster.
    pub fn set_force(&self, force: bool) {
        self.force
            .store(force, std::sync::atomic::Ordering::Relaxed);
    }

    fn matmul(&self, p: &Plan, a: u64, x: u64, out: u64, accumulate: bool) -> anyhow::Result<()> {
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        let Some(workspace) = self.workspace.get() else {
            anyhow::bail!("cuBLASLt matmul before any shape was timed");
        };
        let (ws, _guard) = workspace.device_ptr(&self.stream);
        // SAFETY: the operands hold the shape's elements (checked by gemm_f16_raw's callers);
        // the plan's layouts describe them; the workspace holds `WORKSPACE` bytes.
        ok(
            unsafe {
                lt::cublasLtMatmul(
                    self.handle,
                    p.desc,
                    (&alpha as *const f32).cast(),
                    a as *const _,
                    p.a,
                    x as *const _,
                    p.b,
                    (&beta as *const f32).cast(),
                    out as *const _,
                    p.c,
                    out as *mut _,
                    p.c,
                    &p.algo,
                    ws as *mut _,
                    p.workspace,
                    self.stream.cu_stream() as _,
                )
            },
            "matmul",
        )
    }

    /// Descriptors of shape `s` (C = Aᵀ·B column-major: A cols × rows, B cols × n, C rows ×
    /// n with ld) with no algorithm yet.
    fn plan(&self, s: Shape) -> anyhow::Result<Plan> {
        let mut p = Plan {
            desc: std::ptr::null_mut(),
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            c: std::ptr::null_mut(),
            // SAFETY: plain data, filled in by the caller before use.
            algo: unsafe { std::mem::zeroed() },
            workspace: 0,
        };
        // SAFETY: out-pointers for new descriptors; attribute buffers of their sizes.
        unsafe {
            ok(
                lt::cublasLtMatmulDescCreate(
                    &mut p.desc,
                    lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    lt::cudaDataType::CUDA_R_32F,
                ),
                "descriptor",
            )?;
            let (t, n) = (
                cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T,
                cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N,
            );
            for (attr, op) in [
                (
                    lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                    &t,
                ),
                (
                    lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                    &n,
                ),
            ] {
                ok(
                    lt::cublasLtMatmulDescSetAttribute(
                        p.desc,
                        attr,
                        (op as *const cudarc::cublas::sys::cublasOperation_t).cast(),
                        std::mem::size_of::<cudarc::cublas::sys::cublasOperation_t>(),
                    ),
                    "transpose attribute",
                )?;
            }
            let f16 = lt::cudaDataType::CUDA_R_16F;
            let (r, c, n, ld) = (s.rows as u64, s.cols as u64, s.n as u64, s.ld as i64);
            ok(
                lt::cublasLtMatrixLayoutCreate(&mut p.a, f16, c, r, c as i64),
                "layout",
            )?;
            ok(
                lt::cublasLtMatrixLayoutCreate(&mut p.b, f16, c, n, c as i64),
                "layout",
            )?;
            ok(
                lt::cublasLtMatrixLayoutCreate(&mut p.c, lt::cudaDataType::CUDA_R_32F, r, n, ld),
                "layout",
            )?;
        }
        Ok(p)
    }

    /// Whether a product of `n` tokens is worth timing: powers of two from 64 (full
    /// 64-sequence decode steps, where the gain was measured, and power-of-two prompt
    /// chunks such as pp512's). Every timed shape stalls its first step (~5–40 ms); timing
    /// each batch size a server passes through (1–64) cost more than it gained: 64 clients
    /// 2,835 against 3,477 generated t/s without timing, ITL p99 65 against 39 ms.
    fn worth_timing(n: usize) -> bool {
        n >= 64 && n.is_power_of_two()
    }

    /// The fastest of the heuristic's candidates for `s` on operands a, x, or None when
    /// `cublasGemmEx` (timed too) is at least as fast and `force` is not set.
    fn tune(
        &self,
        blas: &cudarc::cublas::CudaBlas,
        s: Shape,
        a: u64,
        x: u64,
        force: bool,
    ) -> anyhow::Result<Option<Plan>> {
        let scratch_len = s.n * s.ld;
        if scratch_len * 4 > MAX_SCRATCH || !(force || Self::worth_timing(s.n)) {
            return Ok(None);
        }
        if self.workspace.get().is_none() {
            let workspace = self
                .stream
                .alloc_zeros::<u8>(WORKSPACE)
                .map_err(|e| anyhow::anyhow!("workspace: {e:?}"))?;
            // Only `run` calls this, under the plans' mutex: set once.
            let _ = self.workspace.set(workspace);
        }
        let mut plan = self.plan(s)?;
        let mut pref = std::ptr::null_mut();
        let mut found: Vec<lt::cublasLtMatmulHeuristicResult_t> =
            // SAFETY: plain data, written by the heuristic below.
            vec![unsafe { std::mem::zeroed() }; CANDIDATES];
        let mut count = 0;
        // SAFETY: out-pointers; `found` holds CANDIDATES results.
        unsafe {
            ok(lt::cublasLtMatmulPreferenceCreate(&mut pref), "preference")?;
            let ws = WORKSPACE as u64;
            let set = lt::cublasLtMatmulPreferenceSetAttribute(
                pref,
                lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws as *const u64).cast(),
                8,
            );
            let heuristic = lt::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                plan.desc,
                plan.a,
                plan.b,
                plan.c,
                plan.c,
                pref,
                CANDIDATES as i32,
                found.as_mut_ptr(),
                &mut count,
            );
            lt::cublasLtMatmulPreferenceDestroy(pref);
            ok(set, "workspace preference")?;
            ok(heuristic, "heuristic")?;
        }
        let scratch = self
            .stream
            .alloc_zeros::<f32>(scratch_len)
            .map_err(|e| anyhow::anyhow!("scratch output: {e:?}"))?;
        let out = {
            let (p, _guard) = scratch.device_ptr(&self.stream);
            p
        };
        let mut best: Option<(f64, usize)> = None;
        for (i, cand) in found[..count.max(0) as usize].iter().enumerate() {
            if cand.state != lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                || cand.workspaceSize > WORKSPACE
            {
                continue;
            }
            plan.algo = cand.algo;
            plan.workspace = cand.workspaceSize;
            let Ok(us) = self.time(|| self.matmul(&plan, a, x, out, false)) else {
                continue;
            };
            if best.is_none_or(|(b, _)| us < b) {
                best = Some((us, i));
            }
        }
        let gemm_ex = self.time(|| gemm_ex_raw(blas, s, a, x, out, false))?;
        drop(scratch);
        match best {
            // Keep cublasGemmEx unless a candidate beats it by more than the timing noise.
            Some((us, i)) if us < gemm_ex * 0.98 || force => {
                if self.verbose {
                    eprintln!(
                        "cuBLASLt for {s:?}: candidate {i} {us:.1} µs against cublasGemmEx {gemm_ex:.1}"
                    );
                }
                plan.algo = found[i].algo;
                plan.workspace = found[i].workspaceSize;
                Ok(Some(plan))
            }
            _ => {
                if self.verbose {
                    eprintln!(
                        "cuBLASLt for {s:?}: cublasGemmEx {gemm_ex:.1} µs, best candidate {best:?}"
                    );
                }
                Ok(None)
            }
        }
    }

    /// Microseconds per call of `f` (two calls to warm up, then TIMED_CALLS timed by events).
    fn time(&self, f: impl Fn() -> anyhow::Result<()>) -> anyhow::Result<f64> {
        let event = || {
            self.ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| anyhow::anyhow!("event: {e:?}"))
        };
        let (start, end) = (event()?, event()?);
        f()?;
        f()?;
        start
            .record(&self.stream)
            .map_err(|e| anyhow::anyhow!("event: {e:?}"))?;
        for _ in 0..TIMED_CALLS {
            f()?;
        }
        end.record(&self.stream)
            .map_err(|e| anyhow::anyhow!("event: {e:?}"))?;
        end.synchronize()
            .map_err(|e| anyhow::anyhow!("timing: {e:?}"))?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(|e| anyhow::anyhow!("timing: {e:?}"))?;
        Ok(ms as f64 * 1000.0 / TIMED_CALLS as f64)
    }
}

/// `cublasGemmEx`: out (n × ld, column-major rows × n) = aᵀ · x (+ out with accumulate).
pub fn gemm_ex_raw(
    blas: &cudarc::cublas::CudaBlas,
    s: Shape,
    a: u64,
    x: u64,
    out: u64,
    accumulate: bool,
) -> anyhow::Result<()> {
    use cudarc::cublas::sys::{
        cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType,
    };
    let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
    // SAFETY: a, x and out hold rows×cols, n×cols and n×ld elements (checked by the
    // callers); the handle is bound to the backend's stream.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            s.rows as i32,
            s.n as i32,
            s.cols as i32,
            (&alpha as *const f32).cast(),
            a as *const std::ffi::c_void,
            cudaDataType::CUDA_R_16F,
            s.cols as i32,
            x as *const std::ffi::c_void,
            cudaDataType::CUDA_R_16F,
            s.cols as i32,
            (&beta as *const f32).cast(),
            out as *mut std::ffi::c_void,
            cudaDataType::CUDA_R_32F,
            s.ld as i32,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| anyhow::anyhow!("{e:?}"))
}
