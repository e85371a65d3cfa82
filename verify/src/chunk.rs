//! Verified chunk reads.

use bytes::Bytes;
use imgfmt::compress::{decompress, Codec};
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
    /// Whether this is the storage saying no (I/O, missing blob), rather than content
    /// that failed its check.
    pub fn is_read_error(&self) -> bool {
        matches!(self, VerifyError::Read { .. })
    }

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
/// handed out without a copy). `Err` carries (detail, actual digest if computed).
pub fn verify_stored(
    algo: HashAlgo,
    codec: Codec,
    stored: impl Into<Bytes>,
    len: u32,
    expected: &ChunkDigest,
) -> Result<VerifiedChunk, (String, Option<ChunkDigest>)> {
    let stored: Bytes = stored.into();
    let raw = match codec {
        Codec::Raw if stored.len() == len as usize => stored,
        _ => decompress(codec, &stored, len as usize).map_err(|e| (e.to_string(), None))?.into(),
    };
    let d = chunk_digest(algo, &raw);
    if &d == expected {
        Ok(VerifiedChunk(raw))
    } else {
        Err(("digest mismatch".into(), Some(d)))
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
    let algo = image.config().hash;
    let offset = chunk << image.chunk_shift();
    match c.at {
        StoredAt::Zero => {
            check_zero_record(image, file, chunk)?;
            Ok(VerifiedChunk(vec![0u8; c.len as usize].into()))
        }
        StoredAt::Pack { pack, offset: at, stored_len, codec } => {
            let mut buf = vec![0u8; stored_len as usize];
            src.read_at_unverified(&image.packs[pack as usize].digest, at, &mut buf).map_err(|source| VerifyError::Read {
                file: f.name.clone(),
                chunk,
                offset,
                source,
            })?;
            verify_stored(algo, codec, buf, c.len, &c.digest).map_err(|(detail, actual)| match actual {
                Some(actual) => VerifyError::DigestMismatch { file: f.name.clone(), chunk, offset, expected: c.digest, actual },
                None => VerifyError::Corrupt { file: f.name.clone(), chunk, offset, detail },
            })
        }
    }
}
