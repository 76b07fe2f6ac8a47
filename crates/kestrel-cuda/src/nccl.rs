//! NCCL, loaded at run time like libcuda: the few entry points tensor parallelism uses
//! (communicators for the GPUs of this process, all-reduce, all-gather).
//!
//! cudarc's `nccl` module is not used: its loader looks for `libnccl.so`, `libnccl.so.13`,
//! `.12`, …, `.1` but never `libnccl.so.2`, the name every NCCL 2 release (and the
//! `nvidia-nccl` Python wheel, often the only copy on a GPU host) ships, and it panics
//! when none loads. Here the library is searched where the system's loader looks, then
//! in Python environments' `nvidia/nccl/lib`, and a missing library is an error.
//!
//! NVLink multicast (NVLS) is turned off before NCCL initializes (`NCCL_NVLS_ENABLE=0`,
//! whatever the environment said): on a shared host it can put the GPUs out of service.
//! Nothing here calls `cuMulticastCreate`.

use std::ffi::{c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

use anyhow::{Context, bail};

type RawComm = *mut c_void;
type Res = c_int;

/// `ncclFloat32` and `ncclSum`.
const NCCL_FLOAT32: c_int = 7;
const NCCL_SUM: c_int = 0;

struct Lib {
    _lib: libloading::Library,
    path: PathBuf,
    version: c_int,
    get_error_string: unsafe extern "C" fn(Res) -> *const c_char,
    comm_init_all: unsafe extern "C" fn(*mut RawComm, c_int, *const c_int) -> Res,
    comm_destroy: unsafe extern "C" fn(RawComm) -> Res,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        RawComm,
        *mut c_void,
    ) -> Res,
    all_gather:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, *mut c_void) -> Res,
}

/// The names to try, in order: the system loader's search (LD_LIBRARY_PATH, ldconfig),
/// then each Python environment's `nvidia/nccl/lib`, then CUDA installs.
fn candidates() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = vec!["libnccl.so.2".into(), "libnccl.so".into()];
    // The interpreter on PATH knows where its `nvidia-nccl` wheel is.
    for py in ["python3", "python"] {
        if let Ok(o) = std::process::Command::new(py)
            .args([
                "-c",
                "import nvidia.nccl as m, os; print(os.path.join(list(m.__path__)[0], 'lib'))",
            ])
            .stderr(std::process::Stdio::null())
            .output()
            && o.status.success()
        {
            let dir = String::from_utf8_lossy(&o.stdout).trim().to_string();
            if !dir.is_empty() {
                out.push(PathBuf::from(dir).join("libnccl.so.2"));
            }
        }
    }
    // The usual places of Python environments and CUDA installs.
    let mut roots: Vec<PathBuf> = vec!["/usr/local/lib".into(), "/usr/lib".into()];
    if let Ok(home) = std::env::var("HOME") {
        roots.push(PathBuf::from(home).join(".local/lib"));
    }
    for base in ["/opt", "/usr/local"] {
        if let Ok(dirs) = std::fs::read_dir(base) {
            for d in dirs.flatten() {
                roots.push(d.path().join(".venv/lib"));
                roots.push(d.path().join("lib"));
            }
        }
    }
    for root in roots {
        let Ok(dirs) = std::fs::read_dir(&root) else {
            continue;
        };
        for d in dirs.flatten() {
            if d.file_name().to_string_lossy().starts_with("python3") {
                for pkgs in ["site-packages", "dist-packages"] {
                    out.push(d.path().join(pkgs).join("nvidia/nccl/lib/libnccl.so.2"));
                }
            }
        }
    }
    for cuda in ["/usr/local/cuda/lib64", "/usr/lib/x86_64-linux-gnu"] {
        out.push(PathBuf::from(cuda).join("libnccl.so.2"));
    }
    out
}

/// The function `name` of `lib` as a `T` (a function pointer type).
///
/// SAFETY: `T` must be the symbol's C signature.
unsafe fn sym<T: Copy>(
    lib: &libloading::Library,
    path: &std::path::Path,
    name: &[u8],
) -> Result<T, String> {
    // SAFETY: per the caller.
    unsafe { lib.get::<T>(name) }
        .map(|s| *s)
        .map_err(|e| format!("{}: {e}", path.display()))
}

