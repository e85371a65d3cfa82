//! The subset of `containers-policy.json` (containers-policy.json(5), what skopeo, podman
//! and CRI-O read) that decides which images snapctl restores.
//!
//! ```json
//! {"default": [{"type": "reject"}],
//!  "transports": {
//!    "docker": {
//!      "127.0.0.1:5000/vm": [{"type": "sigstoreSigned", "keyPath": "/etc/snapctl/cosign.pub",
//!                             "signedIdentity": {"type": "matchRepository"}}],
//!      "127.0.0.1:5000/scratch": [{"type": "insecureAcceptAnything"}]},
//!    "oci": {"/srv/images": [{"type": "insecureAcceptAnything"}]}}}
//! ```
//!
//! The requirements for an image are those of its most specific scope under its
//! transport (`docker` for a registry, `oci` for a layout; see
//! [`crate::identity::ImageIdentity`]), else the transport's `""` scope, else `default`.
//! Every requirement in the list must accept the image.
//!
//! Read as strictly as containers/image reads it: a key given twice, a field or a type
//! this grammar does not have, a scope an `oci` transport cannot match, or an empty list
//! of requirements is an error, never ignored. snapctl goes one step further and refuses
//! transport names containers/image does not define (a typo would otherwise quietly not
//! apply). Requirements snapctl understands but cannot check (`signedBy` GPG or X.509
//! signatures, `signedBaseLayer`, and `sigstoreSigned` with Fulcio, PKI or Rekor) parse,
//! and refuse every image they apply to, naming why.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::value::RawValue;

use crate::identity::{DockerRef, ImageIdentity};

/// Largest policy file read (CRI-O's and Fedora's defaults are a few KiB).
pub const MAX_POLICY_BYTES: u64 = 1 << 20;

/// Transport names containers/image defines.
const TRANSPORTS: &[&str] =
    &["docker", "oci", "atomic", "containers-storage", "dir", "docker-archive", "docker-daemon", "oci-archive", "ostree", "sif", "tarball"];

#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum PolicyError {
    /// reading policy {path}: {source}
    Read { path: PathBuf, source: std::io::Error },
    /// policy {path} is {got} bytes, over the 1 MiB limit
    TooLarge { path: PathBuf, got: u64 },
    /// invalid policy {path}: {message}
    Invalid { path: PathBuf, message: String },
}

/// A parsed policy.
#[derive(Debug, Clone)]
pub struct Policy {
    /// Where it was read from (for messages).
    pub path: PathBuf,
    pub default: Vec<Requirement>,
    /// transport → scope → requirements.
    pub transports: BTreeMap<String, BTreeMap<String, Vec<Requirement>>>,
}

/// One requirement of a scope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Requirement {
    InsecureAcceptAnything,
    Reject,
    /// Simple signing with GPG keys or X.509 (`signedBy`): parsed, not verified by
    /// snapctl; refuses where it applies.
    SignedBy {
        key_type: String,
    },
    /// `signedBaseLayer`: containers/image has not implemented it either; refuses.
    SignedBaseLayer,
    SigstoreSigned(SigstoreRule),
}

impl Requirement {
    pub fn type_name(&self) -> &'static str {
        match self {
            Requirement::InsecureAcceptAnything => "insecureAcceptAnything",
            Requirement::Reject => "reject",
            Requirement::SignedBy { .. } => "signedBy",
            Requirement::SignedBaseLayer => "signedBaseLayer",
            Requirement::SigstoreSigned(_) => "sigstoreSigned",
        }
    }
}

/// Where a `sigstoreSigned` rule's public keys come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// `keyPath` / `keyPaths`: a PEM file, read when the rule is applied.
    Path(PathBuf),
    /// `keyData` / `keyDatas`: the PEM text itself (base64 in the JSON).
    Data(Vec<u8>),
}

impl fmt::Display for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::Path(p) => write!(f, "key {}", p.display()),
            KeySource::Data(_) => f.write_str("key from keyData"),
        }
    }
}

/// `sigstoreSigned`: at least one cosign signature by one of `keys`, for this manifest,
/// whose identity `signed_identity` accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SigstoreRule {
    pub keys: Vec<KeySource>,
    pub signed_identity: IdentityMatch,
    /// A field snapctl cannot check (`fulcio`, `pki`, `rekorPublicKey*`): the rule refuses.
    pub unsupported: Option<String>,
}

