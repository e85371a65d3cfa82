//! The outboard of slice CVs: kept while hashing, inherited from the chain, shared with the base.

use std::collections::HashMap;

use imgfmt::compress::Codec;
use imgfmt::outboard::{slice_count, Cv, Outboard, ENTRY_LEN, HEADER_LEN as OUTBOARD_HEADER_LEN, MAX_OUTBOARD_BYTES};
use imgfmt::{media, BlobSource, ChunkDigest, ChunkIndex, Descriptor, HashAlgo, Image, OciLayout, RecordKind};

use super::layers::ensure_blob;
use super::options::{PackError, PackOptions, PackReport};

/// Slice CVs of the raw chunks placed so far, by digest, kept under the outboard's size
/// limit by doubling the slice size when they would pass it.
pub(super) struct SliceCvs {
    /// Slice shift the CVs are computed at (as hashed).
    pub(super) hashed_shift: u8,
    /// Slice shift they are kept at (`hashed_shift` unless coarsened).
    pub(super) shift: u8,
    pub(super) chunk_shift: u8,
    pub(super) by_digest: HashMap<ChunkDigest, (u32, Vec<Cv>)>,
    /// Encoded size of an outboard of what `by_digest` holds.
    pub(super) bytes: u64,
    /// Most bytes that outboard may have ([`MAX_OUTBOARD_BYTES`]; smaller in tests).
    pub(super) limit: u64,
}

impl SliceCvs {
    pub(super) fn new(chunk_shift: u8, shift: u8) -> Self {
        SliceCvs { hashed_shift: shift, shift, chunk_shift, by_digest: HashMap::new(), bytes: OUTBOARD_HEADER_LEN as u64, limit: MAX_OUTBOARD_BYTES }
    }

    pub(super) fn entry_bytes(n_cvs: usize) -> u64 {
        (ENTRY_LEN + 32 * n_cvs) as u64
    }

    /// Keep `cvs` (computed at `hashed_shift`) for the raw chunk `digest` of `len` bytes.
    pub(super) fn insert(&mut self, digest: ChunkDigest, len: u32, mut cvs: Vec<Cv>) {
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
    pub(super) fn coarsen(&mut self) {
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

/// The base's outboard, read to share: the slice CVs of the base's chunks this image
/// shares stay there (the manifest lists it) instead of being copied into every clone's
/// outboard. `None` without a BLAKE3 base of the same slice size, or when it cannot be
/// read (then its CVs are copied).
pub(super) fn shared_base_outboard(opts: &PackOptions) -> Option<(Vec<u8>, Outboard)> {
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

/// The base's outboard as a layer of this image, stored in `dest`: when this image
/// leaves slices of the base's chunks to it (`used`), or when the parent did (the chunks
/// it inherits, or records again when rebased).
pub(super) fn base_outboard_layer(
    dest: &OciLayout,
    opts: &PackOptions,
    used: bool,
    base_outboard: Option<&(Vec<u8>, Outboard)>,
) -> Result<Option<Descriptor>, PackError> {
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
pub(super) fn own_outboard_layer(dest: &OciLayout, ob: &Outboard, report: &mut PackReport) -> Result<Descriptor, PackError> {
    let bytes = ob.encode();
    let d = dest.put_blob(&bytes)?;
    report.slice_size = 1 << ob.slice_shift;
    report.outboard_entries = ob.entries.len() as u64;
    report.outboard_bytes = bytes.len() as u64;
    Ok(Descriptor::new(media::OUTBOARD, d, bytes.len() as u64).with_annotation(media::ANN_OWNER, "self"))
}

/// The outboard of the packed `index` from the slice CVs kept while hashing; a rebased
/// index lists the chain's chunks this packer did not hash: their CVs come from the
/// outboards the chain already stored (an entry is trusted by a reader only once its
/// CVs merge to the digest, §8.2).
pub(super) fn outboard_of_pack(
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
pub(super) fn outboard_of(index: &ChunkIndex, mut slices: SliceCvs, complete: bool, base_outboard: Option<&Outboard>) -> Result<Option<Outboard>, PackError> {
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
pub(super) fn inherit_slice_cvs(index: &ChunkIndex, parent: &Image, source: &dyn BlobSource, slices: &mut SliceCvs) -> Result<(), PackError> {
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
