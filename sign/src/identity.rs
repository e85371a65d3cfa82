//! Names, as the policy sees them: docker references (what a payload's
//! `docker-reference` and a policy's `dockerReference` hold) and the identity of the image
//! being restored (which policy scope applies to it, and which name a signature must
//! carry).
//!
//! A docker reference is `[DOMAIN/]PATH[:TAG][@DIGEST]`, normalised as containers/image
//! does: a first component without `.` or `:` and other than `localhost` is not a domain,
//! so `busybox` is `docker.io/library/busybox`; `docker.io/x` is `docker.io/library/x`.

use std::path::Path;

use imgfmt::reference::{check_host, check_repository, Reference, Selector};

/// A parsed, normalised docker reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DockerRef {
    /// `domain/path`.
    pub name: String,
    pub tag: Option<String>,
    pub digest: Option<String>,
}

impl std::fmt::Display for DockerRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

fn check_tag(t: &str) -> bool {
    let b = t.as_bytes();
    !b.is_empty()
        && b.len() <= 128
        && (b[0].is_ascii_alphanumeric() || b[0] == b'_')
        && b.iter().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-'))
}

fn check_digest(d: &str) -> bool {
    let Some((alg, hex)) = d.split_once(':') else { return false };
    !alg.is_empty()
        && alg.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'+' | b'.' | b'_' | b'-'))
        && hex.len() >= 32
        && hex.bytes().all(|c| c.is_ascii_hexdigit())
}

impl DockerRef {
    /// Parse and normalise (`reference.ParseNormalizedNamed`).
    pub fn parse(s: &str) -> Result<Self, String> {
        let bad = |why: &str| format!("{s:?} is not a docker reference: {why}");
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => {
                if !check_digest(d) {
                    return Err(bad("bad digest"));
                }
                (r, Some(d.to_string()))
            }
            None => (s, None),
        };
        // A tag is after the last ':' that follows the last '/' (a port's ':' precedes it).
        let last_slash = rest.rfind('/').map_or(0, |i| i + 1);
        let (name, tag) = match rest[last_slash..].rfind(':') {
            Some(i) => {
                let t = &rest[last_slash + i + 1..];
                if !check_tag(t) {
                    return Err(bad("bad tag"));
                }
                (&rest[..last_slash + i], Some(t.to_string()))
            }
            None => (rest, None),
        };
        let (domain, path) = match name.split_once('/') {
            Some((d, p)) if d.contains(['.', ':']) || d == "localhost" => (d.to_string(), p.to_string()),
            _ => ("docker.io".to_string(), name.to_string()),
        };
        let domain = if domain == "index.docker.io" { "docker.io".to_string() } else { domain };
        let path = if domain == "docker.io" && !path.contains('/') { format!("library/{path}") } else { path };
        check_host(&domain).map_err(|e| bad(&e))?;
        check_repository(&path).map_err(|e| bad(&e))?;
        if domain.len() + 1 + path.len() > 255 {
            return Err(bad("name longer than 255 characters"));
        }
        Ok(DockerRef { name: format!("{domain}/{path}"), tag, digest })
    }

    /// Neither a tag nor a digest: a repository only (what cosign signs).
    pub fn is_name_only(&self) -> bool {
        self.tag.is_none() && self.digest.is_none()
    }
}

/// Which transport of `containers-policy.json` an image is read through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// A registry (`HOST/REPO...`): scopes are `host[:port]/path` and their parents, then
    /// `*.domain` wildcards.
    Docker,
    /// A local OCI layout (`oci:PATH`): scopes are the absolute directory and its parents.
    Oci,
}

impl Transport {
    pub fn name(self) -> &'static str {
        match self {
            Transport::Docker => "docker",
            Transport::Oci => "oci",
        }
    }
}

