//! Referrers: artifacts (a prefetch trace, a signature) that point at a snapshot through
//! their manifest's `subject`. Listed by `GET /v2/<name>/referrers/<digest>` where the
//! registry has the API (OCI distribution 1.1), else by the spec's fallback tag
//! `<alg>-<hex>` naming an image index of referrer descriptors, which the pushing client
//! maintains (read, add, write back) when the registry does not answer `OCI-Subject`.
//!
//! A listing is read page by page (`Link: <…>; rel="next"`, on the registry's own origin
//! only), each page at most 4 MiB, and at most [`MAX_REFERRER_PAGES`] pages and
//! [`MAX_REFERRERS`] descriptors in all: a subject with more referrers than that is listed
//! in part, with a warning, never read without bound. Ask with `artifactType` for what
//! you want ([`ReferrersQuery`]): the registry filters where it can (`OCI-Filters-Applied`),
//! and the client filters what it did not.

use std::collections::BTreeMap;
use std::io::Read;

use imgfmt::manifest::{ImageIndex, MAX_MANIFEST_BYTES};
use imgfmt::{media, BlobSource, Descriptor, Manifest, OciDigest};

use super::{ClientError, RegistrySource};

/// The OCI "empty" config (`{}`) artifact manifests carry.
pub const EMPTY_CONFIG_TYPE: &str = "application/vnd.oci.empty.v1+json";
/// Media type of a referrer's payload layer.
pub const PAYLOAD_TYPE: &str = "application/octet-stream";
/// Largest referrer payload read back.
pub const MAX_PAYLOAD_BYTES: u64 = 256 << 20;
/// Most pages of one referrers listing followed.
pub const MAX_REFERRER_PAGES: usize = 16;
/// Most referrer descriptors one listing returns by default.
pub const MAX_REFERRERS: usize = 1000;

/// What to list: referrers of one artifact type (or all), and at most how many.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReferrersQuery<'a> {
    /// Only referrers whose `artifactType` is this (asked of the registry as
    /// `?artifactType=`, and checked here when it did not filter).
    pub artifact_type: Option<&'a str>,
    /// Most descriptors returned (and pages read: at most [`MAX_REFERRER_PAGES`]).
    pub max: usize,
}

impl<'a> ReferrersQuery<'a> {
    /// Referrers of `artifact_type` (all when `None`), at most [`MAX_REFERRERS`].
    pub fn of_type(artifact_type: Option<&'a str>) -> Self {
        ReferrersQuery { artifact_type, max: MAX_REFERRERS }
    }
}

/// A referrers listing.
#[derive(Debug, Clone, Default)]
pub struct Referrers {
    /// The referrer descriptors, in the registry's order.
    pub descriptors: Vec<Descriptor>,
    /// More were there than the query's `max` or [`MAX_REFERRER_PAGES`] pages allowed.
    pub truncated: bool,
    /// From the registry's referrers API (`false`: from the fallback tag's index).
    pub from_api: bool,
}

/// The target of a `Link: <URL>; rel="next"` header.
pub(crate) fn next_link(h: &reqwest::header::HeaderMap) -> Option<String> {
    for v in h.get_all(reqwest::header::LINK) {
        let Ok(v) = v.to_str() else { continue };
        for link in v.split(',') {
            let (target, params) = link.split_once(';').unwrap_or((link, ""));
            let target = target.trim();
            let is_next = params.split(';').any(|p| {
                let p = p.trim().replace(' ', "");
                p == "rel=\"next\"" || p == "rel=next"
            });
            if let (true, Some(t)) = (is_next, target.strip_prefix('<').and_then(|t| t.strip_suffix('>'))) {
                return Some(t.to_string());
            }
        }
    }
    None
}

/// The fallback tag for a subject: `sha256-<hex>` (one grammar: imgfmt's).
pub use imgfmt::layout::referrers_tag as fallback_tag;

impl RegistrySource {
    fn get_index(&self, url: &str, what: &str) -> Result<Option<(ImageIndex, bool)>, ClientError> {
        Ok(self.get_index_page(url, what)?.map(|(idx, filtered, _)| (idx, filtered)))
    }

