//! Prometheus text metrics, kept in atomics and small maps (no metrics framework).
//!
//! Exposed at `GET /metrics` (or on its own listener, `--metrics-listen`). Every label
//! takes values from a fixed set, whatever a client sends: a hostile client must not be
//! able to grow this process's memory or the scrape by inventing methods, paths or codes.
//! - `snapctl_http_requests_total{method,status}` counter (`method` is one of
//!   [`METHODS`] or `other`; `status` a three-digit code the server sent)
//! - `snapctl_http_request_bytes_total`, `snapctl_http_response_bytes_total` counters
//! - `snapctl_http_errors_total{code}` counter of OCI error responses
//! - `snapctl_uploads_started_total`, `snapctl_uploads_completed_total`,
//!   `snapctl_uploads_cancelled_total` counters; `snapctl_uploads_in_progress` gauge (this process)
//! - `snapctl_uploads_expired_total` counter: sessions removed by the server's idle sweep
//! - `snapctl_storage_seconds{op}` histogram, `snapctl_storage_errors_total{op}` counter
//! - `snapctl_http_connections` gauge; `snapctl_http_connections_refused_total` (over the
//!   per-address cap) and `snapctl_http_connections_timed_out_total` counters
//! - `snapctl_http_responses_open` gauge (requests in progress: handler or body);
//!   `snapctl_http_requests_refused_total` (429: over the per-client request cap) and
//!   `snapctl_http_responses_stalled_total` (connections closed because a response body
//!   did not move) counters
//! - with authentication: `snapctl_auth_password_checks_total`,
//!   `snapctl_auth_cache_hits_total`, `snapctl_auth_refused_total{reason}` (`backoff` or
//!   `busy`) counters
//! - `snapctl_http_request_duration_seconds{route,method}` histogram: time to the response
//!   head, by route class ([`ROUTES`]) and method label
//! - `snapctl_build_info{version,commit}` gauge, always 1
//! - `snapctl_store_*` gauges from the last store scan (rendered by `crate::stats::Totals`)

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

/// Histogram bucket upper bounds, seconds.
const BUCKETS: [f64; 10] = [0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0];

#[derive(Debug, Default, Clone)]
struct Hist {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
    errors: u64,
}

impl Hist {
    fn observe(&mut self, took: Duration, failed: bool) {
        let s = took.as_secs_f64();
        for (i, b) in BUCKETS.iter().enumerate() {
            if s <= *b {
                self.counts[i] += 1;
            }
        }
        self.count += 1;
        self.sum += s;
        if failed {
            self.errors += 1;
        }
    }

    /// The histogram's lines for one label set (`labels` ends with a comma, or is empty).
    fn render(&self, o: &mut String, name: &str, labels: &str) {
        for (i, b) in BUCKETS.iter().enumerate() {
            let _ = writeln!(o, "{name}_bucket{{{labels}le=\"{b}\"}} {}", self.counts[i]);
        }
        let _ = writeln!(o, "{name}_bucket{{{labels}le=\"+Inf\"}} {}", self.count);
        let plain = labels.trim_end_matches(',');
        let _ = writeln!(o, "{name}_sum{{{plain}}} {}", self.sum);
        let _ = writeln!(o, "{name}_count{{{plain}}} {}", self.count);
    }
}

/// The methods counted under their own name; any other is counted as `other`.
pub const METHODS: [&str; 7] = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"];

/// The `method` label of a request method: its name if it is one of [`METHODS`], else
/// `other`. (Method names are client input of any length: a series each would let a
/// client grow the process without bound.)
pub fn method_label(method: &str) -> &'static str {
    METHODS.iter().find(|m| **m == method).copied().unwrap_or("other")
}

/// The route classes requests are timed by.
pub const ROUTES: [&str; 11] = ["base", "catalog", "blob", "upload", "manifest", "tags", "referrers", "token", "metrics", "web", "other"];

