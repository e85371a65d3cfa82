//! Prefetch: what a restore installs ahead of the guest besides its faults, and when. The
//! trace's chunk order first (a trace is kept by [`crate::trace`]), then the *stream* of the
//! rest of the image, at once (`--prefetch all`) or once the misses look scattered
//! ([`Detector`]); all of it yields to the connection's faults ([`crate::pacing`]).
//!
//! ```text
//! order = trace chunks, then every other non-zero chunk (file order)
//!   dispatcher ──(run, permit)──► workers: Installer::prefetch_run (Fetcher, on the
//!       │      background's client: one range request per run of chunks adjacent in
//!       │      their pack, each chunk single-flight, verified, cached; gaps only)
//!       └─ a run goes when the background's window has room for its bytes; a run is
//!          at most half the window (RUN_BYTES at most), so its bytes are in few requests
//!          (crate::pacing: LEDBAT, the faults' queueing delay kept under a target)
//! fault loop ──Demand──► misses -> Detector -> go
//! ```

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use imgfmt::Image;

use crate::install::Installer;
use crate::pacing::{Background, Class, Kind, Permit};
use crate::trace::Trace;

/// How to prefetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefetchMode {
    None,
    /// Replay the image's trace if it has one.
    Trace,
    /// The trace, then every other non-zero chunk in file order.
    All,
}

impl std::str::FromStr for PrefetchMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(PrefetchMode::None),
            "trace" => Ok(PrefetchMode::Trace),
            "all" => Ok(PrefetchMode::All),
            _ => Err(format!("unknown prefetch mode {s:?} (expected trace, all or none)")),
        }
    }
}

/// The order to prefetch in: the trace (deduplicated), then with `All` every other
/// non-zero chunk in file order.
pub fn prefetch_order(mode: PrefetchMode, trace: Option<&Trace>, image: &Image, file: usize) -> Vec<u64> {
    let chunks = &image.files[file].chunks;
    let mut seen = vec![false; chunks.len()];
    let mut out = Vec::new();
    if mode == PrefetchMode::None {
        return out;
    }
    for &c in trace.map(|t| t.chunks.as_slice()).unwrap_or_default() {
        if let Some(s) = seen.get_mut(c as usize) {
            if !*s && !matches!(chunks[c as usize].at, imgfmt::StoredAt::Zero) {
                *s = true;
                out.push(c);
            }
        }
    }
    if mode == PrefetchMode::All {
        for (c, ch) in chunks.iter().enumerate() {
            if !seen[c] && !matches!(ch.at, imgfmt::StoredAt::Zero) {
                out.push(c as u64);
            }
        }
    }
    out
}

/// A restore's chunks to install ahead of the guest: the trace's first (`order[..trace]`),
/// then, with `All` or once the misses look scattered (`Trace`), the rest of the file's
/// non-zero chunks in file order.
pub fn stream_order(mode: PrefetchMode, trace: Option<&Trace>, image: &Image, file: usize) -> (Vec<u64>, usize) {
    if mode == PrefetchMode::None {
        return (Vec::new(), 0);
    }
    let traced = prefetch_order(PrefetchMode::Trace, trace, image, file).len();
    (prefetch_order(PrefetchMode::All, trace, image, file), traced)
}

/// Distinct data chunks missed before the detector may fire, whatever the fraction: a
/// handful of misses says nothing about a pattern.
pub const MIN_MISSES: u64 = 8;
/// Default of `--stream-after` for a restore with no working set to replay: 0, so the
/// rest is streamed once [`MIN_MISSES`] data chunks missed. A guest's misses do not tell a
/// scattered working set from a clustered one touched in random order until the clustered
/// one has covered its set (bench/wan.sh's clustered guest: 23 % of the data chunks), and
/// every miss before the stream costs a scattered guest a round trip per vCPU; streaming at
/// once keeps any pattern within a pull's time plus a few round trips. Measured with
/// bench/wan.sh, 512 MiB, 20 ms, 1 Gbit/s, slice faults on (BENCHMARKS.md "Dialled
/// network"): 0 gave scattered 1.09x a pull and clustered 0.72x; 15 % 1.12x and 0.59x;
/// 30 % 1.18x and 0.44x. What it costs: a clustered guest's restore shares the link with
/// the stream and ends with the whole image in guest memory.
pub const DEFAULT_STREAM_AFTER: f64 = 0.0;
/// With a recorded working set replayed, the share is at least this: the working set
/// covers what the guest is expected to touch, a few misses beyond it are a guest doing
/// a little more, and only a guest that departs from it widely (30 % of the data chunks:
/// above the clustered guest's 23 %) gets the rest streamed.
pub const REPLAY_STREAM_AFTER: f64 = 0.3;

