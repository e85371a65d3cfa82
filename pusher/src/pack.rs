//! `pack`: a checkpoint directory becomes an image in a local OCI layout.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use imgfmt::compress::{compress_ref, Codec, RefHeader, REF_HEADER_LEN};
use imgfmt::config::{BlobRef, ChainRef, FileEntry, CONFIG_FORMAT, MAX_CHAIN_DEPTH};
use imgfmt::digest::OciHasher;
use imgfmt::index::{chunk_count, chunk_len, IndexFile};
use imgfmt::layout::BlobWriter;
use imgfmt::outboard::{slice_count, Cv, Outboard, ENTRY_LEN, HEADER_LEN as OUTBOARD_HEADER_LEN, MAX_OUTBOARD_BYTES};
use imgfmt::{
    media, BlobSource, ChunkDigest, ChunkIndex, ChunkRecord, Compression, Descriptor, FormatError, HashAlgo, Image, ImageConfig, Kind, Manifest, OciDigest,
    OciLayout, PackRef, RecordKind, Role, StoredAt,
};
use serde::Serialize;
use verify::hash::is_zero;

use crate::scan::{self, Coverage, ExtentCursor};

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
    Format(#[from] FormatError),
    /// {0}
    Verify(#[from] verify::VerifyError),
    /// {0}
    Invalid(String),
}

fn io_at(path: &Path) -> impl FnOnce(std::io::Error) -> PackError + '_ {
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
/// Level of the first pass over every new chunk with a base counterpart; only a chunk that
/// came to under a quarter of its size is compressed again at the `base_delta` level.
const BASE_DELTA_FIRST_LEVEL: i32 = 3;
/// zstd-ref tries after which, when fewer than a quarter paid, no more base chunks are
/// read: an image packed with an unrelated `--base` reads at most this many of them.
const BASE_DELTA_PROBATION: u64 = 32;

/// Why the image a tag holds is not taken, by itself, as the parent of a new image of a
/// directory (spec/transfer.md §2, "The tag's image as the parent").
#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum NotSameFiles {
    /// it is a {image} snapshot and this directory a {dir} one
    Kind { image: Kind, dir: Kind },
    /// it is cut into {image_chunk} KiB chunks hashed with {image_hash}, this pack {chunk} KiB with {hash} (pass the same --chunk-size and --hash)
    Chunking { image_chunk: u64, image_hash: HashAlgo, chunk: u64, hash: HashAlgo },
    /// not the same files (only in the directory: {added}; only in the image: {removed})
    Files { added: String, removed: String },
    /// reading the directory: {0}
    Io(#[from] std::io::Error),
}

/// Whether `image` holds a snapshot of "the same files" as `src_dir` packed with `opts`,
/// so that a new image of the directory is made as a layer over it without being asked:
/// the same kind, chunk size and hash, and the same set of file names (sizes and content
/// may differ; that is what a layer records).
pub fn same_files(image: &Image, src_dir: &Path, opts: &PackOptions) -> Result<(), NotSameFiles> {
    let sc = scan::scan_dir(src_dir)?;
    same_files_scanned(image.config(), image.files.iter().map(|f| f.name.as_str()), &sc, opts)
}

/// [`same_files`] of an image's config `c` (its file names `names`) and a directory
/// scanned already: what a push checks of each image of a repository before opening any.
pub fn same_files_scanned<'a>(c: &ImageConfig, names: impl Iterator<Item = &'a str>, sc: &scan::Scan, opts: &PackOptions) -> Result<(), NotSameFiles> {
    if c.hash != opts.hash || c.chunk_shift() != opts.chunk_shift {
        return Err(NotSameFiles::Chunking { image_chunk: c.chunk_size >> 10, image_hash: c.hash, chunk: (1u64 << opts.chunk_shift) >> 10, hash: opts.hash });
    }
    let kind = opts.kind.unwrap_or_else(|| scan::detect_kind(&sc.files));
    if c.kind != kind {
        return Err(NotSameFiles::Kind { image: c.kind, dir: kind });
    }
    let ours: std::collections::BTreeSet<&str> = sc.files.iter().map(|f| f.name.as_str()).collect();
    let theirs: std::collections::BTreeSet<&str> = names.collect();
    if ours != theirs {
        // A few names are enough to say why; a directory of thousands is not listed whole.
        let list = |v: Vec<&&str>| {
            let mut s = v.iter().take(5).map(|n| n.to_string()).collect::<Vec<_>>().join(", ");
            if v.len() > 5 {
                s.push_str(&format!(" and {} more", v.len() - 5));
            }
            if s.is_empty() {
                s.push_str("none");
            }
            s
        };
        return Err(NotSameFiles::Files { added: list(ours.difference(&theirs).collect()), removed: list(theirs.difference(&ours).collect()) });
    }
    Ok(())
}

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

/// Where a chunk's stored bytes are during packing (own packs are not named yet).
#[derive(Debug, Clone, Copy)]
struct Loc {
    /// Index into `pack_slots`.
    slot: u32,
    offset: u64,
    stored_len: u32,
    codec: Codec,
}

enum Slot {
    /// The n-th pack this run writes.
    Own(usize),
    Foreign {
        pack: PackRef,
        owner: &'static str,
        from_base: bool,
    },
}

/// Where one chunk went: `None` = inherited from the parent, `Some((digest, None))` =
/// zero, `Some((digest, Some(loc)))` = stored.
type PlacedChunk = Option<(ChunkDigest, Option<Loc>)>;

/// Per file, per chunk: where it went.
type Placed = Vec<Vec<PlacedChunk>>;

/// Slice CVs of the raw chunks placed so far, by digest, kept under the outboard's size
/// limit by doubling the slice size when they would pass it.
struct SliceCvs {
    /// Slice shift the CVs are computed at (as hashed).
    hashed_shift: u8,
    /// Slice shift they are kept at (`hashed_shift` unless coarsened).
    shift: u8,
    chunk_shift: u8,
    by_digest: HashMap<ChunkDigest, (u32, Vec<Cv>)>,
    /// Encoded size of an outboard of what `by_digest` holds.
    bytes: u64,
    /// Most bytes that outboard may have ([`MAX_OUTBOARD_BYTES`]; smaller in tests).
    limit: u64,
}

impl SliceCvs {
    fn new(chunk_shift: u8, shift: u8) -> Self {
        SliceCvs { hashed_shift: shift, shift, chunk_shift, by_digest: HashMap::new(), bytes: OUTBOARD_HEADER_LEN as u64, limit: MAX_OUTBOARD_BYTES }
    }

    fn entry_bytes(n_cvs: usize) -> u64 {
        (ENTRY_LEN + 32 * n_cvs) as u64
    }

    /// Keep `cvs` (computed at `hashed_shift`) for the raw chunk `digest` of `len` bytes.
    fn insert(&mut self, digest: ChunkDigest, len: u32, mut cvs: Vec<Cv>) {
        if self.by_digest.contains_key(&digest) || self.shift >= self.chunk_shift {
            return;
        }
        for _ in self.hashed_shift..self.shift {
            cvs = verify::hash::coarsen_slice_cvs(&cvs);
        }
        if cvs.len() < 2 {
            return;
        }
        self.bytes += Self::entry_bytes(cvs.len());
        self.by_digest.insert(digest, (len, cvs));
        while self.bytes > self.limit && self.shift < self.chunk_shift {
            self.coarsen();
        }
    }

    /// Double the slice size: merge CV pairs, drop chunks now of one slice. At half a
    /// chunk per slice and still too big, give up on an outboard (every entry gone).
    fn coarsen(&mut self) {
        self.shift += 1;
        let shift = self.shift;
        let last = shift >= self.chunk_shift;
        self.by_digest.retain(|_, (len, cvs)| {
            *cvs = verify::hash::coarsen_slice_cvs(cvs);
            !last && slice_count(u64::from(*len), shift) >= 2
        });
        self.bytes = OUTBOARD_HEADER_LEN as u64 + self.by_digest.values().map(|(_, c)| Self::entry_bytes(c.len())).sum::<u64>();
    }
}

/// A chunk's compressed form, when compression paid.
type Compressed = (Codec, Vec<u8>);

enum ToWriter {
    Data(Vec<u8>),
    /// The current pack is complete; later data goes into a new one.
    Rollover,
    /// Every chunk was sent: seal the last pack. A pack still open when the channel closes
    /// without this (the packing failed) is discarded, never named.
    End,
}

enum ToHasher {
    Data(Vec<u8>),
    /// All of this pack's bytes were sent before it.
    Seal(Box<BlobWriter>),
}

/// Bytes a pack writer lets pile up before starting their writeback.
const WRITEBACK_EVERY: u64 = 8 << 20;

/// Pipeline stage 1: copy each chunk into the current pack file, then pass it on to be
/// hashed. Stops quietly when the hasher is gone (its own error is the cause).
fn write_packs(layout: &OciLayout, rx: mpsc::Receiver<ToWriter>, to_hasher: mpsc::SyncSender<ToHasher>) -> Result<(), FormatError> {
    let mut cur: Option<BlobWriter> = None;
    for msg in rx {
        let ToWriter::Data(b) = msg else {
            // Rollover or End: the pack being written is complete.
            if let Some(mut w) = cur.take() {
                w.start_writeback();
                if to_hasher.send(ToHasher::Seal(Box::new(w))).is_err() {
                    return Ok(());
                }
            }
            if matches!(msg, ToWriter::End) {
                break;
            }
            continue;
        };
        let w = match cur.as_mut() {
            Some(w) => w,
            None => cur.insert(layout.blob_writer_hashed_by_caller()?),
        };
        w.write_all(&b).map_err(|e| FormatError::Io { context: format!("writing a pack into {}", layout.root().display()), source: e })?;
        if w.unhinted() >= WRITEBACK_EVERY {
            w.start_writeback();
        }
        if to_hasher.send(ToHasher::Data(b)).is_err() {
            return Ok(());
        }
    }
    Ok(())
}

/// Pipeline stage 2: the SHA-256 of each pack, from the same bytes the writer wrote.
fn hash_packs(rx: mpsc::Receiver<ToHasher>, to_sealer: mpsc::SyncSender<(BlobWriter, OciDigest)>) -> Result<(), FormatError> {
    let mut h = OciHasher::sha256();
    for msg in rx {
        match msg {
            ToHasher::Data(b) => h.update(&b),
            ToHasher::Seal(w) => {
                let d = std::mem::replace(&mut h, OciHasher::sha256()).finish();
                if to_sealer.send((*w, d)).is_err() {
                    return Ok(());
                }
            }
        }
    }
    Ok(())
}

