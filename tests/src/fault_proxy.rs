//! A fault-injecting TCP proxy for HTTP/1.1, in front of a registry, for tests.
//!
//! `FaultProxy::start(upstream)` listens on 127.0.0.1:free-port and relays each client
//! connection to its own upstream connection, one thread per connection (the accept loop
//! and shutdown are [`crate::proxy`]'s, shared with [`crate::netem`]). It understands
//! HTTP/1.1 framing (request and response heads, `Content-Length` and `chunked` bodies,
//! bodies that end at close, `HEAD`/204/304 without bodies, interim 1xx), so keep-alive
//! connections work and a fault can hit exactly one response on a reused connection.
//!
//! Faults come from a [`Plan`] of [`Rule`]s shared behind `Arc<Mutex<_>>`: a test can
//! change it at any time (e.g. mid-transfer), and the next response consults it.
//!
//! | fault | what the client sees |
//! |---|---|
//! | [`Fault::Reset`] | the response starts, then after N bytes (head included) a TCP RST |
//! | [`Fault::Status`] | an injected status (503 by default) with a small JSON body; the request never reaches upstream |
//! | [`Fault::Truncate`] | the full head (with the original `Content-Length`), N body bytes, then FIN |
//! | [`Fault::FlipByte`] | the full, well-framed response with one body byte XOR 0xFF |
//! | [`Fault::Drip`] | the full head at once, then the body one byte at a time, slowly |
//! | [`Fault::Delay`] | the response, whole and correct, after the request waited in the proxy |
//! | [`Fault::Redirect`] | an injected redirect to the same target on another origin; the request never reaches upstream |
//! | [`Fault::MoveLocation`] | the response with its `Location` header moved to another origin (a registry handing uploads elsewhere) |
//!
//! [`FaultProxy::require_basic`] makes the proxy a registry that wants HTTP Basic
//! credentials, and [`Seen::authorization`] records what each request carried: together
//! with a second proxy as "another origin", that tests where a client sends credentials.
//!
//! The proxy is for tests only: it trusts its upstream, and it keeps no limits beyond a
//! bound on head sizes and chunk-size lines so a broken peer fails a test instead of
//! eating memory.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::proxy::{linger_zero, resolve, Acceptor, Tracked};

/// Longest request or response head the proxy accepts (bytes).
const MAX_HEAD: usize = 64 * 1024;
/// Relay buffer size.
const BUF: usize = 64 * 1024;
/// Idle timeout on both sides of a relayed connection, so a stuck peer ends its thread.
const IDLE: Duration = Duration::from_secs(60);

/// What to do to one response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Forward the response, but after `after` bytes of it (head included) reset the
    /// client connection (SO_LINGER 0, so the client sees ECONNRESET, not a clean EOF).
    Reset {
        /// Response bytes delivered before the reset.
        after: u64,
    },
    /// Do not forward the request; answer `status` with a small JSON error body and keep
    /// the connection alive (the request body is read and dropped).
    Status {
        /// Status code to answer (503 for "bursts of unavailability", 429, 500, ...).
        code: u16,
    },
    /// [`Fault::Status`] whose JSON error body says `message` (a registry's own words,
    /// such as "No space left on device").
    StatusSaying {
        /// Status code to answer.
        code: u16,
        /// The `message` of the body's one error.
        message: String,
    },
    /// Forward the head unchanged (so `Content-Length` promises the whole body), then
    /// only `after` bytes of the body, then close the connection (FIN).
    Truncate {
        /// Body bytes delivered before the close.
        after: u64,
    },
    /// Forward the whole response, with the body byte at offset `at` (of the decoded
    /// body; the last byte if the body is shorter) XORed with 0xFF. Bodies of length 0
    /// are left alone and do not use up the rule.
    FlipByte {
        /// Offset in the body.
        at: u64,
    },
    /// Forward the head at once, then the body one byte every `every`: a registry whose
    /// link barely moves. Every read sees progress, so only a deadline on the whole
    /// request ends it.
    Drip {
        /// Wait before each body byte.
        every: Duration,
    },
    /// Hold the request `by` before forwarding it: a registry (or a link) slow to answer
    /// this one request, everything else on time.
    Delay {
        /// How long the request waits.
        by: Duration,
    },
    /// Do not forward the request; answer `code` (301, 302, 303, 307, 308) with
    /// `Location: {to}{target}` (`to` an origin such as `http://127.0.0.1:PORT`).
    Redirect {
        /// Redirect status.
        code: u16,
        /// Origin to send the client to.
        to: String,
    },
    /// Forward, and point the response's `Location` header (absolute or relative) at
    /// origin `to`, keeping its path and query.
    MoveLocation {
        /// Origin the `Location` moves to.
        to: String,
    },
}

