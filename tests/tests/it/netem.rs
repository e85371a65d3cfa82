//! The dialled network (`snapctl_tests::netem`, issue 16 §1): every byte pays half an RTT
//! each way, connections and the bytes within one connection are pipelined rather than
//! taking turns, a bandwidth cap is shared by all connections, the bottleneck pushes back
//! on its senders (window) or queues everything in one FIFO (deep), and `snapctl pull`
//! works across it. The `netem_proxy` program starts, says where it listens, and stops.
//!
//! Timing assertions are lower bounds (a delay the proxy promises), except where the point is
//! that things overlap: there the bound is half or less of what taking turns would cost, so a
//! loaded machine has hundreds of milliseconds of slack.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use reqwest::blocking::Client;
use snapctl_tests::netem::{LinkModel, Netem, NetemConfig};
use snapctl_tests::registry_support::{random_bytes, sha256, Serve};
use snapctl_tests::{run, snapctl};

const MS: Duration = Duration::from_millis(1);

/// A `snapctl serve` holding a blob of `len` random bytes in repo `net/blob` (uploaded
/// directly, not through any proxy), and the blob's digest.
fn serve_with_blob(len: usize) -> (tempfile::TempDir, Serve, Vec<u8>, String) {
    let tmp = tempfile::tempdir().unwrap();
    let s = Serve::start(tmp.path().join("store").to_str().unwrap(), &[], &[]);
    let data = random_bytes(len as u64, len);
    let d = sha256(&data);
    let r = Client::new().post(s.url(&format!("/v2/net/blob/blobs/uploads/?digest={d}"))).body(data.clone()).send().unwrap();
    assert_eq!(r.status(), 201, "{}", r.text().unwrap_or_default());
    (tmp, s, data, d)
}

/// One HTTP/1.1 GET on a kept-alive connection; returns the status line once the whole
/// body (Content-Length framing: the registry's `/v2/`) has arrived.
fn get(conn: &mut BufReader<TcpStream>, path: &str) -> String {
    write!(conn.get_mut(), "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut status = String::new();
    conn.read_line(&mut status).unwrap();
    let mut len = 0usize;
    loop {
        let mut l = String::new();
        conn.read_line(&mut l).unwrap();
        if l == "\r\n" {
            break;
        }
        if let Some(v) = l.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap();
        }
    }
    let mut body = vec![0u8; len];
    conn.read_exact(&mut body).unwrap();
    status.trim().to_string()
}

fn connect(addr: &str) -> BufReader<TcpStream> {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    BufReader::new(s)
}

#[test]
fn a_request_through_a_40ms_rtt_proxy_takes_at_least_40ms_and_a_fresh_connection_one_rtt_more() {
    let (_t, s, _, _) = serve_with_blob(1);
    let rtt = 40 * MS;
    let net = Netem::start(s.addr.as_str(), NetemConfig::new(rtt)).unwrap();
    let t0 = Instant::now();
    let mut c = connect(&net.addr);
    assert_eq!(get(&mut c, "/v2/"), "HTTP/1.1 200 OK");
    let first = t0.elapsed();
    let t1 = Instant::now();
    assert_eq!(get(&mut c, "/v2/"), "HTTP/1.1 200 OK");
    let second = t1.elapsed();
    assert!(first >= 2 * rtt, "a request on a fresh connection took {first:?}, under handshake + 1 RTT ({:?})", 2 * rtt);
    assert!(second >= rtt, "a request on a kept-alive connection took {second:?}, under 1 RTT ({rtt:?})");

    let quick = Netem::start(s.addr.as_str(), NetemConfig { handshake: false, ..NetemConfig::new(rtt) }).unwrap();
    let t0 = Instant::now();
    let mut c = connect(&quick.addr);
    assert_eq!(get(&mut c, "/v2/"), "HTTP/1.1 200 OK");
    assert!(t0.elapsed() >= rtt, "without the handshake a request still takes 1 RTT; took {:?}", t0.elapsed());
    assert_eq!((net.connections(), quick.connections()), (1, 1));
}