/// Pipeline stage 3: make each finished pack durable under its name, in order, and
/// announce it (`push DIR` starts uploading it then, while later packs are being made).
fn seal_packs(rx: mpsc::Receiver<(BlobWriter, OciDigest)>, on_pack: Option<OnPack>) -> Result<Vec<(OciDigest, u64)>, FormatError> {
    let mut done = Vec::new();
    for (w, d) in rx {
        let (d, size) = w.finish_as(d)?;
        if let Some(f) = on_pack {
            f(&d, size);
        }
        done.push((d, size));
    }
    Ok(done)
}

struct Job {
    chunk: u64,
    len: u32,
    /// `None`: a hole, zero without reading; `Some(buf)`: the chunk's bytes.
    data: Option<Vec<u8>>,
    /// Inherit from the parent without looking at the data (diff-snapshot hole).
    inherit: bool,
    digest: ChunkDigest,
    /// Slice CVs, when the image has an outboard and the chunk is longer than a slice.
    cvs: Option<Vec<Cv>>,
    zero: bool,
    /// Unchanged since the parent, but stored again: the parent has it in a pack a
    /// compaction retires.
    compacted: bool,
}

/// Pack `src_dir` into `dest` and tag it `tag`.
pub fn pack(src_dir: &Path, dest: &OciLayout, tag: &str, opts: &PackOptions) -> Result<PackReport, PackError> {
    let t0 = Instant::now();
    imgfmt::layout::check_tag(tag)?;
    check_options(opts)?;
    let algo = opts.hash;
    // A layer has its parent's ancestors plus the parent. Past the limit, rebase: the
    // same records a full image would have, pointing where the chain stored the bytes.
    let rebase = opts.parent.as_ref().is_some_and(|p| p.image.chain.len() > opts.max_chain);
    // Packs of the chain a rebased image points into are no ancestor's any more.
    let chain_owner = if rebase { media::OWNER_REBASED } else { "parent" };
    let (sc, kind) = scan_source(src_dir, opts)?;
    let mut report = PackReport { kind: kind.to_string(), files: sc.files.len(), skipped: sc.skipped.clone(), ..Default::default() };

    let compaction = Compaction::plan(opts);
    if let Some(c) = &compaction {
        report.compacted = true;
        report.packs_retired = c.retired.len();
    }
    let retired = compaction.map(|c| c.retired).unwrap_or_default();
    let known = known_chunks(opts, chain_owner, &retired);
    let parent_files: HashMap<&str, &imgfmt::ResolvedFile> = opts.parent.iter().flat_map(|r| r.image.files.iter().map(|f| (f.name.as_str(), f))).collect();
    let mut slots = Slots::default();
    let base_outboard = shared_base_outboard(opts);
    let input = ChunkInput { opts, parent_files: &parent_files, known: &known, retired: &retired, base_outboard: base_outboard.as_ref().map(|(_, ob)| ob) };
    let (Chunked { placed, own_bytes, slices, base_outboard_used }, own_packs) = chunk_into_packs(dest, &sc.files, &input, &mut slots, &mut report)?;
    report.pack_bytes = own_bytes;
    report.packs = own_packs.len();
    let placement = Placement { files: &sc.files, placed: &placed, parent_files: &parent_files };

    if rebase {
        add_chain_packs(opts, &placement, &mut slots, chain_owner);
    }
    let (index, entries, roots) = placement.index(opts, rebase, &slots, &own_packs)?;
    let outboard = match slices {
        Some(s) => outboard_of_pack(&index, s, opts, rebase, base_outboard.as_ref().map(|(_, ob)| ob))?,
        None => None,
    };
    let image_root = verify::image_root(algo, sc.files.iter().zip(&roots).map(|(f, r)| (f.name.as_str(), f.size, *r)));
    let index_bytes = index.encode();
    let index_digest = dest.put_blob(&index_bytes)?;

    let index_ref = BlobRef { digest: index_digest.clone(), size: index_bytes.len() as u64 };
    let config = image_config(opts, rebase, kind, entries, image_root.display_with(algo), index_ref);
    let config_bytes = config.encode();
    let config_digest = dest.put_blob(&config_bytes)?;

    // Manifest layers: own index and packs, the parent chain's configs and indexes, and
    // every foreign pack a chunk of the resolved image points into.
    let mut layers = vec![Descriptor::new(media::INDEX, index_digest.clone(), index_bytes.len() as u64).with_annotation(media::ANN_OWNER, "self")];
    for (d, size) in &own_packs {
        layers.push(Descriptor::new(media::PACK, d.clone(), *size).with_annotation(media::ANN_OWNER, "self"));
    }
    if let Some(ob) = &outboard {
        layers.push(own_outboard_layer(dest, ob, &mut report)?);
    }
    let parent = opts.parent.as_ref().filter(|_| !rebase);
    if let Some(p) = parent {
        layers.extend(ancestor_layers(dest, p)?);
    }
    if let Some(d) = base_outboard_layer(dest, opts, base_outboard_used, base_outboard.as_ref())? {
        layers.push(Descriptor::new(media::OUTBOARD, d.digest, d.size).with_annotation(media::ANN_OWNER, "base"));
    }
    let foreign = foreign_packs(&slots, parent.map(|p| (p, &placement)));
    layers.extend(foreign_pack_layers(dest, opts, &foreign)?);
    let annotations = manifest_annotations(opts, rebase, &config, kind, &foreign, &mut report);
    report.chain_depth = match &opts.parent {
        Some(p) if !rebase => p.image.chain.len(),
        _ => 0,
    };
    report.excess_packs = excess_packs(&placement, opts, &index);
    let manifest = Manifest {
        schema_version: 2,
        media_type: Some(media::OCI_MANIFEST.into()),
        artifact_type: Some(media::ARTIFACT_TYPE.into()),
        config: Descriptor::new(media::CONFIG, config_digest, config_bytes.len() as u64),
        layers,
        subject: None,
        annotations,
    };
    let manifest_bytes = manifest.encode();
    let manifest_digest = dest.put_blob(&manifest_bytes)?;
    dest.set_tag(
        tag,
        Descriptor::new(media::OCI_MANIFEST, manifest_digest.clone(), manifest_bytes.len() as u64).with_annotation(media::ANN_ROOT, config.root.clone()),
    )?;

    report.manifest = manifest_digest.to_string();
    report.root = config.root;
    report.metadata_bytes = (manifest_bytes.len() + config_bytes.len() + index_bytes.len()) as u64 + report.outboard_bytes;
    report.seconds = t0.elapsed().as_secs_f64();
    Ok(report)
}

/// The base's outboard, read to share: the slice CVs of the base's chunks this image
/// shares stay there (the manifest lists it) instead of being copied into every clone's
/// outboard. `None` without a BLAKE3 base of the same slice size, or when it cannot be
/// read (then its CVs are copied).
fn shared_base_outboard(opts: &PackOptions) -> Option<(Vec<u8>, Outboard)> {
    match (&opts.base, opts.slice_shift) {
        (Some(b), Some(shift)) if opts.hash == HashAlgo::Blake3 => match b.image.chain[0].read_outboard_bytes(b.source) {
            Ok(Some((bytes, ob))) if ob.slice_shift == shift => Some((bytes, ob)),
            Ok(_) => None,
            Err(e) => {
                tracing::warn!("the base's outboard could not be read ({e}): its slice CVs are copied into this image's");
                None
            }
        },
        _ => None,
    }
}

/// Rebasing: every chunk the layer would have inherited gets a record where the chain
/// stores it, so those packs join the pack table as foreign packs owned by `chain_owner`.
fn add_chain_packs(opts: &PackOptions, placement: &Placement, slots: &mut Slots, chain_owner: &'static str) {
    let p = opts.parent.as_ref().expect("rebase has a parent");
    for pc in placement.inherited() {
        if let StoredAt::Pack { pack, codec, .. } = pc.at {
            for pr in std::iter::once(pack).chain(codec.ref_pack()).map(|k| &p.image.packs[k as usize]) {
                slots.foreign(&pr.digest, chain_owner, false, || pr.size);
            }
        }
    }
}

/// The base's outboard as a layer of this image, stored in `dest`: when this image
/// leaves slices of the base's chunks to it (`used`), or when the parent did (the chunks
/// it inherits, or records again when rebased).
fn base_outboard_layer(dest: &OciLayout, opts: &PackOptions, used: bool, base_outboard: Option<&(Vec<u8>, Outboard)>) -> Result<Option<Descriptor>, PackError> {
    Ok(match (&opts.base, &opts.parent) {
        (Some(b), _) if used => {
            // Read (and checked against its digest) before packing: stored from those
            // bytes, not read from the base again (a remote base's is megabytes).
            let (bytes, _) = base_outboard.expect("used only when read");
            let d = b.image.chain[0].outboard_blob.clone().expect("read from the blob the base lists");
            if !dest.has_blob(&d.digest) {
                dest.put_blob(bytes)?;
            }
            Some(d)
        }
        (_, Some(p)) => match &p.image.base_outboard_blob {
            Some(d) => {
                ensure_blob(dest, p.source, &d.digest)?;
                Some(d.clone())
            }
            None => None,
        },
        _ => None,
    })
}

/// This image's own outboard as a layer, stored in `dest`, its figures in `report`.
fn own_outboard_layer(dest: &OciLayout, ob: &Outboard, report: &mut PackReport) -> Result<Descriptor, PackError> {
    let bytes = ob.encode();
    let d = dest.put_blob(&bytes)?;
    report.slice_size = 1 << ob.slice_shift;
    report.outboard_entries = ob.entries.len() as u64;
    report.outboard_bytes = bytes.len() as u64;
    Ok(Descriptor::new(media::OUTBOARD, d, bytes.len() as u64).with_annotation(media::ANN_OWNER, "self"))
}

