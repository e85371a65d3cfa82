//! A network you can dial, for tests and benchmarks (issue 16 §1): a TCP proxy on
//! 127.0.0.1 that delays every byte by half a round-trip time in each direction and can cap
//! each direction's bandwidth. Linux's `tc netem` is not available here, so this is done in
//! user space; `tests/src/bin/netem_proxy.rs` is the same proxy as a program for `bench/`.
//!
//! ```text
//!            ┌────────── one connection ───────────────────────────────────┐
//!  client ──>│ reader ─> link "up"   ─> delay line (rtt/2) ─> writer │──> upstream
//!  client <──│ writer <─ delay line (rtt/2) <─ link "down" <─ reader │<── upstream
//!            └─────────────────────────────────────────────────────────────┘
//!  link "up" and link "down": one each for the whole proxy, shared by every connection
//! ```
//!
//! Each direction of each connection is a pipeline, not a turnstile: its reader takes
//! whatever bytes have arrived, notes when they may leave, and queues them; its writer
//! writes each piece when it is due. Bytes read at time `t` are written at `t + rtt/2`, while
//! later bytes are already on their way, and every connection has its own threads, so
//! neither requests on different connections nor pieces of one response wait for each other.
//!
//! | what | how it is modelled |
//! |---|---|
//! | latency | every byte waits `rtt / 2` in each direction |
//! | connection set-up | a connection's first client bytes wait one more `rtt` (TCP's SYN, SYN-ACK): a request on a fresh connection costs 2 RTT, one on a kept-alive connection 1 RTT, as on a real network (`handshake: false` turns this off) |
//! | bandwidth (optional) | one link per direction shared by all connections, as a host's uplink and downlink are: a virtual clock books each piece onto the link after the pieces before it (`len / rate` each; a gap under 5 ms is caught up, as a late wake-up of this proxy's threads and not the sender's pause, while a link idle for longer starts afresh with no credit); the reader waits until its piece starts to be sent (so a busy link pushes back on the sender through TCP, and the link never idles while bytes wait), and the piece is due `rtt / 2` after its last byte has been sent |
//! | TCP window | bytes of one direction of one connection count as in flight from when they are read until one RTT after they left (when the sender would see them acknowledged); at most `window` bytes are in flight, so one connection moves at most `window / rtt`, as TCP does. The default, 16 MiB, leaves a 1 Gbit/s path at 50 ms RTT (6.25 MB in flight) limited by the link, not the window |
//! | the bottleneck (`link`, with a cap) | one of three models, chosen per run ([`LinkModel`]): **window** (the default) holds each busy connection's next piece and reads no more of that connection until the piece starts to be sent, so a busy link pushes back on every sender through TCP and connections take turns (a piece waits behind at most one piece per busy connection, as at a queue per connection or a fair-queueing router); **deep** is one FIFO per direction that takes every byte at once and never drops one: no sender is pushed back (its window never fills: 16 MiB against the at most 8 MiB a response of `pull` or the lazy stream carries), a piece waits behind every byte booked before it on any connection, and only the queueing delay grows (a bufferbloated uplink, a busy NAT, a cloud egress shaper); **shallow** is the window model with a buffer of `queue_limit` bytes (by default 30 % of the bandwidth-delay product, at least 256 KiB): a piece that finds more than that booked ahead of it and not yet sent is dropped, the sender sees the loss a round trip later and sends it again (fast retransmit), so that connection's piece waits one RTT (at least 1 ms) and is booked again; counted in `drops`. A piece always enters an empty queue. The most link time booked ahead of a piece is `max_queue` |
//!
//! Not modelled: loss other than a full shallow buffer's, TCP's window cut after a loss
//! (a dropped connection only pauses), reordering, jitter, slow start (a fresh connection
//! gets the whole link at once, which flatters short transfers on new connections), and a
//! deep buffer's own bound (it holds what the windows let in: at most `window` bytes per
//! connection and direction).
//!
//! Timing: sleeps end at or after their deadline, never before, so every delay here is a
//! lower bound; on a loaded machine bytes may arrive later than modelled. Threads with
//! `std::thread::sleep` rather than tokio: tokio's timer has millisecond granularity (its
//! docs say so), an error of 50-100% on a 2 ms RTT; a thread's sleep overshoots by tens of
//! microseconds. The accept loop and shutdown are [`crate::proxy`]'s, shared with
//! [`crate::fault_proxy`]; to inject faults across a slow network, chain the two
//! (`Netem` in front of a `FaultProxy` in front of the registry).

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::proxy::{linger_zero, resolve, Acceptor, Tracked};

