//! The small pieces every handler shares: building an answer (status, headers, the API
//! version header), reading a request (query parameters, digests, `Range`,
//! `Content-Range`, `Content-Length`, `Accept`, the client's address) and watching a body
//! stream (bytes counted, a stall ended).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode, Uri};
use axum::response::Response;
use bytes::Bytes;
use futures::StreamExt;
use imgfmt::OciDigest;

use super::listen;
use crate::error::{ApiError, Code};
use crate::metrics::Metrics;
use crate::store::BlobStore;

/// The `Docker-Distribution-API-Version` header every `/v2/` answer carries.
pub(super) const API_VERSION: (&str, &str) = ("docker-distribution-api-version", "registry/2.0");

/// Query parameters of a URI, decoded, repeated keys kept.
pub(super) fn query(uri: &Uri) -> Vec<(String, String)> {
    form_urlencoded::parse(uri.query().unwrap_or("").as_bytes()).into_owned().collect()
}

pub(super) fn param<'a>(q: &'a [(String, String)], k: &str) -> Option<&'a str> {
    q.iter().find(|(a, _)| a == k).map(|(_, v)| v.as_str())
}

pub(super) fn parse_digest(s: &str) -> Result<OciDigest, ApiError> {
    s.parse().map_err(|e| ApiError::bad(Code::DigestInvalid, format!("{e}")))
}

pub(super) fn hv(s: &str) -> HeaderValue {
    HeaderValue::from_str(s).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}

/// Build a response from status, headers and body.
pub(super) fn respond(status: StatusCode, headers: &[(HeaderName, String)], body: Body) -> Response {
    let mut r = Response::new(body);
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(HeaderName::from_static(API_VERSION.0), HeaderValue::from_static(API_VERSION.1));
    for (k, v) in headers {
        h.insert(k.clone(), hv(v));
    }
    r
}

pub(super) fn empty(status: StatusCode, headers: &[(HeaderName, String)]) -> Response {
    let mut all = headers.to_vec();
    if !all.iter().any(|(k, _)| k == header::CONTENT_LENGTH) {
        all.push((header::CONTENT_LENGTH, "0".into()));
    }
    respond(status, &all, Body::empty())
}

/// Whether the store has `key`.
pub(super) async fn exists(store: &dyn BlobStore, key: &str) -> Result<bool, ApiError> {
    match store.head(key).await {
        Ok(_) => Ok(true),
        Err(e) if e.is_not_found() => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// A `Range: bytes=...` request header resolved against `size`: `Ok(None)` = whole
/// object, `Err` = 416.
pub(super) fn parse_range(h: Option<&HeaderValue>, size: u64) -> Result<Option<std::ops::Range<u64>>, ApiError> {
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
pub(super) fn parse_content_range(h: Option<&HeaderValue>) -> Result<Option<(u64, u64)>, ApiError> {
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

pub(super) fn content_length(h: &HeaderMap) -> Option<u64> {
    h.get(header::CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

/// Whether the request's `Accept` allows media type `mt`. No `Accept` allows all.
pub(super) fn accepts(h: &HeaderMap, mt: &str) -> bool {
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
pub(super) type Client = Option<axum::Extension<listen::ClientAddr>>;

pub(super) fn client_ip(c: Client) -> Option<std::net::IpAddr> {
    c.map(|axum::Extension(listen::ClientAddr(ip))| ip)
}

/// Pass a byte stream through, adding its sizes to the request (`inbound`) or response
/// byte counter.
pub(super) fn count_bytes<E>(
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

/// Fail a request body that stalls: when no byte arrives for `idle`, the stream ends with
/// an error, the handler answers, and the connection can go (a body owed forever would
/// hold its connection and descriptor forever).
pub(super) fn stall_limited(
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
