//! The outboard blob: for each raw-stored BLAKE3 chunk longer than one slice, the BLAKE3
//! chaining values (CVs) of its slices, so a reader can fetch and verify one slice of a
//! chunk (a page fault's worth) instead of the whole chunk.
//!
//! ```text
//! offset           size       what
//! 0                32         OutboardHeader
//! 32               48 × E     entries   (digest, chunk_len, reserved, first_cv), sorted by digest, unique
//! 32 + 48E         32 × C     CVs       entry e's are cvs[first_cv .. first_cv + ceil(chunk_len / slice)]
//! 32 + 48E + 32C   —          end: the blob is exactly this long, at most 256 MiB
//! ```
//! All integers little-endian. Entries' CV runs are contiguous, in entry order, so each
//! `first_cv` is checkable arithmetic (the sum of the runs before it).
//!
//! A slice is `2^slice_shift` bytes (4 KiB by default) of the chunk, at a multiple of that
//! size; the last slice may be short. Because a slice is a power of two of BLAKE3's 1 KiB
//! chunks, every slice is a complete subtree of the chunk's BLAKE3 tree, and the CVs merge
//! back into the chunk digest (`verify::hash::merge_slice_cvs`). An entry is only trusted
//! once its CVs merged to its digest, and the digest is covered by the index, the config
//! and the image root; so this blob needs no trust of its own (a forged one can only fail
//! closed). This crate only decodes it; the hashing is `verify`'s. See `spec/format.md` §8a.

use std::sync::OnceLock;

use crate::digest::{ChunkDigest, HashAlgo};
use crate::index::{u32_at, u64_at, BinaryBlob};
use crate::{FormatError, MAX_CHUNK_SHIFT, MIN_CHUNK_SHIFT};

/// First 8 bytes of every outboard blob.
pub const OUTBOARD_MAGIC: [u8; 8] = *b"SNAPCOBO";
/// The major version this build writes and reads. A different major is refused.
pub const OUTBOARD_MAJOR: u16 = 1;
/// The minor version this build writes. Higher minors are read (they may only give
/// meaning to reserved bytes, which this version ignores).
pub const OUTBOARD_MINOR: u16 = 0;

pub const HEADER_LEN: usize = 32;

const OUTBOARD_BLOB: BinaryBlob = BinaryBlob {
    name: "outboard",
    size_what: "outboard blob size",
    header_what: "outboard header",
    magic: OUTBOARD_MAGIC,
    major: OUTBOARD_MAJOR,
    limit: MAX_OUTBOARD_BYTES,
    header_len: HEADER_LEN,
};
pub const ENTRY_LEN: usize = 48;
pub const CV_LEN: usize = 32;

/// An outboard blob is at most 256 MiB (8 Mi CVs: 32 GiB of raw chunks at 4 KiB slices).
/// Bounds what a hostile registry can make a client allocate; a packer that would go over
/// it uses larger slices instead.
pub const MAX_OUTBOARD_BYTES: u64 = 256 << 20;
/// Smallest slice: 4 KiB, the page size a fault asks for (and 4 BLAKE3 chunks).
pub const MIN_SLICE_SHIFT: u8 = 12;
/// Default slice: 4 KiB (see spec/format.md, Discussion).
pub const DEFAULT_SLICE_SHIFT: u8 = 12;

/// One 32-byte BLAKE3 chaining value.
pub type Cv = [u8; 32];

/// Number of slices of a chunk of `len` bytes.
pub fn slice_count(len: u64, slice_shift: u8) -> u64 {
    len.div_ceil(1u64 << slice_shift)
}

/// One chunk's entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutboardEntry {
    /// The chunk's digest (BLAKE3 of its uncompressed bytes): the key.
    pub digest: ChunkDigest,
    /// Its length: more than one slice, at most one chunk.
    pub chunk_len: u32,
    /// Index of its first CV in the CV table.
    pub first_cv: u64,
}

