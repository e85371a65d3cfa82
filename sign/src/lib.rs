//! Who made a manifest: cosign-format signatures, cosign's key files, and the
//! `containers-policy.json` subset that decides which images snapctl restores.
//!
//! The format crates prove that bytes are the ones a manifest names; this one proves who
//! named the manifest. It speaks cosign's formats, so cosign 2.x, skopeo and podman can
//! check what `snapctl sign` writes and snapctl can check what they write:
//!
//! ```text
//! key.rs       cosign.key (scrypt + NaCl secretbox over PKCS#8) and cosign.pub (PEM SPKI); ECDSA P-256
//! payload.rs   the simple-signing payload: {"critical":{identity, image digest, type}, "optional"}
//! manifest.rs  where signatures live: tag sha256-<hex>.sig (layers appended), OCI 1.1 referrers
//! identity.rs  docker references, and an image's policy scopes (registry path or layout directory)
//! policy.rs    containers-policy.json: default, transports, scopes, requirements, signedIdentity
//! check.rs     check() and sign(), through an imgfmt::ImageStore (registry or layout)
//! ```
//!
//! Keyless signing (Fulcio certificates, Rekor transparency log) needs the internet and is
//! not here: a policy rule that asks for it refuses, saying so. Sync core: the store is
//! `imgfmt::ImageStore`, implemented by the OCI layout and the registry client. The formats
//! are specified in `spec/sign.md`.

pub mod check;
pub mod identity;
pub mod key;
pub mod manifest;
pub mod payload;
pub mod policy;

pub use check::{check, sign, Accepted, CheckError, SignError, SignReport, Signatures};
pub use identity::{DockerRef, ImageIdentity, Transport};
pub use key::{KeyError, PrivateKey, PublicKey};
pub use payload::Payload;
pub use policy::{Policy, PolicyError, Requirement};

#[cfg(test)]
pub(crate) mod mem;

#[cfg(test)]
mod spec_example {
    /// The fenced block after `<!-- vector: NAME -->` in spec/sign.md.
    fn vector(spec: &str, name: &str) -> String {
        let marker = format!("<!-- vector: {name} -->");
        let at = spec.find(&marker).unwrap_or_else(|| panic!("spec/sign.md has no vector {name}"));
        let rest = &spec[at + marker.len()..];
        let start = rest.find("```").expect("fence") + 3;
        let body = &rest[start..];
        let body = &body[body.find('\n').expect("fence line") + 1..];
        body[..body.find("```").expect("closing fence")].trim_end_matches('\n').to_string()
    }

    #[test]
    fn spec_worked_example_verifies_byte_for_byte() {
        use base64::Engine as _;
        let spec = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../spec/sign.md")).expect("spec/sign.md");
        let v = |n| vector(&spec, n);
        let key = crate::PrivateKey::from_encrypted_pem(v("cosign.key").as_bytes(), b"example").expect("the example key decrypts");
        assert!(crate::PrivateKey::from_encrypted_pem(v("cosign.key").as_bytes(), b"Example").is_err());
        let public = crate::PublicKey::from_pem(v("cosign.pub").as_bytes()).unwrap();
        assert_eq!(key.public_key(), public);
        assert_eq!(public.to_pem().trim_end(), v("cosign.pub"));
        assert_eq!(public.fingerprint(), v("fingerprint"));
        let image: imgfmt::OciDigest = "sha256:03144e6235f58dd342bda5c8b7aecb41b8286b248b190287adc8908d14f3d2b8".parse().unwrap();
        let payload = crate::Payload { creator: Some("snapctl 0.1.0".into()), ..crate::Payload::new("127.0.0.1:5000/vm/web:v1", &image, Some(1767225600)) };
        assert_eq!(String::from_utf8(payload.encode()).unwrap(), v("payload"));
        assert_eq!(payload.encode().len(), 286);
        let sig = base64::engine::general_purpose::STANDARD.decode(v("signature")).unwrap();
        assert!(public.verify(v("payload").as_bytes(), &sig));
        assert!(public.verify(&payload.encode(), &key.sign(&payload.encode()).unwrap()), "a fresh signature verifies too");
        let layer = crate::manifest::signature_layer(&payload.encode(), &sig);
        assert_eq!(serde_json::to_string(&layer).unwrap(), v("layer"));
        let crate::manifest::TagManifest { config, manifest } = crate::manifest::tag_manifest(None, [layer.clone()]).unwrap().expect("a first signature");
        assert_eq!(String::from_utf8(config).unwrap(), v("tag-config"));
        assert_eq!(String::from_utf8(manifest.clone()).unwrap(), v("tag-manifest"));
        assert_eq!(imgfmt::OciDigest::of(&manifest).to_string(), v("tag-manifest-digest"));
        let subject = imgfmt::Descriptor::new(imgfmt::media::OCI_MANIFEST, image.clone(), 1100);
        let referrer = crate::manifest::referrer_manifest(subject, layer);
        assert_eq!(String::from_utf8(referrer.clone()).unwrap(), v("referrer-manifest"));
        assert_eq!(imgfmt::OciDigest::of(&referrer).to_string(), v("referrer-manifest-digest"));
        // The policy given in the text accepts it by tag and refuses :v2.
        let store = crate::mem::MemStore::default();
        store.set_tag(&crate::manifest::signature_tag(&image), &manifest);
        store.put(v("payload").as_bytes());
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("cosign.pub"), v("cosign.pub")).unwrap();
        let text = format!(
            r#"{{"default":[{{"type":"reject"}}],"transports":{{"docker":{{"127.0.0.1:5000/vm":[{{"type":"sigstoreSigned","keyPath":"{}"}}]}}}}}}"#,
            dir.path().join("cosign.pub").display()
        );
        let policy = crate::Policy::from_bytes(text.as_bytes(), std::path::Path::new("p")).unwrap();
        let id = |s: &str| crate::ImageIdentity::docker(crate::DockerRef::parse(s).unwrap());
        crate::check(&store, &policy, &id("127.0.0.1:5000/vm/web:v1"), &image).unwrap();
        crate::check(&store, &policy, &id(&format!("127.0.0.1:5000/vm/web@{image}")), &image).unwrap();
        assert!(crate::check(&store, &policy, &id("127.0.0.1:5000/vm/web:v2"), &image).is_err());
    }
}
