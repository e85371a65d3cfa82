//! Prefetch: the order a previous restore faulted chunks in (the *trace*), stored with the
//! image as an OCI artifact whose subject is the image's manifest, and replayed ahead of
//! the guest on later restores; then the *stream* of the rest of the image, at once
//! (`--prefetch all`) or once the misses look scattered ([`Detector`]).
//!
//! ```text
//! order = trace chunks, then every other non-zero chunk (file order)
//!   dispatcher ──(chunk)──► depth workers: Fetcher::get (single-flight, verified, cached)
//!       │                                  -> Conn::prefetch_span (gaps only)
//!       └─ in flight ≤ Pacer::limit: depth while no fault waits, else the link's measured
//!          bandwidth-delay product + 1 minus the faults' fetches (faults first)
//! ```
//!
//! ```text
//! trace manifest (artifactType application/vnd.snapctl.trace.v1+json)
//!   config  = the OCI empty descriptor ({})
//!   layers  = [trace JSON: {"format","file","chunkSize","chunks":[...],"workingSet":[...]},
//!              working-set blob: the bytes of the `workingSet` slices, in that order]
//!   subject = the image manifest
//! found by: referrers API (registry) | tag `sha256-<image manifest hex>` (layout, fallback)
//! ```

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use imgfmt::manifest::{Descriptor, Manifest};
use imgfmt::{media, FormatError, Image, OciLayout};
use serde::{Deserialize, Serialize};

use super::uffd::Conn;

/// Media type (and artifactType) of a prefetch trace.
pub const TRACE_MEDIA_TYPE: &str = "application/vnd.snapctl.trace.v1+json";
/// Value of [`Trace::format`].
pub const TRACE_FORMAT: &str = "snapctl.trace.v1";
/// The OCI "empty" config descriptor's media type and content.
pub const EMPTY_MEDIA_TYPE: &str = "application/vnd.oci.empty.v1+json";
const EMPTY: &[u8] = b"{}";
/// A trace blob is at most 64 MiB (8 M chunk numbers).
pub const MAX_TRACE_BYTES: u64 = 64 << 20;
/// Media type of a trace's working-set blob (its second layer): the bytes of the slices
/// the recorded restore touched, in the order the trace lists them.
pub const WORKING_SET_MEDIA_TYPE: &str = "application/vnd.snapctl.workingset.v1";

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

/// The order in which a restore first faulted the chunks of the memory file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Trace {
    /// Always [`TRACE_FORMAT`].
    pub format: String,
    /// The memory file's name in the image.
    pub file: String,
    pub chunk_size: u64,
    /// Chunk indices, each once, first fault first.
    pub chunks: Vec<u64>,
    /// File offsets of the slices (of the outboard's slice size) whose pages the restore
    /// touched, each once, first touch first; their bytes are the working-set blob. Empty:
    /// no working set (an image without an outboard, or a trace recorded before them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub working_set: Vec<u64>,
    /// Zero chunks the restore touched, first touch first: installed (as zeros, nothing
    /// fetched) before the guest asks, as the working set is.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub zero_chunks: Vec<u64>,
    /// The working-set blob's descriptor (the trace manifest's second layer), as loaded.
    #[serde(skip)]
    pub working_set_blob: Option<Descriptor>,
}

impl Trace {
    pub fn new(file: &str, chunk_size: u64, chunks: Vec<u64>) -> Self {
        Trace { format: TRACE_FORMAT.into(), file: file.into(), chunk_size, chunks, working_set: Vec::new(), zero_chunks: Vec::new(), working_set_blob: None }
    }

