//! The fault-injecting proxy (`snapctl_tests::fault_proxy`) does each fault it promises,
//! against a real `snapctl serve`, on keep-alive connections, with reqwest and raw sockets.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};

use reqwest::blocking::Client;
use snapctl_tests::fault_proxy::{Fault, FaultProxy, Match, Rule};
use snapctl_tests::registry_support::{random_bytes, sha256, Serve};

const MIB: usize = 1024 * 1024;

/// A `snapctl serve` holding one blob of `len` random bytes in repo `fp/blob`, and a
/// proxy in front of it. The upload itself goes through the proxy (POST with a body,
/// keep-alive), so request bodies are relayed too.
fn setup(len: usize) -> (tempfile::TempDir, Serve, FaultProxy, Vec<u8>, String) {
    let tmp = tempfile::tempdir().unwrap();
    let s = Serve::start(tmp.path().join("store").to_str().unwrap(), &[], &[]);
    let p = FaultProxy::start(s.addr.as_str()).unwrap();
    let data = random_bytes(len as u64, len);
    let d = sha256(&data);
    let r = Client::new().post(p.url(&format!("/v2/fp/blob/blobs/uploads/?digest={d}"))).body(data.clone()).send().unwrap();
    assert_eq!(r.status(), 201, "{}", r.text().unwrap_or_default());
    (tmp, s, p, data, d)
}

/// A raw HTTP/1.1 GET on a fresh connection: (status line, Content-Length, body bytes
/// received, how the stream ended).
fn raw_get(addr: &str, path: &str) -> (String, usize, Vec<u8>, Result<(), ErrorKind>) {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut r = BufReader::new(s);
    let mut status = String::new();
    r.read_line(&mut status).unwrap();
    let mut len = 0;
    loop {
        let mut l = String::new();
        r.read_line(&mut l).unwrap();
        if l == "\r\n" {
            break;
        }
        if let Some(v) = l.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap();
        }
    }
    let mut body = Vec::new();
    let mut buf = [0u8; 65536];
    let end = loop {
        match r.read(&mut buf) {
            Ok(0) => break Ok(()),
            Ok(n) => {
                body.extend_from_slice(&buf[..n]);
                if body.len() >= len {
                    break Ok(());
                }
            }
            Err(e) => break Err(e.kind()),
        }
    };
    (status.trim().to_string(), len, body, end)
}

/// A raw HTTP/1.1 client on one keep-alive connection, so tests can say which requests
/// share a connection (reqwest's pool may open a new one while the last response is still
/// being handed back).
struct KeepAlive {
    w: TcpStream,
    r: BufReader<TcpStream>,
    addr: String,
}

impl KeepAlive {
    fn connect(addr: &str) -> KeepAlive {
        let w = TcpStream::connect(addr).unwrap();
        w.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
        KeepAlive { r: BufReader::new(w.try_clone().unwrap()), w, addr: addr.to_string() }
    }

    /// Send a request without a body; return (status, body), decoding Content-Length or
    /// chunked framing.
    fn send(&mut self, method: &str, path: &str, headers: &[(&str, &str)]) -> (u16, Vec<u8>) {
        let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {}\r\n", self.addr);
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        self.w.write_all(head.as_bytes()).unwrap();
        let mut line = String::new();
        self.r.read_line(&mut line).unwrap();
        let status: u16 = line.split_whitespace().nth(1).expect("status line").parse().unwrap();
        let (mut len, mut chunked) = (0usize, false);
        loop {
            line.clear();
            self.r.read_line(&mut line).unwrap();
            if line == "\r\n" {
                break;
            }
            let l = line.to_ascii_lowercase();
            if let Some(v) = l.strip_prefix("content-length:") {
                len = v.trim().parse().unwrap();
            }
            chunked |= l.starts_with("transfer-encoding:") && l.contains("chunked");
        }
        let mut body = Vec::new();
        if method == "HEAD" {
            return (status, body);
        }
        if !chunked {
            body.resize(len, 0);
            self.r.read_exact(&mut body).unwrap();
            return (status, body);
        }
        loop {
            line.clear();
            self.r.read_line(&mut line).unwrap();
            let n = usize::from_str_radix(line.trim().split(';').next().unwrap(), 16).unwrap();
            if n == 0 {
                loop {
                    line.clear();
                    self.r.read_line(&mut line).unwrap();
                    if line == "\r\n" {
                        return (status, body);
                    }
                }
            }
            let at = body.len();
            body.resize(at + n, 0);
            self.r.read_exact(&mut body[at..]).unwrap();
            line.clear();
            self.r.read_line(&mut line).unwrap();
        }
    }
}

