//! An opened image: manifest, config and index read and checked against their OCI
//! digests, the parent chain resolved into one flat table of chunk locations.
//!
//! Outboards (slice chaining values, optional) are found when the image opens but read
//! only on request ([`Image::load_outboards`]): only a reader that fetches slices needs
//! them, and a pull or an inspect should not pay a blob fetch for them.

use std::collections::HashMap;
use std::sync::Arc;

use crate::compress::Codec;
use crate::config::{ImageConfig, Role, MAX_CHAIN_DEPTH, MAX_CONFIG_BYTES};
use crate::digest::{ChunkDigest, OciDigest};
use crate::index::{chunk_count, chunk_len, ChunkIndex, PackRef, RecordKind, MAX_INDEX_BYTES};
use crate::manifest::{Descriptor, Manifest, MAX_MANIFEST_BYTES};
use crate::media;
use crate::outboard::{self, Outboard, OutboardTable, SliceCvs, SliceShape, MAX_OUTBOARD_BYTES, MIN_SLICE_SHIFT};
use crate::source::{read_verified_blob, BlobSource};
use crate::FormatError;

/// Where a resolved chunk's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredAt {
    Zero,
    /// `pack` indexes [`Image::packs`].
    Pack {
        pack: u32,
        offset: u64,
        stored_len: u32,
        codec: Codec,
    },
}

impl StoredAt {
    /// The bytes the chunk takes in its pack (none for a zero chunk).
    pub fn stored_len(&self) -> u64 {
        match self {
            StoredAt::Pack { stored_len, .. } => u64::from(*stored_len),
            StoredAt::Zero => 0,
        }
    }

    /// Whether one range read may take a chunk stored here right after one stored at
    /// `prev`: both in the same pack, this one starting where that one ends, and neither a
    /// `zstd-ref` chunk (whose reference is read besides it).
    pub fn follows(&self, prev: &StoredAt) -> bool {
        match (prev, self) {
            (StoredAt::Pack { pack: p, offset, stored_len, codec: cp }, StoredAt::Pack { pack: q, offset: next, codec: cq, .. }) => {
                p == q && offset + u64::from(*stored_len) == *next && cp.ref_pack().is_none() && cq.ref_pack().is_none()
            }
            _ => false,
        }
    }
}

/// One chunk after resolving the chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResolvedChunk {
    pub digest: ChunkDigest,
    /// Uncompressed length.
    pub len: u32,
    pub at: StoredAt,
    /// Which image's index recorded it: 0 = this image, 1 = its parent, …
    pub depth: u8,
}

// One resolved chunk per chunk position, each recorded by some link of the chain: the
// resolved table is at most as large as the chain's records (spec/format.md §12).
const _: () = assert!(std::mem::size_of::<ResolvedChunk>() <= crate::index::RECORD_LEN);

#[derive(Debug, Clone)]
pub struct ResolvedFile {
    pub name: String,
    pub size: u64,
    pub mode: u32,
    pub role: Role,
    pub chunks: Vec<ResolvedChunk>,
}

/// One image of the chain (this image at depth 0).
#[derive(Debug, Clone)]
pub struct ChainLink {
    pub config_digest: OciDigest,
    pub config: ImageConfig,
    pub index_digest: OciDigest,
    pub index: ChunkIndex,
    /// The outboard blob covering this link's records, when the manifest lists one (media
    /// type [`media::OUTBOARD`], owner `self` for the image, `parent…` for an ancestor).
    pub outboard_blob: Option<Descriptor>,
    /// That outboard, decoded, once [`Image::load_outboards`] read it.
    pub outboard: Option<Arc<Outboard>>,
}

impl ChainLink {
    /// The most bytes this link's outboard can need: an entry and a CV per smallest slice
    /// for every raw record longer than one smallest slice. An outboard covers only its
    /// own index's records, so a bigger one is a lie; refusing it before reading bounds
    /// what a hostile store can make a reader fetch and allocate by the data it describes.
    pub fn outboard_limit(&self) -> u64 {
        let min_slice = 1u64 << MIN_SLICE_SHIFT;
        let need: u64 = self
            .index
            .records
            .iter()
            .filter_map(|r| match r.kind {
                RecordKind::Stored { codec: Codec::Raw, stored_len, .. } if u64::from(stored_len) > min_slice => {
                    Some((outboard::ENTRY_LEN + outboard::CV_LEN * u64::from(stored_len).div_ceil(min_slice) as usize) as u64)
                }
                _ => None,
            })
            .sum();
        (outboard::HEADER_LEN as u64 + need).min(MAX_OUTBOARD_BYTES)
    }

    /// Read, check (sha256, size, bounds) and decode this link's outboard, if it has one.
    pub fn read_outboard(&self, src: &dyn BlobSource) -> Result<Option<Outboard>, FormatError> {
        Ok(self.read_outboard_bytes(src)?.map(|(_, ob)| ob))
    }

    /// [`ChainLink::read_outboard`], with the blob's bytes (checked against its digest), for
    /// a caller that also stores the blob.
    pub fn read_outboard_bytes(&self, src: &dyn BlobSource) -> Result<Option<(Vec<u8>, Outboard)>, FormatError> {
        let Some(d) = &self.outboard_blob else { return Ok(None) };
        let whose = format!("the index {}", self.index_digest);
        read_outboard_blob(src, d, self.outboard_limit(), (self.index.chunk_shift, &whose), "outboard").map(Some)
    }
}

/// Read outboard blob `d` (at most `limit` bytes, its sha256 and size checked), decode it
/// and check it is for chunks of `2^chunk_shift` bytes, the chunk size of `whose`; `what`
/// names the blob in errors.
fn read_outboard_blob(
    src: &dyn BlobSource,
    d: &Descriptor,
    limit: u64,
    (chunk_shift, whose): (u8, &str),
    what: &'static str,
) -> Result<(Vec<u8>, Outboard), FormatError> {
    let b = read_verified_blob(src, &d.digest, limit)?;
    if b.len() as u64 != d.size {
        return Err(FormatError::invalid(what, format!("{} is {} bytes, the manifest says {}", d.digest, b.len(), d.size)));
    }
    let ob = Outboard::decode(&b).map_err(|e| FormatError::invalid(what, format!("{}: {e}", d.digest)))?;
    if ob.chunk_shift != chunk_shift {
        return Err(FormatError::invalid(what, format!("{}: chunk_shift {} but {whose} has {chunk_shift}", d.digest, ob.chunk_shift)));
    }
    Ok((b, ob))
}

