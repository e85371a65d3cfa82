//! Counters and the fault latency histogram: per connection (the `--json` summary) and for
//! the whole daemon (Prometheus text on `--metrics`).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::Serialize;

/// Sub-buckets per power of two: values are kept to within 1/8 (12.5 %).
const SUB_BITS: u32 = 3;
const SUB: u64 = 1 << SUB_BITS;
/// Enough buckets for any u64.
const BUCKETS: usize = (SUB as usize) * (64 - SUB_BITS as usize + 1);

/// A log-linear histogram of microsecond latencies, lock-free to record.
pub struct Histogram {
    buckets: Box<[AtomicU64]>,
    count: AtomicU64,
    sum: AtomicU64,
    max: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram { buckets: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(), count: AtomicU64::new(0), sum: AtomicU64::new(0), max: AtomicU64::new(0) }
    }
}

fn bucket_of(v: u64) -> usize {
    if v < SUB {
        return v as usize;
    }
    let e = 63 - v.leading_zeros(); // >= SUB_BITS
    let sub = (v >> (e - SUB_BITS)) & (SUB - 1);
    (SUB as usize) + ((e - SUB_BITS) as usize) * (SUB as usize) + sub as usize
}

/// Largest value that falls in bucket `b`.
fn bucket_upper(b: usize) -> u64 {
    if b < SUB as usize {
        return b as u64;
    }
    let e = (b - SUB as usize) / SUB as usize + SUB_BITS as usize;
    let sub = ((b - SUB as usize) % SUB as usize) as u64;
    let low = (SUB + sub) << (e - SUB_BITS as usize);
    low + ((1u64 << (e - SUB_BITS as usize)) - 1)
}

/// Percentiles of a histogram, in microseconds.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct Latency {
    pub p50: u64,
    pub p90: u64,
    pub p99: u64,
    pub max: u64,
}

impl Histogram {
    pub fn record(&self, us: u64) {
        self.buckets[bucket_of(us)].fetch_add(1, Relaxed);
        self.count.fetch_add(1, Relaxed);
        self.sum.fetch_add(us, Relaxed);
        self.max.fetch_max(us, Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.count.load(Relaxed)
    }

    /// The value at quantile `q` (0..=1): the upper bound of its bucket, never above the
    /// largest value recorded.
    pub fn quantile(&self, q: f64) -> u64 {
        let n = self.count();
        if n == 0 {
            return 0;
        }
        let rank = ((q * n as f64).ceil() as u64).clamp(1, n);
        let mut seen = 0;
        for (b, c) in self.buckets.iter().enumerate() {
            seen += c.load(Relaxed);
            if seen >= rank {
                return bucket_upper(b).min(self.max.load(Relaxed));
            }
        }
        self.max.load(Relaxed)
    }

    pub fn latency(&self) -> Latency {
        Latency { p50: self.quantile(0.5), p90: self.quantile(0.9), p99: self.quantile(0.99), max: self.max.load(Relaxed) }
    }

    /// Prometheus histogram lines (cumulative buckets at powers of two, in seconds).
    fn prometheus(&self, name: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} Time from reading a page fault to resolving it.\n# TYPE {name} histogram");
        let mut cum = 0u64;
        let mut b = 0usize;
        for p in 0..=26u32 {
            // Everything up to 2^p microseconds.
            let limit = 1u64 << p;
            while b < BUCKETS && bucket_upper(b) <= limit {
                cum += self.buckets[b].load(Relaxed);
                b += 1;
            }
            let _ = writeln!(out, "{name}_bucket{{le=\"{}\"}} {cum}", limit as f64 / 1e6);
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count());
        let _ = writeln!(out, "{name}_sum {}", self.sum.load(Relaxed) as f64 / 1e6);
        let _ = writeln!(out, "{name}_count {}", self.count());
    }
}

