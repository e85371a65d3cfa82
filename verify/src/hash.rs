//! Chunk digests, and the BLAKE3 slice chaining values that let part of a chunk be
//! verified (spec/format.md §8a).
//!
//! BLAKE3 hashes a tree over 1 KiB chunks in which a node's left subtree holds the largest
//! power of two of chunks strictly less than the node's total. With a slice of `2^s`
//! bytes (`s ≥ 10`), every slice-aligned piece of an input, the last one possibly short, is
//! a complete subtree, and the tree over the slices follows the same rule: the largest
//! power of two of *slices* strictly less than the total goes left. So a chunk's digest is
//! its slices' chaining values (CVs) merged by that rule ([`merge_slice_cvs`]), and one
//! slice is verified by recomputing its CV alone ([`slice_cv`]).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use blake3::hazmat::{merge_subtrees_non_root, merge_subtrees_root, HasherExt, Mode};
use imgfmt::outboard::Cv;
use imgfmt::{ChunkDigest, HashAlgo};

/// Digest of a chunk's uncompressed bytes.
pub fn chunk_digest(algo: HashAlgo, data: &[u8]) -> ChunkDigest {
    match algo {
        HashAlgo::Blake3 => ChunkDigest(*blake3::hash(data).as_bytes()),
        HashAlgo::Sha256 => {
            use sha2::Digest;
            ChunkDigest(sha2::Sha256::digest(data).into())
        }
    }
}

/// Digest of `len` zero bytes, cached: an image has at most two zero-chunk lengths per
/// file (full and tail), so zero chunks cost no hashing after the first.
pub fn zero_digest(algo: HashAlgo, len: u32) -> ChunkDigest {
    static CACHE: OnceLock<Mutex<HashMap<(u8, u32), ChunkDigest>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(d) = cache.lock().expect("poisoned").get(&(algo.code(), len)) {
        return *d;
    }
    let d = chunk_digest(algo, &vec![0u8; len as usize]);
    cache.lock().expect("poisoned").insert((algo.code(), len), d);
    d
}

/// The CV of the slice `data` that starts `offset` bytes into its chunk. `offset` is a
/// multiple of the slice size, and `data` at most one slice (the last may be short).
pub fn slice_cv(data: &[u8], offset: u64) -> Cv {
    debug_assert!(!data.is_empty(), "empty slices have no CV");
    blake3::Hasher::new().set_input_offset(offset).update(data).finalize_non_root()
}

/// The CVs of every `2^slice_shift`-byte slice of `chunk`, slice 0 first.
pub fn slice_cvs(chunk: &[u8], slice_shift: u8) -> Vec<Cv> {
    let slice = 1usize << slice_shift;
    chunk.chunks(slice).enumerate().map(|(i, s)| slice_cv(s, (i * slice) as u64)).collect()
}

/// The BLAKE3 digest of a chunk from its slices' CVs (at least two): split at the largest
/// power of two strictly less than the count, merge each side as a non-root subtree, and
/// the two as the root.
pub fn merge_slice_cvs(cvs: &[Cv]) -> ChunkDigest {
    assert!(cvs.len() >= 2, "a chunk of one slice is its own root: hash it");
    let (l, r) = cvs.split_at(left_count(cvs.len()));
    ChunkDigest(*merge_subtrees_root(&merge_non_root(l), &merge_non_root(r), Mode::Hash).as_bytes())
}

fn merge_non_root(cvs: &[Cv]) -> Cv {
    if cvs.len() == 1 {
        return cvs[0];
    }
    let (l, r) = cvs.split_at(left_count(cvs.len()));
    merge_subtrees_non_root(&merge_non_root(l), &merge_non_root(r), Mode::Hash)
}

/// Largest power of two strictly less than `n` (`n ≥ 2`).
fn left_count(n: usize) -> usize {
    1 << (usize::BITS - 1 - (n - 1).leading_zeros())
}

/// A chunk's BLAKE3 digest and, when it is longer than one slice, its slice CVs, in one
/// pass over the bytes (the digest is the merge of the CVs).
pub fn digest_with_slice_cvs(chunk: &[u8], slice_shift: u8) -> (ChunkDigest, Option<Vec<Cv>>) {
    if chunk.len() <= 1 << slice_shift {
        return (chunk_digest(HashAlgo::Blake3, chunk), None);
    }
    let cvs = slice_cvs(chunk, slice_shift);
    (merge_slice_cvs(&cvs), Some(cvs))
}

