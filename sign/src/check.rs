//! Reading and writing signatures through an [`ImageStore`] (a registry repository or a
//! layout), and deciding by a policy.
//!
//! ```text
//! check(store, policy, image, digest)
//!   requirements_for(image) ──► reject / insecureAcceptAnything: no I/O
//!                           └─► sigstoreSigned:
//!        ┌── thread: store.referrers(digest)          (listing, in flight meanwhile)
//!        └── tag sha256-<hex>.sig ──► payloads (≤ 8 at once) ──► each rule accepted?
//!                 yes: done (the listing is not followed)
//!                 no:  referrer manifests ──► payloads ──► each rule accepted?
//! ```
//!
//! A signature is accepted by a `sigstoreSigned` rule when, in this order: its layer
//! carries the signature annotation; the signature (base64, ASN.1 ECDSA) verifies over the
//! payload's bytes under one of the rule's keys; the payload reads strictly; its
//! `docker-manifest-digest` is the image's manifest digest; and the rule's
//! `signedIdentity` accepts its `docker-reference`. One accepted signature satisfies the
//! rule; every requirement of the scope must be satisfied. The payload bytes used are
//! the layer's blob checked against the layer's digest; nothing else of the store is
//! trusted.

use std::sync::Mutex;

use base64::Engine as _;
use imgfmt::{Descriptor, FormatError, ImageStore, OciDigest};

use crate::identity::ImageIdentity;
use crate::key::{PrivateKey, PublicKey};
use crate::manifest::{self, ManifestError, MAX_SIGNATURE_MANIFEST_BYTES, MAX_SIGNATURE_REFERRERS, SIGNATURE_ANNOTATION, SIMPLE_SIGNING_TYPE};
use crate::payload::{Payload, MAX_PAYLOAD_BYTES};
use crate::policy::{KeySource, Policy, Requirement, SigstoreRule};

/// Payloads fetched at once.
const PAYLOAD_FETCHES: usize = 8;

/// One signature layer found for an image.
#[derive(Debug, Clone)]
pub struct Found {
    /// Where: `tag sha256-….sig` or `referrer sha256:…`, and the layer's position.
    pub place: String,
    pub layer: Descriptor,
    /// The payload's bytes checked against the layer's digest, or why there are none.
    pub payload: Result<Vec<u8>, String>,
}

/// What a store holds for an image: its signatures, and what was wrong with the rest.
#[derive(Debug, Default, Clone)]
pub struct Signatures {
    pub found: Vec<Found>,
    /// A signature manifest too large, malformed or missing its blobs: a refusal.
    pub problems: Vec<String>,
    /// Whether the tag-scheme manifest exists.
    pub tag_present: bool,
    /// Signature referrers listed.
    pub referrers: usize,
}

#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum CheckError {
    /// policy {policy}: {rule} ({requirement}) refused {image}: {reason}
    Refused { policy: String, rule: String, requirement: String, image: String, reason: String },
    /// reading signatures of {image} from {store}: {source}
    Store { image: String, store: String, source: FormatError },
}

/// An accepted image: which rule, and for each signature requirement the signature that
/// satisfied it.
#[derive(Debug, Clone)]
pub struct Accepted {
    pub rule: String,
    pub requirements: Vec<String>,
    pub signatures: Vec<AcceptedSignature>,
}

#[derive(Debug, Clone)]
pub struct AcceptedSignature {
    pub place: String,
    /// Fingerprint of the key that verified it ([`PublicKey::fingerprint`]).
    pub key: String,
    pub payload: Payload,
}

/// Whether a store error says the content is wrong or missing (a refusal) rather than
/// that the store could not be asked (an error).
fn content_problem(e: &FormatError) -> bool {
    e.is_integrity() || matches!(e, FormatError::BlobNotFound(_) | FormatError::TooLarge { .. })
}

fn manifest_problem(e: ManifestError) -> String {
    e.to_string()
}

