//! API tests in the spirit of the OCI distribution-spec conformance suite: a real
//! server on 127.0.0.1:0 over a temp-dir store, driven with reqwest.

use std::sync::Arc;

use reqwest::{Client, StatusCode};
use serde_json::json;

use axum::http::{header, HeaderMap, Uri};
use imgfmt::OciDigest;

use super::*;
use crate::error::Code;
use crate::layout;
use crate::name::RepoName;
use crate::store::FsStore;

pub(crate) struct TestServer {
    pub url: String,
    pub dir: tempfile::TempDir,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl TestServer {
    pub async fn start(cfg: Config) -> TestServer {
        let dir = tempfile::tempdir().unwrap();
        TestServer::start_in(dir, cfg).await
    }

    pub async fn start_in(dir: tempfile::TempDir, cfg: Config) -> TestServer {
        let store = Arc::new(FsStore::open(dir.path()).unwrap());
        TestServer::start_on(store, dir, cfg).await
    }

    /// A server over `store` (`dir` is only kept alive with it).
    pub async fn start_on(store: Arc<dyn BlobStore>, dir: tempfile::TempDir, cfg: Config) -> TestServer {
        let server = Server::new(store, cfg);
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let (tx, rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            server
                .serve(l, async {
                    let _ = rx.await;
                })
                .await
                .unwrap();
        });
        TestServer { url, dir, stop: Some(tx), task: Some(task) }
    }

    /// Stop serving and hand back the storage directory.
    pub async fn stop(mut self) -> tempfile::TempDir {
        let _ = self.stop.take().unwrap().send(());
        self.task.take().unwrap().await.unwrap();
        let tmp = tempfile::tempdir().unwrap();
        std::mem::replace(&mut self.dir, tmp)
    }

    pub fn u(&self, path: &str) -> String {
        format!("{}{path}", self.url)
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

fn sha(data: &[u8]) -> OciDigest {
    OciDigest::of(data)
}

fn sha512(data: &[u8]) -> OciDigest {
    imgfmt::OciHasher::sha512().finish_with(data)
}

fn code_of(body: &str) -> String {
    let v: serde_json::Value = serde_json::from_str(body).unwrap_or_else(|_| panic!("not an OCI error body: {body}"));
    v["errors"][0]["code"].as_str().unwrap().to_owned()
}

async fn push_blob(c: &Client, s: &TestServer, repo: &str, data: &[u8]) -> OciDigest {
    let d = sha(data);
    let r = c.post(s.u(&format!("/v2/{repo}/blobs/uploads/?digest={d}"))).body(data.to_vec()).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED, "{}", r.text().await.unwrap());
    d
}

fn image_manifest(config: &OciDigest, config_len: usize, layers: &[(OciDigest, usize)]) -> serde_json::Value {
    json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config.to_string(), "size": config_len},
        "layers": layers.iter().map(|(d, n)| json!({"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d.to_string(), "size": n})).collect::<Vec<_>>(),
    })
}

async fn push_manifest(c: &Client, s: &TestServer, repo: &str, reference: &str, m: &serde_json::Value) -> reqwest::Response {
    c.put(s.u(&format!("/v2/{repo}/manifests/{reference}")))
        .header("content-type", m["mediaType"].as_str().unwrap_or(OCI_MANIFEST))
        .body(serde_json::to_vec(m).unwrap())
        .send()
        .await
        .unwrap()
}

/// A repo with one config + one layer + a manifest tagged `t`; returns the manifest digest.
async fn sample_image(c: &Client, s: &TestServer, repo: &str, tag: &str, salt: &str) -> OciDigest {
    let cfg = format!("{{\"salt\":\"{salt}\"}}");
    let cd = push_blob(c, s, repo, cfg.as_bytes()).await;
    let layer = format!("layer bytes {salt}");
    let ld = push_blob(c, s, repo, layer.as_bytes()).await;
    let m = image_manifest(&cd, cfg.len(), &[(ld, layer.len())]);
    let r = push_manifest(c, s, repo, tag, &m).await;
    assert_eq!(r.status(), StatusCode::CREATED);
    sha(&serde_json::to_vec(&m).unwrap())
}

#[tokio::test]
async fn base_endpoint_answers_200_with_api_version() {
    let s = TestServer::start(Config::default()).await;
    let r = reqwest::get(s.u("/v2/")).await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers()["docker-distribution-api-version"], "registry/2.0");
}

/// The server's end of every accepted connection has TCP_NODELAY. Without it, a small
/// response on a kept-alive connection (a config, an index: how a reader opens a chain)
/// could wait for the client's delayed ACK of its headers before its body went out, 40 ms
/// a request on Linux; opening a 64-layer chain from `snapctl serve` took up to seconds
/// (issue 13 §2). Checked on the socket itself: the stall depends on timing, the option
/// does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regression_issue_13_accepted_connections_have_tcp_nodelay() {
    let s = TestServer::start(Config::default()).await;
    let port: u16 = s.url.rsplit(':').next().unwrap().parse().unwrap();
    let c = Client::new();
    let d = push_blob(&c, &s, "r", br#"{"a small config": true}"#).await;
    assert_eq!(c.get(s.u(&format!("/v2/r/blobs/{d}"))).send().await.unwrap().status(), StatusCode::OK);
    // A connection of our own, held open while we look: the client's pooled ones may
    // already be closed (about one run in eight found none).
    let mut held = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        held.write_all(b"GET /v2/ HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").await.unwrap();
        let mut buf = [0u8; 512];
        assert!(held.read(&mut buf).await.unwrap() > 0, "an answer on the held connection");
    }
    // The server runs in this process: find its accepted sockets among our descriptors
    // (local port = the server's, with a peer; the listener has none).
    let mut accepted = Vec::new();
    for e in std::fs::read_dir("/proc/self/fd").unwrap() {
        let Ok(fd) = e.unwrap().file_name().to_string_lossy().parse::<i32>() else { continue };
        // SAFETY: getsockname/getpeername/getsockopt on a descriptor number only write
        // into the buffers passed with their lengths; a non-socket fails with ENOTSOCK.
        unsafe {
            let mut addr: libc::sockaddr_in = std::mem::zeroed();
            let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            if libc::getsockname(fd, &mut addr as *mut _ as *mut libc::sockaddr, &mut len) != 0 || i32::from(addr.sin_family) != libc::AF_INET {
                continue;
            }
            if u16::from_be(addr.sin_port) != port {
                continue;
            }
            let mut peer: libc::sockaddr_in = std::mem::zeroed();
            let mut plen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            if libc::getpeername(fd, &mut peer as *mut _ as *mut libc::sockaddr, &mut plen) != 0 {
                continue; // the listener
            }
            let mut v: libc::c_int = 0;
            let mut vlen = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
            assert_eq!(libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_NODELAY, &mut v as *mut _ as *mut libc::c_void, &mut vlen), 0);
            accepted.push(v);
        }
    }
    assert!(!accepted.is_empty(), "found no accepted connection on port {port}");
    assert!(accepted.iter().all(|v| *v != 0), "TCP_NODELAY per accepted connection: {accepted:?}");
    drop(held);
}

#[tokio::test]
async fn monolithic_post_put_then_pull_and_head() {
    let s = TestServer::start(Config::default()).await;
    let c = Client::new();
    let data = b"some blob content".to_vec();
    let d = sha(&data);
    let r = c.post(s.u("/v2/a/b/blobs/uploads/")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::ACCEPTED);
    let loc = r.headers()["location"].to_str().unwrap().to_owned();
    assert!(loc.starts_with("/v2/a/b/blobs/uploads/"));
    let r = c.put(s.u(&format!("{loc}?digest={d}"))).body(data.clone()).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(r.headers()["docker-content-digest"], d.to_string().as_str());
    assert_eq!(r.headers()["location"], format!("/v2/a/b/blobs/{d}").as_str());
    let r = c.get(s.u(&format!("/v2/a/b/blobs/{d}"))).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.bytes().await.unwrap(), data);
    let r = c.head(s.u(&format!("/v2/a/b/blobs/{d}"))).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers()["content-length"], data.len().to_string().as_str());
    // Same digest, other repository: not linked there.
    let r = c.get(s.u(&format!("/v2/other/blobs/{d}"))).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    assert_eq!(code_of(&r.text().await.unwrap()), "BLOB_UNKNOWN");
}