/// Version and commit of the running binary (`snapctl_build_info`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildInfo {
    /// Package version.
    pub version: String,
    /// Source commit, or `unknown`.
    pub commit: String,
}

impl Default for BuildInfo {
    fn default() -> BuildInfo {
        BuildInfo { version: env!("CARGO_PKG_VERSION").to_owned(), commit: "unknown".to_owned() }
    }
}

/// A Prometheus label value, escaped.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// All counters of one server.
#[derive(Debug, Default)]
pub struct Metrics {
    /// (method label, status): at most 8 × 900 series, in practice a dozen.
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    errors: Mutex<BTreeMap<&'static str, u64>>,
    storage: Mutex<BTreeMap<&'static str, Hist>>,
    /// (route class, method label): at most 11 × 8 series.
    latency: Mutex<BTreeMap<(&'static str, &'static str), Hist>>,
    build: std::sync::OnceLock<BuildInfo>,
    /// Request body bytes received.
    pub bytes_in: AtomicU64,
    /// Response body bytes sent.
    pub bytes_out: AtomicU64,
    /// Upload sessions started.
    pub uploads_started: AtomicU64,
    /// Upload sessions that produced a blob.
    pub uploads_completed: AtomicU64,
    /// Upload sessions cancelled or failed digest checks.
    pub uploads_cancelled: AtomicU64,
    /// Sessions started here and not finished yet (kept by [`crate::upload::Uploads`]).
    pub uploads_in_progress: AtomicI64,
    /// Sessions removed by the server's idle sweep.
    pub uploads_expired: AtomicU64,
    /// Connections open now.
    pub connections: AtomicI64,
    /// Connections closed at once because their address had too many open.
    pub connections_refused: AtomicU64,
    /// Connections closed because a request head, a request body or the connection
    /// itself stalled past its timeout.
    pub connections_timed_out: AtomicU64,
    /// Requests in progress now (a handler running or a response body not finished).
    pub responses_open: AtomicI64,
    /// Requests answered 429 at once: their client had too many in progress.
    pub requests_refused: AtomicU64,
    /// Connections closed because one of their response bodies had not moved for the idle
    /// timeout (also counted in `connections_timed_out`).
    pub responses_stalled: AtomicU64,
}

impl Metrics {
    /// Count one request (`method` is reduced to [`method_label`]).
    pub fn request(&self, method: &str, status: u16) {
        // StatusCode is always 100..=999; the server only sends codes it chose.
        *self.requests.lock().unwrap_or_else(|p| p.into_inner()).entry((method_label(method), status)).or_default() += 1;
    }

    /// Count one OCI error response.
    pub fn error(&self, code: &'static str) {
        *self.errors.lock().unwrap_or_else(|p| p.into_inner()).entry(code).or_default() += 1;
    }

    /// Record one storage call.
    pub fn storage_op(&self, op: &'static str, took: Duration, failed: bool) {
        self.storage.lock().unwrap_or_else(|p| p.into_inner()).entry(op).or_default().observe(took, failed);
    }

    /// Record how long a request took to its response head (`route`: its class, one of
    /// [`ROUTES`]; `method` reduced to its [`method_label`]).
    pub fn request_latency(&self, route: &'static str, method: &str, took: Duration) {
        let key = (route, method_label(method));
        self.latency.lock().unwrap_or_else(|p| p.into_inner()).entry(key).or_default().observe(took, false);
    }

    /// Name the running binary (`snapctl_build_info`); the first call wins.
    pub fn set_build(&self, b: BuildInfo) {
        let _ = self.build.set(b);
    }