/// The signature layers of one signature manifest, payloads fetched (at most
/// [`PAYLOAD_FETCHES`] at once) and checked against their digests.
fn fetch_layers(store: &dyn ImageStore, m: &imgfmt::Manifest, place: &str, out: &mut Signatures) -> Result<(), FormatError> {
    let layers: Vec<(usize, &Descriptor)> = m.layers.iter().enumerate().filter(|(_, l)| l.media_type == SIMPLE_SIGNING_TYPE).collect();
    let results: Mutex<Vec<Option<Found>>> = Mutex::new(vec![None; layers.len()]);
    imgfmt::work::try_for_each_index(
        layers.len(),
        PAYLOAD_FETCHES,
        || (),
        |_, i| {
            let (n, l) = layers[i];
            let payload = match store.read_blob_unverified(&l.digest, MAX_PAYLOAD_BYTES) {
                Ok(b) if OciDigest::of(&b) == l.digest && b.len() as u64 == l.size => Ok(b),
                Ok(_) => Err(format!("payload blob {} does not match its digest (tampered)", l.digest)),
                Err(e) if content_problem(&e) => Err(format!("payload blob {}: {e}", l.digest)),
                Err(e) => return Err(e),
            };
            results.lock().expect("poisoned")[i] = Some(Found { place: format!("{place} layer {n}"), layer: l.clone(), payload });
            Ok(())
        },
    )?;
    out.found.extend(results.into_inner().expect("poisoned").into_iter().flatten());
    Ok(())
}

/// The tag-scheme signatures of `digest`.
pub fn tag_signatures(store: &dyn ImageStore, digest: &OciDigest) -> Result<Signatures, FormatError> {
    let tag = manifest::signature_tag(digest);
    let mut out = Signatures::default();
    let bytes = match store.manifest_by_tag(&tag, MAX_SIGNATURE_MANIFEST_BYTES) {
        Ok(Some(b)) => b,
        Ok(None) => return Ok(out),
        Err(e) if content_problem(&e) => {
            out.problems.push(format!("tag {tag}: {e}"));
            return Ok(out);
        }
        Err(e) => return Err(e),
    };
    out.tag_present = true;
    match manifest::decode(&bytes) {
        Ok(m) => fetch_layers(store, &m, &format!("tag {tag}"), &mut out)?,
        Err(e) => out.problems.push(format!("tag {tag}: {}", manifest_problem(e))),
    }
    Ok(out)
}

/// The referrer signatures of `digest`, from a listing already made.
fn referrer_signatures(store: &dyn ImageStore, digest: &OciDigest, listed: Vec<Descriptor>) -> Result<Signatures, FormatError> {
    let mut out = Signatures { referrers: listed.len(), ..Default::default() };
    if listed.len() > MAX_SIGNATURE_REFERRERS {
        out.problems.push(format!("{} signature referrers, more than {MAX_SIGNATURE_REFERRERS}", listed.len()));
        return Ok(out);
    }
    for d in &listed {
        let place = format!("referrer {}", d.digest);
        let bytes = match store.manifest(&d.digest, MAX_SIGNATURE_MANIFEST_BYTES) {
            Ok(b) if OciDigest::of(&b) == d.digest => b,
            Ok(_) => {
                out.problems.push(format!("{place}: manifest does not match its digest"));
                continue;
            }
            Err(e) if content_problem(&e) => {
                out.problems.push(format!("{place}: {e}"));
                continue;
            }
            Err(e) => return Err(e),
        };
        let m = match manifest::decode(&bytes) {
            Ok(m) => m,
            Err(e) => {
                out.problems.push(format!("{place}: {}", manifest_problem(e)));
                continue;
            }
        };
        // A referrer is about its subject: one naming another image is not this one's.
        if m.subject.as_ref().map(|s| &s.digest) != Some(digest) {
            out.problems.push(format!("{place}: its subject is not {digest}"));
            continue;
        }
        fetch_layers(store, &m, &place, &mut out)?;
    }
    Ok(out)
}