#[test]
fn passes_through_keep_alive_and_counts() {
    let (_t, _s, p, data, d) = setup(3 * MIB + 5);
    let mut c = KeepAlive::connect(&p.addr);
    let path = format!("/v2/fp/blob/blobs/{d}");
    for _ in 0..3 {
        let (st, body) = c.send("GET", &path, &[]);
        assert_eq!(st, 200);
        assert!(body == data);
    }
    assert_eq!(c.send("HEAD", &path, &[]).0, 200);
    let missing = "/v2/fp/blob/blobs/sha256:0000000000000000000000000000000000000000000000000000000000000000";
    assert_eq!(c.send("GET", missing, &[]).0, 404);
    let (st, body) = c.send("GET", &path, &[("Range", "bytes=10-19")]);
    assert_eq!(st, 206);
    assert_eq!(&body[..], &data[10..20]);
    // Upload + 3 GETs + HEAD + 404 + ranged GET, over 2 client connections (the upload's
    // and this one, reused throughout).
    assert_eq!(p.requests(), 7);
    assert_eq!(p.counters().connections.load(std::sync::atomic::Ordering::Relaxed), 2);
    assert!(p.bytes_down() > 3 * data.len() as u64);
    assert!(p.bytes_up() > data.len() as u64);
    assert_eq!(p.faults(), 0);
}

#[test]
fn burst_of_503_then_recovery() {
    let (_t, _s, p, data, d) = setup(MIB);
    p.add(Rule::new(Fault::Status { code: 503 }).times(2));
    let c = Client::new();
    let url = p.url(&format!("/v2/fp/blob/blobs/{d}"));
    for _ in 0..2 {
        let r = c.get(&url).send().unwrap();
        assert_eq!(r.status(), 503);
        assert!(r.text().unwrap().contains("UNAVAILABLE"));
    }
    let r = c.get(&url).send().unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.bytes().unwrap() == data);
    assert_eq!(p.faults(), 2);
    // A 503 to an upload does not leak the body upstream: the blob is not half-written.
    p.add(Rule::new(Fault::Status { code: 503 }).on(Match::new("POST", "/blobs/uploads/")));
    let other = random_bytes(7, 100_000);
    let od = sha256(&other);
    let r = c.post(p.url(&format!("/v2/fp/blob/blobs/uploads/?digest={od}"))).body(other.clone()).send().unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(c.head(p.url(&format!("/v2/fp/blob/blobs/{od}"))).send().unwrap().status(), 404);
    let log = p.log();
    assert_eq!(log.iter().filter(|s| s.status == 503).count(), 3);
    assert!(log.iter().all(|s| (s.status == 503) == s.fault.is_some()));
}