/// CVs of a chunk's slices of twice the size, from those of its slices: pairs merged as
/// non-root subtrees, an odd last one kept as it is (a slice alone at the end is its own
/// subtree at either size). A packer whose outboard would grow past its limit coarsens.
pub fn coarsen_slice_cvs(cvs: &[Cv]) -> Vec<Cv> {
    cvs.chunks(2).map(|p| if p.len() == 2 { merge_subtrees_non_root(&p[0], &p[1], Mode::Hash) } else { p[0] }).collect()
}

/// Whether a buffer is all zero bytes (fast path for the zero map).
pub fn is_zero(data: &[u8]) -> bool {
    // OR-fold 64-byte blocks (the compiler vectorises this), then the tail.
    let body = data.len() / 64 * 64;
    data[..body].chunks_exact(64).all(|b| b.iter().fold(0u8, |a, x| a | x) == 0) && data[body..].iter().all(|&b| b == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        // BLAKE3("") and SHA-256("") from their specs.
        assert_eq!(chunk_digest(HashAlgo::Blake3, b"").to_hex(), "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262");
        assert_eq!(chunk_digest(HashAlgo::Sha256, b"").to_hex(), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        assert_eq!(zero_digest(HashAlgo::Blake3, 100), chunk_digest(HashAlgo::Blake3, &[0; 100]));
    }

    /// Deterministic, not periodic at any power of two (so a misplaced slice changes the hash).
    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i as u32).wrapping_mul(2654435761).rotate_right(13) as u8).collect()
    }

    #[test]
    fn slice_cvs_merge_to_the_blake3_digest() {
        let kib = 1024;
        let mut lens = vec![1, 1023, 1024, 4096, 4097, 8191, 8192, 8193, 10 * kib, 12 * kib, 12 * kib + 1, 16 * kib, 20 * kib, 60 * kib + 5];
        lens.extend([(1 << 20) - 1, 1 << 20, (1 << 20) + 1 - 4096, 3 * (1 << 19) + 17, 999_999]);
        for len in lens {
            let data = pattern(len);
            let want = chunk_digest(HashAlgo::Blake3, &data);
            for shift in [12u8, 13, 14, 16] {
                let (d, cvs) = digest_with_slice_cvs(&data, shift);
                assert_eq!(d, want, "len {len} slice 2^{shift}");
                let n = len.div_ceil(1 << shift);
                match cvs {
                    None => assert_eq!(n, 1, "len {len}: CVs only for more than one slice"),
                    Some(cvs) => {
                        assert_eq!(cvs.len(), n);
                        assert_eq!(merge_slice_cvs(&cvs), want);
                        // Coarsening gives the CVs of the double-size slices.
                        let coarse = coarsen_slice_cvs(&cvs);
                        if coarse.len() >= 2 {
                            assert_eq!(coarse, slice_cvs(&data, shift + 1), "len {len}: coarsened 2^{shift}");
                        }
                        // One slice alone, at its offset, gives its CV; elsewhere it does not.
                        let last = n - 1;
                        let s = (last << shift) as u64;
                        assert_eq!(slice_cv(&data[s as usize..], s), cvs[last]);
                        if last > 0 {
                            assert_ne!(slice_cv(&data[s as usize..], 0), cvs[last]);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn merge_rule_splits_at_the_largest_power_of_two_below() {
        assert_eq!([2, 3, 4, 5, 8, 9, 255, 256, 257].map(left_count), [1, 2, 2, 4, 4, 8, 128, 128, 256]);
        // Swapping two CVs changes the digest: order is bound.
        let cvs = slice_cvs(&pattern(3 * 4096), 12);
        assert_ne!(merge_slice_cvs(&cvs), merge_slice_cvs(&[cvs[1], cvs[0], cvs[2]]));
    }

    #[test]
    fn zero_check() {
        let mut v = vec![0u8; 1000];
        assert!(is_zero(&v));
        v[999] = 1;
        assert!(!is_zero(&v));
        v[999] = 0;
        v[3] = 1;
        assert!(!is_zero(&v));
        assert!(is_zero(&[]));
    }
}