/// Which requests a rule applies to.
#[derive(Clone, Debug, Default)]
pub struct Match {
    /// HTTP method, e.g. `GET` (any when `None`).
    pub method: Option<String>,
    /// Substring of the request target, e.g. `/blobs/` (any when `None`).
    pub path_contains: Option<String>,
}

impl Match {
    /// Every request.
    pub fn any() -> Match {
        Match::default()
    }

    /// `GET`s of blobs: `/v2/<name>/blobs/<digest>` (uploads live under `/blobs/uploads/`
    /// and are excluded).
    pub fn blob_gets() -> Match {
        Match { method: Some("GET".into()), path_contains: Some("/blobs/sha256:".into()) }
    }

    /// Requests with this method whose target contains `path`.
    pub fn new(method: &str, path: &str) -> Match {
        Match { method: Some(method.to_string()), path_contains: Some(path.to_string()) }
    }

    fn matches(&self, method: &str, target: &str) -> bool {
        self.method.as_deref().is_none_or(|m| m.eq_ignore_ascii_case(method)) && self.path_contains.as_deref().is_none_or(|p| target.contains(p))
    }
}

/// One entry of a [`Plan`]: on matching requests, after letting `skip` through, apply
/// `fault` to the next `times` of them, each with probability `probability`.
#[derive(Clone, Debug)]
pub struct Rule {
    /// The fault.
    pub fault: Fault,
    /// Which requests.
    pub on: Match,
    /// Matching requests to let through untouched first (so `skip: n - 1` hits the n-th).
    pub skip: u64,
    /// How many faults to inject before the rule is spent (`u64::MAX`: forever).
    pub times: u64,
    /// Chance that an eligible request is hit (1.0: always). Deterministic: the plan's
    /// random generator is seeded (see [`Plan::seed`]).
    pub probability: f64,
}

impl Rule {
    /// `fault` on the next matching request of any kind, once.
    pub fn new(fault: Fault) -> Rule {
        Rule { fault, on: Match::any(), skip: 0, times: 1, probability: 1.0 }
    }
    /// Restrict to requests matching `m`.
    pub fn on(mut self, m: Match) -> Rule {
        self.on = m;
        self
    }
    /// Hit the `n`-th matching request (1-based) and, with `times`, the ones after it.
    pub fn nth(mut self, n: u64) -> Rule {
        self.skip = n.saturating_sub(1);
        self
    }
    /// Hit `k` requests in a row (a burst), or forever with `u64::MAX`.
    pub fn times(mut self, k: u64) -> Rule {
        self.times = k;
        self
    }
    /// Hit each eligible request with probability `p`.
    pub fn probability(mut self, p: f64) -> Rule {
        self.probability = p;
        self
    }
}

/// The faults to inject, consulted once per request. Rules are tried in order; the
/// first eligible one that fires wins.
#[derive(Debug)]
pub struct Plan {
    rules: Vec<Rule>,
    rng: u64,
}

impl Default for Plan {
    fn default() -> Plan {
        Plan { rules: Vec::new(), rng: 0x5eed_f00d_cafe_d00d }
    }
}

impl Plan {
    /// Add a rule.
    pub fn push(&mut self, r: Rule) {
        self.rules.push(r);
    }
    /// Remove every rule: pass everything through.
    pub fn clear(&mut self) {
        self.rules.clear();
    }
    /// Re-seed the generator behind [`Rule::probability`].
    pub fn seed(&mut self, seed: u64) {
        self.rng = seed | 1;
    }
    /// Rules still able to fire.
    pub fn pending(&self) -> usize {
        self.rules.iter().filter(|r| r.times > 0).count()
    }

