//! Chunk digests.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

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
