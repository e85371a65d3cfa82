//! An OCI image layout on local disk (`oci-layout`, `index.json`, `blobs/sha256/…`), as
//! skopeo and the OCI image spec define it.
//!
//! Blobs are written to a temporary name, synced and renamed, so a crash never leaves a
//! partial blob under its digest; `index.json` is rewritten the same way under a lock.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::digest::OciHasher;

use crate::digest::OciDigest;
use crate::manifest::{Descriptor, ImageIndex};
use crate::media::{ANN_REF_NAME, OCI_INDEX};
use crate::source::BlobSource;
use crate::FormatError;

const OCI_LAYOUT_CONTENT: &str = "{\"imageLayoutVersion\":\"1.0.0\"}";
/// `index.json` is at most 64 MiB.
const MAX_INDEX_JSON: u64 = 64 << 20;

/// A local OCI image layout.
pub struct OciLayout {
    root: PathBuf,
    open_blobs: Mutex<HashMap<OciDigest, Arc<File>>>,
}

impl std::fmt::Debug for OciLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "OciLayout({})", self.root.display())
    }
}

fn io_err(ctx: impl Into<String>) -> impl FnOnce(io::Error) -> FormatError {
    let ctx = ctx.into();
    move |e| FormatError::io(ctx, e)
}

/// Sync a directory so a rename inside it is durable.
pub fn sync_dir(dir: &Path) -> Result<(), FormatError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(format!("sync {}", dir.display())))
}

impl OciLayout {
    /// Open an existing layout.
    pub fn open(root: impl AsRef<Path>) -> Result<Self, FormatError> {
        let root = root.as_ref().to_path_buf();
        let marker = root.join("oci-layout");
        let text = fs::read_to_string(&marker).map_err(io_err(format!("{} is not an OCI image layout (reading oci-layout)", root.display())))?;
        if !text.contains("imageLayoutVersion") {
            return Err(FormatError::invalid("oci-layout", format!("{}: no imageLayoutVersion", marker.display())));
        }
        Ok(OciLayout { root, open_blobs: Mutex::new(HashMap::new()) })
    }

