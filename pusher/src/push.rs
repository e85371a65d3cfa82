//! Push: an image in any [`BlobSource`] (usually a local layout) goes to a repository of
//! an OCI registry. Blobs the registry has are skipped (HEAD), blobs other repositories of
//! the same registry hold are cross-mounted (`--mount-from`, and the local record of
//! where blobs were pushed to or pulled from), the rest are uploaded in parallel, large
//! ones in resumable pieces; then the manifest is PUT under the tag.
//!
//! `push DIR` packs the directory first, into a layout of its own under the cache
//! directory, and sends each pack while the next is being made:
//! ```text
//! stamp (names, sizes, times, inodes) --same as last time--> recorded manifest, nothing read
//!   | changed
//!   v
//! pack --on_pack--> senders (up to 4 threads): each sealed pack goes up at once
//!   |
//!   v
//! "previous" tag: same index and packs as last time -> that manifest (only the time differed)
//!   |
//!   v
//! copy: what is not there yet (the packs sent ahead are found there), manifest PUT
//! ```
//! [`pack_dir`] does the first three, [`push_packed`] the last; [`push_dir`] both. The
//! stamp is specified in `spec/transfer.md` §2.
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
use imgfmt::{media, BlobSource, FormatError, OciDigest, OciLayout};
use regclient::RegistrySource;

use crate::copy::{copy, copy_after, send_blob, CopyError, CopyOptions, Moved, PackStep, PushReport, Target};
use crate::pack::{pack, PackError, PackOptions, PackReport};

/// Push manifest `digest` of `src`, with all its blobs, to `dest`'s repository as `tag`.
pub fn push(src: &dyn BlobSource, digest: &OciDigest, dest: &RegistrySource, tag: &str, opts: &CopyOptions) -> Result<PushReport, CopyError> {
    imgfmt::layout::check_tag(tag)?;
    copy(src, digest, &Target::Registry(dest), Some(tag), opts)
}

/// Why `push DIR` could not pack. The doc comment of each variant is its message.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum PushError {
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
    /// How to pack; `on_pack` is set by [`pack_dir`] (it sends each pack ahead).
    pub pack: PackOptions<'a>,
    /// Names the pack options (and the packer's version) in the directory's stamp: a stamp
    /// recorded under another key is not trusted. Stamps are not used with a base or a
    /// parent, whose content can change under the same name.
    pub options_key: String,
    /// The cache directory: the layout packed into and the stamp live under
    /// `push-layouts/`.
    pub cache_dir: PathBuf,
    /// `pack.parent` is the image the destination tag holds, taken by itself (not named
    /// with `--parent`): the directory's stamp still applies, since an unchanged directory
    /// is pushed as the image it was last packed to, whatever the tag holds now.
    pub parent_is_the_tags: bool,
}

/// Why the image of a directory was not the one just packed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reused {
    /// The directory's stamp equals the one recorded when it was last packed with the
    /// same options: the recorded manifest, without reading the files.
    Stamp,
    /// Packed, and the index and packs equal the image pushed last from this directory
    /// (only the creation time differed): that image's manifest.
    Previous,
    /// Packed as a layer over the image the tag holds, and nothing differed from it (the
    /// same content, names, sizes and modes): that image's manifest, so the tag's chain
    /// does not grow by an empty layer.
    Parent,
}

/// A directory packed for a push.
pub struct PackedDir {
    /// The layout under the cache directory that holds the image.
    pub layout: OciLayout,
    /// Its manifest.
    pub digest: OciDigest,
    /// How packing went (`None`: not packed, [`Reused::Stamp`]).
    pub report: Option<PackReport>,
    /// Whether an earlier image was used instead of the one just packed.
    pub reused: Option<Reused>,
    /// The packing step for the push report.
    pub step: PackStep,
    /// The packs sent while packing, and how each went.
    pub ahead: Vec<(OciDigest, Moved)>,
    /// Held from packing to the end of the push: an eviction leaves the layout alone.
    lock: UseLock,
}

