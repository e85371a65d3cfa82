//! `pull`: materialise an image's files from any [`BlobSource`] (a registry, mostly),
//! fetching only what the per-host [`ChunkCache`] does not already hold.
//!
//! ```text
//! dest:   every name resolved beneath DEST, never through a symlink (imgfmt::file::Dir);
//!         a file already under its final name holding exactly the image is kept
//! plan:   every chunk position -> zero (a hole) | a distinct digest
//! files:  temp name (or the temp file of a killed pull here, taken over if it is a
//!         regular single-link file of ours), set_len (holes)
//! resume: in a taken-over file, each distinct chunk found whole and verified is kept
//! rest:   in the cache? read it (re-hashed) : fetch it
//! fetch:  misses grouped by pack, sorted by offset, neighbours coalesced into
//!         range requests of <= 8 MiB; `jobs` requests in flight at once, and more once
//!         one round trip is timed: enough to fill a 10 Gbit/s link at that RTT, at most
//!         `max_jobs` and 256 MiB of ranges (see `in_flight_depth`)
//! each:   verify_stored -> write at every position holding that digest
//!         (--cache-copy: and queue it for `CACHE_WRITERS` threads that put copies in
//!         the cache in batches, drained before pull returns)
//! done:   fsync, rename, fsync dir; then the cache records where each fetched chunk now
//!         is (a reference into the pulled file) unless it holds a copy
//! ```
//!
//! Why references by default: a copy in the cache writes every byte to disk twice, and
//! the disk is what a pull on a fast network waits for (2 GiB, half zero: 2.3 s with
//! copies, 1.15 s without, on the benchmark machine). The pulled files are what a
//! restore uses and they stay on the host while it runs; a reference that goes stale
//! (files deleted or changed) is a miss, never wrong bytes, as every read is re-hashed.
//!
//! Identical chunks are fetched once. A layer whose parent was pulled before on this host
//! fetches only the chunks its parent did not have (they come from the cache). A pull
//! killed half-way (or failed on the network) and rerun takes over its temp file and
//! fetches only what is not verified there; killed between its renames, the rerun keeps
//! the files already renamed once each is checked whole. See `spec/cache.md` §6.

use std::ffi::OsString;
use std::fs::{self, File};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use imgfmt::compress::Codec;
use imgfmt::{BlobSource, ChunkDigest, Image, StoredAt};
use serde::Serialize;
use verify::{VerifiedChunk, VerifyError};

use crate::cache::{CacheError, CacheStats, ChunkCache, PreparedRefs};
use crate::unpack::{partial_name, DestDirs, TempGuard, UnpackError, WRITE_PIECE};
use imgfmt::file::Dir;

/// Largest coalesced range request.
pub const DEFAULT_MAX_RANGE: u64 = 8 << 20;
/// Upper bound on `max_range` (a pack's largest size).
const MAX_RANGE_LIMIT: u64 = 256 << 20;
/// Stored bytes of other chunks a range may read through to join two needed neighbours:
/// one round trip costs more than this many bytes on any link worth pulling over.
const MAX_GAP: u64 = 256 << 10;
/// When a range request is repeated after a transient failure (4 times, beyond the
/// registry client's own retries of each request, and within the retry budget as a
/// wall-clock bound, [`regclient::retry_budget`]) before the pull gives up.
fn range_retry() -> imgfmt::RetryPolicy {
    imgfmt::RetryPolicy { budget: Some(regclient::retry_budget()), ..imgfmt::RetryPolicy::attempts(4) }
}
/// Threads putting fetched chunks in the cache: two, so one gathers the next batch while
/// the other waits on the disk.
const CACHE_WRITERS: usize = 2;
/// Chunk bytes waiting in the cache queue, and the most one batch holds: enough to keep
/// the disk busy, bounded so a slow disk slows the fetch instead of growing memory.
const CACHE_QUEUE_BYTES: u64 = 32 << 20;
/// Most chunks in one batch put, whatever their size.
const CACHE_BATCH_MAX: usize = 64;
/// Threads recording cache references after a pull.
const REF_WRITERS: usize = 4;
/// Default bound on range requests in flight however long the round trip: each holds a
/// thread and, over HTTP/1.1, a connection of its own. Half of what `snapctl serve` allows
/// one client (64 connections, registry/src/server/listen.rs), so the idle connections a
/// pull keeps beside them never meet that cap (at 64, one pull of the chain bench through
/// a proxy failed, 2026-12-01; its message was not kept, and the proxy had counted 65
/// connections open at once in another run). 32 requests of 1 MiB cover 1 Gbit/s up to
/// ~250 ms of RTT.
pub const DEFAULT_MAX_JOBS: usize = 32;
/// The link a pull is sized to fill, in bytes per second (10 Gbit/s). The bandwidth is not
/// measured: a request in flight beyond what the link needs only waits its turn on the
/// link, holding memory (bounded by [`IN_FLIGHT_BYTES`]) and a connection, while one too
/// few leaves the link idle for a round trip (at 50 ms RTT, as on a WAN).
const LINK_BYTES_PER_SEC: f64 = 1.25e9;
/// Stored bytes of range requests in flight at most, whatever the RTT asks for: each holds
/// its range in memory until its chunks are written. `jobs` requests are always allowed.
const IN_FLIGHT_BYTES: u64 = 256 << 20;

#[derive(Debug, Clone)]
pub struct PullOptions {
    /// Range requests in flight from the start (and threads reading the cache).
    pub jobs: usize,
    /// Range requests in flight at most ([`DEFAULT_MAX_JOBS`]): once a round trip to the
    /// source is timed, more than `jobs` are started if the link needs them (see
    /// [`in_flight_depth`]). `jobs` or less: exactly `jobs`.
    pub max_jobs: usize,
    /// Replace files that already exist under the destination.
    pub overwrite: bool,
    /// Largest coalesced range request, in stored bytes (a single chunk larger than this
    /// is still fetched whole).
    pub max_range: u64,
    /// Pause before each range request: a throttle for tests and demos of interruption
    /// (`SNAPCTL_PULL_DELAY_MS` in the CLI). Zero in real use.
    pub request_delay: Duration,
    /// Put a copy of every fetched chunk in the cache (it then survives the pulled files
    /// being deleted or changed, at the price of writing every byte twice). Without it
    /// the cache records where in the pulled files each chunk now is (a reference,
    /// re-hashed when read, like a copy).
    pub cache_copies: bool,
}

