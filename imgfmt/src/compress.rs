//! Per-chunk compression. A chunk is stored compressed only when that saves at least
//! [`MIN_SAVING`] of its size; otherwise it is stored raw, so incompressible memory costs
//! no CPU at restore time.

use std::fmt;
use std::io::{Read, Write};
use std::str::FromStr;

use crate::FormatError;

/// A stored chunk must be at most this fraction (in 1/64ths) of its raw size to be kept
/// compressed: 60/64 ≈ 94%, i.e. compression must save at least ~6%.
pub const MIN_SAVING: (usize, usize) = (60, 64);

/// How chunks of an image are compressed (the packer's choice; the index records the
/// codec of each chunk separately).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compression {
    #[default]
    None,
    Zstd(i32),
    Flate(u32),
}

/// The codec of one stored chunk, as recorded in the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Codec {
    Raw,
    Zstd,
    Flate,
    /// A zstd frame compressed against another stored chunk (its *reference*, usually
    /// the base's chunk at the same position) as a raw-content prefix. The stored bytes
    /// start with a [`RefHeader`] that says where the reference is stored; the number is
    /// the reference's pack (in an index: its pack table; in a resolved image: its packs).
    ZstdRef(u32),
}

impl Codec {
    pub fn code(self) -> u8 {
        match self {
            Codec::Raw => 0,
            Codec::Zstd => 1,
            Codec::Flate => 2,
            Codec::ZstdRef(_) => 3,
        }
    }
    /// The codec of index code `c`; `ref_pack` is the record's reference pack field, used
    /// only by `zstd-ref`.
    pub fn from_code(c: u8, ref_pack: u32) -> Option<Self> {
        match c {
            0 => Some(Codec::Raw),
            1 => Some(Codec::Zstd),
            2 => Some(Codec::Flate),
            3 => Some(Codec::ZstdRef(ref_pack)),
            _ => None,
        }
    }
    /// The pack a `zstd-ref` chunk's reference is stored in.
    pub fn ref_pack(self) -> Option<u32> {
        match self {
            Codec::ZstdRef(p) => Some(p),
            _ => None,
        }
    }
    /// The same codec with its reference pack renumbered (a resolved image numbers packs
    /// across its chain).
    pub fn map_ref(self, f: impl FnOnce(u32) -> u32) -> Self {
        match self {
            Codec::ZstdRef(p) => Codec::ZstdRef(f(p)),
            c => c,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Codec::Raw => "raw",
            Codec::Zstd => "zstd",
            Codec::Flate => "flate",
            Codec::ZstdRef(_) => "zstd-ref",
        }
    }
}

impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Compression::None => f.write_str("none"),
            Compression::Zstd(l) => write!(f, "zstd:{l}"),
            Compression::Flate(l) => write!(f, "flate:{l}"),
        }
    }
}

impl FromStr for Compression {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (name, level) = match s.split_once(':') {
            Some((n, l)) => (n, Some(l)),
            None => (s, None),
        };
        let parse = |l: &str, lo: i64, hi: i64| -> Result<i64, String> {
            let v: i64 = l.parse().map_err(|_| format!("compression level {l:?} is not a number"))?;
            if !(lo..=hi).contains(&v) {
                return Err(format!("compression level {v} out of range {lo}..={hi}"));
            }
            Ok(v)
        };
        match name {
            "none" | "raw" if level.is_none() => Ok(Compression::None),
            "zstd" => Ok(Compression::Zstd(level.map(|l| parse(l, 1, 22)).transpose()?.unwrap_or(3) as i32)),
            "flate" | "deflate" => Ok(Compression::Flate(level.map(|l| parse(l, 0, 9)).transpose()?.unwrap_or(6) as u32)),
            _ => Err(format!("unknown compression {s:?} (expected none, zstd[:1-22] or flate[:0-9])")),
        }
    }
}

