//! Moving an image between stores, keeping digests: the manifest's bytes are copied
//! verbatim, every blob it lists is streamed from the source and checked against its OCI
//! digest before the destination commits it (a registry's final PUT, a layout's rename).
//!
//! One engine serves `snapctl copy` (any direction), `snapctl push` (layout → registry,
//! see [`crate::push()`]) and `snapctl pull REF oci:PATH:TAG` (registry → layout).

use std::collections::BTreeSet;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Instant;

use imgfmt::manifest::MAX_MANIFEST_BYTES;
use imgfmt::source::read_verified_blob;
use imgfmt::{media, BlobSource, Descriptor, FormatError, Manifest, OciDigest, OciLayout};
use regclient::{ClientError, KnownBlobs, RegistrySource, UploadOptions, UploadProgress};
use serde::Serialize;

/// Where an image goes.
pub enum Target<'a> {
    Registry(&'a RegistrySource),
    Layout(&'a OciLayout),
}

impl Target<'_> {
    pub(crate) fn describe(&self) -> String {
        match self {
            Target::Registry(r) => r.describe(),
            Target::Layout(l) => l.describe(),
        }
    }
}

/// How to move blobs.
pub struct CopyOptions<'a> {
    /// Blobs moved at once (each one stream).
    pub jobs: usize,
    /// Repositories of the destination registry to try cross-mounting blobs from, before
    /// the ones the known-blobs record names.
    pub mount_from: Vec<String>,
    /// Upload piece size and resume state location (`cache_dir`); the cache directory
    /// also holds the known-blobs record (which repositories hold which blobs).
    pub upload: UploadOptions,
    /// Told how each blob goes, as it goes (`None`: nobody is told).
    pub observer: Option<&'a dyn TransferObserver>,
}

impl Default for CopyOptions<'_> {
    fn default() -> Self {
        CopyOptions { jobs: 4, mount_from: Vec::new(), upload: UploadOptions::default(), observer: None }
    }
}

/// What a copy tells its caller of each blob, as it goes, from the threads that move them
/// (progress bars; `push DIR`'s count of what it is to upload). Every method defaults to
/// nothing.
pub trait TransferObserver: Sync {
    /// `blob` is at the destination without being sent: it was there, or was mounted.
    fn found(&self, _blob: &Descriptor) {}
    /// `blob` is to be sent: all of it, less what `progress` then says was
    /// [`Skipped`](UploadProgress::Skipped), plus what it says is sent
    /// [`Again`](UploadProgress::Again).
    fn upload_starts(&self, _blob: &Descriptor) {}
    /// How the sending of `blob` goes.
    fn progress(&self, _blob: &Descriptor, _p: UploadProgress) {}
}

/// What a push or copy did (`--json`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct PushReport {
    /// Manifest digest (the same at source and destination).
    pub manifest: String,
    /// Where it went.
    pub destination: String,
    /// Bytes read from the source (blobs and manifest).
    pub bytes_read: u64,
    /// Blob bytes sent to the destination in request bodies or written to its files.
    pub bytes_sent: u64,
    /// Sum of the sizes of all blobs the manifest lists.
    pub bytes_total: u64,
    /// Blob bytes an earlier interrupted push had already uploaded (not sent again).
    pub bytes_resumed: u64,
    pub blobs: usize,
    /// Blobs the destination already had.
    pub skipped_blobs: usize,
    /// Blobs linked from another repository of the same registry.
    pub mounted_blobs: usize,
    pub uploaded_blobs: usize,
    /// Uploaded blobs that `--mount-from` or this host's record named in another
    /// repository of the registry, whose mount the registry declined (no pull access to
    /// that repository, or it no longer holds them).
    pub mounts_declined: usize,
    /// Chunks not sent because they are zero or their pack was already there (skipped or
    /// mounted). Snapshot images only; 0 for other artifacts.
    pub deduplicated_chunks: u64,
    /// Wall time of the whole command (for `push DIR`: packing included).
    pub seconds: f64,
    /// `push DIR` only: how the directory became an image (absent for images that were
    /// already packed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pack: Option<PackStep>,
    /// `copy`: the referrers and subject-named tags carried with the image.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub referrers: Vec<crate::attached::Attached>,
    /// `--sign-key`: the signature written for the manifest once it was in place.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signature: Option<sign::SignReport>,
}