/// The foreign packs as layers, by owner. Each is copied into `dest` from the base or
/// parent it comes from, except a parent's when the parent's packs are stored elsewhere.
fn foreign_pack_layers(dest: &OciLayout, opts: &PackOptions, foreign: &BTreeMap<OciDigest, (u64, &'static str, bool)>) -> Result<Vec<Descriptor>, PackError> {
    let mut layers = Vec::with_capacity(foreign.len());
    for (d, (size, owner, from_base)) in foreign {
        let src = if *from_base { opts.base.as_ref() } else { opts.parent.as_ref() }.expect("foreign pack has a source").source;
        if *from_base || !opts.parent_packs_elsewhere {
            ensure_blob(dest, src, d)?;
        }
        layers.push(Descriptor::new(media::PACK, d.clone(), *size).with_annotation(media::ANN_OWNER, *owner));
    }
    Ok(layers)
}

/// The manifest's annotations: root, kind, creation, and for a rebased image what it was
/// rebased from (noted in `report` with the chain packs it refers to).
fn manifest_annotations(
    opts: &PackOptions,
    rebase: bool,
    config: &ImageConfig,
    kind: Kind,
    foreign: &BTreeMap<OciDigest, (u64, &'static str, bool)>,
    report: &mut PackReport,
) -> BTreeMap<String, String> {
    let mut annotations = BTreeMap::new();
    annotations.insert(media::ANN_ROOT.to_string(), config.root.clone());
    annotations.insert(media::ANN_KIND.to_string(), kind.to_string());
    annotations.insert(media::ANN_CREATED.to_string(), config.created.clone());
    if rebase {
        let p = opts.parent.as_ref().expect("rebase has a parent");
        annotations.insert(media::ANN_REBASED_FROM.to_string(), p.image.manifest_digest.to_string());
        report.rebased = true;
        report.rebased_from = Some(p.image.manifest_digest.to_string());
        report.chain_packs_referenced = foreign.values().filter(|(_, owner, _)| *owner == media::OWNER_REBASED).count();
    }
    annotations
}

/// Refuse options no image can be made with before anything is read: sizes out of range,
/// a base or parent hashed or chunked differently, `--diff` without a parent, a chain
/// longer than readers open.
fn check_options(opts: &PackOptions) -> Result<(), PackError> {
    if !(imgfmt::MIN_CHUNK_SHIFT..=imgfmt::MAX_CHUNK_SHIFT).contains(&opts.chunk_shift) {
        return Err(PackError::Invalid(format!("chunk size 2^{} outside 64KiB..=16MiB", opts.chunk_shift)));
    }
    if opts.pack_size < (1u64 << opts.chunk_shift) {
        return Err(PackError::Invalid("pack size must be at least one chunk".into()));
    }
    if let Some(s) = opts.slice_shift {
        if !(imgfmt::outboard::MIN_SLICE_SHIFT..opts.chunk_shift).contains(&s) {
            return Err(PackError::Invalid(format!("slice size 2^{s} outside 4KiB..={}KiB (half a chunk)", (1u64 << opts.chunk_shift) >> 11)));
        }
    }
    let shift = opts.chunk_shift;
    let algo = opts.hash;
    for (what, rel) in [("base", &opts.base), ("parent", &opts.parent)] {
        if let Some(r) = rel {
            let c = r.image.config();
            if c.hash != algo || c.chunk_shift() != shift {
                return Err(PackError::Invalid(format!(
                    "{what} {} uses {} with {} KiB chunks; this pack uses {algo} with {} KiB chunks (pass the same --hash and --chunk-size)",
                    r.reference,
                    c.hash,
                    c.chunk_size >> 10,
                    (1u64 << shift) >> 10
                )));
            }
        }
    }
    if opts.diff && opts.parent.is_none() {
        return Err(PackError::Invalid("--diff needs --parent: a diff snapshot's holes mean 'as in the parent'".into()));
    }
    if opts.max_chain > MAX_CHAIN_DEPTH {
        return Err(PackError::Invalid(format!("--max-chain {}: readers open at most {MAX_CHAIN_DEPTH} ancestors", opts.max_chain)));
    }
    Ok(())
}

/// The source directory's files, named and given their roles, and the runtime kind.
fn scan_source(src_dir: &Path, opts: &PackOptions) -> Result<(scan::Scan, Kind), PackError> {
    let mut sc = scan::scan_dir(src_dir).map_err(io_at(src_dir))?;
    if sc.files.len() as u64 > imgfmt::index::MAX_FILES {
        return Err(PackError::Invalid(format!("{} files, at most {}", sc.files.len(), imgfmt::index::MAX_FILES)));
    }
    let kind = opts.kind.unwrap_or_else(|| scan::detect_kind(&sc.files));
    for f in &mut sc.files {
        imgfmt::config::check_name(&f.name)?;
        f.role = scan::role_of(kind, &f.name);
    }
    Ok((sc, kind))
}

/// A compaction of the parent chain's packs (spec/format.md §10, "Compaction"): the packs
/// whose chunks this image stores again instead of pointing into them.
struct Compaction {
    retired: HashSet<OciDigest>,
}

impl Compaction {
    /// The packs to retire, or `None` when the image does not pass the bound. Measured on
    /// the parent as resolved (what this image inherits), plus one pack of its own: for
    /// each of the chain's packs (a base's excepted: sharing those is the point of a
    /// base), the bytes of the distinct stored ranges it is read for.
    fn plan(opts: &PackOptions) -> Option<Compaction> {
        let (bound, p) = (opts.compact_after?, opts.parent.as_ref()?);
        let live = chain_pack_bytes(&p.image, opts);
        let total: u64 = live.iter().map(|(_, b)| b).sum();
        let fewest = |bytes: u64| bytes.div_ceil(opts.pack_size) as usize;
        // This image adds a pack of its own (almost always: something changed).
        if (live.len() + 1).saturating_sub(fewest(total)) <= bound {
            return None;
        }
        // Keep the packs read for the most bytes, as many as the target allows with the
        // rest rewritten into as few packs as they fill: the fewest bytes rewritten.
        let target = fewest(total) + bound / 4;
        let mut kept_bytes = 0u64;
        let mut keep = 0;
        for (k, (_, b)) in live.iter().enumerate() {
            if k + 1 + fewest(total - kept_bytes - b) > target {
                break;
            }
            kept_bytes += b;
            keep = k + 1;
        }
        Some(Compaction { retired: live[keep..].iter().map(|(d, _)| d.clone()).collect() })
    }
}

/// The parent chain's packs the parent reads from (a base's excepted), with the bytes of
/// the distinct stored ranges read from each, most first.
fn chain_pack_bytes(parent: &Image, opts: &PackOptions) -> Vec<(OciDigest, u64)> {
    let base: HashSet<&OciDigest> = parent
        .manifest
        .layers
        .iter()
        .filter(|d| d.annotations.get(media::ANN_OWNER).is_some_and(|o| o == "base"))
        .map(|d| &d.digest)
        .chain(opts.base.iter().flat_map(|b| b.image.packs.iter().map(|p| &p.digest)))
        .collect();
    let mut ranges: Vec<(u32, u64, u32)> = parent
        .files
        .iter()
        .flat_map(|f| &f.chunks)
        .filter_map(|c| if let StoredAt::Pack { pack, offset, stored_len, .. } = c.at { Some((pack, offset, stored_len)) } else { None })
        .collect();
    ranges.sort_unstable();
    ranges.dedup();
    let mut bytes: HashMap<u32, u64> = HashMap::new();
    for (pack, _, len) in ranges {
        *bytes.entry(pack).or_default() += u64::from(len);
    }
    let mut live: Vec<(OciDigest, u64)> =
        bytes.into_iter().map(|(p, b)| (parent.packs[p as usize].digest.clone(), b)).filter(|(d, _)| !base.contains(d)).collect();
    live.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    live
}

/// The written image's fragmentation: packs of the chain (a base's excepted) and of its
/// own that a full read touches, beyond the fewest that could hold the bytes read.
fn excess_packs(placement: &Placement, opts: &PackOptions, index: &ChunkIndex) -> usize {
    let base: HashSet<&OciDigest> = opts.base.iter().flat_map(|b| b.image.packs.iter().map(|p| &p.digest)).collect();
    let mut ranges: Vec<(&OciDigest, u64, u32)> = Vec::new();
    for r in &index.records {
        if let RecordKind::Stored { pack, offset, stored_len, .. } = r.kind {
            ranges.push((&index.packs[pack as usize].digest, offset, stored_len));
        }
    }
    if let Some(p) = opts.parent.as_ref().filter(|_| index.layer) {
        for pc in placement.inherited() {
            if let StoredAt::Pack { pack, offset, stored_len, .. } = pc.at {
                ranges.push((&p.image.packs[pack as usize].digest, offset, stored_len));
            }
        }
    }
    ranges.retain(|(d, _, _)| !base.contains(d));
    ranges.sort_unstable();
    ranges.dedup();
    let bytes: u64 = ranges.iter().map(|r| u64::from(r.2)).sum();
    let packs: HashSet<&OciDigest> = ranges.iter().map(|r| r.0).collect();
    packs.len().saturating_sub(bytes.div_ceil(opts.pack_size) as usize)
}

/// Where a chunk of the base or the parent chain is stored: a chunk of this image with
/// its digest is recorded there instead of stored again.
struct KnownChunk {
    pack: OciDigest,
    offset: u64,
    stored_len: u32,
    /// As the base or the chain resolved it (a `zstd-ref` chunk's reference pack numbered
    /// among that image's packs: see `ref_pack`).
    codec: Codec,
    /// A `zstd-ref` chunk's reference pack (digest, size).
    ref_pack: Option<(OciDigest, u64)>,
    /// The manifest annotation `owner` of its pack.
    owner: &'static str,
    /// In the base (else in the parent chain): which source holds the pack.
    from_base: bool,
}

/// Every stored chunk of the base and the parent chain, by digest (the base's first),
/// except those in `retired` packs (a compaction stores them again).
fn known_chunks(opts: &PackOptions, chain_owner: &'static str, retired: &HashSet<OciDigest>) -> HashMap<ChunkDigest, KnownChunk> {
    let mut known = HashMap::new();
    for (rel, owner, from_base) in [(&opts.base, "base", true), (&opts.parent, chain_owner, false)] {
        if let Some(r) = rel {
            for f in &r.image.files {
                for c in &f.chunks {
                    if let StoredAt::Pack { pack, offset, stored_len, codec } = c.at {
                        if retired.contains(&r.image.packs[pack as usize].digest) {
                            continue;
                        }
                        known.entry(c.digest).or_insert_with(|| KnownChunk {
                            pack: r.image.packs[pack as usize].digest.clone(),
                            offset,
                            stored_len,
                            codec,
                            ref_pack: codec.ref_pack().map(|rp| (r.image.packs[rp as usize].digest.clone(), r.image.packs[rp as usize].size)),
                            owner,
                            from_base,
                        });
                    }
                }
            }
        }
    }
    known
}

/// The pack table being built: own packs (named once written) and the foreign packs
/// (base, parent chain) this index points into, in the order chunks first used them.
#[derive(Default)]
struct Slots {
    list: Vec<Slot>,
    /// A foreign pack's slot.
    foreign: HashMap<OciDigest, u32>,
}

impl Slots {
    /// The slot of foreign pack `digest`, added if it has none yet (`size` is asked only
    /// then).
    fn foreign(&mut self, digest: &OciDigest, owner: &'static str, from_base: bool, size: impl FnOnce() -> u64) -> u32 {
        *self.foreign.entry(digest.clone()).or_insert_with(|| {
            self.list.push(Slot::Foreign { pack: PackRef { digest: digest.clone(), size: size() }, owner, from_base });
            (self.list.len() - 1) as u32
        })
    }

    /// The index's pack table: slots in order, own packs now named.
    fn table(&self, own_packs: &[(OciDigest, u64)]) -> Vec<PackRef> {
        self.list
            .iter()
            .map(|s| match s {
                Slot::Own(n) => {
                    let (d, size) = &own_packs[*n];
                    PackRef { digest: d.clone(), size: *size }
                }
                Slot::Foreign { pack, .. } => pack.clone(),
            })
            .collect()
    }
}

/// Chunk `files` while the pack pipeline (see [`write_packs`]) writes what is stored:
/// returns what chunking placed and the own packs written (digest, size), in order.
fn chunk_into_packs(
    dest: &OciLayout,
    files: &[scan::SourceFile],
    input: &ChunkInput,
    slots: &mut Slots,
    report: &mut PackReport,
) -> Result<(Chunked, Vec<(OciDigest, u64)>), PackError> {
    // Packs are written by a pipeline beside this thread (which reads and BLAKE3-hashes):
    // a writer copies each chunk into the pack file and starts its writeback, a hasher
    // runs the pack's SHA-256 (one stream, so one core: the slowest stage), and a sealer
    // fsyncs and names each finished pack, so no stage waits on another's slow part
    // (with one thread doing all three, a 2 GiB pack took 1.7 s, 0.6 s of it in fsyncs).
    // Not `imgfmt::work`: three stages joined by channels, not items shared out.
    let (tx, rx) = mpsc::sync_channel::<ToWriter>(16);
    let on_pack = input.opts.on_pack;
    let (result, own_packs) = std::thread::scope(|s| {
        let (to_hasher, hasher_rx) = mpsc::sync_channel::<ToHasher>(32);
        let (to_sealer, sealer_rx) = mpsc::sync_channel::<(BlobWriter, OciDigest)>(4);
        let writer = s.spawn(move || write_packs(dest, rx, to_hasher));
        let hasher = s.spawn(move || hash_packs(hasher_rx, to_sealer));
        let sealer = s.spawn(move || seal_packs(sealer_rx, on_pack));
        let mut r = Chunker::new(input, slots, &tx, report).all(files);
        if r.is_ok() && tx.send(ToWriter::End).is_err() {
            r = Err(PackError::Invalid("pack writer stopped early".into()));
        }
        drop(tx);
        // A stage that fails drops its receiver, and the stages before it stop
        // quietly: the one error returned is the cause.
        let stages = [writer.join(), hasher.join()].into_iter().map(|j| j.expect("pack writer thread panicked"));
        let sealed = sealer.join().expect("pack sealer thread panicked");
        let w = stages.fold(Ok(()), Result::and).and(sealed);
        (r, w)
    });
    // A writer that failed (a full disk, a file size limit) is the cause; the main thread
    // only saw it stop taking data, so its own error would hide the reason.
    let own_packs = match (&result, own_packs) {
        (Err(_), Err(e)) => return Err(e.into()),
        (_, w) => w,
    };
    let chunked = result?;
    Ok((chunked, own_packs?))
}

/// Where every chunk of the source files went ([`Placed`]), with what it builds on: what
/// the index, the roots and the manifest are made from.
struct Placement<'a> {
    files: &'a [scan::SourceFile],
    placed: &'a Placed,
    parent_files: &'a HashMap<&'a str, &'a imgfmt::ResolvedFile>,
}

impl Placement<'_> {
    /// The parent's chunk at every position inherited from it, in file order.
    fn inherited(&self) -> impl Iterator<Item = &imgfmt::ResolvedChunk> + '_ {
        self.files.iter().zip(self.placed).flat_map(move |(f, slots)| {
            let parent = self.parent_files.get(f.name.as_str());
            slots.iter().enumerate().filter(|(_, s)| s.is_none()).map(move |(c, _)| &parent.expect("an inherited chunk has a parent file").chunks[c])
        })
    }

    /// The chunk index (records, file table, pack table), each file's config entry and
    /// Merkle root. A layer has no record for an inherited chunk; a rebased image records
    /// it where the chain stores it.
    fn index(
        &self,
        opts: &PackOptions,
        rebase: bool,
        slots: &Slots,
        own_packs: &[(OciDigest, u64)],
    ) -> Result<(ChunkIndex, Vec<FileEntry>, Vec<ChunkDigest>), PackError> {
        let (algo, shift) = (opts.hash, opts.chunk_shift);
        let layer = opts.parent.is_some() && !rebase;
        let mut index = ChunkIndex { hash: algo, chunk_shift: shift, layer, files: Vec::new(), packs: slots.table(own_packs), records: Vec::new() };
        let mut entries = Vec::new();
        let mut roots = Vec::new();
        for (fi, f) in self.files.iter().enumerate() {
            let first = index.records.len() as u64;
            let mut digests = Vec::with_capacity(self.placed[fi].len());
            for (c, slot) in self.placed[fi].iter().enumerate() {
                let (digest, kind) = match slot {
                    Some((digest, None)) => (*digest, RecordKind::Zero),
                    Some((digest, Some(l))) => (*digest, RecordKind::Stored { pack: l.slot, offset: l.offset, stored_len: l.stored_len, codec: l.codec }),
                    None => {
                        let pc = self.parent_files[f.name.as_str()].chunks[c];
                        digests.push(pc.digest);
                        if !rebase {
                            // Inherited from the parent: no record.
                            continue;
                        }
                        let p = opts.parent.as_ref().expect("rebase has a parent");
                        let kind = match pc.at {
                            StoredAt::Zero => RecordKind::Zero,
                            StoredAt::Pack { pack, offset, stored_len, codec } => RecordKind::Stored {
                                pack: slots.foreign[&p.image.packs[pack as usize].digest],
                                offset,
                                stored_len,
                                codec: codec.map_ref(|rp| slots.foreign[&p.image.packs[rp as usize].digest]),
                            },
                        };
                        index.records.push(ChunkRecord { chunk: c as u64, kind, digest: pc.digest });
                        continue;
                    }
                };
                digests.push(digest);
                index.records.push(ChunkRecord { chunk: c as u64, kind, digest });
            }
            index.files.push(IndexFile { size: f.size, first_record: first, record_count: index.records.len() as u64 - first });
            let root = verify::file_root(algo, &digests);
            roots.push(root);
            entries.push(FileEntry {
                name: f.name.clone(),
                size: f.size,
                mode: f.mode,
                role: f.role,
                chunks: chunk_count(f.size, shift),
                root: root.display_with(algo),
            });
        }
        index.validate()?;
        Ok((index, entries, roots))
    }
}