/// What a connection (or the daemon) did.
#[derive(Default)]
pub struct Counters {
    /// Faults resolved with zeros: zero chunks and removed ranges.
    pub zero: AtomicU64,
    /// Faults whose chunk came from the chunk cache, memory, or another connection's fetch.
    pub cache_hit: AtomicU64,
    /// Faults whose chunk was fetched from the source by this fault.
    pub fetched: AtomicU64,
    /// Faults on pages already installed by the time they were read (another vCPU's fault
    /// or the prefetcher got there first): only a wake-up was needed.
    pub present: AtomicU64,
    /// Faults served with zeros because the guest had removed the range.
    pub removed_zero: AtomicU64,
    pub bytes_fetched: AtomicU64,
    pub retries: AtomicU64,
    pub verify_failures: AtomicU64,
    pub poisoned_pages: AtomicU64,
    pub removed_ranges: AtomicU64,
    pub prefetched_chunks: AtomicU64,
    pub prefetched_bytes: AtomicU64,
    /// The part of `prefetched_*` the background stream of the rest of the image installed
    /// (beyond the trace).
    pub streamed_chunks: AtomicU64,
    pub streamed_bytes: AtomicU64,
    /// Faults served by a fetch of verified slices rather than the whole chunk (part of
    /// `fetched`; a slice fetch that another install overtook is not counted here).
    pub slice_fetches: AtomicU64,
    /// Bytes slice fetches moved (part of `bytes_fetched`).
    pub slice_bytes: AtomicU64,
    /// Faults on a slice the working-set replay was fetching: they waited for it (part of
    /// `present`).
    pub ws_waits: AtomicU64,
    /// Slices the working-set replay installed, and the bytes it read for them.
    pub ws_slices: AtomicU64,
    pub ws_bytes: AtomicU64,
    /// Slices of the working-set blob that failed their check and were not installed (the
    /// blob is a hint: not part of `verify_failures`).
    pub ws_rejected: AtomicU64,
    /// Daemon-wide only: chunks the fill put in the chunk cache, their bytes, and whether
    /// every data chunk of the file is there (1) or not yet (0).
    pub filled_chunks: AtomicU64,
    pub filled_bytes: AtomicU64,
    pub fill_done: AtomicU64,
    pub latency: Histogram,
}

impl Counters {
    pub fn faults(&self) -> u64 {
        self.zero.load(Relaxed) + self.cache_hit.load(Relaxed) + self.fetched.load(Relaxed) + self.present.load(Relaxed)
    }
}

/// Record into the connection's counters and the daemon's at once.
#[derive(Clone)]
pub struct Rec(pub std::sync::Arc<Counters>, pub std::sync::Arc<Counters>);

impl Rec {
    pub fn add(&self, f: impl Fn(&Counters) -> &AtomicU64, n: u64) {
        if n > 0 {
            f(&self.0).fetch_add(n, Relaxed);
            f(&self.1).fetch_add(n, Relaxed);
        }
    }
    pub fn latency(&self, us: u64) {
        self.0.latency.record(us);
        self.1.latency.record(us);
    }
}

/// Fault counts by how they were served.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct FaultCounts {
    pub zero: u64,
    pub cache_hit: u64,
    pub fetched: u64,
    pub present: u64,
    pub total: u64,
}

/// Why a connection (or a CRIU task) ended: the `ended` field of its report, which is
/// this message.
#[derive(Debug, Clone, PartialEq, Eq, displaydoc::Display)]
#[non_exhaustive]
pub enum End {
    /// peer closed the socket
    PeerClosed,
    /// userfaultfd closed
    UffdClosed,
    /// daemon stopping
    Stopping,
    /// the VMM's memory is gone
    VmmGone,
    /// the process's memory is gone
    ProcessGone,
    /// all pages installed
    AllInstalled,
    /// the task's memory is gone
    TaskGone,
    /// the restore failed or was stopped
    RestoreFailed,
    /// {0}
    Failed(String),
}

