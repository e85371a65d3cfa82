//! Digest types. Computing digests is the `verify` crate's job; this module only
//! names, parses and prints them.

use std::fmt;
use std::str::FromStr;

use crate::FormatError;

/// Hash algorithm for chunk digests and Merkle roots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum HashAlgo {
    /// BLAKE3, 32-byte output (default).
    #[default]
    Blake3,
    /// SHA-256.
    Sha256,
}

impl HashAlgo {
    /// The code stored in the index header.
    pub fn code(self) -> u8 {
        match self {
            HashAlgo::Blake3 => 1,
            HashAlgo::Sha256 => 2,
        }
    }
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(HashAlgo::Blake3),
            2 => Some(HashAlgo::Sha256),
            _ => None,
        }
    }
    /// Name used in configs and in `algo:hex` strings.
    pub fn name(self) -> &'static str {
        match self {
            HashAlgo::Blake3 => "blake3",
            HashAlgo::Sha256 => "sha256",
        }
    }
}

impl fmt::Display for HashAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for HashAlgo {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "blake3" | "b3" => Ok(HashAlgo::Blake3),
            "sha256" | "sha-256" => Ok(HashAlgo::Sha256),
            other => Err(format!("unknown hash {other:?} (expected blake3 or sha256)")),
        }
    }
}

/// A 32-byte content digest of a chunk (or a Merkle node), in the image's [`HashAlgo`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct ChunkDigest(pub [u8; 32]);

impl ChunkDigest {
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
    /// `algo:hex`, the form used in configs and annotations.
    pub fn display_with(&self, algo: HashAlgo) -> String {
        format!("{}:{}", algo.name(), self.to_hex())
    }
    /// Parse `algo:hex`, checking the algorithm.
    pub fn parse_with(s: &str, algo: HashAlgo) -> Result<Self, FormatError> {
        let (a, h) = s.split_once(':').ok_or_else(|| FormatError::invalid("digest", format!("{s:?} is not algo:hex")))?;
        if a != algo.name() {
            return Err(FormatError::invalid("digest", format!("{s:?} is not a {algo} digest")));
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(h, &mut out).map_err(|_| FormatError::invalid("digest", format!("{s:?}: expected 64 hex digits")))?;
        Ok(ChunkDigest(out))
    }
}

impl fmt::Debug for ChunkDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.to_hex())
    }
}
impl fmt::Display for ChunkDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.to_hex())
    }
}

/// An OCI content digest (`sha256:<64 hex>` or `sha512:<128 hex>`), naming a blob.
///
/// Stored in canonical lowercase form; parsing rejects anything else, so a digest can be
/// used as a file name under `blobs/<algo>/` without further checks.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OciDigest(String);

impl OciDigest {
    pub fn sha256_from_bytes(b: [u8; 32]) -> Self {
        OciDigest(format!("sha256:{}", hex::encode(b)))
    }
    /// sha256 of `data` (for small blobs: manifests, configs, indexes).
    pub fn of(data: &[u8]) -> Self {
        use sha2::Digest;
        Self::sha256_from_bytes(sha2::Sha256::digest(data).into())
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
    pub fn algorithm(&self) -> &str {
        self.0.split_once(':').map(|(a, _)| a).unwrap_or("")
    }
    pub fn hex(&self) -> &str {
        self.0.split_once(':').map(|(_, h)| h).unwrap_or("")
    }
    /// The raw 32 bytes of a sha256 digest.
    pub fn sha256_bytes(&self) -> Option<[u8; 32]> {
        if self.algorithm() != "sha256" {
            return None;
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(self.hex(), &mut out).ok()?;
        Some(out)
    }
}

/// The one streaming hasher of OCI digests: SHA-256 or SHA-512, whichever a digest names.
/// Blobs of any size go through it a piece at a time (uploads, layouts, audits).
#[derive(Clone)]
pub struct OciHasher(OciHasherInner);

#[derive(Clone)]
enum OciHasherInner {
    Sha256(sha2::Sha256),
    Sha512(sha2::Sha512),
}

impl OciHasher {
    /// A SHA-256 hasher.
    pub fn sha256() -> Self {
        use sha2::Digest;
        OciHasher(OciHasherInner::Sha256(sha2::Sha256::new()))
    }
    /// A hasher of `d`'s algorithm (SHA-512 for `sha512:`, else SHA-256).
    pub fn for_digest(d: &OciDigest) -> Self {
        use sha2::Digest;
        if d.algorithm() == "sha512" {
            OciHasher(OciHasherInner::Sha512(sha2::Sha512::new()))
        } else {
            Self::sha256()
        }
    }
    pub fn update(&mut self, b: &[u8]) {
        use sha2::Digest;
        match &mut self.0 {
            OciHasherInner::Sha256(h) => h.update(b),
            OciHasherInner::Sha512(h) => h.update(b),
        }
    }
    pub fn finish(self) -> OciDigest {
        use sha2::Digest;
        match self.0 {
            OciHasherInner::Sha256(h) => OciDigest::sha256_from_bytes(h.finalize().into()),
            OciHasherInner::Sha512(h) => OciDigest(format!("sha512:{}", hex::encode(h.finalize()))),
        }
    }
}

impl FromStr for OciDigest {
    type Err = FormatError;
    fn from_str(s: &str) -> Result<Self, FormatError> {
        let bad = |why: &str| FormatError::invalid("OCI digest", format!("{s:?}: {why}"));
        let (algo, hex) = s.split_once(':').ok_or_else(|| bad("expected algorithm:hex"))?;
        let want = match algo {
            "sha256" => 64,
            "sha512" => 128,
            _ => return Err(bad("algorithm must be sha256 or sha512")),
        };
        if hex.len() != want || !hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            return Err(bad(&format!("expected {want} lowercase hex digits")));
        }
        Ok(OciDigest(s.to_owned()))
    }
}

impl fmt::Display for OciDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
impl fmt::Debug for OciDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl serde::Serialize for OciDigest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}
impl<'de> serde::Deserialize<'de> for OciDigest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oci_digest_rejects_traversal_and_case() {
        assert!("sha256:../../etc/passwd".parse::<OciDigest>().is_err());
        assert!(format!("sha256:{}", "A".repeat(64)).parse::<OciDigest>().is_err());
        assert!(format!("md5:{}", "a".repeat(32)).parse::<OciDigest>().is_err());
        let d: OciDigest = format!("sha256:{}", "a".repeat(64)).parse().unwrap();
        assert_eq!(d.hex().len(), 64);
    }

    #[test]
    fn chunk_digest_round_trip() {
        let d = ChunkDigest([7; 32]);
        let s = d.display_with(HashAlgo::Blake3);
        assert_eq!(ChunkDigest::parse_with(&s, HashAlgo::Blake3).unwrap(), d);
        assert!(ChunkDigest::parse_with(&s, HashAlgo::Sha256).is_err());
    }
}