/// The manifest layers of a layer's ancestors, copied into `dest` when missing: each
/// one's config, index and outboard (so a lazy reader of this layer can verify slices of
/// the chunks it inherits: an outboard covers only its own index's records).
fn ancestor_layers(dest: &OciLayout, p: &Related) -> Result<Vec<Descriptor>, PackError> {
    let mut layers = Vec::new();
    for (k, link) in p.image.chain.iter().enumerate() {
        let owner = vec!["parent"; k + 1].join(".");
        ensure_blob(dest, p.source, &link.config_digest)?;
        ensure_blob(dest, p.source, &link.index_digest)?;
        // The copy just ensured is local: asking a registry instead cost a round trip
        // per ancestor, one after the other.
        let cs = dest.blob_size(&link.config_digest)?;
        layers.push(Descriptor::new(media::CONFIG, link.config_digest.clone(), cs).with_annotation(media::ANN_OWNER, owner.clone()));
        layers.push(Descriptor::new(media::INDEX, link.index_digest.clone(), link.config.index.size).with_annotation(media::ANN_OWNER, owner.clone()));
        if let Some(ob) = &link.outboard_blob {
            ensure_blob(dest, p.source, &ob.digest)?;
            layers.push(Descriptor::new(media::OUTBOARD, ob.digest.clone(), ob.size).with_annotation(media::ANN_OWNER, owner));
        }
    }
    Ok(layers)
}

