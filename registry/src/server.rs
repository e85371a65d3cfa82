//! The HTTP API: OCI Distribution v1.1 under `/v2/`, the docker token endpoint
//! `/token`, and Prometheus `/metrics`.
//!
//! Repository names contain `/`, so `/v2/*` is routed by hand from the end of the path
//! ([`parse_route`]). Every name, tag and digest is validated before it reaches storage.
//! Connections are accepted by [`listen`], which bounds what a slow or idle client can
//! hold (timeouts, a cap per client).

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use axum::Router;
use bytes::Bytes;
use futures::StreamExt;
use imgfmt::{OciDigest, OciHasher};

use crate::auth::{Action, Auth, Identity, Rejected};
use crate::catalog::{Catalog, Readable};
use crate::error::{ApiError, Code};
use crate::inuse;
use crate::layout;
use crate::metrics::Metrics;
use crate::name::{RepoName, Tag};
use crate::pulls::PullLog;
use crate::store::{BlobStore, MeteredStore};
use crate::upload::{self, range_header, upload_location, Uploads};

/// Default manifest size limit: 4 MiB, the spec's minimum that registries should accept.
pub const DEFAULT_MAX_MANIFEST: usize = 4 * 1024 * 1024;

/// Media type of an OCI image index.
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
/// Media type of an OCI image manifest.
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const API_VERSION: (&str, &str) = ("docker-distribution-api-version", "registry/2.0");

mod drain;
mod listen;
pub use listen::{Limits, DEFAULT_MAX_CONNS_PER_CLIENT, DEFAULT_MAX_REQUESTS_PER_CLIENT, DEFAULT_MAX_STREAMS_PER_CONN};
mod web;

/// Most bytes a referrer's annotations may take (as JSON) in the referrers index: a
/// manifest with a `subject` and more is refused (each listing repeats them, and a client
/// reads a page of them at once).
pub const MAX_REFERRER_ANNOTATIONS: usize = 16 << 10;
/// Referrers per page of a referrers listing when the client asks for no `n` (and the
/// most it may ask for): with [`MAX_REFERRER_ANNOTATIONS`], a page stays under 2 MiB,
/// within the 4 MiB a client reads of an index.
pub const REFERRERS_PAGE: usize = 100;
/// Largest stored referrers-index descriptor served; a larger one (stored before the
/// annotation bound) is skipped.
const MAX_REFERRER_DESCRIPTOR: u64 = MAX_REFERRER_ANNOTATIONS as u64 + 4096;

pub use crate::refs::{manifest_refs, ManifestRefs};
pub use crate::upload::DEFAULT_UPLOAD_TTL;

/// Default interval between checks of the htpasswd file for changes.
pub const DEFAULT_HTPASSWD_POLL: Duration = Duration::from_secs(2);

/// How long the web view's retention dry run is reused.
pub const PREVIEW_TTL: Duration = Duration::from_secs(60);

/// Server configuration.
#[derive(Debug)]
pub struct Config {
    /// Largest manifest accepted; bigger ones get 413.
    pub max_manifest_bytes: usize,
    /// Authentication; `None` = open registry (anyone may pull and push).
    pub auth: Option<Auth>,
    /// Whether the server is reached over TLS (for the token realm URL).
    pub tls: bool,
    /// `OCI-Chunk-Min-Length` announced when an upload starts; PATCHes with a smaller
    /// `Content-Length` are refused (the last piece goes with the closing PUT). 0 = none.
    pub chunk_min_length: u64,
    /// Timeouts and the per-client connection cap.
    pub limits: Limits,
    /// Upload sessions idle this long are removed, by a sweep every quarter of it
    /// (between 1 s and 10 min).
    pub upload_ttl: Duration,
    /// Serve `/metrics` on the API listener (with auth enabled, to users only). Off when
    /// metrics have a listener of their own ([`Server::serve_metrics`]).
    pub api_metrics: bool,
    /// How often pulls recorded in memory are written to the store (spec/registry.md §4).
    pub pull_flush: Duration,
    /// Run gc (retention included) on a schedule; `None`: never.
    pub gc: Option<crate::gc::Schedule>,
    /// Most repositories one `/v2/_catalog` page may ask for; more is 400
    /// `PAGINATION_NUMBER_INVALID`.
    pub catalog_max_entries: usize,
    /// The htpasswd file `auth` was loaded from: reloaded when it changes (polled every
    /// `htpasswd_poll`; never when zero) and on [`Server::reload_htpasswd`].
    pub htpasswd_file: Option<std::path::PathBuf>,
    /// How often the htpasswd file is checked for changes.
    pub htpasswd_poll: Duration,
    /// How often the store's totals (`/metrics` `snapctl_store_*`, the web view) are
    /// taken by a scan of the store; zero: never.
    pub stats_interval: Duration,
    /// The running binary, for `snapctl_build_info`.
    pub build: crate::metrics::BuildInfo,
    /// Longest restore lease granted (`Snapctl-Lease`, crate::restore_lease).
    pub max_lease: Duration,
    /// Keys whose signatures the web view shows as verified (`serve --trusted-key`);
    /// none: signatures are shown, not checked (crate::signed).
    pub trusted_keys: Vec<sign::PublicKey>,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            max_manifest_bytes: DEFAULT_MAX_MANIFEST,
            auth: None,
            tls: false,
            chunk_min_length: 0,
            limits: Limits::default(),
            upload_ttl: DEFAULT_UPLOAD_TTL,
            api_metrics: true,
            pull_flush: crate::pulls::DEFAULT_FLUSH_EVERY,
            gc: None,
            catalog_max_entries: crate::catalog::DEFAULT_MAX_ENTRIES,
            htpasswd_file: None,
            htpasswd_poll: DEFAULT_HTPASSWD_POLL,
            stats_interval: crate::stats::DEFAULT_INTERVAL,
            build: crate::metrics::BuildInfo::default(),
            max_lease: crate::restore_lease::DEFAULT_MAX_LEASE,
            trusted_keys: Vec::new(),
        }
    }
}

impl Config {
    /// Why serving on `addr` with this configuration exposes something (logged as a
    /// warning at start-up): passwords and tokens in clear text on a non-loopback address.
    pub fn exposure_warnings(&self, addr: SocketAddr) -> Vec<String> {
        let mut w = Vec::new();
        if self.auth.is_some() && !self.tls && !addr.ip().is_loopback() {
            w.push(format!(
                "authentication is enabled without TLS on {addr}: passwords and tokens cross the network in clear text (use --tls-cert/--tls-key, or a TLS proxy in front)"
            ));
        }
        w
    }
}

/// Aborts a background task when dropped (the server's sweeper ends with its listener).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What [`Server::spawn_background`] started.
struct Background {
    _sweeper: AbortOnDrop,
    _watcher: Option<AbortOnDrop>,
    _scanner: Option<AbortOnDrop>,
    _pulls: AbortOnDrop,
    gc: Option<crate::gc::Scheduled>,
}

/// A registry server: store, upload sessions, metrics, config.
#[derive(Debug)]
pub struct Server {
    store: Arc<dyn BlobStore>,
    uploads: Uploads,
    catalog: Catalog,
    htpasswd: Option<crate::reload::HtpasswdFile>,
    /// The store's totals, as of the last scan.
    pub stats: crate::stats::Stats,
    /// The server's counters.
    pub metrics: Arc<Metrics>,
    /// Pulls recorded since they were last written.
    pub pulls: Arc<PullLog>,
    /// The web view's last retention dry run, and when it was taken.
    preview: tokio::sync::Mutex<Option<(std::time::Instant, Arc<crate::retention::Plan>)>>,
    cfg: Config,
}

/// A parsed `/v2/...` route. Names are validated; references are raw strings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// `/v2/`
    Base,
    /// `/v2/_catalog`
    Catalog,
    /// `/v2/<name>/blobs/<digest>`
    Blob(RepoName, String),
    /// `/v2/<name>/manifests/<reference>`
    Manifest(RepoName, String),
    /// `/v2/<name>/tags/list`
    Tags(RepoName),
    /// `/v2/<name>/referrers/<digest>`
    Referrers(RepoName, String),
    /// `/v2/<name>/blobs/uploads/`
    UploadStart(RepoName),
    /// `/v2/<name>/blobs/uploads/<id>`
    Upload(RepoName, String),
}

fn bad_name(n: &str) -> ApiError {
    ApiError::bad(Code::NameInvalid, format!("invalid repository name {n:?}"))
}

