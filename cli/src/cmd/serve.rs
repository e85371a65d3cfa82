//! `snapctl serve`: run the OCI registry (owned by the registry work; see registry/).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::builder::TypedValueParser as _;
use registry::config::{FileConfig, GcSection, LogFormat, ServeSettings};

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
/// --stats-interval), request latency histograms and build info; /ui/ is a read-only web
/// view (same credentials) with each tag's push and last pull times, and /ui/retention
/// shows what retention would delete now (a dry run of the schedule's policies).
///
/// Every option can also be set in a TOML file (--config FILE) by its name in snake_case
/// (`upload_ttl = "24h"`); options on the command line win. The file also holds the gc
/// schedule and retention policies (spec/registry.md §4.1):
///
///   storage = "/var/lib/snapctl"
///   [gc]
///   interval = "24h"     # run gc (retention, then unreferenced blobs) this long after
///                        # the last run ended; "0" never. Default 24h
///   grace = "1h"         # as gc --grace; also the retention delay unless set
///   pull_flush = "5m"    # pulls are recorded in memory and written this often
///   max_lease = "24h"    # the longest lease a running restore may hold on its image
///   [retention]
///   delay = "24h"        # untagged manifests go once this old (default: grace)
///   [[retention.policies]]
///   repositories = ["sandboxes/**"]
///   keep_tags = [{ patterns = ["latest", "v.*"], most_recently_pushed_count = 10,
///                  pulled_within = "30d" }]
///
/// Without policies gc keeps every tag, what tagged images need, and referrers of what it
/// keeps; untagged manifests go once older than the delay (a re-pushed tag's old image,
/// with its traces and signatures).
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
#[command(verbatim_doc_comment)]
pub struct ServeArgs {
    /// Configuration file (TOML): these options in snake_case, [gc], [retention].
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Read and check FILE as serve would (the other flags laid over it, the --htpasswd,
    /// --acl and --token-secret-file it names read), print the effective settings on
    /// stdout and exit: 0 when they are good, 2 with the error. Starts no server.
    #[arg(long, value_name = "FILE", conflicts_with = "config")]
    pub check_config: Option<PathBuf>,
    /// Where blobs and manifests live: a directory, or s3://BUCKET/PREFIX
    /// [default: ./snapctl-registry].
    #[arg(long)]
    pub storage: Option<String>,
    /// Address to listen on [default: 127.0.0.1:5000].
    #[arg(long)]
    pub listen: Option<String>,
    /// Local directory for staging uploads when storage is remote (default: system temp dir).
    #[arg(long)]
    pub staging_dir: Option<PathBuf>,
    /// htpasswd file with bcrypt hashes (`htpasswd -B`); enables authentication.
    #[arg(long)]
    pub htpasswd: Option<PathBuf>,
    /// ACL file (TOML, see spec/registry.md); without it, every user may pull and push.
    /// Needs --htpasswd.
    #[arg(long)]
    pub acl: Option<PathBuf>,
    /// Let anonymous clients pull every repository (with --htpasswd).
    #[arg(long)]
    pub anonymous_read: bool,
    /// File holding the token signing secret (>= 32 bytes); share it between replicas.
    /// Default: a random secret per process. Needs --htpasswd.
    #[arg(long)]
    pub token_secret_file: Option<PathBuf>,
    /// Most bcrypt password checks running at once (default: half the cores, at least 1).
    /// A request with Basic credentials that finds every slot busy is answered 503 with
    /// Retry-After at once; verified credentials are remembered for 5 minutes (no check),
    /// and a client (address) sending a sixth wrong password waits 1 s, doubling to 60 s,
    /// before its next is checked (429 with Retry-After meanwhile). Needs --htpasswd.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_password_checks: Option<u64>,
    /// Token realm URL for the WWW-Authenticate challenge (default: this server's /token).
    /// Needs --htpasswd.
    #[arg(long)]
    pub token_realm: Option<String>,
    /// TLS certificate chain (PEM); with --tls-key.
    #[arg(long)]
    pub tls_cert: Option<PathBuf>,
    /// TLS private key (PEM); with --tls-cert.
    #[arg(long)]
    pub tls_key: Option<PathBuf>,
    /// Largest manifest accepted, in bytes (larger: 413) [default: 4MiB].
    #[arg(long, value_parser = super::common::parse_size)]
    pub max_manifest_bytes: Option<u64>,
    /// Smallest PATCH accepted during chunked uploads, announced as OCI-Chunk-Min-Length
    /// when an upload starts (0: no minimum) [default: 0].
    #[arg(long, value_parser = super::common::parse_size)]
    pub chunk_min_length: Option<u64>,
    /// A request head (for a new connection: its TLS handshake too) must arrive within this
    /// [default: 30s].
    #[arg(long, value_parser = super::common::parse_duration)]
    pub header_timeout: Option<Duration>,
    /// Close a connection with no request in flight and no byte moving, and fail a request
    /// whose body stops arriving, after this [default: 120s].
    #[arg(long, value_parser = super::common::parse_duration)]
    pub idle_timeout: Option<Duration>,
    /// Most connections one client (IPv4 address, IPv6 /64) may hold open; more are
    /// closed at once (0: no cap). Generous: moving connections are cheap, and one host
    /// pulling for many sandboxes at once opens hundreds; what a client can hold still
    /// is bounded by --max-requests-per-client and --idle-timeout. Both caps are lowered
    /// to a quarter of the descriptor limit (`ulimit -n`, whose soft limit serve raises
    /// to the hard one) when that is smaller, so one client cannot use every descriptor
    /// [default: 512].
    #[arg(long)]
    pub max_conns_per_client: Option<usize>,
    /// Most requests one client may have in progress across its connections (a handler
    /// running or a response still being sent, each possibly holding a file open); more
    /// are answered 429 with Retry-After at once (0: no cap) [default: 512].
    #[arg(long)]
    pub max_requests_per_client: Option<usize>,
    /// Most HTTP/2 streams one connection may have open at once (announced to the client
    /// in SETTINGS_MAX_CONCURRENT_STREAMS) [default: 64].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_streams_per_conn: Option<u32>,
    /// Remove upload sessions idle for this long (checked every quarter of it)
    /// [default: 15m].
    #[arg(long, value_parser = super::common::parse_duration)]
    pub upload_ttl: Option<Duration>,
    /// Serve /metrics on this address only (e.g. 127.0.0.1:9100), unauthenticated, and not
    /// on --listen. Default: on --listen, needing credentials when --htpasswd is set.
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// Most repositories one GET /v2/_catalog page may ask for (?n=); more is refused with
    /// 400 PAGINATION_NUMBER_INVALID, as distribution does [default: 1000].
    #[arg(long)]
    pub catalog_max_entries: Option<usize>,
    /// Check the --htpasswd file for changes this often and load them (0: only on SIGHUP)
    /// [default: 2s].
    #[arg(long, value_parser = super::common::parse_duration)]
    pub htpasswd_poll: Option<Duration>,
    /// Take the store's totals for /metrics (snapctl_store_*) by a scan of the store this
    /// often; a scrape never scans (0: never) [default: 5m].
    #[arg(long, value_parser = super::common::parse_duration)]
    pub stats_interval: Option<Duration>,
    /// How log lines are written: `text` (one line per event) or `json` (one JSON object
    /// per line, fields at the top level, for log shippers) [default: text].
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(LogFormat::NAMES).map(|s| s.parse::<LogFormat>().expect("a listed value")))]
    pub log_format: Option<LogFormat>,
    /// A PEM public key (cosign.pub) whose signatures the web view shows as verified,
    /// with its fingerprint (repeatable; `trusted_keys` in --config). Without one,
    /// signatures are shown as not checked [default: none].
    #[arg(long, value_name = "FILE")]
    pub trusted_key: Vec<std::path::PathBuf>,
}

