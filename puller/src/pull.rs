//! `pull`: materialise an image's files from any [`BlobSource`] (a registry, mostly),
//! fetching only what the per-host [`ChunkCache`] does not already hold.
//!
//! ```text
//! plan:   every chunk position -> zero (a hole) | a distinct digest
//!         distinct digest      -> in the cache? read it (re-hashed) : fetch it
//! fetch:  misses grouped by pack, sorted by offset, neighbours coalesced into
//!         range requests of <= 8 MiB, `jobs` requests in flight
//! each:   verify_stored -> write at every position holding that digest -> cache queue
//! cache:  `CACHE_WRITERS` threads drain a bounded queue, putting chunks in batches
//!         (one round of syncs per batch, not per chunk); drained before pull returns
//! files:  temp name, set_len (holes), chunks, fsync, rename, fsync dir
//! ```
//!
//! Identical chunks are fetched once. A layer whose parent was pulled before on this host
//! fetches only the chunks its parent did not have, and a pull killed half-way and rerun
//! fetches only what the first run did not get into the cache: both fall out of the
//! cache, not of any pull-specific state. See `spec/cache.md`.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use imgfmt::compress::Codec;
use imgfmt::{BlobSource, ChunkDigest, Image, StoredAt};
use serde::Serialize;
use verify::{VerifiedChunk, VerifyError};

use crate::cache::{CacheStats, ChunkCache};
use crate::unpack::{TempGuard, UnpackError, WRITE_PIECE};

/// Largest coalesced range request.
pub const DEFAULT_MAX_RANGE: u64 = 8 << 20;
/// Upper bound on `max_range` (a pack's largest size).
const MAX_RANGE_LIMIT: u64 = 256 << 20;
/// Stored bytes of other chunks a range may read through to join two needed neighbours:
/// one round trip costs more than this many bytes on any link worth pulling over.
const MAX_GAP: u64 = 256 << 10;
/// Times a range request is repeated after an I/O failure before the pull gives up.
const RANGE_RETRIES: u32 = 4;
/// Threads putting fetched chunks in the cache: two, so one gathers the next batch while
/// the other waits on the disk.
const CACHE_WRITERS: usize = 2;
/// Chunk bytes waiting in the cache queue, and the most one batch holds: enough to keep
/// the disk busy, bounded so a slow disk slows the fetch instead of growing memory.
const CACHE_QUEUE_BYTES: u64 = 32 << 20;
/// Most chunks in one batch put, whatever their size.
const CACHE_BATCH_MAX: usize = 64;

#[derive(Debug, Clone)]
pub struct PullOptions {
    /// Range requests in flight (and threads reading the cache).
    pub jobs: usize,
    /// Replace files that already exist under the destination.
    pub overwrite: bool,
    /// Largest coalesced range request, in stored bytes (a single chunk larger than this
    /// is still fetched whole).
    pub max_range: u64,
    /// Pause before each range request: a throttle for tests and demos of interruption
    /// (`SNAPCTL_PULL_DELAY_MS` in the CLI). Zero in real use.
    pub request_delay: Duration,
}

impl Default for PullOptions {
    fn default() -> Self {
        PullOptions { jobs: 8, overwrite: false, max_range: DEFAULT_MAX_RANGE, request_delay: Duration::ZERO }
    }
}

/// What a pull did. Serialized as the `--json` summary of `snapctl pull`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PullReport {
    pub manifest: String,
    pub files: usize,
    /// Sum of the files' sizes.
    pub logical_bytes: u64,
    /// Bytes received in range requests (stored, possibly compressed, bytes).
    pub bytes_fetched: u64,
    pub range_requests: u64,
    /// Chunk positions in all files.
    pub chunks_total: u64,
    /// Positions that are holes (never fetched, never written).
    pub chunks_zero: u64,
    /// Distinct chunks read from the cache.
    pub chunks_from_cache: u64,
    /// Distinct chunks fetched from the source.
    pub chunks_fetched: u64,
    /// Non-zero positions served by a chunk already read or fetched for another position.
    pub chunks_deduplicated: u64,
    /// Chunks that failed verification once and were fetched again alone (a corrupted
    /// transfer); a second failure fails the pull.
    pub chunks_refetched: u64,
    /// Range requests repeated after an I/O failure mid-transfer (counted in
    /// `range_requests` too).
    pub range_retries: u64,
    /// Cache puts that failed (disk full, ...): the pull goes on, the chunk is not cached.
    pub cache_put_errors: u64,
    pub bytes_written: u64,
    pub seconds: f64,
    pub cache: Option<CacheStats>,
}

