//! Tests of what an operator sees: the catalog, the web view, metrics, request logs,
//! htpasswd reloads. Real servers on 127.0.0.1:0, as in `tests.rs`.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use imgfmt::OciDigest;
use reqwest::{Client, StatusCode};
use serde_json::json;

use super::tests::TestServer;
use super::*;
use crate::layout;
use crate::name::RepoName;

/// Distribution's catalog order: lexical by path component (`a`, `a/b`, `a-b`).
fn catalog_order(a: &str, b: &str) -> std::cmp::Ordering {
    a.replace('/', "\0").cmp(&b.replace('/', "\0"))
}

/// A repository written straight into a directory store (no fsync: 10,001 of them must
/// be cheap): its manifest link, as an earlier snapctl laid it out, so the server has to
/// find it; with `indexed`, its catalog entry too, as a manifest PUT writes it.
fn lay_out_repository(root: &std::path::Path, name: &str, indexed: bool) {
    let d = OciDigest::of(name.as_bytes());
    let dir = root.join(format!("repositories/{name}/_manifests/sha256"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(d.hex()), OCI_MANIFEST).unwrap();
    if indexed {
        let entry = root.join(layout::catalog_entry(&RepoName::parse(name).unwrap()));
        std::fs::create_dir_all(entry.parent().unwrap()).unwrap();
        std::fs::write(entry, b"").unwrap();
    }
}

/// Push a one-blob image to `repo` through the API.
async fn push_image(c: &Client, base: &str, repo: &str) {
    let cfg = format!("{{\"repo\":\"{repo}\"}}");
    let cd = OciDigest::of(cfg.as_bytes());
    let r = c.post(format!("{base}/v2/{repo}/blobs/uploads/?digest={cd}")).body(cfg.clone()).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    let m = json!({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd.to_string(), "size": cfg.len()},
        "layers": [],
    });
    let r = c.put(format!("{base}/v2/{repo}/manifests/v1")).header("content-type", OCI_MANIFEST).body(serde_json::to_vec(&m).unwrap()).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED, "{}", r.text().await.unwrap());
}

/// Follow `/v2/_catalog?n=N` and its `Link` headers to the end; the names and the pages.
async fn walk_catalog(c: &Client, base: &str, n: usize, auth: Option<(&str, &str)>) -> (Vec<String>, usize) {
    let (mut names, mut pages) = (Vec::new(), 0);
    let mut next = Some(format!("/v2/_catalog?n={n}"));
    while let Some(path) = next.take() {
        let mut rq = c.get(format!("{base}{path}"));
        if let Some((u, p)) = auth {
            rq = rq.basic_auth(u, Some(p));
        }
        let r = rq.send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{path}");
        assert_eq!(r.headers()["content-type"], "application/json; charset=utf-8");
        if let Some(l) = r.headers().get("link") {
            let l = l.to_str().unwrap();
            let target = l.strip_prefix('<').and_then(|l| l.strip_suffix(">; rel=\"next\"")).unwrap_or_else(|| panic!("Link header {l:?}"));
            assert!(target.starts_with("/v2/_catalog?last=") && target.ends_with(&format!("&n={n}")), "{l}");
            next = Some(target.to_owned());
        }
        let v: serde_json::Value = r.json().await.unwrap();
        let page: Vec<String> = v["repositories"].as_array().unwrap().iter().map(|x| x.as_str().unwrap().to_owned()).collect();
        assert!(page.len() <= n, "page of {} with n={n}", page.len());
        if next.is_some() {
            assert_eq!(page.len(), n, "a page with a next page is full");
        }
        names.extend(page);
        pages += 1;
    }
    (names, pages)
}