/// Every signature of `digest` the store holds, tag scheme and referrers (for `inspect`).
pub fn all_signatures(store: &dyn ImageStore, digest: &OciDigest) -> Result<Signatures, FormatError> {
    let (tag, listed) = std::thread::scope(|s| {
        let listing = s.spawn(|| store.referrers(digest, Some(manifest::SIGNATURE_ARTIFACT_TYPE)));
        (tag_signatures(store, digest), listing.join().expect("listing thread"))
    });
    let mut all = tag?;
    let r = referrer_signatures(store, digest, listed?)?;
    all.referrers = r.referrers;
    all.found.extend(r.found);
    all.problems.extend(r.problems);
    Ok(all)
}

/// The keys of a rule, read now (a key file is read when the rule applies, as
/// containers/image does).
pub fn load_keys(rule: &SigstoreRule) -> Result<Vec<PublicKey>, String> {
    rule.keys
        .iter()
        .map(|k| {
            let text = match k {
                KeySource::Path(p) => {
                    use std::io::Read as _;
                    let mut b = Vec::new();
                    std::fs::File::open(p)
                        .and_then(|f| f.take(crate::key::MAX_KEY_FILE_BYTES + 1).read_to_end(&mut b))
                        .map_err(|e| format!("reading {}: {e}", p.display()))?;
                    b
                }
                KeySource::Data(d) => d.clone(),
            };
            PublicKey::from_pem(&text).map_err(|e| format!("{k}: {e}"))
        })
        .collect()
}

/// Whether `f` is a signature `keys` made of `digest` under a name `rule` accepts for
/// `image`: the accepted signature, or why not.
pub fn accept(f: &Found, keys: &[PublicKey], rule: &SigstoreRule, image: &ImageIdentity, digest: &OciDigest) -> Result<AcceptedSignature, String> {
    let payload = f.payload.as_ref().map_err(Clone::clone)?;
    let b64 = f.layer.annotations.get(SIGNATURE_ANNOTATION).ok_or_else(|| format!("no {SIGNATURE_ANNOTATION} annotation"))?;
    let sig = base64::engine::general_purpose::STANDARD.decode(b64.trim()).map_err(|_| "the signature annotation is not base64".to_string())?;
    let key = keys.iter().find(|k| k.verify(payload, &sig)).ok_or_else(|| {
        format!(
            "the signature does not verify with {} (another key, or a tampered payload or signature)",
            rule.keys.iter().map(|k| k.to_string()).collect::<Vec<_>>().join(", ")
        )
    })?;
    let p = Payload::decode(payload).map_err(|e| e.to_string())?;
    if p.manifest_digest != digest.as_str() {
        return Err(format!("it signs another manifest, {}", p.manifest_digest));
    }
    if !rule.signed_identity.accepts(image.docker.as_ref(), &p.docker_reference) {
        let name = image.docker.as_ref().map_or_else(|| format!("a layout ({}), which has no registry name", image.scope), |d| d.to_string());
        return Err(format!("it names {:?}, which signedIdentity {} does not accept for {name}", p.docker_reference, rule.signed_identity.type_name()));
    }
    Ok(AcceptedSignature { place: f.place.clone(), key: key.fingerprint(), payload: p })
}