/// The packing step of `push DIR` (spec/transfer.md §2).
#[derive(Debug, Clone, Default, Serialize)]
pub struct PackStep {
    /// The directory's stamp matched the one recorded when it was last packed with the same
    /// options, so the earlier manifest was pushed without reading the files.
    pub skipped: bool,
    /// Seconds spent stamping (and, unless skipped, packing) the directory; packs are sent
    /// to the registry during this time too, as soon as each is sealed.
    pub seconds: f64,
    /// Ancestors of the pushed image (0: a full image, rebased ones included).
    pub chain_depth: usize,
    /// The layer over `--parent` would have passed `--max-chain`, so a full index was
    /// written instead, pointing into packs the chain already stored: only the new index,
    /// config and manifest (and packs of chunks new in this snapshot) go up.
    pub rebased: bool,
    /// When rebased: the parent's manifest digest (provenance only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rebased_from: Option<String>,
}

#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum CopyError {
    /// {0}
    Client(#[from] ClientError),
    /// {0}
    Format(#[from] FormatError),
    /// {what}: {source}
    Io { what: String, source: std::io::Error },
    /// {0}
    Unsupported(String),
    /// blob {digest}: the manifest says {manifest} bytes, the source has {actual}
    SizeMismatch { digest: OciDigest, manifest: u64, actual: u64 },
    /// {store}: cannot add the copied signatures to tag {tag}, not replacing it (its signatures would be lost): {reason}
    SignatureTag { store: String, tag: String, reason: String },
}

impl CopyError {
    /// Whether the source's content failed a digest check (as opposed to "could not").
    pub fn is_integrity(&self) -> bool {
        matches!(
            self,
            CopyError::Client(ClientError::DigestMismatch { .. }) | CopyError::Format(FormatError::BlobDigestMismatch { .. }) | CopyError::SizeMismatch { .. }
        )
    }
}

/// Counts what is read from a source.
struct Counting<'a> {
    inner: &'a dyn BlobSource,
    n: AtomicU64,
}

impl imgfmt::source::Forward for Counting<'_> {
    fn inner(&self) -> &dyn BlobSource {
        self.inner
    }
    fn read_blob_unverified(&self, d: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError> {
        let b = self.inner.read_blob_unverified(d, limit)?;
        self.n.fetch_add(b.len() as u64, Relaxed);
        Ok(b)
    }
    fn read_at_unverified(&self, d: &OciDigest, offset: u64, buf: &mut [u8]) -> Result<(), FormatError> {
        self.inner.read_at_unverified(d, offset, buf)?;
        self.n.fetch_add(buf.len() as u64, Relaxed);
        Ok(())
    }
    fn read_range_unverified(&self, d: &OciDigest, offset: u64, len: usize) -> Result<bytes::Bytes, FormatError> {
        let b = self.inner.read_range_unverified(d, offset, len)?;
        self.n.fetch_add(b.len() as u64, Relaxed);
        Ok(b)
    }
}

/// Outcome of one blob.
/// What happened to one blob.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Moved {
    /// The destination had it.
    Skipped,
    /// Linked from another repository of the same registry.
    Mounted,
    Uploaded {
        sent: u64,
        resumed: u64,
        /// A mount was tried first and the registry declined it.
        declined: bool,
    },
}

/// Which repositories of a registry this host recorded as holding which blobs.
pub type KnownMap = std::collections::HashMap<OciDigest, BTreeSet<String>>;

/// The record of where blobs are that a copy to `target` mounts from (empty for a layout,
/// or without a cache directory).
pub fn known_blobs(target: &Target, opts: &CopyOptions) -> KnownMap {
    match (target, &opts.upload.cache_dir) {
        (Target::Registry(r), Some(c)) => KnownBlobs::new(c, r.host()).load(),
        _ => KnownMap::new(),
    }
}

