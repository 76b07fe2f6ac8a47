//! Models by Hugging Face name: `ORG/REPO[:QUANT]`, fetched with the `hf-hub` crate into
//! the Hugging Face cache (`$HF_HOME/hub`, shared with Python's `huggingface_hub`).
//!
//! `QUANT` picks the GGUF file of the repository whose name carries that quantization
//! (`Q4_K_M` matches `model-Q4_K_M.gguf` but not `model-Q4_K_M_L.gguf`); without it the
//! repository's only GGUF, else its `Q4_K_M` one, is taken. A model split into
//! `-00001-of-0000N.gguf` parts is fetched whole. Every file must be a whole GGUF file of
//! the size the hub lists, or it is removed from the cache again.
//!
//! hf-hub lists the repository, builds the URLs and names the cache folders; the files
//! themselves are fetched here (`download`), not by hf-hub's `download`: hf-hub turns the
//! hub's `ETag`/`X-Linked-Etag` and `X-Repo-Commit` headers into path components
//! (`blobs/<etag>`, `snapshots/<commit>/`) and creates them before any check could run, so
//! a hostile `HF_ENDPOINT` answering `../../x` or an absolute path made it write outside
//! the cache. Here the headers are validated before anything is created, and the body is
//! read to the announced size and no further.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo};
use indicatif::ProgressBar;

use crate::partial;
use crate::progress::bytes_bar;
use crate::verify::check_gguf;

/// The quantization taken when a repository has several and none was asked for.
pub const DEFAULT_QUANT: &str = "Q4_K_M";

/// A model named as `ORG/REPO[:QUANT]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HfSpec {
    pub repo: String,
    pub quant: Option<String>,
}

impl HfSpec {
    /// Reads `ORG/REPO[:QUANT]`; `None` for anything else. The parts may hold only ASCII
    /// letters, digits, `-`, `_` and `.` (not `.` or `..` alone), so a name can never
    /// reach outside the cache directory.
    pub fn parse(s: &str) -> Option<HfSpec> {
        let (repo, quant) = match s.split_once(':') {
            Some((repo, quant)) => (repo, Some(quant)),
            None => (s, None),
        };
        let (org, name) = repo.split_once('/')?;
        let part_ok = |p: &str| {
            !p.is_empty()
                && p != "."
                && p != ".."
                && p.len() <= 96
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        };
        if !part_ok(org) || !part_ok(name) || quant.is_some_and(|q| !part_ok(q)) {
            return None;
        }
        Some(HfSpec {
            repo: repo.to_string(),
            quant: quant.map(str::to_string),
        })
    }
}

impl std::fmt::Display for HfSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.quant {
            Some(q) => write!(f, "{}:{q}", self.repo),
            None => f.write_str(&self.repo),
        }
    }
}

/// Where the hub is and who is asking.
#[derive(Debug, Clone)]
pub struct HubConfig {
    /// `$HF_ENDPOINT`, else `https://huggingface.co`.
    pub endpoint: String,
    /// The Hugging Face cache: `$HF_HOME/hub`, else `~/.cache/huggingface/hub`.
    pub cache_dir: PathBuf,
    /// `$HF_TOKEN`, else the token `huggingface-cli login` saved.
    pub token: Option<String>,
    /// A transfer that makes no progress for this long is given up.
    pub stall_timeout: Duration,
}

impl HubConfig {
    pub fn from_env() -> HubConfig {
        let cache = Cache::from_env();
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        HubConfig {
            endpoint: env("HF_ENDPOINT")
                .map(|e| e.trim_end_matches('/').to_string())
                .unwrap_or_else(|| "https://huggingface.co".to_string()),
            token: env("HF_TOKEN").or_else(|| cache.token()),
            cache_dir: cache.path().clone(),
            stall_timeout: Duration::from_secs(60),
        }
    }
}

/// One file of a repository as the hub lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RepoFile {
    name: String,
    size: Option<u64>,
}

