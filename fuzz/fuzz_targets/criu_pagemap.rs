//! CRIU pagemap decoding (`lazy::pagemap`, built here from its source file so the
//! fuzz crate does not pull in the lazy crate's uffd and network stack): never panics, never allocates
//! beyond the input; what decodes re-encodes to the same pagemap, and its pages runs are
//! consistent (ascending, non-overlapping, offsets summing to `pages_bytes`).
#![no_main]

#[allow(dead_code)]
#[path = "../../lazy/src/pagemap.rs"]
mod pagemap;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(p) = pagemap::decode_pagemap(data) else { return };
    let again = pagemap::decode_pagemap(&pagemap::encode_pagemap(&p)).expect("an accepted pagemap re-encodes to an accepted pagemap");
    assert_eq!(again, p);
    let mut off = 0;
    let mut end = 0;
    for r in p.runs() {
        assert_eq!(r.offset, off);
        assert!(r.vaddr >= end && r.len > 0);
        off += r.len;
        end = r.vaddr + r.len;
    }
    assert_eq!(off, p.pages_bytes());
});
