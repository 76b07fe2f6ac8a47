use std::collections::{HashMap, HashSet};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use kestrel_quant::GgmlType;

use crate::reader::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_ARRAY_DEPTH};
use crate::reader::{align_up, alignment_from_value};
use crate::tensor::checked_tensor_bytes;
use crate::{GgufError, GgufFile, TensorInfo, Value, ValueType};

/// Longest tensor name llama.cpp accepts (its `GGML_MAX_NAME` is 64 including the NUL).
pub const MAX_TENSOR_NAME_LEN: usize = 63;

/// Builds a GGUF file: metadata (kept in insertion order) and a tensor table whose data
/// offsets are laid out in declaration order, each aligned.
///
/// Two ways to write:
/// - in memory: give each tensor its bytes with [`add_tensor_with_data`](Self::add_tensor_with_data),
///   then [`write_to_vec`](Self::write_to_vec), [`write_to_path`](Self::write_to_path) or
///   [`write_to`](Self::write_to);
/// - streaming: declare tensors with [`add_tensor`](Self::add_tensor), call
///   [`stream_to`](Self::stream_to) or [`stream_to_path`](Self::stream_to_path), which write
///   the header, then hand the returned stream each tensor's bytes in declaration order.
///
/// Both can be mixed: tensors declared with data are written by the stream on their own.
#[derive(Clone)]
pub struct GgufWriter {
    version: u32,
    metadata: Vec<(String, Value)>,
    key_index: HashMap<String, usize>,
    alignment: u64,
    tensors: Vec<TensorInfo>,
    tensor_names: HashSet<String>,
    /// In-memory data for tensors declared with it.
    data: Vec<Option<Vec<u8>>>,
}

