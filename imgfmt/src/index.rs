//! The chunk index blob: a binary table telling, for every chunk of every file, whether
//! it is zero or where its stored bytes are (pack, offset, length, codec) and its digest.
//!
//! ```text
//! offset  size        what
//! 0       64          IndexHeader
//! 64      32 × F      file table   (FileEntry: size, first_record, record_count, reserved)
//! ..      40 × P      pack table   (PackEntry: sha256 of the pack blob, its size)
//! ..      64 × R      records      (Record: chunk, pack, kind, codec, offset, stored_len, digest)
//! ```
//! All integers little-endian. The blob is exactly that long; nothing may follow.
//!
//! A *full* index (flag bit 0 clear) has one record for every chunk of every file, in
//! order. A *layer* index (bit 0 set) has records only for chunks that differ from the
//! parent image; a chunk without a record is the parent's chunk at the same position of
//! the file with the same name. That is what lets an unchanged layer cost a few hundred
//! bytes. Byte-by-byte description and a worked example: `spec/format.md`.

use crate::compress::Codec;
use crate::digest::{ChunkDigest, HashAlgo, OciDigest};
use crate::{FormatError, MAX_CHUNK_SHIFT, MIN_CHUNK_SHIFT};

/// First 8 bytes of every index blob.
pub const INDEX_MAGIC: [u8; 8] = *b"SNAPCIDX";
/// The major version this build writes and reads. A different major is refused.
pub const INDEX_MAJOR: u16 = 1;
/// The minor version this build writes for an index without `zstd-ref` records. Higher
/// minors are read (they only add meaning to reserved bytes, which this version ignores).
pub const INDEX_MINOR: u16 = 0;
/// The minor version of an index with a `zstd-ref` record (codec 3, whose reference pack
/// is the record's bytes 28..32). Readers of minor 0 refuse such a record by its codec.
pub const INDEX_MINOR_REF: u16 = 1;

pub const HEADER_LEN: usize = 64;
pub const FILE_ENTRY_LEN: usize = 32;
pub const PACK_ENTRY_LEN: usize = 40;
pub const RECORD_LEN: usize = 64;

/// At most this many files in one image.
pub const MAX_FILES: u64 = 1 << 16;
/// At most this many packs referenced by one index.
pub const MAX_PACKS: u64 = 1 << 16;
/// An index blob is at most 256 MiB (4 Mi records): decoders refuse to read more, which
/// bounds what a hostile registry can make a client allocate.
pub const MAX_INDEX_BYTES: u64 = 256 << 20;
/// Largest file: 1 PiB.
pub const MAX_FILE_SIZE: u64 = 1 << 50;

/// Flag bit 0: a layer index (absent chunks are inherited from the parent).
pub const FLAG_LAYER: u8 = 1;

/// `pack` value of a zero record.
pub const NO_PACK: u32 = u32::MAX;

/// One file's slice of the record table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexFile {
    /// File size in bytes (the chunk count is `ceil(size / chunk_size)`).
    pub size: u64,
    /// Index of this file's first record; files' records are contiguous and in order.
    pub first_record: u64,
    /// Number of records of this file.
    pub record_count: u64,
}

/// A pack blob that records point into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackRef {
    /// `sha256:` digest of the pack blob.
    pub digest: OciDigest,
    /// Its size in bytes.
    pub size: u64,
}

/// Where a chunk's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordKind {
    /// All zero: never stored, never sent.
    Zero,
    /// `stored_len` bytes at `offset` in pack `pack` (index into the pack table), encoded
    /// with `codec`.
    Stored { pack: u32, offset: u64, stored_len: u32, codec: Codec },
}

/// One chunk's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkRecord {
    /// Chunk number within its file (byte offset = chunk × chunk_size).
    pub chunk: u64,
    pub kind: RecordKind,
    /// Digest of the chunk's uncompressed bytes (for a zero chunk, of that many zeros).
    pub digest: ChunkDigest,
}

