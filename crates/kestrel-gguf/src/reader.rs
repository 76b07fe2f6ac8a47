use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fs::File;
use std::path::Path;

use kestrel_quant::GgmlType;
use memmap2::Mmap;

use crate::cursor::Cursor;
use crate::error::shorten;
use crate::tensor::{GGML_MAX_DIMS, checked_tensor_bytes};
use crate::{GgufError, TensorInfo, Value, ValueType};

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Metadata key that overrides the alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// Deepest nesting of arrays inside arrays the reader accepts (bounds recursion).
pub const MAX_ARRAY_DEPTH: usize = 64;

/// Fewest bytes one key/value pair can take: key length (8), value type (4), 1-byte value.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
/// Fewest bytes one tensor info can take: name length (8), n_dims (4), one dim (8),
/// type (4), offset (8).
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 8 + 4 + 8;

enum Storage {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(map) => map,
            Storage::Owned(vec) => vec,
        }
    }
}

/// A parsed GGUF file: header, metadata and tensor table, with the tensor data left in
/// place (memory-mapped or in an owned buffer) and handed out as slices.
///
/// A model split by llama.cpp's `gguf-split` (`NAME-00001-of-0000N.gguf`, metadata
/// `split.count`) opens as one: [`GgufFile::open`] on the first part maps every part, and the
/// tensor table holds the tensors of all of them (the metadata is the first part's).
pub struct GgufFile {
    storage: Storage,
    /// The other parts of a split model: their storage and data offset.
    parts: Vec<(Storage, u64)>,
    /// Per tensor (same index as `tensors`): 0 for this file, `k` for `parts[k - 1]`.
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, Value)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .field("n_metadata", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .field("file_size", &self.file_size())
            .finish()
    }
}

/// Metadata keys of a split model.
pub const SPLIT_COUNT_KEY: &str = "split.count";
pub const SPLIT_NO_KEY: &str = "split.no";

