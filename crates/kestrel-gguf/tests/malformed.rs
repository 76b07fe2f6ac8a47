//! Malformed input: every error names the problem and its byte offset, nothing panics.

mod common;

use common::{Raw, random_spec, same_value};
use kestrel_gguf::{GgmlType, GgufError, GgufFile, GgufWriter, Value, ValueType};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Parses and expects an error at `offset` whose message contains `needle`.
#[track_caller]
fn expect_err(bytes: Vec<u8>, offset: u64, needle: &str) -> GgufError {
    let err = GgufFile::from_bytes(bytes).expect_err("malformed input was accepted");
    let msg = err.to_string();
    assert_eq!(err.offset(), Some(offset), "wrong offset in: {msg}");
    assert!(
        msg.contains(&format!("byte {offset}")),
        "offset missing from: {msg}"
    );
    assert!(msg.contains(needle), "'{needle}' missing from: {msg}");
    err
}

/// Header with one kv and no tensors; the key starts at byte 24.
fn one_kv() -> Raw {
    Raw::header(3, 0, 1)
}

#[test]
fn bad_magic_and_versions() {
    let mut r = Raw::header(3, 0, 0);
    r.bytes[3] = b'G';
    let err = expect_err(r.bytes, 0, "magic");
    assert!(matches!(err, GgufError::BadMagic { .. }));
    expect_err(Raw::header(1, 0, 0).bytes, 4, "v1");
    expect_err(Raw::header(4, 0, 0).bytes, 4, "versions 2 and 3");
    expect_err(Raw::header(0, 0, 0).bytes, 4, "versions 2 and 3");
    expect_err(Raw::header(3u32.swap_bytes(), 0, 0).bytes, 4, "big-endian");
    // Both supported versions parse.
    for v in [2, 3] {
        assert_eq!(
            GgufFile::from_bytes(Raw::header(v, 0, 0).bytes)
                .unwrap()
                .version(),
            v
        );
    }
    expect_err(b"GG".to_vec(), 0, "magic");
    expect_err(b"GGUF\x03\0".to_vec(), 4, "version");
}

#[test]
fn forged_counts_fail_before_allocating() {
    expect_err(
        Raw::header(3, 0, u64::MAX).bytes,
        16,
        "metadata count 18446744073709551615",
    );
    expect_err(
        Raw::header(3, u64::MAX, 0).bytes,
        8,
        "tensor count 18446744073709551615",
    );
    // A count that fits the bytes on its own but not once the metadata is read.
    let mut r = Raw::header(3, 2, 1);
    r.kv("pad", &Value::String("x".repeat(60)));
    let meta_end = r.pos();
    r.raw(&[0; 40]);
    expect_err(r.bytes, meta_end, "tensor count 2");

    // Huge string length in a key and in a value.
    let mut r = one_kv();
    r.u64(u64::MAX / 2).raw(&[b'a'; 64]);
    expect_err(r.bytes, 24, "claims 9223372036854775807 bytes");
    let mut r = one_kv();
    r.str("k")
        .u32(ValueType::String.id())
        .u64(1 << 40)
        .raw(b"abc");
    expect_err(r.bytes, 24 + 9 + 4, "claims 1099511627776 bytes");

    // Huge array length: the count sits after key (9), type (4) and element type (4).
    let mut r = one_kv();
    r.str("k")
        .u32(ValueType::Array.id())
        .u32(ValueType::U32.id())
        .u64(1 << 60);
    r.raw(&[0; 64]);
    expect_err(r.bytes, 24 + 9 + 4 + 4, "array of 1152921504606846976 u32");
    // Strings need at least 8 bytes each: 16 of them cannot fit in 100 bytes.
    let mut r = one_kv();
    r.str("k")
        .u32(ValueType::Array.id())
        .u32(ValueType::String.id())
        .u64(16);
    r.raw(&[0; 100]);
    expect_err(r.bytes, 41, "array of 16 string");
    // Nested arrays: an inner count is checked against what remains at that point.
    let mut r = one_kv();
    r.str("k")
        .u32(ValueType::Array.id())
        .u32(ValueType::Array.id())
        .u64(1);
    let inner = r.pos();
    r.u32(ValueType::I64.id()).u64(3).raw(&[0; 16]);
    expect_err(r.bytes, inner + 4, "array of 3 i64");
}

