//! `snapctl serve` with real clients: skopeo, oras (PyPI), curl-like raw HTTP, an S3
//! server (moto), kill -9 and SIGTERM. Peers that are missing skip loudly (`have`).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use reqwest::blocking::Client;
use snapctl_tests::registry_support::{htpasswd, layout_manifest_digest, oci_layout, random_bytes, sha256, S3Server, Serve};
use snapctl_tests::{have, run, snapctl};

const MIB: usize = 1024 * 1024;

fn skopeo_copy(src: &str, dst: &str, extra: &[&str]) -> snapctl_tests::Run {
    let mut c = Command::new("skopeo");
    c.args(["copy", "--quiet", "--preserve-digests", "--src-tls-verify=false", "--dest-tls-verify=false"]).args(extra).args([src, dst]);
    run(&mut c)
}

/// Files under `dir` (recursively), as paths relative to it.
fn files_under(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p.strip_prefix(dir).unwrap().display().to_string());
            }
        }
    }
    out
}

/// Send a request head plus the first `send` bytes of a body of `declared` bytes, and
/// return the open connection (the rest of the body is still owed).
fn partial_request(addr: &str, method: &str, path: &str, headers: &[(&str, String)], declared: usize, body: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {declared}\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    s.flush().unwrap();
    s
}

fn start_upload(c: &Client, s: &Serve, repo: &str) -> String {
    let r = c.post(s.url(&format!("/v2/{repo}/blobs/uploads/"))).send().unwrap();
    assert_eq!(r.status(), 202);
    r.headers()["location"].to_str().unwrap().to_owned()
}

#[test]
fn skopeo_copy_round_trip_preserves_manifest_digest() {
    if !have("skopeo") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let md = oci_layout(&src, "v1", &[(1, 5 * MIB + 17), (2, 1)]);
    let s = Serve::start(tmp.path().join("store").to_str().unwrap(), &[], &[]);
    let r = skopeo_copy(&format!("oci:{}:v1", src.display()), &format!("docker://{}/snap/vm:v1", s.addr), &[]);
    assert_eq!(r.code, 0, "push: {}\nserver log:\n{}", r.stderr, s.log_text());
    let back = tmp.path().join("back");
    let r = skopeo_copy(&format!("docker://{}/snap/vm:v1", s.addr), &format!("oci:{}:v1", back.display()), &[]);
    assert_eq!(r.code, 0, "pull: {}", r.stderr);
    assert_eq!(layout_manifest_digest(&back, "v1").as_deref(), Some(md.as_str()), "manifest digest changed in transit");
    for f in files_under(&src.join("blobs")) {
        let a = std::fs::read(src.join("blobs").join(&f)).unwrap();
        let b = std::fs::read(back.join("blobs").join(&f)).unwrap_or_else(|_| panic!("blob {f} missing after pull"));
        assert!(a == b, "blob {f} differs");
    }
    // The tag is listed, and the manifest is served with its media type.
    let c = Client::new();
    let tags: serde_json::Value = c.get(s.url("/v2/snap/vm/tags/list")).send().unwrap().json().unwrap();
    assert_eq!(tags["tags"], serde_json::json!(["v1"]));
}