    fn next_f64(&mut self) -> f64 {
        // xorshift64*: deterministic, good enough to spread faults in tests.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        (self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Decide the fault for a request, using up the rule that fires. `FlipByte` on an
    /// empty body is decided later (see [`Plan::refund`]).
    fn decide(&mut self, method: &str, target: &str) -> Option<Fault> {
        for i in 0..self.rules.len() {
            let r = &self.rules[i];
            if r.times == 0 || !r.on.matches(method, target) {
                continue;
            }
            if r.skip > 0 {
                self.rules[i].skip -= 1;
                continue;
            }
            let p = r.probability;
            if p < 1.0 && self.next_f64() >= p {
                continue;
            }
            let r = &mut self.rules[i];
            r.times = r.times.saturating_sub(if r.times == u64::MAX { 0 } else { 1 });
            return Some(r.fault.clone());
        }
        None
    }

    /// Give back a fault that could not be applied (a flip on an empty body).
    fn refund(&mut self, f: &Fault) {
        if let Some(r) = self.rules.iter_mut().find(|r| &r.fault == f && r.times != u64::MAX) {
            r.times += 1;
        }
    }
}

/// Pass-through counters, readable while the proxy runs.
#[derive(Debug, Default)]
pub struct Counters {
    /// Client connections accepted.
    pub connections: AtomicU64,
    /// Requests seen (including those answered by an injected status).
    pub requests: AtomicU64,
    /// Bytes from clients to upstream (heads and bodies, as relayed).
    pub bytes_up: AtomicU64,
    /// Bytes from upstream (or the proxy) to clients.
    pub bytes_down: AtomicU64,
    /// Faults injected.
    pub faults: AtomicU64,
}

/// One request as the proxy saw it.
#[derive(Clone, Debug)]
pub struct Seen {
    /// Method.
    pub method: String,
    /// Request target (path and query).
    pub target: String,
    /// Status sent to the client (0 if none got out).
    pub status: u16,
    /// The fault injected into its response, if any.
    pub fault: Option<Fault>,
    /// Its `Authorization` header, if it had one.
    pub authorization: Option<String>,
}

struct Shared {
    upstream: SocketAddr,
    plan: Arc<Mutex<Plan>>,
    counters: Counters,
    log: Mutex<Vec<Seen>>,
    /// `Basic …` a request must carry, else the proxy answers 401 itself.
    require: Mutex<Option<String>>,
}

/// A running proxy; stopped (listener closed, live connections shut down, threads
/// joined) on drop.
pub struct FaultProxy {
    /// `127.0.0.1:PORT` the proxy listens on.
    pub addr: String,
    shared: Arc<Shared>,
    _acceptor: Acceptor,
}

impl FaultProxy {
    /// Start a proxy on 127.0.0.1:free-port in front of `upstream` (e.g. `127.0.0.1:5000`).
    pub fn start(upstream: impl ToSocketAddrs) -> io::Result<FaultProxy> {
        let upstream = resolve(upstream)?;
        let shared = Arc::new(Shared {
            upstream,
            plan: Arc::new(Mutex::new(Plan::default())),
            counters: Counters::default(),
            log: Mutex::new(Vec::new()),
            require: Mutex::new(None),
        });
        let sh = shared.clone();
        let acceptor = Acceptor::start(SocketAddr::from(([127, 0, 0, 1], 0)), "fault-proxy", move |client, tracked| {
            sh.counters.connections.fetch_add(1, Ordering::Relaxed);
            let _ = relay(&sh, client, tracked);
        })?;
        Ok(FaultProxy { addr: acceptor.addr.to_string(), shared, _acceptor: acceptor })
    }

    /// `http://127.0.0.1:PORT` + path.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// The plan, to change at any time.
    pub fn plan(&self) -> Arc<Mutex<Plan>> {
        self.shared.plan.clone()
    }

    /// Add a rule to the plan.
    pub fn add(&self, r: Rule) {
        self.shared.plan.lock().unwrap().push(r);
    }

    /// Drop every rule.
    pub fn clear(&self) {
        self.shared.plan.lock().unwrap().clear();
    }

    /// The counters.
    pub fn counters(&self) -> &Counters {
        &self.shared.counters
    }

    /// Requests seen so far.
    pub fn requests(&self) -> u64 {
        self.shared.counters.requests.load(Ordering::Relaxed)
    }

    /// Faults injected so far.
    pub fn faults(&self) -> u64 {
        self.shared.counters.faults.load(Ordering::Relaxed)
    }