#[test]
fn bad_value_types_and_contents() {
    let mut r = one_kv();
    r.str("k").u32(13).u32(0);
    expect_err(r.bytes, 33, "unknown value type id 13");
    let mut r = one_kv();
    r.str("k").u32(ValueType::Array.id()).u32(99).u64(0);
    expect_err(r.bytes, 37, "unknown array element type id 99");
    let mut r = one_kv();
    r.str("k").u32(ValueType::Bool.id()).u8(2);
    expect_err(r.bytes, 37, "bool value is 2");

    // Invalid UTF-8: the offset is that of the first bad byte.
    let mut r = one_kv();
    r.u64(3).raw(b"a\xffb").u32(ValueType::U8.id()).u8(0);
    expect_err(r.bytes, 33, "metadata key is not valid UTF-8");
    let mut r = one_kv();
    r.str("k").u32(ValueType::String.id()).u64(2).raw(b"\xc3(");
    expect_err(r.bytes, 45, "string value is not valid UTF-8");

    let mut r = Raw::header(3, 0, 2);
    r.kv("same", &Value::U8(1));
    r.kv("same", &Value::U8(2));
    expect_err(
        r.bytes,
        41,
        "duplicate metadata key 'same' (first at byte 24)",
    );

    // Nesting beyond the limit.
    let mut r = one_kv();
    r.str("k").u32(ValueType::Array.id());
    for _ in 0..kestrel_gguf::MAX_ARRAY_DEPTH {
        r.u32(ValueType::Array.id()).u64(1);
    }
    r.raw(&[0; 64]);
    let err = GgufFile::from_bytes(r.bytes).unwrap_err();
    assert!(err.to_string().contains("nested deeper"), "{err}");
    // Just within the limit parses.
    let mut deep = Value::Array(ValueType::U8, vec![Value::U8(7)]);
    for _ in 0..kestrel_gguf::MAX_ARRAY_DEPTH - 1 {
        deep = Value::Array(ValueType::Array, vec![deep]);
    }
    let mut r = one_kv();
    r.kv("k", &deep);
    let file = GgufFile::from_bytes(r.bytes).unwrap();
    assert!(same_value(file.get("k").unwrap(), &deep));
}

#[test]
fn bad_alignment() {
    for (value, needle) in [
        (Value::U32(0), "0 is not a nonzero power of two"),
        (Value::U32(48), "48 is not a nonzero power of two"),
        (Value::U64(32), "must be a u32, found a u64"),
        (Value::I32(32), "must be a u32, found a i32"),
        (Value::F32(32.0), "must be a u32, found a f32"),
        (Value::String("32".into()), "must be a u32, found a string"),
    ] {
        let mut r = one_kv();
        r.kv("general.alignment", &value);
        expect_err(r.bytes, 24 + 8 + 17 + 4, needle);
    }
    let mut r = one_kv();
    r.kv("general.alignment", &Value::U32(1));
    assert_eq!(GgufFile::from_bytes(r.bytes).unwrap().alignment(), 1);
}

/// One tensor info with the given fields, no metadata, then `data_len` bytes of data at
/// the aligned data offset. Returns the bytes and the offset of the tensor info.
fn one_tensor(name: &str, dims: &[u64], type_id: u32, offset: u64, data_len: usize) -> Vec<u8> {
    let mut r = Raw::header(3, 1, 0);
    r.tensor_info(name, dims, type_id, offset);
    r.pad_to(32);
    r.raw(&vec![0; data_len]);
    r.bytes
}

#[test]
fn bad_tensor_infos() {
    // The tensor info starts at byte 24; its name "t" takes 9 bytes.
    let dims_at = 24 + 9;
    assert!(GgufFile::from_bytes(one_tensor("t", &[4, 2], 0, 0, 32)).is_ok());
    expect_err(one_tensor("t", &[], 0, 0, 64), dims_at, "dimension count 0");
    expect_err(
        one_tensor("t", &[1; 5], 0, 0, 64),
        dims_at,
        "dimension count 5",
    );
    expect_err(
        one_tensor("t", &[4, 0], 0, 0, 64),
        dims_at,
        "dimension 1 of shape [4, 0] is zero",
    );
    expect_err(
        one_tensor("t", &[1 << 22, 1 << 22, 1 << 22], 0, 0, 64),
        dims_at,
        "overflows u64",
    );
    expect_err(
        one_tensor("t", &[1 << 32, 1 << 31], 0, 0, 64),
        dims_at,
        "exceeds i64::MAX",
    );
    expect_err(
        one_tensor("t", &[40], 2, 0, 64),
        dims_at,
        "row length 40 is not a multiple of the q4_0 block size 32",
    );
    // Type ids 4 and 5 (removed Q4_2/Q4_3) and past the end are unknown.
    let type_at = dims_at + 4 + 8;
    expect_err(
        one_tensor("t", &[32], 4, 0, 64),
        type_at,
        "unknown tensor type id 4",
    );
    expect_err(
        one_tensor("t", &[32], 1000, 0, 64),
        type_at,
        "unknown tensor type id 1000",
    );
    let offset_at = type_at + 4;
    expect_err(
        one_tensor("t", &[8], 0, 16, 64),
        offset_at,
        "data offset 16 is not a multiple of the alignment 32",
    );
    expect_err(
        one_tensor("t", &[8], 0, 0, 31),
        offset_at,
        "ends past the data section",
    );
    expect_err(
        one_tensor("t", &[8], 0, 64, 64),
        offset_at,
        "ends past the data section",
    );
    expect_err(
        one_tensor("t", &[8], 0, u64::MAX - 31, 64),
        offset_at,
        "ends past the data section",
    );
    // A data section entirely missing.
    expect_err(one_tensor("t", &[8], 0, 0, 0), offset_at, "file size");
    // Invalid UTF-8 in a tensor name.
    let mut r = Raw::header(3, 1, 0);
    r.u64(2)
        .raw(b"\xe2\x82")
        .u32(1)
        .u64(1)
        .u32(0)
        .u64(0)
        .pad_to(32)
        .raw(&[0; 32]);
    expect_err(r.bytes, 32, "tensor name is not valid UTF-8");
}