/// The manifest at `digest` in `src` (checked against it) and the blobs it lists.
pub fn manifest_blobs(src: &dyn BlobSource, digest: &OciDigest) -> Result<(Vec<u8>, Manifest), CopyError> {
    let bytes = read_verified_blob(src, digest, MAX_MANIFEST_BYTES)?;
    let probe: serde_json::Value = serde_json::from_slice(&bytes).map_err(|source| FormatError::Json { what: "manifest", source })?;
    if probe.get("manifests").is_some() || probe.get("mediaType").and_then(|m| m.as_str()) == Some(media::OCI_INDEX) {
        return Err(CopyError::Unsupported(format!("{digest} is an image index: copy moves single image manifests")));
    }
    let m = Manifest::decode(&bytes)?;
    Ok((bytes, m))
}

/// Copy the manifest `digest` of `src`, with every blob it lists, to `target`, tagged
/// `tag` (or stored by digest only when `None`).
pub fn copy(src: &dyn BlobSource, digest: &OciDigest, target: &Target, tag: Option<&str>, opts: &CopyOptions) -> Result<PushReport, CopyError> {
    copy_after(src, digest, target, tag, opts, &[])
}

/// Send one blob to `target` now (HEAD, mount from the repositories `known` names, or
/// upload), ahead of the [`copy_after`] of the image that lists it: `push DIR` sends each
/// pack as soon as it is sealed.
pub fn send_blob(src: &dyn BlobSource, desc: &Descriptor, target: &Target, opts: &CopyOptions, known: &KnownMap) -> Result<Moved, CopyError> {
    move_blob(src, desc, target, opts, known)
}

/// [`copy`], when some blobs were already sent with [`send_blob`]: `ahead` says how, and
/// the report counts those (the copy itself then finds them at the destination).
pub fn copy_after(
    src: &dyn BlobSource,
    digest: &OciDigest,
    target: &Target,
    tag: Option<&str>,
    opts: &CopyOptions,
    ahead: &[(OciDigest, Moved)],
) -> Result<PushReport, CopyError> {
    let t0 = Instant::now();
    let src = Counting { inner: src, n: AtomicU64::new(0) };
    let (bytes, manifest) = manifest_blobs(&src, digest)?;
    let mut blobs: Vec<Descriptor> = Vec::new();
    let mut seen = BTreeSet::new();
    for d in std::iter::once(&manifest.config).chain(&manifest.layers) {
        if seen.insert(d.digest.clone()) {
            blobs.push(d.clone());
        }
    }
    // Largest first: the long uploads start early, small ones fill the gaps.
    blobs.sort_by_key(|b| std::cmp::Reverse(b.size));
    let known = match (target, &opts.upload.cache_dir) {
        (Target::Registry(r), Some(c)) => Some(KnownBlobs::new(c, r.host())),
        _ => None,
    };
    let known_map = known_blobs(target, opts);

    let results: Mutex<Vec<(OciDigest, Moved)>> = Mutex::new(Vec::new());
    imgfmt::work::try_for_each_index::<_, CopyError>(
        blobs.len(),
        opts.jobs.clamp(1, 64),
        || (),
        |_, i| {
            let desc = &blobs[i];
            let m = move_blob(&src, desc, target, opts, &known_map)?;
            results.lock().expect("poisoned").push((desc.digest.clone(), m));
            Ok(())
        },
    )?;
    // Blobs first, then the manifest: a registry may refuse a manifest whose blobs it
    // does not have, and a reader must never find a tag before its content.
    match target {
        Target::Registry(r) => {
            let reference = tag.map(str::to_string).unwrap_or_else(|| digest.to_string());
            let put = r.put_manifest(&reference, &bytes)?;
            if &put.digest != digest {
                return Err(ClientError::DigestMismatch { digest: digest.clone(), actual: put.digest }.into());
            }
        }
        Target::Layout(l) => {
            l.put_blob(&bytes)?;
            if let Some(t) = tag {
                let mt = manifest.media_type.clone().unwrap_or_else(|| media::OCI_MANIFEST.into());
                let mut desc = Descriptor::new(&mt, digest.clone(), bytes.len() as u64);
                desc.artifact_type = manifest.artifact_type.clone();
                l.set_tag(t, desc)?;
            }
        }
    }
    let mut results = results.into_inner().expect("poisoned");
    for (d, m) in results.iter_mut() {
        if *m == Moved::Skipped {
            if let Some((_, before)) = ahead.iter().find(|(a, _)| a == d) {
                *m = *before;
            }
        }
    }
    if let Some(k) = &known {
        let Target::Registry(r) = target else { unreachable!("known only for registries") };
        k.record(r.repository(), results.iter().map(|(d, _)| d));
    }
    let mut rep = PushReport {
        manifest: digest.to_string(),
        destination: target.describe(),
        bytes_total: blobs.iter().map(|b| b.size).sum(),
        blobs: blobs.len(),
        ..Default::default()
    };
    for (_, m) in &results {
        match m {
            Moved::Skipped => rep.skipped_blobs += 1,
            Moved::Mounted => rep.mounted_blobs += 1,
            Moved::Uploaded { sent, resumed, declined } => {
                rep.uploaded_blobs += 1;
                rep.bytes_sent += sent;
                rep.bytes_resumed += resumed;
                rep.mounts_declined += usize::from(*declined);
            }
        }
    }
    rep.deduplicated_chunks = chunks_not_sent(&src, digest, &results);
    // Blobs sent ahead were read from the source then, not through `src` here.
    let read_ahead: u64 = ahead.iter().map(|(_, m)| if let Moved::Uploaded { sent, .. } = m { *sent } else { 0 }).sum();
    rep.bytes_read = src.n.load(Relaxed) + read_ahead;
    rep.seconds = t0.elapsed().as_secs_f64();
    Ok(rep)
}