/// The catalog conformance walk: 10,001 repositories, pages of 1, 7 and 1000 walked at
/// once while other clients push new repositories. Every walk must list each repository
/// that existed throughout exactly once, in order, and nothing that does not exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn regression_issue_25_catalog_walks_10001_repositories_while_repositories_are_added() {
    let dir = tempfile::tempdir().unwrap();
    let mut initial = Vec::new();
    for i in 0..10_001usize {
        // Nested names and names beside them, so the order is put to the test.
        let name = match i % 3 {
            0 => format!("a{i}"),
            1 => format!("n{}/x{i}", i % 10),
            _ => format!("n{}-{i}", i % 10),
        };
        lay_out_repository(dir.path(), &name, true);
        initial.push(name);
    }
    // Indexing 10,001 repositories at start costs a durable write each (minutes on a slow
    // disk): laid out as indexed; `a_store_from_before_the_catalog_is_listed_whole` covers
    // the indexing.
    std::fs::write(dir.path().join(layout::CATALOG_BUILT), b"").unwrap();
    let t0 = std::time::Instant::now();
    let s = TestServer::start_in(dir, Config::default()).await;
    let base = s.url.clone();
    let c = Client::new();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let added = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let mut adders = Vec::new();
    for w in 0..3 {
        let (c, base, stop, added) = (c.clone(), base.clone(), stop.clone(), added.clone());
        adders.push(tokio::spawn(async move {
            // Bounded: the walks must be able to catch up with names added at the end.
            let mut k = 0;
            while !stop.load(Ordering::Relaxed) && k < 100 {
                // Names that sort all over the catalog: before, between and after the others.
                let name = match k % 3 {
                    0 => format!("a{k}-{w}"),
                    1 => format!("n{}/x{k}/new{w}", k % 10),
                    _ => format!("zz{w}/{k}"),
                };
                push_image(&c, &base, &name).await;
                added.lock().unwrap().push(name);
                k += 1;
            }
        }));
    }
    let during = Arc::new(AtomicUsize::new(0));
    let walks: Vec<_> = [1usize, 7, 1000]
        .into_iter()
        .map(|n| {
            let (c, base, added, during) = (c.clone(), base.clone(), added.clone(), during.clone());
            tokio::spawn(async move {
                let before = added.lock().unwrap().len();
                let r = walk_catalog(&c, &base, n, None).await;
                during.fetch_add(added.lock().unwrap().len() - before, Ordering::Relaxed);
                (n, r)
            })
        })
        .collect();
    let mut results = Vec::new();
    for w in walks {
        results.push(w.await.unwrap());
    }
    stop.store(true, Ordering::Relaxed);
    for a in adders {
        a.await.unwrap();
    }
    let added: HashSet<String> = added.lock().unwrap().iter().cloned().collect();
    let existing: HashSet<&String> = initial.iter().collect();
    assert!(during.load(Ordering::Relaxed) > 0, "no repository was added while the walks ran");
    for (n, (names, pages)) in results {
        let mut seen = HashSet::new();
        for w in names.windows(2) {
            assert_eq!(catalog_order(&w[0], &w[1]), std::cmp::Ordering::Less, "n={n}: {:?} listed before {:?}", w[0], w[1]);
        }
        for name in &names {
            assert!(seen.insert(name.clone()), "n={n}: {name} listed twice");
            assert!(added.contains(name) || existing.contains(name), "n={n}: {name} does not exist");
        }
        let missing: Vec<&String> = initial.iter().filter(|x| !seen.contains(*x)).take(5).collect();
        assert!(missing.is_empty(), "n={n}: repositories that existed throughout the walk are missing: {missing:?}");
        assert!(pages >= 10_001usize.div_ceil(n), "n={n}: {pages} pages");
        eprintln!("n={n}: {} repositories in {pages} pages", names.len());
    }
    eprintln!("walks took {:?}", t0.elapsed());
}

#[tokio::test]
async fn a_store_from_before_the_catalog_is_listed_whole() {
    let dir = tempfile::tempdir().unwrap();
    let names: Vec<String> = (0..150).map(|i| format!("old{}/r{i}", i % 4)).collect();
    for n in &names {
        lay_out_repository(dir.path(), n, false);
    }
    let s = TestServer::start_in(dir, Config::default()).await;
    let c = Client::new();
    let (got, pages) = walk_catalog(&c, &s.url, 7, None).await;
    let mut want = names.clone();
    want.sort_by(|a, b| catalog_order(a, b));
    assert_eq!(got, want);
    assert_eq!(pages, 150usize.div_ceil(7));
}