impl Serialize for End {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// The `pacing` object of a connection's report: what the background's window measured
/// (see spec/lazy.md "Pacing the background").
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Pacing {
    /// The least probe time, in milliseconds (`null`: no probe came back).
    pub base_ms: Option<f64>,
    /// The queueing delay the window aimed at, in milliseconds.
    pub target_ms: f64,
    /// Delay samples taken (probes answered and the faults' slice fetches).
    pub probes: u64,
    /// Losses seen (the window halved).
    pub cuts: u64,
    /// Most bytes the background had in flight at once.
    pub most_bytes: u64,
    /// The largest window reached, in bytes.
    pub most_window: u64,
    /// Whether the target was widened because the guest needs most of the image
    /// (`target_ms` is then the wide one).
    pub widened: bool,
}

impl From<crate::pacing::PacingReport> for Pacing {
    fn from(r: crate::pacing::PacingReport) -> Pacing {
        Pacing {
            base_ms: r.base.map(|d| d.as_secs_f64() * 1e3),
            target_ms: r.target.as_secs_f64() * 1e3,
            probes: r.probes,
            cuts: r.cuts,
            most_bytes: r.most_bytes,
            most_window: r.most_window,
            widened: r.widened,
        }
    }
}

/// The `fill` object of a connection's report: the daemon's fill of the chunk cache so far
/// (see spec/lazy.md "The fill").
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct FillReport {
    /// Chunks the fill put in the chunk cache, and their bytes.
    pub chunks: u64,
    pub bytes: u64,
    /// Every data chunk of the file is in the chunk cache: the restore no longer depends on
    /// the registry.
    pub done: bool,
}

impl FillReport {
    /// The daemon's fill as its counters say.
    pub fn of(c: &Counters) -> FillReport {
        FillReport { chunks: c.filled_chunks.load(Relaxed), bytes: c.filled_bytes.load(Relaxed), done: c.fill_done.load(Relaxed) == 1 }
    }
}

/// The `--json` line printed when a connection ends (see spec/lazy.md).
#[derive(Debug, Clone, Serialize)]
pub struct ConnReport {
    pub pid: i32,
    pub faults: FaultCounts,
    pub bytes_fetched: u64,
    pub retries: u64,
    pub verify_failures: u64,
    pub poisoned_pages: u64,
    pub removed_ranges: u64,
    /// Faults served as zeros because the guest removed the range (part of `faults.zero`).
    pub removed_faults: u64,
    pub prefetched_chunks: u64,
    pub prefetched_bytes: u64,
    /// Units the stream of the rest of the image installed, and their bytes (part of
    /// `prefetched_*`).
    pub streamed_chunks: u64,
    pub streamed_bytes: u64,
    /// Seconds after the connection started at which the stream of the rest began
    /// (`null`: it never did).
    pub stream_started_s: Option<f64>,
    /// Most requests the stream kept in flight (sized from the timed round trip; 0: no
    /// stream ran).
    pub stream_depth: u64,
    /// Worker threads the stream started (at most `stream_depth`; 0: none ran).
    pub stream_threads: u64,
    /// The round trip timed before the stream began, in milliseconds (`null`: not timed).
    pub stream_rtt_ms: Option<f64>,
    /// How the background class (stream and replay) was paced.
    pub pacing: Pacing,
    /// Faults served by a fetch of verified slices (part of `faults.fetched`).
    pub slice_fetches: u64,
    /// Bytes slice fetches moved (part of `bytes_fetched`).
    pub slice_bytes: u64,
    /// Slices the replay of a recorded working set installed, and the bytes
    /// of the working-set blob it read (not part of `bytes_fetched`).
    pub working_set_slices: u64,
    pub working_set_bytes: u64,
    /// Faults on a slice the replay was still fetching: they waited for it, not for a
    /// fetch of their own (part of `faults.present`).
    pub working_set_waits: u64,
    /// Slices of the working-set blob that failed their check against the outboard and
    /// were not installed (the guest's touches there were served by the fault path,
    /// verified; not part of `verify_failures`).
    pub working_set_rejected_slices: u64,
    /// Seconds after the connection started at which the replay was done (`null`: none ran).
    pub working_set_s: Option<f64>,
    /// Slices recorded into the working set stored with the trace (with --record-trace).
    pub working_set_recorded: u64,
    /// The daemon's fill of the chunk cache when the connection ended.
    pub fill: FillReport,
    pub latency_us: Latency,
    pub seconds: f64,
    /// Why the connection ended.
    pub ended: End,
    /// The digest of the trace manifest this connection replayed (its working set or its
    /// chunk order; `null`: none).
    pub trace_digest: Option<String>,
    /// Where the recorded trace went (with --record-trace).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace: Option<String>,
}

impl ConnReport {
    pub fn from_counters(pid: i32, c: &Counters, seconds: f64, ended: End) -> Self {
        let l = |a: &AtomicU64| a.load(Relaxed);
        ConnReport {
            pid,
            faults: FaultCounts { zero: l(&c.zero), cache_hit: l(&c.cache_hit), fetched: l(&c.fetched), present: l(&c.present), total: c.faults() },
            bytes_fetched: l(&c.bytes_fetched),
            retries: l(&c.retries),
            verify_failures: l(&c.verify_failures),
            poisoned_pages: l(&c.poisoned_pages),
            removed_ranges: l(&c.removed_ranges),
            removed_faults: l(&c.removed_zero),
            prefetched_chunks: l(&c.prefetched_chunks),
            prefetched_bytes: l(&c.prefetched_bytes),
            streamed_chunks: l(&c.streamed_chunks),
            streamed_bytes: l(&c.streamed_bytes),
            stream_started_s: None,
            stream_depth: 0,
            stream_threads: 0,
            stream_rtt_ms: None,
            pacing: Pacing::default(),
            slice_fetches: l(&c.slice_fetches),
            slice_bytes: l(&c.slice_bytes),
            working_set_slices: l(&c.ws_slices),
            working_set_bytes: l(&c.ws_bytes),
            working_set_waits: l(&c.ws_waits),
            working_set_rejected_slices: l(&c.ws_rejected),
            working_set_s: None,
            working_set_recorded: 0,
            fill: FillReport::default(),
            latency_us: c.latency.latency(),
            seconds,
            ended,
            trace_digest: None,
            trace: None,
        }
    }