/// The image being restored, as the policy sees it.
#[derive(Debug, Clone)]
pub struct ImageIdentity {
    pub transport: Transport,
    /// Most specific scope: `host/repo:tag` or `host/repo@digest`; for a layout its
    /// absolute directory.
    pub scope: String,
    /// Less specific scopes, most specific first (the repository, its parents, then
    /// wildcard domains; for a layout the directory and its parents, without `/`).
    pub namespaces: Vec<String>,
    /// The name a signature's identity is matched against; none for a layout (as for
    /// containers/image, only `exactReference` and `exactRepository` can accept a
    /// layout's signatures).
    pub docker: Option<DockerRef>,
}

impl ImageIdentity {
    /// The identity of a snapctl reference. A layout's path is made absolute and its
    /// symlinks resolved (containers/image does the same), so `./images` and
    /// `/srv/images` fall under the same scope.
    pub fn of(r: &Reference) -> Result<Self, String> {
        match r {
            Reference::Registry { host, repository, selector } => {
                let mut s = format!("{host}/{repository}");
                match selector {
                    Selector::Tag(t) => s.push_str(&format!(":{t}")),
                    Selector::Digest(d) => s.push_str(&format!("@{d}")),
                }
                let docker = DockerRef::parse(&s)?;
                Ok(Self::docker(docker))
            }
            Reference::Layout { path, .. } => {
                let abs = std::fs::canonicalize(path).map_err(|e| format!("{}: {e}", path.display()))?;
                Ok(Self::layout(&abs))
            }
        }
    }

    /// A registry image named `d` (which has a tag or a digest).
    pub fn docker(d: DockerRef) -> Self {
        let scope = d.to_string();
        let mut namespaces = Vec::new();
        let mut name = d.name.as_str();
        loop {
            namespaces.push(name.to_string());
            match name.rfind('/') {
                Some(i) => name = &name[..i],
                None => break,
            }
        }
        // Wildcards from the domain without its port: example.com:5000 → *.com.
        let mut domain = name.split(':').next().unwrap_or(name);
        while let Some(i) = domain.find('.') {
            domain = &domain[i + 1..];
            namespaces.push(format!("*.{domain}"));
        }
        ImageIdentity { transport: Transport::Docker, scope, namespaces, docker: Some(d) }
    }

    /// A layout at absolute directory `dir`.
    pub fn layout(dir: &Path) -> Self {
        let scope = dir.to_string_lossy().into_owned();
        let mut namespaces = Vec::new();
        let mut p = scope.as_str();
        while p != "/" && !p.is_empty() {
            namespaces.push(p.to_string());
            match p.rfind('/') {
                Some(0) | None => break,
                Some(i) => p = &p[..i],
            }
        }
        ImageIdentity { transport: Transport::Oci, scope, namespaces, docker: None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_normalise_as_containers_image_does() {
        let r = DockerRef::parse("busybox").unwrap();
        assert_eq!(r.to_string(), "docker.io/library/busybox");
        assert!(r.is_name_only());
        assert_eq!(DockerRef::parse("127.0.0.1:5000/vm/web:v1").unwrap().tag.as_deref(), Some("v1"));
        assert_eq!(DockerRef::parse("localhost:5000/vm/web").unwrap().name, "localhost:5000/vm/web");
        let d = format!("r.io/a@sha256:{}", "a".repeat(64));
        assert_eq!(DockerRef::parse(&d).unwrap().to_string(), d);
        for bad in ["", "UPPER/x", "r.io/a:", "r.io/a@sha256:zz", "r.io//a", "r.io/a:t:t"] {
            assert!(DockerRef::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn scopes_go_from_the_tag_to_wildcard_domains() {
        let id = ImageIdentity::docker(DockerRef::parse("reg.example.com:5000/vm/web:v1").unwrap());
        assert_eq!(id.scope, "reg.example.com:5000/vm/web:v1");
        assert_eq!(id.namespaces, ["reg.example.com:5000/vm/web", "reg.example.com:5000/vm", "reg.example.com:5000", "*.example.com", "*.com"]);
        let l = ImageIdentity::layout(Path::new("/srv/images/a"));
        assert_eq!(l.namespaces, ["/srv/images/a", "/srv/images", "/srv"]);
    }
}