    /// Open a layout to write into, creating an empty one if the directory does not hold
    /// one yet. Temp files of blob writers that were killed are removed (see
    /// [`OciLayout::remove_stale_temps`]).
    pub fn open_or_create(root: impl AsRef<Path>) -> Result<Self, FormatError> {
        let root = root.as_ref();
        if root.join("oci-layout").exists() {
            let l = Self::open(root)?;
            l.remove_stale_temps();
            return Ok(l);
        }
        fs::create_dir_all(root.join("blobs").join("sha256")).map_err(io_err(format!("create {}", root.display())))?;
        write_atomic(&root.join("oci-layout"), OCI_LAYOUT_CONTENT.as_bytes())?;
        if !root.join("index.json").exists() {
            write_atomic(&root.join("index.json"), &serde_json::to_vec(&ImageIndex::empty()).expect("serializes"))?;
        }
        Self::open(root)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Remove the `blobs/sha256/.tmp-blob-*` files of blob writers that were killed (a
    /// `pack` killed mid-way leaves one per pack in progress, each up to a pack's size).
    /// A temp file goes only when all three say its writer is gone: it is older than
    /// [`STALE_TEMP_AGE`], the pid in its name does not run on this host, and its `flock`
    /// (which every [`BlobWriter`] holds from creation to rename) can be taken. The lock
    /// is what protects a live writer in another pid namespace; the age, the instant
    /// between a writer's create and its lock; the pid, a writer of a build that did not
    /// lock. Best effort: what cannot be checked or removed stays. Returns how many went.
    pub fn remove_stale_temps(&self) -> usize {
        let Ok(dir) = crate::file::Dir::open(&self.root.join("blobs").join("sha256")) else { return 0 };
        let Ok(names) = dir.names() else { return 0 };
        let mut removed = 0;
        for name in names {
            let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(".tmp-blob-")) else { continue };
            if rest
                .split('-')
                .next()
                .and_then(|p| p.parse::<u32>().ok())
                .is_some_and(|pid| pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists())
            {
                continue;
            }
            // Only our own regular files (a symlink planted under such a name is not opened).
            let Ok(f) = dir.open_own_file(&name, false) else { continue };
            let old = f.metadata().and_then(|m| m.modified()).is_ok_and(|t| t.elapsed().is_ok_and(|age| age > STALE_TEMP_AGE));
            // Held while unlinking: no writer can be holding it meanwhile.
            if old && f.try_lock().is_ok() && dir.remove_file(&name).is_ok() {
                removed += 1;
            }
        }
        removed
    }

    /// Path of a blob (which may not exist).
    pub fn blob_path(&self, d: &OciDigest) -> PathBuf {
        self.root.join("blobs").join(d.algorithm()).join(d.hex())
    }

    pub fn has_blob(&self, d: &OciDigest) -> bool {
        self.blob_path(d).is_file()
    }

    /// Store a small blob (manifest, config, index) and return its digest. Idempotent.
    pub fn put_blob(&self, data: &[u8]) -> Result<OciDigest, FormatError> {
        let d = OciDigest::of(data);
        if !self.has_blob(&d) {
            let mut w = self.blob_writer()?;
            w.write_all(data).map_err(io_err("write blob"))?;
            w.finish()?;
        }
        Ok(d)
    }

    /// A streaming writer for a large blob; the digest is computed as bytes go in.
    pub fn blob_writer(&self) -> Result<BlobWriter, FormatError> {
        let dir = self.root.join("blobs").join("sha256");
        fs::create_dir_all(&dir).map_err(io_err(format!("create {}", dir.display())))?;
        let tmp = tempname(&dir, ".tmp-blob");
        let file = OpenOptions::new().write(true).create_new(true).open(&tmp).map_err(io_err(format!("create {}", tmp.display())))?;
        // Held until the file is renamed or removed: a later `remove_stale_temps` (another
        // process's) tells a live writer's temp file from a killed one's by it. A
        // filesystem without flock leaves the pid and the age to tell.
        let _ = file.try_lock();
        // Writes of at most 256 KiB reach the kernel: larger page-cache copies were several
        // times slower on the VMs we measured (BENCHMARKS.md, "Machine and method").
        Ok(BlobWriter { file: Some(io::BufWriter::with_capacity(WRITE_PIECE, file)), tmp, dir, hasher: Some(OciHasher::sha256()), len: 0, hinted: 0 })
    }

    /// A streaming writer for a large blob whose digest the caller computes from the same
    /// bytes, on another thread (one SHA-256 stream cannot be split, so `pack` hashes a
    /// pack on one core while another copies it to disk). Finish it with
    /// [`BlobWriter::finish_as`].
    pub fn blob_writer_hashed_by_caller(&self) -> Result<BlobWriter, FormatError> {
        let mut w = self.blob_writer()?;
        w.hasher = None;
        Ok(w)
    }

    fn read_index_json(&self) -> Result<ImageIndex, FormatError> {
        let p = self.root.join("index.json");
        let f = File::open(&p).map_err(io_err(format!("open {}", p.display())))?;
        let mut b = Vec::new();
        f.take(MAX_INDEX_JSON + 1).read_to_end(&mut b).map_err(io_err(format!("read {}", p.display())))?;
        if b.len() as u64 > MAX_INDEX_JSON {
            return Err(FormatError::TooLarge { what: "index.json", got: b.len() as u64, limit: MAX_INDEX_JSON });
        }
        serde_json::from_slice(&b).map_err(|source| FormatError::Json { what: "index.json", source })
    }

    /// The tags (`org.opencontainers.image.ref.name`) and their descriptors.
    pub fn tags(&self) -> Result<Vec<(String, Descriptor)>, FormatError> {
        Ok(self.read_index_json()?.manifests.into_iter().filter_map(|d| d.annotations.get(ANN_REF_NAME).cloned().map(|t| (t, d))).collect())
    }

    /// Point `tag` at a manifest (replacing what it pointed at). The manifest blob must
    /// already be stored.
    pub fn set_tag(&self, tag: &str, desc: Descriptor) -> Result<(), FormatError> {
        check_tag(tag)?;
        let _lock = LayoutLock::acquire(&self.root)?;
        let mut idx = self.read_index_json()?;
        idx.manifests.retain(|d| d.annotations.get(ANN_REF_NAME).map(String::as_str) != Some(tag));
        idx.manifests.push(desc.with_annotation(ANN_REF_NAME, tag));
        if idx.media_type.is_none() {
            idx.media_type = Some(OCI_INDEX.into());
        }
        write_atomic(&self.root.join("index.json"), &serde_json::to_vec(&idx).expect("serializes"))
    }

    /// Remove the tag `tag` (the manifest and its blobs stay). `TagNotFound` when the
    /// layout has no such tag.
    pub fn remove_tag(&self, tag: &str) -> Result<(), FormatError> {
        let _lock = LayoutLock::acquire(&self.root)?;
        let mut idx = self.read_index_json()?;
        let before = idx.manifests.len();
        idx.manifests.retain(|d| d.annotations.get(ANN_REF_NAME).map(String::as_str) != Some(tag));
        if idx.manifests.len() == before {
            return Err(FormatError::TagNotFound { layout: self.root.display().to_string(), tag: tag.into() });
        }
        write_atomic(&self.root.join("index.json"), &serde_json::to_vec(&idx).expect("serializes"))
    }

    /// Remove the manifest `digest`: every `index.json` entry naming it (its tags), then its
    /// blob. The blobs it lists stay (other images may share them). `BlobNotFound` when the
    /// layout has neither an entry nor the blob.
    pub fn remove_manifest(&self, digest: &OciDigest) -> Result<(), FormatError> {
        let _lock = LayoutLock::acquire(&self.root)?;
        let mut idx = self.read_index_json()?;
        let before = idx.manifests.len();
        idx.manifests.retain(|d| &d.digest != digest);
        let had_blob = self.has_blob(digest);
        if idx.manifests.len() == before && !had_blob {
            return Err(FormatError::BlobNotFound(digest.clone()));
        }
        write_atomic(&self.root.join("index.json"), &serde_json::to_vec(&idx).expect("serializes"))?;
        let p = self.blob_path(digest);
        match fs::remove_file(&p) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(FormatError::io(format!("remove {}", p.display()), e)),
        }
    }

