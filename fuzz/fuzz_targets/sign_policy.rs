//! `sign::Policy::from_bytes` (containers-policy.json) on arbitrary bytes: never panics;
//! what parses answers `requirements_for` for registry and layout images, and each
//! signedIdentity answers for any payload name.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sign::policy::Requirement;
use sign::{DockerRef, ImageIdentity, Policy};

fuzz_target!(|data: &[u8]| {
    let Ok(p) = Policy::from_bytes(data, std::path::Path::new("fuzz.json")) else { return };
    let names = ["127.0.0.1:5000/vm/web:v1", "r.example.com/a/b@sha256:0000000000000000000000000000000000000000000000000000000000000000", "busybox:latest"];
    for n in names {
        let id = ImageIdentity::docker(DockerRef::parse(n).expect("valid name"));
        let (_, reqs) = p.requirements_for(&id);
        assert!(!reqs.is_empty(), "an accepted policy has no empty requirement list");
        for r in reqs {
            if let Requirement::SigstoreSigned(rule) = r {
                for signed in names.iter().chain(&["127.0.0.1:5000/vm/web", "not a name"]) {
                    let _ = rule.signed_identity.accepts(id.docker.as_ref(), signed);
                    let _ = rule.signed_identity.accepts(None, signed);
                }
            }
        }
    }
    let _ = p.requirements_for(&ImageIdentity::layout(std::path::Path::new("/srv/images/a")));
});
