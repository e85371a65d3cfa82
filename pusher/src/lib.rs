//! Pusher: a checkpoint directory becomes an image ([`pack`]); an image goes to a
//! registry ([`push()`], or a directory packed on the way: [`push_dir`]) or between any
//! two stores ([`copy()`]), with what is attached to it ([`referrers`]). Its one job is the sending side of the pipeline; the CLI only
//! parses flags and prints.
//!
//! ```text
//! scan (kind, roles, sparse extents) -> chunk (read, zero-check, digest, compress)
//!   -> dedup (own, base, parent) -> pack writer (sha256 as it writes) -> index, config, manifest
//! ```

mod attached;
pub mod closest;
pub mod copy;
mod pack;
pub mod push;
pub mod referrers;
pub mod scan;

pub use copy::{copy, CopyError, CopyOptions, PushReport, Target};
pub use pack::{
    ensure_blob, pack, same_files, same_files_scanned, NotSameFiles, OnPack, PackError, PackOptions, PackReport, Related, DEFAULT_BASE_DELTA_LEVEL,
    DEFAULT_COMPACT_AFTER, DEFAULT_PACK_SIZE,
};
pub use push::{push, push_dir, DirOptions, PushError};
