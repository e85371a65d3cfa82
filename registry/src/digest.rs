//! Content digests (`sha256:<hex>`, `sha512:<hex>`) and the streaming hasher that checks them.

use std::fmt;
use std::str::FromStr;

use sha2::Digest as _;

/// A digest algorithm the registry accepts for blobs and manifests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Algorithm {
    /// SHA-256, 64 lowercase hex digits.
    Sha256,
    /// SHA-512, 128 lowercase hex digits.
    Sha512,
}

impl Algorithm {
    /// The name used in digest strings and storage keys.
    pub fn as_str(self) -> &'static str {
        match self {
            Algorithm::Sha256 => "sha256",
            Algorithm::Sha512 => "sha512",
        }
    }

    fn hex_len(self) -> usize {
        match self {
            Algorithm::Sha256 => 64,
            Algorithm::Sha512 => 128,
        }
    }

    /// A fresh hasher for this algorithm.
    pub fn hasher(self) -> Hasher {
        match self {
            Algorithm::Sha256 => Hasher::Sha256(sha2::Sha256::new()),
            Algorithm::Sha512 => Hasher::Sha512(sha2::Sha512::new()),
        }
    }
}

/// A parsed, validated digest: `algorithm:hex`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest {
    alg: Algorithm,
    hex: String,
}

/// Why a digest string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum DigestError {
    /// digest {0:?} has no `algorithm:` prefix
    NoAlgorithm(String),
    /// digest algorithm {0:?} is not supported (sha256, sha512)
    UnsupportedAlgorithm(String),
    /// digest {0:?}: encoded part must be {1} lowercase hex digits
    BadHex(String, usize),
}

impl Digest {
    /// The algorithm.
    pub fn algorithm(&self) -> Algorithm {
        self.alg
    }

    /// The lowercase hex of the hash.
    pub fn hex(&self) -> &str {
        &self.hex
    }

    /// Digest of a byte slice with the given algorithm.
    pub fn of(alg: Algorithm, data: &[u8]) -> Digest {
        let mut h = alg.hasher();
        h.update(data);
        h.finish()
    }
}

impl FromStr for Digest {
    type Err = DigestError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (alg, hex) = s.split_once(':').ok_or_else(|| DigestError::NoAlgorithm(s.to_owned()))?;
        let alg = match alg {
            "sha256" => Algorithm::Sha256,
            "sha512" => Algorithm::Sha512,
            other => return Err(DigestError::UnsupportedAlgorithm(other.to_owned())),
        };
        let ok = hex.len() == alg.hex_len() && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        if !ok {
            return Err(DigestError::BadHex(s.to_owned(), alg.hex_len()));
        }
        Ok(Digest { alg, hex: hex.to_owned() })
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.alg.as_str(), self.hex)
    }
}

impl serde::Serialize for Digest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Digest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// An incremental hasher for one of the supported algorithms. `Clone` so that a
/// caller can keep the state at a committed offset and roll back a failed append.
#[derive(Clone)]
pub enum Hasher {
    /// SHA-256 state.
    Sha256(sha2::Sha256),
    /// SHA-512 state.
    Sha512(sha2::Sha512),
}

impl fmt::Debug for Hasher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Hasher::Sha256(_) => "Hasher(sha256)",
            Hasher::Sha512(_) => "Hasher(sha512)",
        })
    }
}

impl Hasher {
    /// Feed bytes.
    pub fn update(&mut self, data: &[u8]) {
        match self {
            Hasher::Sha256(h) => h.update(data),
            Hasher::Sha512(h) => h.update(data),
        }
    }

    /// The algorithm of this hasher.
    pub fn algorithm(&self) -> Algorithm {
        match self {
            Hasher::Sha256(_) => Algorithm::Sha256,
            Hasher::Sha512(_) => Algorithm::Sha512,
        }
    }

    /// The digest of everything fed so far.
    pub fn finish(self) -> Digest {
        let (alg, hex) = match self {
            Hasher::Sha256(h) => (Algorithm::Sha256, hex::encode(h.finalize())),
            Hasher::Sha512(h) => (Algorithm::Sha512, hex::encode(h.finalize())),
        };
        Digest { alg, hex }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_displays() {
        let d: Digest = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855".parse().unwrap();
        assert_eq!(d, Digest::of(Algorithm::Sha256, b""));
        assert_eq!(d.to_string(), "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        let d512 = Digest::of(Algorithm::Sha512, b"abc");
        assert_eq!(d512.to_string().parse::<Digest>().unwrap(), d512);
        assert!(d512.hex().starts_with("ddaf35a193617aba"));
    }

    #[test]
    fn refuses_bad_digests() {
        for bad in [
            "",
            "sha256",
            "md5:d41d8cd98f00b204e9800998ecf8427e",
            "sha256:E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855",
            "sha256:e3b0",
            "sha256:../../../../etc/passwd",
            "sha512:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        ] {
            assert!(bad.parse::<Digest>().is_err(), "{bad:?} accepted");
        }
    }
}