#[test]
fn concurrent_connections_each_pay_their_own_round_trips_not_each_others() {
    let (_t, s, _, _) = serve_with_blob(1);
    let rtt = 200 * MS;
    let net = Netem::start(s.addr.as_str(), NetemConfig::new(rtt)).unwrap();
    let n = 8;
    let go = Arc::new(Barrier::new(n + 1));
    let threads: Vec<_> = (0..n)
        .map(|_| {
            let (addr, go) = (net.addr.clone(), go.clone());
            std::thread::spawn(move || {
                go.wait();
                let t = Instant::now();
                let mut c = connect(&addr);
                assert_eq!(get(&mut c, "/v2/"), "HTTP/1.1 200 OK");
                t.elapsed()
            })
        })
        .collect();
    go.wait();
    let t0 = Instant::now();
    let each: Vec<Duration> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let total = t0.elapsed();
    // Each: handshake + 1 RTT = 400 ms. Taking turns: 8 x 400 ms = 3.2 s.
    for e in &each {
        assert!(*e >= 2 * rtt, "a request took {e:?}, under handshake + 1 RTT");
    }
    assert!(total < n as u32 * 2 * rtt / 2, "{n} concurrent requests took {total:?}: they took turns ({each:?})");
    assert_eq!(net.connections(), n as u64);
}

/// A TCP echo server on 127.0.0.1 (one thread per connection), for timing single bytes.
fn echo_server() -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { continue };
            std::thread::spawn(move || {
                let mut w = c.try_clone().unwrap();
                let _ = std::io::copy(&mut c, &mut w);
            });
        }
    });
    addr
}

#[test]
fn bytes_sent_one_after_another_on_one_connection_travel_together() {
    // 12 single bytes sent 50 ms apart through 200 ms of RTT: each echo comes back 1 RTT
    // after its byte was sent, with the others in flight meanwhile; not after the echo
    // before it (one round trip at a time), nor batched with later bytes (a relay that
    // only reads again once it has delivered what it read: up to +100 ms each way).
    let rtt = 200 * MS;
    let net = Netem::start(echo_server(), NetemConfig { handshake: false, ..NetemConfig::new(rtt) }).unwrap();
    let mut s = TcpStream::connect(&net.addr).unwrap();
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut r = s.try_clone().unwrap();
    let n = 12;
    let sender = std::thread::spawn(move || {
        let mut sent = Vec::new();
        for i in 0..n {
            sent.push(Instant::now());
            s.write_all(&[i as u8]).unwrap();
            std::thread::sleep(50 * MS);
        }
        sent
    });
    let mut back = Vec::new();
    let mut b = [0u8; 1];
    for i in 0..n {
        r.read_exact(&mut b).unwrap();
        assert_eq!(b[0], i as u8, "bytes in order");
        back.push(Instant::now());
    }
    let sent = sender.join().unwrap();
    let mut took: Vec<Duration> = sent.iter().zip(&back).map(|(s, b)| *b - *s).collect();
    for (i, t) in took.iter().enumerate() {
        assert!(*t >= rtt, "byte {i} came back after {t:?}, under 1 RTT");
    }
    took.sort();
    // The median, so one late wake-up on a loaded machine does not decide; 100 ms of slack.
    let median = took[n / 2];
    assert!(median < rtt * 3 / 2, "echoes took {median:?} (median) for a {rtt:?} RTT: bytes wait for each other ({took:?})");
}

