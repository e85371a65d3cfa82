//! Small manifests attached to an image (signatures): read by tag or digest without
//! touching the tag-resolution cache, and whether the registry has the referrers API.
//!
//! `resolve_tag` keeps the manifest it resolved for the image opener's next read; a
//! signature check that runs beside the opener (lazy restore) must not replace it, or the
//! opener pays a round trip to fetch its manifest again.

use imgfmt::{BlobSource as _, Descriptor, FormatError, OciDigest};

use super::{read_limited, RegistrySource};

impl RegistrySource {
    /// The manifest `reference` (a tag or a digest) names, as served, at most `limit`
    /// bytes (more: `FormatError::TooLarge`); `None` when the registry has no such
    /// manifest (404).
    pub fn get_manifest(&self, reference: &str, limit: u64) -> Result<Option<Vec<u8>>, FormatError> {
        let url = self.url("manifests", reference);
        let what = format!("fetching manifest {}:{reference}", self.describe_repo());
        let resp = self.send(&what, &|c| c.get(&url).header(reqwest::header::ACCEPT, Self::accept())).map_err(|e| self.source_err(e))?;
        if resp.status().as_u16() == 404 {
            return Ok(None);
        }
        if !resp.status().is_success() {
            return Err(self.not_found_or(resp, &what, None));
        }
        if let Some(n) = resp.content_length().filter(|n| *n > limit) {
            return Err(FormatError::TooLarge { what: "manifest size", got: n, limit });
        }
        read_limited(resp, limit, &what).map(Some)
    }

    /// Whether the registry answers the referrers API (`GET /v2/<name>/referrers/<digest>`
    /// → 200) rather than 404 (Debian's docker-registry 2.8 and other pre-1.1 registries).
    pub fn has_referrers_api(&self, subject: &OciDigest) -> Result<bool, FormatError> {
        let url = self.url("referrers", subject.as_str());
        let what = format!("asking {} for referrers", self.describe_repo());
        let resp = self.send(&what, &|c| c.get(&url).header(reqwest::header::ACCEPT, imgfmt::media::OCI_INDEX)).map_err(|e| self.source_err(e))?;
        match resp.status().as_u16() {
            200..=299 => Ok(true),
            404 => Ok(false),
            _ => Err(self.not_found_or(resp, &what, None)),
        }
    }

    fn describe_repo(&self) -> String {
        format!("{}/{}", self.host, self.repository)
    }
}