#[tokio::test]
async fn sha512_blobs_are_accepted_and_checked() {
    let s = TestServer::start(Config::default()).await;
    let c = Client::new();
    let data = b"sha512 content";
    let d = sha512(data);
    let r = c.post(s.u(&format!("/v2/r/blobs/uploads/?digest={d}"))).body(data.to_vec()).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(c.get(s.u(&format!("/v2/r/blobs/{d}"))).send().await.unwrap().bytes().await.unwrap(), &data[..]);
    // Chunked + sha512 (the cached running hash is sha256; the server must rehash).
    let loc = c.post(s.u("/v2/r/blobs/uploads/")).send().await.unwrap().headers()["location"].to_str().unwrap().to_owned();
    let data2 = b"more sha512";
    let d2 = sha512(data2);
    assert_eq!(c.patch(s.u(&loc)).body(data2.to_vec()).send().await.unwrap().status(), StatusCode::ACCEPTED);
    let r = c.put(s.u(&format!("{loc}?digest={d2}"))).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
}

#[tokio::test]
async fn wrong_digest_is_digest_invalid_and_never_visible() {
    let s = TestServer::start(Config::default()).await;
    let c = Client::new();
    for claimed in [sha(b"what the client claims"), sha512(b"what the client claims")] {
        // Single POST.
        let r = c.post(s.u(&format!("/v2/r/blobs/uploads/?digest={claimed}"))).body("other bytes").send().await.unwrap();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        assert_eq!(code_of(&r.text().await.unwrap()), "DIGEST_INVALID");
        // Session.
        let loc = c.post(s.u("/v2/r/blobs/uploads/")).send().await.unwrap().headers()["location"].to_str().unwrap().to_owned();
        let r = c.put(s.u(&format!("{loc}?digest={claimed}"))).body("other bytes").send().await.unwrap();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        assert_eq!(code_of(&r.text().await.unwrap()), "DIGEST_INVALID");
        let r = c.head(s.u(&format!("/v2/r/blobs/{claimed}"))).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
        assert!(!s.dir.path().join(layout::blob(&claimed)).exists(), "refused blob reached storage");
    }
    // A malformed digest is refused too.
    let r = c.post(s.u("/v2/r/blobs/uploads/?digest=sha256:nothex")).body("x").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn sha512_chunked_upload_and_manifest_with_a_wrong_digest_are_refused() {
    let s = TestServer::start(Config::default()).await;
    let c = Client::new();
    let data = b"patched bytes";
    // PATCH first, so the server holds a running sha256 of the session; the PUT claims
    // sha512 of other bytes. Only a sha512 over the session's bytes may decide.
    for claimed in [sha512(b"other bytes"), sha512(b"patched bytes, and more")] {
        let loc = c.post(s.u("/v2/r/blobs/uploads/")).send().await.unwrap().headers()["location"].to_str().unwrap().to_owned();
        assert_eq!(c.patch(s.u(&loc)).body(data.to_vec()).send().await.unwrap().status(), StatusCode::ACCEPTED);
        let r = c.put(s.u(&format!("{loc}?digest={claimed}"))).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        assert_eq!(code_of(&r.text().await.unwrap()), "DIGEST_INVALID");
        assert_eq!(c.head(s.u(&format!("/v2/r/blobs/{claimed}"))).send().await.unwrap().status(), StatusCode::NOT_FOUND);
        assert!(!s.dir.path().join(layout::blob(&claimed)).exists(), "refused blob reached storage");
    }
    // A sha256 digest of the bytes is not a sha512 one: the algorithm is part of the name.
    let r = c.post(s.u(&format!("/v2/r/blobs/uploads/?digest=sha512:{}", sha(data).hex()))).body(data.to_vec()).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    assert_eq!(code_of(&r.text().await.unwrap()), "DIGEST_INVALID");
    // Manifests by sha512 digest: the right one is stored under it, a wrong one refused.
    let cd = push_blob(&c, &s, "r", b"{}").await;
    let m = image_manifest(&cd, 2, &[]);
    let raw = serde_json::to_vec(&m).unwrap();
    let r = push_manifest(&c, &s, "r", &sha512(b"not the manifest").to_string(), &m).await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    assert_eq!(code_of(&r.text().await.unwrap()), "DIGEST_INVALID");
    let md = sha512(&raw);
    let r = push_manifest(&c, &s, "r", &md.to_string(), &m).await;
    assert_eq!(r.status(), StatusCode::CREATED, "{}", r.text().await.unwrap());
    let r = c.get(s.u(&format!("/v2/r/manifests/{md}"))).header("accept", OCI_MANIFEST).send().await.unwrap();
    assert_eq!(r.headers()["docker-content-digest"], md.to_string().as_str());
    assert_eq!(r.bytes().await.unwrap(), raw);
}

/// A store that an earlier registry wrote, laid out here key by key from literal paths
/// (`spec/registry.md`, "Storage layout") with digests from `sha2` directly, is served
/// and collected as it is: changing the digest type underneath must not move a key.
#[tokio::test]
async fn a_store_laid_out_by_an_earlier_registry_is_still_served() {
    use sha2::Digest as _;
    let dir = tempfile::tempdir().unwrap();
    let put = |rel: &str, data: &[u8]| {
        let p = dir.path().join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, data).unwrap();
    };
    let h256 = |b: &[u8]| hex::encode(sha2::Sha256::digest(b));
    let (layer, big, config, orphan) = (&b"layer written by path"[..], &b"sha512 blob written by path"[..], &br#"{"old":true}"#[..], &b"nobody's"[..]);
    let (lh, bh, ch, oh) = (h256(layer), hex::encode(sha2::Sha512::digest(big)), h256(config), h256(orphan));
    put(&format!("blobs/sha256/{}/{lh}", &lh[..2]), layer);
    put(&format!("blobs/sha512/{}/{bh}", &bh[..2]), big);
    put(&format!("blobs/sha256/{}/{ch}", &ch[..2]), config);
    put(&format!("blobs/sha256/{}/{oh}", &oh[..2]), orphan);
    for (alg, h) in [("sha256", &lh), ("sha512", &bh), ("sha256", &ch)] {
        put(&format!("repositories/old/img/_layers/{alg}/{h}"), b"");
    }
    let desc = |mt: &str, d: String, n: usize| json!({"mediaType": mt, "digest": d, "size": n});
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": desc("application/vnd.oci.image.config.v1+json", format!("sha256:{ch}"), config.len()),
        "layers": [desc("application/vnd.oci.image.layer.v1.tar", format!("sha256:{lh}"), layer.len()),
                   desc("application/vnd.oci.image.layer.v1.tar", format!("sha512:{bh}"), big.len())],
    }))
    .unwrap();
    let mh = h256(&manifest);
    put(&format!("blobs/sha256/{}/{mh}", &mh[..2]), &manifest);
    put(&format!("repositories/old/img/_manifests/sha256/{mh}"), OCI_MANIFEST.as_bytes());
    put("repositories/old/img/_tags/v1", format!("sha256:{mh}").as_bytes());
    let referrer = serde_json::to_vec(&json!({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": "application/vnd.example.sig",
        "config": desc("application/vnd.oci.image.config.v1+json", format!("sha256:{ch}"), config.len()),
        "layers": [], "subject": desc(OCI_MANIFEST, format!("sha256:{mh}"), manifest.len()),
    }))
    .unwrap();
    let rh = h256(&referrer);
    put(&format!("blobs/sha256/{}/{rh}", &rh[..2]), &referrer);
    put(&format!("repositories/old/img/_manifests/sha256/{rh}"), OCI_MANIFEST.as_bytes());
    let rdesc = json!({"mediaType": OCI_MANIFEST, "digest": format!("sha256:{rh}"), "size": referrer.len(), "artifactType": "application/vnd.example.sig"});
    put(&format!("repositories/old/img/_referrers/sha256/{mh}/sha256-{rh}"), &serde_json::to_vec(&rdesc).unwrap());

    let s = TestServer::start_in(dir, Config::default()).await;
    let c = Client::new();
    for (d, bytes) in [(format!("sha256:{lh}"), layer), (format!("sha512:{bh}"), big), (format!("sha256:{ch}"), config)] {
        let r = c.get(s.u(&format!("/v2/old/img/blobs/{d}"))).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{d}");
        assert_eq!(r.headers()["docker-content-digest"], d.as_str());
        assert_eq!(r.bytes().await.unwrap(), bytes, "{d}");
    }
    for reference in ["v1".to_owned(), format!("sha256:{mh}")] {
        let r = c.get(s.u(&format!("/v2/old/img/manifests/{reference}"))).header("accept", OCI_MANIFEST).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{reference}");
        assert_eq!(r.headers()["docker-content-digest"], format!("sha256:{mh}").as_str());
        assert_eq!(r.bytes().await.unwrap(), manifest);
    }
    let v: serde_json::Value = c.get(s.u("/v2/old/img/tags/list")).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["tags"], json!(["v1"]));
    let v: serde_json::Value = c.get(s.u(&format!("/v2/old/img/referrers/sha256:{mh}"))).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["manifests"][0]["digest"], format!("sha256:{rh}"));
    assert_eq!(v["manifests"].as_array().unwrap().len(), 1);
    // gc reads the same keys: everything reachable is marked, only the orphan would go.
    let dir = s.stop().await;
    let store = FsStore::open(dir.path()).unwrap();
    let report = crate::gc::run(&store, &crate::gc::GcOptions { grace: std::time::Duration::ZERO, dry_run: true, ..Default::default() }).await.unwrap();
    assert_eq!((report.manifests, report.blobs, report.marked, report.swept), (2, 6, 5, 1), "{report:?}");
}