#[test]
fn one_connection_keeps_a_window_of_bytes_in_flight_not_one_piece_per_round_trip() {
    // 20 MB at 100 ms RTT, no cap: with 16 MiB in flight that is a few round trips
    // (~0.5 s); a relay that held each piece until it was delivered (or acknowledged)
    // before reading the next would move 256 KiB per 50-100 ms: 4-8 s.
    let len = 20_000_000;
    let (_t, s, _, d) = serve_with_blob(len);
    let net = Netem::start(s.addr.as_str(), NetemConfig::new(100 * MS)).unwrap();
    let t0 = Instant::now();
    let body = Client::new().get(net.url(&format!("/v2/net/blob/blobs/{d}"))).send().unwrap().error_for_status().unwrap().bytes().unwrap();
    let took = t0.elapsed();
    assert_eq!(sha256(&body), d, "bytes arrive unchanged");
    assert!(took >= 200 * MS, "handshake + 1 RTT at least: {took:?}");
    assert!(took < Duration::from_secs(2), "20 MB over one connection at 100 ms RTT took {took:?}: one piece per round trip?");

    // And the window is what bounds a connection: 2 MiB per 100 ms RTT moves 20 MB in >= 0.95 s.
    let narrow = Netem::start(s.addr.as_str(), NetemConfig { window: 2 << 20, ..NetemConfig::new(100 * MS) }).unwrap();
    let t0 = Instant::now();
    let body = Client::new().get(narrow.url(&format!("/v2/net/blob/blobs/{d}"))).send().unwrap().bytes().unwrap();
    let slow = t0.elapsed();
    assert_eq!(body.len(), len);
    assert!(slow >= Duration::from_millis(900), "a 2 MiB window at 100 ms RTT moved 20 MB in {slow:?}");
}

#[test]
fn a_bandwidth_cap_is_a_lower_bound_on_time_and_shared_by_all_connections() {
    let len = 10_000_000;
    let (_t, s, _, d) = serve_with_blob(len);
    let rate = 80_000_000; // 80 Mbit/s: 10 MB takes 1 s
    let net = Netem::start(s.addr.as_str(), NetemConfig::new(2 * MS).rate(rate)).unwrap();
    let url = net.url(&format!("/v2/net/blob/blobs/{d}"));

    // One connection, 20 MB (the blob twice, kept alive): >= 2 s at 80 Mbit/s.
    let client = Client::builder().timeout(Duration::from_secs(120)).build().unwrap();
    let t0 = Instant::now();
    for _ in 0..2 {
        let body = client.get(&url).send().unwrap().error_for_status().unwrap().bytes().unwrap();
        assert_eq!(sha256(&body), d, "bytes arrive unchanged");
    }
    let one = t0.elapsed();
    assert!(one >= Duration::from_millis(1800), "20 MB at 80 Mbit/s took {one:?}, under 1.8 s");

    // Two connections at once, 10 MB each: they share the link, so together >= ~2 s too.
    let t0 = Instant::now();
    let both: Vec<_> = (0..2)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || Client::builder().timeout(Duration::from_secs(120)).build().unwrap().get(&url).send().unwrap().bytes().unwrap())
        })
        .collect();
    for t in both {
        assert_eq!(t.join().unwrap().len(), len);
    }
    let shared = t0.elapsed();
    assert!(shared >= Duration::from_millis(1800), "2 x 10 MB on two connections took {shared:?}: the cap is not shared");

    // The other direction has its own link: an upload of 10 MB takes >= ~1 s.
    let up = random_bytes(7, len);
    let ud = sha256(&up);
    let t0 = Instant::now();
    let r = client.post(net.url(&format!("/v2/net/up/blobs/uploads/?digest={ud}"))).body(up).send().unwrap();
    let upload = t0.elapsed();
    assert_eq!(r.status(), 201);
    assert!(upload >= Duration::from_millis(900), "a 10 MB upload at 80 Mbit/s took {upload:?}");
    assert!(net.bytes_down() >= 4 * len as u64 && net.bytes_up() >= len as u64, "counters: {} down, {} up", net.bytes_down(), net.bytes_up());
}

