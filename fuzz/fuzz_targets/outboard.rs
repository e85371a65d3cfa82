//! `Outboard::decode` on arbitrary bytes: never panics, never allocates more than the blob;
//! whatever it accepts re-encodes to an accepted outboard equal to it (byte-identical when
//! its reserved bytes are zero), every entry is found by its digest with CV runs that tile
//! the chunk, and merging an entry's CVs (what `verify` does before trusting one) is safe.
//! `OutboardTable::decode_prefix` on any prefix of the bytes, with their length as the
//! blob's: never panics, and accepts exactly what `decode` accepts once the prefix holds the
//! entries, with the same entries and CV ranges that hold the same CVs.
#![no_main]

use imgfmt::outboard::{slice_count, Outboard, OutboardTable, ENTRY_LEN, HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let decoded = Outboard::decode(data);
    let entries = data.get(16..20).map_or(0, |b| u64::from(u32::from_le_bytes(b.try_into().unwrap())));
    let need = (OutboardTable::prefix_len(entries) as usize).min(data.len());
    // A prefix one byte short of the entries, and one that holds them.
    if need > 0 {
        let _ = OutboardTable::decode_prefix(&data[..need - 1], data.len() as u64);
    }
    let table = OutboardTable::decode_prefix(&data[..need], data.len() as u64);
    assert_eq!(table.is_ok(), decoded.is_ok(), "the table and the blob decoders disagree: {:?} / {:?}", table.as_ref().err(), decoded.as_ref().err());
    let Ok(ob) = decoded else { return };
    let table = table.unwrap();
    assert_eq!(table.entries, ob.entries);
    for i in 0..ob.entries.len() {
        let (at, len) = table.cv_range(i);
        table.set_cvs(i, &data[at as usize..at as usize + len]).expect("the CV range of an accepted blob");
        assert_eq!(table.entry(i).unwrap().cvs, ob.entry(i).cvs);
    }
    let enc = ob.encode();
    assert_eq!(enc.len(), ob.encoded_len());
    assert_eq!(enc.len(), data.len(), "the decoder checks the exact length");
    let again = Outboard::decode(&enc).expect("an accepted outboard re-encodes to an accepted outboard");
    assert_eq!(again, ob, "decode(encode(x)) != x");
    if canonical(data) {
        assert_eq!(enc, data, "a canonical outboard re-encodes to the same bytes");
    }
    let mut next = 0u64;
    for (i, e) in ob.entries.iter().enumerate() {
        let s = ob.find(&e.digest).expect("every entry is found by its digest");
        assert_eq!(s.cvs, ob.entry(i).cvs);
        assert_eq!(e.first_cv, next);
        let n = slice_count(u64::from(e.chunk_len), ob.slice_shift);
        assert!(n >= 2);
        assert_eq!(u64::from(s.slice_count()), n);
        assert_eq!(s.slice_range(0).start, 0);
        assert_eq!(s.slice_range(s.slice_count() - 1).end, u64::from(e.chunk_len));
        next += n;
        let _ = verify::hash::merge_slice_cvs(s.cvs);
    }
    assert_eq!(next, ob.cvs.len() as u64);
});

/// Whether every reserved byte of `b` (an accepted outboard) is zero.
fn canonical(b: &[u8]) -> bool {
    let entries = u32::from_le_bytes(b[16..20].try_into().unwrap()) as usize;
    b[10..12] == [0, 0]
        && b[15] == 0
        && b[20..24] == [0, 0, 0, 0]
        && (0..entries).all(|i| b[HEADER_LEN + i * ENTRY_LEN + 36..HEADER_LEN + i * ENTRY_LEN + 40] == [0, 0, 0, 0])
}
