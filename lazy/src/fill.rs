//! The fill: a running restore finishes the file it serves into the host's chunk cache in
//! the background, so that it stops depending on the registry. A lazily restored guest may
//! live for days on an image whose tag moved on; once the registry's gc deletes that
//! manifest's packs, a fault on a chunk nobody fetched has nothing left to read. Chunks are
//! fetched, verified and put in the cache (pinned there while the restore runs: see the
//! daemon's pin); they are not installed into guest memory (the stream does that when it
//! runs).
//!
//! ```text
//! connection ──► wait: faults settled (none waited for a fetch for FILL_SETTLE),
//!                      working-set replay over, stream of the rest not streaming
//!            ──► one fill per daemon at a time (the token), in the order of the trace,
//!                then file order; zero chunks never; chunks the cache holds skipped
//!            ──► run of adjacent chunks ─► Background window (Class::Fill: after the
//!                replay and the stream, yielding to the faults) ─► Fetcher::fill_run
//!                (single-flight, verified) ─► the cache (pinned; room: the budget)
//!            ──► every data chunk in the cache: done ("no longer depends on the registry")
//! ```
//!
//! The budget: pinned bytes count toward the cache's limit and no eviction frees them, so
//! the fill stops where the pinned bytes would pass it, and says once that the rest of the
//! image keeps depending on the registry.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use imgfmt::StoredAt;

use crate::fetch::{ChunkStore, Fetcher};
use crate::pacing::{Background, Class};
use crate::prefetch::{Demand, RUN_BYTES};
use crate::stats::Counters;

/// How long no fault may have waited for a fetch before the fill starts (and after a
/// fault that did, before it goes on): the guest's first faults, and any burst later, have
/// the link to themselves.
pub const FILL_SETTLE: Duration = Duration::from_secs(1);
/// How often a waiting fill looks again.
const LOOK: Duration = Duration::from_millis(50);
/// The longest pause between rounds when chunks could not be fetched (the source failing):
/// each round without progress doubles the pause from a second up to this.
const MOST_PAUSE: Duration = Duration::from_secs(60);

/// What the daemon's fill knows: which chunks of the served file the cache holds, who is
/// filling, and whether it is done. Shared by every connection of the daemon.
pub(crate) struct Fill {
    /// Per chunk of the file: known to be in the cache (zero chunks count as held).
    held: Vec<AtomicBool>,
    /// A connection is filling (one at a time).
    running: AtomicBool,
    /// The budget stopped the fill (said once).
    stopped: AtomicBool,
    /// Every data chunk is in the cache.
    done: AtomicBool,
}

/// Releases the fill's token when the connection filling ends.
struct Token<'a>(&'a AtomicBool);

impl Drop for Token<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// One connection's view of the daemon's fill: what it reads through and reports into.
pub(crate) struct Filler<'a> {
    pub fill: &'a Fill,
    pub fetcher: &'a Fetcher,
    pub store: &'a dyn ChunkStore,
    pub bg: &'a Arc<Background>,
    pub demand: &'a Demand,
    /// The daemon's counters (`filled_*`, `fill_done`).
    pub counters: &'a Counters,
    /// The connection is over (or the daemon stopping).
    pub ended: &'a (dyn Fn() -> bool + Sync),
}

impl Fill {
    pub fn new(fetcher: &Fetcher) -> Fill {
        let chunks = &fetcher.image.files[fetcher.file].chunks;
        Fill {
            held: chunks.iter().map(|c| AtomicBool::new(matches!(c.at, StoredAt::Zero))).collect(),
            running: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            done: AtomicBool::new(false),
        }
    }

    /// Every data chunk of the file is in the cache.
    pub fn done(&self) -> bool {
        self.done.load(Ordering::Relaxed)
    }
}

