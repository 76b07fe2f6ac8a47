//! Kernel sources compiled with NVRTC for the device's architecture, cached on disk.

use std::path::{Path, PathBuf};

use anyhow::bail;
use cudarc::nvrtc::{CompileOptions, Ptx};
use sha2::{Digest, Sha256};

/// Every kernel, as one translation unit (the helpers first).
pub const SOURCE: &str = concat!(
    include_str!("../kernels/common.cuh"),
    "\n",
    include_str!("../kernels/quant.cu"),
    "\n",
    include_str!("../kernels/gemv.cu"),
    "\n",
    include_str!("../kernels/mmq.cu"),
    "\n",
    include_str!("../kernels/ops.cu"),
);

/// Names of the kernels the backend loads from the module.
pub const KERNELS: &[&str] = &[
    "embed",
    "matmul",
    "gemv",
    "gemv1",
    "gemv_dec",
    "gemv_dec_r1",
    "gemv_dec_r4",
    "quantize_x_q8",
    "gemv_q8",
    "gemv_q8_r1",
    "gemv_q8_t4",
    "gemv_q8_t8",
    "quantize_x_mmq",
    "rms_norm_mmq",
    "mmq_t8",
    "mmq_t16",
    "mmq_t32",
    "mmq_t64",
    "mmq_t8_gated",
    "mmq_t16_gated",
    "mmq_t32_gated",
    "mmq_t64_gated",
    "convert_x_mmh",
    "mmh_t8",
    "mmh_t16",
    "mmh_t32",
    "mmh_t64",
    "mmh_t8_gated",
    "mmh_t16_gated",
    "mmh_t32_gated",
    "mmh_t64_gated",
    "scale_f32",
    "add_f32",
    "add_bias",
    "gated_act",
    "rms_norm",
    "rms_norm_q8",
    "rope",
    "store_kv",
    "rope_store_kv",
    "attention",
    "attention_split",
    "attention_split_gqa",
    "attention_split_tiled64",
    "attention_split_tiled128",
    "attention_combine",
    "attention_prefill",
    "attention_prefill_mma64",
    "attention_prefill_mma128",
    "gather_rows",
    "argmax_rows",
    "dequant_f16",
    "f32_to_f16",
];

/// NVRTC's version, `(major, minor)`.
fn nvrtc_version() -> anyhow::Result<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters; the library was checked to be present.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if status != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        bail!("nvrtcVersion failed: {status:?}");
    }
    Ok((major, minor))
}

/// Folder of compiled kernels: `$KESTREL_HOME/cuda-cache`.
pub fn cache_dir() -> PathBuf {
    kestrel_hub::kestrel_home().join("cuda-cache")
}

/// Where the PTX of `SOURCE` for `arch` compiled by this NVRTC version is kept.
fn cache_path(dir: &Path, arch: &str, nvrtc: (i32, i32)) -> PathBuf {
    let mut h = Sha256::new();
    h.update(SOURCE.as_bytes());
    h.update([0]);
    h.update(arch.as_bytes());
    h.update([0]);
    h.update(format!("nvrtc {}.{}", nvrtc.0, nvrtc.1).as_bytes());
    let digest = h.finalize();
    let hex: String = digest[..12].iter().map(|b| format!("{b:02x}")).collect();
    dir.join(format!("kestrel-{arch}-{hex}.ptx"))
}

/// Whether the last `load` compiled or read the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Compiled,
    Cached,
}

/// The PTX of every kernel for `arch` (e.g. `sm_90`): from the disk cache, or compiled
/// with NVRTC and stored there.
pub fn load(arch: &str) -> anyhow::Result<(Ptx, Origin)> {
    // SAFETY: only probes whether the shared library can be opened.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        bail!(
            "NVRTC (libnvrtc) was not found; add the CUDA toolkit's lib folder \
             (e.g. /usr/local/cuda/lib64) to LD_LIBRARY_PATH"
        );
    }
    let version = nvrtc_version()?;
    let dir = cache_dir();
    let path = cache_path(&dir, arch, version);
    if let Ok(text) = std::fs::read_to_string(&path)
        && !text.is_empty()
    {
        return Ok((Ptx::from_src(text), Origin::Cached));
    }
    let mut include_paths = Vec::new();
    if Path::new("/usr/local/cuda/include").is_dir() {
        include_paths.push("/usr/local/cuda/include".to_string());
    }
    let opts = CompileOptions {
        include_paths,
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()],
        name: Some("kestrel.cu".into()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => {
            anyhow::anyhow!(
                "NVRTC failed to compile the kernels:\n{}",
                log.to_string_lossy()
            )
        }
        other => anyhow::anyhow!("NVRTC: {other:?}"),
    })?;
    let text = ptx.to_src();
    // The cache is an optimization: failing to write it is not an error.
    if std::fs::create_dir_all(&dir).is_ok() {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &text).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok((Ptx::from_src(text), Origin::Compiled))
}

/// `sm_XY` for a compute capability.
pub fn arch_name(major: i32, minor: i32) -> anyhow::Result<String> {
    if major < 6 {
        bail!("compute capability {major}.{minor} is too old (need 6.0 or newer)");
    }
    Ok(format!("sm_{major}{minor}"))
}
