//! `ORG/REPO[:QUANT]` pulls through hf-hub against a mock hub on 127.0.0.1: the listing,
//! quant choice, split sets, the token, the cache layout, refused bodies, list and rm.

use std::collections::HashMap;
use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kestrel_gguf::{GgmlType, GgufWriter, Value};
use kestrel_hub::{HfSpec, HubConfig, ModelSource};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// A mock of the hub's two endpoints hf-hub uses: the repository listing and `resolve`
/// (with `Range`). `files` maps a file name to its bytes; `listed_size` overrides a size.
struct MockHub {
    endpoint: String,
    /// The Authorization header of every request.
    auth: Arc<Mutex<Vec<Option<String>>>>,
}

fn mock_hub(repo: &str, files: Vec<(&str, Vec<u8>)>, listed_size: HashMap<String, u64>) -> MockHub {
    mock_hub_headers(repo, files, listed_size, Headers::default())
}

/// Header values a hostile hub sends instead of the honest ones.
#[derive(Clone, Default)]
struct Headers {
    etag: Option<String>,
    linked_etag: Option<String>,
    commit: Option<String>,
}

fn mock_hub_headers(
    repo: &str,
    files: Vec<(&str, Vec<u8>)>,
    listed_size: HashMap<String, u64>,
    headers: Headers,
) -> MockHub {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let endpoint = format!("http://{}", listener.local_addr().expect("addr"));
    let files: HashMap<String, Vec<u8>> =
        files.into_iter().map(|(n, d)| (n.to_string(), d)).collect();
    let auth = Arc::new(Mutex::new(Vec::new()));
    let seen = auth.clone();
    let repo = repo.to_string();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let _ = answer(stream, &repo, &files, &listed_size, &seen, &headers);
        }
    });
    MockHub { endpoint, auth }
}

fn answer(
    mut stream: TcpStream,
    repo: &str,
    files: &HashMap<String, Vec<u8>>,
    listed_size: &HashMap<String, u64>,
    seen: &Mutex<Vec<Option<String>>>,
    hostile: &Headers,
) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut request = String::new();
    reader.read_line(&mut request)?;
    let mut headers = HashMap::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    seen.lock()
        .expect("lock")
        .push(headers.get("authorization").cloned());
    let path = request.split_whitespace().nth(1).unwrap_or("");
    let path = path.split('?').next().unwrap_or("");
    if path == format!("/api/models/{repo}/revision/main") {
        let siblings: Vec<serde_json::Value> = files
            .iter()
            .map(|(name, data)| {
                let size = listed_size.get(name).copied().unwrap_or(data.len() as u64);
                serde_json::json!({"rfilename": name, "size": size})
            })
            .chain([serde_json::json!({"rfilename": "README.md", "size": 5})])
            .collect();
        let body = serde_json::json!({"sha": COMMIT, "siblings": siblings}).to_string();
        return respond(&mut stream, "200 OK", "", body.as_bytes());
    }
    let prefix = format!("/{repo}/resolve/main/");
    let Some(data) = path.strip_prefix(&prefix).and_then(|f| files.get(f)) else {
        return respond(&mut stream, "404 Not Found", "", b"not found");
    };
    let start: usize = headers
        .get("range")
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.split('-').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let end = match headers.get("range").map(String::as_str) {
        Some("bytes=0-0") => 1.min(data.len()),
        _ => data.len(),
    };
    let etag = (hostile.etag.clone()).unwrap_or_else(|| format!("{:016x}", fxhash(data)));
    let commit = hostile.commit.as_deref().unwrap_or(COMMIT);
    let linked = hostile
        .linked_etag
        .as_ref()
        .map(|l| format!("X-Linked-Etag: {l}\r\n"))
        .unwrap_or_default();
    let extra = format!(
        "ETag: \"{etag}\"\r\n{linked}X-Repo-Commit: {commit}\r\nContent-Range: bytes {start}-{}/{}\r\n",
        end.saturating_sub(1),
        data.len()
    );
    respond(
        &mut stream,
        "206 Partial Content",
        &extra,
        &data[start.min(end)..end],
    )
}

fn respond(stream: &mut TcpStream, status: &str, extra: &str, body: &[u8]) -> std::io::Result<()> {
    write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n",
        body.len()
    )?;
    stream.write_all(body)?;
    stream.flush()?;
    // Drain what the client may still send so the close is clean.
    let _ = stream.read(&mut [0u8; 64]);
    Ok(())
}