/// The (first) file of `spec` if the cache has it at the revision `main` points to. Needs
/// no network.
pub fn cached(spec: &HfSpec, cache_dir: &Path) -> Option<PathBuf> {
    let repo_dir = cache_dir.join(Repo::model(spec.repo.clone()).folder_name());
    let commit = std::fs::read_to_string(repo_dir.join("refs/main")).ok()?;
    let commit = commit.trim();
    if !safe_component(commit) {
        return None;
    }
    let snapshot = repo_dir.join("snapshots").join(commit);
    let names: Vec<RepoFile> = std::fs::read_dir(&snapshot)
        .ok()?
        .flatten()
        .map(|e| RepoFile {
            name: e.file_name().to_string_lossy().into_owned(),
            size: None,
        })
        .collect();
    // Without a quant only the default one is known offline: the repository may hold
    // others that were never fetched, so anything else asks the hub.
    let quant = spec.quant.as_deref().unwrap_or(DEFAULT_QUANT);
    let picked = pick_files(&names, Some(quant)).ok()?;
    Some(snapshot.join(&picked.first()?.name))
}

/// Fetches the GGUF file(s) of `spec` into the cache unless they are there; returns the
/// path of the (first) file.
pub fn pull(spec: &HfSpec, cfg: &HubConfig) -> Result<PathBuf> {
    if let Some(path) = cached(spec, &cfg.cache_dir) {
        return Ok(path);
    }
    let activity = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let (tx, rx) = mpsc::channel();
    {
        let (spec, cfg, activity) = (spec.clone(), cfg.clone(), activity.clone());
        // hf-hub's blocking client has no read timeout: the transfer runs on its own thread
        // and is given up when it stalls (the thread ends with the process).
        std::thread::spawn(move || {
            let _ = tx.send(fetch(&spec, &cfg, &activity, started));
        });
    }
    loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(result) => return result.with_context(|| format!("cannot pull {spec}")),
            Err(mpsc::RecvTimeoutError::Disconnected) => bail!("cannot pull {spec}: lost"),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let last = Duration::from_millis(activity.load(Ordering::SeqCst));
                if started.elapsed().saturating_sub(last) > cfg.stall_timeout {
                    partial::remove_partials();
                    bail!(
                        "cannot pull {spec}: no data from {} for {} s",
                        cfg.endpoint,
                        cfg.stall_timeout.as_secs()
                    );
                }
            }
        }
    }
}

/// Lists the repository, picks the files and downloads and checks each.
fn fetch(
    spec: &HfSpec,
    cfg: &HubConfig,
    activity: &AtomicU64,
    started: Instant,
) -> Result<PathBuf> {
    let api = ApiBuilder::from_cache(Cache::new(cfg.cache_dir.clone()))
        .with_endpoint(cfg.endpoint.clone())
        .with_token(cfg.token.clone())
        .with_progress(false)
        .build()
        .map_err(|e| anyhow!("{e}"))?;
    let repo = api.model(spec.repo.clone());
    let cache_repo = Cache::new(cfg.cache_dir.clone()).model(spec.repo.clone());
    let listing = repo
        .info_request()
        .query("blobs", "true")
        .call()
        .map_err(|e| anyhow!("cannot list {} at {}: {e}", spec.repo, cfg.endpoint))?
        .into_string()
        .context("reading the repository listing")?;
    let files = parse_listing(&listing)?;
    let picked = pick_files(&files, spec.quant.as_deref())?;
    let repo_dir = cfg
        .cache_dir
        .join(Repo::model(spec.repo.clone()).folder_name());
    // A signal while downloading removes hf-hub's `.part` files with the rest.
    let _registered = partial::register_pattern(&repo_dir.join("blobs"), "part");
    let mut paths = Vec::new();
    for file in &picked {
        let progress = HubProgress {
            bar: bytes_bar(file.size),
            activity,
            started,
        };
        let path = match cache_repo.get(&file.name) {
            Some(path) => path,
            None => download(cfg, &repo.url(&file.name), &repo_dir, file, progress)
                .with_context(|| format!("cannot download {}", file.name))?,
        };
        if let Err(e) = check_download(&path, &repo_dir, file) {
            remove_from_cache(&path);
            return Err(e.context(format!("{} was refused", file.name)));
        }
        paths.push(path);
    }
    paths
        .into_iter()
        .next()
        .ok_or_else(|| anyhow!("nothing to download"))
}