#[test]
fn duplicate_and_overlapping_tensors() {
    let mut r = Raw::header(3, 2, 0);
    r.tensor_info("w", &[8], 0, 0);
    let second = r.pos();
    r.tensor_info("w", &[8], 0, 32).pad_to(32).raw(&[0; 64]);
    expect_err(
        r.bytes,
        second,
        "duplicate tensor name 'w' (first at byte 24)",
    );

    // b starts inside a: the error points at b's offset field.
    let mut r = Raw::header(3, 2, 0);
    r.tensor_info("a", &[16], 0, 0);
    r.tensor_info("b", &[8], 0, 32);
    let b_offset_field = r.pos() - 8;
    r.pad_to(32).raw(&[0; 128]);
    expect_err(
        r.bytes,
        b_offset_field,
        "tensor 'b' (data 32..64) overlaps tensor 'a' (data 0..64)",
    );
    // Listed out of data order, still overlapping: detected the same way.
    let mut r = Raw::header(3, 2, 0);
    r.tensor_info("late", &[16], 0, 32);
    let late_field = r.pos() - 8;
    r.tensor_info("early", &[16], 0, 0)
        .pad_to(32)
        .raw(&[0; 128]);
    expect_err(r.bytes, late_field, "overlaps tensor 'early'");
    // Out of data order without overlap, and gaps, are fine.
    let mut r = Raw::header(3, 2, 0);
    r.tensor_info("late", &[8], 0, 96);
    r.tensor_info("early", &[8], 0, 0).pad_to(32);
    r.raw(&[1; 32]).raw(&[0; 64]).raw(&[2; 32]);
    let file = GgufFile::from_bytes(r.bytes).unwrap();
    assert_eq!(file.tensor_bytes("late").unwrap(), &[2; 32]);
    assert_eq!(file.tensor_bytes("early").unwrap(), &[1; 32]);
}

/// The shortest prefix of a writer-made file that is still complete: the end of the last
/// tensor's data, or with no tensors the end of the header before padding.
fn complete_length(bytes: &[u8]) -> usize {
    let file = GgufFile::from_bytes(bytes.to_vec()).unwrap();
    match file.tensors().iter().map(|t| t.offset + t.n_bytes()).max() {
        Some(end) => (file.data_offset() + end) as usize,
        None => {
            let mut r = Raw::header(file.version(), 0, file.metadata().len() as u64);
            for (k, v) in file.metadata() {
                r.kv(k, v);
            }
            r.bytes.len()
        }
    }
}

#[test]
fn every_truncation_fails() {
    for seed in 0..40 {
        let spec = random_spec(seed);
        let bytes = spec.writer().write_to_vec().unwrap();
        let complete = complete_length(&bytes);
        for len in 0..bytes.len() {
            let result = GgufFile::from_bytes(bytes[..len].to_vec());
            if len < complete {
                let err = result.expect_err("truncated file was accepted");
                assert!(err.offset().is_some_and(|o| o <= len as u64), "{err}");
            } else {
                // Only trailing padding is missing.
                assert!(result.is_ok(), "seed {seed} len {len}: {:?}", result.err());
            }
        }
    }
}