impl std::fmt::Debug for GgufWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not derived: the in-memory tensor data can be large.
        f.debug_struct("GgufWriter")
            .field("version", &self.version)
            .field("alignment", &self.alignment)
            .field("n_metadata", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    /// An empty version-3 file.
    pub fn new() -> Self {
        GgufWriter {
            version: 3,
            metadata: Vec::new(),
            key_index: HashMap::new(),
            alignment: DEFAULT_ALIGNMENT,
            tensors: Vec::new(),
            tensor_names: HashSet::new(),
            data: Vec::new(),
        }
    }

    /// A writer holding the version, metadata and tensor declarations of `file`, with no
    /// tensor data: stream it, e.g. from `file.tensor_data`.
    pub fn from_gguf(file: &GgufFile) -> Result<Self, GgufError> {
        let mut writer = GgufWriter::new();
        writer.set_version(file.version())?;
        for (key, value) in file.metadata() {
            writer.add_metadata(key.clone(), value.clone())?;
        }
        for info in file.tensors() {
            writer.add_tensor(info.name.clone(), &info.dims, info.ty)?;
        }
        Ok(writer)
    }

    /// Sets the format version (2 or 3; they differ only in big-endian support).
    pub fn set_version(&mut self, version: u32) -> Result<(), GgufError> {
        if !matches!(version, 2 | 3) {
            return Err(GgufError::Writer(format!(
                "cannot write GGUF version {version}; only 2 and 3 are supported"
            )));
        }
        self.version = version;
        Ok(())
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment of tensor data: `general.alignment` if set, else 32.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Adds a metadata pair at the end. Fails if the key exists or the value cannot be
    /// written (array elements not of the declared type, too deeply nested arrays, an
    /// invalid `general.alignment`).
    pub fn add_metadata(
        &mut self,
        key: impl Into<String>,
        value: impl Into<Value>,
    ) -> Result<(), GgufError> {
        let key = key.into();
        if self.key_index.contains_key(&key) {
            return Err(GgufError::Writer(format!("duplicate metadata key '{key}'")));
        }
        let value = value.into();
        self.check_metadata(&key, &value)?;
        self.key_index.insert(key.clone(), self.metadata.len());
        self.metadata.push((key, value));
        self.after_metadata_change();
        Ok(())
    }

    /// Sets a metadata pair: replaces the value in place if the key exists, else appends.
    pub fn set_metadata(
        &mut self,
        key: impl Into<String>,
        value: impl Into<Value>,
    ) -> Result<(), GgufError> {
        let key = key.into();
        let value = value.into();
        self.check_metadata(&key, &value)?;
        match self.key_index.get(&key) {
            Some(&i) => self.metadata[i].1 = value,
            None => {
                self.key_index.insert(key.clone(), self.metadata.len());
                self.metadata.push((key, value));
            }
        }
        self.after_metadata_change();
        Ok(())
    }

    /// Removes a metadata pair, returning its value.
    pub fn remove_metadata(&mut self, key: &str) -> Option<Value> {
        let index = self.key_index.remove(key)?;
        let (_, value) = self.metadata.remove(index);
        for slot in self.key_index.values_mut() {
            if *slot > index {
                *slot -= 1;
            }
        }
        self.after_metadata_change();
        Some(value)
    }

    /// The metadata, in the order it will be written.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The value of a metadata key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn check_metadata(&self, key: &str, value: &Value) -> Result<(), GgufError> {
        check_value(value, 0)
            .map_err(|reason| GgufError::Writer(format!("metadata key '{key}': {reason}")))?;
        if key == ALIGNMENT_KEY {
            alignment_from_value(value)
                .map_err(|reason| GgufError::Writer(format!("{ALIGNMENT_KEY}: {reason}")))?;
        }
        Ok(())
    }

    /// Keeps the alignment and tensor offsets in step with `general.alignment`.
    fn after_metadata_change(&mut self) {
        let alignment = self
            .get(ALIGNMENT_KEY)
            .and_then(|v| alignment_from_value(v).ok())
            .unwrap_or(DEFAULT_ALIGNMENT);
        if alignment != self.alignment {
            self.alignment = alignment;
            self.relayout();
        }
    }

    fn relayout(&mut self) {
        let mut next = 0u64;
        for info in &mut self.tensors {
            // Sizes were checked when each tensor was added and their sum stays far below
            // u64::MAX (each is below 2^63 and data must fit in a file), but stay total.
            info.offset = align_up(next, self.alignment).unwrap_or(u64::MAX);
            next = info.offset.saturating_add(info.n_bytes());
        }
    }

    /// Where the next tensor's data would start, relative to the data section.
    fn next_offset(&self) -> Result<u64, GgufError> {
        let end = match self.tensors.last() {
            Some(last) => last.offset.checked_add(last.n_bytes()),
            None => Some(0),
        };
        end.and_then(|end| align_up(end, self.alignment))
            .ok_or_else(|| GgufError::Writer("tensor data exceeds u64 bytes".into()))
    }

    /// Declares a tensor whose data will be streamed. Returns its table entry (with the
    /// data offset it was given).
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
    ) -> Result<&TensorInfo, GgufError> {
        self.push_tensor(name.into(), dims, ty, None)
    }

    /// Declares a tensor together with its data (`data.len()` must be its byte size).
    pub fn add_tensor_with_data(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
        data: Vec<u8>,
    ) -> Result<&TensorInfo, GgufError> {
        self.push_tensor(name.into(), dims, ty, Some(data))
    }

    fn push_tensor(
        &mut self,
        name: String,
        dims: &[u64],
        ty: GgmlType,
        data: Option<Vec<u8>>,
    ) -> Result<&TensorInfo, GgufError> {
        if name.len() > MAX_TENSOR_NAME_LEN {
            return Err(GgufError::Writer(format!(
                "tensor name '{name}' is {} bytes, longer than llama.cpp's limit of {MAX_TENSOR_NAME_LEN}",
                name.len()
            )));
        }
        if self.tensor_names.contains(&name) {
            return Err(GgufError::Writer(format!("duplicate tensor name '{name}'")));
        }
        let n_bytes = checked_tensor_bytes(dims, ty)
            .map_err(|reason| GgufError::Writer(format!("tensor '{name}': {reason}")))?;
        if let Some(len) = data.as_ref().map(Vec::len).filter(|&l| l as u64 != n_bytes) {
            return Err(GgufError::Writer(format!(
                "tensor '{name}' ({ty}, shape {dims:?}) needs {n_bytes} bytes of data, got {len}"
            )));
        }
        let offset = self.next_offset()?;
        offset
            .checked_add(n_bytes)
            .ok_or_else(|| GgufError::Writer("tensor data exceeds u64 bytes".into()))?;
        self.tensor_names.insert(name.clone());
        self.tensors.push(TensorInfo {
            name,
            dims: dims.to_vec(),
            ty,
            offset,
            part: 0,
        });
        self.data.push(data);
        Ok(&self.tensors[self.tensors.len() - 1])
    }

    /// The tensor table, in declaration (and data) order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Size of the header, metadata and tensor table before padding.
    fn header_len(&self) -> u64 {
        let mut counter = CountingSink(0);
        // Writing to a counter cannot fail.
        let _ = self.write_header_unpadded(&mut counter);
        counter.0
    }

    /// Absolute file offset of the data section.
    pub fn data_offset(&self) -> u64 {
        align_up(self.header_len(), self.alignment).unwrap_or(u64::MAX)
    }

    /// Size of the finished file in bytes.
    pub fn file_size(&self) -> u64 {
        let data_len = match self.tensors.last() {
            Some(last) => align_up(last.offset.saturating_add(last.n_bytes()), self.alignment)
                .unwrap_or(u64::MAX),
            None => 0,
        };
        self.data_offset().saturating_add(data_len)
    }

    fn write_header_unpadded(&self, w: &mut impl Write) -> io::Result<()> {
        w.write_all(&GGUF_MAGIC)?;
        w.write_all(&self.version.to_le_bytes())?;
        w.write_all(&(self.tensors.len() as u64).to_le_bytes())?;
        w.write_all(&(self.metadata.len() as u64).to_le_bytes())?;
        for (key, value) in &self.metadata {
            write_string(w, key)?;
            w.write_all(&value.value_type().id().to_le_bytes())?;
            write_value(w, value)?;
        }
        for info in &self.tensors {
            write_string(w, &info.name)?;
            w.write_all(&(info.dims.len() as u32).to_le_bytes())?;
            for dim in &info.dims {
                w.write_all(&dim.to_le_bytes())?;
            }
            w.write_all(&info.ty.id().to_le_bytes())?;
            w.write_all(&info.offset.to_le_bytes())?;
        }
        Ok(())
    }

    /// Writes the header, then returns a stream that takes the tensor data in order.
    pub fn stream_to<W: Write>(self, mut w: W) -> Result<TensorStream<W>, GgufError> {
        let header_len = self.header_len();
        self.write_header_unpadded(&mut w)
            .map_err(GgufError::Write)?;
        write_zeros(
            &mut w,
            align_up(header_len, self.alignment).unwrap_or(header_len) - header_len,
        )
        .map_err(GgufError::Write)?;
        let mut stream = TensorStream {
            sink: w,
            alignment: self.alignment,
            tensors: self.tensors,
            data: self.data,
            current: 0,
            written: 0,
            failed: false,
        };
        stream.write_stored()?;
        Ok(stream)
    }

    /// Like [`stream_to`](Self::stream_to), into a temporary file next to `path` that
    /// [`FileStream::finish`] renames to `path`.
    pub fn stream_to_path(self, path: impl AsRef<Path>) -> Result<FileStream, GgufError> {
        let path = path.as_ref().to_owned();
        let temp = create_temp_beside(&path)?;
        let stream = self.stream_to(BufWriter::with_capacity(1 << 20, temp))?;
        Ok(FileStream { stream, path })
    }

    /// Writes the whole file; every tensor must have been given its data.
    pub fn write_to<W: Write>(self, w: W) -> Result<W, GgufError> {
        self.check_all_data()?;
        self.stream_to(w)?.finish()
    }

    /// The whole file in memory; every tensor must have been given its data.
    pub fn write_to_vec(self) -> Result<Vec<u8>, GgufError> {
        self.check_all_data()?;
        let capacity = usize::try_from(self.file_size()).unwrap_or(0);
        self.write_to(Vec::with_capacity(capacity))
    }

    /// Writes the whole file to `path` (through a temporary file in the same directory,
    /// renamed at the end); every tensor must have been given its data.
    pub fn write_to_path(self, path: impl AsRef<Path>) -> Result<(), GgufError> {
        self.check_all_data()?;
        self.stream_to_path(path)?.finish()
    }

    fn check_all_data(&self) -> Result<(), GgufError> {
        match self.data.iter().position(Option::is_none) {
            Some(i) => Err(GgufError::Writer(format!(
                "tensor '{}' was declared without data; use stream_to to supply it",
                self.tensors[i].name
            ))),
            None => Ok(()),
        }
    }
}

