//! Accepting connections, with limits a hostile client cannot get around (without them,
//! a few hundred half-sent requests hold the registry at its descriptor limit and
//! `GET /v2/` gets no answer).
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
//! - A response body that has not moved for `idle_timeout` closes its connection, even
//!   while other bytes move on it: an HTTP/2 client can keep a connection busy with PINGs
//!   while its streams' flow-control windows stay at 0, so that each stream holds its
//!   blob file open forever.
//! - Connections over the per-client cap are closed at once. A client is an IPv4
//!   address, or an IPv6 /64 (one host is routinely given a whole /64).
//! - What a client holds is bounded where it costs: HTTP/2 streams per connection
//!   (`max_streams_per_conn`, announced in SETTINGS), and requests in progress (handler
//!   running or response body not finished: each may hold a file) per client across all
//!   its connections (`max_requests_per_client`); a request past that is answered at once
//!   with 429 and `Retry-After`, without reaching the handler. Honest connections that
//!   move are cheap, so the connection cap is generous (a host waking many sandboxes
//!   opens hundreds).

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

/// Connection limits (defaults: 30 s, 120 s, 512 connections, 512 requests, 64 streams).
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
    /// Requests in progress per client, across its connections: a handler running or a
    /// response body not yet sent (each may hold a file). Past it: 429. 0 = no cap.
    pub max_requests_per_client: usize,
    /// HTTP/2 streams one connection may have open (SETTINGS_MAX_CONCURRENT_STREAMS).
    pub max_streams_per_conn: u32,
}

/// How often a connection's watchdog looks at it, at least.
const WATCH_EVERY: Duration = Duration::from_secs(1);

/// Default [`Limits::max_conns_per_client`]: eight pulls with 32 jobs each from one host.
pub const DEFAULT_MAX_CONNS_PER_CLIENT: usize = 512;
/// Default [`Limits::max_requests_per_client`].
pub const DEFAULT_MAX_REQUESTS_PER_CLIENT: usize = 512;
/// Default [`Limits::max_streams_per_conn`] (hyper's own default is 200).
pub const DEFAULT_MAX_STREAMS_PER_CONN: u32 = 64;

impl Limits {
    /// These limits with the per-client caps lowered, where needed, to a quarter of the
    /// process's descriptor limit (`RLIMIT_NOFILE`, after raising the soft limit to the
    /// hard one): every connection and every request in progress holds a descriptor,
    /// so a cap above that would let one client use them all and leave other clients
    /// unanswered. 0 (no cap) stays 0 only when the descriptors are unlimited.
    pub fn within_descriptors(mut self, nofile: u64) -> Limits {
        if nofile == u64::MAX {
            return self;
        }
        let share = usize::try_from(nofile / 4).unwrap_or(usize::MAX).max(8);
        for cap in [&mut self.max_conns_per_client, &mut self.max_requests_per_client] {
            if *cap == 0 || *cap > share {
                tracing::info!(nofile, from = *cap, to = share, "per-client cap lowered to a quarter of the descriptor limit");
                *cap = share;
            }
        }
        self
    }
}

/// The process's descriptor limit, with the soft limit raised to the hard one first (as
/// Go's runtime and most servers do: the soft default of 1024 is far below what a
/// registry serving hundreds of pulls holds). `u64::MAX` = unlimited.
pub fn descriptor_limit() -> u64 {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit with a valid resource and a pointer to an initialised
    // struct we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 {
            return 1024;
        }
        if r.rlim_cur < r.rlim_max {
            let raised = libc::rlimit { rlim_cur: r.rlim_max, rlim_max: r.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                r.rlim_cur = r.rlim_max;
            }
        }
    }
    if r.rlim_cur == libc::RLIM_INFINITY {
        u64::MAX
    } else {
        r.rlim_cur
    }
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            header_read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(120),
            max_conns_per_client: DEFAULT_MAX_CONNS_PER_CLIENT,
            max_requests_per_client: DEFAULT_MAX_REQUESTS_PER_CLIENT,
            max_streams_per_conn: DEFAULT_MAX_STREAMS_PER_CONN,
        }
    }
}

/// The client a request came from (its [`client_of`] key), in the request's extensions:
/// the handlers make a client that keeps failing to log in wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ClientAddr(pub IpAddr);

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

/// What one client holds now.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Held {
    conns: usize,
    requests: usize,
}