impl Default for PullOptions {
    fn default() -> Self {
        PullOptions { jobs: 8, max_jobs: DEFAULT_MAX_JOBS, overwrite: false, max_range: DEFAULT_MAX_RANGE, request_delay: Duration::ZERO, cache_copies: false }
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
    /// Most range requests that were allowed in flight at once (`jobs`, or more if the
    /// round trip asked for them).
    pub ranges_in_flight: usize,
    /// The round trip timed to size that depth, in milliseconds (none if there was
    /// nothing to fetch beyond `jobs` ranges, or `max_jobs` allowed no more).
    pub rtt_ms: Option<f64>,
    /// Chunk positions in all files.
    pub chunks: u64,
    /// Positions that are holes (never fetched, never written).
    pub zero_chunks: u64,
    /// Distinct chunks read from the cache.
    pub cached_chunks: u64,
    /// Distinct chunks fetched from the source.
    pub fetched_chunks: u64,
    /// Distinct chunks found complete and verified in the temp file of an earlier pull
    /// into the same place that was killed (resumed, not fetched).
    pub resumed_chunks: u64,
    /// Files already under their final name holding exactly the image's content (a pull
    /// killed between its renames left them; every chunk checked): kept, not written.
    pub in_place_files: usize,
    /// Chunk positions of those files (counted in `chunks` too, in no other count).
    pub in_place_chunks: u64,
    /// Non-zero positions served by a chunk already read or fetched for another position.
    pub deduplicated_chunks: u64,
    /// Chunks that failed verification once and were fetched again alone (a corrupted
    /// transfer); a second failure fails the pull.
    pub refetched_chunks: u64,
    /// Range requests repeated after an I/O failure mid-transfer (counted in
    /// `range_requests` too).
    pub range_retries: u64,
    /// Cache puts that failed (disk full, ...): the pull goes on, the chunk is not cached.
    pub cache_put_errors: u64,
    pub bytes_written: u64,
    pub seconds: f64,
    pub cache: Option<CacheStats>,
}

/// Where a distinct chunk goes and where it can be fetched from. 80 bytes, one per
/// distinct stored chunk: a hostile image has 4 M of them per index, and most chunks have
/// a single position, so the others live in one shared list ([`Plan::more`]) instead of a
/// vector each (a vector and a hash map entry per chunk would make a pull's plan several
/// times the size of the index).
struct Distinct {
    digest: ChunkDigest,
    len: u32,
    /// One place it is stored (the first position's).
    pack: u32,
    offset: u64,
    stored_len: u32,
    /// Its first (file, chunk) position, which names it in errors, and whose record says
    /// how it is stored (its codec: see [`Ctx::codec`]).
    first: (u32, u64),
    /// Its other positions: `Plan::more[more]`.
    more: std::ops::Range<u32>,
}

// spec/format.md §12 states this size.
const _: () = assert!(std::mem::size_of::<Distinct>() <= 80);

/// The distinct stored chunks of an image, sorted by (digest, length), and where each
/// goes.
struct Plan {
    distinct: Vec<Distinct>,
    /// Positions after each distinct chunk's first, grouped by chunk.
    more: Vec<(u32, u64)>,
}

impl Plan {
    /// Every (file, chunk) position of distinct chunk `i`, the first first.
    fn positions(&self, i: usize) -> impl Iterator<Item = (usize, u64)> + '_ {
        let d = &self.distinct[i];
        std::iter::once(d.first).chain(self.more[d.more.start as usize..d.more.end as usize].iter().copied()).map(|(f, c)| (f as usize, c))
    }

    fn position_count(&self, i: usize) -> u64 {
        1 + self.distinct[i].more.len() as u64
    }

    /// Index range of the distinct chunks with digest `d` (one per length).
    fn with_digest(&self, d: &ChunkDigest) -> std::ops::Range<usize> {
        let start = self.distinct.partition_point(|x| x.digest < *d);
        start..start + self.distinct[start..].iter().take_while(|x| x.digest == *d).count()
    }

    /// Group the stored positions of `image` by (digest, length): a sort of 16-byte
    /// positions rather than a hash map of digests. Positions keep their file order within
    /// a group, so a chunk's first position is where it first occurs.
    fn of(image: &Image, skip: &[bool]) -> Result<Plan, UnpackError> {
        // The format's limits keep positions far below 2^32 (64 links of 4 Mi records).
        let too_many = |n: usize| {
            UnpackError::Format(imgfmt::FormatError::TooLarge { what: "files or chunk positions of one image", got: n as u64, limit: u32::MAX as u64 })
        };
        let mut stored: Vec<(u32, u64)> = Vec::new();
        for (fi, f) in image.files.iter().enumerate().filter(|(fi, _)| !skip[*fi]) {
            let fi = u32::try_from(fi).map_err(|_| too_many(fi))?;
            stored.extend(f.chunks.iter().enumerate().filter(|(_, c)| !matches!(c.at, StoredAt::Zero)).map(|(ci, _)| (fi, ci as u64)));
        }
        let chunk = |&(fi, ci): &(u32, u64)| &image.files[fi as usize].chunks[ci as usize];
        stored.sort_unstable_by(|a, b| (chunk(a).digest, chunk(a).len, a).cmp(&(chunk(b).digest, chunk(b).len, b)));
        let same = |a: &(u32, u64), b: &(u32, u64)| chunk(a).digest == chunk(b).digest && chunk(a).len == chunk(b).len;
        let groups = stored.chunk_by(|a, b| same(a, b)).count();
        let mut plan = Plan { distinct: Vec::with_capacity(groups), more: Vec::with_capacity(stored.len() - groups) };
        for g in stored.chunk_by(|a, b| same(a, b)) {
            let c = chunk(&g[0]);
            let StoredAt::Pack { pack, offset, stored_len, .. } = c.at else { unreachable!("only stored positions were collected") };
            let start = u32::try_from(plan.more.len()).map_err(|_| too_many(plan.more.len()))?;
            plan.more.extend_from_slice(&g[1..]);
            let end = u32::try_from(plan.more.len()).map_err(|_| too_many(plan.more.len()))?;
            plan.distinct.push(Distinct { digest: c.digest, len: c.len, pack, offset, stored_len, first: g[0], more: start..end });
        }
        Ok(plan)
    }
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
    let algo = image.config().hash;
    let shift = image.chunk_shift();
    let mut report = PullReport {
        manifest: image.manifest_digest.to_string(),
        files: image.files.len(),
        logical_bytes: image.files.iter().map(|f| f.size).sum(),
        ..Default::default()
    };

    let (mut dirs, in_place) = check_destination(image, dest, opts)?;
    // Plan: distinct non-zero digests and their positions; zero records checked.
    let in_place_bytes = count_positions(image, &in_place, &mut report)?;
    let plan = Plan::of(image, &in_place)?;
    report.deduplicated_chunks = plan.more.len() as u64;
    let distinct = &plan.distinct;
    if let Some(p) = progress {
        p(in_place_bytes);
    }
    let (mut outs, adopted) = create_temp_files(image, &mut dirs, &in_place)?;