/// Writes tensor data after the header, in declaration order, padding each tensor to the
/// alignment. Obtained from [`GgufWriter::stream_to`].
pub struct TensorStream<W: Write> {
    sink: W,
    alignment: u64,
    tensors: Vec<TensorInfo>,
    data: Vec<Option<Vec<u8>>>,
    /// Index of the tensor whose data comes next.
    current: usize,
    /// Bytes of the current tensor written so far.
    written: u64,
    /// Set after a write error: the output is incomplete and must not be finished.
    failed: bool,
}

impl<W: Write> TensorStream<W> {
    /// The tensor whose data is expected next, or `None` when all are written.
    pub fn next_tensor(&self) -> Option<&TensorInfo> {
        self.tensors.get(self.current)
    }

    /// Writes the entire data of the next tensor.
    pub fn write_tensor(&mut self, data: &[u8]) -> Result<(), GgufError> {
        let info = self.expect_tensor()?;
        if self.written != 0 || data.len() as u64 != info.n_bytes() {
            return Err(GgufError::Writer(format!(
                "tensor '{}' needs {} bytes of data, got {}{}",
                info.name,
                info.n_bytes(),
                data.len(),
                if self.written != 0 {
                    format!(
                        " after {} bytes were already written in chunks",
                        self.written
                    )
                } else {
                    String::new()
                }
            )));
        }
        self.write_chunk(data)
    }