/// Parse the path of a `/v2/` request. `None` = no such endpoint (404).
pub fn parse_route(path: &str) -> Option<Result<Route, ApiError>> {
    let rest = path.strip_prefix("/v2")?;
    if rest.is_empty() || rest == "/" {
        return Some(Ok(Route::Base));
    }
    let rest = rest.strip_prefix('/')?;
    if rest == "_catalog" {
        return Some(Ok(Route::Catalog));
    }
    let segs: Vec<&str> = rest.split('/').collect();
    let n = segs.len();
    let name = |k: usize| -> Result<RepoName, ApiError> {
        let s = segs[..k].join("/");
        RepoName::parse(&s).map_err(|_| bad_name(&s))
    };
    let r = if n >= 4 && segs[n - 3] == "blobs" && segs[n - 2] == "uploads" {
        if segs[n - 1].is_empty() {
            name(n - 3).map(Route::UploadStart)
        } else {
            name(n - 3).map(|r| Route::Upload(r, segs[n - 1].to_owned()))
        }
    } else if n >= 3 && segs[n - 2] == "blobs" && segs[n - 1] == "uploads" {
        name(n - 2).map(Route::UploadStart)
    } else if n >= 3 && segs[n - 2] == "blobs" {
        name(n - 2).map(|r| Route::Blob(r, segs[n - 1].to_owned()))
    } else if n >= 3 && segs[n - 2] == "manifests" {
        name(n - 2).map(|r| Route::Manifest(r, segs[n - 1].to_owned()))
    } else if n >= 3 && segs[n - 2] == "tags" && segs[n - 1] == "list" {
        name(n - 2).map(Route::Tags)
    } else if n >= 3 && segs[n - 2] == "referrers" {
        name(n - 2).map(|r| Route::Referrers(r, segs[n - 1].to_owned()))
    } else {
        return None;
    };
    Some(r)
}

impl Route {
    /// The access a `method` request on this route needs: `None` for none (the base, and
    /// the catalog, which lists only what the caller may read). A method the route does
    /// not answer is refused (405).
    pub fn action(&self, method: &Method) -> Result<Option<Action>, ApiError> {
        let read = *method == Method::GET || *method == Method::HEAD;
        let need = match self {
            Route::Base => Some(None),
            Route::Catalog => read.then_some(None),
            Route::Blob(..) if *method == Method::DELETE => Some(Some(Action::Delete)),
            Route::Blob(..) => read.then_some(Some(Action::Pull)),
            Route::Manifest(..) if *method == Method::DELETE => Some(Some(Action::Delete)),
            Route::Manifest(..) if *method == Method::PUT => Some(Some(Action::Push)),
            Route::Manifest(..) => read.then_some(Some(Action::Pull)),
            Route::Tags(..) | Route::Referrers(..) => read.then_some(Some(Action::Pull)),
            Route::UploadStart(..) | Route::Upload(..) => Some(Some(Action::Push)),
        };
        need.ok_or_else(|| ApiError::new(StatusCode::METHOD_NOT_ALLOWED, Code::Unsupported, format!("{method} not allowed here")))
    }

    /// The class requests on this route are timed by (one of [`crate::metrics::ROUTES`]).
    pub fn class(&self) -> &'static str {
        match self {
            Route::Base => "base",
            Route::Catalog => "catalog",
            Route::Blob(..) => "blob",
            Route::Manifest(..) => "manifest",
            Route::Tags(..) => "tags",
            Route::Referrers(..) => "referrers",
            Route::UploadStart(..) | Route::Upload(..) => "upload",
        }
    }
}

/// The route class of a request path (one of [`crate::metrics::ROUTES`]): a `/v2/` route's
/// [`Route::class`], the token, metrics and web endpoints', else `other` (no such
/// endpoint, or a name that is not valid).
pub fn route_class(path: &str) -> &'static str {
    match path {
        "/token" => "token",
        "/metrics" => "metrics",
        p if p == "/ui" || p.starts_with("/ui/") => "web",
        p => match parse_route(p) {
            Some(Ok(r)) => r.class(),
            Some(Err(_)) | None => "other",
        },
    }
}

/// The authority (`host[:port]`) a request was sent to: the URI's authority when it has
/// one (HTTP/2 sends `:authority` and no `Host`; an HTTP/1.1 absolute-form target
/// overrides `Host`), else the `Host` header. `None` when absent or not a plain
/// authority: it is echoed into the token realm, so nothing that could break out of
/// the quoted challenge parameter gets there.
pub fn request_authority<'a>(uri: &'a Uri, headers: &'a HeaderMap) -> Option<&'a str> {
    let a = uri.authority().map(|a| a.as_str()).or_else(|| headers.get(header::HOST)?.to_str().ok())?;
    let plain = !a.is_empty() && a.len() <= 255 && a.bytes().all(|b| b.is_ascii_alphanumeric() || b".-:[]_".contains(&b));
    plain.then_some(a)
}

/// Query parameters of a URI, decoded, repeated keys kept.
fn query(uri: &Uri) -> Vec<(String, String)> {
    form_urlencoded::parse(uri.query().unwrap_or("").as_bytes()).into_owned().collect()
}

fn param<'a>(q: &'a [(String, String)], k: &str) -> Option<&'a str> {
    q.iter().find(|(a, _)| a == k).map(|(_, v)| v.as_str())
}

fn parse_digest(s: &str) -> Result<OciDigest, ApiError> {
    s.parse().map_err(|e| ApiError::bad(Code::DigestInvalid, format!("{e}")))
}

fn hv(s: &str) -> HeaderValue {
    HeaderValue::from_str(s).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}

/// Build a response from status, headers and body.
fn respond(status: StatusCode, headers: &[(HeaderName, String)], body: Body) -> Response {
    let mut r = Response::new(body);
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(HeaderName::from_static(API_VERSION.0), HeaderValue::from_static(API_VERSION.1));
    for (k, v) in headers {
        h.insert(k.clone(), hv(v));
    }
    r
}

fn empty(status: StatusCode, headers: &[(HeaderName, String)]) -> Response {
    let mut all = headers.to_vec();
    if !all.iter().any(|(k, _)| k == header::CONTENT_LENGTH) {
        all.push((header::CONTENT_LENGTH, "0".into()));
    }
    respond(status, &all, Body::empty())
}