/// Largest piece read at once (uncapped); under a cap pieces are at most ~1 ms of link time.
const PIECE: usize = 256 * 1024;
/// Smallest piece under a cap (so a slow link does not cost a syscall per few bytes).
const MIN_PIECE: usize = 4096;
/// Smallest window accepted: less than one piece would stall a connection.
const MIN_WINDOW: usize = 64 * 1024;
/// A link idle for less than this is taken as still busy (see [`Link::try_book`]).
const HICCUP: Duration = Duration::from_millis(5);
/// Least time a dropped piece waits before it is sent again (at RTT 0 the retransmission
/// would otherwise spin against a full queue).
const MIN_RETRANSMIT: Duration = Duration::from_millis(1);
/// A shallow buffer's default: this share of the bandwidth-delay product...
const SHALLOW_SHARE: f64 = 0.3;
/// ...and at least this many bytes (two pieces at 1 Gbit/s).
const MIN_SHALLOW: usize = 256 * 1024;

/// How the bottleneck (each direction's shared link, under a cap) queues what it cannot send
/// yet (the module doc's table).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LinkModel {
    /// Each busy connection's next piece waits at the link before more of it is read: the
    /// link pushes back on every sender, and connections take turns.
    #[default]
    Window,
    /// One FIFO per direction that takes every byte at once and drops none: no sender is
    /// pushed back, and the queueing delay grows with what the senders have sent.
    Deep,
    /// The window model with a buffer of `queue_limit` bytes: a piece that does not fit is
    /// dropped and sent again a round trip later.
    Shallow,
}

impl LinkModel {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            LinkModel::Window => "window",
            LinkModel::Deep => "deep",
            LinkModel::Shallow => "shallow",
        }
    }
}

impl std::str::FromStr for LinkModel {
    type Err = String;
    fn from_str(s: &str) -> Result<LinkModel, String> {
        match s {
            "window" => Ok(LinkModel::Window),
            "deep" => Ok(LinkModel::Deep),
            "shallow" => Ok(LinkModel::Shallow),
            _ => Err(format!("unknown link model {s:?} (window, deep or shallow)")),
        }
    }
}

/// How the network behaves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetemConfig {
    /// Round-trip time: each direction delays every byte by half of it.
    pub rtt: Duration,
    /// Bandwidth cap in bits per second, per direction, shared by all connections (a
    /// host's link). `None`: no cap.
    pub rate_bps: Option<u64>,
    /// Bytes one direction of one connection may have in flight (see the module doc).
    pub window: usize,
    /// Charge a fresh connection one RTT for TCP's handshake before its first bytes go.
    pub handshake: bool,
    /// How the bottleneck queues (the module doc). `Deep` and `Shallow` need `rate_bps`.
    pub link: LinkModel,
    /// A shallow buffer's size in bytes per direction; `None`: 30 % of the bandwidth-delay
    /// product, at least 256 KiB ([`NetemConfig::shallow_limit`]). Only with `Shallow`.
    pub queue_limit: Option<usize>,
}

impl Default for NetemConfig {
    fn default() -> NetemConfig {
        NetemConfig { rtt: Duration::ZERO, rate_bps: None, window: 16 << 20, handshake: true, link: LinkModel::Window, queue_limit: None }
    }
}

