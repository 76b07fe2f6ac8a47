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

/// What a download in progress may leave behind.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Temporary {
    /// A file or a folder.
    Path(PathBuf),
    /// Every file with this extension in a folder (another library's temporary files).
    Pattern(PathBuf, &'static str),
}

/// The temporaries of downloads in progress in this process.
static IN_PROGRESS: Mutex<Vec<Temporary>> = Mutex::new(Vec::new());

/// Keeps an entry in the registry for as long as it lives.
pub(crate) struct Registered(Temporary);

fn register_entry(entry: Temporary) -> Registered {
    lock_registry().push(entry.clone());
    Registered(entry)
}

pub(crate) fn register(path: &Path) -> Registered {
    register_entry(Temporary::Path(path.to_path_buf()))
}

/// Registers every `*.{extension}` file in `dir`.
pub(crate) fn register_pattern(dir: &Path, extension: &'static str) -> Registered {
    register_entry(Temporary::Pattern(dir.to_path_buf(), extension))
}

impl Drop for Registered {
    fn drop(&mut self) {
        let mut registry = lock_registry();
        if let Some(i) = registry.iter().position(|e| e == &self.0) {
            registry.remove(i);
        }
    }
}

fn lock_registry() -> std::sync::MutexGuard<'static, Vec<Temporary>> {
    IN_PROGRESS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Deletes the temporary files and folders of every download in progress in this process.
/// Meant for a signal handler that exits right after.
pub fn remove_partials() {
    for entry in lock_registry().iter() {
        match entry {
            Temporary::Path(path) if path.is_dir() => {
                let _ = fs::remove_dir_all(path);
            }
            Temporary::Path(path) => {
                let _ = fs::remove_file(path);
            }
            Temporary::Pattern(dir, extension) => {
                for file in fs::read_dir(dir).into_iter().flatten().flatten() {
                    if file.path().extension().is_some_and(|e| e == *extension) {
                        let _ = fs::remove_file(file.path());
                    }
                }
            }
        }
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
