//! How a registry is reached: plain HTTP or HTTPS, which certificates TLS trusts, and
//! which connection failures no retry can fix.
//!
//! ```text
//! HOST ──► Transport::plain_http_for ──► http://HOST   (loopback by default, --plain-http)
//!                                   └──► https://HOST  (elsewhere; loopback with --ca-file,
//!                                                       --insecure or --tls-verify=true)
//! trust: Mozilla's roots + the system's (or SSL_CERT_FILE / SSL_CERT_DIR) + --ca-file
//! a failed connection ──► unreachable(): Some(why) fails at once; None is retried
//! ```

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Mutex;

/// How to reach registries: the scheme and what TLS trusts. The default is the rule of
/// [`Transport::plain_http_for`] with the built-in and system trust roots.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Transport {
    /// Plain HTTP to every host (`--plain-http`).
    pub plain_http: bool,
    /// HTTPS also to a loopback host (`--tls-verify=true`; implied by `ca_files` and
    /// `insecure`).
    pub tls_on_loopback: bool,
    /// PEM files of CA certificates trusted besides Mozilla's roots and the system's
    /// (`--ca-file`). The system's are `SSL_CERT_FILE` and `SSL_CERT_DIR` when either is
    /// set, as OpenSSL reads them.
    pub ca_files: Vec<PathBuf>,
    /// Accept any certificate (`--insecure`, skopeo's `--tls-verify=false`): for a test
    /// registry with a self-signed certificate, never for credentials that matter.
    pub insecure: bool,
}

impl Transport {
    /// Whether to speak plain HTTP to `host`: when asked, or for a loopback host
    /// ([`crate::is_loopback`]) unless a TLS setting was given (a loopback registry served
    /// with a certificate is reached by saying how to trust it).
    pub fn plain_http_for(&self, host: &str) -> bool {
        self.plain_http || (crate::is_loopback(host) && !self.tls_on_loopback && !self.insecure && self.ca_files.is_empty())
    }

    /// `builder` with this transport's trust settings.
    pub(crate) fn apply(&self, mut builder: reqwest::blocking::ClientBuilder) -> Result<reqwest::blocking::ClientBuilder, String> {
        for path in &self.ca_files {
            let pem = std::fs::read(path).map_err(|e| format!("reading the CA file {}: {e}", path.display()))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| format!("the CA file {}: {e}", path.display()))?;
            if certs.is_empty() {
                return Err(format!("the CA file {}: no PEM certificate in it", path.display()));
            }
            for c in certs {
                builder = builder.add_root_certificate(c);
            }
        }
        if self.insecure {
            builder = builder.danger_accept_invalid_certs(true);
        }
        Ok(builder)
    }
}

/// Why a registry cannot be reached, when trying again would not change it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unreachable {
    /// Nothing listens at the address (connection refused), and nothing ever answered
    /// there in this process.
    Refused,
    /// The host name does not resolve, and it never did in this process.
    NoSuchHost,
    /// The registry's TLS certificate is not trusted, or not for this name.
    Certificate,
    /// Plain HTTP was spoken to a registry that speaks HTTPS.
    ExpectsTls,
    /// HTTPS was spoken to a registry that speaks plain HTTP.
    ExpectsPlainHttp,
}

impl Unreachable {
    /// The line that says what to change, for `host` (`HOST[:PORT]`).
    pub fn hint(self, host: &str) -> String {
        match self {
            Unreachable::Refused => format!("is the registry running, and listening on {host}?"),
            Unreachable::NoSuchHost => "check the registry's name (HOST[:PORT]/REPO)".into(),
            Unreachable::Certificate => {
                "pass --ca-file FILE with the certificate of the CA that signed the registry's (or set SSL_CERT_FILE), or --insecure to skip the check for a test registry".into()
            }
            Unreachable::ExpectsTls if crate::is_loopback(host) => {
                "snapctl speaks plain HTTP to a loopback registry unless told how to trust its certificate: pass --ca-file FILE, --tls-verify=true (system roots) or --insecure".into()
            }
            Unreachable::ExpectsTls => "drop --plain-http (and SNAPCTL_PLAIN_HTTP=1)".into(),
            Unreachable::ExpectsPlainHttp => "pass --plain-http".into(),
        }
    }