fn fxhash(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf29ce484222325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

fn gguf(seed: u8, len: usize) -> Vec<u8> {
    let mut writer = GgufWriter::new();
    writer
        .add_metadata("general.architecture", Value::String("test".into()))
        .expect("metadata");
    writer
        .add_tensor_with_data("t", &[len as u64], GgmlType::I8, vec![seed; len])
        .expect("tensor");
    writer.write_to_vec().expect("serialize")
}

fn config(hub: &MockHub, cache: &Path, token: Option<&str>) -> HubConfig {
    HubConfig {
        endpoint: hub.endpoint.clone(),
        cache_dir: cache.to_path_buf(),
        token: token.map(str::to_string),
        stall_timeout: Duration::from_secs(10),
    }
}

fn spec(s: &str) -> HfSpec {
    HfSpec::parse(s).expect("spec")
}

#[test]
fn pulls_the_asked_quant_into_the_hf_cache_layout() {
    let q4 = gguf(1, 3000);
    let q8 = gguf(2, 5000);
    let hub = mock_hub(
        "org/Model-GGUF",
        vec![
            ("model-Q4_K_M.gguf", q4.clone()),
            ("model-Q8_0.gguf", q8.clone()),
        ],
        HashMap::new(),
    );
    let cache = tempfile::tempdir().expect("tempdir");
    let cfg = config(&hub, cache.path(), Some("secret-token"));
    let path = kestrel_hub::hf_pull(&spec("org/Model-GGUF:q8_0"), &cfg).expect("pull");
    // The Hugging Face cache layout: a snapshot link to a blob.
    let expected = cache.path().join(format!(
        "models--org--Model-GGUF/snapshots/{COMMIT}/model-Q8_0.gguf"
    ));
    assert_eq!(path, expected);
    assert!(fs::read(&path).expect("read") == q8);
    let refs = fs::read_to_string(cache.path().join("models--org--Model-GGUF/refs/main"));
    assert_eq!(refs.expect("ref").trim(), COMMIT);
    // The token went with every request.
    let auth = hub.auth.lock().expect("lock").clone();
    assert!(!auth.is_empty());
    assert!(
        auth.iter()
            .all(|a| a.as_deref() == Some("Bearer secret-token")),
        "{auth:?}"
    );
    // Default quant: Q4_K_M.
    let path = kestrel_hub::hf_pull(&spec("org/Model-GGUF"), &cfg).expect("pull default");
    assert!(fs::read(&path).expect("read") == q4);
    // Once cached, no request is made.
    let before = hub.auth.lock().expect("lock").len();
    kestrel_hub::hf_pull(&spec("org/Model-GGUF:Q8_0"), &cfg).expect("cached");
    assert_eq!(hub.auth.lock().expect("lock").len(), before);

    // list names both by the name that finds them; rm removes link and blob.
    let models = tempfile::tempdir().expect("tempdir");
    let listed = kestrel_hub::list_models(models.path(), cache.path());
    let names: Vec<&str> = listed.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["org/Model-GGUF:Q4_K_M", "org/Model-GGUF:Q8_0"]);
    assert!(listed.iter().all(|m| m.source == ModelSource::HuggingFace));
    assert_eq!(listed[1].size, q8.len() as u64);
    let removed =
        kestrel_hub::remove_model("org/Model-GGUF:Q8_0", models.path(), cache.path()).expect("rm");
    assert_eq!(removed.len(), 2, "{removed:?}");
    let listed = kestrel_hub::list_models(models.path(), cache.path());
    assert_eq!(listed.len(), 1);
    assert!(kestrel_hub::remove_model("org/Model-GGUF:Q8_0", models.path(), cache.path()).is_err());
}

#[test]
fn split_models_are_fetched_whole() {
    let parts = [gguf(3, 1000), gguf(4, 1200), gguf(5, 900)];
    let names = [
        "big-Q4_K_M-00001-of-00003.gguf",
        "big-Q4_K_M-00002-of-00003.gguf",
        "big-Q4_K_M-00003-of-00003.gguf",
    ];
    let hub = mock_hub(
        "org/big",
        names
            .iter()
            .zip(&parts)
            .map(|(n, p)| (*n, p.clone()))
            .collect(),
        HashMap::new(),
    );
    let cache = tempfile::tempdir().expect("tempdir");
    let path = kestrel_hub::hf_pull(&spec("org/big:Q4_K_M"), &config(&hub, cache.path(), None))
        .expect("pull");
    assert!(path.ends_with(names[0]), "{}", path.display());
    for (name, data) in names.iter().zip(&parts) {
        let file = path.parent().expect("dir").join(name);
        assert!(&fs::read(&file).expect("part") == data, "{name}");
    }
    let listed = kestrel_hub::list_models(cache.path(), cache.path());
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].name, "org/big:Q4_K_M");
    assert_eq!(
        listed[0].size,
        parts.iter().map(|p| p.len() as u64).sum::<u64>()
    );
}