    let write_locks: Vec<Mutex<()>> = outs.iter().map(|_| Mutex::new(())).collect();
    let c = Counters::default();
    // Distinct chunks that reached the destination from the source or a resumed file
    // (not from the cache): the ones the cache gets references to.
    let landed: Vec<AtomicBool> = distinct.iter().map(|_| AtomicBool::new(false)).collect();
    let copies = cache.is_some() && opts.cache_copies;
    let ctx =
        Ctx { src, image, cache, to_cache: None, distinct, plan: &plan, outs: &outs, write_locks: &write_locks, shift, algo, progress, c: &c, landed: &landed };
    let resolved = if adopted.iter().any(|&a| a) { ctx.resume(&adopted, opts.jobs.max(1))? } else { vec![false; distinct.len()] };
    let WorkList { work, cached, landing } = work_list(cache, algo, distinct, &resolved, opts);
    let refs = if cache.is_some() && !copies { RefTargets::of(image, distinct, &landing, &outs, shift) } else { RefTargets::none(image) };
    let Fetched { result, ranges_in_flight, rtt_ms, prepared } = fetch(ctx, cache, &work, opts, copies, &refs);
    (report.ranges_in_flight, report.rtt_ms) = (ranges_in_flight, rtt_ms);
    if let (Some(cache), true) = (cache, copies) {
        // The writers' passes may have overlapped; one more check, with nothing in flight,
        // leaves the cache within its limit and the report's size exact if it was over.
        if cache.maintain(false).is_err() {
            c.put_errors.fetch_add(1, Ordering::Relaxed);
        }
    }
    if let Err(e) = result {
        if !matches!(e, UnpackError::Verify(_)) {
            // The network or the disk failed, not the data: keep the temp files (hidden
            // names, never the final ones) so that running the pull again resumes from
            // them, as after a kill. Nothing unverified is in them.
            for out in outs.iter_mut() {
                let _ = out.guard.0.take();
            }
        }
        // Otherwise the guards remove every temp file: nothing appears under a final name.
        return Err(e);
    }

    rename_into_place(image, &mut outs, opts.overwrite)?;
    if let (Some(cache), false) = (cache, copies) {
        // Only now that the files are durable under their final names may the cache point
        // into them: the prepared references become visible, for every chunk that landed.
        let landed_digest = |d: &ChunkDigest| {
            let r = plan.with_digest(d);
            !r.is_empty() && r.into_iter().all(|i| landed[i].load(Ordering::Relaxed))
        };
        let late = late_refs(&cached, distinct, &landed, shift, image.files.len());
        commit_refs(cache, algo, prepared, landed_digest, &late, &refs.final_paths, &c);
    }
    c.report_into(&mut report);
    report.cache = cache.map(|c| c.stats());
    report.seconds = t0.elapsed().as_secs_f64();
    Ok(report)
}

/// Destination first, so that a pull that cannot finish fails before anything is
/// fetched: every name is resolved beneath `dest` without following a symlink (a planted
/// one is refused, never written through). A file already under its final name is kept
/// only if it holds exactly the image's content (a pull killed between its renames left
/// it; its bytes are checked whoever did); anything else there fails the pull, unless
/// --overwrite. Returns the directories and which files are in place.
fn check_destination<'a>(image: &Image, dest: &'a Path, opts: &PullOptions) -> Result<(DestDirs<'a>, Vec<bool>), UnpackError> {
    let mut dirs = DestDirs::create(dest)?;
    let mut in_place = vec![false; image.files.len()];
    for (fi, f) in image.files.iter().enumerate() {
        let Some((dir, base)) = dirs.dir_of(&f.name, false)? else { continue };
        let path = dir.display_path(&base);
        if dir.entry(&base).map_err(|source| UnpackError::Io { path, source })?.is_none() {
            continue;
        }
        in_place[fi] = holds_in_place(image, fi, &dir, &base, opts.jobs.max(1))?;
        if !in_place[fi] && !opts.overwrite {
            return Err(UnpackError::Exists(dest.join(&f.name)));
        }
    }
    Ok((dirs, in_place))
}

/// Count every chunk position into `report` (total, zero, in place) and check every zero
/// record, which no fetch will: returns the bytes of data chunks that need no fetch (in
/// files already in place), for the progress count. The count never includes zero
/// chunks: a progress total is the image's data ([`data_bytes`]), not its holes.
fn count_positions(image: &Image, in_place: &[bool], report: &mut PullReport) -> Result<u64, UnpackError> {
    let mut in_place_bytes = 0u64;
    for (fi, f) in image.files.iter().enumerate() {
        for (ci, c) in f.chunks.iter().enumerate() {
            report.chunks += 1;
            if let StoredAt::Zero = c.at {
                verify::check_zero_record(image, fi, ci as u64)?;
            }
            if in_place[fi] {
                report.in_place_chunks += 1;
                if !matches!(c.at, StoredAt::Zero) {
                    in_place_bytes += c.len as u64;
                }
                continue;
            }
            if let StoredAt::Zero = c.at {
                report.zero_chunks += 1;
            }
        }
        if in_place[fi] {
            report.in_place_files += 1;
        }
    }
    Ok(in_place_bytes)
}

/// The bytes of `image`'s files that are data, not zero chunks: what a pull's progress
/// counts to (each data chunk is fetched, or found in the cache or in place).
pub fn data_bytes(image: &Image) -> u64 {
    image.files.iter().flat_map(|f| &f.chunks).filter(|c| !matches!(c.at, StoredAt::Zero)).map(|c| c.len as u64).sum()
}

