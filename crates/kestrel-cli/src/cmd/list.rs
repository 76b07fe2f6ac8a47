//! `kestrel list`: the models in the caches, by the name that runs them.

use std::collections::HashMap;
use std::path::Path;

use anyhow::Result;
use kestrel_gguf::GgufFile;

#[derive(clap::Args)]
pub struct Args {
    /// One JSON object per line instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> Result<()> {
    let models_dir = kestrel_hub::models_dir();
    let stale = kestrel_hub::clean_stale_partials(&models_dir);
    if stale > 0 {
        eprintln!("kestrel: removed {stale} unfinished download(s) left by an earlier run");
    }
    let hf_cache = kestrel_hub::HubConfig::from_env().cache_dir;
    let models = kestrel_hub::list_models(&models_dir, &hf_cache);
    let rows: Vec<[String; 6]> = models
        .iter()
        .map(|m| {
            let (arch, quant) = describe(&m.path);
            [
                m.name.clone(),
                m.path.display().to_string(),
                format!("{:.1} MiB", m.size as f64 / (1024.0 * 1024.0)),
                arch,
                quant,
                m.source.to_string(),
            ]
        })
        .collect();
    if args.json {
        for r in &rows {
            let obj = serde_json::json!({
                "name": r[0], "file": r[1], "size": r[2], "architecture": r[3], "quant": r[4],
                "source": r[5],
            });
            println!("{obj}");
        }
        return Ok(());
    }
    if rows.is_empty() {
        println!(
            "no models in {} or {} (kestrel pull NAME fetches one)",
            models_dir.display(),
            hf_cache.display()
        );
        return Ok(());
    }
    let header = ["NAME", "FILE", "SIZE", "ARCH", "QUANT", "SOURCE"].map(str::to_string);
    let widths: Vec<usize> = (0..6)
        .map(|c| {
            rows.iter()
                .chain([&header])
                .map(|r| r[c].chars().count())
                .max()
                .unwrap_or(0)
        })
        .map(|w| w.min(80))
        .collect();
    for row in std::iter::once(&header).chain(&rows) {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, &w)| format!("{cell:<w$}"))
            .collect();
        println!("{}", cells.join("  ").trim_end());
    }
    Ok(())
}

/// Architecture and quantization of a model file ("?" where it cannot be read): the type
/// of most bytes among its matrices.
fn describe(path: &Path) -> (String, String) {
    let Ok(file) = GgufFile::open(path) else {
        return ("?".into(), "?".into());
    };
    let arch = file.architecture().unwrap_or("?").to_string();
    let mut bytes: HashMap<&str, u64> = HashMap::new();
    for t in file.tensors().iter().filter(|t| t.dims.len() >= 2) {
        *bytes.entry(t.ty.name()).or_default() += t.n_bytes();
    }
    let quant = bytes
        .into_iter()
        .max_by_key(|&(name, n)| (n, name))
        .map_or("?".to_string(), |(name, _)| name.to_string());
    (arch, quant)
}