impl NetemConfig {
    /// `rtt` of latency, no cap.
    pub fn new(rtt: Duration) -> NetemConfig {
        NetemConfig { rtt, ..NetemConfig::default() }
    }

    /// Cap each direction at `bps` bits per second.
    pub fn rate(mut self, bps: u64) -> NetemConfig {
        self.rate_bps = Some(bps);
        self
    }

    /// Give the bottleneck a buffer of `bytes` per direction (a shallow buffer).
    pub fn queue_limit(mut self, bytes: usize) -> NetemConfig {
        self.link = LinkModel::Shallow;
        self.queue_limit = Some(bytes);
        self
    }

    /// Queue at the bottleneck as `link` does.
    pub fn link(mut self, link: LinkModel) -> NetemConfig {
        self.link = link;
        self
    }

    /// The shallow buffer's size in bytes: `queue_limit`, or 30 % of the bandwidth-delay
    /// product and at least 256 KiB. `None` unless the link is shallow and capped.
    pub fn shallow_limit(&self) -> Option<usize> {
        match (self.link, self.rate_bps) {
            (LinkModel::Shallow, Some(bps)) => Some(self.queue_limit.unwrap_or_else(|| {
                let bdp = bps as f64 / 8.0 * self.rtt.as_secs_f64();
                ((bdp * SHALLOW_SHARE) as usize).max(MIN_SHALLOW)
            })),
            _ => None,
        }
    }

    fn validate(&self) -> io::Result<()> {
        let bad = |m: String| Err(io::Error::new(io::ErrorKind::InvalidInput, m));
        if self.rate_bps == Some(0) {
            return bad("a rate of 0 bit/s moves nothing (use no cap instead)".into());
        }
        if self.window < MIN_WINDOW {
            return bad(format!("window {} is below the minimum of {MIN_WINDOW} bytes", self.window));
        }
        if self.rtt > Duration::from_secs(60) {
            return bad(format!("rtt {:?} is over a minute", self.rtt));
        }
        if self.link != LinkModel::Window && self.rate_bps.is_none() {
            return bad(format!("a {} link needs a rate cap (the queue is the bottleneck's)", self.link.name()));
        }
        if self.queue_limit.is_some() && self.link != LinkModel::Shallow {
            return bad(format!("a queue limit is a shallow link's, not a {} one's", self.link.name()));
        }
        if self.queue_limit == Some(0) {
            return bad("a queue limit of 0 bytes passes nothing".into());
        }
        Ok(())
    }

    /// Bytes read at once: under a cap about 1 ms of link time, so connections sharing the
    /// link interleave finely.
    fn piece(&self) -> usize {
        match self.rate_bps {
            Some(bps) => ((bps / 8 / 1000) as usize).clamp(MIN_PIECE, PIECE),
            None => PIECE,
        }
    }
}

/// Traffic counters, readable while the proxy runs.
#[derive(Debug, Default)]
pub struct NetemCounters {
    /// Client connections accepted.
    pub connections: AtomicU64,
    /// Client connections open now.
    pub open: AtomicU64,
    /// Most client connections open at once. An HTTP/1.1 client opens a connection when
    /// none of its open ones is idle, so this is how many requests it had in flight at
    /// once, at least.
    pub max_open: AtomicU64,
    /// Bytes delivered from clients to upstream.
    pub bytes_up: AtomicU64,
    /// Bytes delivered from upstream to clients.
    pub bytes_down: AtomicU64,
    /// Pieces a full shallow buffer dropped (and the sender sent again), both directions.
    pub drops: AtomicU64,
    /// Most link time booked ahead of a piece when it was booked, in microseconds, either
    /// direction: the deepest queue a byte met at the bottleneck.
    pub max_queue_us: AtomicU64,
}

/// One direction's share of the host's link: a virtual clock of when it is next free.
struct Link {
    secs_per_byte: f64,
    free_at: Mutex<Instant>,
    /// Most link time booked ahead and not yet sent that a piece may join (a shallow
    /// buffer); `None`: no bound.
    limit: Option<Duration>,
}

