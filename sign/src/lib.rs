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
//! check.rs     the Store trait (registry or layout, glue in the CLI), check() and sign()
//! ```
//!
//! Keyless signing (Fulcio certificates, Rekor transparency log) needs the internet and is
//! not here: a policy rule that asks for it refuses, saying so. Sync core: the store is a
//! trait the binary implements over the registry client and the OCI layout. The formats
//! are specified in `spec/sign.md`.

pub mod check;
pub mod identity;
pub mod key;
pub mod manifest;
pub mod payload;
pub mod policy;

pub use check::{check, sign, Accepted, CheckError, SignError, SignReport, Signatures, Store};
pub use identity::{DockerRef, ImageIdentity, Transport};
pub use key::{KeyError, PrivateKey, PublicKey};
pub use payload::Payload;
pub use policy::{Policy, PolicyError, Requirement};

#[cfg(test)]
pub(crate) mod mem;
