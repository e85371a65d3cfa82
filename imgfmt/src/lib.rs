//! The snapctl image format: bytes <-> types. `std::io` only, no async, no network.
//!
//! A snapshot image is an OCI image manifest (`artifactType`
//! [`media::ARTIFACT_TYPE`]) whose blobs are
//!
//! ```text
//! manifest ──► config   (JSON: kind, files, chunk size, hash, roots, base/parent refs)
//!          ├─► index    (binary: file table, pack table, chunk records)  ◄── this crate's codec
//!          ├─► pack*    (concatenated stored chunks, each range-addressable)
//!          ├─► outboard (optional, BLAKE3: slice chaining values, to verify part of a chunk)
//!          └─► chain*   (configs and indexes of parents, packs inherited from base/parents)
//! ```
//!
//! Chunks are fixed-size, page-aligned slices of each file. All-zero chunks are flagged
//! and never stored. A full image's index has a record for every chunk; a *layer* (an
//! image with a parent) records only the chunks that differ from its parent, so an
//! unchanged layer costs a few hundred bytes of index. [`Image`] resolves a chain into
//! one flat table of [`ResolvedChunk`]s.
//!
//! Chunk digests, Merkle roots and their checks live in the `verify` crate. The OCI blob
//! digest ([`OciDigest`]) and its one streaming hasher ([`OciHasher`]) live here, because
//! every crate names blobs with them. What this crate decodes is *structurally* valid
//! (bounds, counts, overlaps); whether chunk bytes match their digests is `verify`'s job.
//! See `spec/format.md`.

pub mod compress;
pub mod config;
pub mod digest;
mod error;
pub mod file;
pub mod image;
pub mod index;
pub mod layout;
pub mod manifest;
pub mod media;
pub mod outboard;
pub mod reference;
pub mod retry;
pub mod size;
pub mod source;
pub mod store;
pub mod work;

pub use compress::Compression;
pub use config::{FileEntry, ImageConfig, Kind, Role};
pub use digest::{ChunkDigest, HashAlgo, OciDigest, OciHasher};
pub use error::{BoxError, ErrorKind, FormatError};
pub use image::{resolve_chain, ChainLink, Image, Outboards, OutboardsAhead, PendingOutboards, ResolvedChunk, ResolvedFile, StoredAt};
pub use index::{ChunkIndex, ChunkRecord, IndexFile, PackRef, RecordKind};
pub use layout::OciLayout;
pub use manifest::{Descriptor, Manifest};
pub use outboard::{Outboard, OutboardTable, SliceCvs, SliceShape};
pub use retry::RetryPolicy;
pub use source::BlobSource;
pub use store::ImageStore;

/// Smallest chunk size: 64 KiB (a multiple of every page size a VMM uses for guest RAM
/// except huge pages, which are served as whole multiples of it).
pub const MIN_CHUNK_SHIFT: u8 = 16;
/// Largest chunk size: 16 MiB.
pub const MAX_CHUNK_SHIFT: u8 = 24;
/// Default chunk size: 1 MiB (see BENCHMARKS.md, "Chunk size").
pub const DEFAULT_CHUNK_SHIFT: u8 = 20;