/// A decoded, structurally valid outboard blob.
#[derive(Debug, Clone)]
pub struct Outboard {
    /// log2 of the image's chunk size (must match the image's).
    pub chunk_shift: u8,
    /// log2 of the slice size: `MIN_SLICE_SHIFT ..= chunk_shift - 1`.
    pub slice_shift: u8,
    /// Sorted by digest, unique.
    pub entries: Vec<OutboardEntry>,
    pub cvs: Vec<Cv>,
    /// Per entry: whether its CVs merged to its digest, once `verify` checked. A memo for
    /// the `verify` crate only (this crate never hashes, so never sets it); not part of
    /// the value (`==` and `encode` ignore it).
    merged: Vec<OnceLock<bool>>,
}

impl PartialEq for Outboard {
    fn eq(&self, o: &Self) -> bool {
        (self.chunk_shift, self.slice_shift, &self.entries, &self.cvs) == (o.chunk_shift, o.slice_shift, &o.entries, &o.cvs)
    }
}
impl Eq for Outboard {}

/// The slice CVs of one chunk, as an outboard records them: **not yet checked** against the
/// chunk digest (`verify` does that, once per entry, before it trusts a slice).
#[derive(Debug, Clone, Copy)]
pub struct SliceCvs<'a> {
    pub digest: ChunkDigest,
    pub chunk_len: u32,
    pub slice_shift: u8,
    /// `ceil(chunk_len / slice)` CVs, slice 0 first.
    pub cvs: &'a [Cv],
    memo: &'a OnceLock<bool>,
}

/// How a chunk with an outboard entry divides into slices: what a reader plans a slice
/// fetch by before it has the entry's CVs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SliceShape {
    pub chunk_len: u32,
    pub slice_shift: u8,
}

impl SliceShape {
    pub fn slice_size(&self) -> u64 {
        1u64 << self.slice_shift
    }
    pub fn slice_count(&self) -> u32 {
        slice_count(u64::from(self.chunk_len), self.slice_shift) as u32
    }
    /// Byte range of slice `i` within the chunk (the last may be short).
    pub fn slice_range(&self, i: u32) -> std::ops::Range<u64> {
        let s = self.slice_size();
        let start = u64::from(i) * s;
        start..(start + s).min(u64::from(self.chunk_len))
    }
}

impl OutboardTable {
    /// Entry `i`'s slices.
    pub fn shape(&self, i: usize) -> SliceShape {
        SliceShape { chunk_len: self.entries[i].chunk_len, slice_shift: self.slice_shift }
    }
}

impl SliceCvs<'_> {
    pub fn shape(&self) -> SliceShape {
        SliceShape { chunk_len: self.chunk_len, slice_shift: self.slice_shift }
    }
    pub fn slice_size(&self) -> u64 {
        1u64 << self.slice_shift
    }
    pub fn slice_count(&self) -> u32 {
        self.cvs.len() as u32
    }
    /// Byte range of slice `i` within the chunk (the last may be short).
    pub fn slice_range(&self, i: u32) -> std::ops::Range<u64> {
        let s = self.slice_size();
        let start = u64::from(i) * s;
        start..(start + s).min(u64::from(self.chunk_len))
    }
    /// The result of `check` (does this entry merge to its digest?), computed at most once
    /// per entry for the life of the decoded outboard. Only `verify` should call this, with
    /// the real check.
    pub fn merged_or(&self, check: impl FnOnce() -> bool) -> bool {
        *self.memo.get_or_init(check)
    }
}

fn check_shifts(chunk_shift: u8, slice_shift: u8) -> Result<(), FormatError> {
    if !(MIN_CHUNK_SHIFT..=MAX_CHUNK_SHIFT).contains(&chunk_shift) {
        return Err(FormatError::invalid("outboard chunk_shift", format!("{chunk_shift} outside {MIN_CHUNK_SHIFT}..={MAX_CHUNK_SHIFT}")));
    }
    if !(MIN_SLICE_SHIFT..chunk_shift).contains(&slice_shift) {
        return Err(FormatError::invalid("outboard slice_shift", format!("{slice_shift} outside {MIN_SLICE_SHIFT}..={}", chunk_shift - 1)));
    }
    Ok(())
}

