//! Verified chunks for the fault path: recent memory -> chunk cache -> source, with
//! single-flight (any number of faults, connections and the prefetcher asking for one
//! chunk cause one fetch), retries inside a time budget, and a second fetch on a digest
//! mismatch.
//!
//! Nothing here hands out bytes that did not match their digest: the source's bytes go
//! through `verify::read_chunk`, the cache re-checks on every read.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use imgfmt::{BlobSource, HashAlgo, Image, StoredAt};
use verify::{VerifiedChunk, VerifiedSlice, VerifyError};

/// Where verified chunks are kept between restores (the per-host `puller::ChunkCache`,
/// below; tests use a map). Errors are the store's to log: a store that cannot
/// answer is a miss, since the source still has the chunk.
pub trait ChunkStore: Send + Sync {
    /// The chunk if present and still matching its digest.
    fn get(&self, algo: HashAlgo, digest: &imgfmt::ChunkDigest, len: u32) -> Option<VerifiedChunk>;
    fn put(&self, algo: HashAlgo, digest: &imgfmt::ChunkDigest, chunk: &VerifiedChunk);
    /// Several chunks at once (what the background writer has queued): a store that can
    /// pay its durability cost once per batch (the chunk cache's `put_batch`) should.
    fn put_many(&self, algo: HashAlgo, items: &[(imgfmt::ChunkDigest, &VerifiedChunk)]) {
        for (d, c) in items {
            self.put(algo, d, c);
        }
    }
    /// Whether the store holds `digest` (not verified: a hint; a read re-checks). The fill
    /// ([`crate::fill`]) skips what it holds.
    fn contains(&self, algo: HashAlgo, digest: &imgfmt::ChunkDigest) -> bool;
    /// Keep `chunks` in the store for as long as the returned guard lives: a running
    /// restore's image, kept out of every eviction (`None`: the store keeps nothing so).
    fn pin(&self, _label: &str, _chunks: &[(HashAlgo, imgfmt::ChunkDigest)]) -> Option<Box<dyn std::any::Any + Send + Sync>> {
        None
    }
    /// Bytes the store may still take of pinned chunks, measured now (`None`: no bound).
    fn pinned_room(&self) -> Option<u64> {
        None
    }
}

/// The per-host chunk cache is the daemon's store. A cache that cannot be read or written
/// is logged and treated as a miss: the source still has every chunk.
impl ChunkStore for puller::ChunkCache {
    fn get(&self, algo: HashAlgo, digest: &imgfmt::ChunkDigest, len: u32) -> Option<VerifiedChunk> {
        puller::ChunkCache::get(self, algo, digest, len).unwrap_or_else(|e| {
            tracing::warn!("chunk cache: {e}; fetching from the source");
            None
        })
    }
    fn put(&self, algo: HashAlgo, digest: &imgfmt::ChunkDigest, chunk: &VerifiedChunk) {
        if let Err(e) = puller::ChunkCache::put(self, algo, digest, chunk) {
            tracing::warn!("chunk not cached: {e}");
        }
    }
    fn put_many(&self, algo: HashAlgo, items: &[(imgfmt::ChunkDigest, &VerifiedChunk)]) {
        for e in self.put_batch(algo, items).into_iter().filter_map(Result::err) {
            tracing::warn!("chunk not cached: {e}");
        }
    }
    fn contains(&self, algo: HashAlgo, digest: &imgfmt::ChunkDigest) -> bool {
        self.contains_unverified(algo, digest)
    }
    fn pin(&self, label: &str, chunks: &[(HashAlgo, imgfmt::ChunkDigest)]) -> Option<Box<dyn std::any::Any + Send + Sync>> {
        match puller::ChunkCache::pin(self, label, chunks) {
            Ok(p) => Some(Box::new(p)),
            Err(e) => {
                tracing::warn!("the image's chunks are not pinned in the cache (an eviction may delete them): {e}");
                None
            }
        }
    }
    fn pinned_room(&self) -> Option<u64> {
        self.measure_pins();
        Some(puller::ChunkCache::pinned_room(self))
    }
}

/// Where a chunk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// Recent memory, the chunk cache, or a fetch another caller was already making.
    Cache,
    /// This call fetched it from the source.
    Fetched,
}

/// Why no verified bytes could be had for a chunk.
#[derive(Debug, Clone, thiserror::Error, displaydoc::Display)]
pub enum FetchFailure {
    /// chunk {chunk}: failed verification twice: {detail}
    Integrity { chunk: u64, detail: String },
    /// chunk {chunk}: source still failing after {retries} retries over {seconds:.0}s: {detail}
    Exhausted { chunk: u64, retries: u64, seconds: f64, detail: String },
    /// chunk {chunk}: {detail} (not retried: waiting does not change this answer)
    Source { chunk: u64, detail: String },
    /// chunk {chunk}: no verified bytes within the retry budget of {seconds:.0}s (the source is too slow)
    TimedOut { chunk: u64, seconds: f64 },
}

impl FetchFailure {
    /// The same failure, said of chunk `chunk` (a range over several chunks failed).
    pub fn for_chunk(&self, chunk: u64) -> FetchFailure {
        let mut f = self.clone();
        match &mut f {
            FetchFailure::Integrity { chunk: c, .. }
            | FetchFailure::Exhausted { chunk: c, .. }
            | FetchFailure::Source { chunk: c, .. }
            | FetchFailure::TimedOut { chunk: c, .. } => *c = chunk,
        }
        f
    }
}

/// Side effects of one `get` the caller accounts for (only the caller that did the work
/// reports them, so a shared fetch is counted once).
#[derive(Debug, Clone, Copy, Default)]
pub struct Work {
    pub bytes_fetched: u64,
    /// The part of `bytes_fetched` that slice fetches moved.
    pub slice_bytes: u64,
    pub retries: u64,
    pub verify_failures: u64,
}

type Outcome = Result<Arc<VerifiedChunk>, FetchFailure>;

struct Flight {
    done: Mutex<Option<Outcome>>,
    cv: Condvar,
}

/// Recently used chunks in memory, first in first out, bounded in bytes: concurrent
/// restores and the fault after the prefetcher's install find them without a disk read.
struct Recent {
    map: HashMap<u64, Arc<VerifiedChunk>>,
    order: VecDeque<u64>,
    bytes: u64,
    limit: u64,
}

impl Recent {
    fn insert(&mut self, chunk: u64, c: Arc<VerifiedChunk>) {
        if self.limit == 0 || self.map.contains_key(&chunk) {
            return;
        }
        self.bytes += c.len() as u64;
        self.map.insert(chunk, c);
        self.order.push_back(chunk);
        while self.bytes > self.limit {
            let Some(old) = self.order.pop_front() else { break };
            if let Some(c) = self.map.remove(&old) {
                self.bytes -= c.len() as u64;
            }
        }
    }
}

/// Least memory kept for recent chunks.
pub const MIN_RECENT: u64 = 16 << 20;

