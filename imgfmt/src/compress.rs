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
}

impl Codec {
    pub fn code(self) -> u8 {
        match self {
            Codec::Raw => 0,
            Codec::Zstd => 1,
            Codec::Flate => 2,
        }
    }
    pub fn from_code(c: u8) -> Option<Self> {
        match c {
            0 => Some(Codec::Raw),
            1 => Some(Codec::Zstd),
            2 => Some(Codec::Flate),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Codec::Raw => "raw",
            Codec::Zstd => "zstd",
            Codec::Flate => "flate",
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
    }
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
}
