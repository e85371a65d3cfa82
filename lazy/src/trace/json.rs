//! A trace's JSON (spec/lazy.md "Prefetch and traces"): the [`Trace`] type and a parser
//! whose cost is bounded by the file the trace is for, not by the trace. Self-contained
//! (imgfmt, serde, serde_json), so the fuzz crate builds it alone (`fuzz_targets/trace_json.rs`).
//!
//! ```text
//! {"format":"snapctl.trace.v1","file":"vm.mem","chunkSize":65536,"chunks":[9,0,20],
//!  "workingSet":[643072,53248,1363968],"zeroChunks":[1]}
//!   chunks, zeroChunks: distinct, each < the file's chunks      (a bit per chunk)
//!   workingSet:         distinct multiples of 4 KiB < its size   (a bit per 4 KiB)
//!   the first entry that is not: refused there, the rest unread
//! ```

use std::fmt;

use imgfmt::manifest::Descriptor;
use imgfmt::OciDigest;
use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde::Serialize;

/// Value of [`Trace::format`].
pub const TRACE_FORMAT: &str = "snapctl.trace.v1";
/// Working-set offsets are slice starts, and no slice is smaller than this.
pub const MIN_SLICE: u64 = 1 << imgfmt::outboard::MIN_SLICE_SHIFT;

/// The order in which a restore first faulted the chunks of the memory file, the working
/// set it touched and the zero chunks it met.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
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
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub working_set: Vec<u64>,
    /// Zero chunks the restore touched, each once, first touch first: installed (as zeros,
    /// nothing fetched) before the guest asks, as the working set is.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub zero_chunks: Vec<u64>,
    /// The working-set blob's descriptor (the trace manifest's second layer), as loaded.
    #[serde(skip)]
    pub working_set_blob: Option<Descriptor>,
    /// The trace manifest's digest, as loaded or stored.
    #[serde(skip)]
    pub manifest: Option<OciDigest>,
    /// Its `org.opencontainers.image.created` annotation, as loaded (what the pusher says).
    #[serde(skip)]
    pub created: Option<String>,
}

impl Trace {
    pub fn new(file: &str, chunk_size: u64, chunks: Vec<u64>) -> Self {
        Trace {
            format: TRACE_FORMAT.into(),
            file: file.into(),
            chunk_size,
            chunks,
            working_set: Vec::new(),
            zero_chunks: Vec::new(),
            working_set_blob: None,
            manifest: None,
            created: None,
        }
    }
}

/// Parse a trace's JSON for a file of `chunks` chunks and `size` bytes: what it costs is a
/// bit per chunk and per 4 KiB page of the file and the lists it keeps, each no longer than
/// those, whatever the input (a list entry out of range, not a slice start or named twice
/// stops the parse there). Unknown and repeated fields are refused.
pub fn parse(b: &[u8], chunks: u64, size: u64) -> Result<Trace, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(b);
    let t = TraceSeed { chunks, size }.deserialize(&mut de)?;
    de.end()?;
    Ok(t)
}

/// The fields of a trace's JSON, in [`TraceSeed`]'s order.
const FIELDS: &[&str] = &["format", "file", "chunkSize", "chunks", "workingSet", "zeroChunks"];

/// Decodes a trace's JSON for a file of `chunks` chunks and `size` bytes.
struct TraceSeed {
    chunks: u64,
    size: u64,
}

impl<'de> DeserializeSeed<'de> for TraceSeed {
    type Value = Trace;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Trace, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for TraceSeed {
    type Value = Trace;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a snapctl trace object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Trace, A::Error> {
        let mut t = Trace::new("", 0, Vec::new());
        let mut seen = [false; FIELDS.len()];
        while let Some(key) = m.next_key::<String>()? {
            let i = FIELDS.iter().position(|f| *f == key).ok_or_else(|| de::Error::unknown_field(&key, FIELDS))?;
            if std::mem::replace(&mut seen[i], true) {
                return Err(de::Error::duplicate_field(FIELDS[i]));
            }
            match i {
                0 => t.format = m.next_value()?,
                1 => t.file = m.next_value()?,
                2 => t.chunk_size = m.next_value()?,
                3 => t.chunks = m.next_value_seed(Distinct { what: "chunk", end: self.chunks, unit: "chunks", step: 1 })?,
                4 => t.working_set = m.next_value_seed(Distinct { what: "working-set offset", end: self.size, unit: "bytes", step: MIN_SLICE })?,
                _ => t.zero_chunks = m.next_value_seed(Distinct { what: "zero chunk", end: self.chunks, unit: "chunks", step: 1 })?,
            }
        }
        if let Some(i) = (0..4).find(|&i| !seen[i]) {
            return Err(de::Error::missing_field(FIELDS[i]));
        }
        Ok(t)
    }
}

/// A list of distinct multiples of `step` below `end`, refused at the first entry that is
/// not: it is never longer than `end / step`, and costs a bit per possible entry.
struct Distinct {
    what: &'static str,
    end: u64,
    unit: &'static str,
    step: u64,
}

impl<'de> DeserializeSeed<'de> for Distinct {
    type Value = Vec<u64>;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Vec<u64>, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Distinct {
    type Value = Vec<u64>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "a list of distinct {}s", self.what)
    }

    fn visit_seq<S: SeqAccess<'de>>(self, mut s: S) -> Result<Vec<u64>, S::Error> {
        let slots = self.end.div_ceil(self.step);
        let mut seen = vec![0u64; slots.div_ceil(64) as usize];
        let mut out = Vec::new();
        while let Some(x) = s.next_element::<u64>()? {
            if x >= self.end {
                return Err(de::Error::custom(format_args!("{} {x} beyond the file's {} {}", self.what, self.end, self.unit)));
            }
            if x % self.step != 0 {
                return Err(de::Error::custom(format_args!("{} {x} is not a multiple of {}", self.what, self.step)));
            }
            let i = x / self.step;
            let (word, bit) = ((i / 64) as usize, 1u64 << (i % 64));
            if seen[word] & bit != 0 {
                return Err(de::Error::custom(format_args!("{} {x} listed twice", self.what)));
            }
            seen[word] |= bit;
            out.push(x);
        }
        Ok(out)
    }
}
