//! Reading images straight from any OCI registry (distribution API), as a
//! [`BlobSource`]: manifests by tag or digest, whole blobs, and byte ranges of packs.
//!
//! This is the read half of the registry protocol (the push half comes with `snapctl
//! push`). It speaks plain HTTP to 127.0.0.1/localhost and HTTPS elsewhere, answers
//! `WWW-Authenticate` challenges (Basic, and the Bearer token flow) with credentials from
//! `~/.docker/config.json` or the caller, and retries transient failures (connection
//! errors, 408, 429, 5xx) with exponential backoff and jitter. Everything it returns is
//! unverified; callers check digests (see `imgfmt::source`).

use std::collections::HashSet;
use std::io::Read;
use std::sync::Mutex;
use std::time::Duration;

use imgfmt::{media, BlobSource, FormatError, OciDigest};

/// Credentials for one registry.
#[derive(Clone)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials({}, ***)", self.username)
    }
}

/// Look up `host` in `~/.docker/config.json` (`auths.<host>.auth`, base64 `user:pass`).
pub fn docker_config_credentials(host: &str) -> Option<Credentials> {
    use base64::Engine;
    let home = std::env::var_os("DOCKER_CONFIG")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".docker")))?;
    let text = std::fs::read(home.join("config.json")).ok()?;
    let v: serde_json::Value = serde_json::from_slice(&text).ok()?;
    let auths = v.get("auths")?.as_object()?;
    let entry = auths.get(host).or_else(|| auths.get(&format!("https://{host}")))?;
    let decoded = base64::engine::general_purpose::STANDARD.decode(entry.get("auth")?.as_str()?).ok()?;
    let s = String::from_utf8(decoded).ok()?;
    let (u, p) = s.split_once(':')?;
    Some(Credentials { username: u.into(), password: p.into() })
}

/// Whether a host is local, where plain HTTP is the default.
pub fn is_loopback(host: &str) -> bool {
    let h = host.rsplit_once(':').map(|(h, _)| h).unwrap_or(host);
    h == "localhost" || h == "127.0.0.1" || h == "[::1]" || h.starts_with("127.")
}

/// A repository in a registry, read over HTTP(S).
pub struct RegistrySource {
    client: reqwest::blocking::Client,
    base: String,
    host: String,
    repository: String,
    creds: Option<Credentials>,
    /// `Authorization` header value that worked last (a bearer token or basic).
    auth: Mutex<Option<String>>,
    /// Digests known to name manifests (they are fetched from `/manifests/`).
    manifests: Mutex<HashSet<OciDigest>>,
    retries: u32,
}

fn http_err(what: &str, e: impl std::fmt::Display) -> FormatError {
    FormatError::Io { context: what.to_string(), source: std::io::Error::other(e.to_string()) }
}

impl RegistrySource {
    pub fn new(host: &str, repository: &str, plain_http: bool, creds: Option<Credentials>) -> Result<Self, FormatError> {
        let client = reqwest::blocking::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(300))
            .user_agent(concat!("snapctl/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| http_err("building HTTP client", e))?;
        let scheme = if plain_http { "http" } else { "https" };
        Ok(RegistrySource {
            client,
            base: format!("{scheme}://{host}"),
            host: host.into(),
            repository: repository.into(),
            creds,
            auth: Mutex::new(None),
            manifests: Mutex::new(HashSet::new()),
            retries: 5,
        })
    }

    /// Send a request (built fresh for each attempt), answering auth challenges and
    /// retrying transient failures.
    fn send(
        &self,
        what: &str,
        build: &dyn Fn(&reqwest::blocking::Client) -> reqwest::blocking::RequestBuilder,
    ) -> Result<reqwest::blocking::Response, FormatError> {
        let mut attempt = 0u32;
        let mut challenged = false;
        loop {
            let mut req = build(&self.client);
            if let Some(a) = self.auth.lock().expect("poisoned").clone() {
                req = req.header(reqwest::header::AUTHORIZATION, a);
            }
            let transient = match req.send() {
                Ok(resp) => {
                    let st = resp.status();
                    if st == reqwest::StatusCode::UNAUTHORIZED && !challenged {
                        challenged = true;
                        let hdr = resp.headers().get(reqwest::header::WWW_AUTHENTICATE).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
                        self.authenticate(&hdr)?;
                        continue;
                    }
                    let code = st.as_u16();
                    if code == 408 || code == 429 || st.is_server_error() {
                        format!("{what}: HTTP {st}")
                    } else {
                        return Ok(resp);
                    }
                }
                Err(e) if e.is_connect() || e.is_timeout() || e.is_request() => format!("{what}: {e}"),
                Err(e) => return Err(http_err(what, e)),
            };
            attempt += 1;
            if attempt > self.retries {
                return Err(http_err(&format!("{transient} (gave up after {} attempts)", attempt), "retries exhausted"));
            }
            // Exponential backoff with jitter: 100 ms, 200 ms, … capped at 5 s.
            let base = 100u64 << attempt.min(6);
            let jitter = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos() as u64 % 100).unwrap_or(0);
            std::thread::sleep(Duration::from_millis(base.min(5000) + jitter));
        }
    }