#[test]
fn skopeo_with_token_auth_push_without_rights_is_refused() {
    if !have("skopeo") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let md = oci_layout(&src, "v1", &[(3, MIB)]);
    let pw = tmp.path().join("htpasswd");
    htpasswd(&pw, &[("alice", "alice-pw"), ("bob", "bob-pw")]);
    let acl = tmp.path().join("acl.toml");
    std::fs::write(
        &acl,
        r#"
[[rule]]
users = ["alice"]
repos = ["*"]
actions = ["pull", "push", "delete"]
[[rule]]
users = ["bob"]
repos = ["snap/*"]
actions = ["pull"]
"#,
    )
    .unwrap();
    let s = Serve::start(tmp.path().join("store").to_str().unwrap(), &["--htpasswd", pw.to_str().unwrap(), "--acl", acl.to_str().unwrap()], &[]);
    let src_ref = format!("oci:{}:v1", src.display());
    let dst = format!("docker://{}/snap/vm:v1", s.addr);
    let r = skopeo_copy(&src_ref, &dst, &["--dest-creds", "bob:bob-pw"]);
    assert_ne!(r.code, 0, "bob has no push right but the push succeeded");
    assert!(r.stderr.contains("unauthorized") || r.stderr.contains("denied"), "{}", r.stderr);
    let r = skopeo_copy(&src_ref, &dst, &["--dest-creds", "alice:wrong"]);
    assert_ne!(r.code, 0, "wrong password accepted");
    let r = skopeo_copy(&src_ref, &dst, &["--dest-creds", "alice:alice-pw"]);
    assert_eq!(r.code, 0, "alice push: {}\n{}", r.stderr, s.log_text());
    let back = tmp.path().join("back");
    let r = skopeo_copy(&dst, &format!("oci:{}:v1", back.display()), &["--src-creds", "bob:bob-pw"]);
    assert_eq!(r.code, 0, "bob pull: {}", r.stderr);
    assert_eq!(layout_manifest_digest(&back, "v1").as_deref(), Some(md.as_str()));
    let r = skopeo_copy(&dst, &format!("oci:{}:anon", back.display()), &[]);
    assert_ne!(r.code, 0, "anonymous pull succeeded without anonymous read");
}

#[test]
fn mount_from_a_repository_the_user_cannot_read_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let pw = tmp.path().join("htpasswd");
    htpasswd(&pw, &[("alice", "a"), ("bob", "b")]);
    let acl = tmp.path().join("acl.toml");
    std::fs::write(
        &acl,
        "[[rule]]\nusers=[\"alice\"]\nrepos=[\"alice/*\"]\nactions=[\"pull\",\"push\"]\n\
         [[rule]]\nusers=[\"bob\"]\nrepos=[\"bob/*\"]\nactions=[\"pull\",\"push\"]\n",
    )
    .unwrap();
    let s = Serve::start(tmp.path().join("store").to_str().unwrap(), &["--htpasswd", pw.to_str().unwrap(), "--acl", acl.to_str().unwrap()], &[]);
    let c = Client::new();
    let data = b"alice's private layer".to_vec();
    let d = sha256(&data);
    let r = c.post(s.url(&format!("/v2/alice/private/blobs/uploads/?digest={d}"))).basic_auth("alice", Some("a")).body(data).send().unwrap();
    assert_eq!(r.status(), 201);
    for q in [format!("mount={d}&from=alice/private"), format!("mount={d}")] {
        let r = c.post(s.url(&format!("/v2/bob/x/blobs/uploads/?{q}"))).basic_auth("bob", Some("b")).send().unwrap();
        assert_eq!(r.status(), 202, "{q}: bob must get an upload session, not a mount");
    }
    let r = c.head(s.url(&format!("/v2/bob/x/blobs/{d}"))).basic_auth("bob", Some("b")).send().unwrap();
    assert_eq!(r.status(), 404);
    // Push without rights: 403 with Basic credentials, 401 + challenge anonymously.
    let r = c.post(s.url("/v2/alice/private/blobs/uploads/")).basic_auth("bob", Some("b")).send().unwrap();
    assert_eq!(r.status(), 403);
    let r = c.post(s.url("/v2/alice/private/blobs/uploads/")).send().unwrap();
    assert_eq!(r.status(), 401);
    assert!(r.headers()["www-authenticate"].to_str().unwrap().starts_with("Bearer realm="));
}

