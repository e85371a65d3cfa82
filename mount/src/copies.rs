//! Whole-file copies for FUSE passthrough: once every stored chunk of a file is in the
//! chunk cache, its verified bytes are written to a private file, which the kernel then
//! reads directly for later opens ([`crate::fs`]), without asking the daemon.
//!
//! ```text
//! <cache>/mount-files/                 0700, the daemon's user's
//!   <pid>-<n>-<nanos>.lock             held (shared) by the daemon whose copies these are
//!   <pid>-<n>-<nanos>/                 0700: one host daemon's copies
//!     <hash>-<algo>-<hex>-<size>       0600: one content's bytes (zero chunks as holes)
//!     .tmp-<n>                         a copy being written
//!
//! make: after the image's fill (or at once, when the cache holds the file already):
//!       every chunk read through the image's chunk source (a cached chunk re-hashed, a
//!       zero chunk's record checked) -> temp file -> fsync -> rename -> fsync the directory
//! keep: while an image holding the content is presented; the last one gone, it goes
//! sweep: a host mount that starts removes every directory whose lock nobody holds
//! ```
//!
//! A copy is named by its content ([`ContentId`]), so two images holding the same file
//! share one. Its bytes are not checked again when read: they were verified as they were
//! written, and only the daemon's user can write them (spec/mount.md §8).

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, RwLock, Weak};

use imgfmt::file::{Dir, UseLock};

use crate::chunks::{ChunkBytes, ChunkSource, Need};
use crate::tree::{Content, ContentId, Tree};
use crate::Served;

/// The directory under the cache root that holds every host daemon's copies.
pub const DIR: &str = "mount-files";

/// Why a host mount has no copies (so no passthrough).
#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum CopyError {
    /// {path}: {source}
    Io { path: PathBuf, source: std::io::Error },
    /// {0}: owned by uid {1}, not by the daemon's user: whole-file copies must be writable by it alone
    NotOurs(PathBuf, u32),
}

enum Slot {
    /// Being written; `orphan`: no image holds its content any more (removed once written).
    Building {
        orphan: bool,
    },
    Ready,
}

/// One host daemon's copies.
pub struct Copies {
    /// `<cache>/mount-files/<name>`.
    dir: Dir,
    /// `<cache>/mount-files`.
    parent: Dir,
    name: OsString,
    lock: Mutex<Option<UseLock>>,
    slots: Mutex<HashMap<ContentId, Slot>>,
    seq: AtomicU64,
}

/// `dir/name`, made if missing, then checked to be the daemon's user's and made 0700.
fn private_dir(dir: &Dir, name: &OsStr) -> Result<Dir, CopyError> {
    let path = dir.display_path(name);
    let io = |source| CopyError::Io { path: path.clone(), source };
    let d = dir.create_dir_all(Path::new(name)).map_err(io)?;
    let f = File::from(d.as_fd().try_clone_to_owned().map_err(io)?);
    let md = f.metadata().map_err(io)?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if md.uid() != me {
        return Err(CopyError::NotOurs(path, md.uid()));
    }
    if md.mode() & 0o777 != 0o700 {
        f.set_permissions(std::fs::Permissions::from_mode(0o700)).map_err(io)?;
    }
    Ok(d)
}

/// Remove directory `name` of `parent` and the files in it (a name in it that is not a
/// file is left, and so is the directory then).
fn remove_tree(parent: &Dir, name: &OsStr) {
    if let Ok(d) = parent.open_dir(Path::new(name)) {
        for n in d.names().unwrap_or_default() {
            let _ = d.remove_file(&n);
        }
    }
    if let Err(e) = parent.remove_dir(name) {
        tracing::debug!("{}: {e}", parent.display_path(name).display());
    }
}

/// The lock file beside a daemon's directory of copies `name`.
fn lock_name(name: &OsStr) -> OsString {
    let mut lock = name.to_os_string();
    lock.push(".lock");
    lock
}

/// Remove the copies of host daemons that are gone (their lock is free) under
/// `<cache_root>/mount-files`. Returns how many directories went.
pub fn sweep(cache_root: &Path) -> usize {
    let Ok(parent) = Dir::open(&cache_root.join(DIR)) else { return 0 };
    let names = parent.names().unwrap_or_default();
    let mut owners: Vec<OsString> = names
        .iter()
        .filter(|n| !n.to_string_lossy().starts_with('.'))
        .map(|n| n.to_string_lossy().strip_suffix(".lock").map_or_else(|| n.clone(), OsString::from))
        .collect();
    owners.sort();
    owners.dedup();
    let mut swept = 0;
    for o in owners {
        let Ok(Some(lock)) = UseLock::try_exclusive(&parent.display_path(lock_name(&o))) else { continue };
        remove_tree(&parent, &o);
        let _ = lock.remove();
        swept += 1;
    }
    swept
}

/// A copy's file name: its content, in characters a file name takes as they are.
fn file_name(id: &ContentId) -> Option<OsString> {
    let root = id.root.replace(':', "-");
    root.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-').then(|| OsString::from(format!("{root}-{}", id.size)))
}