impl Filler<'_> {
    /// Fill the cache with the file's chunks, `order` first (the trace's chunks, then file
    /// order), once the guest's faults have settled; until done, the budget stops it, or
    /// the connection ends. Another connection filling already: wait for it to end.
    pub fn run(&self, order: &[u64]) {
        let Some(_token) = self.take_token() else { return };
        let mut pause = Duration::from_secs(1);
        while !self.fill.done() && !(self.ended)() {
            let before = self.held();
            if !self.round(order) {
                return;
            }
            if self.check_done() {
                return;
            }
            // Chunks left: being fetched by a fault or the stream when passed (their puts
            // land meanwhile), refused, or the source failing. Again after a pause, longer
            // while nothing moves.
            pause = if self.held() > before { Duration::from_secs(1) } else { (pause * 2).min(MOST_PAUSE) };
            if !self.sleep(pause) {
                return;
            }
        }
    }

    /// The fill's token, once the faults have settled and no other connection fills;
    /// `None` when the connection ends (or the fill is done) first.
    fn take_token(&self) -> Option<Token<'_>> {
        loop {
            if (self.ended)() || self.fill.done() {
                return None;
            }
            if self.demand.quiet(FILL_SETTLE) && self.fill.running.compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                return Some(Token(&self.fill.running));
            }
            std::thread::sleep(LOOK);
        }
    }

    /// Sleep `d` unless the connection ends first (then `false`).
    fn sleep(&self, d: Duration) -> bool {
        let end = std::time::Instant::now() + d;
        while std::time::Instant::now() < end {
            if (self.ended)() {
                return false;
            }
            std::thread::sleep(LOOK.min(end.saturating_duration_since(std::time::Instant::now())));
        }
        true
    }

    fn held(&self) -> usize {
        self.fill.held.iter().filter(|h| h.load(Ordering::Relaxed)).count()
    }

    /// One pass over `order`; `false` when the fill is to stop (the connection ended, or
    /// the budget has no room left).
    fn round(&self, order: &[u64]) -> bool {
        let algo = self.fetcher.image.config().hash;
        let chunks = &self.fetcher.image.files[self.fetcher.file].chunks;
        let mut room = self.store.pinned_room();
        // The window's probes run while the fill has requests to make.
        let mut wanting = None;
        let mut i = 0;
        while i < order.len() {
            // Faults (and the stream, the replay) first.
            while !self.demand.quiet(FILL_SETTLE) {
                wanting = None;
                if !self.sleep(LOOK) {
                    return false;
                }
            }
            let c = order[i];
            let rec = chunks[c as usize];
            if self.fill.held[c as usize].load(Ordering::Relaxed) || self.store.contains(algo, &rec.digest) {
                self.fill.held[c as usize].store(true, Ordering::Relaxed);
                i += 1;
                continue;
            }
            let run = self.run_from(order, i);
            let n = run.len();
            // Within the room the budget leaves pinned chunks (cached bytes are whole blocks).
            let blocks = |k: usize| run[..k].iter().map(|&c| u64::from(chunks[c as usize].len).div_ceil(4096) * 4096).sum::<u64>();
            let fits = match room {
                Some(r) => (1..=n).rev().find(|&k| blocks(k) <= r).unwrap_or(0),
                None => n,
            };
            if fits == 0 {
                self.over_budget();
                return false;
            }
            let run = &run[..fits];
            let wire: u64 = run.iter().map(|&c| self.fetcher.wire_bytes(c)).sum();
            wanting.get_or_insert_with(|| self.bg.wanting());
            let Some(permit) = self.bg.acquire(wire, Class::Fill, self.ended) else { return false };
            let (_, got) = self.fetcher.fill_run(run);
            drop(permit);
            self.store_chunks(algo, &got);
            if let Some(r) = room.as_mut() {
                *r = r.saturating_sub(blocks(fits));
            }
            i += fits.max(1);
        }
        true
    }

    /// The chunks from `order[i]` that one range request reads: adjacent in their pack, not
    /// held, at most half the window and [`RUN_BYTES`].
    fn run_from(&self, order: &[u64], i: usize) -> Vec<u64> {
        let f = self.fetcher;
        let most = (self.bg.window() / 2).min(RUN_BYTES).max(f.wire_bytes(order[i]));
        let mut run = vec![order[i]];
        let mut bytes = f.wire_bytes(order[i]);
        while let Some(&d) = order.get(i + run.len()) {
            let b = f.wire_bytes(d);
            if bytes + b > most || !f.adjacent(run[run.len() - 1], d) || self.fill.held[d as usize].load(Ordering::Relaxed) {
                break;
            }
            run.push(d);
            bytes += b;
        }
        run
    }

    /// Put `got` in the cache and count what is there now.
    fn store_chunks(&self, algo: imgfmt::HashAlgo, got: &[(u64, Arc<verify::VerifiedChunk>)]) {
        if got.is_empty() {
            return;
        }
        let chunks = &self.fetcher.image.files[self.fetcher.file].chunks;
        let items: Vec<_> = got.iter().map(|(c, v)| (chunks[*c as usize].digest, v.as_ref())).collect();
        self.store.put_many(algo, &items);
        for (c, v) in got {
            if self.store.contains(algo, &chunks[*c as usize].digest) && !self.fill.held[*c as usize].swap(true, Ordering::Relaxed) {
                self.counters.filled_chunks.fetch_add(1, Ordering::Relaxed);
                self.counters.filled_bytes.fetch_add(v.len() as u64, Ordering::Relaxed);
            }
        }
    }

    /// Whether every data chunk is in the cache now (each looked at again: an entry may
    /// have gone since it was counted); says so once when it is.
    fn check_done(&self) -> bool {
        let algo = self.fetcher.image.config().hash;
        let chunks = &self.fetcher.image.files[self.fetcher.file].chunks;
        let mut whole = true;
        for (c, rec) in chunks.iter().enumerate() {
            if matches!(rec.at, StoredAt::Zero) {
                continue;
            }
            let there = self.store.contains(algo, &rec.digest);
            self.fill.held[c].store(there, Ordering::Relaxed);
            whole &= there;
        }
        if whole && !self.fill.done.swap(true, Ordering::Relaxed) {
            self.counters.fill_done.store(1, Ordering::Relaxed);
            let file = &self.fetcher.image.files[self.fetcher.file];
            tracing::info!(
                "{} of {} is whole in the chunk cache ({} data chunks): this restore no longer depends on the registry",
                file.name,
                self.fetcher.image.manifest_digest,
                chunks.iter().filter(|c| !matches!(c.at, StoredAt::Zero)).count()
            );
        }
        whole
    }

    /// The budget has no room for the next chunk: said once.
    fn over_budget(&self) {
        if !self.fill.stopped.swap(true, Ordering::Relaxed) {
            let file = &self.fetcher.image.files[self.fetcher.file];
            tracing::warn!(
                "{} of {}: the chunk cache's budget (--cache-size) has no room for the rest of the image ({} of {} data chunks cached): the rest keeps depending on the registry",
                file.name,
                self.fetcher.image.manifest_digest,
                self.held() - file.chunks.iter().filter(|c| matches!(c.at, StoredAt::Zero)).count(),
                file.chunks.iter().filter(|c| !matches!(c.at, StoredAt::Zero)).count()
            );
        }
    }
}