/// Every foreign pack a chunk of the resolved image points into, by digest: (size,
/// owner, from the base): the index's foreign slots, and for a layer (`parent`) the
/// packs of the chunks it inherits.
fn foreign_packs(slots: &Slots, parent: Option<(&Related, &Placement)>) -> BTreeMap<OciDigest, (u64, &'static str, bool)> {
    let mut foreign: BTreeMap<OciDigest, (u64, &'static str, bool)> = BTreeMap::new();
    for s in &slots.list {
        if let Slot::Foreign { pack, owner, from_base } = s {
            foreign.insert(pack.digest.clone(), (pack.size, owner, *from_base));
        }
    }
    if let Some((p, placement)) = parent {
        for pc in placement.inherited() {
            if let StoredAt::Pack { pack, codec, .. } = pc.at {
                let pr = &p.image.packs[pack as usize];
                foreign.entry(pr.digest.clone()).or_insert((pr.size, "parent", false));
                // A `zstd-ref` chunk reads its reference's pack too: a base's pack, which
                // keeps its owner (compaction never retires a base's packs).
                if let Some(rp) = codec.ref_pack() {
                    let pr = &p.image.packs[rp as usize];
                    let base =
                        p.image.manifest.layers.iter().any(|d| d.digest == pr.digest && d.annotations.get(media::ANN_OWNER).is_some_and(|o| o == "base"));
                    foreign.entry(pr.digest.clone()).or_insert((pr.size, if base { "base" } else { "parent" }, false));
                }
            }
        }
    }
    foreign
}

/// The config of the image being packed.
fn image_config(opts: &PackOptions, rebase: bool, kind: Kind, files: Vec<FileEntry>, root: String, index: BlobRef) -> ImageConfig {
    let chain_ref = |r: &Related| ChainRef {
        manifest: r.image.manifest_digest.clone(),
        config: r.image.chain[0].config_digest.clone(),
        index: r.image.chain[0].index_digest.clone(),
        root: r.image.config().root.clone(),
        reference: Some(r.reference.clone()),
    };
    ImageConfig {
        format: CONFIG_FORMAT.into(),
        kind,
        created: created_now(),
        chunk_size: 1 << opts.chunk_shift,
        hash: opts.hash,
        compression: opts.compression.to_string(),
        files,
        root,
        index,
        parent: opts.parent.as_ref().filter(|_| !rebase).map(chain_ref),
        base: opts.base.as_ref().map(chain_ref),
        annotations: opts.annotations.clone(),
    }
}

/// The outboard of the packed `index` from the slice CVs kept while hashing; a rebased
/// index lists the chain's chunks this packer did not hash: their CVs come from the
/// outboards the chain already stored (an entry is trusted by a reader only once its
/// CVs merge to the digest, §8.2).
fn outboard_of_pack(
    index: &ChunkIndex,
    mut slices: SliceCvs,
    opts: &PackOptions,
    rebase: bool,
    base_outboard: Option<&Outboard>,
) -> Result<Option<Outboard>, PackError> {
    if rebase {
        let parent = opts.parent.as_ref().expect("rebase has a parent");
        inherit_slice_cvs(index, &parent.image, parent.source, &mut slices)?;
    }
    outboard_of(index, slices, !rebase, base_outboard)
}

/// The outboard of `index`: an entry for every raw record longer than a slice, from the
/// CVs computed while hashing. `None` when no record needs one (no blob is written).
///
/// `complete`: every raw record was hashed by this packer, so a missing entry is a bug; a
/// rebased index may name chunks no stored outboard covers, which readers then fetch whole.
fn outboard_of(index: &ChunkIndex, mut slices: SliceCvs, complete: bool, base_outboard: Option<&Outboard>) -> Result<Option<Outboard>, PackError> {
    let slice = 1u64 << slices.shift;
    let mut entries = Vec::new();
    let mut done = std::collections::HashSet::new();
    for r in &index.records {
        let RecordKind::Stored { codec: Codec::Raw, stored_len, .. } = r.kind else { continue };
        if u64::from(stored_len) <= slice || slices.shift >= index.chunk_shift {
            continue;
        }
        if let Some((len, cvs)) = slices.by_digest.remove(&r.digest) {
            entries.push((r.digest, len, cvs));
            done.insert(r.digest);
        } else if base_outboard.and_then(|o| o.find_chunk(&r.digest, stored_len)).is_some() {
            // A base's chunk: its slices are in the base's outboard, which the manifest lists.
        } else if complete && !done.contains(&r.digest) {
            // Every raw record was hashed by this packer, which kept its CVs.
            return Err(PackError::Invalid(format!("internal: no slice CVs kept for raw chunk {}", r.digest)));
        }
    }
    if entries.is_empty() {
        return Ok(None);
    }
    Ok(Some(Outboard::from_entries(index.chunk_shift, slices.shift, entries)?))
}

/// Slice CVs, from the chain's outboards, of raw records of `index` this packer did not
/// hash (a rebased index's inherited chunks). Only outboards at the slice size being
/// written are used; a chunk none covers gets no entry.
fn inherit_slice_cvs(index: &ChunkIndex, parent: &Image, source: &dyn BlobSource, slices: &mut SliceCvs) -> Result<(), PackError> {
    let missing: std::collections::HashSet<ChunkDigest> = index
        .records
        .iter()
        .filter(|r| matches!(r.kind, RecordKind::Stored { codec: Codec::Raw, .. }) && !slices.by_digest.contains_key(&r.digest))
        .map(|r| r.digest)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    for ob in parent.read_outboards(source) {
        let Some(ob) = ob? else { continue };
        if ob.slice_shift != slices.hashed_shift {
            continue;
        }
        for d in &missing {
            if let Some(e) = ob.find(d) {
                slices.insert(e.digest, e.chunk_len, e.cvs.to_vec());
            }
        }
    }
    Ok(())
}

/// What chunking reads besides the files: the options, the parent's files by name and
/// the chunks the base and the parent chain already store.
struct ChunkInput<'a> {
    opts: &'a PackOptions<'a>,
    parent_files: &'a HashMap<&'a str, &'a imgfmt::ResolvedFile>,
    known: &'a HashMap<ChunkDigest, KnownChunk>,
    /// The chain's packs a compaction retires: a chunk the parent has there is stored
    /// again, not inherited.
    retired: &'a HashSet<OciDigest>,
    /// The base's own outboard (at this image's slice size), when it has one.
    base_outboard: Option<&'a Outboard>,
}

impl ChunkInput<'_> {
    /// Whether the parent's chunk `pc` lives in a retired pack.
    fn retired(&self, pc: &imgfmt::ResolvedChunk) -> bool {
        match (pc.at, &self.opts.parent) {
            (StoredAt::Pack { pack, .. }, Some(p)) => self.retired.contains(&p.image.packs[pack as usize].digest),
            _ => false,
        }
    }
}

/// What chunking gives.
struct Chunked {
    /// Where every chunk went.
    placed: Placed,
    /// Stored bytes sent to own packs.
    own_bytes: u64,
    /// Slice CVs of the raw chunks (when the image has an outboard).
    slices: Option<SliceCvs>,
    /// Some raw chunk of the base's has its slice CVs in the base's outboard only.
    base_outboard_used: bool,
}

/// Reads, digests and places every chunk, batch after batch, sending new chunks' bytes
/// to the pack writer; what was placed so far is what the next chunk dedups against.
struct Chunker<'a, 'i> {
    input: &'i ChunkInput<'a>,
    slots: &'i mut Slots,
    tx: &'i mpsc::SyncSender<ToWriter>,
    report: &'i mut PackReport,
    /// Slice CVs come from the same pass over the bytes as the digest (the digest is
    /// their merge), so an outboard costs no second read of any chunk.
    slice_shift: Option<u8>,
    slices: Option<SliceCvs>,
    /// Chunks per batch.
    batch: usize,
    /// Every chunk placed so far (own packs, base, chain), by digest.
    own: HashMap<ChunkDigest, Loc>,
    own_count: usize,
    /// The own pack being filled, and its size so far.
    cur_slot: Option<u32>,
    cur_off: u64,
    total: u64,
    base_outboard_used: bool,
    /// zstd-ref attempts so far, and those that were kept.
    delta_tried: AtomicU64,
    delta_paid: AtomicU64,
}

impl<'a, 'i> Chunker<'a, 'i> {
    fn new(input: &'i ChunkInput<'a>, slots: &'i mut Slots, tx: &'i mpsc::SyncSender<ToWriter>, report: &'i mut PackReport) -> Self {
        let opts = input.opts;
        let slice_shift = opts.slice_shift.filter(|_| opts.hash == HashAlgo::Blake3);
        Chunker {
            input,
            slots,
            tx,
            report,
            slice_shift,
            slices: slice_shift.map(|s| SliceCvs::new(opts.chunk_shift, s)),
            batch: ((32u64 << 20) >> opts.chunk_shift).max(opts.threads as u64 * 2) as usize,
            own: HashMap::new(),
            own_count: 0,
            cur_slot: None,
            cur_off: 0,
            total: 0,
            base_outboard_used: false,
            delta_tried: AtomicU64::new(0),
            delta_paid: AtomicU64::new(0),
        }
    }

    /// Every file, in order.
    fn all(mut self, files: &[scan::SourceFile]) -> Result<Chunked, PackError> {
        let mut placed = Vec::with_capacity(files.len());
        for f in files {
            placed.push(self.file(f)?);
        }
        self.report.base_delta_reads = self.delta_tried.load(Ordering::Relaxed);
        Ok(Chunked { placed, own_bytes: self.total, slices: self.slices, base_outboard_used: self.base_outboard_used })
    }

    /// One file, a batch of chunks at a time.
    fn file(&mut self, f: &scan::SourceFile) -> Result<Vec<PlacedChunk>, PackError> {
        let opts = self.input.opts;
        let shift = opts.chunk_shift;
        let cs = 1u64 << shift;
        let file = File::open(&f.path).map_err(io_at(&f.path))?;
        // Re-stat through the open handle: the size the scan saw must still hold.
        let size = file.metadata().map_err(io_at(&f.path))?.len();
        if size != f.size {
            return Err(PackError::Invalid(format!("{}: size changed while packing ({} -> {size})", f.name, f.size)));
        }
        let extents = if size == 0 { vec![] } else { scan::data_extents(&file, size).map_err(io_at(&f.path))? };
        let mut cursor = ExtentCursor::new(&extents);
        let n = chunk_count(size, shift);
        let parent = self.input.parent_files.get(f.name.as_str()).copied();
        let diff_file = opts.diff && f.role == Role::Memory;
        if diff_file && parent.is_none_or(|p| p.size != size) {
            return Err(PackError::Invalid(format!("--diff: {} has no same-size counterpart in the parent, so its holes cannot mean 'unchanged'", f.name)));
        }
        let batch = self.batch as u64;
        let mut slots_of_file: Vec<PlacedChunk> = Vec::with_capacity(n as usize);
        let mut c = 0u64;
        imgfmt::file::will_need(&file, 0, batch * cs);
        while c < n {
            let end_c = (c + batch).min(n);
            // The batch after this one starts coming in from disk while this one is
            // hashed and written (a source not in the page cache cost a 2 GiB push 0.5 s
            // of waiting on synchronous 1 MiB reads).
            imgfmt::file::will_need(&file, end_c * cs, batch * cs);
            let mut jobs = self.read(f, &file, &mut cursor, c..end_c, diff_file)?;
            self.digest(&mut jobs);
            let (mut decided, to_store) = self.decide(f, parent, &mut jobs)?;
            let compressed = self.compress(f, &jobs, to_store);
            self.store(&mut jobs, compressed, &mut decided)?;
            // Duplicates within the batch pointed at placeholders: resolve them now.
            for (digest, l) in decided.iter_mut().flatten().filter_map(|(d, l)| l.as_mut().map(|l| (d, l))) {
                if l.slot == u32::MAX {
                    *l = self.own[digest];
                }
            }
            for j in &jobs {
                if let Some(p) = opts.progress {
                    p(j.len as u64);
                }
            }
            self.report.logical_bytes += jobs.iter().map(|j| j.len as u64).sum::<u64>();
            slots_of_file.extend(decided);
            c = end_c;
        }
        Ok(slots_of_file)
    }

    /// Read phase: the bytes of chunks `range` of `f` (holes are not read; a diff
    /// snapshot's partly written chunk is merged over the parent's).
    fn read(
        &mut self,
        f: &scan::SourceFile,
        file: &File,
        cursor: &mut ExtentCursor,
        range: std::ops::Range<u64>,
        diff_file: bool,
    ) -> Result<Vec<Job>, PackError> {
        let opts = self.input.opts;
        let shift = opts.chunk_shift;
        let cs = 1u64 << shift;
        let mut jobs = Vec::with_capacity((range.end - range.start) as usize);
        for ci in range {
            let len = chunk_len(f.size, shift, ci);
            let start = ci * cs;
            let cov = cursor.coverage(start, start + len);
            let mut job =
                Job { chunk: ci, len: len as u32, data: None, inherit: false, digest: ChunkDigest::default(), cvs: None, zero: false, compacted: false };
            // A diff snapshot's hole over a chunk a compaction retires: the parent's bytes
            // are stored again, so they are read (and checked) from the parent.
            let retired =
                diff_file && self.input.parent_files.get(f.name.as_str()).and_then(|p| p.chunks.get(ci as usize)).is_some_and(|pc| self.input.retired(pc));
            match (cov, diff_file) {
                (Coverage::Hole, true) if !retired => job.inherit = true,
                (Coverage::Hole, false) => job.zero = true,
                (Coverage::Partial | Coverage::Hole, true) => {
                    // Dirty pages over the parent's chunk: merge here, per chunk,
                    // without ever materialising the merged file.
                    let p = opts.parent.as_ref().expect("diff has parent");
                    let (pfi, _) = p.image.file(&f.name).expect("checked above");
                    let mut buf = verify::read_chunk(p.source, &p.image, pfi, ci)?.into_vec();
                    for (s, e) in cursor.pieces(start, start + len) {
                        file.read_exact_at(&mut buf[(s - start) as usize..(e - start) as usize], s).map_err(io_at(&f.path))?;
                        self.report.bytes_read += e - s;
                    }
                    job.data = Some(buf);
                }
                _ => {
                    let mut buf = vec![0u8; len as usize];
                    file.read_exact_at(&mut buf, start).map_err(io_at(&f.path))?;
                    self.report.bytes_read += len;
                    job.data = Some(buf);
                }
            }
            jobs.push(job);
        }
        Ok(jobs)
    }

