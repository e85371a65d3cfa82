//! How a registry is reached: plain HTTP or HTTPS, which certificates TLS trusts, and
//! which connection failures no retry can fix.
//!
//! ```text
//! HOST ──► Transport::plain_http_for ──► http://HOST   (loopback by default, --plain-http)
//!                                   └──► https://HOST  (elsewhere; loopback with --ca-file,
//!                                                       --insecure or --tls-verify=true)
//! trust: Mozilla's roots + the system's (or SSL_CERT_FILE / SSL_CERT_DIR) + --ca-file,
//!        read at the first TLS handshake, once per process (LazyRoots)
//! a failed connection ──► unreachable(): Some(why) fails at once; None is retried
//! ```
//!
//! Why the roots wait for a handshake: reading the system's store (a PEM bundle and a
//! directory of ~150 files, each parsed) took 8–25 ms per client here, and a process
//! builds several clients (`snapctl lazy`: the metadata's, the faults' and the
//! background's) before its first request. Read at build time, every client paid it, in
//! sequence, before the daemon could bind its socket; a plain-HTTP registry (loopback)
//! never needs them at all, unless it redirects a blob to HTTPS storage.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};

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
    /// What the clients' reads are for, told to the registry on every request
    /// ([`crate::Purpose`]; default: reading, not restoring).
    pub purpose: crate::Purpose,
}

impl Transport {
    /// Whether to speak plain HTTP to `host`: when asked, or for a loopback host
    /// ([`crate::is_loopback`]) unless a TLS setting was given (a loopback registry served
    /// with a certificate is reached by saying how to trust it).
    pub fn plain_http_for(&self, host: &str) -> bool {
        self.plain_http || (crate::is_loopback(host) && !self.tls_on_loopback && !self.insecure && self.ca_files.is_empty())
    }

    /// `builder` with this transport's trust settings. The CA files are read now (a bad
    /// one is an error before any request); the built-in roots at the first handshake.
    pub(crate) fn apply(&self, builder: reqwest::blocking::ClientBuilder) -> Result<reqwest::blocking::ClientBuilder, String> {
        let mut extra = Vec::new();
        for path in &self.ca_files {
            let pem = std::fs::read(path).map_err(|e| format!("reading the CA file {}: {e}", path.display()))?;
            let certs = CertificateDer::pem_slice_iter(&pem).collect::<Result<Vec<_>, _>>().map_err(|e| format!("the CA file {}: {e}", path.display()))?;
            if certs.is_empty() {
                return Err(format!("the CA file {}: no PEM certificate in it", path.display()));
            }
            extra.extend(certs);
        }
        if self.insecure {
            // reqwest's own verifier that accepts any certificate (it reads the roots to
            // no purpose; only test registries are reached this way).
            return Ok(builder.danger_accept_invalid_certs(true));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = Arc::new(LazyRoots { extra, provider: provider.clone(), verifier: OnceLock::new() });
        let mut tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS versions: {e}"))?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        // What reqwest offers with its http2 feature (enabled in Cargo.toml).
        tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(builder.use_preconfigured_tls(tls))
    }
}

/// Mozilla's roots and the system's, read once per process, at the first TLS handshake of
/// any client (see the module doc).
fn built_in_roots() -> &'static RootCertStore {
    static ROOTS: OnceLock<RootCertStore> = OnceLock::new();
    ROOTS.get_or_init(|| {
        let mut roots = RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        // The system's store (SSL_CERT_FILE / SSL_CERT_DIR when set, as OpenSSL reads
        // them); a certificate that does not parse is skipped, as reqwest skips it.
        let loaded = rustls_native_certs::load_native_certs();
        let (added, ignored) = roots.add_parsable_certificates(loaded.certs);
        tracing::debug!(added, ignored, errors = loaded.errors.len(), "read the system's TLS roots");
        roots
    })
}

/// A verifier that reads its roots at its first use: WebPKI's, over the built-in roots and
/// a transport's CA files. Signatures are checked with the provider's algorithms, which
/// need no roots.
#[derive(Debug)]
struct LazyRoots {
    /// Certificates of `--ca-file`, trusted besides the built-in roots.
    extra: Vec<CertificateDer<'static>>,
    provider: Arc<CryptoProvider>,
    verifier: OnceLock<Result<Arc<WebPkiServerVerifier>, String>>,
}

impl LazyRoots {
    fn verifier(&self) -> Result<&Arc<WebPkiServerVerifier>, rustls::Error> {
        self.verifier
            .get_or_init(|| {
                let mut roots = built_in_roots().clone();
                for c in &self.extra {
                    roots.add(c.clone()).map_err(|e| format!("a CA certificate: {e}"))?;
                }
                WebPkiServerVerifier::builder_with_provider(Arc::new(roots), self.provider.clone()).build().map_err(|e| format!("TLS trust roots: {e}"))
            })
            .as_ref()
            .map_err(|e| rustls::Error::General(e.clone()))
    }
}

impl ServerCertVerifier for LazyRoots {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.verifier()?.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
    }

    fn verify_tls12_signature(&self, message: &[u8], cert: &CertificateDer<'_>, dss: &DigitallySignedStruct) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(&self, message: &[u8], cert: &CertificateDer<'_>, dss: &DigitallySignedStruct) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
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