/// Every file's temp file, all of them before anything is fetched (a directory that
/// cannot be made fails the pull first), each of the final size with holes for zero
/// chunks. Returns them and which were taken over from a killed pull.
fn create_temp_files(image: &Image, dirs: &mut DestDirs, in_place: &[bool]) -> Result<(Vec<Out>, Vec<bool>), UnpackError> {
    let mut outs: Vec<Out> = Vec::with_capacity(image.files.len());
    let mut adopted = vec![false; image.files.len()];
    for (fi, f) in image.files.iter().enumerate() {
        let (dir, base) = dirs.dir_of(&f.name, true)?.expect("created");
        let (prefix, tmp) = partial_name(&dir, &base);
        let tmp_path = dir.display_path(&tmp);
        if in_place[fi] {
            // Nothing to write: no temp file, no rename.
            outs.push(Out { file: None, dir, tmp, base, path: tmp_path, guard: TempGuard(None) });
            continue;
        }
        // The temp file of a pull here that was killed holds what it got: take it over
        // (rename is atomic, so two pulls never both get it), then check what was taken:
        // only a regular file with one link, of our own user, is kept (a symlink or a hard
        // link planted under such a name is dropped, its target untouched). Its bytes are
        // checked chunk by chunk (`Ctx::resume`).
        let mut file = None;
        for p in dead_partials(&dir, &prefix) {
            if file.is_none() && dir.rename(&p, &tmp, false).is_ok() {
                match dir.open_own_file(&tmp, true) {
                    Ok(f) => {
                        file = Some(f);
                        continue;
                    }
                    Err(e) => tracing::warn!("not taking over {}: {e}", dir.display_path(&p).display()),
                }
                let _ = dir.remove_file(&tmp);
                continue;
            }
            let _ = dir.remove_file(&p);
        }
        adopted[fi] = file.is_some();
        let guard = TempGuard(Some((dir.clone(), tmp.clone())));
        let io = |source| UnpackError::Io { path: tmp_path.clone(), source };
        let file = match file {
            Some(f) => f,
            // Created, never opened through whatever is under the name; 0600 until done.
            None => dir.create_new(&tmp, 0o600).map_err(io)?,
        };
        // A sparse file of the final size: zero chunks are never written.
        file.set_len(f.size).map_err(io)?;
        outs.push(Out { file: Some(file), dir, tmp, base, path: tmp_path, guard });
    }
    Ok((outs, adopted))
}

/// What the fetch pool works through, and what the cache phases need to know of it.
struct WorkList {
    /// Ranges first (they wait on the network), then cache reads.
    work: Vec<Work>,
    /// Distinct chunks planned from the cache, in file order.
    cached: Vec<usize>,
    /// Distinct chunks that will land from the source or a resumed file (for the cache's
    /// references).
    landing: Vec<usize>,
}

/// Split the distinct chunks not `resolved` by a resumed file into cache reads and
/// misses, and coalesce the misses into range requests.
fn work_list(cache: Option<&ChunkCache>, algo: imgfmt::HashAlgo, distinct: &[Distinct], resolved: &[bool], opts: &PullOptions) -> WorkList {
    let mut cached: Vec<usize> = Vec::new();
    let mut misses: Vec<usize> = Vec::new();
    for (i, d) in distinct.iter().enumerate() {
        if resolved[i] {
            continue;
        }
        match cache {
            Some(c) if c.contains_unverified(algo, &d.digest) => cached.push(i),
            _ => misses.push(i),
        }
    }
    // The plan is in digest order: read cached chunks in file order, for the disk.
    cached.sort_unstable_by_key(|&i| distinct[i].first);
    let landing: Vec<usize> = misses.iter().copied().chain((0..distinct.len()).filter(|&i| resolved[i])).collect();
    // Bounded whatever the caller asks: each request in flight holds its range in memory.
    let mut work = coalesce(distinct, misses, opts.max_range.min(MAX_RANGE_LIMIT));
    work.extend(cached.iter().map(|&i| Work::Cached(i)));
    WorkList { work, cached, landing }
}

/// References (the default cache mode): every chunk this pull lands from the source or a
/// resumed file gets one, naming the file's final path and the chunk's first position.
/// They are written under hidden names while the fetch runs and made visible only once
/// the files are durable under those names.
struct RefTargets {
    /// Per file: (digest, length, offset) of each chunk landing there.
    items: Vec<Vec<(ChunkDigest, u32, u64)>>,
    /// Per file: its final path, absolute (`None`: none could be made; it gets no
    /// references).
    final_paths: Vec<Option<PathBuf>>,
}

impl RefTargets {
    /// No references (no cache, or a cache of copies).
    fn none(image: &Image) -> Self {
        RefTargets { items: vec![Vec::new(); image.files.len()], final_paths: vec![None; image.files.len()] }
    }

    fn of(image: &Image, distinct: &[Distinct], landing: &[usize], outs: &[Out], shift: u8) -> Self {
        let mut refs = Self::none(image);
        for &i in landing {
            let d = &distinct[i];
            let (fi, ci) = d.first;
            refs.items[fi as usize].push((d.digest, d.len, ci << shift));
        }
        for (fi, out) in outs.iter().enumerate() {
            // The directory exists (created above, no symlink beneath `dest`); the file
            // is not there yet.
            refs.final_paths[fi] = fs::canonicalize(out.dir.path()).ok().map(|d| d.join(&out.base));
        }
        refs
    }
}

/// What the fetch phase gave.
struct Fetched<'a> {
    /// The first error of the fetch pool.
    result: Result<(), UnpackError>,
    ranges_in_flight: usize,
    rtt_ms: Option<f64>,
    /// (how many references, what preparing them gave), per part.
    prepared: Vec<(usize, Result<PreparedRefs<'a>, CacheError>)>,
}

/// Run the fetch pool over `work`, and beside it the threads that fill the cache: with
/// `copies`, writers putting each fetched chunk in the cache; without, threads preparing
/// the references of `refs` (made visible after the renames) in `cache`. Every queued
/// copy is put before this returns.
fn fetch<'c>(base: Ctx<'_>, cache: Option<&'c ChunkCache>, work: &[Work], opts: &PullOptions, copies: bool, refs: &'c RefTargets) -> Fetched<'c> {
    // The cache queue: fetch workers hand verified chunks over and go on writing the
    // destination; the writers make them durable in the cache behind them.
    let per_chunk = 1u64 << base.shift;
    let queue_len = (CACHE_QUEUE_BYTES / per_chunk).clamp(2, CACHE_BATCH_MAX as u64) as usize;
    let (to_cache, from_fetch) = std::sync::mpsc::sync_channel::<(ChunkDigest, VerifiedChunk)>(queue_len);
    let from_fetch = Mutex::new(from_fetch);
    let (algo, c) = (base.algo, base.c);
    // Not `imgfmt::work`: the cache writers drain a channel and the preparers each have
    // one part, all beside the fetch pool, which runs in this scope.
    std::thread::scope(|outer| {
        if let (Some(cache), true) = (cache, copies) {
            for _ in 0..CACHE_WRITERS {
                outer.spawn(|| cache_writer(cache, algo, &from_fetch, queue_len, c));
            }
        }
        let mut preparing = Vec::new();
        if let (Some(cache), false) = (cache, copies) {
            let threads = opts.jobs.clamp(1, REF_WRITERS);
            for (fi, items) in refs.items.iter().enumerate() {
                if items.is_empty() {
                    continue;
                }
                let Some(path) = &refs.final_paths[fi] else {
                    // No absolute name for the destination: the pull goes on, uncached.
                    c.put_errors.fetch_add(items.len() as u64, Ordering::Relaxed);
                    continue;
                };
                for part in items.chunks(items.len().div_ceil(threads)) {
                    preparing.push((part.len(), outer.spawn(move || cache.prepare_refs(algo, path, part))));
                }
            }
        }
        let ctx = Ctx { to_cache: copies.then_some(to_cache), ..base };
        let (result, (ranges_in_flight, rtt_ms)) = run_workers(&ctx, work, opts);
        // Dropping the last sender ends the writers once the queue is drained; the outer
        // scope waits for them, so every queued chunk is put before pull returns.
        drop(ctx);
        let prepared = preparing.into_iter().map(|(n, h)| (n, h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))).collect();
        Fetched { result, ranges_in_flight, rtt_ms, prepared }
    })
}