/// The entries' invariants ([`Outboard::validate`]) against a CV table of `cv_count` CVs.
fn check_entries(chunk_shift: u8, slice_shift: u8, entries: &[OutboardEntry], cv_count: u64) -> Result<(), FormatError> {
    check_shifts(chunk_shift, slice_shift)?;
    let slice = 1u64 << slice_shift;
    let chunk = 1u64 << chunk_shift;
    let mut next = 0u64;
    for (i, e) in entries.iter().enumerate() {
        if i > 0 && entries[i - 1].digest >= e.digest {
            return Err(FormatError::invalid("outboard entries", format!("entry {i} ({}) is not after entry {} in digest order", e.digest, i - 1)));
        }
        let len = u64::from(e.chunk_len);
        if len <= slice || len > chunk {
            return Err(FormatError::invalid(
                "outboard entry",
                format!("entry {i} ({}): chunk_len {len} must be over one slice ({slice}) and at most one chunk ({chunk})", e.digest),
            ));
        }
        if e.first_cv != next {
            return Err(FormatError::invalid(
                "outboard entry",
                format!("entry {i} ({}): first_cv {} but the entries before it end at {next}", e.digest, e.first_cv),
            ));
        }
        // At most 2^12 slices per chunk and 2^22 entries: no overflow.
        next += slice_count(len, slice_shift);
    }
    if next != cv_count {
        return Err(FormatError::invalid("outboard", format!("entries cover {next} CVs, the table has {cv_count}")));
    }
    Ok(())
}

/// The header of an outboard blob `blob_len` bytes long, checked as [`Outboard::decode`]
/// checks it: `(chunk_shift, slice_shift, entry_count, cv_count)`.
fn decode_header(b: &[u8], blob_len: u64) -> Result<(u8, u8, u64, u64), FormatError> {
    OUTBOARD_BLOB.check_header(&b[..b.len().min(HEADER_LEN)])?;
    // Only BLAKE3 is a tree whose slices' CVs merge into the chunk digest.
    if b[12] != HashAlgo::Blake3.code() {
        return Err(FormatError::invalid("outboard hash algorithm", format!("code {}: only 1 (BLAKE3) has slice CVs", b[12])));
    }
    let (chunk_shift, slice_shift) = (b[13], b[14]);
    check_shifts(chunk_shift, slice_shift)?;
    let entry_count = u64::from(u32_at(b, 16));
    let cv_count = u64_at(b, 24);
    let max_entries = MAX_OUTBOARD_BYTES / ENTRY_LEN as u64;
    if entry_count > max_entries {
        return Err(FormatError::TooLarge { what: "outboard entry_count", got: entry_count, limit: max_entries });
    }
    let max_cvs = MAX_OUTBOARD_BYTES / CV_LEN as u64;
    if cv_count > max_cvs {
        return Err(FormatError::TooLarge { what: "outboard cv_count", got: cv_count, limit: max_cvs });
    }
    // Both counts are bounded above, so this cannot overflow.
    let expected = HEADER_LEN as u64 + ENTRY_LEN as u64 * entry_count + CV_LEN as u64 * cv_count;
    if blob_len != expected {
        return Err(FormatError::Truncated { what: "outboard blob", got: blob_len, expected });
    }
    Ok((chunk_shift, slice_shift, entry_count, cv_count))
}

/// Entries `0 .. count` of an outboard whose bytes `b` hold at least its header and them.
fn decode_entries(b: &[u8], count: u64) -> Vec<OutboardEntry> {
    b[HEADER_LEN..HEADER_LEN + ENTRY_LEN * count as usize]
        .chunks_exact(ENTRY_LEN)
        .map(|e| OutboardEntry { digest: ChunkDigest(e[..32].try_into().expect("32 bytes")), chunk_len: u32_at(e, 32), first_cv: u64_at(e, 40) })
        .collect()
}

