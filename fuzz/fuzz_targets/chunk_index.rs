//! `ChunkIndex::decode` on arbitrary bytes: never panics, never allocates more than the
//! blob, and whatever it accepts re-encodes to the same bytes and decodes to the same value.
#![no_main]

use imgfmt::ChunkIndex;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(ix) = ChunkIndex::decode(data) else { return };
    let enc = ix.encode();
    assert_eq!(enc.len(), ix.encoded_len());
    let again = ChunkIndex::decode(&enc).expect("an accepted index re-encodes to an accepted index");
    assert_eq!(again, ix, "decode(encode(x)) != x");
    // Reserved bytes are ignored by this version, so only the bytes that carry meaning
    // must survive the round trip; with zeroed reserved bytes the encoding is exact.
    if enc.len() == data.len() && canonical(data) {
        assert_eq!(enc, data, "a canonical index re-encodes to the same bytes");
    }
    // Lookups agree with the record table.
    for (fi, _) in ix.files.iter().enumerate() {
        for r in ix.file_records(fi) {
            assert_eq!(ix.find(fi, r.chunk), Some(r));
        }
    }
});

/// Whether `b` (a decoded index) is what the encoder writes: every reserved byte zero, and
/// the minor version 1 exactly when a record is zstd-ref (codec 3, whose bytes 28..32 are
/// its reference pack rather than reserved).
fn canonical(b: &[u8]) -> bool {
    use imgfmt::index::{FILE_ENTRY_LEN, HEADER_LEN, PACK_ENTRY_LEN, RECORD_LEN};
    let files = u32::from_le_bytes(b[16..20].try_into().unwrap()) as usize;
    let packs = u32::from_le_bytes(b[20..24].try_into().unwrap()) as usize;
    if b[15] != 0 || b[32..HEADER_LEN].iter().any(|&x| x != 0) {
        return false;
    }
    let ft = HEADER_LEN;
    if (0..files).any(|i| b[ft + i * FILE_ENTRY_LEN + 24..ft + (i + 1) * FILE_ENTRY_LEN].iter().any(|&x| x != 0)) {
        return false;
    }
    let rt = ft + files * FILE_ENTRY_LEN + packs * PACK_ENTRY_LEN;
    let is_ref = |r: &[u8]| r[12] == 1 && r[13] == 3;
    let minor = if b[rt..].chunks(RECORD_LEN).any(is_ref) { [1, 0] } else { [0, 0] };
    b[10..12] == minor && b[rt..].chunks(RECORD_LEN).all(|r| r[14..16] == [0, 0] && (is_ref(r) || r[28..32] == [0, 0, 0, 0]))
}
