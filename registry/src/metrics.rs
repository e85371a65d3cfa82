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

/// The methods counted under their own name; any other is counted as `other`.
pub const METHODS: [&str; 7] = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"];

/// The `method` label of a request method: its name if it is one of [`METHODS`], else
/// `other`. (Method names are client input of any length: 1,000 made-up ones grew the
/// process by 60 MB when each became a series, issue 14.)
pub fn method_label(method: &str) -> &'static str {
    METHODS.iter().find(|m| **m == method).copied().unwrap_or("other")
}

/// All counters of one server.
#[derive(Debug, Default)]
pub struct Metrics {
    /// (method label, status): at most 8 × 900 series, in practice a dozen.
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    errors: Mutex<BTreeMap<&'static str, u64>>,
    storage: Mutex<BTreeMap<&'static str, Hist>>,
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
        let s = took.as_secs_f64();
        let mut m = self.storage.lock().unwrap_or_else(|p| p.into_inner());
        let h = m.entry(op).or_default();
        for (i, b) in BUCKETS.iter().enumerate() {
            if s <= *b {
                h.counts[i] += 1;
            }
        }
        h.count += 1;
        h.sum += s;
        if failed {
            h.errors += 1;
        }
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
            for (i, b) in BUCKETS.iter().enumerate() {
                let _ = writeln!(o, "snapctl_storage_seconds_bucket{{op=\"{op}\",le=\"{b}\"}} {}", h.counts[i]);
            }
            let _ = writeln!(o, "snapctl_storage_seconds_bucket{{op=\"{op}\",le=\"+Inf\"}} {}", h.count);
            let _ = writeln!(o, "snapctl_storage_seconds_sum{{op=\"{op}\"}} {}", h.sum);
            let _ = writeln!(o, "snapctl_storage_seconds_count{{op=\"{op}\"}} {}", h.count);
        }
        o.push_str("# HELP snapctl_storage_errors_total Failed storage calls by operation (not-found excluded).\n");
        o.push_str("# TYPE snapctl_storage_errors_total counter\n");
        for (op, h) in &storage {
            let _ = writeln!(o, "snapctl_storage_errors_total{{op=\"{op}\"}} {}", h.errors);
        }
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