/// Every file is complete: sync and rename each, then sync its directory.
fn rename_into_place(image: &Image, outs: &mut [Out], overwrite: bool) -> Result<(), UnpackError> {
    for (f, out) in image.files.iter().zip(outs.iter_mut()) {
        let Some(file) = out.file.take() else { continue };
        let final_path = out.dir.display_path(&out.base);
        let io = |source| UnpackError::Io { path: out.path.clone(), source };
        file.set_permissions(fs::Permissions::from_mode(imgfmt::config::applied_mode(f.mode))).map_err(io)?;
        file.sync_all().map_err(io)?;
        drop(file);
        // Without --overwrite, a name that appeared since the check is not replaced (the
        // verified temp file stays, for a rerun to take over).
        if let Err(e) = out.dir.rename(&out.tmp, &out.base, overwrite) {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                let _ = out.guard.0.take();
                return Err(UnpackError::Exists(final_path));
            }
            return Err(UnpackError::Io { path: final_path, source: e });
        }
        // Renamed: nothing left for the guard to remove.
        let _ = out.guard.0.take();
        out.dir.sync().map_err(|source| UnpackError::Io { path: out.dir.path().to_path_buf(), source })?;
    }
    Ok(())
}

/// Chunks planned from the cache whose entry had gone meanwhile were fetched: they had no
/// prepared reference. Per file: (digest, length, offset) of each.
fn late_refs(cached: &[usize], distinct: &[Distinct], landed: &[AtomicBool], shift: u8, files: usize) -> Vec<Vec<(ChunkDigest, u32, u64)>> {
    let mut late = vec![Vec::new(); files];
    for &i in cached.iter().filter(|&&i| landed[i].load(Ordering::Relaxed)) {
        let d = &distinct[i];
        late[d.first.0 as usize].push((d.digest, d.len, d.first.1 << shift));
    }
    late
}

/// Make the references prepared during the fetch visible (those of chunks that landed)
/// and write the `late` ones, once the files are durable under their final names. A
/// reference that cannot be written is counted, never an error: the pull is complete,
/// only the cache missed out.
fn commit_refs(
    cache: &ChunkCache,
    algo: imgfmt::HashAlgo,
    prepared: Vec<(usize, Result<PreparedRefs<'_>, CacheError>)>,
    landed_digest: impl Fn(&ChunkDigest) -> bool,
    late: &[Vec<(ChunkDigest, u32, u64)>],
    final_paths: &[Option<PathBuf>],
    c: &Counters,
) {
    for (n, p) in prepared {
        match p {
            Err(_) => c.put_errors.fetch_add(n as u64, Ordering::Relaxed),
            Ok(p) => match p.commit(&landed_digest) {
                Ok(_) => 0,
                Err(_) => c.put_errors.fetch_add(1, Ordering::Relaxed),
            },
        };
    }
    for (late, path) in late.iter().zip(final_paths) {
        if late.is_empty() {
            continue;
        }
        match path {
            Some(path) if cache.put_refs(algo, path, late).is_ok() => {}
            _ => {
                c.put_errors.fetch_add(late.len() as u64, Ordering::Relaxed);
            }
        }
    }
}

/// Put chunks from the queue in the cache until every sender is gone: block for one,
/// then take whatever else is already waiting (up to `batch_max`) into the same batch, so
/// batches grow only when the disk is the bottleneck and a slow trickle is put promptly.
fn cache_writer(cache: &ChunkCache, algo: imgfmt::HashAlgo, rx: &Mutex<Receiver<(ChunkDigest, VerifiedChunk)>>, batch_max: usize, c: &Counters) {
    loop {
        let batch: Vec<(ChunkDigest, VerifiedChunk)> = {
            let rx = rx.lock().expect("poisoned");
            let Ok(first) = rx.recv() else { return };
            imgfmt::work::batch_after(first, &rx, batch_max)
        };
        let items: Vec<(ChunkDigest, &VerifiedChunk)> = batch.iter().map(|(d, ch)| (*d, ch)).collect();
        let failed = cache.put_batch(algo, &items).iter().filter(|r| r.is_err()).count();
        c.put_errors.fetch_add(failed as u64, Ordering::Relaxed);
    }
}

/// The fetch pool: `jobs` threads taking work items in order until done or one fails,
/// then, once a round trip to the source has been timed, as many more as
/// [`in_flight_depth`] says the link needs. Returns the first error, and (the depth, the
/// RTT timed).
fn run_workers(ctx: &Ctx<'_>, work: &[Work], opts: &PullOptions) -> (Result<(), UnpackError>, (usize, Option<f64>)) {
    let jobs = opts.jobs.max(1);
    // Ranges come first in the work list.
    let ranges: Vec<(u32, u64)> = work
        .iter()
        .map_while(|w| match w {
            Work::Range { pack, start, end, .. } => Some((*pack, end - start)),
            Work::Cached(_) => None,
        })
        .collect();
    let item = |_: &mut (), i: usize| match &work[i] {
        Work::Cached(i) => ctx.read_cached(*i),
        Work::Range { pack, start, end, members } => {
            if !opts.request_delay.is_zero() {
                std::thread::sleep(opts.request_delay);
            }
            ctx.fetch_range(*pack, *start, *end, members)
        }
    };
    imgfmt::work::try_for_each_index_growing(
        work.len(),
        jobs,
        || (),
        item,
        |pool| {
            // The first `jobs` ranges are on their way; time round trips beside them (a
            // HEAD of the first pack). With no more ranges than that, there is nothing to size.
            if opts.max_jobs <= jobs || ranges.len() <= jobs {
                return (jobs, None);
            }
            let Some(rtt) = imgfmt::source::round_trip(ctx.src, &ctx.image.packs[ranges[0].0 as usize].digest) else { return (jobs, None) };
            let mean = ranges.iter().map(|r| r.1).sum::<u64>() / ranges.len() as u64;
            let largest = ranges.iter().map(|r| r.1).max().unwrap_or(0);
            let depth = in_flight_depth(rtt, mean, largest, jobs, opts.max_jobs);
            tracing::debug!(rtt_ms = rtt.as_secs_f64() * 1e3, mean_range = mean, depth, "range requests in flight");
            for _ in jobs..depth {
                // No more threads than ranges still to start; out of threads, the ones
                // running finish the work.
                if pool.taken() >= ranges.len() || pool.stopped() || !pool.add_thread() {
                    break;
                }
            }
            (depth, Some(rtt.as_secs_f64() * 1e3))
        },
    )
}

/// Range requests to keep in flight so that a [`LINK_BYTES_PER_SEC`] link stays busy at
/// round-trip time `rtt`, with ranges of `mean` stored bytes on average and `largest` at
/// most: every request waits one RTT before its first byte, so the others must hold a
/// bandwidth-delay product of bytes between them, plus the one transferring. Bounded by
/// [`IN_FLIGHT_BYTES`] of ranges and by `max_jobs`, and never below `jobs`.
///
/// At 50 ms: 8 MiB ranges need 9, 1 MiB ranges (misses scattered between cached chunks)
/// 61; at loopback's 0.1 ms, 1 MiB ranges need 2, so `jobs` (8) stays.
fn in_flight_depth(rtt: Duration, mean: u64, largest: u64, jobs: usize, max_jobs: usize) -> usize {
    let bdp = LINK_BYTES_PER_SEC * rtt.as_secs_f64();
    let want = (bdp / mean.max(1) as f64).ceil().min(u32::MAX as f64) as usize + 1;
    let by_memory = (IN_FLIGHT_BYTES / largest.max(1)).max(1) as usize;
    want.min(by_memory).min(max_jobs).max(jobs)
}

/// The names of `<prefix>-<pid>-...` temp files in `dir` of pulls (or unpacks) that were
/// killed: their pid no longer runs. A live writer's temp file (another pull into the
/// same directory) is left alone. Names only: what is under them is checked when taken.
fn dead_partials(dir: &Dir, prefix: &str) -> Vec<OsString> {
    let Ok(names) = dir.names() else { return Vec::new() };
    let mut out = Vec::new();
    for name in names {
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(prefix)).and_then(|r| r.strip_prefix('-')) else { continue };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else { continue };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            out.push(name);
        }
    }
    out.sort();
    out
}

