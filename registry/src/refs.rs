//! What a stored manifest points at: the blobs and manifests its descriptors name, and its
//! `subject`. The server checks a manifest's references at PUT with it; gc marks from it.

use imgfmt::OciDigest;

use crate::error::{ApiError, Code};

/// What a manifest points at.
#[derive(Debug, Default)]
pub struct ManifestRefs {
    /// (digest, is_manifest): config and layers are blobs; index entries are manifests.
    pub children: Vec<(OciDigest, bool)>,
    /// The `subject`, if any.
    pub subject: Option<OciDigest>,
}

/// Descriptors referenced by an image manifest or index (docker v2 included).
pub fn manifest_refs(json: &serde_json::Value) -> Result<ManifestRefs, ApiError> {
    let desc = |v: &serde_json::Value| -> Result<OciDigest, ApiError> {
        let d = v.get("digest").and_then(|d| d.as_str()).ok_or_else(|| ApiError::bad(Code::ManifestInvalid, "descriptor without digest"))?;
        d.parse().map_err(|e| ApiError::bad(Code::ManifestInvalid, format!("descriptor: {e}")))
    };
    let mut r = ManifestRefs::default();
    if !json.is_object() {
        return Err(ApiError::bad(Code::ManifestInvalid, "manifest is not a JSON object"));
    }
    if let Some(c) = json.get("config") {
        r.children.push((desc(c)?, false));
    }
    for key in ["layers", "blobs"] {
        if let Some(ls) = json.get(key).and_then(|v| v.as_array()) {
            for l in ls {
                // Foreign layers live elsewhere (`urls`); they need not be in the registry.
                if l.get("urls").is_some_and(|u| u.as_array().is_some_and(|a| !a.is_empty())) {
                    continue;
                }
                r.children.push((desc(l)?, false));
            }
        }
    }
    if let Some(ms) = json.get("manifests").and_then(|v| v.as_array()) {
        for m in ms {
            r.children.push((desc(m)?, true));
        }
    }
    if let Some(s) = json.get("subject") {
        r.subject = Some(desc(s)?);
    }
    Ok(r)
}