/// Decide whether `policy` lets the image `digest` (named `image`) be restored, reading
/// its signatures from `store` only when a rule asks for them.
pub fn check(store: &dyn ImageStore, policy: &Policy, image: &ImageIdentity, digest: &OciDigest) -> Result<Accepted, CheckError> {
    let (rule, reqs) = policy.requirements_for(image);
    let name = image.docker.as_ref().map_or_else(|| image.scope.clone(), |d| d.to_string());
    let refuse = |i: usize, req: &Requirement, reason: String| CheckError::Refused {
        policy: policy.path.display().to_string(),
        rule: rule.clone(),
        requirement: format!("requirement {i}: {}", describe(req)),
        image: name.clone(),
        reason,
    };
    let store_err = |source| CheckError::Store { image: name.clone(), store: store.describe(), source };
    let mut rules = Vec::new();
    for (i, req) in reqs.iter().enumerate() {
        match req {
            Requirement::InsecureAcceptAnything => {}
            Requirement::Reject => return Err(refuse(i, req, "the rule rejects every image".into())),
            Requirement::SignedBy { key_type } => {
                return Err(refuse(i, req, format!("signedBy ({key_type}) signatures are not checked by snapctl (it checks sigstoreSigned)")));
            }
            Requirement::SignedBaseLayer => return Err(refuse(i, req, "signedBaseLayer is not implemented (nor by containers/image)".into())),
            Requirement::SigstoreSigned(r) => {
                if let Some(u) = &r.unsupported {
                    return Err(refuse(i, req, format!("uses {u}")));
                }
                let keys = load_keys(r).map_err(|e| refuse(i, req, e))?;
                rules.push((i, req, r, keys));
            }
        }
    }
    let requirements = reqs.iter().map(describe).collect();
    if rules.is_empty() {
        return Ok(Accepted { rule, requirements, signatures: Vec::new() });
    }
    std::thread::scope(|s| {
        let listing = s.spawn(|| store.referrers(digest, Some(manifest::SIGNATURE_ARTIFACT_TYPE)));
        let tag = tag_signatures(store, digest).map_err(store_err)?;
        let try_all = |sigs: &Signatures| -> Vec<Result<AcceptedSignature, Vec<String>>> {
            rules
                .iter()
                .map(|(_, _, r, keys)| {
                    let mut why = Vec::new();
                    for f in &sigs.found {
                        match accept(f, keys, r, image, digest) {
                            Ok(a) => return Ok(a),
                            Err(e) => why.push(format!("[{}] {e}", f.place)),
                        }
                    }
                    Err(why)
                })
                .collect()
        };
        let first = try_all(&tag);
        let mut sigs = tag;
        let verdicts = if first.iter().all(Result::is_ok) && sigs.problems.is_empty() {
            first
        } else {
            let listed = listing.join().expect("listing thread").map_err(store_err)?;
            let r = referrer_signatures(store, digest, listed).map_err(store_err)?;
            sigs.referrers = r.referrers;
            sigs.found.extend(r.found);
            sigs.problems.extend(r.problems);
            try_all(&sigs)
        };
        let mut accepted = Vec::new();
        for ((i, req, _, _), v) in rules.iter().zip(verdicts) {
            if !sigs.problems.is_empty() {
                return Err(refuse(*i, req, format!("malformed signature storage: {}", sigs.problems.join("; "))));
            }
            match v {
                Ok(a) => accepted.push(a),
                Err(why) if why.is_empty() => {
                    let tag = manifest::signature_tag(digest);
                    let at = if sigs.tag_present { format!("tag {tag} holds no signature layer") } else { format!("no tag {tag}") };
                    return Err(refuse(*i, req, format!("no signature ({at}, {} signature referrers)", sigs.referrers)));
                }
                Err(why) => {
                    return Err(refuse(*i, req, format!("none of the {} signatures was accepted: {}", why.len(), why.join("; "))));
                }
            }
        }
        Ok(Accepted { rule: rule.clone(), requirements, signatures: accepted })
    })
}

/// A requirement as messages name it: `sigstoreSigned, key /etc/keys/cosign.pub`.
pub fn describe(req: &Requirement) -> String {
    match req {
        Requirement::SigstoreSigned(r) => {
            format!("sigstoreSigned, {}, signedIdentity {}", r.keys.iter().map(|k| k.to_string()).collect::<Vec<_>>().join(", "), r.signed_identity.type_name())
        }
        other => other.type_name().to_string(),
    }
}