impl Copies {
    /// A directory of copies of this daemon's own under `<cache_root>/mount-files`, held
    /// by a lock for as long as it lives.
    pub fn start(cache_root: &Path) -> Result<Copies, CopyError> {
        let root = Dir::create_all(cache_root).map_err(|source| CopyError::Io { path: cache_root.to_path_buf(), source })?;
        let parent = private_dir(&root, OsStr::new(DIR))?;
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        static STARTED: AtomicU64 = AtomicU64::new(0);
        let name = OsString::from(format!("{}-{}-{nanos}", std::process::id(), STARTED.fetch_add(1, Relaxed)));
        let lock_path = parent.display_path(lock_name(&name));
        let lock = UseLock::shared(&lock_path).map_err(|source| CopyError::Io { path: lock_path, source })?;
        let dir = private_dir(&parent, &name)?;
        Ok(Copies { dir, parent, name, lock: Mutex::new(Some(lock)), slots: Mutex::new(HashMap::new()), seq: AtomicU64::new(0) })
    }

    /// The directory the copies are in.
    pub fn path(&self) -> PathBuf {
        self.parent.display_path(&self.name)
    }

    /// The copy of content `id`, opened for reading, if it is ready.
    pub fn open(&self, id: &ContentId) -> Option<File> {
        if !matches!(self.slots.lock().expect("poisoned").get(id), Some(Slot::Ready)) {
            return None;
        }
        match self.dir.open_own_file(&file_name(id)?, false) {
            Ok(f) => Some(f),
            Err(e) => {
                tracing::warn!("{}: {e}: its opens go through the daemon", self.dir.display_path(file_name(id)?).display());
                None
            }
        }
    }

    /// Take content `id` to write: `false` when it is written already or being written.
    fn claim(&self, id: &ContentId) -> bool {
        let mut slots = self.slots.lock().expect("poisoned");
        if slots.contains_key(id) {
            return false;
        }
        slots.insert(id.clone(), Slot::Building { orphan: false });
        true
    }

    /// A claimed copy is written (`ok`) or given up.
    fn finish(&self, id: &ContentId, ok: bool) {
        let mut slots = self.slots.lock().expect("poisoned");
        let orphan = matches!(slots.get(id), Some(Slot::Building { orphan: true }));
        if ok && !orphan {
            slots.insert(id.clone(), Slot::Ready);
            return;
        }
        slots.remove(id);
        if ok {
            self.remove(id);
        }
    }

    fn remove(&self, id: &ContentId) {
        if let Some(n) = file_name(id) {
            if let Err(e) = self.dir.remove_file(&n) {
                tracing::debug!("{}: {e}", self.dir.display_path(&n).display());
            }
        }
    }

    /// Keep only the copies whose content `keep` says is presented (one being written is
    /// removed once it is).
    pub fn retain(&self, keep: impl Fn(&ContentId) -> bool) {
        let mut slots = self.slots.lock().expect("poisoned");
        let gone: Vec<ContentId> = slots.keys().filter(|id| !keep(id)).cloned().collect();
        for id in gone {
            match slots.get_mut(&id) {
                Some(Slot::Building { orphan }) => *orphan = true,
                _ => {
                    slots.remove(&id);
                    self.remove(&id);
                }
            }
        }
    }

    /// Whether content `id`'s copy is no longer wanted (while it is being written).
    fn orphaned(&self, id: &ContentId) -> bool {
        matches!(self.slots.lock().expect("poisoned").get(id), Some(Slot::Building { orphan: true }))
    }

    /// Remove every copy and this daemon's directory (the daemon ends). Processes that
    /// still have a file open through passthrough keep reading it: the kernel holds it.
    pub fn clear(&self) {
        self.slots.lock().expect("poisoned").clear();
        let Some(lock) = self.lock.lock().expect("poisoned").take() else { return };
        remove_tree(&self.parent, &self.name);
        drop(lock);
        // Removed by whoever holds it alone: a sweep of another daemon may be looking.
        if let Ok(Some(l)) = UseLock::try_exclusive(&self.parent.display_path(lock_name(&self.name))) {
            let _ = l.remove();
        }
    }

    /// Write file `file` of `src` as the copy of content `id`: every chunk through `src`
    /// (verified), zero chunks left as holes, then fsync and rename into place.
    fn write(&self, id: &ContentId, src: &dyn ChunkSource, file: usize, stop: &dyn Fn() -> bool) -> Result<(), String> {
        let name = file_name(id).ok_or_else(|| format!("a content root {:?} that names no file", id.root))?;
        let tmp = OsString::from(format!(".tmp-{}", self.seq.fetch_add(1, Relaxed)));
        let f = self.dir.create_new(&tmp, 0o600).map_err(|e| format!("creating {}: {e}", self.dir.display_path(&tmp).display()))?;
        let res = (|| {
            let image = src.image();
            let entry = &image.files[file];
            f.set_len(entry.size).map_err(|e| e.to_string())?;
            for c in 0..entry.chunks.len() as u64 {
                if stop() {
                    return Err("stopped".to_string());
                }
                if let ChunkBytes::Verified(v) = src.chunk(file, c, Need::Fill).map_err(|e| e.to_string())? {
                    f.write_all_at(v.as_bytes(), c << image.chunk_shift()).map_err(|e| e.to_string())?;
                }
            }
            f.sync_all().map_err(|e| e.to_string())?;
            self.dir.rename(&tmp, &name, false).map_err(|e| e.to_string())?;
            self.dir.sync().map_err(|e| e.to_string())
        })();
        if res.is_err() {
            let _ = self.dir.remove_file(&tmp);
        }
        res
    }
}

