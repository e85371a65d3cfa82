//! Accepting connections, with limits a hostile client cannot get around (issue 14: 300
//! half-sent requests held the registry at its descriptor limit and `GET /v2/` got no
//! answer).
//!
//! ```text
//! accept ─> at most `max_conns_per_client` per client ─> TLS handshake ─> hyper (HTTP/1.1, h2)
//!                                                                            │
//!   watchdog: the first request head within `header_read_timeout` of the connect
//!             (TLS handshake and h2 preface included); with nothing in flight and no
//!             byte moving either way, closed after `idle_timeout`
//! ```
//! - HTTP/1.1 heads of later requests must also arrive within `header_read_timeout`
//!   (hyper's timer, which starts when the connection waits for a request, so it also
//!   closes idle keep-alive connections).
//! - While a handler runs the connection is not idle; a request body that stalls for
//!   `idle_timeout` fails the request instead (`server.rs`, `count_bytes`).
//! - A response the client stops reading stops moving bytes, and is closed as idle.
//! - Connections over the per-client cap are closed at once. A client is an IPv4
//!   address, or an IPv6 /64 (one host is routinely given a whole /64).

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::metrics::Metrics;

/// Connection limits (defaults: 30 s, 120 s, 64).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// A request head (and, for a new connection, the TLS handshake before it) must
    /// arrive within this.
    pub header_read_timeout: Duration,
    /// A connection with no request in flight and no byte moving, or a request body
    /// with no byte arriving, is closed after this.
    pub idle_timeout: Duration,
    /// Open connections per client (IPv4 address or IPv6 /64); 0 = no cap.
    pub max_conns_per_client: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits { header_read_timeout: Duration::from_secs(30), idle_timeout: Duration::from_secs(120), max_conns_per_client: 64 }
    }
}

/// The key a client's connections are counted under.
fn client_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & !((1u128 << 64) - 1))),
        },
    }
}

/// Open connections per client.
#[derive(Debug, Default)]
struct Clients {
    open: Mutex<HashMap<IpAddr, usize>>,
}

/// One admitted connection; leaves the count (and the gauge) when dropped.
#[derive(Debug)]
struct Slot {
    clients: Arc<Clients>,
    client: IpAddr,
    metrics: Arc<Metrics>,
}

impl Clients {
    fn admit(self: &Arc<Self>, ip: IpAddr, cap: usize, metrics: &Arc<Metrics>) -> Option<Slot> {
        let client = client_of(ip);
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let n = open.entry(client).or_default();
        if cap > 0 && *n >= cap {
            return None;
        }
        *n += 1;
        metrics.connections.fetch_add(1, Relaxed);
        Some(Slot { clients: self.clone(), client, metrics: metrics.clone() })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.clients.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = open.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.client);
            }
        }
        self.metrics.connections.fetch_sub(1, Relaxed);
    }
}

/// What the watchdog knows about one connection.
#[derive(Debug)]
struct ConnState {
    born: Instant,
    /// Milliseconds after `born` when a byte last moved.
    last_byte_ms: AtomicU64,
    /// Requests being handled (h2: streams).
    in_flight: AtomicUsize,
    /// Requests whose head arrived.
    requests: AtomicU64,
}

impl ConnState {
    fn new() -> ConnState {
        ConnState { born: Instant::now(), last_byte_ms: AtomicU64::new(0), in_flight: AtomicUsize::new(0), requests: AtomicU64::new(0) }
    }

    fn moved(&self) {
        self.last_byte_ms.store(self.born.elapsed().as_millis() as u64, Relaxed);
    }

    /// Time left before the connection counts as stalled; `None` while a request is
    /// being handled.
    fn left(&self, l: &Limits) -> Option<Duration> {
        if self.in_flight.load(Relaxed) > 0 {
            return None;
        }
        let deadline =
            if self.requests.load(Relaxed) == 0 { l.header_read_timeout } else { Duration::from_millis(self.last_byte_ms.load(Relaxed)) + l.idle_timeout };
        Some(deadline.saturating_sub(self.born.elapsed()))
    }
}

/// Counts a request in flight until dropped (also when the handler is cancelled).
struct InFlight(Arc<ConnState>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Relaxed);
    }
}

/// A stream that tells its [`ConnState`] whenever a byte moves.
struct Tracked<I> {
    inner: I,
    state: Arc<ConnState>,
}

impl<I: AsyncRead + Unpin> AsyncRead for Tracked<I> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.state.moved();
        }
        r
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Tracked<I> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.state.moved();
        }
        r
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.state.moved();
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The router as a hyper service that counts its requests in flight.
#[derive(Clone)]
struct Counted {
    inner: TowerToHyperService<Router>,
    state: Arc<ConnState>,
    /// The client, for handlers and the request log (`ConnectInfo`).
    peer: SocketAddr,
}

