//! Verified chunks of one image, for reads and the fill: recent memory -> chunk cache ->
//! source, single-flight (any number of readers and the fill asking for one chunk cause
//! one fetch), retried inside a time budget, fetched once more on a digest mismatch and
//! then refused for good.
//!
//! [`ChunkSource`] is the seam: the file system asks it for "the verified bytes of chunk
//! `c` of file `f`" and knows nothing of where they come from. [`Fetcher`] is today's
//! implementation, over the public pieces other crates offer (`verify::read_chunk`, a
//! [`lazy::ChunkStore`]); a fetcher with slices and the page server's pacing can take its
//! place without the file system noticing.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex, Weak};

use imgfmt::{BlobSource, ChunkDigest, Image, RetryPolicy, StoredAt};
use lazy::pacing::{Background, Class, Kind};
use lazy::ChunkStore;
use puller::ChunkCache;
use verify::{VerifiedChunk, VerifyError};

/// Who asks: a reader waits in front; the fill waits for room in the cache's queue (so a
/// filled image is all in the cache), a reader never does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    Read,
    Fill,
}

/// Why there are no verified bytes for a chunk.
#[derive(Debug, Clone, thiserror::Error, displaydoc::Display)]
pub enum ChunkFailure {
    /// {file}: chunk {chunk} at offset {offset}: failed verification twice, never served: {detail}
    Integrity { file: String, chunk: u64, offset: u64, detail: String },
    /// {file}: chunk {chunk} at offset {offset}: {detail}
    Source { file: String, chunk: u64, offset: u64, detail: String },
}

/// What the fetcher did, for the report.
#[derive(Debug, Default)]
pub struct FetchCounters {
    /// Chunks read from the source (each verified).
    pub fetched_chunks: AtomicU64,
    /// Stored bytes those moved.
    pub bytes_fetched: AtomicU64,
    /// Chunks found in recent memory, the chunk cache, or another caller's fetch.
    pub cache_hits: AtomicU64,
    /// Reads of the source whose bytes did not match their digest.
    pub verify_failures: AtomicU64,
    /// Source reads retried.
    pub retries: AtomicU64,
    /// Chunks the background fill asked for that were not local yet.
    pub filled_chunks: AtomicU64,
    /// Reads served from part of a cached chunk, checked slice by slice (the rest unread).
    pub cache_slice_reads: AtomicU64,
    /// Small reads served by fetching only their slices from the source.
    pub fetched_slice_reads: AtomicU64,
}

/// A chunk's verified bytes: a zero chunk (its record checked against the digest of
/// zeros, nothing fetched) or a stored one.
#[derive(Debug, Clone)]
pub enum ChunkBytes {
    Zeros(u32),
    Verified(Arc<VerifiedChunk>),
}

