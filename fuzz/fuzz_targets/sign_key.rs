//! cosign key files on arbitrary bytes: `PublicKey::from_pem` and
//! `PrivateKey::from_encrypted_pem` never panic, and never run scrypt with parameters
//! other than cosign's three; an accepted public key re-encodes to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sign::{PrivateKey, PublicKey};

fuzz_target!(|data: &[u8]| {
    if let Ok(k) = PublicKey::from_pem(data) {
        let again = PublicKey::from_pem(k.to_pem().as_bytes()).expect("an accepted key re-encodes");
        assert_eq!(again, k);
        assert!(!k.verify(b"payload", data));
    }
    if let Ok(k) = PrivateKey::from_encrypted_pem(data, b"") {
        let _ = k.public_key().fingerprint();
    }
});