/// Retry policy for transient source failures: the daemon's default stalls a fault for up
/// to 120 s (`snapctl lazy --retry-budget`) before poisoning it.
pub use imgfmt::RetryPolicy;

/// The lazy server's default policy: stall, never fail, for 120 s.
pub const DEFAULT_RETRY: RetryPolicy = RetryPolicy::stall(Duration::from_secs(120));

/// Chunks waiting to be put in the store, at most: a slow disk then costs cache entries
/// (the chunk is fetched again by a later restore), never fault latency.
const PUT_QUEUE: usize = 64;

type PutItem = (HashAlgo, imgfmt::ChunkDigest, Arc<VerifiedChunk>);
/// Queued chunks written to the store in one batch, at most.
const PUT_BATCH: usize = 32;
/// Chunks a fault fetched while the queue was full, kept (shared, not copied) for the
/// writer to put once the queue has drained, at most: past this they are skipped. Without
/// it a stream over a link faster than the disk kept the queue full, and the faults'
/// chunks (60-130 MB of a 1 GiB image, uncapped at 20-50 ms) were fetched again by the next
/// restore. Up to 256 MiB of 1 MiB chunks held beyond `--memory` while the disk catches up.
const PUT_OVERFLOW: usize = 256;
/// How long the writer waits on an empty queue before it looks at the overflow.
const OVERFLOW_LOOK: Duration = Duration::from_millis(20);

/// Chunks of one file of one image.
pub struct Fetcher {
    pub image: Arc<Image>,
    pub file: usize,
    src: Arc<dyn BlobSource>,
    /// Where the background class (the stream, the working-set replay) reads, when it has
    /// a client of its own (see [`Fetcher::set_background_source`]); `src` otherwise.
    background: std::sync::OnceLock<Arc<dyn BlobSource>>,
    store: Option<Arc<dyn ChunkStore>>,
    /// Fetched chunks on their way into `store`, put by a background thread: a put is
    /// durable (fdatasync) and must not sit between a fault and its install.
    puts: Option<std::sync::mpsc::SyncSender<PutItem>>,
    /// Faults' chunks that found `puts` full (see [`PUT_OVERFLOW`]).
    overflow: Arc<Mutex<VecDeque<PutItem>>>,
    putter: Option<std::thread::JoinHandle<()>>,
    policy: RetryPolicy,
    inflight: Mutex<HashMap<u64, Arc<Flight>>>,
    recent: Mutex<Recent>,
}

impl Drop for Fetcher {
    /// Let the queued puts finish: a daemon that exits (`--once`) keeps what it fetched.
    fn drop(&mut self) {
        drop(self.puts.take());
        if let Some(h) = self.putter.take() {
            let _ = h.join();
        }
    }
}

impl Fetcher {
    pub fn new(image: Arc<Image>, file: usize, src: Arc<dyn BlobSource>, store: Option<Arc<dyn ChunkStore>>, policy: RetryPolicy, memory_bytes: u64) -> Self {
        let overflow: Arc<Mutex<VecDeque<PutItem>>> = Arc::default();
        let (puts, putter) = match &store {
            Some(st) => {
                let (tx, rx) = std::sync::mpsc::sync_channel::<PutItem>(PUT_QUEUE);
                let st = st.clone();
                let overflow = overflow.clone();
                let h = std::thread::Builder::new()
                    .name("lazy-cache-put".into())
                    .spawn(move || {
                        use std::sync::mpsc::RecvTimeoutError;
                        // Whatever has queued up while the last batch was written goes
                        // down as one batch: on a busy fetch path the disk's flush is then
                        // paid once per batch, not once per chunk. The overflow goes down
                        // when the queue is empty, and before the thread ends.
                        loop {
                            let batch: Vec<PutItem> = match rx.recv_timeout(OVERFLOW_LOOK) {
                                Ok(first) => imgfmt::work::batch_after(first, &rx, PUT_BATCH),
                                Err(e) => {
                                    let mut o = overflow.lock().expect("poisoned");
                                    let n = o.len().min(PUT_BATCH);
                                    let batch: Vec<PutItem> = o.drain(..n).collect();
                                    if batch.is_empty() && e == RecvTimeoutError::Disconnected {
                                        return;
                                    }
                                    batch
                                }
                            };
                            let mut rest = &batch[..];
                            while let Some((algo, _, _)) = rest.first() {
                                let n = rest.iter().take_while(|(a, _, _)| a == algo).count();
                                let items: Vec<_> = rest[..n].iter().map(|(_, d, c)| (*d, c.as_ref())).collect();
                                st.put_many(*algo, &items);
                                rest = &rest[n..];
                            }
                        }
                    })
                    .ok();
                // Without the thread, no puts: the cache is an optimisation.
                (h.is_some().then_some(tx), h)
            }
            None => (None, None),
        };
        Fetcher {
            image,
            file,
            src,
            background: std::sync::OnceLock::new(),
            store,
            puts,
            overflow,
            putter,
            policy,
            inflight: Mutex::new(HashMap::new()),
            // At least 16 MiB: a chunk fetched for a parked fault must still be here when
            // the fault is served.
            recent: Mutex::new(Recent { map: HashMap::new(), order: VecDeque::new(), bytes: 0, limit: memory_bytes.max(MIN_RECENT) }),
        }
    }

    /// Whether chunk `chunk` is all zeros (never fetched: zeros are made locally).
    /// The record's digest is checked against the digest of zeros first, so a lying
    /// index cannot make us install zeros where the snapshot has data.
    pub fn is_zero(&self, chunk: u64) -> Result<bool, FetchFailure> {
        let c = &self.image.files[self.file].chunks[chunk as usize];
        match c.at {
            StoredAt::Zero => {
                verify::check_zero_record(&self.image, self.file, chunk).map(|_| true).map_err(|e| FetchFailure::Integrity { chunk, detail: e.to_string() })
            }
            StoredAt::Pack { .. } => Ok(false),
        }
    }

    /// The chunk cache chunks are kept in between restores, if any.
    pub fn store(&self) -> Option<&Arc<dyn ChunkStore>> {
        self.store.as_ref()
    }

    /// How long a fault may wait for a chunk (`--retry-budget`; `None`: no bound).
    pub fn budget(&self) -> Option<Duration> {
        self.policy.budget
    }

    /// Where the faults' chunks are read from.
    pub fn source(&self) -> Arc<dyn BlobSource> {
        self.src.clone()
    }

    /// Give the background class (the stream's chunks, the working-set blob) a source of
    /// its own: a second client, with its own connections and its own thread reading them,
    /// so a fault's small response is never read behind a stream's megabytes in one event
    /// loop. Once; later calls do nothing.
    pub fn set_background_source(&self, src: Arc<dyn BlobSource>) {
        let _ = self.background.set(src);
    }

    /// Where the background class reads: its own source, or the faults'.
    pub fn background_source(&self) -> Arc<dyn BlobSource> {
        self.background.get().unwrap_or(&self.src).clone()
    }