impl GgufFile {
    /// Memory-maps and parses the file at `path`; for the first part of a split model, the
    /// other parts too (beside it, named `NAME-0000k-of-0000N.gguf`), as one model.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref();
        let mut file = Self::open_part(path)?;
        let count = file.get_u64(SPLIT_COUNT_KEY).unwrap_or(1);
        if count <= 1 {
            return Ok(file);
        }
        let split_err = |msg: String| GgufError::Split {
            path: path.to_owned(),
            message: msg,
        };
        if file.get_u64(SPLIT_NO_KEY).unwrap_or(0) != 0 {
            return Err(split_err(
                "this is not the first part of a split model; open the -00001-of- file".into(),
            ));
        }
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let suffix = format!("-00001-of-{count:05}.gguf");
        let Some(stem) = name.strip_suffix(&suffix) else {
            return Err(split_err(format!(
                "split.count is {count}, but the file name does not end in {suffix}"
            )));
        };
        for k in 2..=count {
            let part_path = path.with_file_name(format!("{stem}-{k:05}-of-{count:05}.gguf"));
            let part = Self::open_part(&part_path)?;
            if part.get_u64(SPLIT_NO_KEY) != Some(k - 1)
                || part.get_u64(SPLIT_COUNT_KEY) != Some(count)
            {
                return Err(split_err(format!(
                    "{} does not say it is part {k} of {count}",
                    part_path.display()
                )));
            }
            file.append_part(part).map_err(split_err)?;
        }
        Ok(file)
    }

    /// Adds the tensors of another part of a split model.
    fn append_part(&mut self, part: GgufFile) -> Result<(), String> {
        let index = self.parts.len() + 1;
        for info in part.tensors {
            match self.tensor_index.entry(info.name.clone()) {
                Entry::Occupied(_) => {
                    return Err(format!("tensor '{}' is in two parts", shorten(&info.name)));
                }
                Entry::Vacant(slot) => {
                    slot.insert(self.tensors.len());
                }
            }
            self.tensors.push(TensorInfo {
                part: index,
                ..info
            });
        }
        self.parts.push((part.storage, part.data_offset));
        Ok(())
    }

    /// Memory-maps and parses one file, whatever its `split.*` metadata says.
    pub fn open_part(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref();
        let io_err = |action, source| GgufError::Io {
            action,
            path: path.to_owned(),
            source,
        };
        let file = File::open(path).map_err(|e| io_err("cannot open", e))?;
        let len = file.metadata().map_err(|e| io_err("cannot stat", e))?.len();
        let storage = if len == 0 {
            Storage::Owned(Vec::new())
        } else {
            // SAFETY: the map is read-only. As with every mmap-based reader, another
            // process truncating or rewriting the file while it is mapped is outside what
            // this program can guard against.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| io_err("cannot memory-map", e))?;
            Storage::Mapped(map)
        };
        Self::parse(storage)
    }

    /// Parses a GGUF file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        Self::parse(Storage::Owned(bytes))
    }

    fn parse(storage: Storage) -> Result<GgufFile, GgufError> {
        let header = parse_header(storage.bytes())?;
        let key_index = header
            .metadata
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (k.clone(), i))
            .collect();
        let tensor_index = header
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(GgufFile {
            storage,
            parts: Vec::new(),
            version: header.version,
            alignment: header.alignment,
            data_offset: header.data_offset,
            metadata: header.metadata,
            key_index,
            tensors: header.tensors,
            tensor_index,
        })
    }

    /// Format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment of tensor data (from `general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute file offset where the tensor data section starts.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Size of the whole file in bytes.
    pub fn file_size(&self) -> u64 {
        self.storage.bytes().len() as u64
    }

    /// The whole file.
    pub fn as_bytes(&self) -> &[u8] {
        self.storage.bytes()
    }

    /// Every metadata pair, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The value of a metadata key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// A string value (`None` if absent or not a string).
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key)?.as_str()
    }

    /// A numeric value as `u64` (see [`Value::as_u64`]).
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key)?.as_u64()
    }

    /// A numeric value as `i64` (see [`Value::as_i64`]).
    pub fn get_i64(&self, key: &str) -> Option<i64> {
        self.get(key)?.as_i64()
    }

    /// A numeric value as `f32` (see [`Value::as_f32`]).
    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.get(key)?.as_f32()
    }

    /// A numeric value as `f64` (see [`Value::as_f64`]).
    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.get(key)?.as_f64()
    }

    /// A boolean value.
    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.get(key)?.as_bool()
    }

    /// The elements of an array value.
    pub fn get_array(&self, key: &str) -> Option<&[Value]> {
        self.get(key)?.as_array()
    }

    /// `general.architecture` (e.g. `llama`, `qwen2`, `gemma3`).
    pub fn architecture(&self) -> Option<&str> {
        self.get_str("general.architecture")
    }

    /// The tensor table, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// A tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The data of a tensor of this file (zero-copy), from whichever part of a split model
    /// holds it. Every tensor of a parsed file lies within its file; for a `TensorInfo` that
    /// does not, the slice is empty.
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        let (storage, data_offset) = match info.part {
            0 => (&self.storage, self.data_offset),
            k => match self.parts.get(k - 1) {
                Some((storage, offset)) => (storage, *offset),
                None => return &[],
            },
        };
        let range = data_offset
            .checked_add(info.offset)
            .and_then(|start| Some(start..start.checked_add(info.n_bytes())?))
            .and_then(|r| Some(usize::try_from(r.start).ok()?..usize::try_from(r.end).ok()?));
        range.and_then(|r| storage.bytes().get(r)).unwrap_or(&[])
    }

    /// The data of the tensor called `name`.
    pub fn tensor_bytes(&self, name: &str) -> Option<&[u8]> {
        self.tensor(name).map(|info| self.tensor_data(info))
    }
}

/// Everything parsed from the header.
struct Header {
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorInfo>,
}

