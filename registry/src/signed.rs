//! Signatures stored beside a manifest, as the web view shows them: cosign's tag scheme
//! (`sha256-<hex>.sig` in the same repository) and OCI 1.1 referrers carrying
//! simple-signing payloads, each checked against the server's trusted keys
//! (`serve --trusted-key`).
//!
//! ```text
//! manifest d ──► tag sha256-<hex>.sig ─┐
//!            └─► _referrers/d/…  ──────┴─► signature manifest (≤ 256 KiB, sign::manifest::decode)
//!                                            └─► each simple-signing layer (≤ 64):
//!                                                  payload blob (≤ 256 KiB, digest checked)
//!                                                  signature annotation (base64 ECDSA)
//!                                                  ──► a trusted key verifies it? its fingerprint
//!                                                  ──► payload names d? (else: signs another)
//! ```
//!
//! A keyed cosign signature does not name its key: the signer is known only by a key that
//! verifies it, so without trusted keys a signature is shown as not checked. What is shown
//! is what `snapctl verify` with a policy over the same keys would accept: the signature
//! verifies over the payload's bytes, and the payload names this manifest.

use base64::Engine as _;
use imgfmt::OciDigest;
use sign::manifest::{MAX_SIGNATURE_MANIFEST_BYTES, SIGNATURE_ANNOTATION, SIGNATURE_ARTIFACT_TYPE, SIMPLE_SIGNING_TYPE};
use sign::payload::MAX_PAYLOAD_BYTES;
use sign::PublicKey;

use crate::layout;
use crate::name::{RepoName, Tag};
use crate::store::{BlobStore, StoreError};

/// Signature referrers of one manifest looked at (as `snapctl verify` does).
pub const MAX_REFERRERS: usize = sign::manifest::MAX_SIGNATURE_REFERRERS;

/// What checking one signature said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// A trusted key verifies it, and its payload names the manifest: the key's
    /// fingerprint (`sha256:` of its DER SubjectPublicKeyInfo).
    Verified { key: String },
    /// Trusted keys are set and none verifies it (or its payload names another manifest).
    NotVerified { reason: String },
    /// The server has no trusted key: the signature was not checked.
    Unchecked,
}

/// One signature of a manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signature {
    /// `tag sha256-….sig` or `referrer sha256:…`.
    pub place: String,
    /// The signature manifest.
    pub manifest: OciDigest,
    /// The `docker-reference` its payload names, when it reads.
    pub identity: Option<String>,
    pub verdict: Verdict,
}

/// The subject of a cosign tag-scheme signature tag: `sha256-<hex>.sig` names
/// `sha256:<hex>`.
pub fn tag_subject(tag: &str) -> Option<OciDigest> {
    let hex = tag.strip_prefix("sha256-")?.strip_suffix(".sig")?;
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()) {
        return None;
    }
    format!("sha256:{hex}").parse().ok()
}

/// Whether `m` (a manifest's JSON) is a signature manifest: a referrer of the signature
/// artifact type, or a manifest whose layers are all simple-signing payloads.
pub fn is_signature(m: &serde_json::Value) -> bool {
    if m.get("artifactType").and_then(|v| v.as_str()) == Some(SIGNATURE_ARTIFACT_TYPE) {
        return true;
    }
    let layers = m.get("layers").and_then(|l| l.as_array());
    layers.is_some_and(|l| !l.is_empty() && l.iter().all(|l| l.get("mediaType").and_then(|v| v.as_str()) == Some(SIMPLE_SIGNING_TYPE)))
}

async fn get_bounded(store: &dyn BlobStore, key: &str, max: u64) -> Result<Option<bytes::Bytes>, StoreError> {
    match store.head(key).await {
        Ok(m) if m.size <= max => {}
        Ok(_) => return Ok(None),
        Err(e) if e.is_not_found() => return Ok(None),
        Err(e) => return Err(e),
    }
    match store.get_bytes(key).await {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.is_not_found() => Ok(None),
        Err(e) => Err(e),
    }
}