    /// The referrers of `subject` this layout lists: the manifests of the image index its
    /// fallback tag ([`referrers_tag`]) names, or the one manifest it names (how snapctl's
    /// trace store wrote a trace before the index). Empty without the tag.
    pub fn referrers(&self, subject: &OciDigest) -> Result<Vec<Descriptor>, FormatError> {
        let tag = referrers_tag(subject);
        let Some((_, cur)) = self.tags()?.into_iter().find(|(t, _)| *t == tag) else { return Ok(Vec::new()) };
        self.referrers_in(cur)
    }

    fn referrers_in(&self, mut cur: Descriptor) -> Result<Vec<Descriptor>, FormatError> {
        if cur.media_type == OCI_INDEX {
            let b = crate::source::read_verified_blob(self, &cur.digest, crate::manifest::MAX_MANIFEST_BYTES)?;
            let idx: ImageIndex = serde_json::from_slice(&b).map_err(|source| FormatError::Json { what: "referrers index", source })?;
            return Ok(idx.manifests);
        }
        cur.annotations.remove(ANN_REF_NAME);
        Ok(vec![cur])
    }

    /// Add `descs` (manifests stored already) to the referrers of `subject`: the fallback
    /// tag then names an image index listing them beside those it listed before.
    pub fn add_referrers(&self, subject: &OciDigest, descs: &[Descriptor]) -> Result<(), FormatError> {
        let tag = referrers_tag(subject);
        let _lock = LayoutLock::acquire(&self.root)?;
        let mut idx = self.read_index_json()?;
        let cur = idx.manifests.iter().find(|d| d.annotations.get(ANN_REF_NAME) == Some(&tag)).cloned();
        let mut list = match cur {
            Some(c) => self.referrers_in(c)?,
            None => Vec::new(),
        };
        let before = list.len();
        for d in descs {
            if !list.iter().any(|m| m.digest == d.digest) {
                list.push(d.clone());
            }
        }
        if list.len() == before && before > 0 {
            return Ok(());
        }
        let mut referrers = ImageIndex::empty();
        referrers.media_type = Some(OCI_INDEX.into());
        referrers.manifests = list;
        let bytes = serde_json::to_vec(&referrers).expect("serializes");
        let d = self.put_blob(&bytes)?;
        idx.manifests.retain(|m| m.annotations.get(ANN_REF_NAME) != Some(&tag));
        idx.manifests.push(Descriptor::new(OCI_INDEX, d, bytes.len() as u64).with_annotation(ANN_REF_NAME, &tag));
        if idx.media_type.is_none() {
            idx.media_type = Some(OCI_INDEX.into());
        }
        write_atomic(&self.root.join("index.json"), &serde_json::to_vec(&idx).expect("serializes"))
    }

