//! The per-host chunk cache: content-addressed files of uncompressed chunk bytes, shared
//! by concurrent pulls (and the lazy restore server), bounded by allocated bytes with
//! least-recently-used eviction, crash-safe. Layout and argument: `spec/cache.md`.
//!
//! ```text
//! <root>/chunks/v1/<algo>/<2 hex>/<64 hex>   one chunk's bytes, nothing else
//! <root>/chunks/v1/tmp/<pid>.<seq>.<nanos>.tmp   a put in progress (or a crash's leftover)
//! <root>/chunks/v1/lock                      flock'd for the eviction pass
//! <root>/chunks/v1/pins/<pid>-<seq>-<nanos>.pin   chunks a running restore keeps (flock'd)
//! ```
//!
//! A put writes a temp file, `fdatasync`s it, renames it under its digest and fsyncs the
//! directory: a crash can forget a chunk but never leave a torn one under its name. A get
//! re-hashes the bytes every time, so damage after the fact (a bad disk, a stray write) is
//! a miss (the entry is deleted), never served.
//!
//! The cache's bound covers the whole cache directory, not only chunks: the push layouts
//! `push DIR` keeps, upload resume state and the known-blobs records are entries of the
//! same least-recently-used eviction, under one budget (`--cache-size`; spec/cache.md
//! §7). A push layout in use (a push holds its [`imgfmt::file::UseLock`]) is left alone;
//! one being evicted is renamed away first, so a kill in the middle leaves either the
//! whole layout under its name or a leftover the next pass removes. A file being written
//! (a stamp's or a state file's temp of a live process) is never an entry.
//!
//! **Pins.** A running restore pins the chunks of the file it serves ([`ChunkCache::pin`]):
//! a pin file under `chunks/v1/pins/` that its process holds locked while it lives. Every
//! pass, of any process, leaves the chunks of live pins alone (`prune --all` too) and
//! deletes the pins of processes that are gone. Pinned bytes count toward the budget: a
//! pinned chunk that would take the pinned bytes past the limit is not stored
//! ([`ChunkCache::pinned_room`] says how much room is left).
//!
//! Whoever else can write into the cache directory cannot make it write, touch or delete
//! anything outside it: `chunks/v1` and `tmp/` are opened beneath the root without
//! following symlinks, temp files are created and renamed through those descriptors,
//! prefix directories that are symlinks are neither written into nor scanned, and an entry
//! or reference that is a symlink, FIFO or device is a miss, never opened through
//! (spec/cache.md §1).

use std::ffi::{OsStr, OsString};
use std::fs::{self, File};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

mod pins;
mod range;

use imgfmt::compress::Codec;
use imgfmt::file::{Dir, UseLock};
use imgfmt::{ChunkDigest, HashAlgo};
use serde::Serialize;
use verify::VerifiedChunk;

/// Default bound on the cache's allocated bytes: 10 GiB.
pub const DEFAULT_LIMIT: u64 = 10 << 30;
/// Version directory: a change of layout gets a new one instead of misreading the old.
const VERSION_DIR: &str = "chunks/v1";
/// Largest entry `get` will read: the format's largest chunk (16 MiB).
const MAX_ENTRY: u64 = 1 << imgfmt::MAX_CHUNK_SHIFT;
/// A temp file whose writer is gone, or this old, is a crash's leftover.
const STALE_TEMP: Duration = Duration::from_secs(3600);
/// A small file's temp (a stamp, a state file) younger than this is taken as being written
/// even when its writer's pid is not seen here (another pid namespace): such a write takes
/// milliseconds.
const STALE_WRITE: Duration = Duration::from_secs(60);
/// Recency is the entry's mtime, refreshed on a hit at most this often (so hot chunks do
/// not cost a metadata write per read).
const TOUCH_EVERY: Duration = Duration::from_secs(60);
/// An eviction pass brings the cache down to this fraction of the limit (in percent), so
/// the next few puts do not each trigger a pass.
const EVICT_TO_PERCENT: u64 = 90;
/// Under the cache root: `push DIR`'s layouts (`<32 hex>/`, `<32 hex>.stamp.json`,
/// `<32 hex>.lock`), upload resume state, the records of where blobs were seen.
const PUSH_LAYOUTS: &str = "push-layouts";
const UPLOADS: &str = "uploads";
const KNOWN_BLOBS: &str = "known-blobs";
/// A push layout being deleted is first renamed to `.evicting-<32 hex>-<pid>-<nanos>`.
const EVICTING_PREFIX: &str = ".evicting-";
/// Small files under the cache root (stamps, upload state, known-blobs records) are written
/// to `.tmp-<pid>-<n>-<nanos>` beside their name and renamed over it
/// (`imgfmt::layout::write_atomic_mode`).
const WRITE_TEMP_PREFIX: &str = ".tmp-";
/// Under `chunks/v1`: the pins of running restores.
const PINS_DIR: &str = "pins";

/// What an entry of the cache directory is: the kinds `snapctl cache` lists, all under
/// one budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum EntryKind {
    /// Chunk copies and references (`chunks/v1`).
    Chunks,
    /// Layouts `push DIR` packed into, with their stamps (`push-layouts/`).
    PushLayouts,
    /// Resume state of chunked uploads (`uploads/`).
    Uploads,
    /// Which repositories of a registry hold which blobs, for mounts (`known-blobs/`).
    KnownBlobs,
}

impl EntryKind {
    pub const ALL: [EntryKind; 4] = [EntryKind::Chunks, EntryKind::PushLayouts, EntryKind::Uploads, EntryKind::KnownBlobs];

    pub fn name(self) -> &'static str {
        match self {
            EntryKind::Chunks => "chunks",
            EntryKind::PushLayouts => "push-layouts",
            EntryKind::Uploads => "uploads",
            EntryKind::KnownBlobs => "known-blobs",
        }
    }
}

/// What the cache directory holds of one kind.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct KindUsage {
    pub kind: EntryKind,
    /// Entries: chunk copies and references, push layouts, state files.
    pub entries: u64,
    /// Allocated bytes.
    pub bytes: u64,
    /// Entries in use (a push layout a push holds, a chunk a running restore pins, a file
    /// being written): never evicted.
    pub in_use: u64,
}

/// What the cache directory holds (`snapctl cache`).
#[derive(Debug, Clone, Serialize)]
pub struct Usage {
    pub dir: PathBuf,
    pub limit_bytes: u64,
    pub total_bytes: u64,
    pub total_entries: u64,
    /// Allocated bytes of the chunk entries live pins name (part of `total_bytes`).
    pub pinned_bytes: u64,
    /// Live pins: restores running on this host that keep their image's chunks here.
    pub pins: u64,
    /// One row per kind, in [`EntryKind::ALL`] order.
    pub kinds: Vec<KindUsage>,
}

/// What a prune did (`snapctl cache prune`).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Pruned {
    pub entries_evicted: u64,
    pub bytes_freed: u64,
    /// Entries left because they are in use.
    pub in_use_kept: u64,
    /// Leftovers of interrupted evictions and writes removed.
    pub leftovers_removed: u64,
}

#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum CacheError {
    /// chunk cache {path}: {source}
    Io { path: PathBuf, source: std::io::Error },
    /// chunk cache: a chunk of {len} bytes is larger than any chunk the format allows
    TooLarge { len: u64 },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CacheError + '_ {
    move |source| CacheError::Io { path: path.to_path_buf(), source }
}

/// Counters since this handle was opened (except `bytes_allocated`: the cache's size as
/// last measured or estimated, all processes included).
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    /// Entries written by this handle (puts of a chunk already present are not counted).
    pub puts: u64,
    /// Entries deleted to stay within the limit.
    pub evictions: u64,
    /// Entries whose bytes no longer matched their digest: deleted, reported as misses.
    pub damaged: u64,
    /// References whose file was gone or no longer held the chunk: deleted, misses.
    pub stale_refs: u64,
    /// Stray temp files of crashed writers removed.
    pub stray_temps_removed: u64,
    /// Pinned chunks not stored because the pinned bytes would have passed the limit.
    pub pinned_over_budget: u64,
    pub bytes_allocated: u64,
    pub limit_bytes: u64,
}

/// References written under temporary names by [`ChunkCache::prepare_refs`], not yet
/// visible. Dropped without [`PreparedRefs::commit`], the temporaries are removed.
#[must_use = "nothing is in the cache until commit"]
pub struct PreparedRefs<'a> {
    cache: &'a ChunkCache,
    /// (prefix directory, temporary name, entry name, digest)
    pending: Vec<(Arc<Dir>, OsString, OsString, ChunkDigest)>,
}

impl PreparedRefs<'_> {
    /// Move the references whose digest `keep` accepts into place (the others are
    /// removed); returns how many became visible, or the first failure (the rest are
    /// still tried: a failed rename only loses that one reference).
    pub fn commit(mut self, keep: impl Fn(&ChunkDigest) -> bool) -> Result<u64, CacheError> {
        let mut written = 0u64;
        let mut first_err = None;
        for (dir, tmp, name, digest) in std::mem::take(&mut self.pending) {
            if !keep(&digest) {
                let _ = dir.remove_file(&tmp);
                continue;
            }
            match dir.rename(&tmp, &name, true) {
                Ok(()) => written += 1,
                Err(e) => {
                    let _ = dir.remove_file(&tmp);
                    first_err.get_or_insert_with(|| io(&dir.display_path(&name))(e));
                }
            }
        }
        self.cache.puts.fetch_add(written, Ordering::Relaxed);
        self.cache.grew(written * 4096)?;
        match first_err {
            Some(e) => Err(e),
            None => Ok(written),
        }
    }
}

impl Drop for PreparedRefs<'_> {
    fn drop(&mut self) {
        for (dir, tmp, _, _) in &self.pending {
            let _ = dir.remove_file(tmp);
        }
    }
}

/// The chunks of each pin a handle holds, by pin: what its puts count toward the budget.
type OwnPins = Arc<Mutex<std::collections::HashMap<u64, Arc<pins::Pinned>>>>;

/// Chunks kept in the cache while this lives ([`ChunkCache::pin`]): no eviction pass of any
/// process deletes them, `snapctl cache prune --all` included. Dropped, its pin file goes;
/// the pin file of a process that was killed is deleted by the next pass (its lock is free).
#[derive(Debug)]
pub struct Pin {
    /// The pin file, locked shared for as long as the pin lives.
    file: File,
    dir: Dir,
    name: OsString,
    id: u64,
    own: OwnPins,
    chunks: usize,
}

impl Pin {
    /// Chunks the pin names.
    pub fn chunks(&self) -> usize {
        self.chunks
    }

    /// The pin file.
    pub fn path(&self) -> PathBuf {
        self.dir.display_path(&self.name)
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        self.own.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.id);
        // Removed while still locked, then closed: no pass takes it for a dead holder's.
        let _ = self.dir.remove_file(&self.name);
        let _ = self.file.unlock();
    }
}

/// A per-host, content-addressed chunk cache. `Send + Sync`: share one with an `Arc` or
/// by reference across threads; several processes may open the same directory.
#[derive(Debug)]
pub struct ChunkCache {
    /// The cache directory (`--cache DIR`): the budget covers everything under it that
    /// snapctl keeps.
    root: PathBuf,
    base: PathBuf,
    tmp: PathBuf,
    /// `base` and `tmp`, opened beneath the cache root without following symlinks: puts
    /// create, rename and remove through these, never through the paths.
    base_dir: Dir,
    tmp_dir: Dir,
    /// `chunks/v1/pins`, opened like `tmp`.
    pins_dir: Dir,
    /// The chunks of the pins this handle holds.
    own_pins: OwnPins,
    /// Allocated bytes of pinned chunk entries (every live pin's, every process's): measured
    /// by the last pass or [`ChunkCache::measure_pins`], plus this handle's pinned puts since.
    pinned: AtomicU64,
    pinned_over: AtomicU64,
    limit: u64,
    hits: AtomicU64,
    misses: AtomicU64,
    puts: AtomicU64,
    evictions: AtomicU64,
    damaged: AtomicU64,
    stale_refs: AtomicU64,
    strays: AtomicU64,
    /// Allocated bytes: measured by the last scan plus what this handle put since.
    allocated: AtomicU64,
    /// Bytes this handle put since the last scan: other processes' puts are invisible to
    /// the estimate, so a rescan happens every tenth of the limit regardless.
    since_scan: AtomicU64,
    seq: AtomicU64,
    /// One eviction pass at a time within the process (the flock covers other processes).
    evicting: Mutex<()>,
    /// Pause before each entry an eviction deletes: a throttle for tests that kill a pass
    /// half-way (0 in real use).
    evict_delay: Duration,
}