#[tokio::test]
async fn chunked_upload_out_of_order_is_416_and_status_reports_range() {
    let s = TestServer::start(Config::default()).await;
    let c = Client::new();
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
    let d = sha(&data);
    let r = c.post(s.u("/v2/r/blobs/uploads/")).send().await.unwrap();
    let loc = r.headers()["location"].to_str().unwrap().to_owned();
    let r = c
        .patch(s.u(&loc))
        .header("content-range", "0-99999")
        .header("content-type", "application/octet-stream")
        .body(data[..100_000].to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::ACCEPTED);
    assert_eq!(r.headers()["range"], "0-99999");
    // Out of order: skips bytes 100000..150000.
    let r = c.patch(s.u(&loc)).header("content-range", "150000-199999").body(data[150_000..200_000].to_vec()).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::RANGE_NOT_SATISFIABLE);
    let r = c.get(s.u(&loc)).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    assert_eq!(r.headers()["range"], "0-99999");
    let r = c.patch(s.u(&loc)).header("content-range", "100000-199999").body(data[100_000..200_000].to_vec()).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::ACCEPTED);
    // Final chunk with the PUT.
    let r = c.put(s.u(&format!("{loc}?digest={d}"))).body(data[200_000..].to_vec()).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    let back = c.get(s.u(&format!("/v2/r/blobs/{d}"))).send().await.unwrap().bytes().await.unwrap();
    assert!(back == data);
    // The session is gone.
    assert_eq!(c.get(s.u(&loc)).send().await.unwrap().status(), StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn cancel_upload_then_unknown() {
    let s = TestServer::start(Config::default()).await;
    let c = Client::new();
    let loc = c.post(s.u("/v2/r/blobs/uploads/")).send().await.unwrap().headers()["location"].to_str().unwrap().to_owned();
    c.patch(s.u(&loc)).body("abc").send().await.unwrap();
    assert_eq!(c.delete(s.u(&loc)).send().await.unwrap().status(), StatusCode::NO_CONTENT);
    let r = c.get(s.u(&loc)).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    assert_eq!(code_of(&r.text().await.unwrap()), "BLOB_UPLOAD_UNKNOWN");
    // Someone else's session id, bogus ids, and a session used via another repo.
    let loc2 = c.post(s.u("/v2/r/blobs/uploads/")).send().await.unwrap().headers()["location"].to_str().unwrap().to_owned();
    let other = loc2.replace("/v2/r/", "/v2/q/");
    assert_eq!(c.get(s.u(&other)).send().await.unwrap().status(), StatusCode::NOT_FOUND);
    assert_eq!(c.get(s.u("/v2/r/blobs/uploads/..%2f..%2fetc")).send().await.unwrap().status(), StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn upload_session_survives_restart_and_resumes() {
    let s = TestServer::start(Config::default()).await;
    let c = Client::new();
    let data: Vec<u8> = (0..1_000_000u32).map(|i| (i * 7 % 256) as u8).collect();
    let d = sha(&data);
    let loc = c.post(s.u("/v2/r/blobs/uploads/")).send().await.unwrap().headers()["location"].to_str().unwrap().to_owned();
    c.patch(s.u(&loc)).header("content-range", "0-399999").body(data[..400_000].to_vec()).send().await.unwrap();
    let dir = s.stop().await;
    let s = TestServer::start_in(dir, Config::default()).await;
    let r = c.get(s.u(&loc)).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    assert_eq!(r.headers()["range"], "0-399999");
    c.patch(s.u(&loc)).header("content-range", "400000-999999").body(data[400_000..].to_vec()).send().await.unwrap();
    let r = c.put(s.u(&format!("{loc}?digest={d}"))).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    assert!(c.get(s.u(&format!("/v2/r/blobs/{d}"))).send().await.unwrap().bytes().await.unwrap() == data);
}

#[tokio::test]
async fn range_requests() {
    let s = TestServer::start(Config::default()).await;
    let c = Client::new();
    let data: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
    let d = push_blob(&c, &s, "r", &data).await;
    let url = s.u(&format!("/v2/r/blobs/{d}"));
    let r = c.get(&url).header("range", "bytes=10-19").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::PARTIAL_CONTENT);
    assert_eq!(r.headers()["content-range"], "bytes 10-19/1000");
    assert_eq!(r.bytes().await.unwrap(), &data[10..20]);
    let r = c.get(&url).header("range", "bytes=990-").send().await.unwrap();
    assert_eq!(r.headers()["content-range"], "bytes 990-999/1000");
    assert_eq!(r.bytes().await.unwrap(), &data[990..]);
    let r = c.get(&url).header("range", "bytes=-5").send().await.unwrap();
    assert_eq!(r.bytes().await.unwrap(), &data[995..]);
    let r = c.get(&url).header("range", "bytes=995-5000").send().await.unwrap();
    assert_eq!(r.bytes().await.unwrap(), &data[995..]);
    let r = c.get(&url).header("range", "bytes=1000-1001").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::RANGE_NOT_SATISFIABLE);
    assert_eq!(r.headers()["content-range"], "bytes */1000");
}

#[tokio::test]
async fn manifests_by_tag_and_digest_with_accept_negotiation() {
    let s = TestServer::start(Config::default()).await;
    let c = Client::new();
    let md = sample_image(&c, &s, "img", "v1", "a").await;
    for reference in ["v1".to_owned(), md.to_string()] {
        let r = c.get(s.u(&format!("/v2/img/manifests/{reference}"))).header("accept", OCI_MANIFEST).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers()["content-type"], OCI_MANIFEST);
        assert_eq!(r.headers()["docker-content-digest"], md.to_string().as_str());
        let body = r.bytes().await.unwrap();
        assert_eq!(sha(&body), md);
        let r = c.head(s.u(&format!("/v2/img/manifests/{reference}"))).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers()["content-length"], body.len().to_string().as_str());
    }
    let r = c.get(s.u("/v2/img/manifests/v1")).header("accept", "application/vnd.docker.distribution.manifest.v2+json").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND, "Accept without the stored type");
    let r = c.get(s.u("/v2/img/manifests/v1")).header("accept", "application/vnd.docker.distribution.manifest.v2+json, */*;q=0.1").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let r = c.get(s.u("/v2/img/manifests/nope")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    assert_eq!(code_of(&r.text().await.unwrap()), "MANIFEST_UNKNOWN");
    // Pushing by digest: the digest must match the body.
    let m = json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [{"mediaType": OCI_MANIFEST, "digest": md.to_string(), "size": 1}]});
    let body = serde_json::to_vec(&m).unwrap();
    let r = push_manifest(&c, &s, "img", &sha(b"not it").to_string(), &m).await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let r = push_manifest(&c, &s, "img", &sha(&body).to_string(), &m).await;
    assert_eq!(r.status(), StatusCode::CREATED, "index whose child is in the repo");
}

#[tokio::test]
async fn manifest_referring_to_missing_blobs_is_refused() {
    let s = TestServer::start(Config::default()).await;
    let c = Client::new();
    let cd = push_blob(&c, &s, "r", b"{}").await;
    let m = image_manifest(&cd, 2, &[(sha(b"never uploaded"), 14)]);
    let r = push_manifest(&c, &s, "r", "t", &m).await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    assert_eq!(code_of(&r.text().await.unwrap()), "MANIFEST_BLOB_UNKNOWN");
    let r = c.put(s.u("/v2/r/manifests/t")).header("content-type", OCI_MANIFEST).body("{not json").send().await.unwrap();
    assert_eq!(code_of(&r.text().await.unwrap()), "MANIFEST_INVALID");
}

#[tokio::test]
async fn manifests_up_to_4_mib_accepted_beyond_413() {
    let s = TestServer::start(Config::default()).await;
    let c = Client::new();
    let cd = push_blob(&c, &s, "r", b"{}").await;
    let mut m = image_manifest(&cd, 2, &[]);
    let base = serde_json::to_vec(&m).unwrap().len();
    let pad = |m: &mut serde_json::Value, n: usize| m["annotations"] = json!({ "pad": "x".repeat(n) });
    pad(&mut m, 0);
    let overhead = serde_json::to_vec(&m).unwrap().len() - base;
    pad(&mut m, DEFAULT_MAX_MANIFEST - base - overhead);
    assert_eq!(serde_json::to_vec(&m).unwrap().len(), DEFAULT_MAX_MANIFEST);
    assert_eq!(push_manifest(&c, &s, "r", "big", &m).await.status(), StatusCode::CREATED);
    pad(&mut m, DEFAULT_MAX_MANIFEST - base - overhead + 1);
    assert_eq!(push_manifest(&c, &s, "r", "bigger", &m).await.status(), StatusCode::PAYLOAD_TOO_LARGE);
}