/// A registry repository: referrers through its API (else the fallback tag the client
/// maintains), cosign's tags looked up by name (a tag list can be long; the names are
/// known).
impl imgfmt::ImageStore for RegistrySource {
    fn manifest_by_tag(&self, tag: &str, limit: u64) -> Result<Option<Vec<u8>>, FormatError> {
        self.get_manifest(tag, limit)
    }
    fn manifest(&self, digest: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError> {
        self.get_manifest(digest.as_str(), limit)?.ok_or_else(|| FormatError::BlobNotFound(digest.clone()))
    }
    fn referrers(&self, subject: &OciDigest, artifact_type: Option<&str>) -> Result<Vec<Descriptor>, FormatError> {
        self.list_referrers(subject, artifact_type).map_err(|e| e.into_source_error(self.host()))
    }
    fn attached_tags(&self, subject: &OciDigest) -> Result<Vec<(String, OciDigest)>, FormatError> {
        let mut out = Vec::new();
        for suffix in imgfmt::store::COSIGN_SUFFIXES {
            let tag = format!("{}.{suffix}", imgfmt::store::referrers_tag(subject));
            match self.resolve_tag(&tag) {
                Ok(d) => out.push((tag, d)),
                Err(FormatError::TagNotFound { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }
    fn put_blob(&self, data: &[u8]) -> Result<OciDigest, FormatError> {
        self.push_small_blob(data).map_err(|e| e.into_source_error(self.host()))
    }
    fn put_tagged_manifest(&self, tag: &str, bytes: &[u8]) -> Result<(), FormatError> {
        self.put_manifest(tag, bytes).map(|_| ()).map_err(|e| e.into_source_error(self.host()))
    }
    fn put_referrer(&self, subject: &OciDigest, bytes: &[u8]) -> Result<bool, FormatError> {
        if !self.has_referrers_api(subject)? {
            return Ok(false);
        }
        let put = self.put_manifest(OciDigest::of(bytes).as_str(), bytes).map_err(|e| e.into_source_error(self.host()))?;
        Ok(put.subject_indexed)
    }
    fn tags(&self) -> Result<Vec<String>, FormatError> {
        self.list_tags()
    }
    fn delete(&self, what: &imgfmt::reference::Selector) -> Result<(), FormatError> {
        self.delete_manifest(what)
    }
}

#[cfg(test)]
mod tests {
    use imgfmt::store::{referrers_tag, signature_tag};
    use imgfmt::{media, ImageStore, OciDigest};

    use crate::upload::tests::local_server;
    use crate::RegistrySource;

    /// An artifact manifest of `artifact_type` (its one layer the empty config), with
    /// `subject` when given; its blobs are pushed.
    fn artifact(c: &RegistrySource, artifact_type: &str, subject: Option<&OciDigest>) -> Vec<u8> {
        let empty = ImageStore::put_blob(c, b"{}").unwrap();
        let subject = subject.map(|s| serde_json::json!({"mediaType": media::OCI_MANIFEST, "digest": s.as_str(), "size": 2}));
        let mut m = serde_json::json!({
            "schemaVersion": 2, "mediaType": media::OCI_MANIFEST, "artifactType": artifact_type,
            "config": {"mediaType": "application/vnd.oci.empty.v1+json", "digest": empty.as_str(), "size": 2},
            "layers": [{"mediaType": "application/vnd.oci.empty.v1+json", "digest": empty.as_str(), "size": 2}],
        });
        if let Some(s) = subject {
            m["subject"] = s;
        }
        serde_json::to_vec(&m).unwrap()
    }

    #[test]
    fn a_registry_stores_tags_finds_cosign_tags_and_lists_referrers_by_type() {
        let (_rt, _dir, host) = local_server();
        let c = RegistrySource::new(&host, "vm/store", true, None).unwrap();
        let store: &dyn ImageStore = &c;
        let image = artifact(&c, "application/image", None);
        store.put_tagged_manifest("v1", &image).unwrap();
        let subject = OciDigest::of(&image);
        assert_eq!(store.manifest_by_tag("v1", 1 << 20).unwrap(), Some(image.clone()));
        assert_eq!(store.manifest_by_tag("v2", 1 << 20).unwrap(), None);
        assert_eq!(store.manifest(&subject, 1 << 20).unwrap(), image);
        assert!(matches!(store.manifest(&OciDigest::of(b"absent"), 1 << 20), Err(imgfmt::FormatError::BlobNotFound(_))));

        let sig = artifact(&c, "application/sig", None);
        store.put_tagged_manifest(&signature_tag(&subject), &sig).unwrap();
        store.put_tagged_manifest(&format!("{}.att", referrers_tag(&subject)), &sig).unwrap();
        let tags: Vec<String> = store.attached_tags(&subject).unwrap().into_iter().map(|(t, _)| t).collect();
        assert_eq!(tags, [signature_tag(&subject), format!("{}.att", referrers_tag(&subject))]);

        assert!(store.referrers(&subject, None).unwrap().is_empty());
        let trace = artifact(&c, "application/trace", Some(&subject));
        assert!(store.put_referrer(&subject, &trace).unwrap(), "snapctl serve has the referrers API");
        assert!(store.put_referrer(&subject, &artifact(&c, "application/other", Some(&subject))).unwrap());
        assert_eq!(store.referrers(&subject, None).unwrap().len(), 2);
        let typed: Vec<OciDigest> = store.referrers(&subject, Some("application/trace")).unwrap().into_iter().map(|d| d.digest).collect();
        assert_eq!(typed, [OciDigest::of(&trace)]);
    }
}