#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum SignError {
    /// {store}: {source}
    Store { store: String, source: FormatError },
    /// {store}: the signature manifest at tag {tag} is malformed ({reason}); not replacing it (other signers' signatures would be lost): delete the tag first
    ExistingMalformed { store: String, tag: String, reason: String },
    /// {store}: the signature manifest at tag {tag} cannot take another signature: {reason}
    Full { store: String, tag: String, reason: crate::manifest::ManifestError },
    /// signing: {0}
    Key(#[from] crate::key::KeyError),
}

/// What [`sign`] wrote.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SignReport {
    pub image: String,
    pub identity: String,
    pub key: String,
    /// `sha256-<hex>.sig`.
    pub tag: String,
    /// Signatures the tag holds now (other signers' included).
    pub tag_signatures: usize,
    /// The tag already held a signature of this key for this image and identity:
    /// nothing was written there.
    pub already_signed: bool,
    pub payload: String,
    /// The referrer manifest's digest, where the store has the referrers API.
    pub referrer: Option<String>,
}

/// Sign manifest `subject` (its descriptor: media type, digest, size) as `identity` with
/// `key`: a signature layer appended to the tag-scheme manifest, and, with `referrer` and
/// where the store indexes referrers, a referrer manifest of its own. `timestamp` goes in
/// the payload's `optional.timestamp`.
pub fn sign(
    store: &dyn ImageStore,
    subject: &Descriptor,
    identity: &str,
    key: &PrivateKey,
    referrer: bool,
    timestamp: Option<i64>,
) -> Result<SignReport, SignError> {
    let serr = |source| SignError::Store { store: store.describe(), source };
    let digest = &subject.digest;
    let tag = manifest::signature_tag(digest);
    let existing = match store.manifest_by_tag(&tag, MAX_SIGNATURE_MANIFEST_BYTES) {
        Ok(Some(b)) => {
            Some(manifest::decode(&b).map_err(|e| SignError::ExistingMalformed { store: store.describe(), tag: tag.clone(), reason: e.to_string() })?)
        }
        Ok(None) => None,
        Err(e) if content_problem(&e) => return Err(SignError::ExistingMalformed { store: store.describe(), tag, reason: e.to_string() }),
        Err(e) => return Err(serr(e)),
    };
    let public = key.public_key();
    // Signing twice with one key adds nothing: keep the tag as it is.
    let mut already = None;
    if let Some(m) = &existing {
        let mut sigs = Signatures::default();
        fetch_layers(store, m, &format!("tag {tag}"), &mut sigs).map_err(serr)?;
        already = sigs.found.iter().find_map(|f| {
            let (p, b64) = (f.payload.as_ref().ok()?, f.layer.annotations.get(SIGNATURE_ANNOTATION)?);
            let s = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
            let d = Payload::decode(p).ok()?;
            (public.verify(p, &s) && d.manifest_digest == digest.as_str() && d.docker_reference == identity).then(|| (p.clone(), f.layer.clone()))
        });
    }
    let (payload, layer, already_signed) = match already {
        Some((p, l)) => (p, l, true),
        None => {
            let payload = Payload::new(identity, digest, timestamp).encode();
            let sig = key.sign(&payload)?;
            (payload.clone(), manifest::signature_layer(&payload, &sig), false)
        }
    };
    store.put_blob(&payload).map_err(serr)?;
    let count = |m: &imgfmt::Manifest| m.layers.iter().filter(|l| l.media_type == SIMPLE_SIGNING_TYPE).count();
    let merged = if already_signed {
        None
    } else {
        manifest::tag_manifest(existing.as_ref(), [layer.clone()]).map_err(|reason| SignError::Full { store: store.describe(), tag: tag.clone(), reason })?
    };
    let tag_signatures = match merged {
        None => existing.as_ref().map_or(0, count),
        Some(t) => {
            store.put_blob(&t.config).map_err(serr)?;
            store.put_tagged_manifest(&tag, &t.manifest).map_err(serr)?;
            manifest::decode(&t.manifest).map(|m| count(&m)).unwrap_or(0)
        }
    };
    let mut referrer_digest = None;
    if referrer {
        let bytes = manifest::referrer_manifest(subject.clone(), layer);
        store.put_blob(b"{}").map_err(serr)?;
        if store.put_referrer(digest, &bytes).map_err(serr)? {
            referrer_digest = Some(OciDigest::of(&bytes).to_string());
        }
    }
    Ok(SignReport {
        image: digest.to_string(),
        identity: identity.into(),
        key: public.fingerprint(),
        tag,
        tag_signatures,
        already_signed,
        payload: OciDigest::of(&payload).to_string(),
        referrer: referrer_digest,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::DockerRef;
    use crate::mem::MemStore;
    use std::path::Path;

    struct World {
        store: MemStore,
        key: PrivateKey,
        image: OciDigest,
        subject: Descriptor,
    }

    fn world(referrers_api: bool) -> World {
        let store = MemStore { referrers_api, ..Default::default() };
        let image = store.put(b"{\"schemaVersion\":2,\"the\":\"image\"}");
        let subject = Descriptor::new(imgfmt::media::OCI_MANIFEST, image.clone(), 33);
        World { store, key: PrivateKey::generate().unwrap(), image, subject }
    }

    fn policy_for(key: &PublicKey, identity: &str) -> Policy {
        let data = base64::engine::general_purpose::STANDARD.encode(key.to_pem());
        let text = format!(
            r#"{{"default":[{{"type":"reject"}}],"transports":{{"docker":{{"r.io:5000/vm":[{{"type":"sigstoreSigned","keyData":"{data}","signedIdentity":{{"type":"{identity}"}}}}]}}}}}}"#
        );
        Policy::from_bytes(text.as_bytes(), Path::new("policy.json")).unwrap()
    }

    fn id(s: &str) -> ImageIdentity {
        ImageIdentity::docker(DockerRef::parse(s).unwrap())
    }

    fn refusal(r: Result<Accepted, CheckError>) -> String {
        match r {
            Err(e @ CheckError::Refused { .. }) => e.to_string(),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn a_signed_image_is_accepted_and_everything_else_refused() {
        let w = world(false);
        let p = policy_for(&w.key.public_key(), "matchRepoDigestOrExact");
        let img = id("r.io:5000/vm/web:v1");
        let e = refusal(check(&w.store, &p, &img, &w.image));
        assert!(e.contains("transports.docker.\"r.io:5000/vm\"") && e.contains("no signature (no tag sha256-"), "{e}");
        let r = sign(&w.store, &w.subject, "r.io:5000/vm/web:v1", &w.key, true, Some(1)).unwrap();
        assert!(!r.already_signed && r.referrer.is_none() && r.tag_signatures == 1);
        let ok = check(&w.store, &p, &img, &w.image).unwrap();
        assert_eq!(ok.signatures[0].key, w.key.public_key().fingerprint());
        // By tag v2: the signature names v1.
        let e = refusal(check(&w.store, &p, &id("r.io:5000/vm/web:v2"), &w.image));
        assert!(e.contains("does not accept"), "{e}");
        // By digest: any tag of the repository.
        check(&w.store, &p, &id(&format!("r.io:5000/vm/web@{}", w.image)), &w.image).unwrap();
        // Another repository under the same scope.
        let e = refusal(check(&w.store, &p, &id("r.io:5000/vm/other:v1"), &w.image));
        assert!(e.contains("names \"r.io:5000/vm/web:v1\""), "{e}");
        // Another image: its own signature tag is empty.
        let other = w.store.put(b"other manifest");
        let e = refusal(check(&w.store, &p, &img, &other));
        assert!(e.contains("no signature"), "{e}");
        // The signature manifest of this image copied under the other's tag.
        w.store.set_tag(&manifest::signature_tag(&other), &w.store.tagged(&manifest::signature_tag(&w.image)));
        let e = refusal(check(&w.store, &p, &img, &other));
        assert!(e.contains("it signs another manifest"), "{e}");
        // A wrong key.
        let p2 = policy_for(&PrivateKey::generate().unwrap().public_key(), "matchRepoDigestOrExact");
        let e = refusal(check(&w.store, &p2, &img, &w.image));
        assert!(e.contains("does not verify"), "{e}");
    }

    #[test]
    fn tampering_is_refused() {
        let w = world(false);
        let p = policy_for(&w.key.public_key(), "matchRepository");
        let img = id("r.io:5000/vm/web:v1");
        sign(&w.store, &w.subject, "r.io:5000/vm/web:v1", &w.key, false, None).unwrap();
        let tag = manifest::signature_tag(&w.image);
        let good = manifest::decode(&w.store.tagged(&tag)).unwrap();
        // A payload rewritten (another identity), its layer descriptor updated to match.
        let mut m = good.clone();
        let payload = String::from_utf8(w.store.get(&m.layers[0].digest)).unwrap().replace("vm/web:v1", "vm/web:v9");
        m.layers[0].digest = w.store.put(payload.as_bytes());
        m.layers[0].size = payload.len() as u64;
        w.store.set_tag(&tag, &m.encode());
        assert!(refusal(check(&w.store, &p, &img, &w.image)).contains("does not verify"));
        // A payload blob served with other bytes than its digest names.
        let mut m = good.clone();
        let original = w.store.get(&m.layers[0].digest);
        w.store.blobs.lock().unwrap().insert(m.layers[0].digest.clone(), payload.into_bytes());
        w.store.set_tag(&tag, &m.encode());
        assert!(refusal(check(&w.store, &p, &img, &w.image)).contains("does not match its digest"));
        // A signature with one bit flipped (over the original payload).
        w.store.put(&original);
        let text = m.layers[0].annotations[SIGNATURE_ANNOTATION].clone();
        let mut raw = base64::engine::general_purpose::STANDARD.decode(&text).unwrap();
        let n = raw.len();
        raw[n - 2] ^= 1;
        m.layers[0].annotations.insert(SIGNATURE_ANNOTATION.into(), base64::engine::general_purpose::STANDARD.encode(raw));
        w.store.set_tag(&tag, &m.encode());
        assert!(refusal(check(&w.store, &p, &img, &w.image)).contains("does not verify"));
        // A malformed and an oversized signature manifest.
        w.store.set_tag(&tag, b"{\"schemaVersion\":2,\"config\":7}");
        assert!(refusal(check(&w.store, &p, &img, &w.image)).contains("malformed signature storage"));
        w.store.set_tag(&tag, &vec![b' '; MAX_SIGNATURE_MANIFEST_BYTES as usize + 1]);
        assert!(refusal(check(&w.store, &p, &img, &w.image)).contains("limit"));
    }

    #[test]
    fn signatures_are_appended_once_per_key_and_referrers_are_read() {
        let w = world(true);
        let other = PrivateKey::generate().unwrap();
        sign(&w.store, &w.subject, "r.io:5000/vm/web", &other, false, None).unwrap();
        let r = sign(&w.store, &w.subject, "r.io:5000/vm/web", &w.key, true, None).unwrap();
        assert_eq!(r.tag_signatures, 2, "the other signer's layer is kept");
        assert!(r.referrer.is_some());
        let again = sign(&w.store, &w.subject, "r.io:5000/vm/web", &w.key, true, None).unwrap();
        assert!(again.already_signed && again.tag_signatures == 2);
        // Only in the referrer: the tag removed.
        w.store.tags.lock().unwrap().clear();
        let p = policy_for(&w.key.public_key(), "matchRepository");
        let ok = check(&w.store, &p, &id("r.io:5000/vm/web:v1"), &w.image).unwrap();
        assert!(ok.signatures[0].place.starts_with("referrer sha256:"), "{:?}", ok.signatures);
    }
}
