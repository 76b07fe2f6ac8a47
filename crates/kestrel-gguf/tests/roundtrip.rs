//! Writer and reader against each other and against an independent encoder.

mod common;

use std::io::Write;

use common::{Spec, assert_matches_spec, random_spec, raw_encode};
use kestrel_gguf::{GgmlType, GgufError, GgufFile, GgufWriter, Value, ValueType};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const SEEDS: u64 = 300;

#[test]
fn writer_matches_independent_encoder_and_reader_recovers_spec() {
    for seed in 0..SEEDS {
        let spec = random_spec(seed);
        let writer = spec.writer();
        let expected_size = writer.file_size();
        let expected_data_offset = writer.data_offset();
        let bytes = writer.write_to_vec().unwrap();
        assert_eq!(bytes, raw_encode(&spec), "seed {seed}");
        assert_eq!(bytes.len() as u64, expected_size, "seed {seed}");

        let file = GgufFile::from_bytes(bytes).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        assert_eq!(file.data_offset(), expected_data_offset);
        assert_matches_spec(&file, &spec);
    }
}

/// Rebuilds a parsed file with the writer: from_gguf, then the data streamed in random
/// chunks.
fn rebuild(file: &GgufFile, rng: &mut StdRng) -> Vec<u8> {
    let writer = GgufWriter::from_gguf(file).unwrap();
    let mut stream = writer.stream_to(Vec::new()).unwrap();
    for info in file.tensors() {
        assert_eq!(stream.next_tensor(), Some(info));
        let mut data = file.tensor_data(info);
        if rng.random_bool(0.5) {
            stream.write_tensor(data).unwrap();
            continue;
        }
        while !data.is_empty() {
            let n = rng.random_range(0..=data.len());
            stream.write_chunk(&data[..n]).unwrap();
            data = &data[n..];
        }
    }
    assert_eq!(stream.next_tensor(), None);
    stream.finish().unwrap()
}

#[test]
fn read_then_rewrite_is_byte_identical() {
    let mut rng = StdRng::seed_from_u64(7);
    for seed in 0..SEEDS {
        let original = spec_bytes(&random_spec(seed));
        let file = GgufFile::from_bytes(original.clone()).unwrap();
        assert_eq!(rebuild(&file, &mut rng), original, "seed {seed}");
    }
}

fn spec_bytes(spec: &Spec) -> Vec<u8> {
    spec.writer().write_to_vec().unwrap()
}

#[test]
fn open_reads_the_same_as_from_bytes_and_write_to_path_is_atomic() {
    let dir = tempfile::tempdir().unwrap();
    for seed in 0..20 {
        let spec = random_spec(seed);
        let path = dir.path().join(format!("model-{seed}.gguf"));
        spec.writer().write_to_path(&path).unwrap();
        let file = GgufFile::open(&path).unwrap();
        assert_matches_spec(&file, &spec);
        assert_eq!(file.as_bytes(), &raw_encode(&spec)[..]);
    }
    // Only the final files remain: every temporary file was renamed.
    let mut names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    let mut expected: Vec<_> = (0..20).map(|s| format!("model-{s}.gguf")).collect();
    expected.sort();
    assert_eq!(names, expected);
}

#[test]
fn abandoned_file_stream_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("partial.gguf");
    let mut w = GgufWriter::new();
    w.add_tensor("a", &[64], GgmlType::F32).unwrap();
    w.add_tensor("b", &[64], GgmlType::F32).unwrap();
    let mut stream = w.stream_to_path(&path).unwrap();
    stream.write_tensor(&[0u8; 256]).unwrap();
    // Finishing early fails and the target never appears.
    assert!(stream.finish().is_err());
    assert!(!path.exists());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn streamed_file_equals_in_memory_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = StdRng::seed_from_u64(11);
    for seed in 0..50 {
        let spec = random_spec(seed);
        let expected = spec_bytes(&spec);
        // Declare without data, except for a random subset given up front: the stream
        // writes those by itself when their turn comes.
        let mut w = GgufWriter::new();
        w.set_version(spec.version).unwrap();
        for (k, v) in &spec.metadata {
            w.add_metadata(k.clone(), v.clone()).unwrap();
        }
        let mut streamed = Vec::new();
        for t in &spec.tensors {
            if rng.random_bool(0.3) {
                w.add_tensor_with_data(t.name.clone(), &t.dims, t.ty, t.data.clone())
                    .unwrap();
            } else {
                w.add_tensor(t.name.clone(), &t.dims, t.ty).unwrap();
                streamed.push(t);
            }
        }
        let path = dir.path().join("streamed.gguf");
        let mut stream = w.stream_to_path(&path).unwrap();
        for t in streamed {
            assert_eq!(stream.next_tensor().unwrap().name, t.name);
            stream.write_tensor(&t.data).unwrap();
        }
        stream.finish().unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), expected, "seed {seed}");
    }
}

