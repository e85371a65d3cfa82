//! A registry client, and only that: the client end of the OCI Distribution API, reading
//! images straight from any OCI registry as a [`BlobSource`] and writing to it (blob
//! uploads with resume, cross-repository mounts, manifests, referrers). It knows nothing
//! of the server (`registry` crate), so `pusher` and `puller` build no HTTP server, TLS
//! acceptor, object store or password hashing to talk to a registry.
//!
//! ```text
//! lib.rs       RegistrySource: HTTP(S), auth challenges, retries; the read half (BlobSource)
//! upload.rs    write half: HEAD, mount, POST/PATCH/PUT uploads with resume, manifest PUT
//! referrers.rs referrers API and the OCI 1.1 fallback tag `sha256-<hex>`
//! listing.rs   tag lists and the catalog, page by page; manifest and tag deletion
//! lease.rs     what a restore tells the registry: `Snapctl-Purpose`, `Snapctl-Lease`
//! artifacts.rs manifests read beside an image (signatures) without the tag cache
//! state.rs     resume state files of chunked uploads
//! known.rs     which repositories of a host hold which blobs (for mounts)
//! config.rs    Docker's config.json (credentials) and snapctl's cache directory
//! helper.rs    Docker credential helpers (docker-credential-NAME get/store/erase)
//! error.rs     ClientError, CredentialsError and the registry's OCI error bodies
//! transport.rs HTTP or HTTPS, TLS trust (--ca-file, --insecure), failures no retry fixes
//! ```
//!
//! It speaks plain HTTP to loopback addresses and HTTPS elsewhere ([`Transport`]), answers
//! `WWW-Authenticate` challenges (Basic, and the Bearer token flow, with a password or an
//! identity token) with credentials from the caller or, looked up at the first challenge,
//! from Docker's config and its credential helpers, and retries transient failures (connection
//! errors, 408, 429 honouring `Retry-After`, 5xx) with exponential backoff and jitter,
//! within a wall-clock retry budget ([`retry_budget`]). Every request has a deadline for
//! the whole of it, answer body included ([`RequestDeadline`]), because a registry dripping bytes moves on every read and a per-read timeout never fires.
//! A registry that cannot be reached in a way no retry fixes (nothing listening or no such
//! host before it ever answered, a certificate not trusted, HTTP spoken to HTTPS) fails at
//! once ([`Unreachable`]). With `debug` logging every request is one line (method, URL,
//! range, status, time to the response head), and every retry another.
//! Credentials go only to the registry's own origin: every request, redirect hop and
//! upload `Location` passes through [`may_send_credentials`] (`RegistrySource::execute`).
//! Everything the read half returns is unverified; callers check digests (see
//! `imgfmt::source`). The wire behaviour is specified in `spec/transfer.md`.

mod artifacts;
mod config;
mod error;
mod helper;
mod known;
mod lease;
mod listing;
mod open;
mod referrers;
mod transport;
pub use referrers::{Referrers, ReferrersQuery, EMPTY_CONFIG_TYPE, MAX_REFERRERS, MAX_REFERRER_PAGES, PAYLOAD_TYPE};
pub use transport::{Transport, Unreachable};
pub mod state;
mod upload;

pub use config::{cache_dir, docker_config_credentials, docker_config_path, remove_docker_credentials, store_docker_credentials, Stored};
pub use error::{explain, ClientError, CredentialsError};
pub use known::KnownBlobs;
pub use lease::{Purpose, LEASE_HEADER, MAX_LEASE_SECONDS, PURPOSE_HEADER};
pub use listing::{refuses_deletes, Tags};
pub use open::{open, Opened};
pub use upload::{MemSource, PutManifest, UploadOptions, UploadProgress, Uploaded, DEFAULT_PIECE, MAX_PIECE};

use std::collections::{BTreeSet, HashSet};
use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use imgfmt::{media, BlobSource, FormatError, OciDigest, RetryPolicy};

/// Credentials for one registry.
#[derive(Clone)]
pub enum Credentials {
    /// A user name and a password (or an access token used as one): HTTP Basic, and Basic
    /// on the token flow's `GET realm`.
    Password { username: String, password: String },
    /// An identity token (docker's `identitytoken`; a helper's `<token>` user): an OAuth2
    /// refresh token, sent to the token flow's `POST realm` (grant_type=refresh_token).
    IdentityToken(String),
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credentials::Password { username, .. } => write!(f, "Password({username}, ***)"),
            Credentials::IdentityToken(_) => f.write_str("IdentityToken(***)"),
        }
    }
}

/// Where a client's credentials come from.
enum CredentialSource {
    /// Given by the caller, or already looked up.
    Known(Option<Credentials>),
    /// Docker's config and credential helpers, asked at the first challenge (a helper is a
    /// process, and a broken one must not fail requests that need no credentials).
    DockerConfig,
}

/// Whether `HOST[:PORT]` names this machine, where plain HTTP is the default: an IP
/// address in `127.0.0.0/8` or `::1` (bracketed with a port, `[::1]:5000`), or the name
/// `localhost`. Decided by parsing the address, never by its spelling: a host *named*
/// `127.example.com` is somebody else's, and plain HTTP to it would carry stored
/// credentials in the clear.
pub fn is_loopback(host: &str) -> bool {
    use std::net::IpAddr;
    let name = match host.strip_prefix('[') {
        // `[v6]` or `[v6]:port`: only the bracketed part is the address.
        Some(rest) => match rest.split_once(']') {
            Some((addr, tail)) if tail.is_empty() || tail.starts_with(':') => return addr.parse::<std::net::Ipv6Addr>().is_ok_and(|a| a.is_loopback()),
            _ => return false,
        },
        None => match host.parse::<IpAddr>() {
            // A bare address, `::1` included (its colons are not a port).
            Ok(ip) => return ip.is_loopback(),
            Err(_) => host.rsplit_once(':').map_or(host, |(h, _)| h),
        },
    };
    name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::Ipv4Addr>().is_ok_and(|a| a.is_loopback())
}

/// Whether credentials that belong to origin `owner` may go with a request to `to`: only
/// to the same origin (scheme, host and port, RFC 6454). An upload `Location` or a
/// redirect naming another host or port, or going from https to http, gets none: a
/// registry may hand its uploads and downloads to any server (a CDN, a bucket), and that
/// server has no business with the registry's password or token.
///
/// This is the one place that decides; every request of the client goes through
/// `RegistrySource::execute`, which asks it at each hop.
pub fn may_send_credentials(owner: &reqwest::Url, to: &reqwest::Url) -> bool {
    let o = owner.origin();
    o.is_tuple() && o == to.origin()
}

/// The realm, service and scopes of a Bearer challenge's parameters.
fn bearer_params(params: &str) -> (Option<String>, Option<String>, BTreeSet<String>) {
    let mut realm = None;
    let mut service = None;
    let mut scopes = BTreeSet::new();
    for part in split_params(params) {
        if let Some((k, v)) = part.split_once('=') {
            let v = v.trim().trim_matches('"').to_string();
            match k.trim() {
                "realm" => realm = Some(v),
                "service" => service = Some(v),
                "scope" => {
                    scopes.extend(v.split(' ').filter(|s| !s.is_empty()).map(str::to_string));
                }
                _ => {}
            }
        }
    }
    (realm, service, scopes)
}

/// The `Authorization` value of a token service's answer: `Bearer` and its `token` (or
/// `access_token`), which must be a valid header value.
fn bearer_from(resp: reqwest::blocking::Response, what: String) -> Result<String, ClientError> {
    let v: serde_json::Value = resp.json().map_err(|e| ClientError::Http { what: what.clone(), message: e.to_string() })?;
    let token = v
        .get("token")
        .or_else(|| v.get("access_token"))
        .and_then(|t| t.as_str())
        .ok_or_else(|| ClientError::Http { what: what.clone(), message: "no token in the response".into() })?;
    let bearer = format!("Bearer {token}");
    if reqwest::header::HeaderValue::from_str(&bearer).is_err() {
        return Err(ClientError::Http { what, message: "the token is not a valid header value".into() });
    }
    Ok(bearer)
}