impl Compression {
    /// Compress `raw`; `None` when the result would not save enough to be worth storing.
    pub fn compress(self, raw: &[u8]) -> Option<(Codec, Vec<u8>)> {
        let limit = raw.len() / MIN_SAVING.1 * MIN_SAVING.0;
        let (codec, out) = match self {
            Compression::None => return None,
            Compression::Zstd(level) => (Codec::Zstd, zstd::bulk::compress(raw, level).ok()?),
            Compression::Flate(level) => {
                let mut enc = flate2::write::DeflateEncoder::new(Vec::with_capacity(raw.len() / 2), flate2::Compression::new(level));
                enc.write_all(raw).ok()?;
                (Codec::Flate, enc.finish().ok()?)
            }
        };
        (out.len() <= limit).then_some((codec, out))
    }
}

/// Decompress a stored chunk into exactly `raw_len` bytes.
///
/// `raw_len` comes from the index (the chunk's position), never from the stored bytes, so
/// a hostile blob cannot make this allocate more than one chunk, and output that is
/// shorter or longer than `raw_len` is an error.
pub fn decompress(codec: Codec, stored: &[u8], raw_len: usize) -> Result<Vec<u8>, FormatError> {
    let bad = |detail: String| FormatError::Invalid { what: "compressed chunk", detail };
    match codec {
        Codec::Raw => {
            if stored.len() != raw_len {
                return Err(bad(format!("raw chunk is {} bytes, expected {raw_len}", stored.len())));
            }
            Ok(stored.to_vec())
        }
        Codec::Zstd => {
            let mut out = vec![0u8; raw_len];
            let n = zstd::bulk::decompress_to_buffer(stored, &mut out[..]).map_err(|e| bad(format!("zstd: {e}")))?;
            if n != raw_len {
                return Err(bad(format!("zstd chunk decompressed to {n} bytes, expected {raw_len}")));
            }
            Ok(out)
        }
        Codec::Flate => {
            let mut out = Vec::with_capacity(raw_len);
            // Read one byte past the expected size to detect output that is too long
            // without ever holding more than raw_len + 1 bytes.
            flate2::read::DeflateDecoder::new(stored).take(raw_len as u64 + 1).read_to_end(&mut out).map_err(|e| bad(format!("deflate: {e}")))?;
            if out.len() != raw_len {
                return Err(bad(format!("deflate chunk decompressed to {}+ bytes, expected {raw_len}", out.len())));
            }
            Ok(out)
        }
        Codec::ZstdRef(_) => Err(bad("a zstd-ref chunk is decoded with its reference (decompress_ref)".into())),
    }
}

/// Length of the [`RefHeader`] at the start of a `zstd-ref` chunk's stored bytes.
pub const REF_HEADER_LEN: usize = 56;

/// Where a `zstd-ref` chunk's reference is stored (its pack is the record's reference
/// pack). 56 bytes, little-endian: offset u64, stored_len u32, len u32, codec u8 (raw,
/// zstd or deflate: a reference is never itself a `zstd-ref` chunk), 7 reserved bytes
/// (0), digest 32 bytes (the reference's chunk digest, checked before it is used).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefHeader {
    pub offset: u64,
    pub stored_len: u32,
    /// The reference's uncompressed length (at most the chunk size).
    pub len: u32,
    pub codec: Codec,
    pub digest: crate::ChunkDigest,
}

impl RefHeader {
    pub fn encode(&self) -> [u8; REF_HEADER_LEN] {
        let mut b = [0u8; REF_HEADER_LEN];
        b[0..8].copy_from_slice(&self.offset.to_le_bytes());
        b[8..12].copy_from_slice(&self.stored_len.to_le_bytes());
        b[12..16].copy_from_slice(&self.len.to_le_bytes());
        b[16] = self.codec.code();
        b[24..56].copy_from_slice(&self.digest.0);
        b
    }

