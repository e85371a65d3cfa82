//! A repository's `_pulled` object, the pull times retention reads
//! (`registry::pulls::decode`, spec/registry.md §4.3): never panics; every entry it keeps
//! is a digest; what it keeps encodes to an object that decodes to the same entries.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(m) = registry::pulls::decode(data) else { return };
    assert!(m.len() <= data.len() / 8, "{} entries from {} bytes", m.len(), data.len());
    let again = registry::pulls::decode(&registry::pulls::encode(&m)).expect("an encoded object decodes");
    assert_eq!(again, m);
});