/// Whether the store has `key`.
async fn exists(store: &dyn BlobStore, key: &str) -> Result<bool, ApiError> {
    match store.head(key).await {
        Ok(_) => Ok(true),
        Err(e) if e.is_not_found() => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// A `Range: bytes=...` request header resolved against `size`: `Ok(None)` = whole
/// object, `Err` = 416.
fn parse_range(h: Option<&HeaderValue>, size: u64) -> Result<Option<std::ops::Range<u64>>, ApiError> {
    let Some(h) = h else { return Ok(None) };
    let unsat = || {
        ApiError::new(StatusCode::RANGE_NOT_SATISFIABLE, Code::BlobUnknown, "range not satisfiable")
            .with_header(header::CONTENT_RANGE, format!("bytes */{size}"))
    };
    let s = h.to_str().map_err(|_| unsat())?;
    let spec = s.trim().strip_prefix("bytes=").ok_or_else(unsat)?;
    if spec.contains(',') {
        return Ok(None); // multipart ranges: serve the whole blob (allowed by RFC 9110)
    }
    let (a, b) = spec.split_once('-').ok_or_else(unsat)?;
    let (start, end) = match (a.trim(), b.trim()) {
        ("", suffix) => {
            let n: u64 = suffix.parse().map_err(|_| unsat())?;
            if n == 0 || size == 0 {
                return Err(unsat());
            }
            (size.saturating_sub(n), size - 1)
        }
        (a, "") => (a.parse().map_err(|_| unsat())?, size.saturating_sub(1)),
        (a, b) => {
            let (x, y): (u64, u64) = (a.parse().map_err(|_| unsat())?, b.parse().map_err(|_| unsat())?);
            if y < x {
                return Err(unsat());
            }
            (x, y.min(size.saturating_sub(1)))
        }
    };
    if start >= size {
        return Err(unsat());
    }
    Ok(Some(start..end + 1))
}

/// `Content-Range: [bytes ]<start>-<end>` of a PATCH: the first byte's offset and the
/// chunk length.
fn parse_content_range(h: Option<&HeaderValue>) -> Result<Option<(u64, u64)>, ApiError> {
    let Some(h) = h else { return Ok(None) };
    let bad = || ApiError::new(StatusCode::RANGE_NOT_SATISFIABLE, Code::BlobUploadInvalid, "invalid Content-Range");
    let s = h.to_str().map_err(|_| bad())?.trim();
    let s = s.strip_prefix("bytes ").unwrap_or(s);
    let s = s.split('/').next().unwrap_or(s);
    let (a, b) = s.split_once('-').ok_or_else(bad)?;
    let (a, b): (u64, u64) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
    if b < a {
        return Err(bad());
    }
    Ok(Some((a, b - a + 1)))
}

impl Server {
    /// A server over `store` (wrapped to record storage latency).
    pub fn new(store: Arc<dyn BlobStore>, cfg: Config) -> Arc<Server> {
        let metrics = Arc::new(Metrics::default());
        let store: Arc<dyn BlobStore> = Arc::new(MeteredStore::new(store, metrics.clone()));
        let htpasswd = cfg.htpasswd_file.as_deref().filter(|_| cfg.auth.is_some()).map(crate::reload::HtpasswdFile::new);
        metrics.set_build(cfg.build.clone());
        Arc::new(Server {
            uploads: Uploads::new(store.clone(), metrics.clone()),
            catalog: Catalog::new(store.clone()),
            stats: crate::stats::Stats::new(store.clone()),
            htpasswd,
            store,
            metrics,
            pulls: Arc::default(),
            preview: tokio::sync::Mutex::new(None),
            cfg,
        })
    }

    /// The axum router of this server.
    pub fn router(self: &Arc<Self>) -> Router {
        let mut r = Router::new()
            .route("/v2", any(v2))
            .route("/v2/", any(v2))
            .route("/v2/{*rest}", any(v2))
            .route("/token", get(token))
            .route("/ui", get(web::root))
            .route("/ui/", get(web::ui))
            .route("/ui/{*rest}", get(web::ui));
        if self.cfg.api_metrics {
            r = r.route("/metrics", get(metrics));
        }
        r.layer(middleware::from_fn_with_state(self.clone(), count)).layer(DefaultBodyLimit::disable()).with_state(self.clone())
    }

    /// The router of the metrics listener: `/metrics` only, unauthenticated.
    pub fn metrics_router(self: &Arc<Self>) -> Router {
        Router::new().route("/metrics", get(open_metrics)).with_state(self.clone())
    }

    /// Serve plain HTTP on `listener` until `shutdown` resolves, then finish in-flight
    /// requests. Idle upload sessions are swept meanwhile.
    pub async fn serve(self: Arc<Self>, listener: tokio::net::TcpListener, shutdown: impl Future<Output = ()> + Send + 'static) -> std::io::Result<()> {
        self.index_catalog().await;
        let background = self.spawn_background();
        let served = listen::serve(self.router(), listener, None, self.cfg.limits.clone(), self.metrics.clone(), shutdown).await;
        self.stop_background(background).await;
        served
    }

    /// Serve `/metrics` alone on `listener` (a private address) until `shutdown` resolves.
    pub async fn serve_metrics(self: Arc<Self>, listener: tokio::net::TcpListener, shutdown: impl Future<Output = ()> + Send + 'static) -> std::io::Result<()> {
        listen::serve(self.metrics_router(), listener, None, self.cfg.limits.clone(), self.metrics.clone(), shutdown).await
    }

    /// The tasks a serving server runs beside requests: the upload sweeper, the htpasswd
    /// watcher, the store-totals scanner, the pull-time writer and the gc schedule.
    fn spawn_background(self: &Arc<Self>) -> Background {
        Background {
            _sweeper: self.spawn_upload_sweeper(),
            _watcher: self.spawn_htpasswd_watcher(),
            _scanner: self.spawn_stats_scanner(),
            _pulls: self.spawn_pull_writer(),
            gc: self.cfg.gc.clone().map(|g| g.spawn(self.store.clone(), self.pulls.clone(), self.stats.rescan_signal())),
        }
    }

    /// After the listener stopped: let a gc run finish (or abandon it cleanly), and write
    /// the pulls recorded since the last flush.
    async fn stop_background(&self, b: Background) {
        if let Some(g) = b.gc {
            g.stop(self.store.as_ref()).await;
        }
        if let Err(e) = self.pulls.flush(self.store.as_ref()).await {
            tracing::warn!(%e, "writing pull times at shutdown");
        }
    }

    /// What retention would do now: a dry run of the scheduled gc's options (else the
    /// defaults), reused for [`PREVIEW_TTL`]; one runs at a time, so a page reloaded over
    /// and over costs one scan of the store a minute.
    pub async fn retention_preview(&self) -> Result<Arc<crate::retention::Plan>, crate::gc::GcError> {
        let mut p = self.preview.lock().await;
        if let Some((at, plan)) = p.as_ref().filter(|(at, _)| at.elapsed() < PREVIEW_TTL) {
            tracing::debug!(age = ?at.elapsed(), "retention preview reused");
            return Ok(plan.clone());
        }
        let opts = self.cfg.gc.as_ref().map(|g| g.options.clone()).unwrap_or_default();
        // A whole dry run, sweep included: the bytes of each deletion are what the sweep
        // would free, as `snapctl gc --dry-run` counts them.
        let report = crate::gc::run(self.store.as_ref(), &crate::gc::GcOptions { dry_run: true, ..opts }).await?;
        let mut plan = report.retention;
        plan.dry_run = true;
        let plan = Arc::new(plan);
        *p = Some((std::time::Instant::now(), plan.clone()));
        Ok(plan)
    }

    /// Write recorded pulls every `pull_flush`, or sooner when many wait, until dropped.
    fn spawn_pull_writer(self: &Arc<Self>) -> AbortOnDrop {
        let s = self.clone();
        AbortOnDrop(tokio::spawn(async move {
            let every = s.cfg.pull_flush.max(Duration::from_secs(1));
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = s.pulls.full.notified() => {}
                }
                if let Err(e) = s.pulls.flush(s.store.as_ref()).await {
                    tracing::warn!(%e, "writing pull times");
                }
            }
        }))
    }

    /// Reload the htpasswd file now, changed or not (`serve` calls this on SIGHUP).
    /// Returns whether the users were replaced; failures are logged.
    pub async fn reload_htpasswd(self: &Arc<Self>) -> bool {
        self.check_htpasswd(true).await
    }

    async fn check_htpasswd(self: &Arc<Self>, force: bool) -> bool {
        let s = self.clone();
        tokio::task::spawn_blocking(move || match (&s.htpasswd, &s.cfg.auth) {
            (Some(f), Some(a)) => f.check(a, force),
            _ => false,
        })
        .await
        .unwrap_or(false)
    }

    /// Take the store's totals now, then every `stats_interval`, until dropped.
    fn spawn_stats_scanner(self: &Arc<Self>) -> Option<AbortOnDrop> {
        let every = self.cfg.stats_interval;
        if every.is_zero() {
            return None;
        }
        let s = self.clone();
        let wanted = s.stats.rescan_signal();
        Some(AbortOnDrop(tokio::spawn(async move {
            loop {
                match s.stats.scan().await {
                    Ok(t) => tracing::debug!(blobs = t.blobs, bytes = t.stored_bytes, ms = t.scan_ms, "store totals taken"),
                    Err(e) => tracing::warn!(%e, "taking the store's totals"),
                }
                // Every interval, and when a gc run of this server changed the store.
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = wanted.notified() => {}
                }
            }
        })))
    }

    /// Check the htpasswd file for changes every `htpasswd_poll`, until dropped.
    fn spawn_htpasswd_watcher(self: &Arc<Self>) -> Option<AbortOnDrop> {
        let every = self.cfg.htpasswd_poll;
        if self.htpasswd.is_none() || every.is_zero() {
            return None;
        }
        let s = self.clone();
        Some(AbortOnDrop(tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                s.check_htpasswd(false).await;
            }
        })))
    }

    /// Index a store laid out before the catalog existed (once per store; see
    /// [`crate::catalog`]). A failure is logged and retried at the next start: the catalog
    /// then misses the old repositories, nothing else does.
    async fn index_catalog(&self) {
        match self.catalog.build_if_missing().await {
            // A new store has nothing to index: only a store with repositories is news.
            Ok(Some(n)) if n > 0 => tracing::info!(repositories = n, "catalog: indexed a store written before the catalog existed"),
            Ok(_) => {}
            Err(e) => tracing::error!(%e, "catalog: could not index the store's repositories; /v2/_catalog lists only those pushed from now on"),
        }
    }

    /// What `id` may see of the catalog; `None` when it may see nothing and presented no
    /// credentials (answered 401, so a client learns to log in).
    fn readable(&self, id: &Identity) -> Option<Readable> {
        let Some(auth) = &self.cfg.auth else { return Some(Readable::All) };
        // A token names its user; the catalog shows what that user may pull now.
        let user = match id {
            Identity::Anonymous => None,
            Identity::User(u) => Some(u.as_str()),
            Identity::Token { sub, .. } => (!sub.is_empty()).then_some(sub.as_str()),
        };
        let r = Readable::from_patterns(auth.acl_patterns(user, Action::Pull));
        (user.is_some() || r != Readable::Only(Vec::new())).then_some(r)
    }

    /// `GET /v2/_catalog?n=&last=`, as distribution answers it (see [`crate::catalog`]).
    async fn catalog_page(&self, id: &Identity, uri: &Uri, headers: &HeaderMap, q: &[(String, String)], head: bool) -> Result<Response, ApiError> {
        let Some(readable) = self.readable(id) else {
            return Err(ApiError::new(StatusCode::UNAUTHORIZED, Code::Unauthorized, "authentication required")
                .with_header(header::WWW_AUTHENTICATE, self.challenge(uri, headers, Some("registry:catalog:*".into()), false)));
        };
        let n = crate::catalog::page_size(param(q, "n"), self.cfg.catalog_max_entries)?;
        let last = param(q, "last");
        let page = if n == 0 { crate::catalog::Page { repos: Vec::new(), more: false } } else { self.catalog.page(last, n, &readable).await? };
        let mut hs = vec![(header::CONTENT_TYPE, "application/json; charset=utf-8".to_owned())];
        if let (true, Some(end)) = (page.more, page.repos.last()) {
            let last: String = form_urlencoded::byte_serialize(end.as_str().as_bytes()).collect();
            hs.push((header::LINK, format!("</v2/_catalog?last={last}&n={n}>; rel=\"next\"")));
        }
        let names: Vec<&str> = page.repos.iter().map(|r| r.as_str()).collect();
        let body = serde_json::to_vec(&serde_json::json!({ "repositories": names })).expect("json");
        Ok(respond(StatusCode::OK, &hs, if head { Body::empty() } else { Body::from(body) }))
    }

    /// Remove idle upload sessions every quarter of the TTL (1 s to 10 min), until dropped.
    fn spawn_upload_sweeper(self: &Arc<Self>) -> AbortOnDrop {
        let s = self.clone();
        AbortOnDrop(tokio::spawn(async move {
            let ttl = s.cfg.upload_ttl;
            let every = (ttl / 4).clamp(Duration::from_secs(1), Duration::from_secs(600));
            loop {
                tokio::time::sleep(every).await;
                match s.uploads.expire(ttl).await {
                    Ok(n) => {
                        s.metrics.uploads_expired.fetch_add(n as u64, Relaxed);
                    }
                    Err(e) => tracing::warn!(%e, "sweeping idle upload sessions"),
                }
            }
        }))
    }

    /// Serve HTTPS with a PEM certificate chain and key until `shutdown` resolves, then
    /// finish in-flight requests.
    pub async fn serve_tls(
        self: Arc<Self>,
        listener: std::net::TcpListener,
        cert: &Path,
        key: &Path,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        // Reads the PEM files and offers h2 and http/1.1 by ALPN.
        let tls = axum_server::tls_rustls::RustlsConfig::from_pem_file(cert, key).await?;
        listener.set_nonblocking(true)?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        self.index_catalog().await;
        let acceptor = tokio_rustls::TlsAcceptor::from(tls.get_inner());
        let background = self.spawn_background();
        let served = listen::serve(self.router(), listener, Some(acceptor), self.cfg.limits.clone(), self.metrics.clone(), shutdown).await;
        self.stop_background(background).await;
        served
    }

    fn challenge(&self, uri: &Uri, headers: &HeaderMap, scope: Option<String>, insufficient: bool) -> String {
        let auth = self.cfg.auth.as_ref().expect("challenge only with auth");
        let realm = auth.realm.clone().unwrap_or_else(|| {
            let host = request_authority(uri, headers).unwrap_or("localhost");
            format!("{}://{host}/token", if self.cfg.tls { "https" } else { "http" })
        });
        let mut c = format!("Bearer realm=\"{realm}\",service=\"{}\"", auth.service);
        if let Some(s) = scope {
            c.push_str(&format!(",scope=\"{s}\""));
        }
        if insufficient {
            c.push_str(",error=\"insufficient_scope\"");
        }
        c
    }

    async fn identify(&self, uri: &Uri, headers: &HeaderMap, client: Option<std::net::IpAddr>) -> Result<Identity, ApiError> {
        let Some(auth) = &self.cfg.auth else { return Ok(Identity::Anonymous) };
        let is_basic = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).is_some_and(|v| v.len() > 6 && v[..6].eq_ignore_ascii_case("basic "));
        let r = if is_basic {
            // bcrypt is deliberately slow (tens of ms per uncached check): on the
            // multi-thread runtime, let the other tasks of this worker move elsewhere.
            let h = headers.clone();
            match tokio::runtime::Handle::current().runtime_flavor() {
                tokio::runtime::RuntimeFlavor::MultiThread => tokio::task::block_in_place(|| auth.identify_client(&h, client)),
                _ => auth.identify_client(&h, client),
            }
        } else {
            auth.identify(headers)
        };
        match &r {
            Ok(Identity::User(u)) => crate::access::note_user(u),
            Ok(Identity::Token { sub, .. }) if !sub.is_empty() => crate::access::note_user(sub),
            _ => {}
        }
        r.map_err(|e: Rejected| match e {
            // Answered at once, without a check: the client waits and asks again.
            Rejected::Backoff { retry_after } => ApiError::new(StatusCode::TOO_MANY_REQUESTS, Code::TooManyRequests, e.to_string())
                .with_header(header::RETRY_AFTER, retry_after.as_secs().max(1).to_string()),
            Rejected::Busy => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, Code::TooManyRequests, e.to_string()).with_header(header::RETRY_AFTER, "1"),
            _ => ApiError::new(StatusCode::UNAUTHORIZED, Code::Unauthorized, e.to_string())
                .with_header(header::WWW_AUTHENTICATE, self.challenge(uri, headers, None, false)),
        })
    }

    /// Check that `id` may do `action` on `repo`; the error is the right 401/403.
    fn authorize(&self, id: &Identity, uri: &Uri, headers: &HeaderMap, repo: &RepoName, action: Action) -> Result<(), ApiError> {
        let Some(auth) = &self.cfg.auth else { return Ok(()) };
        if auth.allows(id, repo.as_str(), action) {
            return Ok(());
        }
        let scope = format!(
            "repository:{repo}:{}",
            match action {
                Action::Pull => "pull",
                Action::Push => "pull,push",
                Action::Delete => "delete",
            }
        );
        let msg = format!("{} access to {repo} denied", action.as_str());
        Err(match id {
            Identity::User(_) => ApiError::new(StatusCode::FORBIDDEN, Code::Denied, msg),
            Identity::Anonymous => ApiError::new(StatusCode::UNAUTHORIZED, Code::Unauthorized, msg)
                .with_header(header::WWW_AUTHENTICATE, self.challenge(uri, headers, Some(scope), false)),
            Identity::Token { .. } => ApiError::new(StatusCode::UNAUTHORIZED, Code::Unauthorized, msg)
                .with_header(header::WWW_AUTHENTICATE, self.challenge(uri, headers, Some(scope), true)),
        })
    }

    fn may(&self, id: &Identity, repo: &RepoName, action: Action) -> bool {
        self.cfg.auth.as_ref().is_none_or(|a| a.allows(id, repo.as_str(), action))
    }

    async fn handle(&self, method: Method, uri: Uri, headers: HeaderMap, body: Body, client: Option<std::net::IpAddr>) -> Result<Response, ApiError> {
        let route = match parse_route(uri.path()) {
            Some(r) => r?,
            None => return Err(ApiError::not_found(Code::Unsupported, format!("no such endpoint {}", uri.path()))),
        };
        let id = self.identify(&uri, &headers, client).await?;
        use Route as R;
        let need = route.action(&method)?;
        let repo = match &route {
            R::Base | R::Catalog => None,
            R::Blob(r, _) | R::Manifest(r, _) | R::Tags(r) | R::Referrers(r, _) | R::UploadStart(r) | R::Upload(r, _) => Some(r),
        };
        if let (Some(repo), Some(action)) = (repo, need) {
            self.authorize(&id, &uri, &headers, repo, action)?;
        }
        let q = query(&uri);
        let head = method == Method::HEAD;
        let body = stall_limited(body.into_data_stream(), self.cfg.limits.idle_timeout, self.metrics.clone());
        let counted = count_bytes(body, self.metrics.clone(), true);
        match (route, method) {
            (R::Base, _) => {
                if self.cfg.auth.is_some() && id == Identity::Anonymous {
                    return Err(ApiError::new(StatusCode::UNAUTHORIZED, Code::Unauthorized, "authentication required")
                        .with_header(header::WWW_AUTHENTICATE, self.challenge(&uri, &headers, None, false)));
                }
                Ok(respond(StatusCode::OK, &[(header::CONTENT_TYPE, "application/json".into())], Body::from("{}")))
            }
            (R::Catalog, _) => self.catalog_page(&id, &uri, &headers, &q, head).await,
            (R::Blob(repo, d), Method::GET | Method::HEAD) => self.get_blob(&repo, &d, &headers, head).await,
            (R::Blob(repo, d), Method::DELETE) => self.delete_blob(&repo, &d).await,
            (R::Manifest(repo, r), Method::GET | Method::HEAD) => self.get_manifest(&repo, &r, &headers, head).await,
            (R::Manifest(repo, r), Method::PUT) => self.put_manifest(&repo, &r, &headers, counted).await,
            (R::Manifest(repo, r), Method::DELETE) => self.delete_manifest(&repo, &r).await,
            (R::Tags(repo), _) => self.tags(&repo, &q).await,
            (R::Referrers(repo, d), _) => self.referrers(&repo, &d, &q).await,
            (R::UploadStart(repo), Method::POST) => self.start_upload(&repo, &q, &id, counted).await,
            (R::Upload(repo, uid), Method::GET) => {
                let n = self.uploads.status(&repo, &uid).await?;
                Ok(empty(StatusCode::NO_CONTENT, &upload_headers(&repo, &uid, n)))
            }
            (R::Upload(repo, uid), Method::PATCH) => {
                let cr = parse_content_range(headers.get(header::CONTENT_RANGE))?;
                let min = self.cfg.chunk_min_length;
                if let Some(cl) = content_length(&headers).filter(|&cl| min > 0 && cl < min) {
                    return Err(ApiError::bad(
                        Code::BlobUploadInvalid,
                        format!("PATCH of {cl} bytes is below OCI-Chunk-Min-Length {min} (only the last piece, sent with the PUT, may be shorter)"),
                    ));
                }
                if let (Some((_, len)), Some(cl)) = (cr, content_length(&headers)) {
                    if len != cl {
                        return Err(ApiError::bad(Code::BlobUploadInvalid, "Content-Range and Content-Length disagree"));
                    }
                }
                let n = self.uploads.append(&repo, &uid, cr.map(|c| c.0), counted).await?;
                Ok(empty(StatusCode::ACCEPTED, &upload_headers(&repo, &uid, n)))
            }
            (R::Upload(repo, uid), Method::PUT) => {
                let d = parse_digest(param(&q, "digest").unwrap_or(""))?;
                match self.uploads.finish(&repo, &uid, &d, counted).await {
                    Ok(stored) => {
                        self.metrics.uploads_completed.fetch_add(1, Relaxed);
                        if let Some(bytes) = stored {
                            self.stats.note(crate::stats::Change::Stored { bytes });
                        }
                    }
                    Err(e) => {
                        if e.code == Code::DigestInvalid {
                            self.metrics.uploads_cancelled.fetch_add(1, Relaxed);
                        }
                        return Err(e);
                    }
                }
                Ok(blob_created(&repo, &d))
            }
            (R::Upload(repo, uid), Method::DELETE) => {
                self.uploads.cancel(&repo, &uid).await?;
                self.metrics.uploads_cancelled.fetch_add(1, Relaxed);
                Ok(empty(StatusCode::NO_CONTENT, &[]))
            }
            (_, method) => Err(ApiError::new(StatusCode::METHOD_NOT_ALLOWED, Code::Unsupported, format!("{method} not allowed here"))),
        }
    }

    async fn get_blob(&self, repo: &RepoName, d: &str, headers: &HeaderMap, head: bool) -> Result<Response, ApiError> {
        let d = parse_digest(d)?;
        let unknown = || ApiError::not_found(Code::BlobUnknown, format!("blob {d} unknown to {repo}"));
        let linked = exists(self.store.as_ref(), &layout::layer_link(repo, &d)).await? || exists(self.store.as_ref(), &layout::manifest_link(repo, &d)).await?;
        if !linked {
            return Err(unknown());
        }
        let key = layout::blob(&d);
        let meta = match self.store.head(&key).await {
            Ok(m) => m,
            Err(e) if e.is_not_found() => return Err(unknown()),
            Err(e) => return Err(e.into()),
        };
        if head {
            // A HEAD that finds a blob lets a pushing client skip uploading it: rely on
            // it, so a running gc keeps it, and answer by what is there after that.
            inuse::rely_on(self.store.as_ref(), &d).await?;
            if !exists(self.store.as_ref(), &key).await? {
                return Err(unknown());
            }
        }
        let range = parse_range(headers.get(header::RANGE), meta.size)?;
        let mut hs = vec![
            (header::CONTENT_TYPE, "application/octet-stream".to_owned()),
            (HeaderName::from_static("docker-content-digest"), d.to_string()),
            (header::ACCEPT_RANGES, "bytes".to_owned()),
            (header::ETAG, format!("\"{d}\"")),
        ];
        let status = match &range {
            Some(r) => {
                hs.push((header::CONTENT_RANGE, format!("bytes {}-{}/{}", r.start, r.end - 1, meta.size)));
                StatusCode::PARTIAL_CONTENT
            }
            None => StatusCode::OK,
        };
        let len = range.as_ref().map(|r| r.end - r.start).unwrap_or(meta.size);
        hs.push((header::CONTENT_LENGTH, len.to_string()));
        if head {
            return Ok(respond(status, &hs, Body::empty()));
        }
        let (_, stream) = match self.store.get(&key, range).await {
            Ok(s) => s,
            Err(e) if e.is_not_found() => return Err(unknown()),
            Err(e) => return Err(e.into()),
        };
        let stream = count_bytes(stream, self.metrics.clone(), false);
        Ok(respond(status, &hs, Body::from_stream(stream)))
    }

    async fn delete_blob(&self, repo: &RepoName, d: &str) -> Result<Response, ApiError> {
        let d = parse_digest(d)?;
        let link = layout::layer_link(repo, &d);
        if !exists(self.store.as_ref(), &link).await? {
            return Err(ApiError::not_found(Code::BlobUnknown, format!("blob {d} unknown to {repo}")));
        }
        // Only the repository's link goes; the bytes are shared and left to gc.
        self.store.delete(&link).await?;
        Ok(empty(StatusCode::ACCEPTED, &[]))
    }

    async fn start_upload(
        &self,
        repo: &RepoName,
        q: &[(String, String)],
        id: &Identity,
        body: impl futures::Stream<Item = Result<Bytes, axum::Error>> + Send,
    ) -> Result<Response, ApiError> {
        if let Some(m) = param(q, "mount") {
            let d = parse_digest(m)?;
            if self.try_mount(repo, &d, param(q, "from"), id).await? {
                return Ok(blob_created(repo, &d));
            }
            // Not mountable (unknown, or no read access to the source): fall through to a
            // fresh upload session, as the spec allows.
        } else if let Some(ds) = param(q, "digest") {
            // Monolithic upload in one POST.
            let d = parse_digest(ds)?;
            self.put_whole_blob(repo, &d, body).await?;
            self.metrics.uploads_completed.fetch_add(1, Relaxed);
            return Ok(blob_created(repo, &d));
        }
        let uid = self.uploads.start(repo).await?;
        self.metrics.uploads_started.fetch_add(1, Relaxed);
        let mut hs = upload_headers(repo, &uid, 0);
        hs.push((HeaderName::from_static("oci-chunk-min-length"), self.cfg.chunk_min_length.to_string()));
        Ok(empty(StatusCode::ACCEPTED, &hs))
    }

    /// Cross-repository mount; `false` when the blob cannot (or may not) be mounted.
    async fn try_mount(&self, repo: &RepoName, d: &OciDigest, from: Option<&str>, id: &Identity) -> Result<bool, ApiError> {
        let blob_there = exists(self.store.as_ref(), &layout::blob(d)).await?;
        if !blob_there {
            return Ok(false);
        }
        match from {
            Some(f) => {
                let Ok(from) = RepoName::parse(f) else { return Ok(false) };
                if !self.may(id, &from, Action::Pull) {
                    tracing::info!(%repo, %from, "mount refused: no pull access to source");
                    return Ok(false);
                }
                if !exists(self.store.as_ref(), &layout::layer_link(&from, d)).await? {
                    return Ok(false);
                }
            }
            None => {
                // Without `from` only an open registry mounts: with auth, knowing a digest
                // must not be enough to obtain a blob from a repository one cannot read.
                if self.cfg.auth.is_some() {
                    return Ok(false);
                }
            }
        }
        inuse::rely_on(self.store.as_ref(), d).await?;
        if !exists(self.store.as_ref(), &layout::blob(d)).await? {
            return Ok(false); // a gc took it meanwhile: the client uploads it instead
        }
        self.store.put(&layout::layer_link(repo, d), Bytes::new()).await?;
        Ok(true)
    }

    async fn put_whole_blob(
        &self,
        repo: &RepoName,
        d: &OciDigest,
        body: impl futures::Stream<Item = Result<Bytes, axum::Error>> + Send,
    ) -> Result<(), ApiError> {
        let tmp = upload::staging_path(self.store.as_ref(), "mono");
        let (n, h) = upload::stream_to_file(body, &tmp, Some(OciHasher::for_digest(d)), None).await?;
        let got = h.expect("hasher").finish();
        if &got != d {
            let _ = tokio::fs::remove_file(&tmp).await;
            self.metrics.uploads_cancelled.fetch_add(1, Relaxed);
            return Err(ApiError::bad(Code::DigestInvalid, format!("content is {got}, not {d}")));
        }
        let key = layout::blob(d);
        // Bytes the registry already holds are not stored again; rely on those, so a
        // running gc keeps them (or they are stored again if it took them).
        if let Err(e) = inuse::rely_on(self.store.as_ref(), d).await {
            let _ = tokio::fs::remove_file(&tmp).await;
            return Err(e.into());
        }
        if exists(self.store.as_ref(), &key).await? {
            let _ = tokio::fs::remove_file(&tmp).await;
        } else if let Err(e) = self.store.put_file(&key, &tmp).await {
            let _ = tokio::fs::remove_file(&tmp).await;
            return Err(e.into());
        } else {
            self.stats.note(crate::stats::Change::Stored { bytes: n });
        }
        self.store.put(&layout::layer_link(repo, d), Bytes::new()).await?;
        Ok(())
    }

    /// Resolve a manifest reference to (digest, media type); `MANIFEST_UNKNOWN` if absent.
    async fn resolve(&self, repo: &RepoName, reference: &str) -> Result<(OciDigest, String), ApiError> {
        let unknown = || ApiError::not_found(Code::ManifestUnknown, format!("manifest {reference} unknown to {repo}"));
        let d = if reference.contains(':') {
            parse_digest(reference)?
        } else {
            let t = Tag::parse(reference).map_err(|e| ApiError::bad(Code::ManifestInvalid, e.to_string()))?;
            match self.store.get_bytes(&layout::tag(repo, &t)).await {
                Ok(b) => std::str::from_utf8(&b)
                    .ok()
                    .and_then(|s| s.trim().parse().ok())
                    .ok_or_else(|| ApiError::internal(format!("tag {t} of {repo} is corrupt")))?,
                Err(e) if e.is_not_found() => return Err(unknown()),
                Err(e) => return Err(e.into()),
            }
        };
        let mt = match self.store.get_bytes(&layout::manifest_link(repo, &d)).await {
            Ok(b) => String::from_utf8_lossy(&b).trim().to_owned(),
            Err(e) if e.is_not_found() => return Err(unknown()),
            Err(e) => return Err(e.into()),
        };
        Ok((d, mt))
    }

    async fn get_manifest(&self, repo: &RepoName, reference: &str, headers: &HeaderMap, head: bool) -> Result<Response, ApiError> {
        // A restore's lease: by digest only (on a tag the header is ignored).
        let ask = match headers.get(crate::restore_lease::HEADER).filter(|_| reference.contains(':')) {
            Some(v) => Some(crate::restore_lease::parse(v.as_bytes()).map_err(|e| ApiError::bad(Code::Unsupported, e))?),
            None => None,
        };
        let (d, mt) = self.resolve(repo, reference).await?;
        if !accepts(headers, &mt) {
            return Err(ApiError::not_found(Code::ManifestUnknown, format!("manifest {reference} is {mt}, which the Accept header does not allow")));
        }
        let bytes = match self.store.get_bytes(&layout::blob(&d)).await {
            Ok(b) => b,
            Err(e) if e.is_not_found() => return Err(ApiError::not_found(Code::ManifestUnknown, format!("manifest {d} content missing"))),
            Err(e) => return Err(e.into()),
        };
        let mut hs = vec![
            (header::CONTENT_TYPE, mt),
            (HeaderName::from_static("docker-content-digest"), d.to_string()),
            (header::CONTENT_LENGTH, bytes.len().to_string()),
            (header::ETAG, format!("\"{d}\"")),
        ];
        if let Some(ask) = ask {
            if let Some(granted) = self.restore_lease(repo, &d, ask).await? {
                hs.push((HeaderName::from_static(crate::restore_lease::HEADER), granted.to_string()));
            }
        }
        let restoring = crate::restore_lease::is_restore(headers.get(crate::restore_lease::PURPOSE_HEADER).map(|v| v.as_bytes()));
        if (!head && restoring) || matches!(ask, Some(crate::restore_lease::Ask::Hold(_))) {
            // In memory; written in batches (crate::pulls). A lease is a restore: a pull.
            self.pulls.record(repo, &d);
        }
        if !head {
            self.metrics.bytes_out.fetch_add(bytes.len() as u64, Relaxed);
        }
        Ok(respond(StatusCode::OK, &hs, if head { Body::empty() } else { Body::from(bytes) }))
    }

    /// Take, renew or release a restore's lease on manifest `d` (crate::restore_lease);
    /// the seconds granted when the lease was recorded (`Some(0)`: released).
    async fn restore_lease(&self, repo: &RepoName, d: &OciDigest, ask: crate::restore_lease::Ask) -> Result<Option<u64>, ApiError> {
        let seconds = match ask {
            crate::restore_lease::Ask::Release => {
                crate::restore_lease::release(self.store.as_ref(), repo, d).await?;
                return Ok(Some(0));
            }
            crate::restore_lease::Ask::Hold(s) => s.min(self.cfg.max_lease.as_secs()),
        };
        if seconds == 0 {
            return Ok(None); // max_lease = 0: this server grants no lease
        }
        // Rely on the manifest like a push relies on a blob: a gc that listed the store
        // before this lease was written sees the use and keeps the manifest (crate::inuse);
        // one deleting it now finishes first, and the manifest is answered as missing.
        inuse::rely_on(self.store.as_ref(), d).await?;
        if !exists(self.store.as_ref(), &layout::manifest_link(repo, d)).await? || !exists(self.store.as_ref(), &layout::blob(d)).await? {
            return Err(ApiError::not_found(Code::ManifestUnknown, format!("manifest {d} unknown to {repo}")));
        }
        let keep_expired = self.cfg.gc.as_ref().map(|g| g.options.delay()).unwrap_or_else(|| crate::gc::GcOptions::default().delay());
        let recorded = crate::restore_lease::hold(self.store.as_ref(), repo, d, seconds, keep_expired).await?;
        Ok(recorded.then_some(seconds))
    }

    async fn put_manifest(
        &self,
        repo: &RepoName,
        reference: &str,
        headers: &HeaderMap,
        body: impl futures::Stream<Item = Result<Bytes, axum::Error>> + Send,
    ) -> Result<Response, ApiError> {
        let limit = self.cfg.max_manifest_bytes;
        let too_big = || ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, Code::SizeInvalid, format!("manifest larger than {limit} bytes"));
        if content_length(headers).is_some_and(|n| n > limit as u64) {
            return Err(too_big());
        }
        let mut buf = Vec::new();
        let mut body = std::pin::pin!(body);
        while let Some(c) = body.next().await {
            let c = c.map_err(|e| ApiError::bad(Code::ManifestInvalid, format!("reading body: {e}")))?;
            if buf.len() + c.len() > limit {
                return Err(too_big());
            }
            buf.extend_from_slice(&c);
        }
        let tag = if reference.contains(':') { None } else { Some(Tag::parse(reference).map_err(|e| ApiError::bad(Code::ManifestInvalid, e.to_string()))?) };
        let d = match &tag {
            None => {
                let want = parse_digest(reference)?;
                let got = OciHasher::for_digest(&want).finish_with(&buf);
                if got != want {
                    return Err(ApiError::bad(Code::DigestInvalid, format!("manifest is {got}, not {want}")));
                }
                got
            }
            Some(_) => OciDigest::of(&buf),
        };
        let json: serde_json::Value = serde_json::from_slice(&buf).map_err(|e| ApiError::bad(Code::ManifestInvalid, format!("manifest is not JSON: {e}")))?;
        let ct = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).map(|s| s.split(';').next().unwrap_or(s).trim().to_owned());
        let field = json.get("mediaType").and_then(|v| v.as_str()).map(str::to_owned);
        let mt = match (ct, field) {
            (Some(c), Some(f)) if c != f => return Err(ApiError::bad(Code::ManifestInvalid, format!("Content-Type {c} but mediaType {f}"))),
            (Some(c), _) => c,
            (None, Some(f)) => f,
            (None, None) => return Err(ApiError::bad(Code::ManifestInvalid, "no Content-Type and no mediaType")),
        };
        let refs = manifest_refs(&json)?;
        // Lease what this manifest relies on (its children and its own bytes) before
        // checking it: a gc whose listing misses this manifest then keeps them, or we
        // see them gone (crate::inuse).
        let mut relied: Vec<OciDigest> = refs.children.iter().map(|(c, _)| c.clone()).collect();
        relied.push(d.clone());
        let lease = inuse::lease_tagged(self.store.as_ref(), relied, tag.as_ref().map(|t| (repo, t))).await?;
        let done = self.commit_manifest(repo, &d, tag.as_ref(), mt, buf, &json, &refs, &lease).await;
        let released = match done {
            Ok(_) => lease.release_committed(self.store.as_ref()).await,
            Err(_) => lease.release(self.store.as_ref()).await,
        };
        if let Err(e) = released {
            // The lease stays and keeps protecting until it is stale; nothing is lost.
            tracing::warn!(%e, %d, "could not release a manifest lease");
        }
        done
    }

    /// The part of a manifest PUT under its lease: check what it references, then write it.
    #[allow(clippy::too_many_arguments)]
    async fn commit_manifest(
        &self,
        repo: &RepoName,
        d: &OciDigest,
        tag: Option<&Tag>,
        mt: String,
        buf: Vec<u8>,
        json: &serde_json::Value,
        refs: &ManifestRefs,
        lease: &inuse::Lease,
    ) -> Result<Response, ApiError> {
        for (child, is_manifest) in &refs.children {
            inuse::settled(self.store.as_ref(), child).await?;
            let key = if *is_manifest { layout::manifest_link(repo, child) } else { layout::layer_link(repo, child) };
            // The bytes too, not only the link: gc may have swept an old unreferenced
            // blob that a client skipped uploading because HEAD said it existed.
            if !exists(self.store.as_ref(), &key).await? || !exists(self.store.as_ref(), &layout::blob(child)).await? {
                return Err(ApiError::bad(Code::ManifestBlobUnknown, format!("{child} is not in {repo}")));
            }
        }
        // Our own bytes may be an old unreferenced copy a gc is deleting: let it finish first.
        inuse::settled(self.store.as_ref(), d).await?;
        lease.check_fresh()?;
        let (d, size) = (d.clone(), buf.len());
        // Whether the bytes and the link are new, for the store totals (crate::stats).
        let (stored, linked) = (exists(self.store.as_ref(), &layout::blob(&d)).await?, exists(self.store.as_ref(), &layout::manifest_link(repo, &d)).await?);
        let logical = self.stats.logical_of(&d, &buf);
        self.store.put(&layout::blob(&d), Bytes::from(buf)).await?;
        if !stored {
            self.stats.note(crate::stats::Change::Stored { bytes: size as u64 });
        }
        // Listed before its first manifest is: a repository with a manifest is in the catalog.
        if self.catalog.record(repo).await? {
            self.stats.note(crate::stats::Change::NewRepository);
        }
        self.store.put(&layout::manifest_link(repo, &d), Bytes::from(mt.clone())).await?;
        if !linked {
            self.stats.note(crate::stats::Change::Linked { logical });
        }
        let mut hs = vec![(header::LOCATION, format!("/v2/{repo}/manifests/{d}")), (HeaderName::from_static("docker-content-digest"), d.to_string())];
        if let Some(subject) = &refs.subject {
            let mut desc = serde_json::json!({ "mediaType": mt, "digest": d.to_string(), "size": size });
            let at = json.get("artifactType").and_then(|v| v.as_str()).or_else(|| json.pointer("/config/mediaType").and_then(|v| v.as_str()));
            if let Some(at) = at {
                desc["artifactType"] = at.into();
            }
            if let Some(a) = json.get("annotations").filter(|a| a.is_object()) {
                let size = serde_json::to_vec(a).map_or(usize::MAX, |v| v.len());
                if size > MAX_REFERRER_ANNOTATIONS {
                    return Err(ApiError::bad(
                        Code::ManifestInvalid,
                        format!("a manifest with a subject may carry at most {MAX_REFERRER_ANNOTATIONS} bytes of annotations into the referrers index, this one has {size}"),
                    ));
                }
                desc["annotations"] = a.clone();
            }
            let raw = serde_json::to_vec(&desc).expect("descriptor serializes");
            self.store.put(&layout::referrer(repo, subject, &d), raw.into()).await?;
            hs.push((HeaderName::from_static("oci-subject"), subject.to_string()));
        }
        if let Some(t) = tag {
            // A gc deciding about this tag (retention) finishes first; it saw our lease, or
            // we write the tag after it deleted the old one (crate::inuse).
            inuse::settled_tag(self.store.as_ref(), repo, t).await?;
            lease.check_fresh()?;
            self.store.put(&layout::tag(repo, t), Bytes::from(d.to_string())).await?;
        }
        Ok(empty(StatusCode::CREATED, &hs))
    }

    async fn delete_manifest(&self, repo: &RepoName, reference: &str) -> Result<Response, ApiError> {
        if !reference.contains(':') {
            let t = Tag::parse(reference).map_err(|e| ApiError::bad(Code::ManifestInvalid, e.to_string()))?;
            let key = layout::tag(repo, &t);
            if !exists(self.store.as_ref(), &key).await? {
                return Err(ApiError::not_found(Code::ManifestUnknown, format!("tag {t} unknown to {repo}")));
            }
            self.store.delete(&key).await?;
            return Ok(empty(StatusCode::ACCEPTED, &[]));
        }
        let (d, _) = self.resolve(repo, reference).await?;
        if let Ok(b) = self.store.get_bytes(&layout::blob(&d)).await {
            if let Ok(json) = serde_json::from_slice::<serde_json::Value>(&b) {
                if let Ok(Some(subject)) = manifest_refs(&json).map(|r| r.subject) {
                    self.store.delete(&layout::referrer(repo, &subject, &d)).await?;
                }
            }
        }
        // Tags pointing at the manifest go with it, as in docker/distribution.
        for m in self.store.list(&layout::tags_dir(repo)).await? {
            if let Ok(b) = self.store.get_bytes(&m.key).await {
                if b.as_ref() == d.to_string().as_bytes() {
                    self.store.delete(&m.key).await?;
                }
            }
        }
        let logical = self.stats.logical(&d).await.unwrap_or(0);
        self.store.delete(&layout::manifest_link(repo, &d)).await?;
        self.stats.note(crate::stats::Change::Unlinked { logical });
        Ok(empty(StatusCode::ACCEPTED, &[]))
    }

    async fn tags(&self, repo: &RepoName, q: &[(String, String)]) -> Result<Response, ApiError> {
        let mut tags: Vec<String> =
            self.store.list(&layout::tags_dir(repo)).await?.into_iter().filter_map(|m| m.key.rsplit('/').next().map(str::to_owned)).collect();
        if tags.is_empty() && self.store.list(&layout::manifests_dir(repo)).await?.is_empty() {
            return Err(ApiError::not_found(Code::NameUnknown, format!("repository {repo} unknown")));
        }
        tags.sort();
        if let Some(last) = param(q, "last") {
            tags.retain(|t| t.as_str() > last);
        }
        let mut hs = vec![(header::CONTENT_TYPE, "application/json".to_owned())];
        if let Some(n) = param(q, "n") {
            let n: usize = n.parse().map_err(|_| ApiError::bad(Code::Unsupported, format!("bad n={n:?}")))?;
            if tags.len() > n {
                tags.truncate(n);
                if let Some(last) = tags.last() {
                    hs.push((header::LINK, format!("</v2/{repo}/tags/list?n={n}&last={last}>; rel=\"next\"")));
                }
            }
        }
        let body = serde_json::to_vec(&serde_json::json!({ "name": repo.as_str(), "tags": tags })).expect("json");
        Ok(respond(StatusCode::OK, &hs, Body::from(body)))
    }

    /// `GET /v2/<name>/referrers/<digest>[?artifactType=T][&n=N][&last=DIGEST]`: a page of
    /// at most `n` (default and most [`REFERRERS_PAGE`]) referrer descriptors in digest
    /// order after `last`, with a `Link: <…>; rel="next"` to the next page when there is one.
    async fn referrers(&self, repo: &RepoName, d: &str, q: &[(String, String)]) -> Result<Response, ApiError> {
        let subject = parse_digest(d)?;
        let filter = param(q, "artifactType");
        let n = match param(q, "n") {
            None => REFERRERS_PAGE,
            Some(v) => v.parse::<usize>().map_err(|_| ApiError::bad(Code::Unsupported, format!("bad n={v:?}")))?.clamp(1, REFERRERS_PAGE),
        };
        let last = param(q, "last");
        let mut entries: Vec<_> = self.store.list(&layout::referrers_dir(repo, &subject)).await?;
        entries.sort_by(|a, b| a.key.cmp(&b.key));
        let mut manifests = Vec::new();
        let mut more = false;
        for m in entries {
            // Keys end in the referrer's digest (`…/<alg>-<hex>`): the order and the cursor.
            let name = m.key.rsplit('/').next().unwrap_or("").replacen('-', ":", 1);
            if last.is_some_and(|l| name.as_str() <= l) {
                continue;
            }
            if m.size > MAX_REFERRER_DESCRIPTOR {
                tracing::warn!(key = %m.key, size = m.size, "skipping an oversized referrers-index entry");
                continue;
            }
            let b = match self.store.get_bytes(&m.key).await {
                Ok(b) => b,
                Err(e) if e.is_not_found() => continue,
                Err(e) => return Err(e.into()),
            };
            let Ok(desc) = serde_json::from_slice::<serde_json::Value>(&b) else { continue };
            if let Some(f) = filter {
                if desc.get("artifactType").and_then(|v| v.as_str()) != Some(f) {
                    continue;
                }
            }
            if manifests.len() == n {
                more = true;
                break;
            }
            manifests.push(desc);
        }
        let body = serde_json::json!({ "schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests });
        let mut hs = vec![(header::CONTENT_TYPE, OCI_INDEX.to_owned())];
        if filter.is_some() {
            hs.push((HeaderName::from_static("oci-filters-applied"), "artifactType".to_owned()));
        }
        if let (true, Some(last)) = (more, manifests.last().and_then(|m| m["digest"].as_str())) {
            let mut next = form_urlencoded::Serializer::new(String::new());
            if let Some(f) = filter {
                next.append_pair("artifactType", f);
            }
            next.append_pair("n", &n.to_string()).append_pair("last", last);
            hs.push((header::LINK, format!("</v2/{repo}/referrers/{subject}?{}>; rel=\"next\"", next.finish())));
        }
        Ok(respond(StatusCode::OK, &hs, Body::from(serde_json::to_vec(&body).expect("json"))))
    }
}

/// Pass a byte stream through, adding its sizes to the request (`inbound`) or response
/// byte counter.
fn count_bytes<E>(
    s: impl futures::Stream<Item = Result<Bytes, E>> + Send + 'static,
    m: Arc<Metrics>,
    inbound: bool,
) -> impl futures::Stream<Item = Result<Bytes, E>> + Send + 'static {
    s.map(move |r| {
        if let Ok(b) = &r {
            let c = if inbound { &m.bytes_in } else { &m.bytes_out };
            c.fetch_add(b.len() as u64, Relaxed);
        }
        r
    })
}

