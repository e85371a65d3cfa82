//! Image references: `oci:PATH[:TAG|@DIGEST]` for a local layout, and
//! `HOST[:PORT]/REPO[:TAG|@DIGEST]` for a registry, also spelt as skopeo does,
//! `docker://HOST[:PORT]/REPO[:TAG|@DIGEST]`.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use crate::digest::OciDigest;
use crate::FormatError;

/// skopeo's (containers/image's) transport prefix for a registry reference.
pub const DOCKER_TRANSPORT: &str = "docker://";

/// Tag used when a reference names none.
pub const DEFAULT_TAG: &str = "latest";

/// Which manifest in a store: by tag or by digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selector {
    Tag(String),
    Digest(OciDigest),
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Selector::Tag(t) => write!(f, ":{t}"),
            Selector::Digest(d) => write!(f, "@{d}"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reference {
    /// A local OCI image layout directory.
    Layout { path: PathBuf, selector: Selector },
    /// A repository in an OCI registry.
    Registry { host: String, repository: String, selector: Selector },
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reference::Layout { path, selector } => {
                let path = path.display().to_string();
                // `PATH:TAG@DIGEST` is read with the tag split off, so a path whose last
                // component holds a ':' would read back shorter; a tag beside the digest
                // (syntax-checked, then ignored) keeps it whole.
                let last = path.rsplit('/').next().unwrap_or_default();
                if matches!(selector, Selector::Digest(_)) && last.contains(':') {
                    write!(f, "oci:{path}:{DEFAULT_TAG}{selector}")
                } else {
                    write!(f, "oci:{path}{selector}")
                }
            }
            // A registry on a host called `oci` with a port would read back as a layout path
            // in the short spelling; skopeo's spelling keeps it a registry.
            Reference::Registry { host, repository, selector } if host.starts_with("oci:") => write!(f, "{DOCKER_TRANSPORT}{host}/{repository}{selector}"),
            Reference::Registry { host, repository, selector } => write!(f, "{host}/{repository}{selector}"),
        }
    }
}

/// The name and its selector: `NAME@DIGEST`, `NAME:TAG`, or `NAME:TAG@DIGEST`, where the
/// digest wins and the tag is only checked (docker's and crane's reading: a tag beside a
/// digest documents which tag the digest was taken from; the digest is what is fetched).
fn split_selector(s: &str, allow_colon_tag: bool) -> Result<(&str, Selector), String> {
    let (name, digest) = match s.rsplit_once('@') {
        Some((rest, d)) => (rest, Some(d.parse::<OciDigest>().map_err(|e: FormatError| e.to_string())?)),
        None => (s, None),
    };
    let (name, tag) = match name.rsplit_once(':') {
        Some((rest, t)) if allow_colon_tag && !t.contains('/') && !rest.is_empty() => {
            crate::layout::check_tag(t).map_err(|e| e.to_string())?;
            (rest, Some(t))
        }
        _ => (name, None),
    };
    let selector = match (digest, tag) {
        (Some(d), _) => Selector::Digest(d),
        (None, Some(t)) => Selector::Tag(t.into()),
        (None, None) => Selector::Tag(DEFAULT_TAG.into()),
    };
    Ok((name, selector))
}

/// Repository names per the OCI distribution spec:
/// `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*(\/[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*)*`.
pub fn check_repository(name: &str) -> Result<(), String> {
    let component_ok = |c: &str| {
        let b = c.as_bytes();
        if b.is_empty() || !b[0].is_ascii_alphanumeric() || !b[b.len() - 1].is_ascii_alphanumeric() {
            return false;
        }
        let mut i = 0;
        while i < b.len() {
            let ch = b[i];
            if ch.is_ascii_lowercase() || ch.is_ascii_digit() {
                i += 1;
                continue;
            }
            // A separator run: ".", "_", "__" or one or more "-".
            let start = i;
            match ch {
                b'.' => i += 1,
                b'_' => {
                    i += 1;
                    if i < b.len() && b[i] == b'_' {
                        i += 1;
                    }
                }
                b'-' => {
                    while i < b.len() && b[i] == b'-' {
                        i += 1;
                    }
                }
                _ => return false,
            }
            if i >= b.len() || !(b[i].is_ascii_lowercase() || b[i].is_ascii_digit()) || i == start {
                return false;
            }
        }
        true
    };
    if name.is_empty() || name.len() > 255 || !name.split('/').all(component_ok) {
        return Err(format!("repository {name:?} does not match the OCI name grammar (lowercase a-z0-9 with . _ __ - separators, '/'-joined)"));
    }
    Ok(())
}