/// Share of the file's data chunks a guest has missed after which it is taken to need most
/// of the image, and the stream's pacing is widened ([`crate::pacing::WIDE_TARGET_SHARE`]).
/// Such a guest (single pages all over its memory) waits a round trip for every chunk the
/// stream has not reached yet, so how soon the stream has everything is its restore's
/// time, and the faults' own whole-chunk fetches already hold about as much queue as the
/// narrow target allows: at 20 ms and 1 Gbit/s with two vCPUs the window shrank to 1–3
/// MiB, the stream moved 10–20 % of the image and the restore took 1.3–1.5× a pull
/// (BENCHMARKS.md "The stream yields to the guest"). 15 %: bench/wan.sh's clustered
/// guests (runs of 256 pages: 10–11 % of the data chunks) never reach it; its scattered
/// guest (nearly every data chunk) does within a few hundred milliseconds.
pub const NEEDS_MOST_AFTER: f64 = 0.15;

/// When a restore's misses look scattered enough that streaming the rest of the image
/// beats faulting it in: once the distinct data chunks that faults had to wait for reach
/// a fraction of the file's data chunks (and at least [`MIN_MISSES`]).
///
/// Why a count and not a pattern: with whole-chunk faults a chunk faults once, wherever
/// in it the guest lands, so a clustered guest (runs of pages in a few chunks, touched in
/// any order) and a scattered one (single pages everywhere) look the same until the
/// clustered one has covered its working set and stops missing. What tells them apart is
/// how much of the image they end up needing: a guest that has needed more than the
/// fraction is likely to need the rest, and then a stream at the link's speed is faster
/// than a round trip per chunk per vCPU. Below it, faults alone win (a guest needing a
/// quarter of the chunks, one round trip each, is done before a pull of the whole).
#[derive(Debug, Clone)]
pub struct Detector {
    /// Distinct misses at which it fires (`u64::MAX`: never).
    need: u64,
    /// Distinct misses at which the guest is taken to need most of the image.
    most: u64,
    seen: Vec<bool>,
    count: u64,
    fired: bool,
}

impl Detector {
    /// A detector for file `file` of `image`, firing after `fraction` (0..=1; above 1:
    /// never) of its data chunks missed.
    pub fn new(image: &Image, file: usize, fraction: f64) -> Detector {
        let chunks = &image.files[file].chunks;
        let data = chunks.iter().filter(|c| !matches!(c.at, imgfmt::StoredAt::Zero)).count() as u64;
        Detector::with_counts(chunks.len() as u64, data, fraction)
    }

    /// A detector for a file of `chunks` chunks of which `data` are not zero.
    pub fn with_counts(chunks: u64, data: u64, fraction: f64) -> Detector {
        // `fraction` of the data chunks, at least MIN_MISSES, at most all of them.
        let misses = |fraction: f64| ((fraction.max(0.0) * data as f64).ceil() as u64).max(MIN_MISSES).min(data.max(1));
        let need = if fraction.is_nan() || fraction > 1.0 { u64::MAX } else { misses(fraction) };
        Detector { need, most: misses(NEEDS_MOST_AFTER), seen: vec![false; chunks as usize], count: 0, fired: false }
    }

    /// Whether the misses so far say the guest needs most of the image
    /// ([`NEEDS_MOST_AFTER`] of its data chunks missed).
    pub fn needs_most(&self) -> bool {
        self.count >= self.most
    }

