//! Verified slice reads: part of a raw-stored BLAKE3 chunk, fetched as one pack range
//! and checked slice by slice against the chunk's outboard entry.
//!
//! ```text
//! image.slice_cvs(file, chunk)      the entry: digest, length, CVs (unchecked)
//!   └─ merge_slice_cvs(cvs) == digest ?       once per entry (memo in the outboard)
//! read_range_unverified(pack, at + first·S, bytes of slices first..end)
//!   └─ for each slice i: slice_cv(bytes_i, i·S) == cvs[i] ?  else refuse, naming it
//! ```
//! The digest is covered by the index, the config and the image root, so after the entry
//! merged to it, a slice whose CV matches is the chunk's bytes at that place. A slice that
//! does not match is an error naming file, chunk, slice and byte offset; its bytes, and
//! those of every other slice of the same read, are never handed out.

use std::ops::Range;

use bytes::Bytes;
use imgfmt::{BlobSource, Image, StoredAt};

use crate::chunk::VerifyError;
use crate::hash::{merge_slice_cvs, slice_cv};

/// Bytes of one slice of a chunk, only constructible by checking them against an outboard
/// entry that was itself checked against the chunk digest.
#[derive(Clone, PartialEq, Eq)]
pub struct VerifiedSlice {
    bytes: Bytes,
    file: usize,
    chunk: u64,
    slice: u32,
    offset_in_chunk: u64,
}

impl std::fmt::Debug for VerifiedSlice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "VerifiedSlice(file {} chunk {} slice {}: {} bytes at {})", self.file, self.chunk, self.slice, self.bytes.len(), self.offset_in_chunk)
    }
}

impl VerifiedSlice {
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }
    /// The bytes as a shared buffer (no copy: a slice of the range that was fetched).
    pub fn into_bytes(self) -> Bytes {
        self.bytes
    }
    pub fn len(&self) -> usize {
        self.bytes.len()
    }
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
    /// Index of the file in `Image::files`.
    pub fn file(&self) -> usize {
        self.file
    }
    pub fn chunk(&self) -> u64 {
        self.chunk
    }
    /// Slice number within the chunk.
    pub fn slice(&self) -> u32 {
        self.slice
    }
    /// Byte offset of the slice within its chunk.
    pub fn offset_in_chunk(&self) -> u64 {
        self.offset_in_chunk
    }
}

/// Read slices `slices` of chunk `chunk` of file `file` of `image` from `src` with one
/// range request, verified. Needs [`Image::load_outboards`] first; a chunk without a usable
/// entry (not raw, no outboard, no entry) is [`VerifyError::NoSlices`]: fetch it whole.
///
/// An image opened with outboard tables ([`imgfmt::OutboardsAhead::Tables`]) may not have
/// the chunk's CVs yet: they are read beside the slices (two range requests at once, one
/// round trip), and checked like any others. A failed CV read is [`VerifyError::NoSlices`].
pub fn read_slices(src: &dyn BlobSource, image: &Image, file: usize, chunk: u64, slices: Range<u32>) -> Result<Vec<VerifiedSlice>, VerifyError> {
    let f = &image.files[file];
    let chunk_offset = chunk << image.chunk_shift();
    let no_slices = || VerifyError::NoSlices { file: f.name.clone(), chunk, offset: chunk_offset };
    let shape = image.slice_shape(file, chunk).ok_or_else(no_slices)?;
    let count = shape.slice_count();
    if slices.start >= slices.end || slices.end > count {
        return Err(VerifyError::SliceRange { file: f.name.clone(), chunk, offset: chunk_offset, start: slices.start, end: slices.end, count });
    }
    let StoredAt::Pack { pack, offset: at, .. } = f.chunks[chunk as usize].at else { unreachable!("slice_shape answers only for stored raw chunks") };
    let start = shape.slice_range(slices.start).start;
    let end = shape.slice_range(slices.end - 1).end;
    let len = (end - start) as usize;
    let read = |source| VerifyError::Read { file: f.name.clone(), chunk, offset: chunk_offset, source };
    let read_bytes = || src.read_range_unverified(&image.packs[pack as usize].digest, at + start, len).map_err(read);
    let bytes = if image.slice_cvs(file, chunk).is_some() {
        read_bytes()?
    } else {
        let (cvs, bytes) = std::thread::scope(|s| {
            let cvs = s.spawn(|| image.read_slice_cvs(src, file, chunk));
            let bytes = read_bytes();
            (cvs.join(), bytes)
        });
        if !matches!(cvs, Ok(Ok(true))) {
            return Err(no_slices());
        }
        bytes?
    };
    let cvs = checked_entry(image, file, chunk)?;
    // The whole outboards may have been put in place since the shape was read; a blob
    // whose entry disagrees with its table's gets no slices.
    if cvs.shape() != shape {
        return Err(no_slices());
    }
    if bytes.len() != len {
        return Err(read(imgfmt::FormatError::Truncated { what: "slice range", got: bytes.len() as u64, expected: len as u64 }));
    }
    slices
        .map(|i| {
            let r = cvs.slice_range(i);
            check_one(image, file, chunk, &cvs, i, bytes.slice((r.start - start) as usize..(r.end - start) as usize))
        })
        .collect()
}

