//! An in-memory [`ImageStore`] for tests: tags, blobs, manifests, and referrers when asked to
//! index them.

use std::collections::HashMap;
use std::sync::Mutex;

use imgfmt::reference::Selector;
use imgfmt::{BlobSource, Descriptor, FormatError, ImageStore, Manifest, OciDigest};

#[derive(Default)]
pub struct MemStore {
    pub blobs: Mutex<HashMap<OciDigest, Vec<u8>>>,
    pub tags: Mutex<HashMap<String, OciDigest>>,
    pub referrers_api: bool,
    pub referrers: Mutex<Vec<(OciDigest, Descriptor)>>,
}

impl MemStore {
    pub fn put(&self, b: &[u8]) -> OciDigest {
        let d = OciDigest::of(b);
        self.blobs.lock().unwrap().insert(d.clone(), b.to_vec());
        d
    }
    pub fn get(&self, d: &OciDigest) -> Vec<u8> {
        self.blobs.lock().unwrap()[d].clone()
    }
    pub fn tagged(&self, tag: &str) -> Vec<u8> {
        let d = self.tags.lock().unwrap()[tag].clone();
        self.get(&d)
    }
    pub fn set_tag(&self, tag: &str, b: &[u8]) {
        let d = self.put(b);
        self.tags.lock().unwrap().insert(tag.into(), d);
    }
}

fn get(store: &MemStore, d: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError> {
    let b = store.blobs.lock().unwrap().get(d).cloned().ok_or_else(|| FormatError::BlobNotFound(d.clone()))?;
    if b.len() as u64 > limit {
        return Err(FormatError::TooLarge { what: "blob", got: b.len() as u64, limit });
    }
    Ok(b)
}

impl BlobSource for MemStore {
    fn describe(&self) -> String {
        "mem".into()
    }
    fn resolve_tag(&self, tag: &str) -> Result<OciDigest, FormatError> {
        self.tags.lock().unwrap().get(tag).cloned().ok_or_else(|| FormatError::TagNotFound { layout: "mem".into(), tag: tag.into() })
    }
    fn read_blob_unverified(&self, d: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError> {
        get(self, d, limit)
    }
    fn blob_size(&self, d: &OciDigest) -> Result<u64, FormatError> {
        get(self, d, u64::MAX).map(|b| b.len() as u64)
    }
    fn read_at_unverified(&self, d: &OciDigest, offset: u64, buf: &mut [u8]) -> Result<(), FormatError> {
        let b = get(self, d, u64::MAX)?;
        let s = b.get(offset as usize..offset as usize + buf.len()).ok_or_else(|| FormatError::BlobNotFound(d.clone()))?;
        buf.copy_from_slice(s);
        Ok(())
    }
}

impl ImageStore for MemStore {
    fn manifest_by_tag(&self, tag: &str, limit: u64) -> Result<Option<Vec<u8>>, FormatError> {
        let d = self.tags.lock().unwrap().get(tag).cloned();
        d.map(|d| get(self, &d, limit)).transpose()
    }
    fn manifest(&self, d: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError> {
        get(self, d, limit)
    }
    fn referrers(&self, subject: &OciDigest, _: Option<&str>) -> Result<Vec<Descriptor>, FormatError> {
        Ok(self.referrers.lock().unwrap().iter().filter(|(s, _)| s == subject).map(|(_, d)| d.clone()).collect())
    }
    fn attached_tags(&self, _: &OciDigest) -> Result<Vec<(String, OciDigest)>, FormatError> {
        Ok(Vec::new())
    }
    fn put_blob(&self, data: &[u8]) -> Result<OciDigest, FormatError> {
        Ok(self.put(data))
    }
    fn put_tagged_manifest(&self, tag: &str, bytes: &[u8]) -> Result<(), FormatError> {
        self.set_tag(tag, bytes);
        Ok(())
    }
    fn put_referrer(&self, subject: &OciDigest, bytes: &[u8]) -> Result<bool, FormatError> {
        if !self.referrers_api {
            return Ok(false);
        }
        let d = self.put(bytes);
        let m = Manifest::decode(bytes).unwrap();
        let mut desc = Descriptor::new(imgfmt::media::OCI_MANIFEST, d, bytes.len() as u64);
        desc.artifact_type = m.artifact_type;
        self.referrers.lock().unwrap().push((subject.clone(), desc));
        Ok(true)
    }
    fn tags(&self) -> Result<Vec<String>, FormatError> {
        let mut t: Vec<String> = self.tags.lock().unwrap().keys().cloned().collect();
        t.sort();
        Ok(t)
    }
    fn delete(&self, what: &Selector) -> Result<(), FormatError> {
        let mut tags = self.tags.lock().unwrap();
        match what {
            Selector::Tag(t) => tags.remove(t).map(drop).ok_or_else(|| FormatError::TagNotFound { layout: "mem".into(), tag: t.clone() }),
            Selector::Digest(d) => {
                tags.retain(|_, v| v != d);
                self.blobs.lock().unwrap().remove(d).map(drop).ok_or_else(|| FormatError::BlobNotFound(d.clone()))
            }
        }
    }
}