    /// Bytes a fetch of chunk `chunk` moves from the source (its stored length; 0 for a
    /// zero chunk).
    pub fn wire_bytes(&self, chunk: u64) -> u64 {
        self.image.files[self.file].chunks.get(chunk as usize).map_or(0, |c| c.at.stored_len())
    }

    /// Bytes a fetch of slices `slices` of chunk `chunk` moves (0 where it has no slices).
    pub fn slice_bytes(&self, chunk: u64, slices: Range<u32>) -> u64 {
        match self.image.slice_shape(self.file, chunk) {
            Some(shape) if slices.start < slices.end && slices.end <= shape.slice_count() => {
                shape.slice_range(slices.end - 1).end - shape.slice_range(slices.start).start
            }
            _ => 0,
        }
    }

    /// Whether a chunk is in recent memory (a `get` would not wait).
    pub fn has_recent(&self, chunk: u64) -> bool {
        self.recent.lock().expect("poisoned").map.contains_key(&chunk)
    }

    /// Whether a whole-chunk fetch of `chunk` is under way (by any connection or the
    /// prefetcher): waiting for it beats a slice fetch of its own.
    pub fn in_flight(&self, chunk: u64) -> bool {
        self.inflight.lock().expect("poisoned").contains_key(&chunk)
    }

    /// A timed round trip to the source ([`imgfmt::source::round_trip`] on the pack that
    /// holds `chunk`), or `None` for a zero chunk or a source that does not answer.
    pub fn round_trip(&self, chunk: u64) -> Option<Duration> {
        let StoredAt::Pack { pack, .. } = self.image.files[self.file].chunks.get(chunk as usize)?.at else { return None };
        imgfmt::source::round_trip(self.src.as_ref(), &self.image.packs.get(pack as usize)?.digest)
    }

    /// The verified bytes of a stored chunk. A chunk fetched from the source is queued
    /// for the chunk cache without waiting: a full queue (the disk behind) skips the put,
    /// as a fault must not wait for the disk.
    pub fn get(&self, chunk: u64) -> (Outcome, Origin, Work) {
        self.get_with(chunk, false)
    }

    /// [`get`](Self::get) for the background class (the stream of the rest of the image):
    /// read through the background's source, and a chunk it fetched waits for room in the
    /// cache's queue (after the faults waiting on the same fetch have their bytes), so a
    /// restore that streamed the image leaves all of it in the cache. Skipping those puts
    /// left ~300 MB of a 1 GiB image to fetch again on the next restore from the cache once
    /// the stream ran unbounded (BENCHMARKS.md, "Lazy restore across a network").
    pub fn get_background(&self, chunk: u64) -> (Outcome, Origin, Work) {
        self.get_with(chunk, true)
    }

    fn get_with(&self, chunk: u64, background: bool) -> (Outcome, Origin, Work) {
        if let Some(c) = self.recent.lock().expect("poisoned").map.get(&chunk) {
            return (Ok(c.clone()), Origin::Cache, Work::default());
        }
        let (flight, leader) = {
            let mut m = self.inflight.lock().expect("poisoned");
            match m.get(&chunk) {
                Some(f) => (f.clone(), false),
                None => {
                    // A flight that ended since our look at `recent` put its chunk there
                    // before leaving `inflight`: look again, or we would fetch it twice
                    // (the cache's copy may still be queued: puts are asynchronous).
                    if let Some(c) = self.recent.lock().expect("poisoned").map.get(&chunk) {
                        return (Ok(c.clone()), Origin::Cache, Work::default());
                    }
                    let f = Arc::new(Flight { done: Mutex::new(None), cv: Condvar::new() });
                    m.insert(chunk, f.clone());
                    (f, true)
                }
            }
        };
        if !leader {
            let mut g = flight.done.lock().expect("poisoned");
            while g.is_none() {
                g = flight.cv.wait(g).expect("poisoned");
            }
            return (g.clone().expect("set"), Origin::Cache, Work::default());
        }
        let (outcome, origin, work) = self.load(chunk, background);
        self.land(chunk, &flight, &outcome, origin, background);
        (outcome, origin, work)
    }

    /// The end of a flight this caller led: the chunk into recent memory, its waiters woken,
    /// the flight gone, and a chunk fetched from the source queued for the chunk cache.
    fn land(&self, chunk: u64, flight: &Flight, outcome: &Outcome, origin: Origin, background: bool) {
        if let Ok(c) = outcome {
            self.recent.lock().expect("poisoned").insert(chunk, c.clone());
        }
        *flight.done.lock().expect("poisoned") = Some(outcome.clone());
        flight.cv.notify_all();
        self.inflight.lock().expect("poisoned").remove(&chunk);
        if let (Ok(v), Some(q), Origin::Fetched) = (outcome, &self.puts, origin) {
            let c = self.image.files[self.file].chunks[chunk as usize];
            let item = (self.image.config().hash, c.digest, v.clone());
            if background {
                let _ = q.send(item);
            } else if let Err(std::sync::mpsc::TrySendError::Full(item)) = q.try_send(item) {
                let mut o = self.overflow.lock().expect("poisoned");
                if o.len() < PUT_OVERFLOW {
                    o.push_back(item);
                }
            }
        }
    }

    /// Whether chunks `a` then `b` can be read with one range request: both stored plainly
    /// (no reference to read besides) in the same pack, `b`'s bytes right after `a`'s.
    pub fn adjacent(&self, a: u64, b: u64) -> bool {
        let chunks = &self.image.files[self.file].chunks;
        match (chunks.get(a as usize), chunks.get(b as usize)) {
            (Some(a), Some(b)) => b.at.follows(&a.at),
            _ => false,
        }
    }

    /// For the background class: fetch `run`, chunks each [`adjacent`](Self::adjacent) to
    /// the one before, with one range request per stretch of them that nobody holds or is
    /// fetching, so the stream keeps few requests in flight for its bytes (on a bottleneck
    /// that takes turns between connections, each request in flight is a turn a fault's
    /// response waits for). Every chunk is verified on its own against its record before
    /// it enters recent memory and the chunk cache; one that fails is fetched alone once
    /// more, then refused (the run's read was its first chance, as [`get`](Self::get)
    /// gives a chunk two). A fault on a chunk of the run waits for that chunk's bytes in the
    /// response (each chunk is landed as it arrives), not for the whole run. Chunks already
    /// in memory, in the cache or in flight are left to their holder. Returns the work and
    /// the chunks of the run it refused (or gave up on), which nobody should fetch again
    /// just to install them.
    pub fn get_background_run(&self, run: &[u64]) -> (Work, Vec<u64>) {
        self.background_run(run, None)
    }

