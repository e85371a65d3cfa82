//! Signature storage on arbitrary bytes: `sign::manifest::decode` (a `.sig` or referrer
//! manifest) and `sign::Payload::decode` never panic; what decodes is within the bounds
//! (layers, sizes) and round-trips.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sign::manifest::{self, MAX_SIGNATURE_LAYERS, SIMPLE_SIGNING_TYPE};
use sign::payload::MAX_PAYLOAD_BYTES;
use sign::Payload;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = manifest::decode(data) {
        assert!(m.layers.len() <= MAX_SIGNATURE_LAYERS);
        assert!(m.layers.iter().filter(|l| l.media_type == SIMPLE_SIGNING_TYPE).all(|l| l.size <= MAX_PAYLOAD_BYTES));
        let again = manifest::decode(&m.encode()).expect("an accepted manifest re-encodes");
        assert_eq!(again, m);
        // Appending a signature keeps the layers already there.
        if let Ok(Some(appended)) = manifest::tag_manifest(Some(&m), [manifest::signature_layer(b"p", b"s")]) {
            let a = manifest::decode(&appended.manifest).expect("a merge is within the bounds readers apply");
            assert_eq!(&a.layers[..m.layers.len()], &m.layers[..]);
        }
    }
    if let Ok(p) = Payload::decode(data) {
        assert_eq!(Payload::decode(&p.encode()).expect("an accepted payload re-encodes"), p);
    }
});