impl ServeArgs {
    /// Whether log lines are JSON: --log-format, else the configuration file's `log_format`
    /// (logging starts before the file is otherwise read; a file that cannot be read is
    /// reported when it is).
    pub fn log_json(&self) -> bool {
        let file = self.log_format.or_else(|| FileConfig::load_opt(self.config.as_deref()).ok().and_then(|f| f.log_format));
        file == Some(LogFormat::Json)
    }

    /// The flags given, as configuration keys (laid over the file's).
    fn flags(self) -> FileConfig {
        FileConfig {
            storage: self.storage,
            listen: self.listen,
            staging_dir: self.staging_dir,
            htpasswd: self.htpasswd,
            acl: self.acl,
            anonymous_read: self.anonymous_read.then_some(true),
            token_secret_file: self.token_secret_file,
            token_realm: self.token_realm,
            tls_cert: self.tls_cert,
            tls_key: self.tls_key,
            max_manifest_bytes: self.max_manifest_bytes,
            chunk_min_length: self.chunk_min_length,
            header_timeout: self.header_timeout,
            idle_timeout: self.idle_timeout,
            max_conns_per_client: self.max_conns_per_client,
            max_requests_per_client: self.max_requests_per_client,
            max_streams_per_conn: self.max_streams_per_conn,
            max_password_checks: self.max_password_checks,
            upload_ttl: self.upload_ttl,
            metrics_listen: self.metrics_listen,
            catalog_max_entries: self.catalog_max_entries,
            htpasswd_poll: self.htpasswd_poll,
            stats_interval: self.stats_interval,
            log_format: self.log_format,
            trusted_keys: (!self.trusted_key.is_empty()).then_some(self.trusted_key),
            gc: GcSection::default(),
            retention: Default::default(),
        }
    }
}

