//! What a pack is asked (`PackOptions`, the images it builds on) and what it reports.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use imgfmt::config::MAX_CHAIN_DEPTH;
use imgfmt::{BlobSource, Compression, FormatError, HashAlgo, Image, Kind, OciDigest};
use serde::Serialize;

/// Default bound on a pack blob: an image is a few blobs, and a push can still upload
/// several in parallel.
pub const DEFAULT_PACK_SIZE: u64 = 256 << 20;

/// Default of [`PackOptions::compact_after`]: a layer whose image would read from more
/// than this many packs beyond the fewest its bytes need is compacted (spec/format.md
/// §10, "Compaction"). See BENCHMARKS.md, "Long histories", for what it costs and saves.
pub const DEFAULT_COMPACT_AFTER: usize = 16;

#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum PackError {
    /// {path}: {source}
    Io { path: PathBuf, source: std::io::Error },
    /// {0}
    Scan(#[from] crate::scan::ScanError),
    /// {0}
    Format(#[from] FormatError),
    /// {0}
    Verify(#[from] verify::VerifyError),
    /// {0}
    Invalid(String),
}

pub(super) fn io_at(path: &Path) -> impl FnOnce(std::io::Error) -> PackError + '_ {
    move |source| PackError::Io { path: path.to_path_buf(), source }
}

/// An image this one builds on, already opened, with the store it lives in.
pub struct Related<'a> {
    pub source: &'a dyn BlobSource,
    pub image: Image,
    /// How the user named it (recorded in the config).
    pub reference: String,
}

/// Told each pack's digest and size as soon as the pack is complete in the layout.
pub type OnPack<'a> = &'a (dyn Fn(&OciDigest, u64) + Sync);

pub struct PackOptions<'a> {
    /// Runtime kind; detected from file names when `None`.
    pub kind: Option<Kind>,
    pub chunk_shift: u8,
    pub compression: Compression,
    pub hash: HashAlgo,
    pub pack_size: u64,
    /// log2 of the slice size of the outboard (`MIN_SLICE_SHIFT ..= chunk_shift - 1`), or
    /// `None` for no outboard. Only BLAKE3 images have one (SHA-256 is not a tree): with
    /// `hash` SHA-256 this is ignored. Should the outboard grow past its limit (over
    /// 32 GiB of raw chunks at 4 KiB), slices are doubled until it fits.
    pub slice_shift: Option<u8>,
    /// Chunks found anywhere in the base are referenced, not stored.
    pub base: Option<Related<'a>>,
    /// Make a layer over this parent: only differing chunks are recorded.
    pub parent: Option<Related<'a>>,
    /// Memory files are Firecracker diff snapshots: holes mean "unchanged since parent".
    pub diff: bool,
    /// Most ancestors the written image may have (at most [`MAX_CHAIN_DEPTH`]). A layer
    /// over a parent whose chain is already this long is *rebased* instead: written as a
    /// full image whose records point into the packs the chain already stored (nothing is
    /// copied or uploaded again), with no parent, so the next layer starts a new chain.
    pub max_chain: usize,
    pub annotations: BTreeMap<String, String>,
    pub threads: usize,
    /// Called with the number of source bytes (holes included) as they are processed.
    pub progress: Option<&'a (dyn Fn(u64) + Sync)>,
    /// Called from the pack writer with each pack's digest and size as soon as the pack
    /// is complete in the layout, while later packs are still being made (`push DIR`
    /// starts uploading it then).
    pub on_pack: Option<OnPack<'a>>,
    /// Compaction bound: when the image, made as a layer (or rebased) over `parent`,
    /// would read its chunks from more than this many of the chain's packs beyond the
    /// fewest that could hold them (`ceil(bytes / pack_size)`), the chunks it still uses
    /// from the packs with the fewest such bytes are written into its own packs instead,
    /// until it reads from at most a quarter of this many beyond the fewest. `None`: never.
    pub compact_after: Option<usize>,
    /// The parent chain's packs are where this image is going (`push DIR` over an image
    /// of the same repository): the destination layout gets no copy of the ones this
    /// image points into. Otherwise they are copied in, so the layout holds the whole
    /// image.
    pub parent_packs_elsewhere: bool,
    /// zstd level of `zstd-ref` chunks: a new chunk where the base has a chunk at the same
    /// position (same file name, same chunk number) is also compressed against that chunk
    /// (read from the base and verified), and stored so when that is smallest. A clone's
    /// chunk that differs from its base's in a few bytes costs those bytes, not the chunk.
    /// `None`: never (only the base's identical chunks are shared).
    pub base_delta: Option<i32>,
}

