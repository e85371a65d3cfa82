//! Trace storage: the order a previous restore faulted chunks in, the working set it
//! touched and the zero chunks it met (the *trace*), stored with the image as an OCI
//! artifact whose subject is the image's manifest, and found again by a later restore.
//! What a restore does with a trace is [`crate::prefetch`]'s and [`crate::workingset`]'s.
//!
//! ```text
//! trace manifest (artifactType application/vnd.snapctl.trace.v1+json)
//!   config  = the OCI empty descriptor ({})
//!   layers  = [trace JSON: {"format","file","chunkSize","chunks":[...],"workingSet":[...]},
//!              working-set blob: the bytes of the `workingSet` slices, in that order]
//!   subject = the image manifest
//! found by: referrers API (registry) | tag `sha256-<image manifest hex>` (layout, fallback)
//! ```

use std::sync::Arc;

use imgfmt::manifest::{Descriptor, Manifest};
use imgfmt::{media, BlobSource, FormatError, Image, OciDigest, OciLayout};

mod json;
use json::MIN_SLICE;
pub use json::{Trace, TRACE_FORMAT};

/// Media type (and artifactType) of a prefetch trace.
pub const TRACE_MEDIA_TYPE: &str = "application/vnd.snapctl.trace.v1+json";
/// The OCI "empty" config descriptor's media type and content.
pub const EMPTY_MEDIA_TYPE: &str = "application/vnd.oci.empty.v1+json";
const EMPTY: &[u8] = b"{}";
/// A trace blob is at most 64 MiB, whatever the image ([`max_trace_bytes`] is usually far
/// less).
pub const MAX_TRACE_BYTES: u64 = 64 << 20;
/// Media type of a trace's working-set blob (its second layer): the bytes of the slices
/// the recorded restore touched, in the order the trace lists them.
pub const WORKING_SET_MEDIA_TYPE: &str = "application/vnd.snapctl.workingset.v1";
/// Trace artifacts of one image looked at, at most, newest first: each costs a few
/// requests, and a registry may hold any number of them.
pub const MAX_TRACE_CANDIDATES: usize = 8;
/// Bytes a trace may take besides its lists (format, file name, field names, spaces).
const TRACE_OVERHEAD: u64 = 64 << 10;
/// Bytes of one list entry at most: 20 digits and a comma.
const ENTRY_BYTES: u64 = 21;
/// A trace dated this far past the daemon's clock counts as undated (clocks differ a little
/// between the host that recorded it and this one; a date in the far future is a lie).
const CLOCK_SKEW_SECS: u64 = 24 * 3600;

/// The most bytes a trace of file `file` of `image` can take: each of its lists names a
/// chunk (or a 4 KiB page, for the working set) at most once, so the image bounds it. A
/// longer trace is refused before it is read.
pub fn max_trace_bytes(image: &Image, file: usize) -> u64 {
    let f = &image.files[file];
    let entries = (f.chunks.len() as u64).saturating_mul(2).saturating_add(f.size.div_ceil(MIN_SLICE));
    TRACE_OVERHEAD.saturating_add(ENTRY_BYTES.saturating_mul(entries)).min(MAX_TRACE_BYTES)
}

