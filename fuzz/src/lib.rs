//! Shared pieces of the fuzz targets: an in-memory [`BlobSource`] and the blobs of the
//! committed spec vectors (`spec/vectors/*/blobs/sha256/*`), so fuzzed configs and
//! indexes can name real parents, bases and packs.

use std::collections::HashMap;
use std::sync::OnceLock;

use imgfmt::{BlobSource, FormatError, OciDigest};

/// Every blob of every committed spec vector, by digest (loaded once per process).
pub fn vector_blobs() -> &'static HashMap<OciDigest, Vec<u8>> {
    static BLOBS: OnceLock<HashMap<OciDigest, Vec<u8>>> = OnceLock::new();
    BLOBS.get_or_init(|| {
        let mut out = HashMap::new();
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../spec/vectors");
        let Ok(vectors) = std::fs::read_dir(&root) else { return out };
        for v in vectors.flatten() {
            let Ok(blobs) = std::fs::read_dir(v.path().join("blobs/sha256")) else { continue };
            for b in blobs.flatten() {
                let name = format!("sha256:{}", b.file_name().to_string_lossy());
                if let (Ok(d), Ok(bytes)) = (name.parse::<OciDigest>(), std::fs::read(b.path())) {
                    out.insert(d, bytes);
                }
            }
        }
        out
    })
}

/// A blob store in memory: the fuzz input's blobs over the spec vectors' blobs.
pub struct MemSource {
    pub own: HashMap<OciDigest, Vec<u8>>,
    pub shared: &'static HashMap<OciDigest, Vec<u8>>,
}

impl MemSource {
    pub fn new() -> Self {
        MemSource { own: HashMap::new(), shared: vector_blobs() }
    }
    /// Store `data` under its sha256 and return the digest.
    pub fn put(&mut self, data: Vec<u8>) -> OciDigest {
        let d = OciDigest::of(&data);
        self.own.insert(d.clone(), data);
        d
    }
    fn get(&self, d: &OciDigest) -> Result<&[u8], FormatError> {
        self.own.get(d).or_else(|| self.shared.get(d)).map(Vec::as_slice).ok_or_else(|| FormatError::BlobNotFound(d.clone()))
    }
}

impl Default for MemSource {
    fn default() -> Self {
        Self::new()
    }
}

impl BlobSource for MemSource {
    fn describe(&self) -> String {
        "mem:".into()
    }
    fn resolve_tag(&self, tag: &str) -> Result<OciDigest, FormatError> {
        Err(FormatError::TagNotFound { layout: self.describe(), tag: tag.into() })
    }
    fn read_blob_unverified(&self, d: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError> {
        let b = self.get(d)?;
        if b.len() as u64 > limit {
            return Err(FormatError::TooLarge { what: "blob size", got: b.len() as u64, limit });
        }
        Ok(b.to_vec())
    }
    fn blob_size(&self, d: &OciDigest) -> Result<u64, FormatError> {
        Ok(self.get(d)?.len() as u64)
    }
    fn read_at_unverified(&self, d: &OciDigest, offset: u64, buf: &mut [u8]) -> Result<(), FormatError> {
        let b = self.get(d)?;
        let end = offset.checked_add(buf.len() as u64).filter(|&e| e <= b.len() as u64).ok_or(FormatError::Truncated {
            what: "blob range",
            got: b.len() as u64,
            expected: offset.saturating_add(buf.len() as u64),
        })?;
        buf.copy_from_slice(&b[offset as usize..end as usize]);
        Ok(())
    }
}
