//! A Hugging Face checkpoint folder: `config.json` and the weights in one or more
//! `.safetensors` files (sharded ones listed by `model.safetensors.index.json`), memory-mapped.
//!
//! The safetensors headers are parsed and checked by the `safetensors` crate (offsets inside
//! the file, sizes matching shapes and dtypes), so a hostile header is an error, not a panic.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

/// One tensor of the checkpoint: where its bytes are and how to read them.
#[derive(Debug, Clone)]
pub struct TensorRef {
    /// Index of the file in [`Checkpoint::files`].
    file: usize,
    /// Byte range in the memory map.
    start: usize,
    end: usize,
    pub dtype: Dtype,
    /// PyTorch order: the last dimension is the row length.
    pub shape: Vec<usize>,
}

/// A checkpoint folder, its weight files mapped.
pub struct Checkpoint {
    pub dir: PathBuf,
    /// `config.json` (for multimodal wrappers, merged with its `text_config`).
    pub config: Value,
    maps: Vec<Mmap>,
    /// Every tensor by name, sorted.
    pub tensors: BTreeMap<String, TensorRef>,
}

/// Reads a JSON file of the folder; `None` if it does not exist.
pub fn read_json(dir: &Path, name: &str) -> Result<Option<Value>> {
    let path = dir.join(name);
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    Ok(Some(value))
}

/// `config.json` (for multimodal wrappers, merged with its `text_config`).
pub fn read_config(dir: &Path) -> Result<Value> {
    if !dir.is_dir() {
        bail!("{} is not a folder", dir.display());
    }
    let mut config = read_json(dir, "config.json")?
        .with_context(|| format!("{} has no config.json", dir.display()))?;
    if !config.is_object() {
        bail!("config.json is not a JSON object");
    }
    // Multimodal checkpoints keep the language model's settings in `text_config`.
    if let Some(Value::Object(text)) = config.get("text_config").cloned()
        && let Value::Object(top) = &mut config
    {
        for (k, v) in text {
            top.insert(k, v);
        }
    }
    Ok(config)
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let config = read_config(dir)?;
        let files = weight_files(dir)?;
        let mut maps = Vec::new();
        let mut tensors = BTreeMap::new();
        for (i, path) in files.iter().enumerate() {
            let file =
                File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
            // SAFETY: the map is read-only; a checkpoint changed by another process while we
            // convert it gives wrong values but no unsoundness beyond what reading a file does.
            let map = unsafe { Mmap::map(&file) }
                .with_context(|| format!("cannot map {}", path.display()))?;
            let parsed = SafeTensors::deserialize(&map)
                .map_err(|e| anyhow::anyhow!("{}: bad safetensors file: {e}", path.display()))?;
            let base = map.as_ptr() as usize;
            for (name, view) in parsed.tensors() {
                let data = view.data();
                let start = data.as_ptr() as usize - base;
                let t = TensorRef {
                    file: i,
                    start,
                    end: start + data.len(),
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                };
                if tensors.insert(name.clone(), t).is_some() {
                    bail!("tensor {name} appears in more than one weight file");
                }
            }
            maps.push(map);
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            config,
            maps,
            tensors,
        })
    }

    /// The raw bytes of a tensor.
    pub fn bytes(&self, t: &TensorRef) -> &[u8] {
        &self.maps[t.file][t.start..t.end]
    }

    /// A tensor's values as f32 (from F32, F16 or BF16).
    pub fn values(&self, name: &str, t: &TensorRef) -> Result<Vec<f32>> {
        let b = self.bytes(t);
        Ok(match t.dtype {
            Dtype::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::BF16 => b
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => bail!("tensor {name} has dtype {other:?}; only F32, F16 and BF16 convert"),
        })
    }

    /// A config value that must be a non-negative integer.
    pub fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .with_context(|| format!("config.json has no {key}"))
    }

    /// An optional non-negative integer config value (an error if present but not one).
    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.config.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|v| usize::try_from(v).ok())
                .map(Some)
                .with_context(|| format!("config.json: {key} is {v}, not a non-negative integer")),
        }
    }

    /// An optional number from config.json.
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.config.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .with_context(|| format!("config.json: {key} is {v}, not a number")),
        }
    }
}

/// The weight files: those of the index if there is one, else every `*.safetensors`.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    if let Some(index) = read_json(dir, "model.safetensors.index.json")? {
        let map = index
            .get("weight_map")
            .and_then(Value::as_object)
            .context("model.safetensors.index.json has no weight_map object")?;
        let mut names: Vec<&str> = Vec::new();
        for v in map.values() {
            let name = v.as_str().context("weight_map values must be file names")?;
            // Only plain names of files in the folder: no paths out of it.
            if name.contains(['/', '\\']) || name.starts_with('.') {
                bail!("weight_map names a file outside the folder: {name}");
            }
            if !names.contains(&name) {
                names.push(name);
            }
        }
        names.sort_unstable();
        return Ok(names.into_iter().map(|n| dir.join(n)).collect());
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        bail!(
            "{} has no .safetensors weights (PyTorch .bin checkpoints are not supported)",
            dir.display()
        );
    }
    Ok(files)
}
