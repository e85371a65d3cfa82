//! Merkle roots: one per file over its chunk digests, one per image over its files.
//!
//! Trees are `rs_merkle` trees (interior node = H(left ‖ right), a lone right-most node is
//! promoted unchanged) with the image's hash algorithm. Leaves of a file tree are the
//! chunk digests in order. Leaves of the image tree are
//! `H("snapctl.file.v1" ‖ u64le(len(name)) ‖ name ‖ u64le(size) ‖ file_root)` in the
//! config's file order. A tree with no leaves has root `H("")`. See `spec/format.md`.

use imgfmt::{ChunkDigest, HashAlgo, ResolvedFile};
use rs_merkle::{Hasher, MerkleTree};

use crate::hash::chunk_digest;

#[derive(Clone)]
struct B3;
impl Hasher for B3 {
    type Hash = [u8; 32];
    fn hash(data: &[u8]) -> [u8; 32] {
        *blake3::hash(data).as_bytes()
    }
}

#[derive(Clone)]
struct S256;
impl Hasher for S256 {
    type Hash = [u8; 32];
    fn hash(data: &[u8]) -> [u8; 32] {
        use sha2::Digest;
        sha2::Sha256::digest(data).into()
    }
}

fn root_of(algo: HashAlgo, leaves: &[[u8; 32]]) -> ChunkDigest {
    if leaves.is_empty() {
        return chunk_digest(algo, b"");
    }
    let root = match algo {
        HashAlgo::Blake3 => MerkleTree::<B3>::from_leaves(leaves).root(),
        HashAlgo::Sha256 => MerkleTree::<S256>::from_leaves(leaves).root(),
    };
    ChunkDigest(root.expect("non-empty tree has a root"))
}

/// Root over one file's chunk digests.
pub fn file_root(algo: HashAlgo, chunks: &[ChunkDigest]) -> ChunkDigest {
    let leaves: Vec<[u8; 32]> = chunks.iter().map(|d| d.0).collect();
    root_of(algo, &leaves)
}

/// Root over files, each given as (name, size, file root).
pub fn image_root<'a>(algo: HashAlgo, files: impl IntoIterator<Item = (&'a str, u64, ChunkDigest)>) -> ChunkDigest {
    let leaves: Vec<[u8; 32]> = files
        .into_iter()
        .map(|(name, size, root)| {
            let mut buf = Vec::with_capacity(15 + 8 + name.len() + 8 + 32);
            buf.extend_from_slice(b"snapctl.file.v1");
            buf.extend_from_slice(&(name.len() as u64).to_le_bytes());
            buf.extend_from_slice(name.as_bytes());
            buf.extend_from_slice(&size.to_le_bytes());
            buf.extend_from_slice(&root.0);
            chunk_digest(algo, &buf).0
        })
        .collect();
    root_of(algo, &leaves)
}

/// Per-file roots and the image root of resolved files.
pub fn resolved_root(algo: HashAlgo, files: &[ResolvedFile]) -> (Vec<ChunkDigest>, ChunkDigest) {
    let roots: Vec<ChunkDigest> = files.iter().map(|f| file_root(algo, &f.chunks.iter().map(|c| c.digest).collect::<Vec<_>>())).collect();
    let root = image_root(algo, files.iter().zip(&roots).map(|(f, r)| (f.name.as_str(), f.size, *r)));
    (roots, root)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes() {
        let a = ChunkDigest([1; 32]);
        let b = ChunkDigest([2; 32]);
        assert_eq!(file_root(HashAlgo::Blake3, &[a]), a, "a one-leaf tree's root is the leaf");
        let mut ab = [0u8; 64];
        ab[..32].copy_from_slice(&a.0);
        ab[32..].copy_from_slice(&b.0);
        assert_eq!(file_root(HashAlgo::Blake3, &[a, b]), chunk_digest(HashAlgo::Blake3, &ab));
        assert_ne!(file_root(HashAlgo::Blake3, &[a, b]), file_root(HashAlgo::Blake3, &[b, a]));
        assert_eq!(file_root(HashAlgo::Sha256, &[]), chunk_digest(HashAlgo::Sha256, b""));
        let r1 = image_root(HashAlgo::Blake3, [("a", 1, a)]);
        let r2 = image_root(HashAlgo::Blake3, [("a", 2, a)]);
        assert_ne!(r1, r2, "size is bound into the image root");
    }
}
