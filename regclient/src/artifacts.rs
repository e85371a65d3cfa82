//! Small manifests attached to an image (signatures): read by tag or digest without
//! touching the tag-resolution cache, and whether the registry has the referrers API.
//!
//! `resolve_tag` keeps the manifest it resolved for the image opener's next read; a
//! signature check that runs beside the opener (lazy restore) must not replace it, or the
//! opener pays a round trip to fetch its manifest again.

use imgfmt::{FormatError, OciDigest};

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