    /// Answer a `WWW-Authenticate` challenge: Basic with the credentials, or the Bearer
    /// token flow (GET realm?service=…&scope=repository:<repo>:pull).
    fn authenticate(&self, challenge: &str) -> Result<(), FormatError> {
        use base64::Engine;
        let (scheme, params) = challenge.split_once(' ').unwrap_or((challenge, ""));
        let basic = self.creds.as_ref().map(|c| {
            format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(format!("{}:{}", c.username, c.password)))
        });
        if scheme.eq_ignore_ascii_case("basic") {
            let b = basic.ok_or_else(|| http_err(&format!("{}: registry wants credentials", self.host), "use ~/.docker/config.json"))?;
            *self.auth.lock().expect("poisoned") = Some(b);
            return Ok(());
        }
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Err(http_err(&format!("{}: unsupported auth scheme {scheme:?}", self.host), "unauthorized"));
        }
        let mut realm = None;
        let mut service = None;
        for part in split_params(params) {
            if let Some((k, v)) = part.split_once('=') {
                let v = v.trim().trim_matches('"').to_string();
                match k.trim() {
                    "realm" => realm = Some(v),
                    "service" => service = Some(v),
                    _ => {}
                }
            }
        }
        let realm = realm.ok_or_else(|| http_err(&format!("{}: bearer challenge without realm", self.host), challenge))?;
        let scope = format!("repository:{}:pull", self.repository);
        let mut req = self.client.get(&realm).query(&[("scope", scope.as_str())]);
        if let Some(s) = &service {
            req = req.query(&[("service", s.as_str())]);
        }
        if let Some(b) = &basic {
            req = req.header(reqwest::header::AUTHORIZATION, b);
        }
        let resp = req.send().map_err(|e| http_err("token request", e))?;
        if !resp.status().is_success() {
            return Err(http_err(&format!("{}: token endpoint said {}", self.host, resp.status()), "unauthorized"));
        }
        let v: serde_json::Value = resp.json().map_err(|e| http_err("token response", e))?;
        let token = v.get("token").or_else(|| v.get("access_token")).and_then(|t| t.as_str()).ok_or_else(|| http_err("token response", "no token"))?;
        *self.auth.lock().expect("poisoned") = Some(format!("Bearer {token}"));
        Ok(())
    }

    fn url(&self, kind: &str, reference: &str) -> String {
        format!("{}/v2/{}/{kind}/{reference}", self.base, self.repository)
    }

    fn accept() -> String {
        format!("{}, {}", media::OCI_MANIFEST, media::OCI_INDEX)
    }

    fn not_found_or(&self, resp: reqwest::blocking::Response, what: &str, d: Option<&OciDigest>) -> FormatError {
        let st = resp.status();
        let body = resp.text().unwrap_or_default();
        match (st.as_u16(), d) {
            (404, Some(d)) => FormatError::BlobNotFound(d.clone()),
            _ => http_err(&format!("{what}: HTTP {st}"), body.chars().take(300).collect::<String>()),
        }
    }
}