#[test]
fn reset_after_n_bytes_of_the_second_blob_get() {
    let (_t, _s, p, data, d) = setup(2 * MIB);
    p.add(Rule::new(Fault::Reset { after: 1000 }).on(Match::blob_gets()).nth(2));
    let path = format!("/v2/fp/blob/blobs/{d}");
    let (st, _, body, end) = raw_get(&p.addr, &path);
    assert!(st.contains("200"), "{st}");
    assert!(body == data && end.is_ok());
    let (st, len, body, end) = raw_get(&p.addr, &path);
    assert!(st.contains("200"), "{st}");
    assert_eq!(len, data.len());
    assert_eq!(end, Err(ErrorKind::ConnectionReset));
    // 1000 bytes of the response went out, head included, then the RST.
    assert!(!body.is_empty() && body.len() < 1000, "{} body bytes", body.len());
    assert_eq!(&body[..], &data[..body.len()]);
    // reqwest sees an error, not a short success.
    p.add(Rule::new(Fault::Reset { after: 64 * 1024 }).on(Match::blob_gets()));
    let r = Client::new().get(p.url(&path)).send().and_then(|r| r.bytes());
    assert!(r.is_err(), "a reset response must not read as a success");
    let (_, _, body, end) = raw_get(&p.addr, &path);
    assert!(body == data && end.is_ok(), "spent rules stop firing");
}

#[test]
fn truncated_body_closes_early_with_the_full_content_length() {
    let (_t, _s, p, data, d) = setup(MIB + 1);
    p.add(Rule::new(Fault::Truncate { after: 4096 }).on(Match::blob_gets()));
    let path = format!("/v2/fp/blob/blobs/{d}");
    let (st, len, body, end) = raw_get(&p.addr, &path);
    assert!(st.contains("200"), "{st}");
    assert_eq!(len, data.len(), "the head still promises the whole body");
    assert_eq!(body.len(), 4096);
    assert_eq!(&body[..], &data[..4096]);
    assert_eq!(end, Ok(()), "a clean close (FIN), not a reset");
    p.add(Rule::new(Fault::Truncate { after: 10 }).on(Match::blob_gets()));
    let r = Client::new().get(p.url(&path)).send().and_then(|r| r.bytes());
    assert!(r.is_err(), "a truncated body must not read as a success");
}

#[test]
fn flipped_byte_on_the_nth_blob_get_of_a_keep_alive_connection() {
    let (_t, _s, p, data, d) = setup(3 * MIB);
    let at = MIB as u64 + 12345;
    // A manifest-like GET in between must not count towards "n-th blob GET".
    p.add(Rule::new(Fault::FlipByte { at }).on(Match::blob_gets()).nth(2));
    let mut c = KeepAlive::connect(&p.addr);
    let url = format!("/v2/fp/blob/blobs/{d}");
    let first = c.send("GET", &url, &[]).1;
    assert!(first == data);
    assert_eq!(c.send("GET", "/v2/", &[]).0, 200);
    let second = c.send("GET", &url, &[]).1;
    assert_eq!(second.len(), data.len());
    let diffs: Vec<usize> = (0..data.len()).filter(|&i| second[i] != data[i]).collect();
    assert_eq!(diffs, vec![at as usize]);
    assert_eq!(second[at as usize], data[at as usize] ^ 0xFF);
    let third = c.send("GET", &url, &[]).1;
    assert!(third == data);
    // All on one connection (the upload used its own).
    assert_eq!(p.counters().connections.load(std::sync::atomic::Ordering::Relaxed), 2);
    // On a short (ranged) body the flip lands on its last byte; a HEAD (no body) does not
    // use the rule up.
    p.add(Rule::new(Fault::FlipByte { at: 1 << 40 }).on(Match { method: None, path_contains: Some("/blobs/sha256:".into()) }));
    assert_eq!(c.send("HEAD", &url, &[]).0, 200);
    let r = c.send("GET", &url, &[("Range", "bytes=100-199")]).1;
    let mut want = data[100..200].to_vec();
    want[99] ^= 0xFF;
    assert_eq!(&r[..], &want[..]);
    assert_eq!(p.plan().lock().unwrap().pending(), 0);
}

