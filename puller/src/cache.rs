//! The per-host chunk cache: content-addressed files of uncompressed chunk bytes, shared
//! by concurrent pulls (and the lazy restore server), bounded by allocated bytes with
//! least-recently-used eviction, crash-safe. Layout and argument: `spec/cache.md`.
//!
//! ```text
//! <root>/chunks/v1/<algo>/<2 hex>/<64 hex>   one chunk's bytes, nothing else
//! <root>/chunks/v1/tmp/<pid>.<seq>.<nanos>.tmp   a put in progress (or a crash's leftover)
//! <root>/chunks/v1/lock                      flock'd for the eviction pass
//! ```
//!
//! A put writes a temp file, `fdatasync`s it, renames it under its digest and fsyncs the
//! directory: a crash can forget a chunk but never leave a torn one under its name. A get
//! re-hashes the bytes every time, so damage after the fact (a bad disk, a stray write) is
//! a miss (the entry is deleted), never served.

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use imgfmt::compress::Codec;
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
/// Recency is the entry's mtime, refreshed on a hit at most this often (so hot chunks do
/// not cost a metadata write per read).
const TOUCH_EVERY: Duration = Duration::from_secs(60);
/// An eviction pass brings the cache down to this fraction of the limit (in percent), so
/// the next few puts do not each trigger a pass.
const EVICT_TO_PERCENT: u64 = 90;

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
    /// Stray temp files of crashed writers removed.
    pub stray_temps_removed: u64,
    pub bytes_allocated: u64,
    pub limit_bytes: u64,
}

/// A per-host, content-addressed chunk cache. `Send + Sync`: share one with an `Arc` or
/// by reference across threads; several processes may open the same directory.
#[derive(Debug)]
pub struct ChunkCache {
    base: PathBuf,
    tmp: PathBuf,
    limit: u64,
    hits: AtomicU64,
    misses: AtomicU64,
    puts: AtomicU64,
    evictions: AtomicU64,
    damaged: AtomicU64,
    strays: AtomicU64,
    /// Allocated bytes: measured by the last scan plus what this handle put since.
    allocated: AtomicU64,
    /// Bytes this handle put since the last scan: other processes' puts are invisible to
    /// the estimate, so a rescan happens every tenth of the limit regardless.
    since_scan: AtomicU64,
    seq: AtomicU64,
    /// One eviction pass at a time within the process (the flock covers other processes).
    evicting: Mutex<()>,
}

/// One cache entry seen by a scan.
struct Entry {
    path: PathBuf,
    allocated: u64,
    used: SystemTime,
}

impl ChunkCache {
    /// Open (creating) a cache rooted at `dir`, bounded to `limit_bytes` of allocated space.
    /// Measures the cache, removes stray temp files of crashed writers, and evicts if the
    /// cache is over the limit (a smaller limit than last time shrinks it).
    pub fn open(dir: &Path, limit_bytes: u64) -> Result<ChunkCache, CacheError> {
        let base = dir.join(VERSION_DIR);
        let tmp = base.join("tmp");
        fs::create_dir_all(&tmp).map_err(io(&tmp))?;
        let c = ChunkCache {
            base,
            tmp,
            limit: limit_bytes,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            puts: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            damaged: AtomicU64::new(0),
            strays: AtomicU64::new(0),
            allocated: AtomicU64::new(0),
            since_scan: AtomicU64::new(0),
            seq: AtomicU64::new(0),
            evicting: Mutex::new(()),
        };
        c.clean_temps()?;
        c.maintain(true)?;
        Ok(c)
    }

