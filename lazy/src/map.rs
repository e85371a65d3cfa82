//! Address arithmetic: fault address -> region -> memory-file offset -> chunk, the span of
//! guest memory one install covers, and the ranges the guest removed.
//!
//! An install covers one *unit* of the memory file: a chunk, or a whole page when pages are
//! larger than chunks (huge pages), clipped to the region. Region offsets and sizes are
//! page multiples and chunks are at least 64 KiB, so every span is page-aligned.

use std::collections::BTreeMap;

use super::handshake::Region;

/// The regions of one connection, over a memory file of `file_size` bytes chunked at
/// `1 << chunk_shift`.
#[derive(Debug, Clone)]
pub struct MemoryMap {
    /// Sorted by `base`, non-overlapping (checked by the handshake).
    pub regions: Vec<Region>,
    pub file_size: u64,
    pub chunk_shift: u8,
}

/// A piece of guest memory to fill from the memory file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub region: usize,
    /// Index of the unit in the file (file offset / unit size).
    pub unit: u64,
    /// Host address range `[host, host + len)`.
    pub host: u64,
    pub len: u64,
    /// Memory-file offset of `host`.
    pub file_offset: u64,
}

impl Span {
    /// Chunks of the memory file whose bytes this span needs.
    pub fn chunks(&self, chunk_shift: u8) -> std::ops::Range<u64> {
        (self.file_offset >> chunk_shift)..((self.file_offset + self.len - 1) >> chunk_shift) + 1
    }
}

impl MemoryMap {
    pub fn chunk_size(&self) -> u64 {
        1 << self.chunk_shift
    }

    /// Install granularity of a region: a chunk, or a (huge) page when that is larger.
    pub fn unit_size(&self, region: usize) -> u64 {
        self.chunk_size().max(self.regions[region].page_size)
    }

    /// The region holding `addr` and the memory-file offset of `addr`.
    pub fn locate(&self, addr: u64) -> Option<(usize, u64)> {
        let i = self.regions.partition_point(|r| r.base <= addr).checked_sub(1)?;
        let r = &self.regions[i];
        r.contains(addr).then(|| (i, r.offset + (addr - r.base)))
    }

    /// The span of region `region` that unit `unit` of the file covers, if any.
    pub fn span(&self, region: usize, unit: u64) -> Option<Span> {
        let r = &self.regions[region];
        let us = self.unit_size(region);
        let start = unit.checked_mul(us)?.max(r.offset);
        let end = unit.checked_add(1)?.checked_mul(us)?.min(r.offset + r.size).min(self.file_size);
        (start < end).then(|| Span { region, unit, host: r.base + (start - r.offset), len: end - start, file_offset: start })
    }

    /// The span serving a fault at `addr`.
    pub fn span_at(&self, addr: u64) -> Option<Span> {
        let (region, off) = self.locate(addr)?;
        self.span(region, off / self.unit_size(region))
    }

    /// Every span that needs file chunk `chunk` (usually one; a chunk split by a region
    /// boundary appears in each region that maps part of it).
    pub fn spans_of_chunk(&self, chunk: u64) -> Vec<Span> {
        let cs = self.chunk_size();
        let (c0, c1) = (chunk * cs, (chunk + 1) * cs);
        let mut out = Vec::new();
        for (i, r) in self.regions.iter().enumerate() {
            if r.offset < c1 && c0 < r.offset + r.size {
                let us = self.unit_size(i);
                if let Some(s) = self.span(i, c0.max(r.offset) / us) {
                    if out.last() != Some(&s) {
                        out.push(s);
                    }
                }
            }
        }
        out
    }

    /// Host address ranges of region `region` that lie in units, as `(unit, host start,
    /// host end)`, for the units that `[start, end)` touches (used to forget installed
    /// units when the guest removes memory).
    pub fn units_touching(&self, start: u64, end: u64) -> Vec<(usize, u64)> {
        let mut out = Vec::new();
        for (i, r) in self.regions.iter().enumerate() {
            let (s, e) = (start.max(r.base), end.min(r.end()));
            if s >= e {
                continue;
            }
            let us = self.unit_size(i);
            let (u0, u1) = ((r.offset + (s - r.base)) / us, (r.offset + (e - r.base) - 1) / us);
            out.extend((u0..=u1).map(|u| (i, u)));
        }
        out
    }
}

/// Host address ranges the guest gave back (`UFFD_EVENT_REMOVE`): their content is no
/// longer the snapshot's, so later faults there get zeros. Kept merged and sorted.
#[derive(Debug, Default, Clone)]
pub struct RemovedRanges {
    /// start -> end, disjoint and non-adjacent.
    map: BTreeMap<u64, u64>,
    events: u64,
}

impl RemovedRanges {
    pub fn insert(&mut self, mut start: u64, mut end: u64) {
        if start >= end {
            return;
        }
        self.events += 1;
        // Absorb every range that overlaps or touches [start, end).
        if let Some((&s, &e)) = self.map.range(..=start).next_back() {
            if e >= start {
                start = s;
                end = end.max(e);
            }
        }
        let absorbed: Vec<(u64, u64)> = self.map.range(start..=end).map(|(&s, &e)| (s, e)).collect();
        for (s, e) in absorbed {
            self.map.remove(&s);
            end = end.max(e);
        }
        self.map.insert(start, end);
    }