/// For a snapshot image: chunks that are zero, or whose pack the destination already had.
fn chunks_not_sent(src: &dyn BlobSource, digest: &OciDigest, results: &[(OciDigest, Moved)]) -> u64 {
    let Ok(img) = imgfmt::Image::open(src, digest) else { return 0 };
    let there: BTreeSet<&OciDigest> = results.iter().filter(|(_, m)| !matches!(m, Moved::Uploaded { .. })).map(|(d, _)| d).collect();
    img.files
        .iter()
        .flat_map(|f| &f.chunks)
        .filter(|c| match c.at {
            imgfmt::StoredAt::Zero => true,
            imgfmt::StoredAt::Pack { pack, .. } => img.packs.get(pack as usize).is_some_and(|p| there.contains(&p.digest)),
        })
        .count() as u64
}

fn move_blob(src: &dyn BlobSource, desc: &Descriptor, target: &Target, opts: &CopyOptions, known: &KnownMap) -> Result<Moved, CopyError> {
    let quiet = Quiet;
    let obs = opts.observer.unwrap_or(&quiet);
    let d = &desc.digest;
    match target {
        Target::Registry(r) => {
            if r.blob_exists(d)? {
                obs.found(desc);
                return Ok(Moved::Skipped);
            }
            let mut candidates: Vec<String> = opts.mount_from.iter().filter(|f| f.as_str() != r.repository()).cloned().collect();
            for k in KnownBlobs::repos_with(known, d, r.repository()) {
                if !candidates.contains(&k) {
                    candidates.push(k);
                }
            }
            // A few tries at most: each refused mount is a round trip.
            let mut declined = false;
            for from in candidates.iter().take(4) {
                match r.mount_blob(d, from) {
                    Ok(true) => {
                        obs.found(desc);
                        return Ok(Moved::Mounted);
                    }
                    Ok(false) => declined = true,
                    // A refused mount (no access to `from`, say) is not a failed push.
                    Err(e) if e.status().is_some_and(|s| (400..500).contains(&s)) => declined = true,
                    Err(e) => return Err(e.into()),
                }
            }
            if declined {
                tracing::debug!("{d}: the registry declined to mount it from {}: uploading", candidates.iter().take(4).cloned().collect::<Vec<_>>().join(", "));
            }
            let size = src.blob_size(d)?;
            if size != desc.size {
                return Err(CopyError::SizeMismatch { digest: d.clone(), manifest: desc.size, actual: size });
            }
            obs.upload_starts(desc);
            let up = r.upload_blob(d, size, src, &opts.upload, &|p| obs.progress(desc, p))?;
            Ok(Moved::Uploaded { sent: up.bytes_sent, resumed: up.resumed_from, declined })
        }
        Target::Layout(l) => {
            if l.has_blob(d) {
                obs.found(desc);
                return Ok(Moved::Skipped);
            }
            let size = src.blob_size(d)?;
            if size != desc.size {
                return Err(CopyError::SizeMismatch { digest: d.clone(), manifest: desc.size, actual: size });
            }
            obs.upload_starts(desc);
            write_blob(src, d, size, l, &|n| obs.progress(desc, UploadProgress::Sent(n)))?;
            Ok(Moved::Uploaded { sent: size, resumed: 0, declined: false })
        }
    }
}