    /// Bytes relayed towards clients so far.
    pub fn bytes_down(&self) -> u64 {
        self.shared.counters.bytes_down.load(Ordering::Relaxed)
    }

    /// Bytes relayed towards upstream so far.
    pub fn bytes_up(&self) -> u64 {
        self.shared.counters.bytes_up.load(Ordering::Relaxed)
    }

    /// Every request seen, in the order their responses started.
    pub fn log(&self) -> Vec<Seen> {
        self.shared.log.lock().unwrap().clone()
    }

    /// From now on, answer any request that lacks `Authorization: Basic base64(user:password)`
    /// with 401 and `WWW-Authenticate: Basic realm="fault-proxy"` (not forwarded): the
    /// proxy plays a registry that wants Basic credentials.
    pub fn require_basic(&self, user: &str, password: &str) {
        use base64::Engine;
        let b = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        *self.shared.require.lock().unwrap() = Some(format!("Basic {b}"));
    }

    /// `http://127.0.0.1:PORT`: the proxy's origin, for [`Fault::Redirect`] and
    /// [`Fault::MoveLocation`] of another proxy.
    pub fn origin(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// A parsed message head: the raw bytes to forward plus what framing needs.
struct Head {
    raw: Vec<u8>,
    /// Request: method; response: empty.
    method: String,
    /// Request: target; response: status code as text.
    target: String,
    status: u16,
    content_length: Option<u64>,
    chunked: bool,
    close: bool,
    expect_continue: bool,
    authorization: Option<String>,
}

/// Read one head (up to and including the blank line). `Ok(None)` on a clean EOF
/// before any byte.
fn read_head(r: &mut impl BufRead, request: bool) -> io::Result<Option<Head>> {
    let mut raw = Vec::new();
    loop {
        let n = r.take((MAX_HEAD - raw.len()) as u64 + 1).read_until(b'\n', &mut raw)?;
        if n == 0 {
            if raw.is_empty() {
                return Ok(None);
            }
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "EOF inside a message head"));
        }
        if raw.len() > MAX_HEAD {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "message head too large"));
        }
        // Tolerate stray blank lines between keep-alive messages (RFC 9112 2.2).
        if raw == b"\r\n" || raw == b"\n" {
            raw.clear();
            continue;
        }
        if raw.ends_with(b"\r\n\r\n") || raw.ends_with(b"\n\n") {
            break;
        }
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let mut lines = text.lines();
    let first = lines.next().unwrap_or_default();
    let mut parts = first.split_whitespace();
    let (a, b) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("bad {what}: {first:?}"));
    let (method, target, status) = if request {
        if b.is_empty() {
            return Err(bad("request line"));
        }
        (a.to_string(), b.to_string(), 0)
    } else {
        let code: u16 = b.parse().map_err(|_| bad("status line"))?;
        (String::new(), b.to_string(), code)
    };
    let http10 = first.contains("HTTP/1.0");
    let mut h = Head { raw, method, target, status, content_length: None, chunked: false, close: http10, expect_continue: false, authorization: None };
    for line in lines {
        let Some((k, v)) = line.split_once(':') else { continue };
        if k.trim().eq_ignore_ascii_case("authorization") {
            h.authorization = Some(v.trim().to_string());
        }
        let (k, v) = (k.trim().to_ascii_lowercase(), v.trim().to_ascii_lowercase());
        match k.as_str() {
            "content-length" => h.content_length = Some(v.parse().map_err(|_| bad("content-length"))?),
            "transfer-encoding" => h.chunked = v.split(',').any(|t| t.trim() == "chunked"),
            "connection" if v.split(',').any(|t| t.trim() == "close") => h.close = true,
            "connection" if v.split(',').any(|t| t.trim() == "keep-alive") => h.close = false,
            "expect" => h.expect_continue = v == "100-continue",
            _ => {}
        }
    }
    Ok(Some(h))
}

/// The head without its `Expect: 100-continue` line (the proxy answers that itself).
fn strip_expect(raw: &[u8]) -> Vec<u8> {
    let text = String::from_utf8_lossy(raw);
    text.split_inclusive('\n').filter(|l| !l.to_ascii_lowercase().starts_with("expect:")).collect::<String>().into_bytes()
}