    /// One page of an index: the index, whether the registry filtered it by
    /// `artifactType`, and the URL of the next page (on this registry's origin only).
    fn get_index_page(&self, url: &str, what: &str) -> Result<Option<(ImageIndex, bool, Option<String>)>, ClientError> {
        let resp = self.send_sized(what, MAX_MANIFEST_BYTES, &|c| c.get(url).header(reqwest::header::ACCEPT, media::OCI_INDEX))?;
        match resp.status().as_u16() {
            200 => {}
            404 => return Ok(None),
            _ => return Err(Self::refusal(what, resp)),
        }
        let filtered = resp.headers().get("oci-filters-applied").and_then(|v| v.to_str().ok()).is_some_and(|v| v.contains("artifactType"));
        let next = next_link(resp.headers()).and_then(|l| resp.url().join(&l).ok()).and_then(|u| {
            if super::may_send_credentials(&self.origin, &u) {
                Some(u.to_string())
            } else {
                tracing::warn!("{what}: the next page is on another origin ({u}); listing only what this one had");
                None
            }
        });
        let mut b = Vec::new();
        resp.take(MAX_MANIFEST_BYTES + 1).read_to_end(&mut b).map_err(|e| ClientError::Http { what: what.into(), message: e.to_string() })?;
        if b.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(ClientError::TooLarge { what: what.into(), limit: MAX_MANIFEST_BYTES });
        }
        let idx: ImageIndex = serde_json::from_slice(&b).map_err(|e| ClientError::Http { what: what.into(), message: format!("not an image index: {e}") })?;
        Ok(Some((idx, filtered, next)))
    }

    /// Referrers of `subject`, optionally only those of `artifact_type`: from the
    /// referrers API, else from the fallback tag (empty when neither has any). Pages are
    /// followed, up to [`MAX_REFERRERS`] descriptors (see [`Self::list_referrers_query`],
    /// which also says whether the listing was cut).
    pub fn list_referrers(&self, subject: &OciDigest, artifact_type: Option<&str>) -> Result<Vec<Descriptor>, ClientError> {
        Ok(self.list_referrers_query(subject, &ReferrersQuery::of_type(artifact_type))?.descriptors)
    }

    /// Referrers of `subject` that match `q`: the referrers API asked with
    /// `?artifactType=` (filtered here too where the registry did not say it filtered),
    /// its pages followed up to `q.max` descriptors and [`MAX_REFERRER_PAGES`] pages; else
    /// the fallback tag's index. Bounded whatever the registry holds: more than that is
    /// `truncated`, not an error.
    pub fn list_referrers_query(&self, subject: &OciDigest, q: &ReferrersQuery<'_>) -> Result<Referrers, ClientError> {
        let what = format!("listing referrers of {subject} in {}", self.describe());
        let keep = |d: &Descriptor, filtered: bool| filtered || q.artifact_type.is_none_or(|t| d.artifact_type.as_deref() == Some(t));
        let mut url = self.url("referrers", subject.as_str());
        if let Some(t) = q.artifact_type {
            url.push_str(&format!("?artifactType={}", form_urlencoded::byte_serialize(t.as_bytes()).collect::<String>()));
        }
        let mut out = Referrers { from_api: true, ..Referrers::default() };
        let mut next = Some(url);
        let mut pages = 0;
        while let Some(u) = next.take() {
            if pages == MAX_REFERRER_PAGES {
                out.truncated = true;
                break;
            }
            let Some((idx, filtered, link)) = self.get_index_page(&u, &what)? else {
                if pages > 0 {
                    break;
                }
                // No referrers API (distribution 2.8): the fallback tag's index.
                out.from_api = false;
                if let Some((idx, _)) = self.get_index(&self.url("manifests", &fallback_tag(subject)), &what)? {
                    out.descriptors = idx.manifests.into_iter().filter(|d| keep(d, false)).collect();
                    if out.descriptors.len() > q.max {
                        out.descriptors.truncate(q.max);
                        out.truncated = true;
                    }
                }
                break;
            };
            pages += 1;
            for d in idx.manifests {
                if !keep(&d, filtered) {
                    continue;
                }
                if out.descriptors.len() == q.max {
                    out.truncated = true;
                    break;
                }
                out.descriptors.push(d);
            }
            if out.truncated {
                break;
            }
            next = link;
        }
        if out.truncated {
            tracing::warn!("{what}: more referrers than the {} (of {} pages at most) listed", q.max, MAX_REFERRER_PAGES);
        }
        Ok(out)
    }

    /// Push an artifact of `artifact_type` holding `payload` that refers to manifest
    /// `subject` (which must be in this repository), and make it findable: by the
    /// registry's referrers API when it indexes `subject` itself, else by adding it to the
    /// fallback tag's index. Returns the artifact manifest's digest.
    ///
    /// The fallback index is read, extended and written back; two clients doing this at
    /// once for one subject can lose an entry (distribution has no conditional PUT).
    pub fn push_referrer(
        &self,
        subject: &OciDigest,
        artifact_type: &str,
        payload: &[u8],
        annotations: BTreeMap<String, String>,
    ) -> Result<OciDigest, ClientError> {
        self.push_referrer_layers(subject, artifact_type, &[(PAYLOAD_TYPE, payload)], annotations)
    }

    /// [`push_referrer`](Self::push_referrer) with several layers, each `(media type,
    /// bytes)`, in that order (a prefetch trace and its working-set blob).
    pub fn push_referrer_layers(
        &self,
        subject: &OciDigest,
        artifact_type: &str,
        payloads: &[(&str, &[u8])],
        annotations: BTreeMap<String, String>,
    ) -> Result<OciDigest, ClientError> {
        let what = format!("subject {subject} in {}", self.describe());
        let url = self.url("manifests", subject.as_str());
        let resp = self.send(&what, &|c| c.head(&url).header(reqwest::header::ACCEPT, Self::accept()))?;
        if !resp.status().is_success() {
            return Err(Self::refusal(&what, resp));
        }
        let subject_type = resp.headers().get(reqwest::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or(media::OCI_MANIFEST).to_string();
        let subject_size = resp
            .headers()
            .get(reqwest::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| ClientError::Http { what: what.clone(), message: "HEAD without Content-Length".into() })?;
        let config = self.push_small_blob(b"{}")?;
        let mut layers = Vec::with_capacity(payloads.len());
        for (media_type, payload) in payloads {
            layers.push(Descriptor::new(media_type, self.push_small_blob(payload)?, payload.len() as u64));
        }
        let manifest = Manifest {
            schema_version: 2,
            media_type: Some(media::OCI_MANIFEST.into()),
            artifact_type: Some(artifact_type.into()),
            config: Descriptor::new(EMPTY_CONFIG_TYPE, config, 2),
            layers,
            subject: Some(Descriptor::new(&subject_type, subject.clone(), subject_size)),
            annotations: annotations.clone(),
        };
        let bytes = manifest.encode();
        let put = self.put_manifest(&OciDigest::of(&bytes).to_string(), &bytes)?;
        if !put.subject_indexed {
            let mut desc = Descriptor::new(media::OCI_MANIFEST, put.digest.clone(), bytes.len() as u64);
            desc.artifact_type = Some(artifact_type.into());
            desc.annotations = annotations;
            self.add_referrers_fallback(subject, &[desc])?;
        }
        Ok(put.digest)
    }

    /// List `descs` (manifests in this repository) as referrers of `subject` in the
    /// fallback index (tag `sha256-<hex>`), for a registry without the referrers API:
    /// read, add what is missing, write back.
    ///
    /// Two clients doing this at once for one subject can lose an entry (distribution has
    /// no conditional PUT).
    pub fn add_referrers_fallback(&self, subject: &OciDigest, descs: &[Descriptor]) -> Result<(), ClientError> {
        let tag = fallback_tag(subject);
        let what = format!("referrers fallback tag {}:{tag}", self.describe());
        let mut idx = match self.get_index(&self.url("manifests", &tag), &what)? {
            Some((idx, _)) => idx,
            None => ImageIndex::empty(),
        };
        let before = idx.manifests.len();
        for d in descs {
            if !idx.manifests.iter().any(|m| m.digest == d.digest) {
                idx.manifests.push(d.clone());
            }
        }
        if idx.manifests.len() != before {
            idx.media_type = Some(media::OCI_INDEX.into());
            self.put_manifest(&tag, &serde_json::to_vec(&idx).expect("serializes"))?;
        }
        Ok(())
    }

    /// The payload of a referrer listed by [`Self::list_referrers`], checked against the
    /// digests in its (checked) manifest: verified bytes.
    pub fn read_referrer_payload(&self, referrer: &Descriptor) -> Result<Vec<u8>, ClientError> {
        use imgfmt::source::read_verified_blob;
        self.manifests.lock().expect("poisoned").insert(referrer.digest.clone());
        let m =
            read_verified_blob(self, &referrer.digest, MAX_MANIFEST_BYTES).map_err(|source| ClientError::Source { digest: referrer.digest.clone(), source })?;
        let m = Manifest::decode(&m).map_err(|source| ClientError::Source { digest: referrer.digest.clone(), source })?;
        let layer =
            m.layers.first().ok_or_else(|| ClientError::Http { what: format!("referrer {}", referrer.digest), message: "has no payload layer".into() })?;
        read_verified_blob(self, &layer.digest, MAX_PAYLOAD_BYTES).map_err(|source| ClientError::Source { digest: layer.digest.clone(), source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_links_are_found_in_any_spelling() {
        let mut h = reqwest::header::HeaderMap::new();
        assert_eq!(next_link(&h), None);
        h.append(reqwest::header::LINK, "</v2/r/referrers/sha256:a?n=2&last=sha256:b>; rel=\"next\"".parse().unwrap());
        assert_eq!(next_link(&h).as_deref(), Some("/v2/r/referrers/sha256:a?n=2&last=sha256:b"));
        let mut h = reqwest::header::HeaderMap::new();
        h.append(reqwest::header::LINK, "<http://x/prev>; rel=prev, <http://x/next>;rel=next".parse().unwrap());
        assert_eq!(next_link(&h).as_deref(), Some("http://x/next"));
    }

    #[test]
    fn fallback_tag_is_a_valid_tag() {
        let d = OciDigest::of(b"x");
        let t = fallback_tag(&d);
        assert!(t.starts_with("sha256-") && t.len() == 7 + 64);
        imgfmt::layout::check_tag(&t).unwrap();
    }
}
