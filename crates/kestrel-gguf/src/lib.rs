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

mod cursor;
mod error;
mod reader;
mod tensor;
mod value;
mod writer;

pub use error::GgufError;
pub use kestrel_quant::GgmlType;
pub use reader::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, GgufFile, MAX_ARRAY_DEPTH};
pub use tensor::{GGML_MAX_DIMS, TensorInfo};
pub use value::{Value, ValueType};
pub use writer::{FileStream, GgufWriter, MAX_TENSOR_NAME_LEN, TensorStream};