    /// `$SNAPCTL_CACHE`, else `$XDG_CACHE_HOME/snapctl`, else `~/.cache/snapctl`
    /// (falling back to a directory under the system temp dir when there is no home).
    pub fn default_dir() -> PathBuf {
        let nonempty = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        if let Some(p) = nonempty("SNAPCTL_CACHE") {
            return p;
        }
        if let Some(p) = nonempty("XDG_CACHE_HOME") {
            return p.join("snapctl");
        }
        if let Some(h) = nonempty("HOME") {
            return h.join(".cache").join("snapctl");
        }
        std::env::temp_dir().join("snapctl-cache")
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
    /// so a damaged entry is deleted and reported as a miss, never served).
    pub fn get(&self, algo: HashAlgo, digest: &ChunkDigest, len: u32) -> Result<Option<VerifiedChunk>, CacheError> {
        let path = self.entry_path(algo, digest);
        let mut f = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => {
                self.misses.fetch_add(1, Ordering::Relaxed);
                return Ok(None);
            }
            Err(e) => return Err(io(&path)(e)),
        };
        let md = f.metadata().map_err(io(&path))?;
        if md.len() != len as u64 || md.len() > MAX_ENTRY {
            // Wrong length: damaged (or a chunk of another length sharing a digest, which
            // a collision-resistant hash rules out).
            self.drop_damaged(&path);
            return Ok(None);
        }
        let mut buf = vec![0u8; len as usize];
        if let Err(e) = f.read_exact(&mut buf) {
            if e.kind() == ErrorKind::UnexpectedEof {
                self.drop_damaged(&path);
                return Ok(None);
            }
            return Err(io(&path)(e));
        }
        match verify::verify_stored(algo, Codec::Raw, buf, len, digest) {
            Ok(chunk) => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                // Recency for LRU eviction. atime is unreliable (noatime, relatime), so the
                // cache keeps its own in mtime; failing to touch only makes eviction less fair.
                if md.modified().map_or(true, |m| m.elapsed().unwrap_or_default() > TOUCH_EVERY) {
                    let _ = OpenOptions::new().write(true).open(&path).and_then(|w| w.set_modified(SystemTime::now()));
                }
                Ok(Some(chunk))
            }
            Err(_) => {
                self.drop_damaged(&path);
                Ok(None)
            }
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
        self.entry_path(algo, digest).is_file()
    }