// A record decodes to no more than its encoded size: what a client holds for an index is
// bounded by the index blob (spec/format.md §12).
const _: () = assert!(std::mem::size_of::<ChunkRecord>() <= RECORD_LEN);

/// A decoded (structurally valid) chunk index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkIndex {
    pub hash: HashAlgo,
    /// log2 of the chunk size.
    pub chunk_shift: u8,
    /// A layer index: records only what differs from the parent.
    pub layer: bool,
    pub files: Vec<IndexFile>,
    pub packs: Vec<PackRef>,
    pub records: Vec<ChunkRecord>,
}

/// Number of chunks of a file of `size` bytes.
pub fn chunk_count(size: u64, chunk_shift: u8) -> u64 {
    size.div_ceil(1u64 << chunk_shift)
}

/// Length of chunk `chunk` of a file of `size` bytes (the last one may be short).
pub fn chunk_len(size: u64, chunk_shift: u8, chunk: u64) -> u64 {
    let cs = 1u64 << chunk_shift;
    let start = chunk.saturating_mul(cs);
    size.saturating_sub(start).min(cs)
}

pub(crate) fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes(b[o..o + 2].try_into().expect("2 bytes"))
}
pub(crate) fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"))
}
pub(crate) fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"))
}

/// The fixed start every binary blob of the format (index, outboard) shares: 8 magic
/// bytes, then the major version at offset 8, in a header of `header_len` bytes, in a
/// blob of at most `limit` bytes.
pub(crate) struct BinaryBlob {
    /// Names the blob in magic and version errors ("chunk index").
    pub name: &'static str,
    /// Names its size in the too-large error ("index blob size").
    pub size_what: &'static str,
    /// Names its header in the truncation error ("index header").
    pub header_what: &'static str,
    pub magic: [u8; 8],
    pub major: u16,
    pub limit: u64,
    pub header_len: usize,
}

impl BinaryBlob {
    /// Check size, header length, magic and major version, in that order, before a
    /// decoder reads anything else.
    pub(crate) fn check_header(&self, b: &[u8]) -> Result<(), FormatError> {
        if b.len() as u64 > self.limit {
            return Err(FormatError::TooLarge { what: self.size_what, got: b.len() as u64, limit: self.limit });
        }
        if b.len() < self.header_len {
            return Err(FormatError::Truncated { what: self.header_what, got: b.len() as u64, expected: self.header_len as u64 });
        }
        if b[..8] != self.magic {
            return Err(FormatError::BadMagic { what: self.name, found: b[..8].to_vec() });
        }
        let major = u16_at(b, 8);
        if major != self.major {
            return Err(FormatError::UnsupportedVersion { what: self.name, major, supported: self.major });
        }
        Ok(())
    }
}

const INDEX_BLOB: BinaryBlob = BinaryBlob {
    name: "chunk index",
    size_what: "index blob size",
    header_what: "index header",
    magic: INDEX_MAGIC,
    major: INDEX_MAJOR,
    limit: MAX_INDEX_BYTES,
    header_len: HEADER_LEN,
};

impl ChunkIndex {
    pub fn chunk_size(&self) -> u64 {
        1u64 << self.chunk_shift
    }

    /// The records of file `f`.
    pub fn file_records(&self, f: usize) -> &[ChunkRecord] {
        let file = &self.files[f];
        &self.records[file.first_record as usize..(file.first_record + file.record_count) as usize]
    }

    /// Record of chunk `chunk` of file `f`, if this index has one.
    pub fn find(&self, f: usize, chunk: u64) -> Option<&ChunkRecord> {
        let recs = self.file_records(f);
        if !self.layer {
            return recs.get(usize::try_from(chunk).ok()?);
        }
        recs.binary_search_by_key(&chunk, |r| r.chunk).ok().map(|i| &recs[i])
    }