/// Suffix of a reference entry's name (`<hex>.ref`).
const REF_SUFFIX: &str = ".ref";
/// Largest reference entry read: a header and a path.
const MAX_REF: u64 = 8192;
/// A reference being written: `<xx>/.ref-<pid>.<seq>` (never read; removed by a scan once
/// its writer is gone).
const REF_TEMP_PREFIX: &str = ".ref-";

/// A reference entry: "these bytes are at `offset` of `file`", for chunks a pull wrote
/// into a file that stays on the host. Encoded as `snapctl-chunk-ref v1 <len> <offset>\n`
/// followed by the file's absolute path (raw bytes, to the end).
#[derive(Debug, Clone, PartialEq, Eq)]
struct ChunkRef {
    len: u32,
    offset: u64,
    file: PathBuf,
}

impl ChunkRef {
    const MAGIC: &'static str = "snapctl-chunk-ref v1";

    fn encode(&self) -> Vec<u8> {
        use std::os::unix::ffi::OsStrExt;
        let mut v = format!("{} {} {}\n", Self::MAGIC, self.len, self.offset).into_bytes();
        v.extend_from_slice(self.file.as_os_str().as_bytes());
        v
    }

    fn decode(raw: &[u8]) -> Option<ChunkRef> {
        use std::os::unix::ffi::OsStrExt;
        let nl = raw.iter().position(|&b| b == b'\n')?;
        let head = std::str::from_utf8(&raw[..nl]).ok()?;
        let rest = head.strip_prefix(Self::MAGIC)?.strip_prefix(' ')?;
        let (len, offset) = rest.split_once(' ')?;
        let file = PathBuf::from(std::ffi::OsStr::from_bytes(&raw[nl + 1..]));
        if !file.is_absolute() {
            return None;
        }
        Some(ChunkRef { len: len.parse().ok()?, offset: offset.parse().ok()?, file })
    }
}

/// One cache entry seen by a scan: a file (a chunk, a reference, a state file) or a push
/// layout (its directory, stamp and lock, evicted together).
struct Entry {
    path: PathBuf,
    allocated: u64,
    used: SystemTime,
    kind: EntryKind,
    /// A push layout (`path` is its directory), not a file.
    layout: bool,
    /// In use, never evicted: a chunk a live pin names, a file a live process is writing.
    held: bool,
}

/// Bring everything under the cache directory `dir` (chunks, push layouts, upload state,
/// known blobs) within `limit_bytes`, least recently used first: what a command that added
/// to it without keeping a [`ChunkCache`] open (a push) does before it ends. The pass
/// [`ChunkCache::open`] makes with that bound.
pub fn keep_within_budget(dir: &Path, limit_bytes: u64) -> Result<(), CacheError> {
    ChunkCache::open(dir, limit_bytes).map(drop)
}

impl ChunkCache {
    /// Open (creating) a cache rooted at `dir`, bounded to `limit_bytes` of allocated space.
    /// Measures the cache, removes stray temp files of crashed writers, and evicts if the
    /// cache is over the limit (a smaller limit than last time shrinks it).
    pub fn open(dir: &Path, limit_bytes: u64) -> Result<ChunkCache, CacheError> {
        let base = dir.join(VERSION_DIR);
        let tmp = base.join("tmp");
        // The root is the caller's to choose; beneath it, a symlink is refused.
        let base_dir = Dir::create_all(dir).and_then(|d| d.create_dir_all(Path::new(VERSION_DIR))).map_err(io(&base))?;
        let tmp_dir = base_dir.create_dir_all(Path::new("tmp")).map_err(io(&tmp))?;
        let pins_dir = base_dir.create_dir_all(Path::new(PINS_DIR)).map_err(io(&base.join(PINS_DIR)))?;
        let c = ChunkCache {
            root: dir.to_path_buf(),
            base,
            tmp,
            base_dir,
            tmp_dir,
            pins_dir,
            own_pins: Arc::default(),
            pinned: AtomicU64::new(0),
            pinned_over: AtomicU64::new(0),
            limit: limit_bytes,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            puts: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            damaged: AtomicU64::new(0),
            stale_refs: AtomicU64::new(0),
            strays: AtomicU64::new(0),
            allocated: AtomicU64::new(0),
            since_scan: AtomicU64::new(0),
            seq: AtomicU64::new(0),
            evicting: Mutex::new(()),
            evict_delay: Duration::ZERO,
        };
        c.clean_temps()?;
        c.maintain(true)?;
        Ok(c)
    }

    /// The host's cache directory, the one the upload state and known blobs live in too
    /// ([`regclient::cache_dir`]: `$SNAPCTL_CACHE`, else `$XDG_CACHE_HOME/snapctl`, else
    /// `~/.cache/snapctl`, else a directory under the system temp dir).
    pub fn default_dir() -> PathBuf {
        regclient::cache_dir()
    }

    /// The cache directory itself (`--cache DIR`).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The directory chunks live under (`<root>/chunks/v1`).
    pub fn dir(&self) -> &Path {
        &self.base
    }

    /// Where the entry for `digest` lives.
    pub fn entry_path(&self, algo: HashAlgo, digest: &ChunkDigest) -> PathBuf {
        let hex = digest.to_hex();
        self.base.join(algo.name()).join(&hex[..2]).join(hex)
    }