/// Whether a header value may be one component of a cache path: 1 to 128 ASCII letters,
/// digits, `-` and `_` (the hub's etags are SHA-256 or git SHA-1 hex, its commits git
/// SHA-1 hex), so never `..`, a separator, an absolute path or an extension.
fn safe_component(value: &str) -> bool {
    (1..=128).contains(&value.len())
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// What the hub says about a file before its body is fetched.
#[derive(Debug, PartialEq, Eq)]
struct FileMeta {
    etag: String,
    commit: String,
    size: u64,
}

/// The file's etag, commit and size from a one-byte range request, the way hf-hub's
/// `metadata` reads them (relative redirects followed, `X-Linked-Etag` before `ETag`),
/// and refused unless each can safely name a cache entry.
fn file_meta(agent: &ureq::Agent, token: Option<&str>, url: &str) -> Result<FileMeta> {
    let mut url = url.to_string();
    for _ in 0..=5 {
        let mut request = agent.get(&url).header("Range", "bytes=0-0");
        if let Some(token) = token {
            request = request.header("Authorization", format!("Bearer {token}"));
        }
        let response = request.call().map_err(|e| anyhow!("request failed: {e}"))?;
        let status = response.status().as_u16();
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
        };
        if (300..400).contains(&status)
            && let Some(location) = header("location")
            && location.starts_with('/')
            && !location.starts_with("//")
        {
            // A relative redirect (a renamed repository): same host, metadata from there.
            let origin_end = url.match_indices('/').nth(2).map_or(url.len(), |(i, _)| i);
            url = format!("{}{location}", &url[..origin_end]);
            continue;
        }
        if !(200..400).contains(&status) {
            bail!("the hub answered {status}");
        }
        let etag = header("x-linked-etag")
            .or_else(|| header("etag"))
            .ok_or_else(|| anyhow!("the hub sent no ETag"))?
            .replace('"', "");
        let commit = header("x-repo-commit")
            .ok_or_else(|| anyhow!("the hub sent no X-Repo-Commit"))?
            .to_string();
        for (what, value) in [("ETag", &etag), ("X-Repo-Commit", &commit)] {
            if !safe_component(value) {
                bail!(
                    "the hub's {what} {:?} cannot name a cache entry (expected letters, \
                     digits, - and _ only); nothing was written",
                    value.chars().take(80).collect::<String>()
                );
            }
        }
        // The size: from `Content-Range: bytes 0-0/SIZE` (a redirect to a CDN carries it
        // only there; the listing's size is used then).
        let size = header("content-range")
            .and_then(|r| r.rsplit('/').next())
            .and_then(|s| s.trim().parse::<u64>().ok());
        return Ok(FileMeta {
            etag,
            commit,
            size: size.unwrap_or(0),
        });
    }
    bail!("too many redirects")
}

/// Fetches one file into the cache: the body to `blobs/<etag>.part` (at most the size the
/// hub announced), renamed to `blobs/<etag>`, linked from `snapshots/<commit>/<name>` as
/// hf-hub and Python's huggingface_hub lay it out, and `refs/main` set to the commit.
/// Every path is built from validated parts only (`safe_component`, `pick_files`).
fn download(
    cfg: &HubConfig,
    url: &str,
    repo_dir: &Path,
    file: &RepoFile,
    mut progress: HubProgress<'_>,
) -> Result<PathBuf> {
    let config = |redirects: u32| {
        ureq::Agent::config_builder()
            .timeout_connect(Some(cfg.stall_timeout))
            .timeout_recv_response(Some(cfg.stall_timeout))
            .timeout_per_read(Some(cfg.stall_timeout))
            .http_status_as_error(false)
            .max_redirects(redirects)
            .redirect_auth_headers(ureq::config::RedirectAuthHeaders::SameHost)
            .build()
    };
    let token = cfg.token.as_deref();
    let meta = file_meta(&config(0).into(), token, url)?;
    if file.name.contains(['/', '\\']) || file.name.starts_with('.') {
        bail!("refusing the file name {:?}", file.name);
    }
    let size = match (file.size, meta.size) {
        (Some(listed), announced) if announced != 0 && announced != listed => {
            bail!("got {announced} bytes announced, the hub lists {listed}")
        }
        (Some(listed), _) => listed,
        (None, 0) => bail!("the hub gives no size for {}", file.name),
        (None, announced) => announced,
    };
    let blobs = repo_dir.join("blobs");
    std::fs::create_dir_all(&blobs)
        .with_context(|| format!("cannot create {}", blobs.display()))?;
    let blob = blobs.join(&meta.etag);
    let part = blobs.join(format!("{}.part", meta.etag));
    progress.init(size as usize, &file.name);
    let fetched = (|| -> Result<()> {
        let agent: ureq::Agent = config(10).into();
        let mut request = agent.get(url);
        if let Some(token) = token {
            request = request.header("Authorization", format!("Bearer {token}"));
        }
        let response = request.call().map_err(|e| anyhow!("request failed: {e}"))?;
        let status = response.status().as_u16();
        if !(200..300).contains(&status) {
            bail!("the hub answered {status}");
        }
        let mut out = std::fs::File::create(&part)
            .with_context(|| format!("cannot create {}", part.display()))?;
        let mut body = response
            .into_body()
            .into_with_config()
            .limit(size.saturating_add(1))
            .reader();
        let mut buf = vec![0u8; 1 << 16];
        let mut got = 0u64;
        loop {
            let n = std::io::Read::read(&mut body, &mut buf).context("download interrupted")?;
            if n == 0 {
                break;
            }
            got += n as u64;
            if got > size {
                bail!("the hub sent more than the {size} bytes it lists");
            }
            std::io::Write::write_all(&mut out, &buf[..n])
                .with_context(|| format!("cannot write {}", part.display()))?;
            progress.update(n);
        }
        if got != size {
            bail!("got {got} bytes, the hub lists {size}");
        }
        out.sync_all()?;
        Ok(())
    })();
    progress.finish();
    if let Err(e) = fetched {
        let _ = std::fs::remove_file(&part);
        return Err(e);
    }
    std::fs::rename(&part, &blob)?;
    let snapshot = repo_dir.join("snapshots").join(&meta.commit);
    std::fs::create_dir_all(&snapshot)?;
    let pointer = snapshot.join(&file.name);
    let target = Path::new("../../blobs").join(&meta.etag);
    if std::fs::symlink_metadata(&pointer).is_ok() {
        std::fs::remove_file(&pointer)?;
    }
    link(&target, &blob, &pointer)?;
    let refs = repo_dir.join("refs");
    std::fs::create_dir_all(&refs)?;
    std::fs::write(refs.join("main"), &meta.commit)?;
    Ok(pointer)
}