/// Through a 40 Mbit/s link at 20 ms of RTT (`link`): a 4 MB download (0.8 s of link time)
/// on one connection and, 100 ms after it was asked for, a `/v2/` on another connection
/// already open. Returns (the small request's time, when its answer came against when the
/// download's last byte did (positive: after), the download's time, the proxy).
fn small_request_beside_a_download(link: LinkModel) -> (Duration, f64, Duration, Netem) {
    let len = 4_000_000;
    let (_t, s, _, d) = serve_with_blob(len);
    let net = Netem::start(s.addr.as_str(), NetemConfig::new(20 * MS).rate(40_000_000).link(link)).unwrap();
    let mut small = connect(&net.addr);
    assert_eq!(get(&mut small, "/v2/"), "HTTP/1.1 200 OK", "opened and warm");
    let url = net.url(&format!("/v2/net/blob/blobs/{d}"));
    let t0 = Instant::now();
    let bulk = std::thread::spawn(move || {
        let body = Client::builder().timeout(Duration::from_secs(60)).build().unwrap().get(&url).send().unwrap().bytes().unwrap();
        assert_eq!(sha256(&body), d, "the download arrives whole and unchanged");
        Instant::now()
    });
    std::thread::sleep(100 * MS);
    let asked = Instant::now();
    assert_eq!(get(&mut small, "/v2/"), "HTTP/1.1 200 OK");
    let answered = Instant::now();
    let bulk_done = bulk.join().unwrap();
    let after = if answered >= bulk_done { (answered - bulk_done).as_secs_f64() } else { -(bulk_done - answered).as_secs_f64() };
    (answered - asked, after, bulk_done - t0, net)
}

#[test]
fn a_deep_buffer_queues_a_download_ahead_of_a_later_small_request_and_drops_nothing() {
    // Deep: the proxy takes the download's 4 MB at once (no push back: the queue is the
    // whole download, 0.8 s of link time), and the small answer, booked after them, comes
    // after the download's last byte: it waited ~0.7 s, 35 round trips.
    let (took, after, bulk, net) = small_request_beside_a_download(LinkModel::Deep);
    // (50 ms of slack: each side's time is taken by a thread of its own after its bytes came.)
    assert!(after >= -0.05, "the small answer came {:.0} ms before the download's end: it overtook queued bytes", -after * 1e3);
    assert!(took >= 500 * MS, "the small request took {took:?}: it did not wait behind the queued download");
    assert!(net.max_queue() >= 500 * MS, "the deepest queue was {:?}: the download was pushed back", net.max_queue());
    assert!(bulk >= 720 * MS, "4 MB at 40 Mbit/s took {bulk:?}: the cap did not hold");
    assert_eq!(net.drops(), 0, "a deep buffer drops nothing");

    // Window (the default): the download's connection is pushed back (its next piece, 1 ms
    // of link time, waits its turn), so the small answer takes its turn beside it: one
    // round trip and a piece or two, long before the download ends.
    let (took, after, bulk, net) = small_request_beside_a_download(LinkModel::Window);
    assert!(after < -0.3, "the small answer came {:.0} ms after the download's end: it waited behind it", after * 1e3);
    assert!(took < 250 * MS, "the small request took {took:?} beside a pushed-back download");
    assert!(net.max_queue() < 50 * MS, "the deepest queue was {:?}: one piece per busy connection at most", net.max_queue());
    assert!(bulk >= 720 * MS, "4 MB at 40 Mbit/s took {bulk:?}");
    assert_eq!(net.drops(), 0);
}

#[test]
fn a_deep_buffers_delay_grows_with_what_the_senders_have_sent() {
    // Two downloads of 4 MB at once, then a small request: it waits behind both (1.6 s of
    // link time), twice what one download made it wait above, and nothing is dropped.
    let len = 4_000_000;
    let (_t, s, _, d) = serve_with_blob(len);
    let net = Netem::start(s.addr.as_str(), NetemConfig::new(20 * MS).rate(40_000_000).link(LinkModel::Deep)).unwrap();
    let mut small = connect(&net.addr);
    assert_eq!(get(&mut small, "/v2/"), "HTTP/1.1 200 OK");
    let url = net.url(&format!("/v2/net/blob/blobs/{d}"));
    let bulks: Vec<_> = (0..2)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || Client::builder().timeout(Duration::from_secs(60)).build().unwrap().get(&url).send().unwrap().bytes().unwrap().len())
        })
        .collect();
    std::thread::sleep(150 * MS);
    let asked = Instant::now();
    assert_eq!(get(&mut small, "/v2/"), "HTTP/1.1 200 OK");
    let took = asked.elapsed();
    for b in bulks {
        assert_eq!(b.join().unwrap(), len);
    }
    assert!(took >= 1200 * MS, "behind 8 MB queued at 40 Mbit/s (1.6 s) the small request took {took:?}");
    assert!(net.max_queue() >= 1200 * MS, "{:?}", net.max_queue());
    assert_eq!(net.drops(), 0);
}