    /// Whether anything failed verification (the guest saw poison or a stall, never bad bytes).
    pub fn integrity_failed(&self) -> bool {
        self.verify_failures > 0 || self.poisoned_pages > 0
    }

    /// The connection's summary as one line for people (`pid N done (...): ...`).
    pub fn summary(&self) -> String {
        format!(
            "pid {} done ({}): {} faults ({} zero, {} cache, {} fetched, {} present), {} fetched, latency p50 {}us p99 {}us max {}us, {} retries, {} verify failures, {} pages poisoned, {:.2}s",
            self.pid,
            self.ended,
            self.faults.total,
            self.faults.zero,
            self.faults.cache_hit,
            self.faults.fetched,
            self.faults.present,
            imgfmt::size::human(self.bytes_fetched),
            self.latency_us.p50,
            self.latency_us.p99,
            self.latency_us.max,
            self.retries,
            self.verify_failures,
            self.poisoned_pages,
            self.seconds
        )
    }
}

/// The daemon's counters as Prometheus text exposition.
pub fn prometheus(c: &Counters, connections_active: u64, connections_total: u64) -> String {
    let mut out = String::new();
    let l = |a: &AtomicU64| a.load(Relaxed);
    let _ = writeln!(out, "# HELP snapctl_lazy_faults_total Page faults served, by how.\n# TYPE snapctl_lazy_faults_total counter");
    for (k, v) in [("zero", &c.zero), ("cache_hit", &c.cache_hit), ("fetched", &c.fetched), ("present", &c.present)] {
        let _ = writeln!(out, "snapctl_lazy_faults_total{{kind=\"{k}\"}} {}", l(v));
    }
    for (name, help, v) in [
        ("snapctl_lazy_bytes_fetched_total", "Stored bytes read from the image source.", &c.bytes_fetched),
        ("snapctl_lazy_retries_total", "Transient source failures retried.", &c.retries),
        ("snapctl_lazy_verify_failures_total", "Chunks whose bytes did not match their digest.", &c.verify_failures),
        ("snapctl_lazy_poisoned_pages_total", "Pages poisoned because no verified bytes could be had.", &c.poisoned_pages),
        ("snapctl_lazy_removed_ranges_total", "UFFD_EVENT_REMOVE events applied.", &c.removed_ranges),
        ("snapctl_lazy_prefetched_chunks_total", "Chunks installed ahead of the guest.", &c.prefetched_chunks),
        ("snapctl_lazy_streamed_chunks_total", "Chunks the background stream of the rest of the image installed.", &c.streamed_chunks),
        ("snapctl_lazy_slice_fetches_total", "Faults served by a fetch of verified slices rather than the whole chunk.", &c.slice_fetches),
        ("snapctl_lazy_working_set_slices_total", "Slices the replay of a recorded working set installed.", &c.ws_slices),
        ("snapctl_lazy_working_set_waits_total", "Faults that waited for the working-set replay instead of fetching.", &c.ws_waits),
        ("snapctl_lazy_working_set_rejected_slices_total", "Slices of a working-set blob that failed their check and were not installed.", &c.ws_rejected),
        ("snapctl_lazy_filled_chunks_total", "Chunks the fill put in the chunk cache.", &c.filled_chunks),
        ("snapctl_lazy_filled_bytes_total", "Bytes of the chunks the fill put in the chunk cache.", &c.filled_bytes),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}", l(v));
    }
    let _ = writeln!(
        out,
        "# HELP snapctl_lazy_fill_done Whether the served file is whole in the chunk cache (the restore no longer depends on the registry).\n# TYPE snapctl_lazy_fill_done gauge\nsnapctl_lazy_fill_done {}",
        l(&c.fill_done)
    );
    let _ = writeln!(
        out,
        "# HELP snapctl_lazy_connections Connections being served.\n# TYPE snapctl_lazy_connections gauge\nsnapctl_lazy_connections {connections_active}"
    );
    let _ = writeln!(out, "# HELP snapctl_lazy_connections_total Connections accepted.\n# TYPE snapctl_lazy_connections_total counter\nsnapctl_lazy_connections_total {connections_total}");
    c.latency.prometheus("snapctl_lazy_fault_latency_seconds", &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_contiguous_and_tight() {
        for v in (0..100_000u64).chain([u64::MAX / 3, u64::MAX]) {
            let b = bucket_of(v);
            assert!(bucket_upper(b) >= v, "{v}");
            assert!(b == 0 || bucket_upper(b - 1) < v, "{v}");
            // Within 12.5 % of the value.
            assert!(bucket_upper(b) - v <= v / 8 + 1, "{v}: {}", bucket_upper(b));
        }
        assert!(bucket_of(u64::MAX) < BUCKETS);
    }

    #[test]
    fn percentiles() {
        let h = Histogram::default();
        assert_eq!(h.latency(), Latency::default());
        for v in 1..=1000 {
            h.record(v);
        }
        let l = h.latency();
        assert!((500..=563).contains(&l.p50), "{l:?}");
        assert!((900..=1000).contains(&l.p90), "{l:?}");
        assert!((990..=1000).contains(&l.p99), "{l:?}");
        assert_eq!(l.max, 1000);
        // One slow outlier shows in max and p99 of a small sample, not in p50.
        let h = Histogram::default();
        for _ in 0..99 {
            h.record(10);
        }
        h.record(2_000_000);
        let l = h.latency();
        assert_eq!((l.p50, l.p99, l.max), (10, 10, 2_000_000));
    }

    /// A connection's end is a type in the code and the same sentence as before in
    /// `--json` (spec/lazy.md lists them).
    #[test]
    fn an_end_reads_as_its_sentence_in_json() {
        assert_eq!(serde_json::to_string(&End::PeerClosed).unwrap(), r#""peer closed the socket""#);
        assert_eq!(serde_json::to_string(&End::AllInstalled).unwrap(), r#""all pages installed""#);
        assert_eq!(End::Failed("poll failed: EBADF".into()).to_string(), "poll failed: EBADF");
        let r = ConnReport::from_counters(1, &Counters::default(), 0.5, End::TaskGone);
        let v: serde_json::Value = serde_json::to_value(&r).unwrap();
        assert_eq!(v["ended"], "the task's memory is gone");
    }

    #[test]
    fn prometheus_text() {
        let c = Counters::default();
        c.zero.fetch_add(3, Relaxed);
        c.latency.record(5);
        c.latency.record(3000);
        let t = prometheus(&c, 1, 2);
        assert!(t.contains("snapctl_lazy_faults_total{kind=\"zero\"} 3"), "{t}");
        assert!(t.contains("snapctl_lazy_fault_latency_seconds_bucket{le=\"0.000008\"} 1"), "{t}");
        assert!(t.contains("snapctl_lazy_fault_latency_seconds_bucket{le=\"+Inf\"} 2"), "{t}");
        assert!(t.contains("snapctl_lazy_connections_total 2"));
    }
}