/// Check `bytes`, read from anywhere (a restore's working-set blob), as slice `slice` of
/// chunk `chunk` of file `file`: the chunk's outboard entry must merge to its digest, and
/// the bytes must have the entry's length and CV for that slice. Needs
/// [`Image::load_outboards`] first, as [`read_slices`].
pub fn check_slice(image: &Image, file: usize, chunk: u64, slice: u32, bytes: Bytes) -> Result<VerifiedSlice, VerifyError> {
    let cvs = checked_entry(image, file, chunk)?;
    let count = cvs.slice_count();
    if slice >= count {
        let f = &image.files[file];
        return Err(VerifyError::SliceRange { file: f.name.clone(), chunk, offset: chunk << image.chunk_shift(), start: slice, end: slice + 1, count });
    }
    check_one(image, file, chunk, &cvs, slice, bytes)
}

/// The outboard entry of a chunk, once it merged to the chunk's digest.
fn checked_entry(image: &Image, file: usize, chunk: u64) -> Result<imgfmt::SliceCvs<'_>, VerifyError> {
    let f = &image.files[file];
    let chunk_offset = chunk << image.chunk_shift();
    let Some(cvs) = image.slice_cvs(file, chunk) else {
        return Err(VerifyError::NoSlices { file: f.name.clone(), chunk, offset: chunk_offset });
    };
    // The entry must merge to the digest the index records (and the roots cover) before a
    // single CV of it is trusted. Once per entry: the memo lives as long as the outboard.
    let digest = f.chunks[chunk as usize].digest;
    if !cvs.merged_or(|| merge_slice_cvs(cvs.cvs) == digest) {
        return Err(VerifyError::OutboardMismatch { file: f.name.clone(), chunk, offset: chunk_offset, digest });
    }
    Ok(cvs)
}

/// Slice `i` of a checked entry: `bytes` must be its length and match its CV.
fn check_one(image: &Image, file: usize, chunk: u64, cvs: &imgfmt::SliceCvs<'_>, i: u32, bytes: Bytes) -> Result<VerifiedSlice, VerifyError> {
    let r = cvs.slice_range(i);
    let chunk_offset = chunk << image.chunk_shift();
    let name = || image.files[file].name.clone();
    if bytes.len() as u64 != r.end - r.start {
        let source = imgfmt::FormatError::Truncated { what: "slice", got: bytes.len() as u64, expected: r.end - r.start };
        return Err(VerifyError::Read { file: name(), chunk, offset: chunk_offset + r.start, source });
    }
    let actual = slice_cv(&bytes, r.start);
    if actual != cvs.cvs[i as usize] {
        return Err(VerifyError::SliceMismatch {
            file: name(),
            chunk,
            slice: i,
            offset: chunk_offset + r.start,
            expected: hex::encode(cvs.cvs[i as usize]),
            actual: hex::encode(actual),
        });
    }
    Ok(VerifiedSlice { bytes, file, chunk, slice: i, offset_in_chunk: r.start })
}