    /// Parse and check a trace against the image it is for.
    pub fn decode(b: &[u8], image: &Image, file: usize) -> Result<Trace, FormatError> {
        if b.len() as u64 > MAX_TRACE_BYTES {
            return Err(FormatError::TooLarge { what: "trace", got: b.len() as u64, limit: MAX_TRACE_BYTES });
        }
        let t: Trace = serde_json::from_slice(b).map_err(|source| FormatError::Json { what: "trace", source })?;
        let f = &image.files[file];
        let n = f.chunks.len() as u64;
        if t.format != TRACE_FORMAT || t.file != f.name || t.chunk_size != 1 << image.chunk_shift() {
            return Err(invalid("trace", format!("for {:?} at chunk size {}, not this image's {:?}", t.file, t.chunk_size, f.name)));
        }
        if let Some(c) = t.chunks.iter().chain(&t.zero_chunks).find(|&&c| c >= n) {
            return Err(invalid("trace", format!("chunk {c} beyond the file's {n} chunks")));
        }
        if let Some(o) = t.working_set.iter().find(|&&o| o >= f.size) {
            return Err(invalid("trace", format!("working-set offset {o} beyond the file's {} bytes", f.size)));
        }
        Ok(t)
    }
}

fn invalid(what: &'static str, detail: impl Into<String>) -> FormatError {
    FormatError::Invalid { what, detail: detail.into() }
}

/// Where traces are kept for an image.
pub trait TraceStore: Send + Sync {
    fn describe(&self) -> String;
    fn load(&self, image: &Image, file: usize) -> Result<Option<Trace>, FormatError>;
    /// Store a trace, with its working-set blob when `working_set` is not empty; returns
    /// where it went.
    fn store(&self, image: &Image, trace: &Trace, working_set: &[u8]) -> Result<String, FormatError>;
}

/// The tag under which an OCI layout lists the traces of `image` (the referrers API's
/// fallback tag scheme).
pub fn fallback_tag(image: &Image) -> String {
    imgfmt::layout::referrers_tag(&image.manifest_digest)
}

/// The trace artifact's manifest (blobs: the empty config, the trace JSON and, when there
/// is one, the working-set blob, whose descriptor its store made while storing it).
pub fn trace_manifest(image: &Image, trace_blob: &[u8], working_set: Option<Descriptor>) -> Manifest {
    let mut layers = vec![Descriptor::new(TRACE_MEDIA_TYPE, imgfmt::OciDigest::of(trace_blob), trace_blob.len() as u64)];
    layers.extend(working_set);
    Manifest {
        schema_version: 2,
        media_type: Some(media::OCI_MANIFEST.into()),
        artifact_type: Some(TRACE_MEDIA_TYPE.into()),
        config: Descriptor::new(EMPTY_MEDIA_TYPE, imgfmt::OciDigest::of(EMPTY), EMPTY.len() as u64),
        layers,
        subject: Some(Descriptor::new(media::OCI_MANIFEST, image.manifest_digest.clone(), image.manifest_bytes.len() as u64)),
        annotations: [(media::ANN_CREATED.to_string(), now_rfc3339())].into_iter().collect(),
    }
}

fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    // Civil date from days since the epoch (Howard Hinnant's algorithm).
    let (days, rem) = (secs / 86400, secs % 86400);
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + (m <= 2) as i64;
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Traces in a local OCI layout, under the fallback tag.
pub struct LayoutTraces(pub OciLayout);

impl TraceStore for LayoutTraces {
    fn describe(&self) -> String {
        format!("oci:{}", self.0.root().display())
    }

    fn load(&self, image: &Image, file: usize) -> Result<Option<Trace>, FormatError> {
        // The newest trace among the image's referrers (RFC 3339 timestamps sort as strings;
        // a trace listed before the index existed has none, and sorts first).
        let refs = self.0.referrers(&image.manifest_digest)?;
        let traces = refs.iter().filter(|d| d.artifact_type.as_deref().is_none_or(|t| t == TRACE_MEDIA_TYPE));
        let Some(desc) = traces.max_by_key(|d| d.annotations.get(media::ANN_CREATED).cloned().unwrap_or_default()) else { return Ok(None) };
        let m = Manifest::decode(&imgfmt::source::read_verified_blob(&self.0, &desc.digest, imgfmt::manifest::MAX_MANIFEST_BYTES)?)?;
        if m.artifact_type.as_deref() != Some(TRACE_MEDIA_TYPE) || m.subject.as_ref().map(|s| &s.digest) != Some(&image.manifest_digest) {
            return Err(invalid("trace manifest", format!("{} is not a trace of {}", desc.digest, image.manifest_digest)));
        }
        read_trace_layer(&self.0, &m, image, file).map(Some)
    }

