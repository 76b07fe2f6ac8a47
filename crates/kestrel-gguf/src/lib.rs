//! GGUF reading and writing.
//!
//! [`GgufFile`] parses a GGUF (version 2 or 3) file, memory-mapped or from bytes, and
//! hands out tensor data as zero-copy slices. Every malformed input gives a [`GgufError`]
//! naming the problem and its byte offset; counts read from the file are checked against
//! the bytes that remain before anything is allocated for them.
//!
//! [`GgufWriter`] builds a file from metadata and tensors, either all in memory or
//! streaming tensor data after the header so large files never sit in memory.
//!
//! Layout (little-endian): magic `GGUF`, u32 version, u64 tensor count, u64 metadata
//! count, the metadata pairs, the tensor table, padding to the alignment, then the tensor
//! data, each tensor at its (aligned) offset relative to the start of the data section.
//!
//! ```
//! use kestrel_gguf::{GgmlType, GgufFile, GgufWriter, Value, ValueType};
//!
//! # fn main() -> Result<(), kestrel_gguf::GgufError> {
//! let mut writer = GgufWriter::new();
//! writer.add_metadata("general.architecture", "llama")?;
//! writer.add_metadata("llama.block_count", 2u32)?;
//! let tokens = ["<s>", "hi"].map(|t| Value::String(t.into())).to_vec();
//! writer.add_metadata("tokenizer.ggml.tokens", Value::Array(ValueType::String, tokens))?;
//! // Small files: give the data with the declaration. Large ones: `add_tensor`, then
//! // `stream_to_path` and `write_tensor`/`write_chunk` for each tensor in order.
//! let data: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0].iter().flat_map(|x| x.to_le_bytes()).collect();
//! writer.add_tensor_with_data("output_norm.weight", &[4], GgmlType::F32, data)?;
//! let bytes = writer.write_to_vec()?;
//!
//! let file = GgufFile::from_bytes(bytes)?; // or GgufFile::open(path), memory-mapped
//! assert_eq!(file.architecture(), Some("llama"));
//! assert_eq!(file.get_u64("llama.block_count"), Some(2));
//! let norm = file.tensor("output_norm.weight").unwrap();
//! assert_eq!((norm.n_elements(), norm.ty), (4, GgmlType::F32));
//! assert_eq!(&file.tensor_data(norm)[4..8], &2.0f32.to_le_bytes());
//! # Ok(())
//! # }
//! ```

mod cursor;
mod error;
mod reader;
mod tensor;
mod value;
mod writer;

pub use error::GgufError;
pub use kestrel_quant::GgmlType;
pub use reader::{
    ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, GgufFile, MAX_ARRAY_DEPTH, SPLIT_COUNT_KEY,
    SPLIT_NO_KEY,
};
pub use tensor::{GGML_MAX_DIMS, TensorInfo};
pub use value::{Value, ValueType};
pub use writer::{FileStream, GgufWriter, MAX_TENSOR_NAME_LEN, TensorStream};