/// A registry host as references spell it: a DNS name or IPv4 address (`[A-Za-z0-9-]`
/// labels joined by `.`) or a bracketed IPv6 address, then an optional `:PORT` (1-65535).
pub fn check_host(host: &str) -> Result<(), String> {
    let bad = || format!("{host:?} is not a registry host (HOST or HOST:PORT, HOST a DNS name, IPv4 or [IPv6] address)");
    let (name, port) = if let Some(rest) = host.strip_prefix('[') {
        let (addr, after) = rest.split_once(']').ok_or_else(bad)?;
        addr.parse::<std::net::Ipv6Addr>().map_err(|_| bad())?;
        match after {
            "" => (None, None),
            p => (None, Some(p.strip_prefix(':').ok_or_else(bad)?)),
        }
    } else {
        match host.split_once(':') {
            Some((n, p)) => (Some(n), Some(p)),
            None => (Some(host), None),
        }
    };
    if let Some(name) = name {
        let label_ok =
            |l: &str| !l.is_empty() && l.len() <= 63 && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') && !l.starts_with('-') && !l.ends_with('-');
        if name.len() > 253 || !name.split('.').all(label_ok) {
            return Err(bad());
        }
    }
    if let Some(p) = port {
        if p.is_empty() || p.len() > 5 || !p.bytes().all(|b| b.is_ascii_digit()) || !(1..=65535).contains(&p.parse::<u32>().unwrap_or(0)) {
            return Err(bad());
        }
    }
    Ok(())
}

impl Reference {
    /// The registry's host, for a registry reference.
    pub fn host(&self) -> Option<&str> {
        match self {
            Reference::Registry { host, .. } => Some(host),
            Reference::Layout { .. } => None,
        }
    }

    /// The registry's host and the repository there, for a registry reference.
    pub fn registry(&self) -> Option<(&str, &str)> {
        match self {
            Reference::Registry { host, repository, .. } => Some((host, repository)),
            Reference::Layout { .. } => None,
        }
    }

    /// The layout's directory, for a layout reference.
    pub fn layout_path(&self) -> Option<&Path> {
        match self {
            Reference::Layout { path, .. } => Some(path),
            Reference::Registry { .. } => None,
        }
    }

    /// What the reference names in its store: a tag or a digest.
    pub fn selector(&self) -> &Selector {
        match self {
            Reference::Layout { selector, .. } | Reference::Registry { selector, .. } => selector,
        }
    }

    /// The store alone, without its tag or digest (`oci:PATH` or `HOST/REPO`), for messages.
    pub fn store_name(&self) -> String {
        match self {
            Reference::Layout { path, .. } => format!("oci:{}", path.display()),
            Reference::Registry { host, repository, .. } => format!("{host}/{repository}"),
        }
    }
}