#[test]
fn plan_changes_mid_transfer_hit_the_next_request() {
    // A "transfer" of several ranged reads on one connection: a fault switched on after
    // the third read hits the fourth and only the fourth.
    let (_t, _s, p, data, d) = setup(4 * MIB);
    let c = Client::new();
    let url = p.url(&format!("/v2/fp/blob/blobs/{d}"));
    let mut got = Vec::new();
    for i in 0..4 {
        if i == 3 {
            p.add(Rule::new(Fault::FlipByte { at: 7 }).on(Match::blob_gets()));
        }
        let range = format!("bytes={}-{}", i * MIB, (i + 1) * MIB - 1);
        got.extend_from_slice(&c.get(&url).header("Range", range).send().unwrap().bytes().unwrap());
    }
    assert_eq!(got.len(), data.len());
    let diffs: Vec<usize> = (0..data.len()).filter(|&i| got[i] != data[i]).collect();
    assert_eq!(diffs, vec![3 * MIB + 7]);
}

#[test]
fn chunked_responses_keep_their_framing_and_faults_count_decoded_bytes() {
    // `snapctl serve` answers with Content-Length; this tiny upstream answers chunked
    // (as other registries and proxies do) to exercise the other framing.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let up = l.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        let mut w = s;
        for _ in 0..2 {
            let mut line = String::new();
            loop {
                line.clear();
                if r.read_line(&mut line).unwrap() == 0 || line == "\r\n" {
                    break;
                }
            }
            w.write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n").unwrap();
        }
    });
    let p = FaultProxy::start(up).unwrap();
    p.add(Rule::new(Fault::FlipByte { at: 6 }).nth(2));
    let mut c = KeepAlive::connect(&p.addr);
    assert_eq!(&c.send("GET", "/a", &[]).1[..], b"hello world");
    let b = c.send("GET", "/b", &[]).1;
    assert_eq!(&b[..], b"hello \x88orld");
    server.join().unwrap();
    assert_eq!(p.counters().connections.load(std::sync::atomic::Ordering::Relaxed), 1);
}

/// Files under `dir` with their contents, for comparing a pulled directory with its source.
fn dir_contents(dir: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_file())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap()))
        .collect();
    v.sort();
    v
}

#[test]
fn snapctl_push_through_503_bursts_and_a_reset_upload_response_completes() {
    // The registry client's retries meet the proxy's faults: a burst of 503s on the first
    // requests, a burst on upload starts, and a PUT whose response never arrives (the
    // registry did commit the blob; the client must notice on retry, not fail or upload a
    // corrupt blob). The pushed image then pulls back byte-identical, without the proxy.
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let r = snapctl_tests::run(snapctl_tests::snapctl().arg("sample").arg(t.join("snap")).args(["--size", "16MiB"]));
    assert_eq!(r.code, 0, "{}", r.stderr);
    let s = Serve::start(t.join("store").to_str().unwrap(), &[], &[]);
    let p = FaultProxy::start(s.addr.as_str()).unwrap();
    p.add(Rule::new(Fault::Status { code: 503 }).times(2));
    p.add(Rule::new(Fault::Status { code: 503 }).on(Match::new("POST", "/blobs/uploads/")).times(2));
    p.add(Rule::new(Fault::Reset { after: 0 }).on(Match::new("PUT", "/blobs/uploads/")));
    let reference = format!("{}/fp/vm:v1", p.addr);
    let r = snapctl_tests::run(snapctl_tests::snapctl().arg("push").arg(t.join("snap")).arg(&reference).arg("--cache").arg(t.join("pcache")));
    assert_eq!(r.code, 0, "push through faults: {}{}", r.stdout, r.stderr);
    assert_eq!(p.plan().lock().unwrap().pending(), 0, "every fault was hit: {:?}", p.log());
    assert_eq!(p.faults(), 5);
    let r =
        snapctl_tests::run(snapctl_tests::snapctl().arg("pull").arg(format!("{}/fp/vm:v1", s.addr)).arg(t.join("pulled")).arg("--cache").arg(t.join("ccache")));
    assert_eq!(r.code, 0, "pull: {}{}", r.stdout, r.stderr);
    assert!(dir_contents(&t.join("snap")) == dir_contents(&t.join("pulled")), "pulled files differ from the pushed ones");
}