#[tokio::test]
async fn catalog_pages_and_n_cap_answer_as_distribution_does() {
    let s = TestServer::start(Config::default()).await;
    let c = Client::new();
    for r in ["b", "a/b", "a", "a-b", "a.b", "a0", "c/d/e"] {
        push_image(&c, &s.url, r).await;
    }
    // Without n: distribution's default page of 100.
    let r = c.get(s.u("/v2/_catalog")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert!(r.headers().get("link").is_none());
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v, json!({"repositories": ["a", "a/b", "a-b", "a.b", "a0", "b", "c/d/e"]}), "distribution 2.8's order");
    let r = c.get(s.u("/v2/_catalog?n=2")).send().await.unwrap();
    assert_eq!(r.headers()["link"], "</v2/_catalog?last=a%2Fb&n=2>; rel=\"next\"", "last is URL-encoded as distribution does");
    let r = c.get(s.u("/v2/_catalog?n=2&last=a%2Fb")).send().await.unwrap();
    assert_eq!(r.headers()["link"], "</v2/_catalog?last=a.b&n=2>; rel=\"next\"");
    assert_eq!(r.json::<serde_json::Value>().await.unwrap(), json!({"repositories": ["a-b", "a.b"]}));
    let r = c.get(s.u("/v2/_catalog?n=2&last=a0")).send().await.unwrap();
    assert!(r.headers().get("link").is_none(), "a full last page has no Link");
    assert_eq!(r.json::<serde_json::Value>().await.unwrap(), json!({"repositories": ["b", "c/d/e"]}));
    let r = c.get(s.u("/v2/_catalog?n=0")).send().await.unwrap();
    assert!(r.headers().get("link").is_none());
    assert_eq!(r.json::<serde_json::Value>().await.unwrap(), json!({"repositories": []}));
    let r = c.get(s.u("/v2/_catalog?n=1001")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        r.json::<serde_json::Value>().await.unwrap(),
        json!({"errors": [{"code": "PAGINATION_NUMBER_INVALID", "message": "invalid number of results requested", "detail": {"n": 1001}}]})
    );
}

mod auth {
    use super::*;

    const ACL: &str = r#"
        [[rule]]
        users = ["alice"]
        repos = ["team/*", "shared"]
        actions = ["pull", "push"]
        [[rule]]
        users = ["bob"]
        repos = ["*"]
        actions = ["push"]
        [[rule]]
        users = ["anonymous"]
        repos = ["public"]
        actions = ["pull"]
    "#;

    fn cfg(acl: &str, anon: bool) -> Config {
        let h = bcrypt::hash("pw", 4).unwrap();
        let a = Auth::new(&format!("alice:{h}\nbob:{h}\nroot:{h}\n"), Some(acl), anon, vec![9; 32]).unwrap();
        Config { auth: Some(a), ..Config::default() }
    }

    async fn seed(dir: &std::path::Path) {
        for r in ["team/a", "team/b/c", "teamx", "shared", "public", "secret/x"] {
            lay_out_repository(dir, r, false);
        }
    }

