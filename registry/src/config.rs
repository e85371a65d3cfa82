//! The configuration of `snapctl serve` and `snapctl gc`: the TOML file (`--config FILE`),
//! the flags over it, and the registry's own defaults under both, resolved and checked in
//! one place. Keys are every flag of `serve` in snake_case, `[gc]` (the schedule) and
//! `[retention]` ([`crate::retention`]); spec/registry.md §4.1 documents them.
//!
//! ```toml
//! storage = "/var/lib/snapctl"          # --storage
//! listen = "0.0.0.0:5000"               # --listen
//! upload_ttl = "24h"                    # --upload-ttl (every duration: "90s", "1h30m", or seconds)
//! [gc]
//! interval = "24h"                      # serve runs gc this long after the last run ended ("0": never)
//! grace = "1h"                          # gc --grace
//! pull_flush = "5m"                     # how often serve writes the pull times it recorded
//! max_lease = "24h"                     # the longest restore lease serve grants
//! [retention]
//! delay = "24h"
//! [[retention.policies]]
//! repositories = ["sandboxes/**"]
//! keep_tags = [{ patterns = ["latest", "v.*"], most_recently_pushed_count = 10 }]
//! ```
//!
//! ```text
//! flags ──► FileConfig ─┐
//!                       ├─ over() ──► serve_settings() / gc_settings() ──► checked values
//! file  ──► FileConfig ─┘              (defaults: the registry's constants; every duration
//!                                        within its bound, so none overflows at run time)
//! ```

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::gc::GcOptions;
use crate::retention::{Retention, RetentionConfig, RetentionError};
use crate::server::Limits;
use crate::units::{opt_duration, opt_size, Bound, TooLong};

/// Largest configuration file read.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// Where `serve` stores when nothing says.
pub const DEFAULT_STORAGE: &str = "./snapctl-registry";
/// Where `serve` listens when nothing says.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:5000";

const fn days(n: u64) -> Duration {
    Duration::from_secs(n * 86_400)
}

/// The bound of each duration key: long enough for any use, short enough that no timer or
/// clock arithmetic can overflow with it.
pub mod bounds {
    use super::*;

    /// `header_timeout`.
    pub const HEADER_TIMEOUT: Bound = Bound { key: "header_timeout", max: Duration::from_secs(3600), max_text: "1h" };
    /// `idle_timeout`.
    pub const IDLE_TIMEOUT: Bound = Bound { key: "idle_timeout", max: days(1), max_text: "24h" };
    /// `upload_ttl`.
    pub const UPLOAD_TTL: Bound = Bound { key: "upload_ttl", max: days(30), max_text: "30d" };
    /// `htpasswd_poll`.
    pub const HTPASSWD_POLL: Bound = Bound { key: "htpasswd_poll", max: days(1), max_text: "24h" };
    /// `stats_interval`.
    pub const STATS_INTERVAL: Bound = Bound { key: "stats_interval", max: days(30), max_text: "30d" };
    /// `[gc] interval`.
    pub const GC_INTERVAL: Bound = Bound { key: "[gc] interval", max: days(365), max_text: "365d" };
    /// `[gc] grace`.
    pub const GC_GRACE: Bound = Bound { key: "[gc] grace", max: days(365), max_text: "365d" };
    /// `[gc] pull_flush`.
    pub const PULL_FLUSH: Bound = Bound { key: "[gc] pull_flush", max: days(1), max_text: "24h" };
    /// `[gc] max_lease`: the protocol's own limit.
    pub const MAX_LEASE: Bound = Bound { key: "[gc] max_lease", max: crate::restore_lease::DEFAULT_MAX_LEASE, max_text: "24h" };
}

/// The file, as read (every key optional; each is its flag, spec/registry.md §4.1); also
/// what the flags set, for [`FileConfig::over`].
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub storage: Option<String>,
    pub listen: Option<String>,
    pub staging_dir: Option<PathBuf>,
    pub htpasswd: Option<PathBuf>,
    pub acl: Option<PathBuf>,
    pub anonymous_read: Option<bool>,
    pub token_secret_file: Option<PathBuf>,
    pub token_realm: Option<String>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    #[serde(default, deserialize_with = "opt_size")]
    pub max_manifest_bytes: Option<u64>,
    #[serde(default, deserialize_with = "opt_size")]
    pub chunk_min_length: Option<u64>,
    #[serde(default, deserialize_with = "opt_duration")]
    pub header_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "opt_duration")]
    pub idle_timeout: Option<Duration>,
    pub max_conns_per_client: Option<usize>,
    pub max_requests_per_client: Option<usize>,
    pub max_streams_per_conn: Option<u32>,
    pub max_password_checks: Option<u64>,
    #[serde(default, deserialize_with = "opt_duration")]
    pub upload_ttl: Option<Duration>,
    pub metrics_listen: Option<String>,
    pub catalog_max_entries: Option<usize>,
    #[serde(default, deserialize_with = "opt_duration")]
    pub htpasswd_poll: Option<Duration>,
    #[serde(default, deserialize_with = "opt_duration")]
    pub stats_interval: Option<Duration>,
    pub log_format: Option<LogFormat>,
    /// PEM public keys (cosign.pub) whose signatures the web view shows as verified.
    pub trusted_keys: Option<Vec<PathBuf>>,
    #[serde(default)]
    pub gc: GcSection,
    #[serde(default)]
    pub retention: RetentionConfig,
}

