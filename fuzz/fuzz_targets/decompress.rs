//! `imgfmt::compress::decompress`: output is exactly `raw_len` bytes or an error, whatever
//! the stored bytes claim; and compressing then decompressing is the identity.
//!
//! Input: `[mode][raw_len: u24 le][bytes…]`. Mode bit 7 set: compress `bytes` with the codec
//! of bits 0..1 and check the round trip. Clear: decompress `bytes` as that codec into
//! `raw_len` bytes (at most 1 MiB, so the fuzzer stays fast; the bound is what is tested).
#![no_main]

use imgfmt::compress::{decompress, Codec};
use imgfmt::Compression;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    let mode = data[0];
    let raw_len = (u32::from_le_bytes([data[1], data[2], data[3], 0]) & 0x0f_ffff) as usize;
    let bytes = &data[4..];
    let codec = match mode & 3 {
        0 => Codec::Raw,
        1 => Codec::Zstd,
        _ => Codec::Flate,
    };
    if mode & 0x80 != 0 {
        let comp = match codec {
            Codec::Raw => Compression::None,
            Codec::Zstd => Compression::Zstd(1 + (mode as i32 >> 2 & 7)),
            Codec::Flate => Compression::Flate((mode as u32 >> 2) & 7),
        };
        match comp.compress(bytes) {
            None => {}
            Some((c, z)) => {
                assert_eq!(c, codec);
                // The ~6% rule: kept only when it saves enough.
                assert!(z.len() <= bytes.len() / 64 * 60);
                assert_eq!(decompress(c, &z, bytes.len()).expect("round trip"), bytes);
                if !bytes.is_empty() {
                    assert!(decompress(c, &z, bytes.len() - 1).is_err());
                }
                assert!(decompress(c, &z, bytes.len() + 1).is_err());
            }
        }
        return;
    }
    if let Ok(out) = decompress(codec, bytes, raw_len) {
        assert_eq!(out.len(), raw_len, "decompress returned a length other than the bound");
    }
});
