//! What is attached to an image: a signature, an attestation or any other manifest whose
//! `subject` it is, or that is tagged after it (cosign's scheme). Found and carried by the
//! referrers module; reported by a copy.

use std::collections::BTreeMap;

use imgfmt::{Descriptor, OciDigest};
use serde::Serialize;

/// A manifest attached to a subject.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Attached {
    /// What it is attached to.
    pub subject: OciDigest,
    /// The attached manifest.
    pub digest: OciDigest,
    #[serde(rename = "mediaType")]
    pub media_type: String,
    #[serde(rename = "artifactType", skip_serializing_if = "Option::is_none")]
    pub artifact_type: Option<String>,
    /// Length of the manifest.
    pub size: u64,
    /// The tag it is found under (cosign's scheme); absent for an OCI 1.1 referrer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// Annotations of its referrers descriptor (kept in a destination's fallback index).
    #[serde(skip)]
    pub annotations: BTreeMap<String, String>,
}

impl Attached {
    pub(crate) fn descriptor(&self) -> Descriptor {
        let mut d = Descriptor::new(&self.media_type, self.digest.clone(), self.size);
        d.artifact_type = self.artifact_type.clone();
        d.annotations = self.annotations.clone();
        d
    }
}