    /// Render in Prometheus text exposition format 0.0.4.
    pub fn render(&self) -> String {
        let mut o = String::new();
        o.push_str("# HELP snapctl_http_requests_total HTTP requests by method and status.\n");
        o.push_str("# TYPE snapctl_http_requests_total counter\n");
        for ((m, s), n) in self.requests.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let _ = writeln!(o, "snapctl_http_requests_total{{method=\"{m}\",status=\"{s}\"}} {n}");
        }
        o.push_str("# HELP snapctl_http_errors_total OCI error responses by code.\n");
        o.push_str("# TYPE snapctl_http_errors_total counter\n");
        for (c, n) in self.errors.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let _ = writeln!(o, "snapctl_http_errors_total{{code=\"{c}\"}} {n}");
        }
        let counters = [
            ("snapctl_http_request_bytes_total", "Request body bytes received.", self.bytes_in.load(Relaxed)),
            ("snapctl_http_response_bytes_total", "Response body bytes sent.", self.bytes_out.load(Relaxed)),
            ("snapctl_uploads_started_total", "Blob upload sessions started.", self.uploads_started.load(Relaxed)),
            ("snapctl_uploads_completed_total", "Blob upload sessions completed.", self.uploads_completed.load(Relaxed)),
            ("snapctl_uploads_cancelled_total", "Blob upload sessions cancelled or refused.", self.uploads_cancelled.load(Relaxed)),
            ("snapctl_uploads_expired_total", "Idle blob upload sessions removed by the server.", self.uploads_expired.load(Relaxed)),
            ("snapctl_http_connections_refused_total", "Connections closed at once: their address had too many open.", self.connections_refused.load(Relaxed)),
            (
                "snapctl_http_connections_timed_out_total",
                "Connections closed because a request head, a body or the connection stalled.",
                self.connections_timed_out.load(Relaxed),
            ),
            (
                "snapctl_http_requests_refused_total",
                "Requests answered 429 at once: their client had too many in progress.",
                self.requests_refused.load(Relaxed),
            ),
            (
                "snapctl_http_responses_stalled_total",
                "Connections closed because a response body had not moved for the idle timeout.",
                self.responses_stalled.load(Relaxed),
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        }
        let _ = writeln!(
            o,
            "# HELP snapctl_uploads_in_progress Upload sessions started by this process and not finished.\n# TYPE snapctl_uploads_in_progress gauge\nsnapctl_uploads_in_progress {}",
            self.uploads_in_progress.load(Relaxed)
        );
        let _ = writeln!(
            o,
            "# HELP snapctl_http_connections Open client connections.\n# TYPE snapctl_http_connections gauge\nsnapctl_http_connections {}",
            self.connections.load(Relaxed)
        );
        let _ = writeln!(
            o,
            "# HELP snapctl_http_responses_open Requests in progress (handler running or response body not finished).\n# TYPE snapctl_http_responses_open gauge\nsnapctl_http_responses_open {}",
            self.responses_open.load(Relaxed)
        );
        o.push_str("# HELP snapctl_storage_seconds Latency of storage calls by operation.\n");
        o.push_str("# TYPE snapctl_storage_seconds histogram\n");
        let storage = self.storage.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for (op, h) in &storage {
            h.render(&mut o, "snapctl_storage_seconds", &format!("op=\"{op}\","));
        }
        o.push_str("# HELP snapctl_storage_errors_total Failed storage calls by operation (not-found excluded).\n");
        o.push_str("# TYPE snapctl_storage_errors_total counter\n");
        for (op, h) in &storage {
            let _ = writeln!(o, "snapctl_storage_errors_total{{op=\"{op}\"}} {}", h.errors);
        }
        o.push_str("# HELP snapctl_http_request_duration_seconds Time from a request to its response head, by route class and method.\n");
        o.push_str("# TYPE snapctl_http_request_duration_seconds histogram\n");
        for ((route, method), h) in self.latency.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            h.render(&mut o, "snapctl_http_request_duration_seconds", &format!("route=\"{route}\",method=\"{method}\","));
        }
        let b = self.build.get().cloned().unwrap_or_default();
        let _ = writeln!(
            o,
            "# HELP snapctl_build_info The running snapctl: version and source commit.\n# TYPE snapctl_build_info gauge\nsnapctl_build_info{{version=\"{}\",commit=\"{}\"}} 1",
            label(&b.version),
            label(&b.commit)
        );
        o
    }
}

