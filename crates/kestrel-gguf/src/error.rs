use std::path::PathBuf;

/// Everything that can go wrong reading or writing a GGUF file.
///
/// Parse errors carry the absolute byte offset in the file where the problem was found.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The operating system refused an operation on a file.
    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The parts of a split model do not fit together.
    #[error("split model {path}: {message}")]
    Split { path: PathBuf, message: String },

    /// An I/O error on a caller-provided writer.
    #[error("write failed: {0}")]
    Write(#[source] std::io::Error),

    /// The file ends before a field that must be there.
    #[error(
        "truncated file: {what} at byte {offset} needs {needed} bytes but only {available} remain"
    )]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        available: u64,
    },

    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file: magic at byte 0 is {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: Vec<u8> },

    /// A version this reader does not support.
    #[error("unsupported GGUF version {version} at byte 4: {reason}")]
    UnsupportedVersion { version: u32, reason: &'static str },

    /// Any other structural problem in the file.
    #[error("invalid GGUF at byte {offset}: {reason}")]
    Invalid { offset: u64, reason: String },

    /// The caller asked the writer for something that cannot be written.
    #[error("GGUF writer: {0}")]
    Writer(String),
}

impl GgufError {
    pub(crate) fn invalid(offset: u64, reason: impl Into<String>) -> Self {
        GgufError::Invalid {
            offset,
            reason: reason.into(),
        }
    }

    /// The byte offset a parse error refers to, if it has one.
    pub fn offset(&self) -> Option<u64> {
        match self {
            GgufError::Truncated { offset, .. } | GgufError::Invalid { offset, .. } => {
                Some(*offset)
            }
            GgufError::BadMagic { .. } => Some(0),
            GgufError::UnsupportedVersion { .. } => Some(4),
            GgufError::Io { .. }
            | GgufError::Split { .. }
            | GgufError::Write(_)
            | GgufError::Writer(_) => None,
        }
    }
}

/// Shortens a name taken from the file for use in an error message.
pub(crate) fn shorten(name: &str) -> String {
    const MAX: usize = 80;
    if name.len() <= MAX {
        return name.to_owned();
    }
    let mut end = MAX;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes)", &name[..end], name.len())
}

impl GgufError {
    /// Adds where in the file's structure the error happened (e.g. which key).
    pub(crate) fn context(self, ctx: &str) -> Self {
        match self {
            GgufError::Truncated {
                what,
                offset,
                needed,
                available,
            } => GgufError::Truncated {
                what: format!("{what} ({ctx})"),
                offset,
                needed,
                available,
            },
            GgufError::Invalid { offset, reason } => GgufError::Invalid {
                offset,
                reason: format!("{ctx}: {reason}"),
            },
            other => other,
        }
    }
}