/// Whether the existing `base` in `dir` is a regular file of ours, with one link, holding
/// exactly file `fi` of the image (size, every chunk checked). Anything else (a symlink,
/// a hard link, another user's file, other bytes) is not: `false`, never an error, so
/// the caller's rule for an existing name applies. Its mode is set to the image's.
fn holds_in_place(image: &Image, fi: usize, dir: &Dir, base: &OsString, jobs: usize) -> Result<bool, UnpackError> {
    let path = dir.display_path(base);
    let file = match dir.open_own_file(base, false) {
        Ok(f) => f,
        Err(e) if imgfmt::file::refusal(&e).is_some() => return Ok(false),
        Err(source) => return Err(UnpackError::Io { path, source }),
    };
    if !verify::file_holds(image, fi, &file, jobs).map_err(|source| UnpackError::Io { path: path.clone(), source })? {
        return Ok(false);
    }
    // Ours (checked above), so its mode is ours to set: what a completed pull gives it
    // (the killed pull set it before renaming, but it may have been changed since).
    let mode = imgfmt::config::applied_mode(image.files[fi].mode);
    file.set_permissions(fs::Permissions::from_mode(mode)).map_err(|source| UnpackError::Io { path, source })?;
    Ok(true)
}

/// One file of a pull: its temp file being written (`None` once renamed, or for a file
/// already in place), the directory holding it and its names there.
struct Out {
    file: Option<File>,
    dir: Arc<Dir>,
    /// The temp name in `dir`.
    tmp: OsString,
    /// The final name in `dir`.
    base: OsString,
    /// `dir/tmp`, for messages.
    path: PathBuf,
    guard: TempGuard,
}

impl Out {
    fn file(&self) -> &File {
        self.file.as_ref().expect("a file being written")
    }
}

/// In a taken-over temp file, make every zero chunk of `f` a hole again where the earlier
/// pull (perhaps of another image) left data: those bytes must read as zeros.
fn punch_zero_runs(file: &File, f: &imgfmt::image::ResolvedFile, shift: u8) -> std::io::Result<()> {
    let mut run: Option<(u64, u64)> = None;
    let mut runs = Vec::new();
    for (ci, c) in f.chunks.iter().enumerate() {
        let (s, e) = ((ci as u64) << shift, ((ci as u64) << shift) + c.len as u64);
        if matches!(c.at, StoredAt::Zero) {
            run = Some(match run {
                Some((rs, re)) if re == s => (rs, e),
                Some(r) => {
                    runs.push(r);
                    (s, e)
                }
                None => (s, e),
            });
        }
    }
    runs.extend(run);
    for (s, e) in runs {
        if has_data(file, s, e)? {
            nix::fcntl::fallocate(
                file,
                nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
                s as libc::off_t,
                (e - s) as libc::off_t,
            )
            .map_err(std::io::Error::from)?;
        }
    }
    Ok(())
}