impl Drop for Copies {
    fn drop(&mut self) {
        self.clear();
    }
}

/// Make the copies of the files image `served` presents (its own and, in the clone
/// layout, its base's) that are complete in the chunk cache and have none yet; until it
/// is no longer presented or `stop`. Each copy made or given up is logged.
pub fn make_complete(tree: &RwLock<Tree>, copies: &Copies, served: &Weak<Served>, stop: &AtomicBool) {
    let Some(name) = served.upgrade().map(|s| s.name.clone()) else { return };
    let contents = tree.read().unwrap_or_else(|p| p.into_inner()).contents_of(&name);
    for (id, content) in contents {
        let Some(s) = served.upgrade().filter(|_| !stop.load(Relaxed)) else { return };
        let (src, file) = match (content, &s.base) {
            (Content::File { file }, _) => (s.chunks.as_ref(), file),
            (Content::BaseFile { file }, Some(base)) => (base.as_ref(), file),
            _ => continue,
        };
        src.settle();
        if !src.complete(file) || !copies.claim(&id) {
            continue;
        }
        let shown = &src.image().files[file].name;
        match copies.write(&id, src, file, &|| stop.load(Relaxed) || copies.orphaned(&id)) {
            Ok(()) => {
                copies.finish(&id, true);
                tracing::info!("{name}: {shown}: complete: later opens are served by FUSE passthrough from its whole-file copy");
            }
            Err(e) => {
                copies.finish(&id, false);
                tracing::warn!("{name}: {shown}: no whole-file copy ({e}): its reads stay with the daemon");
            }
        }
        // An image removed while the copy was written: its content may be gone with it.
        let tree = tree.read().unwrap_or_else(|p| p.into_inner());
        copies.retain(|i| tree.holds(i));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use imgfmt::{BlobSource, RetryPolicy};
    use puller::ChunkCache;

    use super::*;
    use crate::Fetcher;

    #[test]
    fn a_complete_file_is_copied_privately_and_a_dead_daemons_copies_are_swept() {
        let t = tempfile::tempdir().unwrap();
        let (layout, image, data) = crate::chunks::tests::packed_mib(t.path(), 3);
        let src: Arc<dyn BlobSource> = layout;
        let root = t.path().join("cache");
        let cache = Arc::new(ChunkCache::open(&root, 1 << 30).unwrap());
        let fetcher = Fetcher::new(image.clone(), src, Some(cache), RetryPolicy::never(), 0);
        assert!(!fetcher.complete(0), "nothing cached yet");
        for c in 0..3 {
            fetcher.fill(0, c).unwrap();
        }
        fetcher.settle();
        assert!(fetcher.complete(0), "the fill's chunks are in the cache once settled");

        let copies = Copies::start(&root).unwrap();
        let id = ContentId { root: "blake3:blake3:00ff".into(), size: data.len() as u64 };
        assert!(copies.claim(&id) && !copies.claim(&id), "one writer per content");
        copies.write(&id, fetcher.as_ref(), 0, &|| false).unwrap();
        assert!(copies.open(&id).is_none(), "not ready before it is finished");
        copies.finish(&id, true);
        let mut got = Vec::new();
        std::io::Read::read_to_end(&mut copies.open(&id).unwrap(), &mut got).unwrap();
        assert!(got == data, "the copy holds the file's bytes");
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!((mode(&root.join(DIR)), mode(&copies.path()), mode(&copies.path().join(file_name(&id).unwrap()))), (0o700, 0o700, 0o600));

        copies.retain(|_| false);
        assert!(copies.open(&id).is_none() && !copies.path().join(file_name(&id).unwrap()).exists(), "gone with its last image");

        // A daemon that was killed left its directory and a lock nobody holds; a live
        // daemon's lock is held.
        let live = Copies::start(&root).unwrap();
        let parent = root.join(DIR);
        std::fs::create_dir(parent.join("1-0-5")).unwrap();
        std::fs::write(parent.join("1-0-5/blake3-blake3-00-1"), b"x").unwrap();
        std::fs::write(parent.join("1-0-5.lock"), b"").unwrap();
        assert_eq!(sweep(&root), 1, "the dead daemon's directory only");
        assert!(!parent.join("1-0-5").exists() && !parent.join("1-0-5.lock").exists());
        assert!(live.path().is_dir() && copies.path().is_dir(), "live daemons' copies stay");
        drop((live, copies));
        assert_eq!(parent.read_dir().unwrap().count(), 0, "a daemon that ends leaves nothing");
    }
}