/// The observer of a copy nobody watches.
struct Quiet;
impl TransferObserver for Quiet {}

/// Stream a blob into a layout, checking its digest before it gets its name (a mismatch
/// leaves nothing behind: the writer's temporary file is removed when dropped).
fn write_blob(src: &dyn BlobSource, d: &OciDigest, size: u64, l: &OciLayout, tick: &dyn Fn(u64)) -> Result<(), CopyError> {
    if d.algorithm() != "sha256" {
        return Err(CopyError::Unsupported(format!("{d}: layouts store sha256 blobs only")));
    }
    // The layout's writer hashes what it writes; `finish_as` names the blob only when that
    // digest is `d` (one SHA-256 pass over the bytes, not a second one here).
    let mut w = l.blob_writer()?;
    imgfmt::source::stream_blob_unverified(src, d, size, |piece| {
        w.write_all(piece).map_err(|source| CopyError::Io { what: format!("writing {d} into {}", l.describe()), source })?;
        tick(piece.len() as u64);
        Ok::<(), CopyError>(())
    })?;
    w.finish_as(d.clone())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A source whose blob `bad` lies about its content.
    struct Lying {
        inner: OciLayout,
        bad: OciDigest,
    }
    impl imgfmt::source::Forward for Lying {
        fn inner(&self) -> &dyn BlobSource {
            &self.inner
        }
        fn describe(&self) -> String {
            "lying".into()
        }
        fn read_at_unverified(&self, d: &OciDigest, o: u64, b: &mut [u8]) -> Result<(), FormatError> {
            self.inner.read_at_unverified(d, o, b)?;
            if d == &self.bad && !b.is_empty() {
                b[0] ^= 1;
            }
            Ok(())
        }
    }

    fn layout_with_image(dir: &std::path::Path) -> (OciLayout, OciDigest, OciDigest) {
        let l = OciLayout::open_or_create(dir).unwrap();
        let cfg = l.put_blob(b"{\"a\":1}").unwrap();
        let layer = l.put_blob(&vec![7u8; 100_000]).unwrap();
        let m = Manifest {
            schema_version: 2,
            media_type: Some(media::OCI_MANIFEST.into()),
            artifact_type: None,
            config: Descriptor::new("application/json", cfg, 7),
            layers: vec![Descriptor::new("application/octet-stream", layer.clone(), 100_000)],
            subject: None,
            annotations: Default::default(),
        };
        let md = l.put_blob(&m.encode()).unwrap();
        (l, md, layer)
    }

    #[test]
    fn layout_to_layout_keeps_digests_and_skips_what_is_there() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let (src, md, _) = layout_with_image(a.path());
        let dst = OciLayout::open_or_create(b.path()).unwrap();
        let opts = CopyOptions { upload: UploadOptions { cache_dir: None, ..Default::default() }, ..Default::default() };
        let r = copy(&src, &md, &Target::Layout(&dst), Some("v1"), &opts).unwrap();
        assert_eq!((r.blobs, r.uploaded_blobs, r.bytes_sent), (2, 2, 100_007));
        assert_eq!(dst.resolve_tag("v1").unwrap(), md);
        let again = copy(&src, &md, &Target::Layout(&dst), Some("v1"), &opts).unwrap();
        assert_eq!((again.skipped_blobs, again.bytes_sent), (2, 0));
    }

    #[test]
    fn a_lying_source_leaves_nothing_under_the_digest() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let (src, md, layer) = layout_with_image(a.path());
        let lying = Lying { inner: src, bad: layer.clone() };
        let dst = OciLayout::open_or_create(b.path()).unwrap();
        let opts = CopyOptions { upload: UploadOptions { cache_dir: None, ..Default::default() }, ..Default::default() };
        let e = copy(&lying, &md, &Target::Layout(&dst), Some("v1"), &opts).unwrap_err();
        assert!(e.is_integrity(), "{e}");
        assert!(!dst.has_blob(&layer));
        assert!(dst.resolve_tag("v1").is_err(), "no tag without its content");
    }
}