/// The head with its `Location` header pointed at origin `to` (path and query kept).
fn move_location(raw: &[u8], to: &str) -> Vec<u8> {
    let text = String::from_utf8_lossy(raw);
    text.split_inclusive('\n')
        .map(|l| match l.split_once(':') {
            Some((k, v)) if k.trim().eq_ignore_ascii_case("location") => {
                let v = v.trim();
                // Absolute: drop scheme and authority; relative: keep it as it is.
                let path = match v.split_once("://") {
                    Some((_, rest)) => rest.find('/').map_or("/", |i| &rest[i..]),
                    None => v,
                };
                format!("Location: {to}{path}\r\n")
            }
            _ => l.to_string(),
        })
        .collect::<String>()
        .into_bytes()
}

/// Write a small response the proxy makes up itself (JSON body), keeping the connection
/// unless the request asked to close it.
fn answer(sh: &Shared, w: &mut TcpStream, req: &Head, code: u16, extra: &str, message: &str) -> io::Result<()> {
    let body = serde_json::json!({"errors": [{"code": "UNAVAILABLE", "message": message}]}).to_string();
    let resp = format!(
        "HTTP/1.1 {code} Injected\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{extra}{}\r\n{body}",
        body.len(),
        if req.close { "Connection: close\r\n" } else { "" }
    );
    w.write_all(resp.as_bytes())?;
    sh.counters.bytes_down.fetch_add(resp.len() as u64, Ordering::Relaxed);
    Ok(())
}

/// Where relayed body bytes go: a writer that may flip, cut or reset.
struct Sink<'a> {
    out: &'a mut TcpStream,
    counters: &'a Counters,
    /// Response bytes written so far (head included) — for `Reset`.
    written: u64,
    /// Decoded body bytes passed so far — for `Truncate` and `FlipByte`.
    body_pos: u64,
    fault: Option<Fault>,
    /// For `FlipByte`: the body length when known up front (to place "the last byte").
    body_len: Option<u64>,
    flipped: bool,
    counting: bool,
}

/// One relay step: `Ok` goes on; `Err(Ok(cut))` ends the message on purpose (a fault);
/// `Err(Err(e))` is a real I/O failure.
type Step = Result<(), Result<Cut, io::Error>>;

/// Why a relay stopped early on purpose.
#[derive(Debug)]
enum Cut {
    /// Reset the client.
    Reset,
    /// Close the client (FIN).
    Close,
}

impl Sink<'_> {
    /// Write bytes of the message that are not body payload (head, chunk framing).
    fn frame(&mut self, data: &[u8]) -> Step {
        self.emit(data)
    }

    /// Write body payload bytes.
    fn body(&mut self, data: &[u8]) -> Step {
        match self.fault {
            Some(Fault::Truncate { after }) => {
                let room = after.saturating_sub(self.body_pos);
                if room < data.len() as u64 {
                    self.emit(&data[..room as usize])?;
                    self.body_pos += room;
                    return Err(Ok(Cut::Close));
                }
            }
            Some(Fault::Drip { every }) => {
                for b in data {
                    std::thread::sleep(every);
                    self.emit(std::slice::from_ref(b))?;
                    self.body_pos += 1;
                }
                return Ok(());
            }
            Some(Fault::FlipByte { at }) if !self.flipped => {
                let at = match self.body_len {
                    Some(len) if len > 0 => at.min(len - 1),
                    _ => at,
                };
                if at >= self.body_pos && at < self.body_pos + data.len() as u64 {
                    let mut copy = data.to_vec();
                    copy[(at - self.body_pos) as usize] ^= 0xFF;
                    self.flipped = true;
                    self.body_pos += data.len() as u64;
                    return self.emit(&copy);
                }
            }
            _ => {}
        }
        self.body_pos += data.len() as u64;
        self.emit(data)
    }

    fn emit(&mut self, data: &[u8]) -> Step {
        let mut data = data;
        let mut cut = None;
        if let Some(Fault::Reset { after }) = self.fault {
            let room = after.saturating_sub(self.written);
            if room < data.len() as u64 {
                data = &data[..room as usize];
                cut = Some(Cut::Reset);
            }
        }
        self.out.write_all(data).map_err(Err)?;
        self.written += data.len() as u64;
        if self.counting {
            self.counters.bytes_down.fetch_add(data.len() as u64, Ordering::Relaxed);
        }
        match cut {
            Some(c) => Err(Ok(c)),
            None => Ok(()),
        }
    }
}

