//! `snapctl serve`: run the OCI registry (owned by the registry work; see registry/).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;

/// Run an OCI Distribution registry that stores snapshots content-addressed.
///
/// Storage is a directory (default) or s3://BUCKET/PREFIX (configured from AWS_* env:
/// AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ALLOW_HTTP).
/// Logs go to stderr, one line per request naming the client, user, method, path, status,
/// bytes in and out, time and user agent, and a 5xx's cause (--log-format json: one JSON
/// object per line; filter with SNAPCTL_LOG or RUST_LOG, e.g. `SNAPCTL_LOG=debug`).
/// SIGTERM or SIGINT stops accepting connections and finishes in-flight requests; SIGHUP
/// reloads the --htpasswd file (it is also reloaded when it changes, see --htpasswd-poll).
///
/// For operators: GET /v2/_catalog lists repositories (paged, only those the caller may
/// pull; `snapctl`-independent clients such as `oras repo ls` use it); /metrics has the
/// store's totals (bytes, blobs, manifests, repositories, dedup ratio, taken every
/// --stats-interval), request latency histograms and build info.
///
/// Against hostile clients: a request head must arrive within --header-timeout, a
/// connection with nothing in flight and nothing moving (or a request body that stops)
/// is closed after --idle-timeout, so is a connection one of whose responses has not moved
/// for --idle-timeout (an HTTP/2 stream whose window stays shut), a client (IPv4 address,
/// IPv6 /64) may hold --max-conns-per-client connections and --max-requests-per-client
/// requests in progress (more get 429 at once), an HTTP/2 connection
/// --max-streams-per-conn streams, idle upload sessions are removed after
/// --upload-ttl, and /metrics has fixed label sets (and, with --htpasswd, needs
/// credentials unless it has its own --metrics-listen address). See spec/registry.md.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Where blobs and manifests live: a directory, or s3://BUCKET/PREFIX.
    #[arg(long, default_value = "./snapctl-registry")]
    pub storage: String,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:5000")]
    pub listen: String,
    /// Local directory for staging uploads when storage is remote (default: system temp dir).
    #[arg(long)]
    pub staging_dir: Option<PathBuf>,
    /// htpasswd file with bcrypt hashes (`htpasswd -B`); enables authentication.
    #[arg(long)]
    pub htpasswd: Option<PathBuf>,
    /// ACL file (TOML, see spec/registry.md); without it, every user may pull and push.
    #[arg(long, requires = "htpasswd")]
    pub acl: Option<PathBuf>,
    /// Let anonymous clients pull every repository (with --htpasswd).
    #[arg(long, requires = "htpasswd")]
    pub anonymous_read: bool,
    /// File holding the token signing secret (>= 32 bytes); share it between replicas.
    /// Default: a random secret per process.
    #[arg(long, requires = "htpasswd")]
    pub token_secret_file: Option<PathBuf>,
    /// Most bcrypt password checks running at once (default: half the cores, at least 1).
    /// A request with Basic credentials that finds every slot busy is answered 503 with
    /// Retry-After at once; verified credentials are remembered for 5 minutes (no check),
    /// and a client (address) sending a sixth wrong password waits 1 s, doubling to 60 s,
    /// before its next is checked (429 with Retry-After meanwhile).
    #[arg(long, requires = "htpasswd", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_password_checks: Option<u64>,
    /// Token realm URL for the WWW-Authenticate challenge (default: this server's /token).
    #[arg(long, requires = "htpasswd")]
    pub token_realm: Option<String>,
    /// TLS certificate chain (PEM).
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// TLS private key (PEM).
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Largest manifest accepted, in bytes (larger: 413).
    #[arg(long, default_value_t = registry::server::DEFAULT_MAX_MANIFEST)]
    pub max_manifest_bytes: usize,
    /// Smallest PATCH accepted during chunked uploads, announced as OCI-Chunk-Min-Length
    /// when an upload starts (0: no minimum).
    #[arg(long, default_value = "0", value_parser = super::common::parse_size)]
    pub chunk_min_length: u64,
    /// A request head (for a new connection: its TLS handshake too) must arrive within this.
    #[arg(long, default_value = "30s", value_parser = super::common::parse_duration)]
    pub header_timeout: Duration,
    /// Close a connection with no request in flight and no byte moving, and fail a request
    /// whose body stops arriving, after this.
    #[arg(long, default_value = "120s", value_parser = super::common::parse_duration)]
    pub idle_timeout: Duration,
    /// Most connections one client (IPv4 address, IPv6 /64) may hold open; more are
    /// closed at once (0: no cap). Generous: moving connections are cheap, and one host
    /// pulling for many sandboxes at once opens hundreds; what a client can hold still
    /// is bounded by --max-requests-per-client and --idle-timeout. Both caps are lowered
    /// to a quarter of the descriptor limit (`ulimit -n`, whose soft limit serve raises
    /// to the hard one) when that is smaller, so one client cannot use every descriptor.
    #[arg(long, default_value_t = registry::server::DEFAULT_MAX_CONNS_PER_CLIENT)]
    pub max_conns_per_client: usize,
    /// Most requests one client may have in progress across its connections (a handler
    /// running or a response still being sent, each possibly holding a file open); more
    /// are answered 429 with Retry-After at once (0: no cap).
    #[arg(long, default_value_t = registry::server::DEFAULT_MAX_REQUESTS_PER_CLIENT)]
    pub max_requests_per_client: usize,
    /// Most HTTP/2 streams one connection may have open at once (announced to the client
    /// in SETTINGS_MAX_CONCURRENT_STREAMS).
    #[arg(long, default_value_t = registry::server::DEFAULT_MAX_STREAMS_PER_CONN, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_streams_per_conn: u32,
    /// Remove upload sessions idle for this long (checked every quarter of it).
    #[arg(long, default_value = "15m", value_parser = super::common::parse_duration)]
    pub upload_ttl: Duration,
    /// Serve /metrics on this address only (e.g. 127.0.0.1:9100), unauthenticated, and not
    /// on --listen. Default: on --listen, needing credentials when --htpasswd is set.
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// Most repositories one GET /v2/_catalog page may ask for (?n=); more is refused with
    /// 400 PAGINATION_NUMBER_INVALID, as distribution does.
    #[arg(long, default_value_t = registry::catalog::DEFAULT_MAX_ENTRIES)]
    pub catalog_max_entries: usize,
    /// Check the --htpasswd file for changes this often and load them (0: only on SIGHUP).
    #[arg(long, default_value = "2s", value_parser = super::common::parse_duration)]
    pub htpasswd_poll: Duration,
    /// Take the store's totals for /metrics (snapctl_store_*) by a scan of the store this
    /// often; a scrape never scans (0: never).
    #[arg(long, default_value = "5m", value_parser = super::common::parse_duration)]
    pub stats_interval: Duration,
    /// How log lines are written: `text` (one line per event) or `json` (one JSON object
    /// per line, fields at the top level, for log shippers).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// `serve --log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// The server's log filter when neither SNAPCTL_LOG nor RUST_LOG sets one: warnings, and