    /// For the fill ([`crate::fill`]): fetch `run` as [`get_background_run`](Self::get_background_run)
    /// does (one range request per stretch, single-flight with the faults and the stream,
    /// each chunk verified on its own), but hand the verified chunks to the caller, to be put
    /// in the chunk cache, instead of keeping them in recent memory or queueing them: the
    /// fill must not push the guest's chunks out of memory. A chunk in recent memory is
    /// handed over without a fetch; one the store holds or another caller is fetching is
    /// left alone. Returns the work and the chunks, in run order.
    pub fn fill_run(&self, run: &[u64]) -> (Work, Vec<(u64, Arc<VerifiedChunk>)>) {
        let mut got = Vec::new();
        let (work, _) = self.background_run(run, Some(&mut got));
        (work, got)
    }

    /// [`get_background_run`](Self::get_background_run), or with `fill` the fill's variant
    /// ([`fill_run`](Self::fill_run)): verified chunks go into `fill`.
    fn background_run(&self, run: &[u64], mut fill: Option<&mut Vec<(u64, Arc<VerifiedChunk>)>>) -> (Work, Vec<u64>) {
        let (mut work, mut refused) = (Work::default(), Vec::new());
        let mut i = 0;
        while i < run.len() {
            // The longest stretch from `i` this call can lead.
            let mut led: Vec<(u64, Arc<Flight>)> = Vec::new();
            while let Some(&c) = run.get(i) {
                if led.last().is_some_and(|&(p, _)| !self.adjacent(p, c)) || !self.claim_background(c, &mut led, fill.as_deref_mut()) {
                    break;
                }
                i += 1;
            }
            if led.is_empty() {
                // Held elsewhere: the next stretch starts after it.
                i += 1;
                continue;
            }
            let w = self.fetch_stretch(&led, &mut refused, fill.as_deref_mut());
            work.bytes_fetched += w.bytes_fetched;
            work.retries += w.retries;
            work.verify_failures += w.verify_failures;
        }
        (work, refused)
    }

    /// Lead the fetch of chunk `c` (pushed onto `led`), unless it is in recent memory, the
    /// chunk cache (then it is put in recent memory) or another caller's flight. For the
    /// fill: a chunk in recent memory goes into `fill`, and one the cache holds is skipped
    /// without a read.
    fn claim_background(&self, c: u64, led: &mut Vec<(u64, Arc<Flight>)>, fill: Option<&mut Vec<(u64, Arc<VerifiedChunk>)>>) -> bool {
        if let Some(v) = self.recent.lock().expect("poisoned").map.get(&c) {
            if let Some(f) = fill {
                f.push((c, v.clone()));
            }
            return false;
        }
        let rec = self.image.files[self.file].chunks[c as usize];
        let algo = self.image.config().hash;
        match (&self.store, fill.is_some()) {
            (Some(store), true) if store.contains(algo, &rec.digest) => return false,
            (Some(store), false) => {
                if let Some(v) = store.get(algo, &rec.digest, rec.len) {
                    self.recent.lock().expect("poisoned").insert(c, Arc::new(v));
                    return false;
                }
            }
            _ => {}
        }
        let mut m = self.inflight.lock().expect("poisoned");
        if m.contains_key(&c) || self.recent.lock().expect("poisoned").map.contains_key(&c) {
            return false;
        }
        let f = Arc::new(Flight { done: Mutex::new(None), cv: Condvar::new() });
        m.insert(c, f.clone());
        led.push((c, f));
        true
    }

    /// One range request for the stretch `led` (adjacent chunks whose flights this caller
    /// leads), each chunk verified on its own and its flight landed as soon as the
    /// response has brought it (a fault waiting on a chunk of the run waits for that chunk,
    /// not for the run); the chunks that failed go onto `refused`. A chunk that did not
    /// verify is fetched alone once more (the run's read was its first chance); one the
    /// response did not bring (the source failed part way) is fetched alone with its
    /// retries. With `fill`, the verified chunks go there instead of into recent memory and
    /// the cache's queue.
    fn fetch_stretch(&self, led: &[(u64, Arc<Flight>)], refused: &mut Vec<u64>, mut fill: Option<&mut Vec<(u64, Arc<VerifiedChunk>)>>) -> Work {
        let chunks = &self.image.files[self.file].chunks;
        let StoredAt::Pack { pack, offset: start, .. } = chunks[led[0].0 as usize].at else { unreachable!("a stretch holds stored chunks only") };
        let lens: Vec<usize> = led.iter().map(|&(c, _)| chunks[c as usize].at.stored_len() as usize).collect();
        let src = self.background_source();
        let digest = &self.image.packs[pack as usize].digest;
        let mut work = Work::default();
        // Per chunk of the run: landed, or what its read did not verify with.
        let mut landed = vec![false; led.len()];
        let mut mismatch: Vec<Option<String>> = vec![None; led.len()];
        let read = src.read_pieces_unverified(digest, start, &lens, &mut |i, bytes| {
            let Some((c, flight)) = led.get(i) else { return };
            work.bytes_fetched += lens[i] as u64;
            match verify::check_stored_chunk(src.as_ref(), &self.image, self.file, *c, Vec::from(bytes)) {
                Ok(v) => {
                    self.land_for(*c, flight, &Ok(Arc::new(v)), fill.as_deref_mut());
                    landed[i] = true;
                }
                Err(e) => {
                    tracing::error!("VERIFY FAILURE: {e}; fetching the chunk alone");
                    work.verify_failures += 1;
                    mismatch[i] = Some(e.to_string());
                }
            }
        });
        if let Err(e) = &read {
            tracing::debug!("chunks {}-{}: {e}; fetching the rest one by one", led[0].0, led[led.len() - 1].0);
        }
        // A source that gave up on one chunk (its retries spent) gave up on the run: the
        // rest hear the same, not a retry budget each.
        let mut gave_up: Option<FetchFailure> = None;
        for (i, (c, flight)) in led.iter().enumerate().filter(|&(i, _)| !landed[i]) {
            let len = lens[i] as u64;
            let (res, w) = match &gave_up {
                Some(f) if mismatch[i].is_none() => (Err(Stop::Failed(f.for_chunk(*c))), Work::default()),
                _ => self.retrying_after(mismatch[i].take(), *c, len, || verify::read_chunk(src.as_ref(), &self.image, self.file, *c), |_| false),
            };
            let outcome = match res {
                Ok(v) => Ok(Arc::new(v)),
                Err(Stop::Failed(f)) => {
                    if !matches!(f, FetchFailure::Integrity { .. }) {
                        gave_up.get_or_insert_with(|| f.clone());
                    }
                    Err(f)
                }
                Err(Stop::Declined(e)) => unreachable!("nothing declined: {e}"),
            };
            work.bytes_fetched += w.bytes_fetched;
            work.retries += w.retries;
            work.verify_failures += w.verify_failures;
            if outcome.is_err() {
                refused.push(*c);
            }
            self.land_for(*c, flight, &outcome, fill.as_deref_mut());
        }
        work
    }

