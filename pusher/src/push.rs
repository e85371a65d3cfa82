//! Push: an image in any [`BlobSource`] (usually a local layout) goes to a repository of
//! an OCI registry. Blobs the registry has are skipped (HEAD), blobs other repositories of
//! the same registry hold are cross-mounted (`--mount-from`, and the local record of
//! where blobs were pushed to or pulled from), the rest are uploaded in parallel, large
//! ones in resumable pieces; then the manifest is PUT under the tag.
//!
//! `push DIR` ([`push_dir`]) works from one walk of the directory ([`DirScan`]): it packs
//! the directory into a layout of its own under the cache directory, and sends each pack
//! while the next is being made:
//! ```text
//! DirScan (one walk) -> no regular file? refused
//!   |
//!   v
//! closest image of the repository (crate::closest) -> the parent, unless one is named
//!   |
//!   v
//! stamp (the walk's names, sizes, times, inodes) --same as last time--> recorded manifest, nothing read
//!   | changed
//!   v
//! pack --on_pack--> senders (up to 4 threads): each sealed pack goes up at once
//!   |                 entries looked up again (no walk): unchanged? the stamp is recorded
//!   v
//! "previous" tag: same index and packs as last time -> that manifest (only the time differed)
//!   |
//!   v
//! copy: what is not there yet (the packs sent ahead are found there), manifest PUT
//! ```
//! The caller's [`PushObserver`] is told each step (the parent, packing progress, the
//! bytes to upload and uploaded); `crate::observe` keeps the count of what is to upload.
//! The stamp is specified in `spec/transfer.md` §2.
//!
//! What stays on the host: the layout is held in use (a shared [`UseLock`]) from packing
//! to the end of the push, so an eviction of the cache directory leaves it alone; once
//! the registry has the image, its packs are deleted from the layout, which keeps only
//! the metadata the next push of the directory builds on (manifests, configs, indexes,
//! outboards): a push needs the packs only until they are uploaded (resuming), and a
//! layer over the pushed image needs none of them (spec/cache.md §7).

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use imgfmt::file::UseLock;
use imgfmt::{media, BlobSource, Descriptor, FormatError, OciDigest, OciLayout};
use regclient::RegistrySource;

use crate::copy::{copy, copy_after, send_blob, CopyError, CopyOptions, Moved, PackStep, PushReport, Target};
use crate::observe::UploadTally;
pub use crate::observe::{ParentNote, PushObserver, Reused};
use crate::pack::{pack_scanned, same_files, PackError, PackOptions, PackReport, Related};
use crate::scan::{DirScan, ScanError};
use crate::stamp::Stamp;

/// Push manifest `digest` of `src`, with all its blobs, to `dest`'s repository as `tag`.
pub fn push(src: &dyn BlobSource, digest: &OciDigest, dest: &RegistrySource, tag: &str, opts: &CopyOptions) -> Result<PushReport, CopyError> {
    imgfmt::layout::check_tag(tag)?;
    copy(src, digest, &Target::Registry(dest), Some(tag), opts)
}

/// Why `push DIR` failed. The doc comment of each variant is its message.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum PushError {
    /// {0}
    Scan(#[from] ScanError),
    /// {what}
    Io { what: String, source: std::io::Error },
    /// {what}
    Format { what: String, source: FormatError },
    /// packing {dir}
    Pack { dir: String, source: Box<PackError> },
    /// {0}
    Copy(#[from] CopyError),
}

/// How `push DIR` packs a directory.
pub struct DirOptions<'a> {
    /// How to pack: `parent` is a parent named by the caller (`--parent`), if any;
    /// `progress` and `on_pack` are set by [`push_dir`] (the observer is told the
    /// progress; each pack is sent ahead).
    pub pack: PackOptions<'a>,
    /// Names the pack options (and the packer's version) in the directory's stamp: a stamp
    /// recorded under another key is not trusted. Stamps are not used with a base or a
    /// named parent, whose content can change under the same name.
    pub options_key: String,
    /// The cache directory: the layout packed into and the stamp live under
    /// `push-layouts/`.
    pub cache_dir: PathBuf,
    /// With no parent named: the new image is made over the closest image of the
    /// destination repository, among the destination tag and this many others
    /// ([`crate::closest::DEFAULT_CANDIDATES`] is what `snapctl push` examines). `None`:
    /// none is looked for (a full image).
    pub closest: Option<usize>,
}

