//! `ImageConfig::decode` on arbitrary bytes: never panics; what it accepts re-encodes to
//! a config that decodes to the same value.
#![no_main]

use imgfmt::ImageConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(c) = ImageConfig::decode(data) else { return };
    let again = ImageConfig::decode(&c.encode()).expect("an accepted config re-encodes to an accepted config");
    assert_eq!(again, c);
    assert_eq!(1u64 << c.chunk_shift(), c.chunk_size);
});
