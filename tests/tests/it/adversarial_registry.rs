//! `snapctl serve` against clients that mean it harm (issue 14; spec/registry.md §7): a
//! gc racing a push, slow and half-sent requests at a descriptor limit, a metrics flood,
//! HTTP/2 over TLS, abandoned uploads. Each test drives the release-shaped binary, as an
//! attacker would.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use reqwest::blocking::Client;
use sha2::{Digest as _, Sha256};
use snapctl_tests::registry_support::{htpasswd, wait_for_port, Serve};
use snapctl_tests::{free_port, have, run, snapctl, snapctl_bin};

const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";

/// Every file under `dir`.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}

/// Set every file under `dir` `by` into the past: a registry that has been there a while.
fn age_all(dir: &Path, by: Duration) {
    let t = SystemTime::now() - by;
    for p in files(dir) {
        std::fs::File::options().write(true).open(&p).unwrap().set_modified(t).unwrap();
    }
}

/// Write `n` distinct small manifests into repository `filler` of the fs store at `root`,
/// the way the server lays them out, so that gc has that many to read while marking.
fn filler_manifests(root: &Path, n: usize) {
    let config = br#"{"filler":true}"#;
    let cd = hex::encode(Sha256::digest(config));
    let put = |rel: String, data: &[u8]| {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, data).unwrap();
    };
    put(format!("blobs/sha256/{}/{cd}", &cd[..2]), config);
    put(format!("repositories/filler/_layers/sha256/{cd}"), b"");
    for i in 0..n {
        let m = format!(
            r#"{{"schemaVersion":2,"mediaType":"{OCI_MANIFEST}","config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:{cd}","size":{}}},"layers":[],"annotations":{{"n":"{i}"}}}}"#,
            config.len()
        );
        let d = hex::encode(Sha256::digest(m.as_bytes()));
        put(format!("blobs/sha256/{}/{d}", &d[..2]), m.as_bytes());
        put(format!("repositories/filler/_manifests/sha256/{d}"), OCI_MANIFEST.as_bytes());
    }
}

/// Issue 14 §2: old unreferenced blobs (their manifest deleted, older than the grace
/// period), a registry with 40,000 manifests so marking takes seconds; `snapctl gc`
/// starts, the same image is pushed again 0.5 s later (its HEADs find the blobs, its
/// manifest PUT succeeds, push exits 0). gc must not then delete those blobs: `verify`
/// of the new tag passes.
#[test]
fn regression_issue_14_gc_racing_a_repush_keeps_what_the_push_was_told_exists() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let snap = tmp.path().join("snap");
    let layout = tmp.path().join("layout");
    let r = run(snapctl().arg("sample").arg(&snap).args(["--size", "8MiB"]));
    assert_eq!(r.code, 0, "{r:?}");
    let r = run(snapctl().arg("pack").arg(&snap).arg(format!("oci:{}:v1", layout.display())));
    assert_eq!(r.code, 0, "{r:?}");
    let src = format!("oci:{}:v1", layout.display());
    std::fs::create_dir_all(&store).unwrap();
    filler_manifests(&store, 40_000);

    let s = Serve::start(store.to_str().unwrap(), &[], &[]);
    let push = |tag: &str, cache: &str| {
        let mut c = snapctl();
        c.env("SNAPCTL_CACHE", tmp.path().join(cache)).env("DOCKER_CONFIG", tmp.path().join("docker"));
        run(c.args(["push", &src, &format!("{}/victim/vm:{tag}", s.addr)]))
    };
    let r = push("v1", "cache-a");
    assert_eq!(r.code, 0, "first push: {r:?}");
    let digest = r.stdout.trim().to_owned();
    let c = Client::new();
    let r = c.delete(s.url(&format!("/v2/victim/vm/manifests/{digest}"))).send().unwrap();
    assert_eq!(r.status(), 202);
    age_all(&store, Duration::from_secs(7200));

    let gc_started = Instant::now();
    let gc = snapctl().args(["gc", "--storage", store.to_str().unwrap(), "--json"]).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    // gc has started once it holds _gc/run (a gc before issue 14 never wrote it: then
    // give it a moment).
    let t = Instant::now();
    while !store.join("_gc/run").exists() && t.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(500));
    let pushed = push("v2", "cache-b");
    let push_done = gc_started.elapsed();
    let out = gc.wait_with_output().unwrap();
    eprintln!("re-push done {push_done:?} after gc started; gc took {:?}", gc_started.elapsed());
    assert_eq!(pushed.code, 0, "re-push during gc: {pushed:?}");
    assert!(out.status.success(), "gc: {}", String::from_utf8_lossy(&out.stderr));
    let rep: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    eprintln!("gc report: {rep}");
    let v = run(snapctl().env("SNAPCTL_CACHE", tmp.path().join("cache-c")).args(["verify", &format!("{}/victim/vm:v2", s.addr)]));
    assert_eq!(v.code, 0, "gc deleted blobs of a push that reported success; gc: {rep}\nverify: {v:?}");
    assert!(rep["manifests"].as_u64().unwrap() >= 40_000, "{rep}");
    assert!(rep["kept_in_use"].as_u64().unwrap_or(0) > 0, "the push did not overlap gc (nothing was tested): {rep}");
}