/// Chain depth an `dev.snapctl.owner` value names: `self` 0, `parent` 1, `parent.parent` 2, …
fn owner_depth(owner: &str) -> Option<usize> {
    if owner == "self" {
        return Some(0);
    }
    owner.split('.').all(|p| p == "parent").then(|| owner.split('.').count())
}

/// An opened, structurally valid image. Chunk *content* is not checked here: see the
/// `verify` crate.
#[derive(Debug, Clone)]
pub struct Image {
    pub manifest_digest: OciDigest,
    pub manifest_bytes: Vec<u8>,
    pub manifest: Manifest,
    /// `chain[0]` is this image, `chain[1]` its parent, and so on.
    pub chain: Vec<ChainLink>,
    /// Every pack any resolved chunk points into (deduplicated across the chain).
    pub packs: Vec<PackRef>,
    pub files: Vec<ResolvedFile>,
    /// The base's outboard, when the manifest lists it (owner `base`): slice CVs of the
    /// base's raw chunks this image shares, which its own outboard then leaves out (every
    /// clone of a base would otherwise carry a copy of them).
    pub base_outboard_blob: Option<Descriptor>,
    /// That outboard, decoded, once [`Image::load_outboards`] read it.
    pub base_outboard: Option<Arc<Outboard>>,
    /// Outboards put in place after the image was shared ([`Image::attach_outboards`]).
    attached: std::sync::OnceLock<Outboards>,
    /// Outboards' entries read without their CVs ([`OutboardsAhead::Tables`]), each
    /// entry's CVs read when a slice of its chunk is first wanted
    /// ([`Image::read_slice_cvs`]).
    tables: Option<Arc<Tables>>,
}

/// How [`Image::open_outboards_later`] reads ahead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutboardsAhead {
    /// The whole outboards of the image and its base, beside the config and index: for a
    /// reader that will want most of them ([`PendingOutboards::finish`]).
    Whole,
    /// Only the entries of every outboard the chain lists, beside the config and index;
    /// a chunk's CVs are read when a slice of it is first wanted. For a reader that wants
    /// slices of a few chunks (a restore serving faults): it never moves the whole blobs,
    /// whose bytes would sit in front of its first faults' on the link.
    Tables,
}

/// The outboard tables of an image's chain links (chain order; `None` for a link without
/// an outboard or whose table could not be read) and of its base, with their blobs.
#[derive(Debug)]
struct Tables {
    links: Vec<Option<(OciDigest, OutboardTable)>>,
    base: Option<(OciDigest, OutboardTable)>,
}

/// Every outboard an image lists, read and checked: each chain link's (chain order; `None`
/// for a link without one) and the base's.
#[derive(Debug, Clone)]
pub struct Outboards {
    pub links: Vec<Option<Arc<Outboard>>>,
    pub base: Option<Arc<Outboard>>,
}

/// Outboards still being read for an image ([`Image::open_outboards_later`]).
pub struct PendingOutboards {
    src: Arc<dyn BlobSource>,
    reading: Option<std::thread::JoinHandle<HashMap<OciDigest, Vec<u8>>>>,
}

impl PendingOutboards {
    /// Wait for the outboards read ahead, read any others the image lists (an ancestor's,
    /// or one too large to read ahead), check them all, and put them in place in `image`,
    /// the image they were opened with. An error leaves `image` without outboards.
    pub fn finish(self, image: &Image) -> Result<(), FormatError> {
        let ahead = self.reading.map(|r| r.join().unwrap_or_default()).unwrap_or_default();
        let outboards = image.read_all_outboards(&Fetched { src: self.src.as_ref(), blobs: std::sync::Mutex::new(ahead) })?;
        image.attach_outboards(outboards);
        Ok(())
    }
}

impl Image {
    pub fn config(&self) -> &ImageConfig {
        &self.chain[0].config
    }
    pub fn index(&self) -> &ChunkIndex {
        &self.chain[0].index
    }
    pub fn chunk_shift(&self) -> u8 {
        self.config().chunk_shift()
    }

    /// Open the image whose manifest has `manifest_digest`, reading its config, index and
    /// parent chain from `src`. Every metadata blob is checked against its digest.
    pub fn open(src: &dyn BlobSource, manifest_digest: &OciDigest) -> Result<Self, FormatError> {
        let (bytes, manifest) = read_manifest(src, manifest_digest)?;
        Self::open_decoded(src, manifest_digest, bytes, manifest)
    }

    /// [`Image::open`], returning once the config and index are read, without waiting for
    /// the outboards, whose reads begin with the config's and index's (`ahead` says which
    /// reads). [`PendingOutboards::finish`] reads what is left of them and puts them in
    /// place. Until then [`Image::slice_cvs`] answers `None`, or, with
    /// [`OutboardsAhead::Tables`], answers for chunks whose CVs [`Image::read_slice_cvs`]
    /// read. A restore that only serves faults takes its first one that much sooner.
    pub fn open_outboards_later(src: Arc<dyn BlobSource>, manifest_digest: &OciDigest, ahead: OutboardsAhead) -> Result<(Self, PendingOutboards), FormatError> {
        let (bytes, manifest) = read_manifest(src.as_ref(), manifest_digest)?;
        let (s2, m2) = (src.clone(), manifest.clone());
        let reading = std::thread::Builder::new()
            .name("outboards".into())
            .spawn(move || match ahead {
                OutboardsAhead::Whole => read_ahead_outboards(s2.as_ref(), &m2),
                OutboardsAhead::Tables => read_ahead_tables(s2.as_ref(), &m2),
            })
            .map_err(|e| FormatError::Io { context: "spawning a thread".into(), source: e })?;
        let mut image = Self::open_decoded(src.as_ref(), manifest_digest, bytes, manifest)?;
        if ahead == OutboardsAhead::Whole {
            return Ok((image, PendingOutboards { src, reading: Some(reading) }));
        }
        let prefixes = reading.join().unwrap_or_default();
        let table = |d: &Descriptor| {
            let t = OutboardTable::decode_prefix(prefixes.get(&d.digest)?, d.size).ok()?;
            (t.chunk_shift == image.chunk_shift()).then(|| (d.digest.clone(), t))
        };
        let links = image.chain.iter().map(|l| l.outboard_blob.as_ref().and_then(table)).collect();
        let base = image.base_outboard_blob.as_ref().and_then(table);
        image.tables = Some(Arc::new(Tables { links, base }));
        Ok((image, PendingOutboards { src, reading: None }))
    }