/// The server's log filter when neither SNAPCTL_LOG nor RUST_LOG sets one: warnings, and
/// one line per request.
pub const DEFAULT_LOG: &str = "warn,registry=info";

/// Flags over the configuration file over the registry's defaults, checked.
fn settings(args: ServeArgs) -> anyhow::Result<ServeSettings> {
    let file = FileConfig::load_opt(args.config.as_deref())?;
    let mut set = args.flags().over(file).serve_settings()?;
    set.server.build = registry::metrics::BuildInfo { version: env!("CARGO_PKG_VERSION").to_owned(), commit: env!("SNAPCTL_COMMIT").to_owned() };
    Ok(set)
}

/// Authentication from the files `set` names (`None`: an open registry).
fn load_auth(set: &ServeSettings) -> anyhow::Result<Option<registry::auth::Auth>> {
    let Some(h) = &set.htpasswd else { return Ok(None) };
    let users = std::fs::read_to_string(h).with_context(|| format!("reading {}", h.display()))?;
    let acl = match &set.acl {
        Some(p) => Some(std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?),
        None => None,
    };
    let secret = match &set.token_secret_file {
        Some(p) => std::fs::read(p).with_context(|| format!("reading {}", p.display()))?,
        None => registry::auth::random_secret(),
    };
    let mut a = registry::auth::Auth::new(&users, acl.as_deref(), set.anonymous_read, secret)
        .with_context(|| format!("loading authentication config ({})", h.display()))?;
    a.realm = set.token_realm.clone();
    if let Some(n) = set.max_password_checks {
        a.max_checks = usize::try_from(n).unwrap_or(usize::MAX);
    }
    Ok(Some(a))
}