/// Whether a Bearer challenge's token service (`realm`) may get the registry's
/// credentials (the Basic password or an identity token). The registry names its token
/// service, often on another host (Docker Hub's auth.docker.io): it gets them over HTTPS,
/// or on the registry's own origin; never over plain HTTP elsewhere (an https registry
/// naming an http realm would otherwise send the password in the clear). Plain HTTP that
/// never leaves this machine (a loopback registry naming a loopback token service, by
/// address, as a local test or sidecar set-up does) is not in the clear.
pub fn realm_may_get_credentials(registry: &reqwest::Url, realm: &reqwest::Url) -> bool {
    let on_this_machine = |u: &reqwest::Url| {
        u.host_str().and_then(|h| h.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>().ok()).is_some_and(|a| a.is_loopback())
    };
    may_send_credentials(registry, realm) || realm.scheme() == "https" || (on_this_machine(registry) && on_this_machine(realm))
}

/// Body bytes this process received from registries and sent to them (blobs, ranges,
/// upload pieces; not headers): what a progress bar shows as the network's rate, where a
/// count of work done would include zero chunks and cache hits.
static TRANSFERRED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Body bytes moved to and from registries by this process so far ([`TRANSFERRED`]).
pub fn bytes_transferred() -> u64 {
    TRANSFERRED.load(Ordering::Relaxed)
}

pub(crate) fn count_transferred(n: u64) {
    TRANSFERRED.fetch_add(n, Ordering::Relaxed);
}

/// Whether a range's body is counted in [`bytes_transferred`] piece by piece as it arrives
/// ([`count_as_bytes_arrive`]), not once it is whole.
static COUNT_AS_ARRIVING: AtomicBool = AtomicBool::new(false);

/// Count range bodies in [`bytes_transferred`] as their bytes arrive rather than once each
/// is whole, for a progress bar someone watches: a pull's ranges are megabytes each, and a
/// bar fed only whole ones stands still, then leaps. It costs zeroing the buffer a body is
/// read into (otherwise the HTTP stack's own buffer is taken), so it is off unless asked.
pub fn count_as_bytes_arrive(on: bool) {
    COUNT_AS_ARRIVING.store(on, Ordering::Relaxed);
}

/// Redirects followed per request (reqwest's own default).
const MAX_REDIRECTS: usize = 10;

/// How long one request may take, whole: from connecting until the last byte of its
/// answer, `floor` plus its body's bytes at `min_rate`. A registry that drips one byte at
/// a time moves on every read, so a timeout per read never fires; this does, and the
/// request counts as a transient failure (retried within the retry budget).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestDeadline {
    /// What every request may take, whatever its size (a slow start, a token round trip).
    pub floor: Duration,
    /// Bytes per second a body must at least average.
    pub min_rate: u64,
}

/// Default [`RequestDeadline`]: 60 s, plus the body at 64 KiB/s (a 1 MiB range: 76 s; a
/// 16 MiB one: 316 s). `SNAPCTL_REQUEST_TIMEOUT` sets the floor.
pub const DEFAULT_REQUEST_DEADLINE: RequestDeadline = RequestDeadline { floor: Duration::from_secs(60), min_rate: 64 << 10 };
/// Default wall-clock bound on retrying one request (and a pull's range request) after
/// transient failures: 120 s from its first try. `SNAPCTL_RETRY_BUDGET` sets it.
pub const DEFAULT_RETRY_BUDGET: Duration = Duration::from_secs(120);

impl RequestDeadline {
    /// The deadline of a request whose answer (or body sent) is about `bytes` long.
    pub fn for_bytes(&self, bytes: u64) -> Duration {
        self.floor.saturating_add(Duration::from_secs(bytes / self.min_rate.max(1)))
    }

    /// [`DEFAULT_REQUEST_DEADLINE`] with its floor from `SNAPCTL_REQUEST_TIMEOUT`.
    pub fn from_env() -> RequestDeadline {
        RequestDeadline { floor: env_duration("SNAPCTL_REQUEST_TIMEOUT").unwrap_or(DEFAULT_REQUEST_DEADLINE.floor), ..DEFAULT_REQUEST_DEADLINE }
    }
}

/// The retry budget: `SNAPCTL_RETRY_BUDGET`, else [`DEFAULT_RETRY_BUDGET`].
pub fn retry_budget() -> Duration {
    env_duration("SNAPCTL_RETRY_BUDGET").unwrap_or(DEFAULT_RETRY_BUDGET)
}

/// The registry client's default retry policy: 5 retries within [`retry_budget`].
pub fn default_retry_policy() -> RetryPolicy {
    RetryPolicy { budget: Some(retry_budget()), ..RetryPolicy::default() }
}

/// A duration from the environment (`90s`, `2m`, `500ms`, or seconds); `None` when unset
/// or unreadable (with a warning) or zero.
pub(crate) fn env_duration(name: &str) -> Option<Duration> {
    let v = std::env::var(name).ok()?;
    match imgfmt::size::parse_duration(&v) {
        Ok(d) if !d.is_zero() => Some(d),
        _ => {
            tracing::warn!("{name}={v:?} is not a duration above 0: ignored");
            None
        }
    }
}

/// A repository in a registry, read and written over HTTP(S).
pub struct RegistrySource {
    client: reqwest::blocking::Client,
    base: String,
    /// `base` parsed: the origin the credentials and tokens belong to.
    origin: reqwest::Url,
    host: String,
    repository: String,
    creds: Mutex<CredentialSource>,
    /// `Authorization` header value that worked last (a bearer token or basic).
    auth: Mutex<Option<String>>,
    /// Token scopes to ask for beyond `repository:<repo>:pull` (push, mount sources).
    scopes: Mutex<BTreeSet<String>>,
    /// Set once a write was attempted: tokens must then carry `push`.
    writing: AtomicBool,
    /// Digests known to name manifests (they are fetched from `/manifests/`).
    manifests: Mutex<HashSet<OciDigest>>,
    /// The manifest the last tag resolved to, as it arrived: opening the image reads it
    /// next, and a second GET of the same bytes cost a round trip (of the ~6 an open
    /// takes before the first chunk). Content-addressed, so it can never be stale.
    resolved: Mutex<Option<(OciDigest, Vec<u8>)>>,
    /// When a transient failure is tried again (every request, and the rest of a body
    /// cut short).
    retry: RetryPolicy,
    /// How long one request may take, whole.
    deadline: RequestDeadline,
    /// What this client's reads are for (`Snapctl-Purpose` on every request to `origin`).
    purpose: Purpose,
}

/// Registry client under the name the write half reads best with.
pub type RegistryClient = RegistrySource;

/// A registry's answer that no retry or login changes (no `Content-Length`, a `Range`
/// ignored, a client that cannot be built).
fn refused(what: &str, e: impl std::fmt::Display) -> FormatError {
    FormatError::Refused { what: what.to_string(), source: e.to_string().into() }
}

/// One try of a request: a response to look at, or a failure worth retrying.
enum Attempt {
    Done(reqwest::blocking::Response),
    Transient { message: String, retry_after: Option<Duration> },
}

/// `Retry-After` in seconds (the HTTP-date form is rare from registries and ignored); the
/// retry policy caps how long of it is honoured.
fn retry_after(resp: &reqwest::blocking::Response) -> Option<Duration> {
    let s: u64 = resp.headers().get(reqwest::header::RETRY_AFTER)?.to_str().ok()?.trim().parse().ok()?;
    Some(Duration::from_secs(s))
}

impl RegistrySource {
    /// A client that speaks plain HTTP (`plain_http`) or HTTPS with the default trust
    /// roots, whatever the host; [`RegistrySource::connect`] applies a [`Transport`].
    pub fn new(host: &str, repository: &str, plain_http: bool, creds: Option<Credentials>) -> Result<Self, FormatError> {
        Self::build(host, repository, plain_http, &Transport::default(), creds)
    }

    /// A client reaching `host` as `transport` says (scheme and TLS trust).
    pub fn connect(host: &str, repository: &str, transport: &Transport, creds: Option<Credentials>) -> Result<Self, FormatError> {
        Self::build(host, repository, transport.plain_http_for(host), transport, creds)
    }

    /// [`RegistrySource::connect`], credentials from Docker's config
    /// (`$DOCKER_CONFIG/config.json` or `~/.docker/config.json`) and the credential helpers
    /// it names, looked up when the registry first asks for them.
    pub fn connect_with_docker_credentials(host: &str, repository: &str, transport: &Transport) -> Result<Self, FormatError> {
        let c = Self::connect(host, repository, transport, None)?;
        *c.creds.lock().expect("poisoned") = CredentialSource::DockerConfig;
        Ok(c)
    }

