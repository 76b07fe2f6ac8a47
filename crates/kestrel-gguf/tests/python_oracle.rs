//! Cross-checks against llama.cpp's gguf-py (an independent implementation): files it
//! writes parse the same here and are rebuilt byte for byte by our writer; files our
//! writer makes parse in gguf-py to what we put in.

mod common;

use common::{assert_matches_dump, python_oracle, random_spec};
use kestrel_gguf::{GgufFile, GgufWriter};

#[test]
fn files_written_by_gguf_py_parse_identically_and_rebuild_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let dumps = python_oracle(&["write", "0", "40", dir.path().to_str().unwrap()]);
    for (seed, dump) in dumps.as_array().unwrap().iter().enumerate() {
        let file = GgufFile::open(dir.path().join(format!("py-{seed}.gguf"))).unwrap();
        assert_matches_dump(&file, dump);

        let mut stream = GgufWriter::from_gguf(&file)
            .unwrap()
            .stream_to(Vec::new())
            .unwrap();
        for info in file.tensors() {
            stream.write_tensor(file.tensor_data(info)).unwrap();
        }
        assert!(stream.finish().unwrap() == file.as_bytes(), "seed {seed}");
    }
}

#[test]
fn files_written_here_parse_in_gguf_py() {
    let dir = tempfile::tempdir().unwrap();
    let specs: Vec<_> = (1000..1060).map(random_spec).collect();
    let paths: Vec<String> = (0..specs.len())
        .map(|i| {
            dir.path()
                .join(format!("ours-{i}.gguf"))
                .to_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    for (spec, path) in specs.iter().zip(&paths) {
        spec.writer().write_to_path(path).unwrap();
    }
    let mut args = vec!["dump"];
    args.extend(paths.iter().map(String::as_str));
    let dumps = python_oracle(&args);
    assert_eq!(dumps.as_array().unwrap().len(), specs.len());
    for ((spec, path), dump) in specs.iter().zip(&paths).zip(dumps.as_array().unwrap()) {
        let file = GgufFile::open(path).unwrap();
        common::assert_matches_spec(&file, spec);
        assert_matches_dump(&file, dump);
    }
}