/// `serve --log-format` (`log_format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

impl LogFormat {
    /// Every value, as written.
    pub const NAMES: [&'static str; 2] = ["text", "json"];
}

impl std::str::FromStr for LogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<LogFormat, String> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            _ => Err(format!("log format {s:?}: expected text or json")),
        }
    }
}

/// `[gc]`.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GcSection {
    /// serve: run gc this long after the last run ended ("0": never).
    #[serde(default, deserialize_with = "opt_duration")]
    pub interval: Option<Duration>,
    /// gc's grace period (`gc --grace`).
    #[serde(default, deserialize_with = "opt_duration")]
    pub grace: Option<Duration>,
    /// serve: how often recorded pull times are written.
    #[serde(default, deserialize_with = "opt_duration")]
    pub pull_flush: Option<Duration>,
    /// serve: the longest restore lease granted (`Snapctl-Lease`; "0": none).
    #[serde(default, deserialize_with = "opt_duration")]
    pub max_lease: Option<Duration>,
}

/// A configuration that cannot be used.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum ConfigError {
    /// reading {path}
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// {path}: {size} bytes; a configuration file is at most 1 MiB
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        size: u64,
    },
    /// {path}: not a valid configuration
    Parse {
        /// The file.
        path: PathBuf,
        /// What the parser said (with the line).
        source: toml::de::Error,
    },
    /// [retention]: {0}
    Retention(#[from] RetentionError),
    /// {0}
    TooLong(#[from] TooLong),
    /// {0} must be more than 0
    Zero(&'static str),
    /// {0} must be at least 1
    NotPositive(&'static str),
    /// --{0} needs --htpasswd (or htpasswd in the configuration file)
    NeedsHtpasswd(&'static str),
    /// --tls-cert and --tls-key go together
    TlsHalf,
    /// --max-manifest-bytes {0}: too large for this machine
    ManifestLimit(u64),
    /// no storage: give --storage DIR|s3://BUCKET/PREFIX, or storage in --config
    NoStorage,
    /// trusted key {path}: {reason}
    TrustedKey {
        /// The file.
        path: PathBuf,
        /// Why it is not a key.
        reason: String,
    },
}

impl FileConfig {
    /// Read `path`. Relative paths in it are relative to the file's directory (a storage
    /// directory, htpasswd, ACL, TLS files, the token secret, the staging directory).
    pub fn load(path: &Path) -> Result<FileConfig, ConfigError> {
        let read = |source| ConfigError::Read { path: path.to_owned(), source };
        let meta = std::fs::metadata(path).map_err(read)?;
        if meta.len() > MAX_CONFIG_BYTES {
            return Err(ConfigError::TooLarge { path: path.to_owned(), size: meta.len() });
        }
        let text = std::fs::read_to_string(path).map_err(read)?;
        let mut c = FileConfig::parse(&text).map_err(|source| ConfigError::Parse { path: path.to_owned(), source })?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let keys = c.trusted_keys.iter_mut().flatten().map(Some);
        for p in [&mut c.staging_dir, &mut c.htpasswd, &mut c.acl, &mut c.token_secret_file, &mut c.tls_cert, &mut c.tls_key]
            .into_iter()
            .map(|p| p.as_mut())
            .chain(keys)
        {
            if let Some(x) = p.filter(|x| x.is_relative()) {
                *x = dir.join(&*x);
            }
        }
        if let Some(s) = c.storage.as_mut().filter(|s| !s.contains("://") && Path::new(s.as_str()).is_relative()) {
            *s = dir.join(&*s).to_string_lossy().into_owned();
        }
        Ok(c)
    }

    /// The file's text, as written (paths as they are).
    pub fn parse(text: &str) -> Result<FileConfig, toml::de::Error> {
        toml::from_str(text)
    }

    /// [`FileConfig::load`] of `path`, or an empty configuration.
    pub fn load_opt(path: Option<&Path>) -> Result<FileConfig, ConfigError> {
        path.map(FileConfig::load).transpose().map(Option::unwrap_or_default)
    }

    /// These values (the flags) over `file`'s, key by key.
    pub fn over(self, file: FileConfig) -> FileConfig {
        FileConfig {
            storage: self.storage.or(file.storage),
            listen: self.listen.or(file.listen),
            staging_dir: self.staging_dir.or(file.staging_dir),
            htpasswd: self.htpasswd.or(file.htpasswd),
            acl: self.acl.or(file.acl),
            anonymous_read: self.anonymous_read.or(file.anonymous_read),
            token_secret_file: self.token_secret_file.or(file.token_secret_file),
            token_realm: self.token_realm.or(file.token_realm),
            tls_cert: self.tls_cert.or(file.tls_cert),
            tls_key: self.tls_key.or(file.tls_key),
            max_manifest_bytes: self.max_manifest_bytes.or(file.max_manifest_bytes),
            chunk_min_length: self.chunk_min_length.or(file.chunk_min_length),
            header_timeout: self.header_timeout.or(file.header_timeout),
            idle_timeout: self.idle_timeout.or(file.idle_timeout),
            max_conns_per_client: self.max_conns_per_client.or(file.max_conns_per_client),
            max_requests_per_client: self.max_requests_per_client.or(file.max_requests_per_client),
            max_streams_per_conn: self.max_streams_per_conn.or(file.max_streams_per_conn),
            max_password_checks: self.max_password_checks.or(file.max_password_checks),
            upload_ttl: self.upload_ttl.or(file.upload_ttl),
            metrics_listen: self.metrics_listen.or(file.metrics_listen),
            catalog_max_entries: self.catalog_max_entries.or(file.catalog_max_entries),
            htpasswd_poll: self.htpasswd_poll.or(file.htpasswd_poll),
            stats_interval: self.stats_interval.or(file.stats_interval),
            log_format: self.log_format.or(file.log_format),
            trusted_keys: self.trusted_keys.or(file.trusted_keys),
            gc: GcSection {
                interval: self.gc.interval.or(file.gc.interval),
                grace: self.gc.grace.or(file.gc.grace),
                pull_flush: self.gc.pull_flush.or(file.gc.pull_flush),
                max_lease: self.gc.max_lease.or(file.gc.max_lease),
            },
            // Policies come from the file only.
            retention: file.retention,
        }
    }

    /// The retention policies, checked.
    pub fn retention(&self) -> Result<Retention, ConfigError> {
        Ok(Retention::new(self.retention.clone())?)
    }

    /// What `gc` (one run, or `serve`'s schedule) does, checked: grace, upload TTL,
    /// retention.
    pub fn gc_options(&self, dry_run: bool) -> Result<GcOptions, ConfigError> {
        bounds::GC_GRACE.check(self.gc.grace)?;
        bounds::UPLOAD_TTL.check(self.upload_ttl)?;
        Ok(GcOptions {
            grace: self.gc.grace.unwrap_or(crate::gc::DEFAULT_GRACE),
            upload_ttl: self.upload_ttl.unwrap_or(crate::upload::DEFAULT_UPLOAD_TTL),
            dry_run,
            retention: self.retention()?,
        })
    }

    /// The storage `gc` runs over (it has no default: gc of the wrong directory deletes).
    pub fn gc_storage(&self) -> Result<&str, ConfigError> {
        self.storage.as_deref().ok_or(ConfigError::NoStorage)
    }

    /// What `serve` runs with, checked; defaults are the registry's constants. Authentication
    /// is for the caller to build from the files named (`server.auth` is `None`).
    pub fn serve_settings(self) -> Result<ServeSettings, ConfigError> {
        let anonymous_read = self.anonymous_read.unwrap_or(false);
        if self.htpasswd.is_none() {
            for (set, what) in [
                (self.acl.is_some(), "acl"),
                (anonymous_read, "anonymous-read"),
                (self.token_secret_file.is_some(), "token-secret-file"),
                (self.token_realm.is_some(), "token-realm"),
                (self.max_password_checks.is_some(), "max-password-checks"),
            ] {
                if set {
                    return Err(ConfigError::NeedsHtpasswd(what));
                }
            }
        }
        let tls = match (self.tls_cert.clone(), self.tls_key.clone()) {
            (Some(c), Some(k)) => Some((c, k)),
            (None, None) => None,
            _ => return Err(ConfigError::TlsHalf),
        };
        if self.max_password_checks == Some(0) {
            return Err(ConfigError::NotPositive("max_password_checks"));
        }
        let server = self.server_config(tls.is_some())?;
        Ok(ServeSettings {
            storage: self.storage.unwrap_or_else(|| DEFAULT_STORAGE.into()),
            listen: self.listen.unwrap_or_else(|| DEFAULT_LISTEN.into()),
            staging_dir: self.staging_dir,
            htpasswd: self.htpasswd,
            acl: self.acl,
            anonymous_read,
            token_secret_file: self.token_secret_file,
            token_realm: self.token_realm,
            max_password_checks: self.max_password_checks,
            tls,
            metrics_listen: self.metrics_listen,
            log_format: self.log_format.unwrap_or(LogFormat::Text),
            server,
        })
    }

    /// The server's [`crate::Config`] (no auth yet), every duration within its bound.
    fn server_config(&self, tls: bool) -> Result<crate::Config, ConfigError> {
        use bounds::*;
        for (b, v) in [
            (HEADER_TIMEOUT, self.header_timeout),
            (IDLE_TIMEOUT, self.idle_timeout),
            (HTPASSWD_POLL, self.htpasswd_poll),
            (STATS_INTERVAL, self.stats_interval),
            (GC_INTERVAL, self.gc.interval),
            (PULL_FLUSH, self.gc.pull_flush),
            (MAX_LEASE, self.gc.max_lease),
        ] {
            b.check(v)?;
        }
        let d = crate::Config::default();
        let limits = Limits {
            header_read_timeout: self.header_timeout.unwrap_or(d.limits.header_read_timeout),
            idle_timeout: self.idle_timeout.unwrap_or(d.limits.idle_timeout),
            max_conns_per_client: self.max_conns_per_client.unwrap_or(d.limits.max_conns_per_client),
            max_requests_per_client: self.max_requests_per_client.unwrap_or(d.limits.max_requests_per_client),
            max_streams_per_conn: self.max_streams_per_conn.unwrap_or(d.limits.max_streams_per_conn),
        };
        if limits.max_streams_per_conn == 0 {
            return Err(ConfigError::NotPositive("max_streams_per_conn"));
        }
        for (what, t) in [("header_timeout", limits.header_read_timeout), ("idle_timeout", limits.idle_timeout)] {
            if t.is_zero() {
                return Err(ConfigError::Zero(what));
            }
        }
        let max_manifest = self.max_manifest_bytes.unwrap_or(d.max_manifest_bytes as u64);
        let options = self.gc_options(false)?;
        let interval = self.gc.interval.unwrap_or(crate::gc::DEFAULT_INTERVAL);
        Ok(crate::Config {
            max_manifest_bytes: usize::try_from(max_manifest).map_err(|_| ConfigError::ManifestLimit(max_manifest))?,
            auth: None,
            tls,
            chunk_min_length: self.chunk_min_length.unwrap_or(d.chunk_min_length),
            limits,
            upload_ttl: options.upload_ttl,
            api_metrics: self.metrics_listen.is_none(),
            pull_flush: self.gc.pull_flush.unwrap_or(d.pull_flush),
            gc: (!interval.is_zero()).then_some(crate::gc::Schedule { interval, options }),
            catalog_max_entries: self.catalog_max_entries.unwrap_or(d.catalog_max_entries),
            htpasswd_file: self.htpasswd.clone(),
            htpasswd_poll: self.htpasswd_poll.unwrap_or(d.htpasswd_poll),
            stats_interval: self.stats_interval.unwrap_or(d.stats_interval),
            build: d.build,
            max_lease: self.gc.max_lease.unwrap_or(d.max_lease),
            trusted_keys: self.trusted_keys()?,
        })
    }

    /// The keys of `trusted_keys`, read and parsed.
    fn trusted_keys(&self) -> Result<Vec<sign::PublicKey>, ConfigError> {
        let bad = |path: &PathBuf, reason: String| ConfigError::TrustedKey { path: path.clone(), reason };
        self.trusted_keys
            .iter()
            .flatten()
            .map(|p| {
                let text = std::fs::read(p).map_err(|e| bad(p, e.to_string()))?;
                sign::PublicKey::from_pem(&text).map_err(|e| bad(p, e.to_string()))
            })
            .collect()
    }
}

/// What `serve` runs with: flags, else the configuration file, else the defaults.
#[derive(Debug)]
pub struct ServeSettings {
    pub storage: String,
    pub listen: String,
    pub staging_dir: Option<PathBuf>,
    pub htpasswd: Option<PathBuf>,
    pub acl: Option<PathBuf>,
    pub anonymous_read: bool,
    pub token_secret_file: Option<PathBuf>,
    pub token_realm: Option<String>,
    pub max_password_checks: Option<u64>,
    /// (certificate chain, key).
    pub tls: Option<(PathBuf, PathBuf)>,
    pub metrics_listen: Option<String>,
    pub log_format: LogFormat,
    /// The server's configuration; `auth` is `None` until the caller builds it.
    pub server: crate::Config,
}

#[cfg(test)]
mod tests;
