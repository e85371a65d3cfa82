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
/// Chunks queued for the cache's writer and not written yet, with a wake-up for `settle`.
type Pending = Arc<(Mutex<u64>, Condvar)>;
/// Fill requests in flight at most (the pacing window's bound, in chunks).
pub const FILL_JOBS: usize = 8;
/// Chunks fetched ahead of a reader that reads a file in order, at most.
const READ_AHEAD: u64 = 16;
/// A read of at most this many bytes of a chunk nobody asked for before fetches only its
/// slices from the source (one range request); a later miss in the chunk fetches it whole.
const SOURCE_SLICE_MAX: u64 = 16 << 10;

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
    /// Read-ahead fetches running.
    ahead: AtomicU64,
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
    /// The image's outboards are read here, before it is shown.
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
                            let (n, cv) = &*pending;
                            let mut n = n.lock().expect("poisoned");
                            *n = n.saturating_sub(items.len() as u64);
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
        load_outboards(&image, src.as_ref());
        let pacer = Background::new(1 << image.chunk_shift(), FILL_JOBS);
        Arc::new_cyclic(|me| Fetcher {
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
            ahead: AtomicU64::new(0),
            me: me.clone(),
            counters: FetchCounters::default(),
            _pin,
        })
    }

    fn failure_at(&self, file: usize, chunk: u64) -> (String, u64) {
        (self.image.files[file].name.clone(), chunk << self.image.chunk_shift())
    }

    /// Lead a flight: the cache, else the source (retried, verified twice at most). A
    /// reader's fetch counts against the fill's pacing window while it is in flight.
    fn load(&self, file: usize, chunk: u64, need: Need) -> (Outcome, bool) {
        let rec = self.image.files[file].chunks[chunk as usize];
        let algo = self.image.config().hash;
        if let Some(v) = self.store.as_ref().and_then(|s| ChunkStore::get(s.as_ref(), algo, &rec.digest, rec.len)) {
            return (Ok(Arc::new(v)), false);
        }
        let (name, offset) = self.failure_at(file, chunk);
        let stored = match rec.at {
            StoredAt::Pack { stored_len, .. } => u64::from(stored_len),
            StoredAt::Zero => 0,
        };
        let _foreground = (need == Need::Read).then(|| self.pacer.foreground(stored));
        let mut retry = self.policy.start();
        let mut mismatch: Option<String> = None;
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
        *self.pending.0.lock().expect("poisoned") += 1;
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
            *self.pending.0.lock().expect("poisoned") -= 1;
        }
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
        if rec.at == StoredAt::Zero || self.store.as_ref().is_none_or(cached) {
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

    fn settle(&self) {
        let (n, cv) = &*self.pending;
        let deadline = std::time::Instant::now() + SETTLE_MAX;
        let mut left = n.lock().expect("poisoned");
        while *left > 0 {
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

/// Read the image's outboards and put them in place, before the image is shown: a read
/// of part of a chunk may then read only that part ([`Fetcher::slices_into`]) from its
/// first read on. Without them (none packed, or unreadable: logged) reads take whole chunks.
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
    /// chunks included) gets the next [`READ_AHEAD`] stored chunks fetched beside it, each
    /// on a thread of its own as a reader's fetch (verified, into recent memory and the
    /// cache, counted against the fill's window), so it waits about one round trip per
    /// [`READ_AHEAD`] chunks rather than one per chunk.
    fn read_ahead(&self, file: usize, chunk: u64) {
        let prev = self.last_read.lock().expect("poisoned").insert(file, chunk);
        if prev.is_none_or(|p| p + 1 != chunk) {
            return;
        }
        let chunks = &self.image.files[file].chunks;
        // The next READ_AHEAD stored chunks (zero chunks cost nothing to read).
        let next = (chunk + 1..chunks.len() as u64).filter(|&c| chunks[c as usize].at != StoredAt::Zero).take(READ_AHEAD as usize);
        for c in next {
            let d = chunks[c as usize].digest;
            let have = self.recent.lock().expect("poisoned").map.contains_key(&d) || self.inflight.lock().expect("poisoned").contains_key(&d);
            if have {
                continue;
            }
            if self.ahead.fetch_add(1, Relaxed) >= READ_AHEAD {
                self.ahead.fetch_sub(1, Relaxed);
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
    }

    /// Copy bytes `within ..` of a stored chunk into `out` from its slices, each checked
    /// against the chunk's outboard entry (merged to its digest first): from the chunk
    /// cache, else, for a read of at most [`SOURCE_SLICE_MAX`] in a chunk no read fetched
    /// slices of before, with one range request to the source. `false`: nothing copied
    /// (no slices, the chunk in recent memory, a check or a fetch failed): read the whole
    /// chunk, which is verified and, on a failure, refused as any chunk is.
    fn slices_into(&self, file: usize, chunk: u64, within: usize, out: &mut [u8]) -> bool {
        let rec = self.image.files[file].chunks[chunk as usize];
        if self.recent.lock().expect("poisoned").map.contains_key(&rec.digest) {
            return false;
        }
        let Some(cvs) = self.image.slice_cvs(file, chunk) else { return false };
        let shift = cvs.shape().slice_size().trailing_zeros();
        let (first, last) = ((within >> shift) as u32, ((within + out.len() - 1) >> shift) as u32);
        let range = cvs.slice_range(first).start..cvs.slice_range(last).end;
        let algo = self.image.config().hash;
        let check = |bytes: Vec<u8>| -> Result<Vec<verify::VerifiedSlice>, VerifyError> {
            let bytes = bytes::Bytes::from(bytes);
            (first..=last)
                .map(|i| {
                    let r = cvs.slice_range(i);
                    verify::check_slice(&self.image, file, chunk, i, bytes.slice((r.start - range.start) as usize..(r.end - range.start) as usize))
                })
                .collect()
        };
        let cached = self.store.as_ref().and_then(|s| s.read_range_unverified(algo, &rec.digest, rec.len, range.clone()).ok().flatten());
        let (slices, counter) = match cached {
            // A part that fails its check is left to the whole chunk's read, which re-hashes
            // the entry and drops it if it is damaged.
            Some(bytes) => (check(bytes).ok(), &self.counters.cache_slice_reads),
            None => {
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
        if let Some(c) = self.recent.lock().expect("poisoned").map.get(&rec.digest) {
            self.counters.cache_hits.fetch_add(1, Relaxed);
            return Ok(c.clone());
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
        let (outcome, fetched) = self.load(file, chunk, need);
        if let (Ok(c), Need::Read) = (&outcome, need) {
            self.recent.lock().expect("poisoned").insert(rec.digest, c.clone());
        }
        // Waiters get the chunk before it is queued for the cache: the fill's put may wait
        // for the disk, a reader joined to its flight must not.
        *flight.done.lock().expect("poisoned") = Some(outcome.clone());
        flight.cv.notify_all();
        self.inflight.lock().expect("poisoned").remove(&rec.digest);
        if let Ok(c) = &outcome {
            if fetched {
                self.queue_put(rec.digest, c, need);
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
        let f = Fetcher::new(image.clone(), layout.clone(), cache, RetryPolicy::never(), 64 << 20);
        let deadline = Instant::now() + Duration::from_secs(30);
        while image.slice_cvs(0, 0).is_none() {
            assert!(Instant::now() < deadline, "the outboards were never put in place");
            std::thread::sleep(Duration::from_millis(5));
        }
        f
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