/// Where a distinct chunk goes and where it can be fetched from.
struct Distinct {
    digest: ChunkDigest,
    len: u32,
    /// One place it is stored (the first position's).
    pack: u32,
    offset: u64,
    stored_len: u32,
    codec: Codec,
    /// (file, chunk) positions holding it; the first names it in errors.
    positions: Vec<(usize, u64)>,
}

/// One unit of work for the pool.
enum Work {
    /// Distinct chunk the cache has an entry for (checked when read).
    Cached(usize),
    /// A range of one pack: stored bytes `[start, end)` covering these distinct chunks.
    Range { pack: u32, start: u64, end: u64, members: Vec<usize> },
}

/// Pull `image` (read from `src`) into `dest`, using and filling `cache` if given.
pub fn pull(
    src: &dyn BlobSource,
    image: &Image,
    dest: &Path,
    cache: Option<&ChunkCache>,
    opts: &PullOptions,
    progress: Option<&(dyn Fn(u64) + Sync)>,
) -> Result<PullReport, UnpackError> {
    let t0 = Instant::now();
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |source| UnpackError::Io { path: p, source }
    };
    let algo = image.config().hash;
    let shift = image.chunk_shift();
    let mut report = PullReport {
        manifest: image.manifest_digest.to_string(),
        files: image.files.len(),
        logical_bytes: image.files.iter().map(|f| f.size).sum(),
        ..Default::default()
    };

    // Plan: distinct non-zero digests and their positions; zero records checked.
    let mut distinct: Vec<Distinct> = Vec::new();
    let mut by_digest: HashMap<ChunkDigest, usize> = HashMap::new();
    let mut zero_bytes = 0u64;
    for (fi, f) in image.files.iter().enumerate() {
        for (ci, c) in f.chunks.iter().enumerate() {
            report.chunks_total += 1;
            match c.at {
                StoredAt::Zero => {
                    verify::check_zero_record(image, fi, ci as u64)?;
                    report.chunks_zero += 1;
                    zero_bytes += c.len as u64;
                }
                StoredAt::Pack { pack, offset, stored_len, codec } => match by_digest.get(&c.digest) {
                    Some(&d) if distinct[d].len == c.len => {
                        distinct[d].positions.push((fi, ci as u64));
                        report.chunks_deduplicated += 1;
                    }
                    _ => {
                        by_digest.insert(c.digest, distinct.len());
                        distinct.push(Distinct { digest: c.digest, len: c.len, pack, offset, stored_len, codec, positions: vec![(fi, ci as u64)] });
                    }
                },
            }
        }
    }
    if let Some(p) = progress {
        p(zero_bytes);
    }

    // Work list: ranges first (they wait on the network), then cache reads.
    let mut cached = Vec::new();
    let mut misses: Vec<usize> = Vec::new();
    for (i, d) in distinct.iter().enumerate() {
        match cache {
            Some(c) if c.contains_unverified(algo, &d.digest) => cached.push(Work::Cached(i)),
            _ => misses.push(i),
        }
    }
    // Bounded whatever the caller asks: each request in flight holds its range in memory.
    let mut work = coalesce(&distinct, misses, opts.max_range.min(MAX_RANGE_LIMIT));
    work.extend(cached);

    // Destination and temp files (all of them first: a missing directory or an existing
    // file fails the pull before anything is fetched).
    fs::create_dir_all(dest).map_err(io(dest))?;
    if !opts.overwrite {
        for f in &image.files {
            let p = dest.join(&f.name);
            if p.symlink_metadata().is_ok() {
                return Err(UnpackError::Exists(p));
            }
        }
    }
    let mut outs: Vec<(File, PathBuf, TempGuard)> = Vec::with_capacity(image.files.len());
    for f in &image.files {
        // Names were checked when the config was decoded: relative, no traversal.
        let final_path = dest.join(&f.name);
        let dir = final_path.parent().expect("joined path has a parent");
        fs::create_dir_all(dir).map_err(io(dir))?;
        let base = final_path.file_name().expect("file name").to_string_lossy().into_owned();
        let prefix = format!(".{base}.snapctl-partial");
        remove_dead_partials(dir, &prefix);
        let tmp = imgfmt::layout::tempname(dir, &prefix);
        let guard = TempGuard(Some(tmp.clone()));
        let file = OpenOptions::new().write(true).create_new(true).open(&tmp).map_err(io(&tmp))?;
        // A sparse file of the final size: zero chunks are never written.
        file.set_len(f.size).map_err(io(&tmp))?;
        outs.push((file, tmp, guard));
    }

    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first_err: Mutex<Option<UnpackError>> = Mutex::new(None);
    let c = Counters::default();
    // The cache queue: fetch workers hand verified chunks over and go on writing the
    // destination; the writers make them durable in the cache behind them.
    let per_chunk = 1u64 << shift;
    let queue_len = (CACHE_QUEUE_BYTES / per_chunk).clamp(2, CACHE_BATCH_MAX as u64) as usize;
    let (to_cache, from_fetch) = std::sync::mpsc::sync_channel::<(ChunkDigest, VerifiedChunk)>(queue_len);
    let from_fetch = Mutex::new(from_fetch);
    std::thread::scope(|outer| {
        if let Some(cache) = cache {
            for _ in 0..CACHE_WRITERS {
                outer.spawn(|| cache_writer(cache, algo, &from_fetch, queue_len, &c));
            }
        }
        let ctx = Ctx { src, image, cache, to_cache: cache.map(|_| to_cache), distinct: &distinct, outs: &outs, shift, algo, progress, c: &c };
        run_workers(&ctx, &work, opts, &next, &failed, &first_err);
        // Dropping the last sender ends the writers once the queue is drained; the outer
        // scope waits for them, so every queued chunk is put before pull returns.
        drop(ctx);
    });
    if let Some(cache) = cache {
        // The writers' passes may have overlapped; one more check, with nothing in flight,
        // leaves the cache within its limit and the report's size exact if it was over.
        if cache.maintain(false).is_err() {
            c.put_errors.fetch_add(1, Ordering::Relaxed);
        }
    }
    if let Some(e) = first_err.into_inner().expect("poisoned") {
        // The guards remove every temp file: nothing appears under a final name.
        return Err(e);
    }

    // Every file is complete: sync and rename each, then sync its directory.
    for (f, (file, tmp, mut guard)) in image.files.iter().zip(outs) {
        let final_path = dest.join(&f.name);
        file.set_permissions(fs::Permissions::from_mode(f.mode)).map_err(io(&tmp))?;
        file.sync_all().map_err(io(&tmp))?;
        drop(file);
        fs::rename(&tmp, &final_path).map_err(io(&final_path))?;
        // Renamed: nothing left for the guard to remove.
        let _ = guard.0.take();
        let dir = final_path.parent().expect("joined path has a parent");
        File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))?;
    }
    report.bytes_fetched = c.bytes_fetched.into_inner();
    report.range_requests = c.range_requests.into_inner();
    report.chunks_from_cache = c.from_cache.into_inner();
    report.chunks_fetched = c.fetched.into_inner();
    report.chunks_refetched = c.refetched.into_inner();
    report.range_retries = c.range_retries.into_inner();
    report.cache_put_errors = c.put_errors.into_inner();
    report.bytes_written = c.written.into_inner();
    report.cache = cache.map(|c| c.stats());
    report.seconds = t0.elapsed().as_secs_f64();
    Ok(report)
}

