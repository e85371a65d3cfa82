//! A place images live: a registry repository or an OCI layout, and what is attached to
//! the images in it. Signature checking and signing (`sign`), the copy of attached
//! artifacts (`pusher`), the lazy restore's traces (`lazy`) and every command of the CLI
//! read and write through one [`ImageStore`]; the layout implements it here, the
//! registry in `regclient`.
//!
//! Attached artifacts are found two ways: OCI 1.1 referrers of a subject (a registry's
//! referrers API, else the image index its fallback tag [`referrers_tag`] names), and
//! tags named after the subject in cosign's scheme (`sha256-<hex>.sig`, `.att`, `.sbom`:
//! [`signature_tag`], [`COSIGN_SUFFIXES`]).

use crate::digest::OciDigest;
use crate::manifest::Descriptor;
use crate::reference::Selector;
use crate::source::BlobSource;
use crate::FormatError;

pub use crate::layout::referrers_tag;

/// Tag suffixes cosign attaches under (`sha256-<hex>.sig` and so on).
pub const COSIGN_SUFFIXES: [&str; 3] = ["sig", "att", "sbom"];

/// The tag cosign's scheme keeps the signatures of `image` under: `sha256-<hex>.sig`.
pub fn signature_tag(image: &OciDigest) -> String {
    format!("{}.sig", referrers_tag(image))
}