#[tokio::test]
async fn tags_list_paginates() {
    let s = TestServer::start(Config::default()).await;
    let c = Client::new();
    let md = sample_image(&c, &s, "r", "a", "x").await;
    let m = c.get(s.u(&format!("/v2/r/manifests/{md}"))).send().await.unwrap().bytes().await.unwrap();
    for t in ["d", "c", "b", "e"] {
        let r = c.put(s.u(&format!("/v2/r/manifests/{t}"))).header("content-type", OCI_MANIFEST).body(m.clone()).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::CREATED);
    }
    let v: serde_json::Value = c.get(s.u("/v2/r/tags/list")).send().await.unwrap().json().await.unwrap();
    assert_eq!(v, json!({"name": "r", "tags": ["a", "b", "c", "d", "e"]}));
    let r = c.get(s.u("/v2/r/tags/list?n=2")).send().await.unwrap();
    assert_eq!(r.headers()["link"], "</v2/r/tags/list?n=2&last=b>; rel=\"next\"");
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["tags"], json!(["a", "b"]));
    let v: serde_json::Value = c.get(s.u("/v2/r/tags/list?n=2&last=b")).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["tags"], json!(["c", "d"]));
    let v: serde_json::Value = c.get(s.u("/v2/r/tags/list?last=d")).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["tags"], json!(["e"]));
    let v: serde_json::Value = c.get(s.u("/v2/r/tags/list?n=0")).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["tags"], json!([]));
    let r = c.get(s.u("/v2/nothing/tags/list")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    assert_eq!(code_of(&r.text().await.unwrap()), "NAME_UNKNOWN");
}

#[tokio::test]
async fn referrers_api_with_subject_header_and_filter() {
    let s = TestServer::start(Config::default()).await;
    let c = Client::new();
    let subject = sample_image(&c, &s, "r", "v1", "subj").await;
    let empty_cfg = push_blob(&c, &s, "r", b"{}").await;
    let mut digests = Vec::new();
    for (i, at) in ["application/vnd.example.sig", "application/vnd.example.sbom"].iter().enumerate() {
        let m = json!({
            "schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": at,
            "config": {"mediaType": "application/vnd.oci.empty.v1+json", "digest": empty_cfg.to_string(), "size": 2},
            "layers": [],
            "subject": {"mediaType": OCI_MANIFEST, "digest": subject.to_string(), "size": 1},
            "annotations": {"n": i.to_string()},
        });
        let r = push_manifest(&c, &s, "r", &sha(&serde_json::to_vec(&m).unwrap()).to_string(), &m).await;
        assert_eq!(r.status(), StatusCode::CREATED);
        assert_eq!(r.headers()["oci-subject"], subject.to_string().as_str());
        digests.push(sha(&serde_json::to_vec(&m).unwrap()));
    }
    let r = c.get(s.u(&format!("/v2/r/referrers/{subject}"))).send().await.unwrap();
    assert_eq!(r.headers()["content-type"], OCI_INDEX);
    assert!(r.headers().get("oci-filters-applied").is_none());
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["manifests"].as_array().unwrap().len(), 2);
    let r = c.get(s.u(&format!("/v2/r/referrers/{subject}?artifactType=application/vnd.example.sbom"))).send().await.unwrap();
    assert_eq!(r.headers()["oci-filters-applied"], "artifactType");
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["manifests"].as_array().unwrap().len(), 1);
    assert_eq!(v["manifests"][0]["artifactType"], "application/vnd.example.sbom");
    assert_eq!(v["manifests"][0]["annotations"]["n"], "1");
    // Deleting a referrer removes it from the list.
    let r = c.delete(s.u(&format!("/v2/r/manifests/{}", digests[1]))).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::ACCEPTED);
    let v: serde_json::Value = c.get(s.u(&format!("/v2/r/referrers/{subject}"))).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["manifests"].as_array().unwrap().len(), 1);
    // Unknown subject: empty index, 200.
    let v: serde_json::Value = c.get(s.u(&format!("/v2/r/referrers/{}", sha(b"none")))).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["manifests"], json!([]));
    assert_eq!(c.get(s.u("/v2/r/referrers/sha256:zz")).send().await.unwrap().status(), StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn cross_repo_mount_with_and_without_from() {
    let s = TestServer::start(Config::default()).await;
    let c = Client::new();
    let d = push_blob(&c, &s, "src", b"shared layer").await;
    let r = c.post(s.u(&format!("/v2/dst/blobs/uploads/?mount={d}&from=src"))).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(r.headers()["location"], format!("/v2/dst/blobs/{d}").as_str());
    assert_eq!(c.get(s.u(&format!("/v2/dst/blobs/{d}"))).send().await.unwrap().status(), StatusCode::OK);
    let r = c.post(s.u(&format!("/v2/dst2/blobs/uploads/?mount={d}"))).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED, "mount without from: blob exists somewhere");
    let r = c.post(s.u(&format!("/v2/dst3/blobs/uploads/?mount={}&from=src", sha(b"unknown")))).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::ACCEPTED, "unknown blob: a session starts instead");
    assert!(r.headers()["location"].to_str().unwrap().starts_with("/v2/dst3/blobs/uploads/"));
    let r = c.post(s.u(&format!("/v2/dst4/blobs/uploads/?mount={d}&from=elsewhere"))).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::ACCEPTED, "blob not in `from`");
}