/// Put chunks from the queue in the cache until every sender is gone: block for one,
/// then take whatever else is already waiting (up to `batch_max`) into the same batch, so
/// batches grow only when the disk is the bottleneck and a slow trickle is put promptly.
fn cache_writer(cache: &ChunkCache, algo: imgfmt::HashAlgo, rx: &Mutex<Receiver<(ChunkDigest, VerifiedChunk)>>, batch_max: usize, c: &Counters) {
    loop {
        let batch: Vec<(ChunkDigest, VerifiedChunk)> = {
            let rx = rx.lock().expect("poisoned");
            let Ok(first) = rx.recv() else { return };
            let mut batch = vec![first];
            while batch.len() < batch_max {
                match rx.try_recv() {
                    Ok(item) => batch.push(item),
                    Err(_) => break,
                }
            }
            batch
        };
        let items: Vec<(ChunkDigest, &VerifiedChunk)> = batch.iter().map(|(d, ch)| (*d, ch)).collect();
        let failed = cache.put_batch(algo, &items).iter().filter(|r| r.is_err()).count();
        c.put_errors.fetch_add(failed as u64, Ordering::Relaxed);
    }
}

/// The fetch pool: `jobs` threads taking work items in order until done or one fails.
fn run_workers(
    ctx: &Ctx<'_>,
    work: &[Work],
    opts: &PullOptions,
    next: &AtomicUsize,
    failed: &AtomicBool,
    first_err: &Mutex<Option<UnpackError>>,
) {
    std::thread::scope(|s| {
        for _ in 0..opts.jobs.max(1) {
            s.spawn(|| loop {
                if failed.load(Ordering::Relaxed) {
                    break;
                }
                let Some(w) = work.get(next.fetch_add(1, Ordering::Relaxed)) else { break };
                let res = match w {
                    Work::Cached(i) => ctx.read_cached(*i),
                    Work::Range { pack, start, end, members } => {
                        if !opts.request_delay.is_zero() {
                            std::thread::sleep(opts.request_delay);
                        }
                        ctx.fetch_range(*pack, *start, *end, members)
                    }
                };
                if let Err(e) = res {
                    failed.store(true, Ordering::Relaxed);
                    first_err.lock().expect("poisoned").get_or_insert(e);
                    break;
                }
            });
        }
    });
}