    /// Writes part of the next tensor's data; once its size is reached the stream moves on
    /// to the following tensor. A chunk may not extend past the current tensor.
    pub fn write_chunk(&mut self, chunk: &[u8]) -> Result<(), GgufError> {
        let info = self.expect_tensor()?;
        let size = info.n_bytes();
        let left = size - self.written;
        if chunk.len() as u64 > left {
            return Err(GgufError::Writer(format!(
                "chunk of {} bytes overruns tensor '{}', which has {left} of {size} bytes left",
                chunk.len(),
                info.name,
            )));
        }
        self.io(|s| s.sink.write_all(chunk))?;
        self.written += chunk.len() as u64;
        if self.written == size {
            self.end_tensor()?;
            self.write_stored()?;
        }
        Ok(())
    }

    /// Checks every tensor was written, flushes, and returns the sink.
    pub fn finish(mut self) -> Result<W, GgufError> {
        if self.failed {
            return Err(GgufError::Writer(
                "cannot finish after a write error".into(),
            ));
        }
        if let Some(info) = self.tensors.get(self.current) {
            return Err(GgufError::Writer(format!(
                "finished before the data of tensor '{}' ({} of {} bytes written) and {} more",
                info.name,
                self.written,
                info.n_bytes(),
                self.tensors.len() - self.current - 1
            )));
        }
        self.io(|s| s.sink.flush())?;
        Ok(self.sink)
    }

    fn expect_tensor(&self) -> Result<&TensorInfo, GgufError> {
        if self.failed {
            return Err(GgufError::Writer(
                "stream unusable after a write error".into(),
            ));
        }
        self.tensors
            .get(self.current)
            .ok_or_else(|| GgufError::Writer("all tensors are already written".into()))
    }

    fn io(&mut self, op: impl FnOnce(&mut Self) -> io::Result<()>) -> Result<(), GgufError> {
        op(self).map_err(|e| {
            self.failed = true;
            GgufError::Write(e)
        })
    }

    /// Pads the finished tensor and moves to the next one.
    fn end_tensor(&mut self) -> Result<(), GgufError> {
        let size = self.tensors[self.current].n_bytes();
        let padding = align_up(size, self.alignment).unwrap_or(size) - size;
        self.io(|s| write_zeros(&mut s.sink, padding))?;
        self.data[self.current] = None;
        self.current += 1;
        self.written = 0;
        Ok(())
    }

    /// Writes the tensors from `current` on that were declared with their data.
    fn write_stored(&mut self) -> Result<(), GgufError> {
        while let Some(Some(_)) = self.data.get(self.current) {
            let data = self.data[self.current].take().unwrap_or_default();
            self.io(|s| s.sink.write_all(&data))?;
            self.end_tensor()?;
        }
        Ok(())
    }
}

/// A [`TensorStream`] into a temporary file that becomes the target path on `finish`.
/// Dropped without `finish`, the temporary file is deleted.
pub struct FileStream {
    stream: TensorStream<BufWriter<tempfile::NamedTempFile>>,
    path: PathBuf,
}

