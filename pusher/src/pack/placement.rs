//! Where each chunk goes: the pack table being built, the chunks the base and the chain
//! already store, and the index made from the placements.

use std::collections::{BTreeMap, HashMap, HashSet};

use imgfmt::compress::Codec;
use imgfmt::config::FileEntry;
use imgfmt::index::{chunk_count, IndexFile};
use imgfmt::{media, ChunkDigest, ChunkIndex, ChunkRecord, OciDigest, PackRef, RecordKind, StoredAt};

use crate::scan;

use super::options::{PackError, PackOptions, Related};

/// Where a chunk's stored bytes are during packing (own packs are not named yet).
#[derive(Debug, Clone, Copy)]
pub(super) struct Loc {
    /// Index into `pack_slots`.
    pub(super) slot: u32,
    pub(super) offset: u64,
    pub(super) stored_len: u32,
    pub(super) codec: Codec,
}

pub(super) enum Slot {
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
pub(super) type PlacedChunk = Option<(ChunkDigest, Option<Loc>)>;

/// Per file, per chunk: where it went.
pub(super) type Placed = Vec<Vec<PlacedChunk>>;

/// Rebasing: every chunk the layer would have inherited gets a record where the chain
/// stores it, so those packs join the pack table as foreign packs owned by `chain_owner`.
pub(super) fn add_chain_packs(opts: &PackOptions, placement: &Placement, slots: &mut Slots, chain_owner: &'static str) {
    let p = opts.parent.as_ref().expect("rebase has a parent");
    for pc in placement.inherited() {
        if let StoredAt::Pack { pack, codec, .. } = pc.at {
            for pr in std::iter::once(pack).chain(codec.ref_pack()).map(|k| &p.image.packs[k as usize]) {
                slots.foreign(&pr.digest, chain_owner, false, || pr.size);
            }
        }
    }
}

/// Where a chunk of the base or the parent chain is stored: a chunk of this image with
/// its digest is recorded there instead of stored again.
pub(super) struct KnownChunk {
    pub(super) pack: OciDigest,
    pub(super) offset: u64,
    pub(super) stored_len: u32,
    /// As the base or the chain resolved it (a `zstd-ref` chunk's reference pack numbered
    /// among that image's packs: see `ref_pack`).
    pub(super) codec: Codec,
    /// A `zstd-ref` chunk's reference pack (digest, size).
    pub(super) ref_pack: Option<(OciDigest, u64)>,
    /// The manifest annotation `owner` of its pack.
    pub(super) owner: &'static str,
    /// In the base (else in the parent chain): which source holds the pack.
    pub(super) from_base: bool,
}

/// Every stored chunk of the base and the parent chain, by digest (the base's first),
/// except those in `retired` packs (a compaction stores them again).
pub(super) fn known_chunks(opts: &PackOptions, chain_owner: &'static str, retired: &HashSet<OciDigest>) -> HashMap<ChunkDigest, KnownChunk> {
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
pub(super) struct Slots {
    pub(super) list: Vec<Slot>,
    /// A foreign pack's slot.
    pub(super) foreign: HashMap<OciDigest, u32>,
}

impl Slots {
    /// The slot of foreign pack `digest`, added if it has none yet (`size` is asked only
    /// then).
    pub(super) fn foreign(&mut self, digest: &OciDigest, owner: &'static str, from_base: bool, size: impl FnOnce() -> u64) -> u32 {
        *self.foreign.entry(digest.clone()).or_insert_with(|| {
            self.list.push(Slot::Foreign { pack: PackRef { digest: digest.clone(), size: size() }, owner, from_base });
            (self.list.len() - 1) as u32
        })
    }

    /// The index's pack table: slots in order, own packs now named.
    pub(super) fn table(&self, own_packs: &[(OciDigest, u64)]) -> Vec<PackRef> {
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

/// Where every chunk of the source files went ([`Placed`]), with what it builds on: what
/// the index, the roots and the manifest are made from.
pub(super) struct Placement<'a> {
    pub(super) files: &'a [scan::SourceFile],
    pub(super) placed: &'a Placed,
    pub(super) parent_files: &'a HashMap<&'a str, &'a imgfmt::ResolvedFile>,
}

impl Placement<'_> {
    /// The parent's chunk at every position inherited from it, in file order.
    pub(super) fn inherited(&self) -> impl Iterator<Item = &imgfmt::ResolvedChunk> + '_ {
        self.files.iter().zip(self.placed).flat_map(move |(f, slots)| {
            let parent = self.parent_files.get(f.name.as_str());
            slots.iter().enumerate().filter(|(_, s)| s.is_none()).map(move |(c, _)| &parent.expect("an inherited chunk has a parent file").chunks[c])
        })
    }

    /// The chunk index (records, file table, pack table), each file's config entry and
    /// Merkle root. A layer has no record for an inherited chunk; a rebased image records
    /// it where the chain stores it.
    pub(super) fn index(
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

/// Every foreign pack a chunk of the resolved image points into, by digest: (size,
/// owner, from the base): the index's foreign slots, and for a layer (`parent`) the
/// packs of the chunks it inherits.
pub(super) fn foreign_packs(slots: &Slots, parent: Option<(&Related, &Placement)>) -> BTreeMap<OciDigest, (u64, &'static str, bool)> {
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