/// An outboard's header and entries without its CVs, decoded from the start of the blob,
/// with each entry's CVs read on their own when a reader first needs them
/// ([`OutboardTable::cv_range`], [`OutboardTable::set_cvs`]). The entries are 48 bytes a
/// chunk against the CVs' 32 per slice (8 KiB for a 1 MiB chunk at 4 KiB slices), so a
/// restore that faults in a few chunks reads a few KiB of CVs instead of the whole blob.
/// Nothing here is trusted: as with [`Outboard`], an entry's CVs are used only once they
/// merged to the chunk's digest (`verify`), so a forged table, like a forged blob, can
/// only make readers fall back to whole chunks.
#[derive(Debug)]
pub struct OutboardTable {
    pub chunk_shift: u8,
    pub slice_shift: u8,
    /// Sorted by digest, unique, checked as [`Outboard::validate`] checks them.
    pub entries: Vec<OutboardEntry>,
    /// Where the CV table starts in the blob.
    cvs_at: u64,
    /// Per entry: its CVs once read.
    read: Vec<OnceLock<ReadCvs>>,
}

/// An entry's CVs as read, and whether they merged (`verify`'s memo, as [`Outboard`]'s).
#[derive(Debug)]
struct ReadCvs {
    cvs: Box<[Cv]>,
    merged: OnceLock<bool>,
}

impl OutboardTable {
    /// Bytes of the blob to read for its header and up to `entries` entries.
    pub fn prefix_len(entries: u64) -> u64 {
        HEADER_LEN as u64 + ENTRY_LEN as u64 * entries
    }

    /// Bytes of the blob its header and all its entries take, as the header at the start
    /// of `prefix` counts them (unchecked); `None` when `prefix` is shorter than a header.
    pub fn table_len(prefix: &[u8]) -> Option<u64> {
        (prefix.len() >= HEADER_LEN).then(|| Self::prefix_len(u64::from(u32_at(prefix, 16))))
    }

    /// Decode the table from `prefix`, the first bytes of an outboard blob of `blob_len`
    /// bytes (its size as the manifest lists it). The header is checked as
    /// [`Outboard::decode`] checks it (its counts must give exactly `blob_len`), then the
    /// entries. A prefix too short for every entry is [`FormatError::Truncated`].
    pub fn decode_prefix(prefix: &[u8], blob_len: u64) -> Result<Self, FormatError> {
        if blob_len > MAX_OUTBOARD_BYTES {
            return Err(FormatError::TooLarge { what: "outboard blob size", got: blob_len, limit: MAX_OUTBOARD_BYTES });
        }
        if prefix.len() < HEADER_LEN {
            return Err(FormatError::Truncated { what: "outboard header", got: prefix.len() as u64, expected: HEADER_LEN as u64 });
        }
        let (chunk_shift, slice_shift, entry_count, cv_count) = decode_header(prefix, blob_len)?;
        let need = Self::prefix_len(entry_count);
        if (prefix.len() as u64) < need {
            return Err(FormatError::Truncated { what: "outboard entries", got: prefix.len() as u64, expected: need });
        }
        let entries = decode_entries(prefix, entry_count);
        check_entries(chunk_shift, slice_shift, &entries, cv_count)?;
        let read = (0..entries.len()).map(|_| OnceLock::new()).collect();
        Ok(OutboardTable { chunk_shift, slice_shift, entries, cvs_at: need, read })
    }

    /// The entry of a chunk of digest `digest` and `len` bytes, by number.
    pub fn find_chunk(&self, digest: &ChunkDigest, len: u32) -> Option<usize> {
        let i = self.entries.binary_search_by(|e| e.digest.cmp(digest)).ok()?;
        (self.entries[i].chunk_len == len).then_some(i)
    }

    /// Entry `i`'s CVs in the blob: `(offset, length)`.
    pub fn cv_range(&self, i: usize) -> (u64, usize) {
        let e = &self.entries[i];
        let n = slice_count(u64::from(e.chunk_len), self.slice_shift);
        (self.cvs_at + e.first_cv * CV_LEN as u64, (n * CV_LEN as u64) as usize)
    }