/// Copy exactly `n` bytes from `r` to `f`.
fn copy_n(r: &mut impl Read, n: u64, mut f: impl FnMut(&[u8]) -> Step) -> Step {
    let mut left = n;
    let mut buf = vec![0u8; BUF];
    while left > 0 {
        let want = left.min(BUF as u64) as usize;
        let got = r.read(&mut buf[..want]).map_err(Err)?;
        if got == 0 {
            return Err(Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed inside a body")));
        }
        f(&buf[..got])?;
        left -= got as u64;
    }
    Ok(())
}

/// Read one line (chunk size line or trailer line), bounded.
fn read_line(r: &mut impl BufRead) -> io::Result<Vec<u8>> {
    let mut line = Vec::new();
    r.take(4096).read_until(b'\n', &mut line)?;
    if !line.ends_with(b"\n") {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "bad chunk framing"));
    }
    Ok(line)
}

/// Relay a chunked body through `frame(bytes, is_payload)`: chunk-size lines, CRLFs and
/// trailers with `false`, chunk data with `true`.
fn relay_chunked(r: &mut impl BufRead, frame: &mut dyn FnMut(&[u8], bool) -> Step) -> Step {
    loop {
        let line = read_line(r).map_err(Err)?;
        let text = String::from_utf8_lossy(&line);
        let size_hex = text.trim().split(';').next().unwrap_or_default().trim();
        let size = u64::from_str_radix(size_hex, 16).map_err(|_| Err(io::Error::new(io::ErrorKind::InvalidData, "bad chunk size")))?;
        frame(&line, false)?;
        if size == 0 {
            // Trailers, then the final blank line.
            loop {
                let t = read_line(r).map_err(Err)?;
                frame(&t, false)?;
                if t == b"\r\n" || t == b"\n" {
                    return Ok(());
                }
            }
        }
        copy_n(r, size, |d| frame(d, true))?;
        let crlf = read_line(r).map_err(Err)?;
        frame(&crlf, false)?;
    }
}