impl Trace {
    /// Parse and check a trace against the image it is for. What it costs is bounded by the
    /// image, not by the trace: a trace larger than [`max_trace_bytes`] is refused unread,
    /// and a list entry out of range, not a slice start or named twice stops the parse
    /// there (each list is checked against a bit per chunk or page as it is read).
    pub fn decode(b: &[u8], image: &Image, file: usize) -> Result<Trace, FormatError> {
        let limit = max_trace_bytes(image, file);
        if b.len() as u64 > limit {
            return Err(FormatError::TooLarge { what: "trace", got: b.len() as u64, limit });
        }
        let f = &image.files[file];
        let t = json::parse(b, f.chunks.len() as u64, f.size).map_err(|source| FormatError::Json { what: "trace", source })?;
        if t.format != TRACE_FORMAT || t.file != f.name || t.chunk_size != 1 << image.chunk_shift() {
            return Err(invalid("trace", format!("for {:?} at chunk size {}, not this image's {:?}", t.file, t.chunk_size, f.name)));
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
    /// The trace to replay for file `file` of `image`, if there is a usable one (its
    /// [`Trace::manifest`] says which).
    fn load(&self, image: &Image, file: usize) -> Result<Option<Trace>, FormatError>;
    /// Store a trace, with its working-set blob when `working_set` is not empty; returns
    /// where it went and the trace manifest's digest.
    fn store(&self, image: &Image, trace: &Trace, working_set: &[u8]) -> Result<(String, OciDigest), FormatError>;
    /// Start looking for the traces of the image whose manifest is `manifest` before the
    /// image itself is open, so the round trips of finding one overlap the image's own: a
    /// later [`TraceStore::load`] of that image uses what was read. `false`: the store
    /// holds no trace of it (a restore then need not wait for what only a replay needs).
    /// The default does nothing and answers `true` (a local store answers at once).
    fn prepare(&self, _manifest: &OciDigest) -> bool {
        true
    }
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
    rfc3339(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0))
}

/// `secs` after the epoch as `YYYY-MM-DDTHH:MM:SSZ`.
fn rfc3339(secs: u64) -> String {
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

/// A trace artifact's creation date, where it can be believed for ordering: an RFC 3339
/// date (`YYYY-MM-DD...`) no later than `latest`. Anything else (absent, malformed, in the
/// future) is no date: such a trace is tried after every dated one.
fn believable_date<'a>(annotations: &'a std::collections::BTreeMap<String, String>, latest: &str) -> Option<&'a str> {
    let c = annotations.get(media::ANN_CREATED)?.as_str();
    let b = c.as_bytes();
    let shaped = b.len() >= 10 && b[..10].iter().enumerate().all(|(i, &x)| if i == 4 || i == 7 { x == b'-' } else { x.is_ascii_digit() });
    (shaped && c <= latest).then_some(c)
}

/// Load and check the trace artifact whose manifest is `digest` in `src`, for file `file`
/// of `image`: an OCI manifest of artifact type [`TRACE_MEDIA_TYPE`] whose subject is the
/// image's manifest, whose first layer is the trace JSON (of its media type, or the
/// registry payload type) no larger than [`max_trace_bytes`] and valid for the image.
/// Its working set is kept only where the second layer is the working-set blob and that
/// blob is there (`Ok((trace, false))`: it is not, and the trace holds its chunk order
/// alone). `Err`: why the trace cannot be used.
fn load_artifact(src: &dyn BlobSource, digest: &OciDigest, image: &Image, file: usize) -> Result<(Trace, bool), String> {
    let bytes = imgfmt::source::read_verified_blob(src, digest, imgfmt::manifest::MAX_MANIFEST_BYTES).map_err(|e| e.to_string())?;
    let m = Manifest::decode(&bytes).map_err(|e| e.to_string())?;
    if let Some(t) = m.media_type.as_deref().filter(|t| *t != media::OCI_MANIFEST) {
        return Err(format!("media type {t}, not an OCI image manifest"));
    }
    if m.artifact_type.as_deref() != Some(TRACE_MEDIA_TYPE) {
        return Err(format!("artifact type {:?}, not a trace", m.artifact_type.as_deref().unwrap_or("")));
    }
    match &m.subject {
        Some(s) if s.digest == image.manifest_digest => {}
        Some(s) => return Err(format!("it refers to {}, not to {}", s.digest, image.manifest_digest)),
        None => return Err("it refers to no image".into()),
    }
    let layer = m.layers.first().ok_or("it has no layers")?;
    if layer.media_type != TRACE_MEDIA_TYPE && layer.media_type != regclient::PAYLOAD_TYPE {
        return Err(format!("its first layer is {}, not a trace", layer.media_type));
    }
    let limit = max_trace_bytes(image, file);
    if layer.size > limit {
        return Err(format!("its trace is {} bytes, too large for this image's (at most {limit})", layer.size));
    }
    let blob = m.layers.get(1).filter(|d| d.media_type == WORKING_SET_MEDIA_TYPE && d.size <= image.files[file].size);
    // Whether the working-set blob is there is asked beside reading the trace (one round
    // trip, not two); the answer counts only if the trace lists a working set.
    let (b, present) = std::thread::scope(|s| {
        let present = blob.map(|d| s.spawn(move || src.blob_size(&d.digest).is_ok_and(|n| n == d.size)));
        let b = imgfmt::source::read_verified_blob(src, &layer.digest, limit);
        (b, present.is_some_and(|h| h.join().unwrap_or(false)))
    });
    let mut t = Trace::decode(&b.map_err(|e| e.to_string())?, image, file).map_err(|e| e.to_string())?;
    t.manifest = Some(digest.clone());
    t.created = m.annotations.get(media::ANN_CREATED).cloned();
    if t.working_set.is_empty() {
        return Ok((t, true));
    }
    // Without its blob the list is of no use: the chunk order alone is replayed.
    if present {
        t.working_set_blob = blob.cloned();
    } else {
        t.working_set.clear();
    }
    Ok((t, present))
}