/// A relative symlink where there are symlinks, else the blob moved to the pointer.
fn link(relative: &Path, blob: &Path, pointer: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        let _ = blob;
        std::os::unix::fs::symlink(relative, pointer)
    }
    #[cfg(not(unix))]
    {
        let _ = relative;
        std::fs::rename(blob, pointer)
    }
}

/// A downloaded file must lie in the repository's cache folder, have the listed size and
/// be a whole GGUF file.
fn check_download(path: &Path, repo_dir: &Path, file: &RepoFile) -> Result<()> {
    let real = path.canonicalize()?;
    if !real.starts_with(repo_dir.canonicalize()?) {
        bail!(
            "the hub's answer put it outside the cache ({})",
            real.display()
        );
    }
    let len = std::fs::metadata(&real)?.len();
    if let Some(size) = file.size
        && len != size
    {
        bail!("got {len} bytes, the hub lists {size}");
    }
    check_gguf(&real)
}

/// Removes a snapshot entry and the blob it points to.
fn remove_from_cache(pointer: &Path) {
    if let Ok(blob) = pointer.canonicalize() {
        let _ = std::fs::remove_file(blob);
    }
    let _ = std::fs::remove_file(pointer);
}

/// The files of the hub's `api/models/REPO/revision/main?blobs=true` answer.
fn parse_listing(text: &str) -> Result<Vec<RepoFile>> {
    let json: serde_json::Value =
        serde_json::from_str(text).context("the repository listing is not JSON")?;
    let siblings = json
        .get("siblings")
        .and_then(|s| s.as_array())
        .ok_or_else(|| anyhow!("the repository listing has no files"))?;
    Ok(siblings
        .iter()
        .filter_map(|s| {
            Some(RepoFile {
                name: s.get("rfilename")?.as_str()?.to_string(),
                size: s.get("size").and_then(|v| v.as_u64()),
            })
        })
        .collect())
}

/// `(stem, part, count)` of a split GGUF name `stem-0000k-of-0000n.gguf`.
fn split_part(name: &str) -> Option<(&str, u32, u32)> {
    let base = name.strip_suffix(".gguf")?;
    let (rest, count) = base.rsplit_once("-of-")?;
    let (stem, part) = rest.rsplit_once('-')?;
    let ok = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !ok(part) || !ok(count) {
        return None;
    }
    Some((stem, part.parse().ok()?, count.parse().ok()?))
}