impl Link {
    fn new(bps: u64, queue_limit: Option<usize>) -> Link {
        let secs_per_byte = 8.0 / bps as f64;
        Link { secs_per_byte, free_at: Mutex::new(Instant::now()), limit: queue_limit.map(|b| Duration::from_secs_f64(b as f64 * secs_per_byte)) }
    }

    /// Book the link for `n` bytes: (when the first of them starts to leave, when the last
    /// has left), or `None` when a shallow buffer is full (the piece is dropped): the queue
    /// is the link time booked beyond now, and a piece is dropped when that and the piece
    /// exceed the limit, never when the queue is empty.
    ///
    /// A link that went idle less than [`HICCUP`] ago is booked from when it went idle, as
    /// if it had stayed busy: such a gap is this proxy's reader thread woken late on a
    /// loaded machine while bytes waited in its socket, and without catching up one
    /// download got 78% of a 1 Gbit/s cap at load 13 on 2 cores. A link idle for longer
    /// starts afresh from now with no credit, so a request after a pause pays the whole
    /// serialisation time of its response, as on a real link (a token bucket that banked
    /// credit while idle cut 5 ms off every 1 MiB fetch at 1 Gbit/s). Either way a link
    /// moves at most its rate times an interval plus `HICCUP` of bytes.
    fn try_book(&self, n: usize) -> Option<(Instant, Instant)> {
        self.try_book_at(n, Instant::now())
    }

    fn try_book_at(&self, n: usize, now: Instant) -> Option<(Instant, Instant)> {
        let mut free = self.free_at.lock().unwrap();
        let start = if *free + HICCUP >= now { *free } else { now };
        let len = Duration::from_secs_f64(n as f64 * self.secs_per_byte);
        if let Some(limit) = self.limit {
            let queued = start.saturating_duration_since(now);
            if !queued.is_zero() && queued + len > limit {
                return None;
            }
        }
        *free = start + len;
        Some((start, *free))
    }
}

struct Shared {
    upstream: SocketAddr,
    cfg: NetemConfig,
    /// Client to upstream, upstream to client.
    up: Option<Link>,
    down: Option<Link>,
    counters: NetemCounters,
}

/// A running proxy; stopped (listener closed, live connections shut down, threads joined)
/// on drop.
pub struct Netem {
    /// `127.0.0.1:PORT` the proxy listens on.
    pub addr: String,
    shared: Arc<Shared>,
    _acceptor: Acceptor,
}

impl Netem {
    /// Start a proxy on 127.0.0.1:free-port in front of `upstream` (e.g. `127.0.0.1:5000`).
    pub fn start(upstream: impl ToSocketAddrs, cfg: NetemConfig) -> io::Result<Netem> {
        Netem::start_on(SocketAddr::from(([127, 0, 0, 1], 0)), upstream, cfg)
    }

    /// Start a proxy listening on `listen` (a loopback address; port 0 picks a free one).
    pub fn start_on(listen: SocketAddr, upstream: impl ToSocketAddrs, cfg: NetemConfig) -> io::Result<Netem> {
        cfg.validate()?;
        let upstream = resolve(upstream)?;
        let link = |bps: Option<u64>| bps.map(|b| Link::new(b, cfg.shallow_limit()));
        let shared = Arc::new(Shared { upstream, up: link(cfg.rate_bps), down: link(cfg.rate_bps), cfg, counters: NetemCounters::default() });
        let sh = shared.clone();
        let acceptor = Acceptor::start(listen, "netem", move |client, tracked| serve(&sh, client, tracked))?;
        Ok(Netem { addr: acceptor.addr.to_string(), shared, _acceptor: acceptor })
    }