#[test]
fn alignment_set_after_tensors_relays_them_out() {
    let mut w = GgufWriter::new();
    w.add_tensor_with_data("a", &[3], GgmlType::F32, vec![1; 12])
        .unwrap();
    w.add_tensor_with_data("b", &[5], GgmlType::I8, vec![2; 5])
        .unwrap();
    assert_eq!(w.tensors()[1].offset, 32);
    w.add_metadata("general.alignment", Value::U32(64)).unwrap();
    assert_eq!(w.alignment(), 64);
    assert_eq!(w.tensors()[1].offset, 64);
    w.set_metadata("general.alignment", Value::U32(4)).unwrap();
    assert_eq!(w.tensors()[1].offset, 12);
    let bytes = w.clone().write_to_vec().unwrap();
    let file = GgufFile::from_bytes(bytes).unwrap();
    assert_eq!(file.alignment(), 4);
    assert_eq!(file.data_offset() % 4, 0);
    assert_eq!(file.tensor_bytes("b").unwrap(), &[2; 5]);
    w.remove_metadata("general.alignment");
    assert_eq!(w.tensors()[1].offset, 32);
}

#[test]
fn metadata_order_set_and_remove() {
    let mut w = GgufWriter::new();
    w.add_metadata("a", 1u32).unwrap();
    w.add_metadata("b", "two").unwrap();
    w.add_metadata("c", true).unwrap();
    assert!(w.add_metadata("b", 5u8).is_err());
    w.set_metadata("b", 2.5f32).unwrap();
    assert_eq!(w.remove_metadata("a"), Some(Value::U32(1)));
    w.set_metadata("d", -4i64).unwrap();
    let file = GgufFile::from_bytes(w.write_to_vec().unwrap()).unwrap();
    let keys: Vec<_> = file.metadata().iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ["b", "c", "d"]);
    assert_eq!(file.get_f32("b"), Some(2.5));
    assert_eq!(file.get_bool("c"), Some(true));
    assert_eq!(file.get_i64("d"), Some(-4));
    assert_eq!(file.get_u64("d"), None);
}