/// `signedIdentity`: which `docker-reference` in a payload names the image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdentityMatch {
    /// The signed reference equals the image's, tag or digest included.
    MatchExact,
    /// As `MatchExact` for an image named by tag; for one named by digest, the signed
    /// reference's repository equals the image's (the default).
    MatchRepoDigestOrExact,
    /// The repositories are equal, tags and digests aside (cosign's own signatures name
    /// a repository only, so this is what accepts them).
    MatchRepository,
    /// The signed reference equals this one (which has a tag or a digest).
    ExactReference(DockerRef),
    /// The signed reference's repository equals this one.
    ExactRepository(DockerRef),
    /// `MatchRepoDigestOrExact` after the image's name has `prefix` replaced by
    /// `signed_prefix` (a mirror whose images were signed under the upstream name).
    RemapIdentity { prefix: String, signed_prefix: String },
}

impl IdentityMatch {
    pub fn type_name(&self) -> &'static str {
        match self {
            IdentityMatch::MatchExact => "matchExact",
            IdentityMatch::MatchRepoDigestOrExact => "matchRepoDigestOrExact",
            IdentityMatch::MatchRepository => "matchRepository",
            IdentityMatch::ExactReference(_) => "exactReference",
            IdentityMatch::ExactRepository(_) => "exactRepository",
            IdentityMatch::RemapIdentity { .. } => "remapIdentity",
        }
    }

    /// Whether a payload's `docker-reference` `signed` names image `image` (`None`: a
    /// layout, which has no docker name).
    pub fn accepts(&self, image: Option<&DockerRef>, signed: &str) -> bool {
        let Ok(sig) = DockerRef::parse(signed) else { return false };
        let repo_digest_or_exact = |intended: &DockerRef| {
            if sig.is_name_only() {
                false
            } else if intended.tag.is_some() {
                sig.to_string() == intended.to_string()
            } else if intended.digest.is_some() {
                sig.name == intended.name
            } else {
                false
            }
        };
        match self {
            IdentityMatch::MatchExact => image.is_some_and(|i| !i.is_name_only() && !sig.is_name_only() && sig.to_string() == i.to_string()),
            IdentityMatch::MatchRepoDigestOrExact => image.is_some_and(repo_digest_or_exact),
            IdentityMatch::MatchRepository => image.is_some_and(|i| sig.name == i.name),
            IdentityMatch::ExactReference(r) => !sig.is_name_only() && sig.to_string() == r.to_string(),
            IdentityMatch::ExactRepository(r) => sig.name == r.name,
            IdentityMatch::RemapIdentity { prefix, signed_prefix } => image.is_some_and(|i| {
                let matches = i.name == *prefix || (i.name.starts_with(prefix.as_str()) && i.name.as_bytes().get(prefix.len()) == Some(&b'/'));
                if !matches {
                    return repo_digest_or_exact(i);
                }
                let remapped = i.to_string().replacen(prefix.as_str(), signed_prefix, 1);
                DockerRef::parse(&remapped).is_ok_and(|r| repo_digest_or_exact(&r))
            }),
        }
    }
}

impl Policy {
    /// Read a policy file (at most [`MAX_POLICY_BYTES`]).
    pub fn from_file(path: &Path) -> Result<Self, PolicyError> {
        use std::io::Read as _;
        let f = std::fs::File::open(path).map_err(|source| PolicyError::Read { path: path.into(), source })?;
        let mut b = Vec::new();
        f.take(MAX_POLICY_BYTES + 1).read_to_end(&mut b).map_err(|source| PolicyError::Read { path: path.into(), source })?;
        if b.len() as u64 > MAX_POLICY_BYTES {
            return Err(PolicyError::TooLarge { path: path.into(), got: b.len() as u64 });
        }
        Self::from_bytes(&b, path)
    }