    fn store(&self, image: &Image, trace: &Trace, working_set: &[u8]) -> Result<String, FormatError> {
        let blob = serde_json::to_vec(trace).expect("trace serializes");
        self.0.put_blob(&blob)?;
        self.0.put_blob(EMPTY)?;
        let ws = match working_set {
            [] => None,
            b => Some(Descriptor::new(WORKING_SET_MEDIA_TYPE, self.0.put_blob(b)?, b.len() as u64)),
        };
        let manifest = trace_manifest(image, &blob, ws);
        let m = manifest.encode();
        let d = self.0.put_blob(&m)?;
        let mut desc = Descriptor::new(media::OCI_MANIFEST, d.clone(), m.len() as u64);
        desc.artifact_type = Some(TRACE_MEDIA_TYPE.into());
        desc.annotations = manifest.annotations.clone();
        // Listed beside the image's other referrers (signatures, SBOMs a copy brought).
        self.0.add_referrers(&image.manifest_digest, &[desc])?;
        Ok(format!("{}:{} ({d})", self.describe(), fallback_tag(image)))
    }
}

/// The trace payload of a trace manifest (its one layer), verified and checked.
fn read_trace_layer(src: &dyn imgfmt::BlobSource, m: &Manifest, image: &Image, file: usize) -> Result<Trace, FormatError> {
    let layer = m.layers.first().ok_or_else(|| invalid("trace manifest", "no layer"))?;
    let b = imgfmt::source::read_verified_blob(src, &layer.digest, MAX_TRACE_BYTES)?;
    let mut t = Trace::decode(&b, image, file)?;
    if !t.working_set.is_empty() {
        // Without its blob the list is of no use: replay the chunk order alone.
        t.working_set_blob = m.layers.get(1).filter(|d| d.media_type == WORKING_SET_MEDIA_TYPE).cloned();
        if t.working_set_blob.is_none() {
            t.working_set.clear();
        }
    }
    Ok(t)
}

/// Traces in a registry: pushed as referrers of the image (the registry's referrers API,
/// or the fallback tag the client maintains).
pub struct RegistryTraces(pub Arc<regclient::RegistrySource>);

impl TraceStore for RegistryTraces {
    fn describe(&self) -> String {
        imgfmt::BlobSource::describe(self.0.as_ref())
    }

    fn load(&self, image: &Image, file: usize) -> Result<Option<Trace>, FormatError> {
        let refs = self.0.list_referrers(&image.manifest_digest, Some(TRACE_MEDIA_TYPE)).map_err(|e| invalid("trace referrers", e.to_string()))?;
        // The newest trace wins (RFC 3339 timestamps sort as strings).
        let Some(d) = refs.iter().max_by_key(|d| d.annotations.get(media::ANN_CREATED).cloned().unwrap_or_default()) else { return Ok(None) };
        let m = Manifest::decode(&imgfmt::source::read_verified_blob(self.0.as_ref(), &d.digest, imgfmt::manifest::MAX_MANIFEST_BYTES)?)?;
        if m.subject.as_ref().map(|s| &s.digest) != Some(&image.manifest_digest) {
            return Err(invalid("trace manifest", format!("{} does not refer to {}", d.digest, image.manifest_digest)));
        }
        read_trace_layer(self.0.as_ref(), &m, image, file).map(Some)
    }