/// What `push DIR` did.
#[derive(Debug, Clone)]
pub struct PushDirReport {
    /// The push (`--json`), its packing step included.
    pub push: PushReport,
    /// The manifest pushed.
    pub manifest: OciDigest,
    /// How packing went (`None`: not packed, [`Reused::Stamp`]).
    pub pack: Option<PackReport>,
    /// Whether an earlier image was pushed instead of the one just packed.
    pub reused: Option<Reused>,
}

/// Push the directory `scan` walked to `dest` as `tag`: packed into a layout under the
/// cache directory (made over the closest image of the repository, unless
/// `opts` name a parent or want none), each pack sent as soon as it is sealed, then what
/// is left and the manifest. The directory is not walked again: every step reads the
/// files `scan` lists. `observer` is told how it goes. Once the registry has the image,
/// the layout drops its packs.
pub fn push_dir(
    scan: &DirScan,
    dest: &RegistrySource,
    tag: &str,
    opts: DirOptions<'_>,
    copy: &CopyOptions,
    observer: &dyn PushObserver,
) -> Result<PushDirReport, PushError> {
    let started = Instant::now();
    imgfmt::layout::check_tag(tag).map_err(CopyError::from)?;
    scan.require_files()?;
    observer.scanned(scan);
    // The metadata of the image pushed last from this directory is in its push layout:
    // read there, not fetched again.
    let local = LocalFirst::new(&scan.dir, &opts.cache_dir, dest);
    let closest = match (&opts.pack.parent, opts.closest) {
        (None, Some(max)) => closest_parent(scan, dest, &local, &opts, tag, max, observer),
        _ => None,
    };
    let DirOptions { pack, options_key, cache_dir, .. } = opts;
    let from_closest = closest.is_some();
    let packed_bytes = |n: u64| observer.packed(n);
    let pack = PackOptions {
        parent: closest.or(pack.parent),
        // The closest image's packs are in the repository pushed to already.
        parent_packs_elsewhere: pack.parent_packs_elsewhere || from_closest,
        progress: Some(&packed_bytes),
        ..pack
    };
    let tally = UploadTally::new(observer);
    let job = PackJob { scan, dest, pack, options_key, cache_dir, parent_is_the_tags: from_closest };
    let packed = pack_dir(job, copy, &tally, observer)?;
    let mut push = push_packed(&packed, dest, tag, copy, &tally)?;
    push.seconds = started.elapsed().as_secs_f64();
    Ok(PushDirReport { push, manifest: packed.digest, pack: packed.report, reused: packed.reused })
}

/// The closest image of `dest`'s repository ([`crate::closest`]), read through `source`,
/// as the parent of the new image; `observer` is told which and why, or why none.
fn closest_parent<'s>(
    scan: &DirScan,
    dest: &RegistrySource,
    source: &'s dyn BlobSource,
    opts: &DirOptions<'_>,
    tag: &str,
    max: usize,
    observer: &dyn PushObserver,
) -> Option<Related<'s>> {
    let last = last_packed(&scan.dir, &opts.cache_dir);
    let search = crate::closest::closest_image(dest, source, scan, &opts.pack, tag, last.as_ref(), max);
    let Some(c) = search.chosen else {
        observer.parent(&ParentNote::None { why: &search.none_because });
        return None;
    };
    let reference = format!("{}/{}:{}", dest.host(), dest.repository(), c.tag);
    let image = imgfmt::Image::open(source, &c.digest)
        .map_err(|e| e.to_string())
        .and_then(|img| same_files(&img, scan, &opts.pack).map(|()| img).map_err(|e| e.to_string()));
    match image {
        Ok(image) => {
            observer.parent(&ParentNote::Taken { reference: &reference, digest: &c.digest, why: &c.why });
            Some(Related { source, image, reference })
        }
        Err(why) => {
            observer.parent(&ParentNote::NotTaken { reference: &reference, why: &why });
            None
        }
    }
}