/// Remove `<prefix>-<pid>-...` temp files of pulls (or unpacks) that were killed: their
/// pid no longer runs. A live writer's temp file (another pull into the same directory)
/// is left alone.
fn remove_dead_partials(dir: &Path, prefix: &str) {
    let Ok(rd) = fs::read_dir(dir) else { return };
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(prefix)).and_then(|r| r.strip_prefix('-')) else { continue };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else { continue };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = fs::remove_file(e.path());
        }
    }
}

/// Group distinct chunks to fetch by pack, in offset order, into ranges of at most
/// `max_range` stored bytes, joining neighbours separated by at most [`MAX_GAP`].
fn coalesce(distinct: &[Distinct], mut misses: Vec<usize>, max_range: u64) -> Vec<Work> {
    misses.sort_by_key(|&i| (distinct[i].pack, distinct[i].offset));
    let mut out = Vec::new();
    let mut cur: Option<(u32, u64, u64, Vec<usize>)> = None;
    for i in misses {
        let d = &distinct[i];
        let (s, e) = (d.offset, d.offset + d.stored_len as u64);
        if let Some((pack, start, end, members)) = &mut cur {
            // Sorted by offset, so `s >= start`; a range only grows while it stays within
            // the bound, and only across a gap small enough to be worth reading through.
            if *pack == d.pack && s <= *end + MAX_GAP && e.max(*end) - *start <= max_range {
                *end = e.max(*end);
                members.push(i);
                continue;
            }
            let (pack, start, end, members) = cur.take().expect("some");
            out.push(Work::Range { pack, start, end, members });
        }
        cur = Some((d.pack, s, e, vec![i]));
    }
    if let Some((pack, start, end, members)) = cur {
        out.push(Work::Range { pack, start, end, members });
    }
    out
}

#[derive(Default)]
struct Counters {
    bytes_fetched: AtomicU64,
    range_requests: AtomicU64,
    from_cache: AtomicU64,
    fetched: AtomicU64,
    refetched: AtomicU64,
    range_retries: AtomicU64,
    put_errors: AtomicU64,
    written: AtomicU64,
}

struct Ctx<'a> {
    src: &'a dyn BlobSource,
    image: &'a Image,
    cache: Option<&'a ChunkCache>,
    /// The cache queue (with a cache only).
    to_cache: Option<SyncSender<(ChunkDigest, VerifiedChunk)>>,
    distinct: &'a [Distinct],
    outs: &'a [(File, PathBuf, TempGuard)],
    shift: u8,
    algo: imgfmt::HashAlgo,
    progress: Option<&'a (dyn Fn(u64) + Sync)>,
    c: &'a Counters,
}