    /// Parse a policy's text; `path` is for messages and for nothing else.
    pub fn from_bytes(b: &[u8], path: &Path) -> Result<Self, PolicyError> {
        let invalid = |message: String| PolicyError::Invalid { path: path.into(), message };
        let top: Top = serde_json::from_slice(b).map_err(|e| invalid(e.to_string()))?;
        let default = requirements(&top.default).map_err(|e| invalid(format!("default: {e}")))?;
        let mut transports = BTreeMap::new();
        for (t, scopes) in top.transports.map(|u| u.0).unwrap_or_default() {
            if !TRANSPORTS.contains(&t.as_str()) {
                return Err(invalid(format!("unknown transport {t:?} (known: {})", TRANSPORTS.join(", "))));
            }
            let mut out = BTreeMap::new();
            for (scope, reqs) in scopes.0 {
                if t == "oci" && !scope.is_empty() {
                    check_path_scope(&scope).map_err(|e| invalid(format!("transports.oci: {e}")))?;
                }
                let r = requirements(&reqs).map_err(|e| invalid(format!("transports.{t}.{scope:?}: {e}")))?;
                out.insert(scope, r);
            }
            transports.insert(t, out);
        }
        Ok(Policy { path: path.into(), default, transports })
    }

    /// The requirements for `image`, and the rule they come from as a policy's reader
    /// would find it (`transports.docker."127.0.0.1:5000/vm"`, `default`).
    pub fn requirements_for(&self, image: &ImageIdentity) -> (String, &[Requirement]) {
        let t = image.transport.name();
        if let Some(scopes) = self.transports.get(t) {
            for s in std::iter::once(&image.scope).chain(&image.namespaces) {
                if let Some(r) = scopes.get(s) {
                    return (format!("transports.{t}.{s:?}"), r);
                }
            }
            if let Some(r) = scopes.get("") {
                return (format!("transports.{t}.\"\""), r);
            }
        }
        ("default".into(), &self.default)
    }
}

/// An `oci` scope: an absolute, clean path other than `/` (containers/image's rule).
fn check_path_scope(s: &str) -> Result<(), String> {
    if !s.starts_with('/') {
        return Err(format!("scope {s:?} must be an absolute path"));
    }
    if s == "/" {
        return Err("scope \"/\": use the transport's default scope \"\"".into());
    }
    if s.ends_with('/') || s.contains("//") || s.split('/').any(|c| c == "." || c == "..") {
        return Err(format!("scope {s:?} is not a clean path"));
    }
    Ok(())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Top {
    default: Box<RawValue>,
    transports: Option<Unique<Unique<Box<RawValue>>>>,
}

/// A JSON object whose keys are all different, in the order given.
struct Unique<V>(Vec<(String, V)>);

impl<'de, V: Deserialize<'de>> Deserialize<'de> for Unique<V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V2<V>(std::marker::PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for V2<V> {
            type Value = Unique<V>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Self::Value, A::Error> {
                let mut out: Vec<(String, V)> = Vec::new();
                while let Some(k) = m.next_key::<String>()? {
                    if out.iter().any(|(o, _)| *o == k) {
                        return Err(de::Error::custom(format!("duplicate key {k:?}")));
                    }
                    let v = m.next_value()?;
                    out.push((k, v));
                }
                Ok(Unique(out))
            }
        }
        d.deserialize_map(V2(std::marker::PhantomData))
    }
}

fn requirements(raw: &RawValue) -> Result<Vec<Requirement>, String> {
    let list: Vec<Box<RawValue>> = serde_json::from_str(raw.get()).map_err(|e| format!("not a list of requirements: {e}"))?;
    if list.is_empty() {
        return Err("the list of requirements must not be empty".into());
    }
    list.iter().enumerate().map(|(i, r)| requirement(r).map_err(|e| format!("requirement {i}: {e}"))).collect()
}