    /// Keep `bytes`, read from [`OutboardTable::cv_range`], as entry `i`'s CVs (not
    /// checked: `verify` merges them to the digest before trusting one). The first CVs kept
    /// stay; bytes of the wrong length are refused.
    pub fn set_cvs(&self, i: usize, bytes: &[u8]) -> Result<(), FormatError> {
        let (_, len) = self.cv_range(i);
        if bytes.len() != len {
            return Err(FormatError::Truncated { what: "outboard entry CVs", got: bytes.len() as u64, expected: len as u64 });
        }
        let cvs: Box<[Cv]> = bytes.chunks_exact(CV_LEN).map(|c| c.try_into().expect("32 bytes")).collect();
        let _ = self.read[i].set(ReadCvs { cvs, merged: OnceLock::new() });
        Ok(())
    }

    /// Entry `i` with its CVs, once they were read.
    pub fn entry(&self, i: usize) -> Option<SliceCvs<'_>> {
        let e = &self.entries[i];
        let r = self.read[i].get()?;
        Some(SliceCvs { digest: e.digest, chunk_len: e.chunk_len, slice_shift: self.slice_shift, cvs: &r.cvs, memo: &r.merged })
    }
}

impl Outboard {
    /// Build an outboard from `(digest, chunk_len, cvs)` per chunk, in any order, each
    /// digest at most once (the caller keys its map by digest). Checks what the decoder
    /// checks, so what this returns encodes to a blob the decoder accepts.
    pub fn from_entries(chunk_shift: u8, slice_shift: u8, mut chunks: Vec<(ChunkDigest, u32, Vec<Cv>)>) -> Result<Self, FormatError> {
        check_shifts(chunk_shift, slice_shift)?;
        chunks.sort_unstable_by_key(|c| c.0);
        let n_cvs: u64 = chunks.iter().map(|c| c.2.len() as u64).sum();
        let len = HEADER_LEN as u64 + ENTRY_LEN as u64 * chunks.len() as u64 + CV_LEN as u64 * n_cvs;
        if len > MAX_OUTBOARD_BYTES {
            return Err(FormatError::TooLarge { what: "outboard blob size", got: len, limit: MAX_OUTBOARD_BYTES });
        }
        let mut entries = Vec::with_capacity(chunks.len());
        let mut cvs = Vec::with_capacity(n_cvs as usize);
        for (digest, chunk_len, c) in chunks {
            entries.push(OutboardEntry { digest, chunk_len, first_cv: cvs.len() as u64 });
            cvs.extend(c);
        }
        let merged = (0..entries.len()).map(|_| OnceLock::new()).collect();
        let ob = Outboard { chunk_shift, slice_shift, entries, cvs, merged };
        ob.validate()?;
        Ok(ob)
    }

