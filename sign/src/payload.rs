//! The simple-signing payload cosign signs: which manifest, under which name.
//!
//! ```json
//! {"critical":{"identity":{"docker-reference":"127.0.0.1:5000/vm/web:v1"},
//!              "image":{"docker-manifest-digest":"sha256:…"},
//!              "type":"cosign container image signature"},
//!  "optional":{"creator":"snapctl 0.1.0","timestamp":1767225600}}
//! ```
//!
//! Read as strictly as containers/image reads it (skopeo and podman): `critical` and
//! `optional` both present and nothing else; `critical` exactly `identity`, `image` and
//! `type`; `identity` exactly `docker-reference`; `image` exactly
//! `docker-manifest-digest`; no key twice anywhere in those; `type` that exact string.
//! `optional` is `null` (what cosign writes) or an object whose `creator`, if present,
//! is a string and `timestamp` an integer; its other keys are ignored.

use serde::{Deserialize, Serialize};

/// `critical.type` of every cosign image signature.
pub const SIGNATURE_TYPE: &str = "cosign container image signature";
/// Largest payload read: a simple-signing payload is a few hundred bytes; cosign's
/// `-a key=value` annotations add to `optional`.
pub const MAX_PAYLOAD_BYTES: u64 = 256 << 10;

#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum PayloadError {
    /// payload of {0} bytes is over the 256 KiB limit
    TooLarge(u64),
    /// not a cosign simple-signing payload: {0}
    Malformed(String),
}

/// A simple-signing payload. What it says is only as good as the signature over its
/// bytes: [`crate::check`] verifies the signature before it decodes these.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payload {
    /// `critical.identity.docker-reference`: the name the signer gave the image
    /// (`host/repo`, `host/repo:tag` or `host/repo@digest`).
    pub docker_reference: String,
    /// `critical.image.docker-manifest-digest`: the manifest signed.
    pub manifest_digest: String,
    /// `optional.creator`.
    pub creator: Option<String>,
    /// `optional.timestamp`, Unix seconds.
    pub timestamp: Option<i64>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Wire {
    critical: Critical,
    optional: serde_json::Value,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Critical {
    identity: Identity,
    image: Image,
    #[serde(rename = "type")]
    kind: String,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Identity {
    #[serde(rename = "docker-reference")]
    docker_reference: String,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Image {
    #[serde(rename = "docker-manifest-digest")]
    docker_manifest_digest: String,
}

impl Payload {
    /// The payload `snapctl sign` writes.
    pub fn new(docker_reference: &str, manifest_digest: &imgfmt::OciDigest, timestamp: Option<i64>) -> Self {
        Payload {
            docker_reference: docker_reference.into(),
            manifest_digest: manifest_digest.to_string(),
            creator: Some(concat!("snapctl ", env!("CARGO_PKG_VERSION")).into()),
            timestamp,
        }
    }

    /// The payload's bytes, compact JSON, keys in the order above.
    pub fn encode(&self) -> Vec<u8> {
        let mut optional = serde_json::Map::new();
        if let Some(c) = &self.creator {
            optional.insert("creator".into(), c.clone().into());
        }
        if let Some(t) = self.timestamp {
            optional.insert("timestamp".into(), t.into());
        }
        let w = Wire {
            critical: Critical {
                identity: Identity { docker_reference: self.docker_reference.clone() },
                image: Image { docker_manifest_digest: self.manifest_digest.clone() },
                kind: SIGNATURE_TYPE.into(),
            },
            optional: if optional.is_empty() { serde_json::Value::Null } else { optional.into() },
        };
        serde_json::to_vec(&w).expect("payload serializes")
    }

    /// Read a payload strictly (see the module doc).
    pub fn decode(b: &[u8]) -> Result<Self, PayloadError> {
        if b.len() as u64 > MAX_PAYLOAD_BYTES {
            return Err(PayloadError::TooLarge(b.len() as u64));
        }
        // serde's derived structs refuse a field given twice and, with
        // deny_unknown_fields, any field not listed.
        let w: Wire = serde_json::from_slice(b).map_err(|e| PayloadError::Malformed(e.to_string()))?;
        if w.critical.kind != SIGNATURE_TYPE {
            return Err(PayloadError::Malformed(format!("critical.type is {:?}", w.critical.kind)));
        }
        let (mut creator, mut timestamp) = (None, None);
        match &w.optional {
            serde_json::Value::Null => {}
            serde_json::Value::Object(m) => {
                if let Some(c) = m.get("creator") {
                    creator = Some(c.as_str().ok_or_else(|| PayloadError::Malformed("optional.creator is not a string".into()))?.to_string());
                }
                if let Some(t) = m.get("timestamp") {
                    let f = t.as_f64().ok_or_else(|| PayloadError::Malformed("optional.timestamp is not a number".into()))?;
                    let i = t.as_i64().or_else(|| (f.fract() == 0.0 && f.abs() < 9.0e15).then_some(f as i64));
                    timestamp = Some(i.ok_or_else(|| PayloadError::Malformed("optional.timestamp is not an integer".into()))?);
                }
            }
            _ => return Err(PayloadError::Malformed("optional is neither null nor an object".into())),
        }
        Ok(Payload { docker_reference: w.critical.identity.docker_reference, manifest_digest: w.critical.image.docker_manifest_digest, creator, timestamp })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cosigns_payload_reads() {
        let cosign = br#"{"critical":{"identity":{"docker-reference":"index.docker.io/namespace/image"},"image":{"docker-manifest-digest":"sha256:4aa3054270f7a70b4528f2064ee90961788e1e1518703592ae4463de3b889dec"},"type":"cosign container image signature"},"optional":null}"#;
        let p = Payload::decode(cosign).unwrap();
        assert_eq!(p.docker_reference, "index.docker.io/namespace/image");
        assert_eq!(p.creator, None);
        let skopeo = br#"{"critical":{"identity":{"docker-reference":"r/a:v1"},"image":{"docker-manifest-digest":"sha256:00"},"type":"cosign container image signature"},"optional":{"creator":"containers/image 5.23.1","timestamp":1700000000,"extra":[1]}}"#;
        let p = Payload::decode(skopeo).unwrap();
        assert_eq!(p.timestamp, Some(1700000000));
        let ours = Payload::new("r/a:v1", &imgfmt::OciDigest::of(b"m"), Some(5));
        assert_eq!(Payload::decode(&ours.encode()).unwrap(), ours);
    }

    #[test]
    fn anything_else_is_refused() {
        let good = r#"{"critical":{"identity":{"docker-reference":"r/a"},"image":{"docker-manifest-digest":"sha256:00"},"type":"cosign container image signature"},"optional":null}"#;
        Payload::decode(good.as_bytes()).unwrap();
        for bad in [
            good.replace("\"optional\":null", "\"optional\":null,\"x\":1"),
            good.replace(",\"optional\":null", ""),
            good.replace("\"type\"", "\"identity\":{\"docker-reference\":\"evil/b\"},\"type\""),
            good.replace("cosign container image signature", "other"),
            good.replace("\"docker-manifest-digest\":\"sha256:00\"", "\"docker-manifest-digest\":\"sha256:00\",\"more\":1"),
            good.replace("null", "[]"),
            good.replace("null", "{\"timestamp\":1.5}"),
            good.replace("null", "{\"creator\":7}"),
        ] {
            assert!(Payload::decode(bad.as_bytes()).is_err(), "{bad}");
        }
    }
}
