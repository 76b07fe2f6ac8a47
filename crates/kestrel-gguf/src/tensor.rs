use kestrel_quant::GgmlType;

/// Most dimensions a GGML tensor can have.
pub const GGML_MAX_DIMS: usize = 4;

/// One entry of the tensor table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// Shape, innermost first: `dims[0]` is the row length (GGML's `ne[0]`).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Start of the data relative to the data section (`GgufFile::data_offset`) of its
    /// file.
    pub offset: u64,
    /// Which file of a split model holds the data (0: the first). A view of part of a
    /// tensor (rows of a fused matrix) keeps its tensor's part.
    pub part: usize,
}

impl TensorInfo {
    /// Number of values (product of `dims`; saturates at `u64::MAX`, which a file that
    /// parsed cannot reach).
    pub fn n_elements(&self) -> u64 {
        self.dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .unwrap_or(u64::MAX)
    }

    /// Size of the data in bytes (whole blocks; a parsed file's tensors always hold
    /// whole blocks).
    pub fn n_bytes(&self) -> u64 {
        let blocks = self.n_elements() / self.ty.block_size() as u64;
        blocks.saturating_mul(self.ty.type_size() as u64)
    }

    /// Values per row (`dims[0]`; 1 for a tensor without dimensions).
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Number of rows (product of every dimension but the first).
    pub fn n_rows(&self) -> u64 {
        self.dims
            .iter()
            .skip(1)
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .unwrap_or(u64::MAX)
    }

    /// Bytes in one row.
    pub fn row_bytes(&self) -> u64 {
        (self.row_len() / self.ty.block_size() as u64).saturating_mul(self.ty.type_size() as u64)
    }
}

/// Checks a shape and type, returning the data size in bytes, or a reason why the
/// combination is not a valid tensor.
pub(crate) fn checked_tensor_bytes(dims: &[u64], ty: GgmlType) -> Result<u64, String> {
    if dims.is_empty() {
        return Err("tensor has zero dimensions".into());
    }
    if dims.len() > GGML_MAX_DIMS {
        return Err(format!(
            "tensor has {} dimensions, more than the maximum {GGML_MAX_DIMS}",
            dims.len()
        ));
    }
    if let Some(axis) = dims.iter().position(|&d| d == 0) {
        return Err(format!("dimension {axis} of shape {dims:?} is zero"));
    }
    let n = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| format!("element count of shape {dims:?} overflows u64"))?;
    // GGML addresses elements with i64: keep the count within it.
    if n > i64::MAX as u64 {
        return Err(format!("element count of shape {dims:?} exceeds i64::MAX"));
    }
    let block = ty.block_size() as u64;
    if dims[0] % block != 0 {
        return Err(format!(
            "row length {} is not a multiple of the {ty} block size {block}",
            dims[0]
        ));
    }
    ty.bytes_for(n)
        .ok_or_else(|| format!("byte size of shape {dims:?} of type {ty} overflows u64"))
}