/// What each client holds; a client holding nothing has no entry.
#[derive(Debug, Default)]
struct Clients {
    open: Mutex<HashMap<IpAddr, Held>>,
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
        let h = open.entry(client).or_default();
        if cap > 0 && h.conns >= cap {
            if *h == Held::default() {
                open.remove(&client);
            }
            return None;
        }
        h.conns += 1;
        metrics.connections.fetch_add(1, Relaxed);
        Some(Slot { clients: self.clone(), client, metrics: metrics.clone() })
    }

    /// Admit one request of `client` (already a key of [`client_of`]) under `cap`.
    fn begin(self: &Arc<Self>, client: IpAddr, cap: usize, metrics: &Arc<Metrics>) -> Option<RequestSlot> {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let h = open.entry(client).or_default();
        if cap > 0 && h.requests >= cap {
            return None;
        }
        h.requests += 1;
        metrics.responses_open.fetch_add(1, Relaxed);
        Some(RequestSlot { clients: self.clone(), client, metrics: metrics.clone() })
    }

    fn release(&self, client: IpAddr, f: impl FnOnce(&mut Held)) {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(h) = open.get_mut(&client) {
            f(h);
            if *h == Held::default() {
                open.remove(&client);
            }
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.clients.release(self.client, |h| h.conns -= 1);
        self.metrics.connections.fetch_sub(1, Relaxed);
    }
}

/// One request in progress (handler or response body); leaves the count when dropped.
#[derive(Debug)]
struct RequestSlot {
    clients: Arc<Clients>,
    client: IpAddr,
    metrics: Arc<Metrics>,
}

