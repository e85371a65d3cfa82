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
    /// Unix permission bits as packed (`0o7777` at most). What pull and unpack give the
    /// file is [`applied_mode`] of this.
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

/// The permission bits pull and unpack give a file whose image records `mode`: the
/// owner/group/other bits only, less write for others. An image comes from someone else;
/// set-uid, set-gid and sticky bits on files a root pull creates, or files any local user
/// may rewrite under a restoring VMM, are not the image's to ask for (spec/format.md §5).
pub const fn applied_mode(mode: u32) -> u32 {
    mode & 0o775
}

/// Check a file name from a config or a source directory: relative, `/`-separated, no
/// traversal, nothing a terminal would act on. Unpack writes under these names and
/// inspect prints them, so this is a security check.
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
    // ESC, newline, carriage return, DEL...: printed, such a name could rewrite or forge
    // the lines around it.
    if name.chars().any(|c| c < ' ' || c == '\x7f') {
        return Err(bad("contains a control character"));
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
        // No name may be a directory of another (`vm.mem` and `vm.mem/x`): no directory
        // could hold both, so such an image could be verified but never pulled.
        for f in &self.files {
            let mut at = 0;
            while let Some(i) = f.name[at..].find('/') {
                let dir = &f.name[..at + i];
                if names.contains(dir) {
                    return Err(FormatError::invalid("config files", format!("{dir:?} is a file and also a directory of {:?}", f.name)));
                }
                at += i + 1;
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
        for bad in ["", "/etc/passwd", "../x", "a/../b", "a//b", "./a", "a\0b", "a/", "a/.", "..", "."] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }

    fn config(names: &[&str]) -> ImageConfig {
        ImageConfig {
            format: CONFIG_FORMAT.into(),
            kind: Kind::Dir,
            created: "1970-01-01T00:00:00Z".into(),
            chunk_size: 1 << 16,
            hash: HashAlgo::Blake3,
            compression: "none".into(),
            files: names.iter().map(|n| FileEntry { name: n.to_string(), size: 0, mode: 0o644, role: Role::Other, chunks: 0, root: String::new() }).collect(),
            root: String::new(),
            index: BlobRef { digest: OciDigest::of(b""), size: 0 },
            parent: None,
            base: None,
            annotations: BTreeMap::new(),
        }
    }

    /// Issue 14 §16: a name holding ESC, a newline or DEL could forge the output it is
    /// printed in; the decoder refuses it.
    #[test]
    fn regression_issue_14_control_characters_in_names_are_refused() {
        for bad in ["vm.mem\n", "\x1b[2Jvm.mem", "a\rb", "a\tb", "x\x7f", "dir/\x07bell"] {
            let e = check_name(bad).unwrap_err();
            assert!(e.to_string().contains("control character"), "{bad:?}: {e}");
            let c = config(&[bad]);
            assert!(ImageConfig::decode(&c.encode()).is_err(), "{bad:?}");
        }
        // Printable non-ASCII is a name like any other.
        check_name("mémoire/été.img").unwrap();
    }

    /// Issue 14 §17: `vm.mem` and `vm.mem/x` in one image could never be written to one
    /// directory; the decoder refuses the image, wherever the pair is in the list.
    #[test]
    fn regression_issue_14_a_name_that_is_a_directory_of_another_is_refused() {
        for names in [&["vm.mem", "vm.mem/x"][..], &["a/b/c", "a/b"], &["a", "z", "a/b/c/d"]] {
            let e = ImageConfig::decode(&config(names).encode()).unwrap_err();
            assert!(e.to_string().contains("also a directory"), "{names:?}: {e}");
        }
        for ok in [&["vm.mem", "vm.mem2/x"][..], &["a/b", "a/c", "ab/c"], &["a.b/c", "a"]] {
            ImageConfig::decode(&config(ok).encode()).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
        }
    }

    #[test]
    fn applied_modes_drop_special_bits_and_world_write() {
        assert_eq!(applied_mode(0o7777), 0o775);
        assert_eq!(applied_mode(0o4755), 0o755);
        assert_eq!(applied_mode(0o666), 0o664);
        assert_eq!(applied_mode(0o600), 0o600);
    }
}
