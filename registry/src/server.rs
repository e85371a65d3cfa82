//! The HTTP API: OCI Distribution v1.1 under `/v2/`, the docker token endpoint
//! `/token`, and Prometheus `/metrics`.
//!
//! Repository names contain `/`, so `/v2/*` is routed by hand from the end of the path
//! ([`parse_route`]). Every name, tag and digest is validated before it reaches storage.
//! Connections are accepted by [`listen`], which bounds what a slow or idle client can
//! hold (timeouts, a cap per client).
//!
//! This file holds the [`Config`], the [`Server`] and how it is served; each concern of a
//! request is a submodule:
//! ```text
//! listen      accepting connections: TLS, HTTP/1.1 and h2, timeouts, caps per client
//! routing     /v2/ paths parsed into a Route, the access each needs, the dispatch; the
//!             middleware that counts, times and logs every request
//! guard       who is asking (credentials, tokens), 401/403 and the challenge, /token
//! blobs       blob GET/HEAD/DELETE; uploads: start, mount, monolithic, PATCH, PUT
//! manifests   references resolved; manifest GET (restore leases), PUT, DELETE
//! listings    /v2/_catalog, tags, referrers: pages with a Link to the next
//! scrape      /metrics on the API listener and on a listener of its own
//! web         the read-only web view under /ui
//! background  the tasks beside requests: upload sweeper, htpasswd watcher, store
//!             totals, pull-time writer, scheduled gc
//! wire        the HTTP pieces every handler shares (answers, headers, query, body streams)
//! drain       reading what a refused client still sends before answering
//! ```
//! Who calls whom: `routing` calls the handlers of `guard`, `blobs`, `manifests` and
//! `listings`; every handler uses `wire`; none calls back into `routing`.

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::middleware;
use axum::routing::{any, get};
use axum::Router;

use crate::auth::Auth;
use crate::catalog::Catalog;
use crate::metrics::Metrics;
use crate::pulls::PullLog;
use crate::store::{BlobStore, MeteredStore};
use crate::upload::Uploads;

/// Default manifest size limit: 4 MiB, the spec's minimum that registries should accept.
pub const DEFAULT_MAX_MANIFEST: usize = 4 * 1024 * 1024;

/// Media type of an OCI image index.
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
/// Media type of an OCI image manifest.
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";

mod background;
mod blobs;
mod drain;
mod guard;
mod listen;
mod listings;
mod manifests;
mod routing;
mod scrape;
mod web;
mod wire;

pub use guard::request_authority;
pub use listen::{Limits, DEFAULT_MAX_CONNS_PER_CLIENT, DEFAULT_MAX_REQUESTS_PER_CLIENT, DEFAULT_MAX_STREAMS_PER_CONN};
pub use routing::{parse_route, route_class, Route};

/// Most bytes a referrer's annotations may take (as JSON) in the referrers index: a
/// manifest with a `subject` and more is refused (each listing repeats them, and a client
/// reads a page of them at once).
pub const MAX_REFERRER_ANNOTATIONS: usize = 16 << 10;
/// Referrers per page of a referrers listing when the client asks for no `n` (and the
/// most it may ask for): with [`MAX_REFERRER_ANNOTATIONS`], a page stays under 2 MiB,
/// within the 4 MiB a client reads of an index.
pub const REFERRERS_PAGE: usize = 100;

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
            .route("/v2", any(routing::v2))
            .route("/v2/", any(routing::v2))
            .route("/v2/{*rest}", any(routing::v2))
            .route("/token", get(guard::token))
            .route("/ui", get(web::root))
            .route("/ui/", get(web::ui))
            .route("/ui/{*rest}", get(web::ui));
        if self.cfg.api_metrics {
            r = r.route("/metrics", get(scrape::metrics));
        }
        r.layer(middleware::from_fn_with_state(self.clone(), routing::count)).layer(DefaultBodyLimit::disable()).with_state(self.clone())
    }

    /// The router of the metrics listener: `/metrics` only, unauthenticated.
    pub fn metrics_router(self: &Arc<Self>) -> Router {
        Router::new().route("/metrics", get(scrape::open_metrics)).with_state(self.clone())
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
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod ops_tests;