    /// Whether every outboard the image lists has its table ([`OutboardsAhead::Tables`]):
    /// then a chunk's slices can be read and checked without the whole blobs, and
    /// [`PendingOutboards::finish`] need not run.
    pub fn slices_on_demand(&self) -> bool {
        let Some(t) = &self.tables else { return false };
        self.chain.iter().zip(&t.links).all(|(l, t)| l.outboard_blob.is_none() || t.is_some()) && (self.base_outboard_blob.is_none() || t.base.is_some())
    }

    /// Every outboard the image lists, read and checked ([`Image::read_outboards`],
    /// [`Image::read_base_outboard`]), without changing the image.
    pub fn read_all_outboards(&self, src: &dyn BlobSource) -> Result<Outboards, FormatError> {
        let links = self.read_outboards(src).into_iter().collect::<Result<Vec<_>, _>>()?;
        let base = match &self.base_outboard {
            Some(b) => Some(b.clone()),
            None => self.read_base_outboard(src)?.map(Arc::new),
        };
        Ok(Outboards { links, base })
    }

    /// Put outboards read for this image ([`Image::read_all_outboards`]) in place while it
    /// is shared: [`Image::slice_cvs`] answers from them from then on. Once: `false` (and
    /// nothing changes) if outboards were attached before.
    pub fn attach_outboards(&self, outboards: Outboards) -> bool {
        outboards.links.len() == self.chain.len() && self.attached.set(outboards).is_ok()
    }

    /// The image of an already read and checked manifest.
    fn open_decoded(src: &dyn BlobSource, manifest_digest: &OciDigest, manifest_bytes: Vec<u8>, manifest: Manifest) -> Result<Self, FormatError> {
        let mut chain = Vec::new();
        let mut config_digest = manifest.config.digest.clone();
        // Kept, not taken: unchanged layers over the same files have identical indexes.
        let fetched = prefetch_metadata(src, &manifest);
        let read = |d: &OciDigest, limit: u64| match fetched.get(d) {
            Some(b) => Ok(b.clone()),
            None => read_verified_blob(src, d, limit),
        };
        loop {
            if chain.len() > MAX_CHAIN_DEPTH {
                return Err(FormatError::TooLarge { what: "parent chain depth", got: chain.len() as u64, limit: MAX_CHAIN_DEPTH as u64 });
            }
            let config = ImageConfig::decode(&read(&config_digest, MAX_CONFIG_BYTES)?)?;
            let index_digest = config.index.digest.clone();
            let index = ChunkIndex::decode(&read(&index_digest, MAX_INDEX_BYTES)?)?;
            check_config_matches_index(&config, &index)?;
            let parent = config.parent.as_ref().map(|p| p.config.clone());
            if index.layer != parent.is_some() {
                return Err(FormatError::invalid(
                    "index",
                    format!("{index_digest}: layer flag is {} but the config {} a parent", index.layer, if parent.is_some() { "names" } else { "names no" }),
                ));
            }
            chain.push(ChainLink { config_digest: config_digest.clone(), config, index_digest, index, outboard_blob: None, outboard: None });
            // The parent's index digest named here is checked against the parent config's
            // own index once the chain is read (below).
            match parent {
                Some(c) => {
                    if chain.iter().any(|l| l.config_digest == c) {
                        return Err(FormatError::invalid("parent chain", format!("cycle at config {c}")));
                    }
                    config_digest = c;
                }
                None => break,
            }
        }
        for w in chain.windows(2) {
            let pref = w[0].config.parent.as_ref().expect("has parent");
            if pref.index != w[1].index_digest {
                return Err(FormatError::invalid(
                    "parent chain",
                    format!("config {} names parent index {} but the parent config has {}", w[0].config_digest, pref.index, w[1].index_digest),
                ));
            }
            if w[0].config.hash != w[1].config.hash || w[0].config.chunk_size != w[1].config.chunk_size {
                return Err(FormatError::invalid("parent chain", "a layer must have its parent's hash and chunk size"));
            }
        }
        let (files, packs) = resolve_chain(&chain)?;
        // The manifest must list every blob the image needs, so registry GC and
        // cross-repository copies keep it whole.
        let listed: std::collections::HashSet<&OciDigest> = manifest.layers.iter().map(|d| &d.digest).collect();
        let needed =
            chain.iter().skip(1).flat_map(|l| [&l.config_digest, &l.index_digest]).chain([&chain[0].index_digest]).chain(packs.iter().map(|p| &p.digest));
        for d in needed {
            if !listed.contains(d) {
                return Err(FormatError::invalid("manifest", format!("{manifest_digest} does not list blob {d} that the image needs")));
            }
        }
        find_outboards(&manifest, manifest_digest, &mut chain)?;
        let base_outboard_blob = base_outboard(&manifest, manifest_digest, &chain[0])?;
        Ok(Image {
            manifest_digest: manifest_digest.clone(),
            manifest_bytes,
            manifest,
            chain,
            packs,
            files,
            base_outboard_blob,
            base_outboard: None,
            attached: std::sync::OnceLock::new(),
            tables: None,
        })
    }

    /// Every link's outboard, chain order: `Ok(None)` for a link without one, a link's
    /// loaded copy when it has one, else read and checked as [`ChainLink::read_outboard`]
    /// does, [`PREFETCH_THREADS`] at a time: one after another they cost a round trip per
    /// link (a 64-ancestor chain 20 ms away: 1.3 s, bench/chain.sh --rtt 20).
    pub fn read_outboards(&self, src: &dyn BlobSource) -> Vec<LinkOutboard> {
        let got: Vec<std::sync::Mutex<Option<LinkOutboard>>> = self.chain.iter().map(|_| std::sync::Mutex::new(None)).collect();
        crate::work::for_each_index(
            self.chain.len(),
            PREFETCH_THREADS,
            || (),
            |_, k| {
                let link = &self.chain[k];
                let r = match &link.outboard {
                    Some(o) => Ok(Some(o.clone())),
                    None => link.read_outboard(src).map(|o| o.map(Arc::new)),
                };
                *got[k].lock().expect("poisoned") = Some(r);
            },
        );
        got.into_iter().map(|m| m.into_inner().expect("poisoned").expect("every link is read")).collect()
    }

    /// Read and decode every outboard the manifest lists ([`Image::read_outboards`], and
    /// [`Image::read_base_outboard`]). After this, [`Image::slice_cvs`] answers. Idempotent.
    pub fn load_outboards(&mut self, src: &dyn BlobSource) -> Result<(), FormatError> {
        let read = self.read_outboards(src);
        for (link, r) in self.chain.iter_mut().zip(read) {
            link.outboard = r?;
        }
        if self.base_outboard.is_none() {
            self.base_outboard = self.read_base_outboard(src)?.map(Arc::new);
        }
        Ok(())
    }