/// Whether any byte of `[start, end)` of `file` is data rather than a hole.
fn has_data(file: &File, start: u64, end: u64) -> std::io::Result<bool> {
    match nix::unistd::lseek(file, start as libc::off_t, nix::unistd::Whence::SeekData) {
        Ok(at) => Ok((at as u64) < end),
        // ENXIO: no data at or after `start`.
        Err(nix::errno::Errno::ENXIO) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Group distinct chunks to fetch by pack, in offset order, into ranges of at most
/// `max_range` stored bytes, joining neighbours separated by at most [`MAX_GAP`].
fn coalesce(distinct: &[Distinct], mut misses: Vec<usize>, max_range: u64) -> Vec<Work> {
    misses.sort_by_key(|&i| (distinct[i].pack, distinct[i].offset));
    let span = |&i: &usize| (distinct[i].pack, distinct[i].offset, distinct[i].offset + distinct[i].stored_len as u64);
    imgfmt::source::coalesce_ranges(&misses, span, MAX_GAP, max_range)
        .into_iter()
        .map(|r| {
            let members = misses[r].to_vec();
            let (pack, start, _) = span(&members[0]);
            let end = members.iter().map(|i| span(i).2).max().expect("a run has members");
            Work::Range { pack, start, end, members }
        })
        .collect()
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
    resumed: AtomicU64,
}

impl Counters {
    /// The counts of a finished pull, into its report.
    fn report_into(self, report: &mut PullReport) {
        report.bytes_fetched = self.bytes_fetched.into_inner();
        report.range_requests = self.range_requests.into_inner();
        report.cached_chunks = self.from_cache.into_inner();
        report.fetched_chunks = self.fetched.into_inner();
        report.resumed_chunks = self.resumed.into_inner();
        report.refetched_chunks = self.refetched.into_inner();
        report.range_retries = self.range_retries.into_inner();
        report.cache_put_errors = self.put_errors.into_inner();
        report.bytes_written = self.written.into_inner();
    }
}

struct Ctx<'a> {
    src: &'a dyn BlobSource,
    image: &'a Image,
    cache: Option<&'a ChunkCache>,
    /// The cache queue (with a cache only).
    to_cache: Option<SyncSender<(ChunkDigest, VerifiedChunk)>>,
    distinct: &'a [Distinct],
    plan: &'a Plan,
    outs: &'a [Out],
    /// One per file, held while writing to it (see `write_at`).
    write_locks: &'a [Mutex<()>],
    shift: u8,
    algo: imgfmt::HashAlgo,
    progress: Option<&'a (dyn Fn(u64) + Sync)>,
    c: &'a Counters,
    landed: &'a [AtomicBool],
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
        let buf = self.read_range(pack_digest, start, (end - start) as usize).map_err(|source| {
            let d = &self.distinct[members[0]];
            let (file, chunk) = d.first;
            VerifyError::Read { file: self.image.files[file as usize].name.clone(), chunk, offset: chunk << self.shift, source }
        })?;
        self.c.bytes_fetched.fetch_add(buf.len() as u64, Ordering::Relaxed);
        for &i in members {
            let d = &self.distinct[i];
            let s = (d.offset - start) as usize;
            // A slice of the range's buffer, not a copy: the chunk keeps it alive.
            let stored = buf.slice(s..s + d.stored_len as usize);
            let chunk = match self
                .reference(i, &stored)
                .and_then(|r| verify::verify_stored_ref(self.algo, self.codec(d), stored, d.len, &d.digest, r.as_ref()).map_err(|_| ()))
            {
                Ok(c) => c,
                // Bytes damaged in transit look the same as bytes damaged at rest; one
                // fetch of the chunk alone tells them apart.
                Err(_) => self.refetch(i)?,
            };
            self.c.fetched.fetch_add(1, Ordering::Relaxed);
            self.place(i, &chunk)?;
            self.landed[i].store(true, Ordering::Relaxed);
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

    /// One range request, tried again under [`range_retry`] while the source says its
    /// failure is transient (the registry still failing once its client's own retries are
    /// spent). Other errors (a missing blob, a refused login, a range past the end) are
    /// answers and are not retried.
    fn read_range(&self, pack: &imgfmt::OciDigest, offset: u64, len: usize) -> Result<bytes::Bytes, imgfmt::FormatError> {
        imgfmt::source::read_range_retrying(self.src, pack, offset, len, range_retry(), |again| {
            self.c.range_requests.fetch_add(1, Ordering::Relaxed);
            if again {
                self.c.range_retries.fetch_add(1, Ordering::Relaxed);
            }
        })
    }

    /// How distinct chunk `d` is stored: the codec of its first position's record.
    fn codec(&self, d: &Distinct) -> Codec {
        match self.image.files[d.first.0 as usize].chunks[d.first.1 as usize].at {
            StoredAt::Pack { codec, .. } => codec,
            StoredAt::Zero => Codec::Raw,
        }
    }

    /// The reference of distinct chunk `i` when it is a `zstd-ref` chunk (`Ok(None)`
    /// otherwise); `Err` when it could not be had, which the caller treats as bytes that
    /// failed verification (one fetch of the chunk alone, [`Ctx::refetch`], then names why).
    fn reference(&self, i: usize, stored: &[u8]) -> Result<Option<VerifiedChunk>, ()> {
        match self.codec(&self.distinct[i]).ref_pack() {
            Some(rp) => self.fetch_reference(rp, stored).map(Some).map_err(|_| ()),
            None => Ok(None),
        }
    }

    /// A `zstd-ref` chunk's reference, from the cache when it holds that chunk (a clone's
    /// base was usually pulled first), else read from pack `rp`; checked either way.
    fn fetch_reference(&self, rp: u32, stored: &[u8]) -> Result<VerifiedChunk, verify::RefError> {
        let h = verify::ref_header(stored).map_err(|e| verify::RefError::Corrupt(e.to_string()))?;
        if let Some(cache) = self.cache {
            if let Ok(Some(c)) = cache.get(self.algo, &h.digest, h.len) {
                return Ok(c);
            }
        }
        let pack = &self.image.packs.get(rp as usize).ok_or_else(|| verify::RefError::Corrupt("its reference pack is not one the image lists".into()))?.digest;
        let bytes = self.read_range(pack, h.offset, h.stored_len as usize).map_err(verify::RefError::Read)?;
        self.c.bytes_fetched.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        verify::reference_of(self.algo, &h, bytes)
    }

    /// Fetch one chunk alone after its bytes failed verification; a second failure is the
    /// answer (exit 1 in the CLI), naming the chunk's first file and position.
    fn refetch(&self, i: usize) -> Result<VerifiedChunk, UnpackError> {
        self.c.refetched.fetch_add(1, Ordering::Relaxed);
        let d = &self.distinct[i];
        let (file, chunk) = d.first;
        let name = &self.image.files[file as usize].name;
        let offset = chunk << self.shift;
        let buf = self.read_range(&self.image.packs[d.pack as usize].digest, d.offset, d.stored_len as usize).map_err(|source| VerifyError::Read {
            file: name.clone(),
            chunk,
            offset,
            source,
        })?;
        self.c.bytes_fetched.fetch_add(buf.len() as u64, Ordering::Relaxed);
        let reference = match self.codec(d).ref_pack() {
            Some(rp) => Some(self.fetch_reference(rp, &buf).map_err(|e| UnpackError::Verify(e.for_chunk(name, chunk, offset)))?),
            None => None,
        };
        verify::verify_stored_ref(self.algo, self.codec(d), buf, d.len, &d.digest, reference.as_ref()).map_err(|(detail, actual)| {
            UnpackError::Verify(match actual {
                Some(actual) => VerifyError::DigestMismatch { file: name.clone(), chunk, offset, expected: d.digest, actual },
                None => VerifyError::Corrupt { file: name.clone(), chunk, offset, detail },
            })
        })
    }

    /// Check the taken-over temp files (`adopted[file]`) chunk by chunk, on `jobs`
    /// threads: a distinct chunk found whole and verified at one of its positions is
    /// written to its other positions and needs no fetch. Returns which are resolved.
    fn resume(&self, adopted: &[bool], jobs: usize) -> Result<Vec<bool>, UnpackError> {
        for (fi, f) in self.image.files.iter().enumerate() {
            if adopted[fi] {
                punch_zero_runs(self.outs[fi].file(), f, self.shift).map_err(|source| UnpackError::Io { path: self.outs[fi].path.clone(), source })?;
            }
        }
        let mut todo: Vec<usize> = (0..self.distinct.len()).filter(|&i| self.plan.positions(i).any(|(fi, _)| adopted[fi])).collect();
        // In file order, for the disk (the plan is in digest order).
        todo.sort_unstable_by_key(|&i| self.distinct[i].first);
        let resolved: Vec<AtomicBool> = self.distinct.iter().map(|_| AtomicBool::new(false)).collect();
        imgfmt::work::try_for_each_index::<_, UnpackError>(
            todo.len(),
            jobs,
            || (),
            |_, k| {
                let i = todo[k];
                resolved[i].store(self.resume_one(i, adopted)?, Ordering::Relaxed);
                Ok(())
            },
        )?;
        Ok(resolved.into_iter().map(AtomicBool::into_inner).collect())
    }

    fn resume_one(&self, i: usize, adopted: &[bool]) -> Result<bool, UnpackError> {
        let d = &self.distinct[i];
        let mut good: Option<VerifiedChunk> = None;
        let mut need: Vec<(usize, u64)> = Vec::new();
        for (fi, ci) in self.plan.positions(i) {
            let (file, tmp) = (self.outs[fi].file(), &self.outs[fi].path);
            let at = ci << self.shift;
            let here = if adopted[fi] && has_data(file, at, at + d.len as u64).map_err(|source| UnpackError::Io { path: tmp.clone(), source })? {
                let mut buf = vec![0u8; d.len as usize];
                file.read_exact_at(&mut buf, at).map_err(|source| UnpackError::Io { path: tmp.clone(), source })?;
                match &good {
                    Some(g) => g.as_bytes() == &buf[..],
                    None => match verify::verify_stored(self.algo, Codec::Raw, buf, d.len, &d.digest) {
                        Ok(ch) => {
                            good = Some(ch);
                            true
                        }
                        Err(_) => false,
                    },
                }
            } else {
                false
            };
            if !here {
                need.push((fi, ci));
            }
        }
        let Some(chunk) = good else { return Ok(false) };
        for (fi, ci) in need {
            self.write_at(fi, ci, &chunk)?;
        }
        self.c.resumed.fetch_add(1, Ordering::Relaxed);
        self.landed[i].store(true, Ordering::Relaxed);
        if let Some(p) = self.progress {
            p(d.len as u64 * self.plan.position_count(i));
        }
        Ok(true)
    }

    /// Write a verified chunk at every position that holds it.
    fn place(&self, i: usize, chunk: &VerifiedChunk) -> Result<(), UnpackError> {
        for (fi, ci) in self.plan.positions(i) {
            self.write_at(fi, ci, chunk)?;
            if let Some(p) = self.progress {
                p(chunk.len() as u64);
            }
        }
        Ok(())
    }

    fn write_at(&self, fi: usize, ci: u64, chunk: &VerifiedChunk) -> Result<(), UnpackError> {
        let (file, tmp) = (self.outs[fi].file(), &self.outs[fi].path);
        let at = ci << self.shift;
        // Buffered writes to one file take its inode lock in the kernel, one at a time
        // anyway; with 8 threads writing, the waiters spun on it (`rwsem_spin_on_owner`:
        // 15% of a pull's CPU in `perf`, and some pulls of 2 GiB took 4 s with 5 s of
        // system time instead of 1.6 s). Taking turns here, waiters sleep instead.
        let _turn = self.write_locks[fi].lock().unwrap_or_else(|p| p.into_inner());
        // Pieces of at most 256 KiB (see unpack: large page-cache copies were slower).
        for (k, piece) in chunk.as_bytes().chunks(WRITE_PIECE).enumerate() {
            file.write_all_at(piece, at + (k * WRITE_PIECE) as u64).map_err(|source| UnpackError::Io { path: tmp.clone(), source })?;
        }
        // The disk works while the network does; the final fsync finds little left.
        imgfmt::file::start_writeback(file, at, chunk.len() as u64);
        self.c.written.fetch_add(chunk.len() as u64, Ordering::Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(pack: u32, offset: u64, stored_len: u32) -> Distinct {
        Distinct { digest: ChunkDigest::default(), len: stored_len, pack, offset, stored_len, first: (0, 0), more: 0..0 }
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
    fn ranges_in_flight_cover_the_bandwidth_delay_product_within_bounds() {
        let mb = 1u64 << 20;
        let ms = Duration::from_millis;
        // 10 Gbit/s x 50 ms = 62.5 MB: 60 ranges of 1 MiB hold it, plus the one arriving.
        assert_eq!(in_flight_depth(ms(50), mb, mb, 8, 64), 61);
        // 8 MiB ranges: 8 hold it.
        assert_eq!(in_flight_depth(ms(50), 8 * mb, 8 * mb, 8, 64), 9);
        // Longer round trips ask for more, up to max_jobs...
        assert_eq!(in_flight_depth(ms(200), mb, mb, 8, 64), 64);
        // ... and 256 MiB of ranges.
        assert_eq!(in_flight_depth(ms(500), 64 * mb, 64 * mb, 1, 64), 4);
        // Loopback needs no more than `jobs`, and `jobs` is kept whatever memory says.
        assert_eq!(in_flight_depth(Duration::from_micros(100), mb, mb, 8, 64), 8);
        assert_eq!(in_flight_depth(ms(50), 256 * mb, 256 * mb, 8, 64), 8);
        // max_jobs at or under jobs: exactly jobs.
        assert_eq!(in_flight_depth(ms(50), mb, mb, 8, 8), 8);
        // Degenerate sizes do not divide by zero or overflow.
        assert_eq!(in_flight_depth(ms(50), 0, 0, 1, 64), 64);
        assert_eq!(in_flight_depth(Duration::from_secs(60), 1, 1, 1, usize::MAX), (256 << 20) as usize);
    }

    #[test]
    fn dead_partials_are_found_live_ones_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let dead = dir.path().join(".vm.mem.snapctl-partial-4000000-0-1");
        let live = dir.path().join(format!(".vm.mem.snapctl-partial-{}-0-1", std::process::id()));
        let other = dir.path().join(".vm.state.snapctl-partial-4000000-0-1");
        let keep = dir.path().join("vm.mem");
        for p in [&dead, &live, &other, &keep] {
            fs::write(p, b"x").unwrap();
        }
        let d = Dir::open(dir.path()).unwrap();
        assert_eq!(dead_partials(&d, ".vm.mem.snapctl-partial"), vec![dead.file_name().unwrap().to_os_string()]);
    }

    #[test]
    fn coalescing_joins_neighbours_within_bounds() {
        let mb = 1u64 << 20;
        let ds = vec![
            d(0, 0, mb as u32),
            d(0, mb, mb as u32),
            d(1, 0, 1000),
            d(0, 3 * mb, mb as u32),   // a 1 MiB gap: too far to read through
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