#[tokio::test]
async fn delete_manifest_tag_and_blob() {
    let s = TestServer::start(Config::default()).await;
    let c = Client::new();
    let md = sample_image(&c, &s, "r", "v1", "del").await;
    let m = c.get(s.u("/v2/r/manifests/v1")).send().await.unwrap().bytes().await.unwrap();
    c.put(s.u("/v2/r/manifests/v2")).header("content-type", OCI_MANIFEST).body(m).send().await.unwrap();
    assert_eq!(c.delete(s.u("/v2/r/manifests/v2")).send().await.unwrap().status(), StatusCode::ACCEPTED);
    assert_eq!(c.get(s.u("/v2/r/manifests/v2")).send().await.unwrap().status(), StatusCode::NOT_FOUND);
    assert_eq!(c.get(s.u("/v2/r/manifests/v1")).send().await.unwrap().status(), StatusCode::OK);
    assert_eq!(c.delete(s.u(&format!("/v2/r/manifests/{md}"))).send().await.unwrap().status(), StatusCode::ACCEPTED);
    assert_eq!(c.get(s.u(&format!("/v2/r/manifests/{md}"))).send().await.unwrap().status(), StatusCode::NOT_FOUND);
    assert_eq!(c.get(s.u("/v2/r/manifests/v1")).send().await.unwrap().status(), StatusCode::NOT_FOUND, "tags go with the manifest");
    assert_eq!(c.delete(s.u(&format!("/v2/r/manifests/{md}"))).send().await.unwrap().status(), StatusCode::NOT_FOUND);
    let d = push_blob(&c, &s, "r", b"to delete").await;
    assert_eq!(c.delete(s.u(&format!("/v2/r/blobs/{d}"))).send().await.unwrap().status(), StatusCode::ACCEPTED);
    assert_eq!(c.head(s.u(&format!("/v2/r/blobs/{d}"))).send().await.unwrap().status(), StatusCode::NOT_FOUND);
    assert_eq!(c.delete(s.u(&format!("/v2/r/blobs/{d}"))).send().await.unwrap().status(), StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn bad_names_and_paths_are_refused() {
    let s = TestServer::start(Config::default()).await;
    let c = Client::new();
    for p in ["/v2/UPPER/tags/list", "/v2/a..b/tags/list", "/v2/_uploads/tags/list", "/v2/a/%2e%2e%2fx/tags/list"] {
        let r = c.get(s.u(p)).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{p}");
        assert_eq!(code_of(&r.text().await.unwrap()), "NAME_INVALID");
    }
    let r = c.get(s.u("/v2/a/manifests/..")).send().await.unwrap();
    assert!(r.status().is_client_error());
    assert_eq!(c.get(s.u("/v2/a/unknown-endpoint/x")).send().await.unwrap().status(), StatusCode::NOT_FOUND);
    assert_eq!(c.put(s.u("/v2/a/tags/list")).send().await.unwrap().status(), StatusCode::METHOD_NOT_ALLOWED);
    // Raw paths (an HTTP client would normalise these before sending).
    for raw in ["/v2/a/../b/tags/list", "/v2/../../etc/manifests/x", "/v2//a/blobs/x", "/v2/a/./b/referrers/x"] {
        assert_eq!(parse_route(raw).unwrap().unwrap_err().code, Code::NameInvalid, "{raw}");
    }
    assert_eq!(parse_route("/v2/a/b/blobs/uploads/").unwrap().unwrap(), Route::UploadStart(RepoName::parse("a/b").unwrap()));
    assert_eq!(parse_route("/v2/blobs/blobs/x").unwrap().unwrap(), Route::Blob(RepoName::parse("blobs").unwrap(), "x".into()));
}

#[tokio::test]
async fn metrics_count_requests_bytes_and_storage() {
    let s = TestServer::start(Config::default()).await;
    let c = Client::new();
    let d = push_blob(&c, &s, "r", b"0123456789").await;
    c.get(s.u(&format!("/v2/r/blobs/{d}"))).send().await.unwrap().bytes().await.unwrap();
    c.get(s.u("/v2/r/blobs/sha256:0000000000000000000000000000000000000000000000000000000000000000")).send().await.unwrap();
    let t = c.get(s.u("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(t.contains("snapctl_http_requests_total{method=\"POST\",status=\"201\"} 1"), "{t}");
    assert!(t.contains("snapctl_http_errors_total{code=\"BLOB_UNKNOWN\"} 1"), "{t}");
    assert!(t.contains("snapctl_http_request_bytes_total 10"), "{t}");
    assert!(t.contains("snapctl_http_response_bytes_total 10"), "{t}");
    assert!(t.contains("snapctl_storage_seconds_count{op=\"put_file\"} 1"), "{t}");
    assert!(t.contains("snapctl_uploads_completed_total 1"), "{t}");
}

mod auth {
    use super::*;
    use base64::Engine as _;

    fn cfg(acl: Option<&str>, anon: bool) -> Config {
        let h = bcrypt::hash("pw", 4).unwrap();
        let a = Auth::new(&format!("alice:{h}\nbob:{h}\n"), acl, anon, vec![9; 32]).unwrap();
        Config { auth: Some(a), ..Config::default() }
    }

    const ACL: &str = r#"
        [[rule]]
        users = ["alice"]
        repos = ["*"]
        actions = ["pull", "push", "delete"]
        [[rule]]
        users = ["bob"]
        repos = ["bob/*"]
        actions = ["pull", "push"]
        [[rule]]
        users = ["anonymous"]
        repos = ["public"]
        actions = ["pull"]
    "#;

    async fn token(c: &Client, s: &TestServer, user: Option<&str>, scope: &str) -> String {
        let mut rq = c.get(s.u(&format!("/token?service=snapctl&scope={scope}")));
        if let Some(u) = user {
            rq = rq.basic_auth(u, Some("pw"));
        }
        let r = rq.send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        let v: serde_json::Value = r.json().await.unwrap();
        v["token"].as_str().unwrap().to_owned()
    }

    #[tokio::test]
    async fn anonymous_gets_bearer_challenge() {
        let s = TestServer::start(cfg(Some(ACL), false)).await;
        let r = reqwest::get(s.u("/v2/")).await.unwrap();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        let ch = r.headers()["www-authenticate"].to_str().unwrap().to_owned();
        assert!(ch.starts_with(&format!("Bearer realm=\"{}/token\",service=\"snapctl\"", s.url)), "{ch}");
        let r = reqwest::get(s.u("/v2/private/tags/list")).await.unwrap();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        assert!(r.headers()["www-authenticate"].to_str().unwrap().contains("scope=\"repository:private:pull\""));
        // Anonymous read of a public repository is allowed by the ACL.
        let r = reqwest::get(s.u("/v2/public/tags/list")).await.unwrap();
        assert_eq!(r.status(), StatusCode::NOT_FOUND, "allowed (the repo just does not exist)");
    }

    #[tokio::test]
    async fn token_flow_grants_only_acl_rights() {
        let s = TestServer::start(cfg(Some(ACL), false)).await;
        let c = Client::new();
        let t = token(&c, &s, Some("bob"), "repository:bob/x:pull,push").await;
        let data = b"bob's blob";
        let d = sha(data);
        let r = c.post(s.u(&format!("/v2/bob/x/blobs/uploads/?digest={d}"))).bearer_auth(&t).body(data.to_vec()).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::CREATED);
        // Push outside bob/*: the token does not carry it.
        let t2 = token(&c, &s, Some("bob"), "repository:alice/x:pull,push").await;
        let r = c.post(s.u("/v2/alice/x/blobs/uploads/")).bearer_auth(&t2).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        assert!(r.headers()["www-authenticate"].to_str().unwrap().contains("insufficient_scope"));
        // With Basic directly: 403.
        let r = c.post(s.u("/v2/alice/x/blobs/uploads/")).basic_auth("bob", Some("pw")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::FORBIDDEN);
        assert_eq!(code_of(&r.text().await.unwrap()), "DENIED");
        // Wrong password: 401 at the token endpoint and on the API.
        let r = c.get(s.u("/token?scope=repository:bob/x:pull")).basic_auth("bob", Some("nope")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        let r = c.get(s.u("/v2/")).basic_auth("bob", Some("nope")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        // A forged token is refused.
        let r = c.get(s.u("/v2/")).bearer_auth(format!("{t}x")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        let basic = base64::engine::general_purpose::STANDARD.encode("alice:pw");
        let r = c.get(s.u("/v2/")).header("authorization", format!("Basic {basic}")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }

    #[tokio::test]
    async fn mount_from_unreadable_repo_falls_back_to_upload() {
        let s = TestServer::start(cfg(Some(ACL), false)).await;
        let c = Client::new();
        let data = b"alice's secret layer";
        let d = sha(data);
        let r = c.post(s.u(&format!("/v2/alice/private/blobs/uploads/?digest={d}"))).basic_auth("alice", Some("pw")).body(data.to_vec()).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::CREATED);
        for q in [format!("mount={d}&from=alice/private"), format!("mount={d}")] {
            let r = c.post(s.u(&format!("/v2/bob/steal/blobs/uploads/?{q}"))).basic_auth("bob", Some("pw")).send().await.unwrap();
            assert_eq!(r.status(), StatusCode::ACCEPTED, "{q}: must not mount");
        }
        let r = c.head(s.u(&format!("/v2/bob/steal/blobs/{d}"))).basic_auth("bob", Some("pw")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
        // alice may mount within her rights.
        let r = c.post(s.u(&format!("/v2/alice/copy/blobs/uploads/?mount={d}&from=alice/private"))).basic_auth("alice", Some("pw")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::CREATED);
    }

    #[tokio::test]
    async fn anonymous_read_flag() {
        let s = TestServer::start(cfg(None, true)).await;
        let c = Client::new();
        let d = sha(b"x");
        let r = c.post(s.u(&format!("/v2/r/blobs/uploads/?digest={d}"))).body("x").send().await.unwrap();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED, "anonymous push refused");
        let r = c.post(s.u(&format!("/v2/r/blobs/uploads/?digest={d}"))).basic_auth("bob", Some("pw")).body("x").send().await.unwrap();
        assert_eq!(r.status(), StatusCode::CREATED);
        let r = c.get(s.u(&format!("/v2/r/blobs/{d}"))).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK, "anonymous pull allowed");
        let t = token(&c, &s, None, "repository:r:pull,push").await;
        let r = c.get(s.u(&format!("/v2/r/blobs/{d}"))).bearer_auth(&t).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        let r = c.post(s.u("/v2/r/blobs/uploads/")).bearer_auth(&t).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED, "anonymous token carries no push");
    }
}

mod gc {
    use super::*;
    use crate::gc::{mark, run, sweep, GcOptions, GcReport, GcRun};
    use std::time::{Duration, SystemTime};

    /// Set the mtime of every file under `dir` back by `by`: blobs, links and use marks
    /// as a registry has them after a while.
    fn age_all(dir: &std::path::Path, by: Duration) {
        let t = SystemTime::now() - by;
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else {
                    std::fs::File::options().write(true).open(&p).unwrap().set_modified(t).unwrap();
                }
            }
        }
    }

    /// Issue 14: old unreferenced blobs; gc marks (seconds, with 40,000 manifests); a
    /// re-push of the same image meanwhile: its HEADs find config and layer, it uploads a
    /// blob the registry already holds, its manifest PUT succeeds. The sweep that follows
    /// must keep everything the push relied on.
    #[tokio::test]
    async fn regression_issue_14_a_push_during_gc_keeps_what_it_relied_on() {
        let s = TestServer::start(Config::default()).await;
        let c = Client::new();
        let md = sample_image(&c, &s, "r", "v1", "old").await;
        let extra = push_blob(&c, &s, "r", b"extra layer").await;
        assert_eq!(c.delete(s.u(&format!("/v2/r/manifests/{md}"))).send().await.unwrap().status(), StatusCode::ACCEPTED);
        age_all(s.dir.path(), Duration::from_secs(7200));
        let (cfg, layer) = ("{\"salt\":\"old\"}", "layer bytes old");
        let (cd, ld) = (sha(cfg.as_bytes()), sha(layer.as_bytes()));

        let store = FsStore::open(s.dir.path()).unwrap();
        let opts = GcOptions::default();
        let mut report = GcReport::default();
        let mut gc = GcRun::start(&store, false).await.unwrap();
        let marked = mark(&store, &mut gc, &opts, &mut report).await.unwrap();

        for d in [&cd, &ld] {
            assert_eq!(c.head(s.u(&format!("/v2/r/blobs/{d}"))).send().await.unwrap().status(), StatusCode::OK);
        }
        assert_eq!(push_blob(&c, &s, "r", b"extra layer").await, extra);
        let m = image_manifest(&cd, cfg.len(), &[(ld.clone(), layer.len()), (extra.clone(), 11)]);
        assert_eq!(push_manifest(&c, &s, "r", "v2", &m).await.status(), StatusCode::CREATED);

        sweep(&store, &mut gc, &opts, marked, &mut report).await.unwrap();
        gc.finish(&store).await;
        assert_eq!((report.kept_in_use, report.swept), (3, 1), "only the deleted manifest goes: {report:?}");
        for d in [&cd, &ld, &extra] {
            let r = c.get(s.u(&format!("/v2/r/blobs/{d}"))).send().await.unwrap();
            assert_eq!(r.status(), StatusCode::OK, "gc deleted {d}, which the push relied on");
        }
        assert!(!s.dir.path().join("_gc/run").exists() && !s.dir.path().join("_gc/condemned").exists(), "gc left its marks");
    }

    /// The same race on an object store (S3's key space, no directories, no way to set an
    /// mtime back): with `--grace 0s` everything stored before gc started is a candidate,
    /// and only what the push relied on while gc ran is kept.
    #[tokio::test]
    async fn regression_issue_14_a_push_during_gc_keeps_what_it_relied_on_object_store() {
        let staging = tempfile::tempdir().unwrap();
        let mem = Arc::new(object_store::memory::InMemory::new());
        let store: Arc<dyn BlobStore> = Arc::new(crate::store::ObjectStoreBackend::new(mem, "reg", staging.path()).unwrap());
        let s = TestServer::start_on(store.clone(), tempfile::tempdir().unwrap(), Config::default()).await;
        let c = Client::new();
        let md = sample_image(&c, &s, "r", "v1", "old").await;
        assert_eq!(c.delete(s.u(&format!("/v2/r/manifests/{md}"))).send().await.unwrap().status(), StatusCode::ACCEPTED);
        let orphan = push_blob(&c, &s, "r", b"nobody relies on this").await;
        let (cfg, layer) = ("{\"salt\":\"old\"}", "layer bytes old");
        let (cd, ld) = (sha(cfg.as_bytes()), sha(layer.as_bytes()));
        tokio::time::sleep(Duration::from_millis(20)).await; // gc starts strictly later

        let opts = GcOptions { grace: Duration::ZERO, ..GcOptions::default() };
        let mut report = GcReport::default();
        let mut gc = GcRun::start(store.as_ref(), false).await.unwrap();
        let marked = mark(store.as_ref(), &mut gc, &opts, &mut report).await.unwrap();
        for d in [&cd, &ld] {
            assert_eq!(c.head(s.u(&format!("/v2/r/blobs/{d}"))).send().await.unwrap().status(), StatusCode::OK);
        }
        let m = image_manifest(&cd, cfg.len(), &[(ld.clone(), layer.len())]);
        assert_eq!(push_manifest(&c, &s, "r", "v2", &m).await.status(), StatusCode::CREATED);
        sweep(store.as_ref(), &mut gc, &opts, marked, &mut report).await.unwrap();
        gc.finish(store.as_ref()).await;

        // The manifest is the same as v1's, written again: young.
        assert_eq!((report.kept_in_use, report.swept, report.kept_young), (2, 1, 1), "only the orphan goes: {report:?}");
        for d in [&cd, &ld] {
            assert_eq!(c.get(s.u(&format!("/v2/r/blobs/{d}"))).send().await.unwrap().status(), StatusCode::OK, "{d}");
        }
        assert_eq!(c.get(s.u(&format!("/v2/r/blobs/{orphan}"))).send().await.unwrap().status(), StatusCode::NOT_FOUND);
        assert!(store.list(layout::GC).await.unwrap().iter().all(|m| m.key.starts_with(layout::GC_USED)), "gc left marks");
    }

    /// A manifest PUT in flight holds a lease on what it references: gc keeps those blobs
    /// whatever their age and the grace period, until the lease goes (or is stale).
    #[tokio::test]
    async fn a_lease_keeps_its_blobs_until_released() {
        let s = TestServer::start(Config::default()).await;
        let c = Client::new();
        let d = push_blob(&c, &s, "r", b"leased").await;
        age_all(s.dir.path(), Duration::from_secs(7200));
        let store = FsStore::open(s.dir.path()).unwrap();
        let now = GcOptions { grace: Duration::ZERO, ..GcOptions::default() };
        let lease = crate::inuse::lease(&store, vec![d.clone()]).await.unwrap();
        let rep = run(&store, &now).await.unwrap();
        assert_eq!((rep.kept_in_use, rep.swept), (1, 0), "{rep:?}");
        lease.release(&store).await.unwrap();
        let rep = run(&store, &now).await.unwrap();
        assert_eq!(rep.swept, 1, "{rep:?}");
    }

    /// A HEAD for a blob gc is deciding about waits for gc, and answers by what gc did:
    /// never "present" for a blob about to go.
    #[tokio::test]
    async fn a_head_during_the_sweep_answers_by_what_gc_did() {
        let s = TestServer::start(Config::default()).await;
        let c = Client::new();
        let d = push_blob(&c, &s, "r", b"condemned").await;
        let store = Arc::new(FsStore::open(s.dir.path()).unwrap());
        store.touch(layout::GC_RUN).await.unwrap();
        store.touch(&layout::gc_condemned(&d)).await.unwrap();
        let st = store.clone();
        let d2 = d.clone();
        let gc = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            st.delete(&layout::blob(&d2)).await.unwrap();
            st.delete(&layout::gc_condemned(&d2)).await.unwrap();
        });
        let r = c.head(s.u(&format!("/v2/r/blobs/{d}"))).send().await.unwrap();
        gc.await.unwrap();
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
    }

    /// One gc at a time: a second refuses while the first keeps `_gc/run` fresh.
    #[tokio::test]
    async fn a_second_gc_refuses_to_run_beside_a_live_one() {
        let dir = tempfile::tempdir().unwrap();
        let store = FsStore::open(dir.path()).unwrap();
        store.touch(layout::GC_RUN).await.unwrap();
        assert!(matches!(run(&store, &GcOptions::default()).await, Err(crate::gc::GcError::Running { .. })));
        age_all(dir.path(), Duration::from_secs(3600));
        run(&store, &GcOptions::default()).await.expect("a stopped gc's mark is taken over");
    }

    /// Issue 14: `gc --upload-ttl` removed a session's files but left its directory.
    #[tokio::test]
    async fn regression_issue_14_gc_removes_upload_sessions_whole() {
        let s = TestServer::start(Config::default()).await;
        let c = Client::new();
        for _ in 0..3 {
            let r = c.post(s.u("/v2/r/blobs/uploads/")).send().await.unwrap();
            let loc = r.headers()["location"].to_str().unwrap().to_owned();
            c.patch(s.u(&loc)).body(vec![7u8; 10]).send().await.unwrap();
        }
        let store = FsStore::open(s.dir.path()).unwrap();
        let rep = run(&store, &GcOptions { upload_ttl: Duration::ZERO, ..GcOptions::default() }).await.unwrap();
        assert_eq!(rep.uploads_removed, 3);
        let left: Vec<_> = std::fs::read_dir(s.dir.path().join("_uploads")).unwrap().flatten().map(|e| e.path()).collect();
        assert!(left.is_empty(), "left behind: {left:?}");
    }

    #[tokio::test]
    async fn sweeps_unreferenced_keeps_reachable_and_young() {
        let s = TestServer::start(Config::default()).await;
        let c = Client::new();
        let md = sample_image(&c, &s, "r", "v1", "keep").await;
        let orphan = push_blob(&c, &s, "r", b"orphan blob").await;
        // A referrer whose own blob is only reachable via its manifest.
        let sig = push_blob(&c, &s, "r", b"signature").await;
        let m = json!({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": "application/x-sig",
            "config": {"mediaType": "application/vnd.oci.empty.v1+json", "digest": sig.to_string(), "size": 9},
            "layers": [], "subject": {"mediaType": OCI_MANIFEST, "digest": md.to_string(), "size": 1}});
        assert_eq!(push_manifest(&c, &s, "r", &sha(&serde_json::to_vec(&m).unwrap()).to_string(), &m).await.status(), StatusCode::CREATED);
        let store = FsStore::open(s.dir.path()).unwrap();
        // Fresh blobs are within the grace period.
        let rep = run(&store, &GcOptions::default()).await.unwrap();
        assert_eq!((rep.swept, rep.kept_young), (0, 1));
        let now = GcOptions { grace: std::time::Duration::ZERO, ..GcOptions::default() };
        let dry = run(&store, &GcOptions { dry_run: true, ..now.clone() }).await.unwrap();
        assert_eq!(dry.swept, 1);
        assert!(s.dir.path().join(layout::blob(&orphan)).exists(), "dry run deletes nothing");
        let rep = run(&store, &now).await.unwrap();
        assert_eq!((rep.swept, rep.links_removed, rep.manifests), (1, 1, 2), "{rep:?}");
        assert!(!s.dir.path().join(layout::blob(&orphan)).exists());
        assert_eq!(c.head(s.u(&format!("/v2/r/blobs/{orphan}"))).send().await.unwrap().status(), StatusCode::NOT_FOUND);
        assert_eq!(c.head(s.u(&format!("/v2/r/blobs/{sig}"))).send().await.unwrap().status(), StatusCode::OK);
        let r = c.get(s.u("/v2/r/manifests/v1")).send().await.unwrap();
        let man: serde_json::Value = r.json().await.unwrap();
        for l in man["layers"].as_array().unwrap().iter().chain([&man["config"]]) {
            let r = c.get(s.u(&format!("/v2/r/blobs/{}", l["digest"].as_str().unwrap()))).send().await.unwrap();
            assert_eq!(r.status(), StatusCode::OK);
        }
        // A referrer lives and dies with its subject (issue 22; it used to keep the subject
        // alive): deleting the image frees its blobs and the referrer's; an old upload
        // session goes too.
        c.delete(s.u(&format!("/v2/r/manifests/{md}"))).send().await.unwrap();
        c.post(s.u("/v2/r/blobs/uploads/")).send().await.unwrap();
        // gc starts strictly later than the referrer's PUT relied on its manifest (the
        // kernel stamps `_gc/run` with a clock a tick coarser than a use mark's).
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        let rep = run(&store, &GcOptions { upload_ttl: std::time::Duration::ZERO, ..now }).await.unwrap();
        assert_eq!((rep.swept, rep.uploads_removed, rep.manifests_removed), (5, 1, 1), "{rep:?}");
    }
}

