//! `Reference` parsing: never panics; what parses prints to a string that parses back to
//! the same reference.
#![no_main]

use imgfmt::reference::Reference;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    let Ok(r) = s.parse::<Reference>() else { return };
    let printed = r.to_string();
    let again: Reference = printed.parse().unwrap_or_else(|e| panic!("{s:?} parsed to {r:?}, printed as {printed:?}, which does not parse: {e}"));
    assert_eq!(again, r, "{s:?} -> {printed:?}");
});
