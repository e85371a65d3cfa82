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
use crate::outboard::{self, Outboard, SliceCvs, MAX_OUTBOARD_BYTES, MIN_SLICE_SHIFT};
use crate::reference::Selector;
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
        let Some(d) = &self.outboard_blob else { return Ok(None) };
        let b = read_verified_blob(src, &d.digest, self.outboard_limit())?;
        if b.len() as u64 != d.size {
            return Err(FormatError::invalid("outboard", format!("{} is {} bytes, the manifest says {}", d.digest, b.len(), d.size)));
        }
        let ob = Outboard::decode(&b).map_err(|e| FormatError::invalid("outboard", format!("{}: {e}", d.digest)))?;
        if ob.chunk_shift != self.index.chunk_shift {
            return Err(FormatError::invalid(
                "outboard",
                format!("{}: chunk_shift {} but the index {} has {}", d.digest, ob.chunk_shift, self.index_digest, self.index.chunk_shift),
            ));
        }
        Ok(Some(ob))
    }
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

    /// Open the manifest a selector names.
    pub fn open_selector(src: &dyn BlobSource, sel: &Selector) -> Result<Self, FormatError> {
        let digest = match sel {
            Selector::Tag(t) => src.resolve_tag(t)?,
            Selector::Digest(d) => d.clone(),
        };
        Self::open(src, &digest)
    }

    /// Open the image whose manifest has `manifest_digest`, reading its config, index and
    /// parent chain from `src`. Every metadata blob is checked against its digest.
    pub fn open(src: &dyn BlobSource, manifest_digest: &OciDigest) -> Result<Self, FormatError> {
        let manifest_bytes = read_verified_blob(src, manifest_digest, MAX_MANIFEST_BYTES)?;
        let manifest = Manifest::decode(&manifest_bytes)?;
        if manifest.config.media_type != media::CONFIG {
            return Err(FormatError::invalid("manifest", format!("{manifest_digest} has config type {:?}: not a snapctl image", manifest.config.media_type)));
        }
        let mut chain = Vec::new();
        let mut config_digest = manifest.config.digest.clone();
        loop {
            if chain.len() > MAX_CHAIN_DEPTH {
                return Err(FormatError::TooLarge { what: "parent chain depth", got: chain.len() as u64, limit: MAX_CHAIN_DEPTH as u64 });
            }
            let config = ImageConfig::decode(&read_verified_blob(src, &config_digest, MAX_CONFIG_BYTES)?)?;
            let index_digest = config.index.digest.clone();
            let index = ChunkIndex::decode(&read_verified_blob(src, &index_digest, MAX_INDEX_BYTES)?)?;
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
        Ok(Image { manifest_digest: manifest_digest.clone(), manifest_bytes, manifest, chain, packs, files })
    }

    /// Read and decode every outboard the manifest lists (see [`ChainLink::read_outboard`]).
    /// After this, [`Image::slice_cvs`] answers. Idempotent.
    pub fn load_outboards(&mut self, src: &dyn BlobSource) -> Result<(), FormatError> {
        for link in &mut self.chain {
            if link.outboard.is_none() {
                link.outboard = link.read_outboard(src)?.map(Arc::new);
            }
        }
        Ok(())
    }

    /// The recorded slice CVs of chunk `chunk` of file `file`, when it is stored raw (so a
    /// slice of it can be fetched as a range) and the outboard of the chain link whose
    /// index recorded it has an entry of its digest and length. `None` for anything else,
    /// and before [`Image::load_outboards`]: the reader then fetches the whole chunk.
    /// **Not checked** against the digest: `verify` does that before trusting a slice.
    pub fn slice_cvs(&self, file: usize, chunk: u64) -> Option<SliceCvs<'_>> {
        let c = self.files.get(file)?.chunks.get(usize::try_from(chunk).ok()?)?;
        let StoredAt::Pack { codec: Codec::Raw, .. } = c.at else { return None };
        let s = self.chain.get(c.depth as usize)?.outboard.as_deref()?.find(&c.digest)?;
        (s.chunk_len == c.len).then_some(s)
    }

    /// Every pack this image points into, with which chain link owns it.
    pub fn pack_index(&self, digest: &OciDigest) -> Option<u32> {
        self.packs.iter().position(|p| &p.digest == digest).map(|i| i as u32)
    }

    pub fn file(&self, name: &str) -> Option<(usize, &ResolvedFile)> {
        self.files.iter().enumerate().find(|(_, f)| f.name == name)
    }
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
        // Map this link's pack table into the global one.
        let mut local = Vec::with_capacity(ix.packs.len());
        for p in &ix.packs {
            let id = *pack_ids.entry(p.digest.clone()).or_insert_with(|| {
                packs.push(p.clone());
                (packs.len() - 1) as u32
            });
            if packs[id as usize].size != p.size {
                return Err(FormatError::invalid("pack table", format!("{} listed with sizes {} and {}", p.digest, packs[id as usize].size, p.size)));
            }
            local.push(id);
        }
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
                            RecordKind::Stored { pack, offset, stored_len, codec } => StoredAt::Pack { pack: local[pack as usize], offset, stored_len, codec },
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
    // Drop packs no resolved chunk uses (an ancestor's pack whose chunks were all replaced).
    let files = below.unwrap_or_default();
    let mut used = vec![false; packs.len()];
    for f in &files {
        for c in &f.chunks {
            if let StoredAt::Pack { pack, .. } = c.at {
                used[pack as usize] = true;
            }
        }
    }
    if used.iter().all(|u| *u) {
        return Ok((files, packs));
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
                if let StoredAt::Pack { pack, .. } = &mut c.at {
                    *pack = remap[*pack as usize];
                }
            }
            f
        })
        .collect();
    Ok((files, kept))
}