    pub fn contains(&self, addr: u64) -> bool {
        self.map.range(..=addr).next_back().is_some_and(|(_, &e)| addr < e)
    }

    /// Number of remove events applied.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// Bytes covered.
    pub fn bytes(&self) -> u64 {
        self.map.iter().map(|(s, e)| e - s).sum()
    }

    /// `[start, end)` split into (removed?, from, to) pieces, in order.
    pub fn split(&self, start: u64, end: u64) -> Vec<(bool, u64, u64)> {
        let mut out = Vec::new();
        let mut at = start;
        let first = self.map.range(..=start).next_back().map(|(&s, _)| s).unwrap_or(start);
        for (&s, &e) in self.map.range(first..end) {
            if e <= at {
                continue;
            }
            if s > at {
                out.push((false, at, s.min(end)));
            }
            let (a, b) = (s.max(at), e.min(end));
            if a < b {
                out.push((true, a, b));
            }
            at = b;
            if at >= end {
                break;
            }
        }
        if at < end {
            out.push((false, at, end));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const KIB: u64 = 1 << 10;

    fn map() -> MemoryMap {
        // Region 0: file [0, 3.5 MiB) at 0x1000_0000; a gap in the address space; region 1:
        // file [3.5 MiB, 6 MiB) at 0x4000_0000, i.e. it starts mid-chunk.
        MemoryMap {
            regions: vec![
                Region { base: 0x1000_0000, size: 3 * MIB + 512 * KIB, offset: 0, page_size: 4096 },
                Region { base: 0x4000_0000, size: 2 * MIB + 512 * KIB, offset: 3 * MIB + 512 * KIB, page_size: 4096 },
            ],
            file_size: 6 * MIB,
            chunk_shift: 20,
        }
    }

    #[test]
    fn fault_address_to_chunk_span() {
        let m = map();
        assert_eq!(m.locate(0x1000_0000 + 5), Some((0, 5)));
        assert_eq!(m.locate(0x0fff_ffff), None);
        // In the gap between the regions.
        assert_eq!(m.locate(0x1000_0000 + 3 * MIB + 512 * KIB), None);
        assert_eq!(m.locate(0x3fff_ffff), None);
        assert_eq!(m.locate(0x4000_0000), Some((1, 3 * MIB + 512 * KIB)));
        assert_eq!(m.locate(0x4000_0000 + 2 * MIB + 512 * KIB), None);

        // A whole chunk inside region 0.
        let s = m.span_at(0x1000_0000 + MIB + 4096).unwrap();
        assert_eq!(s, Span { region: 0, unit: 1, host: 0x1000_0000 + MIB, len: MIB, file_offset: MIB });
        // Chunk 3 is split by the region boundary: region 0 holds its first half ...
        let s = m.span_at(0x1000_0000 + 3 * MIB).unwrap();
        assert_eq!(s, Span { region: 0, unit: 3, host: 0x1000_0000 + 3 * MIB, len: 512 * KIB, file_offset: 3 * MIB });
        // ... region 1, which starts mid-chunk, its second half.
        let s = m.span_at(0x4000_0000 + 4096).unwrap();
        assert_eq!(s, Span { region: 1, unit: 3, host: 0x4000_0000, len: 512 * KIB, file_offset: 3 * MIB + 512 * KIB });
        assert_eq!(s.chunks(20), 3..4);
        let s = m.span_at(0x4000_0000 + 512 * KIB).unwrap();
        assert_eq!(s, Span { region: 1, unit: 4, host: 0x4000_0000 + 512 * KIB, len: MIB, file_offset: 4 * MIB });
        assert_eq!(m.spans_of_chunk(3).len(), 2);
        assert_eq!(m.spans_of_chunk(0).len(), 1);
        assert!(m.spans_of_chunk(6).is_empty());
    }

    #[test]
    fn huge_pages_span_several_chunks() {
        let mut m = map();
        m.regions = vec![Region { base: 0x20_0000 * 8, size: 4 * MIB, offset: 2 * MIB, page_size: 2 * MIB }];
        let s = m.span_at(0x20_0000 * 8 + 3 * MIB).unwrap();
        assert_eq!(s, Span { region: 0, unit: 2, host: 0x20_0000 * 8 + 2 * MIB, len: 2 * MIB, file_offset: 4 * MIB });
        assert_eq!(s.chunks(20), 4..6);
    }

    /// A 2 MiB-page region over 1 MiB chunks, starting 2 MiB into the file: every address
    /// of a huge page (first byte, middle, last byte) maps to the same aligned span, which
    /// needs the page's two chunks; both chunks name that one span.
    #[test]
    fn a_fault_anywhere_in_a_huge_page_is_served_by_the_whole_aligned_page() {
        const HUGE: u64 = 2 * MIB;
        let base = 0x7f00_0040_0000;
        let m = MemoryMap { regions: vec![Region { base, size: 6 * MIB, offset: 2 * MIB, page_size: HUGE }], file_size: 8 * MIB, chunk_shift: 20 };
        assert_eq!(m.unit_size(0), HUGE);
        for addr in [base + 2 * MIB, base + 3 * MIB + 12345, base + 4 * MIB - 1] {
            let s = m.span_at(addr).unwrap();
            assert_eq!(s, Span { region: 0, unit: 2, host: base + 2 * MIB, len: HUGE, file_offset: 4 * MIB }, "{addr:#x}");
            assert_eq!(s.host % HUGE, 0);
            assert_eq!(s.chunks(20), 4..6);
        }
        assert_eq!(m.spans_of_chunk(4), m.spans_of_chunk(5));
        assert_eq!(m.spans_of_chunk(4).len(), 1);
        // The first huge page of the region is unit 1 of the file (file offset 2 MiB).
        assert_eq!(m.span_at(base).unwrap().unit, 1);
        assert!(m.span_at(base + 6 * MIB).is_none());
        // A remove of one 4 KiB page inside a huge page forgets that whole page, only it.
        assert_eq!(m.units_touching(base + 3 * MIB, base + 3 * MIB + 4096), vec![(0, 2)]);
        assert_eq!(m.units_touching(base + 2 * MIB - 4096, base + 2 * MIB + 4096), vec![(0, 1), (0, 2)]);
    }

    /// Chunks larger than huge pages (4 MiB): the install unit is the chunk, two huge
    /// pages, and it stays huge-page aligned; chunks smaller (64 KiB): a huge page needs 32.
    #[test]
    fn huge_page_units_against_larger_and_smaller_chunks() {
        const HUGE: u64 = 2 * MIB;
        let base = 0x4000_0000;
        let big = MemoryMap { regions: vec![Region { base, size: 8 * MIB, offset: 0, page_size: HUGE }], file_size: 8 * MIB, chunk_shift: 22 };
        let s = big.span_at(base + 5 * MIB).unwrap();
        assert_eq!(s, Span { region: 0, unit: 1, host: base + 4 * MIB, len: 4 * MIB, file_offset: 4 * MIB });
        assert_eq!((s.host % HUGE, s.len % HUGE), (0, 0));
        let small = MemoryMap { chunk_shift: 16, ..big };
        let s = small.span_at(base + 5 * MIB).unwrap();
        assert_eq!(s, Span { region: 0, unit: 2, host: base + 4 * MIB, len: HUGE, file_offset: 4 * MIB });
        assert_eq!(s.chunks(16), 64..96);
        // A huge-page region beside a 4 KiB one: each keeps its own unit.
        let mixed = MemoryMap {
            regions: vec![
                Region { base, size: 4 * MIB, offset: 0, page_size: HUGE },
                Region { base: base + 64 * MIB, size: 4 * MIB, offset: 4 * MIB, page_size: 4096 },
            ],
            file_size: 8 * MIB,
            chunk_shift: 20,
        };
        assert_eq!(mixed.span_at(base + MIB + 1).unwrap().len, HUGE);
        assert_eq!(mixed.span_at(base + 64 * MIB + MIB + 1).unwrap(), Span { region: 1, unit: 5, host: base + 65 * MIB, len: MIB, file_offset: 5 * MIB });
    }

    #[test]
    fn units_touched_by_a_remove() {
        let m = map();
        let u = m.units_touching(0x1000_0000 + MIB - 4096, 0x1000_0000 + MIB + 4096);
        assert_eq!(u, vec![(0, 0), (0, 1)]);
        assert!(m.units_touching(0x2000_0000, 0x3000_0000).is_empty());
    }

    #[test]
    fn removed_ranges_merge_and_split() {
        let mut r = RemovedRanges::default();
        r.insert(0x1000, 0x3000);
        r.insert(0x5000, 0x6000);
        assert!(r.contains(0x1000) && r.contains(0x2fff) && !r.contains(0x3000) && !r.contains(0xfff));
        assert_eq!(
            r.split(0, 0x8000),
            vec![(false, 0, 0x1000), (true, 0x1000, 0x3000), (false, 0x3000, 0x5000), (true, 0x5000, 0x6000), (false, 0x6000, 0x8000)]
        );
        assert_eq!(r.split(0x2000, 0x5800), vec![(true, 0x2000, 0x3000), (false, 0x3000, 0x5000), (true, 0x5000, 0x5800)]);
        // Touching and overlapping ranges merge into one.
        r.insert(0x3000, 0x5000);
        assert_eq!(r.split(0, 0x8000), vec![(false, 0, 0x1000), (true, 0x1000, 0x6000), (false, 0x6000, 0x8000)]);
        r.insert(0x800, 0x7000);
        assert_eq!(r.bytes(), 0x7000 - 0x800);
        assert_eq!(r.events(), 4);
        r.insert(0x9000, 0x9000);
        assert_eq!(r.events(), 4, "an empty range is not an event");
        assert_eq!(r.split(0x7000, 0x8000), vec![(false, 0x7000, 0x8000)]);
    }
}