    /// Digest phase, in parallel: each chunk's digest (and slice CVs); chunks of zeros
    /// found.
    fn digest(&self, jobs: &mut [Job]) {
        let (algo, slice_shift) = (self.input.opts.hash, self.slice_shift);
        imgfmt::work::for_each_mut(jobs, self.input.opts.threads, |j| {
            if let Some(d) = &j.data {
                if is_zero(d) {
                    j.zero = true;
                    j.data = None;
                } else if let Some(s) = slice_shift {
                    (j.digest, j.cvs) = verify::hash::digest_with_slice_cvs(d, s);
                } else {
                    j.digest = verify::chunk_digest(algo, d);
                }
            }
            if j.zero {
                j.digest = verify::zero_digest(algo, j.len);
            }
        });
    }

    /// Decide phase: inherit, zero, dedup or store, per chunk. Returns the placements
    /// (new chunks at a placeholder) and which jobs hold new content.
    fn decide(&mut self, f: &scan::SourceFile, parent: Option<&imgfmt::ResolvedFile>, jobs: &mut [Job]) -> Result<(Vec<PlacedChunk>, Vec<usize>), PackError> {
        let opts = self.input.opts;
        let mut to_store: Vec<usize> = Vec::new();
        let mut decided: Vec<PlacedChunk> = Vec::with_capacity(jobs.len());
        for (k, j) in jobs.iter_mut().enumerate() {
            self.report.chunks += 1;
            let pc = parent.and_then(|p| p.chunks.get(j.chunk as usize)).filter(|pc| pc.len == j.len);
            j.compacted = pc.is_some_and(|pc| pc.digest == j.digest && self.input.retired(pc));
            if j.inherit || (pc.is_some_and(|pc| pc.digest == j.digest) && !j.compacted) {
                if pc.is_none() {
                    return Err(PackError::Invalid(format!("--diff: {} chunk {} is a hole but the parent has no such chunk", f.name, j.chunk)));
                }
                self.report.inherited_chunks += 1;
                decided.push(None);
                continue;
            }
            if j.zero {
                self.report.zero_chunks += 1;
                decided.push(Some((j.digest, None)));
                continue;
            }
            if let Some(l) = self.own.get(&j.digest) {
                self.report.deduplicated_chunks += 1;
                decided.push(Some((j.digest, Some(*l))));
                continue;
            }
            if let Some(kc) = self.input.known.get(&j.digest) {
                let slot = self.slots.foreign(&kc.pack, kc.owner, kc.from_base, || {
                    if kc.from_base { &opts.base } else { &opts.parent }
                        .as_ref()
                        .and_then(|r| r.image.packs.iter().find(|p| p.digest == kc.pack))
                        .map(|p| p.size)
                        .unwrap_or(0)
                });
                // A `zstd-ref` chunk brings its reference's pack along (same owner, same source).
                let codec = match &kc.ref_pack {
                    Some((d, size)) => Codec::ZstdRef(self.slots.foreign(d, kc.owner, kc.from_base, || *size)),
                    None => kc.codec,
                };
                let l = Loc { slot, offset: kc.offset, stored_len: kc.stored_len, codec };
                self.own.insert(j.digest, l);
                let in_base_outboard = kc.from_base && self.input.base_outboard.and_then(|o| o.find_chunk(&j.digest, j.len)).is_some();
                if in_base_outboard {
                    self.base_outboard_used = true;
                } else if let (Codec::Raw, Some(s), Some(cvs)) = (kc.codec, self.slices.as_mut(), j.cvs.take()) {
                    s.insert(j.digest, j.len, cvs);
                }
                self.report.deduplicated_chunks += 1;
                decided.push(Some((j.digest, Some(l))));
                continue;
            }
            // New content: placeholder location, filled after compression. Mark it in
            // `own` right away so a duplicate later in this batch dedups against it.
            to_store.push(k);
            self.own.insert(j.digest, Loc { slot: u32::MAX, offset: k as u64, stored_len: 0, codec: Codec::Raw });
            decided.push(Some((j.digest, None)));
        }
        Ok((decided, to_store))
    }

    /// Compress phase, in parallel, for new chunks only: (job, compressed form when
    /// compression paid, the reference's pack when that form is `zstd-ref`).
    fn compress(&self, f: &scan::SourceFile, jobs: &[Job], to_store: Vec<usize>) -> Vec<(usize, Option<Compressed>, Option<OciDigest>)> {
        let opts = self.input.opts;
        let compression = opts.compression;
        let base = opts.base.as_ref().zip(opts.base_delta).and_then(|(b, level)| b.image.file(&f.name).map(|(bfi, bf)| (b, bfi, bf, level)));
        let mut compressed: Vec<(usize, Option<Compressed>, Option<OciDigest>)> = to_store.into_iter().map(|k| (k, None, None)).collect();
        if compression == Compression::None && base.is_none() {
            return compressed;
        }
        imgfmt::work::for_each_mut(&mut compressed, opts.threads, |(k, out, ref_pack)| {
            let j = &jobs[*k];
            let data = j.data.as_deref().expect("stored chunk has data");
            *out = compression.compress(data);
            let Some((b, bfi, bf, level)) = base else { return };
            // The base's chunk at this position, when it is stored (not zero, not itself
            // a `zstd-ref` chunk: a reference is one read, never a chain of them).
            let Some(bc) = bf.chunks.get(j.chunk as usize) else { return };
            let StoredAt::Pack { pack, offset, stored_len, codec } = bc.at else { return };
            if codec.ref_pack().is_some() {
                return;
            }
            // An image that is no close relative of its base (most tries not paying) stops
            // reading the base's chunks: from a remote base each is a range request.
            let (tried, paid) = (self.delta_tried.load(Ordering::Relaxed), self.delta_paid.load(Ordering::Relaxed));
            if tried >= BASE_DELTA_PROBATION && paid * 4 < tried {
                return;
            }
            self.delta_tried.fetch_add(1, Ordering::Relaxed);
            let reference = match verify::read_chunk(b.source, &b.image, bfi, j.chunk) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!("{} chunk {}: the base's chunk there could not be read ({e}); stored without it", f.name, j.chunk);
                    return;
                }
            };
            let best = out.as_ref().map_or(data.len(), |(_, b)| b.len());
            // A fast pass first: most chunks are either unrelated to their base's (not
            // worth more CPU) or close to it; only a close one is compressed again at
            // `level`, where the optimal parser halves a shifted state file's delta.
            let Some(mut frame) = compress_ref(data, reference.as_bytes(), level.min(BASE_DELTA_FIRST_LEVEL), true) else { return };
            if level > BASE_DELTA_FIRST_LEVEL && frame.len() * 4 < data.len() {
                if let Some(better) = compress_ref(data, reference.as_bytes(), level, false).filter(|b| b.len() < frame.len()) {
                    frame = better;
                }
            }
            if REF_HEADER_LEN + frame.len() < best {
                self.delta_paid.fetch_add(1, Ordering::Relaxed);
                let h = RefHeader { offset, stored_len, len: bc.len, codec, digest: bc.digest };
                let mut bytes = Vec::with_capacity(REF_HEADER_LEN + frame.len());
                bytes.extend_from_slice(&h.encode());
                bytes.extend_from_slice(&frame);
                *out = Some((Codec::ZstdRef(u32::MAX), bytes));
                *ref_pack = Some(b.image.packs[pack as usize].digest.clone());
            }
        });
        compressed
    }

    /// Write phase: place each new chunk in the current own pack (a new one when it
    /// would pass the pack size), send its bytes to the writer, and record where it went.
    fn store(
        &mut self,
        jobs: &mut [Job],
        compressed: Vec<(usize, Option<Compressed>, Option<OciDigest>)>,
        decided: &mut [PlacedChunk],
    ) -> Result<(), PackError> {
        let writer_gone = || PackError::Invalid("pack writer stopped early".into());
        let opts = self.input.opts;
        let pack_size = opts.pack_size;
        for (k, comp, ref_pack) in compressed {
            let j = &mut jobs[k];
            let (codec, bytes) = match comp {
                Some((Codec::ZstdRef(_), b)) => {
                    let d = ref_pack.expect("a zstd-ref chunk names its reference's pack");
                    let slot = self.slots.foreign(&d, "base", true, || {
                        opts.base.as_ref().and_then(|r| r.image.packs.iter().find(|p| p.digest == d)).map(|p| p.size).unwrap_or(0)
                    });
                    self.report.base_delta_chunks += 1;
                    self.report.base_delta_bytes += b.len() as u64;
                    (Codec::ZstdRef(slot), b)
                }
                Some((codec, b)) => (codec, b),
                None => (Codec::Raw, j.data.take().expect("stored chunk has data")),
            };
            let stored_len = bytes.len() as u64;
            if self.cur_slot.is_none() || (self.cur_off > 0 && self.cur_off + stored_len > pack_size) {
                if self.cur_slot.is_some() {
                    self.tx.send(ToWriter::Rollover).map_err(|_| writer_gone())?;
                }
                self.slots.list.push(Slot::Own(self.own_count));
                self.own_count += 1;
                self.cur_slot = Some((self.slots.list.len() - 1) as u32);
                self.cur_off = 0;
            }
            let l = Loc { slot: self.cur_slot.expect("set"), offset: self.cur_off, stored_len: stored_len as u32, codec };
            self.cur_off += stored_len;
            self.total += stored_len;
            self.tx.send(ToWriter::Data(bytes)).map_err(|_| writer_gone())?;
            self.own.insert(j.digest, l);
            if let (Codec::Raw, Some(s), Some(cvs)) = (codec, self.slices.as_mut(), j.cvs.take()) {
                s.insert(j.digest, j.len, cvs);
            }
            decided[k] = Some((j.digest, Some(l)));
            self.report.stored_chunks += 1;
            if j.compacted {
                self.report.compacted_chunks += 1;
                self.report.compacted_bytes += stored_len;
            }
        }
        Ok(())
    }
}

