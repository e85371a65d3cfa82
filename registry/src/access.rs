//! The request log: one line per request, written when its response body has been sent
//! (or dropped), so it can say how many bytes went each way.
//!
//! Fields: `client` (address:port), `user` (who authenticated; `-` for nobody), `method`,
//! `path` (cut to 512 bytes), `status`, `bytes_in` and `bytes_out` (body bytes),
//! `ms` (from the request to the end of its response body), `user_agent` (cut to 256
//! bytes), and for a 5xx, `error`: its cause. Method, path and user agent are client input,
//! bounded before they are logged, and every control character (C0, DEL, C1) in a field is
//! written as its escape (`\u{85}`): a JSON writer escapes only C0, and a raw NEL or CSI
//! would end or recolour a line in a log viewer. `serve --log-format json` writes each line as one JSON
//! object (the CLI's subscriber; this module only emits `tracing` events).
//!
//! Who authenticated and why a request failed are known deep in the handler; it notes them
//! ([`note_user`], [`note_error`]) in a task-local the middleware reads at the end.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Body;
use axum::extract::{ConnectInfo, Request};
use axum::http::header;
use axum::response::Response;
use bytes::Bytes;
use http_body::{Frame, SizeHint};

/// What the handler learnt about a request, for its log line.
#[derive(Debug, Default)]
struct Notes {
    user: Option<String>,
    error: Option<String>,
}

tokio::task_local! {
    static NOTES: Arc<Mutex<Notes>>;
}

/// Record who the request authenticated as (no-op outside a logged request).
pub(crate) fn note_user(user: &str) {
    let _ = NOTES.try_with(|n| n.lock().unwrap_or_else(|p| p.into_inner()).user = Some(clip(user, 256)));
}

/// Record why a request failed on the server's side.
pub(crate) fn note_error(cause: &str) {
    let _ = NOTES.try_with(|n| n.lock().unwrap_or_else(|p| p.into_inner()).error = Some(clip(cause, 1024)));
}

/// At most `n` bytes of `s` (cut at a character boundary), control characters escaped.
pub(crate) fn clip(s: &str, n: usize) -> String {
    let mut end = s.len().min(n);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    escape_controls(&s[..end])
}

/// `s` with each control character (C0, DEL, C1) written as its Rust escape.
fn escape_controls(s: &str) -> String {
    s.chars().fold(String::with_capacity(s.len()), |mut out, c| {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
        out
    })
}

/// A body that counts the bytes of its data frames.
struct Counting<B> {
    inner: B,
    bytes: Arc<AtomicU64>,
}

impl<B: http_body::Body<Data = Bytes> + Unpin> http_body::Body for Counting<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(f))) = &r {
            if let Some(d) = f.data_ref() {
                self.bytes.fetch_add(d.len() as u64, Relaxed);
            }
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A request's log line, written when dropped (with the response body).
struct Line {
    start: Instant,
    client: String,
    method: String,
    path: String,
    user_agent: String,
    status: u16,
    notes: Arc<Mutex<Notes>>,
    bytes_in: Arc<AtomicU64>,
    bytes_out: Arc<AtomicU64>,
}

impl Drop for Line {
    fn drop(&mut self) {
        let notes = self.notes.lock().unwrap_or_else(|p| p.into_inner());
        let user = notes.user.as_deref().unwrap_or("-");
        let (bytes_in, bytes_out) = (self.bytes_in.load(Relaxed), self.bytes_out.load(Relaxed));
        let ms = self.start.elapsed().as_millis() as u64;
        let (client, method, path, ua, status) = (&self.client, &self.method, &self.path, &self.user_agent, self.status);
        match &notes.error {
            Some(error) if status >= 500 => {
                tracing::error!(client, user, method, path, status, bytes_in, bytes_out, ms, user_agent = ua, error, "request")
            }
            _ => tracing::info!(client, user, method, path, status, bytes_in, bytes_out, ms, user_agent = ua, "request"),
        }
    }
}

/// The response body, carrying its log line.
struct Logged {
    body: Counting<Body>,
    _line: Line,
}

impl http_body::Body for Logged {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// Run `next` on `req` and arrange for its log line.
pub(crate) async fn logged<F, Fut>(req: Request, next: F) -> Response
where
    F: FnOnce(Request) -> Fut,
    Fut: std::future::Future<Output = Response>,
{
    let start = Instant::now();
    let client = req.extensions().get::<ConnectInfo<SocketAddr>>().map(|c| c.0.to_string()).unwrap_or_else(|| "-".to_owned());
    let method = clip(req.method().as_str(), 16);
    let path = clip(req.uri().path(), 512);
    let user_agent = req.headers().get(header::USER_AGENT).map(|v| clip(&String::from_utf8_lossy(v.as_bytes()), 256)).unwrap_or_default();
    let (bytes_in, bytes_out) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let (parts, body) = req.into_parts();
    let req = Request::from_parts(parts, Body::new(Counting { inner: body, bytes: bytes_in.clone() }));
    let notes = Arc::new(Mutex::new(Notes::default()));
    let resp = NOTES.scope(notes.clone(), next(req)).await;
    let status = resp.status().as_u16();
    let line = Line { start, client, method, path, user_agent, status, notes, bytes_in, bytes_out: bytes_out.clone() };
    let (parts, body) = resp.into_parts();
    Response::from_parts(parts, Body::new(Logged { body: Counting { inner: body, bytes: bytes_out }, _line: line }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 35: the JSON request log wrote C1 control characters of a User-Agent raw
    /// (serde_json escapes only C0): a NEL ends the line in many viewers, a CSI recolours.
    #[test]
    fn regression_issue_35_log_fields_escape_c0_c1_and_del() {
        assert_eq!(clip("curl/8\u{85}fake line\u{9b}31m\u{7f}\u{1b}[0m", 256), "curl/8\\u{85}fake line\\u{9b}31m\\u{7f}\\u{1b}[0m");
        assert_eq!(clip("é ok/1.0", 256), "é ok/1.0", "printable text stays as it is");
        assert_eq!(clip("ééé", 3), "é", "cut at a character boundary");
    }
}