fn parse_header(bytes: &[u8]) -> Result<Header, GgufError> {
    let mut cur = Cursor::new(bytes);
    let magic = cur.take(4, "magic")?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic {
            found: magic.to_vec(),
        });
    }
    let version = read_version(&mut cur)?;

    let count_offset = cur.offset();
    let tensor_count = cur.u64("tensor count")?;
    let kv_count = cur.u64("metadata count")?;
    let remaining = cur.remaining() as u64;
    // Forged counts must fail here, before anything is reserved for them.
    if kv_count > remaining / MIN_KV_BYTES {
        return Err(GgufError::invalid(
            count_offset + 8,
            format!(
                "metadata count {kv_count} cannot fit in the {remaining} bytes that remain \
                 (each pair takes at least {MIN_KV_BYTES})"
            ),
        ));
    }
    if tensor_count > remaining / MIN_TENSOR_INFO_BYTES {
        return Err(GgufError::invalid(
            count_offset,
            format!(
                "tensor count {tensor_count} cannot fit in the {remaining} bytes that remain \
                 (each tensor info takes at least {MIN_TENSOR_INFO_BYTES})"
            ),
        ));
    }

    let (metadata, alignment) = read_metadata(&mut cur, kv_count)?;
    let (tensors, offset_fields) = read_tensor_infos(&mut cur, tensor_count, alignment)?;

    let header_end = cur.offset();
    let data_offset = align_up(header_end, alignment)
        .ok_or_else(|| GgufError::invalid(header_end, "data section offset overflows u64"))?;
    check_tensor_placement(&tensors, &offset_fields, data_offset, bytes.len() as u64)?;
    Ok(Header {
        version,
        alignment,
        data_offset,
        metadata,
        tensors,
    })
}

fn read_version(cur: &mut Cursor) -> Result<u32, GgufError> {
    let version = cur.u32("version")?;
    match version {
        2 | 3 => Ok(version),
        1 => Err(GgufError::UnsupportedVersion {
            version,
            reason: "GGUF v1 (32-bit counts) is obsolete; convert the file with a current llama.cpp",
        }),
        v if matches!(v.swap_bytes(), 1..=3) => Err(GgufError::UnsupportedVersion {
            version,
            reason: "the file appears to be big-endian; only little-endian GGUF is supported",
        }),
        _ => Err(GgufError::UnsupportedVersion {
            version,
            reason: "only versions 2 and 3 are supported",
        }),
    }
}

fn read_metadata(
    cur: &mut Cursor,
    kv_count: u64,
) -> Result<(Vec<(String, Value)>, u64), GgufError> {
    // The count was checked against the file size, so this reservation is bounded.
    let mut metadata = Vec::with_capacity(kv_count as usize);
    let mut seen: HashMap<String, u64> = HashMap::new();
    let mut alignment = DEFAULT_ALIGNMENT;
    for index in 0..kv_count {
        let key_offset = cur.offset();
        let key = cur
            .string("metadata key")
            .map_err(|e| e.context(&format!("metadata pair {index}")))?;
        match seen.entry(key.clone()) {
            Entry::Occupied(first) => {
                return Err(GgufError::invalid(
                    key_offset,
                    format!(
                        "duplicate metadata key '{}' (first at byte {})",
                        shorten(&key),
                        first.get()
                    ),
                ));
            }
            Entry::Vacant(slot) => {
                slot.insert(key_offset);
            }
        }
        let ctx = || format!("key '{}'", shorten(&key));
        let ty = read_value_type(cur, "value type").map_err(|e| e.context(&ctx()))?;
        let value_offset = cur.offset();
        let value = read_value(cur, ty, 0).map_err(|e| e.context(&ctx()))?;
        if key == ALIGNMENT_KEY {
            alignment = alignment_from_value(&value).map_err(|reason| {
                GgufError::invalid(value_offset, format!("{ALIGNMENT_KEY}: {reason}"))
            })?;
        }
        metadata.push((key, value));
    }
    Ok((metadata, alignment))
}

