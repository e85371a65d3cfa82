//! Compaction of the parent chain's packs (spec/format.md §10) and the image's fragmentation.

use std::collections::{HashMap, HashSet};

use imgfmt::{media, ChunkIndex, Image, OciDigest, RecordKind, StoredAt};

use super::options::PackOptions;
use super::placement::Placement;

/// A compaction of the parent chain's packs (spec/format.md §10, "Compaction"): the packs
/// whose chunks this image stores again instead of pointing into them.
pub(super) struct Compaction {
    pub(super) retired: HashSet<OciDigest>,
}

impl Compaction {
    /// The packs to retire, or `None` when the image does not pass the bound. Measured on
    /// the parent as resolved (what this image inherits), plus one pack of its own: for
    /// each of the chain's packs (a base's excepted: sharing those is the point of a
    /// base), the bytes of the distinct stored ranges it is read for.
    pub(super) fn plan(opts: &PackOptions) -> Option<Compaction> {
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
pub(super) fn chain_pack_bytes(parent: &Image, opts: &PackOptions) -> Vec<(OciDigest, u64)> {
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
pub(super) fn excess_packs(placement: &Placement, opts: &PackOptions, index: &ChunkIndex) -> usize {
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