    fn build(host: &str, repository: &str, plain_http: bool, transport: &Transport, creds: Option<Credentials>) -> Result<Self, FormatError> {
        let builder = reqwest::blocking::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(300))
            .user_agent(concat!("snapctl/", env!("CARGO_PKG_VERSION")))
            // Redirects are followed by `execute`, which decides at each hop whether the
            // credentials go along (reqwest's policy has its own rule for that).
            .redirect(reqwest::redirect::Policy::none());
        let client = transport.apply(builder).map_err(|e| refused("TLS settings", e))?.build().map_err(|e| refused("building HTTP client", e))?;
        let scheme = if plain_http { "http" } else { "https" };
        let base = format!("{scheme}://{host}");
        let origin = reqwest::Url::parse(&base).map_err(|e| refused(&format!("registry address {base}"), e))?;
        Ok(RegistrySource {
            client,
            base,
            origin,
            host: host.into(),
            repository: repository.into(),
            creds: Mutex::new(CredentialSource::Known(creds)),
            auth: Mutex::new(None),
            scopes: Mutex::new(BTreeSet::new()),
            writing: AtomicBool::new(false),
            manifests: Mutex::new(HashSet::new()),
            resolved: Mutex::new(None),
            retry: default_retry_policy(),
            deadline: RequestDeadline::from_env(),
            purpose: transport.purpose,
        })
    }

    /// The credentials, looked up once (under the lock: parallel requests that meet their
    /// first challenge together run a helper once).
    fn credentials(&self) -> Result<Option<Credentials>, ClientError> {
        let mut c = self.creds.lock().expect("poisoned");
        if let CredentialSource::DockerConfig = *c {
            let found = config::docker_config_credentials(&self.host).map_err(|source| ClientError::Credentials { host: self.host.clone(), source })?;
            *c = CredentialSource::Known(found);
        }
        match &*c {
            CredentialSource::Known(k) => Ok(k.clone()),
            CredentialSource::DockerConfig => unreachable!("looked up above"),
        }
    }

    /// The registry host (`HOST[:PORT]`).
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The repository this client reads and writes.
    pub fn repository(&self) -> &str {
        &self.repository
    }

    /// When a transient failure is retried (default: [`default_retry_policy`], 5 times
    /// within [`retry_budget`]).
    pub fn set_retry_policy(&mut self, policy: RetryPolicy) {
        self.retry = policy;
    }

    /// A client error as this source's error, naming this registry when it wants a login.
    fn source_err(&self, e: ClientError) -> FormatError {
        e.into_source_error(&self.host)
    }

    /// One try: send, answer one auth challenge, classify the outcome; within the
    /// deadline of a small request.
    fn attempt(&self, what: &str, build: &dyn Fn(&reqwest::blocking::Client) -> reqwest::blocking::RequestBuilder) -> Result<Attempt, ClientError> {
        self.attempt_within(what, self.deadline.floor, build)
    }

    /// [`Self::attempt`] whose whole request (answer body included) must be done within
    /// `deadline`.
    fn attempt_within(
        &self,
        what: &str,
        deadline: Duration,
        build: &dyn Fn(&reqwest::blocking::Client) -> reqwest::blocking::RequestBuilder,
    ) -> Result<Attempt, ClientError> {
        // Each request answers one challenge, and one more when it went out with no
        // credentials, or with other ones than the client now holds: other threads share
        // `auth`, and a push that starts writing drops a read-only token
        // (`mark_writing`), so a request may leave just before or after a renewal. The
        // bound keeps a registry that refuses every token from looping.
        let mut challenges = 0;
        loop {
            let req = build(&self.client).timeout(deadline).build().map_err(|e| ClientError::Http { what: what.into(), message: error_chain(&e) })?;
            let sent = self.auth.lock().expect("poisoned").clone();
            match self.execute(req, sent.as_deref().map(|a| (&self.origin, a))) {
                Ok(resp) => {
                    transport::reached(&self.origin);
                    let st = resp.status();
                    let stale = sent.is_none() || *self.auth.lock().expect("poisoned") != sent;
                    // Only the registry's own challenges are answered: another origin
                    // asking for credentials gets none (see `may_send_credentials`).
                    let ours = may_send_credentials(&self.origin, resp.url());
                    if st == reqwest::StatusCode::UNAUTHORIZED && ours && (challenges == 0 || (stale && challenges < 3)) {
                        challenges += 1;
                        let hdr = resp.headers().get(reqwest::header::WWW_AUTHENTICATE).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
                        if !hdr.is_empty() {
                            match self.authenticate(&hdr) {
                                Ok(()) => continue,
                                // A token service that is busy (a registry bounding its
                                // password checks) or failing is as transient as the registry.
                                Err(ClientError::Registry { status, .. }) if status == 429 || status >= 500 => {
                                    return Ok(Attempt::Transient { message: format!("token service answered HTTP {status}"), retry_after: None })
                                }
                                Err(e) => return Err(e),
                            }
                        }
                    }
                    let code = st.as_u16();
                    if code == 408 || code == 429 || st.is_server_error() {
                        let retry_after = retry_after(&resp);
                        return Ok(Attempt::Transient { message: Self::status_message(resp, &self.host), retry_after });
                    }
                    return Ok(Attempt::Done(resp));
                }
                Err(e) => {
                    if let Some((why, detail)) = transport::unreachable(&e, &self.origin) {
                        // A redirect's server is named by its own address.
                        let host = match e.url().filter(|u| u.origin() != self.origin.origin()) {
                            Some(u) => u.host_str().map_or_else(|| u.to_string(), |h| u.port().map_or_else(|| h.to_string(), |p| format!("{h}:{p}"))),
                            None => self.host.clone(),
                        };
                        return Err(ClientError::Unreachable { hint: why.hint(&host), host, why, detail });
                    }
                    if e.is_timeout() {
                        return Ok(Attempt::Transient {
                            message: format!("no complete answer within the request deadline of {} s: {}", deadline.as_secs_f64(), error_chain(&e)),
                            retry_after: None,
                        });
                    }
                    if e.is_connect() || e.is_request() || e.is_body() {
                        return Ok(Attempt::Transient { message: error_chain(&e), retry_after: None });
                    }
                    return Err(ClientError::Http { what: what.into(), message: error_chain(&e) });
                }
            }
        }
    }

    /// Send `req`, following redirects (at most [`MAX_REDIRECTS`]) by hand, with
    /// `Authorization: auth.1` on each hop that [`may_send_credentials`] allows for origin
    /// `auth.0`, and on no other. 301/302/303 are followed for GET and HEAD (other methods
    /// get the redirect back as their answer), 307/308 for any method whose body can be
    /// sent again.
    fn execute(&self, mut req: reqwest::blocking::Request, auth: Option<(&reqwest::Url, &str)>) -> reqwest::Result<reqwest::blocking::Response> {
        use reqwest::header::{HeaderValue, AUTHORIZATION, LOCATION};
        let mut hops = 0;
        loop {
            req.headers_mut().remove(AUTHORIZATION);
            // What the reads are for goes to the registry alone, not to a blob store a
            // redirect names.
            if may_send_credentials(&self.origin, req.url()) {
                req.headers_mut().insert(lease::PURPOSE_HEADER, HeaderValue::from_static(self.purpose.as_str()));
            } else {
                req.headers_mut().remove(lease::PURPOSE_HEADER);
            }
            if let Some((owner, value)) = auth {
                if may_send_credentials(owner, req.url()) {
                    // Tokens are checked to be header-safe when stored; one that is not
                    // simply goes unsent.
                    if let Ok(mut v) = HeaderValue::from_str(value) {
                        v.set_sensitive(true);
                        req.headers_mut().insert(AUTHORIZATION, v);
                    }
                } else {
                    tracing::debug!("{} {}: not {owner}'s origin: sent without credentials", req.method(), req.url());
                }
            }
            let again = req.try_clone();
            let method = req.method().clone();
            let resp = log_request(&self.client, req)?;
            let follow = match resp.status().as_u16() {
                301..=303 => method == reqwest::Method::GET || method == reqwest::Method::HEAD,
                307 | 308 => true,
                _ => false,
            };
            if !follow || hops == MAX_REDIRECTS {
                return Ok(resp);
            }
            let next = resp.headers().get(LOCATION).and_then(|v| v.to_str().ok()).and_then(|l| resp.url().join(l).ok());
            let (Some(next), Some(mut again)) = (next.filter(|u| matches!(u.scheme(), "http" | "https")), again) else {
                return Ok(resp);
            };
            tracing::debug!("{method} {}: HTTP {}, following to {next}", resp.url(), resp.status());
            *again.url_mut() = next;
            req = again;
            hops += 1;
        }
    }

    /// Send a request (built fresh for each attempt), answering auth challenges and
    /// retrying transient failures. Only for requests that are safe to repeat.
    fn send(
        &self,
        what: &str,
        build: &dyn Fn(&reqwest::blocking::Client) -> reqwest::blocking::RequestBuilder,
    ) -> Result<reqwest::blocking::Response, ClientError> {
        self.send_sized(what, 0, build)
    }

    /// [`Self::send`] of a request whose answer is about `bytes` long: each try has the
    /// deadline of that size, cut to what is left of the retry budget (so the budget bounds
    /// the whole, in wall-clock time).
    fn send_sized(
        &self,
        what: &str,
        bytes: u64,
        build: &dyn Fn(&reqwest::blocking::Client) -> reqwest::blocking::RequestBuilder,
    ) -> Result<reqwest::blocking::Response, ClientError> {
        let mut retry = self.retry.start();
        loop {
            let mut deadline = self.deadline.for_bytes(bytes);
            if let Some(b) = self.retry.budget {
                deadline = deadline.min(b.saturating_sub(retry.elapsed()).max(Duration::from_secs(1)));
            }
            match self.attempt_within(what, deadline, build)? {
                Attempt::Done(r) => return Ok(r),
                Attempt::Transient { message, retry_after } => {
                    let Some(wait) = retry.failed(retry_after) else {
                        return Err(ClientError::RetriesExhausted { what: what.into(), attempts: retry.failures(), last: message });
                    };
                    log_retry(what, &message, retry.failures(), wait);
                    std::thread::sleep(wait);
                }
            }
        }
    }

    /// Turn a non-success response into the registry's error (its OCI error message).
    fn refusal(what: &str, resp: reqwest::blocking::Response) -> ClientError {
        let host = match (resp.url().host_str(), resp.url().port()) {
            (Some(h), Some(p)) => format!("{h}:{p}"),
            (h, None) => h.unwrap_or("HOST").to_string(),
            (None, Some(_)) => "HOST".to_string(),
        };
        Self::refusal_for(&host, what, resp)
    }

    /// [`Self::refusal`], a hint to log in naming registry `host`.
    fn refusal_for(host: &str, what: &str, resp: reqwest::blocking::Response) -> ClientError {
        let status = resp.status().as_u16();
        let plain = resp.url().scheme() == "http";
        let body = error_body(resp);
        if plain && transport::is_http_to_https_answer(status, &body) {
            let why = Unreachable::ExpectsTls;
            return ClientError::Unreachable {
                hint: why.hint(host),
                host: host.into(),
                why,
                detail: "it speaks HTTPS, and was spoken to in plain HTTP".into(),
            };
        }
        let (code, message) = error::explain_for(status, &body, host);
        ClientError::Registry { what: what.into(), status, code, message }
    }

    /// A retried status with the registry's words, if it gave any: `HTTP 500 Internal
    /// Server Error: No space left on device`.
    fn status_message(resp: reqwest::blocking::Response, host: &str) -> String {
        let status = resp.status();
        let body = error_body(resp);
        if body.iter().all(u8::is_ascii_whitespace) {
            return format!("HTTP {status}");
        }
        format!("HTTP {status}: {}", error::explain_for(status.as_u16(), &body, host).1)
    }

    /// Answer a `WWW-Authenticate` challenge: Basic with the credentials, or the Bearer
    /// token flow (scopes from the challenge plus `repository:<repo>:pull[,push]` and
    /// `repository:<mount source>:pull`): `GET realm?service=…&scope=…` with Basic
    /// credentials, or with an identity token `POST realm` (OAuth2 refresh_token grant).
    fn authenticate(&self, challenge: &str) -> Result<(), ClientError> {
        use base64::Engine;
        let (scheme, params) = challenge.split_once(' ').unwrap_or((challenge, ""));
        let creds = self.credentials()?;
        let basic = match &creds {
            Some(Credentials::Password { username, password }) => {
                Some(format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(format!("{username}:{password}"))))
            }
            _ => None,
        };
        if scheme.eq_ignore_ascii_case("basic") {
            let b = match (basic, &creds) {
                (Some(b), _) => b,
                (None, Some(Credentials::IdentityToken(_))) => {
                    return Err(ClientError::Http {
                        what: self.host.clone(),
                        message: "the registry asks for Basic auth, but its credentials are an identity token (usable only with the Bearer token flow)".into(),
                    })
                }
                (None, _) => return Err(ClientError::NeedsCredentials { host: self.host.clone() }),
            };
            *self.auth.lock().expect("poisoned") = Some(b);
            return Ok(());
        }
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Err(ClientError::Http { what: self.host.clone(), message: format!("unsupported auth scheme {scheme:?}") });
        }
        let (realm, service, mut scopes) = bearer_params(params);
        let realm = realm.ok_or_else(|| ClientError::Http { what: self.host.clone(), message: format!("bearer challenge without realm: {challenge}") })?;
        let realm_url =
            reqwest::Url::parse(&realm).map_err(|e| ClientError::Http { what: self.host.clone(), message: format!("bearer realm {realm:?}: {e}") })?;
        let realm_gets_basic = realm_may_get_credentials(&self.origin, &realm_url);
        if !realm_gets_basic && basic.is_some() {
            tracing::warn!("{}: token realm {realm} is plain HTTP on another origin: asking it without credentials", self.host);
        }
        if !self.repository.is_empty() {
            let actions = if self.writing.load(Ordering::Relaxed) { "pull,push" } else { "pull" };
            scopes.insert(format!("repository:{}:{actions}", self.repository));
        }
        scopes.extend(self.scopes.lock().expect("poisoned").iter().cloned());
        let req = self.token_request(creds.as_ref(), &realm, &realm_url, realm_gets_basic, service.as_deref(), &scopes)?;
        let what = format!("token request to {realm}");
        let req = req.timeout(self.deadline.floor).build().map_err(|e| ClientError::Http { what: what.clone(), message: error_chain(&e) })?;
        let basic = basic.filter(|_| realm_gets_basic);
        let resp =
            self.execute(req, basic.as_deref().map(|b| (&realm_url, b))).map_err(|e| ClientError::Http { what: what.clone(), message: error_chain(&e) })?;
        if !resp.status().is_success() {
            let status = resp.status().as_u16();
            if (status == 401 || status == 403) && creds.is_none() {
                return Err(ClientError::NeedsCredentials { host: self.host.clone() });
            }
            // The token service refused the registry's credentials: log in to the registry.
            return Err(Self::refusal_for(&self.host, &what, resp));
        }
        *self.auth.lock().expect("poisoned") = Some(bearer_from(resp, what)?);
        Ok(())
    }

    /// The token request to `realm_url`: with an identity token, the OAuth2
    /// refresh_token grant (`POST`, only when the realm may get credentials); else a `GET`
    /// with the scopes and service as query parameters.
    fn token_request(
        &self,
        creds: Option<&Credentials>,
        realm: &str,
        realm_url: &reqwest::Url,
        realm_gets_basic: bool,
        service: Option<&str>,
        scopes: &BTreeSet<String>,
    ) -> Result<reqwest::blocking::RequestBuilder, ClientError> {
        Ok(if let Some(Credentials::IdentityToken(refresh)) = creds {
            // An identity token is a long-lived secret: like a password, it goes to the
            // realm only over HTTPS or on the registry's own origin.
            if !realm_gets_basic {
                return Err(ClientError::Http {
                    what: self.host.clone(),
                    message: format!("token realm {realm} is plain HTTP on another origin: not sending it the identity token"),
                });
            }
            // The docker token spec's OAuth2 form (what docker sends with an identity
            // token): scopes space-separated in one field.
            let mut form = form_urlencoded::Serializer::new(String::new());
            form.append_pair("grant_type", "refresh_token").append_pair("refresh_token", refresh).append_pair("client_id", "snapctl");
            if let Some(s) = service {
                form.append_pair("service", s);
            }
            if !scopes.is_empty() {
                form.append_pair("scope", &scopes.iter().map(String::as_str).collect::<Vec<_>>().join(" "));
            }
            self.client.post(realm_url.clone()).header(reqwest::header::CONTENT_TYPE, "application/x-www-form-urlencoded").body(form.finish())
        } else {
            let mut req = self.client.get(realm_url.clone());
            for s in scopes {
                req = req.query(&[("scope", s.as_str())]);
            }
            if let Some(s) = service {
                req = req.query(&[("service", s)]);
            }
            req
        })
    }

    /// Check that the registry accepts this client's credentials: `GET /v2/` after
    /// answering its challenge must say 200.
    pub fn check_login(&self) -> Result<(), ClientError> {
        let url = format!("{}/v2/", self.base);
        let what = format!("logging in to {}", self.host);
        // A 401 here, from the registry or its token service, is the answer to these
        // credentials: not a hint to log in, which is what is being done.
        let wrong = |e: ClientError| match e.status() {
            Some(401) => ClientError::WrongCredentials { host: self.host.clone() },
            _ => e,
        };
        let resp = self.send(&what, &|c| c.get(&url)).map_err(wrong)?;
        if resp.status().is_success() {
            return Ok(());
        }
        Err(wrong(Self::refusal(&what, resp)))
    }

    fn url(&self, kind: &str, reference: &str) -> String {
        format!("{}/v2/{}/{kind}/{reference}", self.base, self.repository)
    }

    fn accept() -> String {
        format!("{}, {}", media::OCI_MANIFEST, media::OCI_INDEX)
    }

    fn not_found_or(&self, resp: reqwest::blocking::Response, what: &str, d: Option<&OciDigest>) -> FormatError {
        match (resp.status().as_u16(), d) {
            (404, Some(d)) => FormatError::BlobNotFound(d.clone()),
            _ => self.source_err(Self::refusal(what, resp)),
        }
    }
}

