//! The configuration file of `serve` and `gc` (`--config FILE`, TOML): every flag of
//! `serve` by its name in snake_case, the gc schedule (`[gc]`) and retention policies
//! (`[retention]`, `registry::retention`). A flag given on the command line wins over the
//! file; the file wins over the default. Keys are documented in spec/registry.md §4.1.
//!
//! ```toml
//! storage = "/var/lib/snapctl"          # --storage
//! listen = "0.0.0.0:5000"               # --listen
//! upload_ttl = "24h"                    # --upload-ttl (every duration flag: "90s", "1h30m", or seconds)
//! [gc]
//! interval = "24h"                      # serve runs gc this long after the last run ended ("0": never)
//! grace = "1h"                          # gc --grace
//! pull_flush = "5m"                     # how often serve writes the pull times it recorded
//! [retention]
//! delay = "24h"
//! [[retention.policies]]
//! repositories = ["sandboxes/**"]
//! keep_tags = [{ patterns = ["latest", "v.*"], most_recently_pushed_count = 10 }]
//! ```

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use registry::retention::RetentionConfig;
use serde::{Deserialize, Deserializer};

/// Largest configuration file read.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// The file, as read (every key optional).
#[derive(Debug, Default, Deserialize)]
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
    #[serde(default)]
    pub gc: GcSection,
    #[serde(default)]
    pub retention: RetentionConfig,
}

/// `serve --log-format` (`log_format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// `[gc]`.
#[derive(Debug, Default, Deserialize)]
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
    /// serve: the longest restore lease granted (`Snapctl-Lease`).
    #[serde(default, deserialize_with = "opt_duration")]
    pub max_lease: Option<Duration>,
}

/// serve's gc schedule when the file sets none.
pub const DEFAULT_GC_INTERVAL: Duration = Duration::from_secs(24 * 3600);
/// gc's grace period when neither `--grace` nor the file sets one.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(3600);

#[derive(Deserialize)]
#[serde(untagged)]
enum Raw {
    Number(u64),
    Text(String),
}

fn opt_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    match Option::<Raw>::deserialize(d)? {
        None => Ok(None),
        Some(Raw::Number(s)) => Ok(Some(Duration::from_secs(s))),
        Some(Raw::Text(t)) => imgfmt::size::parse_duration(&t).map(Some).map_err(serde::de::Error::custom),
    }
}

fn opt_size<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    match Option::<Raw>::deserialize(d)? {
        None => Ok(None),
        Some(Raw::Number(n)) => Ok(Some(n)),
        Some(Raw::Text(t)) => imgfmt::size::parse_size(&t).map(Some).map_err(serde::de::Error::custom),
    }
}

impl FileConfig {
    /// Read `path`. Relative paths in it are relative to the file's directory (a storage
    /// directory, htpasswd, ACL, TLS files, the token secret, the staging directory).
    pub fn load(path: &Path) -> anyhow::Result<FileConfig> {
        let meta = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
        if meta.len() > MAX_CONFIG_BYTES {
            anyhow::bail!("{}: {} bytes; a configuration file is at most {MAX_CONFIG_BYTES}", path.display(), meta.len());
        }
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut c = FileConfig::parse(&text).with_context(|| format!("{}: not a valid configuration", path.display()))?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let abs = |p: &mut Option<PathBuf>| {
            if let Some(x) = p.as_mut().filter(|x| x.is_relative()) {
                *x = dir.join(&*x);
            }
        };
        for p in [&mut c.staging_dir, &mut c.htpasswd, &mut c.acl, &mut c.token_secret_file, &mut c.tls_cert, &mut c.tls_key] {
            abs(p);
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
    pub fn load_opt(path: Option<&Path>) -> anyhow::Result<FileConfig> {
        path.map(FileConfig::load).transpose().map(Option::unwrap_or_default)
    }

    /// The retention policies, checked.
    pub fn retention(&self) -> anyhow::Result<registry::retention::Retention> {
        registry::retention::Retention::new(self.retention.clone()).context("[retention]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_parses_and_relative_paths_follow_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("snapctl.toml");
        std::fs::write(
            &p,
            r#"
            storage = "store"
            listen = "127.0.0.1:5001"
            staging_dir = "/var/tmp/st"
            htpasswd = "users"
            acl = "acl.toml"
            anonymous_read = true
            token_secret_file = "secret"
            token_realm = "https://auth.example/token"
            tls_cert = "c.pem"
            tls_key = "k.pem"
            max_manifest_bytes = "8MiB"
            chunk_min_length = 1048576
            header_timeout = "10s"
            idle_timeout = 60
            max_conns_per_client = 8
            max_requests_per_client = 16
            max_streams_per_conn = 10
            max_password_checks = 2
            catalog_max_entries = 50
            htpasswd_poll = "5s"
            stats_interval = 0
            log_format = "json"
            upload_ttl = "2h"
            metrics_listen = "127.0.0.1:9100"
            [gc]
            interval = "6h"
            grace = "30m"
            pull_flush = "1m"
            [retention]
            dry_run = true
            [[retention.policies]]
            repositories = ["a/**"]
            "#,
        )
        .unwrap();
        let c = FileConfig::load(&p).unwrap();
        assert_eq!(c.storage.as_deref(), Some(dir.path().join("store").to_str().unwrap()));
        assert_eq!(c.htpasswd, Some(dir.path().join("users")));
        assert_eq!(c.staging_dir, Some(PathBuf::from("/var/tmp/st")), "absolute paths stay");
        assert_eq!(c.max_manifest_bytes, Some(8 << 20));
        assert_eq!(c.chunk_min_length, Some(1 << 20));
        assert_eq!(c.idle_timeout, Some(Duration::from_secs(60)));
        assert_eq!(c.stats_interval, Some(Duration::ZERO));
        assert_eq!(c.log_format, Some(LogFormat::Json));
        assert_eq!(c.gc.interval, Some(Duration::from_secs(6 * 3600)));
        assert_eq!(c.gc.pull_flush, Some(Duration::from_secs(60)));
        assert!(c.retention.dry_run);
        c.retention().unwrap();
        std::fs::write(&p, "storag = \"x\"\n").unwrap();
        let e = format!("{:#}", FileConfig::load(&p).unwrap_err());
        assert!(e.contains("unknown field `storag`"), "{e}");
        std::fs::write(&p, "storage = \"s3://bucket/prefix\"\n").unwrap();
        assert_eq!(FileConfig::load(&p).unwrap().storage.as_deref(), Some("s3://bucket/prefix"));
    }
}