/// What [`pack_dir`] packs, and how.
struct PackJob<'a> {
    scan: &'a DirScan,
    dest: &'a RegistrySource,
    pack: PackOptions<'a>,
    options_key: String,
    cache_dir: PathBuf,
    /// `pack.parent` is the closest image, taken by itself (not named): the directory's
    /// stamp still applies, since an unchanged directory is pushed as the image it was
    /// last packed to, whatever the repository holds now.
    parent_is_the_tags: bool,
}

/// A directory packed for a push.
struct PackedDir {
    /// The layout under the cache directory that holds the image.
    layout: OciLayout,
    /// Its manifest.
    digest: OciDigest,
    /// How packing went (`None`: not packed, [`Reused::Stamp`]).
    report: Option<PackReport>,
    /// Whether an earlier image was used instead of the one just packed.
    reused: Option<Reused>,
    /// The packing step for the push report.
    step: PackStep,
    /// The packs sent while packing, and how each went.
    ahead: Vec<(OciDigest, Moved)>,
    /// Held from packing to the end of the push: an eviction leaves the layout alone.
    lock: UseLock,
}

/// Pack as `job` says, sending each pack to `job.dest` as soon as it is sealed, on up to
/// 4 threads: the upload of one pack overlaps the packing of the next instead of
/// starting when packing is over. A pack whose early send failed is left to
/// [`push_packed`], which sends it again (resuming) and reports. `tally` counts each
/// sealed pack, and the image's own metadata once packing is done, as bytes to upload.
fn pack_dir(job: PackJob<'_>, copy: &CopyOptions, tally: &UploadTally<'_>, observer: &dyn PushObserver) -> Result<PackedDir, PushError> {
    let started = Instant::now();
    let dest = job.dest;
    let root = layout_root(&job.scan.dir, &job.cache_dir)?;
    let lock = hold_layout(&root)?;
    let packs = OciLayout::open_or_create(&root).map_err(|source| PushError::Format { what: format!("opening {}", root.display()), source })?;
    let copy = CopyOptions {
        jobs: copy.jobs,
        mount_from: copy.mount_from.clone(),
        // The pack writer hashed every pack as it wrote it; the registry checks that
        // digest when it commits the blob. Hashing the bytes again on the way out was a
        // quarter of the push's CPU (a 2 GiB image on 2 cores: the 20:39 run of
        // bench/results/BENCHMARKS-diary-2026-11-29-to-12-01.md, "What changed").
        upload: regclient::UploadOptions { source_hashed: true, ..copy.upload.clone() },
        observer: Some(tally),
    };
    let target = Target::Registry(dest);
    // Packs this host pushed to (or pulled from) another repository of the registry are
    // mounted from there, not uploaded again.
    let known = crate::copy::known_blobs(&target, &copy);
    let ahead = Mutex::new(Vec::new());
    let (tx, rx) = std::sync::mpsc::channel::<(OciDigest, u64)>();
    let rx = Mutex::new(rx);
    // Not `imgfmt::work`: the senders take packs from a channel as the packer seals them,
    // not from a list known up front.
    let packed = std::thread::scope(|s| {
        for _ in 0..copy.jobs.clamp(1, 4) {
            s.spawn(|| loop {
                let next = rx.lock().expect("poisoned").recv();
                let Ok((d, size)) = next else { return };
                let desc = Descriptor::new(media::PACK, d.clone(), size);
                match send_blob(&packs, &desc, &target, &copy, &known) {
                    Ok(m) => ahead.lock().expect("poisoned").push((d, m)),
                    Err(e) => {
                        tracing::debug!("sending pack {d} ahead: {e}");
                        tally.failed(&d);
                    }
                }
            });
        }
        let tx = tx;
        let send = |d: &OciDigest, size: u64| {
            tally.expect(d, size);
            let _ = tx.send((d.clone(), size));
        };
        let packed = pack_directory(job, Some(&send))?;
        let (layout, digest, report, reused) = &packed;
        if reused.is_none() {
            for d in own_metadata(layout, digest) {
                tally.expect(&d.digest, d.size);
            }
        }
        observer.packing_done(*reused, report.as_ref());
        Ok::<_, PushError>(packed)
        // `tx` goes here: the senders finish what is queued, then stop.
    });
    let (layout, digest, report, reused) = packed?;
    let step = PackStep {
        skipped: report.is_none(),
        seconds: started.elapsed().as_secs_f64(),
        // The tag's own image pushed again: its depth, not that of the layer packed over it.
        chain_depth: report.as_ref().map_or(0, |r| r.chain_depth.saturating_sub(usize::from(reused == Some(Reused::Parent)))),
        rebased: report.as_ref().is_some_and(|r| r.rebased),
        rebased_from: report.as_ref().and_then(|r| r.rebased_from.clone()),
    };
    Ok(PackedDir { layout, digest, report, reused, step, ahead: ahead.into_inner().expect("poisoned"), lock })
}