#[derive(Deserialize)]
struct TypeOnly {
    #[serde(rename = "type")]
    kind: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JustType {
    #[serde(rename = "type")]
    _kind: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct SignedByWire {
    #[serde(rename = "type")]
    _kind: String,
    key_type: String,
    key_path: Option<String>,
    key_paths: Option<Vec<String>>,
    key_data: Option<String>,
    signed_identity: Option<Box<RawValue>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct BaseLayerWire {
    #[serde(rename = "type")]
    _kind: String,
    base_layer_identity: Box<RawValue>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct SigstoreWire {
    #[serde(rename = "type")]
    _kind: String,
    key_path: Option<String>,
    key_paths: Option<Vec<String>>,
    key_data: Option<String>,
    key_datas: Option<Vec<String>>,
    fulcio: Option<serde_json::Value>,
    pki: Option<serde_json::Value>,
    rekor_public_key_path: Option<String>,
    rekor_public_key_paths: Option<Vec<String>>,
    rekor_public_key_data: Option<String>,
    rekor_public_key_datas: Option<Vec<String>>,
    signed_identity: Option<Box<RawValue>>,
}

fn key_data(s: &str) -> Result<Vec<u8>, String> {
    base64::engine::general_purpose::STANDARD.decode(s).map_err(|e| format!("keyData is not base64: {e}"))
}

fn requirement(raw: &RawValue) -> Result<Requirement, String> {
    let t: TypeOnly = serde_json::from_str(raw.get()).map_err(|e| e.to_string())?;
    let strict = |e: serde_json::Error| format!("{}: {e}", t.kind);
    Ok(match t.kind.as_str() {
        "insecureAcceptAnything" | "reject" => {
            let _: JustType = serde_json::from_str(raw.get()).map_err(strict)?;
            if t.kind == "reject" {
                Requirement::Reject
            } else {
                Requirement::InsecureAcceptAnything
            }
        }
        "signedBy" => {
            let w: SignedByWire = serde_json::from_str(raw.get()).map_err(strict)?;
            if !["GPGKeys", "signedByGPGKeys", "X509Certificates", "signedByX509CAs"].contains(&w.key_type.as_str()) {
                return Err(format!("signedBy: unknown keyType {:?}", w.key_type));
            }
            let sources = [w.key_path.is_some(), w.key_paths.is_some(), w.key_data.is_some()].iter().filter(|b| **b).count();
            if sources != 1 {
                return Err("signedBy: exactly one of keyPath, keyPaths and keyData".into());
            }
            if let Some(si) = &w.signed_identity {
                identity_match(si)?;
            }
            Requirement::SignedBy { key_type: w.key_type }
        }
        "signedBaseLayer" => {
            let w: BaseLayerWire = serde_json::from_str(raw.get()).map_err(strict)?;
            identity_match(&w.base_layer_identity)?;
            Requirement::SignedBaseLayer
        }
        "sigstoreSigned" => {
            let w: SigstoreWire = serde_json::from_str(raw.get()).map_err(strict)?;
            let mut keys = Vec::new();
            let mut given = 0;
            if let Some(p) = w.key_path {
                given += 1;
                keys.push(KeySource::Path(p.into()));
            }
            if let Some(ps) = w.key_paths {
                given += 1;
                if ps.is_empty() {
                    return Err("sigstoreSigned: keyPaths is empty".into());
                }
                keys.extend(ps.into_iter().map(|p| KeySource::Path(p.into())));
            }
            if let Some(d) = w.key_data {
                given += 1;
                keys.push(KeySource::Data(key_data(&d)?));
            }
            if let Some(ds) = w.key_datas {
                given += 1;
                if ds.is_empty() {
                    return Err("sigstoreSigned: keyDatas is empty".into());
                }
                for d in ds {
                    keys.push(KeySource::Data(key_data(&d)?));
                }
            }
            let mut unsupported = None;
            if w.fulcio.is_some() || w.pki.is_some() {
                given += 1;
                unsupported = Some(format!(
                    "{} certificates (keyless signing needs Fulcio; snapctl checks keys only)",
                    if w.fulcio.is_some() { "fulcio" } else { "pki" }
                ));
            }
            if given != 1 {
                return Err("sigstoreSigned: exactly one of keyPath, keyPaths, keyData, keyDatas, fulcio and pki".into());
            }
            if w.rekor_public_key_path.is_some()
                || w.rekor_public_key_paths.is_some()
                || w.rekor_public_key_data.is_some()
                || w.rekor_public_key_datas.is_some()
            {
                unsupported.get_or_insert_with(|| "rekorPublicKey* (snapctl does not check Rekor transparency log entries)".into());
            }
            let signed_identity = match &w.signed_identity {
                Some(si) => identity_match(si)?,
                None => IdentityMatch::MatchRepoDigestOrExact,
            };
            Requirement::SigstoreSigned(SigstoreRule { keys, signed_identity, unsupported })
        }
        other => return Err(format!("unknown requirement type {other:?}")),
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ExactReferenceWire {
    #[serde(rename = "type")]
    _kind: String,
    docker_reference: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ExactRepositoryWire {
    #[serde(rename = "type")]
    _kind: String,
    docker_repository: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RemapWire {
    #[serde(rename = "type")]
    _kind: String,
    prefix: String,
    signed_prefix: String,
}

/// A remapIdentity prefix: a domain (`host[:port]`) or a domain and a path.
fn check_prefix(s: &str) -> Result<String, String> {
    let ok = if s.contains('/') { DockerRef::parse(s).is_ok_and(|r| r.is_name_only() && r.name == s) } else { imgfmt::reference::check_host(s).is_ok() };
    if ok {
        Ok(s.to_string())
    } else {
        Err(format!("remapIdentity: prefix {s:?} is not a domain or a domain/path"))
    }
}

fn identity_match(raw: &RawValue) -> Result<IdentityMatch, String> {
    let t: TypeOnly = serde_json::from_str(raw.get()).map_err(|e| format!("signedIdentity: {e}"))?;
    let strict = |e: serde_json::Error| format!("signedIdentity {}: {e}", t.kind);
    Ok(match t.kind.as_str() {
        "matchExact" | "matchRepoDigestOrExact" | "matchRepository" => {
            let _: JustType = serde_json::from_str(raw.get()).map_err(strict)?;
            match t.kind.as_str() {
                "matchExact" => IdentityMatch::MatchExact,
                "matchRepository" => IdentityMatch::MatchRepository,
                _ => IdentityMatch::MatchRepoDigestOrExact,
            }
        }
        "exactReference" => {
            let w: ExactReferenceWire = serde_json::from_str(raw.get()).map_err(strict)?;
            let r = DockerRef::parse(&w.docker_reference)?;
            if r.is_name_only() {
                return Err(format!("exactReference {:?} has neither a tag nor a digest", w.docker_reference));
            }
            IdentityMatch::ExactReference(r)
        }
        "exactRepository" => {
            let w: ExactRepositoryWire = serde_json::from_str(raw.get()).map_err(strict)?;
            IdentityMatch::ExactRepository(DockerRef::parse(&w.docker_repository)?)
        }
        "remapIdentity" => {
            let w: RemapWire = serde_json::from_str(raw.get()).map_err(strict)?;
            IdentityMatch::RemapIdentity { prefix: check_prefix(&w.prefix)?, signed_prefix: check_prefix(&w.signed_prefix)? }
        }
        other => return Err(format!("unknown signedIdentity type {other:?}")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Policy, PolicyError> {
        Policy::from_bytes(s.as_bytes(), Path::new("p.json"))
    }

    #[test]
    fn the_longest_scope_wins_then_the_transport_default_then_default() {
        let p = parse(
            r#"{"default":[{"type":"reject"}],"transports":{"docker":{
                "r.io:5000/vm":[{"type":"sigstoreSigned","keyData":"eA==","signedIdentity":{"type":"matchRepository"}}],
                "r.io:5000/vm/web:v1":[{"type":"insecureAcceptAnything"}],
                "*.io":[{"type":"insecureAcceptAnything"},{"type":"reject"}],
                "":[{"type":"insecureAcceptAnything"}]}}}"#,
        )
        .unwrap();
        let id = |s: &str| ImageIdentity::docker(DockerRef::parse(s).unwrap());
        assert_eq!(p.requirements_for(&id("r.io:5000/vm/web:v1")).1, &[Requirement::InsecureAcceptAnything]);
        let (rule, reqs) = p.requirements_for(&id("r.io:5000/vm/web:v2"));
        assert_eq!(rule, "transports.docker.\"r.io:5000/vm\"");
        assert!(
            matches!(&reqs[0], Requirement::SigstoreSigned(r) if r.keys == [KeySource::Data(b"x".to_vec())] && r.signed_identity == IdentityMatch::MatchRepository)
        );
        assert_eq!(p.requirements_for(&id("q.io/a:1")).1.len(), 2);
        assert_eq!(p.requirements_for(&id("localhost:5/a:1")).0, "transports.docker.\"\"");
        assert_eq!(p.requirements_for(&ImageIdentity::layout(Path::new("/x"))).0, "default");
    }

    #[test]
    fn unknown_fields_types_duplicates_and_empty_lists_are_errors() {
        for bad in [
            r#"{}"#,
            r#"{"default":[]}"#,
            r#"{"default":[{"type":"reject"}],"x":1}"#,
            r#"{"default":[{"type":"reject","x":1}]}"#,
            r#"{"default":[{"type":"rejekt"}]}"#,
            r#"{"default":[{"type":"reject"}],"default":[{"type":"reject"}]}"#,
            r#"{"default":[{"type":"reject"}],"transports":{"docker":{"a":[{"type":"reject"}],"a":[{"type":"reject"}]}}}"#,
            r#"{"default":[{"type":"reject"}],"transports":{"dockr":{}}}"#,
            r#"{"default":[{"type":"reject"}],"transports":{"oci":{"relative/path":[{"type":"reject"}]}}}"#,
            r#"{"default":[{"type":"sigstoreSigned"}]}"#,
            r#"{"default":[{"type":"sigstoreSigned","keyPath":"/a","keyData":"eA=="}]}"#,
            r#"{"default":[{"type":"sigstoreSigned","keyPath":"/a","keyPath":"/b"}]}"#,
            r#"{"default":[{"type":"sigstoreSigned","keyPath":"/a","signedIdentity":{"type":"matchAnything"}}]}"#,
            r#"{"default":[{"type":"sigstoreSigned","keyPath":"/a","signedIdentity":{"type":"matchRepository","x":1}}]}"#,
            r#"{"default":[{"type":"sigstoreSigned","keyPath":"/a","signedIdentity":{"type":"exactReference","dockerReference":"r.io/a"}}]}"#,
            r#"{"default":[{"type":"signedBy","keyType":"GPGKeys"}]}"#,
        ] {
            assert!(parse(bad).is_err(), "accepted: {bad}");
        }
        // What containers tools ship parses (Fedora's default, with a GPG rule).
        let fedora = r#"{"default":[{"type":"insecureAcceptAnything"}],"transports":{"docker":{"registry.access.redhat.com":[{"type":"signedBy","keyType":"GPGKeys","keyPaths":["/etc/pki/rpm-gpg/RPM-GPG-KEY-redhat-release","/etc/pki/rpm-gpg/RPM-GPG-KEY-redhat-beta"]}]},"docker-daemon":{"":[{"type":"insecureAcceptAnything"}]}}}"#;
        assert!(matches!(parse(fedora).unwrap().transports["docker"]["registry.access.redhat.com"][0], Requirement::SignedBy { .. }));
    }

    #[test]
    fn signed_identities_match_as_containers_image_matches() {
        let d = |s: &str| DockerRef::parse(s).unwrap();
        let digest = format!("sha256:{}", "a".repeat(64));
        let by_tag = d("r.io/vm/web:v1");
        let by_digest = d(&format!("r.io/vm/web@{digest}"));
        use IdentityMatch::*;
        // Cosign's repository-only identity: only matchRepository (and exactRepository).
        assert!(!MatchRepoDigestOrExact.accepts(Some(&by_tag), "r.io/vm/web"));
        assert!(MatchRepository.accepts(Some(&by_tag), "r.io/vm/web"));
        assert!(MatchRepoDigestOrExact.accepts(Some(&by_tag), "r.io/vm/web:v1"));
        assert!(!MatchRepoDigestOrExact.accepts(Some(&by_tag), "r.io/vm/web:v2"));
        assert!(MatchRepoDigestOrExact.accepts(Some(&by_digest), "r.io/vm/web:v2"));
        assert!(!MatchRepoDigestOrExact.accepts(Some(&by_digest), "r.io/vm/other:v2"));
        assert!(!MatchRepository.accepts(Some(&by_tag), "r.io/vm/other"));
        assert!(!MatchExact.accepts(Some(&by_digest), "r.io/vm/web:v1"));
        assert!(ExactRepository(d("r.io/vm/web")).accepts(None, "r.io/vm/web:v9"));
        assert!(!MatchRepository.accepts(None, "r.io/vm/web"), "a layout has no docker name");
        let remap = RemapIdentity { prefix: "mirror.io/up".into(), signed_prefix: "r.io/vm".into() };
        assert!(remap.accepts(Some(&d("mirror.io/up/web:v1")), "r.io/vm/web:v1"));
        assert!(!remap.accepts(Some(&d("mirror.io/up/web:v1")), "mirror.io/up/web:v1"));
        assert!(!remap.accepts(Some(&d("mirror.io/upx/web:v1")), "r.io/vm/web:v1"));
    }
}