/// The signatures of manifest `d` in `repo`: its tag-scheme signature manifest and up to
/// [`MAX_REFERRERS`] signature referrers, each layer checked against `keys`.
pub async fn of(store: &dyn BlobStore, repo: &RepoName, d: &OciDigest, keys: &[PublicKey]) -> Result<Vec<Signature>, StoreError> {
    let mut places: Vec<(String, OciDigest)> = Vec::new();
    if let Ok(tag) = Tag::parse(&sign::manifest::signature_tag(d)) {
        if let Some(raw) = get_bounded(store, &layout::tag(repo, &tag), 1024).await? {
            if let Ok(sd) = String::from_utf8_lossy(&raw).trim().parse::<OciDigest>() {
                places.push((format!("tag {tag}"), sd));
            }
        }
    }
    for k in store.list_after(&layout::referrers_dir(repo, d), None, 1000).await? {
        if places.len() > MAX_REFERRERS {
            break;
        }
        let Some(raw) = get_bounded(store, &k.key, 64 << 10).await? else { continue };
        let Ok(desc) = serde_json::from_slice::<serde_json::Value>(&raw) else { continue };
        if desc.get("artifactType").and_then(|v| v.as_str()) != Some(SIGNATURE_ARTIFACT_TYPE) {
            continue;
        }
        if let Some(rd) = desc.get("digest").and_then(|v| v.as_str()).and_then(|v| v.parse::<OciDigest>().ok()) {
            places.push((format!("referrer {rd}"), rd));
        }
    }
    let mut out = Vec::new();
    for (place, sd) in places {
        let Some(raw) = get_bounded(store, &layout::blob(&sd), MAX_SIGNATURE_MANIFEST_BYTES).await? else { continue };
        let Ok(m) = sign::manifest::decode(&raw) else { continue };
        for l in m.layers.iter().filter(|l| l.media_type == SIMPLE_SIGNING_TYPE) {
            let payload = get_bounded(store, &layout::blob(&l.digest), MAX_PAYLOAD_BYTES).await?.filter(|p| OciDigest::of(p) == l.digest);
            let sig = l.annotations.get(SIGNATURE_ANNOTATION).and_then(|s| base64::engine::general_purpose::STANDARD.decode(s).ok());
            let decoded = payload.as_deref().and_then(|p| sign::Payload::decode(p).ok());
            let verdict = verdict(payload.as_deref(), sig.as_deref(), decoded.as_ref(), d, keys);
            out.push(Signature { place: place.clone(), manifest: sd.clone(), identity: decoded.map(|p| p.docker_reference), verdict });
        }
    }
    Ok(out)
}

/// Whether `keys` verify `sig` over `payload`, and the payload names `d`.
fn verdict(payload: Option<&[u8]>, sig: Option<&[u8]>, decoded: Option<&sign::Payload>, d: &OciDigest, keys: &[PublicKey]) -> Verdict {
    if keys.is_empty() {
        return Verdict::Unchecked;
    }
    let not = |reason: &str| Verdict::NotVerified { reason: reason.to_owned() };
    let (Some(payload), Some(sig)) = (payload, sig) else { return not("payload or signature missing") };
    let Some(key) = keys.iter().find(|k| k.verify(payload, sig)) else { return not("no trusted key verifies it") };
    match decoded {
        Some(p) if p.manifest_digest == d.as_str() => Verdict::Verified { key: key.fingerprint() },
        Some(_) => not("its payload signs another manifest"),
        None => not("its payload does not read"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_tags_name_their_subject() {
        let d = OciDigest::of(b"x");
        let hex = d.as_str().strip_prefix("sha256:").unwrap();
        assert_eq!(tag_subject(&format!("sha256-{hex}.sig")), Some(d.clone()));
        for not in ["latest", "sha256-abc.sig", &format!("sha256-{hex}.att"), &format!("sha256-{}.sig", hex.to_uppercase())] {
            assert_eq!(tag_subject(not), None, "{not}");
        }
    }

    #[test]
    fn regression_issue_39_a_signature_is_verified_only_by_a_trusted_key_over_this_manifest() {
        let d = OciDigest::of(b"image");
        let key = sign::PrivateKey::generate().unwrap();
        let other = sign::PrivateKey::generate().unwrap();
        let payload = sign::Payload::new("reg/vm:1", &d, None);
        let bytes = payload.encode();
        let sig = key.sign(&bytes).unwrap();
        let pubs = [other.public_key(), key.public_key()];
        assert_eq!(verdict(Some(&bytes), Some(&sig), Some(&payload), &d, &pubs), Verdict::Verified { key: key.public_key().fingerprint() });
        assert_eq!(verdict(Some(&bytes), Some(&sig), Some(&payload), &d, &[]), Verdict::Unchecked);
        assert!(matches!(verdict(Some(&bytes), Some(&sig), Some(&payload), &d, &[other.public_key()]), Verdict::NotVerified { .. }));
        let elsewhere = OciDigest::of(b"another image");
        assert!(matches!(verdict(Some(&bytes), Some(&sig), Some(&payload), &elsewhere, &pubs), Verdict::NotVerified { .. }));
    }
}