/// `refs` newest believable date first (RFC 3339 dates sort as strings); undated last, in
/// the registry's order.
fn by_date(refs: &[Descriptor]) -> Vec<&Descriptor> {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let latest = rfc3339(now + CLOCK_SKEW_SECS);
    let mut candidates: Vec<&Descriptor> = refs.iter().collect();
    candidates.sort_by(|a, b| believable_date(&b.annotations, &latest).cmp(&believable_date(&a.annotations, &latest)));
    candidates
}

/// The newest usable trace of `refs` (trace manifests in `src`): a date in the future counts
/// as none (such a trace is tried last), and the newest [`MAX_TRACE_CANDIDATES`] are tried in
/// turn until one is usable ([`load_artifact`]), preferring one whose working-set blob is
/// there.
fn newest_usable(src: &dyn BlobSource, refs: &[Descriptor], image: &Image, file: usize) -> Result<Option<Trace>, FormatError> {
    let candidates = by_date(refs);
    if candidates.len() > MAX_TRACE_CANDIDATES {
        tracing::info!("{} traces of {}: looking at the newest {MAX_TRACE_CANDIDATES}", candidates.len(), image.manifest_digest);
    }
    let mut partial = None;
    for d in candidates.iter().take(MAX_TRACE_CANDIDATES) {
        if d.size > imgfmt::manifest::MAX_MANIFEST_BYTES {
            tracing::warn!("skipping the trace {}: its manifest is {} bytes", d.digest, d.size);
            continue;
        }
        match load_artifact(src, &d.digest, image, file) {
            Ok((t, true)) => return Ok(Some(t)),
            Ok((t, false)) => {
                tracing::warn!("the trace {}: its working-set blob is missing; looking for a trace with one", d.digest);
                partial.get_or_insert(t);
            }
            Err(e) => tracing::warn!("skipping the trace {}: {e}", d.digest),
        }
    }
    match partial {
        Some(t) => Ok(Some(t)),
        None if candidates.is_empty() => Ok(None),
        None => Err(invalid("trace", format!("none of the {} traces looked at can be used", candidates.len().min(MAX_TRACE_CANDIDATES)))),
    }
}

/// Traces in a local OCI layout, under the fallback tag.
pub struct LayoutTraces(pub OciLayout);

impl TraceStore for LayoutTraces {
    fn describe(&self) -> String {
        format!("oci:{}", self.0.root().display())
    }

    /// The newest usable trace among the image's referrers (the fallback tag names an
    /// index of them, or the one trace an older snapctl wrote), chosen as
    /// [`RegistryTraces`] chooses.
    fn load(&self, image: &Image, file: usize) -> Result<Option<Trace>, FormatError> {
        let refs = self.0.referrers(&image.manifest_digest)?;
        let traces: Vec<Descriptor> = refs.into_iter().filter(|d| d.artifact_type.as_deref().is_none_or(|t| t == TRACE_MEDIA_TYPE)).collect();
        newest_usable(&self.0, &traces, image, file)
    }

    fn store(&self, image: &Image, trace: &Trace, working_set: &[u8]) -> Result<(String, OciDigest), FormatError> {
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
        Ok((format!("{}:{} ({d})", self.describe(), fallback_tag(image)), d))
    }
}

/// Traces in a registry: pushed as referrers of the image (the registry's referrers API,
/// or the fallback tag the client maintains).
pub struct RegistryTraces {
    src: Arc<regclient::RegistrySource>,
    /// What [`TraceStore::prepare`] read for one image, until its `load` takes it.
    ahead: std::sync::Mutex<Option<ReadAhead>>,
}

