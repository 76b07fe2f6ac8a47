//! Fuzzes the GGUF reader: any input must parse or return an error, never panic, and
//! whatever parses must be internally consistent and survive a write/read round trip.

#![no_main]

use kestrel_gguf::{GgufFile, GgufWriter, Value};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let file = match GgufFile::from_bytes(data.to_vec()) {
        Ok(file) => file,
        Err(err) => {
            // Rendering the message must not panic either.
            let _ = err.to_string();
            return;
        }
    };

    let mut checksum = 0u64;
    for (key, value) in file.metadata() {
        assert!(file.get(key).is_some());
        checksum = checksum.wrapping_add(touch(value));
    }
    for info in file.tensors() {
        let bytes = file.tensor_data(info);
        assert_eq!(bytes.len() as u64, info.n_bytes());
        assert_eq!(info.offset % file.alignment(), 0);
        assert_eq!(file.tensor(&info.name), Some(info));
        checksum = bytes
            .iter()
            .fold(checksum, |acc, &b| acc.rotate_left(1) ^ u64::from(b));
    }
    std::hint::black_box(checksum);

    // Rewrite and re-read: the same metadata and tensors must come back. The writer
    // refuses names llama.cpp cannot load (over 63 bytes); skip those files.
    let Ok(writer) = GgufWriter::from_gguf(&file) else {
        return;
    };
    let mut stream = writer.stream_to(Vec::new()).expect("writing to memory");
    for info in file.tensors() {
        stream
            .write_tensor(file.tensor_data(info))
            .expect("tensor of declared size");
    }
    let rewritten = stream.finish().expect("all tensors written");
    let again = GgufFile::from_bytes(rewritten).expect("writer output parses");
    assert_eq!(again.metadata().len(), file.metadata().len());
    for ((k1, v1), (k2, v2)) in again.metadata().iter().zip(file.metadata()) {
        assert_eq!(k1, k2);
        assert!(same(v1, v2), "{k1}: {v1:?} != {v2:?}");
    }
    assert_eq!(again.tensors().len(), file.tensors().len());
    for (a, b) in again.tensors().iter().zip(file.tensors()) {
        assert_eq!((&a.name, &a.dims, a.ty), (&b.name, &b.dims, b.ty));
        assert_eq!(again.tensor_data(a), file.tensor_data(b));
    }
});

/// Reads every part of a value, including all accessors.
fn touch(value: &Value) -> u64 {
    let _ = (
        value.as_u64(),
        value.as_i64(),
        value.as_f32(),
        value.as_f64(),
    );
    let _ = (value.as_bool(), value.value_type().name());
    match value {
        Value::String(s) => s.len() as u64,
        Value::Array(_, items) => items.iter().map(touch).fold(1, u64::wrapping_add),
        _ => 1,
    }
}

/// Equality with floats compared by bits (NaN payloads must survive the round trip).
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::F32(x), Value::F32(y)) => x.to_bits() == y.to_bits(),
        (Value::F64(x), Value::F64(y)) => x.to_bits() == y.to_bits(),
        (Value::Array(ta, xs), Value::Array(tb, ys)) => {
            ta == tb && xs.len() == ys.len() && xs.iter().zip(ys).all(|(x, y)| same(x, y))
        }
        _ => a == b,
    }
}