    /// Read, check (sha256, size, bound) and decode the base's outboard, when the
    /// manifest lists one.
    pub fn read_base_outboard(&self, src: &dyn BlobSource) -> Result<Option<Outboard>, FormatError> {
        let Some(d) = &self.base_outboard_blob else { return Ok(None) };
        read_outboard_blob(src, d, MAX_OUTBOARD_BYTES, (self.chunk_shift(), "the image"), "base outboard").map(|(_, ob)| Some(ob))
    }

    /// The recorded slice CVs of chunk `chunk` of file `file`, when it is stored raw (so a
    /// slice of it can be fetched as a range) and the outboard of the chain link whose
    /// index recorded it has an entry of its digest and length. `None` for anything else,
    /// and before [`Image::load_outboards`]: the reader then fetches the whole chunk.
    /// **Not checked** against the digest: `verify` does that before trusting a slice.
    pub fn slice_cvs(&self, file: usize, chunk: u64) -> Option<SliceCvs<'_>> {
        let c = self.raw_chunk(file, chunk)?;
        // The link's own outboard, else the base's: a base-referencing image leaves the
        // slices of the base's chunks to the base's outboard.
        let attached = self.attached.get();
        let link = self.chain.get(c.depth as usize)?.outboard.as_deref().or_else(|| attached?.links.get(c.depth as usize)?.as_deref());
        let own = link.and_then(|o| o.find_chunk(&c.digest, c.len));
        let whole = own.or_else(|| self.base_outboard.as_deref().or_else(|| attached?.base.as_deref())?.find_chunk(&c.digest, c.len));
        whole.or_else(|| {
            let (_, t, i) = self.table_entry(c)?;
            t.entry(i)
        })
    }

    /// How chunk `chunk` of file `file` divides into slices, when it has an outboard entry
    /// ([`Image::slice_cvs`]'s, or a table's whose CVs are not read yet).
    pub fn slice_shape(&self, file: usize, chunk: u64) -> Option<SliceShape> {
        if let Some(cvs) = self.slice_cvs(file, chunk) {
            return Some(cvs.shape());
        }
        let (_, t, i) = self.table_entry(self.raw_chunk(file, chunk)?)?;
        Some(t.shape(i))
    }

    /// Read the CVs of chunk `chunk` of file `file` from its outboard table's blob (one
    /// range request, unverified: `verify` merges them to the digest before trusting
    /// them), unless [`Image::slice_cvs`] has them. `Ok(false)`: the chunk has no entry
    /// to read (no table, or none of its digest).
    pub fn read_slice_cvs(&self, src: &dyn BlobSource, file: usize, chunk: u64) -> Result<bool, FormatError> {
        if self.slice_cvs(file, chunk).is_some() {
            return Ok(true);
        }
        let Some((blob, t, i)) = self.raw_chunk(file, chunk).and_then(|c| self.table_entry(c)) else { return Ok(false) };
        let (offset, len) = t.cv_range(i);
        t.set_cvs(i, &src.read_range_unverified(blob, offset, len)?)?;
        Ok(true)
    }

    /// A stored raw chunk (the only kind with slices).
    fn raw_chunk(&self, file: usize, chunk: u64) -> Option<&ResolvedChunk> {
        let c = self.files.get(file)?.chunks.get(usize::try_from(chunk).ok()?)?;
        matches!(c.at, StoredAt::Pack { codec: Codec::Raw, .. }).then_some(c)
    }

    /// The outboard table with an entry for chunk `c` (its link's, else the base's), its
    /// blob and the entry's number.
    fn table_entry(&self, c: &ResolvedChunk) -> Option<(&OciDigest, &OutboardTable, usize)> {
        fn find<'t>(t: &'t Option<(OciDigest, OutboardTable)>, c: &ResolvedChunk) -> Option<(&'t OciDigest, &'t OutboardTable, usize)> {
            let (d, t) = t.as_ref()?;
            Some((d, t, t.find_chunk(&c.digest, c.len)?))
        }
        let t = self.tables.as_deref()?;
        t.links.get(c.depth as usize).and_then(|l| find(l, c)).or_else(|| find(&t.base, c))
    }

    /// Every pack this image points into, with which chain link owns it.
    pub fn pack_index(&self, digest: &OciDigest) -> Option<u32> {
        self.packs.iter().position(|p| &p.digest == digest).map(|i| i as u32)
    }

    pub fn file(&self, name: &str) -> Option<(usize, &ResolvedFile)> {
        self.files.iter().enumerate().find(|(_, f)| f.name == name)
    }
}

/// A chain link's outboard as read: none listed, the outboard, or why it could not be read.
pub type LinkOutboard = Result<Option<Arc<Outboard>>, FormatError>;

/// Threads fetching a chain's configs, indexes and outboards at once.
const PREFETCH_THREADS: usize = crate::source::SMALL_READS_IN_FLIGHT;

/// The largest outboard read before the index that bounds it ([`ChainLink::outboard_limit`])
/// is known: 32 MiB covers 8 GiB of raw chunks. A larger one is read after the index, and
/// one over its bound is never read; so a hostile manifest can make a reader fetch at most
/// this much per outboard (two) that it would not have fetched.
pub const SPECULATIVE_OUTBOARD_BYTES: u64 = 32 << 20;

/// The config and index blobs the manifest lists for the image (its config, the index of
/// owner `self`) and for its ancestors (owner `parent`, `parent.parent`, …), fetched in
/// parallel and checked against their digests. Reading a chain link by link costs two
/// round trips per link, one after the other (130 for a chain of 64: seconds over a WAN,
/// and most of a small pull's time on loopback). At most as many blobs as the longest
/// chain has are fetched, so a manifest listing more cannot make a reader fetch more than
/// the link-by-link walk could. A blob that fails here is left to the walk, which reads it
/// again and reports the failure.
fn prefetch_metadata(src: &dyn BlobSource, manifest: &Manifest) -> HashMap<OciDigest, Vec<u8>> {
    let mut seen = std::collections::HashSet::from([&manifest.config.digest]);
    let wanted: Vec<(&OciDigest, u64)> = std::iter::once((&manifest.config.digest, MAX_CONFIG_BYTES))
        .chain(
            manifest
                .layers
                .iter()
                .filter(|d| d.annotations.get(media::ANN_OWNER).is_some_and(|o| owner_depth(o).is_some()) && seen.insert(&d.digest))
                .filter_map(|d| match d.media_type.as_str() {
                    media::CONFIG => Some((&d.digest, MAX_CONFIG_BYTES)),
                    media::INDEX => Some((&d.digest, MAX_INDEX_BYTES)),
                    _ => None,
                })
                .take(2 * MAX_CHAIN_DEPTH + 1),
        )
        .collect();
    read_all(src, &wanted, true)
}

