//! Part of a cached chunk, read without the rest: for a reader that checks the part
//! itself against the chunk's outboard slices (`verify::check_slice`), so a 4 KiB read of
//! a cached 1 MiB chunk reads and hashes 4 KiB, not the chunk.
//!
//! The bytes are unverified, and the name of the one method that hands them out says so.
//! A part that then fails its check is no proof the entry is damaged (the outboard may be
//! the wrong one): the caller reads the whole chunk with [`ChunkCache::get`], which
//! re-hashes it and drops a damaged entry.

use std::io::ErrorKind;
use std::ops::Range;
use std::os::unix::fs::FileExt;

use imgfmt::{ChunkDigest, HashAlgo};

use super::{io, CacheError, ChunkCache, Found};

impl ChunkCache {
    /// Bytes `range` of the chunk `digest` (of `len` bytes) as the cache holds it, in a copy
    /// or in the file a reference names, NOT verified. `None`: no entry, a copy of another
    /// length, a reference that may not be followed or names a file too short, or a range
    /// outside the chunk. Nothing is deleted or counted here: [`ChunkCache::get`] judges
    /// entries.
    pub fn read_range_unverified(&self, algo: HashAlgo, digest: &ChunkDigest, len: u32, range: Range<u64>) -> Result<Option<Vec<u8>>, CacheError> {
        if range.start >= range.end || range.end > u64::from(len) {
            return Ok(None);
        }
        let mut buf = vec![0u8; (range.end - range.start) as usize];
        Ok(match self.locate(algo, digest, len)? {
            Found::Copy { file, path, .. } => read_exact_at(&file, &mut buf, range.start).map_err(io(&path))?.then_some(buf),
            Found::Ref { file, offset, .. } => read_exact_at(&file, &mut buf, offset + range.start).unwrap_or(false).then_some(buf),
            Found::Missing | Found::Damaged(_) | Found::Stale(_) => None,
        })
    }
}

/// Fill `buf` from `at`: `false` if the file ends first.
fn read_exact_at(f: &std::fs::File, buf: &mut [u8], at: u64) -> std::io::Result<bool> {
    match f.read_exact_at(buf, at) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use verify::VerifiedChunk;

    fn chunk(bytes: &[u8]) -> (ChunkDigest, VerifiedChunk) {
        let d = verify::hash::chunk_digest(HashAlgo::Blake3, bytes);
        (d, verify::verify_stored(HashAlgo::Blake3, imgfmt::compress::Codec::Raw, bytes.to_vec(), bytes.len() as u32, &d).unwrap())
    }

    #[test]
    fn a_range_of_a_copy_and_of_a_reference() {
        let t = tempfile::tempdir().unwrap();
        let cache = ChunkCache::open(&t.path().join("c"), 1 << 30).unwrap();
        let bytes: Vec<u8> = (0..65536u32).map(|i| (i * 31 / 7) as u8).collect();
        let (d, c) = chunk(&bytes);
        assert_eq!(cache.read_range_unverified(HashAlgo::Blake3, &d, 65536, 4096..8192).unwrap(), None, "nothing cached yet");
        cache.put(HashAlgo::Blake3, &d, &c).unwrap();
        assert_eq!(cache.read_range_unverified(HashAlgo::Blake3, &d, 65536, 4096..8192).unwrap().as_deref(), Some(&bytes[4096..8192]));
        assert_eq!(cache.read_range_unverified(HashAlgo::Blake3, &d, 65536, 60000..70000).unwrap(), None, "past the chunk");
        assert_eq!(cache.read_range_unverified(HashAlgo::Blake3, &d, 4096, 0..100).unwrap(), None, "another length");

        let other: Vec<u8> = (0..65536u32).map(|i| (i * 13 + 5) as u8).collect();
        let (d2, _) = chunk(&other);
        let file = t.path().join("pulled");
        let mut whole = vec![0u8; 1000];
        whole.extend_from_slice(&other);
        std::fs::write(&file, &whole).unwrap();
        cache.put_refs(HashAlgo::Blake3, &file, &[(d2, 65536, 1000)]).unwrap();
        assert_eq!(cache.read_range_unverified(HashAlgo::Blake3, &d2, 65536, 0..4096).unwrap().as_deref(), Some(&other[..4096]));
        std::fs::write(&file, &whole[..2000]).unwrap();
        assert_eq!(cache.read_range_unverified(HashAlgo::Blake3, &d2, 65536, 0..4096).unwrap(), None, "the file is too short now");
    }
}