    /// Land a background flight: the stream's into recent memory and the cache's queue, the
    /// fill's into `fill` (its waiters woken either way).
    fn land_for(&self, chunk: u64, flight: &Flight, outcome: &Outcome, fill: Option<&mut Vec<(u64, Arc<VerifiedChunk>)>>) {
        let Some(fill) = fill else { return self.land(chunk, flight, outcome, Origin::Fetched, true) };
        if let Ok(v) = outcome {
            fill.push((chunk, v.clone()));
        }
        *flight.done.lock().expect("poisoned") = Some(outcome.clone());
        flight.cv.notify_all();
        self.inflight.lock().expect("poisoned").remove(&chunk);
    }

    fn load(&self, chunk: u64, background: bool) -> (Outcome, Origin, Work) {
        let c = self.image.files[self.file].chunks[chunk as usize];
        let algo = self.image.config().hash;
        if let Some(store) = &self.store {
            if let Some(v) = store.get(algo, &c.digest, c.len) {
                return (Ok(Arc::new(v)), Origin::Cache, Work::default());
            }
        }
        let stored_len = c.at.stored_len();
        let src = if background { self.background.get().unwrap_or(&self.src) } else { &self.src };
        let (res, work) = self.retrying(chunk, stored_len, || verify::read_chunk(src.as_ref(), &self.image, self.file, chunk), |_| false);
        match res {
            // Queued for the cache by `get_with`, once the flight's waiters have it.
            Ok(v) => (Ok(Arc::new(v)), Origin::Fetched, work),
            Err(Stop::Failed(f)) => (Err(f), Origin::Fetched, work),
            Err(Stop::Declined(e)) => unreachable!("nothing declined: {e}"),
        }
    }

    /// Verified slices `slices` of chunk `chunk`, fetched with one range request, or the
    /// whole chunk when recent memory or the chunk cache has it (cheaper than the network).
    /// Slices never enter either: a partial chunk is not a cached chunk.
    pub fn get_slices(&self, chunk: u64, slices: Range<u32>) -> (Result<SliceFetch, FetchFailure>, Work) {
        if self.recent.lock().expect("poisoned").map.contains_key(&chunk) {
            return (Ok(SliceFetch::Whole), Work::default());
        }
        let c = self.image.files[self.file].chunks[chunk as usize];
        if let Some(store) = &self.store {
            if let Some(v) = store.get(self.image.config().hash, &c.digest, c.len) {
                self.recent.lock().expect("poisoned").insert(chunk, Arc::new(v));
                return (Ok(SliceFetch::Whole), Work::default());
            }
        }
        let bytes = self.slice_bytes(chunk, slices.clone());
        // No usable outboard entry (or one that does not merge to the digest: a forged or
        // damaged outboard) is not a failure: the whole chunk, checked against its digest,
        // serves the fault.
        let declined = |e: &VerifyError| matches!(e, VerifyError::NoSlices { .. } | VerifyError::OutboardMismatch { .. } | VerifyError::SliceRange { .. });
        let (res, mut work) = self.retrying(chunk, bytes, || verify::read_slices(self.src.as_ref(), &self.image, self.file, chunk, slices.clone()), declined);
        work.slice_bytes = work.bytes_fetched;
        match res {
            Ok(v) => (Ok(SliceFetch::Slices(v)), work),
            Err(Stop::Failed(f)) => (Err(f), work),
            Err(Stop::Declined(e)) => {
                if matches!(e, VerifyError::OutboardMismatch { .. }) {
                    tracing::error!("VERIFY FAILURE: {e}; fetching the whole chunk instead");
                }
                (Ok(SliceFetch::Declined), work)
            }
        }
    }

    /// Run `attempt` (a verified read of `bytes` bytes of chunk `chunk`) until it answers:
    /// source errors are retried with backoff inside the policy's budget, a verification
    /// failure is fetched once more, then refused; errors `declined` accepts are handed back.
    fn retrying<T>(
        &self,
        chunk: u64,
        bytes: u64,
        attempt: impl FnMut() -> Result<T, VerifyError>,
        declined: impl Fn(&VerifyError) -> bool,
    ) -> (Result<T, Stop>, Work) {
        self.retrying_after(None, chunk, bytes, attempt, declined)
    }

    /// [`retrying`](Self::retrying), where `mismatch` is what an earlier read of the same
    /// bytes failed verification with (then the next failure is the last).
    fn retrying_after<T>(
        &self,
        mut mismatch: Option<String>,
        chunk: u64,
        bytes: u64,
        mut attempt: impl FnMut() -> Result<T, VerifyError>,
        declined: impl Fn(&VerifyError) -> bool,
    ) -> (Result<T, Stop>, Work) {
        let mut work = Work::default();
        let mut retry = self.policy.start();
        loop {
            match attempt() {
                Ok(v) => {
                    work.bytes_fetched += bytes;
                    return (Ok(v), work);
                }
                Err(e) if declined(&e) => return (Err(Stop::Declined(e)), work),
                Err(e @ VerifyError::Read { .. }) if e.kind().is_transient() => {
                    // Stalling is better than failing here: a faulting vCPU that waits
                    // recovers when the registry does; one that gets poison does not.
                    let Some(wait) = retry.failed(None) else {
                        let f = FetchFailure::Exhausted { chunk, retries: work.retries, seconds: retry.elapsed().as_secs_f64(), detail: e.to_string() };
                        return (Err(Stop::Failed(f)), work);
                    };
                    work.retries += 1;
                    if work.retries == 1 || work.retries % 10 == 0 {
                        tracing::warn!("chunk {chunk}: {e}; retrying (attempt {})", work.retries + 1);
                    }
                    std::thread::sleep(wait);
                }
                // Not found, not authorized, a local disk error: no wait changes the answer.
                Err(e @ VerifyError::Read { .. }) if !e.kind().is_integrity() => {
                    return (Err(Stop::Failed(FetchFailure::Source { chunk, detail: e.to_string() })), work);
                }
                Err(e) => {
                    work.bytes_fetched += bytes;
                    work.verify_failures += 1;
                    tracing::error!("VERIFY FAILURE: {e}");
                    if let Some(first) = mismatch {
                        let f = FetchFailure::Integrity { chunk, detail: format!("{first}; then {e}") };
                        return (Err(Stop::Failed(f)), work);
                    }
                    // Fetch once more: a corrupted transfer deserves a second chance, a
                    // corrupted pack does not get a third.
                    mismatch = Some(e.to_string());
                }
            }
        }
    }
}

/// Why [`Fetcher::retrying`] stopped without bytes.
enum Stop {
    Failed(FetchFailure),
    /// An error the caller asked back (it has another way to the bytes).
    Declined(VerifyError),
}

