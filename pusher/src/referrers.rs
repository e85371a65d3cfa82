//! What is attached to an image, and carrying it along a copy.
//!
//! ```text
//! source (registry or layout)                          destination
//!   OCI 1.1 referrers of the subject  ──copy──►  PUT by digest; listed by its referrers API,
//!     (referrers API, else the fallback              else added to the fallback index
//!      index tagged sha256-<hex>)                    (distribution 2.8 has no API)
//!   tags named after the subject      ──copy──►  the same tag (digests are kept, so the
//!     (cosign: sha256-<hex>.sig/.att/.sbom)          name still matches the subject); a .sig
//!                                                    the destination has gets the source's
//!                                                    signatures added, none of its own lost
//!   and what is attached to those (a signature of an SBOM), a few levels deep
//! ```
//!
//! Every referrer is an ordinary manifest to the copy engine ([`crate::copy`]): its bytes
//! are copied verbatim (a signature still verifies), its blobs streamed and checked
//! (a snapctl trace's working-set blob with it).

use std::collections::{BTreeMap, BTreeSet, HashSet};

use imgfmt::manifest::MAX_MANIFEST_BYTES;
use imgfmt::source::read_verified_blob;
use imgfmt::{media, BlobSource, Descriptor, FormatError, ImageStore, OciDigest};

pub use crate::attached::Attached;
use crate::copy::{copy_after, CopyError, CopyOptions, Target};

pub use imgfmt::store::COSIGN_SUFFIXES;
/// How deep attached artifacts of attached artifacts are followed.
pub const MAX_DEPTH: usize = 3;
/// Most attached artifacts carried for one image (a bound against a source that lists
/// without end; a sandbox's restores each add a trace).
pub const MAX_ATTACHED: usize = 4096;

/// A manifest's descriptor fields from its (verified) bytes.
fn described(src: &dyn BlobSource, subject: &OciDigest, d: &OciDigest, tag: Option<String>) -> Result<Attached, CopyError> {
    let bytes = read_verified_blob(src, d, MAX_MANIFEST_BYTES)?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(|source| FormatError::Json { what: "attached manifest", source })?;
    let media_type = v.get("mediaType").and_then(|m| m.as_str()).unwrap_or(media::OCI_MANIFEST).to_string();
    let artifact_type = v.get("artifactType").or_else(|| v.pointer("/config/mediaType")).and_then(|m| m.as_str()).map(str::to_owned);
    let annotations = v.get("annotations").and_then(|a| serde_json::from_value(a.clone()).ok()).unwrap_or_default();
    Ok(Attached { subject: subject.clone(), digest: d.clone(), media_type, artifact_type, size: bytes.len() as u64, tag, annotations })
}

/// What is attached to `subject` at `origin` directly: OCI 1.1 referrers and tags named
/// after it. A listed referrer that names its artifact type (a registry's referrers API)
/// is taken as listed; one that does not (a layout's fallback index may hold a bare
/// manifest) is read for its fields.
pub fn attached(origin: &dyn ImageStore, subject: &OciDigest) -> Result<Vec<Attached>, CopyError> {
    let mut out = Vec::new();
    for d in origin.referrers(subject, None)? {
        if d.artifact_type.is_some() {
            out.push(Attached {
                subject: subject.clone(),
                digest: d.digest,
                media_type: d.media_type,
                artifact_type: d.artifact_type,
                size: d.size,
                tag: None,
                annotations: d.annotations,
            });
            continue;
        }
        let mut a = described(origin, subject, &d.digest, None)?;
        a.annotations.extend(d.annotations);
        out.push(a);
    }
    for (tag, d) in origin.attached_tags(subject)? {
        out.push(described(origin, subject, &d, Some(tag))?);
    }
    Ok(out)
}

/// [`attached`] of `subject` and, up to [`MAX_DEPTH`] levels, of what is attached to it,
/// each once (subjects before what refers to them).
pub fn attached_tree(origin: &dyn ImageStore, subject: &OciDigest) -> Result<Vec<Attached>, CopyError> {
    let mut out: Vec<Attached> = Vec::new();
    let mut seen: HashSet<OciDigest> = [subject.clone()].into_iter().collect();
    let mut level = vec![subject.clone()];
    for _ in 0..MAX_DEPTH {
        let mut next = Vec::new();
        for s in &level {
            for a in attached(origin, s)? {
                if seen.insert(a.digest.clone()) {
                    if out.len() >= MAX_ATTACHED {
                        return Err(CopyError::Unsupported(format!("{subject}: more than {MAX_ATTACHED} attached artifacts")));
                    }
                    next.push(a.digest.clone());
                    out.push(a);
                }
            }
        }
        if next.is_empty() {
            break;
        }
        level = next;
    }
    Ok(out)
}

