//! The two real models: parsed the same as gguf-py parses them, and rebuilt by the writer
//! byte for byte (compared chunk by chunk against the memory-mapped original, never
//! holding a second copy).

mod common;

use std::io::{Read, Write};

use common::{assert_matches_dump, python_oracle};
use kestrel_gguf::{GgufFile, GgufWriter};
use sha2::{Digest, Sha256};

const MODELS: [&str; 2] = ["gemma-3-270m", "qwen2.5-coder-1.5b"];

fn open(name: &str) -> GgufFile {
    let path = kestrel_hub::resolve_model(name).expect("model available");
    GgufFile::open(path).expect("real model parses")
}

#[test]
fn real_models_match_gguf_py() {
    let paths: Vec<String> = MODELS
        .iter()
        .map(|name| {
            let path = kestrel_hub::resolve_model(name).unwrap();
            path.to_str().unwrap().to_owned()
        })
        .collect();
    let dumps = python_oracle(&["dump", &paths[0], &paths[1]]);
    for (path, dump) in paths.iter().zip(dumps.as_array().unwrap()) {
        assert_matches_dump(&GgufFile::open(path).unwrap(), dump);
    }
}

#[test]
fn real_models_expose_expected_structure() {
    let gemma = open("gemma-3-270m");
    assert_eq!(gemma.architecture(), Some("gemma3"));
    let qwen = open("qwen2.5-coder-1.5b");
    assert_eq!(qwen.architecture(), Some("qwen2"));
    for file in [&gemma, &qwen] {
        let arch = file.architecture().unwrap();
        let n_layers = file.get_u64(&format!("{arch}.block_count")).unwrap();
        assert!(file.tensor("token_embd.weight").is_some());
        // Every layer has its attention-norm tensor.
        for layer in 0..n_layers {
            assert!(
                file.tensor(&format!("blk.{layer}.attn_norm.weight"))
                    .is_some()
            );
        }
        let tokens = file.get_array("tokenizer.ggml.tokens").unwrap();
        assert!(tokens.iter().all(|t| t.as_str().is_some()));
        // Tensor data ends exactly at the end of the file.
        let end = file
            .tensors()
            .iter()
            .map(|t| t.offset + t.n_bytes())
            .max()
            .unwrap();
        assert_eq!(file.data_offset() + end, file.file_size());
    }
}

/// A sink that compares everything written to it with an expected byte string.
struct CompareSink<'a> {
    expected: &'a [u8],
    pos: usize,
}

impl Write for CompareSink<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let end = self.pos + buf.len();
        let want = self.expected.get(self.pos..end).ok_or_else(|| {
            std::io::Error::other(format!("output runs past the original at byte {end}"))
        })?;
        if let Some(i) = (0..buf.len()).find(|&i| buf[i] != want[i]) {
            return Err(std::io::Error::other(format!(
                "output differs from the original at byte {}",
                self.pos + i
            )));
        }
        self.pos = end;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn real_models_rebuild_byte_for_byte() {
    for name in MODELS {
        let file = open(name);
        let writer = GgufWriter::from_gguf(&file).unwrap();
        assert_eq!(writer.file_size(), file.file_size());
        let sink = CompareSink {
            expected: file.as_bytes(),
            pos: 0,
        };
        let mut stream = writer.stream_to(sink).unwrap();
        for info in file.tensors() {
            stream.write_tensor(file.tensor_data(info)).unwrap();
        }
        let sink = stream.finish().unwrap();
        assert_eq!(sink.pos as u64, file.file_size(), "{name}");
    }
}

fn sha256_file(path: &std::path::Path) -> Vec<u8> {
    let mut f = std::fs::File::open(path).unwrap();
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    hasher.finalize().to_vec()
}

#[test]
fn real_model_rewritten_to_disk_has_the_same_sha256() {
    let path = kestrel_hub::resolve_model("gemma-3-270m").unwrap();
    let file = GgufFile::open(&path).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("copy.gguf");
    let mut stream = GgufWriter::from_gguf(&file)
        .unwrap()
        .stream_to_path(&out)
        .unwrap();
    for info in file.tensors() {
        // Stream in 1 MiB chunks, as a converter producing data piecewise would.
        for chunk in file.tensor_data(info).chunks(1 << 20) {
            stream.write_chunk(chunk).unwrap();
        }
    }
    stream.finish().unwrap();
    assert_eq!(sha256_file(&out), sha256_file(&path));
}
