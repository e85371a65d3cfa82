//! The background class's share of the link: the stream of the rest of the image and the
//! working-set replay are *scavengers*, using the link only as far as they do not delay
//! the guest's faults. Delay-based, as LEDBAT (RFC 6817) paces BitTorrent's uTP and OS
//! update services: keep the queueing delay a fault's request would meet under a small
//! target, and let the background's window grow while it is under, shrink while it is over.
//!
//! ```text
//! samples: the faults' own slice fetches (4 KiB, as they happen), and, while the
//!   background has work, a probe thread's tiny requests (HEAD of a pack) on the faults'
//!   client, PROBES_PER_RTT per round trip
//!     -> base delay of each kind: the least time seen (per minute, the last BASE_MINUTES)
//!     -> queueing = time - its kind's base; current = least of the last CURRENT_FILTER
//!     -> Ledbat::sample -> window (bytes)
//!   a fault's slice YIELD_TARGETS over its base with background bytes in flight
//!     -> Ledbat::fault_waited: the window halves at once
//! faults' fetches: counted against the window while in flight (they take it first)
//! stream / replay: Background::acquire(bytes) before each request, released when its bytes
//!   have arrived (the stream: before they are installed; the replay: once installed),
//!   while the window holds it beside the faults' bytes; the replay goes before the stream
//! fill: the same window, after the replay (and it waits while the stream streams)
//! ```
//!
//! Why delay, measured on the faults' own path: a fault's request waits behind whatever
//! the bottleneck holds of the background's bytes, in whatever way the bottleneck queues
//! them (a FIFO buffer, a queue per connection, a shallow buffer that drops). Its time on
//! the wire is what matters, so that is what is measured: the faults' slice fetches
//! themselves while there are any, and probes (a request as small as the faults' on the
//! client the faults use) so the window is right before the next fault comes. Each kind is
//! compared with its own base, so a probe's and a slice's different costs at the server do
//! not read as queueing. The window is counted in bytes of requests in flight, as LEDBAT
//! counts a congestion window, with one whole chunk as its segment; the faults' own fetches
//! in flight count against it first, so a bottleneck that shares its rate between
//! connections (a queue per connection, as `netem`'s and fair-queueing routers) gives the
//! faults' chunks the link rather than a share of it beside the stream.
//!
//! The constants, and why (spec/lazy.md "Pacing the background"):
//! - [`TARGET_SHARE`] (10 %) of the base delay, at least [`MIN_TARGET`], widened to
//!   [`WIDE_TARGET_SHARE`] (50 %) once the guest's misses say it needs most of the image
//!   (its restore then waits for the stream's bytes, not for a fault's): the stream may add
//!   at most a quarter of the round trip to a fault's wait. The window holds the queue
//!   about its target, not under it (the filter takes the least of several samples, and a
//!   fault's slice also waits behind a piece of each request in flight): at 20 % a fault's
//!   median wait grew by 7 ms at RTT 20 ms, over the quarter; at 10 % by 1-4 ms (the
//!   bottleneck tests in `tests.rs`). RFC 6817's TARGET is an upper bound (100 ms) for links
//!   of unknown delay; ours is known from the probes.
//! - [`GAIN`] 1 (RFC 6817: at most 1): at full distance from the target the window grows by
//!   one chunk per round trip, and shrinks in proportion to how far over it is.
//! - Slow start while the latest sample's queueing delay is under half the target
//!   (LEDBAT++'s exit at a share of the target; the latest, not the filtered, so the exit is
//!   not late by the filter's length): the window doubles per round trip from
//!   [`INIT_WINDOW`] chunks.
//! - A sample that alone took a round trip more than its base, and at least [`LOSS_TARGETS`]
//!   targets more, the next back under half that, is taken as a loss (a shallow buffer
//!   dropped its bytes and TCP sent them again a round trip later): the window halves, once
//!   per round trip (RFC 6817 §2.4.2). When the next is as late the delay lasts: a deep
//!   buffer's queue, left to the delay law (halving on it empties the link).
//! - A fault's slice fetch [`YIELD_TARGETS`] targets over its base while the background has
//!   bytes in flight waited behind them: the window halves at once, unfiltered.
//! - The window grows only while it is used (RFC 6817's ALLOWED_INCREASE, per probe: to at
//!   most twice the bytes in flight and a chunk), and never beyond `--stream-jobs` chunks.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use imgfmt::{BlobSource, OciDigest};

