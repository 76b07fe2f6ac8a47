//! Kernel sources compiled with NVRTC for the device's architecture, cached on disk.

use std::path::{Path, PathBuf};

use anyhow::bail;
use cudarc::nvrtc::Ptx;
use sha2::{Digest, Sha256};

/// Every kernel, as one translation unit (the helpers first).
pub const SOURCE: &str = concat!(
    include_str!("../kernels/common.cuh"),
    "\n",
    include_str!("../kernels/quant.cu"),
    "\n",
    include_str!("../kernels/gemv.cu"),
    "\n",
    include_str!("../kernels/moe.cu"),
    "\n",
    include_str!("../kernels/mmq.cu"),
    "\n",
    include_str!("../kernels/moe_mma.cu"),
    "\n",
    include_str!("../kernels/elementwise.cu"),
    "\n",
    include_str!("../kernels/norm_rope.cu"),
    "\n",
    include_str!("../kernels/attention.cu"),
    "\n",
    include_str!("../kernels/argmax.cu"),
    "\n",
    include_str!("../kernels/mmw.cu"),
    "\n",
    include_str!("../kernels/sample.cu"),
    "\n",
    include_str!("../kernels/peer.cu"),
    "\n",
    include_str!("../kernels/delta.cu"),
);

/// Names of the kernels the backend loads from the module: each family's list, declared
/// beside its launcher.
pub fn kernels() -> impl Iterator<Item = &'static str> {
    [
        crate::matmul::KERNELS,
        crate::matmul::gemv::KERNELS,
        crate::matmul::mmq::KERNELS,
        crate::matmul::mmw::KERNELS,
        crate::matmul::cublas::KERNELS,
        crate::weights::KERNELS,
        crate::norm_rope::KERNELS,
        crate::attention::KERNELS,
        crate::step::KERNELS,
        crate::sample::KERNELS,
        crate::delta::KERNELS,
        crate::moe::KERNELS,
        crate::tp::KERNELS,
        crate::moe_mma::KERNELS,
        crate::split::KERNELS,
    ]
    .into_iter()
    .flatten()
    .copied()
}

/// Folder of compiled kernels: `$KESTREL_HOME/cuda-cache`, where `KESTREL_HOME` defaults to
/// `~/.cache/kestrel` (the rule of `kestrel_hub::kestrel_home`, restated here so that the
/// backend does not depend on the hub crate).
pub fn cache_dir() -> PathBuf {
    let home = match std::env::var_os("KESTREL_HOME").filter(|v| !v.is_empty()) {
        Some(home) => PathBuf::from(home),
        None => match std::env::var_os("HOME").filter(|v| !v.is_empty()) {
            Some(home) => PathBuf::from(home).join(".cache").join("kestrel"),
            None => std::env::temp_dir().join("kestrel"),
        },
    };
    home.join("cuda-cache")
}

/// Where the machine code of `SOURCE` for `arch` is kept. The key is the source and the
/// architecture only: a cubin for `sm_90` from any NVRTC of the driver's major version loads,
/// so one compiled elsewhere (`scripts/kernel_check.py --cubin`, for the GPU host) is used
/// as it is.
pub fn cache_path(dir: &Path, arch: &str) -> PathBuf {
    let mut h = Sha256::new();
    h.update(SOURCE.as_bytes());
    h.update([0]);
    h.update(arch.as_bytes());
    let digest = h.finalize();
    let hex: String = digest[..12].iter().map(|b| format!("{b:02x}")).collect();
    dir.join(format!("kestrel-{arch}-{hex}.cubin"))
}

/// Whether the last `load` compiled or read the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Compiled,
    Cached,
}

/// The machine code of every kernel for `arch` (e.g. `sm_90`): from the disk cache, or
/// compiled with NVRTC and stored there.
pub fn load(arch: &str) -> anyhow::Result<(Ptx, Origin)> {
    let path = cache_path(&cache_dir(), arch);
    if let Ok(bytes) = std::fs::read(&path)
        && !bytes.is_empty()
    {
        return Ok((Ptx::from_binary(bytes), Origin::Cached));
    }
    Ok((compile(arch)?, Origin::Compiled))
}

/// Drops the cached machine code for `arch` (one the driver refused to load).
pub fn forget(arch: &str) {
    let _ = std::fs::remove_file(cache_path(&cache_dir(), arch));
}