    /// The chunk if present AND its bytes still hash to `digest` (re-checked on every read,
    /// so a damaged entry is deleted and reported as a miss, never served). A copy is read
    /// under its name; else a reference entry is followed, if there is one and the file it
    /// names still holds those bytes (re-hashed, like a copy): a reference whose file is gone,
    /// shorter, or changed is stale, deleted, a miss.
    pub fn get(&self, algo: HashAlgo, digest: &ChunkDigest, len: u32) -> Result<Option<VerifiedChunk>, CacheError> {
        let mut buf = vec![0u8; len as usize];
        // What is wrong when the bytes are short or do not hash: the copy, or the reference.
        let (entry, modified, wrong) = match self.locate(algo, digest, len)? {
            Found::Missing => {
                self.misses.fetch_add(1, Ordering::Relaxed);
                return Ok(None);
            }
            Found::Damaged(path) => {
                self.drop_damaged(&path);
                return Ok(None);
            }
            Found::Stale(rpath) => {
                self.drop_stale(&rpath);
                return Ok(None);
            }
            Found::Copy { mut file, path, modified } => {
                if let Err(e) = file.read_exact(&mut buf) {
                    if e.kind() != ErrorKind::UnexpectedEof {
                        return Err(io(&path)(e));
                    }
                    self.drop_damaged(&path);
                    return Ok(None);
                }
                (file, modified, Wrong::Copy(path))
            }
            Found::Ref { rfile, rpath, modified, file, offset } => {
                use std::os::unix::fs::FileExt;
                if file.read_exact_at(&mut buf, offset).is_err() {
                    // Unreadable or shorter now: the reference is what is wrong, not the disk.
                    self.drop_stale(&rpath);
                    return Ok(None);
                }
                (rfile, modified, Wrong::Ref(rpath))
            }
        };
        match verify::verify_stored(algo, Codec::Raw, buf, len, digest) {
            Ok(chunk) => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                touch(&entry, modified);
                Ok(Some(chunk))
            }
            // Damaged; or, through a reference, the file changed after it was pulled: never
            // served.
            Err(_) => {
                match wrong {
                    Wrong::Copy(path) => self.drop_damaged(&path),
                    Wrong::Ref(rpath) => self.drop_stale(&rpath),
                }
                Ok(None)
            }
        }
    }

    /// Where the cache holds chunk `digest` (of `len` bytes), nothing read of it yet: its
    /// copy (a regular file of that length), else the file its reference entry names (only a
    /// regular file the reference's writer could have pulled, long enough), else nothing.
    /// What cannot be ours is said, for [`get`](Self::get) to delete; nothing is deleted or
    /// counted here.
    pub(crate) fn locate(&self, algo: HashAlgo, digest: &ChunkDigest, len: u32) -> Result<Found, CacheError> {
        let path = self.entry_path(algo, digest);
        match imgfmt::file::open_regular(&path) {
            Ok(file) => {
                let md = file.metadata().map_err(io(&path))?;
                // Wrong length: damaged (or a chunk of another length sharing a digest, which
                // a collision-resistant hash rules out).
                if md.len() != u64::from(len) || md.len() > MAX_ENTRY {
                    return Ok(Found::Damaged(path));
                }
                return Ok(Found::Copy { file, path, modified: md.modified().ok() });
            }
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            // A symlink, FIFO or device under an entry's name is not one of ours: a miss,
            // never opened through (and gone, as a damaged entry would be).
            Err(e) if imgfmt::file::refusal(&e).is_some() => return Ok(Found::Damaged(path)),
            Err(e) => return Err(io(&path)(e)),
        }
        let rpath = self.ref_path(algo, digest);
        let mut rfile = match imgfmt::file::open_regular(&rpath) {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Found::Missing),
            Err(e) if imgfmt::file::refusal(&e).is_some() => return Ok(Found::Stale(rpath)),
            Err(e) => return Err(io(&rpath)(e)),
        };
        let rmd = rfile.metadata().map_err(io(&rpath))?;
        // A reference is a few hundred bytes; more is not one of ours.
        let mut raw = Vec::new();
        (&mut rfile).take(MAX_REF + 1).read_to_end(&mut raw).map_err(io(&rpath))?;
        let Some(r) = ChunkRef::decode(&raw).filter(|r| r.len == len && raw.len() as u64 <= MAX_REF) else {
            return Ok(Found::Stale(rpath));
        };
        // The referenced file is read only if it is (still) a regular file: a symlink, FIFO
        // or device swapped in under its name is stale, never opened through. And only a
        // file its reference's writer could have pulled (`may_follow`): a root pull must
        // not read, for whoever can write into a shared cache, a file they could not.
        let followed = imgfmt::file::open_regular(&r.file).and_then(|f| Self::may_follow(&f, rmd.uid(), &self.base, r.offset + u64::from(len)).map(|()| f));
        Ok(match followed {
            Ok(file) => Found::Ref { rfile, rpath, modified: rmd.modified().ok(), file, offset: r.offset },
            Err(_) => Found::Stale(rpath),
        })
    }

    /// Where the reference entry for `digest` lives (beside where its copy would be).
    pub fn ref_path(&self, algo: HashAlgo, digest: &ChunkDigest) -> PathBuf {
        let mut p = self.entry_path(algo, digest).into_os_string();
        p.push(REF_SUFFIX);
        PathBuf::from(p)
    }

    /// Whether a reference entry owned by `ref_owner` may be followed to the open file `f`,
    /// which it says holds bytes up to `end`. The file must belong to the entry's owner, who
    /// must be this process's user or the owner of the cache (`base`); it must be that long
    /// (procfs files say 0), and not on a pseudo filesystem whose reads have side effects.
    /// Anything else is a stale reference, never read (spec/cache.md §1.3).
    fn may_follow(f: &File, ref_owner: u32, base: &Path, end: u64) -> std::io::Result<()> {
        let refuse = |why: String| Err(std::io::Error::new(ErrorKind::PermissionDenied, why));
        let md = f.metadata()?;
        // SAFETY: geteuid has no preconditions and touches no memory.
        let me = unsafe { libc::geteuid() };
        let cache_owner = fs::metadata(base)?.uid();
        if md.uid() != ref_owner {
            return refuse(format!("the file belongs to uid {}, its reference to uid {ref_owner}", md.uid()));
        }
        if ref_owner != me && ref_owner != cache_owner {
            return refuse(format!("the reference belongs to uid {ref_owner}, neither this user ({me}) nor the cache's owner ({cache_owner})"));
        }
        if md.len() < end {
            return refuse(format!("the file has {} bytes, the reference names bytes up to {end}", md.len()));
        }
        // procfs, sysfs, debugfs, tracefs, securityfs, configfs, cgroup, cgroup2.
        const PSEUDO: [i64; 8] = [0x9fa0, 0x6265_6572, 0x6462_6720, 0x7472_6163, 0x7363_6673, 0x6265_6570, 0x0027_e0eb, 0x6367_7270];
        let mut st = std::mem::MaybeUninit::<libc::statfs>::uninit();
        // SAFETY: fstatfs writes a statfs into the buffer we pass, sized for it, on a
        // descriptor we hold open.
        let rc = unsafe { libc::fstatfs(std::os::fd::AsRawFd::as_raw_fd(f), st.as_mut_ptr()) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // f_type's C type differs between architectures.
        #[allow(clippy::unnecessary_cast)]
        // SAFETY: fstatfs returned 0, so it filled the struct.
        let kind = unsafe { st.assume_init() }.f_type as i64;
        if PSEUDO.contains(&kind) {
            return refuse(format!("the file is on a pseudo filesystem (type {kind:#x})"));
        }
        Ok(())
    }

    fn drop_stale(&self, path: &Path) {
        self.stale_refs.fetch_add(1, Ordering::Relaxed);
        self.misses.fetch_add(1, Ordering::Relaxed);
        let _ = fs::remove_file(path);
    }

    /// Record that the chunks `items` (digest, length, offset) are held by the complete,
    /// durable file `file` (an absolute path), instead of storing copies: the pull that
    /// wrote `file` calls this after its fsync and rename. Reads re-hash the bytes, so a
    /// reference can go stale (the file deleted or changed) but never serve wrong bytes;
    /// that is also why the references themselves are not fsynced (a crash can only lose
    /// or tear one, and a torn one fails to decode: a miss). Zero chunks and digests that
    /// already have a copy are skipped. Returns how many references were written.
    pub fn put_refs(&self, algo: HashAlgo, file: &Path, items: &[(ChunkDigest, u32, u64)]) -> Result<u64, CacheError> {
        self.prepare_refs(algo, file, items)?.commit(|_| true)
    }

    /// The slow half of [`ChunkCache::put_refs`], for a pull to do while it is still
    /// fetching: write each reference under a hidden temporary name (creating ~1000 small
    /// files took 0.25 s of a 1.5 s pull here when it came after the fetch). Nothing is
    /// visible until [`PreparedRefs::commit`] renames them into place, which the pull does
    /// once `file` is durable under its name; dropped uncommitted, the temporaries go.
    pub fn prepare_refs(&self, algo: HashAlgo, file: &Path, items: &[(ChunkDigest, u32, u64)]) -> Result<PreparedRefs<'_>, CacheError> {
        if !file.is_absolute() {
            return Err(CacheError::Io {
                path: file.to_path_buf(),
                source: std::io::Error::new(ErrorKind::InvalidInput, "a chunk reference needs an absolute path"),
            });
        }
        let mut prepared = PreparedRefs { cache: self, pending: Vec::with_capacity(items.len()) };
        let mut dirs: std::collections::HashMap<String, Arc<Dir>> = std::collections::HashMap::new();
        for (digest, len, offset) in items {
            if self.entry_path(algo, digest).is_file() {
                continue;
            }
            let hex = digest.to_hex();
            let dir = match dirs.get(&hex[..2]) {
                Some(d) => d.clone(),
                None => {
                    let (d, _) = self.prefix_dir(algo, &hex)?;
                    let d = Arc::new(d);
                    dirs.insert(hex[..2].to_string(), d.clone());
                    d
                }
            };
            let body = ChunkRef { len: *len, offset: *offset, file: file.to_path_buf() }.encode();
            // The temp name is in the entry's own directory, not `tmp/`: creating files is
            // the cost of a pull's references (~0.3 ms each here), and spread over the 256
            // prefix directories, threads doing it at once do not queue on one directory.
            // Created (never opened through whatever a crash, or someone else, left under
            // the name); a leftover of a dead process with our pid is removed first.
            let tmp = OsString::from(format!("{REF_TEMP_PREFIX}{}.{}", std::process::id(), self.seq.fetch_add(1, Ordering::Relaxed)));
            let created = dir.create_new(&tmp, 0o644).or_else(|e| match e.kind() {
                ErrorKind::AlreadyExists => dir.remove_file(&tmp).and_then(|()| dir.create_new(&tmp, 0o644)),
                _ => Err(e),
            });
            if let Err(e) = created.and_then(|mut f| f.write_all(&body)) {
                let _ = dir.remove_file(&tmp);
                return Err(io(&dir.display_path(&tmp))(e));
            }
            let mut name = OsString::from(&hex);
            name.push(REF_SUFFIX);
            prepared.pending.push((dir, tmp, name, *digest));
        }
        Ok(prepared)
    }

    fn temp_name(&self) -> OsString {
        let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_nanos();
        OsString::from(format!("{}.{}.{nanos}.tmp", std::process::id(), self.seq.fetch_add(1, Ordering::Relaxed)))
    }

    /// The prefix directory `<algo>/<xx>` of the entry of `hex`, beneath `chunks/v1`
    /// without following a symlink (one planted there is refused: nothing is put through
    /// it), created if missing; and whether it was created.
    fn prefix_dir(&self, algo: HashAlgo, hex: &str) -> Result<(Dir, bool), CacheError> {
        let rel = Path::new(algo.name()).join(&hex[..2]);
        let path = self.base.join(&rel);
        match self.base_dir.open_dir(&rel) {
            Ok(d) => Ok((d, false)),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok((self.base_dir.create_dir_all(&rel).map_err(io(&path))?, true)),
            Err(e) => Err(io(&path)(e)),
        }
    }

    fn drop_damaged(&self, path: &Path) {
        self.damaged.fetch_add(1, Ordering::Relaxed);
        self.misses.fetch_add(1, Ordering::Relaxed);
        // Another process may have replaced it with a good copy in the meantime; deleting
        // that one too only costs a refetch.
        let _ = fs::remove_file(path);
    }

    /// Whether an entry for `digest` exists (not verified: a hint for planning, e.g. to
    /// skip fetching; the bytes are checked when read with [`ChunkCache::get`]).
    pub fn contains_unverified(&self, algo: HashAlgo, digest: &ChunkDigest) -> bool {
        self.entry_path(algo, digest).is_file() || self.ref_path(algo, digest).is_file()
    }

    /// Pin `chunks` in the cache for as long as the returned [`Pin`] lives: every eviction
    /// pass, of this process or another, leaves their entries alone (`prune --all` too), and
    /// this handle's puts of them count toward [`ChunkCache::pinned_room`]. `label` says
    /// whose pin it is (one line in the pin file, for whoever looks). A killed process's pin
    /// is deleted by the next pass. Chunks not in the cache yet are pinned once put.
    pub fn pin(&self, label: &str, chunks: &[(HashAlgo, ChunkDigest)]) -> Result<Pin, CacheError> {
        let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_nanos();
        let id = self.seq.fetch_add(1, Ordering::Relaxed);
        let unique = format!("{}-{id}-{nanos}", std::process::id());
        let pins_path = self.base.join(PINS_DIR);
        let (file, name) = pins::create(&self.pins_dir, &unique, label, chunks).map_err(io(&pins_path))?;
        let pin = Pin { file, dir: self.pins_dir.try_clone().map_err(io(&pins_path))?, name, id, own: self.own_pins.clone(), chunks: chunks.len() };
        self.own_pins.lock().unwrap_or_else(|p| p.into_inner()).insert(id, Arc::new(chunks.iter().copied().collect()));
        self.measure_pins();
        Ok(pin)
    }

    /// Measure the allocated bytes of the chunk entries that live pins name (every
    /// process's), and count from that from now on; returns it.
    pub fn measure_pins(&self) -> u64 {
        let (pinned, _) = pins::live(&self.pins_dir, false, writer_runs);
        let bytes = pinned.iter().map(|(a, d)| self.entry_bytes(*a, d)).sum();
        self.pinned.store(bytes, Ordering::Relaxed);
        bytes
    }

    /// Bytes pinned chunks may still take: the limit less the pinned bytes (as last
    /// measured, plus this handle's pinned puts since). A pinned chunk whose put would pass
    /// it is not stored (counted in [`CacheStats::pinned_over_budget`]).
    pub fn pinned_room(&self) -> u64 {
        self.limit.saturating_sub(self.pinned.load(Ordering::Relaxed))
    }

    /// The limit this handle keeps the cache within.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Allocated bytes of the entries (copy and reference) of `digest`.
    fn entry_bytes(&self, algo: HashAlgo, digest: &ChunkDigest) -> u64 {
        [self.entry_path(algo, digest), self.ref_path(algo, digest)]
            .iter()
            .filter_map(|p| fs::symlink_metadata(p).ok())
            .filter(|m| m.is_file())
            .map(|m| m.blocks() * 512)
            .sum()
    }

    /// Whether a pin this handle holds names `digest`.
    fn own_pinned(&self, algo: HashAlgo, digest: &ChunkDigest) -> bool {
        self.own_pins.lock().unwrap_or_else(|p| p.into_inner()).values().any(|s| s.contains(&(algo, *digest)))
    }

    /// Store a verified chunk durably: temp file, fdatasync, atomic rename (a crash can
    /// forget a chunk but never leave a torn one under its name). Idempotent; safe across
    /// processes. All-zero chunks are not stored (callers make zeros locally).
    pub fn put(&self, algo: HashAlgo, digest: &ChunkDigest, chunk: &VerifiedChunk) -> Result<(), CacheError> {
        self.put_batch(algo, &[(*digest, chunk)]).pop().expect("one result per item")
    }

    /// Store several verified chunks with the guarantees of [`ChunkCache::put`], paying
    /// the disk's latency once per batch instead of once per chunk: every temp file is
    /// written, writeback of all of them is started, then each is fdatasync'ed (by then
    /// mostly already on disk), renamed under its digest, and each touched directory is
    /// fsynced once. An entry's name still appears only after its own data is durable.
    /// One result per item, in order.
    pub fn put_batch(&self, algo: HashAlgo, items: &[(ChunkDigest, &VerifiedChunk)]) -> Vec<Result<(), CacheError>> {
        let mut results: Vec<Result<(), CacheError>> = Vec::with_capacity(items.len());
        // Items with a temp file written: (index into results, temp, open file, final path).
        let mut pending: Vec<(usize, OsString, File, Written)> = Vec::new();
        // Parents of prefix directories this batch created: their entries must be durable
        // for the new directories' (and so the chunks') to be.
        let mut new_dir_parents: Vec<PathBuf> = Vec::new();
        for (digest, chunk) in items {
            let r = self.write_temp(algo, digest, chunk, &mut new_dir_parents);
            match r {
                Ok(Some((tmp, f, path))) => {
                    pending.push((results.len(), tmp, f, path));
                    results.push(Ok(()));
                }
                Ok(None) => results.push(Ok(())),
                Err(e) => results.push(Err(e)),
            }
        }
        // Start writeback of every temp before waiting on any: the waits then overlap
        // instead of queueing one chunk's I/O behind the previous one's.
        for (_, _, f, _) in &pending {
            imgfmt::file::start_writeback(f, 0, 0);
        }
        let mut touched: Vec<PathBuf> = Vec::new();
        let mut renamed: Vec<(usize, PathBuf, u64)> = Vec::new();
        for (k, tmp, f, w) in pending {
            let tmp_path = self.tmp.join(&tmp);
            let res = (|| {
                f.sync_data().map_err(io(&tmp_path))?;
                let allocated = f.metadata().map_err(io(&tmp_path))?.blocks() * 512;
                drop(f);
                // Concurrent puts of one digest each rename a complete copy of the same
                // bytes: whichever lands last wins, and every reader sees a whole file.
                self.tmp_dir.rename_to(&tmp, &w.dir, &w.name, true).map_err(io(&w.path))?;
                Ok(allocated)
            })();
            match res {
                Ok(allocated) => {
                    let dir = w.path.parent().expect("entry has a parent").to_path_buf();
                    if !touched.contains(&dir) {
                        touched.push(dir.clone());
                    }
                    renamed.push((k, dir, allocated));
                }
                Err(e) => {
                    let _ = self.tmp_dir.remove_file(&tmp);
                    results[k] = Err(e);
                }
            }
        }
        new_dir_parents.sort();
        new_dir_parents.dedup();
        let mut dir_errors: Vec<(PathBuf, std::io::Error)> = Vec::new();
        for d in new_dir_parents.iter().chain(touched.iter()) {
            if let Err(e) = File::open(d).and_then(|h| h.sync_all()) {
                dir_errors.push((d.clone(), e));
            }
        }
        let mut added = 0u64;
        for (k, dir, allocated) in renamed {
            // A failed directory sync leaves the entry named but perhaps not durably so:
            // report the put as failed, as a single put always did.
            let failed = dir_errors.iter().find(|(d, _)| *d == dir || dir.parent() == Some(d.as_path()));
            if let Some((d, e)) = failed {
                results[k] = Err(CacheError::Io { path: d.clone(), source: std::io::Error::new(e.kind(), e.to_string()) });
                continue;
            }
            self.puts.fetch_add(1, Ordering::Relaxed);
            added += allocated;
            if self.own_pinned(algo, &items[k].0) {
                self.pinned.fetch_add(allocated, Ordering::Relaxed);
            }
        }
        if let Err(e) = self.grew(added) {
            // The chunks are stored; only the pass failed. Report it on the last put.
            if let Some(last) = results.last_mut() {
                *last = Err(e);
            }
        }
        results
    }

    /// Count `added` allocated bytes just stored, and run an eviction pass when the cache
    /// is over its limit or has grown by a tenth of it since the last scan.
    fn grew(&self, added: u64) -> Result<(), CacheError> {
        if added == 0 {
            return Ok(());
        }
        let total = self.allocated.fetch_add(added, Ordering::Relaxed) + added;
        let since = self.since_scan.fetch_add(added, Ordering::Relaxed) + added;
        if total > self.limit || since > self.limit / 10 {
            self.maintain(false)?;
        }
        Ok(())
    }

    /// Step one of a put: checks, the prefix directory, the temp file written but not yet
    /// synced. `None` when there is nothing to store (a zero chunk, an entry present).
    fn write_temp(
        &self,
        algo: HashAlgo,
        digest: &ChunkDigest,
        chunk: &VerifiedChunk,
        new_dir_parents: &mut Vec<PathBuf>,
    ) -> Result<Option<(OsString, File, Written)>, CacheError> {
        let bytes = chunk.as_bytes();
        if bytes.len() as u64 > MAX_ENTRY {
            return Err(CacheError::TooLarge { len: bytes.len() as u64 });
        }
        if verify::hash::is_zero(bytes) {
            return Ok(None);
        }
        let path = self.entry_path(algo, digest);
        if let Ok(md) = fs::symlink_metadata(&path) {
            if md.is_file() && md.len() == bytes.len() as u64 {
                return Ok(None);
            }
        }
        // Pinned bytes count toward the budget, and no pass can evict them: a pinned chunk
        // that would take them past the limit is not stored (the restore keeps fetching it).
        let blocks = (bytes.len() as u64).div_ceil(4096) * 4096;
        if self.pinned.load(Ordering::Relaxed) + blocks > self.limit && self.own_pinned(algo, digest) {
            self.pinned_over.fetch_add(1, Ordering::Relaxed);
            return Ok(None);
        }
        let hex = digest.to_hex();
        let (dir, created) = self.prefix_dir(algo, &hex)?;
        if created {
            new_dir_parents.push(path.parent().and_then(Path::parent).expect("algo dir").to_path_buf());
        }
        let tmp = self.temp_name();
        let tmp_path = self.tmp.join(&tmp);
        let mut f = self.tmp_dir.create_new(&tmp, 0o644).map_err(io(&tmp_path))?;
        if let Err(e) = f.write_all(bytes) {
            drop(f);
            let _ = self.tmp_dir.remove_file(&tmp);
            return Err(io(&tmp_path)(e));
        }
        Ok(Some((tmp, f, Written { dir, name: OsString::from(hex), path })))
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            puts: self.puts.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            damaged: self.damaged.load(Ordering::Relaxed),
            stale_refs: self.stale_refs.load(Ordering::Relaxed),
            stray_temps_removed: self.strays.load(Ordering::Relaxed),
            pinned_over_budget: self.pinned_over.load(Ordering::Relaxed),
            bytes_allocated: self.allocated.load(Ordering::Relaxed),
            limit_bytes: self.limit,
        }
    }

    /// Measure the cache and, if it is over the limit, evict least-recently-used entries
    /// down to 90% of it. Several processes may do this at once: the pass holds an
    /// exclusive flock on `<root>/chunks/v1/lock`, so they take turns and each sees what
    /// the previous one left. Puts need no lock (rename is atomic); an entry evicted while
    /// a reader has it open stays readable to that reader.
    pub fn maintain(&self, force_scan: bool) -> Result<(), CacheError> {
        // One pass at a time; a thread that waited re-checks below, against an estimate
        // that includes what was put during the other's pass (so nothing is missed, as
        // it was when a pass in progress made the others skip theirs).
        let _one = self.evicting.lock().unwrap_or_else(|p| p.into_inner());
        if !force_scan && self.allocated.load(Ordering::Relaxed) <= self.limit && self.since_scan.load(Ordering::Relaxed) <= self.limit / 10 {
            return Ok(());
        }
        let _lock = self.pass_lock()?;
        self.evict_down_to(self.limit, self.limit / 100 * EVICT_TO_PERCENT)?;
        Ok(())
    }

    /// Evict least-recently-used entries of every kind until the cache holds at most
    /// `to` bytes (0: everything not in use), whatever the limit; leftovers of interrupted
    /// evictions go too. `snapctl cache prune`.
    pub fn prune(&self, to: u64) -> Result<Pruned, CacheError> {
        let _one = self.evicting.lock().unwrap_or_else(|p| p.into_inner());
        let _lock = self.pass_lock()?;
        self.evict_down_to(to, to)
    }

    /// What the cache directory holds, by kind, measured now.
    pub fn usage(&self) -> Result<Usage, CacheError> {
        let _one = self.evicting.lock().unwrap_or_else(|p| p.into_inner());
        let _lock = self.pass_lock()?;
        let (pinned, pins) = pins::live(&self.pins_dir, true, writer_runs);
        let entries = self.scan(&pinned)?;
        let mut kinds: Vec<KindUsage> = EntryKind::ALL.iter().map(|&kind| KindUsage { kind, entries: 0, bytes: 0, in_use: 0 }).collect();
        let mut pinned_bytes = 0;
        for e in &entries {
            let k = &mut kinds[EntryKind::ALL.iter().position(|&x| x == e.kind).expect("every kind is listed")];
            k.entries += 1;
            k.bytes += e.allocated;
            if e.held || (e.layout && !push_layout_free(&e.path)) {
                k.in_use += 1;
            }
            if e.held && e.kind == EntryKind::Chunks {
                pinned_bytes += e.allocated;
            }
        }
        Ok(Usage {
            dir: self.root.clone(),
            limit_bytes: self.limit,
            total_bytes: kinds.iter().map(|k| k.bytes).sum(),
            total_entries: kinds.iter().map(|k| k.entries).sum(),
            pinned_bytes,
            pins,
            kinds,
        })
    }

    /// Pause before each entry an eviction deletes (a throttle for tests that kill a pass
    /// in the middle; never set in real use).
    pub fn set_evict_delay(&mut self, d: Duration) {
        self.evict_delay = d;
    }

    /// The exclusive flock one eviction pass at a time holds across processes.
    fn pass_lock(&self) -> Result<File, CacheError> {
        let lock_path = self.base.join("lock");
        let lock = match self.base_dir.create_new(OsStr::new("lock"), 0o644) {
            Err(e) if e.kind() == ErrorKind::AlreadyExists => self.base_dir.open_regular(OsStr::new("lock")),
            other => other,
        }
        .map_err(io(&lock_path))?;
        lock.lock().map_err(io(&lock_path))?;
        Ok(lock)
    }

    /// The pass itself, with the pass lock held: scan every kind; when the total passes
    /// `over`, delete oldest first down to `target` (entries in use are skipped);
    /// leftovers of interrupted evictions always go. Sets the estimate to what is left.
    fn evict_down_to(&self, over: u64, target: u64) -> Result<Pruned, CacheError> {
        self.since_scan.store(0, Ordering::Relaxed);
        let mut pruned = Pruned { leftovers_removed: self.remove_leftovers(), ..Default::default() };
        // Pins of processes that are gone go now; the live ones' chunks stay whatever the target.
        let (pinned, _) = pins::live(&self.pins_dir, true, writer_runs);
        let mut entries = self.scan(&pinned)?;
        let mut total: u64 = entries.iter().map(|e| e.allocated).sum();
        self.pinned.store(entries.iter().filter(|e| e.held && e.kind == EntryKind::Chunks).map(|e| e.allocated).sum(), Ordering::Relaxed);
        if total > over {
            entries.sort_by_key(|e| e.used);
            for e in entries {
                if total <= target {
                    break;
                }
                if !self.evict_delay.is_zero() {
                    std::thread::sleep(self.evict_delay);
                }
                match self.evict(&e) {
                    Ok(true) => {
                        self.evictions.fetch_add(1, Ordering::Relaxed);
                        pruned.entries_evicted += 1;
                        pruned.bytes_freed += e.allocated;
                        total = total.saturating_sub(e.allocated);
                    }
                    Ok(false) => pruned.in_use_kept += 1,
                    Err(err) if err.kind() == ErrorKind::NotFound => total = total.saturating_sub(e.allocated),
                    Err(err) => return Err(io(&e.path)(err)),
                }
            }
        }
        // Puts that landed during the scan may or may not be in `total`: count them again
        // (an over-estimate only brings the next pass forward; an under-estimate would let
        // the cache outgrow its limit unnoticed).
        self.allocated.store(total + self.since_scan.load(Ordering::Relaxed), Ordering::Relaxed);
        Ok(pruned)
    }

    /// Delete one entry; `false` when it is a push layout in use (left alone).
    fn evict(&self, e: &Entry) -> std::io::Result<bool> {
        if e.held {
            return Ok(false);
        }
        if !e.layout {
            return fs::remove_file(&e.path).map(|()| true);
        }
        // A push layout: the lock keeps a push from starting in it meanwhile (a push
        // waiting for it finds a fresh directory). The stamp goes first (a stamp whose
        // layout is gone is only a miss anyway), then the directory is renamed away in
        // one step, so a kill from here on leaves no half-deleted layout under its name:
        // only a leftover, removed by the next pass.
        let (pl, key) = split_layout(&e.path);
        let Some(lock) = UseLock::try_exclusive(&pl.join(format!("{key}.lock")))? else { return Ok(false) };
        match fs::remove_file(pl.join(format!("{key}.stamp.json"))) {
            Err(err) if err.kind() != ErrorKind::NotFound => return Err(err),
            _ => {}
        }
        let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_nanos();
        let away = pl.join(format!("{EVICTING_PREFIX}{key}-{}-{nanos}", std::process::id()));
        match fs::rename(&e.path, &away) {
            Ok(()) => {
                if !self.evict_delay.is_zero() {
                    std::thread::sleep(self.evict_delay);
                }
                // Does not follow symlinks: a link inside is removed, never what it names.
                fs::remove_dir_all(&away)?;
            }
            Err(err) if err.kind() == ErrorKind::NotFound => {}
            Err(err) => return Err(err),
        }
        lock.remove()?;
        Ok(true)
    }

    /// Remove what interrupted evictions left (`push-layouts/.evicting-*`): with the pass
    /// lock held no other pass is deleting them. Returns how many went. (The lock file of
    /// a layout that is gone goes too, when no push holds it.)
    fn remove_leftovers(&self) -> u64 {
        let pl = self.root.join(PUSH_LAYOUTS);
        let Ok(names) = fs::read_dir(&pl) else { return 0 };
        let mut removed = 0;
        for e in names.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(key) = name.strip_suffix(".lock").filter(|k| !pl.join(k).exists() && !pl.join(format!("{k}.stamp.json")).exists()) {
                if let Ok(Some(lock)) = UseLock::try_exclusive(&pl.join(format!("{key}.lock"))) {
                    let _ = lock.remove();
                }
                continue;
            }
            if !name.starts_with(EVICTING_PREFIX) {
                continue;
            }
            let gone = match e.file_type() {
                Ok(t) if t.is_dir() => fs::remove_dir_all(e.path()),
                _ => fs::remove_file(e.path()),
            };
            if gone.is_ok() {
                removed += 1;
                self.strays.fetch_add(1, Ordering::Relaxed);
            }
        }
        removed
    }

    /// Regular files directly in `dir` (not through a symlink), as entries of `kind`.
    fn scan_files(&self, dir: &Path, kind: EntryKind, out: &mut Vec<Entry>) {
        if !fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir()) {
            return;
        }
        let Ok(names) = fs::read_dir(dir) else { return };
        for e in names.flatten() {
            let Ok(md) = e.metadata() else { continue };
            if md.is_file() {
                out.extend(self.file_entry(e.path(), &md, kind));
            }
        }
    }

    /// Every entry the budget covers: chunk entries under `<root>/chunks/v1/<algo>/<xx>/`,
    /// push layouts, upload state and known-blobs records.
    /// Chunk entries `pinned` names are held. Temps of small files being written are held
    /// while their writer runs; those of writers that are gone are leftovers, removed.
    fn scan(&self, pinned: &pins::Pinned) -> Result<Vec<Entry>, CacheError> {
        let mut out = self.scan_chunks(pinned)?;
        self.scan_push_layouts(&mut out);
        for (dir, kind) in [(UPLOADS, EntryKind::Uploads), (KNOWN_BLOBS, EntryKind::KnownBlobs)] {
            self.scan_files(&self.root.join(dir), kind, &mut out);
        }
        Ok(out)
    }

    /// A file `name` of `kind` (not a push layout's part) seen by a scan: an entry, a file
    /// being written (held), or a dead writer's temp (removed, `None`).
    fn file_entry(&self, path: PathBuf, md: &fs::Metadata, kind: EntryKind) -> Option<Entry> {
        let held = match path.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_prefix(WRITE_TEMP_PREFIX)) {
            None => false,
            Some(rest) => {
                let pid = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
                // A writer in another pid namespace is not seen in /proc: a temp that young
                // is its write under way all the same.
                let young = md.modified().ok().and_then(|m| m.elapsed().ok()).is_some_and(|age| age < STALE_WRITE);
                if !pid.is_some_and(writer_runs) && !young {
                    if fs::remove_file(&path).is_ok() {
                        self.strays.fetch_add(1, Ordering::Relaxed);
                    }
                    return None;
                }
                true
            }
        };
        Some(Entry { path, allocated: md.blocks() * 512, used: md.modified().unwrap_or(SystemTime::UNIX_EPOCH), kind, layout: false, held })
    }

    /// `push-layouts/`: one entry per layout key, its directory, stamp and lock together
    /// (a stamp or lock without a directory too: a push that has not packed yet, or one
    /// whose layout went); recency is the latest of their mtimes (a push sets its lock's
    /// mtime when it takes it). Temp files of stamps being written count as files.
    fn scan_push_layouts(&self, out: &mut Vec<Entry>) {
        let pl = self.root.join(PUSH_LAYOUTS);
        if !fs::symlink_metadata(&pl).is_ok_and(|m| m.is_dir()) {
            return;
        }
        let Ok(names) = fs::read_dir(&pl) else { return };
        let mut layouts: std::collections::BTreeMap<String, (u64, SystemTime)> = std::collections::BTreeMap::new();
        for e in names.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Ok(md) = e.metadata() else { continue };
            let key = name.split('.').next().unwrap_or_default();
            if name.starts_with(EVICTING_PREFIX) {
                continue;
            }
            if key.len() == 32
                && key.bytes().all(|b| b.is_ascii_hexdigit())
                && (md.is_dir() && name == key || name == format!("{key}.stamp.json") || name == format!("{key}.lock"))
            {
                // Recency: the lock (a push sets its mtime), the stamp and the layout's
                // `index.json` (its tags), whichever was written last.
                let (bytes, used) = if md.is_dir() {
                    (tree_bytes(&e.path()), fs::symlink_metadata(e.path().join("index.json")).and_then(|m| m.modified()).unwrap_or(SystemTime::UNIX_EPOCH))
                } else {
                    (md.blocks() * 512, md.modified().unwrap_or(SystemTime::UNIX_EPOCH))
                };
                let slot = layouts.entry(key.to_string()).or_insert((0, SystemTime::UNIX_EPOCH));
                slot.0 += bytes;
                slot.1 = slot.1.max(used);
            } else if md.is_file() {
                out.extend(self.file_entry(e.path(), &md, EntryKind::PushLayouts));
            }
        }
        for (key, (allocated, used)) in layouts {
            // A lock alone is no layout: a push about to pack, or what a killed eviction
            // left (removed with the leftovers once free).
            if !pl.join(&key).exists() && !pl.join(format!("{key}.stamp.json")).exists() {
                continue;
            }
            out.push(Entry { path: pl.join(key), allocated, used, kind: EntryKind::PushLayouts, layout: true, held: false });
        }
    }

    /// Every entry under `<root>/chunks/v1/<algo>/<xx>/`; those `pinned` names are held.
    fn scan_chunks(&self, pinned: &pins::Pinned) -> Result<Vec<Entry>, CacheError> {
        let mut out = Vec::new();
        for algo in [HashAlgo::Blake3, HashAlgo::Sha256] {
            let adir = self.base.join(algo.name());
            // Never through a symlink: evicting "entries" of a directory it points at
            // would delete someone else's files.
            if !fs::symlink_metadata(&adir).is_ok_and(|m| m.is_dir()) {
                continue;
            }
            let Ok(prefixes) = fs::read_dir(&adir) else { continue };
            for p in prefixes {
                let p = p.map_err(io(&adir))?;
                if !p.file_type().is_ok_and(|t| t.is_dir()) {
                    continue;
                }
                let Ok(files) = fs::read_dir(p.path()) else { continue };
                for f in files {
                    let Ok(f) = f else { continue };
                    if let Some(rest) = f.file_name().to_str().and_then(|n| n.strip_prefix(REF_TEMP_PREFIX)) {
                        // A reference write that never got renamed: its writer crashed.
                        let pid: Option<u32> = rest.split('.').next().and_then(|p| p.parse().ok());
                        if !pid.is_some_and(writer_runs) && fs::remove_file(f.path()).is_ok() {
                            self.strays.fetch_add(1, Ordering::Relaxed);
                        }
                        continue;
                    }
                    // Vanished since the listing (evicted or damaged elsewhere): skip.
                    let Ok(md) = f.metadata() else { continue };
                    if md.is_file() {
                        let name = f.file_name();
                        let hex = name.to_str().map(|n| n.strip_suffix(REF_SUFFIX).unwrap_or(n)).unwrap_or_default();
                        let held =
                            !pinned.is_empty() && ChunkDigest::parse_with(&format!("{}:{hex}", algo.name()), algo).is_ok_and(|d| pinned.contains(&(algo, d)));
                        out.push(Entry {
                            path: f.path(),
                            allocated: md.blocks() * 512,
                            used: md.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                            kind: EntryKind::Chunks,
                            layout: false,
                            held,
                        });
                    }
                }
            }
        }
        Ok(out)
    }

    /// Remove temp files whose writer is gone (its pid no longer runs) or that are older
    /// than an hour. A temp file is never under a chunk's name, so whatever it holds was
    /// never served; removing one of a live writer in another pid namespace only fails that
    /// put (the chunk is fetched again next time).
    fn clean_temps(&self) -> Result<(), CacheError> {
        // Listed and removed through the descriptor opened (symlink-free) at open: names
        // only ever of the cache's own temp directory.
        let Ok(names) = self.tmp_dir.names() else { return Ok(()) };
        for os_name in names {
            let name = os_name.to_string_lossy();
            let pid: Option<u32> = name.split('.').next().and_then(|p| p.parse().ok());
            let modified = fs::symlink_metadata(self.tmp.join(&os_name)).ok().and_then(|m| m.modified().ok());
            let old = modified.is_none_or(|m| m.elapsed().unwrap_or_default() > STALE_TEMP);
            let writer_gone = !pid.is_some_and(writer_runs);
            if (old || writer_gone) && self.tmp_dir.remove_file(&os_name).is_ok() {
                self.strays.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }
}

/// Refresh an entry's recency for LRU eviction, at most once per [`TOUCH_EVERY`] (so hot
/// entries do not cost a metadata write per read). atime is unreliable (noatime,
/// relatime), so the cache keeps its own in mtime; failing to touch only makes eviction
/// less fair. `entry`: the entry as just opened and read (through its descriptor: never
/// a file a symlink swapped in since points at); `modified`: its mtime (unknown: touch).
/// Where [`ChunkCache::locate`] found a chunk's bytes.
pub(crate) enum Found {
    /// Its copy, `path`, of the right length.
    Copy { file: File, path: PathBuf, modified: Option<SystemTime> },
    /// The file `file` its reference entry `rpath` names, the bytes at `offset`.
    Ref { rfile: File, rpath: PathBuf, modified: Option<SystemTime>, file: File, offset: u64 },
    /// Neither a copy nor a reference.
    Missing,
    /// A copy that is not one of ours (another kind of file, another length).
    Damaged(PathBuf),
    /// A reference that is not one of ours, or may not be followed.
    Stale(PathBuf),
}

/// Which entry to drop when the bytes read do not hash to the digest.
enum Wrong {
    Copy(PathBuf),
    Ref(PathBuf),
}

fn touch(entry: &File, modified: Option<SystemTime>) {
    if modified.is_none_or(|m| m.elapsed().unwrap_or_default() > TOUCH_EVERY) {
        let _ = entry.set_modified(SystemTime::now());
    }
}

/// Whether process `pid` runs on this host (this process does): the writer of a temp file
/// named after it may still be writing.
fn writer_runs(pid: u32) -> bool {
    pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists()
}

/// Allocated bytes of everything under `dir` (symlinks counted as themselves, never
/// followed).
fn tree_bytes(dir: &Path) -> u64 {
    let mut bytes = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(names) = fs::read_dir(&d) else { continue };
        for e in names.flatten() {
            let Ok(md) = fs::symlink_metadata(e.path()) else { continue };
            bytes += md.blocks() * 512;
            if md.is_dir() {
                stack.push(e.path());
            }
        }
    }
    bytes
}

