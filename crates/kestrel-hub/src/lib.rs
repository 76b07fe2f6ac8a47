//! kestrel-hub
