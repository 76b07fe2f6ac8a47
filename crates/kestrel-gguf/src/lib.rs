//! GGUF reader and writer. To be implemented (see the crate's task).