/// The trace referrers of one image, or why they could not be listed.
struct ReadAhead {
    subject: OciDigest,
    refs: Result<Vec<Descriptor>, String>,
}

impl RegistryTraces {
    pub fn new(src: Arc<regclient::RegistrySource>) -> Self {
        RegistryTraces { src, ahead: std::sync::Mutex::new(None) }
    }

    /// The trace referrers of `manifest`.
    fn list(&self, manifest: &OciDigest) -> Result<Vec<Descriptor>, String> {
        self.src.list_referrers(manifest, Some(TRACE_MEDIA_TYPE)).map_err(|e| e.to_string())
    }
}

impl TraceStore for RegistryTraces {
    fn describe(&self) -> String {
        imgfmt::BlobSource::describe(self.src.as_ref())
    }

    /// Lists the image's traces: the first of the three round trips of loading a trace,
    /// as long as the image's config and index take. The rest (the newest trace's
    /// manifest, then its trace and whether its working set is there, asked at once) is
    /// `load`'s, which a replaying daemon runs while the whole outboards arrive: read here,
    /// the manifest put a round trip in front of the outboards' request.
    fn prepare(&self, manifest: &OciDigest) -> bool {
        let refs = self.list(manifest);
        let none = refs.as_ref().is_ok_and(|r| r.is_empty());
        *self.ahead.lock().expect("poisoned") = Some(ReadAhead { subject: manifest.clone(), refs });
        !none
    }

    /// The newest usable trace. Anyone who may push may add a referrer, and its date is
    /// what the pusher wrote: a date in the future counts as none (such a trace is tried
    /// last), and the newest [`MAX_TRACE_CANDIDATES`] are tried in turn until one is
    /// usable ([`load_artifact`]), preferring one whose working-set blob is there. The
    /// listing asks the registry for trace artifacts only (`artifactType`; the client
    /// filters where the registry cannot).
    fn load(&self, image: &Image, file: usize) -> Result<Option<Trace>, FormatError> {
        let ahead = self.ahead.lock().expect("poisoned").take().filter(|a| a.subject == image.manifest_digest);
        let refs = match ahead {
            Some(a) => a.refs,
            None => self.list(&image.manifest_digest),
        };
        let refs = refs.map_err(|e| invalid("trace referrers", e))?;
        newest_usable(self.src.as_ref(), &refs, image, file)
    }

    fn store(&self, image: &Image, trace: &Trace, working_set: &[u8]) -> Result<(String, OciDigest), FormatError> {
        let blob = serde_json::to_vec(trace).expect("trace serializes");
        let ann = [(media::ANN_CREATED.to_string(), now_rfc3339())].into_iter().collect();
        let mut layers = vec![(regclient::PAYLOAD_TYPE, blob.as_slice())];
        if !working_set.is_empty() {
            layers.push((WORKING_SET_MEDIA_TYPE, working_set));
        }
        let d = self.src.push_referrer_layers(&image.manifest_digest, TRACE_MEDIA_TYPE, &layers, ann).map_err(|e| invalid("trace push", e.to_string()))?;
        Ok((format!("{} referrer {d}", self.describe()), d))
    }
}

/// A trace store whose trace for one file was read ahead, beside the outboards, by
/// [`LoadedAhead::read`]: the daemon's own `load` then takes it without a round trip.
/// A replay plans its working set only once both are in (and a recording restore listens
/// only then), and the trace's round trips need nothing of the outboards, so the two
/// overlap. Everything else goes to the store.
pub struct LoadedAhead {
    store: Box<dyn TraceStore>,
    loaded: std::sync::Mutex<Option<ReadTrace>>,
}

/// What [`LoadedAhead::read`] read: for which image manifest and file, and the answer.
type ReadTrace = (OciDigest, usize, Result<Option<Trace>, FormatError>);

impl LoadedAhead {
    /// Load file `file`'s trace of `image` from `store` now.
    pub fn read(store: Box<dyn TraceStore>, image: &Image, file: usize) -> LoadedAhead {
        let r = store.load(image, file);
        LoadedAhead { store, loaded: std::sync::Mutex::new(Some((image.manifest_digest.clone(), file, r))) }
    }
}

