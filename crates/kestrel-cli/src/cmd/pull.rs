//! `kestrel pull NAME|URL|ORG/REPO[:QUANT]`

use anyhow::Result;

#[derive(clap::Args)]
pub struct Args {
    /// A catalog name (e.g. qwen2.5-coder-1.5b, gemma-3-270m), a Hugging Face name
    /// ORG/REPO[:QUANT] (e.g. Qwen/Qwen2.5-Coder-7B-Instruct-GGUF:Q4_K_M) or an http(s) URL.
    /// Without it, the catalog is listed.
    pub model: Option<String>,
    /// Name for a model pulled from a URL (default: from its file name); use it with -m.
    #[arg(long)]
    pub name: Option<String>,
}

pub fn run(args: Args) -> Result<()> {
    let Some(model) = args.model else {
        list_catalog();
        return Ok(());
    };
    let path = kestrel_hub::pull(&model, args.name.as_deref())?;
    // The last line of stdout is the path, for scripts.
    println!("{}", path.display());
    Ok(())
}

fn list_catalog() {
    let dir = kestrel_hub::models_dir();
    println!("models (cached in {}):", dir.display());
    for entry in kestrel_hub::catalog() {
        let cached = dir.join(entry.file_name()).is_file();
        let default = if entry.name == kestrel_hub::DEFAULT_MODEL {
            " (default)"
        } else {
            ""
        };
        println!(
            "  {:<20} {:>8.1} MiB  {}{}{}",
            entry.name,
            entry.size as f64 / (1024.0 * 1024.0),
            entry.description,
            default,
            if cached { "  [cached]" } else { "" }
        );
    }
}