    /// A fault had to wait for (data) chunk `chunk`. True exactly once: when the misses
    /// first reach the threshold.
    pub fn miss(&mut self, chunk: u64) -> bool {
        if let Some(s) = self.seen.get_mut(chunk as usize) {
            if !*s {
                *s = true;
                self.count += 1;
            }
        }
        if !self.fired && self.count >= self.need {
            self.fired = true;
            return true;
        }
        false
    }

    /// Distinct chunks missed so far.
    pub fn missed(&self) -> u64 {
        self.count
    }
}

/// Default of `--stream-jobs`: the background's requests in flight at most. 32 requests of
/// 1 MiB cover 1 Gbit/s at ~250 ms of RTT and 10 Gbit/s at ~25 ms; `snapctl serve` allows
/// one client 64 connections, and faults need some. Within it the window of
/// [`crate::pacing`] decides.
pub const DEFAULT_STREAM_JOBS: usize = 32;

/// Most bytes one request of the stream reads: a run of chunks adjacent in their pack, up
/// to half the background's window, so that the window's bytes are in flight as two
/// requests or so rather than one per chunk. A bottleneck that takes turns between
/// connections (as `netem`'s link and fair-queueing routers do) makes a fault's response
/// wait a turn for each request in flight, and gives a fault's chunk a share of the link
/// beside each: 1 MiB requests filling a 1 Gbit/s link at 20 ms are 3-4 turns, over the
/// pacing's 2 ms target, so the window settled below the link's rate (a scattered guest,
/// which waits for the stream's bytes, took 1.27× pull's time). 8 MiB, as `pull`'s ranges.
pub const RUN_BYTES: u64 = 8 << 20;

/// What the connection's fault loop tells its prefetcher: how many faults wait for the
/// fetch pool (the CRIU push yields to them), and, through the [`Detector`], when the rest
/// of the image is to be streamed. Shared by the fault loop (writes), the stream and the
/// CRIU push (read). The stream's share of the link is [`crate::pacing`]'s: it measures
/// what the faults' requests meet rather than counting them.
pub(crate) struct Demand {
    /// When the connection started: `go_at_us` counts from here.
    started: Instant,
    /// Faults waiting for the fetch pool.
    parked_faults: AtomicU64,
    /// Decides, from this connection's misses, when to stream the rest of the image
    /// (`--prefetch trace`); `None`: never from misses (`all` streams at once, `none` not).
    detector: Mutex<Option<Detector>>,
    /// Set once the rest of the image is to be streamed (the detector fired, or `all`).
    go: AtomicBool,
    /// Microseconds since `started` (+1) at which `go` was set; 0 not yet.
    go_at_us: AtomicU64,
    /// Set once the detector says the guest needs most of the image.
    needs_most: AtomicBool,
    /// Microseconds since `started` at which faults last waited for the fetch pool.
    busy_at_us: AtomicU64,
    /// A working-set replay is running (or waiting for its trace).
    replaying: AtomicBool,
    /// The stream is over (done, stopped, or there was none).
    stream_over: AtomicBool,
}

impl Demand {
    pub fn new(started: Instant, detector: Option<Detector>) -> Demand {
        Demand {
            started,
            parked_faults: AtomicU64::new(0),
            detector: Mutex::new(detector),
            go: AtomicBool::new(false),
            go_at_us: AtomicU64::new(0),
            needs_most: AtomicBool::new(false),
            busy_at_us: AtomicU64::new(0),
            replaying: AtomicBool::new(false),
            stream_over: AtomicBool::new(false),
        }
    }

    /// `faults` wait for the fetch pool now.
    pub fn publish(&self, faults: u64) {
        self.parked_faults.store(faults, Ordering::Relaxed);
        if faults > 0 {
            self.busy_at_us.store(self.started.elapsed().as_micros() as u64, Ordering::Relaxed);
        }
    }

    /// A working-set replay runs until the guard is dropped.
    pub fn replaying(me: &Arc<Demand>) -> Replaying {
        me.replaying.store(true, Ordering::Relaxed);
        Replaying(me.clone())
    }