pub fn run(mut args: ServeArgs) -> anyhow::Result<ExitCode> {
    if let Some(file) = args.check_config.take() {
        args.config = Some(file);
        return check_config(args);
    }
    let mut set = settings(args)?;
    set.server.auth = load_auth(&set)?;
    let store = registry::store::open(&set.storage, set.staging_dir.as_deref()).with_context(|| format!("opening storage {}", set.storage))?;
    let ServeSettings { storage, listen, tls, metrics_listen, server: cfg, htpasswd, .. } = set;

    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting tokio")?;
    rt.block_on(async move {
        let listener = std::net::TcpListener::bind(&listen).with_context(|| format!("listening on {listen}"))?;
        let addr = listener.local_addr()?;
        for w in cfg.exposure_warnings(addr) {
            tracing::warn!("{w}");
        }
        match &cfg.gc {
            Some(g) => {
                tracing::info!(interval = ?g.interval, grace = ?g.options.grace, policies = g.options.retention.config.policies.len(), "gc on a schedule")
            }
            None => tracing::info!("no scheduled gc (gc.interval = 0)"),
        }
        let server = registry::Server::new(store, cfg);
        if htpasswd.is_some() {
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
        let metrics = match &metrics_listen {
            Some(m) => {
                let l = tokio::net::TcpListener::bind(m).await.with_context(|| format!("listening on {m} for metrics"))?;
                eprintln!("snapctl serve: metrics on http://{}/metrics", l.local_addr()?);
                Some(tokio::spawn(server.clone().serve_metrics(l, stopped(stop_rx.clone()))))
            }
            None => None,
        };
        eprintln!("snapctl serve: listening on {}://{addr} (storage: {storage})", if tls.is_some() { "https" } else { "http" });
        match &tls {
            Some((cert, key)) => server.serve_tls(listener, cert, key, stopped(stop_rx)).await,
            None => {
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

/// `serve --check-config`: the settings `run` would start with, printed as configuration
/// keys, or the error that would stop it (the storage is not opened, no port is bound).
fn check_config(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let file = args.config.clone().unwrap_or_default();
    let set = settings(args).with_context(|| format!("checking {}", file.display()))?;
    load_auth(&set).with_context(|| format!("checking {}", file.display()))?;
    for line in effective(&set) {
        super::common::outln!("{line}")?;
    }
    eprintln!("snapctl serve: {} is good", file.display());
    Ok(ExitCode::SUCCESS)
}

/// `set` as `key = value` lines in the configuration file's names (TOML), secrets left out
/// (the token secret's file is named, never read out).
fn effective(set: &ServeSettings) -> Vec<String> {
    let q = |s: &str| format!("{s:?}");
    let path = |p: &Option<PathBuf>| p.as_ref().map(|p| q(&p.display().to_string()));
    let c = &set.server;
    let mut out: Vec<(&str, Option<String>)> = vec![
        ("storage", Some(q(&set.storage))),
        ("listen", Some(q(&set.listen))),
        ("staging_dir", path(&set.staging_dir)),
        ("htpasswd", path(&set.htpasswd)),
        ("acl", path(&set.acl)),
        ("anonymous_read", Some(set.anonymous_read.to_string())),
        ("token_secret_file", path(&set.token_secret_file)),
        ("token_realm", set.token_realm.as_deref().map(q)),
        ("max_password_checks", set.max_password_checks.map(|n| n.to_string())),
        ("tls_cert", set.tls.as_ref().map(|(c, _)| q(&c.display().to_string()))),
        ("tls_key", set.tls.as_ref().map(|(_, k)| q(&k.display().to_string()))),
        ("metrics_listen", set.metrics_listen.as_deref().map(q)),
        ("log_format", Some(q(if set.log_format == LogFormat::Json { "json" } else { "text" }))),
        ("max_manifest_bytes", Some(c.max_manifest_bytes.to_string())),
        ("chunk_min_length", Some(c.chunk_min_length.to_string())),
        ("header_timeout", Some(q(&duration(c.limits.header_read_timeout)))),
        ("idle_timeout", Some(q(&duration(c.limits.idle_timeout)))),
        ("max_conns_per_client", Some(c.limits.max_conns_per_client.to_string())),
        ("max_requests_per_client", Some(c.limits.max_requests_per_client.to_string())),
        ("max_streams_per_conn", Some(c.limits.max_streams_per_conn.to_string())),
        ("upload_ttl", Some(q(&duration(c.upload_ttl)))),
        ("catalog_max_entries", Some(c.catalog_max_entries.to_string())),
        ("htpasswd_poll", Some(q(&duration(c.htpasswd_poll)))),
        ("stats_interval", Some(q(&duration(c.stats_interval)))),
    ];
    out.retain(|(_, v)| v.is_some());
    let mut lines: Vec<String> = out.into_iter().map(|(k, v)| format!("{k} = {}", v.unwrap_or_default())).collect();
    lines.push(String::new());
    lines.push("[gc]".into());
    match &c.gc {
        Some(g) => {
            lines.push(format!("interval = {}", q(&duration(g.interval))));
            lines.push(format!("grace = {}", q(&duration(g.options.grace))));
            lines.push(format!("# retention: {} policies", g.options.retention.config.policies.len()));
        }
        None => lines.push("interval = \"0\"  # no scheduled gc".into()),
    }
    lines.push(format!("pull_flush = {}", q(&duration(c.pull_flush))));
    lines.push(format!("max_lease = {}", q(&duration(c.max_lease))));
    lines
}

/// `d` in the duration grammar the file is read with, in its largest whole unit.
fn duration(d: Duration) -> String {
    let (s, ms) = (d.as_secs(), d.subsec_millis());
    match (s, ms) {
        (0, 0) => "0s".into(),
        (s, 0) if s % 86_400 == 0 => format!("{}d", s / 86_400),
        (s, 0) if s % 3600 == 0 => format!("{}h", s / 3600),
        (s, 0) if s % 60 == 0 => format!("{}m", s / 60),
        (s, 0) => format!("{s}s"),
        _ => format!("{}ms", d.as_millis()),
    }
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
        // Neither flag given: serve and gc fall back to the configuration file, then to
        // the registry's constant.
        let a = Cli::parse_from(["serve"]);
        assert_eq!(a.serve.upload_ttl, None);
        assert!(registry::server::DEFAULT_UPLOAD_TTL <= std::time::Duration::from_secs(15 * 60));
        assert_eq!(registry::gc::GcOptions::default().upload_ttl, registry::server::DEFAULT_UPLOAD_TTL);
        assert_eq!(Gc::parse_from(["gc", "--storage", "x"]).gc.upload_ttl, None);
    }
}