/// Copy everything attached to `subject` at `origin` (which the copy of `subject` has
/// brought to `target` already) to `target`, and make the OCI 1.1 referrers findable
/// there: by its referrers API, else by the fallback index. Returns what was carried.
/// An attached image index is skipped with a warning (copy moves single manifests).
pub fn copy_attached(origin: &dyn ImageStore, subject: &OciDigest, target: &Target, opts: &CopyOptions) -> Result<Vec<Attached>, CopyError> {
    let found = attached_tree(origin, subject)?;
    let quiet = CopyOptions { jobs: opts.jobs, mount_from: opts.mount_from.clone(), upload: opts.upload.clone(), observer: None };
    let mut carried = Vec::new();
    let mut to_index: BTreeMap<OciDigest, Vec<Descriptor>> = BTreeMap::new();
    for a in found {
        let merged = match a.tag.as_deref() {
            Some(t) if t.ends_with(".sig") => merge_signature_tag(origin, &a.digest, t, target, &quiet)?,
            _ => false,
        };
        if merged {
            carried.push(a);
            continue;
        }
        match copy_after(origin, &a.digest, target, a.tag.as_deref(), &quiet, &[]) {
            Ok(_) => {}
            Err(CopyError::Unsupported(why)) => {
                tracing::warn!(digest = %a.digest, %why, "attached artifact not carried");
                continue;
            }
            Err(e) => return Err(e),
        }
        if a.tag.is_none() {
            to_index.entry(a.subject.clone()).or_default().push(a.descriptor());
        }
        carried.push(a);
    }
    for (s, descs) in to_index {
        match target {
            Target::Registry(r) => {
                let listed: BTreeSet<OciDigest> = r.list_referrers(&s, None)?.into_iter().map(|d| d.digest).collect();
                let missing: Vec<Descriptor> = descs.into_iter().filter(|d| !listed.contains(&d.digest)).collect();
                if !missing.is_empty() {
                    r.add_referrers_fallback(&s, &missing)?;
                }
            }
            Target::Layout(l) => l.add_referrers(&s, &descs)?,
        }
    }
    Ok(carried)
}

/// The manifest tagged `tag` at `target` (unverified: a tag names no digest), if any.
fn tagged_at(target: &Target, tag: &str) -> Result<Option<Vec<u8>>, CopyError> {
    let limit = sign::manifest::MAX_SIGNATURE_MANIFEST_BYTES;
    Ok(match target {
        Target::Registry(r) => r.get_manifest(tag, limit)?,
        Target::Layout(l) => match l.resolve_tag(tag) {
            Ok(d) => Some(read_verified_blob(*l, &d, limit)?),
            Err(FormatError::TagNotFound { .. }) => None,
            Err(e) => return Err(e.into()),
        },
    })
}

/// A cosign signature tag (`sha256-<hex>.sig`) that `target` holds already, for another
/// manifest than `digest` at `src`: the source's signature layers are added to the
/// destination's with the same merge `snapctl sign` uses, so the signers the destination
/// had keep their signatures (a copy never drops one). Returns false when there is
/// nothing to merge with (the tag is absent there, or names this very manifest): the
/// caller copies the tag as it is.
fn merge_signature_tag(src: &dyn BlobSource, digest: &OciDigest, tag: &str, target: &Target, opts: &CopyOptions) -> Result<bool, CopyError> {
    let Some(theirs) = tagged_at(target, tag)? else { return Ok(false) };
    if &OciDigest::of(&theirs) == digest {
        return Ok(false);
    }
    let refuse = |reason: String| CopyError::SignatureTag { store: target.describe(), tag: tag.into(), reason };
    let theirs = sign::manifest::decode(&theirs).map_err(|e| refuse(format!("the destination's is malformed ({e}); delete the tag to replace it")))?;
    let (ours, _) = crate::copy::manifest_blobs(src, digest)?;
    let ours = sign::manifest::decode(&ours).map_err(|e| refuse(format!("the source's is malformed ({e})")))?;
    let Some(merged) = sign::manifest::tag_manifest(Some(&theirs), ours.layers.iter().cloned()).map_err(|e| refuse(e.to_string()))? else {
        return Ok(true);
    };
    for l in &ours.layers {
        crate::copy::send_blob(src, l, target, opts, &Default::default())?;
    }
    match target {
        Target::Registry(r) => {
            r.push_small_blob(&merged.config)?;
            r.put_manifest(tag, &merged.manifest)?;
        }
        Target::Layout(l) => {
            l.put_blob(&merged.config)?;
            let d = l.put_blob(&merged.manifest)?;
            l.set_tag(tag, Descriptor::new(media::OCI_MANIFEST, d, merged.manifest.len() as u64))?;
        }
    }
    tracing::info!(%tag, store = %target.describe(), had = theirs.layers.len(), "copied signatures added to the destination's");
    Ok(true)
}
