//! Puller: an image becomes checkpoint files again ([`unpack`]), from a local layout now
//! and from a registry later (pull, the chunk cache and the lazy UFFD server).
//!
//! ```text
//! source (layout | registry) -> verified chunk (verify::read_chunk) -> temp file -> fsync -> rename
//! ```

mod unpack;

pub use registry::client::{Credentials, RegistrySource};

pub use unpack::{unpack, UnpackError, UnpackOptions, UnpackReport};
