//! Refusals a client can read: a request refused before its body was read (a `PATCH`
//! whose `Content-Range` is out of order, a push without the right) has the rest of its
//! body read and dropped, up to [`DRAIN_MAX`] bytes, before the answer goes out.
//!
//! ```text
//! request body ──► Shared ──► handler (reads some, all or none of it)
//!                    │
//!                    └── handler refused it ──► drain: read ≤ DRAIN_MAX more, drop them ──► answer
//! ```
//!
//! Why: answering while the client is still sending, then closing the connection (hyper
//! cannot keep it once a body is left unread), closes a socket with unread bytes in its
//! receive buffer. The kernel then sends a reset, and a client still writing its body
//! sees the reset instead of the answer: a `416` and its `Range`, which say where to
//! resume, are lost. distribution reads the body of a refused request in the same way.
//!
//! A request sent with `Expect: 100-continue` whose body was never read is answered at
//! once: the client waits for the answer before sending its body, so there is nothing to
//! drain (and reading it would ask the client, with a `100 Continue`, to send it). A body
//! larger than the bound still ends in a closed connection: draining is a courtesy to
//! clients sending pieces of a usual size, not a promise to read any amount.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, BodyDataStream};
use axum::http::{header, HeaderMap};
use bytes::Bytes;
use futures::{Stream, StreamExt};

/// The most body bytes read and dropped after a refusal: a client's usual upload piece
/// (16 MiB, `regclient::DEFAULT_PIECE`). It bounds what a refused request costs.
pub const DRAIN_MAX: u64 = 16 << 20;

/// A request body shared between the handler and the drain after it.
#[derive(Clone)]
pub struct Shared {
    inner: Arc<Mutex<Option<BodyDataStream>>>,
    polled: Arc<std::sync::atomic::AtomicBool>,
}

impl Shared {
    /// Share `body`: the returned `Body` is the handler's, `Shared` keeps hold of what
    /// it leaves.
    pub fn new(body: Body) -> (Body, Shared) {
        let s = Shared { inner: Arc::new(Mutex::new(Some(body.into_data_stream()))), polled: Arc::default() };
        (Body::from_stream(s.clone()), s)
    }

    /// Read and drop what is left of the body, up to [`DRAIN_MAX`] bytes, each read
    /// within `idle`; whether it ended (the connection can then be kept).
    pub async fn drain(self, headers: &HeaderMap, idle: Duration) -> bool {
        let expects = headers.get(header::EXPECT).and_then(|v| v.to_str().ok()).is_some_and(|v| v.eq_ignore_ascii_case("100-continue"));
        if expects && !self.polled.load(std::sync::atomic::Ordering::Relaxed) {
            return true;
        }
        let Some(mut s) = self.inner.lock().expect("poisoned").take() else { return true };
        let mut read = 0u64;
        while read <= DRAIN_MAX {
            match tokio::time::timeout(idle, s.next()).await {
                Ok(Some(Ok(b))) => read += b.len() as u64,
                Ok(None) => return true,
                Ok(Some(Err(_))) | Err(_) => return false,
            }
        }
        tracing::debug!(read, "refused request's body is larger than the drain bound; the connection closes");
        false
    }
}

impl Stream for Shared {
    type Item = Result<Bytes, axum::Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.polled.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut g = self.inner.lock().expect("poisoned");
        match g.as_mut() {
            Some(s) => s.poll_next_unpin(cx),
            None => Poll::Ready(None),
        }
    }
}