/// Make sure `dest` holds blob `d`, copying it from `src` (and checking its digest on
/// the way) when it is not there yet.
pub fn ensure_blob(dest: &OciLayout, src: &dyn BlobSource, d: &OciDigest) -> Result<(), PackError> {
    if dest.has_blob(d) {
        return Ok(());
    }
    let size = src.blob_size(d)?;
    let mut w = dest.blob_writer()?;
    imgfmt::source::stream_blob_unverified::<FormatError>(src, d, size, |piece| {
        w.write_all(piece).map_err(|e| FormatError::Io { context: "copy blob".into(), source: e })
    })?;
    let (got, _) = w.finish()?;
    if &got != d {
        // The blob landed under its real name, which is harmless; the one we needed is
        // still missing, which is the error.
        return Err(FormatError::BlobDigestMismatch { digest: d.clone(), actual: got }.into());
    }
    Ok(())
}

/// RFC 3339 now, or `SOURCE_DATE_EPOCH` for reproducible images.
fn created_now() -> String {
    let t = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|s| s.parse::<i64>().ok())
        .and_then(|s| time::OffsetDateTime::from_unix_timestamp(s).ok())
        .unwrap_or_else(time::OffsetDateTime::now_utc);
    t.replace_nanosecond(0).unwrap_or(t).format(&time::format_description::well_known::Rfc3339).unwrap_or_else(|_| "1970-01-01T00:00:00Z".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// What the sealer returned, the packs announced, and the file names left in the layout.
    type Outcome = (Result<Vec<(OciDigest, u64)>, FormatError>, Vec<OciDigest>, Vec<String>);

    /// Run the three pack-writing stages on `msgs`, as `pack` does.
    fn run_pipeline(msgs: Vec<ToWriter>) -> Outcome {
        let dir = tempfile::tempdir().unwrap();
        let layout = OciLayout::open_or_create(dir.path()).unwrap();
        let announced = Mutex::new(Vec::new());
        let on_pack = |d: &OciDigest, _: u64| announced.lock().unwrap().push(d.clone());
        // The pack pipeline's three stages, as in `chunk_into_packs` (not a worker pool).
        let done = std::thread::scope(|s| {
            let (tx, rx) = mpsc::sync_channel(1);
            let (to_hasher, hasher_rx) = mpsc::sync_channel(1);
            let (to_sealer, sealer_rx) = mpsc::sync_channel(1);
            let w = s.spawn(|| write_packs(&layout, rx, to_hasher));
            let h = s.spawn(|| hash_packs(hasher_rx, to_sealer));
            let sealer = s.spawn(|| seal_packs(sealer_rx, Some(&on_pack)));
            for m in msgs {
                tx.send(m).unwrap();
            }
            drop(tx);
            w.join().unwrap().unwrap();
            h.join().unwrap().unwrap();
            sealer.join().unwrap()
        });
        let mut names: Vec<String> =
            std::fs::read_dir(dir.path().join("blobs/sha256")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        names.sort();
        (done, announced.into_inner().unwrap(), names)
    }

    /// An outboard that would pass its limit doubles its slices (CV pairs merged, chunks
    /// now of one slice dropped) until it fits, and what it keeps is what hashing at the
    /// larger slice gives; past half a chunk per slice there is no outboard at all.
    #[test]
    fn slice_cvs_past_the_limit_are_coarsened_until_they_fit() {
        let data: Vec<Vec<u8>> = (0..6u8).map(|k| (0..65536u32).map(|i| (i.wrapping_mul(2654435761) >> 7) as u8 ^ k).collect()).collect();
        let lens = [65536usize, 65536, 65536, 40000, 9000, 5000];
        let mut s = SliceCvs::new(16, 12);
        // Room for the header and about 40 CVs: 4 KiB slices (16 per full chunk) do not fit.
        s.limit = 32 + 6 * 48 + 40 * 32;
        for (d, &len) in data.iter().zip(&lens) {
            let (digest, cvs) = verify::hash::digest_with_slice_cvs(&d[..len], 12);
            s.insert(digest, len as u32, cvs.unwrap());
        }
        assert!(s.bytes <= s.limit, "{} > {}", s.bytes, s.limit);
        assert_eq!(s.shift, 13, "8 KiB slices: 8+8+8+5+2 CVs");
        assert_eq!(s.bytes, 32 + 5 * 48 + 31 * 32);
        assert_eq!(s.by_digest.len(), 5, "the 5000-byte chunk is one slice now");
        for (d, &len) in data.iter().zip(&lens) {
            let digest = verify::chunk_digest(HashAlgo::Blake3, &d[..len]);
            if let Some((l, cvs)) = s.by_digest.get(&digest) {
                assert_eq!(*l as usize, len);
                assert_eq!(cvs, &verify::hash::slice_cvs(&d[..len], 13));
                assert_eq!(verify::hash::merge_slice_cvs(cvs), digest);
            }
        }
        // A chunk hashed later at 4 KiB is kept at the current size.
        let late: Vec<u8> = (0..30000u32).map(|i| (i * 7) as u8).collect();
        let (digest, cvs) = verify::hash::digest_with_slice_cvs(&late, 12);
        s.insert(digest, 30000, cvs.unwrap());
        assert_eq!(s.by_digest[&digest].1, verify::hash::slice_cvs(&late, s.shift));
        // A limit nothing fits under leaves no outboard.
        let mut none = SliceCvs::new(16, 12);
        none.limit = 100;
        let (digest, cvs) = verify::hash::digest_with_slice_cvs(&data[0], 12);
        none.insert(digest, 65536, cvs.unwrap());
        assert!(none.by_digest.is_empty());
        assert_eq!(none.shift, 16);
    }

    #[test]
    fn packs_are_named_by_their_bytes_in_order() {
        let (a, b) = (vec![1u8; 3000], vec![2u8; 5000]);
        let msgs = vec![ToWriter::Data(a[..1000].to_vec()), ToWriter::Data(a[1000..].to_vec()), ToWriter::Rollover, ToWriter::Data(b.clone()), ToWriter::End];
        let (done, announced, names) = run_pipeline(msgs);
        let want = vec![(OciDigest::of(&a), 3000), (OciDigest::of(&b), 5000)];
        assert_eq!(done.unwrap(), want);
        assert_eq!(announced, vec![want[0].0.clone(), want[1].0.clone()]);
        let mut want_names: Vec<String> = want.iter().map(|(d, _)| d.hex().to_string()).collect();
        want_names.sort();
        assert_eq!(names, want_names);
    }

    /// A packing that fails stops sending without `End`: the pack it was filling is
    /// removed, never named; packs sealed before stay (complete, content-addressed).
    #[test]
    fn a_pack_left_open_by_a_failed_packing_is_discarded() {
        let (a, b) = (vec![1u8; 3000], vec![2u8; 5000]);
        let (done, announced, names) = run_pipeline(vec![ToWriter::Data(a.clone()), ToWriter::Rollover, ToWriter::Data(b)]);
        assert_eq!(done.unwrap(), vec![(OciDigest::of(&a), 3000)]);
        assert_eq!(announced, vec![OciDigest::of(&a)]);
        assert_eq!(names, vec![OciDigest::of(&a).hex().to_string()], "no temp file, no second pack");
    }

    fn noise(n: usize, mut x: u64) -> Vec<u8> {
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// An image packed with a base it is no close relative of reads 32 of the base's
    /// chunks trying zstd-ref, then stops; one whose chunks are each the base's with a few
    /// bytes changed reads (and stores as zstd-ref) every one.
    #[test]
    fn regression_issue_22_an_unrelated_base_is_read_only_on_probation() {
        let t = tempfile::tempdir().unwrap();
        let layout = OciLayout::open_or_create(t.path().join("layout")).unwrap();
        let base_mem = noise(100 << 16, 1);
        let (base, far, near) = (t.path().join("base"), t.path().join("far"), t.path().join("near"));
        for (d, mem) in [
            (&base, base_mem.clone()),
            (&far, noise(100 << 16, 2)),
            (&near, {
                let mut m = base_mem.clone();
                for c in 0..100 {
                    m[(c << 16) + 17] ^= 0xff;
                }
                m
            }),
        ] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join("mem"), mem).unwrap();
        }
        pack(&base, &layout, "base", &PackOptions { chunk_shift: 16, threads: 2, ..Default::default() }).unwrap();
        let with_base = |dir: &Path, tag: &str| {
            let b = Related { source: &layout, image: open(&layout, "base"), reference: "base".into() };
            pack(dir, &layout, tag, &PackOptions { chunk_shift: 16, threads: 2, base: Some(b), ..Default::default() }).unwrap()
        };
        let r = with_base(&far, "far");
        assert_eq!((r.stored_chunks, r.base_delta_chunks), (100, 0));
        // Tries run two at a time, so a few may start before the count says stop.
        assert!((BASE_DELTA_PROBATION..BASE_DELTA_PROBATION + 4).contains(&r.base_delta_reads), "{} base chunks read", r.base_delta_reads);
        let r = with_base(&near, "near");
        assert_eq!((r.stored_chunks, r.base_delta_chunks, r.base_delta_reads), (100, 100, 100));
    }

    /// A snapshot directory: `mem` of 8 chunks of 64 KiB (chunk `i` filled with `fill[i]`,
    /// 0 = zeros) and a small `state`.
    fn snapshot(dir: &Path, fill: &[u8; 8]) {
        std::fs::create_dir_all(dir).unwrap();
        let mem: Vec<u8> = fill.iter().flat_map(|b| std::iter::repeat_n(*b, 1 << 16)).collect();
        std::fs::write(dir.join("mem"), mem).unwrap();
        std::fs::write(dir.join("state"), b"state").unwrap();
    }

    fn open(layout: &OciLayout, tag: &str) -> Image {
        Image::open(layout, &layout.resolve_tag(tag).unwrap()).unwrap()
    }

    /// Pack `dir` as `tag`, a layer over `parent` (a tag of the same layout) if given.
    fn pack_as(dir: &Path, layout: &OciLayout, tag: &str, parent: Option<&str>, max_chain: usize) -> Result<PackReport, PackError> {
        let parent = parent.map(|p| Related { source: layout, image: open(layout, p), reference: p.to_string() });
        let opts = PackOptions { chunk_shift: 16, parent, max_chain, threads: 2, ..Default::default() };
        pack(dir, layout, tag, &opts)
    }

    /// Every resolved chunk's digest and where its bytes are (pack digest, offset).
    fn located(img: &Image) -> Vec<(ChunkDigest, Option<(OciDigest, u64)>)> {
        img.files
            .iter()
            .flat_map(|f| &f.chunks)
            .map(|c| match c.at {
                StoredAt::Zero => (c.digest, None),
                StoredAt::Pack { pack, offset, .. } => (c.digest, Some((img.packs[pack as usize].digest.clone(), offset))),
            })
            .collect()
    }

    fn blobs(dir: &Path) -> std::collections::BTreeSet<String> {
        std::fs::read_dir(dir.join("blobs/sha256")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect()
    }

    /// The layer that would have 65 ancestors is rebased: no parent, a full index whose
    /// records point where the chain stored each chunk (no pack copied or written for
    /// them), the same content root a layer of that content has; it verifies, and the
    /// next layer starts a new chain over it.
    #[test]
    fn the_layer_past_the_chain_limit_is_rebased_onto_the_chains_packs() {
        let dir = tempfile::tempdir().unwrap();
        let layout = OciLayout::open_or_create(dir.path().join("layout")).unwrap();
        let src = dir.path().join("src");
        let mut fill = [1, 2, 0, 4, 5, 0, 7, 8];
        snapshot(&src, &fill);
        assert_eq!(pack_as(&src, &layout, "l0", None, MAX_CHAIN_DEPTH).unwrap().chain_depth, 0);
        for i in 1..=MAX_CHAIN_DEPTH + 2 {
            fill[i % 8] = 10 + i as u8; // one chunk changes per layer
            snapshot(&src, &fill);
            let before = blobs(layout.root());
            let parent = open(&layout, &format!("l{}", i - 1));
            let r = pack_as(&src, &layout, &format!("l{i}"), Some(&format!("l{}", i - 1)), MAX_CHAIN_DEPTH).unwrap();
            let img = open(&layout, &format!("l{i}"));
            if i <= MAX_CHAIN_DEPTH {
                assert_eq!((r.rebased, r.chain_depth, img.chain.len()), (false, i, i + 1), "layer {i}");
                continue;
            }
            if i == MAX_CHAIN_DEPTH + 2 {
                assert_eq!((r.rebased, r.chain_depth, img.chain.len()), (false, 1, 2), "a new chain over the rebased image");
                continue;
            }
            assert!(r.rebased && r.chain_depth == 0, "layer {i}: {r:?}");
            assert_eq!(r.rebased_from.as_deref(), Some(parent.manifest_digest.as_str()));
            assert_eq!(img.manifest.annotations.get(media::ANN_REBASED_FROM).map(String::as_str), Some(parent.manifest_digest.as_str()));
            assert_eq!(img.chain.len(), 1, "no parent link");
            assert!(!img.index().layer && img.config().parent.is_none());
            // One chunk changed: one new pack of one chunk; every other chunk where the
            // chain had it.
            assert_eq!((r.packs, r.pack_bytes, r.stored_chunks), (1, 1 << 16, 1));
            let (want, got) = (located(&parent), located(&img));
            let differ: Vec<usize> = (0..want.len()).filter(|&k| want[k] != got[k]).collect();
            assert_eq!(differ, vec![i % 8], "only the changed chunk is elsewhere");
            let added: Vec<String> = blobs(layout.root()).difference(&before).cloned().collect();
            // ... and its outboard: slice CVs of its records, most from the chain's outboards.
            let outboards = img.manifest.layers.iter().filter(|d| d.media_type == media::OUTBOARD).count();
            assert_eq!(outboards, 1, "a rebased image has an outboard of its own");
            let raw: std::collections::HashSet<_> = img
                .index()
                .records
                .iter()
                .filter(|r| matches!(r.kind, RecordKind::Stored { codec: Codec::Raw, stored_len, .. } if stored_len > 4096))
                .map(|r| r.digest)
                .collect();
            let ob = img.chain[0].read_outboard(&layout).unwrap().expect("an outboard");
            assert!(raw.iter().all(|d| ob.find(d).is_some()), "every raw chunk of the rebased index has its slice CVs ({} of {})", ob.entries.len(), raw.len());
            assert_eq!(added.len(), 5, "new pack, index, outboard, config, manifest only: {added:?}");
            let owned = |o: &str| img.manifest.layers.iter().filter(|d| d.media_type == media::PACK && d.annotations[media::ANN_OWNER] == o).count();
            assert_eq!((owned("self"), owned(media::OWNER_REBASED), r.chain_packs_referenced), (1, img.packs.len() - 1, img.packs.len() - 1));
            assert!(!img.manifest.layers.iter().any(|d| d.media_type == media::CONFIG), "no ancestor is listed");
            let audit = verify::audit(&layout, &img, &verify::AuditOptions { threads: 2, blob_digests: true, ..Default::default() }).unwrap();
            assert!(audit.ok(), "{:?}", audit.failures);
            assert_eq!(audit.stored_chunks_checked, 9, "every stored chunk verified (by now all 8 of mem, and state)");
        }
    }

    /// A lower limit rebases earlier; the rebased image's content root equals that of the
    /// layer it replaces (same content, same root), and an unchanged directory rebases
    /// into metadata alone.
    #[test]
    fn max_chain_rebases_earlier_with_the_same_root_and_no_new_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let layout = OciLayout::open_or_create(dir.path().join("layout")).unwrap();
        let src = dir.path().join("src");
        snapshot(&src, &[1, 2, 3, 0, 0, 6, 7, 8]);
        pack_as(&src, &layout, "l0", None, 2).unwrap();
        snapshot(&src, &[1, 9, 3, 0, 0, 6, 7, 8]);
        pack_as(&src, &layout, "l1", Some("l0"), 2).unwrap();
        snapshot(&src, &[1, 9, 3, 0, 11, 6, 7, 8]);
        assert_eq!(pack_as(&src, &layout, "l2", Some("l1"), 2).unwrap().chain_depth, 2);
        snapshot(&src, &[1, 9, 3, 12, 11, 6, 7, 8]);
        let layer = pack_as(&src, &layout, "layer", Some("l2"), 3).unwrap();
        let rebased = pack_as(&src, &layout, "rebased", Some("l2"), 2).unwrap();
        assert_eq!((layer.rebased, layer.chain_depth, rebased.rebased, rebased.chain_depth), (false, 3, true, 0));
        assert_eq!(rebased.root, layer.root);
        assert_eq!(located(&open(&layout, "rebased")), located(&open(&layout, "layer")), "same chunks in the same places");

        // Nothing changed: no pack at all, only index, config and manifest.
        let before = blobs(layout.root());
        let again = pack_as(&src, &layout, "again", Some("layer"), 0).unwrap();
        assert!(again.rebased && again.packs == 0 && again.pack_bytes == 0, "{again:?}");
        assert_eq!(blobs(layout.root()).difference(&before).count(), 3);
        assert_eq!(again.root, layer.root);
    }

    /// Packs a full read of `img` touches.
    fn packs_read(img: &Image) -> std::collections::BTreeSet<OciDigest> {
        located(img).into_iter().filter_map(|(_, at)| at.map(|(p, _)| p)).collect()
    }

    /// Issue 22 §6: a long history is compacted. Layers that each change one chunk, with
    /// `compact_after` 2: no image reads from more than 2 packs beyond the fewest its
    /// bytes need (without compaction the 30th reads from 9, one per chunk); a compacted
    /// image stores again only unchanged chunks of the packs it retires, its manifest
    /// lists none of them (retention may free them once older images go), it has the
    /// root an uncompacted image of the same content has, and it verifies.
    #[test]
    fn regression_issue_22_a_long_history_is_compacted_into_few_packs() {
        let dir = tempfile::tempdir().unwrap();
        let layout = OciLayout::open_or_create(dir.path().join("layout")).unwrap();
        let src = dir.path().join("src");
        let mut fill = [1, 2, 3, 4, 5, 6, 7, 8];
        snapshot(&src, &fill);
        pack_as(&src, &layout, "l0", None, MAX_CHAIN_DEPTH).unwrap();
        let mut compactions = 0;
        for i in 1..=30usize {
            fill[i % 8] = 20 + i as u8;
            snapshot(&src, &fill);
            let parent = Related { source: &layout, image: open(&layout, &format!("l{}", i - 1)), reference: String::new() };
            let opts = PackOptions { chunk_shift: 16, parent: Some(parent), compact_after: Some(2), threads: 2, ..Default::default() };
            let r = pack(&src, &layout, &format!("l{i}"), &opts).unwrap();
            let img = open(&layout, &format!("l{i}"));
            let read = packs_read(&img);
            // All of this image's bytes fit one pack: at most 1 + 2 packs.
            assert!(read.len() <= 3, "layer {i} reads from {} packs: {r:?}", read.len());
            assert_eq!(r.excess_packs, read.len() - 1, "layer {i}");
            let listed: std::collections::BTreeSet<OciDigest> =
                img.manifest.layers.iter().filter(|d| d.media_type == media::PACK).map(|d| d.digest.clone()).collect();
            assert_eq!(listed, read, "layer {i}: the manifest lists exactly the packs the image reads");
            if r.compacted {
                compactions += 1;
                assert!(r.compacted_chunks >= 1 && r.packs_retired >= 1, "{r:?}");
                // Only the changed chunk is new content; the rest was stored before.
                assert_eq!(r.stored_chunks, r.compacted_chunks + 1, "{r:?}");
                let parent = open(&layout, &format!("l{}", i - 1));
                let plain = PackOptions {
                    chunk_shift: 16,
                    parent: Some(Related { source: &layout, image: parent, reference: String::new() }),
                    compact_after: None,
                    threads: 2,
                    ..Default::default()
                };
                let uncompacted = pack(&src, &layout, "plain", &plain).unwrap();
                assert_eq!(uncompacted.root, r.root, "same content, same root");
                assert!(packs_read(&open(&layout, "plain")).len() > read.len());
            }
            let audit = verify::audit(&layout, &img, &verify::AuditOptions { threads: 2, ..Default::default() }).unwrap();
            assert!(audit.ok(), "layer {i}: {:?}", audit.failures);
        }
        assert!(compactions >= 5, "{compactions} compactions in 30 layers");
    }

    #[test]
    fn max_chain_past_what_readers_open_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let layout = OciLayout::open_or_create(dir.path().join("layout")).unwrap();
        let src = dir.path().join("src");
        snapshot(&src, &[1; 8]);
        let err = pack_as(&src, &layout, "l0", None, MAX_CHAIN_DEPTH + 1).unwrap_err();
        assert!(err.to_string().contains("--max-chain 65"), "{err}");
    }
}
