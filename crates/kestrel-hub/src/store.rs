//! What is cached: `kestrel list` and `kestrel rm`.
//!
//! Models live in two places: [`crate::models_dir()`] holds the catalog's models and those
//! pulled from URLs (`NAME.gguf`, with `NAME.gguf.source` naming the URL), and the Hugging
//! Face cache holds those pulled by `ORG/REPO[:QUANT]` (the snapshot `refs/main` points to).

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use hf_hub::Repo;

use crate::hf::{self, HfSpec};
use crate::{catalog, check_local_name, marker_path, partial_path, source_path};

/// Where a cached model came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    Catalog,
    Url(String),
    HuggingFace,
}

impl std::fmt::Display for ModelSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModelSource::Catalog => f.write_str("catalog"),
            ModelSource::Url(url) => f.write_str(url),
            ModelSource::HuggingFace => f.write_str("hugging face"),
        }
    }
}

/// One cached model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredModel {
    /// The name that finds it again (`-m NAME`).
    pub name: String,
    /// Its file (the first part, for a split model).
    pub path: PathBuf,
    /// Bytes of all its files.
    pub size: u64,
    pub source: ModelSource,
}

/// Every model in `models_dir` and in the Hugging Face cache `hf_cache`, by name.
pub fn list_models(models_dir: &Path, hf_cache: &Path) -> Vec<StoredModel> {
    let mut models = Vec::new();
    for entry in read_dir_sorted(models_dir) {
        let name = entry.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let Some(stem) = name.strip_suffix(".gguf") else {
            continue;
        };
        let source = if catalog::find(stem).is_some() {
            ModelSource::Catalog
        } else {
            match fs::read_to_string(source_path(&entry)) {
                Ok(url) => ModelSource::Url(url.trim().to_string()),
                // Placed there by hand: still usable by name.
                Err(_) => ModelSource::Url("(unknown)".into()),
            }
        };
        models.push(StoredModel {
            name: stem.to_string(),
            size: file_size(&entry),
            path: entry,
            source,
        });
    }
    for repo_dir in read_dir_sorted(hf_cache) {
        let Some(repo) = repo_dir
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("models--"))
            .and_then(|n| n.split_once("--"))
            .map(|(org, name)| format!("{org}/{name}"))
        else {
            continue;
        };
        let Ok(commit) = fs::read_to_string(repo_dir.join("refs/main")) else {
            continue;
        };
        let snapshot = repo_dir.join("snapshots").join(commit.trim());
        let files: Vec<PathBuf> = read_dir_sorted(&snapshot);
        for file in &files {
            let Some(name) = file.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            let Some(quant) = hf::quant_label(name) else {
                continue;
            };
            let spec = format!("{repo}:{quant}");
            // Only names that find this very file (the first part, for a split model).
            if HfSpec::parse(&spec)
                .and_then(|s| hf::cached(&s, hf_cache))
                .as_deref()
                != Some(file.as_path())
            {
                continue;
            }
            let parts = hf::parts_of(&snapshot, name);
            models.push(StoredModel {
                name: spec,
                path: file.clone(),
                size: parts.iter().map(|p| file_size(p)).sum(),
                source: ModelSource::HuggingFace,
            });
        }
    }
    models
}

/// Removes a cached model by the name [`list_models`] gives it; returns the files removed.
pub fn remove_model(name: &str, models_dir: &Path, hf_cache: &Path) -> Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    let mut remove = |path: &Path| {
        if fs::remove_file(path).is_ok() {
            removed.push(path.to_path_buf());
        }
    };
    if catalog::find(name).is_some() || check_local_name(name).is_ok() {
        let file = models_dir.join(format!("{name}.gguf"));
        if !file.is_file() {
            bail!("no model '{name}' in {}", models_dir.display());
        }
        for path in [
            file.clone(),
            marker_path(&file),
            source_path(&file),
            partial_path(&file),
        ] {
            remove(&path);
        }
        return Ok(removed);
    }
    let Some(spec) = HfSpec::parse(name) else {
        bail!("no model '{name}': not a catalog name, a pulled model's name nor ORG/REPO:QUANT");
    };
    let Some(first) = hf::cached(&spec, hf_cache) else {
        bail!("no model '{name}' in {}", hf_cache.display());
    };
    let snapshot = first.parent().map(Path::to_path_buf).unwrap_or_default();
    let first_name = first.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let repo_dir = hf_cache.join(Repo::model(spec.repo.clone()).folder_name());
    let blobs = repo_dir.join("blobs").canonicalize().ok();
    for pointer in hf::parts_of(&snapshot, first_name) {
        // The blob goes too, if it is this cache's (never a file the link points elsewhere).
        if let (Ok(blob), Some(blobs)) = (pointer.canonicalize(), &blobs)
            && blob.starts_with(blobs)
        {
            remove(&blob);
        }
        remove(&pointer);
    }
    Ok(removed)
}

fn read_dir_sorted(dir: &Path) -> Vec<PathBuf> {
    let mut paths: Vec<PathBuf> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .collect();
    paths.sort();
    paths
}

fn file_size(path: &Path) -> u64 {
    fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}