/// Serve one client connection until either side closes or a fault ends it.
fn relay(sh: &Shared, client: TcpStream, tracked: &Tracked) -> io::Result<()> {
    client.set_read_timeout(Some(IDLE))?;
    let _ = client.set_nodelay(true);
    let mut client_w = client.try_clone()?;
    let mut client_r = BufReader::with_capacity(BUF, client.try_clone()?);
    let mut upstream: Option<(TcpStream, BufReader<TcpStream>)> = None;

    loop {
        let Some(req) = read_head(&mut client_r, true)? else { return Ok(()) };
        if tracked.stopping() {
            return Ok(());
        }
        sh.counters.requests.fetch_add(1, Ordering::Relaxed);
        if req.expect_continue {
            client_w.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")?;
        }
        let required = sh.require.lock().unwrap().clone();
        if required.is_some() && req.authorization != required {
            drain_request_body(&mut client_r, &req)?;
            answer(sh, &mut client_w, &req, 401, "WWW-Authenticate: Basic realm=\"fault-proxy\"\r\n", "credentials required")?;
            sh.log.lock().unwrap().push(Seen { method: req.method, target: req.target, status: 401, fault: None, authorization: req.authorization });
            if req.close {
                return Ok(());
            }
            continue;
        }
        let fault = sh.plan.lock().unwrap().decide(&req.method, &req.target);

        let made_up = match &fault {
            Some(Fault::Status { code }) => Some((*code, String::new(), format!("fault proxy: injected {code}"))),
            Some(Fault::StatusSaying { code, message }) => Some((*code, String::new(), message.clone())),
            Some(Fault::Redirect { code, to }) => Some((*code, format!("Location: {to}{}\r\n", req.target), format!("fault proxy: injected redirect {code}"))),
            _ => None,
        };
        if let Some((code, extra, message)) = made_up {
            // Drain the request body, answer ourselves, keep the connection.
            drain_request_body(&mut client_r, &req)?;
            sh.counters.faults.fetch_add(1, Ordering::Relaxed);
            answer(sh, &mut client_w, &req, code, &extra, &message)?;
            sh.log.lock().unwrap().push(Seen { method: req.method, target: req.target, status: code, fault, authorization: req.authorization });
            if req.close {
                return Ok(());
            }
            continue;
        }

        if let Some(Fault::Delay { by }) = &fault {
            sh.counters.faults.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(*by);
        }
        // Forward the request.
        if upstream.is_none() {
            let u = TcpStream::connect(sh.upstream)?;
            tracked.add(&u);
            u.set_read_timeout(Some(IDLE))?;
            let _ = u.set_nodelay(true);
            let r = BufReader::with_capacity(BUF, u.try_clone()?);
            upstream = Some((u, r));
        }
        let (up_w, up_r) = upstream.as_mut().expect("connected above");
        let head = if req.expect_continue { strip_expect(&req.raw) } else { req.raw.clone() };
        up_w.write_all(&head)?;
        sh.counters.bytes_up.fetch_add(head.len() as u64, Ordering::Relaxed);
        forward_request_body(&mut client_r, up_w, &req, &sh.counters)?;

        // Read the response head, passing interim 1xx responses through.
        let resp = loop {
            let Some(h) = read_head(up_r, false)? else {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "upstream closed before responding"));
            };
            if (100..200).contains(&h.status) && h.status != 101 {
                client_w.write_all(&h.raw)?;
                continue;
            }
            break h;
        };
        let no_body = req.method.eq_ignore_ascii_case("HEAD") || resp.status == 204 || resp.status == 304;
        let until_close = !no_body && !resp.chunked && resp.content_length.is_none();

        let mut fault = fault;
        if let (Some(f @ Fault::FlipByte { .. }), true) = (&fault, no_body || resp.content_length == Some(0)) {
            // Nothing to flip: give the fault back for the next response.
            sh.plan.lock().unwrap().refund(f);
            fault = None;
        }
        if fault.is_some() {
            sh.counters.faults.fetch_add(1, Ordering::Relaxed);
        }
        sh.log.lock().unwrap().push(Seen {
            method: req.method.clone(),
            target: req.target.clone(),
            status: resp.status,
            fault: fault.clone(),
            authorization: req.authorization.clone(),
        });
        let resp_raw = match &fault {
            Some(Fault::MoveLocation { to }) => move_location(&resp.raw, to),
            _ => resp.raw.clone(),
        };

        let mut sink =
            Sink { out: &mut client_w, counters: &sh.counters, written: 0, body_pos: 0, fault, body_len: resp.content_length, flipped: false, counting: true };
        let result = (|| {
            sink.frame(&resp_raw)?;
            if no_body {
                return Ok(());
            }
            if resp.chunked {
                relay_chunked(up_r, &mut |d, payload| if payload { sink.body(d) } else { sink.frame(d) })
            } else if let Some(n) = resp.content_length {
                copy_n(up_r, n, |d| sink.body(d))
            } else {
                // Body ends when upstream closes.
                let mut buf = vec![0u8; BUF];
                loop {
                    let n = up_r.read(&mut buf).map_err(Err)?;
                    if n == 0 {
                        return Ok(());
                    }
                    sink.body(&buf[..n])?;
                }
            }
        })();
        match result {
            Ok(()) => {}
            Err(Ok(Cut::Reset)) => {
                linger_zero(&client_w);
                return Ok(());
            }
            Err(Ok(Cut::Close)) => {
                let _ = client_w.flush();
                let _ = client_w.shutdown(Shutdown::Both);
                return Ok(());
            }
            Err(Err(e)) => return Err(e),
        }
        if req.close || resp.close || until_close {
            let _ = client_w.shutdown(Shutdown::Write);
            return Ok(());
        }
    }
}

/// Request bodies are never cut on purpose; a `Cut` there would be a bug in this file.
fn cut_to_io(e: Result<Cut, io::Error>) -> io::Error {
    match e {
        Ok(cut) => io::Error::other(format!("unexpected {cut:?} in a request body")),
        Err(e) => e,
    }
}

fn forward_request_body(r: &mut BufReader<TcpStream>, up: &mut TcpStream, req: &Head, c: &Counters) -> io::Result<()> {
    let mut emit = |d: &[u8]| -> Step {
        up.write_all(d).map_err(Err)?;
        c.bytes_up.fetch_add(d.len() as u64, Ordering::Relaxed);
        Ok(())
    };
    let res = if req.chunked {
        relay_chunked(r, &mut |d, _| emit(d))
    } else if let Some(n) = req.content_length {
        copy_n(r, n, emit)
    } else {
        Ok(())
    };
    res.map_err(cut_to_io)
}