/// `snapctl serve` under `ulimit -n nofile`.
fn serve_with_nofile(storage: &Path, nofile: u32, extra: &[&str]) -> Serve {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let log = std::env::temp_dir().join(format!("snapctl-serve-{port}.log"));
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(format!("ulimit -n {nofile} && exec \"$0\" \"$@\""))
        .arg(snapctl_bin())
        .args(["serve", "--storage", storage.to_str().unwrap(), "--listen", &addr])
        .args(extra)
        .env_remove("SNAPCTL_LOG");
    let child = cmd.stdout(Stdio::null()).stderr(std::fs::File::create(&log).unwrap()).spawn().unwrap();
    let mut s = Serve { child, addr, log };
    wait_for_port(port, &mut s.child, "snapctl serve");
    s
}

/// A TCP connection to `to` from source address `from` (any 127/8 address on Linux).
fn connect_from(from: &str, to: &str) -> std::io::Result<TcpStream> {
    // SAFETY: plain socket calls on a descriptor we own; the sockaddr structs are
    // initialised and their sizes passed.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let stream = <TcpStream as std::os::fd::FromRawFd>::from_raw_fd(fd);
        let sa = |a: SocketAddr| {
            let SocketAddr::V4(a) = a else { unreachable!("IPv4 only") };
            libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from(*a.ip()).to_be() },
                sin_zero: [0; 8],
            }
        };
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let local = sa(format!("{from}:0").parse().unwrap());
        if libc::bind(fd, &local as *const _ as *const libc::sockaddr, len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let remote = sa(to.parse().unwrap());
        if libc::connect(fd, &remote as *const _ as *const libc::sockaddr, len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(stream)
    }
}

/// Issue 14 §12: 300 half-sent requests held the registry at its descriptor limit (256)
/// and `GET /v2/` got no answer. Now the flood's client is capped, its half-sent heads
/// time out, and another client is answered meanwhile.
#[test]
fn regression_issue_14_half_sent_requests_at_the_descriptor_limit() {
    let tmp = tempfile::tempdir().unwrap();
    let s = serve_with_nofile(&tmp.path().join("store"), 256, &["--header-timeout", "3s"]);
    let mut held = Vec::new();
    for _ in 0..300 {
        // Past the cap the server closes connections at once; a connect may then also fail.
        if let Ok(mut c) = connect_from("127.0.0.2", &s.addr) {
            let _ = c.write_all(b"PUT /v2/x/manifests/v1 HTTP/1.1\r\nHost: x\r\nX-Slow: ");
            held.push(c);
        }
    }
    let t = Instant::now();
    let c = Client::builder().timeout(Duration::from_secs(10)).build().unwrap();
    let r = c.get(s.url("/v2/")).send();
    assert!(matches!(&r, Ok(r) if r.status() == 200), "GET /v2/ while one client floods: {r:?}\n{}", s.log_text());
    assert!(t.elapsed() < Duration::from_secs(3), "answered only after {:?}", t.elapsed());
    let m = c.get(s.url("/metrics")).send().unwrap().text().unwrap();
    let refused: u64 = m.lines().find_map(|l| l.strip_prefix("snapctl_http_connections_refused_total ")).unwrap().parse().unwrap();
    assert!(refused >= 300 - 64, "{m}");
    // The half-sent heads go after the header timeout.
    let mut open = 0;
    for mut c in held {
        c.set_read_timeout(Some(Duration::from_secs(8))).unwrap();
        let mut b = [0u8; 1024];
        loop {
            match c.read(&mut b) {
                Ok(0) => break,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut => {
                    open += 1;
                    break;
                }
                Err(_) => break,
            }
        }
    }
    assert_eq!(open, 0, "half-sent requests outlived --header-timeout");
}

/// Resident set of a process, KiB.
fn rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok()).unwrap()
}