    fn store(&self, image: &Image, trace: &Trace, working_set: &[u8]) -> Result<String, FormatError> {
        let blob = serde_json::to_vec(trace).expect("trace serializes");
        let ann = [(media::ANN_CREATED.to_string(), now_rfc3339())].into_iter().collect();
        let mut layers = vec![(regclient::PAYLOAD_TYPE, blob.as_slice())];
        if !working_set.is_empty() {
            layers.push((WORKING_SET_MEDIA_TYPE, working_set));
        }
        let d = self.0.push_referrer_layers(&image.manifest_digest, TRACE_MEDIA_TYPE, &layers, ann).map_err(|e| invalid("trace push", e.to_string()))?;
        Ok(format!("{} referrer {d}", self.describe()))
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
        let need =
            if fraction.is_nan() || fraction > 1.0 { u64::MAX } else { ((fraction.max(0.0) * data as f64).ceil() as u64).max(MIN_MISSES).min(data.max(1)) };
        Detector { need, seen: vec![false; chunks as usize], count: 0, fired: false }
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

/// The link the stream's depth is sized for while no fault waits, in bytes per second
/// (10 Gbit/s, as `puller::pull`): a request beyond what the link needs only waits its turn.
const LINK_BYTES_PER_SEC: f64 = 1.25e9;
/// Requests in flight at least: on loopback the round trip is nothing but verifying and
/// installing are work, which a few threads spread over the cores.
const MIN_DEPTH: usize = 4;
/// Default of `--stream-jobs`: the stream's requests in flight at most. 32 requests of
/// 1 MiB cover 1 Gbit/s at ~250 ms of RTT and 10 Gbit/s at ~25 ms; `snapctl serve` allows
/// one client 64 connections, and faults need some.
pub const DEFAULT_STREAM_JOBS: usize = 32;

/// Requests to keep in flight to fill a [`LINK_BYTES_PER_SEC`] link at round trip `rtt`
/// with requests of `chunk` bytes: a bandwidth-delay product of them, plus the one
/// arriving; at least [`MIN_DEPTH`], at most `max_jobs`.
pub fn stream_depth(rtt: Duration, chunk: u64, max_jobs: usize) -> usize {
    let want = (LINK_BYTES_PER_SEC * rtt.as_secs_f64() / chunk.max(1) as f64).ceil().min(1e6) as usize + 1;
    want.max(MIN_DEPTH).min(max_jobs.max(1))
}

/// How many requests the stream may have in flight now: the faults-first rule.
///
/// While no fault waits for a fetch, the stream keeps `depth` (sized from the timed round
/// trip for a fast link). While faults wait, what the link holds counts for both: the
/// stream keeps twice what the link was measured to carry (Little's law: the measured
/// bandwidth times the shortest time a whole-chunk fetch took, in chunks; doubled, see
/// [`LINK_GAIN`]; rounded up, plus one),
/// minus the faults' fetches, and at least one. Requests beyond what the link carries would
/// only queue in front of a fault's; with the link just full, a fault's request costs about
/// what it costs on an idle link, and the stream still moves whatever the faults leave.
/// Measured, not assumed: the bandwidth is the bytes this daemon fetched over the last few
/// round trips; the fetch time is the shortest of the stream's recent fetches (a round
/// trip, the chunk's bytes, the server's and our own work: the timed round trip alone is
/// half of it on a loaded host), never below the timed round trip. Too low an estimate
/// corrects itself: while the link is not full the bandwidth measured grows with each
/// request added, and the "+1" puts one more on the link than it was measured to carry;
/// once it is full, more requests only add waiting, and the estimate stays.
pub(crate) struct Pacer {
    rtt: Duration,
    chunk: u64,
    depth: usize,
    samples: VecDeque<(Instant, u64)>,
    /// How long the stream's recent fetches took.
    took: VecDeque<Duration>,
}

/// What the link was measured to carry is doubled, as BBR sizes its congestion window at
/// twice the bandwidth-delay product: a fetch's time on a busy host varies with more than
/// the link (at 20 ms on this 2-core machine faults' fetches took 1.5-2x the shortest),
/// and with exactly the product in flight the link idles whenever one runs late. Measured
/// with bench/wan.sh at 20 ms, 1 Gbit/s: `--prefetch all` took 3.2 s with a gain of 1, a
/// pull of the same image 2.3 s (BENCHMARKS.md, "Dialled network").
const LINK_GAIN: f64 = 2.0;

/// Fetch times remembered for the shortest.
const FETCH_TIMES: usize = 32;

impl Pacer {
    pub fn new(rtt: Duration, chunk: u64, max_jobs: usize) -> Pacer {
        Pacer { rtt, chunk, depth: stream_depth(rtt, chunk, max_jobs), samples: VecDeque::new(), took: VecDeque::new() }
    }

    /// A fetch of the stream's that installed bytes took `d`.
    pub fn fetched(&mut self, d: Duration) {
        if self.took.len() == FETCH_TIMES {
            self.took.pop_front();
        }
        self.took.push_back(d);
    }

    /// The shortest recent fetch that took at least the round trip (a shorter one found
    /// its chunk brought by another fetch); the round trip if none did.
    fn fetch_time(&self) -> Duration {
        self.took.iter().filter(|&&d| d >= self.rtt).min().copied().unwrap_or(self.rtt)
    }

    pub fn depth(&self) -> usize {
        self.depth
    }

    /// The bandwidth is measured over this long; a fault seen this recently counts as
    /// waiting still.
    pub fn window(&self) -> Duration {
        (self.rtt * 4).max(Duration::from_millis(100))
    }

    /// Note that `bytes` had been fetched in all by `now`.
    pub fn sample(&mut self, now: Instant, bytes: u64) {
        let w = self.window();
        while self.samples.len() > 1 && self.samples.get(1).is_some_and(|&(t, _)| now.duration_since(t) >= w) {
            self.samples.pop_front();
        }
        self.samples.push_back((now, bytes));
    }

    /// Bytes per second over the window, once it spans at least half of it.
    fn rate(&self) -> Option<f64> {
        let (&(t0, b0), &(t1, b1)) = (self.samples.front()?, self.samples.back()?);
        let span = t1.duration_since(t0);
        (span >= self.window() / 2).then(|| b1.saturating_sub(b0) as f64 / span.as_secs_f64())
    }

    /// Requests the stream may have in flight while faults wait for `fault_fetches` fetches.
    pub fn limit(&self, fault_fetches: u64) -> usize {
        if fault_fetches == 0 {
            return self.depth;
        }
        let link = match self.rate() {
            Some(r) => (LINK_GAIN * r * self.fetch_time().as_secs_f64() / self.chunk.max(1) as f64).ceil().min(1e6) as usize + 1,
            None => 2,
        };
        link.saturating_sub(fault_fetches as usize).clamp(1, self.depth)
    }
}

/// What the prefetcher did, for the connection's report.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct StreamRun {
    /// Most requests it kept in flight (0: it had nothing to do).
    pub depth: usize,
    pub rtt: Option<Duration>,
}

/// Install `order`'s chunks ahead of the guest with up to [`stream_depth`] requests in
/// flight (the faults-first rule of [`Pacer`]), each through the fetcher's single-flight
/// path (a fault on a chunk being streamed waits for that fetch; every chunk is verified
/// before it is installed and goes into the chunk cache), at no more than `rate` bytes per
/// second (0: unbounded). The first `traced` are the trace's; the rest wait for
/// `conn.stream_go`. Until done, the connection ends or `stop` is set.
pub(crate) fn run(conn: Arc<Conn>, order: Vec<u64>, traced: usize, max_jobs: usize, rate: u64, stop: Arc<AtomicBool>) -> StreamRun {
    let Some(&first) = order.first() else { return StreamRun::default() };
    let rtt = conn.fetcher.round_trip(first);
    let mut pacer = Pacer::new(rtt.unwrap_or_default(), conn.map.chunk_size(), max_jobs);
    let depth = pacer.depth();
    let (job_tx, job_rx) = mpsc::channel::<(u64, bool)>();
    let job_rx = Mutex::new(job_rx);
    let (done_tx, done_rx) = mpsc::channel::<(u64, Duration)>();
    let ended = || stop.load(Ordering::Relaxed) || conn.gone.load(Ordering::Relaxed);
    std::thread::scope(|s| {
        for _ in 0..depth {
            let (conn, job_rx, done_tx) = (&conn, &job_rx, done_tx.clone());
            let spawned = std::thread::Builder::new().name("lazy-stream".into()).spawn_scoped(s, move || loop {
                let Ok((c, rest)) = job_rx.lock().expect("poisoned").recv() else { return };
                let t = Instant::now();
                let mut bytes = 0;
                for span in conn.map.spans_of_chunk(c) {
                    if conn.gone.load(Ordering::Relaxed) {
                        break;
                    }
                    bytes += conn.prefetch_span(&span);
                }
                if rest && bytes > 0 {
                    conn.rec.add(|k| &k.streamed_chunks, 1);
                    conn.rec.add(|k| &k.streamed_bytes, bytes);
                }
                if done_tx.send((bytes, t.elapsed())).is_err() {
                    return;
                }
            });
            if spawned.is_err() {
                // Out of threads: those running do the work.
                break;
            }
        }
        drop(done_tx);
        let t0 = Instant::now();
        let (mut next, mut in_flight, mut installed, mut most) = (0usize, 0usize, 0u64, 0usize);
        let mut fault_seen: Option<Instant> = None;
        'dispatch: while !ended() {
            let now = Instant::now();
            pacer.sample(now, conn.rec.1.bytes_fetched.load(Ordering::Relaxed));
            // A guest that faulted a moment ago is between two faults, not done: the whole
            // depth then would put its next fault's request behind a burst of the stream's.
            let mut faults = conn.fault_fetches.load(Ordering::Relaxed);
            if faults > 0 {
                fault_seen = Some(now);
            } else if fault_seen.is_some_and(|t| now.duration_since(t) < pacer.window()) {
                faults = 1;
            }
            let limit = pacer.limit(faults);
            let mut waiting_for_go = false;
            while in_flight < limit && next < order.len() {
                if next >= traced && !conn.stream_go.load(Ordering::Relaxed) {
                    waiting_for_go = true;
                    break;
                }
                // Stay under the rate: the bytes installed so far were due by now.
                if rate > 0 && Duration::from_secs_f64(installed as f64 / rate as f64) > t0.elapsed() {
                    break;
                }
                if job_tx.send((order[next], next >= traced)).is_err() {
                    break 'dispatch;
                }
                next += 1;
                in_flight += 1;
                most = most.max(in_flight);
            }
            if next == order.len() && in_flight == 0 {
                break;
            }
            // Woken by a finished request; otherwise look again soon (faults may have
            // come or gone, the detector may have fired, the rate may allow more).
            let nap = if waiting_for_go && in_flight == 0 { Duration::from_millis(20) } else { Duration::from_millis(2) };
            let mut done = |(b, took): (u64, Duration)| {
                in_flight -= 1;
                installed += b;
                if b > 0 {
                    pacer.fetched(took);
                }
            };
            match done_rx.recv_timeout(nap) {
                Ok(d) => {
                    done(d);
                    while let Ok(d) = done_rx.try_recv() {
                        done(d);
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        drop(job_tx);
        StreamRun { depth: most, rtt }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_round_trips_through_a_layout_and_is_checked() {
        let (_d, _mem, image, layout) = crate::fetch::tests::sample_image(6);
        let file = image.file("vm.mem").unwrap().0;
        let store = LayoutTraces(layout);
        assert_eq!(store.load(&image, file).unwrap(), None);
        let t = Trace::new("vm.mem", 1 << 16, vec![4, 0, 2]);
        let at = store.store(&image, &t, &[]).unwrap();
        assert!(at.contains(&fallback_tag(&image)), "{at}");
        assert_eq!(store.load(&image, file).unwrap(), Some(t.clone()));
        // The image itself is untouched and still opens.
        let tags = store.0.tags().unwrap();
        assert_eq!(tags.len(), 2);
        // A trace naming chunks the file does not have is refused.
        let bad = serde_json::to_vec(&Trace::new("vm.mem", 1 << 16, vec![6])).unwrap();
        assert!(Trace::decode(&bad, &image, file).is_err());
        let other = serde_json::to_vec(&Trace::new("vm.state", 1 << 16, vec![0])).unwrap();
        assert!(Trace::decode(&other, &image, file).is_err());
        assert!(Trace::decode(b"{", &image, file).is_err());
        // Order: trace first (zero chunks and repeats dropped), then the rest with `all`.
        // (Chunks 1 and 4 of the sample are zero.)
        let t = Trace::new("vm.mem", 1 << 16, vec![5, 1, 5, 0, 4]);
        assert_eq!(prefetch_order(PrefetchMode::Trace, Some(&t), &image, file), vec![5, 0]);
        assert_eq!(prefetch_order(PrefetchMode::All, Some(&t), &image, file), vec![5, 0, 2, 3]);
        assert_eq!(prefetch_order(PrefetchMode::All, None, &image, file), vec![0, 2, 3, 5]);
        assert!(prefetch_order(PrefetchMode::None, Some(&t), &image, file).is_empty());
        assert_eq!(now_rfc3339().len(), 20);
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

    #[test]
    fn stream_depth_fills_the_link_and_yields_to_faults() {
        const MIB: u64 = 1 << 20;
        let ms = Duration::from_millis;
        // 10 Gbit/s x 20 ms = 25 MB: 24 requests of 1 MiB hold it, plus the one arriving.
        assert_eq!(stream_depth(ms(20), MIB, 32), 25);
        assert_eq!(stream_depth(ms(50), MIB, 32), 32, "bounded by --stream-jobs");
        assert_eq!(stream_depth(Duration::ZERO, MIB, 32), MIN_DEPTH, "loopback: a few, for the CPU");
        assert_eq!(stream_depth(ms(50), MIB, 2), 2);
        // No fault waiting: the whole depth.
        let mut p = Pacer::new(ms(20), MIB, 32);
        assert_eq!(p.limit(0), 25);
        // Faults waiting before the link was measured: room for one more than the faults.
        assert_eq!(p.limit(1), 1);
        // The link measured at 1 Gbit/s (125 MB/s over the window), no fetch timed yet:
        // a round trip holds 2.4 MiB, twice that 4.8, so 6 requests in all, of which the
        // faults' 2 leave the stream 4; 9 faults' fetches leave it 1, never none.
        let t0 = Instant::now();
        for i in 0..=20u64 {
            p.sample(t0 + ms(10 * i), 1_250_000 * i);
        }
        assert_eq!(p.limit(2), 4);
        assert_eq!(p.limit(9), 1);
        assert_eq!(p.limit(0), 25);
        // Whole-chunk fetches timed at 36 ms at best (round trip, bytes, work): the link
        // carries 4.3 MiB in that time, twice that 8.6, so 10 requests in all, 8 of them
        // the stream's. A
        // fetch shorter than the round trip (a chunk another fetch brought) does not count.
        for d in [40, 36, 50, 3] {
            p.fetched(ms(d));
        }
        assert_eq!(p.limit(2), 8);
        // A faster link measured: more, up to the depth.
        for i in 21..=40u64 {
            p.sample(t0 + ms(10 * i), 1_250_000 * 20 + 12_500_000 * (i - 20));
        }
        assert_eq!(p.limit(2), 25);
    }
}