    /// `http://127.0.0.1:PORT` + path.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &NetemConfig {
        &self.shared.cfg
    }

    /// The counters.
    pub fn counters(&self) -> &NetemCounters {
        &self.shared.counters
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.shared.counters.connections.load(Ordering::Relaxed)
    }

    /// Most client connections open at once so far.
    pub fn max_open(&self) -> u64 {
        self.shared.counters.max_open.load(Ordering::Relaxed)
    }

    /// Bytes delivered to clients so far.
    pub fn bytes_down(&self) -> u64 {
        self.shared.counters.bytes_down.load(Ordering::Relaxed)
    }

    /// Bytes delivered to upstream so far.
    pub fn bytes_up(&self) -> u64 {
        self.shared.counters.bytes_up.load(Ordering::Relaxed)
    }

    /// Pieces a full shallow buffer dropped so far.
    pub fn drops(&self) -> u64 {
        self.shared.counters.drops.load(Ordering::Relaxed)
    }

    /// The most link time a piece found booked ahead of it so far (the deepest queue).
    pub fn max_queue(&self) -> Duration {
        Duration::from_micros(self.shared.counters.max_queue_us.load(Ordering::Relaxed))
    }
}

/// What a reader hands its writer.
enum Piece {
    /// Bytes to write at `due`.
    Data(Vec<u8>, Instant),
    /// The source ended at `due`: cleanly (pass on a FIN) or not (pass on a reset).
    End { due: Instant, reset: bool },
}

fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}

/// Relay one client connection through its own upstream connection until both directions
/// have ended.
fn serve(sh: &Shared, client: TcpStream, tracked: &Tracked) {
    sh.counters.connections.fetch_add(1, Ordering::Relaxed);
    let open = sh.counters.open.fetch_add(1, Ordering::Relaxed) + 1;
    sh.counters.max_open.fetch_max(open, Ordering::Relaxed);
    // Closed whichever way this returns.
    struct Open<'a>(&'a AtomicU64);
    impl Drop for Open<'_> {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::Relaxed);
        }
    }
    let _open = Open(&sh.counters.open);
    let Ok(upstream) = TcpStream::connect(sh.upstream) else {
        // As a refused connection looks from far away: the client's socket is reset.
        linger_zero(&client);
        return;
    };
    tracked.add(&upstream);
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let clones = || -> io::Result<[TcpStream; 6]> {
        Ok([client.try_clone()?, client.try_clone()?, client.try_clone()?, upstream.try_clone()?, upstream.try_clone()?, upstream.try_clone()?])
    };
    let Ok([client_r, client_w, client_x, up_r, up_w, up_x]) = clones() else {
        linger_zero(&client);
        return;
    };
    let extra = if sh.cfg.handshake { sh.cfg.rtt } else { Duration::ZERO };
    let (to_up, from_client) = channel();
    let (to_client, from_up) = channel();
    let (cfg, c, up_link, down_link) = (&sh.cfg, &sh.counters, sh.up.as_ref(), sh.down.as_ref());
    std::thread::scope(|s| {
        let ok = spawn(s, "netem-up-read", move || read_side(client_r, to_up, cfg, up_link, c, extra))
            && spawn(s, "netem-up-write", move || write_side(up_w, from_client, &c.bytes_up, client_x))
            && spawn(s, "netem-down-write", move || write_side(client_w, from_up, &c.bytes_down, up_x));
        if ok {
            read_side(up_r, to_client, cfg, down_link, c, Duration::ZERO);
        } else {
            // Out of threads: end the connection; the threads that did start see it end.
            let _ = client.shutdown(Shutdown::Both);
            let _ = upstream.shutdown(Shutdown::Both);
        }
    });
}

/// Start a named scoped thread; false if the system has none to give.
fn spawn<'scope, F: FnOnce() + Send + 'scope>(s: &'scope std::thread::Scope<'scope, '_>, name: &str, f: F) -> bool {
    std::thread::Builder::new().name(name.into()).spawn_scoped(s, f).is_ok()
}

