use crate::GgufError;

/// A bounds-checked little-endian reader over a byte slice. Every read either returns
/// the value or a `Truncated` error naming the field and its absolute offset.
pub(crate) struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        Cursor { bytes, pos: 0 }
    }

    /// Absolute offset of the next byte.
    pub fn offset(&self) -> u64 {
        self.pos as u64
    }

    /// Bytes left after the current position.
    pub fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    /// Takes the next `n` bytes.
    pub fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufError> {
        let available = self.remaining();
        match usize::try_from(n) {
            Ok(len) if len <= available => {
                let out = &self.bytes[self.pos..self.pos + len];
                self.pos += len;
                Ok(out)
            }
            _ => Err(GgufError::Truncated {
                what: what.to_owned(),
                offset: self.offset(),
                needed: n,
                available: available as u64,
            }),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let bytes = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    pub fn u8(&mut self, what: &str) -> Result<u8, GgufError> {
        Ok(self.array::<1>(what)?[0])
    }

    pub fn i8(&mut self, what: &str) -> Result<i8, GgufError> {
        Ok(i8::from_le_bytes(self.array(what)?))
    }

    pub fn u16(&mut self, what: &str) -> Result<u16, GgufError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }

    pub fn i16(&mut self, what: &str) -> Result<i16, GgufError> {
        Ok(i16::from_le_bytes(self.array(what)?))
    }

    pub fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    pub fn i32(&mut self, what: &str) -> Result<i32, GgufError> {
        Ok(i32::from_le_bytes(self.array(what)?))
    }

    pub fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    pub fn i64(&mut self, what: &str) -> Result<i64, GgufError> {
        Ok(i64::from_le_bytes(self.array(what)?))
    }

    pub fn f32(&mut self, what: &str) -> Result<f32, GgufError> {
        Ok(f32::from_le_bytes(self.array(what)?))
    }

    pub fn f64(&mut self, what: &str) -> Result<f64, GgufError> {
        Ok(f64::from_le_bytes(self.array(what)?))
    }

    /// A GGUF string: u64 byte length, then UTF-8 bytes.
    pub fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len_offset = self.offset();
        let len = self.u64(what).map_err(|e| match e {
            GgufError::Truncated {
                offset,
                needed,
                available,
                ..
            } => GgufError::Truncated {
                what: format!("length of {what}"),
                offset,
                needed,
                available,
            },
            other => other,
        })?;
        if len > self.remaining() as u64 {
            return Err(GgufError::invalid(
                len_offset,
                format!(
                    "{what} claims {len} bytes but only {} bytes remain in the file",
                    self.remaining()
                ),
            ));
        }
        let start = self.offset();
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(GgufError::invalid(
                start + e.valid_up_to() as u64,
                format!("{what} is not valid UTF-8"),
            )),
        }
    }
}