/// The quantization a GGUF file name ends with (`m-Q4_K_M.gguf` → `Q4_K_M`; parts of a
/// split model give their set's), for naming a cached file.
pub(crate) fn quant_label(name: &str) -> Option<String> {
    let stem = match split_part(name) {
        Some((stem, _, _)) => stem,
        None => name.strip_suffix(".gguf")?,
    };
    let label = stem.rsplit(['-', '.']).next()?;
    HfSpec::parse(&format!("a/b:{label}")).map(|_| label.to_string())
}

/// The files of the model whose (first) file is `snapshot/first`: every part of a split
/// model, else just that file.
pub(crate) fn parts_of(snapshot: &Path, first: &str) -> Vec<PathBuf> {
    match split_part(first) {
        Some((stem, _, count)) => (1..=count)
            .map(|k| snapshot.join(format!("{stem}-{k:05}-of-{count:05}.gguf")))
            .filter(|p| p.exists())
            .collect(),
        None => vec![snapshot.join(first)],
    }
}

/// Whether `name` carries the quantization `quant` as a whole word (case-insensitive).
fn has_quant(name: &str, quant: &str) -> bool {
    let (name, quant) = (name.to_ascii_lowercase(), quant.to_ascii_lowercase());
    let bytes = name.as_bytes();
    let is_word = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    name.match_indices(&quant).any(|(at, _)| {
        let before = at.checked_sub(1).map(|i| bytes[i]);
        let after = bytes.get(at + quant.len()).copied();
        !before.is_some_and(|b| b.is_ascii_alphanumeric()) && !after.is_some_and(is_word)
    })
}