    /// Store a verified chunk durably: temp file, fdatasync, atomic rename (a crash can
    /// forget a chunk but never leave a torn one under its name). Idempotent; safe across
    /// processes. All-zero chunks are not stored (callers make zeros locally).
    pub fn put(&self, algo: HashAlgo, digest: &ChunkDigest, chunk: &VerifiedChunk) -> Result<(), CacheError> {
        let bytes = chunk.as_bytes();
        if bytes.len() as u64 > MAX_ENTRY {
            return Err(CacheError::TooLarge { len: bytes.len() as u64 });
        }
        if verify::hash::is_zero(bytes) {
            return Ok(());
        }
        let path = self.entry_path(algo, digest);
        if let Ok(md) = fs::metadata(&path) {
            if md.len() == bytes.len() as u64 {
                return Ok(());
            }
        }
        let dir = path.parent().expect("entry has a parent");
        if !dir.is_dir() {
            fs::create_dir_all(dir).map_err(io(dir))?;
            // The new directory's own entry must be durable for the chunk's to be.
            sync_dir(dir.parent().expect("algo dir"))?;
        }
        let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_nanos();
        let tmp = self.tmp.join(format!("{}.{}.{nanos}.tmp", std::process::id(), self.seq.fetch_add(1, Ordering::Relaxed)));
        let res = (|| {
            let mut f = OpenOptions::new().write(true).create_new(true).open(&tmp).map_err(io(&tmp))?;
            f.write_all(bytes).map_err(io(&tmp))?;
            f.sync_data().map_err(io(&tmp))?;
            let allocated = f.metadata().map_err(io(&tmp))?.blocks() * 512;
            drop(f);
            // Concurrent puts of one digest each rename a complete copy of the same bytes:
            // whichever lands last wins, and every reader sees a whole file.
            fs::rename(&tmp, &path).map_err(io(&path))?;
            sync_dir(dir)?;
            Ok(allocated)
        })();
        let allocated = match res {
            Ok(a) => a,
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                return Err(e);
            }
        };
        self.puts.fetch_add(1, Ordering::Relaxed);
        let total = self.allocated.fetch_add(allocated, Ordering::Relaxed) + allocated;
        let since = self.since_scan.fetch_add(allocated, Ordering::Relaxed) + allocated;
        if total > self.limit || since > self.limit / 10 {
            self.maintain(false)?;
        }
        Ok(())
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            puts: self.puts.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            damaged: self.damaged.load(Ordering::Relaxed),
            stray_temps_removed: self.strays.load(Ordering::Relaxed),
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
        let Ok(_one) = self.evicting.try_lock() else {
            // Another thread of this process is on it.
            return Ok(());
        };
        if !force_scan && self.allocated.load(Ordering::Relaxed) <= self.limit && self.since_scan.load(Ordering::Relaxed) <= self.limit / 10 {
            return Ok(());
        }
        let lock_path = self.base.join("lock");
        let lock = OpenOptions::new().create(true).truncate(false).write(true).open(&lock_path).map_err(io(&lock_path))?;
        lock.lock().map_err(io(&lock_path))?;
        self.since_scan.store(0, Ordering::Relaxed);
        let mut entries = self.scan()?;
        let mut total: u64 = entries.iter().map(|e| e.allocated).sum();
        if total > self.limit {
            let target = self.limit / 100 * EVICT_TO_PERCENT;
            entries.sort_by_key(|e| e.used);
            for e in entries {
                if total <= target {
                    break;
                }
                match fs::remove_file(&e.path) {
                    Ok(()) => {
                        self.evictions.fetch_add(1, Ordering::Relaxed);
                        total = total.saturating_sub(e.allocated);
                    }
                    Err(err) if err.kind() == ErrorKind::NotFound => total = total.saturating_sub(e.allocated),
                    Err(err) => return Err(io(&e.path)(err)),
                }
            }
        }
        self.allocated.store(total, Ordering::Relaxed);
        Ok(())
    }

    /// Every entry under `<root>/chunks/v1/<algo>/<xx>/`.
    fn scan(&self) -> Result<Vec<Entry>, CacheError> {
        let mut out = Vec::new();
        for algo in [HashAlgo::Blake3, HashAlgo::Sha256] {
            let adir = self.base.join(algo.name());
            let Ok(prefixes) = fs::read_dir(&adir) else { continue };
            for p in prefixes {
                let p = p.map_err(io(&adir))?;
                let Ok(files) = fs::read_dir(p.path()) else { continue };
                for f in files {
                    let Ok(f) = f else { continue };
                    // Vanished since the listing (evicted or damaged elsewhere): skip.
                    let Ok(md) = f.metadata() else { continue };
                    if md.is_file() {
                        out.push(Entry { path: f.path(), allocated: md.blocks() * 512, used: md.modified().unwrap_or(SystemTime::UNIX_EPOCH) });
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
        let Ok(rd) = fs::read_dir(&self.tmp) else { return Ok(()) };
        let me = std::process::id();
        for e in rd.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            let pid: Option<u32> = name.split('.').next().and_then(|p| p.parse().ok());
            let old = e.metadata().ok().and_then(|m| m.modified().ok()).is_none_or(|m| m.elapsed().unwrap_or_default() > STALE_TEMP);
            let writer_gone = match pid {
                Some(p) if p == me => false,
                Some(p) => !Path::new(&format!("/proc/{p}")).exists(),
                None => true,
            };
            if (old || writer_gone) && fs::remove_file(e.path()).is_ok() {
                self.strays.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }
}

fn sync_dir(dir: &Path) -> Result<(), CacheError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))
}

/// Parse `SIZE` for `--cache-size` (`10GiB`, `512M`, bytes).
pub fn parse_limit(s: &str) -> Result<u64, String> {
    imgfmt::size::parse_size(s)
}

#[cfg(test)]
mod tests {
    use super::*;
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
        let measured: u64 = c.scan().unwrap().iter().map(|e| e.allocated).sum();
        assert!(measured <= 10 * len as u64 + 1000, "over the limit: {measured}");
        assert!(c.stats().evictions >= 20);
        assert!(c.contains_unverified(HashAlgo::Blake3, &chunks[0].0), "the recently used entry survived");
        assert!(c.contains_unverified(HashAlgo::Blake3, &chunks[29].0), "the newest entry survived");
        assert!(!c.contains_unverified(HashAlgo::Blake3, &chunks[1].0), "the oldest went first");
        // A smaller limit on reopen shrinks the cache.
        let small = ChunkCache::open(dir.path(), 2 * len as u64 + 1000).unwrap();
        assert!(small.stats().bytes_allocated <= 2 * len as u64 + 1000);
        let measured: u64 = small.scan().unwrap().iter().map(|e| e.allocated).sum();
        assert_eq!(measured, small.stats().bytes_allocated);
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
}