/// The blobs of the image `digest` in `layout` that it made itself and are no pack: its
/// config and its own index and outboard (what goes up after the packs).
fn own_metadata(layout: &OciLayout, digest: &OciDigest) -> Vec<Descriptor> {
    let Ok(bytes) = imgfmt::source::read_verified_blob(layout, digest, imgfmt::manifest::MAX_MANIFEST_BYTES) else { return Vec::new() };
    let Ok(m) = imgfmt::Manifest::decode(&bytes) else { return Vec::new() };
    let own = m.layers.into_iter().filter(|d| d.media_type != media::PACK && d.annotations.get(media::ANN_OWNER).is_some_and(|o| o == "self"));
    std::iter::once(m.config).chain(own).collect()
}

/// Push a directory packed by [`pack_dir`] to `dest` as `tag`: what was not sent ahead
/// goes up, then the manifest. The report includes the packing step, and the bytes of
/// early sends that failed (sent, and sent again). Once the registry has the image, the
/// layout drops its packs ([`keep_metadata_only`]).
fn push_packed(packed: &PackedDir, dest: &RegistrySource, tag: &str, copy: &CopyOptions, tally: &UploadTally<'_>) -> Result<PushReport, CopyError> {
    let opts = CopyOptions { jobs: copy.jobs, mount_from: copy.mount_from.clone(), upload: copy.upload.clone(), observer: Some(tally) };
    let mut report = copy_after(&packed.layout, &packed.digest, &Target::Registry(dest), Some(tag), &opts, &packed.ahead)?;
    report.bytes_sent += tally.lost();
    report.pack = Some(packed.step.clone());
    // The push is done whatever happens here: a layout that keeps its packs only holds
    // more than it needs until the next push (or an eviction).
    match keep_metadata_only(&packed.layout, &packed.lock) {
        Ok(freed) => tracing::debug!("{}: {freed} bytes of pushed packs dropped", packed.layout.root().display()),
        Err(e) => tracing::warn!("{}: dropping the pushed packs: {e}", packed.layout.root().display()),
    }
    Ok(report)
}

