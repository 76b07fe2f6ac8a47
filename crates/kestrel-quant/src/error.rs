use crate::GgmlType;

/// What went wrong converting between f32 values and a block format.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    /// The type has no dequantizer here (integer types, f64).
    #[error("dequantizing {0} is not supported")]
    DequantizeUnsupported(GgmlType),
    /// The type has no quantizer here.
    #[error("quantizing to {0} is not supported")]
    QuantizeUnsupported(GgmlType),
    /// A value count that is not a whole number of blocks.
    #[error("{n} values is not a whole number of {ty} blocks ({block_size} values each)")]
    NotWholeBlocks {
        ty: GgmlType,
        n: usize,
        block_size: usize,
    },
    /// The byte buffer does not have the size that the value count needs.
    #[error("{ty}: {n} values take {expected} bytes, but the buffer has {actual}")]
    ByteLength {
        ty: GgmlType,
        n: usize,
        expected: usize,
        actual: usize,
    },
    /// A byte buffer that is not a whole number of blocks.
    #[error("{len} bytes is not a whole number of {ty} blocks ({type_size} bytes each)")]
    NotWholeBlockBytes {
        ty: GgmlType,
        len: usize,
        type_size: usize,
    },
    /// A row length of zero, or values that are not a whole number of rows.
    #[error("{n} values cannot be split into rows of {row_len}")]
    BadRowLength { n: usize, row_len: usize },
    /// The activations do not match the quantized row in length.
    #[error("{ty}: the row holds {row_values} values but {x_len} activations were given")]
    DotLength {
        ty: GgmlType,
        row_values: usize,
        x_len: usize,
    },
}