    /// Whether the link is the fill's to use: no fault has waited for the fetch pool for
    /// `settle` (nor since the connection started), no working-set replay is running, and
    /// no stream of the rest is under way.
    pub fn quiet(&self, settle: Duration) -> bool {
        let since_busy = self.started.elapsed().saturating_sub(Duration::from_micros(self.busy_at_us.load(Ordering::Relaxed)));
        self.parked_faults() == 0
            && since_busy >= settle
            && !self.replaying.load(Ordering::Relaxed)
            && (!self.going() || self.stream_over.load(Ordering::Relaxed))
    }

    /// Faults waiting for the fetch pool.
    pub fn parked_faults(&self) -> u64 {
        self.parked_faults.load(Ordering::Relaxed)
    }

    /// A fault had to wait for chunk `c` to be fetched: tell the detector, and let the
    /// stream of the rest go once it says the misses look scattered.
    pub fn missed(&self, c: u64) {
        let (fire, most) = match self.detector.lock().expect("poisoned").as_mut() {
            Some(d) => (d.miss(c), d.needs_most()),
            None => (false, false),
        };
        if fire {
            self.go();
        }
        if most {
            self.needs_most.store(true, Ordering::Relaxed);
        }
    }

    /// Whether the misses say the guest needs most of the image ([`NEEDS_MOST_AFTER`]).
    pub fn needs_most(&self) -> bool {
        self.needs_most.load(Ordering::Relaxed)
    }

    /// Let the stream of the rest of the image go (once; later calls do nothing).
    pub fn go(&self) {
        if !self.go.swap(true, Ordering::Relaxed) {
            self.go_at_us.store(self.started.elapsed().as_micros() as u64 + 1, Ordering::Relaxed);
        }
    }

    /// Whether the rest of the image is to be streamed.
    pub fn going(&self) -> bool {
        self.go.load(Ordering::Relaxed)
    }

    /// How long after the connection started the stream of the rest was let go.
    pub fn went_after(&self) -> Option<Duration> {
        match self.go_at_us.load(Ordering::Relaxed) {
            0 => None,
            us => Some(Duration::from_micros(us - 1)),
        }
    }
}

/// Held while a working-set replay runs (or is about to): the fill waits meanwhile.
pub(crate) struct Replaying(Arc<Demand>);

impl Drop for Replaying {
    fn drop(&mut self) {
        self.0.replaying.store(false, Ordering::Relaxed);
    }
}

/// Dropped when the stream of the rest is over (its thread's end, or at once with no
/// stream): the fill may go from then on.
pub(crate) struct StreamOver(pub Arc<Demand>);

impl Drop for StreamOver {
    fn drop(&mut self) {
        self.0.stream_over.store(true, Ordering::Relaxed);
    }
}

/// What the prefetcher did, for the connection's report.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct StreamRun {
    /// Most requests it kept in flight (0: it had nothing to do).
    pub depth: usize,
    /// Worker threads it started: one for each request that found every worker busy, so
    /// never more than `depth`.
    pub threads: usize,
    pub rtt: Option<Duration>,
}

/// One request of the stream: a run of chunks adjacent in their pack, whether they are the
/// rest's (not the trace's), and its room in the background's window.
type Job = (Vec<u64>, bool, Permit);

/// What a stream worker tells the dispatcher.
enum Event {
    /// A request's bytes arrived: its room in the window is free (installing them uses none
    /// of the link), so the dispatcher may send the next at once.
    Arrived,
    /// A request is done: this many bytes installed.
    Done(u64),
}