impl ChunkBytes {
    pub fn len(&self) -> usize {
        match self {
            ChunkBytes::Zeros(n) => *n as usize,
            ChunkBytes::Verified(c) => c.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copy bytes `from..from + out.len()` of the chunk into `out`.
    pub fn copy_to(&self, from: usize, out: &mut [u8]) {
        match self {
            ChunkBytes::Zeros(_) => out.fill(0),
            ChunkBytes::Verified(c) => out.copy_from_slice(&c.as_bytes()[from..from + out.len()]),
        }
    }
    /// The chunk's bytes, `None` for zeros.
    pub fn data(&self) -> Option<&[u8]> {
        match self {
            ChunkBytes::Zeros(_) => None,
            ChunkBytes::Verified(c) => Some(c.as_bytes()),
        }
    }
}

/// Verified bytes of chunk `chunk` of file `file` of one image.
pub trait ChunkSource: Send + Sync {
    fn image(&self) -> &Arc<Image>;
    fn chunk(&self, file: usize, chunk: u64, need: Need) -> Result<ChunkBytes, ChunkFailure>;
    /// Bring a stored chunk into the host's chunk cache if it is not there (the fill).
    fn fill(&self, file: usize, chunk: u64) -> Result<(), ChunkFailure> {
        self.chunk(file, chunk, Need::Fill).map(|_| ())
    }
    /// [`fill`](Self::fill), waiting first for room in the source's pacing window when the
    /// chunk must be fetched; nothing once `ended()` says so.
    fn fill_paced(&self, file: usize, chunk: u64, _ended: &dyn Fn() -> bool) -> Result<(), ChunkFailure> {
        self.fill(file, chunk)
    }
    /// The pacer of the source's background requests and the source (for its probes), if
    /// the fill is paced.
    fn pacing(&self) -> Option<(&Arc<Background>, &Arc<dyn BlobSource>)> {
        None
    }
    fn counters(&self) -> &FetchCounters;
    /// Whether every stored chunk of file `file` is in the host's chunk cache (by name:
    /// each is re-hashed when it is read), so the whole file can be read without a fetch.
    fn complete(&self, _file: usize) -> bool {
        false
    }
    /// Wait, a bounded time, until the chunks queued for the host's chunk cache are written
    /// (so that [`complete`](Self::complete) sees what the fill brought).
    fn settle(&self) {}
    /// The fill is through: the link is the readers' alone, and the source may read what
    /// it put off.
    fn fill_done(&self) {}
    /// Verified bytes `within .. within + out.len()` of the chunk, copied into `out`. A
    /// source that can check part of a chunk (against its outboard slices) may read only
    /// that part; by default the whole chunk is read.
    fn read_part(&self, file: usize, chunk: u64, within: usize, out: &mut [u8], need: Need) -> Result<(), ChunkFailure> {
        self.chunk(file, chunk, need)?.copy_to(within, out);
        Ok(())
    }
}

type Outcome = Result<Arc<VerifiedChunk>, ChunkFailure>;

struct Flight {
    done: Mutex<Option<Outcome>>,
    cv: Condvar,
}

/// Recently used chunks by digest, first in first out, bounded in bytes.
struct Recent {
    map: HashMap<ChunkDigest, Arc<VerifiedChunk>>,
    order: VecDeque<ChunkDigest>,
    bytes: u64,
    limit: u64,
}

impl Recent {
    fn insert(&mut self, d: ChunkDigest, c: Arc<VerifiedChunk>) {
        if self.limit == 0 || self.map.contains_key(&d) {
            return;
        }
        self.bytes += c.len() as u64;
        self.map.insert(d, c);
        self.order.push_back(d);
        while self.bytes > self.limit {
            let Some(old) = self.order.pop_front() else { break };
            if let Some(c) = self.map.remove(&old) {
                self.bytes -= c.len() as u64;
            }
        }
    }
}

/// Chunks a fetch put in the queue for the chunk cache's writer thread (all of the image's
/// one hash).
type PutItem = (ChunkDigest, Arc<VerifiedChunk>);
/// Chunks waiting for the cache's writer at most: a read never waits for the disk.
const PUT_QUEUE: usize = 64;
/// How long [`ChunkSource::settle`] waits for the cache's writer at most.
const SETTLE_MAX: std::time::Duration = std::time::Duration::from_secs(60);
/// Chunks queued for the cache's writer and not written yet, by digest (with how many
/// times each is queued), with a wake-up for `settle`. A reader (or the fill, or a stream)
/// finds a chunk here that was fetched and is not on disk yet, instead of fetching it again.
type Pending = Arc<(Mutex<HashMap<ChunkDigest, (Arc<VerifiedChunk>, u32)>>, Condvar)>;
/// Fill requests in flight at most (the pacing window's bound, in chunks).
pub const FILL_JOBS: usize = 8;
/// A reader reading a file in order has a new read-ahead stream started once fewer than
/// this many stored chunks ahead of it are taken on (8 MiB of 1 MiB chunks: a round trip
/// of 64 ms at 1 Gbit/s, so the link does not idle between streams).
const READ_AHEAD: u64 = 8;
/// A file's first read-ahead stream takes on this many stored chunks; each next one twice
/// as many as the one before, up to [`MAX_STRETCH`] (a reader that keeps reading in order
/// has fewer, longer requests, whose bytes come in order).
const FIRST_STRETCH: u64 = 16;
const MAX_STRETCH: u64 = 64;
/// A read this many chunks or fewer before the last one read is taken as a read the
/// kernel sent out of order (its reads run at once), not as a reader going back.
const REORDER: u64 = 2;
/// Read-ahead streams running at once, at most.
const AHEAD_STREAMS: u64 = 4;
/// How often a fill worker waiting for a reader's streams to end looks again.
const STREAM_YIELD_POLL: std::time::Duration = std::time::Duration::from_millis(5);
/// A read of at most this many bytes of a chunk nobody asked for before fetches only its
/// slices from the source (one range request); a later miss in the chunk fetches it whole.
const SOURCE_SLICE_MAX: u64 = 16 << 10;

/// What a file's read-ahead streams took on: every stored chunk before `next`; the next
/// stream takes on `stretch` more.
#[derive(Debug, Clone, Copy)]
struct Ahead {
    next: u64,
    stretch: u64,
}

/// [`ChunkSource`] over an image's source and the host's chunk cache.
pub struct Fetcher {
    image: Arc<Image>,
    src: Arc<dyn BlobSource>,
    store: Option<Arc<ChunkCache>>,
    puts: Mutex<Option<SyncSender<PutItem>>>,
    putter: Mutex<Option<std::thread::JoinHandle<()>>>,
    pending: Pending,
    policy: RetryPolicy,
    inflight: Mutex<HashMap<ChunkDigest, Arc<Flight>>>,
    recent: Mutex<Recent>,
    /// Chunks that failed verification twice: refused without another fetch.
    refused: Mutex<HashSet<ChunkDigest>>,
    /// Chunks a small read fetched slices of: the next miss fetches the whole chunk.
    sliced: Mutex<HashSet<ChunkDigest>>,
    /// The fill's share of the link beside the readers' fetches (spec/lazy.md "Pacing the
    /// background"): readers' fetches count against its window, their slice fetches time
    /// the queueing delay.
    pacer: Arc<Background>,
    /// Per file, the chunk a reader read last: a read of the next one reads ahead.
    last_read: Mutex<HashMap<usize, u64>>,
    /// Per file, what its read-ahead streams took on.
    frontier: Mutex<HashMap<usize, Ahead>>,
    /// Read-ahead streams running.
    streams: AtomicU64,
    /// Read-ahead loads of chunks from the chunk cache running.
    ahead: AtomicU64,
    /// Whether the whole outboards of an image opened with their tables were asked for.
    outboards_asked: std::sync::atomic::AtomicBool,
    me: Weak<Fetcher>,
    counters: FetchCounters,
    /// The image's chunks, pinned in the chunk cache for as long as the image is presented:
    /// the kernel may drop its page cache and read again at any time.
    _pin: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl Drop for Fetcher {
    /// The queued puts go down before the fetcher does: a mount that ends keeps what it fetched.
    fn drop(&mut self) {
        drop(self.puts.lock().map(|mut p| p.take()));
        if let Some(h) = self.putter.lock().ok().and_then(|mut h| h.take()) {
            let _ = h.join();
        }
    }
}

impl Fetcher {
    /// `memory_bytes` of recently used chunks are kept in memory (the page cache keeps
    /// what readers read; this serves the rest of a chunk a read fetched for part of it).
    /// An image opened with its outboards' tables ([`imgfmt::OutboardsAhead::Tables`])
    /// reads a chunk's CVs beside its first slice read; any other has its whole outboards
    /// read on a thread of its own, its reads taking whole chunks until they are in. Either
    /// way nothing of the outboards is read before the image is shown.
    pub fn new(image: Arc<Image>, src: Arc<dyn BlobSource>, store: Option<Arc<ChunkCache>>, policy: RetryPolicy, memory_bytes: u64) -> Arc<Fetcher> {
        let pending = Pending::default();
        let (puts, putter) = match &store {
            Some(st) => {
                let (tx, rx) = sync_channel::<PutItem>(PUT_QUEUE);
                let (st, algo, pending) = (st.clone(), image.config().hash, pending.clone());
                let h = std::thread::Builder::new()
                    .name("mount-cache-put".into())
                    .spawn(move || {
                        while let Ok(first) = rx.recv() {
                            // One put per batch: the disk's latency is paid once for all
                            // of them, not once per chunk.
                            let batch = imgfmt::work::batch_after(first, &rx, 32);
                            let items: Vec<_> = batch.iter().map(|(d, c)| (*d, c.as_ref())).collect();
                            ChunkStore::put_many(st.as_ref(), algo, &items);
                            let (queued, cv) = &*pending;
                            let mut queued = queued.lock().expect("poisoned");
                            for (d, _) in &batch {
                                unqueue(&mut queued, d);
                            }
                            cv.notify_all();
                        }
                    })
                    .ok();
                (h.is_some().then_some(tx), h)
            }
            None => (None, None),
        };
        let _pin = store.as_ref().and_then(|s| {
            let algo = image.config().hash;
            let mut chunks: Vec<_> = image.files.iter().flat_map(|f| &f.chunks).filter(|c| c.at != StoredAt::Zero).map(|c| (algo, c.digest)).collect();
            chunks.sort_unstable_by_key(|(_, d)| *d);
            chunks.dedup();
            ChunkStore::pin(s.as_ref(), &format!("snapctl mount (pid {}) presenting {}", std::process::id(), image.manifest_digest), &chunks)
        });
        if !image.slices_on_demand() {
            let (i, s) = (image.clone(), src.clone());
            if let Err(e) = std::thread::Builder::new().name("mount-outboards".into()).spawn(move || load_outboards(&i, s.as_ref())) {
                tracing::warn!("{}: its outboards are not read ({e}): reads take whole chunks", image.manifest_digest);
            }
        }
        let pacer = Background::new(1 << image.chunk_shift(), FILL_JOBS);
        let fetcher = Arc::new_cyclic(|me| Fetcher {
            image,
            src,
            store,
            puts: Mutex::new(puts),
            putter: Mutex::new(putter),
            pending,
            policy,
            inflight: Mutex::new(HashMap::new()),
            recent: Mutex::new(Recent { map: HashMap::new(), order: VecDeque::new(), bytes: 0, limit: memory_bytes }),
            refused: Mutex::new(HashSet::new()),
            sliced: Mutex::new(HashSet::new()),
            pacer,
            last_read: Mutex::new(HashMap::new()),
            frontier: Mutex::new(HashMap::new()),
            streams: AtomicU64::new(0),
            ahead: AtomicU64::new(0),
            outboards_asked: Default::default(),
            me: me.clone(),
            counters: FetchCounters::default(),
            _pin,
        });
        if fetcher.store.is_some() && fetcher.image.slices_on_demand() {
            // Every chunk cached already: the link is quiet from the start.
            let me = Arc::downgrade(&fetcher);
            let _ = std::thread::Builder::new().name("mount-outboards".into()).spawn(move || {
                let Some(f) = me.upgrade() else { return };
                if (0..f.image.files.len()).all(|file| f.complete(file)) {
                    f.outboards_when_quiet();
                }
            });
        }
        fetcher
    }

    /// Read the whole outboards of an image opened with only their tables, once, on a
    /// thread of their own: a read of part of a cached chunk then reads and checks only its
    /// slices. Asked for once the link is quiet (the fill is through, or every chunk was
    /// cached from the start), so their bytes never sit in front of a reader's.
    fn outboards_when_quiet(&self) {
        if !self.image.slices_on_demand() || self.outboards_asked.swap(true, Relaxed) {
            return;
        }
        let (i, s) = (self.image.clone(), self.src.clone());
        if let Err(e) = std::thread::Builder::new().name("mount-outboards".into()).spawn(move || load_outboards(&i, s.as_ref())) {
            tracing::warn!("{}: its whole outboards are not read ({e}): parts of cached chunks are read whole", self.image.manifest_digest);
        }
    }

    fn failure_at(&self, file: usize, chunk: u64) -> (String, u64) {
        (self.image.files[file].name.clone(), chunk << self.image.chunk_shift())
    }

    /// Lead a flight: the cache, else the source (retried, verified twice at most, once
    /// when `mismatch` says an earlier read of it did not verify). A reader's fetch counts
    /// against the fill's pacing window while it is in flight.
    fn load(&self, file: usize, chunk: u64, need: Need, mismatch: Option<String>) -> (Outcome, bool) {
        let rec = self.image.files[file].chunks[chunk as usize];
        let algo = self.image.config().hash;
        if let Some(v) = self.store.as_ref().and_then(|s| ChunkStore::get(s.as_ref(), algo, &rec.digest, rec.len)) {
            return (Ok(Arc::new(v)), false);
        }
        let (name, offset) = self.failure_at(file, chunk);
        let stored = rec.at.stored_len();
        let _foreground = (need == Need::Read).then(|| self.pacer.foreground(stored));
        let mut retry = self.policy.start();
        let mut mismatch = mismatch;
        loop {
            match verify::read_chunk(self.src.as_ref(), &self.image, file, chunk) {
                Ok(v) => {
                    self.counters.fetched_chunks.fetch_add(1, Relaxed);
                    self.counters.bytes_fetched.fetch_add(stored, Relaxed);
                    return (Ok(Arc::new(v)), true);
                }
                Err(e @ VerifyError::Read { .. }) if e.kind().is_transient() => {
                    let Some(wait) = retry.failed(None) else {
                        let detail = format!("the source still fails after {:.0}s: {e}", retry.elapsed().as_secs_f64());
                        return (Err(ChunkFailure::Source { file: name, chunk, offset, detail }), false);
                    };
                    if retry.failures() == 1 {
                        tracing::warn!("{e}; retrying");
                    }
                    self.counters.retries.fetch_add(1, Relaxed);
                    std::thread::sleep(wait);
                }
                Err(e @ VerifyError::Read { .. }) if !e.kind().is_integrity() => {
                    return (Err(ChunkFailure::Source { file: name, chunk, offset, detail: e.to_string() }), false);
                }
                Err(e) => {
                    self.counters.bytes_fetched.fetch_add(stored, Relaxed);
                    self.counters.verify_failures.fetch_add(1, Relaxed);
                    tracing::error!("VERIFY FAILURE: {e}");
                    if let Some(first) = mismatch {
                        self.refused.lock().expect("poisoned").insert(rec.digest);
                        let detail = format!("{first}; then {e}");
                        return (Err(ChunkFailure::Integrity { file: name, chunk, offset, detail }), false);
                    }
                    // A damaged transfer deserves a second chance; a damaged pack no third.
                    mismatch = Some(e.to_string());
                }
            }
        }
    }

    /// Queue a chunk fetched from the source for the chunk cache.
    fn queue_put(&self, digest: ChunkDigest, c: &Arc<VerifiedChunk>, need: Need) {
        let puts = self.puts.lock().expect("poisoned");
        let Some(q) = puts.as_ref() else { return };
        let item = (digest, c.clone());
        // Counted before it is sent: the writer may be done with it before `send` returns.
        self.pending.0.lock().expect("poisoned").entry(digest).or_insert_with(|| (c.clone(), 0)).1 += 1;
        let sent = match need {
            // The fill's chunks all reach the cache: it is not on a reader's path.
            Need::Fill => {
                let q = q.clone();
                drop(puts);
                q.send(item).is_ok()
            }
            // A reader's chunk is skipped when the disk is behind.
            Need::Read => match q.try_send(item) {
                Ok(()) => true,
                Err(TrySendError::Full(_)) => false,
                Err(TrySendError::Disconnected(_)) => {
                    tracing::debug!("chunk cache writer gone");
                    false
                }
            },
        };
        if !sent {
            unqueue(&mut self.pending.0.lock().expect("poisoned"), &digest);
        }
    }

    /// A chunk fetched and queued for the chunk cache, not written yet.
    fn queued(&self, digest: &ChunkDigest) -> Option<Arc<VerifiedChunk>> {
        self.pending.0.lock().expect("poisoned").get(digest).map(|(c, _)| c.clone())
    }
}

impl ChunkSource for Fetcher {
    fn image(&self) -> &Arc<Image> {
        &self.image
    }

    fn chunk(&self, file: usize, chunk: u64, need: Need) -> Result<ChunkBytes, ChunkFailure> {
        let rec = self.image.files[file].chunks[chunk as usize];
        if need == Need::Read {
            self.read_ahead(file, chunk);
        }
        if rec.at == StoredAt::Zero {
            return verify::check_zero_record(&self.image, file, chunk).map(|()| ChunkBytes::Zeros(rec.len)).map_err(|e| {
                let (file, offset) = self.failure_at(file, chunk);
                ChunkFailure::Integrity { file, chunk, offset, detail: e.to_string() }
            });
        }
        self.stored(file, chunk, need).map(ChunkBytes::Verified)
    }

    /// A chunk the cache holds is left there unread (whoever reads it re-hashes it); one it
    /// lacks is fetched (or waited for) and queued for it, and not kept in recent memory.
    fn fill(&self, file: usize, chunk: u64) -> Result<(), ChunkFailure> {
        self.fill_paced(file, chunk, &|| false)
    }

    fn fill_paced(&self, file: usize, chunk: u64, ended: &dyn Fn() -> bool) -> Result<(), ChunkFailure> {
        let rec = self.image.files[file].chunks[chunk as usize];
        let cached = |s: &Arc<ChunkCache>| s.contains_unverified(self.image.config().hash, &rec.digest);
        if rec.at == StoredAt::Zero || self.store.as_ref().is_none_or(cached) || self.queued(&rec.digest).is_some() {
            return Ok(());
        }
        // A chunk a reader has in recent memory (its put skipped while the disk was behind)
        // goes to the cache from there.
        let recent = self.recent.lock().expect("poisoned").map.get(&rec.digest).cloned();
        if let Some(c) = recent {
            self.queue_put(rec.digest, &c, Need::Fill);
            return Ok(());
        }
        let StoredAt::Pack { stored_len, .. } = rec.at else { return Ok(()) };
        // A reader reading in order is served by its own streams, which bring the file in
        // order at the link's pace: the fill waits for them to end instead of sharing the
        // link with them (on a bottleneck that takes turns between connections, its
        // workers would outnumber the reader's stream).
        while self.streams.load(Relaxed) > 0 {
            if ended() {
                return Ok(());
            }
            std::thread::sleep(STREAM_YIELD_POLL);
        }
        let Some(_permit) = self.pacer.acquire(u64::from(stored_len), Class::Fill, ended) else { return Ok(()) };
        self.counters.filled_chunks.fetch_add(1, Relaxed);
        self.stored(file, chunk, Need::Fill).map(|_| ())
    }

    fn pacing(&self) -> Option<(&Arc<Background>, &Arc<dyn BlobSource>)> {
        Some((&self.pacer, &self.src))
    }

    fn counters(&self) -> &FetchCounters {
        &self.counters
    }

    fn fill_done(&self) {
        self.outboards_when_quiet();
    }

    fn settle(&self) {
        let (n, cv) = &*self.pending;
        let deadline = std::time::Instant::now() + SETTLE_MAX;
        let mut left = n.lock().expect("poisoned");
        while !left.is_empty() {
            let wait = deadline.saturating_duration_since(std::time::Instant::now());
            if wait.is_zero() {
                return;
            }
            left = cv.wait_timeout(left, wait).expect("poisoned").0;
        }
    }

    fn complete(&self, file: usize) -> bool {
        let Some(store) = &self.store else { return false };
        let algo = self.image.config().hash;
        self.image.files[file].chunks.iter().filter(|c| c.at != StoredAt::Zero).all(|c| store.contains_unverified(algo, &c.digest))
    }

    /// A read of part of a stored chunk that is not in recent memory reads only the slices
    /// under it when the chunk has outboard slices: from the chunk cache, else (a small
    /// read, the chunk's first) from the source. Anything else takes the whole chunk.
    fn read_part(&self, file: usize, chunk: u64, within: usize, out: &mut [u8], need: Need) -> Result<(), ChunkFailure> {
        let rec = self.image.files[file].chunks[chunk as usize];
        if need == Need::Read && rec.at != StoredAt::Zero && out.len() < rec.len as usize && self.slices_into(file, chunk, within, out) {
            return Ok(());
        }
        self.chunk(file, chunk, need)?.copy_to(within, out);
        Ok(())
    }
}

/// One queueing of `d` for the chunk cache is over (written, or not sent).
fn unqueue(queued: &mut HashMap<ChunkDigest, (Arc<VerifiedChunk>, u32)>, d: &ChunkDigest) {
    if let Some((_, n)) = queued.get_mut(d) {
        *n -= 1;
        if *n == 0 {
            queued.remove(d);
        }
    }
}

/// Read the image's whole outboards and put them in place: a read of part of a chunk may
/// then read only that part ([`Fetcher::slices_into`]). Without them (none packed, not
/// in yet, or unreadable: logged) reads take whole chunks.
fn load_outboards(image: &Image, src: &dyn BlobSource) {
    match image.read_all_outboards(src) {
        Ok(o) => {
            image.attach_outboards(o);
        }
        Err(e) => tracing::warn!("{}: its outboards could not be read ({e}): reads take whole chunks", image.manifest_digest),
    }
}

impl Fetcher {
    /// A reader reading a file in order (chunk `chunk` follows the one it read last, zero
    /// chunks included; a read of that one again or of one at most [`REORDER`] before it
    /// changes nothing) gets the chunks after it
    /// fetched ahead of it as a reader's fetches (verified, into recent memory and the
    /// cache, counted against the fill's window). Those the source must send come in
    /// streams ([`Fetcher::stream`]): one request per stretch, its chunks landed one by one
    /// as they arrive, so the reader's next chunk is not slowed by the ones after it, and a
    /// reader that stops waits for none of what was fetched beyond it. A new stream starts
    /// once fewer than [`READ_AHEAD`] stored chunks ahead of the reader are taken on; the
    /// first takes on [`FIRST_STRETCH`], each next twice as many up to [`MAX_STRETCH`] and
    /// half of recent memory (where they wait for the reader). A
    /// read out of order ends the file's read-ahead until the reader is in order again.
    /// Chunks in the chunk cache are loaded from there, each on a thread of its own.
    fn read_ahead(&self, file: usize, chunk: u64) {
        {
            let mut last = self.last_read.lock().expect("poisoned");
            match last.get(&file).copied() {
                // The same chunk again, or one the kernel sent behind a later one.
                Some(p) if chunk <= p && p - chunk <= REORDER => return,
                Some(p) if chunk == p + 1 => {
                    last.insert(file, chunk);
                }
                _ => {
                    // A first read, or not in order: what a stream took on is no guide.
                    last.insert(file, chunk);
                    self.frontier.lock().expect("poisoned").remove(&file);
                    return;
                }
            }
        }
        // Chunks fetched ahead wait in recent memory (and the chunk cache's queue) until the
        // reader comes: a stream takes on at most half of recent memory, or, with a chunk
        // cache to find them in, at least FIRST_STRETCH; with neither, nothing.
        let room = (self.recent.lock().expect("poisoned").limit >> self.image.chunk_shift()) / 2;
        let most = MAX_STRETCH.min(if self.store.is_some() { room.max(FIRST_STRETCH) } else { room });
        if most == 0 {
            return;
        }
        let chunks = &self.image.files[file].chunks;
        let stored = |c: &u64| chunks[*c as usize].at != StoredAt::Zero;
        let run: Vec<u64> = {
            let mut frontier = self.frontier.lock().expect("poisoned");
            let mut ahead = frontier.get(&file).copied().filter(|a| a.next > chunk).unwrap_or(Ahead { next: chunk + 1, stretch: FIRST_STRETCH });
            ahead.stretch = ahead.stretch.min(most);
            // Zero chunks cost nothing to read: only stored ones count.
            if (chunk + 1..ahead.next).filter(stored).count() as u64 >= READ_AHEAD {
                return;
            }
            let run: Vec<u64> = (ahead.next..chunks.len() as u64).filter(stored).take(ahead.stretch as usize).collect();
            let Some(&last) = run.last() else { return };
            frontier.insert(file, Ahead { next: last + 1, stretch: (ahead.stretch * 2).min(most) });
            run
        };
        let algo = self.image.config().hash;
        let (cached, fetch): (Vec<u64>, Vec<u64>) = match &self.store {
            Some(st) => run.into_iter().partition(|&c| st.contains_unverified(algo, &chunks[c as usize].digest)),
            None => (Vec::new(), run),
        };
        for c in cached {
            self.load_ahead(file, c);
        }
        if fetch.is_empty() || self.streams.fetch_add(1, Relaxed) >= AHEAD_STREAMS {
            self.streams.fetch_sub(u64::from(!fetch.is_empty()), Relaxed);
            return;
        }
        let me = self.me.clone();
        let spawned = std::thread::Builder::new().name("mount-readahead".into()).spawn(move || {
            if let Some(f) = me.upgrade() {
                f.stream(file, &fetch);
                f.streams.fetch_sub(1, Relaxed);
            }
        });
        if spawned.is_err() {
            self.streams.fetch_sub(1, Relaxed);
        }
    }

    /// Load chunk `c` of file `file` from the chunk cache into recent memory on a thread of
    /// its own (at most [`FIRST_STRETCH`] at once), unless it is there or in flight already.
    fn load_ahead(&self, file: usize, c: u64) {
        let d = self.image.files[file].chunks[c as usize].digest;
        let have = self.recent.lock().expect("poisoned").map.contains_key(&d) || self.inflight.lock().expect("poisoned").contains_key(&d);
        if have || self.ahead.fetch_add(1, Relaxed) >= FIRST_STRETCH {
            self.ahead.fetch_sub(u64::from(!have), Relaxed);
            return;
        }
        let me = self.me.clone();
        let spawned = std::thread::Builder::new().name("mount-readahead".into()).spawn(move || {
            if let Some(f) = me.upgrade() {
                // A failure is the reader's to meet (and log) when it reads the chunk.
                let _ = f.stored(file, c, Need::Read);
                f.ahead.fetch_sub(1, Relaxed);
            }
        });
        if spawned.is_err() {
            self.ahead.fetch_sub(1, Relaxed);
        }
    }

    /// Fetch the chunks of `run` (stored chunks of file `file`, in order) that nobody holds
    /// or is fetching: each stretch of them adjacent in their pack with one request, its
    /// chunks verified and landed one by one as the response brings them (into recent
    /// memory and the cache's queue, like any reader's fetch). A chunk the response did not
    /// bring (the source failed part way, or the bytes did not verify) is fetched on its
    /// own as any reader's miss is, with its retries and second chance.
    fn stream(&self, file: usize, run: &[u64]) {
        let chunks = &self.image.files[file].chunks;
        let mut i = 0;
        while i < run.len() {
            let mut led: Vec<(u64, Arc<Flight>)> = Vec::new();
            while let Some(&c) = run.get(i) {
                if led.last().is_some_and(|&(p, _)| !chunks[c as usize].at.follows(&chunks[p as usize].at)) {
                    break;
                }
                i += 1;
                match self.claim(file, c) {
                    Some(f) => led.push((c, f)),
                    None if led.is_empty() => {}
                    None => break,
                }
            }
            if !led.is_empty() {
                self.fetch_stretch(file, &led);
            }
        }
    }

    /// Lead the flight of chunk `c` of file `file`, unless it is in recent memory, the
    /// chunk cache or its queue (the fill may have brought it since the stream was
    /// planned), refused, or another caller's flight.
    fn claim(&self, file: usize, c: u64) -> Option<Arc<Flight>> {
        let d = self.image.files[file].chunks[c as usize].digest;
        if self.queued(&d).is_some() || self.store.as_ref().is_some_and(|s| s.contains_unverified(self.image.config().hash, &d)) {
            return None;
        }
        let mut m = self.inflight.lock().expect("poisoned");
        if m.contains_key(&d) || self.recent.lock().expect("poisoned").map.contains_key(&d) || self.refused.lock().expect("poisoned").contains(&d) {
            return None;
        }
        let f = Arc::new(Flight { done: Mutex::new(None), cv: Condvar::new() });
        m.insert(d, f.clone());
        Some(f)
    }

    /// One request for the stretch `led` (adjacent stored chunks whose flights this caller
    /// leads), counted against the fill's window while it runs; see [`Fetcher::stream`].
    fn fetch_stretch(&self, file: usize, led: &[(u64, Arc<Flight>)]) {
        let chunks = &self.image.files[file].chunks;
        let lens: Vec<usize> = led.iter().map(|&(c, _)| chunks[c as usize].at.stored_len() as usize).collect();
        let StoredAt::Pack { pack, offset, .. } = chunks[led[0].0 as usize].at else { unreachable!("a stretch holds stored chunks only") };
        let foreground = self.pacer.foreground(lens.iter().sum::<usize>() as u64);
        let mut landed = vec![false; led.len()];
        let digest = &self.image.packs[pack as usize].digest;
        let mut mismatches: HashMap<usize, String> = HashMap::new();
        let read = self.src.read_pieces_unverified(digest, offset, &lens, &mut |i, bytes| {
            let Some(&(c, ref flight)) = led.get(i) else { return };
            self.counters.bytes_fetched.fetch_add(lens[i] as u64, Relaxed);
            match verify::check_stored_chunk(self.src.as_ref(), &self.image, file, c, Vec::from(bytes)) {
                Ok(v) => {
                    self.counters.fetched_chunks.fetch_add(1, Relaxed);
                    // Its waiters have it; the reader reads it from recent memory.
                    let _ = self.land(file, c, flight, Ok(Arc::new(v)), true, Need::Read);
                    landed[i] = true;
                }
                Err(e) => {
                    self.counters.verify_failures.fetch_add(1, Relaxed);
                    tracing::error!("VERIFY FAILURE: {e}");
                    mismatches.insert(i, e.to_string());
                }
            }
        });
        drop(foreground);
        if let Err(e) = read {
            tracing::debug!("{}: reading ahead from chunk {}: {e}; fetching the rest one by one", self.image.files[file].name, led[0].0);
        }
        for (i, &(c, ref flight)) in led.iter().enumerate().filter(|&(i, _)| !landed[i]) {
            // A chunk whose bytes did not verify has had its first chance.
            let (outcome, fetched) = self.load(file, c, Need::Read, mismatches.remove(&i));
            let _ = self.land(file, c, flight, outcome, fetched, Need::Read);
        }
    }

    /// Copy bytes `within ..` of a stored chunk into `out` from its slices, each checked
    /// against the chunk's outboard entry (merged to its digest first): from the chunk
    /// cache (when the entry's CVs are here), else, for a read of at most
    /// [`SOURCE_SLICE_MAX`] in a chunk no read fetched slices of before, with one range
    /// request to the source (the CVs, when only the table is here, read beside it).
    /// `false`: nothing copied (no slices, the chunk in recent memory or refused, a cached
    /// chunk whose CVs are not here, a check or a fetch failed): read the whole chunk, which is
    /// verified and, on a failure, refused as any chunk is.
    fn slices_into(&self, file: usize, chunk: u64, within: usize, out: &mut [u8]) -> bool {
        let rec = self.image.files[file].chunks[chunk as usize];
        // A refused chunk is refused whole, without another read.
        if self.recent.lock().expect("poisoned").map.contains_key(&rec.digest) || self.refused.lock().expect("poisoned").contains(&rec.digest) {
            return false;
        }
        let Some(shape) = self.image.slice_shape(file, chunk) else { return false };
        let shift = shape.slice_size().trailing_zeros();
        let (first, last) = ((within >> shift) as u32, ((within + out.len() - 1) >> shift) as u32);
        let range = shape.slice_range(first).start..shape.slice_range(last).end;
        let algo = self.image.config().hash;
        let check = |bytes: Vec<u8>| -> Result<Vec<verify::VerifiedSlice>, VerifyError> {
            let bytes = bytes::Bytes::from(bytes);
            (first..=last)
                .map(|i| {
                    let r = shape.slice_range(i);
                    verify::check_slice(&self.image, file, chunk, i, bytes.slice((r.start - range.start) as usize..(r.end - range.start) as usize))
                })
                .collect()
        };
        // Part of a cached chunk is checked against the chunk's CVs when they are here (an
        // image opened with its tables reads them from the source when first wanted: not
        // worth a round trip when the whole chunk is on disk).
        let cvs_here = self.image.slice_cvs(file, chunk).is_some();
        let cached = self.store.as_ref().filter(|_| cvs_here).and_then(|s| s.read_range_unverified(algo, &rec.digest, rec.len, range.clone()).ok().flatten());
        let (slices, counter) = match cached {
            // A part that fails its check is left to the whole chunk's read, which re-hashes
            // the entry and drops it if it is damaged.
            Some(bytes) => (check(bytes).ok(), &self.counters.cache_slice_reads),
            None => {
                if !cvs_here && self.store.as_ref().is_some_and(|s| s.contains_unverified(algo, &rec.digest)) {
                    return false;
                }
                if range.end - range.start > SOURCE_SLICE_MAX || !self.sliced.lock().expect("poisoned").insert(rec.digest) {
                    return false;
                }
                let foreground = self.pacer.foreground(range.end - range.start);
                let t = std::time::Instant::now();
                let got = verify::read_slices(self.src.as_ref(), &self.image, file, chunk, first..last + 1);
                drop(foreground);
                match &got {
                    Ok(_) => {
                        // A reader's own wait on the link: the fill's window moves by it.
                        self.pacer.sample(Kind::Slice, t.elapsed());
                        self.counters.bytes_fetched.fetch_add(range.end - range.start, Relaxed);
                    }
                    Err(e) if e.kind().is_integrity() => {
                        self.counters.bytes_fetched.fetch_add(range.end - range.start, Relaxed);
                        self.counters.verify_failures.fetch_add(1, Relaxed);
                        tracing::error!("VERIFY FAILURE: {e}; reading the whole chunk instead");
                    }
                    Err(_) => {}
                }
                (got.ok(), &self.counters.fetched_slice_reads)
            }
        };
        let Some(slices) = slices else { return false };
        let mut at = range.start as usize;
        let (mut done, end) = (0usize, within + out.len());
        for s in &slices {
            let (from, to) = (within.max(at), end.min(at + s.len()));
            if from < to {
                out[done..done + (to - from)].copy_from_slice(&s.as_bytes()[from - at..to - at]);
                done += to - from;
            }
            at += s.len();
        }
        if done != out.len() {
            return false;
        }
        counter.fetch_add(1, Relaxed);
        true
    }

    /// A stored chunk: recent memory, another caller's flight, or a flight of our own.
    fn stored(&self, file: usize, chunk: u64, need: Need) -> Outcome {
        let rec = self.image.files[file].chunks[chunk as usize];
        let here = self.recent.lock().expect("poisoned").map.get(&rec.digest).cloned();
        if let Some(c) = here.or_else(|| self.queued(&rec.digest)) {
            self.counters.cache_hits.fetch_add(1, Relaxed);
            return Ok(c);
        }
        if self.refused.lock().expect("poisoned").contains(&rec.digest) {
            let (file, offset) = self.failure_at(file, chunk);
            return Err(ChunkFailure::Integrity { file, chunk, offset, detail: "refused earlier (see the first failure above)".into() });
        }
        let (flight, leader) = {
            let mut m = self.inflight.lock().expect("poisoned");
            match m.get(&rec.digest) {
                Some(f) => (f.clone(), false),
                None => {
                    if let Some(c) = self.recent.lock().expect("poisoned").map.get(&rec.digest) {
                        self.counters.cache_hits.fetch_add(1, Relaxed);
                        return Ok(c.clone());
                    }
                    let f = Arc::new(Flight { done: Mutex::new(None), cv: Condvar::new() });
                    m.insert(rec.digest, f.clone());
                    (f, true)
                }
            }
        };
        if !leader {
            let mut g = flight.done.lock().expect("poisoned");
            while g.is_none() {
                g = flight.cv.wait(g).expect("poisoned");
            }
            self.counters.cache_hits.fetch_add(1, Relaxed);
            return g.clone().expect("set");
        }
        let (outcome, fetched) = self.load(file, chunk, need, None);
        self.land(file, chunk, &flight, outcome, fetched, need)
    }

    /// Land a flight this caller leads with `outcome`: a reader's chunk into recent memory,
    /// the outcome to its waiters, and a chunk `fetched` from the source into the cache's
    /// queue (else it came from the cache: a hit).
    fn land(&self, file: usize, chunk: u64, flight: &Flight, outcome: Outcome, fetched: bool, need: Need) -> Outcome {
        let digest = self.image.files[file].chunks[chunk as usize].digest;
        if let (Ok(c), Need::Read) = (&outcome, need) {
            self.recent.lock().expect("poisoned").insert(digest, c.clone());
        }
        // Waiters get the chunk before it is queued for the cache: the fill's put may wait
        // for the disk, a reader joined to its flight must not.
        *flight.done.lock().expect("poisoned") = Some(outcome.clone());
        flight.cv.notify_all();
        self.inflight.lock().expect("poisoned").remove(&digest);
        if let Ok(c) = &outcome {
            if fetched {
                self.queue_put(digest, c, need);
            } else {
                self.counters.cache_hits.fetch_add(1, Relaxed);
            }
        }
        outcome
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::path::Path;
    use std::time::{Duration, Instant};

    use imgfmt::OciLayout;

    use super::*;

    const MIB: usize = 1 << 20;

    /// A layout holding a `mib` MiB `vm.mem` of distinct bytes (no two chunks alike),
    /// packed with the defaults (1 MiB chunks, raw, 4 KiB outboard slices), and its bytes.
    pub(crate) fn packed_mib(dir: &Path, mib: usize) -> (Arc<OciLayout>, Arc<Image>, Vec<u8>) {
        let src = dir.join("src");
        std::fs::create_dir_all(&src).unwrap();
        let mut x = 7u64;
        let data: Vec<u8> = (0..mib * MIB)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (x >> 56) as u8
            })
            .collect();
        std::fs::write(src.join("vm.mem"), &data).unwrap();
        let layout = OciLayout::open_or_create(dir.join("l")).unwrap();
        pusher::pack(&src, &layout, "v1", &Default::default()).unwrap();
        let image = Image::open(&layout, &layout.resolve_tag("v1").unwrap()).unwrap();
        (Arc::new(layout), Arc::new(image), data)
    }

    fn packed(dir: &Path) -> (Arc<OciLayout>, Arc<Image>, Vec<u8>) {
        packed_mib(dir, 4)
    }

    fn fetcher(layout: &Arc<OciLayout>, image: &Arc<Image>, cache: Option<Arc<ChunkCache>>) -> Arc<Fetcher> {
        fetcher_over(image, layout.clone(), cache)
    }

    fn read(f: &Fetcher, offset: usize, len: usize) -> Result<Vec<u8>, ChunkFailure> {
        let mut out = vec![0u8; len];
        crate::read::read_file(f, 0, offset as u64, &mut out, Need::Read)?;
        Ok(out)
    }

    fn count(c: &AtomicU64) -> u64 {
        c.load(Relaxed)
    }

    /// The pack blob holding chunk `chunk` and the chunk's offset in it.
    fn pack_of(layout: &OciLayout, image: &Image, chunk: usize) -> (std::path::PathBuf, u64) {
        let StoredAt::Pack { pack, offset, .. } = image.files[0].chunks[chunk].at else { panic!("stored") };
        let d = &image.packs[pack as usize].digest;
        (layout.root().join("blobs").join(d.algorithm()).join(d.hex()), offset)
    }

    #[test]
    fn regression_issue_38_a_small_read_of_a_cold_chunk_fetches_its_slices_then_the_chunk() {
        let t = tempfile::tempdir().unwrap();
        let (layout, image, data) = packed(t.path());
        let f = fetcher(&layout, &image, None);
        let at = MIB + 5 * 4096 + 50;
        assert_eq!(read(&f, at, 4000).unwrap(), data[at..at + 4000]);
        let c = f.counters();
        assert_eq!((count(&c.fetched_slice_reads), count(&c.fetched_chunks)), (1, 0), "one slice read, no chunk");
        assert_eq!(count(&c.bytes_fetched), 4096, "one 4 KiB slice moved");
        // The second miss in the same chunk takes it whole (and later reads come from memory).
        assert_eq!(read(&f, MIB + 300_000, 4096).unwrap(), data[MIB + 300_000..MIB + 304_096]);
        assert_eq!((count(&c.fetched_slice_reads), count(&c.fetched_chunks)), (1, 1));
        // A read larger than a few slices takes the chunk whole at once.
        assert_eq!(read(&f, 3 * MIB + 8192, 64 << 10).unwrap(), data[3 * MIB + 8192..3 * MIB + 8192 + (64 << 10)]);
        assert_eq!((count(&c.fetched_slice_reads), count(&c.fetched_chunks)), (1, 2));
    }

    /// A source counting its ranged reads and whole-blob reads, and damaging the bytes
    /// of one pack range when asked to.
    struct Counting {
        inner: Arc<OciLayout>,
        ranges: AtomicU64,
        whole: Mutex<Vec<imgfmt::OciDigest>>,
        damage_at: Option<u64>,
    }

    impl imgfmt::source::Forward for Counting {
        fn inner(&self) -> &dyn BlobSource {
            self.inner.as_ref()
        }
        fn read_blob_unverified(&self, digest: &imgfmt::OciDigest, limit: u64) -> Result<Vec<u8>, imgfmt::FormatError> {
            self.whole.lock().unwrap().push(digest.clone());
            self.inner.read_blob_unverified(digest, limit)
        }
        fn read_at_unverified(&self, digest: &imgfmt::OciDigest, offset: u64, buf: &mut [u8]) -> Result<(), imgfmt::FormatError> {
            self.ranges.fetch_add(1, Relaxed);
            self.inner.read_at_unverified(digest, offset, buf)?;
            if let Some(at) = self.damage_at.filter(|&at| (offset..offset + buf.len() as u64).contains(&at)) {
                buf[(at - offset) as usize] ^= 1;
            }
            Ok(())
        }
    }

    fn counting(layout: &Arc<OciLayout>, damage_at: Option<u64>) -> Arc<Counting> {
        Arc::new(Counting { inner: layout.clone(), ranges: AtomicU64::new(0), whole: Mutex::new(Vec::new()), damage_at })
    }

    #[test]
    fn regression_issue_38_a_reader_in_order_gets_the_chunks_ahead_in_one_request_per_stretch() {
        let t = tempfile::tempdir().unwrap();
        let (layout, image, data) = packed_mib(t.path(), 24);
        let src = counting(&layout, None);
        let f = fetcher_over(&image, src.clone(), None);
        assert_eq!(read(&f, 0, MIB).unwrap(), data[..MIB]);
        assert_eq!(read(&f, MIB, MIB).unwrap(), data[MIB..2 * MIB]);
        let deadline = Instant::now() + Duration::from_secs(30);
        while count(&f.counters().fetched_chunks) < 2 + FIRST_STRETCH {
            assert!(Instant::now() < deadline, "the chunks ahead were never fetched");
            std::thread::sleep(Duration::from_millis(5));
        }
        // Two single chunks, then the sixteen after them in one request.
        assert_eq!(count(&src.ranges), 3, "one request for the stretch ahead, not one per chunk");
        for c in 2..10 {
            assert_eq!(read(&f, c * MIB, MIB).unwrap(), data[c * MIB..(c + 1) * MIB], "chunk {c}");
        }
        assert_eq!(count(&src.ranges), 3, "eight chunks still taken on ahead: no new stream yet");
        // Fewer than eight ahead: the next stream takes on the rest (up to 32).
        assert_eq!(read(&f, 10 * MIB, MIB).unwrap(), data[10 * MIB..11 * MIB]);
        while count(&f.counters().fetched_chunks) < 24 {
            assert!(Instant::now() < deadline, "the next stretch was never fetched");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(count(&src.ranges), 4, "the rest in one request");
        for c in 11..24 {
            assert_eq!(read(&f, c * MIB, MIB).unwrap(), data[c * MIB..(c + 1) * MIB], "chunk {c}");
        }
        assert_eq!(count(&f.counters().fetched_chunks), 24, "each chunk fetched once");
    }

    #[test]
    fn regression_issue_38_a_stream_takes_on_no_more_than_half_of_recent_memory() {
        let t = tempfile::tempdir().unwrap();
        let (layout, image, data) = packed_mib(t.path(), 24);
        let read_in_order = |memory: u64| -> u64 {
            let f = Fetcher::new(image.clone(), layout.clone(), None, RetryPolicy::never(), memory);
            for c in 0..3 {
                assert_eq!(read(&f, c * MIB, MIB).unwrap(), data[c * MIB..(c + 1) * MIB]);
            }
            // Whatever was started ahead has landed once no stream runs.
            let deadline = Instant::now() + Duration::from_secs(30);
            while f.streams.load(Relaxed) > 0 {
                assert!(Instant::now() < deadline, "a stream never ended");
                std::thread::sleep(Duration::from_millis(5));
            }
            count(&f.counters().fetched_chunks)
        };
        // No chunk cache and no recent memory: nowhere to keep chunks fetched ahead.
        assert_eq!(read_in_order(0), 3, "nothing fetched ahead");
        // 8 MiB of recent memory: streams of 4 chunks.
        // Chunks 0 and 1 read, then streams of four: 2-5 (chunk 2 read from it), then 6-9.
        assert_eq!(read_in_order(8 << 20), 2 + 4 + 4, "two streams of four");
    }

    #[test]
    fn regression_issue_38_a_damaged_chunk_in_a_stretch_ahead_is_refused_and_the_rest_served() {
        let t = tempfile::tempdir().unwrap();
        let (layout, image, data) = packed_mib(t.path(), 8);
        let StoredAt::Pack { offset, .. } = image.files[0].chunks[4].at else { panic!("chunk 4 is stored") };
        let f = fetcher_over(&image, counting(&layout, Some(offset + 100)), None);
        assert_eq!(read(&f, 0, MIB).unwrap(), data[..MIB]);
        assert_eq!(read(&f, MIB, MIB).unwrap(), data[MIB..2 * MIB]);
        for c in [2, 3, 5, 6, 7] {
            assert_eq!(read(&f, c * MIB, MIB).unwrap(), data[c * MIB..(c + 1) * MIB], "chunk {c}");
        }
        let e = read(&f, 4 * MIB, MIB).unwrap_err();
        assert!(matches!(e, ChunkFailure::Integrity { chunk: 4, .. }), "{e}");
        assert_eq!(count(&f.counters().verify_failures), 2, "the stretch's read and one more, then refused");
    }

    #[test]
    fn regression_issue_38_an_image_opened_with_its_tables_never_reads_the_whole_outboard() {
        let t = tempfile::tempdir().unwrap();
        let (layout, first, data) = packed(t.path());
        let src = counting(&layout, None);
        let (image, _) = Image::open_outboards_later(src.clone(), &first.manifest_digest, imgfmt::OutboardsAhead::Tables).unwrap();
        let image = Arc::new(image);
        assert!(image.slices_on_demand());
        let f = Fetcher::new(image.clone(), src.clone(), None, RetryPolicy::never(), 64 << 20);
        let at = 2 * MIB + 3 * 4096;
        assert_eq!(read(&f, at, 4096).unwrap(), data[at..at + 4096]);
        let c = f.counters();
        assert_eq!((count(&c.fetched_slice_reads), count(&c.fetched_chunks)), (1, 0), "the slice, checked against CVs read beside it");
        std::thread::sleep(Duration::from_millis(100));
        let outboard = image.chain[0].outboard_blob.as_ref().expect("packed with an outboard").digest.clone();
        assert!(!src.whole.lock().unwrap().contains(&outboard), "the whole outboard was read");
    }

    #[test]
    fn regression_issue_38_a_chunk_the_fill_fetched_is_not_fetched_again_before_it_is_on_disk() {
        let t = tempfile::tempdir().unwrap();
        let (layout, image, data) = packed_mib(t.path(), 48);
        let cache = Arc::new(ChunkCache::open(&t.path().join("cache"), 1 << 30).unwrap());
        let f = fetcher(&layout, &image, Some(cache));
        for c in 0..48 {
            f.fill(0, c).unwrap();
        }
        // Read at once, most of them still queued for the disk: every byte right, and
        // none fetched a second time.
        for c in (0..48).rev() {
            assert_eq!(read(&f, c * MIB + 4096, MIB - 8192).unwrap(), data[c * MIB + 4096..(c + 1) * MIB - 4096], "chunk {c}");
        }
        assert_eq!(count(&f.counters().fetched_chunks), 48, "each chunk fetched once");
        f.settle();
        assert!(f.complete(0));
    }

    #[test]
    fn regression_issue_38_an_image_opened_with_its_tables_over_a_complete_cache_reads_slices_of_cached_chunks() {
        let t = tempfile::tempdir().unwrap();
        let (layout, first, data) = packed(t.path());
        let cache = Arc::new(ChunkCache::open(&t.path().join("cache"), 1 << 30).unwrap());
        let warm = fetcher(&layout, &first, Some(cache.clone()));
        for c in 0..4 {
            warm.fill(0, c).unwrap();
        }
        warm.settle();
        drop(warm);
        let (image, _) = Image::open_outboards_later(layout.clone(), &first.manifest_digest, imgfmt::OutboardsAhead::Tables).unwrap();
        let image = Arc::new(image);
        let f = Fetcher::new(image.clone(), layout.clone(), Some(cache), RetryPolicy::never(), 64 << 20);
        let deadline = Instant::now() + Duration::from_secs(30);
        while image.slice_cvs(0, 2).is_none() {
            assert!(Instant::now() < deadline, "a mount over a complete cache never read the whole outboards");
            std::thread::sleep(Duration::from_millis(5));
        }
        let at = 2 * MIB + 5 * 4096;
        assert_eq!(read(&f, at, 4096).unwrap(), data[at..at + 4096]);
        let c = f.counters();
        assert_eq!((count(&c.cache_slice_reads), count(&c.fetched_chunks)), (1, 0), "one slice from the cache, nothing fetched");
    }

    /// A fetcher over `src` whose outboards are in place.
    fn fetcher_over(image: &Arc<Image>, src: Arc<dyn BlobSource>, cache: Option<Arc<ChunkCache>>) -> Arc<Fetcher> {
        let f = Fetcher::new(image.clone(), src, cache, RetryPolicy::never(), 64 << 20);
        let deadline = Instant::now() + Duration::from_secs(30);
        while image.slice_cvs(0, 0).is_none() {
            assert!(Instant::now() < deadline, "the outboards were never put in place");
            std::thread::sleep(Duration::from_millis(5));
        }
        f
    }

    #[test]
    fn regression_issue_38_a_reader_reading_in_order_gets_the_next_chunks_fetched_ahead() {
        let t = tempfile::tempdir().unwrap();
        let (layout, image, data) = packed(t.path());
        let f = fetcher(&layout, &image, None);
        assert_eq!(read(&f, 0, MIB).unwrap(), data[..MIB]);
        assert_eq!(count(&f.counters().fetched_chunks), 1, "one chunk read, nothing ahead yet");
        assert_eq!(read(&f, MIB, MIB).unwrap(), data[MIB..2 * MIB]);
        let deadline = Instant::now() + Duration::from_secs(30);
        while count(&f.counters().fetched_chunks) < 4 {
            assert!(Instant::now() < deadline, "chunks 2 and 3 were never fetched ahead");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(read(&f, 2 * MIB, 2 * MIB).unwrap(), data[2 * MIB..], "right bytes, from recent memory");
        assert_eq!(count(&f.counters().fetched_chunks), 4, "each chunk fetched once");
    }

    #[test]
    fn regression_issue_38_a_small_read_of_a_cached_chunk_reads_and_checks_only_its_slices() {
        let t = tempfile::tempdir().unwrap();
        let (layout, image, data) = packed(t.path());
        let cache = Arc::new(ChunkCache::open(&t.path().join("cache"), 1 << 30).unwrap());
        let rec = image.files[0].chunks[3];
        let whole = verify::read_chunk(layout.as_ref(), &image, 0, 3).unwrap();
        cache.put(image.config().hash, &rec.digest, &whole).unwrap();
        let f = fetcher(&layout, &image, Some(cache.clone()));
        let at = 3 * MIB + 12_345;
        for _ in 0..3 {
            assert_eq!(read(&f, at, 4096).unwrap(), data[at..at + 4096]);
        }
        let c = f.counters();
        assert_eq!((count(&c.cache_slice_reads), count(&c.fetched_chunks), count(&c.bytes_fetched)), (3, 0, 0), "every read from the cache's slices");

        // A damaged cache entry: the part fails its check, the whole chunk is read instead,
        // the damaged entry is dropped and the chunk fetched from the source: right bytes.
        let entry = cache.entry_path(image.config().hash, &rec.digest);
        let mut bytes = std::fs::read(&entry).unwrap();
        bytes[12_400] ^= 0xff;
        std::fs::write(&entry, &bytes).unwrap();
        assert_eq!(read(&f, at, 4096).unwrap(), data[at..at + 4096]);
        assert_eq!((count(&c.cache_slice_reads), count(&c.fetched_chunks)), (3, 1), "fetched whole from the source");
    }

    #[test]
    fn regression_issue_38_a_tampered_slice_is_never_served() {
        let t = tempfile::tempdir().unwrap();
        let (layout, image, data) = packed(t.path());
        let (pack, offset) = pack_of(&layout, &image, 2);
        let mut blob = std::fs::read(&pack).unwrap();
        blob[offset as usize + 8192 + 7] ^= 1;
        std::fs::write(&pack, &blob).unwrap();
        let f = fetcher(&layout, &image, None);
        let failed = read(&f, 2 * MIB + 8192, 4096).unwrap_err();
        assert!(matches!(failed, ChunkFailure::Integrity { chunk: 2, .. }), "{failed}");
        assert!(count(&f.counters().verify_failures) >= 2, "the slice and the whole chunk both failed");
        // Another chunk of the same file still reads.
        assert_eq!(read(&f, 8192, 4096).unwrap(), data[8192..12288]);
    }
}