/// one line per request.
pub const DEFAULT_LOG: &str = "warn,registry=info";

pub fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let auth = match &args.htpasswd {
        None => None,
        Some(h) => {
            let users = std::fs::read_to_string(h).with_context(|| format!("reading {}", h.display()))?;
            let acl = match &args.acl {
                Some(p) => Some(std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?),
                None => None,
            };
            let secret = match &args.token_secret_file {
                Some(p) => std::fs::read(p).with_context(|| format!("reading {}", p.display()))?,
                None => registry::auth::random_secret(),
            };
            let mut a = registry::auth::Auth::new(&users, acl.as_deref(), args.anonymous_read, secret).context("loading authentication config")?;
            a.realm = args.token_realm.clone();
            if let Some(n) = args.max_password_checks {
                a.max_checks = usize::try_from(n).unwrap_or(usize::MAX);
            }
            Some(a)
        }
    };
    let tls = args.tls_cert.is_some();
    let limits = registry::server::Limits {
        header_read_timeout: args.header_timeout,
        idle_timeout: args.idle_timeout,
        max_conns_per_client: args.max_conns_per_client,
        max_requests_per_client: args.max_requests_per_client,
        max_streams_per_conn: args.max_streams_per_conn,
    };
    if limits.header_read_timeout.is_zero() || limits.idle_timeout.is_zero() {
        anyhow::bail!("--header-timeout and --idle-timeout must be more than 0");
    }
    let cfg = registry::Config {
        max_manifest_bytes: args.max_manifest_bytes,
        auth,
        tls,
        chunk_min_length: args.chunk_min_length,
        limits,
        upload_ttl: args.upload_ttl,
        api_metrics: args.metrics_listen.is_none(),
        catalog_max_entries: args.catalog_max_entries,
        htpasswd_file: args.htpasswd.clone(),
        htpasswd_poll: args.htpasswd_poll,
        stats_interval: args.stats_interval,
        build: registry::metrics::BuildInfo { version: env!("CARGO_PKG_VERSION").to_owned(), commit: env!("SNAPCTL_COMMIT").to_owned() },
    };
    let store = registry::store::open(&args.storage, args.staging_dir.as_deref()).with_context(|| format!("opening storage {}", args.storage))?;

    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting tokio")?;
    rt.block_on(async move {
        let listener = std::net::TcpListener::bind(&args.listen).with_context(|| format!("listening on {}", args.listen))?;
        let addr = listener.local_addr()?;
        for w in cfg.exposure_warnings(addr) {
            tracing::warn!("{w}");
        }
        let server = registry::Server::new(store, cfg);
        if args.htpasswd.is_some() {
            let s = server.clone();
            tokio::spawn(async move {
                let Ok(mut hup) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) else { return };
                while hup.recv().await.is_some() {
                    s.reload_htpasswd().await;
                }
            });
        }
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(());
        tokio::spawn(async move {
            shutdown_signal().await;
            let _ = stop_tx.send(());
        });
        let stopped = |mut rx: tokio::sync::watch::Receiver<()>| async move {
            let _ = rx.changed().await;
        };
        let metrics = match &args.metrics_listen {
            Some(m) => {
                let l = tokio::net::TcpListener::bind(m).await.with_context(|| format!("listening on {m} for metrics"))?;
                eprintln!("snapctl serve: metrics on http://{}/metrics", l.local_addr()?);
                Some(tokio::spawn(server.clone().serve_metrics(l, stopped(stop_rx.clone()))))
            }
            None => None,
        };
        eprintln!("snapctl serve: listening on {}://{addr} (storage: {})", if tls { "https" } else { "http" }, args.storage);
        match (&args.tls_cert, &args.tls_key) {
            (Some(cert), Some(key)) => server.serve_tls(listener, cert, key, stopped(stop_rx)).await,
            _ => {
                listener.set_nonblocking(true)?;
                let l = tokio::net::TcpListener::from_std(listener)?;
                server.serve(l, stopped(stop_rx)).await
            }
        }
        .context("serving")?;
        if let Some(m) = metrics {
            m.await.context("metrics listener")?.context("serving metrics")?;
        }
        eprintln!("snapctl serve: stopped");
        Ok(ExitCode::SUCCESS)
    })
}

/// Resolves on SIGTERM or SIGINT.
async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
    eprintln!("snapctl serve: shutting down, finishing in-flight requests");
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        serve: super::ServeArgs,
    }

    #[derive(clap::Parser)]
    struct Gc {
        #[command(flatten)]
        gc: super::super::gc::GcArgs,
    }

    /// Issue 25: an abandoned upload was kept 24 h. The flag's default is the registry's.
    #[test]
    fn regression_issue_25_the_upload_ttl_default_is_the_registrys() {
        let a = Cli::parse_from(["serve"]);
        assert_eq!(a.serve.upload_ttl, registry::server::DEFAULT_UPLOAD_TTL);
        assert!(a.serve.upload_ttl <= std::time::Duration::from_secs(15 * 60), "{:?}", a.serve.upload_ttl);
        assert_eq!(registry::gc::GcOptions::default().upload_ttl, registry::server::DEFAULT_UPLOAD_TTL);
        assert_eq!(Gc::parse_from(["gc", "--storage", "x"]).gc.upload_ttl, registry::server::DEFAULT_UPLOAD_TTL);
    }
}