/// Issue 14 §11: 1,000 requests with long made-up methods grew RSS from 8.7 to 68.8 MB
/// and `/metrics` to 60 MB. Now they are all `other`.
#[test]
fn regression_issue_14_made_up_methods_do_not_grow_the_registry() {
    let tmp = tempfile::tempdir().unwrap();
    let s = Serve::start(tmp.path().join("store").to_str().unwrap(), &[], &[]);
    let c = Client::new();
    let flood = |from: usize, to: usize| {
        for i in from..to {
            let m = reqwest::Method::from_bytes(format!("X{i:05}{}", "Y".repeat(20_000)).as_bytes()).unwrap();
            c.request(m, s.url("/v2/")).send().unwrap();
        }
    };
    flood(0, 100);
    let before = (rss_kib(s.child.id()), c.get(s.url("/metrics")).send().unwrap().text().unwrap().len());
    flood(100, 1000);
    let after = (rss_kib(s.child.id()), c.get(s.url("/metrics")).send().unwrap().text().unwrap().len());
    assert!(after.1 < before.1 + 64, "/metrics grew from {} to {} bytes", before.1, after.1);
    assert!(after.0 < before.0 + 8 * 1024, "RSS grew from {} to {} KiB", before.0, after.0);
}

/// Issue 14 §11: `/metrics` can live on its own (private) listener, and is then not on
/// the API listener.
#[test]
fn metrics_listen_moves_metrics_off_the_api_listener() {
    let tmp = tempfile::tempdir().unwrap();
    let mport = free_port();
    let s = Serve::start(tmp.path().join("store").to_str().unwrap(), &["--metrics-listen", &format!("127.0.0.1:{mport}")], &[]);
    assert_eq!(reqwest::blocking::get(s.url("/metrics")).unwrap().status(), 404);
    let r = reqwest::blocking::get(format!("http://127.0.0.1:{mport}/metrics")).unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().unwrap().contains("snapctl_http_requests_total"));
}

/// Issue 14 §8: under TLS with HTTP/2 the token realm was `https://localhost/token`
/// (built from `Host`, which HTTP/2 does not send).
#[test]
fn regression_issue_14_h2_over_tls_token_realm_names_the_server() {
    if !have("openssl") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (cert, key, users) = (tmp.path().join("cert.pem"), tmp.path().join("key.pem"), tmp.path().join("htpasswd"));
    let r = run(Command::new("openssl")
        .args(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&cert));
    assert_eq!(r.code, 0, "{}", r.stderr);
    htpasswd(&users, &[("alice", "pw")]);
    let s = Serve::start(
        tmp.path().join("store").to_str().unwrap(),
        &["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap(), "--htpasswd", users.to_str().unwrap()],
        &[],
    );
    // The certificate does not matter here (tls_from_cert_and_key_files checks it); the
    // realm does.
    let c = Client::builder().danger_accept_invalid_certs(true).http2_prior_knowledge().build().unwrap();
    let r = c.get(format!("https://{}/v2/", s.addr)).send().unwrap();
    assert_eq!(r.version(), reqwest::Version::HTTP_2);
    assert_eq!(r.status(), 401);
    let ch = r.headers()["www-authenticate"].to_str().unwrap();
    assert!(ch.starts_with(&format!("Bearer realm=\"https://{}/token\"", s.addr)), "{ch}");
}

/// Issue 14 §13: upload sessions never expired in `serve`, and expiry left a directory
/// per upload with the in-progress gauge up.
#[test]
fn regression_issue_14_abandoned_uploads_expire_in_serve() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let s = Serve::start(store.to_str().unwrap(), &["--upload-ttl", "1s"], &[]);
    let c = Client::new();
    for _ in 0..5 {
        let r = c.post(s.url("/v2/r/blobs/uploads/")).send().unwrap();
        let loc = r.headers()["location"].to_str().unwrap().to_owned();
        assert_eq!(c.patch(s.url(&loc)).body(vec![7u8; 1000]).send().unwrap().status(), 202);
    }
    let uploads = store.join("_uploads");
    let deadline = Instant::now() + Duration::from_secs(15);
    while std::fs::read_dir(&uploads).map(|d| d.count()).unwrap_or(0) > 0 {
        assert!(Instant::now() < deadline, "abandoned sessions still there: {:?}", files(&uploads));
        std::thread::sleep(Duration::from_millis(200));
    }
    let m = c.get(s.url("/metrics")).send().unwrap().text().unwrap();
    assert!(m.contains("\nsnapctl_uploads_in_progress 0\n"), "{m}");
    assert!(m.contains("\nsnapctl_uploads_expired_total 5\n"), "{m}");
}