impl TraceStore for LoadedAhead {
    fn describe(&self) -> String {
        self.store.describe()
    }
    /// The trace read ahead, once, for the image and file it was read for; any other
    /// load reads the store.
    fn load(&self, image: &Image, file: usize) -> Result<Option<Trace>, FormatError> {
        let taken = self.loaded.lock().expect("poisoned").take();
        match taken {
            Some((m, f, r)) if m == image.manifest_digest && f == file => r,
            _ => self.store.load(image, file),
        }
    }
    fn store(&self, image: &Image, trace: &Trace, working_set: &[u8]) -> Result<(String, OciDigest), FormatError> {
        self.store.store(image, trace, working_set)
    }
    fn prepare(&self, manifest: &OciDigest) -> bool {
        self.store.prepare(manifest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A trace read ahead answers the first load of its image and file, once, without
    /// reading the store; the next load reads the store again.
    #[test]
    fn regression_issue_23_a_trace_read_beside_the_outboards_is_the_one_the_daemon_loads() {
        struct Counting(LayoutTraces, Arc<std::sync::atomic::AtomicUsize>);
        impl TraceStore for Counting {
            fn describe(&self) -> String {
                self.0.describe()
            }
            fn load(&self, image: &Image, file: usize) -> Result<Option<Trace>, FormatError> {
                self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.0.load(image, file)
            }
            fn store(&self, image: &Image, trace: &Trace, ws: &[u8]) -> Result<(String, OciDigest), FormatError> {
                self.0.store(image, trace, ws)
            }
        }
        let (_d, _mem, image, layout) = crate::fetch::tests::sample_image(6);
        let file = image.file("vm.mem").unwrap().0;
        let (_, digest) = LayoutTraces(OciLayout::open(layout.root()).unwrap()).store(&image, &Trace::new("vm.mem", 1 << 16, vec![4, 0, 2]), &[]).unwrap();
        let loads = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let ahead = LoadedAhead::read(Box::new(Counting(LayoutTraces(layout), loads.clone())), &image, file);
        let n = || loads.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(n(), 1, "read once, ahead");
        let first = ahead.load(&image, file).unwrap().expect("the trace read ahead");
        assert_eq!((first.manifest.as_ref(), n()), (Some(&digest), 1), "taken from what was read ahead");
        let again = ahead.load(&image, file).unwrap().expect("from the store");
        assert_eq!((again.manifest.as_ref(), n()), (Some(&digest), 2), "once only; then the store");
        assert!(ahead.describe().starts_with("oci:"), "the store's name: {}", ahead.describe());
    }

    #[test]
    fn trace_round_trips_through_a_layout_and_is_checked() {
        let (_d, _mem, image, layout) = crate::fetch::tests::sample_image(6);
        let file = image.file("vm.mem").unwrap().0;
        let store = LayoutTraces(layout);
        assert_eq!(store.load(&image, file).unwrap(), None);
        let t = Trace::new("vm.mem", 1 << 16, vec![4, 0, 2]);
        let (at, digest) = store.store(&image, &t, &[]).unwrap();
        assert!(at.contains(&fallback_tag(&image)), "{at}");
        let loaded = store.load(&image, file).unwrap().unwrap();
        assert_eq!(loaded.manifest.as_ref(), Some(&digest), "it says which trace it is");
        assert!(loaded.created.is_some());
        assert_eq!(Trace { manifest: None, created: None, ..loaded }, t);
        // The image itself is untouched and still opens.
        let tags = store.0.tags().unwrap();
        assert_eq!(tags.len(), 2);
        // A trace naming chunks the file does not have is refused.
        let bad = serde_json::to_vec(&Trace::new("vm.mem", 1 << 16, vec![6])).unwrap();
        assert!(Trace::decode(&bad, &image, file).is_err());
        let other = serde_json::to_vec(&Trace::new("vm.state", 1 << 16, vec![0])).unwrap();
        assert!(Trace::decode(&other, &image, file).is_err());
        assert!(Trace::decode(b"{", &image, file).is_err());
        assert_eq!(now_rfc3339().len(), 20);
    }

    /// Issue 21 §4: a trace naming one zero chunk over and over (33 million times in 64 MiB)
    /// was loaded whole and copied for every VM. A list entry named twice, out of the
    /// file, or (working set) not a slice start is refused when the trace is parsed, and
    /// a trace longer than the image allows is refused before it is parsed.
    #[test]
    fn regression_issue_21_duplicates_and_strays_in_a_trace_are_refused_when_parsed() {
        let (_d, _mem, image, _layout) = crate::fetch::tests::sample_image(6);
        let file = image.file("vm.mem").unwrap().0;
        let trace = |lists: &str| format!(r#"{{"format":"snapctl.trace.v1","file":"vm.mem","chunkSize":65536,{lists}}}"#);
        let refused = |lists: &str| Trace::decode(trace(lists).as_bytes(), &image, file).expect_err(lists).to_string();
        // (Chunks 1 and 4 of the six are zero.)
        let good = Trace::decode(trace(r#""chunks":[5,0],"workingSet":[4096,0],"zeroChunks":[4,1]"#).as_bytes(), &image, file).unwrap();
        assert_eq!((good.chunks, good.working_set, good.zero_chunks), (vec![5, 0], vec![4096, 0], vec![4, 1]));
        for (lists, why) in [
            (r#""chunks":[0],"zeroChunks":[1,1]"#, "zero chunk 1 listed twice"),
            (r#""chunks":[0,2,0]"#, "chunk 0 listed twice"),
            (r#""chunks":[0],"workingSet":[8192,4096,8192]"#, "working-set offset 8192 listed twice"),
            (r#""chunks":[0],"workingSet":[4100]"#, "working-set offset 4100 is not a multiple of 4096"),
            (r#""chunks":[0],"workingSet":[393216]"#, "working-set offset 393216 beyond the file's 393216 bytes"),
            (r#""chunks":[6]"#, "chunk 6 beyond the file's 6 chunks"),
            (r#""chunks":[0],"zeroChunks":[1],"zeroChunks":[4]"#, "duplicate field"),
            (r#""chunks":[0],"extra":1"#, "unknown field"),
            (r#""zeroChunks":[1]"#, "missing field `chunks`"),
        ] {
            let e = refused(lists);
            assert!(e.contains(why), "{lists}: {e}");
        }
        // The one zero chunk named a million times (2 MB): refused before a byte is parsed,
        // as the image's six chunks cannot need more than a few KiB of trace.
        let mut big = String::from("1");
        while big.len() < 2 << 20 {
            big.push_str(",1");
        }
        let e = refused(&format!(r#""chunks":[0],"zeroChunks":[{big}]"#));
        assert!(e.contains("too large") || e.contains("limit"), "{e}");
        assert!(max_trace_bytes(&image, file) < 100 << 10, "{}", max_trace_bytes(&image, file));
        // Within the bound, the parse stops at the second mention (serde's position says where).
        let mut many = String::from("1");
        while many.len() < 30_000 {
            many.push_str(",1");
        }
        let e = refused(&format!(r#""chunks":[0],"zeroChunks":[{many}]"#));
        assert!(e.contains("zero chunk 1 listed twice"), "{e}");
        let column: usize = e.rsplit("column ").next().and_then(|c| c.trim().parse().ok()).expect("a position");
        assert!(column < 120, "read up to column {column} of {}", many.len());
    }

    /// A date in the future, or one that is not a date, does not order traces.
    #[test]
    fn only_believable_dates_order_traces() {
        let at = |c: &str| [(media::ANN_CREATED.to_string(), c.to_string())].into_iter().collect::<std::collections::BTreeMap<_, _>>();
        let latest = rfc3339(1_800_000_000);
        assert_eq!(latest, "2027-01-15T08:00:00Z");
        assert_eq!(believable_date(&at("2026-12-01T10:00:00Z"), &latest), Some("2026-12-01T10:00:00Z"));
        assert_eq!(believable_date(&at("2026-12-01"), &latest), Some("2026-12-01"));
        assert_eq!(believable_date(&at("9999-12-31T00:00:00Z"), &latest), None);
        assert_eq!(believable_date(&at("yesterday"), &latest), None);
        assert_eq!(believable_date(&Default::default(), &latest), None);
    }
}