#[test]
fn oras_push_and_pull_a_file_artifact() {
    if !have("python3") {
        return;
    }
    let has_oras = Command::new("python3").args(["-c", "import oras.client"]).status().is_ok_and(|s| s.success());
    if !has_oras {
        assert!(!snapctl_tests::require_peers(), "oras (PyPI) is required");
        eprintln!("SKIP: python module oras not installed");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let s = Serve::start(tmp.path().join("store").to_str().unwrap(), &[], &[]);
    let work = tmp.path().join("work");
    std::fs::create_dir_all(work.join("out")).unwrap();
    let content = random_bytes(9, 3 * MIB + 5);
    std::fs::write(work.join("snapshot.bin"), &content).unwrap();
    let script = format!(
        r#"
import oras.client
c = oras.client.OrasClient(hostname="{a}", insecure=True)
r = c.push(target="{a}/art/file:v1", files=["snapshot.bin:application/vnd.snapctl.test"])
assert r.status_code == 201, r.status_code
print(c.pull(target="{a}/art/file:v1", outdir="out"))
"#,
        a = s.addr
    );
    let r = run(Command::new("python3").arg("-c").arg(script).current_dir(&work));
    assert_eq!(r.code, 0, "oras: {}\n{}", r.stderr, s.log_text());
    let back = std::fs::read(work.join("out/snapshot.bin")).unwrap();
    assert!(back == content, "oras pulled different bytes");
}

#[test]
fn kill9_during_chunked_upload_then_restart_resumes_and_shows_no_partial_blob() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let store_s = store.to_str().unwrap().to_owned();
    let data = random_bytes(11, 64 * MIB);
    let d = sha256(&data);
    let first = 16 * MIB;
    let c = Client::new();
    let mut s = Serve::start(&store_s, &[], &[]);
    let loc = start_upload(&c, &s, "crash/vm");
    let r = c.patch(s.url(&loc)).header("content-range", format!("0-{}", first - 1)).body(data[..first].to_vec()).send().unwrap();
    assert_eq!(r.status(), 202);
    // Second chunk: announce 48 MiB, send 20 MiB, then kill -9 the server mid-body.
    let rest = data.len() - first;
    let _conn = partial_request(&s.addr, "PATCH", &loc, &[("Content-Range", format!("{first}-{}", data.len() - 1))], rest, &data[first..first + 20 * MIB]);
    std::thread::sleep(Duration::from_millis(500));
    // On disk a session's chunks are appended in place to _uploads/<id>/data (spec/registry.md §3).
    let id = loc.rsplit('/').next().unwrap().split('?').next().unwrap().to_owned();
    let data_file = store.join("_uploads").join(&id).join("data");
    let written = std::fs::metadata(&data_file).map(|m| m.len()).unwrap_or(0);
    assert!(written > first as u64, "the kill must land while the second chunk is being written ({written} bytes in {})", data_file.display());
    s.kill9();
    assert!(files_under(&store.join("blobs")).is_empty(), "a blob appeared before the upload finished");

    let mut s = Serve::start(&store_s, &[], &[]);
    assert!(files_under(&store.join("_tmp")).is_empty(), "partial staging files survive a restart");
    let r = c.get(s.url(&loc)).send().unwrap();
    assert_eq!(r.status(), 204, "upload session lost by the restart");
    assert_eq!(r.headers()["range"], format!("0-{}", first - 1).as_str(), "committed offset (the torn tail of the killed chunk does not count)");
    assert_eq!(c.head(s.url(&format!("/v2/crash/vm/blobs/{d}"))).send().unwrap().status(), 404);
    // Resume where the server says, then finish.
    let r = c.patch(s.url(&loc)).header("content-range", format!("{first}-{}", data.len() - 1)).body(data[first..].to_vec()).send().unwrap();
    assert_eq!(r.status(), 202);
    let r = c.put(s.url(&format!("{loc}?digest={d}"))).send().unwrap();
    assert_eq!(r.status(), 201, "{}", r.text().unwrap());
    // A committed blob survives kill -9 right after the 201.
    s.kill9();
    let s = Serve::start(&store_s, &[], &[]);
    let back = c.get(s.url(&format!("/v2/crash/vm/blobs/{d}"))).send().unwrap().bytes().unwrap();
    assert_eq!(sha256(&back), d);
}