#[test]
fn writer_rejects_what_it_cannot_write() {
    let mut w = GgufWriter::new();
    let err = |r: Result<(), GgufError>| r.unwrap_err().to_string();
    assert!(err(w.set_version(1)).contains("version 1"));
    // Array elements must have the declared type.
    let mixed = Value::Array(ValueType::U32, vec![Value::U32(1), Value::I32(2)]);
    assert!(err(w.add_metadata("k", mixed)).contains("index 1"));
    assert!(err(w.add_metadata("general.alignment", 3u32)).contains("power of two"));
    assert!(err(w.add_metadata("general.alignment", 0u32)).contains("power of two"));
    assert!(err(w.add_metadata("general.alignment", 32.0f32)).contains("u32"));
    // Too deep nesting.
    let mut deep = Value::Array(ValueType::U8, vec![]);
    for _ in 0..kestrel_gguf::MAX_ARRAY_DEPTH {
        deep = Value::Array(ValueType::Array, vec![deep]);
    }
    assert!(err(w.add_metadata("deep", deep)).contains("nested"));

    let t = |w: &mut GgufWriter, name: &str, dims: &[u64], ty| {
        w.add_tensor(name, dims, ty)
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    assert!(t(&mut w, "x", &[], GgmlType::F32).contains("zero dimensions"));
    assert!(t(&mut w, "x", &[1, 1, 1, 1, 1], GgmlType::F32).contains("5 dimensions"));
    assert!(t(&mut w, "x", &[4, 0], GgmlType::F32).contains("is zero"));
    assert!(t(&mut w, "x", &[33], GgmlType::Q4_0).contains("block size"));
    assert!(t(&mut w, "x", &[1 << 40, 1 << 40], GgmlType::F32).contains("overflows"));
    assert!(t(&mut w, &"n".repeat(64), &[1], GgmlType::F32).contains("63"));
    w.add_tensor("x", &[2], GgmlType::F32).unwrap();
    assert!(t(&mut w, "x", &[2], GgmlType::F32).contains("duplicate"));
    assert!(
        w.add_tensor_with_data("y", &[2], GgmlType::F32, vec![0; 7])
            .unwrap_err()
            .to_string()
            .contains("needs 8 bytes")
    );
    // In-memory writing needs every tensor's data.
    assert!(
        w.clone()
            .write_to_vec()
            .unwrap_err()
            .to_string()
            .contains("'x'")
    );

    // Stream misuse.
    let mut s = w.stream_to(Vec::new()).unwrap();
    assert!(s.write_tensor(&[0; 4]).is_err());
    assert!(
        s.write_chunk(&[0; 9])
            .unwrap_err()
            .to_string()
            .contains("overruns")
    );
    s.write_chunk(&[0; 3]).unwrap();
    assert!(
        s.write_tensor(&[0; 8])
            .unwrap_err()
            .to_string()
            .contains("already written")
    );
    s.write_chunk(&[0; 5]).unwrap();
    assert!(
        s.write_chunk(&[0])
            .unwrap_err()
            .to_string()
            .contains("all tensors")
    );
    let out = s.finish().unwrap();
    assert!(GgufFile::from_bytes(out).is_ok());
}

/// A sink that fails after a number of bytes, to check write errors surface and stick.
struct FailingSink(usize);

impl Write for FailingSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if buf.len() > self.0 {
            return Err(std::io::Error::other("disk full"));
        }
        self.0 -= buf.len();
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn write_errors_are_reported_and_poison_the_stream() {
    let mut w = GgufWriter::new();
    w.add_tensor("a", &[1024], GgmlType::F32).unwrap();
    w.add_tensor("b", &[1024], GgmlType::F32).unwrap();
    let header = w.data_offset() as usize;
    assert!(matches!(
        w.clone().stream_to(FailingSink(10)),
        Err(GgufError::Write(_))
    ));
    let mut s = w.stream_to(FailingSink(header + 100)).unwrap();
    assert!(matches!(
        s.write_tensor(&[0; 4096]),
        Err(GgufError::Write(_))
    ));
    assert!(s.write_tensor(&[0; 4096]).is_err());
    assert!(s.finish().is_err());
}

/// A sink that only counts, to stream a file bigger than 4 GiB without storing it.
struct Counter(u64);

impl Write for Counter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn streams_a_file_larger_than_4gib_in_chunks() {
    let mut w = GgufWriter::new();
    // Three 2 GiB tensors with a small odd-sized one between: offsets cross 4 GiB.
    w.add_tensor("big.0", &[1 << 19, 1 << 10], GgmlType::F32)
        .unwrap();
    w.add_tensor("small", &[3], GgmlType::I8).unwrap();
    w.add_tensor("big.1", &[1 << 19, 1 << 10], GgmlType::F32)
        .unwrap();
    w.add_tensor("big.2", &[1 << 20, 1 << 10], GgmlType::Q8_0)
        .unwrap();
    let offsets: Vec<u64> = w.tensors().iter().map(|t| t.offset).collect();
    assert_eq!(offsets, [0, 1 << 31, (1 << 31) + 32, (1 << 32) + 32]);
    let expected = w.file_size();
    let chunk = vec![0u8; 8 << 20];
    let mut s = w.stream_to(Counter(0)).unwrap();
    while let Some(info) = s.next_tensor() {
        let mut left = info.n_bytes();
        while left > 0 {
            let n = left.min(chunk.len() as u64);
            s.write_chunk(&chunk[..n as usize]).unwrap();
            left -= n;
        }
    }
    assert_eq!(s.finish().unwrap().0, expected);
}
