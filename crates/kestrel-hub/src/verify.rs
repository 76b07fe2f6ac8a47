//! What a download must be before it may enter the cache: a whole GGUF file.

use std::path::Path;

use anyhow::{Result, bail};
use kestrel_gguf::GgufFile;

/// Checks that `path` is a complete GGUF file: the header, metadata and tensor table parse,
/// every tensor lies inside the file (the reader checks that), and the file ends where the
/// last tensor's data does (give or take the alignment padding), so a cut-off or padded body
/// is caught even when it parses.
pub fn check_gguf(path: &Path) -> Result<()> {
    // One file at a time: the parts of a split model are checked as they arrive.
    let file =
        GgufFile::open_part(path).map_err(|e| anyhow::anyhow!("not a valid GGUF file: {e}"))?;
    let data_end = file
        .tensors()
        .iter()
        .map(|t| t.offset.saturating_add(t.n_bytes()))
        .max()
        .unwrap_or(0);
    let data_len = file.file_size().saturating_sub(file.data_offset());
    let padded_end = data_end.next_multiple_of(file.alignment());
    if data_len < data_end || data_len > padded_end {
        bail!(
            "not a whole GGUF file: its tensor data takes {data_end} bytes but the file has {data_len} after the header"
        );
    }
    Ok(())
}