    /// Whether this failure stays one after the registry has answered before: a
    /// certificate stays untrusted, but a refused connection or a failed name lookup of a
    /// registry that answered a moment ago is a restart or a blip (retried).
    fn permanent_once_reached(self) -> bool {
        self == Unreachable::Certificate
    }
}

/// Registry origins (`scheme://host:port`) that have answered in this process: a failure
/// to reach one of them is taken for a restart, not for a wrong address.
static REACHED: Mutex<Option<HashSet<String>>> = Mutex::new(None);

/// Record that `origin` answered a request.
pub(crate) fn reached(origin: &reqwest::Url) {
    let key = origin.origin().ascii_serialization();
    let mut r = REACHED.lock().unwrap_or_else(|p| p.into_inner());
    r.get_or_insert_with(HashSet::new).insert(key);
}

fn was_reached(origin: &reqwest::Url) -> bool {
    let key = origin.origin().ascii_serialization();
    REACHED.lock().unwrap_or_else(|p| p.into_inner()).as_ref().is_some_and(|s| s.contains(&key))
}

/// Whether a failed request to registry `origin` is one no retry fixes, and why (with the
/// detail that says so). `None`: worth retrying, or not a connection failure at all.
pub(crate) fn unreachable(e: &reqwest::Error, origin: &reqwest::Url) -> Option<(Unreachable, String)> {
    let (why, detail) = classify(e, origin.scheme() == "https")?;
    (why.permanent_once_reached() || !was_reached(origin)).then_some((why, detail))
}

/// Read the failure from the error's causes: an `io::Error`'s kind, a rustls verdict, or
/// the words of hyper (which exports no kind for a response that is not HTTP).
fn classify(e: &reqwest::Error, tls: bool) -> Option<(Unreachable, String)> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    let mut texts = Vec::new();
    while let Some(c) = cur {
        if let Some(io) = c.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::ConnectionRefused {
                return Some((Unreachable::Refused, "connection refused".into()));
            }
            // `io::Error::source` skips the error it wraps: look at it here.
            if let Some(inner) = io.get_ref() {
                if let Some(found) = tls_verdict(inner.to_string()) {
                    return Some(found);
                }
            }
        }
        texts.push(c.to_string());
        cur = c.source();
    }
    let all = texts.join(": ");
    if let Some(found) = tls_verdict(all.clone()) {
        return Some(found);
    }
    if all.contains("dns error") {
        let detail = texts.last().cloned().unwrap_or_default();
        return Some((Unreachable::NoSuchHost, format!("no such host ({detail})")));
    }
    // A TLS alert (or any other non-HTTP bytes) where an HTTP status line belongs.
    if !tls && all.contains("invalid HTTP version parsed") {
        return Some((Unreachable::ExpectsTls, "it answered plain HTTP with bytes that are not HTTP (a TLS alert: it speaks HTTPS)".into()));
    }
    None
}

/// rustls's own words for a certificate it does not trust, and for a server that answered
/// a TLS hello with something that is not TLS.
fn tls_verdict(text: String) -> Option<(Unreachable, String)> {
    if text.contains("invalid peer certificate") {
        return Some((Unreachable::Certificate, format!("its TLS certificate is not trusted ({text})")));
    }
    if text.contains("InvalidContentType") || text.contains("corrupt message") {
        return Some((Unreachable::ExpectsPlainHttp, format!("it does not speak TLS ({text})")));
    }
    None
}

/// What a Go server (distribution) answers to plain HTTP on a TLS port.
pub(crate) fn is_http_to_https_answer(status: u16, body: &[u8]) -> bool {
    status == 400 && String::from_utf8_lossy(body).contains("HTTP request to an HTTPS server")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_http_rule() {
        let t = Transport::default();
        assert!(t.plain_http_for("127.0.0.1:5000") && t.plain_http_for("localhost") && !t.plain_http_for("ghcr.io"));
        let plain = Transport { plain_http: true, ..Default::default() };
        assert!(plain.plain_http_for("ghcr.io"));
        for tls in [
            Transport { tls_on_loopback: true, ..Default::default() },
            Transport { insecure: true, ..Default::default() },
            Transport { ca_files: vec!["/x.pem".into()], ..Default::default() },
        ] {
            assert!(!tls.plain_http_for("127.0.0.1:5000"), "{tls:?}");
            assert!(!tls.plain_http_for("ghcr.io"));
        }
    }
}