/// Most of an error body read: enough for any registry's explanation, and a bound on
/// what a hostile one can make the client hold.
const MAX_ERROR_BODY: u64 = 8 << 10;

/// The first [`MAX_ERROR_BODY`] bytes of an error answer's body (what arrives before the
/// connection fails, if it does).
fn error_body(resp: reqwest::blocking::Response) -> Vec<u8> {
    let mut body = Vec::new();
    let _ = resp.take(MAX_ERROR_BODY).read_to_end(&mut body);
    body
}

/// Send one request (one hop), logged at `debug` as one line: method, URL, range, status
/// and the time to the response head (or the failure).
fn log_request(client: &reqwest::blocking::Client, req: reqwest::blocking::Request) -> reqwest::Result<reqwest::blocking::Response> {
    if !tracing::enabled!(tracing::Level::DEBUG) {
        return client.execute(req);
    }
    let (method, url) = (req.method().clone(), req.url().clone());
    let range = req.headers().get(reqwest::header::RANGE).and_then(|v| v.to_str().ok()).map(|r| format!(" {r}")).unwrap_or_default();
    let t0 = Instant::now();
    let r = client.execute(req);
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    match &r {
        Ok(resp) => tracing::debug!("{method} {url}{range} -> {} in {ms:.1} ms", resp.status().as_u16()),
        Err(e) => tracing::debug!("{method} {url}{range} -> failed in {ms:.1} ms: {}", error_chain(e)),
    }
    r
}

