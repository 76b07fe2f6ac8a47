//! Split models (`NAME-0000k-of-0000N.gguf`, as llama.cpp's gguf-split writes them) open as
//! one file: the first part's metadata and every part's tensors, each tensor's data from its
//! own part; parts that do not fit together are a clear error.

use std::path::{Path, PathBuf};

use kestrel_gguf::{
    GgmlType, GgufError, GgufFile, GgufWriter, SPLIT_COUNT_KEY, SPLIT_NO_KEY, Value,
};

/// Writes `tensors` (name, f32 values) split over `parts.len()` files, `parts[k]` naming the
/// tensors of part k; returns the part paths.
fn write_split(dir: &Path, stem: &str, parts: &[&[(&str, Vec<f32>)]]) -> Vec<PathBuf> {
    let n = parts.len();
    let mut paths = Vec::new();
    for (k, tensors) in parts.iter().enumerate() {
        let mut w = GgufWriter::new();
        if k == 0 {
            w.add_metadata("general.architecture", Value::String("llama".into()))
                .expect("meta");
        }
        w.add_metadata(SPLIT_NO_KEY, Value::U16(k as u16))
            .expect("meta");
        w.add_metadata(SPLIT_COUNT_KEY, Value::U16(n as u16))
            .expect("meta");
        for (name, values) in tensors.iter() {
            let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            w.add_tensor_with_data(*name, &[values.len() as u64], GgmlType::F32, bytes)
                .expect("tensor");
        }
        let path = dir.join(format!("{stem}-{:05}-of-{n:05}.gguf", k + 1));
        w.write_to_path(&path).expect("write");
        paths.push(path);
    }
    paths
}

fn floats(file: &GgufFile, name: &str) -> Vec<f32> {
    file.tensor_bytes(name)
        .expect("tensor")
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn parts_open_as_one_model() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = vec![1.0, 2.0, 3.0];
    let b = vec![4.0; 40];
    let c = vec![-1.5, 0.25];
    let paths = write_split(
        dir.path(),
        "m",
        &[
            &[("a", a.clone())],
            &[("b", b.clone()), ("c", c.clone())],
            &[("d", vec![9.0])],
        ],
    );
    let file = GgufFile::open(&paths[0]).expect("open split");
    assert_eq!(file.architecture(), Some("llama"));
    let names: Vec<&str> = file.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["a", "b", "c", "d"]);
    // Same offsets in different parts: each tensor's data comes from its own part.
    assert_eq!(floats(&file, "a"), a);
    assert_eq!(floats(&file, "b"), b);
    assert_eq!(floats(&file, "c"), c);
    assert_eq!(floats(&file, "d"), [9.0]);
    // One part alone is just that part.
    assert_eq!(
        GgufFile::open_part(&paths[0])
            .expect("part")
            .tensors()
            .len(),
        1
    );
}

#[test]
fn parts_that_do_not_fit_are_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let one: &[(&str, Vec<f32>)] = &[("a", vec![1.0])];
    let two: &[(&str, Vec<f32>)] = &[("b", vec![2.0])];

    let paths = write_split(dir.path(), "missing", &[one, two, two]);
    std::fs::remove_file(&paths[2]).expect("rm");
    let err = GgufFile::open(&paths[0])
        .expect_err("a part missing")
        .to_string();
    assert!(err.contains("missing-00003-of-00003.gguf"), "{err}");

    let paths = write_split(dir.path(), "dup", &[one, one]);
    let err = GgufFile::open(&paths[0])
        .expect_err("duplicate")
        .to_string();
    assert!(err.contains("tensor 'a' is in two parts"), "{err}");

    let paths = write_split(dir.path(), "second", &[one, two]);
    let err = GgufFile::open(&paths[1]).expect_err("not first");
    assert!(matches!(err, GgufError::Split { .. }), "{err}");

    // Part 2 and 3 swapped on disk: each says which part it is.
    let paths = write_split(dir.path(), "swap", &[one, two, &[("c", vec![3.0])]]);
    let tmp = dir.path().join("tmp");
    std::fs::rename(&paths[1], &tmp).expect("mv");
    std::fs::rename(&paths[2], &paths[1]).expect("mv");
    std::fs::rename(&tmp, &paths[2]).expect("mv");
    let err = GgufFile::open(&paths[0]).expect_err("swapped").to_string();
    assert!(err.contains("does not say it is part 2 of 3"), "{err}");

    let paths = write_split(dir.path(), "renamed", &[one, two]);
    let odd = dir.path().join("renamed.gguf");
    std::fs::rename(&paths[0], &odd).expect("mv");
    let err = GgufFile::open(&odd).expect_err("misnamed").to_string();
    assert!(err.contains("-00001-of-00002.gguf"), "{err}");
}

/// A view of some rows of a tensor in a later part (how Phi-3's fused `attn_qkv` loads its
/// Q, K and V) reads that part's bytes, whatever the view is called.
#[test]
fn a_view_of_a_tensor_reads_its_own_part() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a: Vec<f32> = (0..8).map(|i| i as f32).collect();
    let b: Vec<f32> = (0..8).map(|i| 100.0 + i as f32).collect();
    let paths = write_split(dir.path(), "v", &[&[("a", a)], &[("b", b.clone())]]);
    let file = GgufFile::open(&paths[0]).expect("open split");
    let info = file.tensor("b").expect("b");
    assert_eq!(info.part, 1);
    let view = kestrel_gguf::TensorInfo {
        name: "b (rows 2..5)".into(),
        dims: vec![3],
        offset: info.offset + 2 * 4,
        ..info.clone()
    };
    let got: Vec<f32> = file
        .tensor_data(&view)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(got, b[2..5]);
}