    fn open_blob(&self, d: &OciDigest) -> Result<Arc<File>, FormatError> {
        let mut map = self.open_blobs.lock().expect("poisoned");
        if let Some(f) = map.get(d) {
            return Ok(f.clone());
        }
        let p = self.blob_path(d);
        let f = File::open(&p).map_err(|e| {
            if e.kind() == io::ErrorKind::NotFound {
                FormatError::BlobNotFound(d.clone())
            } else {
                FormatError::io(format!("open {}", p.display()), e)
            }
        })?;
        let f = Arc::new(f);
        if map.len() > 256 {
            map.clear();
        }
        map.insert(d.clone(), f.clone());
        Ok(f)
    }
}

/// The tag the OCI referrers fallback scheme lists the referrers of `subject` under:
/// `sha256-<hex>` (registries without the referrers API, and layouts).
pub fn referrers_tag(subject: &OciDigest) -> String {
    format!("{}-{}", subject.algorithm(), subject.hex())
}

/// Tags follow the OCI distribution grammar: `[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}`.
pub fn check_tag(tag: &str) -> Result<(), FormatError> {
    let ok = !tag.is_empty()
        && tag.len() <= 128
        && tag.bytes().enumerate().all(|(i, b)| b.is_ascii_alphanumeric() || b == b'_' || (i > 0 && (b == b'.' || b == b'-')));
    if ok {
        Ok(())
    } else {
        Err(FormatError::invalid("tag", format!("{tag:?} is not [a-zA-Z0-9_][a-zA-Z0-9._-]{{0,127}}")))
    }
}

impl BlobSource for OciLayout {
    fn describe(&self) -> String {
        format!("oci:{}", self.root.display())
    }

    fn resolve_tag(&self, tag: &str) -> Result<OciDigest, FormatError> {
        self.tags()?
            .into_iter()
            .find(|(t, _)| t == tag)
            .map(|(_, d)| d.digest)
            .ok_or_else(|| FormatError::TagNotFound { layout: self.describe(), tag: tag.into() })
    }

    fn read_blob_unverified(&self, d: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError> {
        let f = self.open_blob(d)?;
        let len = f.metadata().map_err(io_err("stat blob"))?.len();
        if len > limit {
            return Err(FormatError::TooLarge { what: "blob size", got: len, limit });
        }
        let mut b = vec![0u8; len as usize];
        f.read_exact_at(&mut b, 0).map_err(io_err(format!("read blob {d}")))?;
        Ok(b)
    }

    fn blob_size(&self, d: &OciDigest) -> Result<u64, FormatError> {
        Ok(self.open_blob(d)?.metadata().map_err(io_err("stat blob"))?.len())
    }

    fn read_at_unverified(&self, d: &OciDigest, offset: u64, buf: &mut [u8]) -> Result<(), FormatError> {
        let f = self.open_blob(d)?;
        f.read_exact_at(buf, offset).map_err(|e| {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                FormatError::Truncated { what: "pack blob (range past its end)", got: offset, expected: offset + buf.len() as u64 }
            } else {
                FormatError::io(format!("read blob {d} at {offset}"), e)
            }
        })
    }