    #[tokio::test]
    async fn the_catalog_lists_only_what_the_caller_may_pull() {
        let dir = tempfile::tempdir().unwrap();
        seed(dir.path()).await;
        let s = TestServer::start_in(dir, cfg(ACL, false)).await;
        let c = Client::new();
        let (alice, _) = walk_catalog(&c, &s.url, 1, Some(("alice", "pw"))).await;
        assert_eq!(alice, ["shared", "team/a", "team/b/c"]);
        let (bob, _) = walk_catalog(&c, &s.url, 10, Some(("bob", "pw"))).await;
        assert!(bob.is_empty(), "bob may push but not pull: {bob:?}");
        // Anonymous may pull `public` only.
        let (anon, _) = walk_catalog(&c, &s.url, 10, None).await;
        assert_eq!(anon, ["public"]);
        let r = c.get(s.u("/v2/_catalog")).basic_auth("alice", Some("nope")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        // A token speaks for its user.
        let t: serde_json::Value =
            c.get(s.u("/token?service=snapctl&scope=registry:catalog:*")).basic_auth("alice", Some("pw")).send().await.unwrap().json().await.unwrap();
        let r = c.get(s.u("/v2/_catalog")).bearer_auth(t["token"].as_str().unwrap()).send().await.unwrap();
        assert_eq!(r.json::<serde_json::Value>().await.unwrap(), json!({"repositories": ["shared", "team/a", "team/b/c"]}));
    }

    /// Issue 35: the store's totals (bytes, blobs, manifests, repositories of the whole
    /// store) were on `/ui/` and in `/metrics` for users the ACL confines to some
    /// repositories. They are for users who may pull every repository.
    #[tokio::test]
    async fn regression_issue_35_store_totals_are_only_for_users_who_may_pull_every_repository() {
        let dir = tempfile::tempdir().unwrap();
        seed(dir.path()).await;
        let acl = format!("{ACL}\n[[rule]]\nusers = [\"root\"]\nrepos = [\"*\"]\nactions = [\"pull\"]\n");
        let s = TestServer::start_in(dir, cfg(&acl, false)).await;
        let c = Client::new();
        let get = |path: &str, user: &str| {
            let rq = c.get(s.u(path)).basic_auth(user, Some("pw"));
            async move { rq.send().await.unwrap().text().await.unwrap() }
        };
        let mut taken = false;
        for _ in 0..100 {
            if get("/metrics", "root").await.contains("snapctl_store_bytes") {
                taken = true;
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        assert!(taken, "the store's totals were never taken");
        assert!(get("/ui/", "root").await.contains("stored bytes"));
        let (metrics, ui) = (get("/metrics", "alice").await, get("/ui/", "alice").await);
        assert!(!metrics.contains("snapctl_store_") && metrics.contains("snapctl_build_info"), "{metrics}");
        assert!(!ui.contains("stored bytes") && ui.contains("team/a"), "{ui}");
    }

    #[tokio::test]
    async fn a_caller_without_credentials_who_may_read_nothing_is_challenged() {
        let dir = tempfile::tempdir().unwrap();
        seed(dir.path()).await;
        let acl = "[[rule]]\nusers = [\"*\"]\nrepos = [\"*\"]\nactions = [\"pull\"]\n";
        let s = TestServer::start_in(dir, cfg(acl, false)).await;
        let c = Client::new();
        let r = c.get(s.u("/v2/_catalog")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        let ch = r.headers()["www-authenticate"].to_str().unwrap().to_owned();
        assert!(ch.starts_with("Bearer realm=") && ch.contains("scope=\"registry:catalog:*\""), "{ch}");
        let body = r.text().await.unwrap();
        assert!(!body.contains("team") && !body.contains("secret"), "{body}");
        let (all, _) = walk_catalog(&c, &s.url, 4, Some(("root", "pw"))).await;
        assert_eq!(all, ["public", "secret/x", "shared", "team/a", "team/b/c", "teamx"]);
    }
}

/// A store laid out with `n` blobs of `size` bytes and one manifest listing them all, in
/// two repositories: stored once, pulled twice.
fn lay_out_shared_image(root: &std::path::Path, n: usize, size: usize) -> (u64, u64) {
    let mut layers = Vec::new();
    let mut stored = 0u64;
    for i in 0..n {
        let data = vec![i as u8; size];
        let d = OciDigest::of(&data);
        let p = root.join(layout::blob(&d));
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, &data).unwrap();
        stored += size as u64;
        layers.push(json!({"mediaType": "application/octet-stream", "digest": d.to_string(), "size": size}));
    }
    let m = serde_json::to_vec(&json!({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "layers": layers})).unwrap();
    let md = OciDigest::of(&m);
    let p = root.join(layout::blob(&md));
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, &m).unwrap();
    stored += m.len() as u64;
    for r in ["one", "two/x"] {
        let link = root.join(layout::manifest_link(&RepoName::parse(r).unwrap(), &md));
        std::fs::create_dir_all(link.parent().unwrap()).unwrap();
        std::fs::write(link, OCI_MANIFEST).unwrap();
    }
    (stored, 2 * stored)
}

fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test]
async fn regression_issue_25_metrics_have_store_gauges_latency_histograms_and_build_info() {
    let dir = tempfile::tempdir().unwrap();
    let (stored, logical) = lay_out_shared_image(dir.path(), 3, 1000);
    let s = TestServer::start_in(dir, Config::default()).await;
    let c = Client::new();
    c.get(s.u("/v2/")).send().await.unwrap();
    c.get(s.u("/v2/one/tags/list")).send().await.unwrap();
    // The totals come from a scan at start, not from the scrape: wait for it.
    let mut text = String::new();
    for _ in 0..100 {
        text = c.get(s.u("/metrics")).send().await.unwrap().text().await.unwrap();
        if text.contains("snapctl_store_bytes ") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(metric(&text, "snapctl_store_bytes"), Some(stored as f64), "{text}");
    assert_eq!(metric(&text, "snapctl_store_blobs"), Some(4.0));
    assert_eq!(metric(&text, "snapctl_store_manifests"), Some(2.0));
    assert_eq!(metric(&text, "snapctl_store_repositories"), Some(2.0));
    assert_eq!(metric(&text, "snapctl_store_logical_bytes"), Some(logical as f64));
    assert_eq!(metric(&text, "snapctl_store_dedup_ratio"), Some(2.0));
    assert!(text.contains("# TYPE snapctl_http_request_duration_seconds histogram"), "{text}");
    assert!(text.contains("snapctl_http_request_duration_seconds_count{route=\"base\",method=\"GET\"} 1\n"), "{text}");
    assert!(text.contains("snapctl_http_request_duration_seconds_count{route=\"tags\",method=\"GET\"} 1\n"), "{text}");
    assert!(text.contains("snapctl_http_request_duration_seconds_bucket{route=\"tags\",method=\"GET\",le=\"+Inf\"} 1\n"), "{text}");
    assert!(text.contains(&format!("snapctl_build_info{{version=\"{}\",commit=\"unknown\"}} 1\n", env!("CARGO_PKG_VERSION"))), "{text}");
    // A scrape lists nothing in the store.
    let lists = |t: &str| metric(t, "snapctl_storage_seconds_count{op=\"list\"}");
    let a = c.get(s.u("/metrics")).send().await.unwrap().text().await.unwrap();
    let b = c.get(s.u("/metrics")).send().await.unwrap().text().await.unwrap();
    assert_eq!(lists(&a), lists(&b), "a scrape walked the store");
}

#[tokio::test]
async fn regression_issue_25_htpasswd_changes_apply_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("htpasswd");
    std::fs::write(&file, format!("alice:{}\n", bcrypt::hash("old", 4).unwrap())).unwrap();
    let auth = Auth::new(&std::fs::read_to_string(&file).unwrap(), None, false, vec![9; 32]).unwrap();
    let cfg = Config { auth: Some(auth), htpasswd_file: Some(file.clone()), htpasswd_poll: std::time::Duration::from_millis(100), ..Config::default() };
    let s = TestServer::start(cfg).await;
    let c = Client::new();
    let status = |pw: &'static str| {
        let (c, u) = (c.clone(), s.u("/v2/"));
        async move { c.get(u).basic_auth("alice", Some(pw)).send().await.unwrap().status() }
    };
    assert_eq!(status("old").await, StatusCode::OK);
    // Written the way editors and `htpasswd` do: a new file renamed over the old one.
    let tmp = dir.path().join("htpasswd.new");
    std::fs::write(&tmp, format!("alice:{}\n", bcrypt::hash("new", 4).unwrap())).unwrap();
    std::fs::rename(&tmp, &file).unwrap();
    let mut ok = false;
    for _ in 0..100 {
        if status("new").await == StatusCode::OK {
            ok = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(ok, "the new password was never accepted");
    assert_eq!(status("old").await, StatusCode::UNAUTHORIZED, "the old password, verified and cached before, is still accepted");
    // Rewritten in place, same size: the modification time tells.
    std::fs::write(&file, format!("alice:{}\n", bcrypt::hash("ne2", 4).unwrap())).unwrap();
    let mut ok = false;
    for _ in 0..100 {
        if status("ne2").await == StatusCode::OK {
            ok = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(ok, "a rewrite in place was not noticed");
    assert_eq!(status("new").await, StatusCode::UNAUTHORIZED);
}
