//! Where signatures are stored: cosign's signature manifests.
//!
//! **Tag scheme** (what cosign writes by default, and skopeo reads and writes): an OCI
//! image manifest tagged `sha256-<hex>.sig` beside the image `sha256:<hex>`, one layer per
//! signature:
//!
//! ```text
//! config   application/vnd.oci.image.config.v1+json   {"architecture":"","created":"0001-01-01T00:00:00Z",
//!                                                      "history":[{"created":…},…],"os":"",
//!                                                      "rootfs":{"type":"layers","diff_ids":[<layer digests>]},"config":{}}
//! layers[] application/vnd.dev.cosign.simplesigning.v1+json: the payload;
//!          annotations {"dev.cosignproject.cosign/signature": base64 of the ASN.1 ECDSA signature}
//! ```
//!
//! A new signature is appended to the layers already there (other signers keep theirs),
//! by `sign` and by `copy` alike ([`tag_manifest`]).
//!
//! **Referrer** (cosign's `--registry-referrers-mode=oci-1-1`): an OCI image manifest with
//! `subject` naming the image and `artifactType`
//! `application/vnd.dev.cosign.artifact.sig.v1+json`, the OCI empty config, and the same
//! kind of layer; found through the registry's referrers API.
//!
//! Both are read with bounds: a manifest over [`MAX_SIGNATURE_MANIFEST_BYTES`], more than
//! [`MAX_SIGNATURE_LAYERS`] layers, or a signature layer larger than the payload limit is
//! refused, never fetched.

use std::collections::BTreeMap;

use imgfmt::{media, Descriptor, Manifest, OciDigest};

use crate::payload::MAX_PAYLOAD_BYTES;

/// Media type of a signature layer (the payload).
pub const SIMPLE_SIGNING_TYPE: &str = "application/vnd.dev.cosign.simplesigning.v1+json";
/// The layer annotation holding the base64 signature.
pub const SIGNATURE_ANNOTATION: &str = "dev.cosignproject.cosign/signature";
/// `artifactType` of a signature referrer (cosign's `ArtifactType("sig")`).
pub const SIGNATURE_ARTIFACT_TYPE: &str = "application/vnd.dev.cosign.artifact.sig.v1+json";
/// Config media type of a tag-scheme signature manifest.
pub const OCI_CONFIG_TYPE: &str = "application/vnd.oci.image.config.v1+json";
/// The OCI empty config, for referrers.
pub const EMPTY_CONFIG_TYPE: &str = "application/vnd.oci.empty.v1+json";
/// Largest signature manifest read. One signature layer's descriptor is ~400 bytes
/// (more with a certificate chain, as keyless signatures carry); 256 KiB holds hundreds.
pub const MAX_SIGNATURE_MANIFEST_BYTES: u64 = 256 << 10;
/// Most layers looked at in one signature manifest (each costs a fetch).
pub const MAX_SIGNATURE_LAYERS: usize = 64;
/// Most signature referrers of one image looked at.
pub const MAX_SIGNATURE_REFERRERS: usize = 16;

#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum ManifestError {
    /// signature manifest of {got} bytes is over the {limit}-byte limit
    TooLarge { got: u64, limit: u64 },
    /// signature manifest has {got} layers, more than {limit}
    TooManyLayers { got: usize, limit: usize },
    /// malformed signature manifest: {0}
    Malformed(String),
}

pub use imgfmt::store::signature_tag;

/// A signature manifest's bytes read, bounded and checked for shape: an OCI image manifest
/// whose layer count and layer sizes are within bounds. Signature layers (by media type)
/// are what the caller fetches; other layers (attestations, SBOMs) are left alone.
pub fn decode(bytes: &[u8]) -> Result<Manifest, ManifestError> {
    if bytes.len() as u64 > MAX_SIGNATURE_MANIFEST_BYTES {
        return Err(ManifestError::TooLarge { got: bytes.len() as u64, limit: MAX_SIGNATURE_MANIFEST_BYTES });
    }
    let m = Manifest::decode(bytes).map_err(|e| ManifestError::Malformed(e.to_string()))?;
    if let Some(mt) = &m.media_type {
        if mt != media::OCI_MANIFEST {
            return Err(ManifestError::Malformed(format!("mediaType {mt:?}, not an OCI image manifest")));
        }
    }
    if m.layers.len() > MAX_SIGNATURE_LAYERS {
        return Err(ManifestError::TooManyLayers { got: m.layers.len(), limit: MAX_SIGNATURE_LAYERS });
    }
    for l in m.layers.iter().filter(|l| l.media_type == SIMPLE_SIGNING_TYPE) {
        if l.size > MAX_PAYLOAD_BYTES {
            return Err(ManifestError::Malformed(format!("signature layer {} claims {} bytes (limit {MAX_PAYLOAD_BYTES})", l.digest, l.size)));
        }
    }
    Ok(m)
}