#[test]
fn kill9_during_monolithic_upload_leaves_nothing_visible() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let data = random_bytes(12, 32 * MIB);
    let d = sha256(&data);
    let mut s = Serve::start(store.to_str().unwrap(), &[], &[]);
    let _conn = partial_request(&s.addr, "POST", &format!("/v2/crash/mono/blobs/uploads/?digest={d}"), &[], data.len(), &data[..10 * MIB]);
    std::thread::sleep(Duration::from_millis(300));
    s.kill9();
    let s = Serve::start(store.to_str().unwrap(), &[], &[]);
    let c = Client::new();
    assert_eq!(c.head(s.url(&format!("/v2/crash/mono/blobs/{d}"))).send().unwrap().status(), 404);
    assert!(files_under(&store.join("blobs")).is_empty());
    assert!(files_under(&store.join("_tmp")).is_empty());
    // A clean retry works.
    let r = c.post(s.url(&format!("/v2/crash/mono/blobs/uploads/?digest={d}"))).body(data).send().unwrap();
    assert_eq!(r.status(), 201);
}

#[test]
fn sigterm_finishes_the_in_flight_upload_then_exits_0() {
    let tmp = tempfile::tempdir().unwrap();
    let mut s = Serve::start(tmp.path().join("store").to_str().unwrap(), &[], &[]);
    let data = random_bytes(13, 8 * MIB);
    let d = sha256(&data);
    let mut conn = partial_request(&s.addr, "POST", &format!("/v2/graceful/blobs/uploads/?digest={d}"), &[], data.len(), &data[..4 * MIB]);
    std::thread::sleep(Duration::from_millis(200));
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) };
    std::thread::sleep(Duration::from_millis(300));
    conn.write_all(&data[4 * MIB..]).unwrap();
    let mut resp = [0u8; 12];
    conn.read_exact(&mut resp).unwrap();
    assert_eq!(&resp, b"HTTP/1.1 201", "in-flight upload cut off by shutdown");
    drop(conn);
    let st = s.child.wait().unwrap();
    assert!(st.success(), "exit status {st}; log:\n{}", s.log_text());
    assert!(s.log_text().contains("shutting down"));
}

#[test]
fn serving_a_large_blob_keeps_rss_flat() {
    let tmp = tempfile::tempdir().unwrap();
    let s = Serve::start(tmp.path().join("store").to_str().unwrap(), &[], &[]);
    let len = 512 * MIB;
    // Stream a generated body in and out; the test process holds one chunk at a time.
    struct Gen(u64, usize, sha2::Sha256);
    impl Read for Gen {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            use sha2::Digest as _;
            let n = buf.len().min(self.1).min(MIB);
            if n == 0 {
                return Ok(0);
            }
            let b = random_bytes(self.0, n);
            self.0 += 1;
            self.1 -= n;
            buf[..n].copy_from_slice(&b);
            self.2.update(&b);
            Ok(n)
        }
    }
    use sha2::Digest as _;
    let mut g = Gen(100, len, sha2::Sha256::new());
    std::io::copy(&mut g, &mut std::io::sink()).unwrap();
    let d = format!("sha256:{}", hex::encode(g.2.finalize()));
    let c = Client::builder().timeout(None).build().unwrap();
    let body = reqwest::blocking::Body::sized(Gen(100, len, sha2::Sha256::new()), len as u64);
    let r = c.post(s.url(&format!("/v2/big/blobs/uploads/?digest={d}"))).body(body).send().unwrap();
    assert_eq!(r.status(), 201);
    let mut r = c.get(s.url(&format!("/v2/big/blobs/{d}"))).send().unwrap();
    assert_eq!(r.status(), 200);
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; MIB];
    loop {
        let n = r.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    assert_eq!(format!("sha256:{}", hex::encode(h.finalize())), d);
    let rss = s.peak_rss_kib();
    assert!(rss > 0 && rss < 100 * 1024, "server peak RSS {rss} KiB while moving a {len}-byte blob");
}

