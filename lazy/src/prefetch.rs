//! Prefetch: the order a previous restore faulted chunks in (the *trace*), stored with the
//! image as an OCI artifact whose subject is the image's manifest, and replayed ahead of
//! the guest on later restores.
//!
//! ```text
//! trace manifest (artifactType application/vnd.snapctl.trace.v1+json)
//!   config  = the OCI empty descriptor ({})
//!   layers  = [trace JSON: {"format","file","chunkSize","chunks":[...]}]
//!   subject = the image manifest
//! found by: referrers API (registry) | tag `sha256-<image manifest hex>` (layout, fallback)
//! ```

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
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
}

impl Trace {
    pub fn new(file: &str, chunk_size: u64, chunks: Vec<u64>) -> Self {
        Trace { format: TRACE_FORMAT.into(), file: file.into(), chunk_size, chunks }
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
        if let Some(c) = t.chunks.iter().find(|&&c| c >= n) {
            return Err(invalid("trace", format!("chunk {c} beyond the file's {n} chunks")));
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
    /// Store a trace; returns where it went.
    fn store(&self, image: &Image, trace: &Trace) -> Result<String, FormatError>;
}

/// The tag under which an OCI layout keeps the trace of `image` (the referrers API's
/// fallback tag scheme).
pub fn fallback_tag(image: &Image) -> String {
    format!("{}-{}", image.manifest_digest.algorithm(), image.manifest_digest.hex())
}

/// The trace artifact's manifest (blobs: the empty config and the trace JSON).
pub fn trace_manifest(image: &Image, trace_blob: &[u8]) -> Manifest {
    Manifest {
        schema_version: 2,
        media_type: Some(media::OCI_MANIFEST.into()),
        artifact_type: Some(TRACE_MEDIA_TYPE.into()),
        config: Descriptor::new(EMPTY_MEDIA_TYPE, imgfmt::OciDigest::of(EMPTY), EMPTY.len() as u64),
        layers: vec![Descriptor::new(TRACE_MEDIA_TYPE, imgfmt::OciDigest::of(trace_blob), trace_blob.len() as u64)],
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
        let tag = fallback_tag(image);
        let Some((_, desc)) = self.0.tags()?.into_iter().find(|(t, _)| *t == tag) else { return Ok(None) };
        let m = Manifest::decode(&imgfmt::source::read_verified_blob(&self.0, &desc.digest, imgfmt::manifest::MAX_MANIFEST_BYTES)?)?;
        if m.artifact_type.as_deref() != Some(TRACE_MEDIA_TYPE) || m.subject.as_ref().map(|s| &s.digest) != Some(&image.manifest_digest) {
            return Err(invalid("trace manifest", format!("tag {tag} is not a trace of {}", image.manifest_digest)));
        }
        read_trace_layer(&self.0, &m, image, file).map(Some)
    }

    fn store(&self, image: &Image, trace: &Trace) -> Result<String, FormatError> {
        let blob = serde_json::to_vec(trace).expect("trace serializes");
        self.0.put_blob(&blob)?;
        self.0.put_blob(EMPTY)?;
        let m = trace_manifest(image, &blob).encode();
        let d = self.0.put_blob(&m)?;
        let mut desc = Descriptor::new(media::OCI_MANIFEST, d.clone(), m.len() as u64);
        desc.artifact_type = Some(TRACE_MEDIA_TYPE.into());
        let tag = fallback_tag(image);
        self.0.set_tag(&tag, desc)?;
        Ok(format!("{}:{tag} ({d})", self.describe()))
    }
}

/// The trace payload of a trace manifest (its one layer), verified and checked.
fn read_trace_layer(src: &dyn imgfmt::BlobSource, m: &Manifest, image: &Image, file: usize) -> Result<Trace, FormatError> {
    let layer = m.layers.first().ok_or_else(|| invalid("trace manifest", "no layer"))?;
    let b = imgfmt::source::read_verified_blob(src, &layer.digest, MAX_TRACE_BYTES)?;
    Trace::decode(&b, image, file)
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

    fn store(&self, image: &Image, trace: &Trace) -> Result<String, FormatError> {
        let blob = serde_json::to_vec(trace).expect("trace serializes");
        let ann = [(media::ANN_CREATED.to_string(), now_rfc3339())].into_iter().collect();
        let d = self.0.push_referrer(&image.manifest_digest, TRACE_MEDIA_TYPE, &blob, ann).map_err(|e| invalid("trace push", e.to_string()))?;
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

/// Install `order`'s chunks ahead of the guest at no more than `rate` bytes per second,
/// until done, the connection ends or `stop` is set.
pub(crate) fn run(conn: Arc<Conn>, order: Vec<u64>, rate: u64, stop: Arc<AtomicBool>) {
    let t0 = Instant::now();
    let mut bytes = 0u64;
    for c in order {
        for span in conn.map.spans_of_chunk(c) {
            if stop.load(Ordering::Relaxed) || conn.gone.load(Ordering::Relaxed) {
                return;
            }
            // Faults waiting for fetches come first: the prefetcher's own fetch would
            // compete with theirs for the link and the CPU.
            while conn.parked_faults.load(Ordering::Relaxed) > 0 && !stop.load(Ordering::Relaxed) && !conn.gone.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(1));
            }
            bytes += conn.prefetch_span(&span);
            if rate > 0 {
                // Stay under the rate: a prefetcher that saturates the link would slow the
                // very faults it is meant to spare.
                let due = Duration::from_secs_f64(bytes as f64 / rate as f64);
                if let Some(wait) = due.checked_sub(t0.elapsed()) {
                    std::thread::sleep(wait.min(Duration::from_millis(500)));
                }
            }
        }
    }
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
        let at = store.store(&image, &t).unwrap();
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
    }
}