/// Reads the alignment from a `general.alignment` value, or says why it is unusable.
/// Like llama.cpp and gguf-py, only a `u32` is accepted.
pub(crate) fn alignment_from_value(value: &Value) -> Result<u64, String> {
    let Value::U32(alignment) = *value else {
        return Err(format!("must be a u32, found a {}", value.value_type()));
    };
    if alignment == 0 || !alignment.is_power_of_two() {
        return Err(format!("{alignment} is not a nonzero power of two"));
    }
    Ok(alignment.into())
}

fn read_value_type(cur: &mut Cursor, what: &str) -> Result<ValueType, GgufError> {
    let offset = cur.offset();
    let id = cur.u32(what)?;
    ValueType::from_id(id)
        .ok_or_else(|| GgufError::invalid(offset, format!("unknown {what} id {id}")))
}

fn read_value(cur: &mut Cursor, ty: ValueType, depth: usize) -> Result<Value, GgufError> {
    Ok(match ty {
        ValueType::U8 => Value::U8(cur.u8("u8 value")?),
        ValueType::I8 => Value::I8(cur.i8("i8 value")?),
        ValueType::U16 => Value::U16(cur.u16("u16 value")?),
        ValueType::I16 => Value::I16(cur.i16("i16 value")?),
        ValueType::U32 => Value::U32(cur.u32("u32 value")?),
        ValueType::I32 => Value::I32(cur.i32("i32 value")?),
        ValueType::F32 => Value::F32(cur.f32("f32 value")?),
        ValueType::U64 => Value::U64(cur.u64("u64 value")?),
        ValueType::I64 => Value::I64(cur.i64("i64 value")?),
        ValueType::F64 => Value::F64(cur.f64("f64 value")?),
        ValueType::Bool => {
            let offset = cur.offset();
            match cur.u8("bool value")? {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                other => {
                    return Err(GgufError::invalid(
                        offset,
                        format!("bool value is {other}, expected 0 or 1"),
                    ));
                }
            }
        }
        ValueType::String => Value::String(cur.string("string value")?),
        ValueType::Array => {
            let type_offset = cur.offset();
            let elem = read_value_type(cur, "array element type")?;
            if elem == ValueType::Array && depth + 1 >= MAX_ARRAY_DEPTH {
                return Err(GgufError::invalid(
                    type_offset,
                    format!("arrays nested deeper than {MAX_ARRAY_DEPTH} levels"),
                ));
            }
            let count_offset = cur.offset();
            let count = cur.u64("array length")?;
            let min = elem.min_encoded_size() as u64;
            let remaining = cur.remaining() as u64;
            if count > remaining / min {
                return Err(GgufError::invalid(
                    count_offset,
                    format!(
                        "array of {count} {elem} values cannot fit in the {remaining} bytes \
                         that remain (each takes at least {min})"
                    ),
                ));
            }
            let mut items = Vec::with_capacity(count as usize);
            for _ in 0..count {
                items.push(read_value(cur, elem, depth + 1)?);
            }
            Value::Array(elem, items)
        }
    })
}

