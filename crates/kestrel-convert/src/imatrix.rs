//! llama.cpp's importance matrices (`llama-imatrix` output) for `kestrel quantize --imatrix`,
//! read as llama-quantize reads them (common/imatrix-loader.cpp, tools/quantize):
//! - the GGUF format: per weight `<name>.in_sum2` (f32 sums of squared activations, `ne0`
//!   per expert) and `<name>.counts` (f32, one per expert), metadata `imatrix.datasets`,
//!   `imatrix.chunk_count`, `imatrix.chunk_size`; values are `in_sum2 / round(count)`, or
//!   1 for an expert never called;
//! - the legacy `.dat` format: i32 entry count, then per entry i32 name length, the name,
//!   i32 ncall, i32 nval, nval f32 (already `sum / count · ncall`), optionally followed by
//!   i32 chunk count, i32 dataset-name length and the name; values are divided by ncall.
//!
//! The file is untrusted: every length is checked against what is left before anything is
//! allocated, and a malformed file is an error saying what is wrong.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result, bail};
use kestrel_gguf::{GgmlType, GgufFile};

/// Importance weights per tensor name.
#[derive(Debug, Clone, Default)]
pub struct Imatrix {
    /// The file it was read from, as given (written to `quantize.imatrix.file`).
    pub file: String,
    /// Weights of each tensor: `ne0` per expert (per row for a 2-D tensor).
    pub entries: HashMap<String, Vec<f32>>,
    /// Names of the texts it was computed on.
    pub datasets: Vec<String>,
    /// Chunks of text it was computed on (0 when the file does not say).
    pub chunk_count: u32,
}

impl Imatrix {
    /// Reads a GGUF or legacy imatrix file.
    pub fn load(path: &Path) -> Result<Imatrix> {
        let bytes =
            std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        let parsed = if bytes.starts_with(b"GGUF") {
            let file = GgufFile::open(path)
                .with_context(|| format!("{} is not a valid GGUF file", path.display()))?;
            drop(bytes);
            from_gguf(&file)
        } else {
            from_legacy(&bytes)
        };
        let mut imatrix =
            parsed.with_context(|| format!("bad importance matrix {}", path.display()))?;
        imatrix.file = path.display().to_string();
        for (name, values) in &imatrix.entries {
            if let Some(v) = values.iter().find(|v| !v.is_finite()) {
                bail!(
                    "bad importance matrix {}: {name} holds the non-finite value {v}",
                    path.display()
                );
            }
        }
        Ok(imatrix)
    }

    /// The weights for tensor `name` of dimensions `dims`: `None` when the matrix has no
    /// entry for it (llama-quantize then quantizes it without), an error when the entry's
    /// size is not `ne0 · ne2` (llama-quantize's check; the token embedding is then
    /// quantized without weights instead, as llama-quantize does).
    pub fn weights_for(&self, name: &str, dims: &[u64]) -> Result<Option<&[f32]>> {
        let Some(w) = self.entries.get(name) else {
            return Ok(None);
        };
        let expected = dims
            .first()
            .copied()
            .unwrap_or(0)
            .saturating_mul(dims.get(2).copied().unwrap_or(1));
        if w.len() as u64 != expected {
            if name.starts_with("token_embd.") {
                return Ok(None);
            }
            bail!(
                "the importance matrix entry for {name} has {} values, but the tensor needs {expected} \
                 (row length {} × {} experts): the matrix was computed for another model",
                w.len(),
                dims.first().copied().unwrap_or(0),
                dims.get(2).copied().unwrap_or(1)
            );
        }
        Ok(Some(w))
    }
}