fn drain_request_body(r: &mut BufReader<TcpStream>, req: &Head) -> io::Result<()> {
    let res = if req.chunked {
        relay_chunked(r, &mut |_, _| Ok(()))
    } else if let Some(n) = req.content_length {
        copy_n(r, n, |_| Ok(()))
    } else {
        Ok(())
    };
    res.map_err(cut_to_io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nth_rule_skips_then_fires_once() {
        let mut p = Plan::default();
        p.push(Rule::new(Fault::Status { code: 503 }).on(Match::blob_gets()).nth(2));
        assert_eq!(p.decide("GET", "/v2/a/blobs/sha256:00"), None);
        assert_eq!(p.decide("GET", "/v2/a/manifests/x"), None);
        assert_eq!(p.decide("GET", "/v2/a/blobs/sha256:00"), Some(Fault::Status { code: 503 }));
        assert_eq!(p.decide("GET", "/v2/a/blobs/sha256:00"), None);
        assert_eq!(p.pending(), 0);
    }

    #[test]
    fn burst_and_forever() {
        let mut p = Plan::default();
        p.push(Rule::new(Fault::Status { code: 503 }).times(3));
        let hits = (0..5).filter(|_| p.decide("HEAD", "/v2/").is_some()).count();
        assert_eq!(hits, 3);
        p.clear();
        p.push(Rule::new(Fault::Truncate { after: 1 }).times(u64::MAX));
        assert!((0..100).all(|_| p.decide("GET", "/").is_some()));
    }

    #[test]
    fn probability_is_roughly_respected_and_deterministic() {
        let run = || {
            let mut p = Plan::default();
            p.push(Rule::new(Fault::FlipByte { at: 0 }).times(u64::MAX).probability(0.25));
            (0..4000).map(|_| p.decide("GET", "/").is_some()).collect::<Vec<_>>()
        };
        let a = run();
        assert_eq!(a, run());
        let hits = a.iter().filter(|h| **h).count();
        assert!((800..1200).contains(&hits), "{hits} hits of 4000 at p=0.25");
    }

    #[test]
    fn head_parsing_finds_framing() {
        let raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: Close\r\n\r\n";
        let h = read_head(&mut &raw[..], false).unwrap().unwrap();
        assert!(h.chunked && h.close);
        assert_eq!(h.status, 200);
        let raw = b"PUT /v2/x HTTP/1.1\r\nContent-Length: 12\r\nExpect: 100-continue\r\n\r\n";
        let h = read_head(&mut &raw[..], true).unwrap().unwrap();
        assert_eq!((h.method.as_str(), h.content_length, h.expect_continue), ("PUT", Some(12), true));
        assert!(read_head(&mut &b"GET / HTTP/1.1\r\nHost: x\r\n"[..], true).is_err());
        let huge = vec![b'a'; MAX_HEAD + 10];
        assert!(read_head(&mut &huge[..], true).is_err());
        let raw = b"GET / HTTP/1.1\r\nauthorization:  Basic eDp5 \r\n\r\n";
        assert_eq!(read_head(&mut &raw[..], true).unwrap().unwrap().authorization.as_deref(), Some("Basic eDp5"));
    }

    #[test]
    fn location_moves_to_another_origin() {
        let to = "http://127.0.0.1:9";
        let raw = b"HTTP/1.1 202 Accepted\r\nlocation: http://127.0.0.1:5000/v2/a/blobs/uploads/u?_state=x\r\nRange: 0-0\r\n\r\n";
        let moved = String::from_utf8(move_location(raw, to)).unwrap();
        assert_eq!(moved, "HTTP/1.1 202 Accepted\r\nLocation: http://127.0.0.1:9/v2/a/blobs/uploads/u?_state=x\r\nRange: 0-0\r\n\r\n");
        let raw = b"HTTP/1.1 202 Accepted\r\nLocation: /v2/a/blobs/uploads/u\r\n\r\n";
        assert!(String::from_utf8(move_location(raw, to)).unwrap().contains("Location: http://127.0.0.1:9/v2/a/blobs/uploads/u\r\n"));
    }
}