/// Split `a="x,y",b=c` on commas outside quotes.
fn split_params(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut start, mut quoted) = (0, false);
    for (i, ch) in s.char_indices() {
        match ch {
            '"' => quoted = !quoted,
            ',' if !quoted => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

impl BlobSource for RegistrySource {
    fn describe(&self) -> String {
        format!("{}/{}", self.host, self.repository)
    }

    fn resolve_tag(&self, tag: &str) -> Result<OciDigest, FormatError> {
        let url = self.url("manifests", tag);
        let what = format!("resolving {}:{tag}", self.describe());
        let resp = self.send(&what, &|c| c.get(&url).header(reqwest::header::ACCEPT, Self::accept()))?;
        if resp.status().as_u16() == 404 {
            return Err(FormatError::TagNotFound { layout: self.describe(), tag: tag.into() });
        }
        if !resp.status().is_success() {
            return Err(self.not_found_or(resp, &what, None));
        }
        let header = resp.headers().get("docker-content-digest").and_then(|v| v.to_str().ok()).and_then(|s| s.parse::<OciDigest>().ok());
        let body = read_limited(resp, imgfmt::manifest::MAX_MANIFEST_BYTES, &what)?;
        // Trust the bytes, not the header: the digest is computed from what arrived.
        let d = OciDigest::of(&body);
        if let Some(h) = header {
            if h.algorithm() == "sha256" && h != d {
                return Err(FormatError::BlobDigestMismatch { digest: h, actual: d });
            }
        }
        self.manifests.lock().expect("poisoned").insert(d.clone());
        Ok(d)
    }

    fn read_blob_unverified(&self, d: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError> {
        let as_manifest = self.manifests.lock().expect("poisoned").contains(d);
        let order: [&str; 2] = if as_manifest { ["manifests", "blobs"] } else { ["blobs", "manifests"] };
        for kind in order {
            let url = self.url(kind, d.as_str());
            let what = format!("fetching {d} from {}", self.describe());
            let resp = self.send(&what, &|c| c.get(&url).header(reqwest::header::ACCEPT, Self::accept()))?;
            if resp.status().as_u16() == 404 {
                continue;
            }
            if !resp.status().is_success() {
                return Err(self.not_found_or(resp, &what, Some(d)));
            }
            if let Some(n) = resp.content_length() {
                if n > limit {
                    return Err(FormatError::TooLarge { what: "blob size", got: n, limit });
                }
            }
            if kind == "manifests" {
                self.manifests.lock().expect("poisoned").insert(d.clone());
            }
            return read_limited(resp, limit, &what);
        }
        Err(FormatError::BlobNotFound(d.clone()))
    }

    fn blob_size(&self, d: &OciDigest) -> Result<u64, FormatError> {
        for kind in ["blobs", "manifests"] {
            let url = self.url(kind, d.as_str());
            let what = format!("HEAD {d} on {}", self.describe());
            let resp = self.send(&what, &|c| c.head(&url).header(reqwest::header::ACCEPT, Self::accept()))?;
            if resp.status().as_u16() == 404 {
                continue;
            }
            if !resp.status().is_success() {
                return Err(self.not_found_or(resp, &what, Some(d)));
            }
            return resp
                .headers()
                .get(reqwest::header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| http_err(&what, "no Content-Length"));
        }
        Err(FormatError::BlobNotFound(d.clone()))
    }

    fn read_at_unverified(&self, d: &OciDigest, offset: u64, buf: &mut [u8]) -> Result<(), FormatError> {
        if buf.is_empty() {
            return Ok(());
        }
        let url = self.url("blobs", d.as_str());
        let range = format!("bytes={}-{}", offset, offset + buf.len() as u64 - 1);
        let what = format!("range {range} of {d} from {}", self.describe());
        let mut resp = self.send(&what, &|c| c.get(&url).header(reqwest::header::RANGE, range.clone()))?;
        match resp.status().as_u16() {
            206 => {}
            // A registry that ignores Range sends the whole blob: usable only from offset 0.
            200 if offset == 0 => {}
            200 => return Err(http_err(&what, "registry ignored the Range header")),
            416 => return Err(FormatError::Truncated { what: "pack blob (range past its end)", got: offset, expected: offset + buf.len() as u64 }),
            _ => return Err(self.not_found_or(resp, &what, Some(d))),
        }
        resp.read_exact(buf).map_err(|e| http_err(&what, e))?;
        Ok(())
    }
}

fn read_limited(resp: reqwest::blocking::Response, limit: u64, what: &str) -> Result<Vec<u8>, FormatError> {
    let mut out = Vec::new();
    resp.take(limit + 1).read_to_end(&mut out).map_err(|e| http_err(what, e))?;
    if out.len() as u64 > limit {
        return Err(FormatError::TooLarge { what: "blob size", got: out.len() as u64, limit });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_and_hosts() {
        assert_eq!(split_params(r#"realm="http://a/token",service="x,y",scope="s""#).len(), 3);
        assert!(is_loopback("127.0.0.1:5000"));
        assert!(is_loopback("localhost"));
        assert!(!is_loopback("ghcr.io"));
    }
}
