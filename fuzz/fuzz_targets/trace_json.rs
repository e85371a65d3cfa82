//! A prefetch trace's JSON (`lazy::trace`'s parser, built here from its source file so the
//! fuzz crate does not pull in the lazy crate's uffd and network stack): never panics, and
//! what it keeps is bounded by the file it is for, whatever the input: each list is
//! distinct and in range (working-set offsets multiples of 4 KiB), so never longer than the
//! file has chunks or pages; what parses re-parses from its own JSON to the same trace.
#![no_main]

#[allow(dead_code)]
#[path = "../../lazy/src/trace/json.rs"]
mod json;

use libfuzzer_sys::fuzz_target;

/// The file the traces are for: 64 chunks of 64 KiB.
const CHUNKS: u64 = 64;
const SIZE: u64 = CHUNKS << 16;

fuzz_target!(|data: &[u8]| {
    let Ok(t) = json::parse(data, CHUNKS, SIZE) else { return };
    for (list, end, step) in [(&t.chunks, CHUNKS, 1), (&t.zero_chunks, CHUNKS, 1), (&t.working_set, SIZE, json::MIN_SLICE)] {
        let mut seen = std::collections::HashSet::new();
        for &x in list.iter() {
            assert!(x < end && x % step == 0, "{x} kept in a list bounded by {end}");
            assert!(seen.insert(x), "{x} kept twice");
        }
    }
    let again = json::parse(&serde_json::to_vec(&t).expect("a trace serializes"), CHUNKS, SIZE).expect("a kept trace re-parses");
    assert_eq!(again, t);
});