#[test]
fn snapctl_pull_across_20ms_of_rtt_succeeds_and_verifies() {
    let w = tempfile::tempdir().unwrap();
    let s = Serve::start(w.path().join("store").to_str().unwrap(), &[], &[]);
    let snap = w.path().join("snap");
    let ok = |r: snapctl_tests::Run| assert_eq!(r.code, 0, "{r:?}");
    ok(run(snapctl().arg("sample").arg(&snap).args(["--size", "24MiB"])));
    ok(run(snapctl().arg("push").arg(&snap).arg(format!("{}/net/vm:v1", s.addr))));

    let net = Netem::start(s.addr.as_str(), NetemConfig::new(20 * MS).rate(1_000_000_000)).unwrap();
    let image = format!("{}/net/vm:v1", net.addr);
    let dest = w.path().join("pulled");
    let t0 = Instant::now();
    ok(run(snapctl().arg("pull").arg(&image).arg(&dest).arg("--cache").arg(w.path().join("cache"))));
    let took = t0.elapsed();
    ok(run(snapctl().arg("verify").arg(&image).arg("--against").arg(&dest)));
    for f in ["vm.mem", "vm.state"] {
        assert!(std::fs::read(snap.join(f)).unwrap() == std::fs::read(dest.join(f)).unwrap(), "{f} differs");
    }
    // It went through the proxy: about 12 MiB of non-zero memory came down it, in no less
    // than the round trips of resolving the tag, the manifest, the config and the packs.
    assert!(net.bytes_down() > 10 << 20, "only {} bytes came through the proxy", net.bytes_down());
    assert!(took >= 4 * 20 * MS, "a pull across 20 ms took {took:?}");
}

#[test]
fn regression_issue_16_pull_keeps_enough_ranges_in_flight_to_cover_50ms_of_rtt() {
    // 48 chunks of 1 MiB, none zero, fetched one range each (`--max-range 1MiB`: the shape
    // of a layer whose parent is in the cache, its misses scattered between cached chunks).
    // Every request waits 50 ms before its first byte, so a fixed pool of 8 moves at most
    // 8 MiB per round trip (168 MB/s) whatever the link; filling a fast link takes dozens
    // in flight. No timing here: the proxy counts the connections open at once (an HTTP/1.1
    // client opens one only when all of its others are busy).
    let w = tempfile::tempdir().unwrap();
    let s = Serve::start(w.path().join("store").to_str().unwrap(), &[], &[]);
    let snap = w.path().join("snap");
    let ok = |r: &snapctl_tests::Run| assert_eq!(r.code, 0, "{r:?}");
    ok(&run(snapctl().arg("sample").arg(&snap).args(["--size", "48MiB", "--zero-fraction", "0"])));
    ok(&run(snapctl().arg("push").arg(&snap).arg(format!("{}/net/vm:v1", s.addr))));
    let pull = |image: &str, dest: &str| -> serde_json::Value {
        let r = run(snapctl().arg("pull").arg(image).arg(w.path().join(dest)).args(["--no-cache", "--json", "--max-range", "1MiB"]));
        ok(&r);
        let j: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
        assert!(std::fs::read(snap.join("vm.mem")).unwrap() == std::fs::read(w.path().join(dest).join("vm.mem")).unwrap(), "vm.mem differs");
        j
    };

    let net = Netem::start(s.addr.as_str(), NetemConfig::new(50 * MS)).unwrap();
    let j = pull(&format!("{}/net/vm:v1", net.addr), "far");
    assert!(j["range_requests"].as_u64().unwrap() >= 48, "{j}");
    // 10 Gbit/s x 50 ms over 1 MiB ranges asks for 61, bounded by --max-jobs (32); 48
    // ranges, some done before the round trip is timed, may leave fewer to start.
    assert!(net.max_open() >= 24, "at most {} connections open at once across 50 ms of RTT: {j}", net.max_open());
    assert_eq!(j["ranges_in_flight"].as_u64(), Some(puller::DEFAULT_MAX_JOBS as u64), "{j}");
    // The depth came from the round trip it timed (the proxy's RTT is a lower bound).
    assert!(j["rtt_ms"].as_f64().unwrap() >= 50.0, "{j}");
}