/// The password-checking counters (with authentication on).
pub fn render_auth(a: &crate::auth::AuthStats) -> String {
    let mut o = String::new();
    let counters = [
        ("snapctl_auth_password_checks_total", "bcrypt verifications run.", a.password_checks),
        ("snapctl_auth_cache_hits_total", "Basic credentials taken from the verified cache, without bcrypt.", a.cache_hits),
    ];
    for (name, help, v) in counters {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
    }
    let name = "snapctl_auth_refused_total";
    let _ = writeln!(o, "# HELP {name} Requests with Basic credentials refused without a check (client backing off, or every check slot busy).");
    let _ = writeln!(o, "# TYPE {name} counter\n{name}{{reason=\"backoff\"}} {}\n{name}{{reason=\"busy\"}} {}", a.refused_backoff, a.refused_busy);
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics::default();
        m.request("GET", 200);
        m.request("GET", 200);
        m.error("BLOB_UNKNOWN");
        m.storage_op("get", Duration::from_millis(2), false);
        m.bytes_out.fetch_add(42, Relaxed);
        let t = m.render();
        assert!(t.contains("snapctl_http_requests_total{method=\"GET\",status=\"200\"} 2\n"), "{t}");
        assert!(t.contains("snapctl_http_errors_total{code=\"BLOB_UNKNOWN\"} 1\n"));
        assert!(t.contains("snapctl_storage_seconds_bucket{op=\"get\",le=\"0.001\"} 0\n"));
        assert!(t.contains("snapctl_storage_seconds_bucket{op=\"get\",le=\"0.005\"} 1\n"));
        assert!(t.contains("snapctl_http_response_bytes_total 42\n"));
    }

    #[test]
    fn regression_issue_25_request_latency_by_route_class_and_build_info() {
        let m = Metrics::default();
        m.set_build(BuildInfo { version: "1.2.3".into(), commit: "abc\"d".into() });
        m.request_latency("blob", "GET", Duration::from_millis(3));
        m.request_latency("blob", "GET", Duration::from_millis(300));
        m.request_latency("upload", "POST", Duration::from_millis(1));
        let t = m.render();
        assert!(t.contains("# TYPE snapctl_http_request_duration_seconds histogram\n"), "{t}");
        assert!(t.contains("snapctl_http_request_duration_seconds_bucket{route=\"blob\",method=\"GET\",le=\"0.005\"} 1\n"), "{t}");
        assert!(t.contains("snapctl_http_request_duration_seconds_bucket{route=\"blob\",method=\"GET\",le=\"+Inf\"} 2\n"), "{t}");
        assert!(t.contains("snapctl_http_request_duration_seconds_count{route=\"blob\",method=\"GET\"} 2\n"), "{t}");
        assert!(t.contains("snapctl_http_request_duration_seconds_count{route=\"upload\",method=\"POST\"} 1\n"), "{t}");
        assert!(t.contains("snapctl_build_info{version=\"1.2.3\",commit=\"abc\\\"d\"} 1\n"), "{t}");
    }

    #[test]
    fn regression_issue_14_made_up_methods_share_one_series() {
        let m = Metrics::default();
        m.request("GET", 200);
        let before = m.render().len();
        for i in 0..1000 {
            m.request(&format!("M{i}{}", "X".repeat(4000)), 400);
        }
        let t = m.render();
        assert!(t.contains("snapctl_http_requests_total{method=\"other\",status=\"400\"} 1000\n"), "{t}");
        assert!(t.len() < before + 200, "metrics grew from {before} to {} bytes", t.len());
        assert_eq!(method_label("PATCH"), "PATCH");
        assert_eq!(method_label("get"), "other", "methods are case-sensitive");
    }
}