/// Queueing delay the background may cause, as a share of the base delay (the round trip).
pub const TARGET_SHARE: f64 = 0.1;
/// The same once the guest's misses say it needs most of the image
/// ([`crate::prefetch::NEEDS_MOST_AFTER`]): the stream's progress is then that guest's
/// restore time, and a fault's wait is worth less than the stream's bytes. Measured at
/// 20 ms and 1 Gbit/s with two vCPUs (bench/wan.sh, 2 GiB, scattered): 10 % throughout
/// took 1.28-1.48x a pull, 20 % throughout 0.96-1.0x, while a clustered guest's first
/// touches (which never widen) would have waited 4-6 ms more at 20 %, over a quarter of
/// the round trip. On a deep buffer (one FIFO that takes every byte) 20 % was not enough:
/// the stream's responses enter the queue as bursts that the filter's least sample hides,
/// the window stayed near the bandwidth-delay product and the link idled between bursts
/// (1 GiB, two vCPUs: 1.14-1.24x a pull). Half the base delay: 1.12x (the faults' p99
/// 53 -> 72 ms); the whole base delay: 1.10x (p99 98 ms).
pub const WIDE_TARGET_SHARE: f64 = 0.5;
/// Least target: the bottleneck moves bytes in pieces (a packet train, `netem`'s ~1 ms
/// pieces), and on a loaded host a probe's time varies by about this much without any
/// queue; a target below it would see queueing that is not there.
pub const MIN_TARGET: Duration = Duration::from_millis(2);
/// RFC 6817's GAIN: the window's change per round trip at full distance from the target, in
/// chunks.
pub const GAIN: f64 = 1.0;
/// Chunks in the window at the start (RFC 6817's INIT_CWND is 2 segments).
pub const INIT_WINDOW: f64 = 2.0;
/// Samples whose least queueing delay is the current one (RFC 6817's CURRENT_FILTER).
pub const CURRENT_FILTER: usize = 4;
/// Minutes of least delays kept for the base (RFC 6817's BASE_HISTORY).
pub const BASE_MINUTES: usize = 10;
/// A sample this many targets over its base (and a round trip over it) is a loss.
pub const LOSS_TARGETS: f64 = 4.0;
/// The least round trip the window's growth is timed by (on loopback the round trip is tens
/// of microseconds: growth per round trip would be a spin).
pub const PROBE_GAP: Duration = Duration::from_millis(10);
/// Probes per round trip while the background has work: the filter ([`CURRENT_FILTER`]
/// samples) then spans about one round trip, so a queue building in a buffer that takes
/// every byte (no loss, no backpressure, only delay) is seen within a round trip of
/// building rather than after several, when the window has already doubled past it.
pub const PROBES_PER_RTT: u32 = 4;
/// Least time between probes (on loopback a probe per quarter round trip would be most of
/// the traffic).
pub const MIN_PROBE_GAP: Duration = Duration::from_millis(5);
/// A fault's slice fetch this many targets over its base, with the background's bytes in
/// flight, waited behind them: the window is halved at once (once per round trip), without
/// waiting for the filter; not once the target is widened (that guest waits for the
/// stream's bytes more than for any one fault's).
pub const YIELD_TARGETS: f64 = 2.0;

/// What a delay sample timed: each kind has a base of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A probe: the smallest request (the path's round trip, and the server's least work).
    Probe = 0,
    /// A fault's slice fetch (a 4 KiB range, verified).
    Slice = 1,
}

/// RFC 6817's controller over requests: a window of bytes the background may have in
/// flight, moved by the queueing delay samples measure. Pure: time and samples come in.
#[derive(Debug, Clone)]
pub struct Ledbat {
    /// Bytes of one request (a chunk): the window's segment.
    chunk: f64,
    /// Most bytes in flight (`--stream-jobs` chunks).
    max: f64,
    /// The target's share of the base delay: [`TARGET_SHARE`], widened to
    /// [`WIDE_TARGET_SHARE`].
    share: f64,
    window: f64,
    slow_start: bool,
    /// Per [`Kind`]: (minute it began, least delay in it), oldest first.
    base: [VecDeque<(Instant, Duration)>; 2],
    /// The last queueing delays.
    current: VecDeque<Duration>,
    last: Option<Instant>,
    last_cut: Option<Instant>,
    /// A sample a round trip over its base, not yet told apart: a loss if the next sample is
    /// back under half that, a lasting queue (a deep buffer) if it is not.
    suspect: Option<Instant>,
    /// Cuts taken: losses (window halved) and faults that waited behind the background.
    pub cuts: u64,
    /// Probes taken.
    pub samples: u64,
}

impl Ledbat {
    /// A controller for requests of `chunk` bytes, at most `max_requests` in flight.
    pub fn new(chunk: u64, max_requests: usize) -> Ledbat {
        let chunk = chunk.max(1) as f64;
        let max = chunk * max_requests.max(1) as f64;
        Ledbat {
            chunk,
            max,
            share: TARGET_SHARE,
            window: (INIT_WINDOW * chunk).min(max),
            slow_start: true,
            base: [VecDeque::new(), VecDeque::new()],
            current: VecDeque::new(),
            last: None,
            last_cut: None,
            suspect: None,
            cuts: 0,
            samples: 0,
        }
    }

    /// The least delay seen (the path's delay with nothing queued): of probes, or of slice
    /// fetches before any probe came back.
    pub fn base(&self) -> Option<Duration> {
        self.base_of(Kind::Probe).or(self.base_of(Kind::Slice))
    }