impl hyper::service::Service<hyper::Request<Incoming>> for Counted {
    type Response = axum::response::Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn call(&self, mut req: hyper::Request<Incoming>) -> Self::Future {
        req.extensions_mut().insert(axum::extract::ConnectInfo(self.peer));
        self.state.requests.fetch_add(1, Relaxed);
        self.state.in_flight.fetch_add(1, Relaxed);
        let guard = InFlight(self.state.clone());
        let fut = self.inner.call(req);
        Box::pin(async move {
            let r = fut.await;
            drop(guard);
            r
        })
    }
}

/// Serve `router` on `listener` (TLS when `tls` is set) under `limits`, until `shutdown`
/// resolves; then stop accepting, let in-flight requests finish and return.
pub(crate) async fn serve(
    router: Router,
    listener: TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    limits: Limits,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let (stop_tx, stop_rx) = watch::channel(());
    let clients = Arc::new(Clients::default());
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of descriptors (EMFILE) or a connection reset before accept:
                    // pause instead of spinning; the backlog waits.
                    tracing::warn!(%e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Some(slot) = clients.admit(peer.ip(), limits.max_conns_per_client, &metrics) else {
            metrics.connections_refused.fetch_add(1, Relaxed);
            tracing::debug!(%peer, cap = limits.max_conns_per_client, "refusing connection: client has too many open");
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let conn = Conn { router: router.clone(), limits: limits.clone(), metrics: metrics.clone(), stop: stop_rx.clone(), peer };
        tokio::spawn(conn.run(tcp, tls.clone(), slot));
    }
    drop(listener);
    drop(stop_rx);
    let _ = stop_tx.send(());
    // Every connection task holds a receiver; all gone = all finished.
    stop_tx.closed().await;
    Ok(())
}

/// One connection's task.
struct Conn {
    router: Router,
    limits: Limits,
    metrics: Arc<Metrics>,
    stop: watch::Receiver<()>,
    peer: SocketAddr,
}

impl Conn {
    async fn run(self, tcp: TcpStream, tls: Option<tokio_rustls::TlsAcceptor>, _slot: Slot) {
        let state = Arc::new(ConnState::new());
        let Some(tls) = tls else { return self.http(tcp, state).await };
        match tokio::time::timeout(self.limits.header_read_timeout, tls.accept(tcp)).await {
            Ok(Ok(s)) => self.http(s, state).await,
            Ok(Err(e)) => tracing::debug!(peer = %self.peer, %e, "TLS handshake failed"),
            Err(_) => {
                self.metrics.connections_timed_out.fetch_add(1, Relaxed);
                tracing::debug!(peer = %self.peer, "TLS handshake timed out");
            }
        }
    }

    async fn http<I: AsyncRead + AsyncWrite + Unpin + Send + 'static>(mut self, io: I, state: Arc<ConnState>) {
        let mut http = auto::Builder::new(TokioExecutor::new());
        http.http1().timer(TokioTimer::new()).header_read_timeout(self.limits.header_read_timeout);
        http.http2().timer(TokioTimer::new());
        let svc = Counted { inner: TowerToHyperService::new(self.router.clone()), state: state.clone(), peer: self.peer };
        let conn = http.serve_connection(TokioIo::new(Tracked { inner: io, state: state.clone() }), svc);
        let mut conn = std::pin::pin!(conn);
        let mut stopping = false;
        loop {
            let wait = state.left(&self.limits).unwrap_or(self.limits.idle_timeout);
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(peer = %self.peer, %e, "connection ended with an error");
                    }
                    return;
                }
                _ = self.stop.changed(), if !stopping => {
                    stopping = true;
                    conn.as_mut().graceful_shutdown();
                }
                () = tokio::time::sleep(wait) => {
                    if state.left(&self.limits) == Some(Duration::ZERO) {
                        self.metrics.connections_timed_out.fetch_add(1, Relaxed);
                        tracing::debug!(peer = %self.peer, "closing a stalled connection");
                        return;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clients_are_addresses_or_ipv6_slash_64s() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:bbbb::9".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(client_of(a), client_of(b));
        assert_ne!(client_of(a), client_of(c));
        let mapped: IpAddr = "::ffff:192.0.2.7".parse().unwrap();
        assert_eq!(client_of(mapped), "192.0.2.7".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn the_cap_counts_open_connections_per_client() {
        let clients = Arc::new(Clients::default());
        let m = Arc::new(Metrics::default());
        let ip: IpAddr = "192.0.2.1".parse().unwrap();
        let held: Vec<Slot> = (0..3).map(|_| clients.admit(ip, 3, &m).expect("under the cap")).collect();
        assert!(clients.admit(ip, 3, &m).is_none(), "fourth connection admitted");
        assert!(clients.admit("192.0.2.2".parse().unwrap(), 3, &m).is_some(), "another client is not capped");
        assert_eq!(m.connections.load(Relaxed), 3);
        drop(held);
        assert!(clients.admit(ip, 3, &m).is_some(), "closed connections leave the count");
        assert!(clients.open.lock().unwrap().is_empty(), "no entry left for clients without connections");
    }
}
