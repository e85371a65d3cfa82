//! Pusher: a checkpoint directory becomes an image ([`pack`]); an image goes to a
//! registry (push, a later issue).
//!
//! ```text
//! scan (kind, roles, sparse extents) -> chunk (read, zero-check, digest, compress)
//!   -> dedup (own, base, parent) -> pack writer (sha256 as it writes) -> index, config, manifest
//! ```

mod pack;
pub mod scan;

pub use pack::{ensure_blob, pack, PackError, PackOptions, PackReport, Related, DEFAULT_PACK_SIZE};