/// Read from `src` whatever arrives and queue it for the writer with the time it is due.
/// `extra` is added to the first piece's due time (the handshake). Pieces a full shallow
/// buffer drops are counted in `c.drops`, the deepest queue in `c.max_queue_us`.
fn read_side(mut src: TcpStream, tx: Sender<Piece>, cfg: &NetemConfig, link: Option<&Link>, c: &NetemCounters, mut extra: Duration) {
    let delay = cfg.rtt / 2;
    let mut buf = vec![0u8; cfg.piece()];
    // (when the sender would see these bytes acknowledged, how many)
    let mut in_flight: VecDeque<(Instant, usize)> = VecDeque::new();
    let mut flying = 0usize;
    loop {
        let now = Instant::now();
        while let Some(&(at, n)) = in_flight.front() {
            if at > now {
                break;
            }
            flying -= n;
            in_flight.pop_front();
        }
        if flying >= cfg.window {
            // A full window: wait for the oldest bytes' acknowledgement.
            sleep_until(in_flight.front().expect("a full window holds bytes").0);
            continue;
        }
        let want = buf.len().min(cfg.window - flying);
        let n = match src.read(&mut buf[..want]) {
            Ok(0) => {
                let _ = tx.send(Piece::End { due: Instant::now() + delay + extra, reset: false });
                return;
            }
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => {
                let _ = tx.send(Piece::End { due: Instant::now() + delay + extra, reset: true });
                return;
            }
        };
        let left = match link {
            Some(l) => {
                let (start, end) = loop {
                    match l.try_book(n) {
                        Some(b) => break b,
                        None => {
                            // Dropped at a full buffer: the sender learns of it a round
                            // trip later and sends the piece again.
                            c.drops.fetch_add(1, Ordering::Relaxed);
                            std::thread::sleep(cfg.rtt.max(MIN_RETRANSMIT));
                        }
                    }
                };
                let queued = start.saturating_duration_since(Instant::now());
                c.max_queue_us.fetch_max(queued.as_micros() as u64, Ordering::Relaxed);
                if cfg.link != LinkModel::Deep {
                    // Wait until the link starts on these bytes (the push back), not until
                    // it is done with them: the next piece is then booked while this one is
                    // being sent, and the link never idles between pieces (waiting for the
                    // end left gaps of a wake-up each: a single connection got ~82% of the
                    // cap). A deep buffer takes the piece at once and reads on.
                    sleep_until(start);
                }
                // Credit never lets bytes arrive before they were read plus the delay.
                end.max(Instant::now())
            }
            None => Instant::now(),
        };
        let due = left + delay + std::mem::take(&mut extra);
        flying += n;
        in_flight.push_back((due + delay, n));
        if tx.send(Piece::Data(buf[..n].to_vec(), due)).is_err() {
            return; // the writer has gone: the connection is ending
        }
    }
}

/// Write each queued piece to `dst` when it is due. On a write failure or a reset, end the
/// whole connection (`dst` and `src`, the socket the pieces came from) so every thread of
/// it returns.
fn write_side(mut dst: TcpStream, rx: Receiver<Piece>, count: &AtomicU64, src: TcpStream) {
    let end_all = |dst: &TcpStream| {
        let _ = dst.shutdown(Shutdown::Both);
        let _ = src.shutdown(Shutdown::Both);
    };
    for piece in rx {
        match piece {
            Piece::Data(bytes, due) => {
                sleep_until(due);
                if dst.write_all(&bytes).is_err() {
                    end_all(&dst);
                    return;
                }
                count.fetch_add(bytes.len() as u64, Ordering::Relaxed);
            }
            Piece::End { due, reset } => {
                sleep_until(due);
                if reset {
                    // The last close of this socket then sends RST, as the source's did.
                    linger_zero(&dst);
                    end_all(&dst);
                } else {
                    let _ = dst.shutdown(Shutdown::Write);
                }
                return;
            }
        }
    }
}