fn content_length(h: &HeaderMap) -> Option<u64> {
    h.get(header::CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

fn upload_headers(repo: &RepoName, uid: &str, size: u64) -> Vec<(HeaderName, String)> {
    vec![(header::LOCATION, upload_location(repo, uid)), (header::RANGE, range_header(size)), (HeaderName::from_static("docker-upload-uuid"), uid.to_owned())]
}

fn blob_created(repo: &RepoName, d: &OciDigest) -> Response {
    empty(StatusCode::CREATED, &[(header::LOCATION, format!("/v2/{repo}/blobs/{d}")), (HeaderName::from_static("docker-content-digest"), d.to_string())])
}

/// Whether the request's `Accept` allows media type `mt`. No `Accept` allows all.
fn accepts(h: &HeaderMap, mt: &str) -> bool {
    let mut any_header = false;
    for v in h.get_all(header::ACCEPT) {
        let Ok(v) = v.to_str() else { continue };
        for item in v.split(',') {
            any_header = true;
            let t = item.split(';').next().unwrap_or("").trim();
            if t == mt || t == "*/*" || t == "application/*" || t.is_empty() {
                return true;
            }
        }
    }
    !any_header
}

/// The client key the listener put in a request's extensions (none when the router is
/// served some other way).
type Client = Option<axum::Extension<listen::ClientAddr>>;

fn client_ip(c: Client) -> Option<std::net::IpAddr> {
    c.map(|axum::Extension(listen::ClientAddr(ip))| ip)
}

async fn v2(State(s): State<Arc<Server>>, client: Client, method: Method, uri: Uri, headers: HeaderMap, body: Body) -> Response {
    let (body, shared) = drain::Shared::new(body);
    match s.handle(method, uri, headers.clone(), body, client_ip(client)).await {
        Ok(r) => r,
        Err(e) => {
            // Read what the client is still sending before answering (server::drain).
            shared.drain(&headers, s.cfg.limits.idle_timeout).await;
            s.metrics.error(e.code.as_str());
            if e.status.is_server_error() {
                crate::access::note_error(&e.message);
            }
            let mut r = e.into_response();
            r.headers_mut().insert(HeaderName::from_static(API_VERSION.0), HeaderValue::from_static(API_VERSION.1));
            r
        }
    }
}

async fn token(State(s): State<Arc<Server>>, client: Client, uri: Uri, headers: HeaderMap) -> Response {
    let Some(auth) = &s.cfg.auth else {
        return ApiError::not_found(Code::Unsupported, "authentication is not enabled").into_response();
    };
    let sub = match s.identify(&uri, &headers, client_ip(client)).await {
        Ok(Identity::User(u)) => Some(u),
        Ok(Identity::Anonymous) => None,
        Err(e) if e.status != StatusCode::UNAUTHORIZED => return e.into_response(),
        Ok(Identity::Token { .. }) | Err(_) => {
            return ApiError::new(StatusCode::UNAUTHORIZED, Code::Unauthorized, "invalid credentials")
                .with_header(header::WWW_AUTHENTICATE, "Basic realm=\"snapctl\"")
                .into_response();
        }
    };
    let q = query(&uri);
    let scopes: Vec<String> = q.iter().filter(|(k, _)| k == "scope").flat_map(|(_, v)| v.split(' ').map(str::to_owned)).collect();
    let (tok, _) = auth.issue_token(sub.as_deref(), &scopes);
    let issued = time::OffsetDateTime::now_utc().format(&time::format_description::well_known::Rfc3339).unwrap_or_default();
    axum::Json(serde_json::json!({
        "token": tok, "access_token": tok,
        "expires_in": crate::auth::TOKEN_TTL.as_secs(), "issued_at": issued,
    }))
    .into_response()
}

/// `/metrics` on the API listener: with auth enabled, for users only (a scraper sends
/// Basic credentials); the store's totals only for users who may pull every repository.
async fn metrics(State(s): State<Arc<Server>>, client: Client, uri: Uri, headers: HeaderMap) -> Response {
    let mut every_repository = true;
    if s.cfg.auth.is_some() {
        let id = s.identify(&uri, &headers, client_ip(client)).await;
        let user = match &id {
            Ok(Identity::User(_)) => true,
            Ok(Identity::Token { sub, .. }) => !sub.is_empty(),
            _ => false,
        };
        if !user {
            return ApiError::new(StatusCode::UNAUTHORIZED, Code::Unauthorized, "metrics need credentials")
                .with_header(header::WWW_AUTHENTICATE, "Basic realm=\"snapctl\"")
                .into_response();
        }
        every_repository = id.ok().and_then(|id| s.readable(&id)) == Some(Readable::All);
    }
    render_metrics(&s, every_repository)
}

/// `/metrics` for anyone who can reach it (the metrics listener).
async fn open_metrics(State(s): State<Arc<Server>>) -> Response {
    render_metrics(&s, true)
}

/// The metrics text; with `store_totals`, the store's totals (which tell about every
/// repository) too.
fn render_metrics(s: &Server, store_totals: bool) -> Response {
    let mut text = s.metrics.render();
    if let Some(a) = &s.cfg.auth {
        text.push_str(&crate::metrics::render_auth(&a.stats()));
    }
    if let Some(t) = s.stats.latest().filter(|_| store_totals) {
        text.push_str(&t.render_prometheus());
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// Middleware: count requests by method and status, time them by route class, and log
/// them ([`crate::access`]).
async fn count(State(s): State<Arc<Server>>, req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let t = std::time::Instant::now();
    let resp = crate::access::logged(req, |req| next.run(req)).await;
    s.metrics.request(method.as_str(), resp.status().as_u16());
    s.metrics.request_latency(route_class(&path), method.as_str(), t.elapsed());
    resp
}

/// Fail a request body that stalls: when no byte arrives for `idle`, the stream ends with
/// an error, the handler answers, and the connection can go (a body owed forever would
/// hold its connection and descriptor forever).
fn stall_limited(
    s: impl futures::Stream<Item = Result<Bytes, axum::Error>> + Send + 'static,
    idle: Duration,
    m: Arc<Metrics>,
) -> impl futures::Stream<Item = Result<Bytes, axum::Error>> + Send + 'static {
    futures::stream::unfold(Some(Box::pin(s)), move |st| {
        let m = m.clone();
        async move {
            let mut s = st?;
            match tokio::time::timeout(idle, s.next()).await {
                Ok(Some(item)) => Some((item, Some(s))),
                Ok(None) => None,
                Err(_) => {
                    m.connections_timed_out.fetch_add(1, Relaxed);
                    let e = std::io::Error::new(std::io::ErrorKind::TimedOut, format!("no byte of the request body for {} s", idle.as_secs_f64()));
                    Some((Err(axum::Error::new(e)), None))
                }
            }
        }
    })
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod ops_tests;
