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
        max_lease = "1h"
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
    let s = c.serve_settings().unwrap();
    assert_eq!(s.server.max_lease, Duration::from_secs(3600));
    assert_eq!(s.server.gc.as_ref().map(|g| g.options.grace), Some(Duration::from_secs(1800)));
    std::fs::write(&p, "storag = \"x\"\n").unwrap();
    let e = FileConfig::load(&p).unwrap_err();
    assert!(matches!(&e, ConfigError::Parse { source, .. } if source.to_string().contains("unknown field `storag`")), "{e}");
    std::fs::write(&p, "storage = \"s3://bucket/prefix\"\n").unwrap();
    assert_eq!(FileConfig::load(&p).unwrap().storage.as_deref(), Some("s3://bucket/prefix"));
}

/// A flag wins over the file, the file over the registry's own defaults.
#[test]
fn flags_over_the_file_over_the_defaults() {
    let file = FileConfig::parse("listen = \"0.0.0.0:1\"\nupload_ttl = \"1h\"\n[gc]\ngrace = \"5m\"\n").unwrap();
    let flags = FileConfig { listen: Some("127.0.0.1:2".into()), ..FileConfig::default() };
    let s = flags.over(file).serve_settings().unwrap();
    assert_eq!((s.listen.as_str(), s.storage.as_str()), ("127.0.0.1:2", DEFAULT_STORAGE));
    assert_eq!(s.server.upload_ttl, Duration::from_secs(3600));
    let d = crate::Config::default();
    assert_eq!((s.server.limits, s.server.htpasswd_poll, s.server.stats_interval), (d.limits, d.htpasswd_poll, d.stats_interval));
    let g = s.server.gc.expect("scheduled by default");
    assert_eq!((g.interval, g.options.grace), (crate::gc::DEFAULT_INTERVAL, Duration::from_secs(300)));
    assert!(matches!(FileConfig::default().gc_storage(), Err(ConfigError::NoStorage)));
    let e = FileConfig { acl: Some("acl".into()), ..FileConfig::default() }.serve_settings().unwrap_err();
    assert_eq!(e.to_string(), "--acl needs --htpasswd (or htpasswd in the configuration file)");
}

/// Issue 35: a huge duration in the file was taken as it was and panicked at run time: a
/// `[gc] interval` killed the gc task (no gc ever again), a `header_timeout` made every
/// connection panic. Each duration is checked at load, and the error names the key and
/// its bound.
#[test]
fn regression_issue_35_huge_durations_are_refused_at_load_naming_the_key_and_the_bound() {
    let huge = i64::MAX; // the largest TOML integer
    for (text, key, max) in [
        (format!("header_timeout = {huge}"), "header_timeout", "1h"),
        (format!("idle_timeout = {huge}"), "idle_timeout", "24h"),
        (format!("upload_ttl = {huge}"), "upload_ttl", "30d"),
        (format!("htpasswd_poll = {huge}"), "htpasswd_poll", "24h"),
        (format!("stats_interval = {huge}"), "stats_interval", "30d"),
        (format!("[gc]\ninterval = {huge}"), "[gc] interval", "365d"),
        ("[gc]\ninterval = \"100000000d\"".to_owned(), "[gc] interval", "365d"),
        (format!("[gc]\ngrace = {huge}"), "[gc] grace", "365d"),
        (format!("[gc]\npull_flush = {huge}"), "[gc] pull_flush", "24h"),
        ("[gc]\nmax_lease = \"2d\"".to_owned(), "[gc] max_lease", "24h"),
        (format!("[retention]\ndelay = {huge}"), "[retention] delay", "3650d"),
    ] {
        let e = FileConfig::parse(&text).unwrap().serve_settings().map(|_| ()).unwrap_err().to_string();
        assert!(e.contains(&format!("{key} = ")) && e.ends_with(&format!("longer than {max}, the most it may be")), "{text}: {e}");
    }
    let e = FileConfig::parse(&format!("[gc]\ngrace = {huge}")).unwrap().gc_options(false).unwrap_err().to_string();
    assert!(e.starts_with("[gc] grace = "), "{e}");
    // At the bound: accepted, and the schedule and listener arithmetic cannot overflow.
    let s = FileConfig::parse("header_timeout = \"1h\"\nidle_timeout = \"24h\"\n[gc]\ninterval = \"365d\"\n").unwrap().serve_settings().unwrap();
    assert_eq!(s.server.gc.unwrap().interval, Duration::from_secs(365 * 86_400));
}

#[test]
fn log_formats() {
    for n in LogFormat::NAMES {
        let f: LogFormat = n.parse().unwrap();
        assert_eq!(FileConfig::parse(&format!("log_format = \"{n}\"")).unwrap().log_format, Some(f));
    }
    assert!("xml".parse::<LogFormat>().is_err());
}