/// Issue 14: what the server promises a hostile client (spec/registry.md §7).
mod hostile {
    use super::*;
    use std::time::{Duration, Instant};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpSocket, TcpStream};

    fn limits(header: u64, idle: u64, cap: usize) -> Limits {
        Limits { header_read_timeout: Duration::from_secs(header), idle_timeout: Duration::from_secs(idle), max_conns_per_client: cap, ..Limits::default() }
    }

    /// A connection to the server from source address `from` (any 127/8 address).
    async fn connect_from(s: &TestServer, from: &str) -> TcpStream {
        let sock = TcpSocket::new_v4().unwrap();
        sock.bind(format!("{from}:0").parse().unwrap()).unwrap();
        sock.connect(s.url.trim_start_matches("http://").parse().unwrap()).await.unwrap()
    }

    /// Whether the server closed `c` (EOF or reset) within `within`; bytes it sent first
    /// (an error response) are skipped.
    async fn closed_within(c: &mut TcpStream, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        let mut buf = [0u8; 4096];
        loop {
            match tokio::time::timeout_at(deadline, c.read(&mut buf)).await {
                Err(_) => return false,
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) => continue,
            }
        }
    }

    #[tokio::test]
    async fn regression_issue_14_made_up_methods_do_not_grow_the_metrics() {
        let s = TestServer::start(Config::default()).await;
        let c = Client::new();
        let send = |i: usize| {
            let m = reqwest::Method::from_bytes(format!("M{i}{}", "X".repeat(2000)).as_bytes()).unwrap();
            c.request(m, s.u("/v2/")).send()
        };
        // Every label set these requests use exists after the first few (the scrape's
        // own latency histogram included), with counts of two digits; from there on only
        // digits may grow: one per counter and histogram line, not a line per method.
        for i in 0..10 {
            send(i).await.unwrap();
        }
        // The store's gauges appear once its first scan ends (a background task).
        for _ in 0..200 {
            if c.get(s.u("/metrics")).send().await.unwrap().text().await.unwrap().contains("snapctl_store_scan_timestamp_seconds") {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let before = c.get(s.u("/metrics")).send().await.unwrap().text().await.unwrap();
        assert!(before.contains("snapctl_store_scan_timestamp_seconds"), "the store's first scan never ended: {before}");
        for i in 10..300 {
            send(i).await.unwrap();
        }
        let after = c.get(s.u("/metrics")).send().await.unwrap().text().await.unwrap();
        let names = |t: &str| t.lines().map(|l| l.split([' ', '{']).next().unwrap_or("").to_owned()).collect::<std::collections::BTreeSet<_>>();
        let new_names: Vec<String> = names(&after).difference(&names(&before)).cloned().collect();
        assert!(after.len() < before.len() + 200, "metrics grew from {} to {} bytes; new: {new_names:?}", before.len(), after.len());
        assert!(after.contains("snapctl_http_requests_total{method=\"other\",status=\"200\"} 300"), "{after}");
    }

    #[tokio::test]
    async fn metrics_can_move_to_their_own_listener() {
        let s = TestServer::start(Config { api_metrics: false, ..Config::default() }).await;
        assert_eq!(reqwest::get(s.u("/metrics")).await.unwrap().status(), StatusCode::NOT_FOUND);
        let server = Server::new(Arc::new(FsStore::open(s.dir.path()).unwrap()), Config::default());
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/metrics", l.local_addr().unwrap());
        tokio::spawn(server.serve_metrics(l, std::future::pending()));
        let r = reqwest::get(&url).await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        assert!(r.text().await.unwrap().contains("snapctl_http_connections"));
    }

    #[tokio::test]
    async fn metrics_on_the_api_listener_need_credentials_when_auth_is_on() {
        let h = bcrypt::hash("pw", 4).unwrap();
        let a = Auth::new(&format!("alice:{h}\n"), None, true, vec![9; 32]).unwrap();
        let s = TestServer::start(Config { auth: Some(a), ..Config::default() }).await;
        let c = Client::new();
        assert_eq!(c.get(s.u("/metrics")).send().await.unwrap().status(), StatusCode::UNAUTHORIZED);
        assert_eq!(c.get(s.u("/metrics")).basic_auth("alice", Some("pw")).send().await.unwrap().status(), StatusCode::OK);
    }

    /// Issue 14: HTTP/2 sends `:authority`, not `Host`; the realm was `…://localhost/token`.
    #[tokio::test]
    async fn regression_issue_14_h2_token_realm_is_the_requests_authority() {
        let h = bcrypt::hash("pw", 4).unwrap();
        let a = Auth::new(&format!("alice:{h}\n"), None, false, vec![9; 32]).unwrap();
        let s = TestServer::start(Config { auth: Some(a), ..Config::default() }).await;
        let c = Client::builder().http2_prior_knowledge().build().unwrap();
        let r = c.get(s.u("/v2/")).send().await.unwrap();
        assert_eq!(r.version(), reqwest::Version::HTTP_2);
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        let ch = r.headers()["www-authenticate"].to_str().unwrap().to_owned();
        assert!(ch.starts_with(&format!("Bearer realm=\"{}/token\"", s.url)), "{ch}");
    }

    #[test]
    fn the_realm_never_echoes_a_host_that_breaks_the_challenge() {
        let mut h = HeaderMap::new();
        let uri: Uri = "/v2/".parse().unwrap();
        h.insert(header::HOST, "reg.example:5000".parse().unwrap());
        assert_eq!(request_authority(&uri, &h), Some("reg.example:5000"));
        h.insert(header::HOST, "evil\",error=\"x".parse().unwrap());
        assert_eq!(request_authority(&uri, &h), None);
        let abs: Uri = "http://[::1]:5000/v2/".parse().unwrap();
        assert_eq!(request_authority(&abs, &h), Some("[::1]:5000"), "the URI's authority wins");
    }

    #[test]
    fn passwords_in_clear_text_on_the_network_are_warned_about() {
        let h = bcrypt::hash("pw", 4).unwrap();
        let auth = || Some(Auth::new(&format!("alice:{h}\n"), None, false, vec![9; 32]).unwrap());
        let public: SocketAddr = "0.0.0.0:5000".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        assert_eq!(Config { auth: auth(), ..Config::default() }.exposure_warnings(public).len(), 1);
        assert!(Config { auth: auth(), ..Config::default() }.exposure_warnings(local).is_empty());
        assert!(Config { auth: auth(), tls: true, ..Config::default() }.exposure_warnings(public).is_empty());
        assert!(Config::default().exposure_warnings(public).is_empty());
    }

    /// Issue 14: 300 half-sent requests held the registry at its descriptor limit. Now a
    /// client past its cap is closed at once, half-sent heads are closed after the header
    /// timeout, and another client is answered meanwhile.
    #[tokio::test]
    async fn regression_issue_14_half_sent_requests_are_capped_and_timed_out() {
        let s = TestServer::start(Config { limits: limits(2, 5, 8), ..Config::default() }).await;
        let mut held = Vec::new();
        for _ in 0..40 {
            let mut c = connect_from(&s, "127.0.0.2").await;
            // Past the cap the server may have closed it already: the write may fail.
            let _ = c.write_all(b"GET /v2/ HTTP/1.1\r\nHost: x\r\nX-Slow: ").await;
            held.push(c);
        }
        let t = Instant::now();
        let r = Client::builder().timeout(Duration::from_secs(5)).build().unwrap().get(s.u("/v2/")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK, "another client is answered");
        assert!(t.elapsed() < Duration::from_secs(2), "answered after {:?}", t.elapsed());
        // Accepted in order, so all 40 were handled before that GET: 8 held, 32 closed.
        let metrics = reqwest::get(s.u("/metrics")).await.unwrap().text().await.unwrap();
        assert!(metrics.contains("snapctl_http_connections_refused_total 32\n"), "{metrics}");
        let mut refused = 0;
        for c in held.iter_mut() {
            if closed_within(c, Duration::from_millis(100)).await {
                refused += 1;
            }
        }
        assert_eq!(refused, 32, "connections past the cap of 8 are closed at once");
        for c in held.iter_mut() {
            assert!(closed_within(c, Duration::from_secs(6)).await, "a half-sent head outlived the header timeout");
        }
        let mut again = connect_from(&s, "127.0.0.2").await;
        again.write_all(b"GET /v2/ HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
        let mut resp = String::new();
        again.read_to_string(&mut resp).await.unwrap();
        assert!(resp.starts_with("HTTP/1.1 200"), "the client may connect again once its connections are gone: {resp}");
    }

    /// A connection that never sends a byte (not even enough to tell HTTP/1.1 from h2) is
    /// closed after the header timeout too.
    #[tokio::test]
    async fn a_silent_connection_is_closed_after_the_header_timeout() {
        let s = TestServer::start(Config { limits: limits(1, 60, 0), ..Config::default() }).await;
        let mut c = connect_from(&s, "127.0.0.1").await;
        let t = Instant::now();
        assert!(closed_within(&mut c, Duration::from_secs(5)).await);
        assert!(t.elapsed() >= Duration::from_millis(900), "closed too early: {:?}", t.elapsed());
    }

    /// A request body that stops arriving fails its request after the idle timeout
    /// instead of holding the connection forever.
    #[tokio::test]
    async fn a_stalled_request_body_is_answered_and_closed() {
        let s = TestServer::start(Config { limits: limits(30, 1, 0), ..Config::default() }).await;
        let c = Client::new();
        let r = c.post(s.u("/v2/r/blobs/uploads/")).send().await.unwrap();
        let loc = r.headers()["location"].to_str().unwrap().to_owned();
        let mut conn = connect_from(&s, "127.0.0.1").await;
        conn.write_all(format!("PATCH {loc} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n0123456789").as_bytes()).await.unwrap();
        let mut resp = vec![0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut resp)).await.expect("no answer to a stalled body").unwrap();
        let head = String::from_utf8_lossy(&resp[..n]);
        assert!(head.starts_with("HTTP/1.1 400"), "{head}");
        assert!(head.contains("request body"), "{head}");
        // The session is intact: nothing of the stalled body was committed.
        let r = c.get(s.u(&loc)).send().await.unwrap();
        assert_eq!(r.headers()["range"], "0-0");
    }

    /// Issue 14: upload sessions never expired in `serve`. Now a sweep removes idle ones
    /// whole (directories too) and the gauge comes back down.
    #[tokio::test]
    async fn regression_issue_14_idle_upload_sessions_expire_in_the_server() {
        let s = TestServer::start(Config { upload_ttl: Duration::from_secs(1), ..Config::default() }).await;
        let c = Client::new();
        let r = c.post(s.u("/v2/r/blobs/uploads/")).send().await.unwrap();
        let loc = r.headers()["location"].to_str().unwrap().to_owned();
        assert_eq!(c.patch(s.u(&loc)).body(vec![1u8; 100]).send().await.unwrap().status(), StatusCode::ACCEPTED);
        let m = c.get(s.u("/metrics")).send().await.unwrap().text().await.unwrap();
        assert!(m.contains("snapctl_uploads_in_progress 1\n"), "{m}");
        let uploads = s.dir.path().join("_uploads");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::fs::read_dir(&uploads).map(|d| d.count()).unwrap_or(0) > 0 {
            assert!(Instant::now() < deadline, "idle session still in {}", uploads.display());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let r = c.get(s.u(&loc)).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
        let m = c.get(s.u("/metrics")).send().await.unwrap().text().await.unwrap();
        assert!(m.contains("snapctl_uploads_in_progress 0\n"), "{m}");
        assert!(m.contains("snapctl_uploads_expired_total 1\n"), "{m}");
    }
}

/// Retention: what gc deletes beyond unreferenced blobs (spec/registry.md §4).
mod retention;

mod restore_lease;

#[test]
fn regression_issue_25_route_class_of_each_endpoint_from_the_route_grammar() {
    use crate::metrics::ROUTES;
    use crate::server::route_class;
    for (path, class) in [
        ("/v2/", "base"),
        ("/v2", "base"),
        ("/v2/_catalog", "catalog"),
        ("/v2/a/b/c/manifests/v1", "manifest"),
        ("/v2/a/blobs/uploads/", "upload"),
        ("/v2/a/b/blobs/uploads/0123", "upload"),
        ("/v2/a/blobs/uploads", "upload"),
        ("/v2/a/tags/list", "tags"),
        ("/v2/a/referrers/sha256:1", "referrers"),
        ("/token", "token"),
        ("/metrics", "metrics"),
        ("/ui/", "web"),
        ("/ui/repo/a", "web"),
        ("/favicon.ico", "other"),
        ("/v2/a/nothing", "other"),
    ] {
        assert_eq!(route_class(path), class, "{path}");
        assert!(ROUTES.contains(&class));
    }
    // A name that is not valid, or a shape no route has, is no endpoint's.
    assert_eq!(route_class("/v2/A/blobs/sha256:00"), "other");
    assert_eq!(route_class("/v2/blobs/uploads/"), "other");
}

/// An out-of-order `PATCH` sent whole (1 MiB, no `Expect`) is answered 416 with the
/// upload's `Range`, read by the client every time: the refused body is drained before the
/// answer, so the connection is not reset under the client while it writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regression_issue_39_a_refused_patch_is_answered_not_reset() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = TestServer::start(Config::default()).await;
    let c = Client::new();
    let r = c.post(s.u("/v2/r/blobs/uploads/")).send().await.unwrap();
    let loc = r.headers()["location"].to_str().unwrap().to_owned();
    let r = c.patch(s.u(&loc)).header("content-range", "0-9").body(vec![7u8; 10]).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::ACCEPTED);
    let body = vec![1u8; 1 << 20];
    let addr = s.url.trim_start_matches("http://").to_owned();
    for round in 0..20 {
        let mut conn = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let head = format!(
            "PATCH {loc} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/octet-stream\r\nContent-Range: 100-{}\r\nContent-Length: {}\r\n\r\n",
            100 + body.len() - 1,
            body.len()
        );
        conn.write_all(head.as_bytes()).await.unwrap();
        conn.write_all(&body).await.unwrap_or_else(|e| panic!("round {round}: the body could not be sent whole: {e}"));
        let mut answer = Vec::new();
        let mut buf = [0u8; 4096];
        while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = conn.read(&mut buf).await.unwrap_or_else(|e| panic!("round {round}: reading the answer: {e}"));
            assert!(n > 0, "round {round}: closed before an answer");
            answer.extend_from_slice(&buf[..n]);
        }
        let text = String::from_utf8_lossy(&answer).to_ascii_lowercase();
        assert!(text.starts_with("http/1.1 416"), "round {round}: {text}");
        assert!(text.contains("\r\nrange: 0-9\r\n"), "round {round}: {text}");
    }
}
