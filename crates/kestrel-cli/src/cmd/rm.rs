//! `kestrel rm NAME`: removes a cached model by the name `kestrel list` shows.

use anyhow::Result;

#[derive(clap::Args)]
pub struct Args {
    /// A catalog name, a URL-pulled model's name or ORG/REPO:QUANT.
    pub name: String,
}

pub fn run(args: Args) -> Result<()> {
    let hf_cache = kestrel_hub::HubConfig::from_env().cache_dir;
    let removed = kestrel_hub::remove_model(&args.name, &kestrel_hub::models_dir(), &hf_cache)?;
    for path in removed {
        println!("removed {}", path.display());
    }
    Ok(())
}
