//! Pusher: a checkpoint directory becomes an image ([`pack`]); an image goes to a
//! registry ([`push()`], or a directory packed on the way: [`push_dir`]) or between any
//! two stores ([`copy()`]), with what is attached to it ([`referrers`]). Its one job is the sending side of the pipeline; the CLI only
//! parses flags and prints.
//!
//! ```text
//! scan (kind, roles, sparse extents) -> chunk (read, zero-check, digest, compress)
//!   -> dedup (own, base, parent) -> pack writer (sha256 as it writes) -> index, config, manifest
//! ```
//!
//! `push DIR` works from one walk of the directory ([`DirScan`]) that every step reads
//! (the closest image's search in [`closest`], the stamp, the packer), and tells its caller
//! how it goes through a [`PushObserver`] ([`observe`]).

mod attached;
pub mod closest;
pub mod copy;
pub mod observe;
mod pack;
pub mod push;
pub mod referrers;
pub mod scan;
mod stamp;

pub use copy::{copy, CopyError, CopyOptions, PushReport, Target, TransferObserver};
pub use observe::{ParentNote, PushObserver, Reused};
pub use pack::{
    ensure_blob, pack, pack_scanned, same_files, same_files_of_config, NotSameFiles, OnPack, PackError, PackOptions, PackReport, Related,
    DEFAULT_BASE_DELTA_LEVEL, DEFAULT_COMPACT_AFTER, DEFAULT_PACK_SIZE,
};
pub use push::{push, push_dir, DirOptions, PushDirReport, PushError};
pub use scan::DirScan;