    fn base_of(&self, kind: Kind) -> Option<Duration> {
        self.base[kind as usize].iter().map(|&(_, d)| d).min()
    }

    /// The queueing delay now: the least of the last samples'.
    pub fn queueing(&self) -> Option<Duration> {
        self.current.iter().min().copied()
    }

    /// The queueing delay the background may cause.
    pub fn target(&self) -> Duration {
        self.base().map_or(MIN_TARGET, |b| b.mul_f64(self.share).max(MIN_TARGET))
    }

    /// Let the background cause [`WIDE_TARGET_SHARE`] of the base delay from now on.
    pub fn widen(&mut self) {
        self.share = self.share.max(WIDE_TARGET_SHARE);
    }

    /// Whether [`widen`](Self::widen) was called.
    pub fn widened(&self) -> bool {
        self.share > TARGET_SHARE
    }

    /// Bytes the background may have in flight.
    pub fn window(&self) -> u64 {
        self.window as u64
    }

    /// The round trip that times the window's growth.
    fn round_trip(&self) -> Duration {
        self.base().unwrap_or(PROBE_GAP).max(PROBE_GAP)
    }

    /// Time between probes: [`PROBES_PER_RTT`] per round trip, at least [`MIN_PROBE_GAP`].
    pub fn probe_gap(&self) -> Duration {
        (self.round_trip() / PROBES_PER_RTT).max(MIN_PROBE_GAP)
    }

    /// Cut the window by `factor`, once per round trip.
    fn cut(&mut self, factor: f64, now: Instant) {
        if self.last_cut.is_none_or(|c| now.saturating_duration_since(c) >= self.round_trip()) {
            self.window *= factor;
            self.last_cut = Some(now);
            self.cuts += 1;
        }
        self.slow_start = false;
    }

    /// A fault's slice fetch met `queueing` over its base with `background` bytes of the
    /// background's requests in flight: if it waited [`YIELD_TARGETS`] targets or more and
    /// the background had bytes ahead of it, halve the window (once per round trip). Not
    /// once [`widen`](Self::widen)ed: that guest waits for the stream's bytes more than for
    /// any one fault's, and halving on each wait slowed its restore.
    pub fn fault_waited(&mut self, queueing: Duration, now: Instant, background: u64) {
        if !self.widened() && background > 0 && queueing >= self.target().mul_f64(YIELD_TARGETS) {
            tracing::debug!(queueing_ms = queueing.as_secs_f64() * 1e3, window = self.window as u64, "pacing: a fault waited behind the background");
            self.cut(0.5, now);
        }
    }

    /// A request of `kind` sent at `now - took` came back at `now`, with `inflight` bytes
    /// of the background's requests in flight. Moves the window.
    pub fn sample(&mut self, kind: Kind, took: Duration, now: Instant, inflight: u64) {
        self.samples += 1;
        // Base: least delay per minute, the last BASE_MINUTES minutes.
        let history = &mut self.base[kind as usize];
        match history.back_mut() {
            Some((began, least)) if now.saturating_duration_since(*began) < Duration::from_secs(60) => *least = (*least).min(took),
            _ => {
                history.push_back((now, took));
                if history.len() > BASE_MINUTES {
                    history.pop_front();
                }
            }
        }
        let base = self.base_of(kind).expect("just set");
        let raw = took.saturating_sub(base);
        self.current.push_back(raw);
        if self.current.len() > CURRENT_FILTER {
            self.current.pop_front();
        }
        let (target, rtt) = (self.target(), self.round_trip());
        let dt = self.last.map_or(Duration::ZERO, |l| now.saturating_duration_since(l)).min(rtt);
        self.last = Some(now);
        // A round trip over the base: a loss (a shallow buffer dropped the bytes and TCP sent
        // them again a round trip later) stands alone, the next sample back near the queue
        // the buffer holds; a deep buffer's queue lasts and grows, and is left to the delay
        // law below (halving on it would empty the queue and the link with it).
        let loss = base.max(target.mul_f64(LOSS_TARGETS));
        if raw >= loss {
            tracing::debug!(?kind, raw_ms = raw.as_secs_f64() * 1e3, window = self.window as u64, inflight, "pacing: a late sample");
            if self.suspect.is_none() {
                self.suspect = Some(now);
                self.slow_start = false;
                return;
            }
            self.suspect = None;
        } else if let Some(at) = self.suspect.take() {
            if raw < loss / 2 {
                tracing::debug!(
                    ?kind,
                    raw_ms = raw.as_secs_f64() * 1e3,
                    base_ms = base.as_secs_f64() * 1e3,
                    window = self.window as u64,
                    inflight,
                    "pacing: a loss"
                );
                self.cut(0.5, at);
                return;
            }
        }
        let queueing = self.queueing().expect("just set");
        let per_rtt = dt.as_secs_f64() / rtt.as_secs_f64();
        let grow = if self.slow_start && raw < target / 2 {
            self.window.max(self.chunk) * per_rtt
        } else {
            self.slow_start = false;
            let off = (target.as_secs_f64() - queueing.as_secs_f64()) / target.as_secs_f64();
            GAIN * off * self.chunk * per_rtt
        };
        let mut w = self.window + grow;
        if grow > 0.0 {
            // Only a window in use grows (RFC 6817's ALLOWED_INCREASE, per probe rather than
            // per acknowledgement: to twice the bytes in flight and a chunk).
            w = w.min(self.window.max(2.0 * inflight as f64 + self.chunk));
        }
        self.window = w.clamp(0.0, self.max);
    }