impl Default for PackOptions<'_> {
    fn default() -> Self {
        PackOptions {
            kind: None,
            chunk_shift: imgfmt::DEFAULT_CHUNK_SHIFT,
            compression: Compression::None,
            hash: HashAlgo::Blake3,
            pack_size: DEFAULT_PACK_SIZE,
            slice_shift: Some(imgfmt::outboard::DEFAULT_SLICE_SHIFT),
            base: None,
            parent: None,
            diff: false,
            max_chain: MAX_CHAIN_DEPTH,
            annotations: BTreeMap::new(),
            threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2),
            progress: None,
            on_pack: None,
            compact_after: Some(DEFAULT_COMPACT_AFTER),
            parent_packs_elsewhere: false,
            base_delta: Some(DEFAULT_BASE_DELTA_LEVEL),
        }
    }
}

/// zstd level of chunks stored against their base's chunk (`zstd-ref`), by default. A
/// gVisor clone's state file (375 KB, bench/fleet.sh) came to 20.2 KB at level 3 (long
/// matching), 13.9 KB at 12 and 10.7 KB at 19, in 0.002, 0.010 and 0.29 s; its 1 MiB
/// chunk of pages with 60 bytes changed to 1.1 KB, 206 B and 212 B, in 0.002, 0.031 and
/// 0.096 s. 19 would cost a clone with a hundred changed chunks ten seconds; 12 one.
pub const DEFAULT_BASE_DELTA_LEVEL: i32 = 12;

/// What a pack did, for `--json` and people.
#[derive(Debug, Clone, Serialize, Default)]
pub struct PackReport {
    pub manifest: String,
    pub root: String,
    pub kind: String,
    pub files: usize,
    pub skipped: Vec<String>,
    /// Logical bytes of all files (holes included).
    pub logical_bytes: u64,
    /// Bytes actually read from the source (holes are not read).
    pub bytes_read: u64,
    pub chunks: u64,
    pub zero_chunks: u64,
    /// Chunks written to this image's own packs.
    pub stored_chunks: u64,
    /// Chunks that matched another chunk of this image, the base or the parent chain.
    pub deduplicated_chunks: u64,
    /// Chunks unchanged since the parent: no record in a layer; in a rebased image, a
    /// record pointing where the chain stores them.
    pub inherited_chunks: u64,
    /// Bytes written into new packs.
    pub pack_bytes: u64,
    /// Manifest + config + index (+ outboard) bytes.
    pub metadata_bytes: u64,
    /// Slice size of the outboard written (0: none).
    pub slice_size: u64,
    /// Chunks the outboard has slice CVs for.
    pub outboard_entries: u64,
    pub outboard_bytes: u64,
    pub packs: usize,
    /// Ancestors of the written image: 0 for a full image (rebased ones included), the
    /// parent's plus one for a layer.
    pub chain_depth: usize,
    /// A layer over the parent would have had more than `max_chain` ancestors, so a full
    /// index was written instead, pointing into the chain's packs: the chain starts over.
    pub rebased: bool,
    /// When rebased: the parent's manifest digest (also the manifest annotation
    /// `dev.snapctl.rebased-from`), for provenance only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rebased_from: Option<String>,
    /// When rebased: packs of the chain the new index points into (none copied or sent).
    pub chain_packs_referenced: usize,
    /// Packs of the chain a full read of the image touches beyond the fewest its stored
    /// bytes need (`ceil(bytes / pack_size)`): its fragmentation (spec/format.md §10).
    pub excess_packs: usize,
    /// The chain was compacted: chunks this image still used from the packs in
    /// `packs_retired` were written into its own packs; it no longer reads those.
    pub compacted: bool,
    pub packs_retired: usize,
    /// Chunks and stored bytes written again by the compaction (unchanged content).
    pub compacted_chunks: u64,
    pub compacted_bytes: u64,
    /// New chunks stored as `zstd-ref` against the base's chunk at their position, and
    /// their stored bytes (headers included).
    pub base_delta_chunks: u64,
    pub base_delta_bytes: u64,
    /// The base's chunks read to try that (after 32 tries of which fewer than a quarter
    /// paid, no more are read: the image is no close relative of its base).
    pub base_delta_reads: u64,
    pub seconds: f64,
}