/// One line at `debug` for every retry: what, why, which retry and after how long.
pub(crate) fn log_retry(what: &str, why: &str, failures: u32, wait: Duration) {
    tracing::debug!("{what}: {why}; retry {failures} in {} ms", wait.as_millis());
}

/// An error and its causes on one line (reqwest hides the useful part in `source()`).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
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
        let resp = self.send(&what, &|c| c.get(&url).header(reqwest::header::ACCEPT, Self::accept())).map_err(|e| self.source_err(e))?;
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
        *self.resolved.lock().expect("poisoned") = Some((d.clone(), body));
        Ok(d)
    }

    fn read_blob_unverified(&self, d: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError> {
        if let Some((_, b)) = self.resolved.lock().expect("poisoned").as_ref().filter(|(r, _)| r == d) {
            if b.len() as u64 > limit {
                return Err(FormatError::TooLarge { what: "blob size", got: b.len() as u64, limit });
            }
            return Ok(b.clone());
        }
        let as_manifest = self.manifests.lock().expect("poisoned").contains(d);
        let order: [&str; 2] = if as_manifest { ["manifests", "blobs"] } else { ["blobs", "manifests"] };
        for kind in order {
            let url = self.url(kind, d.as_str());
            let what = format!("fetching {d} from {}", self.describe());
            let resp = self.send_sized(&what, limit, &|c| c.get(&url).header(reqwest::header::ACCEPT, Self::accept())).map_err(|e| self.source_err(e))?;
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
            let resp = self.send(&what, &|c| c.head(&url).header(reqwest::header::ACCEPT, Self::accept())).map_err(|e| self.source_err(e))?;
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
                .ok_or_else(|| refused(&what, "no Content-Length"));
        }
        Err(FormatError::BlobNotFound(d.clone()))
    }

    fn read_at_unverified(&self, d: &OciDigest, offset: u64, buf: &mut [u8]) -> Result<(), FormatError> {
        self.read_into(d, offset, buf, None, &mut |_| {})
    }

    fn read_range_unverified(&self, d: &OciDigest, offset: u64, len: usize) -> Result<Bytes, FormatError> {
        if len == 0 {
            return Ok(Bytes::new());
        }
        let Some(last) = offset.checked_add(len as u64 - 1) else {
            return Err(FormatError::Truncated { what: "pack blob (range past its end)", got: 0, expected: u64::MAX });
        };
        let url = self.url("blobs", d.as_str());
        let range = format!("bytes={offset}-{last}");
        let what = format!("range {range} of {d} from {}", self.describe());
        let resp = self.send_sized(&what, len as u64, &|c| c.get(&url).header(reqwest::header::RANGE, range.clone())).map_err(|e| self.source_err(e))?;
        let plain = resp.status().as_u16() == 206 && resp.content_length() == Some(len as u64);
        let first = if !plain || COUNT_AS_ARRIVING.load(Ordering::Relaxed) {
            // Not the plain answer (a registry ignoring Range, an error status), or a bar
            // watching: the general path reads this response piece by piece, counting
            // each as it arrives, and says what went wrong.
            Some(resp)
        } else {
            // The body as the HTTP stack collected it: one copy out of the socket's
            // buffers, where reading into a zeroed buffer of our own cost a memset and a
            // second copy (the 20:39 run of bench/results/BENCHMARKS-diary-2026-11-29-to-12-01.md,
            // "What changed").
            match resp.bytes() {
                Ok(b) if b.len() == len => {
                    count_transferred(len as u64);
                    return Ok(b);
                }
                Ok(b) => tracing::debug!("{what}: body of {} bytes, expected {len}; asking again", b.len()),
                Err(e) => tracing::debug!("{what}: {e}; asking again"),
            }
            // Cut short: the general path asks again, with its retries.
            None
        };
        let mut buf = vec![0u8; len];
        self.read_into(d, offset, &mut buf, first, &mut |_| {})?;
        Ok(buf.into())
    }

    /// One range request; each piece is handed over as soon as the body has brought it
    /// (a body cut short is asked again for the rest, as any range read is).
    fn read_pieces_unverified(&self, d: &OciDigest, offset: u64, lens: &[usize], each: &mut dyn FnMut(usize, Bytes)) -> Result<(), FormatError> {
        let mut buf = vec![0u8; lens.iter().sum()];
        let (mut next, mut start) = (0usize, 0usize);
        let mut hand_over = |got: &[u8]| {
            while let Some(&n) = lens.get(next).filter(|&&n| start + n <= got.len()) {
                each(next, Bytes::copy_from_slice(&got[start..start + n]));
                (next, start) = (next + 1, start + n);
            }
        };
        self.read_into(d, offset, &mut buf, None, &mut hand_over)?;
        // Empty pieces at the end (or an empty range) bring no bytes to announce them.
        hand_over(&buf);
        Ok(())
    }
}