/// Install `order`'s chunks ahead of the guest, each through the fetcher's single-flight
/// path (a fault on a chunk being streamed waits for its bytes in that fetch; every chunk
/// is verified before it is installed and goes into the chunk cache), with as many
/// requests in flight as the background's window allows (`bg`, [`crate::pacing`]: the
/// faults' requests meet at most a small queue of the stream's bytes), at most `max_jobs`,
/// at no more than `rate` bytes per second (0: unbounded). The first `traced` are the trace's; the rest wait for
/// the [`Demand`]'s go. Until done, the connection ends or `stop` is set.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run(
    inst: Arc<Installer>,
    demand: Arc<Demand>,
    bg: Arc<Background>,
    order: Vec<u64>,
    traced: usize,
    max_jobs: usize,
    rate: u64,
    stop: Arc<AtomicBool>,
) -> StreamRun {
    let Some(&first) = order.first() else { return StreamRun::default() };
    // The path's delay with nothing of ours on it: the window's first base.
    let rtt = inst.fetcher.round_trip(first);
    if let Some(d) = rtt {
        bg.sample(Kind::Probe, d);
    }
    let (job_tx, job_rx) = mpsc::channel::<Job>();
    let job_rx = Mutex::new(job_rx);
    let (done_tx, done_rx) = mpsc::channel::<Event>();
    let ended = || stop.load(Ordering::Relaxed) || inst.gone();
    std::thread::scope(|s| {
        // A worker per request in flight, started when a request finds every worker busy:
        // a guest whose stream never starts costs no threads, and none start beside its
        // first faults.
        let mut start = || {
            let (inst, job_rx, done_tx) = (&inst, &job_rx, done_tx.clone());
            std::thread::Builder::new().name("lazy-stream".into()).spawn_scoped(s, move || worker(inst, job_rx, &done_tx)).is_ok()
        };
        let mut d = Dispatch {
            inst: &inst,
            bg: &bg,
            order: &order,
            traced,
            max_jobs,
            rate,
            t0: Instant::now(),
            next: 0,
            in_flight: 0,
            installed: 0,
            most: 0,
            workers: 0,
        };
        let (mut wanting, mut widened) = (None, false);
        while !ended() {
            if !widened && demand.needs_most() {
                bg.widen();
                widened = true;
            }
            // The probes run while there are requests to make.
            let work = d.next < order.len() && (d.next < traced || demand.going());
            if work && wanting.is_none() {
                wanting = Some(bg.wanting());
            } else if !work {
                wanting = None;
            }
            let Some(waiting_for_go) = d.send(&demand, &job_tx, &mut start) else { break };
            if d.next == order.len() && d.in_flight == 0 {
                break;
            }
            // Woken by a request's bytes arriving or its end; otherwise look again soon (the
            // window may have grown, the detector may have fired, the rate may allow more).
            let nap = if waiting_for_go && d.in_flight == 0 { Duration::from_millis(20) } else { Duration::from_millis(2) };
            if !d.collect(&done_rx, nap) {
                break;
            }
        }
        drop(wanting);
        drop(job_tx);
        StreamRun { depth: d.most, threads: d.workers, rtt }
    })
}

/// A stream worker: take requests until the dispatcher is gone.
fn worker(inst: &Installer, jobs: &Mutex<mpsc::Receiver<Job>>, events: &mpsc::Sender<Event>) {
    loop {
        let Ok((run, rest, permit)) = jobs.lock().expect("poisoned").recv() else { return };
        // The request's room in the window goes back once its bytes have arrived: checking
        // and installing them uses none of the link.
        let (bytes, chunks) = inst.prefetch_run(&run, || {
            drop(permit);
            let _ = events.send(Event::Arrived);
        });
        if rest && bytes > 0 {
            inst.rec.add(|k| &k.streamed_chunks, chunks);
            inst.rec.add(|k| &k.streamed_bytes, bytes);
        }
        if events.send(Event::Done(bytes)).is_err() {
            return;
        }
    }
}

/// The stream's dispatcher: where it is in the order, and what it has in flight.
struct Dispatch<'a> {
    inst: &'a Installer,
    bg: &'a Arc<Background>,
    order: &'a [u64],
    traced: usize,
    max_jobs: usize,
    rate: u64,
    t0: Instant,
    /// The next chunk of `order` to look at.
    next: usize,
    in_flight: usize,
    /// Bytes installed so far (for the rate).
    installed: u64,
    /// Most requests in flight at once.
    most: usize,
    workers: usize,
}

