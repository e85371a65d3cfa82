//! `Manifest::decode` on arbitrary bytes: never panics; round trips.
#![no_main]

use imgfmt::Manifest;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(m) = Manifest::decode(data) else { return };
    let again = Manifest::decode(&m.encode()).expect("an accepted manifest re-encodes to an accepted manifest");
    assert_eq!(again, m);
});