/// `netem_proxy` with stdin as a pipe: (process, the address it printed).
fn start_program(upstream: &str, args: &[&str]) -> (std::process::Child, BufReader<std::process::ChildStdout>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_netem_proxy"))
        .args(["--upstream", upstream])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut addr = String::new();
    out.read_line(&mut addr).unwrap();
    (child, out, addr.trim().to_string())
}

#[test]
fn the_netem_proxy_program_prints_its_address_relays_and_stops_on_stdin_eof_or_sigterm() {
    let (_t, s, _, _) = serve_with_blob(1);
    let (mut child, mut out, addr) = start_program(&s.addr, &["--rtt", "20ms", "--rate", "100mbit"]);
    assert!(addr.starts_with("127.0.0.1:"), "{addr:?}");
    let t0 = Instant::now();
    let mut c = connect(&addr);
    assert_eq!(get(&mut c, "/v2/"), "HTTP/1.1 200 OK");
    assert!(t0.elapsed() >= 40 * MS, "handshake + 1 RTT of 20 ms: took {:?}", t0.elapsed());
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    let mut summary = String::new();
    out.read_to_string(&mut summary).unwrap();
    let v: serde_json::Value = serde_json::from_str(summary.trim()).unwrap();
    assert_eq!(v["connections"], 1, "{v}");
    assert!(v["bytes_down"].as_u64().unwrap() > 0 && v["bytes_up"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(v["rate_bps"], 100_000_000u64, "{v}");
    assert_eq!((v["link"].as_str(), v["drops"].as_u64()), (Some("window"), Some(0)), "{v}");

    let (mut child, mut out, addr) = start_program(&s.addr, &["--rate", "100mbit", "--link", "deep"]);
    assert_eq!(get(&mut connect(&addr), "/v2/"), "HTTP/1.1 200 OK");
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    let mut summary = String::new();
    out.read_to_string(&mut summary).unwrap();
    let v: serde_json::Value = serde_json::from_str(summary.trim()).unwrap();
    assert_eq!((v["link"].as_str(), v["queue_limit"].as_u64()), (Some("deep"), None), "{v}");
    assert!(v["max_queue_ms"].as_f64().is_some(), "{v}");
    let (mut child, mut out, _) = start_program(&s.addr, &["--rtt", "20ms", "--rate", "1gbit", "--link", "shallow"]);
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    let mut summary = String::new();
    out.read_to_string(&mut summary).unwrap();
    let v: serde_json::Value = serde_json::from_str(summary.trim()).unwrap();
    assert_eq!((v["link"].as_str(), v["queue_limit"].as_u64()), (Some("shallow"), Some(750_000)), "30 % of the BDP: {v}");

    let (mut child, _out, _) = start_program(&s.addr, &[]);
    // SAFETY: kill(2) on our own child's pid; no memory is involved.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success(), "SIGTERM stops it cleanly");

    let bad_args: [&[&str]; 6] = [
        &["--listen", "0.0.0.0:0"],
        &["--rate", "fast"],
        &["--rtt", "20"],
        &["--link", "bloat", "--rate", "1gbit"],
        &["--link", "deep"],
        &["--link", "deep", "--rate", "1gbit", "--queue-limit", "1MiB"],
    ];
    for bad in bad_args {
        let r = run(Command::new(env!("CARGO_BIN_EXE_netem_proxy")).args(["--upstream", &s.addr]).args(bad).stdin(Stdio::null()));
        assert_eq!(r.code, 2, "{bad:?}: {r:?}");
        assert!(r.stdout.is_empty(), "{bad:?}: nothing on stdout: {r:?}");
    }
}