/// Pack directory `dir` for a push to `dest`, sending each pack to `dest` as soon as it
/// is sealed, on up to 4 threads: the upload of one pack overlaps the packing of the next
/// instead of starting when packing is over. A pack whose early send failed is left to
/// [`push_packed`], which sends it again (resuming) and reports.
pub fn pack_dir(dir: &Path, dest: &RegistrySource, opts: DirOptions<'_>, copy: &CopyOptions) -> Result<PackedDir, PushError> {
    let started = Instant::now();
    let root = layout_root(dir, &opts.cache_dir)?;
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
        // The caller's observer sees the packs' bytes go up as they are sent.
        progress: copy.progress,
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
                let desc = imgfmt::Descriptor::new(imgfmt::media::PACK, d.clone(), size);
                match send_blob(&packs, &desc, &target, &copy, &known) {
                    Ok(m) => ahead.lock().expect("poisoned").push((d, m)),
                    Err(e) => tracing::debug!("sending pack {d} ahead: {e}"),
                }
            });
        }
        let tx = tx;
        let send = |d: &OciDigest, size: u64| {
            let _ = tx.send((d.clone(), size));
        };
        pack_directory(dir, dest, opts, Some(&send))
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

/// Push a directory packed by [`pack_dir`] to `dest` as `tag`: what was not sent ahead
/// goes up, then the manifest. The report includes the packing step (and its time). Once
/// the registry has the image, the layout drops its packs ([`keep_metadata_only`]).
pub fn push_packed(packed: &PackedDir, dest: &RegistrySource, tag: &str, opts: &CopyOptions) -> Result<PushReport, CopyError> {
    imgfmt::layout::check_tag(tag)?;
    let mut report = copy_after(&packed.layout, &packed.digest, &Target::Registry(dest), Some(tag), opts, &packed.ahead)?;
    // The packs were being sent while packing: the push took both.
    report.seconds += packed.step.seconds;
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

/// [`pack_dir`] then [`push_packed`]: `push DIR` as one call.
pub fn push_dir(dir: &Path, dest: &RegistrySource, tag: &str, opts: DirOptions<'_>, copy: &CopyOptions) -> Result<PushReport, PushError> {
    imgfmt::layout::check_tag(tag).map_err(CopyError::from)?;
    let packed = pack_dir(dir, dest, opts, copy)?;
    Ok(push_packed(&packed, dest, tag, copy)?)
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
pub fn last_packed(dir: &Path, cache_dir: &Path) -> Option<OciDigest> {
    let root = layout_root(dir, cache_dir).ok()?;
    OciLayout::open(root).ok()?.resolve_tag("previous").ok()
}

/// The layout under the cache directory that `push DIR` packs `dir` into.
fn layout_root(dir: &Path, cache: &Path) -> Result<PathBuf, PushError> {
    let canon = dir.canonicalize().map_err(|source| PushError::Io { what: format!("resolving {}", dir.display()), source })?;
    let key = OciDigest::of(canon.as_os_str().as_encoded_bytes());
    Ok(cache.join("push-layouts").join(&key.hex()[..32]))
}

/// Pack a directory into a layout of its own under the cache directory (one per source
/// path); also how it was packed (`None`: packing was skipped). When the directory's stamp (every entry's
/// name, size, times and inode, see [`Stamp`]) equals the one recorded when it was last
/// packed with the same options, the recorded manifest is used without reading the
/// files. When the content is unchanged though the stamp is not (same index and packs:
/// only the creation time would differ), the earlier manifest is used again. Either way
/// the registry is only asked what it has and nothing is sent.
fn pack_directory(
    dir: &Path,
    dest: &RegistrySource,
    opts: DirOptions<'_>,
    on_pack: Option<crate::OnPack<'_>>,
) -> Result<(OciLayout, OciDigest, Option<PackReport>, Option<Reused>), PushError> {
    let io = |what: String| move |source| PushError::Io { what, source };
    let canon = dir.canonicalize().map_err(io(format!("resolving {}", dir.display())))?;
    let key = OciDigest::of(canon.as_os_str().as_encoded_bytes());
    let root = layout_root(dir, &opts.cache_dir)?;
    let layout = OciLayout::open_or_create(&root).map_err(|source| PushError::Format { what: format!("opening {}", root.display()), source })?;
    let stamp_path = opts.cache_dir.join("push-layouts").join(format!("{}.stamp.json", &key.hex()[..32]));
    // A base or parent is named by a reference whose content can change under the same
    // name, so the stamp of this directory alone does not say the image would be the same.
    // The tag's own image, taken as the parent by itself, is no such name: an unchanged
    // directory is pushed as the image it was packed to last.
    let options = (opts.pack.base.is_none() && (opts.pack.parent.is_none() || opts.parent_is_the_tags)).then_some(opts.options_key.as_str());
    let before = match options {
        Some(o) => Some(Stamp::take(&canon, o).map_err(io(format!("reading {}", dir.display())))?),
        None => None,
    };
    if let Some(stamp) = &before {
        if let Some(digest) = Stamp::recorded(&stamp_path, stamp).filter(|d| can_push_again(&layout, d, dest)) {
            return Ok((layout, digest, None, Some(Reused::Stamp)));
        }
    }
    let pack_opts = PackOptions { on_pack, ..opts.pack };
    let (digest, report, reused) = pack_and_reuse(dir, &layout, &pack_opts)?;
    let unchanged = if opts.parent_is_the_tags { unchanged_from_parent(&layout, &pack_opts, &report)? } else { None };
    let (digest, reused) = match unchanged {
        Some(d) => (d, Some(Reused::Parent)),
        None => (digest, reused),
    };
    if let (Some(before), Some(options)) = (before, options) {
        // Recorded only when nothing changed while packing and no file was written so
        // recently that a later write could leave its times as they are (see Stamp::racy).
        let after = Stamp::take(&canon, options).map_err(io(format!("reading {}", dir.display())))?;
        if after.entries == before.entries && !before.racy() {
            Stamp { manifest: digest.to_string(), ..before }.save(&stamp_path).map_err(io(format!("writing {}", stamp_path.display())))?;
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

/// Pack `dir` into `layout`; when only the creation time differs from the image pushed
/// last from this directory, that image's manifest; and the pack report.
fn pack_and_reuse(dir: &Path, layout: &OciLayout, opts: &PackOptions<'_>) -> Result<(OciDigest, PackReport, Option<Reused>), PushError> {
    let previous = layout.resolve_tag("previous").ok();
    let report = pack(dir, layout, "latest", opts).map_err(|source| PushError::Pack { dir: dir.display().to_string(), source: Box::new(source) })?;
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
/// What a directory looked like when it was packed: every entry (recursively, the
/// directory itself included) with the metadata any change moves. A write to a file
/// always sets its ctime (which no user call can set back), a replaced file has another
/// inode, a renamed or removed one changes the names, so an equal stamp means the files
/// hold what was packed (spec/transfer.md §2).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Stamp {
    /// snapctl version and pack options: another version or option packs differently.
    options: String,
    entries: Vec<StampEntry>,
    /// When the stamp was taken (ns since the epoch).
    taken_ns: i64,
    /// Manifest the directory was packed to (empty until packed).
    manifest: String,
}

#[derive(Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct StampEntry {
    /// Relative path, `/`-separated ("" for the directory itself).
    name: String,
    /// st_mode: file type and permissions.
    mode: u32,
    size: u64,
    mtime_ns: i64,
    ctime_ns: i64,
    inode: u64,
    dev: u64,
}

/// A stamp file larger than this is not ours (a directory of a million entries is ~150 MB
/// of JSON; checkpoint directories hold a handful).
const MAX_STAMP_BYTES: u64 = 64 << 20;

impl Stamp {
    fn take(dir: &Path, options: &str) -> std::io::Result<Stamp> {
        use std::os::unix::fs::MetadataExt;
        let taken_ns = ns_since_epoch(std::time::SystemTime::now());
        let entry = |name: String, md: &std::fs::Metadata| StampEntry {
            name,
            mode: md.mode(),
            size: md.size(),
            mtime_ns: md.mtime().saturating_mul(1_000_000_000).saturating_add(md.mtime_nsec()),
            ctime_ns: md.ctime().saturating_mul(1_000_000_000).saturating_add(md.ctime_nsec()),
            inode: md.ino(),
            dev: md.dev(),
        };
        let mut entries = vec![entry(String::new(), &std::fs::symlink_metadata(dir)?)];
        let mut stack = vec![(dir.to_path_buf(), String::new())];
        while let Some((p, prefix)) = stack.pop() {
            for e in std::fs::read_dir(&p)? {
                let e = e?;
                let name = e.file_name().to_string_lossy().into_owned();
                let rel = if prefix.is_empty() { name } else { format!("{prefix}/{name}") };
                // Not followed: a symlink is recorded as itself (pack skips it).
                let md = std::fs::symlink_metadata(e.path())?;
                if md.is_dir() {
                    stack.push((e.path(), rel.clone()));
                }
                entries.push(entry(rel, &md));
            }
        }
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Stamp { options: options.to_string(), entries, taken_ns, manifest: String::new() })
    }

    /// A file changed within a clock tick of the stamp: a second write in that same tick
    /// would leave mtime and ctime (and maybe size) as they are, so such a stamp is not
    /// recorded. The kernel stamps files from a coarse clock (ticks of up to 10 ms); on a
    /// file system with whole-second times (every nanosecond field 0) the margin is 2 s.
    fn racy(&self) -> bool {
        let whole_seconds = self.entries.iter().all(|e| e.ctime_ns % 1_000_000_000 == 0 && e.mtime_ns % 1_000_000_000 == 0);
        let margin: i64 = if whole_seconds { 2_000_000_000 } else { 20_000_000 };
        self.entries.iter().any(|e| e.ctime_ns.max(e.mtime_ns) >= self.taken_ns.saturating_sub(margin))
    }

    /// The manifest recorded at `path` when its stamp's options and entries equal `now`'s.
    /// Any problem reading it means "not recorded": the directory is packed again.
    fn recorded(path: &Path, now: &Stamp) -> Option<OciDigest> {
        use std::io::Read;
        let mut bytes = Vec::new();
        std::fs::File::open(path).ok()?.take(MAX_STAMP_BYTES).read_to_end(&mut bytes).ok()?;
        let old: Stamp = serde_json::from_slice(&bytes).ok()?;
        (old.options == now.options && old.entries == now.entries).then(|| old.manifest.parse().ok()).flatten()
    }

    /// Written atomically (and synced), so a reader sees a whole stamp or none.
    fn save(&self, path: &Path) -> std::io::Result<()> {
        imgfmt::layout::write_atomic_mode(path, &serde_json::to_vec(self)?, 0o666)
    }
}

fn ns_since_epoch(t: std::time::SystemTime) -> i64 {
    t.duration_since(std::time::UNIX_EPOCH).map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch directory removed on drop (the CLI crate has no tempfile dependency).
    struct Scratch(PathBuf);
    impl Scratch {
        fn new(name: &str) -> Scratch {
            let p = std::env::temp_dir().join(format!("snapctl-stamp-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(p.join("sub")).unwrap();
            std::fs::write(p.join("vm.mem"), vec![1u8; 8192]).unwrap();
            std::fs::write(p.join("sub/vm.state"), b"state").unwrap();
            Scratch(p)
        }
    }
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn stamp_lists_every_entry_and_sees_renames_removals_and_options() {
        let d = Scratch::new("entries");
        let s = Stamp::take(&d.0, "o").unwrap();
        let names: Vec<&str> = s.entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["", "sub", "sub/vm.state", "vm.mem"]);
        assert_eq!(s.entries[3].size, 8192);
        assert_eq!(Stamp::take(&d.0, "o").unwrap().entries, s.entries, "nothing changed");

        // Saved and read back: the manifest for the same stamp, nothing for other options
        // or another directory state.
        let file = d.0.with_extension("stamp.json");
        let digest = OciDigest::of(b"manifest");
        Stamp { manifest: digest.to_string(), ..Stamp::take(&d.0, "o").unwrap() }.save(&file).unwrap();
        assert_eq!(Stamp::recorded(&file, &Stamp::take(&d.0, "o").unwrap()), Some(digest));
        assert_eq!(Stamp::recorded(&file, &Stamp::take(&d.0, "other options").unwrap()), None);
        std::fs::rename(d.0.join("sub/vm.state"), d.0.join("sub/vm.state2")).unwrap();
        assert_eq!(Stamp::recorded(&file, &Stamp::take(&d.0, "o").unwrap()), None, "renamed");
        std::fs::remove_file(d.0.join("sub/vm.state2")).unwrap();
        assert_ne!(Stamp::take(&d.0, "o").unwrap().entries, s.entries, "removed");
        // A damaged stamp file is "not recorded", not an error.
        std::fs::write(&file, b"{not json").unwrap();
        assert_eq!(Stamp::recorded(&file, &s), None);
        std::fs::remove_file(&file).unwrap();
    }

    /// Files written just now could be written again within the same clock tick without
    /// their times moving: such a stamp must not be recorded.
    #[test]
    fn a_stamp_of_files_written_just_now_is_racy() {
        let d = Scratch::new("racy");
        assert!(Stamp::take(&d.0, "o").unwrap().racy());
        let mut old = Stamp::take(&d.0, "o").unwrap();
        old.taken_ns += 60_000_000_000;
        assert!(!old.racy(), "a minute later the same times are safe");
    }
}
