//! Which part of a chunk a fault's fetch asks for: a slice, a readahead of slices, or the
//! whole chunk (spec/lazy.md "Slice faults"). A policy over one connection's misses,
//! consulted by the fault loop; it fetches and installs nothing itself.
//!
//! ```text
//! first miss in a chunk      -> its slice (+ pending faults' slices within COALESCE_GAP)
//! second miss right past it  -> READAHEAD_SLICES
//! any other miss             -> the whole chunk
//! a fetch in flight covers it -> join that fetch
//! ```

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use imgfmt::Image;

use crate::map::MemoryMap;

/// The first sequential miss in a chunk fetches this many slices (64 KiB at 4 KiB slices);
/// the one after that fetches the whole chunk.
const READAHEAD_SLICES: u32 = 16;
/// Pending faults on slices at most this far from a fetch's range join it (one request
/// for a few more KiB beats a round trip per fault).
const COALESCE_GAP: u32 = 8;

/// Per connection, on the fault thread: how each chunk's misses went, for deciding between
/// a slice fetch and the whole chunk.
#[derive(Default)]
pub(crate) struct Slicing {
    /// Slice fetches in flight, by number: their chunk and range.
    jobs: HashMap<u64, (u64, Range<u32>)>,
    next: u64,
    /// Per chunk: slice fetches made, and where the last one ended.
    misses: HashMap<u64, (u32, u32)>,
    /// Chunks with no verifiable slices (no entry, or one that does not merge): whole.
    whole: HashSet<u64>,
}

impl Slicing {
    /// Whether a fault at `addr` (in chunk `c`, which no whole fetch is bringing) needs only
    /// part of its chunk, and which: the slice fetch in flight that covers its slice
    /// (`(number, None)`: no new fetch), or a new one (`(number, Some(range))`). `None`:
    /// fetch the whole chunk (no verifiable slices, huge pages, or a chunk that missed
    /// before). `pending`: addresses of the faults waiting to be looked at, which ride along
    /// when near.
    ///
    /// A chunk's first miss fetches its slice, with any pending faults on slices near it
    /// in the same range. A second miss right past that range (the guest walking through
    /// memory) fetches [`READAHEAD_SLICES`]; any other second miss, and any third, fetches
    /// the whole chunk: past that point round trips cost more than the bytes they save, and
    /// the whole chunk goes into memory and the chunk cache.
    pub fn plan(
        &mut self,
        map: &MemoryMap,
        image: &Image,
        file: usize,
        addr: u64,
        c: u64,
        pending: impl Iterator<Item = u64>,
    ) -> Option<(u64, Option<Range<u32>>)> {
        if self.whole.contains(&c) {
            return None;
        }
        let (region, _) = map.locate(addr)?;
        // The shape only: the CVs may not be read yet (an image opened with outboard
        // tables reads them beside the slices).
        let shape = image.slice_shape(file, c)?;
        // A huge page needs more than a slice, and a unit larger than the chunk needs more
        // than the chunk: both go whole.
        if map.regions[region].page_size > shape.slice_size() || map.unit_size(region) != map.chunk_size() {
            return None;
        }
        let count = shape.slice_count();
        let shift = shape.slice_shift;
        let slice_of = |addr: u64| -> Option<u32> {
            let (_, off) = map.locate(addr)?;
            (off >> map.chunk_shift == c).then(|| ((off - (c << map.chunk_shift)) >> shift) as u32)
        };
        let s = slice_of(addr)?;
        if let Some((k, _)) = self.jobs.iter().find(|(_, (jc, r))| *jc == c && r.contains(&s)) {
            return Some((*k, None));
        }
        let (misses, end) = self.misses.get(&c).copied().unwrap_or((0, 0));
        let mut range = match misses {
            0 => s..s + 1,
            1 if s >= end && s < end + 2 => s..(s + READAHEAD_SLICES).min(count),
            _ => return None,
        };
        // Pending faults on this chunk near the range ride along.
        let mut near: Vec<u32> = pending.filter_map(slice_of).collect();
        near.sort_unstable();
        loop {
            let before = range.clone();
            for &t in &near {
                if t < range.start && t + COALESCE_GAP >= range.start {
                    range.start = t;
                } else if t >= range.end && t < range.end + COALESCE_GAP {
                    range.end = t + 1;
                }
            }
            if range == before {
                break;
            }
        }
        self.misses.insert(c, (misses + 1, range.end));
        let id = self.next;
        self.next += 1;
        self.jobs.insert(id, (c, range.clone()));
        Some((id, Some(range)))
    }

    /// Slice fetch `id` is over.
    pub fn finished(&mut self, id: u64) {
        self.jobs.remove(&id);
    }

    /// Chunk `c` has no verifiable slices: its misses fetch it whole from now on.
    pub fn whole(&mut self, c: u64) {
        self.whole.insert(c);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handshake::Region;

    /// The slice policy alone, over the 64 KiB-chunk sample (4 KiB slices): a first miss
    /// fetches its slice with pending neighbours, a fault inside a fetch in flight joins
    /// it, a second miss right past the first reads ahead, any other miss goes whole.
    #[test]
    fn a_chunks_misses_fetch_a_slice_then_a_readahead_then_the_whole_chunk() {
        let (_d, mem, image, layout) = crate::fetch::tests::sample_image(6);
        let image = crate::tests::with_outboards(image, &layout);
        let file = image.file("vm.mem").unwrap().0;
        let base = 0x7000_0000u64;
        let map =
            MemoryMap { regions: vec![Region { base, size: mem.len() as u64, offset: 0, page_size: 4096 }], file_size: mem.len() as u64, chunk_shift: 16 };
        let at = |c: u64, slice: u64| base + (c << 16) + slice * 4096;
        let mut s = Slicing::default();
        // First miss in chunk 0 at slice 1, with pending faults at slices 3 and 12 of it
        // (3 is within reach, 12 is not) and one in chunk 2 (another chunk).
        let (id, range) = s.plan(&map, &image, file, at(0, 1), 0, [at(0, 3), at(0, 12), at(2, 6)].into_iter()).unwrap();
        assert_eq!(range, Some(1..4));
        // A fault inside that range joins the fetch in flight.
        assert_eq!(s.plan(&map, &image, file, at(0, 2), 0, std::iter::empty()), Some((id, None)));
        s.finished(id);
        // The next miss right past it reads ahead 16 slices (clipped to the chunk).
        let (_, range) = s.plan(&map, &image, file, at(0, 5), 0, std::iter::empty()).unwrap();
        assert_eq!(range, Some(5..16));
        // A third miss: the whole chunk.
        assert_eq!(s.plan(&map, &image, file, at(0, 1), 0, std::iter::empty()), None);
        // A second miss elsewhere in a chunk: whole too.
        assert!(s.plan(&map, &image, file, at(2, 1), 2, std::iter::empty()).is_some());
        assert_eq!(s.plan(&map, &image, file, at(2, 9), 2, std::iter::empty()), None);
        // A chunk declared whole, and a zero chunk (no outboard entry): whole.
        s.whole(3);
        assert_eq!(s.plan(&map, &image, file, at(3, 0), 3, std::iter::empty()), None);
        assert_eq!(s.plan(&map, &image, file, at(1, 0), 1, std::iter::empty()), None);
        // Huge pages need more than a slice.
        let huge = MemoryMap { regions: vec![Region { base, size: mem.len() as u64, offset: 0, page_size: 2 << 20 }], ..map.clone() };
        assert_eq!(Slicing::default().plan(&huge, &image, file, at(5, 0), 5, std::iter::empty()), None);
    }
}