/// The files to fetch for `quant`: one GGUF, or every part of a split one, in order.
fn pick_files(files: &[RepoFile], quant: Option<&str>) -> Result<Vec<RepoFile>> {
    // Only plain file names: a listing may not send a download outside the snapshot.
    let ggufs: Vec<&RepoFile> = files
        .iter()
        .filter(|f| f.name.ends_with(".gguf") && !f.name.contains(['/', '\\']))
        .filter(|f| !f.name.starts_with('.') && !f.name.to_ascii_lowercase().contains("mmproj"))
        .collect();
    if ggufs.is_empty() {
        bail!("the repository has no GGUF file");
    }
    // Models: a single file, or a split set named by its stem.
    let mut models: Vec<(String, Vec<&RepoFile>)> = Vec::new();
    for f in &ggufs {
        let key = match split_part(&f.name) {
            Some((stem, _, _)) => format!("{stem}.gguf"),
            None => f.name.clone(),
        };
        match models.iter_mut().find(|(k, _)| *k == key) {
            Some((_, parts)) => parts.push(f),
            None => models.push((key, vec![f])),
        }
    }
    let wanted = quant.or((models.len() > 1).then_some(DEFAULT_QUANT));
    let matching: Vec<&(String, Vec<&RepoFile>)> = match wanted {
        Some(q) => models.iter().filter(|(k, _)| has_quant(k, q)).collect(),
        None => models.iter().collect(),
    };
    let names = || {
        models
            .iter()
            .map(|(k, _)| k.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let (key, parts) = match matching.as_slice() {
        [one] => *one,
        [] => bail!(
            "no GGUF file for {} (the repository has: {}); add :QUANT",
            wanted.unwrap_or("this name"),
            names()
        ),
        _ => bail!(
            "several GGUF files match {} ({}); name one with :QUANT",
            wanted.unwrap_or("this name"),
            matching
                .iter()
                .map(|(k, _)| k.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut parts: Vec<RepoFile> = parts.iter().map(|f| (*f).clone()).collect();
    parts.sort_by(|a, b| a.name.cmp(&b.name));
    if let Some((_, _, count)) = split_part(&parts[0].name) {
        let numbers: Vec<u32> = parts
            .iter()
            .filter_map(|p| split_part(&p.name))
            .map(|p| p.1)
            .collect();
        if numbers != (1..=count).collect::<Vec<_>>() {
            bail!("{key} is split in {count} parts but the repository has parts {numbers:?}");
        }
    }
    Ok(parts)
}

/// Download progress: a byte bar, and the time of the last byte for the stall
/// check.
struct HubProgress<'a> {
    bar: ProgressBar,
    activity: &'a AtomicU64,
    started: Instant,
}

impl HubProgress<'_> {
    fn init(&mut self, size: usize, filename: &str) {
        self.bar.set_length(size as u64);
        self.bar.set_message(filename.to_string());
        self.touch();
    }

    fn update(&mut self, size: usize) {
        self.bar.inc(size as u64);
        self.touch();
    }

    fn finish(&mut self) {
        self.bar.finish_and_clear();
    }

    fn touch(&self) {
        let ms = self.started.elapsed().as_millis() as u64;
        self.activity.store(ms, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(names: &[&str]) -> Vec<RepoFile> {
        names
            .iter()
            .map(|n| RepoFile {
                name: n.to_string(),
                size: None,
            })
            .collect()
    }

    fn picked(names: &[&str], quant: Option<&str>) -> Result<Vec<String>> {
        Ok(pick_files(&files(names), quant)?
            .into_iter()
            .map(|f| f.name)
            .collect())
    }

    #[test]
    fn names_parse_and_hostile_ones_do_not() {
        let spec = HfSpec::parse("Qwen/Qwen2.5-Coder-7B-Instruct-GGUF:Q4_K_M").expect("spec");
        assert_eq!(spec.repo, "Qwen/Qwen2.5-Coder-7B-Instruct-GGUF");
        assert_eq!(spec.quant.as_deref(), Some("Q4_K_M"));
        assert_eq!(
            spec.to_string(),
            "Qwen/Qwen2.5-Coder-7B-Instruct-GGUF:Q4_K_M"
        );
        assert_eq!(HfSpec::parse("org/repo").expect("spec").quant, None);
        for bad in [
            "gemma-3-270m",
            "../etc",
            "org/..",
            "./repo",
            "org/repo/extra",
            "org/re po",
            "org/repo:",
            "org/repo:../x",
            "/abs/path",
            "org/",
        ] {
            assert_eq!(HfSpec::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn quant_picks_whole_words() {
        assert!(has_quant("model-Q4_K_M.gguf", "q4_k_m"));
        assert!(!has_quant("model-Q4_K_M.gguf", "Q4_K"));
        assert!(!has_quant("model-Q4_K_M_L.gguf", "Q4_K_M"));
        assert!(!has_quant("model-IQ4_XS.gguf", "Q4_XS"));
        assert!(has_quant("model.Q8_0.gguf", "Q8_0"));
    }

    #[test]
    fn files_are_picked_by_quant_split_sets_whole() {
        let repo = [
            "README.md",
            "m-Q4_K_M.gguf",
            "m-Q8_0-00002-of-00002.gguf",
            "m-Q8_0-00001-of-00002.gguf",
            "mmproj-m-f16.gguf",
            "sub/m-Q2_K.gguf",
        ];
        assert_eq!(
            picked(&repo, Some("q4_k_m")).expect("q4"),
            ["m-Q4_K_M.gguf"]
        );
        // Default: Q4_K_M when there are several.
        assert_eq!(picked(&repo, None).expect("default"), ["m-Q4_K_M.gguf"]);
        assert_eq!(
            picked(&repo, Some("Q8_0")).expect("q8"),
            ["m-Q8_0-00001-of-00002.gguf", "m-Q8_0-00002-of-00002.gguf"]
        );
        let err = picked(&repo, Some("Q2_K")).expect_err("in a subfolder");
        assert!(err.to_string().contains("m-Q4_K_M.gguf"), "{err}");
        // The only GGUF is taken whatever its name.
        assert_eq!(picked(&["x.gguf"], None).expect("one"), ["x.gguf"]);
        let err = picked(
            &["m-Q8_0-00001-of-00003.gguf", "m-Q8_0-00003-of-00003.gguf"],
            None,
        )
        .expect_err("a part missing");
        assert!(err.to_string().contains("[1, 3]"), "{err}");
        let err = picked(&["a-Q4_K_M.gguf", "b-Q4_K_M.gguf"], None).expect_err("ambiguous");
        assert!(err.to_string().contains("several"), "{err}");
        assert!(picked(&["README.md"], None).is_err());
    }

    #[test]
    fn listings_are_read_defensively() {
        let files = parse_listing(
            r#"{"sha":"abc","siblings":[{"rfilename":"a.gguf","size":12},{"rfilename":7},{"rfilename":"b.gguf"}]}"#,
        )
        .expect("listing");
        assert_eq!(
            files,
            [
                RepoFile {
                    name: "a.gguf".into(),
                    size: Some(12)
                },
                RepoFile {
                    name: "b.gguf".into(),
                    size: None
                },
            ]
        );
        assert!(parse_listing("<html>").is_err());
        assert!(parse_listing("{}").is_err());
    }
}