impl RegistrySource {
    /// Fill `buf` with a blob's bytes from `offset` by range requests, starting from
    /// `first` if a response to the whole range is already in hand; `arrived` is shown the
    /// bytes in so far each time more have come.
    fn read_into(
        &self,
        d: &OciDigest,
        offset: u64,
        buf: &mut [u8],
        mut first: Option<reqwest::blocking::Response>,
        arrived: &mut dyn FnMut(&[u8]),
    ) -> Result<(), FormatError> {
        let url = self.url("blobs", d.as_str());
        // A connection reset or a body cut short after the status line is as transient as a
        // 503: ask again for the bytes still missing, within the same retry budget
        // (`send` retries what happens before the status line).
        let mut got = 0usize;
        let mut retry = self.retry.start();
        while got < buf.len() {
            let at = offset + got as u64;
            let range = format!("bytes={}-{}", at, offset + buf.len() as u64 - 1);
            let what = format!("range {range} of {d} from {}", self.describe());
            let mut resp = match first.take() {
                Some(r) => r,
                None => self
                    .send_sized(&what, (buf.len() - got) as u64, &|c| c.get(&url).header(reqwest::header::RANGE, range.clone()))
                    .map_err(|e| self.source_err(e))?,
            };
            match resp.status().as_u16() {
                206 => {}
                // A registry that ignores Range sends the whole blob: usable only from offset 0.
                200 if at == 0 => {}
                200 => return Err(refused(&what, "registry ignored the Range header")),
                416 => return Err(FormatError::Truncated { what: "pack blob (range past its end)", got: at, expected: offset + buf.len() as u64 }),
                _ => return Err(self.not_found_or(resp, &what, Some(d))),
            }
            let before = got;
            let err = loop {
                match resp.read(&mut buf[got..]) {
                    Ok(0) => break std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "body ended early"),
                    Ok(n) => {
                        got += n;
                        count_transferred(n as u64);
                        arrived(&buf[..got]);
                        if got == buf.len() {
                            return Ok(());
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => break e,
                }
            };
            // Progress made on this attempt earns a fresh budget only for the rest: a server
            // that keeps cutting without progress still runs out.
            if got > before {
                retry.progressed();
            }
            let Some(wait) = retry.failed(None) else {
                let mut last = error_chain(&err);
                if err.kind() == std::io::ErrorKind::TimedOut || last.contains("timed out") {
                    last = format!("no complete answer within the request deadline (SNAPCTL_REQUEST_TIMEOUT): {last}");
                }
                let e = ClientError::RetriesExhausted { what: what.clone(), attempts: retry.failures(), last };
                return Err(self.source_err(e));
            };
            log_retry(&what, &format!("{err}; asking again for the rest"), retry.failures(), wait);
            std::thread::sleep(wait);
        }
        Ok(())
    }
}

fn read_limited(resp: reqwest::blocking::Response, limit: u64, what: &str) -> Result<Vec<u8>, FormatError> {
    let mut out = Vec::new();
    // A body that breaks off is as transient as a 503 (not retried here: small blobs,
    // the caller decides).
    resp.take(limit + 1).read_to_end(&mut out).map_err(|e| {
        let mut message = error_chain(&e);
        if e.kind() == std::io::ErrorKind::TimedOut || message.contains("timed out") {
            message = format!("no complete answer within the request deadline (SNAPCTL_REQUEST_TIMEOUT): {message}");
        }
        FormatError::Transient { what: what.to_string(), source: Box::new(ClientError::Http { what: what.to_string(), message }) }
    })?;
    count_transferred(out.len() as u64);
    if out.len() as u64 > limit {
        return Err(FormatError::TooLarge { what: "blob size", got: out.len() as u64, limit });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A registry on 127.0.0.1 answering every blob read with a 206 of `len` bytes of 7s
    /// whose first `first` bytes are sent at once and the rest once the sender is told.
    fn holding_back(len: usize, first: usize) -> (String, std::sync::mpsc::Sender<()>) {
        use std::io::{BufRead, BufReader, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let (go, wait) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            for c in l.incoming() {
                let Ok(mut c) = c else { return };
                let mut r = BufReader::new(c.try_clone().unwrap());
                let mut target = String::new();
                let mut line = String::new();
                while r.read_line(&mut line).is_ok_and(|n| n > 2) {
                    if target.is_empty() {
                        target = line.clone();
                    }
                    line.clear();
                }
                if !target.contains("/blobs/") {
                    let _ = c.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
                    continue;
                }
                let head =
                    format!("HTTP/1.1 206 Partial Content\r\nContent-Length: {len}\r\nContent-Range: bytes 0-{}/{len}\r\nConnection: close\r\n\r\n", len - 1);
                let body = vec![7u8; len];
                let _ = c.write_all(head.as_bytes()).and_then(|()| c.write_all(&body[..first])).and_then(|()| c.flush());
                let _ = wait.recv();
                let _ = c.write_all(&body[first..]);
                return;
            }
        });
        (addr, go)
    }

    /// A range's body is counted as it arrives once a bar watches: half of it sent, the
    /// rest held back, and the count has the half while the read still waits.
    #[test]
    fn regression_issue_39_range_bytes_count_as_they_arrive_when_a_bar_watches() {
        const LEN: usize = 4 << 20;
        let (addr, go) = holding_back(LEN, LEN / 2);
        count_as_bytes_arrive(true);
        let c = RegistrySource::new(&addr, "vm/x", true, None).unwrap();
        let before = bytes_transferred();
        let reading = std::thread::spawn(move || c.read_range_unverified(&OciDigest::of(b"x"), 0, LEN));
        let deadline = Instant::now() + Duration::from_secs(20);
        while bytes_transferred() - before < (LEN / 2) as u64 {
            assert!(Instant::now() < deadline, "the half that arrived was never counted: {}", bytes_transferred() - before);
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!reading.is_finished(), "the read waits for the rest");
        go.send(()).unwrap();
        let got = reading.join().unwrap().unwrap();
        count_as_bytes_arrive(false);
        assert_eq!(got.len(), LEN);
        assert!(got.iter().all(|&b| b == 7));
    }

    /// A read in pieces hands over each piece once it is in: the first of two pieces
    /// while the second is still held back, the second once it comes.
    #[test]
    fn regression_issue_38_pieces_are_handed_over_as_they_arrive() {
        const PIECE: usize = 1 << 20;
        let (addr, go) = holding_back(2 * PIECE, PIECE + 10);
        let c = RegistrySource::new(&addr, "vm/x", true, None).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let reading = std::thread::spawn(move || c.read_pieces_unverified(&OciDigest::of(b"x"), 0, &[PIECE, PIECE], &mut |i, b| tx.send((i, b)).unwrap()));
        let (i, first) = rx.recv_timeout(Duration::from_secs(20)).expect("the first piece was handed over while the second was held back");
        assert_eq!((i, first.len()), (0, PIECE));
        assert!(rx.try_recv().is_err() && !reading.is_finished(), "the second piece waits for its bytes");
        go.send(()).unwrap();
        reading.join().unwrap().unwrap();
        let (i, second) = rx.recv().unwrap();
        assert_eq!((i, second.len()), (1, PIECE));
        assert!(first.iter().chain(second.iter()).all(|&b| b == 7));
    }

    /// A tiny HTTP/1.1 server on 127.0.0.1 for tests: one request per connection
    /// (`Connection: close`), answered by `answer(method, target, authorization)` with
    /// (status, extra header lines, body); every request is recorded.
    type Seen = std::sync::Arc<Mutex<Vec<(String, String, Option<String>)>>>;
    fn canned(answer: impl Fn(&str, &str, Option<&str>) -> (u16, String, String) + Send + Sync + 'static) -> (String, Seen) {
        use std::io::{BufRead, BufReader, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let seen: Seen = Default::default();
        let rec = seen.clone();
        std::thread::spawn(move || {
            for c in l.incoming() {
                let Ok(mut c) = c else { return };
                let mut r = BufReader::new(c.try_clone().unwrap());
                let mut first = String::new();
                if r.read_line(&mut first).is_err() {
                    continue;
                }
                let (mut auth, mut len) = (None, 0usize);
                loop {
                    let mut h = String::new();
                    if r.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
                        break;
                    }
                    let (k, v) = h.split_once(':').unwrap_or((&h, ""));
                    match k.trim().to_ascii_lowercase().as_str() {
                        "authorization" => auth = Some(v.trim().to_string()),
                        "content-length" => len = v.trim().parse().unwrap_or(0),
                        _ => {}
                    }
                }
                let mut body = vec![0u8; len];
                let _ = std::io::Read::read_exact(&mut r, &mut body);
                let mut parts = first.split_whitespace();
                let (m, t) = (parts.next().unwrap_or("").to_string(), parts.next().unwrap_or("").to_string());
                let (status, extra, body) = answer(&m, &t, auth.as_deref());
                rec.lock().unwrap().push((m, t, auth));
                let _ = write!(c, "HTTP/1.1 {status} X\r\n{extra}Content-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
            }
        });
        (addr, seen)
    }

    fn creds() -> Option<Credentials> {
        Some(Credentials::Password { username: "alice".into(), password: "s3cret".into() })
    }
    const BASIC: &str = "Basic YWxpY2U6czNjcmV0";

    #[test]
    fn credentials_go_only_to_their_origin() {
        let u = |s: &str| reqwest::Url::parse(s).unwrap();
        let owner = u("https://reg.example:5000/v2/");
        assert!(may_send_credentials(&owner, &u("https://reg.example:5000/v2/a/blobs/uploads/x?y=1")));
        assert!(may_send_credentials(&owner, &u("https://REG.example:5000/other")), "host names compare case-insensitively");
        assert!(!may_send_credentials(&owner, &u("http://reg.example:5000/v2/")), "https to http");
        assert!(!may_send_credentials(&owner, &u("https://reg.example:5001/v2/")), "another port");
        assert!(!may_send_credentials(&owner, &u("https://cdn.reg.example:5000/v2/")), "another host, even a subdomain");
        assert!(!may_send_credentials(&owner, &u("https://reg.example/v2/")), "443 is another port than 5000");
        assert!(may_send_credentials(&u("https://reg.example/"), &u("https://reg.example:443/x")), "the default port is the port");
        assert!(!may_send_credentials(&u("http://127.0.0.1:5000/"), &u("http://localhost:5000/")), "another name for the host is another origin");
        assert!(may_send_credentials(&u("http://[::1]:5000/"), &u("http://[::1]:5000/v2/")));
    }

    /// Issue 14 §6: the upload POST's `Location` named another origin and the PATCH/PUT
    /// sent there carried the registry's Basic credentials.
    #[test]
    fn regression_issue_14_upload_location_on_another_origin_gets_no_credentials() {
        let (elsewhere, seen_elsewhere) = canned(|m, _, _| if m == "PUT" { (201, String::new(), String::new()) } else { (404, String::new(), String::new()) });
        let loc = format!("http://{elsewhere}/upload/1");
        let (registry, seen_registry) = canned(move |m, _, auth| match (m, auth == Some(BASIC)) {
            (_, false) => (401, "WWW-Authenticate: Basic realm=\"r\"\r\n".into(), String::new()),
            ("POST", true) => (202, format!("Location: {loc}\r\n"), String::new()),
            _ => (404, String::new(), String::new()),
        });
        let c = RegistrySource::new(&registry, "vm/x", true, creds()).unwrap();
        let m = MemSource::new(b"hello".to_vec());
        let opts = UploadOptions { piece: DEFAULT_PIECE, cache_dir: None, source_hashed: false };
        c.upload_blob(&m.digest, 5, &m, &opts, &|_| {}).unwrap();
        let there = seen_elsewhere.lock().unwrap().clone();
        assert_eq!(there.len(), 1, "{there:?}");
        assert_eq!(there[0].2, None, "credentials went to another origin: {there:?}");
        assert!(seen_registry.lock().unwrap().iter().any(|(m, _, a)| m == "POST" && a.as_deref() == Some(BASIC)));
    }

    /// The Bearer flow's token service gets the password over HTTPS or on the registry's
    /// own origin, not over plain HTTP elsewhere; the token itself goes to the registry.
    #[test]
    fn a_plain_http_token_realm_elsewhere_gets_no_password() {
        let u = |s: &str| reqwest::Url::parse(s).unwrap();
        let reg = u("http://reg.example:5000/");
        assert!(!realm_may_get_credentials(&reg, &u("http://auth.example/token")), "plain HTTP elsewhere");
        assert!(!realm_may_get_credentials(&u("https://reg.example/"), &u("http://auth.example/token")), "https registry, http realm");
        assert!(!realm_may_get_credentials(&u("http://127.0.0.1:5000/"), &u("http://auth.example/token")), "loopback registry, remote realm");
        assert!(!realm_may_get_credentials(&u("http://localhost:5000/"), &u("http://localhost:5001/")), "names are not addresses");
        assert!(realm_may_get_credentials(&reg, &u("https://auth.example/token")));
        assert!(realm_may_get_credentials(&reg, &u("http://reg.example:5000/token")));
        assert!(realm_may_get_credentials(&u("http://127.0.0.1:5000/"), &u("http://127.0.0.1:5001/token")), "never leaves this machine");
        assert!(realm_may_get_credentials(&u("http://[::1]:5000/"), &u("http://127.0.0.1:5001/token")));

        // A realm on the registry's own origin gets it.
        let reg: std::sync::Arc<Mutex<String>> = Default::default();
        let r2 = reg.clone();
        let (registry, seen) = canned(move |_, t, auth| match (t.starts_with("/token"), auth) {
            (true, _) => (200, String::new(), r#"{"token":"t0k"}"#.into()),
            (false, Some("Bearer t0k")) => (200, String::new(), "{}".into()),
            _ => (401, format!("WWW-Authenticate: Bearer realm=\"http://{}/token\"\r\n", r2.lock().unwrap()), String::new()),
        });
        *reg.lock().unwrap() = registry.clone();
        RegistrySource::new(&registry, "vm/x", true, creds()).unwrap().check_login().unwrap();
        assert!(seen.lock().unwrap().iter().any(|(_, t, a)| t.starts_with("/token") && a.as_deref() == Some(BASIC)));
    }

    /// Issue 15: a registry's 401 became `FormatError::Io { context: "registry" }`, the
    /// same as a dead network, and its hint said `snapctl login HOST`. Now it is an
    /// unauthorized error naming the registry to log in to; so is a 403, and a challenge
    /// with no credentials at all.
    #[test]
    fn regression_issue_15_a_401_is_unauthorized_and_says_how_to_log_in() {
        let (registry, _) =
            canned(|_, _, _| (401, "WWW-Authenticate: Basic realm=\"r\"\r\n".into(), r#"{"errors":[{"code":"UNAUTHORIZED","message":"no"}]}"#.into()));
        for creds in [creds(), None] {
            let c = RegistrySource::new(&registry, "vm/x", true, creds.clone()).unwrap();
            let e = c.resolve_tag("v1").unwrap_err();
            assert_eq!(e.kind(), imgfmt::ErrorKind::Unauthorized, "{e}");
            assert!(matches!(&e, FormatError::Unauthorized { registry: r, .. } if *r == registry), "{e:?}");
            assert!(e.to_string().contains(&format!("snapctl login {registry}")), "with {creds:?}: {e}");
            let d = OciDigest::of(b"x");
            assert_eq!(c.read_range_unverified(&d, 0, 10).unwrap_err().kind(), imgfmt::ErrorKind::Unauthorized);
        }
        let (forbidden, _) = canned(|_, _, _| (403, String::new(), r#"{"errors":[{"code":"DENIED","message":"not yours"}]}"#.into()));
        let c = RegistrySource::new(&forbidden, "vm/x", true, creds()).unwrap();
        assert_eq!(c.blob_size(&OciDigest::of(b"x")).unwrap_err().kind(), imgfmt::ErrorKind::Unauthorized);
        let e = c.resolve_tag("v1").unwrap_err();
        assert_eq!(e.kind(), imgfmt::ErrorKind::Unauthorized, "{e}");
        assert!(e.to_string().contains("DENIED: not yours") && e.to_string().contains(&format!("snapctl login {forbidden}")), "{e}");
    }

    /// Issue 15: a 503 storm is a transient error once the client's policy has made its
    /// attempts (and no more); a 404 is "not found" at once, and a 400 a refusal at once.
    #[test]
    fn regression_issue_15_a_503_storm_is_transient_after_the_policys_attempts() {
        let (registry, seen) = canned(|_, t, _| match t {
            t if t.contains("missing") => (404, String::new(), String::new()),
            t if t.contains("bad") => (400, String::new(), r#"{"errors":[{"code":"NAME_INVALID","message":"bad"}]}"#.into()),
            _ => (503, "Retry-After: 0\r\n".into(), String::new()),
        });
        let mut c = RegistrySource::new(&registry, "vm/x", true, None).unwrap();
        c.set_retry_policy(RetryPolicy { first_backoff: Duration::from_millis(1), max_backoff: Duration::from_millis(2), ..RetryPolicy::attempts(3) });
        let d = OciDigest::of(b"storm");
        let e = c.read_range_unverified(&d, 0, 10).unwrap_err();
        assert!(e.is_transient(), "{e:?}");
        assert!(e.to_string().contains("gave up after 4 attempts") && e.to_string().contains("503"), "{e}");
        assert_eq!(seen.lock().unwrap().len(), 4, "1 try and 3 retries");

        seen.lock().unwrap().clear();
        let e = c.resolve_tag("missing").unwrap_err();
        assert_eq!((e.kind(), seen.lock().unwrap().len()), (imgfmt::ErrorKind::NotFound, 1), "{e}");
        seen.lock().unwrap().clear();
        let e = c.resolve_tag("bad").unwrap_err();
        assert_eq!((e.kind(), seen.lock().unwrap().len()), (imgfmt::ErrorKind::Refused, 1), "{e}");
    }

    /// Opening an image by tag reads its manifest once: the bytes the tag resolved to
    /// serve the read by digest, not a second round trip before the first chunk.
    #[test]
    fn regression_issue_16_a_resolved_manifest_is_not_fetched_again() {
        let manifest = r#"{"schemaVersion":2}"#;
        let (registry, seen) = canned(move |_, t, _| {
            if t.ends_with("/manifests/v1") {
                (200, "Content-Type: application/vnd.oci.image.manifest.v1+json\r\n".into(), manifest.into())
            } else {
                (404, String::new(), String::new())
            }
        });
        let c = RegistrySource::new(&registry, "vm/x", true, None).unwrap();
        let d = c.resolve_tag("v1").unwrap();
        assert_eq!(d, OciDigest::of(manifest.as_bytes()));
        assert_eq!(c.read_blob_unverified(&d, 1 << 20).unwrap(), manifest.as_bytes());
        assert_eq!(seen.lock().unwrap().len(), 1, "one GET: {:?}", seen.lock().unwrap());
        // The limit still holds, and another digest still goes to the registry.
        assert_eq!(c.read_blob_unverified(&d, 4).unwrap_err().kind(), imgfmt::ErrorKind::Integrity);
        assert!(c.read_blob_unverified(&OciDigest::of(b"other"), 1 << 20).is_err());
        assert!(seen.lock().unwrap().len() > 1);
    }

    /// Issue 25: a registry's 500 said only "HTTP 500 Internal Server Error" once the
    /// retries were spent; its body ("No space left on device") now travels with it,
    /// bounded and on one line.
    #[test]
    fn regression_issue_25_a_5xx_body_reaches_the_caller() {
        let (registry, seen) = canned(|_, t, _| match t {
            t if t.contains("json") => {
                (500, "Retry-After: 0\r\n".into(), r#"{"errors":[{"code":"UNKNOWN","message":"write /srv/x: no space left on device"}]}"#.into())
            }
            t if t.contains("huge") => (503, String::new(), format!("overloaded\x1b[2J{}", "x".repeat(100_000))),
            _ => (500, String::new(), "No space left on device\n".into()),
        });
        let mut c = RegistrySource::new(&registry, "vm/x", true, None).unwrap();
        c.set_retry_policy(RetryPolicy { first_backoff: Duration::from_millis(1), max_backoff: Duration::from_millis(2), ..RetryPolicy::attempts(2) });
        let e = c.resolve_tag("text").unwrap_err();
        assert!(e.is_transient(), "{e:?}");
        assert!(e.to_string().ends_with("HTTP 500 Internal Server Error: No space left on device"), "{e}");
        let e = c.resolve_tag("json").unwrap_err();
        assert!(e.to_string().contains("HTTP 500 Internal Server Error: UNKNOWN: write /srv/x: no space left on device"), "{e}");
        let e = c.resolve_tag("huge").unwrap_err().to_string();
        assert!(e.contains("overloaded [2Jxxx") && e.len() < 1000 && !e.contains('\x1b'), "{e}");
        assert_eq!(seen.lock().unwrap().len(), 9, "three requests, each tried three times");
    }

    /// Issue 25: an upload that gave up left its session at the registry for the registry
    /// to expire (24 h for `snapctl serve`). A session nobody can take over (refused, or
    /// a blob of one piece, whose session is not saved) is now deleted when the client
    /// gives up; one saved for a rerun is kept when the failure may pass.
    #[test]
    fn regression_issue_25_an_upload_that_gives_up_deletes_its_session() {
        let (registry, seen) = canned(|m, t, _| match m {
            "POST" => (202, format!("Location: {t}s1\r\n"), String::new()),
            "PUT" if t.contains("/vm/refuse/") => (400, String::new(), r#"{"errors":[{"code":"BLOB_UPLOAD_INVALID","message":"no"}]}"#.into()),
            "PUT" | "PATCH" => (503, "Retry-After: 0\r\n".into(), String::new()),
            "GET" => (204, format!("Range: 0-0\r\nLocation: {t}\r\n"), String::new()),
            "HEAD" => (404, String::new(), String::new()),
            _ => (204, String::new(), String::new()),
        });
        let mut c = RegistrySource::new(&registry, "vm/x", true, None).unwrap();
        c.set_retry_policy(RetryPolicy { first_backoff: Duration::from_millis(1), max_backoff: Duration::from_millis(2), ..RetryPolicy::attempts(1) });
        let deletes = |seen: &Seen| seen.lock().unwrap().iter().filter(|(m, t, _)| m == "DELETE" && t.ends_with("/uploads/s1")).count();
        let m = MemSource::new(b"hello".to_vec());
        let opts = UploadOptions { piece: DEFAULT_PIECE, cache_dir: None, source_hashed: false };
        // One piece, a 503 storm: not resumable, so deleted.
        let e = c.upload_blob(&m.digest, 5, &m, &opts, &|_| {}).unwrap_err();
        assert!(e.kind().is_transient(), "{e}");
        assert_eq!(deletes(&seen), 1, "{:?}", seen.lock().unwrap());
        // Refused: deleted.
        let refused = RegistrySource::new(&registry, "vm/refuse", true, None).unwrap();
        seen.lock().unwrap().clear();
        assert_eq!(refused.upload_blob(&m.digest, 5, &m, &opts, &|_| {}).unwrap_err().status(), Some(400));
        assert_eq!(deletes(&seen), 1, "{:?}", seen.lock().unwrap());
        // Several pieces, saved for a rerun: a transient failure keeps the session.
        let dir = tempfile::tempdir().unwrap();
        let big = MemSource::new(vec![7u8; 64]);
        let saved = UploadOptions { piece: 16, cache_dir: Some(dir.path().to_path_buf()), source_hashed: false };
        seen.lock().unwrap().clear();
        assert!(c.upload_blob(&big.digest, 64, &big, &saved, &|_| {}).unwrap_err().kind().is_transient());
        assert_eq!(deletes(&seen), 0, "a session a rerun can resume is kept: {:?}", seen.lock().unwrap());
        assert_eq!(std::fs::read_dir(dir.path().join("uploads")).unwrap().count(), 1, "and its state");
    }

    #[test]
    fn params() {
        assert_eq!(split_params(r#"realm="http://a/token",service="x,y",scope="s""#).len(), 3);
    }

    /// Issue 14 §7: a host *named* `127.something` was taken for loopback, so snapctl
    /// spoke plain HTTP to it and sent stored Basic credentials in the clear.
    #[test]
    fn regression_issue_14_loopback_is_an_address_not_a_spelling() {
        for h in ["127.0.0.1", "127.0.0.1:5000", "127.1.2.3:80", "127.255.255.254", "localhost", "localhost:5000", "LOCALHOST:1", "[::1]", "[::1]:5000", "::1"]
        {
            assert!(is_loopback(h), "{h} is loopback");
        }
        for h in [
            "127.example.com",
            "127.example.com:5000",
            "127.0.0.1.nip.io",
            "127.0.0.1.evil.io:443",
            "localhost.evil.io",
            "ghcr.io",
            "10.0.0.1:5000",
            "[::2]:5000",
            "[::1].evil.io",
            "[::1]x:5000",
            "[127.0.0.1]:5000",
            "128.0.0.1",
            "",
        ] {
            assert!(!is_loopback(h), "{h} is not loopback");
        }
    }
}