    /// Exact encoded length.
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN + ENTRY_LEN * self.entries.len() + CV_LEN * self.cvs.len()
    }

    pub fn encode(&self) -> Vec<u8> {
        debug_assert!(self.validate().is_ok(), "encoding an invalid outboard: {:?}", self.validate());
        let mut out = Vec::with_capacity(self.encoded_len());
        out.extend_from_slice(&OUTBOARD_MAGIC);
        out.extend_from_slice(&OUTBOARD_MAJOR.to_le_bytes());
        out.extend_from_slice(&OUTBOARD_MINOR.to_le_bytes());
        out.push(HashAlgo::Blake3.code());
        out.push(self.chunk_shift);
        out.push(self.slice_shift);
        out.push(0);
        out.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&(self.cvs.len() as u64).to_le_bytes());
        debug_assert_eq!(out.len(), HEADER_LEN);
        for e in &self.entries {
            out.extend_from_slice(&e.digest.0);
            out.extend_from_slice(&e.chunk_len.to_le_bytes());
            out.extend_from_slice(&0u32.to_le_bytes());
            out.extend_from_slice(&e.first_cv.to_le_bytes());
        }
        for cv in &self.cvs {
            out.extend_from_slice(cv);
        }
        debug_assert_eq!(out.len(), self.encoded_len());
        out
    }

    /// Decode and validate an outboard blob. Every count is bounded and the exact length
    /// checked before anything is allocated, so this never allocates more than the blob's
    /// own size (which callers bound by [`MAX_OUTBOARD_BYTES`] before reading it).
    pub fn decode(b: &[u8]) -> Result<Self, FormatError> {
        OUTBOARD_BLOB.check_header(b)?;
        let (chunk_shift, slice_shift, entry_count, _) = decode_header(b, b.len() as u64)?;
        let entries = decode_entries(b, entry_count);
        let pos = HEADER_LEN + ENTRY_LEN * entries.len();
        let cvs = b[pos..].chunks_exact(CV_LEN).map(|c| c.try_into().expect("32 bytes")).collect();
        let merged = (0..entries.len()).map(|_| OnceLock::new()).collect();
        let ob = Outboard { chunk_shift, slice_shift, entries, cvs, merged };
        ob.validate()?;
        Ok(ob)
    }

    /// Check every structural invariant: shifts in range, entries sorted by digest and
    /// unique, each chunk longer than one slice and at most one chunk, each `first_cv` the
    /// sum of the runs before it, and the runs covering exactly the CV table.
    pub fn validate(&self) -> Result<(), FormatError> {
        check_entries(self.chunk_shift, self.slice_shift, &self.entries, self.cvs.len() as u64)
    }

    /// The entry for chunk digest `digest`, if this outboard has one.
    pub fn find(&self, digest: &ChunkDigest) -> Option<SliceCvs<'_>> {
        let i = self.entries.binary_search_by(|e| e.digest.cmp(digest)).ok()?;
        Some(self.entry(i))
    }

    /// The entry for a chunk of digest `digest` and `len` bytes, if this outboard has one
    /// (an entry of that digest with another length covers some other chunk).
    pub fn find_chunk(&self, digest: &ChunkDigest, len: u32) -> Option<SliceCvs<'_>> {
        self.find(digest).filter(|e| e.chunk_len == len)
    }

    /// Entry `i` with its CVs.
    pub fn entry(&self, i: usize) -> SliceCvs<'_> {
        let e = &self.entries[i];
        let n = slice_count(u64::from(e.chunk_len), self.slice_shift) as usize;
        let first = e.first_cv as usize;
        SliceCvs { digest: e.digest, chunk_len: e.chunk_len, slice_shift: self.slice_shift, cvs: &self.cvs[first..first + n], memo: &self.merged[i] }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Outboard {
        // A 64 KiB-chunk image with 4 KiB slices: a full chunk (16 CVs) and a 10 KiB tail (3).
        let cv = |n: u8| [n; 32];
        Outboard::from_entries(
            16,
            12,
            vec![(ChunkDigest([9; 32]), 65536, (0..16).map(cv).collect()), (ChunkDigest([3; 32]), 10240, vec![cv(100), cv(101), cv(102)])],
        )
        .unwrap()
    }

    /// The table decoded from the blob's start has the blob's entries; each entry's CVs,
    /// read from its range, are the blob's; a prefix short of the entries, a size the
    /// header does not give, and CVs of the wrong length are refused.
    #[test]
    fn a_table_from_the_blobs_start_reads_each_entrys_cvs_by_range() {
        let ob = sample();
        let b = ob.encode();
        let need = OutboardTable::prefix_len(2) as usize;
        let t = OutboardTable::decode_prefix(&b[..need], b.len() as u64).unwrap();
        assert_eq!(t.entries, ob.entries);
        for i in 0..2 {
            assert!(t.entry(i).is_none(), "no CVs before they are read");
            let (at, len) = t.cv_range(i);
            assert!(t.set_cvs(i, &b[at as usize..at as usize + len - 1]).is_err());
            t.set_cvs(i, &b[at as usize..at as usize + len]).unwrap();
            assert_eq!(t.entry(i).unwrap().cvs, ob.entry(i).cvs);
            assert_eq!(t.shape(i), ob.entry(i).shape());
        }
        assert_eq!(t.find_chunk(&ChunkDigest([9; 32]), 65536), Some(1));
        assert_eq!(t.find_chunk(&ChunkDigest([9; 32]), 4096), None);
        let short = OutboardTable::decode_prefix(&b[..need - 1], b.len() as u64).unwrap_err();
        assert!(matches!(short, FormatError::Truncated { what: "outboard entries", .. }), "{short}");
        assert!(OutboardTable::decode_prefix(&b, b.len() as u64 + 32).is_err());
        assert!(OutboardTable::decode_prefix(&b[..20], b.len() as u64).is_err());
        assert!(OutboardTable::decode_prefix(&b, MAX_OUTBOARD_BYTES + 1).is_err());
    }

    #[test]
    fn round_trip_and_lookup() {
        let ob = sample();
        let b = ob.encode();
        assert_eq!(b.len(), 32 + 2 * 48 + 19 * 32);
        let back = Outboard::decode(&b).unwrap();
        assert_eq!(back, ob);
        assert_eq!(back.encode(), b);
        // Sorted by digest: [3;32] first.
        assert_eq!(back.entries[0].digest, ChunkDigest([3; 32]));
        assert_eq!(back.entries[1].first_cv, 3);
        let s = back.find(&ChunkDigest([9; 32])).unwrap();
        assert_eq!((s.chunk_len, s.slice_count()), (65536, 16));
        assert_eq!(s.cvs[15], [15; 32]);
        let t = back.find(&ChunkDigest([3; 32])).unwrap();
        assert_eq!(t.slice_range(2), 8192..10240);
        assert!(back.find(&ChunkDigest([4; 32])).is_none());
        let empty = Outboard::from_entries(20, 12, vec![]).unwrap();
        assert_eq!(Outboard::decode(&empty.encode()).unwrap(), empty);
    }

    #[test]
    fn memo_is_per_entry_and_not_part_of_the_value() {
        let ob = sample();
        let s = ob.find(&ChunkDigest([9; 32])).unwrap();
        assert!(s.merged_or(|| true));
        assert!(s.merged_or(|| panic!("computed once")));
        assert!(!ob.find(&ChunkDigest([3; 32])).unwrap().merged_or(|| false));
        assert_eq!(ob, sample());
    }

    fn set(b: &mut [u8], at: usize, v: &[u8]) {
        b[at..at + v.len()].copy_from_slice(v);
    }

    #[test]
    fn rejects_every_bad_header_field() {
        let b = sample().encode();
        let bad = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut x = b.clone();
            f(&mut x);
            Outboard::decode(&x).unwrap_err()
        };
        assert!(matches!(bad(&|x| x[0] = b'X'), FormatError::BadMagic { .. }));
        assert!(matches!(bad(&|x| x[8] = 2), FormatError::UnsupportedVersion { major: 2, .. }));
        assert!(matches!(bad(&|x| x[12] = 2), FormatError::Invalid { what: "outboard hash algorithm", .. }));
        assert!(matches!(bad(&|x| x[13] = 15), FormatError::Invalid { what: "outboard chunk_shift", .. }));
        assert!(matches!(bad(&|x| x[13] = 25), FormatError::Invalid { what: "outboard chunk_shift", .. }));
        assert!(matches!(bad(&|x| x[14] = 11), FormatError::Invalid { what: "outboard slice_shift", .. }));
        assert!(matches!(bad(&|x| x[14] = 16), FormatError::Invalid { what: "outboard slice_shift", .. }));
        assert!(matches!(bad(&|x| set(x, 16, &u32::MAX.to_le_bytes())), FormatError::TooLarge { what: "outboard entry_count", .. }));
        assert!(matches!(bad(&|x| set(x, 24, &u64::MAX.to_le_bytes())), FormatError::TooLarge { what: "outboard cv_count", .. }));
        // Counts within their limits but not matching the length.
        assert!(matches!(bad(&|x| set(x, 16, &3u32.to_le_bytes())), FormatError::Truncated { .. }));
        assert!(matches!(bad(&|x| set(x, 24, &20u64.to_le_bytes())), FormatError::Truncated { .. }));
        assert!(matches!(bad(&|x| x.truncate(x.len() - 1)), FormatError::Truncated { .. }));
        assert!(matches!(bad(&|x| x.push(0)), FormatError::Truncated { .. }));
        assert!(matches!(Outboard::decode(&b[..31]), Err(FormatError::Truncated { what: "outboard header", .. })));
        let huge = vec![0u8; MAX_OUTBOARD_BYTES as usize + 1];
        assert!(matches!(Outboard::decode(&huge), Err(FormatError::TooLarge { what: "outboard blob size", .. })));
        // Reserved bytes are ignored (a later minor may give them meaning).
        let mut x = b.clone();
        x[10] = 7;
        x[15] = 1;
        set(&mut x, 20, &[1, 2, 3, 4]);
        set(&mut x, 32 + 36, &[5; 4]);
        assert_eq!(Outboard::decode(&x).unwrap(), sample());
    }

    #[test]
    fn rejects_every_bad_entry() {
        let b = sample().encode();
        let e1 = HEADER_LEN + ENTRY_LEN;
        let bad = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut x = b.clone();
            f(&mut x);
            Outboard::decode(&x).unwrap_err().to_string()
        };
        // Order and uniqueness.
        assert!(bad(&|x| x.copy_within(HEADER_LEN..HEADER_LEN + 32, e1)).contains("digest order"), "duplicate digest");
        assert!(bad(&|x| x[e1] = 0).contains("digest order"), "unsorted");
        // Lengths: one slice or less, more than a chunk, and a length that needs another CV.
        assert!(bad(&|x| set(x, HEADER_LEN + 32, &4096u32.to_le_bytes())).contains("over one slice"));
        assert!(bad(&|x| set(x, e1 + 32, &65537u32.to_le_bytes())).contains("at most one chunk"));
        assert!(bad(&|x| set(x, HEADER_LEN + 32, &12289u32.to_le_bytes())).contains("first_cv 3 but the entries before it end at 4"));
        assert!(bad(&|x| set(x, HEADER_LEN + 32, &8192u32.to_le_bytes())).contains("first_cv 3 but the entries before it end at 2"));
        // first_cv arithmetic.
        assert!(bad(&|x| set(x, e1 + 40, &2u64.to_le_bytes())).contains("first_cv 2"));
        assert!(bad(&|x| set(x, HEADER_LEN + 40, &1u64.to_le_bytes())).contains("first_cv 1"));
        // The runs must cover the CV table exactly: one CV more in the table than the runs.
        let mut x = b.clone();
        set(&mut x, 24, &20u64.to_le_bytes());
        x.extend_from_slice(&[0; 32]);
        assert!(Outboard::decode(&x).unwrap_err().to_string().contains("entries cover 19 CVs, the table has 20"));
    }

    #[test]
    fn builder_refuses_what_the_decoder_would() {
        assert!(Outboard::from_entries(16, 16, vec![]).is_err(), "slice as large as a chunk");
        assert!(Outboard::from_entries(16, 12, vec![(ChunkDigest([1; 32]), 4096, vec![[0; 32]])]).is_err(), "one slice");
        assert!(Outboard::from_entries(16, 12, vec![(ChunkDigest([1; 32]), 8192, vec![[0; 32]])]).is_err(), "too few CVs");
        let twice = vec![(ChunkDigest([1; 32]), 8192, vec![[0; 32]; 2]), (ChunkDigest([1; 32]), 8192, vec![[0; 32]; 2])];
        assert!(Outboard::from_entries(16, 12, twice).is_err(), "duplicate digest");
    }
}