impl Ctx<'_> {
    /// A distinct chunk the cache should have; if its entry turned out damaged or gone
    /// (evicted by another process since planning), fetch it alone.
    fn read_cached(&self, i: usize) -> Result<(), UnpackError> {
        let d = &self.distinct[i];
        let cache = self.cache.expect("cached work only with a cache");
        match cache.get(self.algo, &d.digest, d.len)? {
            Some(chunk) => {
                self.c.from_cache.fetch_add(1, Ordering::Relaxed);
                self.place(i, &chunk)
            }
            None => self.fetch_range(d.pack, d.offset, d.offset + d.stored_len as u64, &[i]),
        }
    }

    /// Fetch stored bytes `[start, end)` of a pack and place every member chunk.
    fn fetch_range(&self, pack: u32, start: u64, end: u64, members: &[usize]) -> Result<(), UnpackError> {
        let pack_digest = &self.image.packs[pack as usize].digest;
        let mut buf = vec![0u8; (end - start) as usize];
        self.read_range(pack_digest, start, &mut buf).map_err(|source| {
            let d = &self.distinct[members[0]];
            let (file, chunk) = d.positions[0];
            VerifyError::Read { file: self.image.files[file].name.clone(), chunk, offset: chunk << self.shift, source }
        })?;
        self.c.bytes_fetched.fetch_add(buf.len() as u64, Ordering::Relaxed);
        for &i in members {
            let d = &self.distinct[i];
            let s = (d.offset - start) as usize;
            let stored = if members.len() == 1 && s == 0 && d.stored_len as usize == buf.len() {
                // The common single-chunk range: hand the buffer over, no copy.
                std::mem::take(&mut buf)
            } else {
                buf[s..s + d.stored_len as usize].to_vec()
            };
            let chunk = match verify::verify_stored(self.algo, d.codec, stored, d.len, &d.digest) {
                Ok(c) => c,
                // Bytes damaged in transit look the same as bytes damaged at rest; one
                // fetch of the chunk alone tells them apart.
                Err(_) => self.refetch(i)?,
            };
            self.c.fetched.fetch_add(1, Ordering::Relaxed);
            self.place(i, &chunk)?;
            if let Some(q) = &self.to_cache {
                // Blocks only while the queue is full. The writers outlive every sender,
                // so a send fails only if they are gone, which leaves the chunk uncached.
                if q.send((d.digest, chunk)).is_err() {
                    self.c.put_errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        Ok(())
    }

    /// One range request, tried again on an I/O failure (a connection reset or a body cut
    /// short mid-transfer, which the HTTP client's own retries do not cover because the
    /// status line had already arrived). Other errors (a missing blob, a range past the
    /// end) are answers and are not retried.
    fn read_range(&self, pack: &imgfmt::OciDigest, offset: u64, buf: &mut [u8]) -> Result<(), imgfmt::FormatError> {
        let mut attempt = 0u32;
        loop {
            self.c.range_requests.fetch_add(1, Ordering::Relaxed);
            match self.src.read_at_unverified(pack, offset, buf) {
                Err(imgfmt::FormatError::Io { .. }) if attempt < RANGE_RETRIES => {
                    attempt += 1;
                    self.c.range_retries.fetch_add(1, Ordering::Relaxed);
                    // Exponential backoff with jitter, so parallel requests that failed
                    // together do not retry together.
                    let base = 100u64 << attempt.min(6);
                    let jitter = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos() as u64) % base;
                    std::thread::sleep(Duration::from_millis(base + jitter));
                }
                other => return other,
            }
        }
    }

    /// Fetch one chunk alone after its bytes failed verification; a second failure is the
    /// answer (exit 1 in the CLI), naming the chunk's first file and position.
    fn refetch(&self, i: usize) -> Result<VerifiedChunk, UnpackError> {
        self.c.refetched.fetch_add(1, Ordering::Relaxed);
        let d = &self.distinct[i];
        let (file, chunk) = d.positions[0];
        let name = &self.image.files[file].name;
        let offset = chunk << self.shift;
        let mut buf = vec![0u8; d.stored_len as usize];
        self.read_range(&self.image.packs[d.pack as usize].digest, d.offset, &mut buf)
            .map_err(|source| VerifyError::Read { file: name.clone(), chunk, offset, source })?;
        self.c.bytes_fetched.fetch_add(buf.len() as u64, Ordering::Relaxed);
        verify::verify_stored(self.algo, d.codec, buf, d.len, &d.digest).map_err(|(detail, actual)| {
            UnpackError::Verify(match actual {
                Some(actual) => VerifyError::DigestMismatch { file: name.clone(), chunk, offset, expected: d.digest, actual },
                None => VerifyError::Corrupt { file: name.clone(), chunk, offset, detail },
            })
        })
    }

    /// Write a verified chunk at every position that holds it.
    fn place(&self, i: usize, chunk: &VerifiedChunk) -> Result<(), UnpackError> {
        for &(fi, ci) in &self.distinct[i].positions {
            let (file, tmp, _) = &self.outs[fi];
            let at = ci << self.shift;
            // Pieces of at most 256 KiB (see unpack: large page-cache copies were slower).
            for (k, piece) in chunk.as_bytes().chunks(WRITE_PIECE).enumerate() {
                file.write_all_at(piece, at + (k * WRITE_PIECE) as u64)
                    .map_err(|source| UnpackError::Io { path: tmp.clone(), source })?;
            }
            start_writeback(file, at, chunk.len() as u64);
            self.c.written.fetch_add(chunk.len() as u64, Ordering::Relaxed);
            if let Some(p) = self.progress {
                p(chunk.len() as u64);
            }
        }
        Ok(())
    }
}

/// Start writing a just-placed chunk to disk without waiting for it, so the disk works
/// while the network does and the final fsync finds little left to do. A hint: if it
/// fails, that fsync does the work.
fn start_writeback(file: &File, at: u64, len: u64) {
    use std::os::fd::AsRawFd;
    let (Ok(off), Ok(n)) = (libc::off64_t::try_from(at), libc::off64_t::try_from(len)) else { return };
    // SAFETY: sync_file_range only reads its integer arguments; the fd stays open for the
    // call (borrowed from `file`).
    let _ = unsafe { libc::sync_file_range(file.as_raw_fd(), off, n, libc::SYNC_FILE_RANGE_WRITE) };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(pack: u32, offset: u64, stored_len: u32) -> Distinct {
        Distinct { digest: ChunkDigest::default(), len: stored_len, pack, offset, stored_len, codec: Codec::Raw, positions: vec![(0, 0)] }
    }

    fn ranges(w: &[Work]) -> Vec<(u32, u64, u64, usize)> {
        w.iter()
            .map(|w| match w {
                Work::Range { pack, start, end, members } => (*pack, *start, *end, members.len()),
                Work::Cached(_) => panic!("no cached work here"),
            })
            .collect()
    }

    #[test]
    fn dead_partials_are_removed_live_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let dead = dir.path().join(".vm.mem.snapctl-partial-4000000-0-1");
        let live = dir.path().join(format!(".vm.mem.snapctl-partial-{}-0-1", std::process::id()));
        let other = dir.path().join(".vm.state.snapctl-partial-4000000-0-1");
        let keep = dir.path().join("vm.mem");
        for p in [&dead, &live, &other, &keep] {
            fs::write(p, b"x").unwrap();
        }
        remove_dead_partials(dir.path(), ".vm.mem.snapctl-partial");
        assert!(!dead.exists());
        assert!(live.exists() && other.exists() && keep.exists());
    }

    #[test]
    fn coalescing_joins_neighbours_within_bounds() {
        let mb = 1u64 << 20;
        let ds = vec![
            d(0, 0, mb as u32),
            d(0, mb, mb as u32),
            d(1, 0, 1000),
            d(0, 3 * mb, mb as u32), // a 1 MiB gap: too far to read through
            d(0, 4 * mb + 1000, 1000), // a small gap: joined
        ];
        let w = coalesce(&ds, vec![4, 2, 0, 3, 1], 8 * mb);
        assert_eq!(ranges(&w), vec![(0, 0, 2 * mb, 2), (0, 3 * mb, 4 * mb + 2000, 2), (1, 0, 1000, 1)]);
        // The bound splits a long run.
        let run: Vec<_> = (0..20).map(|k| d(0, k * mb, mb as u32)).collect();
        let w = coalesce(&run, (0..20).collect(), 8 * mb);
        assert_eq!(ranges(&w).iter().map(|r| r.3).collect::<Vec<_>>(), vec![8, 8, 4]);
        assert!(ranges(&w).iter().all(|r| r.2 - r.1 <= 8 * mb));
        // A chunk larger than the bound is still fetched, alone.
        let w = coalesce(&[d(0, 0, (9 * mb) as u32), d(0, 9 * mb, 10)], vec![0, 1], 8 * mb);
        assert_eq!(ranges(&w), vec![(0, 0, 9 * mb, 1), (0, 9 * mb, 9 * mb + 10, 1)]);
    }
}
