//! Puller: an image becomes checkpoint files again: [`unpack`] from any source chunk by
//! chunk, [`pull`] from a registry through the per-host [`ChunkCache`] (fetching only
//! what the cache lacks, in coalesced parallel range requests). Serving page faults from
//! the same cache is the next stage's job (`lazy`).
//!
//! ```text
//! source (layout | registry) -> verified chunk (verify) -> temp file -> fsync -> rename
//!                      cache <-^ (re-hashed on read, put after verification)
//! ```

pub mod cache;
mod pull;
mod unpack;

pub use regclient::{Credentials, RegistrySource};

pub use cache::{CacheError, CacheStats, ChunkCache, PreparedRefs};
pub use pull::{data_bytes, pull, PullOptions, PullReport, DEFAULT_MAX_JOBS, DEFAULT_MAX_RANGE};
pub use unpack::{unpack, DestDirs, UnpackError, UnpackOptions, UnpackReport};