/// After a push the registry has every pack of the layout's images: keep only what the
/// next push of the directory reads (each tagged image's manifest, config and metadata
/// layers: indexes, outboards, ancestors' configs), and delete the rest (packs, and
/// images no tag names any more). Skipped while another push of the same directory holds
/// the layout. Returns the bytes freed.
fn keep_metadata_only(layout: &OciLayout, lock: &UseLock) -> Result<u64, FormatError> {
    let io = |context: String| move |source| FormatError::Io { context, source };
    if !lock.try_upgrade().map_err(io(format!("locking {}", layout.root().display())))? {
        return Ok(0);
    }
    let mut keep = std::collections::BTreeSet::new();
    for (_, desc) in layout.tags()? {
        let Ok(bytes) = imgfmt::source::read_verified_blob(layout, &desc.digest, imgfmt::manifest::MAX_MANIFEST_BYTES) else { continue };
        keep.insert(desc.digest.hex().to_string());
        if let Ok(m) = imgfmt::Manifest::decode(&bytes) {
            keep.insert(m.config.digest.hex().to_string());
            keep.extend(m.layers.iter().filter(|d| d.media_type != media::PACK).map(|d| d.digest.hex().to_string()));
        }
    }
    let blobs = layout.root().join("blobs").join("sha256");
    let dir = imgfmt::file::Dir::open(&blobs).map_err(io(format!("opening {}", blobs.display())))?;
    let mut freed = 0;
    for name in dir.names().map_err(io(format!("listing {}", blobs.display())))? {
        let Some(n) = name.to_str() else { continue };
        // Only blobs by their names: a writer's temp file is the layout's to clean.
        if n.len() != 64 || !n.bytes().all(|b| b.is_ascii_hexdigit()) || keep.contains(n) {
            continue;
        }
        let size = std::fs::symlink_metadata(blobs.join(n)).map(|m| {
            use std::os::unix::fs::MetadataExt;
            m.blocks() * 512
        });
        if dir.remove_file(&name).is_ok() {
            freed += size.unwrap_or(0);
        }
    }
    Ok(freed)
}

/// Hold the layout at `root` in use (its lock is `<root>.lock`, beside it, so that
/// deleting the layout does not delete the lock a waiting push holds).
fn hold_layout(root: &Path) -> Result<UseLock, PushError> {
    let parent = root.parent().expect("a push layout has a parent");
    std::fs::create_dir_all(parent).map_err(|source| PushError::Io { what: format!("creating {}", parent.display()), source })?;
    let path = lock_path(root);
    UseLock::shared(&path).map_err(|source| PushError::Io { what: format!("locking {}", path.display()), source })
}

/// `push-layouts/<key>.lock` for the layout `push-layouts/<key>`.
fn lock_path(root: &Path) -> PathBuf {
    root.with_extension("lock")
}

/// Blobs from the push layout of a directory when it has them, else from the registry: an
/// image made over the one pushed last reads that image's metadata (kept by the layout)
/// without fetching it again. Readers check every blob against its digest, wherever it
/// came from.
pub struct LocalFirst<'a> {
    local: Option<OciLayout>,
    remote: &'a dyn BlobSource,
}