/// Everything a successfully parsed file promises.
fn check_parsed(file: &GgufFile) {
    let len = file.file_size();
    for (key, value) in file.metadata() {
        assert!(same_value(file.get(key).unwrap(), value));
    }
    let mut spans = Vec::new();
    for info in file.tensors() {
        let data = file.tensor_data(info);
        assert_eq!(data.len() as u64, info.n_bytes());
        assert_eq!(info.offset % file.alignment(), 0);
        assert!(file.data_offset() + info.offset + info.n_bytes() <= len);
        assert!(info.dims.len() <= 4 && !info.dims.is_empty());
        assert_eq!(info.row_len() % info.ty.block_size() as u64, 0);
        spans.push((info.offset, info.offset + info.n_bytes()));
        // Touch the data.
        std::hint::black_box(data.iter().fold(0u8, |a, &b| a ^ b));
    }
    spans.sort();
    assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0));
    // Whatever parsed can be written again (unless a name is too long for llama.cpp) and
    // reads back the same.
    let Ok(writer) = GgufWriter::from_gguf(file) else {
        return;
    };
    let mut stream = writer.stream_to(Vec::new()).unwrap();
    for info in file.tensors() {
        stream.write_tensor(file.tensor_data(info)).unwrap();
    }
    let again = GgufFile::from_bytes(stream.finish().unwrap()).unwrap();
    assert_eq!(again.metadata().len(), file.metadata().len());
    for ((k1, v1), (k2, v2)) in again.metadata().iter().zip(file.metadata()) {
        assert_eq!(k1, k2);
        assert!(same_value(v1, v2));
    }
    for (a, b) in again.tensors().iter().zip(file.tensors()) {
        assert_eq!((&a.name, &a.dims, a.ty), (&b.name, &b.dims, b.ty));
        assert_eq!(again.tensor_data(a), file.tensor_data(b));
    }
}

#[test]
fn random_corruption_never_panics() {
    let mut rng = StdRng::seed_from_u64(2024);
    let originals: Vec<Vec<u8>> = (0..60)
        .map(|seed| random_spec(seed).writer().write_to_vec().unwrap())
        .collect();
    let (mut accepted, mut rejected) = (0, 0);
    for _ in 0..20_000 {
        let mut bytes = originals[rng.random_range(0..originals.len())].clone();
        let header_len = GgufFile::from_bytes(bytes.clone()).unwrap().data_offset() as usize;
        match rng.random_range(0..4) {
            // Flip a few bits, mostly in the header where they matter.
            0 | 1 => {
                for _ in 0..rng.random_range(1..4) {
                    let end = if rng.random_bool(0.9) {
                        header_len
                    } else {
                        bytes.len()
                    };
                    let at = rng.random_range(0..end.max(1));
                    if let Some(b) = bytes.get_mut(at) {
                        *b ^= 1 << rng.random_range(0..8);
                    }
                }
            }
            // Overwrite 8 bytes with a random or extreme little-endian number.
            2 => {
                let at = rng.random_range(0..header_len.saturating_sub(8).max(1));
                let v: u64 = match rng.random_range(0..3) {
                    0 => rng.random(),
                    1 => u64::MAX - rng.random_range(0..64),
                    _ => rng.random_range(0..256),
                };
                let end = (at + 8).min(bytes.len());
                bytes[at..end].copy_from_slice(&v.to_le_bytes()[..end - at]);
            }
            // Drop or insert a byte inside the header.
            _ => {
                let at = rng.random_range(0..header_len.max(1));
                if rng.random_bool(0.5) {
                    bytes.remove(at.min(bytes.len() - 1));
                } else {
                    bytes.insert(at, rng.random());
                }
            }
        }
        let len = bytes.len() as u64;
        match GgufFile::from_bytes(bytes) {
            Ok(file) => {
                accepted += 1;
                check_parsed(&file);
            }
            Err(err) => {
                rejected += 1;
                assert!(!err.to_string().is_empty());
                if let Some(offset) = err.offset() {
                    assert!(offset <= len, "offset {offset} beyond file of {len}: {err}");
                }
            }
        }
    }
    // Both outcomes must actually occur, or the corruption is not exercising anything.
    assert!(
        accepted > 100 && rejected > 1000,
        "{accepted} accepted, {rejected} rejected"
    );
}

#[test]
fn tensor_helpers() {
    let mut w = GgufWriter::new();
    let info = w
        .add_tensor("q", &[512, 3, 2], GgmlType::Q4K)
        .unwrap()
        .clone();
    assert_eq!(info.n_elements(), 512 * 6);
    assert_eq!(info.row_len(), 512);
    assert_eq!(info.n_rows(), 6);
    assert_eq!(info.n_bytes(), 2 * 6 * 144);
    assert_eq!(info.row_bytes(), 2 * 144);
    assert_eq!(
        info.n_bytes(),
        GgmlType::Q4K.bytes_for(info.n_elements()).unwrap()
    );
}