/// What [`Fetcher::get_slices`] found.
#[derive(Debug, Clone)]
pub enum SliceFetch {
    /// The asked slices, each verified against the chunk's checked outboard entry.
    Slices(Vec<VerifiedSlice>),
    /// The whole chunk is in recent memory (it was there, or the chunk cache had it).
    Whole,
    /// No verifiable slices for this chunk: fetch it whole.
    Declined,
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use imgfmt::{FormatError, OciDigest};
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A source that counts reads, can fail the first `fail` of them, and can corrupt bytes.
    pub struct Flaky {
        pub inner: Box<dyn BlobSource>,
        pub reads: AtomicU64,
        /// Bytes of the reads that did not fail.
        pub bytes: AtomicU64,
        pub fail: AtomicU64,
        pub corrupt: std::sync::atomic::AtomicBool,
        pub delay: Duration,
    }
    impl imgfmt::source::Forward for Flaky {
        fn inner(&self) -> &dyn BlobSource {
            self.inner.as_ref()
        }
        fn describe(&self) -> String {
            "flaky".into()
        }
        fn read_at_unverified(&self, d: &OciDigest, o: u64, buf: &mut [u8]) -> Result<(), FormatError> {
            self.reads.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(self.delay);
            if self.fail.load(Ordering::SeqCst) > 0 {
                self.fail.fetch_sub(1, Ordering::SeqCst);
                return Err(FormatError::Transient { what: "injected".into(), source: "connection reset".into() });
            }
            self.bytes.fetch_add(buf.len() as u64, Ordering::SeqCst);
            self.inner.read_at_unverified(d, o, buf)?;
            if self.corrupt.load(Ordering::SeqCst) {
                buf[0] ^= 1;
            }
            Ok(())
        }
    }

    /// A small image in a temporary layout: `mem` of `chunks` 64 KiB chunks, every third
    /// chunk zero.
    pub fn sample_image(chunks: usize) -> (tempfile::TempDir, Vec<u8>, Arc<Image>, imgfmt::OciLayout) {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        std::fs::create_dir_all(&src).unwrap();
        let mut mem = vec![0u8; chunks << 16];
        for (i, c) in mem.chunks_mut(1 << 16).enumerate() {
            if i % 3 != 1 {
                for (j, b) in c.iter_mut().enumerate() {
                    *b = (j as u8).wrapping_mul(7).wrapping_add(i as u8) | 1;
                }
            }
        }
        std::fs::write(src.join("vm.mem"), &mem).unwrap();
        std::fs::write(src.join("vm.state"), b"state").unwrap();
        let layout = imgfmt::OciLayout::open_or_create(dir.path().join("layout")).unwrap();
        let opts = pusher::PackOptions { chunk_shift: 16, kind: Some(imgfmt::Kind::Firecracker), ..Default::default() };
        pusher::pack(&src, &layout, "t", &opts).unwrap();
        let d = layout.resolve_tag("t").unwrap();
        let image = Arc::new(Image::open(&layout, &d).unwrap());
        (dir, mem, image, layout)
    }

    fn fetcher(flaky: Arc<Flaky>, image: Arc<Image>, budget: Duration) -> Fetcher {
        let file = image.file("vm.mem").unwrap().0;
        let policy = RetryPolicy { first_backoff: Duration::from_millis(1), max_backoff: Duration::from_millis(5), ..RetryPolicy::stall(budget) };
        Fetcher::new(image, file, flaky, None, policy, 0)
    }

    fn flaky(layout: imgfmt::OciLayout, delay: Duration) -> Arc<Flaky> {
        Arc::new(Flaky { inner: Box::new(layout), reads: 0.into(), bytes: 0.into(), fail: 0.into(), corrupt: false.into(), delay })
    }