    /// Split a `zstd-ref` chunk's stored bytes into its header and its frame. The
    /// reference's lengths are checked against `max_len` (the image's chunk size) and its
    /// codec must be raw, zstd or deflate with a length that codec allows.
    pub fn decode(stored: &[u8], max_len: u32) -> Result<(RefHeader, &[u8]), FormatError> {
        let bad = |detail: String| FormatError::Invalid { what: "zstd-ref chunk header", detail };
        if stored.len() <= REF_HEADER_LEN {
            return Err(bad(format!("{} stored bytes, not more than its {REF_HEADER_LEN}-byte header", stored.len())));
        }
        let (h, frame) = stored.split_at(REF_HEADER_LEN);
        let u32_at = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().expect("4 bytes"));
        let offset = u64::from_le_bytes(h[0..8].try_into().expect("8 bytes"));
        let (stored_len, len) = (u32_at(8), u32_at(12));
        let codec = match Codec::from_code(h[16], 0) {
            Some(c @ (Codec::Raw | Codec::Zstd | Codec::Flate)) => c,
            _ => return Err(bad(format!("reference codec {} (a reference is raw, zstd or deflate)", h[16]))),
        };
        if len == 0 || len > max_len {
            return Err(bad(format!("reference of {len} bytes (chunks are 1..={max_len})")));
        }
        let len_ok = match codec {
            Codec::Raw => stored_len == len,
            _ => stored_len > 0 && stored_len < len,
        };
        if !len_ok {
            return Err(bad(format!("reference stored_len {stored_len} impossible for a {len}-byte {} chunk", codec.name())));
        }
        if offset.checked_add(u64::from(stored_len)).is_none() {
            return Err(bad(format!("reference range {offset} + {stored_len} overflows")));
        }
        let digest = crate::ChunkDigest(h[24..56].try_into().expect("32 bytes"));
        Ok((RefHeader { offset, stored_len, len, codec, digest }, frame))
    }
}

/// The zstd window a `zstd-ref` frame needs: it must reach from the end of the chunk back
/// to the start of its reference.
fn ref_window_log(reference: usize, raw: usize) -> u32 {
    let span = (reference + raw).max(1 << 10) as u64;
    (64 - (span - 1).leading_zeros()).clamp(10, 27)
}

/// Compress `raw` as a zstd frame with `reference` as its raw-content prefix (what
/// `zstd --patch-from` does), with long-distance matching when `long`; `None` when the
/// frame would not save the ~6% the other codecs must (counting the header) or zstd fails.
pub fn compress_ref(raw: &[u8], reference: &[u8], level: i32, long: bool) -> Option<Vec<u8>> {
    use zstd::zstd_safe::{CCtx, CParameter};
    let limit = (raw.len() / MIN_SAVING.1 * MIN_SAVING.0).checked_sub(REF_HEADER_LEN)?;
    let mut cx = CCtx::create();
    cx.set_parameter(CParameter::CompressionLevel(level)).ok()?;
    cx.set_parameter(CParameter::WindowLog(ref_window_log(reference.len(), raw.len()))).ok()?;
    cx.set_parameter(CParameter::ContentSizeFlag(true)).ok()?;
    // Long-distance matching finds the reference's runs however far they moved: at level
    // 3 a gVisor clone's state file (375 KB, shifted and patched) came to 20 KB with it and
    // 35 KB without; from level 12 on it made no difference or cost a little.
    cx.set_parameter(CParameter::EnableLongDistanceMatching(long)).ok()?;
    cx.ref_prefix(reference).ok()?;
    let mut out: Vec<u8> = Vec::with_capacity(zstd::zstd_safe::compress_bound(raw.len()));
    cx.compress2(&mut out, raw).ok()?;
    (out.len() <= limit).then_some(out)
}

