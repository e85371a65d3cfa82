//! Verified chunk reads.

use bytes::Bytes;
use imgfmt::compress::{decompress, decompress_ref, Codec, RefHeader};
use imgfmt::{BlobSource, ChunkDigest, ErrorKind, FormatError, HashAlgo, Image, StoredAt};

use crate::hash::{chunk_digest, zero_digest};

/// A chunk's uncompressed bytes, only constructible by checking them against their digest.
/// Cheap to clone: the bytes may be a slice of a larger buffer (a range of a pack).
#[derive(Clone, PartialEq, Eq)]
pub struct VerifiedChunk(Bytes);

impl std::fmt::Debug for VerifiedChunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "VerifiedChunk({} bytes)", self.0.len())
    }
}

impl VerifiedChunk {
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
    /// The bytes as a `Vec` (no copy when this chunk owns its whole buffer alone).
    pub fn into_vec(self) -> Vec<u8> {
        self.0.into()
    }
    /// The bytes as a shared buffer (no copy).
    pub fn into_bytes(self) -> Bytes {
        self.0
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Why a chunk could not be handed out.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum VerifyError {
    /// {file}: chunk {chunk} at offset {offset}: digest mismatch: expected {expected}, got {actual}
    DigestMismatch { file: String, chunk: u64, offset: u64, expected: ChunkDigest, actual: ChunkDigest },
    /// {file}: chunk {chunk} at offset {offset}: stored bytes do not decode: {detail}
    Corrupt { file: String, chunk: u64, offset: u64, detail: String },
    /// {file}: chunk {chunk} at offset {offset}: zero chunk recorded with a non-zero digest {recorded}
    BadZeroRecord { file: String, chunk: u64, offset: u64, recorded: ChunkDigest },
    /// {file}: chunk {chunk} at offset {offset}: reading its pack failed: {source}
    Read { file: String, chunk: u64, offset: u64, source: FormatError },
    /// {file}: chunk {chunk} slice {slice} at offset {offset}: slice CV mismatch: expected {expected}, got {actual}
    SliceMismatch { file: String, chunk: u64, slice: u32, offset: u64, expected: String, actual: String },
    /// {file}: chunk {chunk} at offset {offset}: the outboard's slice CVs do not merge to its digest {digest}
    OutboardMismatch { file: String, chunk: u64, offset: u64, digest: ChunkDigest },
    /// {file}: chunk {chunk} at offset {offset}: no slice CVs (not stored raw, or no outboard entry): read the whole chunk
    NoSlices { file: String, chunk: u64, offset: u64 },
    /// {file}: chunk {chunk} at offset {offset}: slices {start}..{end} asked of a chunk of {count}
    SliceRange { file: String, chunk: u64, offset: u64, start: u32, end: u32, count: u32 },
}

impl VerifyError {
    /// What a caller can do about this error: a read keeps its source's kind (a transient
    /// one is worth retrying; a pack shorter than the index says is an integrity failure
    /// like a digest mismatch); a chunk that asked for slices it cannot have is refused.
    pub fn kind(&self) -> ErrorKind {
        match self {
            VerifyError::Read { source, .. } => source.kind(),
            VerifyError::NoSlices { .. } | VerifyError::SliceRange { .. } => ErrorKind::Refused,
            VerifyError::DigestMismatch { .. }
            | VerifyError::Corrupt { .. }
            | VerifyError::BadZeroRecord { .. }
            | VerifyError::SliceMismatch { .. }
            | VerifyError::OutboardMismatch { .. } => ErrorKind::Integrity,
        }
    }
}

/// Decompress and check stored bytes (taken by value so a raw chunk is checked and
/// handed out without a copy). `Err` carries (detail, actual digest if computed). A
/// `zstd-ref` chunk needs its reference: see [`verify_stored_ref`].
pub fn verify_stored(
    algo: HashAlgo,
    codec: Codec,
    stored: impl Into<Bytes>,
    len: u32,
    expected: &ChunkDigest,
) -> Result<VerifiedChunk, (String, Option<ChunkDigest>)> {
    verify_stored_ref(algo, codec, stored, len, expected, None)
}

/// [`verify_stored`] for any codec: a `zstd-ref` chunk is decoded against `reference`,
/// the verified chunk its header names (see [`ref_header`] and [`read_reference`]).
pub fn verify_stored_ref(
    algo: HashAlgo,
    codec: Codec,
    stored: impl Into<Bytes>,
    len: u32,
    expected: &ChunkDigest,
    reference: Option<&VerifiedChunk>,
) -> Result<VerifiedChunk, (String, Option<ChunkDigest>)> {
    let stored: Bytes = stored.into();
    let raw = match codec {
        Codec::Raw if stored.len() == len as usize => stored,
        Codec::ZstdRef(_) => {
            let reference = reference.ok_or_else(|| ("a zstd-ref chunk read without its reference".to_string(), None))?;
            let (_, frame) = RefHeader::decode(&stored, 1 << imgfmt::MAX_CHUNK_SHIFT).map_err(|e| (e.to_string(), None))?;
            decompress_ref(frame, reference.as_bytes(), len as usize).map_err(|e| (e.to_string(), None))?.into()
        }
        _ => decompress(codec, &stored, len as usize).map_err(|e| (e.to_string(), None))?.into(),
    };
    let d = chunk_digest(algo, &raw);
    if &d == expected {
        Ok(VerifiedChunk(raw))
    } else {
        Err(("digest mismatch".into(), Some(d)))
    }
}

/// The header of a `zstd-ref` chunk's stored bytes: where its reference is stored.
pub fn ref_header(stored: &[u8]) -> Result<RefHeader, FormatError> {
    RefHeader::decode(stored, 1 << imgfmt::MAX_CHUNK_SHIFT).map(|(h, _)| h)
}

/// Read the reference a `zstd-ref` chunk's stored bytes name, from pack `pack` of `src`,
/// and check it against the digest its header records. The reference is itself never a
/// `zstd-ref` chunk (the header's codec is refused otherwise), so this never recurses.
pub fn read_reference(src: &dyn BlobSource, algo: HashAlgo, pack: &imgfmt::OciDigest, stored: &[u8]) -> Result<VerifiedChunk, RefError> {
    let h = ref_header(stored).map_err(|e| RefError::Corrupt(e.to_string()))?;
    let bytes = src.read_range_unverified(pack, h.offset, h.stored_len as usize).map_err(RefError::Read)?;
    reference_of(algo, &h, bytes)
}

/// Check a reference's stored bytes against the header that names it.
pub fn reference_of(algo: HashAlgo, h: &RefHeader, stored: impl Into<Bytes>) -> Result<VerifiedChunk, RefError> {
    verify_stored(algo, h.codec, stored, h.len, &h.digest)
        .map_err(|(detail, _)| RefError::Corrupt(format!("its reference ({} bytes at {}): {detail}", h.stored_len, h.offset)))
}

/// Why a `zstd-ref` chunk's reference could not be had.
#[derive(Debug)]
pub enum RefError {
    /// Reading the reference's pack failed.
    Read(FormatError),
    /// The header or the reference's bytes are not what they must be.
    Corrupt(String),
}

impl RefError {
    /// As the chunk's own error.
    pub fn for_chunk(self, file: &str, chunk: u64, offset: u64) -> VerifyError {
        match self {
            RefError::Read(source) => VerifyError::Read { file: file.to_string(), chunk, offset, source },
            RefError::Corrupt(detail) => VerifyError::Corrupt { file: file.to_string(), chunk, offset, detail },
        }
    }
}

/// Check that a zero chunk's record carries the digest of zeros (no buffer needed).
pub fn check_zero_record(image: &Image, file: usize, chunk: u64) -> Result<(), VerifyError> {
    let f = &image.files[file];
    let c = &f.chunks[chunk as usize];
    if c.digest != zero_digest(image.config().hash, c.len) {
        return Err(VerifyError::BadZeroRecord { file: f.name.clone(), chunk, offset: chunk << image.chunk_shift(), recorded: c.digest });
    }
    Ok(())
}

/// Read chunk `chunk` of file `file` of `image` from `src`, verified. Zero chunks are
/// produced locally (their recorded digest is checked against the zero digest).
pub fn read_chunk(src: &dyn BlobSource, image: &Image, file: usize, chunk: u64) -> Result<VerifiedChunk, VerifyError> {
    let f = &image.files[file];
    let c = &f.chunks[chunk as usize];
    let offset = chunk << image.chunk_shift();
    match c.at {
        StoredAt::Zero => {
            check_zero_record(image, file, chunk)?;
            Ok(VerifiedChunk(vec![0u8; c.len as usize].into()))
        }
        StoredAt::Pack { pack, offset: at, stored_len, .. } => {
            let mut buf = vec![0u8; stored_len as usize];
            src.read_at_unverified(&image.packs[pack as usize].digest, at, &mut buf).map_err(|source| VerifyError::Read {
                file: f.name.clone(),
                chunk,
                offset,
                source,
            })?;
            check_stored_chunk(src, image, file, chunk, buf)
        }
    }
}

/// Check `stored`, the stored bytes of chunk `chunk` of file `file` (read by the caller,
/// e.g. as part of one range request over several chunks), against its record: decoded
/// (a `zstd-ref` chunk's reference is read from `src` and checked first) and hashed. The
/// only way from bytes a caller read to a [`VerifiedChunk`] besides [`read_chunk`].
pub fn check_stored_chunk(src: &dyn BlobSource, image: &Image, file: usize, chunk: u64, stored: Vec<u8>) -> Result<VerifiedChunk, VerifyError> {
    let f = &image.files[file];
    let c = &f.chunks[chunk as usize];
    let algo = image.config().hash;
    let offset = chunk << image.chunk_shift();
    let StoredAt::Pack { stored_len, codec, .. } = c.at else {
        return Err(VerifyError::Corrupt { file: f.name.clone(), chunk, offset, detail: "a zero chunk has no stored bytes".into() });
    };
    if stored.len() != stored_len as usize {
        return Err(VerifyError::Corrupt {
            file: f.name.clone(),
            chunk,
            offset,
            detail: format!("{} stored bytes, the record says {stored_len}", stored.len()),
        });
    }
    let reference = match codec.ref_pack() {
        Some(rp) => Some(read_reference(src, algo, &image.packs[rp as usize].digest, &stored).map_err(|e| e.for_chunk(&f.name, chunk, offset))?),
        None => None,
    };
    verify_stored_ref(algo, codec, stored, c.len, &c.digest, reference.as_ref()).map_err(|(detail, actual)| match actual {
        Some(actual) => VerifyError::DigestMismatch { file: f.name.clone(), chunk, offset, expected: c.digest, actual },
        None => VerifyError::Corrupt { file: f.name.clone(), chunk, offset, detail },
    })
}