impl Dispatch<'_> {
    /// Send requests while the window has room: `Some(true)` when the rest waits for the
    /// detector's go, `None` when no request can ever be taken (no worker, or they are gone).
    fn send(&mut self, demand: &Demand, jobs: &mpsc::Sender<Job>, start: &mut dyn FnMut() -> bool) -> Option<bool> {
        while self.in_flight < self.max_jobs && self.next < self.order.len() {
            if self.next >= self.traced && !demand.going() {
                return Some(true);
            }
            // Stay under the rate: the bytes installed so far were due by now.
            if self.rate > 0 && Duration::from_secs_f64(self.installed as f64 / self.rate as f64) > self.t0.elapsed() {
                break;
            }
            if !self.inst.chunk_pending(self.order[self.next]) {
                // Installed by a fault or the replay meanwhile.
                self.next += 1;
                continue;
            }
            let (run, bytes) = self.next_run();
            let Some(permit) = self.bg.try_acquire(bytes, Class::Stream) else { break };
            if self.in_flight >= self.workers && self.workers < self.max_jobs.max(1) && start() {
                self.workers += 1;
            }
            if self.workers == 0 {
                // Out of threads: nothing would ever take the request.
                return None;
            }
            let n = run.len();
            jobs.send((run, self.next >= self.traced, permit)).ok()?;
            self.next += n;
            self.in_flight += 1;
            self.most = self.most.max(self.in_flight);
        }
        Some(false)
    }

    /// The chunks from `order[next]` (pending) that one range request reads, and their
    /// bytes on the wire: adjacent in their pack and still pending, within the trace's part
    /// or the rest's, at most half the window (see [`RUN_BYTES`]): in a buffer that queues
    /// every byte, a fault's response waits behind the window's bytes, so a run is no more
    /// than the share of the window the next fault may meet.
    fn next_run(&self) -> (Vec<u64>, u64) {
        let (f, c) = (&self.inst.fetcher, self.order[self.next]);
        let end = if self.next < self.traced { self.traced } else { self.order.len() };
        let most_bytes = run_bytes(self.bg.window(), f.wire_bytes(c));
        let (mut run, mut bytes) = (vec![c], f.wire_bytes(c));
        while let Some(&d) = self.order.get(self.next + run.len()) {
            let b = f.wire_bytes(d);
            if self.next + run.len() >= end || bytes + b > most_bytes || !f.adjacent(run[run.len() - 1], d) || !self.inst.chunk_pending(d) {
                break;
            }
            run.push(d);
            bytes += b;
        }
        (run, bytes)
    }

    /// Wait up to `nap` for a request's bytes to arrive or a request to end, and take every
    /// event waiting. False once the workers are gone.
    fn collect(&mut self, events: &mpsc::Receiver<Event>, nap: Duration) -> bool {
        let mut take = |e: Event| {
            if let Event::Done(b) = e {
                self.in_flight -= 1;
                self.installed += b;
            }
        };
        match events.recv_timeout(nap) {
            Ok(e) => {
                take(e);
                while let Ok(e) = events.try_recv() {
                    take(e);
                }
                true
            }
            Err(mpsc::RecvTimeoutError::Timeout) => true,
            Err(mpsc::RecvTimeoutError::Disconnected) => false,
        }
    }
}