/// The outboards of owner `self` and `base` the manifest lists (at most one each: a second
/// is an error the open reports), those no larger than [`SPECULATIVE_OUTBOARD_BYTES`],
/// read in parallel as the source gives them: their reader checks them once it knows
/// their bound.
/// The start of every outboard blob of the chain and the base ([`OutboardsAhead::Tables`]):
/// enough for its header and, for the usual shapes, its entries
/// ([`table_prefix_len`]); where the header says the entries go on, the rest of them when
/// that is at most [`TABLE_REST_BYTES`] more. Unverified (a table needs no trust of its
/// own: [`OutboardTable`]). At most as many blobs as a chain can have links, plus the
/// base's, and only those the read-ahead of whole outboards would also consider, so a
/// hostile manifest can make a reader fetch at most 66 × 1 MiB it would not have fetched.
fn read_ahead_tables(src: &dyn BlobSource, manifest: &Manifest) -> HashMap<OciDigest, Vec<u8>> {
    let wanted = outboards_to_read_ahead(manifest, |o| o == "base" || owner_depth(o).is_some(), MAX_CHAIN_DEPTH + 2);
    read_each(&wanted, |d| {
        let mut b = src.read_range_unverified(&d.digest, 0, table_prefix_len(d.size) as usize).ok()?.to_vec();
        let need = OutboardTable::table_len(&b).unwrap_or(0).min(d.size);
        if need > b.len() as u64 && need - b.len() as u64 <= TABLE_REST_BYTES {
            b.extend_from_slice(&src.read_range_unverified(&d.digest, b.len() as u64, (need - b.len() as u64) as usize).ok()?);
        }
        Some((d.digest.clone(), b))
    })
}

/// The outboards the manifest lists whose owner `owner` accepts, no larger than
/// [`SPECULATIVE_OUTBOARD_BYTES`], each once, at most `most`: what may be read before the
/// indexes that bound them are.
fn outboards_to_read_ahead(manifest: &Manifest, owner: impl Fn(&str) -> bool, most: usize) -> Vec<&Descriptor> {
    let mut seen = std::collections::HashSet::new();
    manifest
        .layers
        .iter()
        .filter(|d| {
            d.media_type == media::OUTBOARD
                && d.size <= SPECULATIVE_OUTBOARD_BYTES
                && d.annotations.get(media::ANN_OWNER).is_some_and(|o| owner(o))
                && seen.insert(&d.digest)
        })
        .take(most)
        .collect()
}

/// `read` of each of `items`, [`PREFETCH_THREADS`] at a time: the blobs it answers, by
/// digest (a `None` is left out).
fn read_each<T: Sync>(items: &[T], read: impl Fn(&T) -> Option<(OciDigest, Vec<u8>)> + Sync) -> HashMap<OciDigest, Vec<u8>> {
    let got = std::sync::Mutex::new(HashMap::new());
    crate::work::for_each_index(
        items.len(),
        PREFETCH_THREADS,
        || (),
        |_, i| {
            if let Some((d, b)) = read(&items[i]) {
                got.lock().expect("poisoned").insert(d, b);
            }
        },
    );
    got.into_inner().expect("poisoned")
}

/// Bytes read from the start of an outboard blob of `size` bytes for its table: 1/64 of
/// it (the entries are 48 bytes against a 1 MiB chunk's 8 KiB of CVs at 4 KiB slices:
/// 1/172), at least 64 KiB, at most the blob.
fn table_prefix_len(size: u64) -> u64 {
    (size / 64).max(64 << 10).min(size)
}

/// The most read again for the rest of an outboard's entries when its first read did not
/// hold them all (small chunks: the entries are a larger part of the blob).
const TABLE_REST_BYTES: u64 = 512 << 10;

fn read_ahead_outboards(src: &dyn BlobSource, manifest: &Manifest) -> HashMap<OciDigest, Vec<u8>> {
    let wanted: Vec<(&OciDigest, u64)> =
        outboards_to_read_ahead(manifest, |o| o == "self" || o == "base", 2).into_iter().map(|d| (&d.digest, d.size)).collect();
    read_all(src, &wanted, false)
}

/// Blobs `wanted` (each with its size bound), [`PREFETCH_THREADS`] at a time; with
/// `verified`, only those that match their digest. A blob that cannot be read is left out.
fn read_all(src: &dyn BlobSource, wanted: &[(&OciDigest, u64)], verified: bool) -> HashMap<OciDigest, Vec<u8>> {
    read_each(wanted, |&(d, limit)| {
        let b = if verified { read_verified_blob(src, d, limit) } else { src.read_blob_unverified(d, limit) };
        Some((d.clone(), b.ok()?))
    })
}

/// The manifest `digest`, checked against it, and decoded: a snapctl image's.
fn read_manifest(src: &dyn BlobSource, digest: &OciDigest) -> Result<(Vec<u8>, Manifest), FormatError> {
    let bytes = read_verified_blob(src, digest, MAX_MANIFEST_BYTES)?;
    let manifest = Manifest::decode(&bytes)?;
    if manifest.config.media_type != media::CONFIG {
        return Err(FormatError::invalid("manifest", format!("{digest} has config type {:?}: not a snapctl image", manifest.config.media_type)));
    }
    Ok((bytes, manifest))
}

/// A source whose blobs read ahead are served from memory, each once; every other read
/// goes to `src`. The bytes are as unverified as `src`'s (the reader checks them).
struct Fetched<'a> {
    src: &'a dyn BlobSource,
    blobs: std::sync::Mutex<HashMap<OciDigest, Vec<u8>>>,
}

impl crate::source::Forward for Fetched<'_> {
    fn inner(&self) -> &dyn BlobSource {
        self.src
    }
    fn read_blob_unverified(&self, digest: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError> {
        match self.blobs.lock().expect("poisoned").remove(digest) {
            Some(b) if b.len() as u64 > limit => Err(FormatError::TooLarge { what: "blob size", got: b.len() as u64, limit }),
            Some(b) => Ok(b),
            None => self.src.read_blob_unverified(digest, limit),
        }
    }
    fn read_at_unverified(&self, digest: &OciDigest, offset: u64, buf: &mut [u8]) -> Result<(), FormatError> {
        self.src.read_at_unverified(digest, offset, buf)
    }
}

