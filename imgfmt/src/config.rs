//! The config blob: JSON describing the snapshot (what `inspect` shows without reading
//! the index), and tying the index and the chain together.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::digest::{HashAlgo, OciDigest};
use crate::index::{MAX_FILES, MAX_FILE_SIZE};
use crate::{FormatError, MAX_CHUNK_SHIFT, MIN_CHUNK_SHIFT};

/// Value of [`ImageConfig::format`] for this major version.
pub const CONFIG_FORMAT: &str = "snapctl.image.v1";
/// A config blob is at most 16 MiB.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;
/// A chain of parents is at most this deep.
pub const MAX_CHAIN_DEPTH: usize = 64;

/// Which runtime wrote the checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Firecracker,
    Gvisor,
    Criu,
    #[default]
    Dir,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Firecracker => "firecracker",
            Kind::Gvisor => "gvisor",
            Kind::Criu => "criu",
            Kind::Dir => "dir",
        })
    }
}

impl FromStr for Kind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "firecracker" | "fc" => Ok(Kind::Firecracker),
            "gvisor" | "runsc" => Ok(Kind::Gvisor),
            "criu" => Ok(Kind::Criu),
            "dir" => Ok(Kind::Dir),
            _ => Err(format!("unknown kind {s:?} (expected firecracker, gvisor, criu or dir)")),
        }
    }
}

/// What a file is to the runtime; drives defaults (memory files are served lazily,
/// state files are fetched eagerly).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Guest RAM, offset-linear (Firecracker `vm.mem`).
    Memory,
    /// Device/VMM/sandbox state (Firecracker `vm.state`, gVisor `checkpoint.img`).
    State,
    /// Page contents addressed by a separate map (gVisor `pages.img`, CRIU `pages-N.img`).
    Pages,
    /// Maps and descriptors (gVisor `pages_meta.img`, CRIU `pagemap-N.img`, other CRIU images).
    Metadata,
    #[default]
    Other,
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Memory => "memory",
            Role::State => "state",
            Role::Pages => "pages",
            Role::Metadata => "metadata",
            Role::Other => "other",
        })
    }
}

/// One file of the snapshot. Files appear in the same order as in the index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    /// Relative path, `/`-separated, no `.`/`..`/empty components.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// Unix permission bits (`0o7777` at most).
    pub mode: u32,
    pub role: Role,
    /// Number of chunks (`ceil(size / chunkSize)`).
    pub chunks: u64,
    /// Merkle root over this file's chunk digests (`algo:hex`).
    pub root: String,
}

/// A reference from a layer to its parent, or from an image to its base.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ChainRef {
    /// Digest of the referenced image's manifest.
    pub manifest: OciDigest,
    /// Its config blob (listed in this image's manifest too, for a parent).
    pub config: OciDigest,
    /// Its index blob (listed in this image's manifest too, for a parent).
    pub index: OciDigest,
    /// Its content root.
    pub root: String,
    /// Where it was found when this image was packed (informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
}

/// Size and digest of the index blob.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlobRef {
    pub digest: OciDigest,
    pub size: u64,
}

/// The config blob.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ImageConfig {
    /// Always [`CONFIG_FORMAT`].
    pub format: String,
    pub kind: Kind,
    /// RFC 3339 creation time.
    pub created: String,
    /// Chunk size in bytes: a power of two, 64 KiB..=16 MiB.
    pub chunk_size: u64,
    /// `blake3` or `sha256`: chunk digests and Merkle roots.
    #[serde(with = "hash_name")]
    pub hash: HashAlgo,
    /// Compression the packer asked for (each chunk records its own codec).
    pub compression: String,
    pub files: Vec<FileEntry>,
    /// The image's content root (`algo:hex`): names the content whatever the packing.
    pub root: String,
    /// The chunk index blob.
    pub index: BlobRef,
    /// Parent image, for a layer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<ChainRef>,
    /// Base image whose packs this image references.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<ChainRef>,
    /// Source annotations (runtime version, host, anything the packer was told).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

mod hash_name {
    use super::HashAlgo;
    use serde::{Deserialize, Deserializer, Serializer};
    pub fn serialize<S: Serializer>(h: &HashAlgo, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(h.name())
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<HashAlgo, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// Check a file name from a config or a source directory: relative, `/`-separated, no
/// traversal. Unpack writes under these names, so this is a security check.
pub fn check_name(name: &str) -> Result<(), FormatError> {
    let bad = |why: &str| FormatError::invalid("file name", format!("{name:?}: {why}"));
    if name.is_empty() || name.len() > 4096 {
        return Err(bad("empty or longer than 4096 bytes"));
    }
    if name.starts_with('/') {
        return Err(bad("absolute path"));
    }
    if name.contains('\0') || name.contains('\\') {
        return Err(bad("contains NUL or backslash"));
    }
    if name.split('/').any(|c| c.is_empty() || c == "." || c == "..") {
        return Err(bad("empty, '.' or '..' component"));
    }
    Ok(())
}

impl ImageConfig {
    pub fn chunk_shift(&self) -> u8 {
        self.chunk_size.trailing_zeros() as u8
    }

    /// Decode and validate a config blob.
    pub fn decode(b: &[u8]) -> Result<Self, FormatError> {
        if b.len() as u64 > MAX_CONFIG_BYTES {
            return Err(FormatError::TooLarge { what: "config blob size", got: b.len() as u64, limit: MAX_CONFIG_BYTES });
        }
        let c: ImageConfig = serde_json::from_slice(b).map_err(|source| FormatError::Json { what: "config", source })?;
        c.validate()?;
        Ok(c)
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec_pretty(self).expect("config serializes");
        v.push(b'\n');
        v
    }

    pub fn validate(&self) -> Result<(), FormatError> {
        if self.format != CONFIG_FORMAT {
            return Err(FormatError::invalid("config format", format!("{:?}, expected {CONFIG_FORMAT:?}", self.format)));
        }
        let cs = self.chunk_size;
        if !cs.is_power_of_two() || !(MIN_CHUNK_SHIFT as u32..=MAX_CHUNK_SHIFT as u32).contains(&cs.trailing_zeros()) {
            return Err(FormatError::invalid("config chunkSize", format!("{cs} is not a power of two in 64KiB..=16MiB")));
        }
        if self.files.len() as u64 > MAX_FILES {
            return Err(FormatError::TooLarge { what: "config file count", got: self.files.len() as u64, limit: MAX_FILES });
        }
        let mut names = std::collections::HashSet::new();
        for f in &self.files {
            check_name(&f.name)?;
            if !names.insert(f.name.as_str()) {
                return Err(FormatError::invalid("config files", format!("{:?} listed twice", f.name)));
            }
            if f.size > MAX_FILE_SIZE {
                return Err(FormatError::TooLarge { what: "file size", got: f.size, limit: MAX_FILE_SIZE });
            }
            if f.mode > 0o7777 {
                return Err(FormatError::invalid("file mode", format!("{:?}: {:#o}", f.name, f.mode)));
            }
            if f.chunks != f.size.div_ceil(cs) {
                return Err(FormatError::invalid("file chunks", format!("{:?}: {} chunks for {} bytes", f.name, f.chunks, f.size)));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for ok in ["vm.mem", "a/b.img", "pages-1.img"] {
            check_name(ok).unwrap();
        }
        for bad in ["", "/etc/passwd", "../x", "a/../b", "a//b", "./a", "a\0b"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }
}