/// Decompress a `zstd-ref` frame against its (verified) reference into exactly `raw_len`
/// bytes. As in [`decompress`], the length comes from the index, and the window the frame
/// may ask for is bounded by what a reference and a chunk can span.
pub fn decompress_ref(frame: &[u8], reference: &[u8], raw_len: usize) -> Result<Vec<u8>, FormatError> {
    use zstd::zstd_safe::{DCtx, DParameter};
    let bad = |detail: String| FormatError::Invalid { what: "compressed chunk", detail };
    let mut dx = DCtx::create();
    dx.set_parameter(DParameter::WindowLogMax(ref_window_log(reference.len(), raw_len)))
        .map_err(|e| bad(format!("zstd-ref: {}", zstd::zstd_safe::get_error_name(e))))?;
    dx.ref_prefix(reference).map_err(|e| bad(format!("zstd-ref: {}", zstd::zstd_safe::get_error_name(e))))?;
    let mut out: Vec<u8> = Vec::with_capacity(raw_len);
    let n = dx.decompress(&mut out, frame).map_err(|e| bad(format!("zstd-ref: {}", zstd::zstd_safe::get_error_name(e))))?;
    if n != raw_len || out.len() != raw_len {
        return Err(bad(format!("zstd-ref chunk decompressed to {n} bytes, expected {raw_len}")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_specs() {
        assert_eq!("none".parse::<Compression>().unwrap(), Compression::None);
        assert_eq!("zstd".parse::<Compression>().unwrap(), Compression::Zstd(3));
        assert_eq!("zstd:19".parse::<Compression>().unwrap(), Compression::Zstd(19));
        assert_eq!("flate:1".parse::<Compression>().unwrap(), Compression::Flate(1));
        assert!("zstd:99".parse::<Compression>().is_err());
        assert!("lz4".parse::<Compression>().is_err());
    }

    #[test]
    fn round_trips_and_bounds() {
        let text: Vec<u8> = b"the quick brown fox ".iter().cycle().take(65536).copied().collect();
        for c in [Compression::Zstd(3), Compression::Flate(6)] {
            let (codec, z) = c.compress(&text).expect("text compresses");
            assert_eq!(decompress(codec, &z, text.len()).unwrap(), text);
            // A bound smaller than the real size is refused, never overrun.
            assert!(decompress(codec, &z, text.len() - 1).is_err());
            assert!(decompress(codec, &z, text.len() + 1).is_err());
        }
    }

    #[test]
    fn incompressible_is_stored_raw() {
        let mut x = 0x9e3779b97f4a7c15u64;
        let rnd: Vec<u8> = (0..65536)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        assert!(Compression::Zstd(3).compress(&rnd).is_none());
    }

    fn noise(n: usize, mut x: u64) -> Vec<u8> {
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn a_chunk_close_to_its_reference_costs_its_difference() {
        // Incompressible on its own; against a reference it differs from by an insertion
        // (every later byte shifted) and a changed page, it is a few hundred bytes.
        let reference = noise(1 << 20, 7);
        let mut raw = reference.clone();
        raw.splice(100..100, *b"eleven more");
        raw.truncate(1 << 20);
        raw[500_000..504_096].copy_from_slice(&noise(4096, 9));
        assert!(Compression::Zstd(3).compress(&raw).is_none());
        let frame = compress_ref(&raw, &reference, 3, true).expect("close to its reference");
        assert!(frame.len() < 4096 + 2048, "{} bytes", frame.len());
        assert_eq!(decompress_ref(&frame, &reference, raw.len()).unwrap(), raw);
        // The wrong reference or the wrong length never yields the chunk.
        let other = noise(1 << 20, 8);
        assert!(decompress_ref(&frame, &other, raw.len()).map_or(true, |out| out != raw));
        assert!(decompress_ref(&frame, &reference, raw.len() - 1).is_err());
        assert!(decompress_ref(&frame, &reference, raw.len() + 1).is_err());
        // Unrelated data is not worth a reference.
        assert!(compress_ref(&other, &reference, 3, true).is_none());
    }

    #[test]
    fn ref_headers_round_trip_and_bound_what_they_name() {
        let h = RefHeader { offset: 1 << 40, stored_len: 4000, len: 65536, codec: Codec::Zstd, digest: crate::ChunkDigest([7; 32]) };
        let mut stored = h.encode().to_vec();
        stored.push(0x28);
        let (back, frame) = RefHeader::decode(&stored, 65536).unwrap();
        assert_eq!((back, frame), (h, &[0x28u8][..]));
        assert!(RefHeader::decode(&stored[..REF_HEADER_LEN], 65536).is_err(), "no frame");
        assert!(RefHeader::decode(&stored, 32768).is_err(), "longer than a chunk");
        let mut r = stored.clone();
        r[16] = 3;
        assert!(RefHeader::decode(&r, 65536).is_err(), "a reference is never zstd-ref");
        let mut r = stored.clone();
        r[16] = 0;
        assert!(RefHeader::decode(&r, 65536).is_err(), "raw reference with stored_len != len");
        let mut r = stored;
        r[0..8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(RefHeader::decode(&r, 65536).is_err(), "range overflows");
    }
}
