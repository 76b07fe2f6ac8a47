//! GGML block formats: layouts, dequantization, quantization and reference dot products.
//!
//! Every format is a sequence of fixed-size blocks, each holding `block_size()` values in
//! `type_size()` bytes. Rows of a weight matrix are whole numbers of blocks.

mod types;

pub use types::GgmlType;