#[test]
fn refused_files_leave_nothing_in_the_cache() {
    let good = gguf(6, 4000);
    let cases: Vec<(&str, Vec<u8>, Option<u64>, &str)> = vec![
        (
            "junk",
            b"<html>not a model</html>".to_vec(),
            None,
            "not a valid GGUF",
        ),
        (
            "cut",
            good[..good.len() - 64].to_vec(),
            None,
            "not a valid GGUF",
        ),
        // The hub lists another size than it serves.
        (
            "size",
            good.clone(),
            Some(good.len() as u64 + 1),
            "the hub lists",
        ),
    ];
    for (what, body, listed, expect) in cases {
        let sizes = listed
            .map(|s| HashMap::from([("m-Q4_K_M.gguf".to_string(), s)]))
            .unwrap_or_default();
        let hub = mock_hub("org/bad", vec![("m-Q4_K_M.gguf", body)], sizes);
        let cache = tempfile::tempdir().expect("tempdir");
        let err = kestrel_hub::hf_pull(&spec("org/bad"), &config(&hub, cache.path(), None))
            .expect_err(what);
        assert!(format!("{err:#}").contains(expect), "{what}: {err:#}");
        let blobs = cache.path().join("models--org--bad/blobs");
        let left: Vec<_> = fs::read_dir(&blobs)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name())
            .filter(|n| !n.to_string_lossy().ends_with(".lock"))
            .collect();
        assert!(left.is_empty(), "{what}: {left:?}");
        assert!(kestrel_hub::list_models(cache.path(), cache.path()).is_empty());
    }
}

#[test]
fn missing_repos_and_quants_are_clear_errors() {
    let hub = mock_hub(
        "org/m",
        vec![("m-Q4_K_M.gguf", gguf(7, 100))],
        HashMap::new(),
    );
    let cache = tempfile::tempdir().expect("tempdir");
    let cfg = config(&hub, cache.path(), None);
    let err = kestrel_hub::hf_pull(&spec("org/other"), &cfg).expect_err("no repo");
    assert!(
        format!("{err:#}").contains("cannot list org/other"),
        "{err:#}"
    );
    let err = kestrel_hub::hf_pull(&spec("org/m:Q2_K"), &cfg).expect_err("no quant");
    assert!(format!("{err:#}").contains("m-Q4_K_M.gguf"), "{err:#}");
}

/// Every path under `root`, relative to it, sorted.
fn tree(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            out.push(
                path.strip_prefix(root)
                    .expect("under root")
                    .display()
                    .to_string(),
            );
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(path);
            }
        }
    }
    out.sort();
    out
}

/// A hostile HF_ENDPOINT whose ETag, X-Linked-Etag or X-Repo-Commit is a relative path
/// out of the cache or an absolute one: refused before anything is created, inside the
/// cache or out of it, with an error naming the header.
#[test]
fn hostile_etags_and_commits_create_nothing() {
    let root = tempfile::tempdir().expect("tempdir");
    let cache = root.path().join("home/cache");
    fs::create_dir_all(&cache).expect("cache");
    let abs = root.path().join("abs-target");
    let abs = abs.to_str().expect("utf-8");
    let cases: Vec<(&str, Headers, &str)> = vec![
        (
            "etag ..",
            Headers {
                etag: Some("../../../../evil".into()),
                ..Default::default()
            },
            "ETag",
        ),
        (
            "etag abs",
            Headers {
                etag: Some(format!("{abs}/blob")),
                ..Default::default()
            },
            "ETag",
        ),
        (
            "etag dots",
            Headers {
                etag: Some("..".into()),
                ..Default::default()
            },
            "ETag",
        ),
        (
            "etag empty",
            Headers {
                etag: Some(String::new()),
                ..Default::default()
            },
            "ETag",
        ),
        (
            "linked etag",
            Headers {
                linked_etag: Some("../../x".into()),
                ..Default::default()
            },
            "ETag",
        ),
        (
            "commit ..",
            Headers {
                commit: Some("../../../../escape".into()),
                ..Default::default()
            },
            "X-Repo-Commit",
        ),
        (
            "commit abs",
            Headers {
                commit: Some(format!("{abs}/snap")),
                ..Default::default()
            },
            "X-Repo-Commit",
        ),
        (
            "commit ext",
            Headers {
                commit: Some("abc.part".into()),
                ..Default::default()
            },
            "X-Repo-Commit",
        ),
    ];
    for (what, headers, header) in cases {
        let hub = mock_hub_headers(
            "org/evil",
            vec![("m-Q4_K_M.gguf", gguf(9, 2000))],
            HashMap::new(),
            headers,
        );
        let err =
            kestrel_hub::hf_pull(&spec("org/evil"), &config(&hub, &cache, None)).expect_err(what);
        let msg = format!("{err:#}");
        assert!(
            msg.contains(&format!("{header} ")) && msg.contains("cannot name a cache entry"),
            "{what}: {msg}"
        );
        // Nothing at all was created: not in the cache, not beside it, not at the
        // absolute target.
        assert_eq!(tree(root.path()), ["home", "home/cache"], "{what}");
    }
    // The same hub with honest headers works, so the refusals above were the headers'.
    let hub = mock_hub(
        "org/evil",
        vec![("m-Q4_K_M.gguf", gguf(9, 2000))],
        HashMap::new(),
    );
    let path = kestrel_hub::hf_pull(&spec("org/evil"), &config(&hub, &cache, None)).expect("pull");
    assert!(path.starts_with(&cache), "{}", path.display());
}