fn read_tensor_infos(
    cur: &mut Cursor,
    tensor_count: u64,
    alignment: u64,
) -> Result<(Vec<TensorInfo>, Vec<u64>), GgufError> {
    let remaining = cur.remaining() as u64;
    if tensor_count > remaining / MIN_TENSOR_INFO_BYTES {
        return Err(GgufError::invalid(
            cur.offset(),
            format!(
                "tensor count {tensor_count} cannot fit in the {remaining} bytes left after \
                 the metadata (each tensor info takes at least {MIN_TENSOR_INFO_BYTES})"
            ),
        ));
    }
    let mut tensors = Vec::with_capacity(tensor_count as usize);
    // Where each tensor's offset field sits, for error messages about its placement.
    let mut offset_fields = Vec::with_capacity(tensor_count as usize);
    let mut seen: HashMap<String, u64> = HashMap::new();
    for index in 0..tensor_count {
        let name_offset = cur.offset();
        let name = cur
            .string("tensor name")
            .map_err(|e| e.context(&format!("tensor info {index}")))?;
        match seen.entry(name.clone()) {
            Entry::Occupied(first) => {
                return Err(GgufError::invalid(
                    name_offset,
                    format!(
                        "duplicate tensor name '{}' (first at byte {})",
                        shorten(&name),
                        first.get()
                    ),
                ));
            }
            Entry::Vacant(slot) => {
                slot.insert(name_offset);
            }
        }
        let ctx = || format!("tensor '{}'", shorten(&name));

        let dims_offset = cur.offset();
        let n_dims = cur.u32("dimension count").map_err(|e| e.context(&ctx()))?;
        if n_dims == 0 || n_dims as usize > GGML_MAX_DIMS {
            return Err(GgufError::invalid(
                dims_offset,
                format!(
                    "{}: dimension count {n_dims} is outside 1..={GGML_MAX_DIMS}",
                    ctx()
                ),
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(cur.u64("dimension").map_err(|e| e.context(&ctx()))?);
        }
        let type_offset = cur.offset();
        let type_id = cur.u32("tensor type").map_err(|e| e.context(&ctx()))?;
        let ty = GgmlType::from_id(type_id).ok_or_else(|| {
            GgufError::invalid(
                type_offset,
                format!("{}: unknown tensor type id {type_id}", ctx()),
            )
        })?;
        let offset_field = cur.offset();
        let offset = cur
            .u64("tensor data offset")
            .map_err(|e| e.context(&ctx()))?;

        checked_tensor_bytes(&dims, ty)
            .map_err(|reason| GgufError::invalid(dims_offset, format!("{}: {reason}", ctx())))?;
        if offset % alignment != 0 {
            return Err(GgufError::invalid(
                offset_field,
                format!(
                    "{}: data offset {offset} is not a multiple of the alignment {alignment}",
                    ctx()
                ),
            ));
        }
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            offset,
            part: 0,
        });
        offset_fields.push(offset_field);
    }
    Ok((tensors, offset_fields))
}

/// Every tensor's data must lie inside the file, and no two may overlap.
fn check_tensor_placement(
    tensors: &[TensorInfo],
    offset_fields: &[u64],
    data_offset: u64,
    file_size: u64,
) -> Result<(), GgufError> {
    let data_len = file_size.saturating_sub(data_offset);
    for (info, &field) in tensors.iter().zip(offset_fields) {
        let end = info.offset.checked_add(info.n_bytes());
        if end.is_none_or(|end| end > data_len) {
            return Err(GgufError::invalid(
                field,
                format!(
                    "tensor '{}': data at offset {} with size {} ends past the data section \
                     (absolute bytes {}..{}, file size {file_size})",
                    shorten(&info.name),
                    info.offset,
                    info.n_bytes(),
                    data_offset as u128 + info.offset as u128,
                    data_offset as u128 + info.offset as u128 + info.n_bytes() as u128,
                ),
            ));
        }
    }
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&i| tensors[i].offset);
    for pair in order.windows(2) {
        let (a, b) = (&tensors[pair[0]], &tensors[pair[1]]);
        // Both ends are within the file, so this cannot overflow.
        let a_end = a.offset + a.n_bytes();
        if b.offset < a_end {
            return Err(GgufError::invalid(
                offset_fields[pair[1]],
                format!(
                    "tensor '{}' (data {}..{}) overlaps tensor '{}' (data {}..{})",
                    shorten(&b.name),
                    b.offset,
                    b.offset + b.n_bytes(),
                    shorten(&a.name),
                    a.offset,
                    a_end
                ),
            ));
        }
    }
    Ok(())
}

/// Rounds `offset` up to a multiple of `alignment` (a power of two).
pub(crate) fn align_up(offset: u64, alignment: u64) -> Option<u64> {
    Some(offset.checked_add(alignment - 1)? & !(alignment - 1))
}