/// Compiles `SOURCE` to a cubin for `arch` with NVRTC and stores it in the cache.
pub fn compile(arch: &str) -> anyhow::Result<Ptx> {
    use cudarc::nvrtc::{result, sys};
    // SAFETY: only probes whether the shared library can be opened.
    if !unsafe { sys::is_culib_present() } {
        bail!(
            "NVRTC (libnvrtc) was not found; add the CUDA toolkit's lib folder \
             (e.g. /usr/local/cuda/lib64) to LD_LIBRARY_PATH"
        );
    }
    let mut options = vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()];
    if Path::new("/usr/local/cuda/include").is_dir() {
        options.push("--include-path=/usr/local/cuda/include".into());
    }
    let src = std::ffi::CString::new(SOURCE).expect("kernel source has no NUL");
    let name = c"kestrel.cu";
    let prog = result::create_program(&src, Some(name))
        .map_err(|e| anyhow::anyhow!("NVRTC: creating the program: {e:?}"))?;
    // SAFETY: `prog` was just created and is destroyed once below; `src` and `name` outlive it.
    let compiled = unsafe {
        let out = match result::compile_program(prog, &options) {
            Ok(()) => cubin_of(prog),
            Err(e) => {
                let log = result::get_program_log(prog)
                    .map(|l| {
                        std::ffi::CStr::from_ptr(l.as_ptr())
                            .to_string_lossy()
                            .into_owned()
                    })
                    .unwrap_or_default();
                Err(anyhow::anyhow!(
                    "NVRTC failed to compile the kernels ({e:?}):\n{log}"
                ))
            }
        };
        let _ = result::destroy_program(prog);
        out
    }?;
    // The cache is an optimization: failing to write it is not an error.
    let path = cache_path(&cache_dir(), arch);
    if let Some(dir) = path.parent()
        && std::fs::create_dir_all(dir).is_ok()
    {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &compiled).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(Ptx::from_binary(compiled))
}

/// The cubin of a compiled program.
///
/// # Safety
/// `prog` must be a compiled, not yet destroyed NVRTC program.
unsafe fn cubin_of(prog: cudarc::nvrtc::sys::nvrtcProgram) -> anyhow::Result<Vec<u8>> {
    use cudarc::nvrtc::sys;
    let mut size = 0usize;
    // SAFETY: as the caller promises; the buffer has the size NVRTC reported.
    unsafe {
        let r = sys::nvrtcGetCUBINSize(prog, &mut size);
        if r != sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
            bail!("NVRTC gave no cubin ({r:?}): is the architecture a real one (sm_XY)?");
        }
        let mut bytes = vec![0u8; size];
        let r = sys::nvrtcGetCUBIN(prog, bytes.as_mut_ptr().cast());
        if r != sys::nvrtcResult::NVRTC_SUCCESS {
            bail!("nvrtcGetCUBIN failed: {r:?}");
        }
        Ok(bytes)
    }
}

/// `sm_XY` for a compute capability.
pub fn arch_name(major: i32, minor: i32) -> anyhow::Result<String> {
    if major < 6 {
        bail!("compute capability {major}.{minor} is too old (need 6.0 or newer)");
    }
    Ok(format!("sm_{major}{minor}"))
}

#[cfg(test)]
mod tests {
    /// NVRTC 13.0 (the GPU host's) compiles a generic lambda's call operator as a host
    /// function and fails the whole program, while newer NVRTCs accept it: kernels must
    /// spell out their lambdas' parameter types.
    #[test]
    fn kernels_have_no_generic_lambdas() {
        for (n, line) in super::SOURCE.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            assert!(
                !(code.contains("](auto") || code.contains("] (auto")),
                "kernel source line {}: a generic lambda: {line}",
                n + 1
            );
        }
    }

    /// No two modules declare the same kernel, and every declared name is in the source (the
    /// module loader then finds it, or `CudaBackend::new` says which is missing;
    /// `scripts/kernel_check.py` lists what the source defines).
    #[test]
    fn declared_kernels_are_unique_and_in_the_source() {
        let names: Vec<&str> = super::kernels().collect();
        let mut sorted = names.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len(), "a kernel declared twice");
        for name in names {
            // (attention_prefill_mma64 / 128 and their `_q` forms are pasted by a macro:
            // attention_prefill_mma##HD, attention_prefill_mma##HD##_q.)
            let (base, suffix) =
                name.split_at(name.strip_suffix("_q").map_or(name.len(), str::len));
            let stem = base.trim_end_matches(|c: char| c.is_ascii_digit());
            let pasted = if suffix.is_empty() {
                format!("{stem}##")
            } else {
                format!("{stem}##HD##{suffix}")
            };
            assert!(
                super::SOURCE.contains(name) || (stem != base && super::SOURCE.contains(&pasted)),
                "kernel {name} is not in the source"
            );
        }
    }
}