/// `push-layouts/` and the key of a push layout's directory.
fn split_layout(layout: &Path) -> (&Path, String) {
    (layout.parent().expect("a push layout is under push-layouts/"), layout.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default())
}

/// Whether no push holds the push layout `layout` (its lock can be taken; it is released
/// at once).
fn push_layout_free(layout: &Path) -> bool {
    let (pl, key) = split_layout(layout);
    let lock = pl.join(format!("{key}.lock"));
    // No lock file: nothing holds it (and none is created just to look).
    !lock.exists() || UseLock::try_exclusive(&lock).is_ok_and(|l| l.is_some())
}

/// Where a put's temp file goes: its prefix directory (opened without following a
/// symlink), the entry's name there, and its path (for messages).
struct Written {
    dir: Dir,
    name: OsString,
    path: PathBuf,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::OpenOptions;
    use std::sync::Arc;

    fn chunk(seed: u8, len: usize) -> (ChunkDigest, VerifiedChunk) {
        let data: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1).collect();
        let d = verify::chunk_digest(HashAlgo::Blake3, &data);
        let c = verify::verify_stored(HashAlgo::Blake3, Codec::Raw, data, len as u32, &d).expect("verifies");
        (d, c)
    }

    #[test]
    fn put_then_get() {
        let dir = tempfile::tempdir().unwrap();
        let c = ChunkCache::open(dir.path(), DEFAULT_LIMIT).unwrap();
        let (d, ch) = chunk(1, 4096);
        assert!(c.get(HashAlgo::Blake3, &d, 4096).unwrap().is_none());
        c.put(HashAlgo::Blake3, &d, &ch).unwrap();
        c.put(HashAlgo::Blake3, &d, &ch).unwrap(); // idempotent
        let got = c.get(HashAlgo::Blake3, &d, 4096).unwrap().expect("hit");
        assert_eq!(got.as_bytes(), ch.as_bytes());
        let s = c.stats();
        assert_eq!((s.hits, s.misses, s.puts), (1, 1, 1));
        assert!(s.bytes_allocated >= 4096);
        let hex = d.to_hex();
        assert!(dir.path().join("chunks/v1/blake3").join(&hex[..2]).join(&hex).is_file());
        // Another handle (another process, as far as the files are concerned) sees it.
        let c2 = ChunkCache::open(dir.path(), DEFAULT_LIMIT).unwrap();
        assert!(c2.get(HashAlgo::Blake3, &d, 4096).unwrap().is_some());
        assert!(c2.stats().bytes_allocated >= 4096);
    }

    /// Prepared references are invisible until committed, only the kept ones appear, and
    /// dropping uncommitted ones leaves no file behind (a pull that fails mid-way).
    #[test]
    fn prepared_references_appear_only_on_commit() {
        let dir = tempfile::tempdir().unwrap();
        let c = ChunkCache::open(&dir.path().join("cache"), DEFAULT_LIMIT).unwrap();
        let (d1, ch1) = chunk(1, 8192);
        let (d2, ch2) = chunk(2, 8192);
        let file = dir.path().join("vm.mem");
        // Not written yet: the pull prepares while it fetches.
        let items = [(d1, 8192, 0), (d2, 8192, 8192)];
        fn refs_under(dir: &Path) -> usize {
            fs::read_dir(dir)
                .unwrap()
                .flatten()
                .map(|e| if e.file_type().unwrap().is_dir() { refs_under(&e.path()) } else { usize::from(e.file_name().to_string_lossy().contains(".ref")) })
                .sum()
        }
        let files_in = |c: &ChunkCache| refs_under(c.dir());

        let p = c.prepare_refs(HashAlgo::Blake3, &file, &items).unwrap();
        assert!(!c.contains_unverified(HashAlgo::Blake3, &d1), "visible before commit");
        assert_eq!(files_in(&c), 2, "two temporaries");
        drop(p);
        assert_eq!(files_in(&c), 0, "dropped: temporaries removed");

        let p = c.prepare_refs(HashAlgo::Blake3, &file, &items).unwrap();
        let mut data = ch1.as_bytes().to_vec();
        data.extend_from_slice(ch2.as_bytes());
        fs::write(&file, &data).unwrap();
        assert_eq!(p.commit(|d| d == &d2).unwrap(), 1);
        assert!(!c.contains_unverified(HashAlgo::Blake3, &d1), "not kept");
        assert_eq!(c.get(HashAlgo::Blake3, &d2, 8192).unwrap().expect("hit").as_bytes(), ch2.as_bytes());
        assert_eq!(files_in(&c), 1, "only the committed reference is left");
        assert_eq!(c.stats().puts, 1);
    }

    /// References: a hit while the file holds the bytes; once the file changes or goes,
    /// a miss that deletes the reference (never the changed bytes).
    #[test]
    fn references_serve_verified_bytes_and_go_stale_safely() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let c = ChunkCache::open(&dir.path().join("cache"), DEFAULT_LIMIT).unwrap();
        let (d1, ch1) = chunk(1, 8192);
        let (d2, ch2) = chunk(2, 4096);
        let file = dir.path().join("vm.mem");
        let mut data = vec![0u8; 65536];
        data[8192..16384].copy_from_slice(ch1.as_bytes());
        data[32768..36864].copy_from_slice(ch2.as_bytes());
        fs::write(&file, &data).unwrap();
        assert!(c.put_refs(HashAlgo::Blake3, Path::new("vm.mem"), &[(d1, 8192, 8192)]).is_err(), "relative paths are refused");
        assert_eq!(c.put_refs(HashAlgo::Blake3, &file, &[(d1, 8192, 8192), (d2, 4096, 32768)]).unwrap(), 2);
        assert!(c.contains_unverified(HashAlgo::Blake3, &d1));
        assert_eq!(c.get(HashAlgo::Blake3, &d1, 8192).unwrap().expect("hit").as_bytes(), ch1.as_bytes());
        assert_eq!(c.get(HashAlgo::Blake3, &d2, 4096).unwrap().expect("hit").as_bytes(), ch2.as_bytes());
        // Asked for another length: not this entry.
        assert!(c.get(HashAlgo::Blake3, &d2, 8192).unwrap().is_none());
        assert_eq!(c.put_refs(HashAlgo::Blake3, &file, &[(d2, 4096, 32768)]).unwrap(), 1);

        // The file changes under the reference: a miss, and the reference is gone.
        fs::OpenOptions::new().write(true).open(&file).unwrap().write_all_at(&[0xee], 9000).unwrap();
        assert!(c.get(HashAlgo::Blake3, &d1, 8192).unwrap().is_none());
        assert!(!c.ref_path(HashAlgo::Blake3, &d1).exists());
        // The file is deleted: a miss too.
        fs::remove_file(&file).unwrap();
        assert!(c.get(HashAlgo::Blake3, &d2, 4096).unwrap().is_none());
        assert!(!c.contains_unverified(HashAlgo::Blake3, &d2));
        assert_eq!(c.stats().stale_refs, 3);

        // A garbled reference (a torn write after a crash) is a miss, not an error.
        fs::write(&file, &data).unwrap();
        c.put_refs(HashAlgo::Blake3, &file, &[(d1, 8192, 8192)]).unwrap();
        fs::write(c.ref_path(HashAlgo::Blake3, &d1), b"snapctl-chunk-ref v1 81").unwrap();
        assert!(c.get(HashAlgo::Blake3, &d1, 8192).unwrap().is_none());
        // A copy wins over (and is not replaced by) a reference.
        c.put(HashAlgo::Blake3, &d1, &ch1).unwrap();
        assert_eq!(c.put_refs(HashAlgo::Blake3, &file, &[(d1, 8192, 8192)]).unwrap(), 0);
        assert!(c.get(HashAlgo::Blake3, &d1, 8192).unwrap().is_some());
    }

    /// Issue 21: a shared cache's reference made a root pull open and read any regular
    /// file it named (a content-confirmation oracle: a hit said the file held the bytes).
    /// Now a reference is followed only to a file of its own writer, who is this user or
    /// the cache's owner, long enough for the bytes it names.
    #[test]
    fn regression_issue_21_references_lead_only_to_their_writers_files() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: needs root to give files to other users");
            return;
        }
        let chown = |p: &Path, uid: u32| std::os::unix::fs::chown(p, Some(uid), None).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let c = ChunkCache::open(&dir.path().join("cache"), DEFAULT_LIMIT).unwrap();
        let (d, ch) = chunk(3, 8192);
        let secret = dir.path().join("someone-elses");
        fs::write(&secret, ch.as_bytes()).unwrap();
        c.put_refs(HashAlgo::Blake3, &secret, &[(d, 8192, 0)]).unwrap();
        assert!(c.get(HashAlgo::Blake3, &d, 8192).unwrap().is_some(), "our own reference to our own file");
        // Another user's file, named by a reference of ours (planted, or the file given away).
        c.put_refs(HashAlgo::Blake3, &secret, &[(d, 8192, 0)]).unwrap();
        chown(&secret, 4242);
        assert!(c.get(HashAlgo::Blake3, &d, 8192).unwrap().is_none(), "a root pull confirmed the content of uid 4242's file");
        // A reference written by a third user, to a file of that user: not ours, not the cache's.
        c.put_refs(HashAlgo::Blake3, &secret, &[(d, 8192, 0)]).unwrap();
        chown(&c.ref_path(HashAlgo::Blake3, &d), 4242);
        assert!(c.get(HashAlgo::Blake3, &d, 8192).unwrap().is_none(), "followed a stranger's reference");
        // ... unless that user owns the cache (a cache shared by its owner with root pulls).
        chown(&dir.path().join("cache").join(VERSION_DIR), 4242);
        c.put_refs(HashAlgo::Blake3, &secret, &[(d, 8192, 0)]).unwrap();
        chown(&c.ref_path(HashAlgo::Blake3, &d), 4242);
        assert!(c.get(HashAlgo::Blake3, &d, 8192).unwrap().is_some(), "the cache owner's reference to its own file");
        // A procfs file is never read, whoever wrote the reference.
        let (d0, _) = chunk(4, 4096);
        c.put_refs(HashAlgo::Blake3, Path::new("/proc/self/environ"), &[(d0, 4096, 0)]).unwrap();
        assert!(c.get(HashAlgo::Blake3, &d0, 4096).unwrap().is_none());
        assert!(!c.ref_path(HashAlgo::Blake3, &d0).exists(), "the reference is dropped as stale");
    }

    /// A reference write killed before its rename leaves `<xx>/.ref-<pid>.<seq>`: never
    /// read, and removed by the next scan once its writer is gone (a live one's is kept).
    #[test]
    fn stray_reference_temps_are_removed_by_a_scan() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("chunks/v1/blake3/ab");
        fs::create_dir_all(&prefix).unwrap();
        let dead = prefix.join(".ref-4000000.7");
        let live = prefix.join(format!(".ref-{}.8", std::process::id()));
        fs::write(&dead, b"snapctl-chunk-ref v1 1").unwrap();
        fs::write(&live, b"snapctl-chunk-ref v1 1").unwrap();
        let c = ChunkCache::open(dir.path(), DEFAULT_LIMIT).unwrap();
        assert!(!dead.exists() && live.exists());
        assert_eq!(c.stats().stray_temps_removed, 1);
    }

    #[test]
    fn chunk_ref_round_trips_and_rejects_garbage() {
        let r = ChunkRef { len: 1 << 20, offset: 7 << 20, file: PathBuf::from("/srv/vm 1/vm.mem") };
        assert_eq!(ChunkRef::decode(&r.encode()), Some(r));
        for bad in [
            &b""[..],
            b"snapctl-chunk-ref v1 1 2",
            b"snapctl-chunk-ref v2 1 2\n/x",
            b"snapctl-chunk-ref v1 1 2\nrelative",
            b"snapctl-chunk-ref v1 -1 2\n/x",
            b"snapctl-chunk-ref v1 99999999999 2\n/x",
        ] {
            assert_eq!(ChunkRef::decode(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn zero_chunks_are_not_stored() {
        let dir = tempfile::tempdir().unwrap();
        let c = ChunkCache::open(dir.path(), DEFAULT_LIMIT).unwrap();
        let d = verify::zero_digest(HashAlgo::Blake3, 4096);
        let z = verify::verify_stored(HashAlgo::Blake3, Codec::Raw, vec![0; 4096], 4096, &d).unwrap();
        c.put(HashAlgo::Blake3, &d, &z).unwrap();
        assert!(!c.entry_path(HashAlgo::Blake3, &d).exists());
        assert_eq!(c.stats().puts, 0);
    }

    #[test]
    fn put_batch_stores_each_and_reports_each() {
        let dir = tempfile::tempdir().unwrap();
        let c = ChunkCache::open(dir.path(), DEFAULT_LIMIT).unwrap();
        let chunks: Vec<_> = (10..30u8).map(|i| chunk(i, 8192)).collect();
        let zd = verify::zero_digest(HashAlgo::Blake3, 4096);
        let z = verify::verify_stored(HashAlgo::Blake3, Codec::Raw, vec![0; 4096], 4096, &zd).unwrap();
        // Present already, zero, a duplicate within the batch, and new ones.
        c.put(HashAlgo::Blake3, &chunks[0].0, &chunks[0].1).unwrap();
        let mut items: Vec<(ChunkDigest, &VerifiedChunk)> = chunks.iter().map(|(d, ch)| (*d, ch)).collect();
        items.push((zd, &z));
        items.push((chunks[5].0, &chunks[5].1));
        let res = c.put_batch(HashAlgo::Blake3, &items);
        assert_eq!(res.len(), items.len());
        for (k, r) in res.iter().enumerate() {
            assert!(r.is_ok(), "item {k}: {r:?}");
        }
        for (d, ch) in &chunks {
            assert_eq!(c.get(HashAlgo::Blake3, d, 8192).unwrap().expect("stored").as_bytes(), ch.as_bytes());
        }
        assert!(!c.entry_path(HashAlgo::Blake3, &zd).exists());
        // The single put, 19 new ones (the present one skipped), and the duplicate: both
        // copies were written before either was renamed, so both count.
        assert_eq!(c.stats().puts, 21);
        assert_eq!(fs::read_dir(dir.path().join("chunks/v1/tmp")).unwrap().count(), 0, "no temp left");
        // The estimate counts what the batch added, as a rescan measures it.
        let measured: u64 = c.scan(&pins::Pinned::new()).unwrap().iter().map(|e| e.allocated).sum();
        // (The duplicate's second copy replaced the first: estimated twice, measured once.)
        let est = c.stats().bytes_allocated;
        assert!(est >= measured && est - measured <= 16384, "estimate {est}, measured {measured}");
    }

    #[test]
    fn damaged_entry_is_a_miss_and_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let c = ChunkCache::open(dir.path(), DEFAULT_LIMIT).unwrap();
        let (d, ch) = chunk(2, 8192);
        c.put(HashAlgo::Blake3, &d, &ch).unwrap();
        let p = c.entry_path(HashAlgo::Blake3, &d);
        let mut bytes = fs::read(&p).unwrap();
        bytes[5000] ^= 0x40;
        fs::write(&p, &bytes).unwrap();
        assert!(c.get(HashAlgo::Blake3, &d, 8192).unwrap().is_none());
        assert!(!p.exists(), "damaged entry deleted");
        assert_eq!(c.stats().damaged, 1);
        // A truncated entry too.
        c.put(HashAlgo::Blake3, &d, &ch).unwrap();
        fs::write(&p, &bytes[..100]).unwrap();
        assert!(c.get(HashAlgo::Blake3, &d, 8192).unwrap().is_none());
        assert!(!p.exists());
        assert_eq!(c.stats().damaged, 2);
    }

    #[test]
    fn concurrent_puts_of_one_digest() {
        let dir = tempfile::tempdir().unwrap();
        let c = Arc::new(ChunkCache::open(dir.path(), DEFAULT_LIMIT).unwrap());
        let (d, ch) = chunk(3, 256 << 10);
        // Eight threads doing the same puts at once, to race them: not a worker pool.
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..10 {
                        c.put(HashAlgo::Blake3, &d, &ch).unwrap();
                        // Readers racing the writers only ever see a whole, correct chunk.
                        if let Some(got) = c.get(HashAlgo::Blake3, &d, 256 << 10).unwrap() {
                            assert_eq!(got.as_bytes(), ch.as_bytes());
                        }
                    }
                });
            }
        });
        assert_eq!(c.stats().damaged, 0);
        assert!(c.get(HashAlgo::Blake3, &d, 256 << 10).unwrap().is_some());
        assert_eq!(fs::read_dir(dir.path().join("chunks/v1/tmp")).unwrap().count(), 0, "no temp left");
    }

    #[test]
    fn limit_is_honoured_least_recently_used_first() {
        let dir = tempfile::tempdir().unwrap();
        let len = 64 << 10;
        // Room for about 10 entries.
        let c = ChunkCache::open(dir.path(), 10 * len as u64 + 1000).unwrap();
        let chunks: Vec<_> = (0..30u8).map(|i| chunk(i, len)).collect();
        let t0 = SystemTime::now() - Duration::from_secs(10_000);
        let set_mtime = |d: &ChunkDigest, t: SystemTime| {
            if let Ok(f) = OpenOptions::new().write(true).open(c.entry_path(HashAlgo::Blake3, d)) {
                f.set_modified(t).unwrap();
            }
        };
        for (i, (d, ch)) in chunks.iter().enumerate() {
            c.put(HashAlgo::Blake3, d, ch).unwrap();
            // Entries age in put order, except the first, kept the most recently used.
            set_mtime(d, t0 + Duration::from_secs(i as u64));
            set_mtime(&chunks[0].0, SystemTime::now());
        }
        let measured: u64 = c.scan(&pins::Pinned::new()).unwrap().iter().map(|e| e.allocated).sum();
        assert!(measured <= 10 * len as u64 + 1000, "over the limit: {measured}");
        assert!(c.stats().evictions >= 20);
        assert!(c.contains_unverified(HashAlgo::Blake3, &chunks[0].0), "the recently used entry survived");
        assert!(c.contains_unverified(HashAlgo::Blake3, &chunks[29].0), "the newest entry survived");
        assert!(!c.contains_unverified(HashAlgo::Blake3, &chunks[1].0), "the oldest went first");
        // A smaller limit on reopen shrinks the cache.
        let small = ChunkCache::open(dir.path(), 2 * len as u64 + 1000).unwrap();
        assert!(small.stats().bytes_allocated <= 2 * len as u64 + 1000);
        let measured: u64 = small.scan(&pins::Pinned::new()).unwrap().iter().map(|e| e.allocated).sum();
        assert_eq!(measured, small.stats().bytes_allocated);
    }

    /// Issue 14 §1, the cache: whoever can write into the cache directory cannot make it
    /// write, touch or delete anything outside. A `tmp/` that is a symlink is refused at
    /// open (cleaning it used to delete the files of the directory it points at); a
    /// prefix directory that is a symlink is neither evicted from nor put into; a symlink
    /// planted under the name of a reference being written is not written through.
    #[test]
    fn regression_issue_14_cache_never_acts_through_planted_symlinks() {
        use std::os::unix::fs::symlink;
        let t = tempfile::tempdir().unwrap();
        let victim_dir = t.path().join("victim");
        fs::create_dir_all(&victim_dir).unwrap();
        let victims: Vec<PathBuf> = (0..4).map(|i| victim_dir.join(format!("important-{i}"))).collect();
        for v in &victims {
            fs::write(v, vec![0xaa; 64 << 10]).unwrap();
        }
        let precious = t.path().join("precious");
        fs::write(&precious, b"precious").unwrap();
        let unchanged = |what: &str| {
            for v in &victims {
                assert_eq!(fs::read(v).unwrap_or_else(|e| panic!("{what}: {} deleted: {e}", v.display())), vec![0xaa; 64 << 10], "{what}");
            }
            assert_eq!(fs::read(&precious).unwrap(), b"precious", "{what}");
        };

        // tmp/ planted as a symlink to the victim directory.
        let root = t.path().join("c1");
        fs::create_dir_all(root.join("chunks/v1")).unwrap();
        symlink(&victim_dir, root.join("chunks/v1/tmp")).unwrap();
        let e = ChunkCache::open(&root, DEFAULT_LIMIT).unwrap_err();
        assert!(e.to_string().contains("symlink"), "{e}");
        unchanged("tmp/ as a symlink");

        // A prefix directory planted as a symlink to the victim directory, in a cache
        // small enough that opening it evicts.
        let root = t.path().join("c2");
        let c = ChunkCache::open(&root, DEFAULT_LIMIT).unwrap();
        let (d, ch) = chunk(9, 8192);
        let hex = d.to_hex();
        fs::create_dir_all(root.join("chunks/v1/blake3")).unwrap();
        symlink(&victim_dir, root.join("chunks/v1/blake3").join(&hex[..2])).unwrap();
        assert!(c.put(HashAlgo::Blake3, &d, &ch).is_err(), "a put through a symlinked prefix directory");
        assert!(!victim_dir.join(&hex).exists());
        drop(ChunkCache::open(&root, 4096).unwrap());
        unchanged("eviction over a symlinked prefix directory");

        // A symlink under the name the next reference temp will take (`.ref-<pid>.<seq>`).
        let root = t.path().join("c3");
        let c = ChunkCache::open(&root, DEFAULT_LIMIT).unwrap();
        let pulled = t.path().join("pulled");
        fs::write(&pulled, ch.as_bytes()).unwrap();
        let prefix = root.join("chunks/v1/blake3").join(&hex[..2]);
        fs::create_dir_all(&prefix).unwrap();
        for seq in 0..4 {
            symlink(&precious, prefix.join(format!("{REF_TEMP_PREFIX}{}.{seq}", std::process::id()))).unwrap();
        }
        assert_eq!(c.put_refs(HashAlgo::Blake3, &pulled, &[(d, 8192, 0)]).unwrap(), 1);
        unchanged("a reference written over a planted symlink");
        assert_eq!(c.get(HashAlgo::Blake3, &d, 8192).unwrap().expect("the reference serves").as_bytes(), ch.as_bytes());
    }

    /// An entry that is a FIFO is a miss, at once: opening it must not wait for a writer.
    #[test]
    fn regression_issue_14_a_fifo_under_an_entry_name_is_a_miss_not_a_hang() {
        let dir = tempfile::tempdir().unwrap();
        let c = ChunkCache::open(dir.path(), DEFAULT_LIMIT).unwrap();
        let (d, _) = chunk(3, 4096);
        let p = c.entry_path(HashAlgo::Blake3, &d);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        nix::unistd::mkfifo(&p, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let c = Arc::new(c);
        let c2 = c.clone();
        std::thread::spawn(move || tx.send(c2.get(HashAlgo::Blake3, &d, 4096).map(|o| o.is_none()).map_err(|e| e.to_string())));
        let got = rx.recv_timeout(Duration::from_secs(5)).expect("get on a FIFO entry hung");
        assert_eq!(got, Ok(true));
        assert!(fs::symlink_metadata(&p).is_err(), "the FIFO's name is dropped like a damaged entry");
    }

    /// A fake push layout `key` under `root`: a directory holding one blob of `len` bytes,
    /// its stamp and its lock, all last used at `at`.
    fn push_layout(root: &Path, key: &str, len: usize, at: SystemTime) -> PathBuf {
        let pl = root.join(PUSH_LAYOUTS);
        let blobs = pl.join(key).join("blobs/sha256");
        fs::create_dir_all(&blobs).unwrap();
        let files = [blobs.join("a".repeat(64)), pl.join(key).join("index.json"), pl.join(format!("{key}.stamp.json")), pl.join(format!("{key}.lock"))];
        for (k, f) in files.iter().enumerate() {
            fs::write(f, if k == 0 { vec![7u8; len] } else { b"{}".to_vec() }).unwrap();
            OpenOptions::new().write(true).open(f).unwrap().set_modified(at).unwrap();
        }
        pl.join(key)
    }

    /// Issue 22 §2: the cache's bound covers everything under the cache directory. Push
    /// layouts, upload state and known-blobs records are evicted with the chunks, least
    /// recently used first; a push layout a push holds stays; an evicted layout goes with
    /// its stamp and lock. (Before, only chunks were counted or evicted.)
    #[test]
    fn regression_issue_22_the_budget_covers_every_kind_of_entry() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let long_ago = SystemTime::now() - Duration::from_secs(7200);
        let old = push_layout(root, &"1".repeat(32), 256 << 10, long_ago);
        let held = push_layout(root, &"2".repeat(32), 256 << 10, long_ago);
        let lock = UseLock::shared(&root.join(PUSH_LAYOUTS).join(format!("{}.lock", "2".repeat(32)))).unwrap();
        for (d, name) in [(UPLOADS, "u.json"), (KNOWN_BLOBS, "h.txt")] {
            fs::create_dir_all(root.join(d)).unwrap();
            fs::write(root.join(d).join(name), vec![1u8; 64 << 10]).unwrap();
            OpenOptions::new().write(true).open(root.join(d).join(name)).unwrap().set_modified(long_ago).unwrap();
        }
        let usage = ChunkCache::open(root, u64::MAX).unwrap().usage().unwrap();
        let of = |k: EntryKind| usage.kinds.iter().find(|u| u.kind == k).copied().unwrap();
        assert_eq!((of(EntryKind::PushLayouts).entries, of(EntryKind::PushLayouts).in_use), (2, 1), "{usage:?}");
        assert!(of(EntryKind::PushLayouts).bytes >= 512 << 10);
        assert_eq!((of(EntryKind::Uploads).entries, of(EntryKind::KnownBlobs).entries), (1, 1));

        // Newer chunks, then a budget whose pass (down to 90 %) has room for them and the
        // held layout only.
        let c = ChunkCache::open(root, u64::MAX).unwrap();
        for i in 0..4u8 {
            let (d, ch) = chunk(i, 64 << 10);
            c.put(HashAlgo::Blake3, &d, &ch).unwrap();
        }
        let chunks = c.usage().unwrap().kinds[0].bytes;
        drop(c);
        let limit = (of(EntryKind::PushLayouts).bytes / 2 + chunks + 2048) / 90 * 100;
        let c = ChunkCache::open(root, limit).unwrap();
        assert!(!old.exists() && !root.join(PUSH_LAYOUTS).join(format!("{}.stamp.json", "1".repeat(32))).exists(), "the old layout went, stamp too");
        assert!(!root.join(PUSH_LAYOUTS).join(format!("{}.lock", "1".repeat(32))).exists(), "and its lock");
        assert!(held.exists(), "a layout in use stays");
        assert!(!root.join(UPLOADS).join("u.json").exists() && !root.join(KNOWN_BLOBS).join("h.txt").exists());
        for i in 0..4u8 {
            assert!(c.contains_unverified(HashAlgo::Blake3, &chunk(i, 64 << 10).0), "the newest entries stay");
        }
        assert!(c.stats().bytes_allocated <= limit, "{:?}", c.stats());
        // Released, the held layout is an old entry like any other: the budget a push
        // keeps when it ends takes it.
        drop(lock);
        keep_within_budget(root, chunks + 2048).unwrap();
        assert!(!held.exists());
    }

    #[test]
    fn stray_temps_are_ignored_and_cleaned() {
        let dir = tempfile::tempdir().unwrap();
        let c = ChunkCache::open(dir.path(), DEFAULT_LIMIT).unwrap();
        let (d, ch) = chunk(4, 4096);
        // A crashed writer's leftovers: a dead pid's temp holding a torn copy of the chunk.
        let dead = c.tmp.join("4000000.0.1.tmp");
        fs::write(&dead, &ch.as_bytes()[..100]).unwrap();
        let unnamed = c.tmp.join("garbage");
        fs::write(&unnamed, b"x").unwrap();
        assert!(c.get(HashAlgo::Blake3, &d, 4096).unwrap().is_none(), "a temp is never an entry");
        let c2 = ChunkCache::open(dir.path(), DEFAULT_LIMIT).unwrap();
        assert!(!dead.exists() && !unnamed.exists());
        assert_eq!(c2.stats().stray_temps_removed, 2);
        // A temp of a live writer (this process) stays.
        let live = c.tmp.join(format!("{}.99.1.tmp", std::process::id()));
        fs::write(&live, b"y").unwrap();
        let _c3 = ChunkCache::open(dir.path(), DEFAULT_LIMIT).unwrap();
        assert!(live.exists());
        c2.put(HashAlgo::Blake3, &d, &ch).unwrap();
        assert!(c2.get(HashAlgo::Blake3, &d, 4096).unwrap().is_some());
    }

    /// Issue 35 §1: the chunks a running restore pins stay through every eviction, the
    /// budget's and `prune --all` alike, from another handle (another process, as far as
    /// the files and locks go); once the pin is dropped they are entries like any other.
    #[test]
    fn regression_issue_35_pinned_chunks_survive_every_eviction_while_their_pin_lives() {
        let dir = tempfile::tempdir().unwrap();
        let holder = ChunkCache::open(dir.path(), DEFAULT_LIMIT).unwrap();
        let chunks: Vec<_> = (0..4u8).map(|i| chunk(i, 64 << 10)).collect();
        for (d, c) in &chunks {
            holder.put(HashAlgo::Blake3, d, c).unwrap();
        }
        let pin = holder.pin("lazy test\nsecond line", &[(HashAlgo::Blake3, chunks[0].0), (HashAlgo::Blake3, chunks[1].0)]).unwrap();
        assert_eq!(pin.chunks(), 2);
        assert!(fs::read_to_string(pin.path()).unwrap().starts_with("snapctl-pin v1 lazy test second line\nblake3:"), "one line of label, then the chunks");
        let other = ChunkCache::open(dir.path(), DEFAULT_LIMIT).unwrap();
        let usage = other.usage().unwrap();
        assert_eq!((usage.pins, usage.kinds[0].in_use), (1, 2), "{usage:?}");
        assert!(usage.pinned_bytes >= 128 << 10, "{usage:?}");
        let pruned = other.prune(0).unwrap();
        assert_eq!((pruned.entries_evicted, pruned.in_use_kept), (2, 2), "{pruned:?}");
        for (k, (d, _)) in chunks.iter().enumerate() {
            assert_eq!(other.contains_unverified(HashAlgo::Blake3, d), k < 2, "chunk {k}");
        }
        // Put while pinned (after the pin): pinned too.
        other.maintain(true).unwrap();
        assert!(holder.get(HashAlgo::Blake3, &chunks[0].0, 64 << 10).unwrap().is_some());
        drop(pin);
        assert_eq!(fs::read_dir(dir.path().join("chunks/v1/pins")).unwrap().count(), 0, "the pin file goes with the pin");
        assert_eq!(other.prune(0).unwrap().entries_evicted, 2);
        assert!(!other.contains_unverified(HashAlgo::Blake3, &chunks[0].0));
    }

    /// Issue 35 §1: the pin of a process that is gone (its file is there, nobody holds its
    /// lock: a daemon killed with -9) pins nothing and is deleted by the next pass; a pin
    /// being written by a dead process likewise.
    #[test]
    fn regression_issue_35_a_dead_holders_pin_is_removed_and_pins_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let c = ChunkCache::open(dir.path(), DEFAULT_LIMIT).unwrap();
        let (d, ch) = chunk(9, 8192);
        c.put(HashAlgo::Blake3, &d, &ch).unwrap();
        let pins = dir.path().join("chunks/v1/pins");
        let dead = pins.join("4000000-1-1.pin");
        fs::write(&dead, format!("snapctl-pin v1 killed\n{}\n", d.display_with(HashAlgo::Blake3))).unwrap();
        let writing = pins.join(".4000000-2-1.tmp");
        fs::write(&writing, "snapctl-pin v1 killed while writing\n").unwrap();
        assert_eq!(c.usage().unwrap().pins, 0, "a pin nobody holds is no pin");
        assert!(!dead.exists() && !writing.exists(), "a pass deletes them");
        fs::write(&dead, format!("snapctl-pin v1 killed\n{}\n", d.display_with(HashAlgo::Blake3))).unwrap();
        assert_eq!(c.prune(0).unwrap().entries_evicted, 1);
        assert!(!c.contains_unverified(HashAlgo::Blake3, &d) && !dead.exists());
    }

    /// Issue 35 §1: pinned bytes count toward the budget and no pass can free them, so a
    /// pinned chunk that would take them past the limit is not stored; the room left says so.
    #[test]
    fn regression_issue_35_pinned_puts_stop_at_the_budget() {
        let dir = tempfile::tempdir().unwrap();
        let len = 64 << 10;
        let chunks: Vec<_> = (0..6u8).map(|i| chunk(i, len)).collect();
        let c = ChunkCache::open(dir.path(), 3 * len as u64 + 4096).unwrap();
        let pin = c.pin("budget", &chunks.iter().map(|(d, _)| (HashAlgo::Blake3, *d)).collect::<Vec<_>>()).unwrap();
        assert_eq!(c.pinned_room(), c.limit());
        for (d, ch) in &chunks {
            c.put(HashAlgo::Blake3, d, ch).unwrap();
        }
        let stored = chunks.iter().filter(|(d, _)| c.contains_unverified(HashAlgo::Blake3, d)).count();
        assert_eq!(stored, 3, "{:?}", c.stats());
        assert_eq!(c.stats().pinned_over_budget, 3);
        assert!(c.pinned_room() < len as u64);
        assert_eq!(c.measure_pins(), 3 * len as u64);
        // Unpinned chunks still come and go within the budget.
        let (d, ch) = chunk(42, len);
        c.put(HashAlgo::Blake3, &d, &ch).unwrap();
        assert!(c.usage().unwrap().total_bytes <= c.limit() + len as u64);
        drop(pin);
    }

    /// Issue 35 §6: a small file being written under the cache root (a stamp's or an upload
    /// state's temp, renamed over its name when written) is not an entry to evict while its
    /// writer runs: `prune --all` deleted it and the push failed at its rename. A dead
    /// writer's old temp is a leftover, removed.
    #[test]
    fn regression_issue_35_files_being_written_are_never_evicted() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let me = std::process::id();
        let mut live = Vec::new();
        for (d, k) in [(PUSH_LAYOUTS, 0), (UPLOADS, 1), (KNOWN_BLOBS, 2)] {
            fs::create_dir_all(root.join(d)).unwrap();
            let p = root.join(d).join(format!(".tmp-{me}-{k}-5"));
            fs::write(&p, b"{}").unwrap();
            live.push(p);
        }
        let dead = root.join(UPLOADS).join(".tmp-4000000-0-5");
        fs::write(&dead, b"{}").unwrap();
        OpenOptions::new().write(true).open(&dead).unwrap().set_modified(SystemTime::now() - Duration::from_secs(3600)).unwrap();
        let c = ChunkCache::open(root, DEFAULT_LIMIT).unwrap();
        let pruned = c.prune(0).unwrap();
        assert_eq!(pruned.in_use_kept, 3, "{pruned:?}");
        for p in &live {
            assert!(p.exists(), "{} is being written", p.display());
        }
        assert!(!dead.exists(), "a dead writer's temp is a leftover");
        let usage = c.usage().unwrap();
        assert_eq!(usage.kinds.iter().map(|k| k.in_use).sum::<u64>(), 3, "{usage:?}");
    }
}
