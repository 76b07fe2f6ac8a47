//! kestrel-cpu
