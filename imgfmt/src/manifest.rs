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
}

impl Descriptor {
    pub fn new(media_type: &str, digest: OciDigest, size: u64) -> Self {
        Descriptor { media_type: media_type.into(), digest, size, artifact_type: None, annotations: BTreeMap::new() }
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
}