impl<'a> LocalFirst<'a> {
    /// The push layout of `dir` under `cache_dir` (if there is one yet) in front of `remote`.
    pub fn new(dir: &Path, cache_dir: &Path, remote: &'a dyn BlobSource) -> LocalFirst<'a> {
        let local = layout_root(dir, cache_dir).ok().and_then(|r| OciLayout::open(r).ok());
        LocalFirst { local, remote }
    }

    fn local(&self, d: &OciDigest) -> Option<&OciLayout> {
        self.local.as_ref().filter(|l| l.has_blob(d))
    }
}

impl imgfmt::source::Forward for LocalFirst<'_> {
    fn inner(&self) -> &dyn BlobSource {
        self.remote
    }
    fn read_blob_unverified(&self, d: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError> {
        match self.local(d) {
            Some(l) => l.read_blob_unverified(d, limit),
            None => self.remote.read_blob_unverified(d, limit),
        }
    }
    fn blob_size(&self, d: &OciDigest) -> Result<u64, FormatError> {
        match self.local(d) {
            Some(l) => l.blob_size(d),
            None => self.remote.blob_size(d),
        }
    }
    fn read_at_unverified(&self, d: &OciDigest, offset: u64, buf: &mut [u8]) -> Result<(), FormatError> {
        match self.local(d) {
            Some(l) => l.read_at_unverified(d, offset, buf),
            None => self.remote.read_at_unverified(d, offset, buf),
        }
    }
    fn read_range_unverified(&self, d: &OciDigest, offset: u64, len: usize) -> Result<bytes::Bytes, FormatError> {
        match self.local(d) {
            Some(l) => l.read_range_unverified(d, offset, len),
            None => self.remote.read_range_unverified(d, offset, len),
        }
    }
}

/// The manifest `tag` names in `dest`'s repository, or `None` when the tag does not exist
/// (a first push).
pub fn tag_manifest(dest: &RegistrySource, tag: &str) -> Result<Option<OciDigest>, PushError> {
    match dest.resolve_tag(tag) {
        Ok(d) => Ok(Some(d)),
        Err(e) if e.kind() == imgfmt::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(PushError::Format { what: format!("resolving {}:{tag}", dest.describe()), source }),
    }
}

/// The manifest `dir` was last packed to by a push (its push layout's "previous": the
/// image packed last, or the earlier one it was found equal to), if any: the image a new
/// one of the same directory is most likely closest to.
fn last_packed(dir: &Path, cache_dir: &Path) -> Option<OciDigest> {
    let root = layout_root(dir, cache_dir).ok()?;
    OciLayout::open(root).ok()?.resolve_tag("previous").ok()
}

/// The layout under the cache directory that `push DIR` packs `dir` into.
fn layout_root(dir: &Path, cache: &Path) -> Result<PathBuf, PushError> {
    let canon = dir.canonicalize().map_err(|source| PushError::Io { what: format!("resolving {}", dir.display()), source })?;
    let key = OciDigest::of(canon.as_os_str().as_encoded_bytes());
    Ok(cache.join("push-layouts").join(&key.hex()[..32]))
}

/// Pack the directory into a layout of its own under the cache directory (one per source
/// path); also how it was packed (`None`: packing was skipped). When the directory's
/// stamp (every entry's name, size, times and inode, as the walk found them: see
/// [`Stamp`]) equals the one recorded when it was last packed with the same options, the
/// recorded manifest is used without reading the files. When the content is unchanged
/// though the stamp is not (same index and packs: only the creation time would differ),
/// the earlier manifest is used again. Either way the registry is only asked what it has
/// and nothing is sent.
fn pack_directory(job: PackJob<'_>, on_pack: Option<crate::OnPack<'_>>) -> Result<(OciLayout, OciDigest, Option<PackReport>, Option<Reused>), PushError> {
    let scan = job.scan;
    let root = layout_root(&scan.dir, &job.cache_dir)?;
    let layout = OciLayout::open_or_create(&root).map_err(|source| PushError::Format { what: format!("opening {}", root.display()), source })?;
    let stamp_path = root.with_extension("stamp.json");
    // A base or parent is named by a reference whose content can change under the same
    // name, so the stamp of this directory alone does not say the image would be the same.
    // The closest image, taken as the parent by itself, is no such name: an unchanged
    // directory is pushed as the image it was packed to last.
    let options = (job.pack.base.is_none() && (job.pack.parent.is_none() || job.parent_is_the_tags)).then_some(job.options_key.as_str());
    let before = options.map(|o| Stamp::of(scan, o));
    if let Some(stamp) = &before {
        if let Some(digest) = Stamp::recorded(&stamp_path, stamp).filter(|d| can_push_again(&layout, d, job.dest)) {
            return Ok((layout, digest, None, Some(Reused::Stamp)));
        }
    }
    let pack_opts = PackOptions { on_pack, ..job.pack };
    let (digest, report, reused) = pack_and_reuse(scan, &layout, &pack_opts)?;
    let unchanged = if job.parent_is_the_tags { unchanged_from_parent(&layout, &pack_opts, &report)? } else { None };
    let (digest, reused) = match unchanged {
        Some(d) => (d, Some(Reused::Parent)),
        None => (digest, reused),
    };
    if let Some(before) = before {
        // Recorded only when nothing changed while packing (each entry looked up again by
        // name: no second walk) and no file was written so recently that a later write
        // could leave its times as they are (see Stamp::racy).
        if !before.racy() && scan.unchanged() {
            before.packed_to(&digest).save(&stamp_path).map_err(|source| PushError::Io { what: format!("writing {}", stamp_path.display()), source })?;
        } else {
            let _ = std::fs::remove_file(&stamp_path);
        }
    }
    Ok((layout, digest, Some(report), reused))
}

/// Whether manifest `digest` can be pushed to `dest` again as recorded: `layout` holds it
/// (checked) and its metadata, at their sizes, and either every pack too or `dest`
/// already has the image (a push drops the packs once the registry has them; a registry
/// keeps the blobs of every manifest it holds). A stamp is only trusted while this holds.
fn can_push_again(layout: &OciLayout, digest: &OciDigest, dest: &RegistrySource) -> bool {
    let Ok(bytes) = imgfmt::source::read_verified_blob(layout, digest, imgfmt::manifest::MAX_MANIFEST_BYTES) else { return false };
    let Ok(m) = imgfmt::Manifest::decode(&bytes) else { return false };
    let here = |d: &imgfmt::Descriptor| layout.blob_size(&d.digest).is_ok_and(|n| n == d.size);
    let (packs, metadata): (Vec<_>, Vec<_>) = std::iter::once(&m.config).chain(&m.layers).partition(|d| d.media_type == media::PACK);
    metadata.into_iter().all(here) && (packs.into_iter().all(here) || dest.manifest_exists(digest).unwrap_or(false))
}

/// The parent's manifest when the image just packed holds exactly what the parent does
/// (content root, and each file's name, size, mode and role): a push of an unchanged
/// directory over the tag's image then leaves the tag as it is, instead of adding an
/// empty layer to its chain. The parent's manifest is put into `layout` (its other
/// metadata is there already: a layer's manifest lists it).
fn unchanged_from_parent(layout: &OciLayout, opts: &PackOptions<'_>, report: &PackReport) -> Result<Option<OciDigest>, PushError> {
    let Some(p) = &opts.parent else { return Ok(None) };
    let c = p.image.config();
    let entries = |f: &[imgfmt::config::FileEntry]| f.iter().map(|e| (e.name.clone(), e.size, e.mode, e.role)).collect::<Vec<_>>();
    let Ok(new) = layout.resolve_tag("latest").and_then(|d| imgfmt::Image::open(layout, &d)) else { return Ok(None) };
    let n = new.config();
    if report.root != c.root || n.kind != c.kind || entries(&n.files) != entries(&c.files) || n.annotations != c.annotations {
        return Ok(None);
    }
    layout.put_blob(&p.image.manifest_bytes).map_err(|source| PushError::Format { what: "keeping the parent's manifest".into(), source })?;
    Ok(Some(p.image.manifest_digest.clone()))
}

/// Pack the directory `scan` walked into `layout`; when only the creation time differs
/// from the image pushed last from this directory, that image's manifest; and the pack
/// report.
fn pack_and_reuse(scan: &DirScan, layout: &OciLayout, opts: &PackOptions<'_>) -> Result<(OciDigest, PackReport, Option<Reused>), PushError> {
    let previous = layout.resolve_tag("previous").ok();
    let report =
        pack_scanned(scan, layout, "latest", opts).map_err(|source| PushError::Pack { dir: scan.dir.display().to_string(), source: Box::new(source) })?;
    let format = |what: &str| {
        let what = what.to_string();
        move |source| PushError::Format { what, source }
    };
    let new: OciDigest = report.manifest.parse().map_err(format("the packed manifest"))?;
    if let Some(old) = previous.filter(|o| o != &new) {
        let same = |d: &OciDigest| {
            imgfmt::source::read_verified_blob(layout, d, imgfmt::manifest::MAX_MANIFEST_BYTES).ok().and_then(|b| imgfmt::Manifest::decode(&b).ok())
        };
        if let (Some(a), Some(b)) = (same(&old), same(&new)) {
            if a.layers == b.layers && a.config.media_type == b.config.media_type {
                return Ok((old, report, Some(Reused::Previous)));
            }
        }
    }
    let desc = imgfmt::Descriptor::new(imgfmt::media::OCI_MANIFEST, new.clone(), layout.blob_size(&new).map_err(format("the packed manifest"))?);
    layout.set_tag("previous", desc).map_err(format("tagging the packed manifest"))?;
    Ok((new, report, None))
}