#[test]
fn gc_cli_sweeps_a_deleted_image_and_keeps_a_live_one() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let s = Serve::start(store.to_str().unwrap(), &[], &[]);
    let c = Client::new();
    let push = |repo: &str, seed: u64| -> String {
        let layer = random_bytes(seed, 1000);
        let cfg = format!("{{\"seed\":{seed}}}").into_bytes();
        for b in [&layer, &cfg] {
            let r = c.post(s.url(&format!("/v2/{repo}/blobs/uploads/?digest={}", sha256(b)))).body(b.clone()).send().unwrap();
            assert_eq!(r.status(), 201);
        }
        let m = serde_json::json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "artifactType": "application/vnd.snapctl.snapshot.v1",
            "config": {"mediaType": "application/vnd.snapctl.config.v1+json", "digest": sha256(&cfg), "size": cfg.len()},
            "layers": [{"mediaType": "application/vnd.snapctl.pack.v1", "digest": sha256(&layer), "size": 1000}]});
        let r = c
            .put(s.url(&format!("/v2/{repo}/manifests/v1")))
            .header("content-type", "application/vnd.oci.image.manifest.v1+json")
            .body(serde_json::to_vec(&m).unwrap())
            .send()
            .unwrap();
        assert_eq!(r.status(), 201);
        r.headers()["docker-content-digest"].to_str().unwrap().to_owned()
    };
    push("live", 1);
    let dead = push("dead", 2);
    assert_eq!(c.delete(s.url(&format!("/v2/dead/manifests/{dead}"))).send().unwrap().status(), 202);
    let gc = |extra: &[&str]| -> serde_json::Value {
        let r = run(snapctl().args(["gc", "--storage", store.to_str().unwrap(), "--json"]).args(extra));
        assert_eq!(r.code, 0, "{}", r.stderr);
        serde_json::from_str(&r.stdout).unwrap()
    };
    let rep = gc(&[]);
    assert_eq!((rep["swept"].as_u64(), rep["kept_young"].as_u64()), (Some(0), Some(3)), "{rep}");
    let rep = gc(&["--grace", "0s", "--dry-run"]);
    assert_eq!(rep["swept"].as_u64(), Some(3), "{rep}");
    let rep = gc(&["--grace", "0s"]);
    assert_eq!(rep["swept"].as_u64(), Some(3), "{rep}");
    let m: serde_json::Value = c.get(s.url("/v2/live/manifests/v1")).send().unwrap().json().unwrap();
    for dsc in [&m["config"], &m["layers"][0]] {
        let r = c.get(s.url(&format!("/v2/live/blobs/{}", dsc["digest"].as_str().unwrap()))).send().unwrap();
        assert_eq!(r.status(), 200, "gc swept a live blob");
    }
    let r = run(snapctl().args(["gc", "--storage", store.to_str().unwrap(), "--grace", "soon"]));
    assert_eq!(r.code, 2, "bad --grace is a usage error: {}", r.stderr);
}