/// The descriptor of a signature layer: the payload's digest and size, the signature in
/// its annotation.
pub fn signature_layer(payload: &[u8], signature: &[u8]) -> Descriptor {
    use base64::Engine as _;
    Descriptor::new(SIMPLE_SIGNING_TYPE, OciDigest::of(payload), payload.len() as u64)
        .with_annotation(SIGNATURE_ANNOTATION, base64::engine::general_purpose::STANDARD.encode(signature))
}

/// The config of a tag-scheme signature manifest over `layers`, as go-containerregistry
/// writes it for cosign: an OCI image config whose rootfs lists the layers (they are
/// uncompressed, so each diff ID is the layer's digest), one history entry each.
pub fn tag_config(layers: &[Descriptor]) -> Vec<u8> {
    // Fields in go-containerregistry's order, so the bytes equal cosign's for the same layers.
    #[derive(serde::Serialize)]
    struct Config<'a> {
        architecture: &'a str,
        created: &'a str,
        history: Vec<serde_json::Value>,
        os: &'a str,
        rootfs: RootFs,
        config: serde_json::Value,
    }
    #[derive(serde::Serialize)]
    struct RootFs {
        #[serde(rename = "type")]
        kind: &'static str,
        diff_ids: Vec<String>,
    }
    let zero = "0001-01-01T00:00:00Z";
    let c = Config {
        architecture: "",
        created: zero,
        history: layers.iter().map(|_| serde_json::json!({"created": zero})).collect(),
        os: "",
        rootfs: RootFs { kind: "layers", diff_ids: layers.iter().map(|l| l.digest.to_string()).collect() },
        config: serde_json::json!({}),
    };
    serde_json::to_vec(&c).expect("serializes")
}

/// A tag-scheme manifest: `existing` (if any) with each of `add` appended that it does not
/// hold yet (the same payload with the same signature), and its config. This is the one
/// way signatures are added to a tag, by `sign` (one new layer) and by `copy` (the
/// source's layers into the destination's): other signers keep theirs. Returns the
/// manifest and its config, or `None` when nothing is new (the tag stays as it is);
/// a result over [`MAX_SIGNATURE_LAYERS`] or [`MAX_SIGNATURE_MANIFEST_BYTES`] is refused,
/// since no reader would read it.
pub fn tag_manifest(existing: Option<&Manifest>, add: impl IntoIterator<Item = Descriptor>) -> Result<Option<TagManifest>, ManifestError> {
    let mut layers = existing.map(|m| m.layers.clone()).unwrap_or_default();
    let before = layers.len();
    for l in add {
        if !layers.iter().any(|h| same_signature(h, &l)) {
            layers.push(l);
        }
    }
    if existing.is_some() && layers.len() == before {
        return Ok(None);
    }
    if layers.len() > MAX_SIGNATURE_LAYERS {
        return Err(ManifestError::TooManyLayers { got: layers.len(), limit: MAX_SIGNATURE_LAYERS });
    }
    let config = tag_config(&layers);
    let m = Manifest {
        schema_version: 2,
        media_type: Some(media::OCI_MANIFEST.into()),
        artifact_type: None,
        config: Descriptor::new(OCI_CONFIG_TYPE, OciDigest::of(&config), config.len() as u64),
        layers,
        subject: None,
        annotations: existing.map(|m| m.annotations.clone()).unwrap_or_default(),
    };
    let bytes = m.encode();
    if bytes.len() as u64 > MAX_SIGNATURE_MANIFEST_BYTES {
        return Err(ManifestError::TooLarge { got: bytes.len() as u64, limit: MAX_SIGNATURE_MANIFEST_BYTES });
    }
    Ok(Some(TagManifest { config, manifest: bytes }))
}

/// A tag-scheme manifest's bytes and its config's, as [`tag_manifest`] builds them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TagManifest {
    pub config: Vec<u8>,
    pub manifest: Vec<u8>,
}

