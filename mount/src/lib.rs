//! `snapctl mount`: an image's files as a read-only FUSE file system, every byte read
//! lazily and verified, and one host mount that presents many images so that a file two
//! images share (a clone's base memory, one snapshot restored eight times) is one inode
//! with one page cache.
//!
//! ```text
//! snapctl mount REF DIR --control socket (0600, peer uid checked)--> host daemon
//!                                                   add REF: open, policy already checked
//!   <host>/sha256:<hex>/...  <-- bind mount --  DIR        (one directory per image)
//!
//! kernel (page cache, readahead up to 1 MiB) --FUSE read(ino, off, len)--> fs
//!   -> tree: inode -> (image, file | clone view)       one inode per content, any image
//!   -> read: the chunks under the range, full length (short only at EOF)
//!        zero chunk (zero map, record checked) -> zeros, nothing fetched
//!        recent memory -> chunk cache -> source (single-flight, retried, verified twice
//!        at most) -> bytes;  no verified bytes -> EIO for that read, logged by chunk
//!   fill (background): trace order, then file order, yielding to reads -> chunk cache
//!   copies (after the fill): a file complete in the chunk cache -> a whole-file copy;
//!        later opens of it -> FUSE passthrough: the kernel reads the copy, not the daemon
//! ```
//!
//! | module | its one job |
//! | --- | --- |
//! | this file | what every part shares: a presented image ([`Served`]), its counters and report |
//! | [`host`] | the host daemon: the FUSE session, binds into DIRs, adds and removes, its life cycle |
//! | [`control`] | the control socket: its wire format, the private socket, admission, the client |
//! | [`tree`] | inodes and directories of the images presented; the clone layout's names |
//! | [`fs`] | FUSE requests answered from the tree and `read` |
//! | [`read`] | the bytes of a read: files, a clone's own pages and their map, from chunks |
//! | [`chunks`] | verified chunks of one image (the seam to the page server's fetcher) |
//! | [`fill`] | the background fill of the chunk cache |
//! | [`copies`] | whole-file copies of complete files, for passthrough: made, kept, swept |
//! | [`target`] | checks of DIR and of the host before anything is mounted; finding a DIR's image |
//!
//! Who calls whom: `host` drives `fs` (through fuser), `control`, `fill` and `copies`; `fs`
//! reads through `read`, which asks `chunks`, and opens copies through `copies`, which
//! writes them from `chunks`; `tree` is data that `host` changes and `fs` and `copies` read.
//! The wire contract, the clone layout and the life cycle are in `spec/mount.md`.

pub mod chunks;
pub mod control;
pub mod copies;
pub mod fill;
pub mod fs;
pub mod host;
pub mod read;
pub mod target;
pub mod tree;

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

pub use chunks::{ChunkSource, Fetcher, Need};
pub use host::{Host, HostOptions, Opened, Opener, Passthrough, TraceLookup};

/// Reads of one image through the mount.
#[derive(Default)]
pub struct ReadCounters {
    pub opens: AtomicU64,
    pub reads: AtomicU64,
    pub bytes_read: AtomicU64,
    /// Reads answered with EIO (a chunk under them had no verified bytes).
    pub read_failures: AtomicU64,
    /// Opens served by FUSE passthrough (the kernel reads the whole-file copy).
    pub passthrough_files: AtomicU64,
    /// Opens of a file with a whole-file copy that the kernel refused to take as a backing
    /// file (served through the daemon instead).
    pub passthrough_refused: AtomicU64,
    pub latency: lazy::stats::Histogram,
}

/// An image the host mount presents.
pub struct Served {
    /// `sha256:<hex>`: its manifest digest, and its directory under the host mount.
    pub name: String,
    /// How it was named (pinned by digest).
    pub reference: String,
    pub chunks: Arc<dyn ChunkSource>,
    /// Its base's chunks, when it has a base the daemon could open (the clone layout).
    pub base: Option<Arc<dyn ChunkSource>>,
    pub counters: ReadCounters,
    pub added: Instant,
}

/// What one image's mount did, printed with `--json` when it is unmounted.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Report {
    /// The image's manifest digest.
    pub image: String,
    pub reference: String,
    /// The directory it was shown in.
    pub dir: String,
    /// Files opened (each open of a file, by any process).
    pub opens: u64,
    pub reads: u64,
    pub bytes_read: u64,
    pub fetched_chunks: u64,
    pub bytes_fetched: u64,
    pub cache_hits: u64,
    pub verify_failures: u64,
    pub read_failures: u64,
    pub retries: u64,
    /// Opens served by FUSE passthrough: the kernel read the file's whole-file copy, and
    /// none of their reads is in `reads`.
    pub passthrough_files: u64,
    /// Opens that would have been served by passthrough but the kernel refused the copy.
    #[serde(default)]
    pub passthrough_refused: u64,
    /// Chunks the background fill brought into the chunk cache.
    pub filled_chunks: u64,
    /// Reads served from part of a cached chunk, checked slice by slice.
    #[serde(default)]
    pub cache_slice_reads: u64,
    /// Small reads served by fetching only their slices from the source.
    #[serde(default)]
    pub fetched_slice_reads: u64,
    pub read_latency_us: Latency,
    pub seconds: f64,
}

/// Percentiles of the daemon's time for each read, in microseconds.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Latency {
    pub p50: u64,
    pub p90: u64,
    pub p99: u64,
    pub max: u64,
}

impl Served {
    /// The report as of now, for the bind at `dir`.
    pub fn report(&self, dir: &str) -> Report {
        let (c, f) = (&self.counters, self.chunks.counters());
        let base = self.base.as_ref().map(|b| b.counters());
        let sum = |x: &dyn Fn(&chunks::FetchCounters) -> &AtomicU64| x(f).load(Relaxed) + base.map_or(0, |b| x(b).load(Relaxed));
        Report {
            image: self.name.clone(),
            reference: self.reference.clone(),
            dir: dir.to_string(),
            opens: c.opens.load(Relaxed),
            reads: c.reads.load(Relaxed),
            bytes_read: c.bytes_read.load(Relaxed),
            fetched_chunks: sum(&|x| &x.fetched_chunks),
            bytes_fetched: sum(&|x| &x.bytes_fetched),
            cache_hits: sum(&|x| &x.cache_hits),
            verify_failures: sum(&|x| &x.verify_failures),
            read_failures: c.read_failures.load(Relaxed),
            retries: sum(&|x| &x.retries),
            passthrough_files: c.passthrough_files.load(Relaxed),
            passthrough_refused: c.passthrough_refused.load(Relaxed),
            filled_chunks: sum(&|x| &x.filled_chunks),
            cache_slice_reads: sum(&|x| &x.cache_slice_reads),
            fetched_slice_reads: sum(&|x| &x.fetched_slice_reads),
            read_latency_us: {
                let l = c.latency.latency();
                Latency { p50: l.p50, p90: l.p90, p99: l.p99, max: l.max }
            },
            seconds: self.added.elapsed().as_secs_f64(),
        }
    }
}

#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum MountError {
    /// {context}: {source}
    Io { context: String, source: std::io::Error },
    /// {0}
    Target(#[from] target::TargetError),
    /// {0}
    Tree(#[from] tree::TreeError),
    /// {0}
    Refused(String),
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> MountError {
    let context = context.into();
    move |source| MountError::Io { context, source }
}