    /// Exact encoded length.
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN + FILE_ENTRY_LEN * self.files.len() + PACK_ENTRY_LEN * self.packs.len() + RECORD_LEN * self.records.len()
    }

    /// Serialize. The caller builds valid indexes; `validate` is the decoder's check and is
    /// also run here in debug builds.
    pub fn encode(&self) -> Vec<u8> {
        debug_assert!(self.validate().is_ok(), "encoding an invalid index: {:?}", self.validate());
        let mut out = Vec::with_capacity(self.encoded_len());
        out.extend_from_slice(&INDEX_MAGIC);
        out.extend_from_slice(&INDEX_MAJOR.to_le_bytes());
        let has_ref = self.records.iter().any(|r| matches!(r.kind, RecordKind::Stored { codec: Codec::ZstdRef(_), .. }));
        out.extend_from_slice(&if has_ref { INDEX_MINOR_REF } else { INDEX_MINOR }.to_le_bytes());
        out.push(self.hash.code());
        out.push(self.chunk_shift);
        out.push(if self.layer { FLAG_LAYER } else { 0 });
        out.push(0);
        out.extend_from_slice(&(self.files.len() as u32).to_le_bytes());
        out.extend_from_slice(&(self.packs.len() as u32).to_le_bytes());
        out.extend_from_slice(&(self.records.len() as u64).to_le_bytes());
        out.resize(HEADER_LEN, 0);
        for f in &self.files {
            out.extend_from_slice(&f.size.to_le_bytes());
            out.extend_from_slice(&f.first_record.to_le_bytes());
            out.extend_from_slice(&f.record_count.to_le_bytes());
            out.extend_from_slice(&0u64.to_le_bytes());
        }
        for p in &self.packs {
            out.extend_from_slice(&p.digest.sha256_bytes().expect("pack digests are sha256"));
            out.extend_from_slice(&p.size.to_le_bytes());
        }
        for r in &self.records {
            out.extend_from_slice(&r.chunk.to_le_bytes());
            let (pack, kind, codec, offset, len, ref_pack) = match r.kind {
                RecordKind::Zero => (NO_PACK, 0u8, 0u8, 0u64, 0u32, 0u32),
                RecordKind::Stored { pack, offset, stored_len, codec } => (pack, 1, codec.code(), offset, stored_len, codec.ref_pack().unwrap_or(0)),
            };
            out.extend_from_slice(&pack.to_le_bytes());
            out.push(kind);
            out.push(codec);
            out.extend_from_slice(&[0, 0]);
            out.extend_from_slice(&offset.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(&ref_pack.to_le_bytes());
            out.extend_from_slice(&r.digest.0);
        }
        debug_assert_eq!(out.len(), self.encoded_len());
        out
    }

    /// Decode and validate an index blob. Allocates the decoded tables (a 64-byte record
    /// decodes to 64 bytes: at most the blob's own size, which callers bound by
    /// [`MAX_INDEX_BYTES`] before reading it) and, while validating, 4 bytes per stored
    /// record.
    pub fn decode(b: &[u8]) -> Result<Self, FormatError> {
        INDEX_BLOB.check_header(b)?;
        let hash = HashAlgo::from_code(b[12]).ok_or_else(|| FormatError::invalid("index hash algorithm", format!("unknown code {}", b[12])))?;
        let chunk_shift = b[13];
        if !(MIN_CHUNK_SHIFT..=MAX_CHUNK_SHIFT).contains(&chunk_shift) {
            return Err(FormatError::invalid("index chunk_shift", format!("{chunk_shift} outside {MIN_CHUNK_SHIFT}..={MAX_CHUNK_SHIFT}")));
        }
        let flags = b[14];
        if flags & !FLAG_LAYER != 0 {
            return Err(FormatError::invalid("index flags", format!("unknown flag bits {flags:#04x}")));
        }
        let file_count = u32_at(b, 16) as u64;
        let pack_count = u32_at(b, 20) as u64;
        let record_count = u64_at(b, 24);
        if file_count > MAX_FILES {
            return Err(FormatError::TooLarge { what: "index file_count", got: file_count, limit: MAX_FILES });
        }
        if pack_count > MAX_PACKS {
            return Err(FormatError::TooLarge { what: "index pack_count", got: pack_count, limit: MAX_PACKS });
        }
        let max_records = MAX_INDEX_BYTES / RECORD_LEN as u64;
        if record_count > max_records {
            return Err(FormatError::TooLarge { what: "index record_count", got: record_count, limit: max_records });
        }
        // Counts are bounded above, so this cannot overflow.
        let expected = HEADER_LEN as u64 + FILE_ENTRY_LEN as u64 * file_count + PACK_ENTRY_LEN as u64 * pack_count + RECORD_LEN as u64 * record_count;
        if b.len() as u64 != expected {
            return Err(FormatError::Truncated { what: "index blob", got: b.len() as u64, expected });
        }

        let mut pos = HEADER_LEN;
        let mut files = Vec::with_capacity(file_count as usize);
        for _ in 0..file_count {
            files.push(IndexFile { size: u64_at(b, pos), first_record: u64_at(b, pos + 8), record_count: u64_at(b, pos + 16) });
            pos += FILE_ENTRY_LEN;
        }
        let mut packs = Vec::with_capacity(pack_count as usize);
        for _ in 0..pack_count {
            let digest = OciDigest::sha256_from_bytes(b[pos..pos + 32].try_into().expect("32 bytes"));
            packs.push(PackRef { digest, size: u64_at(b, pos + 32) });
            pos += PACK_ENTRY_LEN;
        }
        let mut records = Vec::with_capacity(record_count as usize);
        for i in 0..record_count {
            let chunk = u64_at(b, pos);
            let pack = u32_at(b, pos + 8);
            let kind = b[pos + 12];
            let codec_code = b[pos + 13];
            let offset = u64_at(b, pos + 16);
            let stored_len = u32_at(b, pos + 24);
            let digest = ChunkDigest(b[pos + 32..pos + 64].try_into().expect("32 bytes"));
            let kind = match kind {
                0 => {
                    if pack != NO_PACK || offset != 0 || stored_len != 0 || codec_code != 0 {
                        return Err(FormatError::invalid("index record", format!("record {i}: zero chunk with pack/offset/length/codec set")));
                    }
                    RecordKind::Zero
                }
                1 => {
                    let codec = Codec::from_code(codec_code, u32_at(b, pos + 28))
                        .ok_or_else(|| FormatError::invalid("index record", format!("record {i}: unknown codec {codec_code}")))?;
                    RecordKind::Stored { pack, offset, stored_len, codec }
                }
                k => return Err(FormatError::invalid("index record", format!("record {i}: unknown kind {k}"))),
            };
            records.push(ChunkRecord { chunk, kind, digest });
            pos += RECORD_LEN;
        }
        let ix = ChunkIndex { hash, chunk_shift, layer: flags & FLAG_LAYER != 0, files, packs, records };
        ix.validate()?;
        Ok(ix)
    }

    /// Check every structural invariant: file slices contiguous, chunk numbers in range
    /// and strictly increasing (dense for a full index), stored lengths consistent with the
    /// chunk's size and codec, ranges inside their packs, and no partial overlaps between
    /// stored chunks (identical ranges are allowed: that is deduplication).
    pub fn validate(&self) -> Result<(), FormatError> {
        let mut next = 0u64;
        for (fi, f) in self.files.iter().enumerate() {
            if f.size > MAX_FILE_SIZE {
                return Err(FormatError::TooLarge { what: "file size", got: f.size, limit: MAX_FILE_SIZE });
            }
            if f.first_record != next {
                return Err(FormatError::invalid("index file table", format!("file {fi}: first_record {} but previous files end at {next}", f.first_record)));
            }
            let n = chunk_count(f.size, self.chunk_shift);
            if f.record_count > n || (!self.layer && f.record_count != n) {
                return Err(FormatError::invalid("index file table", format!("file {fi}: {} records for {n} chunks", f.record_count)));
            }
            next = next
                .checked_add(f.record_count)
                .filter(|&v| v <= self.records.len() as u64)
                .ok_or_else(|| FormatError::invalid("index file table", format!("file {fi}: records past the end of the table")))?;
            let recs = &self.records[f.first_record as usize..next as usize];
            let mut prev: Option<u64> = None;
            for (j, r) in recs.iter().enumerate() {
                let ri = f.first_record + j as u64;
                let ok_order = if self.layer { prev.is_none_or(|p| r.chunk > p) } else { r.chunk == j as u64 };
                if !ok_order || r.chunk >= n {
                    return Err(FormatError::invalid("index record", format!("record {ri}: file {fi} chunk {} out of order or past its {n} chunks", r.chunk)));
                }
                prev = Some(r.chunk);
                if let RecordKind::Stored { pack, offset, stored_len, codec } = r.kind {
                    let raw = chunk_len(f.size, self.chunk_shift, r.chunk);
                    let len_ok = match codec {
                        Codec::Raw => stored_len as u64 == raw,
                        Codec::ZstdRef(_) => stored_len as usize > crate::compress::REF_HEADER_LEN && (stored_len as u64) < raw,
                        _ => stored_len > 0 && (stored_len as u64) < raw,
                    };
                    if !len_ok {
                        return Err(FormatError::invalid(
                            "index record",
                            format!("record {ri}: stored_len {stored_len} impossible for a {raw}-byte {} chunk", codec.name()),
                        ));
                    }
                    let p = self.packs.get(pack as usize).ok_or_else(|| {
                        FormatError::invalid("index record", format!("record {ri}: pack {pack} not in the {}-entry pack table", self.packs.len()))
                    })?;
                    if let Some(rp) = codec.ref_pack().filter(|&rp| rp as usize >= self.packs.len()) {
                        return Err(FormatError::invalid(
                            "index record",
                            format!("record {ri}: reference pack {rp} not in the {}-entry pack table", self.packs.len()),
                        ));
                    }
                    if offset.checked_add(stored_len as u64).is_none_or(|end| end > p.size) {
                        return Err(FormatError::OutOfBounds { file: fi as u32, record: ri, pack, offset, len: stored_len as u64, pack_size: p.size });
                    }
                }
            }
        }
        if next != self.records.len() as u64 {
            return Err(FormatError::invalid("index file table", format!("files cover {next} records, table has {}", self.records.len())));
        }
        for p in &self.packs {
            if p.digest.algorithm() != "sha256" {
                return Err(FormatError::invalid("index pack table", format!("{} is not sha256", p.digest)));
            }
        }
        // Stored ranges in (pack, offset, length) order, as 4-byte record numbers (the
        // records are at most 4 Mi): sorting copies of the ranges would hold 24 bytes per
        // record more, a third of the decoded index again.
        let range = |i: u32| match self.records[i as usize].kind {
            RecordKind::Stored { pack, offset, stored_len, .. } => (pack, offset, stored_len as u64),
            RecordKind::Zero => unreachable!("only stored records are sorted"),
        };
        let n = u32::try_from(self.records.len()).map_err(|_| FormatError::TooLarge {
            what: "index record_count",
            got: self.records.len() as u64,
            limit: u32::MAX as u64,
        })?;
        let mut stored: Vec<u32> = (0..n).filter(|&i| matches!(self.records[i as usize].kind, RecordKind::Stored { .. })).collect();
        stored.sort_unstable_by_key(|&i| range(i));
        for w in stored.windows(2) {
            let (a, b) = (range(w[0]), range(w[1]));
            if a.0 == b.0 && a != b && a.1 + a.2 > b.1 {
                return Err(FormatError::Overlap { pack: a.0, offset: b.1, len: b.2, other_offset: a.1, other_len: a.2 });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> ChunkIndex {
        let d = |n: u8| ChunkDigest([n; 32]);
        ChunkIndex {
            hash: HashAlgo::Blake3,
            chunk_shift: 16,
            layer: false,
            files: vec![IndexFile { size: 65536 * 2 + 10, first_record: 0, record_count: 3 }, IndexFile { size: 0, first_record: 3, record_count: 0 }],
            packs: vec![PackRef { digest: OciDigest::of(b"pack"), size: 65536 + 10 }],
            records: vec![
                ChunkRecord { chunk: 0, kind: RecordKind::Stored { pack: 0, offset: 0, stored_len: 65536, codec: Codec::Raw }, digest: d(1) },
                ChunkRecord { chunk: 1, kind: RecordKind::Zero, digest: d(2) },
                ChunkRecord { chunk: 2, kind: RecordKind::Stored { pack: 0, offset: 65536, stored_len: 10, codec: Codec::Raw }, digest: d(3) },
            ],
        }
    }

    #[test]
    fn round_trip() {
        let ix = sample();
        let b = ix.encode();
        assert_eq!(b.len(), ix.encoded_len());
        assert_eq!(ChunkIndex::decode(&b).unwrap(), ix);
    }

    #[test]
    fn rejects_bad_magic_version_and_truncation() {
        let b = sample().encode();
        let mut x = b.clone();
        x[0] = b'X';
        assert!(matches!(ChunkIndex::decode(&x), Err(FormatError::BadMagic { .. })));
        let mut x = b.clone();
        x[8] = 2;
        assert!(matches!(ChunkIndex::decode(&x), Err(FormatError::UnsupportedVersion { major: 2, .. })));
        assert!(matches!(ChunkIndex::decode(&b[..b.len() - 1]), Err(FormatError::Truncated { .. })));
        let mut x = b.clone();
        x.push(0);
        assert!(matches!(ChunkIndex::decode(&x), Err(FormatError::Truncated { .. })));
    }

    #[test]
    fn rejects_huge_counts_before_allocating() {
        let mut b = sample().encode();
        b[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(ChunkIndex::decode(&b), Err(FormatError::TooLarge { what: "index record_count", .. })));
        let mut b = sample().encode();
        b[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(ChunkIndex::decode(&b), Err(FormatError::TooLarge { what: "index file_count", .. })));
    }

    #[test]
    fn rejects_out_of_bounds_and_overlap() {
        let mut ix = sample();
        ix.packs[0].size = 65536 + 9;
        assert!(matches!(ix.validate(), Err(FormatError::OutOfBounds { record: 2, .. })));
        let mut ix = sample();
        if let RecordKind::Stored { offset, .. } = &mut ix.records[2].kind {
            *offset = 65530;
        }
        assert!(matches!(ix.validate(), Err(FormatError::Overlap { .. })));
        // Identical ranges are deduplication, not overlap.
        let mut ix = sample();
        ix.files[0].size = 65536 * 3;
        ix.records[2].kind = ix.records[0].kind;
        ix.validate().unwrap();
    }

    #[test]
    fn rejects_bad_lengths_and_order() {
        let mut ix = sample();
        if let RecordKind::Stored { stored_len, .. } = &mut ix.records[2].kind {
            *stored_len = 11;
        }
        assert!(ix.validate().is_err(), "raw chunk longer than the file tail");
        let mut ix = sample();
        ix.records[1].chunk = 2;
        assert!(ix.validate().is_err(), "full index must be dense");
        let mut ix = sample();
        ix.layer = true;
        ix.records.swap(0, 1);
        assert!(ix.validate().is_err(), "layer records must be increasing");
    }

    #[test]
    fn layer_lookup() {
        let mut ix = sample();
        ix.layer = true;
        ix.files[0].record_count = 2;
        ix.files[1].first_record = 2;
        ix.records.remove(1);
        ix.validate().unwrap();
        assert!(ix.find(0, 1).is_none());
        assert_eq!(ix.find(0, 2).unwrap().chunk, 2);
    }
}