#[test]
fn tls_from_cert_and_key_files() {
    if !have("openssl") || !have("curl") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (cert, key) = (tmp.path().join("cert.pem"), tmp.path().join("key.pem"));
    let r = run(Command::new("openssl")
        .args(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&cert));
    assert_eq!(r.code, 0, "{}", r.stderr);
    let s = Serve::start(tmp.path().join("store").to_str().unwrap(), &["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap()], &[]);
    let r = run(Command::new("curl")
        .args(["-sS", "--cacert", cert.to_str().unwrap(), "-o", "/dev/null", "-w", "%{http_code}"])
        .arg(format!("https://{}/v2/", s.addr)));
    assert_eq!(r.stdout, "200", "{}", r.stderr);
    let r = run(Command::new("curl").args(["-sS", "-o", "/dev/null", "-w", "%{http_code}"]).arg(format!("http://{}/v2/", s.addr)));
    assert_ne!(r.stdout, "200", "plain HTTP must not be served on a TLS port");
}

#[test]
fn s3_store_passes_the_storage_conformance_suite() {
    let Some(s3) = S3Server::start("conformance") else { return };
    let staging = tempfile::tempdir().unwrap();
    let o = s3.overrides();
    let o: Vec<(&str, &str)> = o.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let store = registry::store::ObjectStoreBackend::s3_with("conformance", "some/prefix", staging.path(), &o).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    rt.block_on(registry::store::conformance::all(&store));
}

#[test]
fn s3_replicas_share_one_bucket() {
    if !have("skopeo") {
        return;
    }
    let Some(s3) = S3Server::start("shared") else { return };
    let env = s3.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let tmp = tempfile::tempdir().unwrap();
    let (sa, sb) = (tmp.path().join("stage-a"), tmp.path().join("stage-b"));
    let a = Serve::start("s3://shared/reg", &["--staging-dir", sa.to_str().unwrap()], &env);
    let b = Serve::start("s3://shared/reg", &["--staging-dir", sb.to_str().unwrap()], &env);
    let src = tmp.path().join("src");
    let md = oci_layout(&src, "v1", &[(21, 20 * MIB + 1), (22, 4096)]);
    let r = skopeo_copy(&format!("oci:{}:v1", src.display()), &format!("docker://{}/snap/vm:v1", a.addr), &[]);
    assert_eq!(r.code, 0, "push to A: {}\n{}", r.stderr, a.log_text());
    let back = tmp.path().join("back");
    let r = skopeo_copy(&format!("docker://{}/snap/vm:v1", b.addr), &format!("oci:{}:v1", back.display()), &[]);
    assert_eq!(r.code, 0, "pull from B: {}\n{}", r.stderr, b.log_text());
    assert_eq!(layout_manifest_digest(&back, "v1").as_deref(), Some(md.as_str()));
    // One chunked upload across both replicas.
    let c = Client::new();
    let data = random_bytes(23, 3 * MIB);
    let d = sha256(&data);
    let loc = start_upload(&c, &a, "snap/chunks");
    let r = c.patch(b.url(&loc)).header("content-range", format!("0-{}", MIB - 1)).body(data[..MIB].to_vec()).send().unwrap();
    assert_eq!(r.status(), 202, "B continues A's session");
    let r = c.patch(a.url(&loc)).header("content-range", format!("{MIB}-{}", data.len() - 1)).body(data[MIB..].to_vec()).send().unwrap();
    assert_eq!(r.status(), 202);
    let r = c.put(b.url(&format!("{loc}?digest={d}"))).send().unwrap();
    assert_eq!(r.status(), 201, "{}", r.text().unwrap());
    let got = c.get(a.url(&format!("/v2/snap/chunks/blobs/{d}"))).send().unwrap().bytes().unwrap();
    assert_eq!(sha256(&got), d);
    // gc over the bucket: nothing live is swept. S3 mtimes have whole seconds, and gc
    // counts a blob (or a use) from the second it started in as younger than `--grace 0s`
    // (spec/registry.md §4): start it in a later second than the upload.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let mut cmd = snapctl();
    cmd.args(["gc", "--storage", "s3://shared/reg", "--grace", "0s", "--json"]);
    for (k, v) in &env {
        cmd.env(k, v);
    }
    let r = run(&mut cmd);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let rep: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(rep["swept"].as_u64(), Some(1), "only the unreferenced chunked blob: {rep}");
    let r = skopeo_copy(&format!("docker://{}/snap/vm:v1", a.addr), &format!("oci:{}:again", back.display()), &[]);
    assert_eq!(r.code, 0, "pull after gc: {}", r.stderr);
}