/// What a place that holds images can do besides serving blobs. Reads return bytes as
/// the store holds them (**unverified**, as [`BlobSource`]'s): callers check them.
pub trait ImageStore: BlobSource {
    /// The manifest tagged `tag`, at most `limit` bytes (larger: `FormatError::TooLarge`);
    /// `None` when the tag does not exist.
    fn manifest_by_tag(&self, tag: &str, limit: u64) -> Result<Option<Vec<u8>>, FormatError>;
    /// The manifest `digest`, at most `limit` bytes (absent: `FormatError::BlobNotFound`).
    fn manifest(&self, digest: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError>;
    /// The OCI 1.1 referrers of `subject` (those of `artifact_type` when given; a
    /// descriptor that names no artifact type is kept); empty when there are none.
    fn referrers(&self, subject: &OciDigest, artifact_type: Option<&str>) -> Result<Vec<Descriptor>, FormatError>;
    /// The tags named after `subject` in cosign's scheme (`sha256-<hex>.sig`, `.att`,
    /// `.sbom`) the store holds, and the manifest each names.
    fn attached_tags(&self, subject: &OciDigest) -> Result<Vec<(String, OciDigest)>, FormatError>;
    /// Store a blob; returns its digest.
    fn put_blob(&self, data: &[u8]) -> Result<OciDigest, FormatError>;
    /// Store the image manifest `bytes` under `tag`.
    fn put_tagged_manifest(&self, tag: &str, bytes: &[u8]) -> Result<(), FormatError>;
    /// Store a referrer manifest of `subject` (by digest) where the store indexes
    /// referrers itself (a registry's referrers API): `Ok(true)`. `Ok(false)`: it does not
    /// (a layout, a registry without the API), and nothing was written.
    fn put_referrer(&self, subject: &OciDigest, bytes: &[u8]) -> Result<bool, FormatError>;
    /// Every tag the store holds, sorted (a registry's tag list, all its pages; a layout's
    /// `index.json`). A registry repository that does not exist:
    /// `FormatError::RepositoryNotFound`.
    fn tags(&self) -> Result<Vec<String>, FormatError>;
    /// Delete what `what` names: a tag (the manifest stays), or a manifest by digest (with
    /// every tag naming it). Absent: `TagNotFound` / `BlobNotFound`; a store that does not
    /// allow deleting: `FormatError::Refused` with its answer.
    fn delete(&self, what: &Selector) -> Result<(), FormatError>;
}

/// A shared store is a store (one client for many threads and callers).
impl<T: ImageStore + ?Sized> ImageStore for std::sync::Arc<T> {
    fn manifest_by_tag(&self, tag: &str, limit: u64) -> Result<Option<Vec<u8>>, FormatError> {
        (**self).manifest_by_tag(tag, limit)
    }
    fn manifest(&self, digest: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError> {
        (**self).manifest(digest, limit)
    }
    fn referrers(&self, subject: &OciDigest, artifact_type: Option<&str>) -> Result<Vec<Descriptor>, FormatError> {
        (**self).referrers(subject, artifact_type)
    }
    fn attached_tags(&self, subject: &OciDigest) -> Result<Vec<(String, OciDigest)>, FormatError> {
        (**self).attached_tags(subject)
    }
    fn put_blob(&self, data: &[u8]) -> Result<OciDigest, FormatError> {
        (**self).put_blob(data)
    }
    fn put_tagged_manifest(&self, tag: &str, bytes: &[u8]) -> Result<(), FormatError> {
        (**self).put_tagged_manifest(tag, bytes)
    }
    fn put_referrer(&self, subject: &OciDigest, bytes: &[u8]) -> Result<bool, FormatError> {
        (**self).put_referrer(subject, bytes)
    }
    fn tags(&self) -> Result<Vec<String>, FormatError> {
        (**self).tags()
    }
    fn delete(&self, what: &Selector) -> Result<(), FormatError> {
        (**self).delete(what)
    }
}

/// A layout: tags in its `index.json`, referrers in the fallback tag's index (a layout
/// has no referrers API: [`ImageStore::put_referrer`] writes nothing).
impl ImageStore for crate::OciLayout {
    fn manifest_by_tag(&self, tag: &str, limit: u64) -> Result<Option<Vec<u8>>, FormatError> {
        match self.resolve_tag(tag) {
            Ok(d) => self.read_blob_unverified(&d, limit).map(Some),
            Err(FormatError::TagNotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }
    fn manifest(&self, digest: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError> {
        self.read_blob_unverified(digest, limit)
    }
    fn referrers(&self, subject: &OciDigest, artifact_type: Option<&str>) -> Result<Vec<Descriptor>, FormatError> {
        let mut refs = crate::OciLayout::referrers(self, subject)?;
        if let Some(want) = artifact_type {
            refs.retain(|d| d.artifact_type.as_deref().is_none_or(|t| t == want));
        }
        Ok(refs)
    }
    fn attached_tags(&self, subject: &OciDigest) -> Result<Vec<(String, OciDigest)>, FormatError> {
        let prefix = referrers_tag(subject);
        let named = |t: &str| t.strip_prefix(&prefix).is_some_and(|rest| rest.starts_with('.'));
        Ok(self.tags()?.into_iter().filter(|(t, _)| named(t)).map(|(t, d)| (t, d.digest)).collect())
    }
    fn put_blob(&self, data: &[u8]) -> Result<OciDigest, FormatError> {
        crate::OciLayout::put_blob(self, data)
    }
    fn put_tagged_manifest(&self, tag: &str, bytes: &[u8]) -> Result<(), FormatError> {
        let d = crate::OciLayout::put_blob(self, bytes)?;
        self.set_tag(tag, Descriptor::new(crate::media::OCI_MANIFEST, d, bytes.len() as u64))
    }
    fn put_referrer(&self, _: &OciDigest, _: &[u8]) -> Result<bool, FormatError> {
        Ok(false)
    }
    fn tags(&self) -> Result<Vec<String>, FormatError> {
        let mut tags: Vec<String> = crate::OciLayout::tags(self)?.into_iter().map(|(t, _)| t).collect();
        tags.sort();
        tags.dedup();
        Ok(tags)
    }
    fn delete(&self, what: &Selector) -> Result<(), FormatError> {
        match what {
            Selector::Tag(t) => self.remove_tag(t),
            Selector::Digest(d) => self.remove_manifest(d),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{media, OciLayout};

    fn desc(bytes: &[u8], artifact_type: Option<&str>) -> Descriptor {
        let mut d = Descriptor::new(media::OCI_MANIFEST, OciDigest::of(bytes), bytes.len() as u64);
        d.artifact_type = artifact_type.map(str::to_owned);
        d
    }

    #[test]
    fn a_layout_stores_tags_finds_cosign_tags_and_lists_referrers_by_type() {
        let dir = tempfile::tempdir().unwrap();
        let l = OciLayout::open_or_create(dir.path()).unwrap();
        let store: &dyn ImageStore = &l;
        let subject = OciDigest::of(b"image manifest");
        assert_eq!(store.manifest_by_tag("v1", 1 << 20).unwrap(), None);
        store.put_tagged_manifest("v1", b"{\"m\":1}").unwrap();
        assert_eq!(store.manifest_by_tag("v1", 1 << 20).unwrap().as_deref(), Some(&b"{\"m\":1}"[..]));
        assert!(matches!(store.manifest_by_tag("v1", 3), Err(FormatError::TooLarge { .. })));
        assert_eq!(store.manifest(&OciDigest::of(b"{\"m\":1}"), 1 << 20).unwrap(), b"{\"m\":1}");

        store.put_tagged_manifest(&signature_tag(&subject), b"{\"sig\":1}").unwrap();
        store.put_tagged_manifest(&format!("{}.sbom", referrers_tag(&subject)), b"{\"sbom\":1}").unwrap();
        store.put_tagged_manifest(&format!("{}x.sig", referrers_tag(&subject)), b"{\"other\":1}").unwrap();
        let mut tags: Vec<String> = store.attached_tags(&subject).unwrap().into_iter().map(|(t, _)| t).collect();
        tags.sort();
        assert_eq!(tags, [format!("{}.sbom", referrers_tag(&subject)), signature_tag(&subject)]);

        assert!(store.referrers(&subject, None).unwrap().is_empty());
        assert!(!store.put_referrer(&subject, b"{}").unwrap(), "a layout has no referrers API");
        let (sig, trace) = (desc(b"sig", Some("application/sig")), desc(b"trace", Some("application/trace")));
        l.add_referrers(&subject, &[sig.clone(), trace.clone(), desc(b"untyped", None)]).unwrap();
        assert_eq!(store.referrers(&subject, None).unwrap().len(), 3);
        let typed: Vec<OciDigest> = store.referrers(&subject, Some("application/trace")).unwrap().into_iter().map(|d| d.digest).collect();
        assert_eq!(typed, [trace.digest, OciDigest::of(b"untyped")]);
    }

    #[test]
    fn a_layout_lists_its_tags_and_deletes_a_tag_or_a_manifest() {
        let dir = tempfile::tempdir().unwrap();
        let l = OciLayout::open_or_create(dir.path()).unwrap();
        let store: &dyn ImageStore = &l;
        store.put_tagged_manifest("v2", b"{\"m\":1}").unwrap();
        store.put_tagged_manifest("v1", b"{\"m\":1}").unwrap();
        store.put_tagged_manifest("other", b"{\"m\":2}").unwrap();
        assert_eq!(store.tags().unwrap(), ["other", "v1", "v2"]);
        store.delete(&Selector::Tag("v2".into())).unwrap();
        assert_eq!(store.tags().unwrap(), ["other", "v1"]);
        assert!(matches!(store.delete(&Selector::Tag("v2".into())), Err(FormatError::TagNotFound { .. })));
        let m1 = OciDigest::of(b"{\"m\":1}");
        store.delete(&Selector::Digest(m1.clone())).unwrap();
        assert_eq!(store.tags().unwrap(), ["other"], "the manifest's tags go with it");
        assert!(!l.has_blob(&m1));
        assert!(matches!(store.delete(&Selector::Digest(m1)), Err(FormatError::BlobNotFound(_))));
    }

    #[test]
    fn the_cosign_signature_tag_is_the_fallback_tag_with_sig() {
        let d = OciDigest::of(b"x");
        assert_eq!(signature_tag(&d), format!("sha256-{}.sig", d.hex()));
    }
}
