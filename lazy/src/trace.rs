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
use imgfmt::{media, FormatError, Image, OciLayout};
use serde::{Deserialize, Serialize};

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

/// The tag under which an OCI layout keeps the trace of `image` (the referrers API's
/// fallback tag scheme).
pub fn fallback_tag(image: &Image) -> String {
    format!("{}-{}", image.manifest_digest.algorithm(), image.manifest_digest.hex())
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
        let tag = fallback_tag(image);
        let Some((_, desc)) = self.0.tags()?.into_iter().find(|(t, _)| *t == tag) else { return Ok(None) };
        let m = Manifest::decode(&imgfmt::source::read_verified_blob(&self.0, &desc.digest, imgfmt::manifest::MAX_MANIFEST_BYTES)?)?;
        if m.artifact_type.as_deref() != Some(TRACE_MEDIA_TYPE) || m.subject.as_ref().map(|s| &s.digest) != Some(&image.manifest_digest) {
            return Err(invalid("trace manifest", format!("tag {tag} is not a trace of {}", image.manifest_digest)));
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
        let m = trace_manifest(image, &blob, ws).encode();
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
        assert_eq!(now_rfc3339().len(), 20);
    }
}