fn load() -> Result<Lib, String> {
    // Before NCCL reads its environment: multicast stays off, always.
    // SAFETY: set before libnccl is loaded; the backend's other threads do not read or
    // write the environment.
    unsafe { std::env::set_var("NCCL_NVLS_ENABLE", "0") };
    let tried = candidates();
    for path in &tried {
        if path.is_absolute() && !path.exists() {
            continue;
        }
        // SAFETY: loading NCCL runs its initializers, which only set up its globals.
        let Ok(lib) = (unsafe { libloading::Library::new(path) }) else {
            continue;
        };
        // SAFETY: the symbols have these C signatures in every NCCL 2 release (nccl.h).
        let lib = unsafe {
            let get_version: unsafe extern "C" fn(*mut c_int) -> Res =
                sym(&lib, path, b"ncclGetVersion")?;
            let mut version = 0;
            get_version(&mut version);
            Lib {
                get_error_string: sym(&lib, path, b"ncclGetErrorString")?,
                comm_init_all: sym(&lib, path, b"ncclCommInitAll")?,
                comm_destroy: sym(&lib, path, b"ncclCommDestroy")?,
                all_reduce: sym(&lib, path, b"ncclAllReduce")?,
                all_gather: sym(&lib, path, b"ncclAllGather")?,
                version,
                path: path.clone(),
                _lib: lib,
            }
        };
        return Ok(lib);
    }
    Err(format!(
        "NCCL was not found (libnccl.so.2; it comes with the CUDA toolkit's NCCL package or Python's nvidia-nccl-cu12/cu13 wheel): tried {}",
        tried
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

fn lib() -> anyhow::Result<&'static Lib> {
    static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();
    LIB.get_or_init(load)
        .as_ref()
        .map_err(|e| anyhow::anyhow!("{e}"))
}

/// Where NCCL was loaded from and its version (`2.27.3`), loading it if needed.
pub fn describe() -> anyhow::Result<String> {
    let l = lib()?;
    let v = l.version;
    let (major, minor, patch) = if v >= 10000 {
        (v / 10000, v / 100 % 100, v % 100)
    } else {
        (v / 1000, v / 100 % 10, v % 100)
    };
    Ok(format!(
        "NCCL {major}.{minor}.{patch} ({})",
        l.path.display()
    ))
}

fn check(r: Res, what: &str) -> anyhow::Result<()> {
    if r == 0 {
        return Ok(());
    }
    let msg = lib()
        .ok()
        .map(|l| {
            // SAFETY: NCCL returns a static string for every result code.
            let p = unsafe { (l.get_error_string)(r) };
            if p.is_null() {
                String::new()
            } else {
                // SAFETY: non-null, NUL-terminated, static.
                unsafe { std::ffi::CStr::from_ptr(p) }
                    .to_string_lossy()
                    .into_owned()
            }
        })
        .unwrap_or_default();
    bail!("NCCL {what}: error {r} ({msg})")
}

/// One rank's communicator.
pub struct Comm {
    raw: RawComm,
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time; each rank's is
// only used by the thread driving that rank.
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl Drop for Comm {
    fn drop(&mut self) {
        if let Ok(l) = lib() {
            // SAFETY: the communicator is live and no operation on it is in flight (the
            // owning backend synchronizes its stream before dropping).
            unsafe { (l.comm_destroy)(self.raw) };
        }
    }
}

/// Communicators for the CUDA devices `ordinals` (rank i on `ordinals[i]`), made in one
/// call from this thread.
pub fn comms(ordinals: &[usize]) -> anyhow::Result<Vec<Comm>> {
    let l = lib()?;
    let devs: Vec<c_int> = ordinals.iter().map(|&o| o as c_int).collect();
    let mut raw: Vec<RawComm> = vec![std::ptr::null_mut(); devs.len()];
    // SAFETY: `raw` has room for one communicator per device.
    check(
        unsafe { (l.comm_init_all)(raw.as_mut_ptr(), devs.len() as c_int, devs.as_ptr()) },
        "initializing the communicators",
    )
    .with_context(|| format!("devices {ordinals:?}"))?;
    Ok(raw.into_iter().map(|raw| Comm { raw }).collect())
}

impl Comm {
    /// In-place sum of `count` f32 at `ptr` over all ranks, queued on `stream`.
    pub(crate) fn all_reduce_sum(
        &self,
        ptr: u64,
        count: usize,
        stream: *mut c_void,
    ) -> anyhow::Result<()> {
        let l = lib()?;
        // SAFETY: `ptr` holds `count` f32 on this rank's device, alive until the stream
        // has run the operation (the backend's buffers live as long as it does).
        check(
            unsafe {
                (l.all_reduce)(
                    ptr as *const c_void,
                    ptr as *mut c_void,
                    count,
                    NCCL_FLOAT32,
                    NCCL_SUM,
                    self.raw,
                    stream,
                )
            },
            "all-reduce",
        )
    }

    /// Every rank's `count` f32 at `send`, concatenated in rank order at `recv`.
    pub(crate) fn all_gather(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        stream: *mut c_void,
    ) -> anyhow::Result<()> {
        let l = lib()?;
        // SAFETY: `send` holds `count` f32 and `recv` ranks × `count`, on this device.
        check(
            unsafe {
                (l.all_gather)(
                    send as *const c_void,
                    recv as *mut c_void,
                    count,
                    NCCL_FLOAT32,
                    self.raw,
                    stream,
                )
            },
            "all-gather",
        )
    }
}