/// Most bytes of one stream request with the background's window at `window`: half of it,
/// at most [`RUN_BYTES`], at least the one chunk (`chunk` bytes) it starts with.
pub(crate) fn run_bytes(window: u64, chunk: u64) -> u64 {
    (window / 2).min(RUN_BYTES).max(chunk)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream request is at most half the window (so a fault behind a full window of the
    /// stream's bytes waits behind two requests' worth at most), at most `RUN_BYTES`, and
    /// always the chunk it starts with.
    #[test]
    fn a_stream_request_is_at_most_half_the_window_and_at_least_its_chunk() {
        const MIB: u64 = 1 << 20;
        assert_eq!(run_bytes(6 * MIB, MIB), 3 * MIB);
        assert_eq!(run_bytes(64 * MIB, MIB), RUN_BYTES);
        assert_eq!(run_bytes(MIB, MIB), MIB, "a window of one chunk still sends it");
        assert_eq!(run_bytes(0, MIB), MIB);
    }

    #[test]
    fn prefetch_and_stream_orders_put_the_trace_first() {
        let (_d, _mem, image, _layout) = crate::fetch::tests::sample_image(6);
        let file = image.file("vm.mem").unwrap().0;
        // Order: trace first (zero chunks and repeats dropped), then the rest with `all`.
        // (Chunks 1 and 4 of the sample are zero.)
        let t = Trace::new("vm.mem", 1 << 16, vec![5, 1, 5, 0, 4]);
        assert_eq!(prefetch_order(PrefetchMode::Trace, Some(&t), &image, file), vec![5, 0]);
        assert_eq!(prefetch_order(PrefetchMode::All, Some(&t), &image, file), vec![5, 0, 2, 3]);
        assert_eq!(prefetch_order(PrefetchMode::All, None, &image, file), vec![0, 2, 3, 5]);
        assert!(prefetch_order(PrefetchMode::None, Some(&t), &image, file).is_empty());
        // The stream's order: the trace's chunks first, then the rest; none: nothing.
        assert_eq!(stream_order(PrefetchMode::Trace, Some(&t), &image, file), (vec![5, 0, 2, 3], 2));
        assert_eq!(stream_order(PrefetchMode::All, None, &image, file), (vec![0, 2, 3, 5], 0));
        assert_eq!(stream_order(PrefetchMode::None, Some(&t), &image, file), (vec![], 0));
    }

    /// The chunks whose first fault must wait for a fetch, in order, for a guest touching
    /// `pct` % of the pages of a `chunks` x 256-page file (every other chunk zero, as
    /// bench/wan.sh's half-zero image), singly at random or in runs of `run` contiguous pages
    /// touched in random order (fake_vmm's two patterns): a chunk faults once, on its first
    /// touch, and then is installed whole.
    fn data_misses(chunks: u64, pct: u64, run: u64, seed: u64) -> Vec<u64> {
        let pages = chunks * 256;
        let mut x = seed;
        let mut rnd = move || {
            // SplitMix64.
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        let want = pages * pct / 100;
        let mut picked = vec![false; pages as usize];
        let mut touches = Vec::new();
        while (touches.len() as u64) < want {
            let start = rnd() % (pages - run + 1);
            for p in start..start + run {
                if !picked[p as usize] && (touches.len() as u64) < want {
                    picked[p as usize] = true;
                    touches.push(p);
                }
            }
        }
        for i in (1..touches.len()).rev() {
            touches.swap(i, (rnd() % (i as u64 + 1)) as usize);
        }
        let mut installed = vec![false; chunks as usize];
        let mut out = Vec::new();
        for p in touches {
            let c = p / 256;
            if !std::mem::replace(&mut installed[c as usize], true) && c % 2 == 0 {
                out.push(c);
            }
        }
        out
    }

    #[test]
    fn detector_streams_for_scattered_misses_not_for_clustered_ones() {
        let (chunks, data) = (2048, 1024);
        for seed in 1..=5 {
            // Scattered 5 %: nearly every data chunk misses; the detector fires at 30 % of
            // them, early in the restore.
            let scattered = data_misses(chunks, 5, 1, seed);
            assert!(scattered.len() as u64 > data * 9 / 10, "{}", scattered.len());
            let mut d = Detector::with_counts(chunks, data, REPLAY_STREAM_AFTER);
            let fired: Vec<usize> = scattered.iter().enumerate().filter(|(_, &c)| d.miss(c)).map(|(i, _)| i).collect();
            assert_eq!(fired, vec![(data as f64 * REPLAY_STREAM_AFTER).ceil() as usize - 1], "fires once, at the threshold");
            // The default for a cold restore fires at the MIN_MISSES-th miss.
            let mut d = Detector::with_counts(chunks, data, DEFAULT_STREAM_AFTER);
            let fired: Vec<usize> = scattered.iter().enumerate().filter(|(_, &c)| d.miss(c)).map(|(i, _)| i).collect();
            assert_eq!(fired, vec![MIN_MISSES as usize - 1]);
            // Clustered 5 % (runs of 64 pages): about a quarter of the data chunks, never
            // enough to stream.
            // Needing most of the image: at 15 % of the data chunks, for the scattered guest;
            // never for one clustered in runs of 256 pages (bench/wan.sh's clustered guest).
            let mut d = Detector::with_counts(chunks, data, DEFAULT_STREAM_AFTER);
            let first = scattered.iter().position(|&c| {
                d.miss(c);
                d.needs_most()
            });
            assert_eq!(first, Some((data as f64 * NEEDS_MOST_AFTER).ceil() as usize - 1), "needs most from the 15 % miss on");
            let wide = data_misses(chunks, 5, 256, seed);
            let mut d = Detector::with_counts(chunks, data, DEFAULT_STREAM_AFTER);
            wide.iter().for_each(|&c| {
                d.miss(c);
            });
            assert!(!d.needs_most(), "seed {seed}: runs of 256 pages missed {} of {data} data chunks", wide.len());
            let clustered = data_misses(chunks, 5, 64, seed);
            assert!((data / 8..data * 3 / 10).contains(&(clustered.len() as u64)), "{}", clustered.len());
            let mut d = Detector::with_counts(chunks, data, REPLAY_STREAM_AFTER);
            assert!(!clustered.iter().any(|&c| d.miss(c)), "seed {seed}: {} of {data} data chunks", clustered.len());
            assert_eq!(d.missed(), clustered.len() as u64);
        }
        // Repeats count once; a tiny file still needs MIN_MISSES (or all its data chunks);
        // a share above 1 never fires; 0 fires at the MIN_MISSES-th miss.
        let mut d = Detector::with_counts(100, 100, 0.0);
        assert!(!(0..MIN_MISSES - 1).chain([0, 0, 1]).any(|c| d.miss(c)));
        assert!(d.miss(MIN_MISSES - 1));
        assert!(!d.miss(99), "only once");
        let mut d = Detector::with_counts(6, 3, 0.3);
        assert_eq!((d.miss(0), d.miss(2), d.miss(4)), (false, false, true));
        let mut d = Detector::with_counts(100, 100, f64::INFINITY);
        assert!(!(0..100).any(|c| d.miss(c)));
        assert!(!d.miss(1000), "chunks beyond the file are ignored");
    }

    /// The fault loop's side of the stream: what it publishes is what the stream reads,
    /// and its misses let the stream go once the detector fires (once, with its time).
    #[test]
    fn demand_carries_the_faults_waits_and_lets_the_stream_go_once() {
        let t0 = Instant::now();
        let d = Demand::new(t0, Some(Detector::with_counts(100, 100, 0.0)));
        assert_eq!((d.parked_faults(), d.going(), d.went_after()), (0, false, None));
        d.publish(5);
        assert_eq!(d.parked_faults(), 5);
        for c in 0..MIN_MISSES - 1 {
            d.missed(c);
        }
        d.missed(0);
        assert!(!d.going(), "{} distinct misses are not enough", MIN_MISSES - 1);
        d.missed(MIN_MISSES);
        assert!(d.going());
        assert!(!d.needs_most(), "{} of 100 data chunks missed", MIN_MISSES + 1);
        (0..100).for_each(|c| d.missed(c));
        assert!(d.needs_most(), "all of them missed");
        let at = d.went_after().expect("the time it went");
        assert!(at <= t0.elapsed());
        d.go();
        assert_eq!(d.went_after(), Some(at), "going twice keeps the first time");
        // Without a detector, misses never let it go; `go` does (`--prefetch all`).
        let d = Demand::new(Instant::now(), None);
        (0..100).for_each(|c| d.missed(c));
        assert!(!d.going() && !d.needs_most());
        d.go();
        assert!(d.going());
    }
}
