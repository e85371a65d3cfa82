//! Digest types. Chunk digests and Merkle roots are computed by the `verify` crate; this
//! module names, parses and prints them. OCI blob digests (sha256/sha512) have their one
//! type here, [`OciDigest`], with the one streaming hasher that makes them, [`OciHasher`],
//! used by the packer, the layout, the registry client and the registry server alike.

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
    /// `algorithm:hex`, as it appears on the wire.
    pub fn as_str(&self) -> &str {
        &self.0
    }
    /// The algorithm part: `"sha256"` or `"sha512"` (parsing admits nothing else), as used
    /// in storage paths (`blobs/<algorithm>/...`).
    pub fn algorithm(&self) -> &str {
        self.0.split_once(':').map(|(a, _)| a).unwrap_or("")
    }
    /// The lowercase hex part (64 digits for sha256, 128 for sha512).
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
    /// A SHA-512 hasher.
    pub fn sha512() -> Self {
        use sha2::Digest;
        OciHasher(OciHasherInner::Sha512(sha2::Sha512::new()))
    }
    /// A hasher of `d`'s algorithm (SHA-512 for `sha512:`, else SHA-256), to check bytes
    /// against `d`: a claimed sha512 digest is verified with SHA-512.
    pub fn for_digest(d: &OciDigest) -> Self {
        if d.algorithm() == "sha512" {
            Self::sha512()
        } else {
            Self::sha256()
        }
    }
    /// The algorithm this hasher computes, spelled as in [`OciDigest::algorithm`]: a caller
    /// holding a running hash can tell whether it can finish it for a given digest.
    pub fn algorithm(&self) -> &'static str {
        match self.0 {
            OciHasherInner::Sha256(_) => "sha256",
            OciHasherInner::Sha512(_) => "sha512",
        }
    }
    /// Feed bytes.
    pub fn update(&mut self, b: &[u8]) {
        use sha2::Digest;
        match &mut self.0 {
            OciHasherInner::Sha256(h) => h.update(b),
            OciHasherInner::Sha512(h) => h.update(b),
        }
    }
    /// Feed `data` and finish: the digest of a whole small blob in this hasher's algorithm,
    /// e.g. `OciHasher::for_digest(&claimed).finish_with(&manifest)`.
    pub fn finish_with(mut self, data: &[u8]) -> OciDigest {
        self.update(data);
        self.finish()
    }
    /// The digest of everything fed so far.
    pub fn finish(self) -> OciDigest {
        use sha2::Digest;
        match self.0 {
            OciHasherInner::Sha256(h) => OciDigest::sha256_from_bytes(h.finalize().into()),
            OciHasherInner::Sha512(h) => OciDigest(format!("sha512:{}", hex::encode(h.finalize()))),
        }
    }
}

impl fmt::Debug for OciHasher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OciHasher({})", self.algorithm())
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
    fn oci_digest_accepts_exactly_sha256_and_sha512_in_canonical_form() {
        let empty = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        let d: OciDigest = empty.parse().unwrap();
        assert_eq!(d, OciDigest::of(b""));
        assert_eq!((d.algorithm(), d.to_string().as_str()), ("sha256", empty));
        for bad in [
            "",
            "sha256",
            ":",
            "md5:d41d8cd98f00b204e9800998ecf8427e",
            "SHA256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            "sha256:E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855",
            "sha256:e3b0",
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855 ",
            "sha256:../../../../etc/passwd",
            // A sha256-length hex under sha512, and the other way round.
            "sha512:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            "sha256:cf83e1357eefb8bdf1542850d66d8007d620e4050b5715dc83f4a921d36ce9ce47d0d13c5d85f2b0ff8318d2877eec2f63b931bd47417a81a538327af927da3e",
        ] {
            assert!(bad.parse::<OciDigest>().is_err(), "{bad:?} accepted");
        }
        // Serde goes through the same parser.
        assert!(serde_json::from_str::<OciDigest>("\"sha256:e3b0\"").is_err());
        assert_eq!(serde_json::to_string(&d).unwrap(), format!("\"{empty}\""));
    }

    #[test]
    fn oci_hasher_streams_sha256_and_sha512() {
        // FIPS 180-2 "abc" vectors, fed in two pieces.
        let abc256 = "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        let abc512 = "sha512:ddaf35a193617abacc417349ae20413112e6fa4e89a97ea20a9eeee64b55d39a2192992a274fc1a836ba3c23a3feebbd454d4423643ce80e2a9ac94fa54ca49f";
        for (want, fresh) in [(abc256, OciHasher::sha256()), (abc512, OciHasher::sha512())] {
            let want: OciDigest = want.parse().unwrap();
            let mut h = OciHasher::for_digest(&want);
            assert_eq!(h.algorithm(), want.algorithm());
            assert_eq!(fresh.algorithm(), want.algorithm());
            h.update(b"a");
            let at_a = h.clone();
            h.update(b"bc");
            assert_eq!(h.finish(), want);
            // A clone keeps the state it was taken at (the server rolls back to it).
            let mut again = at_a;
            again.update(b"bc");
            assert_eq!(again.finish(), want);
        }
        assert_eq!(OciDigest::of(b"abc").as_str(), abc256);
        assert_eq!(OciHasher::sha512().finish_with(b"abc").as_str(), abc512);
    }

    #[test]
    fn chunk_digest_round_trip() {
        let d = ChunkDigest([7; 32]);
        let s = d.display_with(HashAlgo::Blake3);
        assert_eq!(ChunkDigest::parse_with(&s, HashAlgo::Blake3).unwrap(), d);
        assert!(ChunkDigest::parse_with(&s, HashAlgo::Sha256).is_err());
    }
}
