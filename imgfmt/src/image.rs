//! An opened image: manifest, config and index read and checked against their OCI
//! digests, the parent chain resolved into one flat table of chunk locations.

use std::collections::HashMap;

use crate::compress::Codec;
use crate::config::{ImageConfig, Role, MAX_CHAIN_DEPTH, MAX_CONFIG_BYTES};
use crate::digest::{ChunkDigest, OciDigest};
use crate::index::{chunk_count, chunk_len, ChunkIndex, PackRef, RecordKind, MAX_INDEX_BYTES};
use crate::manifest::{Manifest, MAX_MANIFEST_BYTES};
use crate::media;
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
            chain.push(ChainLink { config_digest: config_digest.clone(), config, index_digest, index });
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
        Ok(Image { manifest_digest: manifest_digest.clone(), manifest_bytes, manifest, chain, packs, files })
    }

    /// Every pack this image points into, with which chain link owns it.
    pub fn pack_index(&self, digest: &OciDigest) -> Option<u32> {
        self.packs.iter().position(|p| &p.digest == digest).map(|i| i as u32)
    }

    pub fn file(&self, name: &str) -> Option<(usize, &ResolvedFile)> {
        self.files.iter().enumerate().find(|(_, f)| f.name == name)
    }
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
