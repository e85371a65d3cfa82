//! What the test proxies share ([`crate::fault_proxy`], [`crate::netem`]): an accept loop on
//! a loopback address that hands each client connection to a thread of its own, keeps the
//! sockets of live connections, and on stop shuts them all down and joins every thread.
//!
//! ```text
//!  accept thread ──> one thread per connection: serve(client, &Tracked)
//!        │                 └─ Tracked::add(&upstream): shut down too on stop
//!  stop(): flag, wake accept(), shut down every tracked socket, join
//! ```
//!
//! Shutting sockets down is what ends a connection thread blocked in `read`: the proxies
//! keep no timeouts of their own that a slow test could trip over.

use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// The first address `addr` resolves to.
pub(crate) fn resolve(addr: impl ToSocketAddrs) -> io::Result<SocketAddr> {
    addr.to_socket_addrs()?.next().ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "address resolves to nothing"))
}

/// Set SO_LINGER {on, 0} so closing sends RST instead of FIN.
pub(crate) fn linger_zero(s: &TcpStream) {
    use std::os::fd::AsRawFd;
    let l = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: setsockopt on a socket we own, with a pointer to a live, correctly sized
    // `linger` value; the kernel copies it before returning.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &l as *const libc::linger as *const libc::c_void,
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

/// Sockets of live connections, by connection.
#[derive(Default)]
struct Live {
    stop: AtomicBool,
    sockets: Mutex<HashMap<u64, Vec<TcpStream>>>,
    next_id: AtomicU64,
}

impl Live {
    fn add(&self, id: u64, s: &TcpStream) {
        if let Ok(c) = s.try_clone() {
            self.sockets.lock().unwrap().entry(id).or_default().push(c);
        }
        // Checked after inserting: either stop() drains this socket or we see its flag.
        if self.stop.load(Ordering::SeqCst) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// The sockets of one connection, shut down when the proxy stops; forgotten when the
/// connection's thread returns.
pub(crate) struct Tracked {
    live: Arc<Live>,
    id: u64,
}

impl Tracked {
    /// Shut `s` down too when the proxy stops (e.g. the connection's upstream socket).
    pub(crate) fn add(&self, s: &TcpStream) {
        self.live.add(self.id, s);
    }

    /// Whether the proxy is stopping.
    pub(crate) fn stopping(&self) -> bool {
        self.live.stop.load(Ordering::SeqCst)
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.live.sockets.lock().unwrap().remove(&self.id);
    }
}

/// A listening socket whose connections are each served on a thread of their own; stopped
/// (and every thread joined) on drop.
pub(crate) struct Acceptor {
    /// The address it listens on.
    pub(crate) addr: SocketAddr,
    live: Arc<Live>,
    accept: Option<JoinHandle<()>>,
}

impl Acceptor {
    /// Listen on `listen` (a loopback address: these proxies are for tests and benchmarks
    /// on one machine) and call `serve` for each connection on a new thread named `name`.
    pub(crate) fn start<F>(listen: SocketAddr, name: &str, serve: F) -> io::Result<Acceptor>
    where
        F: Fn(TcpStream, &Tracked) + Send + Sync + 'static,
    {
        if !listen.ip().is_loopback() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("refusing to listen on {listen}: loopback addresses only")));
        }
        let listener = TcpListener::bind(listen)?;
        let addr = listener.local_addr()?;
        let live = Arc::new(Live::default());
        let (lv, name) = (live.clone(), name.to_string());
        let serve = Arc::new(serve);
        let accept = std::thread::Builder::new().name(format!("{name}-accept")).spawn(move || {
            let mut workers: Vec<JoinHandle<()>> = Vec::new();
            for conn in listener.incoming() {
                if lv.stop.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(client) = conn else { continue };
                let tracked = Tracked { live: lv.clone(), id: lv.next_id.fetch_add(1, Ordering::Relaxed) };
                tracked.add(&client);
                let serve = serve.clone();
                workers.retain(|w| !w.is_finished());
                match std::thread::Builder::new().name(name.clone()).spawn(move || serve(client, &tracked)) {
                    Ok(w) => workers.push(w),
                    // Out of threads: this connection is dropped (closed), the proxy goes on.
                    Err(_) => continue,
                }
            }
            for w in workers {
                let _ = w.join();
            }
        })?;
        Ok(Acceptor { addr, live, accept: Some(accept) })
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.live.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept() with a throwaway connection.
        let _ = TcpStream::connect(self.addr);
        for (_, socks) in self.live.sockets.lock().unwrap().drain() {
            for s in socks {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
    }
}