impl FileStream {
    /// The tensor whose data is expected next.
    pub fn next_tensor(&self) -> Option<&TensorInfo> {
        self.stream.next_tensor()
    }

    /// See [`TensorStream::write_tensor`].
    pub fn write_tensor(&mut self, data: &[u8]) -> Result<(), GgufError> {
        self.stream.write_tensor(data)
    }

    /// See [`TensorStream::write_chunk`].
    pub fn write_chunk(&mut self, chunk: &[u8]) -> Result<(), GgufError> {
        self.stream.write_chunk(chunk)
    }

    /// Checks every tensor was written, syncs the file and renames it to the target path.
    pub fn finish(self) -> Result<(), GgufError> {
        let path = self.path;
        let io_err = |action, source| GgufError::Io {
            action,
            path: path.clone(),
            source,
        };
        let temp = self
            .stream
            .finish()?
            .into_inner()
            .map_err(|e| io_err("cannot write", e.into_error()))?;
        temp.as_file()
            .sync_all()
            .map_err(|e| io_err("cannot sync", e))?;
        temp.persist(&path)
            .map_err(|e| io_err("cannot rename the temporary file to", e.error))?;
        Ok(())
    }
}

fn create_temp_beside(path: &Path) -> Result<tempfile::NamedTempFile, GgufError> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "gguf".into());
    let prefix = format!(".{file_name}.");
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix).suffix(".tmp");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        // The umask still applies, as for any newly created file.
        builder.permissions(std::fs::Permissions::from_mode(0o644));
    }
    builder.tempfile_in(dir).map_err(|source| GgufError::Io {
        action: "cannot create a temporary file for",
        path: path.to_owned(),
        source,
    })
}

/// Checks that a value can be written and read back: array elements match the declared
/// element type, and arrays do not nest deeper than the reader accepts.
fn check_value(value: &Value, depth: usize) -> Result<(), String> {
    let Value::Array(elem, items) = value else {
        return Ok(());
    };
    if *elem == ValueType::Array && depth + 1 >= MAX_ARRAY_DEPTH {
        return Err(format!(
            "arrays nested deeper than {MAX_ARRAY_DEPTH} levels"
        ));
    }
    for (i, item) in items.iter().enumerate() {
        if item.value_type() != *elem {
            return Err(format!(
                "array of {elem} has a {} at index {i}",
                item.value_type()
            ));
        }
        check_value(item, depth + 1)?;
    }
    Ok(())
}

fn write_string(w: &mut impl Write, s: &str) -> io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

fn write_value(w: &mut impl Write, value: &Value) -> io::Result<()> {
    match value {
        Value::U8(v) => w.write_all(&[*v]),
        Value::I8(v) => w.write_all(&v.to_le_bytes()),
        Value::U16(v) => w.write_all(&v.to_le_bytes()),
        Value::I16(v) => w.write_all(&v.to_le_bytes()),
        Value::U32(v) => w.write_all(&v.to_le_bytes()),
        Value::I32(v) => w.write_all(&v.to_le_bytes()),
        Value::F32(v) => w.write_all(&v.to_le_bytes()),
        Value::Bool(v) => w.write_all(&[u8::from(*v)]),
        Value::String(s) => write_string(w, s),
        Value::Array(elem, items) => {
            w.write_all(&elem.id().to_le_bytes())?;
            w.write_all(&(items.len() as u64).to_le_bytes())?;
            items.iter().try_for_each(|item| write_value(w, item))
        }
        Value::U64(v) => w.write_all(&v.to_le_bytes()),
        Value::I64(v) => w.write_all(&v.to_le_bytes()),
        Value::F64(v) => w.write_all(&v.to_le_bytes()),
    }
}

fn write_zeros(w: &mut impl Write, n: u64) -> io::Result<()> {
    const ZEROS: [u8; 256] = [0; 256];
    let mut left = n;
    while left > 0 {
        let step = left.min(ZEROS.len() as u64) as usize;
        w.write_all(&ZEROS[..step])?;
        left -= step as u64;
    }
    Ok(())
}

/// A writer that only counts bytes, to measure the header.
struct CountingSink(u64);

impl Write for CountingSink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0 += buf.len() as u64;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