impl Drop for RequestSlot {
    fn drop(&mut self) {
        self.clients.release(self.client, |h| h.requests -= 1);
        self.metrics.responses_open.fetch_sub(1, Relaxed);
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
    /// Response bodies being sent, each with the millisecond (after `born`) its last
    /// frame went out (or it was created).
    bodies: Mutex<HashMap<u64, Arc<AtomicU64>>>,
    next_body: AtomicU64,
}

impl ConnState {
    fn new() -> ConnState {
        ConnState {
            born: Instant::now(),
            last_byte_ms: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            requests: AtomicU64::new(0),
            bodies: Mutex::new(HashMap::new()),
            next_body: AtomicU64::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        self.born.elapsed().as_millis() as u64
    }

    fn moved(&self) {
        self.last_byte_ms.store(self.now_ms(), Relaxed);
    }

    /// Time left before the connection counts as stalled: nothing in flight and no byte
    /// moving, or a response body that has not moved, for too long. `None` while a
    /// request is being handled and no response body is waiting.
    fn left(&self, l: &Limits) -> Option<Duration> {
        let now = self.born.elapsed();
        let body = self.oldest_body_progress().map(|t| Duration::from_millis(t).saturating_add(l.idle_timeout).saturating_sub(now));
        if self.in_flight.load(Relaxed) > 0 {
            return body;
        }
        let deadline = if self.requests.load(Relaxed) == 0 {
            l.header_read_timeout
        } else {
            Duration::from_millis(self.last_byte_ms.load(Relaxed)).saturating_add(l.idle_timeout)
        };
        let conn = deadline.saturating_sub(now);
        Some(body.map_or(conn, |b| b.min(conn)))
    }

    /// When the least recently moved response body of this connection last moved.
    fn oldest_body_progress(&self) -> Option<u64> {
        self.bodies.lock().unwrap_or_else(|p| p.into_inner()).values().map(|t| t.load(Relaxed)).min()
    }

    /// Whether a response body has not moved for `idle`.
    fn body_stalled(&self, idle: Duration) -> bool {
        self.oldest_body_progress().is_some_and(|t| self.born.elapsed() >= Duration::from_millis(t).saturating_add(idle))
    }
}

/// A response body on its way out: tells its connection when a frame leaves, and holds
/// its client's request slot until it is finished or dropped.
struct HeldBody {
    inner: axum::body::Body,
    conn: Arc<ConnState>,
    id: u64,
    progress: Arc<AtomicU64>,
    _slot: RequestSlot,
}

impl HeldBody {
    fn new(inner: axum::body::Body, conn: Arc<ConnState>, slot: RequestSlot) -> HeldBody {
        let id = conn.next_body.fetch_add(1, Relaxed);
        let progress = Arc::new(AtomicU64::new(conn.now_ms()));
        conn.bodies.lock().unwrap_or_else(|p| p.into_inner()).insert(id, progress.clone());
        HeldBody { inner, conn, id, progress, _slot: slot }
    }
}

impl Drop for HeldBody {
    fn drop(&mut self) {
        self.conn.bodies.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.id);
    }
}

impl hyper::body::Body for HeldBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(_))) = &r {
            self.progress.store(self.conn.now_ms(), Relaxed);
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
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

/// The router as a hyper service that counts its requests in flight, admits each under
/// its client's request cap, and tracks its response body.
#[derive(Clone)]
struct Counted {
    inner: TowerToHyperService<Router>,
    state: Arc<ConnState>,
    clients: Arc<Clients>,
    /// The client's key ([`client_of`]).
    client: IpAddr,
    cap: usize,
    metrics: Arc<Metrics>,
    /// The client, for handlers and the request log (`ConnectInfo`).
    peer: SocketAddr,
}

/// The answer to a request over its client's cap: at once, with no body (so it needs no
/// flow-control window to finish) and no work behind it.
fn too_many_requests(cap: usize) -> axum::response::Response {
    let mut r = axum::response::Response::new(axum::body::Body::empty());
    *r.status_mut() = hyper::StatusCode::TOO_MANY_REQUESTS;
    let h = r.headers_mut();
    h.insert(hyper::header::RETRY_AFTER, hyper::header::HeaderValue::from_static("1"));
    h.insert(hyper::header::CONTENT_LENGTH, hyper::header::HeaderValue::from_static("0"));
    if let Ok(v) = hyper::header::HeaderValue::from_str(&format!("more than {cap} requests in progress from this client")) {
        h.insert(hyper::header::HeaderName::from_static("x-snapctl-refused"), v);
    }
    r
}

impl hyper::service::Service<hyper::Request<Incoming>> for Counted {
    type Response = axum::response::Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn call(&self, mut req: hyper::Request<Incoming>) -> Self::Future {
        req.extensions_mut().insert(axum::extract::ConnectInfo(self.peer));
        self.state.requests.fetch_add(1, Relaxed);
        req.extensions_mut().insert(ClientAddr(self.client));
        let Some(slot) = self.clients.begin(self.client, self.cap, &self.metrics) else {
            self.metrics.requests_refused.fetch_add(1, Relaxed);
            self.metrics.request(req.method().as_str(), 429);
            tracing::debug!(client = %self.client, cap = self.cap, "refusing a request: client has too many in progress");
            return Box::pin(std::future::ready(Ok(too_many_requests(self.cap))));
        };
        self.state.in_flight.fetch_add(1, Relaxed);
        let guard = InFlight(self.state.clone());
        let fut = self.inner.call(req);
        let conn = self.state.clone();
        Box::pin(async move {
            let r = fut.await;
            drop(guard);
            r.map(|resp| resp.map(|b| axum::body::Body::new(HeldBody::new(b, conn, slot))))
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
    let limits = limits.within_descriptors(descriptor_limit());
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
        let conn = Conn { router: router.clone(), limits: limits.clone(), metrics: metrics.clone(), stop: stop_rx.clone(), peer, clients: clients.clone() };
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
    clients: Arc<Clients>,
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
        http.http2().timer(TokioTimer::new()).max_concurrent_streams(self.limits.max_streams_per_conn);
        let svc = Counted {
            inner: TowerToHyperService::new(self.router.clone()),
            state: state.clone(),
            clients: self.clients.clone(),
            client: client_of(self.peer.ip()),
            cap: self.limits.max_requests_per_client,
            metrics: self.metrics.clone(),
            peer: self.peer,
        };
        let conn = http.serve_connection(TokioIo::new(Tracked { inner: io, state: state.clone() }), svc);
        let mut conn = std::pin::pin!(conn);
        let mut stopping = false;
        loop {
            // Looked at again at least every WATCH_EVERY: a response body that starts
            // waiting after this sleep began has its own, earlier deadline.
            let wait = state.left(&self.limits).unwrap_or(self.limits.idle_timeout).min(WATCH_EVERY);
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
                        if state.body_stalled(self.limits.idle_timeout) {
                            // Dropping the connection drops its streams, their bodies and files.
                            self.metrics.responses_stalled.fetch_add(1, Relaxed);
                            tracing::debug!(peer = %self.peer, "closing a connection whose response has not moved");
                        } else {
                            tracing::debug!(peer = %self.peer, "closing a stalled connection");
                        }
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
    fn per_client_caps_stay_within_a_quarter_of_the_descriptors() {
        let l = Limits::default().within_descriptors(256);
        assert_eq!((l.max_conns_per_client, l.max_requests_per_client), (64, 64));
        let l = Limits { max_conns_per_client: 0, ..Limits::default() }.within_descriptors(1 << 20);
        assert_eq!((l.max_conns_per_client, l.max_requests_per_client), (1 << 18, DEFAULT_MAX_REQUESTS_PER_CLIENT));
        assert_eq!(Limits::default().within_descriptors(u64::MAX), Limits::default());
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