impl FromStr for Reference {
    type Err = FormatError;
    fn from_str(s: &str) -> Result<Self, FormatError> {
        let bad = |reason: String| FormatError::BadReference { reference: s.into(), reason };
        if let Some(rest) = s.strip_prefix("oci:") {
            let (path, selector) = split_selector(rest, true).map_err(bad)?;
            if path.is_empty() {
                return Err(bad("empty layout path".into()));
            }
            return Ok(Reference::Layout { path: PathBuf::from(path), selector });
        }
        // skopeo's spelling names the same thing; only the explicit host is required here
        // (no Docker Hub short names: `docker://alpine` would mean docker.io/library/alpine).
        let (docker, name) = match s.strip_prefix(DOCKER_TRANSPORT) {
            Some(n) => (true, n),
            None => (false, s),
        };
        let Some((host, rest)) = name.split_once('/').filter(|(h, _)| h.contains('.') || h.contains(':') || *h == "localhost") else {
            return Err(bad(if docker {
                "docker:// references name their registry: docker://HOST[:PORT]/REPO[:TAG|@DIGEST]".into()
            } else if let Some((host, _)) = name.split_once('/').filter(|(h, _)| !h.is_empty()) {
                format!("{host:?} is not a registry host (use oci:PATH for a local layout)")
            } else {
                "expected oci:PATH[:TAG] or HOST[:PORT]/REPO[:TAG|@DIGEST]".into()
            }));
        };
        check_host(host).map_err(bad)?;
        let (repository, selector) = split_selector(rest, true).map_err(bad)?;
        check_repository(repository).map_err(bad)?;
        Ok(Reference::Registry { host: host.into(), repository: repository.into(), selector })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the `reference` fuzz target: `docker://oci:/x/y` took `oci:` for a host
    /// and printed as `oci:/x/y`, a layout.
    #[test]
    fn hosts_follow_their_grammar_and_print_back() {
        for bad in ["docker://oci:/7_ebc.d/e", "a..b/x", "-a.b/x", "h:0/x", "h:99999/x", "h:/x", "[::1/x", "[zz]:5/x", "h_s.io/x"] {
            assert!(bad.parse::<Reference>().is_err(), "{bad}");
        }
        for good in ["docker://oci:5000/x", "localhost:5000/a/b:v1", "[::1]:5000/x", "127.0.0.1/x", "Ghcr.IO/org/x"] {
            let r: Reference = good.parse().unwrap();
            let back: Reference = r.to_string().parse().unwrap();
            assert_eq!(back, r, "{good} -> {r}");
        }
    }

    /// Found by the `reference` fuzz target once `PATH:TAG@DIGEST` was accepted: a layout
    /// path whose last component held a ':' printed (with its digest) as something that
    /// read back with part of the path taken for a tag, or not at all.
    #[test]
    fn regression_issue_25_layout_paths_with_colons_print_back_beside_a_digest() {
        let d = format!("sha256:{}", "a".repeat(64));
        for s in [format!("oci:/a:b:v1@{d}"), format!("oci:/a:b@{d}"), format!("oci:/x\0:0caa@sha2aaa\0:0caa@{d}"), format!("oci:/x/y@{d}")] {
            let r: Reference = s.parse().unwrap();
            let printed = r.to_string();
            let back: Reference = printed.parse().unwrap_or_else(|e| panic!("{s} -> {printed}: {e}"));
            assert_eq!(back, r, "{s} -> {printed}");
        }
        let r: Reference = format!("oci:/a:b:v1@{d}").parse().unwrap();
        assert!(matches!(&r, Reference::Layout { path, .. } if path.as_os_str() == "/a:b"), "{r:?}");
    }

    #[test]
    fn layouts() {
        let r: Reference = "oci:/tmp/x:v1".parse().unwrap();
        assert_eq!(r, Reference::Layout { path: "/tmp/x".into(), selector: Selector::Tag("v1".into()) });
        let r: Reference = "oci:rel/dir".parse().unwrap();
        assert_eq!(r, Reference::Layout { path: "rel/dir".into(), selector: Selector::Tag("latest".into()) });
        let d = format!("sha256:{}", "a".repeat(64));
        let r: Reference = format!("oci:/x@{d}").parse().unwrap();
        assert!(matches!(r, Reference::Layout { selector: Selector::Digest(_), .. }));
        assert!("oci:".parse::<Reference>().is_err());
        assert!("oci:/x:bad/tag".parse::<Reference>().is_ok(), "a colon in a path component is part of the path");
    }

    #[test]
    fn registries() {
        let r: Reference = "127.0.0.1:5000/vm/base:v2".parse().unwrap();
        assert_eq!(r, Reference::Registry { host: "127.0.0.1:5000".into(), repository: "vm/base".into(), selector: Selector::Tag("v2".into()) });
        assert!("localhost/Bad".parse::<Reference>().is_err());
        assert!("localhost/a/../b".parse::<Reference>().is_err());
        assert!("noreg".parse::<Reference>().is_err());
        check_repository("a__b-c.d/e").unwrap();
        assert!("/repo".parse::<Reference>().is_err());
        assert!("vm/base:v1".parse::<Reference>().unwrap_err().to_string().contains("\"vm\" is not a registry host"));
    }

    /// Issue 25: `REPO:TAG@DIGEST` (what `docker inspect` prints as a pinned image) was
    /// refused as a repository named `REPO:TAG`. The digest wins, as docker and crane read
    /// it; the tag must still be a tag.
    #[test]
    fn regression_issue_25_tag_and_digest_the_digest_wins() {
        let d = format!("sha256:{}", "c".repeat(64));
        let digest: OciDigest = d.parse().unwrap();
        for (s, host, repo) in [
            (format!("127.0.0.1:5000/vm/base:v2@{d}"), "127.0.0.1:5000", "vm/base"),
            (format!("docker://localhost:5000/a:latest@{d}"), "localhost:5000", "a"),
            (format!("ghcr.io/org/x:1.0@{d}"), "ghcr.io", "org/x"),
        ] {
            let r: Reference = s.parse().unwrap_or_else(|e| panic!("{s}: {e}"));
            assert_eq!(r, Reference::Registry { host: host.into(), repository: repo.into(), selector: Selector::Digest(digest.clone()) }, "{s}");
        }
        let r: Reference = format!("oci:/tmp/x:v1@{d}").parse().unwrap();
        assert_eq!(r, Reference::Layout { path: "/tmp/x".into(), selector: Selector::Digest(digest.clone()) });
        // The tag is still checked, and so is the digest.
        assert!(format!("localhost/x:{}@{d}", "t".repeat(200)).parse::<Reference>().is_err());
        assert!("localhost/x:v1@sha256:abc".parse::<Reference>().is_err());
        // A port is not a tag.
        let r: Reference = format!("localhost:5000/x@{d}").parse().unwrap();
        assert!(matches!(r, Reference::Registry { ref host, .. } if host == "localhost:5000"));
    }

    /// Issue 13: skopeo's `docker://` spelling is the same registry reference.
    #[test]
    fn regression_issue_13_docker_transport_prefix() {
        let digest = format!("sha256:{}", "b".repeat(64));
        for plain in ["127.0.0.1:5000/vm/base:v2".to_string(), "registry.example.com/a/b".into(), format!("localhost/x@{digest}")] {
            let docker: Reference = format!("docker://{plain}").parse().unwrap();
            assert_eq!(docker, plain.parse::<Reference>().unwrap(), "{plain}");
            assert!(matches!(docker, Reference::Registry { .. }));
        }
        let r: Reference = "docker://ghcr.io/org/vm:v1".parse().unwrap();
        assert_eq!(r, Reference::Registry { host: "ghcr.io".into(), repository: "org/vm".into(), selector: Selector::Tag("v1".into()) });
        // The repository grammar still applies, and a short name says what to write.
        assert!("docker://ghcr.io/Org/vm".parse::<Reference>().is_err());
        for short in ["docker://alpine:3", "docker://library/alpine", "docker://"] {
            let e = short.parse::<Reference>().unwrap_err().to_string();
            assert!(e.contains("docker://HOST[:PORT]/REPO"), "{short}: {e}");
        }
        assert!(check_repository("a___b").is_err());
        assert!(check_repository("-a").is_err());
    }
}
