//! Pusher: a checkpoint directory becomes an image ([`pack`]); an image goes to a
//! registry ([`push()`]) or between any two stores ([`copy()`]).
//!
//! ```text
//! scan (kind, roles, sparse extents) -> chunk (read, zero-check, digest, compress)
//!   -> dedup (own, base, parent) -> pack writer (sha256 as it writes) -> index, config, manifest
//! ```

pub mod copy;
mod pack;
mod push;
pub mod scan;

pub use copy::{copy, CopyError, CopyOptions, PushReport, Target};
pub use pack::{ensure_blob, pack, OnPack, PackError, PackOptions, PackReport, Related, DEFAULT_PACK_SIZE};
pub use push::push;