    /// Large ranges are mapped, not copied: an upload hands the mapping to the HTTP
    /// client, which sends it straight from the page cache (a pread into a zeroed buffer
    /// was a memset and a copy per byte pushed).
    fn read_range_unverified(&self, d: &OciDigest, offset: u64, len: usize) -> Result<bytes::Bytes, FormatError> {
        if len < MAP_MIN {
            let mut buf = vec![0u8; len];
            self.read_at_unverified(d, offset, &mut buf)?;
            return Ok(buf.into());
        }
        let f = self.open_blob(d)?;
        let size = f.metadata().map_err(io_err("stat blob"))?.len();
        if offset.checked_add(len as u64).is_none_or(|end| end > size) {
            return Err(FormatError::Truncated { what: "pack blob (range past its end)", got: size, expected: offset.saturating_add(len as u64) });
        }
        // A blob file is renamed into place complete and never written afterwards (gc
        // unlinks, which leaves a mapping intact); the range was checked above.
        crate::file::map_range(&f, offset, len).map_err(|e| FormatError::io(format!("map blob {d} at {offset}"), e))
    }
}

/// A blob writer's temp file unchanged for this long may be a killed writer's leftover
/// (see [`OciLayout::remove_stale_temps`]).
pub const STALE_TEMP_AGE: std::time::Duration = std::time::Duration::from_secs(60);

/// Ranges from this size up are mapped rather than read (see `read_range_unverified`).
const MAP_MIN: usize = 1 << 20;

/// Streams a blob into the layout. Dropped without [`BlobWriter::finish`], it removes its
/// temporary file: nothing partial ever appears under a digest.
pub struct BlobWriter {
    file: Option<io::BufWriter<File>>,
    tmp: PathBuf,
    dir: PathBuf,
    /// `None` for a writer whose digest the caller computes.
    hasher: Option<OciHasher>,
    len: u64,
    /// Bytes up to here were handed to [`crate::file::start_writeback`].
    hinted: u64,
}

impl BlobWriter {
    pub fn len(&self) -> u64 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes written since the last [`BlobWriter::start_writeback`].
    pub fn unhinted(&self) -> u64 {
        self.len - self.hinted
    }

    /// Start writing what was written so far to disk, without waiting, so the sync in
    /// `finish` finds little left to do. A hint: a failure only costs speed.
    pub fn start_writeback(&mut self) {
        let Some(w) = self.file.as_mut() else { return };
        if w.flush().is_err() {
            return;
        }
        if self.len > self.hinted {
            crate::file::start_writeback(w.get_ref(), self.hinted, self.len - self.hinted);
            self.hinted = self.len;
        }
    }

    /// Sync, rename to `blobs/sha256/<digest>`, sync the directory.
    pub fn finish(mut self) -> Result<(OciDigest, u64), FormatError> {
        let h = self.hasher.take().expect("finish() is for writers that hash; use finish_as");
        let digest = h.finish();
        self.finish_named(digest)
    }

    /// [`BlobWriter::finish`] for a writer made by
    /// [`OciLayout::blob_writer_hashed_by_caller`]: `digest` must be the SHA-256 of exactly
    /// the bytes written (a writer that hashes checks it; a mismatch is an error and
    /// nothing is named).
    pub fn finish_as(mut self, digest: OciDigest) -> Result<(OciDigest, u64), FormatError> {
        if let Some(h) = self.hasher.take() {
            let own = h.finish();
            if own != digest {
                return Err(FormatError::BlobDigestMismatch { digest, actual: own });
            }
        }
        self.finish_named(digest)
    }

    fn finish_named(mut self, digest: OciDigest) -> Result<(OciDigest, u64), FormatError> {
        let w = self.file.take().expect("finish once");
        let dest = self.dir.join(digest.hex());
        let res = w
            .into_inner()
            .map_err(|e| FormatError::io("flush blob", e.into_error()))
            .and_then(|f| f.sync_all().map_err(io_err("sync blob")))
            .and_then(|()| fs::rename(&self.tmp, &dest).map_err(io_err(format!("rename to {}", dest.display()))));
        if let Err(e) = res {
            let _ = fs::remove_file(&self.tmp);
            return Err(e);
        }
        sync_dir(&self.dir)?;
        Ok((digest, self.len))
    }
}

