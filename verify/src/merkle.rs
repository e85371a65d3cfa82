//! Merkle roots: one per file over its chunk digests, one per image over its files.
//!
//! Trees are `rs_merkle`'s (interior node = H(left ‖ right), a lone right-most node is
//! promoted unchanged) with the image's hash algorithm. Leaves of a file tree are the
//! chunk digests in order. Leaves of the image tree are
//! `H("snapctl.file.v1" ‖ u64le(len(name)) ‖ name ‖ u64le(size) ‖ file_root)` in the
//! config's file order. A tree with no leaves has root `H("")`. See `spec/format.md` §9.
//!
//! Roots are computed as the leaves arrive ([`RootBuilder`]), holding one node per level
//! (at most 64): a file of 4 M chunks needs 2 KiB, where building the whole tree would
//! hold every level of it (256 MiB for the leaves and the levels above them).

use imgfmt::{ChunkDigest, HashAlgo, ResolvedFile};

use crate::hash::chunk_digest;

/// A Merkle root computed leaf by leaf.
///
/// Level `k` holds the root of the last complete subtree of `2^k` leaves not yet joined
/// to a left neighbour: pushing a leaf joins equal-sized subtrees like a binary counter
/// carries. At the end the pending subtrees, smallest (right-most) first, are joined
/// right to left: that is the promotion rule, as a level with an odd node count passes
/// its last node up unchanged until it meets a left neighbour.
#[derive(Debug, Clone)]
pub struct RootBuilder {
    algo: HashAlgo,
    levels: Vec<Option<[u8; 32]>>,
    leaves: u64,
}

impl RootBuilder {
    pub fn new(algo: HashAlgo) -> Self {
        RootBuilder { algo, levels: Vec::new(), leaves: 0 }
    }

    fn join(&self, left: &[u8; 32], right: &[u8; 32]) -> [u8; 32] {
        let mut b = [0u8; 64];
        b[..32].copy_from_slice(left);
        b[32..].copy_from_slice(right);
        chunk_digest(self.algo, &b).0
    }

    /// Add the next leaf (a 32-byte value, not hashed again).
    pub fn push(&mut self, leaf: [u8; 32]) {
        self.leaves += 1;
        let mut carry = leaf;
        for level in 0.. {
            if level == self.levels.len() {
                self.levels.push(None);
            }
            match self.levels[level].take() {
                Some(left) => carry = self.join(&left, &carry),
                None => {
                    self.levels[level] = Some(carry);
                    return;
                }
            }
        }
    }

    /// The root of the leaves pushed (`H("")` for none).
    pub fn finish(self) -> ChunkDigest {
        if self.leaves == 0 {
            return chunk_digest(self.algo, b"");
        }
        let mut acc: Option<[u8; 32]> = None;
        for node in self.levels.iter().flatten() {
            acc = Some(match acc {
                None => *node,
                Some(right) => self.join(node, &right),
            });
        }
        ChunkDigest(acc.expect("at least one leaf"))
    }
}

/// Root over one file's chunk digests.
pub fn file_root(algo: HashAlgo, chunks: &[ChunkDigest]) -> ChunkDigest {
    let mut b = RootBuilder::new(algo);
    for d in chunks {
        b.push(d.0);
    }
    b.finish()
}

/// Root over files, each given as (name, size, file root).
pub fn image_root<'a>(algo: HashAlgo, files: impl IntoIterator<Item = (&'a str, u64, ChunkDigest)>) -> ChunkDigest {
    let mut b = RootBuilder::new(algo);
    for (name, size, root) in files {
        let mut buf = Vec::with_capacity(15 + 8 + name.len() + 8 + 32);
        buf.extend_from_slice(b"snapctl.file.v1");
        buf.extend_from_slice(&(name.len() as u64).to_le_bytes());
        buf.extend_from_slice(name.as_bytes());
        buf.extend_from_slice(&size.to_le_bytes());
        buf.extend_from_slice(&root.0);
        b.push(chunk_digest(algo, &buf).0);
    }
    b.finish()
}

/// Per-file roots and the image root of resolved files.
pub fn resolved_root(algo: HashAlgo, files: &[ResolvedFile]) -> (Vec<ChunkDigest>, ChunkDigest) {
    let roots: Vec<ChunkDigest> = files
        .iter()
        .map(|f| {
            let mut b = RootBuilder::new(algo);
            for c in &f.chunks {
                b.push(c.digest.0);
            }
            b.finish()
        })
        .collect();
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

    #[derive(Clone)]
    struct B3;
    impl rs_merkle::Hasher for B3 {
        type Hash = [u8; 32];
        fn hash(data: &[u8]) -> [u8; 32] {
            *blake3::hash(data).as_bytes()
        }
    }
    #[derive(Clone)]
    struct S256;
    impl rs_merkle::Hasher for S256 {
        type Hash = [u8; 32];
        fn hash(data: &[u8]) -> [u8; 32] {
            use sha2::Digest;
            sha2::Sha256::digest(data).into()
        }
    }

    /// The streaming root is `rs_merkle`'s tree root (the reference the format names) for
    /// every leaf count up to 600 and a few around powers of two beyond, in both hashes.
    #[test]
    fn streaming_root_is_rs_merkles_root() {
        let counts = (1..=600u32).chain([1023, 1024, 1025, 4095, 4097, 65535, 65537]);
        for n in counts {
            let leaves: Vec<[u8; 32]> = (0..n).map(|i| *blake3::hash(&i.to_le_bytes()).as_bytes()).collect();
            let digests: Vec<ChunkDigest> = leaves.iter().map(|l| ChunkDigest(*l)).collect();
            let b3 = rs_merkle::MerkleTree::<B3>::from_leaves(&leaves).root().unwrap();
            assert_eq!(file_root(HashAlgo::Blake3, &digests).0, b3, "{n} leaves, blake3");
            if n <= 70 {
                let s = rs_merkle::MerkleTree::<S256>::from_leaves(&leaves).root().unwrap();
                assert_eq!(file_root(HashAlgo::Sha256, &digests).0, s, "{n} leaves, sha256");
            }
        }
    }
}