fn from_gguf(file: &GgufFile) -> Result<Imatrix> {
    if file.tensors().is_empty() {
        bail!("it holds no tensors");
    }
    let datasets = file.get("imatrix.datasets");
    let chunk_count = file.get_u64("imatrix.chunk_count");
    if datasets.is_none() || chunk_count.is_none() || file.get("imatrix.chunk_size").is_none() {
        bail!(
            "missing imatrix metadata (imatrix.datasets, imatrix.chunk_count, imatrix.chunk_size): \
             not an importance matrix written by llama-imatrix"
        );
    }
    let datasets = datasets
        .and_then(|v| v.as_array())
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let mut pairs: HashMap<&str, (Option<usize>, Option<usize>)> = HashMap::new();
    for (i, t) in file.tensors().iter().enumerate() {
        if let Some(base) = t.name.strip_suffix(".in_sum2") {
            pairs.entry(base).or_default().0 = Some(i);
        } else if let Some(base) = t.name.strip_suffix(".counts") {
            pairs.entry(base).or_default().1 = Some(i);
        }
    }
    let f32s = |i: usize| -> Result<Vec<f32>> {
        let t = &file.tensors()[i];
        if t.ty != GgmlType::F32 {
            bail!("{} is {}, not F32", t.name, t.ty);
        }
        Ok(file
            .tensor_data(t)
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    };
    let mut entries = HashMap::new();
    for (name, pair) in pairs {
        let (Some(s), Some(c)) = pair else {
            bail!(
                "mismatched sums and counts for {name}: one of {name}.in_sum2 / {name}.counts is missing"
            );
        };
        let sums = f32s(s)?;
        let counts = f32s(c)?;
        if counts.is_empty() || sums.is_empty() || sums.len() % counts.len() != 0 {
            bail!(
                "{name}: {} sums do not split into {} experts",
                sums.len(),
                counts.len()
            );
        }
        let ne0 = sums.len() / counts.len();
        let mut e = vec![0f32; sums.len()];
        for (j, &count) in counts.iter().enumerate() {
            if !count.is_finite() {
                bail!("{name}.counts holds the non-finite value {count}");
            }
            // llama.cpp: counts rounded to int64 (lround), then divided as float.
            let count = count.round() as i64 as f32;
            for i in 0..ne0 {
                e[j * ne0 + i] = if count > 0.0 {
                    sums[j * ne0 + i] / count
                } else {
                    1.0
                };
            }
        }
        entries.insert(name.to_string(), e);
    }
    Ok(Imatrix {
        file: String::new(),
        entries,
        datasets,
        chunk_count: u32::try_from(chunk_count.unwrap_or(0)).unwrap_or(u32::MAX),
    })
}

/// A little-endian reader over untrusted bytes that names what it was reading when short.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if self.bytes.len() - self.at < n {
            bail!(
                "the file ends inside {what} (at byte {}, {} bytes needed, {} left)",
                self.at,
                n,
                self.bytes.len() - self.at
            );
        }
        let out = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(out)
    }

    fn i32(&mut self, what: &str) -> Result<i32> {
        let b = self.take(4, what)?;
        Ok(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn left(&self) -> usize {
        self.bytes.len() - self.at
    }
}

fn from_legacy(bytes: &[u8]) -> Result<Imatrix> {
    let mut r = Reader { bytes, at: 0 };
    let n_entries = r.i32("the entry count")?;
    if n_entries < 1 {
        bail!("no data: the entry count is {n_entries}");
    }
    let mut entries = HashMap::new();
    for i in 1..=n_entries {
        let len = r.i32("an entry's name length")?;
        let len = usize::try_from(len)
            .map_err(|_| anyhow::anyhow!("entry {i}: negative name length {len}"))?;
        let name = r.take(len, "an entry's name")?;
        // llama.cpp reads the name as a C string: it ends at the first NUL.
        let name = name.split(|&b| b == 0).next().unwrap_or_default();
        let name = String::from_utf8_lossy(name).into_owned();
        let ncall = r.i32("an entry's call count")?;
        let nval = r.i32("an entry's value count")?;
        if nval < 1 {
            bail!("entry {i} ({name}): {nval} values");
        }
        let nval = nval as usize;
        if nval > r.left() / 4 {
            bail!(
                "entry {i} ({name}) claims {nval} values but only {} bytes are left",
                r.left()
            );
        }
        let raw = r.take(4 * nval, "an entry's values")?;
        let values = raw
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        // llama-quantize: sums / ncall when ncall > 0, else as stored.
        let e: Vec<f32> = if ncall > 0 {
            let n = ncall as i64 as f32;
            values.map(|v| v / n).collect()
        } else {
            values.collect()
        };
        entries.insert(name, e);
    }
    let mut imatrix = Imatrix {
        entries,
        ..Default::default()
    };
    // Optional trailer: the chunk count, then the dataset name.
    if r.left() > 0 {
        let chunks = r.i32("the chunk count")?;
        imatrix.chunk_count = chunks.max(0) as u32;
        if r.left() >= 4 {
            let len = r.i32("the dataset name length")?;
            if len > 0 {
                let name = r.take(len as usize, "the dataset name")?;
                let name = name.split(|&b| b == 0).next().unwrap_or_default();
                imatrix
                    .datasets
                    .push(String::from_utf8_lossy(name).into_owned());
            }
        }
    }
    Ok(imatrix)
}