/// Parse a bandwidth as `tc` writes it: `1gbit`, `200mbit`, `80Mbit`, `500kbit`, `1e9`
/// (bits per second, decimal prefixes). `0`, `none`, `off`: no cap (`None`).
pub fn parse_rate(s: &str) -> Result<Option<u64>, String> {
    let t = s.trim().to_ascii_lowercase();
    if matches!(t.as_str(), "0" | "none" | "off" | "unlimited") {
        return Ok(None);
    }
    let (num, mult) = [("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)]
        .iter()
        .find_map(|&(suffix, m)| t.strip_suffix(suffix).map(|n| (n, m)))
        .unwrap_or((t.as_str(), 1.0));
    let v: f64 = num.trim().parse().map_err(|_| format!("bad rate {s:?} (e.g. 1gbit, 200mbit, 0 for no cap)"))?;
    let bps = v * mult;
    if !(1.0..=1e13).contains(&bps) {
        return Err(format!("rate {s:?} out of range (1 bit/s to 10 Tbit/s)"));
    }
    Ok(Some(bps.round() as u64))
}

/// Parse a duration: `20ms`, `0.5ms`, `250us`, `1.5s`, or `0`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    if t == "0" {
        return Ok(Duration::ZERO);
    }
    let (num, secs) = [("us", 1e-6), ("ms", 1e-3), ("s", 1.0)]
        .iter()
        .find_map(|&(suffix, m)| t.strip_suffix(suffix).map(|n| (n, m)))
        .ok_or_else(|| format!("bad duration {s:?}: give a unit (e.g. 20ms, 250us, 1s)"))?;
    let v: f64 = num.trim().parse().map_err(|_| format!("bad duration {s:?} (e.g. 20ms, 250us, 1s)"))?;
    if !(0.0..=3600.0).contains(&(v * secs)) {
        return Err(format!("duration {s:?} out of range"));
    }
    Ok(Duration::from_secs_f64(v * secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_read_as_tc_writes_them() {
        assert_eq!(parse_rate("1gbit"), Ok(Some(1_000_000_000)));
        assert_eq!(parse_rate("200Mbit"), Ok(Some(200_000_000)));
        assert_eq!(parse_rate("1.5kbit"), Ok(Some(1500)));
        assert_eq!(parse_rate("80000"), Ok(Some(80_000)));
        assert_eq!(parse_rate("0"), Ok(None));
        assert_eq!(parse_rate("none"), Ok(None));
        assert!(parse_rate("fast").is_err());
        assert!(parse_rate("-1mbit").is_err());
        assert!(parse_rate("0.1bit").is_err());
    }

    #[test]
    fn durations_need_a_unit_except_zero() {
        assert_eq!(parse_duration("20ms"), Ok(Duration::from_millis(20)));
        assert_eq!(parse_duration("250us"), Ok(Duration::from_micros(250)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert!(parse_duration("20").is_err());
        assert!(parse_duration("-1ms").is_err());
    }

    #[test]
    fn a_shared_link_books_back_to_back() {
        // 8 Mbit/s = 1 byte per microsecond: bookings of 1000 bytes follow each other 1 ms
        // apart.
        let l = Link::new(8_000_000, None);
        let booked: Vec<(Instant, Instant)> = (0..3).map(|_| l.try_book(1000).unwrap()).collect();
        for w in booked.windows(2) {
            assert_eq!(w[1].0, w[0].1, "back to back");
            assert_eq!(w[1].1 - w[1].0, Duration::from_millis(1));
        }
        // Asked again 1 ms after the last booking ended (a hiccup): still back to back.
        let last = booked[2].1;
        assert_eq!(l.try_book_at(1000, last + Duration::from_millis(1)).unwrap().0, last, "a short gap is caught up");
        // Asked 2 x HICCUP after that one ended: no credit, from then, for the whole time.
        let later = last + Duration::from_millis(1) + 2 * HICCUP;
        assert_eq!(l.try_book_at(20_000, later), Some((later, later + Duration::from_millis(20))), "an idle link banks nothing");
    }

    #[test]
    fn a_shallow_buffer_drops_what_does_not_fit_and_never_an_empty_queues_piece() {
        // 8 Mbit/s: 1000 bytes take 1 ms; the buffer holds 2500 bytes (2.5 ms).
        let l = Link::new(8_000_000, Some(2500));
        let t0 = Instant::now() + Duration::from_secs(1);
        let ms = Duration::from_millis;
        // A piece larger than the buffer still enters an empty queue.
        assert_eq!(l.try_book_at(4000, t0), Some((t0, t0 + ms(4))));
        // At t0 + 2 ms, 2 ms are queued: 1000 bytes more (3 ms) do not fit.
        assert_eq!(l.try_book_at(1000, t0 + ms(2)), None, "dropped");
        // At t0 + 3 ms, 1 ms is queued: 1000 bytes fit (2 ms), then the queue is full.
        assert_eq!(l.try_book_at(1000, t0 + ms(3)), Some((t0 + ms(4), t0 + ms(5))));
        assert_eq!(l.try_book_at(1000, t0 + ms(3)), None);
        // A deep buffer takes anything.
        let deep = Link::new(8_000_000, None);
        assert!((0..100).all(|_| deep.try_book_at(4000, t0).is_some()));
    }

    #[test]
    fn configs_that_cannot_work_are_refused() {
        assert!(NetemConfig::new(Duration::ZERO).rate(0).validate().is_err());
        assert!(NetemConfig { window: 100, ..NetemConfig::default() }.validate().is_err());
        assert!(NetemConfig::new(Duration::ZERO).queue_limit(1 << 20).validate().is_err(), "a queue needs a link");
        assert!(NetemConfig::new(Duration::ZERO).rate(1_000_000).queue_limit(0).validate().is_err());
        assert!(NetemConfig::new(Duration::ZERO).rate(1_000_000).queue_limit(1 << 20).validate().is_ok());
        assert!(NetemConfig::new(Duration::ZERO).link(LinkModel::Deep).validate().is_err(), "a deep buffer needs a link");
        assert!(NetemConfig::new(Duration::ZERO).link(LinkModel::Shallow).validate().is_err());
        assert!(NetemConfig::new(Duration::ZERO).rate(1_000_000).link(LinkModel::Deep).validate().is_ok());
        let deep_with_limit = NetemConfig { queue_limit: Some(1 << 20), ..NetemConfig::new(Duration::ZERO).rate(1_000_000).link(LinkModel::Deep) };
        assert!(deep_with_limit.validate().is_err(), "a deep buffer has no limit");
        // A shallow buffer's default: 30 % of the bandwidth-delay product, at least 256 KiB.
        let shallow = |ms: u64| NetemConfig::new(Duration::from_millis(ms)).rate(1_000_000_000).link(LinkModel::Shallow);
        assert_eq!(shallow(20).shallow_limit(), Some(750_000));
        assert_eq!(shallow(2).shallow_limit(), Some(256 * 1024));
        assert_eq!(shallow(20).queue_limit(100_000).shallow_limit(), Some(100_000));
        assert_eq!(NetemConfig::new(Duration::ZERO).rate(1_000_000).link(LinkModel::Deep).shallow_limit(), None);
        assert_eq!("deep".parse::<LinkModel>(), Ok(LinkModel::Deep));
        assert!("bloat".parse::<LinkModel>().is_err());
        assert!(Netem::start_on("0.0.0.0:0".parse().unwrap(), "127.0.0.1:1", NetemConfig::default()).is_err(), "loopback only");
        assert_eq!(NetemConfig::new(Duration::ZERO).rate(1_000_000_000).piece(), 125_000);
        assert_eq!(NetemConfig::new(Duration::ZERO).rate(1000).piece(), MIN_PIECE);
    }
}