    #[test]
    fn single_flight_across_threads() {
        let (_d, mem, image, layout) = sample_image(6);
        let src = flaky(layout, Duration::from_millis(50));
        let f = Arc::new(fetcher(src.clone(), image, Duration::from_secs(5)));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let f = f.clone();
                std::thread::spawn(move || f.get(2))
            })
            .collect();
        let mut fetched = 0;
        for h in handles {
            let (o, origin, _) = h.join().unwrap();
            assert_eq!(o.unwrap().as_bytes(), &mem[2 << 16..3 << 16]);
            fetched += (origin == Origin::Fetched) as u32;
        }
        assert_eq!(fetched, 1);
        assert_eq!(src.reads.load(Ordering::SeqCst), 1, "four callers, one read");
    }

    #[test]
    fn transient_errors_are_retried_then_give_up() {
        let (_d, mem, image, layout) = sample_image(3);
        let src = flaky(layout, Duration::ZERO);
        src.fail.store(3, Ordering::SeqCst);
        let f = fetcher(src.clone(), image.clone(), Duration::from_secs(5));
        let (o, origin, work) = f.get(0);
        assert_eq!(o.unwrap().as_bytes(), &mem[..1 << 16]);
        assert_eq!((origin, work.retries), (Origin::Fetched, 3));
        src.fail.store(u64::MAX / 2, Ordering::SeqCst);
        let f = fetcher(src, image, Duration::from_millis(100));
        let (o, _, work) = f.get(2);
        assert!(matches!(o, Err(FetchFailure::Exhausted { .. })), "{o:?}");
        assert!(work.retries >= 3);
    }

    /// A source that answers every read with `err`, counting the reads.
    struct Answers {
        inner: imgfmt::OciLayout,
        err: fn() -> FormatError,
        reads: AtomicU64,
    }
    impl imgfmt::source::Forward for Answers {
        fn inner(&self) -> &dyn BlobSource {
            &self.inner
        }
        fn describe(&self) -> String {
            "answers".into()
        }
        fn read_at_unverified(&self, _: &OciDigest, _: u64, _: &mut [u8]) -> Result<(), FormatError> {
            self.reads.fetch_add(1, Ordering::SeqCst);
            Err((self.err)())
        }
    }

    /// Issue 15: every read error was retried for the whole budget (a fault stalled 120 s
    /// on a blob the registry does not have, or a login it refuses). Only a transient one
    /// is; a missing blob or a refused login is the answer at once, and a pack shorter than
    /// the index says is fetched once more like a digest mismatch, then refused.
    #[test]
    fn regression_issue_15_only_transient_read_errors_are_retried() {
        let (d, _mem, image, _) = sample_image(3);
        let layout = || imgfmt::OciLayout::open(d.path().join("layout")).unwrap();
        let file = image.file("vm.mem").unwrap().0;
        let src = Arc::new(Answers { inner: layout(), err: || FormatError::BlobNotFound(OciDigest::of(b"pack")), reads: 0.into() });
        let f = Fetcher::new(image.clone(), file, src.clone(), None, RetryPolicy::stall(Duration::from_secs(5)), 0);
        let (o, _, work) = f.get(0);
        assert!(matches!(o, Err(FetchFailure::Source { .. })), "{o:?}");
        assert_eq!((work.retries, src.reads.load(Ordering::SeqCst)), (0, 1));

        let src = Arc::new(Answers { inner: layout(), err: || FormatError::Unauthorized { registry: "r".into(), source: "HTTP 401".into() }, reads: 0.into() });
        let f = Fetcher::new(image.clone(), file, src.clone(), None, RetryPolicy::stall(Duration::from_secs(5)), 0);
        assert!(matches!(f.get(0).0, Err(FetchFailure::Source { .. })));
        assert_eq!(src.reads.load(Ordering::SeqCst), 1);

        let src = Arc::new(Answers { inner: layout(), err: || FormatError::Truncated { what: "pack", got: 1, expected: 2 }, reads: 0.into() });
        let f = Fetcher::new(image, file, src.clone(), None, RetryPolicy::stall(Duration::from_secs(5)), 0);
        let (o, _, work) = f.get(0);
        assert!(matches!(o, Err(FetchFailure::Integrity { .. })), "{o:?}");
        assert_eq!((work.verify_failures, src.reads.load(Ordering::SeqCst)), (2, 2));
    }

    /// A store whose puts block until released, and which counts them and the batches
    /// they came in.
    struct StuckStore {
        released: Mutex<bool>,
        cv: Condvar,
        puts: AtomicU64,
        batches: Mutex<Vec<usize>>,
    }

    /// More data chunks than the put queue and a batch hold (`PUT_QUEUE + PUT_BATCH + 24`),
    /// a fetcher whose cache is a [`StuckStore`], and the data chunks' numbers.
    fn stuck_fetcher() -> (tempfile::TempDir, Vec<u8>, Arc<StuckStore>, Fetcher, Vec<u64>) {
        let n = PUT_QUEUE + PUT_BATCH + 24;
        // Every third chunk of the sample is zero: make enough data chunks.
        let (d, mem, image, layout) = sample_image(n * 3 / 2 + 3);
        let store = Arc::new(StuckStore { released: Mutex::new(false), cv: Condvar::new(), puts: AtomicU64::new(0), batches: Mutex::new(Vec::new()) });
        let file = image.file("vm.mem").unwrap().0;
        let f = Fetcher::new(image, file, flaky(layout, Duration::ZERO), Some(store.clone()), DEFAULT_RETRY, 0);
        let data: Vec<u64> = (0..(n * 3 / 2 + 3) as u64).filter(|&c| !f.is_zero(c).unwrap()).take(n).collect();
        assert_eq!(data.len(), n);
        (d, mem, store, f, data)
    }
    impl ChunkStore for StuckStore {
        fn get(&self, _: HashAlgo, _: &imgfmt::ChunkDigest, _: u32) -> Option<VerifiedChunk> {
            None
        }
        fn contains(&self, _: HashAlgo, _: &imgfmt::ChunkDigest) -> bool {
            false
        }
        fn put(&self, algo: HashAlgo, d: &imgfmt::ChunkDigest, c: &VerifiedChunk) {
            self.put_many(algo, &[(*d, c)]);
        }
        fn put_many(&self, _: HashAlgo, items: &[(imgfmt::ChunkDigest, &VerifiedChunk)]) {
            let mut r = self.released.lock().unwrap();
            while !*r {
                r = self.cv.wait(r).unwrap();
            }
            self.puts.fetch_add(items.len() as u64, Ordering::SeqCst);
            self.batches.lock().unwrap().push(items.len());
        }
    }

    /// A fault never waits for the chunk cache: with every put stuck (a disk that does not
    /// answer), more chunks than the put queue holds are still served, and the puts that
    /// fit in the queue happen once the store answers (the rest are skipped, not lost
    /// faults). Before, each put (an fdatasync) ran between the fetch and the install.
    /// Issue 16: the stream's fetches wait for room in the cache's queue instead of
    /// skipping the put, so a restore that streamed the image leaves every chunk in the
    /// cache (the same stuck store as above loses all but a queue's worth to `get`).
    #[test]
    fn regression_issue_16_streamed_chunks_all_reach_the_cache() {
        let (_d, _mem, store, f, data) = stuck_fetcher();
        let n = data.len();
        let worker = std::thread::spawn(move || {
            for &c in &data {
                assert!(f.get_background(c).0.is_ok());
            }
            f
        });
        // The disk comes back after a while; the stream waited for it.
        std::thread::sleep(Duration::from_millis(300));
        *store.released.lock().unwrap() = true;
        store.cv.notify_all();
        drop(worker.join().unwrap()); // drains the queue
        assert_eq!(store.puts.load(Ordering::SeqCst), n as u64, "every streamed chunk was put");
    }

    #[test]
    fn regression_issue_5_faults_do_not_wait_for_cache_puts() {
        let (_d, mem, store, f, data) = stuck_fetcher();
        let n = data.len();
        let (tx, rx) = std::sync::mpsc::channel();
        let worker = std::thread::spawn(move || {
            for &c in &data {
                let (o, origin, _) = f.get(c);
                assert_eq!(o.unwrap().as_bytes(), &mem[(c as usize) << 16..((c as usize) + 1) << 16]);
                assert_eq!(origin, Origin::Fetched);
            }
            tx.send(()).unwrap();
            f
        });
        // Generous: this is about blocking forever, not speed.
        let served = rx.recv_timeout(Duration::from_secs(60));
        *store.released.lock().unwrap() = true;
        store.cv.notify_all();
        let f = worker.join().unwrap();
        assert!(served.is_ok(), "faults waited for the stuck cache");
        drop(f); // drains the queue
                 // What the queue holds, the batch the writer had taken when it got stuck, and the
                 // overflow: kept for the writer, never waited for.
        let puts = store.puts.load(Ordering::SeqCst);
        assert_eq!(puts, n as u64, "every chunk put once the disk came back");
        // What queued up behind the stuck put went down in full batches.
        let batches = store.batches.lock().unwrap().clone();
        assert_eq!(batches.iter().sum::<usize>() as u64, puts);
        assert_eq!(batches.iter().max(), Some(&PUT_BATCH), "{batches:?}");
    }

    /// The data chunks of [`sample_image`]`(n)` (every third is zero), in file order.
    fn data_chunks(n: u64) -> Vec<u64> {
        (0..n).filter(|c| c % 3 != 1).collect()
    }

    #[test]
    fn a_background_run_is_one_request_and_each_chunk_is_verified() {
        let (_d, mem, image, layout) = sample_image(9);
        let src = flaky(layout, Duration::ZERO);
        let f = fetcher(src.clone(), image, Duration::from_secs(5));
        let run = data_chunks(9);
        assert!(run.windows(2).all(|w| f.adjacent(w[0], w[1])), "a fresh pack stores the data chunks one after another");
        assert!(!f.adjacent(0, 1) && !f.adjacent(2, 0), "a zero chunk, or a chunk before, is not adjacent");
        let (work, refused) = f.get_background_run(&run);
        assert!(refused.is_empty());
        assert_eq!(src.reads.load(Ordering::SeqCst), 1, "one range request");
        assert_eq!(work.bytes_fetched, run.iter().map(|&c| f.wire_bytes(c)).sum::<u64>());
        for &c in &run {
            let (o, origin, _) = f.get(c);
            assert_eq!(origin, Origin::Cache);
            assert_eq!(o.unwrap().as_bytes(), &mem[(c as usize) << 16..((c as usize) + 1) << 16]);
        }
        assert_eq!(src.reads.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_background_run_leaves_held_chunks_to_their_holder_and_reads_around_them() {
        let (_d, _mem, image, layout) = sample_image(9);
        let src = flaky(layout, Duration::ZERO);
        let f = fetcher(src.clone(), image, Duration::from_secs(5));
        assert!(f.get(3).0.is_ok());
        let _ = f.get_background_run(&data_chunks(9));
        assert_eq!(src.reads.load(Ordering::SeqCst), 3, "chunk 3 alone, then [0, 2] and [5, 6, 8]");
        assert!(data_chunks(9).iter().all(|&c| f.has_recent(c)));
    }

    #[test]
    fn a_fault_on_a_chunk_of_a_background_run_waits_for_the_run() {
        let (_d, mem, image, layout) = sample_image(9);
        let src = flaky(layout, Duration::from_millis(200));
        let f = Arc::new(fetcher(src.clone(), image, Duration::from_secs(5)));
        let g = f.clone();
        let run = std::thread::spawn(move || g.get_background_run(&data_chunks(9)).0);
        while !f.in_flight(6) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let (o, origin, work) = f.get(6);
        assert_eq!((origin, work.bytes_fetched), (Origin::Cache, 0), "joined the run's flight");
        assert_eq!(o.unwrap().as_bytes(), &mem[6 << 16..7 << 16]);
        run.join().unwrap();
        assert_eq!(src.reads.load(Ordering::SeqCst), 1);
    }

    /// A source that reads ranges in pieces as a registry's body brings them: the first
    /// piece at once, the rest once `go` says so.
    struct HeldBack {
        inner: imgfmt::OciLayout,
        go: std::sync::Mutex<std::sync::mpsc::Receiver<()>>,
    }
    impl BlobSource for HeldBack {
        fn describe(&self) -> String {
            "held back".into()
        }
        fn resolve_tag(&self, tag: &str) -> Result<OciDigest, FormatError> {
            self.inner.resolve_tag(tag)
        }
        fn read_blob_unverified(&self, d: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError> {
            self.inner.read_blob_unverified(d, limit)
        }
        fn blob_size(&self, d: &OciDigest) -> Result<u64, FormatError> {
            self.inner.blob_size(d)
        }
        fn read_at_unverified(&self, d: &OciDigest, o: u64, buf: &mut [u8]) -> Result<(), FormatError> {
            self.inner.read_at_unverified(d, o, buf)
        }
        fn read_pieces_unverified(&self, d: &OciDigest, o: u64, lens: &[usize], each: &mut dyn FnMut(usize, bytes::Bytes)) -> Result<(), FormatError> {
            let all = self.inner.read_range_unverified(d, o, lens.iter().sum())?;
            each(0, all.slice(..lens[0]));
            let _ = self.go.lock().unwrap().recv();
            imgfmt::source::split_pieces(all.slice(lens[0]..), &lens[1..], &mut |i, b| each(i + 1, b));
            Ok(())
        }
    }

    #[test]
    fn regression_issue_37_a_fault_on_a_chunk_of_a_background_run_gets_it_when_its_bytes_arrive() {
        let (_d, mem, image, layout) = sample_image(9);
        let (go, wait) = std::sync::mpsc::channel();
        let src = Arc::new(HeldBack { inner: layout, go: std::sync::Mutex::new(wait) });
        let file = image.file("vm.mem").unwrap().0;
        let f = Arc::new(Fetcher::new(image, file, src, None, RetryPolicy::never(), 0));
        let g = f.clone();
        let run = std::thread::spawn(move || g.get_background_run(&data_chunks(9)));
        while !f.in_flight(0) && !f.has_recent(0) {
            std::thread::sleep(Duration::from_millis(1));
        }
        // The run's first chunk has arrived, the rest is held back: a fault on it is served.
        let (o, origin, _) = f.get(0);
        assert_eq!(origin, Origin::Cache, "joined the run's flight");
        assert_eq!(o.unwrap().as_bytes(), &mem[..1 << 16]);
        assert!(!run.is_finished() && f.in_flight(8), "the rest of the run still on its way");
        go.send(()).unwrap();
        let (work, refused) = run.join().unwrap();
        assert!(refused.is_empty());
        assert_eq!(work.bytes_fetched, data_chunks(9).iter().map(|&c| f.wire_bytes(c)).sum::<u64>());
        for c in data_chunks(9) {
            assert_eq!(f.get(c).0.unwrap().as_bytes(), &mem[(c as usize) << 16..((c as usize) + 1) << 16]);
        }
    }

    #[test]
    fn regression_issue_37_a_run_whose_source_gives_up_fails_its_chunks_within_one_budget() {
        let (_d, _mem, image, layout) = sample_image(9);
        let src = flaky(layout, Duration::ZERO);
        src.fail.store(u64::MAX / 2, Ordering::SeqCst);
        let f = fetcher(src.clone(), image, Duration::from_millis(300));
        let t = std::time::Instant::now();
        let (_, refused) = f.get_background_run(&data_chunks(9));
        assert_eq!(refused, data_chunks(9), "every chunk of the run failed");
        // One retry budget for the run, not one per chunk (six would be 1.8 s).
        assert!(t.elapsed() < Duration::from_millis(1200), "took {:?}", t.elapsed());
    }

    #[test]
    fn a_corrupt_chunk_in_a_background_run_is_fetched_alone_then_refused() {
        let (_d, mem, image, layout) = sample_image(9);
        let src = flaky(layout, Duration::ZERO);
        // Every read's first byte is flipped: in the run's one read that is chunk 0's.
        src.corrupt.store(true, Ordering::SeqCst);
        let f = fetcher(src.clone(), image, Duration::from_secs(5));
        let (work, refused) = f.get_background_run(&data_chunks(9));
        assert_eq!(work.verify_failures, 2, "the run's copy, then one of its own");
        assert_eq!(refused, vec![0], "refused: the caller must not fetch it again to install it");
        assert_eq!(src.reads.load(Ordering::SeqCst), 2);
        assert!(!f.has_recent(0), "refused, never handed out");
        for c in [2u64, 3, 5, 6, 8] {
            let (o, _, _) = f.get(c);
            assert_eq!(o.unwrap().as_bytes(), &mem[(c as usize) << 16..((c as usize) + 1) << 16]);
        }
    }

    #[test]
    fn corrupt_bytes_are_fetched_twice_then_refused() {
        let (_d, _mem, image, layout) = sample_image(3);
        let src = flaky(layout, Duration::ZERO);
        src.corrupt.store(true, Ordering::SeqCst);
        let f = fetcher(src.clone(), image, Duration::from_secs(5));
        let (o, _, work) = f.get(0);
        assert!(matches!(o, Err(FetchFailure::Integrity { .. })), "{o:?}");
        assert_eq!((work.verify_failures, src.reads.load(Ordering::SeqCst)), (2, 2));
        assert!(f.is_zero(1).unwrap() && !f.is_zero(0).unwrap());
    }
}
