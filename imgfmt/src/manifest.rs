//! OCI image manifest and descriptor types (the subset snapctl reads and writes).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::digest::OciDigest;
use crate::FormatError;

/// Manifests are at most 4 MiB (the OCI distribution spec's recommended minimum limit).
pub const MAX_MANIFEST_BYTES: u64 = 4 << 20;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    pub media_type: String,
    pub digest: OciDigest,
    pub size: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_type: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Every other field (`urls`, `platform`, `data`, ... and keys no spec has yet), kept
    /// as read: a descriptor written back (a tag moved in a shared `index.json`, an entry
    /// added to a referrers index) loses nothing another tool put in it.
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

impl Descriptor {
    pub fn new(media_type: &str, digest: OciDigest, size: u64) -> Self {
        Descriptor { media_type: media_type.into(), digest, size, artifact_type: None, annotations: BTreeMap::new(), extra: BTreeMap::new() }
    }
    pub fn with_annotation(mut self, k: &str, v: impl Into<String>) -> Self {
        self.annotations.insert(k.into(), v.into());
        self
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    pub schema_version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_type: Option<String>,
    pub config: Descriptor,
    #[serde(default)]
    pub layers: Vec<Descriptor>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<Descriptor>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

impl Manifest {
    pub fn decode(b: &[u8]) -> Result<Self, FormatError> {
        if b.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(FormatError::TooLarge { what: "manifest size", got: b.len() as u64, limit: MAX_MANIFEST_BYTES });
        }
        let m: Manifest = serde_json::from_slice(b).map_err(|source| FormatError::Json { what: "manifest", source })?;
        if m.schema_version != 2 {
            return Err(FormatError::invalid("manifest schemaVersion", m.schema_version.to_string()));
        }
        Ok(m)
    }
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("manifest serializes")
    }
}

/// An OCI image index (`index.json` of a layout, or a referrers response).
///
/// Read, changed and written back by snapctl in places other tools write too (a layout
/// skopeo or oras also fills, the referrers fallback tag), so it keeps what it does not
/// model: `artifactType`, `subject` and unknown keys here, and in each descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ImageIndex {
    pub schema_version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    #[serde(default)]
    pub manifests: Vec<Descriptor>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Every other field, kept as read.
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

impl ImageIndex {
    /// An OCI image index with no manifests.
    pub fn empty() -> Self {
        ImageIndex {
            schema_version: 2,
            media_type: Some(crate::media::OCI_INDEX.into()),
            manifests: Vec::new(),
            annotations: BTreeMap::new(),
            extra: BTreeMap::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 14 §3: fields snapctl does not model survive a decode and an encode, in the
    /// index and in each descriptor; the ones it does model are still typed.
    #[test]
    fn regression_issue_14_index_keeps_fields_it_does_not_model() {
        let d = OciDigest::of(b"m");
        let text = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "artifactType": "application/vnd.example.sbom",
            "subject": {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": d.as_str(), "size": 7},
            "x-future": {"nested": [1, 2, 3]},
            "manifests": [{
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": d.as_str(),
                "size": 1,
                "platform": {"architecture": "amd64", "os": "linux"},
                "urls": ["https://example.com/blob"],
                "data": "bQ==",
                "artifactType": "application/vnd.example",
                "annotations": {"org.opencontainers.image.ref.name": "v1"},
                "x-unknown": 42
            }],
            "annotations": {"a": "b"}
        });
        let idx: ImageIndex = serde_json::from_value(text.clone()).unwrap();
        assert_eq!(idx.manifests[0].digest, d);
        assert_eq!(idx.manifests[0].artifact_type.as_deref(), Some("application/vnd.example"));
        assert_eq!(idx.manifests[0].annotations["org.opencontainers.image.ref.name"], "v1");
        assert_eq!(serde_json::to_value(&idx).unwrap(), text);
        // Nothing invented for an index that has no such fields.
        let bare = serde_json::to_value(ImageIndex::empty()).unwrap();
        assert_eq!(bare, serde_json::json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": []}));
    }
}