    /// Whether a request of `bytes` may go with `inflight` bytes already in flight: it fits
    /// the window, or nothing is in flight and the window holds at least one chunk.
    pub fn allows(&self, inflight: u64, bytes: u64) -> bool {
        (inflight + bytes) as f64 <= self.window || (inflight == 0 && self.window >= self.chunk)
    }
}

/// Who asks for room: the replay's requests go before the stream's, and the fill's
/// ([`crate::fill`]) after both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    Replay,
    Stream,
    Fill,
}

/// What [`Background`] measured, for the connection's report.
#[derive(Debug, Clone, Copy, Default)]
pub struct PacingReport {
    pub base: Option<Duration>,
    pub target: Duration,
    pub probes: u64,
    pub cuts: u64,
    /// Most bytes the background had in flight at once.
    pub most_bytes: u64,
    /// The largest window reached.
    pub most_window: u64,
    /// The target was widened ([`Background::widen`]).
    pub widened: bool,
}

struct State {
    ledbat: Ledbat,
    /// Bytes of the background's requests in flight.
    inflight: u64,
    /// Bytes of the faults' fetches in flight: they take the window first.
    foreground: u64,
    most_bytes: u64,
    most_window: u64,
    replay_waiting: usize,
}

/// One connection's background class: its window, the requests in flight under it, and the
/// probes that move it. Shared by the stream and the working-set replay, and used by
/// `snapctl mount`'s fill (the `mount` crate) beside its readers' fetches.
pub struct Background {
    state: Mutex<State>,
    cv: Condvar,
    /// Users with requests to make: the probes run while there are any.
    wanting: AtomicUsize,
}

/// Room for one request; given back when dropped.
pub struct Permit {
    bg: Arc<Background>,
    bytes: u64,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut st = self.bg.state.lock().expect("poisoned");
        st.inflight -= self.bytes;
        drop(st);
        self.bg.cv.notify_all();
    }
}

/// A fault's fetch of `bytes` in flight: the background yields it that much of its window.
pub struct Foreground {
    bg: Arc<Background>,
    bytes: u64,
}

impl Drop for Foreground {
    fn drop(&mut self) {
        let mut st = self.bg.state.lock().expect("poisoned");
        st.foreground -= self.bytes;
        drop(st);
        self.bg.cv.notify_all();
    }
}

/// Held while a user of the background has requests to make (the probes run meanwhile).
pub struct Wanting(Arc<Background>);

