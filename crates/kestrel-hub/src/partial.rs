//! Temporary download files: never left behind.
//!
//! A download in progress holds an exclusive lock on its `.partial` file and is listed in a
//! process-wide registry. [`remove_partials`] (called from a SIGINT/SIGTERM handler) deletes
//! every listed file; [`clean_stale_partials`] (called when a pull starts) deletes the
//! `.partial` files of runs that died without cleaning up, which are the ones nobody holds a
//! lock on.

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Files and folders of downloads in progress in this process.
static IN_PROGRESS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Keeps a path in the registry for as long as it lives.
pub(crate) struct Registered(PathBuf);

pub(crate) fn register(path: &Path) -> Registered {
    lock_registry().push(path.to_path_buf());
    Registered(path.to_path_buf())
}

impl Drop for Registered {
    fn drop(&mut self) {
        lock_registry().retain(|p| p != &self.0);
    }
}

fn lock_registry() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    IN_PROGRESS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Deletes the temporary files and folders of every download in progress in this process.
/// Meant for a signal handler that exits right after.
pub fn remove_partials() {
    for path in lock_registry().iter() {
        let _ = if path.is_dir() {
            fs::remove_dir_all(path)
        } else {
            fs::remove_file(path)
        };
    }
}

/// Deletes the `*.partial` files in `dir` that no live download holds (leftovers of a run
/// that was killed). Returns how many were removed.
pub fn clean_stale_partials(dir: &Path) -> usize {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "partial") {
            continue;
        }
        // A download in progress (here or in another process) holds the lock.
        let Ok(file) = File::open(&path) else {
            continue;
        };
        if file.try_lock().is_ok() && fs::remove_file(&path).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Creates `path` for writing and locks it, so that [`clean_stale_partials`] in another
/// process leaves it alone while this one writes.
pub(crate) fn create_locked(path: &Path) -> io::Result<File> {
    let file = File::create(path)?;
    file.try_lock().map_err(io::Error::other)?;
    Ok(file)
}
