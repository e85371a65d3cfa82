//! `imgfmt::compress::decompress`: output is exactly `raw_len` bytes or an error, whatever
//! the stored bytes claim; and compressing then decompressing is the identity.
//!
//! Input: `[mode][raw_len: u24 le][bytes…]`. Mode bit 7 set: compress `bytes` with the codec
//! of bits 0..1 and check the round trip. Clear: decompress `bytes` as that codec into
//! `raw_len` bytes (at most 1 MiB, so the fuzzer stays fast; the bound is what is tested).
//!
//! Codec bits 3 (zstd-ref): `bytes` is `[ref_len: u16 le][reference][rest]`. Compress mode:
//! `rest` against the reference, and back. Decompress mode: `rest` as a zstd-ref chunk's
//! stored bytes (header decoded with its bounds, then the frame against the reference).
#![no_main]

use imgfmt::compress::{compress_ref, decompress, decompress_ref, Codec, RefHeader, REF_HEADER_LEN};
use imgfmt::Compression;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    let mode = data[0];
    let raw_len = (u32::from_le_bytes([data[1], data[2], data[3], 0]) & 0x0f_ffff) as usize;
    let bytes = &data[4..];
    if mode & 3 == 3 {
        if bytes.len() < 2 {
            return;
        }
        let ref_len = (u16::from_le_bytes([bytes[0], bytes[1]]) as usize).min(bytes.len() - 2);
        let (reference, rest) = bytes[2..].split_at(ref_len);
        if mode & 0x80 != 0 {
            if let Some(frame) = compress_ref(rest, reference, 1 + (mode as i32 >> 2 & 7), mode & 0x40 != 0) {
                // Kept only when it saves the ~6% with its header counted.
                assert!(frame.len() + REF_HEADER_LEN <= rest.len() / 64 * 60);
                assert_eq!(decompress_ref(&frame, reference, rest.len()).expect("round trip"), rest);
                assert!(decompress_ref(&frame, reference, rest.len() + 1).is_err());
            }
            return;
        }
        if let Ok((h, frame)) = RefHeader::decode(rest, 1 << 20) {
            assert!(h.len as usize <= 1 << 20 && h.len > 0);
            assert!(h.codec.ref_pack().is_none(), "a reference is never zstd-ref");
            if let Ok(out) = decompress_ref(frame, reference, raw_len) {
                assert_eq!(out.len(), raw_len, "decompress_ref returned a length other than the bound");
            }
        }
        return;
    }
    let codec = match mode & 3 {
        0 => Codec::Raw,
        1 => Codec::Zstd,
        _ => Codec::Flate,
    };
    if mode & 0x80 != 0 {
        let comp = match codec {
            Codec::Raw => Compression::None,
            Codec::Zstd => Compression::Zstd(1 + (mode as i32 >> 2 & 7)),
            _ => Compression::Flate((mode as u32 >> 2) & 7),
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