/// The base's outboard the manifest lists (owner `base`), at most one, for a BLAKE3 image
/// (a layer over a clone lists its parent's base's, whether or not it names a base itself).
fn base_outboard(manifest: &Manifest, manifest_digest: &OciDigest, link: &ChainLink) -> Result<Option<Descriptor>, FormatError> {
    let mut found: Option<Descriptor> = None;
    for d in manifest.layers.iter().filter(|d| d.media_type == media::OUTBOARD && d.annotations.get(media::ANN_OWNER).is_some_and(|o| o == "base")) {
        let bad = |detail: String| FormatError::invalid("manifest", format!("{manifest_digest}: base outboard {}: {detail}", d.digest));
        if link.config.hash != crate::HashAlgo::Blake3 {
            return Err(bad(format!("the image is {}, and only BLAKE3 has slice CVs", link.config.hash)));
        }
        if let Some(other) = &found {
            return Err(bad(format!("a second base outboard (the first is {})", other.digest)));
        }
        if d.size > MAX_OUTBOARD_BYTES {
            return Err(FormatError::TooLarge { what: "base outboard size", got: d.size, limit: MAX_OUTBOARD_BYTES });
        }
        found = Some(d.clone());
    }
    Ok(found)
}

/// Attach to each chain link the outboard the manifest lists for it. An outboard whose
/// owner is not a link of this chain is ignored, as any blob the image does not need (a
/// later version may list others); two for one link, one for a SHA-256 image, or one over
/// the size its link's records can need, are rejected.
fn find_outboards(manifest: &Manifest, manifest_digest: &OciDigest, chain: &mut [ChainLink]) -> Result<(), FormatError> {
    for d in manifest.layers.iter().filter(|d| d.media_type == media::OUTBOARD) {
        let Some(k) = d.annotations.get(media::ANN_OWNER).and_then(|o| owner_depth(o)).filter(|&k| k < chain.len()) else { continue };
        let link = &mut chain[k];
        let bad = |detail: String| FormatError::invalid("manifest", format!("{manifest_digest}: outboard {}: {detail}", d.digest));
        if link.config.hash != crate::HashAlgo::Blake3 {
            return Err(bad(format!("the image it covers (config {}) is {}, and only BLAKE3 has slice CVs", link.config_digest, link.config.hash)));
        }
        if let Some(other) = &link.outboard_blob {
            return Err(bad(format!("a second outboard for config {} (the first is {})", link.config_digest, other.digest)));
        }
        let limit = link.outboard_limit();
        if d.size > limit {
            return Err(FormatError::TooLarge { what: "outboard size (for the records it can cover)", got: d.size, limit });
        }
        link.outboard_blob = Some(d.clone());
    }
    Ok(())
}

fn check_config_matches_index(config: &ImageConfig, index: &ChunkIndex) -> Result<(), FormatError> {
    if config.hash != index.hash || config.chunk_shift() != index.chunk_shift {
        return Err(FormatError::invalid("config/index", "hash or chunk size differ between config and index"));
    }
    if config.files.len() != index.files.len() {
        return Err(FormatError::invalid("config/index", format!("config lists {} files, index {}", config.files.len(), index.files.len())));
    }
    for (c, i) in config.files.iter().zip(&index.files) {
        if c.size != i.size {
            return Err(FormatError::invalid("config/index", format!("{:?}: config size {} but index size {}", c.name, c.size, i.size)));
        }
    }
    Ok(())
}

/// Flatten a chain (`chain[0]` the image, deepest last) into per-file chunk tables and
/// one pack list. [`Image::open`] does this for the whole chain; audits call it on each
/// suffix to check every ancestor's roots.
pub fn resolve_chain(chain: &[ChainLink]) -> Result<(Vec<ResolvedFile>, Vec<PackRef>), FormatError> {
    let mut packs: Vec<PackRef> = Vec::new();
    let mut pack_ids: HashMap<OciDigest, u32> = HashMap::new();
    let mut below: Option<Vec<ResolvedFile>> = None;
    for (depth, link) in chain.iter().enumerate().rev() {
        let ix = &link.index;
        let shift = ix.chunk_shift;
        let local = map_pack_table(&ix.packs, &mut packs, &mut pack_ids)?;
        let parent_by_name: HashMap<&str, &ResolvedFile> = below.iter().flatten().map(|f| (f.name.as_str(), f)).collect();
        let mut files = Vec::with_capacity(ix.files.len());
        for (fi, (cf, xf)) in link.config.files.iter().zip(&ix.files).enumerate() {
            let n = chunk_count(xf.size, shift);
            let recs = ix.file_records(fi);
            // Every chunk is either recorded here or inherited from the parent's file of
            // the same name, so a file claiming more chunks than that is a lie; refuse it
            // before allocating for it.
            let parent_chunks = parent_by_name.get(cf.name.as_str()).map_or(0, |pf| pf.chunks.len() as u64);
            if n > recs.len() as u64 + parent_chunks {
                return Err(FormatError::invalid(
                    "layer index",
                    format!("{:?} claims {n} chunks but has {} records and its parent {parent_chunks} chunks", cf.name, recs.len()),
                ));
            }
            let mut chunks = Vec::with_capacity(n as usize);
            let mut r = recs.iter().peekable();
            for c in 0..n {
                let len = chunk_len(xf.size, shift, c) as u32;
                let rc = match r.peek() {
                    Some(rec) if rec.chunk == c => {
                        let rec = r.next().expect("peeked");
                        let at = match rec.kind {
                            RecordKind::Zero => StoredAt::Zero,
                            RecordKind::Stored { pack, offset, stored_len, codec } => {
                                StoredAt::Pack { pack: local[pack as usize], offset, stored_len, codec: codec.map_ref(|p| local[p as usize]) }
                            }
                        };
                        ResolvedChunk { digest: rec.digest, len, at, depth: depth as u8 }
                    }
                    _ => {
                        let inherited = parent_by_name.get(cf.name.as_str()).and_then(|pf| pf.chunks.get(c as usize));
                        match inherited {
                            Some(pc) if pc.len == len => *pc,
                            _ => {
                                return Err(FormatError::invalid(
                                    "layer index",
                                    format!("{:?} chunk {c}: no record and no parent chunk of {len} bytes to inherit", cf.name),
                                ))
                            }
                        }
                    }
                };
                chunks.push(rc);
            }
            files.push(ResolvedFile { name: cf.name.clone(), size: cf.size, mode: cf.mode, role: cf.role, chunks });
        }
        below = Some(files);
    }
    Ok(drop_unused_packs(below.unwrap_or_default(), packs))
}