/// Largest write a [`BlobWriter`] passes to the kernel at once.
const WRITE_PIECE: usize = 256 << 10;

impl Write for BlobWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let buf = &buf[..buf.len().min(WRITE_PIECE)];
        let n = self.file.as_mut().expect("not finished").write(buf)?;
        if let Some(h) = self.hasher.as_mut() {
            h.update(&buf[..n]);
        }
        self.len += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.file.as_mut().expect("not finished").flush()
    }
}

impl Drop for BlobWriter {
    fn drop(&mut self) {
        if self.file.is_some() {
            let _ = fs::remove_file(&self.tmp);
        }
    }
}

/// A unique temporary name in `dir`.
pub fn tempname(dir: &Path, prefix: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    dir.join(format!("{prefix}-{}-{n}-{nanos}", std::process::id()))
}

/// Write a whole small file atomically: temp, sync, rename, sync directory.
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<(), FormatError> {
    write_atomic_mode(path, data, 0o666).map_err(|e| FormatError::io(format!("write {}", path.display()), e))
}

/// [`write_atomic`] for any small file that must be whole or absent (credentials, stamps,
/// records), created with `mode` (before the umask) from the start, so a file of
/// credentials (0o600) is never readable by others, not even between create and chmod.
/// A reader sees the old content or the new, never a part; once this returns, the new
/// content and its name survive a crash. The temporary file is removed on failure.
pub fn write_atomic_mode(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let tmp = tempname(dir, ".tmp");
    let res = (|| {
        let mut f = OpenOptions::new().write(true).create_new(true).mode(mode).open(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if let Err(e) = res {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    File::open(dir)?.sync_all()
}

/// An exclusive `flock` on the layout, held while `index.json` is rewritten so two
/// concurrent `pack`s into one layout do not lose each other's tags.
struct LayoutLock(File);

impl LayoutLock {
    fn acquire(root: &Path) -> Result<Self, FormatError> {
        let p = root.join(".snapctl.lock");
        let f = OpenOptions::new().create(true).truncate(false).write(true).open(&p).map_err(io_err(format!("open {}", p.display())))?;
        use std::os::fd::AsRawFd;
        // SAFETY: flock on a valid, owned descriptor; no memory is involved.
        let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
        if rc != 0 {
            return Err(FormatError::io(format!("lock {}", p.display()), io::Error::last_os_error()));
        }
        Ok(LayoutLock(f))
    }
}

impl Drop for LayoutLock {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: unlocking the descriptor we locked and still own.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Referrers in a layout: the fallback tag becomes an index; a single referrer it named
    /// before (snapctl's old trace store) joins it; adding twice lists once.
    #[test]
    fn referrers_are_listed_by_an_index_under_the_fallback_tag() {
        let dir = tempfile::tempdir().unwrap();
        let l = OciLayout::open_or_create(dir.path()).unwrap();
        let subject = OciDigest::of(b"subject");
        assert!(l.referrers(&subject).unwrap().is_empty());
        let old = l.put_blob(b"{\"old\":1}").unwrap();
        l.set_tag(&referrers_tag(&subject), Descriptor::new(crate::media::OCI_MANIFEST, old.clone(), 9)).unwrap();
        assert_eq!(l.referrers(&subject).unwrap().iter().map(|d| &d.digest).collect::<Vec<_>>(), vec![&old]);
        let new = l.put_blob(b"{\"new\":1}").unwrap();
        let mut nd = Descriptor::new(crate::media::OCI_MANIFEST, new.clone(), 9);
        nd.artifact_type = Some("application/x-sig".into());
        l.add_referrers(&subject, std::slice::from_ref(&nd)).unwrap();
        l.add_referrers(&subject, std::slice::from_ref(&nd)).unwrap();
        let got = l.referrers(&subject).unwrap();
        assert_eq!(got.iter().map(|d| &d.digest).collect::<Vec<_>>(), vec![&old, &new]);
        assert_eq!(got[1].artifact_type.as_deref(), Some("application/x-sig"));
        assert!(!got[0].annotations.contains_key(ANN_REF_NAME), "the index lists no tag names");
        assert_eq!(l.tags().unwrap().len(), 1, "one tag, naming the index");
    }

    #[test]
    fn blobs_and_tags() {
        let dir = tempfile::tempdir().unwrap();
        let l = OciLayout::open_or_create(dir.path()).unwrap();
        let d = l.put_blob(b"hello").unwrap();
        assert_eq!(l.read_blob_unverified(&d, 100).unwrap(), b"hello");
        assert!(matches!(l.read_blob_unverified(&d, 2), Err(FormatError::TooLarge { .. })));
        let mut buf = [0u8; 3];
        l.read_at_unverified(&d, 2, &mut buf).unwrap();
        assert_eq!(&buf, b"llo");
        let mut buf = [0u8; 4];
        assert!(l.read_at_unverified(&d, 2, &mut buf).is_err());
        l.set_tag("v1", Descriptor::new("x", d.clone(), 5)).unwrap();
        l.set_tag("v1", Descriptor::new("x", d.clone(), 5)).unwrap();
        assert_eq!(l.tags().unwrap().len(), 1);
        assert_eq!(l.resolve_tag("v1").unwrap(), d);
        assert!(l.resolve_tag("v2").is_err());
        assert!(l.set_tag("../x", Descriptor::new("x", d, 5)).is_err());
    }

    /// A writer hashed by its caller is named by the digest it is given; a writer that
    /// hashes itself refuses a digest that is not its content's, and names nothing.
    #[test]
    fn finish_as_names_the_blob_and_checks_a_hashing_writer() {
        let dir = tempfile::tempdir().unwrap();
        let l = OciLayout::open_or_create(dir.path()).unwrap();
        let mut w = l.blob_writer_hashed_by_caller().unwrap();
        w.write_all(b"pack bytes").unwrap();
        w.start_writeback();
        let (d, n) = w.finish_as(OciDigest::of(b"pack bytes")).unwrap();
        assert_eq!((d.clone(), n), (OciDigest::of(b"pack bytes"), 10));
        assert_eq!(l.read_blob_unverified(&d, 100).unwrap(), b"pack bytes");

        let mut w = l.blob_writer().unwrap();
        w.write_all(b"other bytes").unwrap();
        let e = w.finish_as(OciDigest::of(b"not these")).unwrap_err();
        assert!(matches!(e, FormatError::BlobDigestMismatch { .. }), "{e}");
        assert!(!l.has_blob(&OciDigest::of(b"not these")) && !l.has_blob(&OciDigest::of(b"other bytes")));
        let names: Vec<_> = fs::read_dir(dir.path().join("blobs/sha256")).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from(d.hex())], "no temp file left behind");
    }

    /// Ranges read by mapping (1 MiB and up) and by pread (below) give the same bytes;
    /// a range past the end is `Truncated`, not a crash.
    #[test]
    fn range_reads_mapped_or_copied() {
        let dir = tempfile::tempdir().unwrap();
        let l = OciLayout::open_or_create(dir.path()).unwrap();
        let data: Vec<u8> = (0..(3u32 << 20) + 5).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
        let d = l.put_blob(&data).unwrap();
        for (off, len) in [(0usize, 10usize), (4097, MAP_MIN - 1), (4097, MAP_MIN), (1, data.len() - 1), (0, data.len())] {
            let got = l.read_range_unverified(&d, off as u64, len).unwrap();
            assert!(got[..] == data[off..off + len], "range {off}+{len}");
        }
        for (off, len) in [(data.len() - 4, MAP_MIN), (data.len() - 4, 10), (usize::MAX - 2, MAP_MIN)] {
            let e = l.read_range_unverified(&d, off as u64, len).unwrap_err();
            assert!(matches!(e, FormatError::Truncated { .. }), "{off}+{len}: {e}");
        }
    }

    /// Issue 14 §3: moving a tag in an `index.json` another tool also writes keeps every
    /// field of every other entry, and of the index itself.
    #[test]
    fn regression_issue_14_set_tag_keeps_what_other_tools_wrote() {
        let dir = tempfile::tempdir().unwrap();
        let l = OciLayout::open_or_create(dir.path()).unwrap();
        let theirs = OciDigest::of(b"theirs");
        let other = serde_json::json!({
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": theirs.as_str(),
            "size": 6,
            "platform": {"architecture": "arm64", "os": "linux", "variant": "v8"},
            "urls": ["https://mirror.example/x"],
            "data": "dGhlaXJz",
            "artifactType": "application/vnd.example.thing",
            "annotations": {"org.opencontainers.image.ref.name": "theirs", "k": "v"},
            "io.example.unknown": true
        });
        let index = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "artifactType": "application/vnd.example.index",
            "subject": {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": theirs.as_str(), "size": 6},
            "io.example.top": [1, 2],
            "manifests": [other.clone()],
            "annotations": {"top": "level"}
        });
        fs::write(dir.path().join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
        let d = l.put_blob(b"ours").unwrap();
        l.set_tag("v1", Descriptor::new("x", d.clone(), 4)).unwrap();
        let after: serde_json::Value = serde_json::from_slice(&fs::read(dir.path().join("index.json")).unwrap()).unwrap();
        assert_eq!(after["manifests"][0], other, "the other tool's entry, field for field");
        assert_eq!(after["manifests"][1]["digest"], d.as_str());
        for k in ["artifactType", "subject", "io.example.top", "annotations"] {
            assert_eq!(after[k], index[k], "{k}");
        }
        assert_eq!(l.resolve_tag("theirs").unwrap(), theirs);
    }

    /// Issue 14 §5: a killed writer's temp blob (its pid gone, unlocked, old) is removed
    /// when the layout is next opened to write; a locked one, a young one, and a live
    /// writer's are not.
    #[test]
    fn regression_issue_14_stale_temp_blobs_are_removed_live_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let l = OciLayout::open_or_create(dir.path()).unwrap();
        let blobs = dir.path().join("blobs/sha256");
        let old = std::time::SystemTime::now() - STALE_TEMP_AGE * 2;
        let make = |name: &str, age: std::time::SystemTime| {
            let f = OpenOptions::new().read(true).write(true).create_new(true).open(blobs.join(name)).unwrap();
            f.write_all_at(&[7u8; 4096], 0).unwrap();
            f.set_modified(age).unwrap();
            f
        };
        drop(make(".tmp-blob-4000000-0-1", old)); // killed: pid gone, unlocked, old
        drop(make(".tmp-blob-4000000-0-2", std::time::SystemTime::now())); // too young to tell
        let held = make(".tmp-blob-4000001-0-3", old); // a writer in another pid namespace
        held.try_lock().unwrap();
        let mut live = l.blob_writer().unwrap(); // this process's own writer
        live.write_all(b"in progress").unwrap();
        live.flush().unwrap();
        File::options().write(true).open(&live.tmp).unwrap().set_modified(old).unwrap();
        let mut before: Vec<_> = fs::read_dir(&blobs).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        before.sort();
        assert_eq!(before.len(), 4);

        drop(OciLayout::open_or_create(dir.path()).unwrap());
        let mut after: Vec<_> = fs::read_dir(&blobs).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        after.sort();
        before.retain(|n| n != ".tmp-blob-4000000-0-1");
        assert_eq!(after, before, "only the killed writer's temp file goes");
        drop(held);
        let (d, _) = live.finish().unwrap();
        assert!(l.has_blob(&d), "the live writer finished its blob");
    }

    #[test]
    fn dropped_writer_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let l = OciLayout::open_or_create(dir.path()).unwrap();
        {
            let mut w = l.blob_writer().unwrap();
            w.write_all(b"partial").unwrap();
        }
        let n = fs::read_dir(dir.path().join("blobs/sha256")).unwrap().count();
        assert_eq!(n, 0);
    }
}