/// Two layers carry the same signature: the same payload and the same signature value.
/// (The payload alone is not enough: two keys may sign identical payloads.)
fn same_signature(a: &Descriptor, b: &Descriptor) -> bool {
    a.digest == b.digest && a.annotations.get(SIGNATURE_ANNOTATION) == b.annotations.get(SIGNATURE_ANNOTATION)
}

/// A referrer manifest for one signature of `subject`. Returns the manifest's bytes (its
/// config is the two-byte empty config `{}`).
pub fn referrer_manifest(subject: Descriptor, layer: Descriptor) -> Vec<u8> {
    let m = Manifest {
        schema_version: 2,
        media_type: Some(media::OCI_MANIFEST.into()),
        artifact_type: Some(SIGNATURE_ARTIFACT_TYPE.into()),
        config: Descriptor::new(EMPTY_CONFIG_TYPE, OciDigest::of(b"{}"), 2),
        layers: vec![layer],
        subject: Some(subject),
        annotations: BTreeMap::new(),
    };
    m.encode()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appending_keeps_other_signers_layers() {
        let a = signature_layer(b"pa", b"sa");
        let first = tag_manifest(None, [a.clone()]).unwrap().unwrap().manifest;
        let m = decode(&first).unwrap();
        let TagManifest { config, manifest: second } = tag_manifest(Some(&m), [signature_layer(b"pb", b"sb")]).unwrap().unwrap();
        let m2 = decode(&second).unwrap();
        assert_eq!(m2.layers.len(), 2);
        assert_eq!(m2.layers[0], a);
        assert_eq!(m2.config.digest, OciDigest::of(&config));
        // The bytes go-containerregistry writes for cosign over the same two layers.
        let want = format!(
            r#"{{"architecture":"","created":"0001-01-01T00:00:00Z","history":[{{"created":"0001-01-01T00:00:00Z"}},{{"created":"0001-01-01T00:00:00Z"}}],"os":"","rootfs":{{"type":"layers","diff_ids":["{}","{}"]}},"config":{{}}}}"#,
            m2.layers[0].digest, m2.layers[1].digest
        );
        assert_eq!(String::from_utf8(config).unwrap(), want);
        assert_eq!(signature_tag(&OciDigest::of(b"x")), format!("sha256-{}.sig", OciDigest::of(b"x").hex()));
    }

    #[test]
    fn merging_another_manifests_layers_keeps_both_and_adds_each_signature_once() {
        let (a, b, c) = (signature_layer(b"pa", b"sa"), signature_layer(b"pb", b"sb"), signature_layer(b"pa", b"other key"));
        let ours = decode(&tag_manifest(None, [a.clone(), b.clone()]).unwrap().unwrap().manifest).unwrap();
        // The same payload signed by another key is another signature.
        let merged = tag_manifest(Some(&ours), [b.clone(), c.clone(), a.clone()]).unwrap().unwrap().manifest;
        assert_eq!(decode(&merged).unwrap().layers, vec![a.clone(), b.clone(), c]);
        // Nothing new: the tag is left as it is.
        assert!(tag_manifest(Some(&ours), [a, b]).unwrap().is_none());
        // A merge no reader would read is refused.
        let full = decode(&tag_manifest(None, (0..MAX_SIGNATURE_LAYERS).map(|i| signature_layer(&[i as u8], b"s"))).unwrap().unwrap().manifest).unwrap();
        assert!(matches!(tag_manifest(Some(&full), [signature_layer(b"one more", b"s")]), Err(ManifestError::TooManyLayers { .. })));
    }

    #[test]
    fn bounds_are_refused_before_anything_is_fetched() {
        let many: Vec<Descriptor> = (0..MAX_SIGNATURE_LAYERS + 1).map(|i| signature_layer(&[i as u8], b"s")).collect();
        let mut m = decode(&tag_manifest(None, [many[0].clone()]).unwrap().unwrap().manifest).unwrap();
        m.layers = many;
        assert!(matches!(decode(&m.encode()), Err(ManifestError::TooManyLayers { .. })));
        m.layers.truncate(1);
        m.layers[0].size = MAX_PAYLOAD_BYTES + 1;
        assert!(matches!(decode(&m.encode()), Err(ManifestError::Malformed(_))));
        assert!(matches!(decode(&vec![b' '; MAX_SIGNATURE_MANIFEST_BYTES as usize + 1]), Err(ManifestError::TooLarge { .. })));
        assert!(decode(b"{\"schemaVersion\":2}").is_err());
    }
}