/// Map a link's pack table into the global one (`packs`, ids by digest in `pack_ids`):
/// the global id of each of its packs. A pack listed with two sizes is refused.
fn map_pack_table(table: &[PackRef], packs: &mut Vec<PackRef>, pack_ids: &mut HashMap<OciDigest, u32>) -> Result<Vec<u32>, FormatError> {
    let mut local = Vec::with_capacity(table.len());
    for p in table {
        let id = *pack_ids.entry(p.digest.clone()).or_insert_with(|| {
            packs.push(p.clone());
            (packs.len() - 1) as u32
        });
        if packs[id as usize].size != p.size {
            return Err(FormatError::invalid("pack table", format!("{} listed with sizes {} and {}", p.digest, packs[id as usize].size, p.size)));
        }
        local.push(id);
    }
    Ok(local)
}

/// Drop packs no resolved chunk uses (an ancestor's pack whose chunks were all replaced),
/// renumbering the chunks' pack ids. A `zstd-ref` chunk uses its reference's pack too.
fn drop_unused_packs(files: Vec<ResolvedFile>, packs: Vec<PackRef>) -> (Vec<ResolvedFile>, Vec<PackRef>) {
    let mut used = vec![false; packs.len()];
    for f in &files {
        for c in &f.chunks {
            if let StoredAt::Pack { pack, codec, .. } = c.at {
                used[pack as usize] = true;
                if let Some(rp) = codec.ref_pack() {
                    used[rp as usize] = true;
                }
            }
        }
    }
    if used.iter().all(|u| *u) {
        return (files, packs);
    }
    let mut remap = vec![u32::MAX; packs.len()];
    let mut kept = Vec::new();
    for (i, p) in packs.into_iter().enumerate() {
        if used[i] {
            remap[i] = kept.len() as u32;
            kept.push(p);
        }
    }
    let files = files
        .into_iter()
        .map(|mut f| {
            for c in &mut f.chunks {
                if let StoredAt::Pack { pack, codec, .. } = &mut c.at {
                    *pack = remap[*pack as usize];
                    *codec = codec.map_ref(|rp| remap[rp as usize]);
                }
            }
            f
        })
        .collect();
    (files, kept)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    use super::*;
    use crate::config::{BlobRef, ChainRef, FileEntry, CONFIG_FORMAT};
    use crate::index::{ChunkRecord, IndexFile};
    use crate::manifest::Descriptor;
    use crate::{HashAlgo, Kind, OciLayout};

    const SHIFT: u8 = 16;

    fn digest(n: u8) -> ChunkDigest {
        ChunkDigest([n; 32])
    }

    fn stored(chunk: u64, pack: u32, offset: u64, d: u8) -> ChunkRecord {
        ChunkRecord { chunk, kind: RecordKind::Stored { pack, offset, stored_len: 65536, codec: Codec::Raw }, digest: digest(d) }
    }

    fn pack(n: u8) -> PackRef {
        PackRef { digest: OciDigest::of(&[n]), size: 5 << 16 }
    }

    fn config(files: &[(&str, u64)], index: &ChunkIndex, parent: Option<ChainRef>) -> ImageConfig {
        ImageConfig {
            format: CONFIG_FORMAT.into(),
            kind: Kind::Dir,
            created: "1970-01-01T00:00:00Z".into(),
            chunk_size: 1 << SHIFT,
            hash: HashAlgo::Blake3,
            compression: "none".into(),
            files: files
                .iter()
                .map(|(name, size)| FileEntry {
                    name: (*name).into(),
                    size: *size,
                    mode: 0o644,
                    role: Role::Other,
                    chunks: size.div_ceil(1 << SHIFT),
                    root: String::new(),
                })
                .collect(),
            root: String::new(),
            index: BlobRef { digest: OciDigest::of(&index.encode()), size: index.encoded_len() as u64 },
            parent,
            base: None,
            annotations: BTreeMap::new(),
        }
    }

    fn link(files: &[(&str, u64)], index: ChunkIndex) -> ChainLink {
        let config = config(files, &index, None);
        ChainLink {
            config_digest: OciDigest::of(&config.encode()),
            index_digest: config.index.digest.clone(),
            config,
            index,
            outboard_blob: None,
            outboard: None,
        }
    }

    fn index(layer: bool, files: Vec<IndexFile>, packs: Vec<PackRef>, records: Vec<ChunkRecord>) -> ChunkIndex {
        let ix = ChunkIndex { hash: HashAlgo::Blake3, chunk_shift: SHIFT, layer, files, packs, records };
        ix.validate().unwrap();
        ix
    }

    /// A file's chunks as (digest, pack digest or none, offset).
    type Located = (String, Vec<(ChunkDigest, Option<OciDigest>, u64)>);

    /// Every resolved chunk's digest and stored location: what a reader does with a
    /// chunk, whatever the pack numbering.
    fn located(files: &[ResolvedFile], packs: &[PackRef]) -> Vec<Located> {
        files
            .iter()
            .map(|f| {
                let chunks = f
                    .chunks
                    .iter()
                    .map(|c| match c.at {
                        StoredAt::Zero => (c.digest, None, 0),
                        StoredAt::Pack { pack, offset, .. } => (c.digest, Some(packs[pack as usize].digest.clone()), offset),
                    })
                    .collect();
                (f.name.clone(), chunks)
            })
            .collect()
    }

    /// A rebased image is a full index whose records point into the packs its chain
    /// stored, with no parent: it resolves to exactly the chunks (and stored locations) of
    /// the layer it replaces, and holds no chain of its own.
    #[test]
    fn a_full_index_into_the_chains_packs_resolves_like_the_layer_it_replaces() {
        let files = [("mem", 4u64 << 16), ("state", 100)];
        // Parent: full, pack 1. Layer: chunk 2 of mem changed (pack 2), chunk 3 zeroed.
        let parent = link(
            &files,
            index(
                false,
                vec![IndexFile { size: 4 << 16, first_record: 0, record_count: 4 }, IndexFile { size: 100, first_record: 4, record_count: 1 }],
                vec![pack(1)],
                vec![
                    stored(0, 0, 0, 10),
                    stored(1, 0, 65536, 11),
                    stored(2, 0, 131072, 12),
                    stored(3, 0, 196608, 13),
                    ChunkRecord { chunk: 0, kind: RecordKind::Stored { pack: 0, offset: 262144, stored_len: 100, codec: Codec::Raw }, digest: digest(14) },
                ],
            ),
        );
        let zero = ChunkRecord { chunk: 3, kind: RecordKind::Zero, digest: digest(99) };
        let layer = link(
            &files,
            index(
                true,
                vec![IndexFile { size: 4 << 16, first_record: 0, record_count: 2 }, IndexFile { size: 100, first_record: 2, record_count: 0 }],
                vec![pack(2)],
                vec![stored(2, 0, 0, 22), zero],
            ),
        );
        let (want_files, want_packs) = resolve_chain(&[layer, parent]).unwrap();

        // The rebased index: one record per chunk, the unchanged ones where the parent
        // stored them; its pack table lists both packs (its own first, as a packer writes).
        let rebased = link(
            &files,
            index(
                false,
                vec![IndexFile { size: 4 << 16, first_record: 0, record_count: 4 }, IndexFile { size: 100, first_record: 4, record_count: 1 }],
                vec![pack(2), pack(1)],
                vec![
                    stored(0, 1, 0, 10),
                    stored(1, 1, 65536, 11),
                    stored(2, 0, 0, 22),
                    zero,
                    ChunkRecord { chunk: 0, kind: RecordKind::Stored { pack: 1, offset: 262144, stored_len: 100, codec: Codec::Raw }, digest: digest(14) },
                ],
            ),
        );
        let (got_files, got_packs) = resolve_chain(std::slice::from_ref(&rebased)).unwrap();
        assert_eq!(located(&got_files, &got_packs), located(&want_files, &want_packs));
        assert!(got_files.iter().flat_map(|f| &f.chunks).all(|c| c.depth == 0), "every chunk is the rebased image's own record");
        let mut a: Vec<_> = got_packs.iter().map(|p| &p.digest).collect();
        let mut b: Vec<_> = want_packs.iter().map(|p| &p.digest).collect();
        a.sort();
        b.sort();
        assert_eq!(a, b, "the same packs are needed");
    }

    /// Counts each blob read, to see what `Image::open` fetches.
    struct Counting<'a> {
        inner: &'a OciLayout,
        reads: Mutex<BTreeMap<OciDigest, usize>>,
    }

    impl crate::source::Forward for Counting<'_> {
        fn inner(&self) -> &dyn BlobSource {
            self.inner
        }
        fn read_blob_unverified(&self, d: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError> {
            *self.reads.lock().unwrap().entry(d.clone()).or_default() += 1;
            self.inner.read_blob_unverified(d, limit)
        }
    }

    /// Store a chain of `n` images (one zero-chunk file; each layer unchanged) and return
    /// the last manifest's digest, with `extra` descriptors added to its layers.
    fn store_chain(layout: &OciLayout, n: usize, extra: &[Descriptor]) -> OciDigest {
        let files = [("mem", 1u64 << 16)];
        let mut ancestors: Vec<(OciDigest, u64, OciDigest, u64)> = Vec::new(); // config, size, index, size (parent first)
        let mut parent: Option<ChainRef> = None;
        let mut last = None;
        for k in 0..n {
            let ix = if k == 0 {
                index(
                    false,
                    vec![IndexFile { size: 1 << 16, first_record: 0, record_count: 1 }],
                    vec![],
                    vec![ChunkRecord { chunk: 0, kind: RecordKind::Zero, digest: digest(0) }],
                )
            } else {
                index(true, vec![IndexFile { size: 1 << 16, first_record: 0, record_count: 0 }], vec![], vec![])
            };
            let ib = ix.encode();
            let id = layout.put_blob(&ib).unwrap();
            let cfg = config(&files, &ix, parent.clone());
            let cb = cfg.encode();
            let cd = layout.put_blob(&cb).unwrap();
            let mut layers = vec![Descriptor::new(media::INDEX, id.clone(), ib.len() as u64).with_annotation(media::ANN_OWNER, "self")];
            for (depth, (c, cs, i, is)) in ancestors.iter().enumerate() {
                let owner = vec!["parent"; depth + 1].join(".");
                layers.push(Descriptor::new(media::CONFIG, c.clone(), *cs).with_annotation(media::ANN_OWNER, owner.clone()));
                layers.push(Descriptor::new(media::INDEX, i.clone(), *is).with_annotation(media::ANN_OWNER, owner));
            }
            if k == n - 1 {
                layers.extend_from_slice(extra);
            }
            let m = Manifest {
                schema_version: 2,
                media_type: Some(media::OCI_MANIFEST.into()),
                artifact_type: Some(media::ARTIFACT_TYPE.into()),
                config: Descriptor::new(media::CONFIG, cd.clone(), cb.len() as u64),
                layers,
                subject: None,
                annotations: BTreeMap::new(),
            };
            let md = layout.put_blob(&m.encode()).unwrap();
            parent = Some(ChainRef { manifest: md.clone(), config: cd.clone(), index: id.clone(), root: String::new(), reference: None });
            ancestors.insert(0, (cd, cb.len() as u64, id, ib.len() as u64));
            last = Some(md);
        }
        last.unwrap()
    }

    /// Opening a deep chain reads each ancestor's config and index once (fetched
    /// together from the manifest's list, not one round trip after another), and blobs
    /// the manifest lists as ancestors' that are not in the chain change nothing.
    #[test]
    fn open_reads_every_ancestor_once_whatever_the_manifest_lists() {
        let dir = tempfile::tempdir().unwrap();
        let layout = OciLayout::open_or_create(dir.path()).unwrap();
        let stray = layout.put_blob(b"{\"not\": \"a config of this chain\"}").unwrap();
        let extra = [Descriptor::new(media::CONFIG, stray.clone(), 33).with_annotation(media::ANN_OWNER, "parent")];
        let top = store_chain(&layout, MAX_CHAIN_DEPTH + 1, &extra);
        let src = Counting { inner: &layout, reads: Mutex::new(BTreeMap::new()) };
        let img = Image::open(&src, &top).unwrap();
        assert_eq!(img.chain.len(), MAX_CHAIN_DEPTH + 1);
        let reads = src.reads.into_inner().unwrap();
        assert!(reads.values().all(|n| *n == 1), "each blob read once: {reads:?}");
        // The manifest, each link's config, the full index and the (identical) layer index.
        assert_eq!(reads.len() - usize::from(reads.contains_key(&stray)), 1 + (MAX_CHAIN_DEPTH + 1) + 2);

        // One more ancestor is still refused.
        let dir = tempfile::tempdir().unwrap();
        let layout = OciLayout::open_or_create(dir.path()).unwrap();
        let top = store_chain(&layout, MAX_CHAIN_DEPTH + 2, &[]);
        let err = Image::open(&layout, &top).unwrap_err();
        assert!(matches!(err, FormatError::TooLarge { what: "parent chain depth", .. }), "{err}");
    }
}