impl Drop for Wanting {
    fn drop(&mut self) {
        self.0.wanting.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Background {
    pub fn new(chunk: u64, max_requests: usize) -> Arc<Background> {
        let ledbat = Ledbat::new(chunk, max_requests);
        let w = ledbat.window();
        Arc::new(Background {
            state: Mutex::new(State { ledbat, inflight: 0, foreground: 0, most_bytes: 0, most_window: w, replay_waiting: 0 }),
            cv: Condvar::new(),
            wanting: AtomicUsize::new(0),
        })
    }

    /// Say that requests are coming (probes run until the guard is dropped).
    pub fn wanting(self: &Arc<Self>) -> Wanting {
        self.wanting.fetch_add(1, Ordering::Relaxed);
        Wanting(self.clone())
    }

    /// A fault's fetch of `bytes` starts; it counts against the window until dropped.
    pub fn foreground(self: &Arc<Self>, bytes: u64) -> Foreground {
        self.state.lock().expect("poisoned").foreground += bytes;
        Foreground { bg: self.clone(), bytes }
    }

    /// Room for a request of `bytes` now, if the window has it (and, for the stream, no
    /// replay request is waiting).
    pub fn try_acquire(self: &Arc<Self>, bytes: u64, class: Class) -> Option<Permit> {
        let mut st = self.state.lock().expect("poisoned");
        self.take(&mut st, bytes, class)
    }

    fn take(self: &Arc<Self>, st: &mut State, bytes: u64, class: Class) -> Option<Permit> {
        if class != Class::Replay && st.replay_waiting > 0 {
            return None;
        }
        // The faults' fetches count against the window first: the background has what is
        // left of what the link takes at the target delay.
        if !st.ledbat.allows(st.inflight + st.foreground, bytes) {
            return None;
        }
        st.inflight += bytes;
        st.most_bytes = st.most_bytes.max(st.inflight);
        Some(Permit { bg: self.clone(), bytes })
    }

    /// Room for a request of `bytes`, waiting for it; `None` once `ended()` says so.
    pub fn acquire(self: &Arc<Self>, bytes: u64, class: Class, ended: &dyn Fn() -> bool) -> Option<Permit> {
        let mut st = self.state.lock().expect("poisoned");
        let replay = class == Class::Replay;
        if replay {
            st.replay_waiting += 1;
        }
        let got = loop {
            if ended() {
                break None;
            }
            if let Some(p) = self.take(&mut st, bytes, class) {
                break Some(p);
            }
            // Woken by a request ending or the window moving; looked at again meanwhile.
            st = self.cv.wait_timeout(st, Duration::from_millis(20)).expect("poisoned").0;
        };
        if replay {
            st.replay_waiting -= 1;
        }
        got
    }

    /// Bytes the background may have in flight now.
    pub fn window(&self) -> u64 {
        self.state.lock().expect("poisoned").ledbat.window()
    }

    /// The guest needs most of the image: widen the target (once; later calls do nothing).
    pub fn widen(&self) {
        self.state.lock().expect("poisoned").ledbat.widen();
    }

    /// A request of `kind` took `took`.
    pub fn sample(&self, kind: Kind, took: Duration) {
        let mut st = self.state.lock().expect("poisoned");
        // The window is in use by the faults' fetches as well as the background's.
        let inflight = st.inflight + st.foreground;
        let now = Instant::now();
        st.ledbat.sample(kind, took, now, inflight);
        if kind == Kind::Slice {
            // A fault's own wait, unfiltered: behind the background's bytes, it cuts at once.
            let waited = took.saturating_sub(st.ledbat.base_of(Kind::Slice).unwrap_or(took));
            let background = st.inflight;
            st.ledbat.fault_waited(waited, now, background);
        }
        st.most_window = st.most_window.max(st.ledbat.window());
        drop(st);
        self.cv.notify_all();
    }

    pub fn report(&self) -> PacingReport {
        let st = self.state.lock().expect("poisoned");
        PacingReport {
            base: st.ledbat.base(),
            target: st.ledbat.target(),
            probes: st.ledbat.samples,
            cuts: st.ledbat.cuts,
            most_bytes: st.most_bytes,
            most_window: st.most_window,
            widened: st.ledbat.widened(),
        }
    }

    /// Probe `blob` on `src` (the faults' source) while anyone wants to send, until
    /// `stop`: one request at a time, [`PROBES_PER_RTT`] per round trip, at least
    /// [`MIN_PROBE_GAP`] apart. A failed probe is not a
    /// sample (the faults' own retries deal with a failing source).
    pub fn probe(&self, src: &dyn BlobSource, blob: &OciDigest, stop: &AtomicBool) {
        while !stop.load(Ordering::Relaxed) {
            if self.wanting.load(Ordering::Relaxed) == 0 {
                std::thread::sleep(PROBE_GAP);
                continue;
            }
            let t = Instant::now();
            if src.blob_size(blob).is_ok() {
                self.sample(Kind::Probe, t.elapsed());
            }
            let gap = self.state.lock().expect("poisoned").ledbat.probe_gap().min(Duration::from_millis(100));
            if let Some(rest) = gap.checked_sub(t.elapsed()) {
                std::thread::sleep(rest);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// Feed `n` probes of `took` each, `every` apart from `t`, with `inflight` bytes in
    /// flight (the window's own, capped at it): the time after the last.
    fn feed(l: &mut Ledbat, t: Instant, n: usize, every: Duration, took: Duration) -> Instant {
        let mut now = t;
        for _ in 0..n {
            now += every;
            let inflight = l.window();
            l.sample(Kind::Probe, took, now, inflight);
        }
        now
    }

    #[test]
    fn the_target_is_a_share_of_the_base_delay_and_never_below_the_floor() {
        let mut l = Ledbat::new(MIB, 32);
        assert_eq!(l.target(), MIN_TARGET, "no probe yet");
        let t = Instant::now();
        l.sample(Kind::Probe, Duration::from_millis(100), t, 0);
        assert_eq!(l.target(), Duration::from_millis(10));
        l.sample(Kind::Probe, Duration::from_millis(50), t + Duration::from_millis(60), 0);
        assert_eq!((l.base(), l.target()), (Some(Duration::from_millis(50)), Duration::from_millis(5)), "the base is the least delay");
        let mut l = Ledbat::new(MIB, 32);
        l.sample(Kind::Probe, Duration::from_micros(300), t, 0);
        assert_eq!(l.target(), MIN_TARGET, "loopback");
    }

    /// A guest that needs most of the image widens the target to its wide share, once and
    /// for good; the floor still holds.
    #[test]
    fn regression_issue_23_widening_raises_the_target_to_the_wide_share() {
        let mut l = Ledbat::new(MIB, 32);
        let t = Instant::now();
        l.sample(Kind::Probe, Duration::from_millis(100), t, 0);
        assert_eq!(l.target(), Duration::from_millis(10));
        l.widen();
        assert_eq!(l.target(), Duration::from_millis(50));
        l.widen();
        assert_eq!(l.target(), Duration::from_millis(50), "widening twice is widening once");
        let mut l = Ledbat::new(MIB, 32);
        l.widen();
        l.sample(Kind::Probe, Duration::from_millis(3), t, 0);
        assert_eq!(l.target(), MIN_TARGET, "3 ms x 50 % is under the floor");
        // Through the shared state, as the stream's dispatcher widens it.
        let bg = Background::new(MIB, 32);
        bg.sample(Kind::Probe, Duration::from_millis(50));
        assert_eq!(bg.report().target, Duration::from_millis(5));
        bg.widen();
        assert_eq!(bg.report().target, Duration::from_millis(25));
    }

    #[test]
    fn an_empty_queue_grows_the_window_to_its_bound_and_a_full_one_shrinks_it() {
        let ms = Duration::from_millis;
        let mut l = Ledbat::new(MIB, 32);
        assert_eq!(l.window(), 2 * MIB);
        let t = Instant::now();
        // 20 ms of base delay and no queueing: slow start doubles the window per round trip,
        // up to 32 chunks in about 4 round trips.
        let t = feed(&mut l, t, 5 * 4, ms(5), ms(20));
        assert_eq!(l.window(), 32 * MIB, "grown to its bound");
        // A queue of 16 ms (eight targets of 2 ms; a round trip more would be a loss): once
        // the filter sees it (the least of 4 probes), the window shrinks by (16 - 2) / 2 = 7
        // chunks per round trip, 1.75 per probe 5 ms apart.
        let t = feed(&mut l, t, 8, ms(5), ms(36));
        let w = l.window() as f64 / MIB as f64;
        assert!((22.0..=25.0).contains(&w), "{w}");
        let t = feed(&mut l, t, 60, ms(5), ms(36));
        assert_eq!(l.window(), 0, "a lasting queue stops the background");
        assert_eq!(l.cuts, 0);
        // The queue gone: the window comes back, one chunk per round trip (no slow start).
        let _ = feed(&mut l, t, 4 * 5, ms(5), ms(20));
        let w = l.window() as f64 / MIB as f64;
        assert!((4.0..=6.0).contains(&w), "{w}");
    }

    #[test]
    fn the_window_settles_where_the_queue_meets_the_target() {
        // A FIFO bottleneck of 125 MB/s (1 Gbit/s) and 20 ms: the background's bytes beyond
        // the bandwidth-delay product queue, each MiB 8.4 ms. The window settles where that
        // queue is about the 2 ms target: about 2.5 MB + 0.25 MB, under 3 chunks.
        let mut l = Ledbat::new(MIB, 32);
        let (base, rate) = (Duration::from_millis(20), 125e6);
        let mut now = Instant::now();
        let mut windows = Vec::new();
        for _ in 0..2000 {
            now += Duration::from_millis(5);
            let inflight = l.window() as f64;
            let queue = ((inflight - rate * base.as_secs_f64()) / rate).max(0.0);
            l.sample(Kind::Probe, base + Duration::from_secs_f64(queue), now, l.window());
            windows.push(l.window());
        }
        let late = &windows[1000..];
        let (lo, hi) = (*late.iter().min().unwrap(), *late.iter().max().unwrap());
        assert!(lo >= 2 * MIB && hi <= 4 * MIB, "settled between {:.1} and {:.1} MiB", lo as f64 / MIB as f64, hi as f64 / MIB as f64);
    }

    #[test]
    fn each_kind_of_sample_is_measured_against_its_own_base() {
        let ms = Duration::from_millis;
        let mut l = Ledbat::new(MIB, 32);
        let t = feed(&mut l, Instant::now(), 40, ms(5), ms(20));
        assert_eq!((l.window(), l.queueing()), (32 * MIB, Some(Duration::ZERO)));
        // Slice fetches cost the server 3 ms more than a probe: no queue.
        let mut now = t;
        for _ in 0..8 {
            now += ms(5);
            l.sample(Kind::Slice, ms(23), now, l.window());
        }
        assert_eq!((l.window(), l.queueing()), (32 * MIB, Some(Duration::ZERO)));
        // A slice 12 ms over its base: a queue of three targets, whoever measured it.
        l.sample(Kind::Slice, ms(35), now + ms(5), l.window());
        assert_eq!(l.queueing(), Some(Duration::ZERO), "filtered: one sample is not a queue yet");
        for i in 2..=4 {
            l.sample(Kind::Slice, ms(35), now + ms(5 * i), l.window());
        }
        assert_eq!(l.queueing(), Some(ms(12)));
        assert!(l.window() < 32 * MIB);
    }

    #[test]
    fn a_loss_halves_the_window_once_per_round_trip() {
        let ms = Duration::from_millis;
        let mut l = Ledbat::new(MIB, 32);
        let t = feed(&mut l, Instant::now(), 40, ms(5), ms(20));
        assert_eq!(l.window(), 32 * MIB);
        // A probe dropped at a shallow buffer: sent again a round trip later, so 41 ms; the
        // next is back near the base, so it stood alone: a loss.
        l.sample(Kind::Probe, ms(41), t + ms(5), l.window());
        assert_eq!((l.window(), l.cuts), (32 * MIB, 0), "one sample over is not told apart yet");
        l.sample(Kind::Probe, ms(21), t + ms(10), l.window());
        assert_eq!((l.window(), l.cuts), (16 * MIB, 1));
        // Another within the same round trip: the same loss event.
        l.sample(Kind::Probe, ms(41), t + ms(15), l.window());
        l.sample(Kind::Probe, ms(21), t + ms(20), l.window());
        assert_eq!((l.window(), l.cuts), (16 * MIB, 1));
        l.sample(Kind::Probe, ms(41), t + ms(40), l.window());
        l.sample(Kind::Probe, ms(21), t + ms(45), l.window());
        assert_eq!((l.window(), l.cuts), (8 * MIB, 2));
        // A noisy probe of a few ms over is a queue, not a loss.
        l.sample(Kind::Probe, ms(27), t + ms(80), l.window());
        l.sample(Kind::Probe, ms(21), t + ms(85), l.window());
        assert_eq!(l.cuts, 2);
    }

    /// A bottleneck that takes every byte into one FIFO (no loss, no backpressure): the
    /// background's bytes beyond the bandwidth-delay product queue, and every sample after
    /// them waits as long. Probes a quarter round trip apart see it.
    fn deep_buffer(l: &mut Ledbat, rounds: usize, fault_every: Option<usize>) -> (Vec<u64>, Vec<Duration>) {
        let (base, rate) = (Duration::from_millis(20), 125e6);
        let mut now = Instant::now();
        let (mut windows, mut waits) = (Vec::new(), Vec::new());
        // The window a round trip ago: a sample tells of the queue it passed through, which
        // the bytes sent then had built.
        let mut past: VecDeque<(Instant, u64)> = VecDeque::new();
        for i in 0..rounds {
            now += l.probe_gap();
            past.push_back((now, l.window()));
            while past.len() > 1 && now.duration_since(past[1].0) >= base {
                past.pop_front();
            }
            let queue = Duration::from_secs_f64(((past[0].1 as f64 - rate * base.as_secs_f64()) / rate).max(0.0));
            l.sample(Kind::Probe, base + queue, now, l.window());
            if fault_every.is_some_and(|n| i % n == 0) {
                // A fault's slice waits behind the same queue.
                waits.push(queue);
                l.fault_waited(queue, now, l.window());
            }
            windows.push(l.window());
        }
        (windows, waits)
    }

    /// A deep buffer holds no loss, only a growing delay: the window follows the queueing
    /// delay to about the target (never halved as if a round trip of delay were a loss), so
    /// a fault meets a queue of a few targets at most while the link stays full.
    #[test]
    fn regression_issue_37_a_deep_buffers_growing_delay_cuts_the_window_and_is_no_loss() {
        let mut l = Ledbat::new(MIB, 32);
        l.widen();
        let (windows, _) = deep_buffer(&mut l, 4000, None);
        let late = &windows[2000..];
        let mean = late.iter().sum::<u64>() as f64 / late.len() as f64 / MIB as f64;
        // 2.5 MB of bandwidth-delay product, plus the 4 ms target's 0.5 MB: about 2.9 MiB.
        eprintln!("mean {mean:.2} MiB, min {:.2}, max {:.2}", *late.iter().min().unwrap() as f64 / MIB as f64, *late.iter().max().unwrap() as f64 / MIB as f64);
        assert!((2.4..=3.6).contains(&mean), "settled about {mean:.1} MiB");
        assert_eq!(l.cuts, 0, "a lasting queue is not a loss");
        // Slow start's overshoot is seen within a few round trips: the most the window
        // reached is a few MiB over the product, not the bound.
        let most = *windows.iter().max().unwrap();
        assert!(most <= 10 * MIB, "{:.1} MiB", most as f64 / MIB as f64);
    }

    /// A fault's slice fetch that waited behind the background's bytes halves the window at
    /// once (once per round trip); a wait under twice the target, or with none of the
    /// background's bytes in flight, changes nothing.
    #[test]
    fn regression_issue_37_a_fault_waiting_behind_the_background_cuts_the_window() {
        let ms = Duration::from_millis;
        let mut l = Ledbat::new(MIB, 32);
        let t = feed(&mut l, Instant::now(), 40, ms(5), ms(20));
        assert_eq!((l.window(), l.target()), (32 * MIB, ms(2)));
        l.fault_waited(ms(3), t, 8 * MIB);
        l.fault_waited(ms(40), t, 0);
        assert_eq!((l.window(), l.cuts), (32 * MIB, 0), "under two targets, or nothing of the background ahead");
        l.fault_waited(ms(5), t, 8 * MIB);
        assert_eq!((l.window(), l.cuts), (16 * MIB, 1), "5 ms of wait against 2 ms of target");
        l.fault_waited(ms(5), t + ms(10), 8 * MIB);
        assert_eq!(l.cuts, 1, "once per round trip");
        l.fault_waited(ms(100), t + ms(30), 8 * MIB);
        assert_eq!((l.window(), l.cuts), (8 * MIB, 2), "the next round trip");
        // A guest that needs most of the image waits for the stream: its faults cut nothing.
        l.widen();
        l.fault_waited(ms(100), t + ms(60), 8 * MIB);
        assert_eq!((l.window(), l.cuts), (8 * MIB, 2), "widened");
        // Through the shared state: a slice sample with the background's bytes in flight.
        let bg = Background::new(MIB, 32);
        for _ in 0..3 {
            bg.sample(Kind::Slice, ms(20));
        }
        let w = bg.window();
        let _permit = bg.try_acquire(MIB, Class::Stream).expect("room");
        bg.sample(Kind::Slice, ms(30));
        assert!(bg.window() < w && bg.report().cuts == 1, "{} of {w}", bg.window());
    }

    /// Where the delay does not grow (a bottleneck that queues per connection, as the
    /// window model's), the window model is unchanged: probes a quarter round trip apart grow
    /// it to its bound as before, and faults' slices that meet no queue cut nothing.
    #[test]
    fn regression_issue_37_without_a_growing_delay_the_window_grows_as_before() {
        let mut l = Ledbat::new(MIB, 32);
        assert_eq!(l.probe_gap(), MIN_PROBE_GAP, "no base yet: a quarter of the least round trip, at least the floor");
        let mut now = Instant::now();
        l.sample(Kind::Probe, Duration::from_millis(20), now, 0);
        assert_eq!(l.probe_gap(), Duration::from_millis(5), "a quarter of 20 ms");
        for _ in 0..200 {
            now += l.probe_gap();
            l.sample(Kind::Probe, Duration::from_millis(20), now, l.window());
            l.fault_waited(Duration::from_millis(1), now, l.window());
        }
        assert_eq!((l.window(), l.cuts), (32 * MIB, 0));
        // Faults meet the queue of a deep buffer whose window is held: a few targets at most.
        let mut l = Ledbat::new(MIB, 32);
        let (_, waits) = deep_buffer(&mut l, 4000, Some(10));
        let late = &waits[200..];
        let mut sorted = late.to_vec();
        sorted.sort();
        let p90 = sorted[sorted.len() * 9 / 10];
        let p50 = sorted[sorted.len() / 2];
        eprintln!("p50 {p50:?} p90 {p90:?}");
        assert!(p50 <= Duration::from_millis(4) && p90 <= Duration::from_millis(12), "a fault's wait: median {p50:?}, 90th percentile {p90:?}");
    }

    #[test]
    fn an_idle_background_does_not_grow_its_window_and_a_small_window_still_sends_one() {
        let ms = Duration::from_millis;
        let mut l = Ledbat::new(MIB, 32);
        let mut now = Instant::now();
        for _ in 0..100 {
            now += ms(5);
            l.sample(Kind::Probe, ms(20), now, 0);
        }
        assert_eq!(l.window(), 2 * MIB, "nothing in flight: at most one chunk beyond it, and it had two");
        assert!(l.allows(0, MIB) && l.allows(MIB, MIB) && !l.allows(2 * MIB, MIB));
        let mut small = Ledbat::new(MIB, 32);
        small.window = 1.5 * MIB as f64;
        assert!(small.allows(0, 4 * MIB), "a request larger than the window goes alone");
        assert!(!small.allows(MIB, MIB));
        small.window = 0.5 * MIB as f64;
        assert!(!small.allows(0, MIB), "less than a chunk: nothing");
    }

    #[test]
    fn the_replay_goes_before_the_stream() {
        let bg = Background::new(MIB, 2);
        let a = bg.try_acquire(MIB, Class::Stream).expect("room");
        let b = bg.try_acquire(MIB, Class::Replay).expect("room");
        assert!(bg.try_acquire(MIB, Class::Stream).is_none(), "the window is full");
        // A replay request waits for room; meanwhile the stream gets none, even once some
        // is free.
        let bg2 = bg.clone();
        let waiter = std::thread::spawn(move || bg2.acquire(MIB, Class::Replay, &|| false).map(|p| p.bytes));
        while bg.state.lock().unwrap().replay_waiting == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(a);
        assert_eq!(waiter.join().unwrap(), Some(MIB));
        drop(b);
        assert!(bg.try_acquire(MIB, Class::Stream).is_some());
        assert_eq!(bg.report().most_bytes, 2 * MIB);
    }
}
