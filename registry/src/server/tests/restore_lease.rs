//! Restore leases (`Snapctl-Lease`) through the API, and gc honouring them from another
//! store handle, as `snapctl gc --storage` does.

use super::*;
use crate::gc::{run, GcOptions};
use crate::retention::{Action, Rule};
use std::time::Duration;

const LEASE: &str = "snapctl-lease";

/// GET (or HEAD) manifest `d` of `repo` with `Snapctl-Lease: value`.
async fn lease(c: &Client, s: &TestServer, repo: &str, d: &str, value: &str, head: bool) -> reqwest::Response {
    let u = s.u(&format!("/v2/{repo}/manifests/{d}"));
    let rq = if head { c.head(u) } else { c.get(u) };
    rq.header(LEASE, value).send().await.unwrap()
}

fn echoed(r: &reqwest::Response) -> Option<String> {
    r.headers().get(LEASE).map(|v| v.to_str().unwrap().to_owned())
}

/// `repo:latest` pushed twice: the first image, now untagged, and the second.
async fn moved_tag(c: &Client, s: &TestServer, repo: &str) -> (OciDigest, OciDigest) {
    let first = sample_image(c, s, repo, "latest", &format!("{repo} first")).await;
    let second = sample_image(c, s, repo, "latest", &format!("{repo} second")).await;
    (first, second)
}

async fn status_of(c: &Client, s: &TestServer, repo: &str, d: &OciDigest) -> StatusCode {
    c.get(s.u(&format!("/v2/{repo}/manifests/{d}"))).send().await.unwrap().status()
}

/// Issue 35: a lazy restore of `vm:latest`; the tag moves on; gc deleted the restored,
/// now untagged, manifest and swept its blobs while the guest still faulted pages from
/// them. A lease keeps it, and every blob it lists, through gc runs with a 1 s grace; a
/// released lease and an expired one keep nothing. gc runs over a store handle of its
/// own (another process, for `snapctl gc --storage`), so the lease is in the store.
#[tokio::test]
async fn regression_issue_35_a_leased_untagged_manifest_survives_gc_and_released_or_expired_ones_go() {
    let s = TestServer::start(Config::default()).await;
    let c = Client::new();
    let (held, _) = moved_tag(&c, &s, "held").await;
    let (released, _) = moved_tag(&c, &s, "released").await;
    let (expired, _) = moved_tag(&c, &s, "expired").await;
    let r = lease(&c, &s, "held", &held.to_string(), "900", false).await;
    assert_eq!((r.status(), echoed(&r).as_deref()), (StatusCode::OK, Some("900")));
    assert!(s.dir.path().join(layout::restore_lease(&RepoName::parse("held").unwrap(), &held)).exists(), "recorded before the answer");
    let r = lease(&c, &s, "released", &released.to_string(), "900", true).await;
    assert_eq!((r.status(), echoed(&r).as_deref()), (StatusCode::OK, Some("900")), "HEAD takes a lease too");
    let r = lease(&c, &s, "released", &released.to_string(), "0", true).await;
    assert_eq!((r.status(), echoed(&r).as_deref()), (StatusCode::OK, Some("0")));
    let r = lease(&c, &s, "expired", &expired.to_string(), "1", false).await;
    assert_eq!(echoed(&r).as_deref(), Some("1"));
    // Past the 1 s lease, the 1 s delay after it, and the 1 s grace of every use mark.
    tokio::time::sleep(Duration::from_millis(2500)).await;

    let gc_store = FsStore::open(s.dir.path()).unwrap();
    let opts = GcOptions { grace: Duration::from_secs(1), ..GcOptions::default() };
    for round in 0..3 {
        let rep = run(&gc_store, &opts).await.unwrap();
        assert_eq!(status_of(&c, &s, "held", &held).await, StatusCode::OK, "round {round}: {rep:?}");
        let v = rep.retention.manifests.iter().find(|v| v.digest == held).unwrap();
        assert!(matches!((v.action, &v.rule), (Action::Keep, Rule::Leased { .. })), "round {round}: {v:?}");
        let m: serde_json::Value = c.get(s.u(&format!("/v2/held/manifests/{held}"))).send().await.unwrap().json().await.unwrap();
        for l in m["layers"].as_array().unwrap().iter().chain([&m["config"]]) {
            let d = l["digest"].as_str().unwrap();
            assert_eq!(c.get(s.u(&format!("/v2/held/blobs/{d}"))).send().await.unwrap().status(), StatusCode::OK, "round {round}: {d} swept");
        }
        if round == 0 {
            assert_eq!(status_of(&c, &s, "released", &released).await, StatusCode::NOT_FOUND, "a released lease keeps nothing: {rep:?}");
            assert_eq!(status_of(&c, &s, "expired", &expired).await, StatusCode::NOT_FOUND, "an expired lease keeps nothing: {rep:?}");
            assert_eq!(rep.manifests_removed, 2, "{rep:?}");
            assert!(!s.dir.path().join(layout::restore_lease(&RepoName::parse("expired").unwrap(), &expired)).exists(), "gc drops spent leases");
        }
        tokio::time::sleep(Duration::from_millis(1100)).await;
    }
}

/// A lease is by digest, with pull access, and a value of 0 to 86400: anything else is
/// 400 and records nothing; on a tag the header is ignored.
#[tokio::test]
async fn regression_issue_35_a_lease_needs_a_digest_pull_access_and_a_valid_value() {
    let h = bcrypt::hash("pw", 4).unwrap();
    let acl = r#"
        [[rule]]
        users = ["alice"]
        repos = ["*"]
        actions = ["pull", "push"]
        [[rule]]
        users = ["bob"]
        repos = ["bob/*"]
        actions = ["pull"]
    "#;
    let auth = Auth::new(&format!("alice:{h}\nbob:{h}\n"), Some(acl), false, vec![9; 32]).unwrap();
    let s = TestServer::start(Config { auth: Some(auth), max_lease: Duration::from_secs(60), ..Config::default() }).await;
    let c = Client::new();
    let cfg = b"{}";
    let up = |data: &'static [u8]| {
        let (c, u) = (c.clone(), s.u(&format!("/v2/vm/blobs/uploads/?digest={}", sha(data))));
        async move { assert_eq!(c.post(u).basic_auth("alice", Some("pw")).body(data).send().await.unwrap().status(), StatusCode::CREATED) }
    };
    up(cfg).await;
    let m = image_manifest(&sha(cfg), 2, &[]);
    let d = sha(&serde_json::to_vec(&m).unwrap());
    let r = c.put(s.u("/v2/vm/manifests/v1")).basic_auth("alice", Some("pw")).header("content-type", OCI_MANIFEST).body(serde_json::to_vec(&m).unwrap());
    assert_eq!(r.send().await.unwrap().status(), StatusCode::CREATED);
    let key = s.dir.path().join(layout::restore_lease(&RepoName::parse("vm").unwrap(), &d));
    let get = |user: Option<&str>, reference: String, value: &str| {
        let mut rq = c.get(s.u(&format!("/v2/vm/manifests/{reference}"))).header(LEASE, value);
        if let Some(u) = user {
            rq = rq.basic_auth(u, Some("pw"));
        }
        rq.send()
    };
    assert_eq!(get(Some("bob"), d.to_string(), "900").await.unwrap().status(), StatusCode::FORBIDDEN);
    assert_eq!(get(None, d.to_string(), "900").await.unwrap().status(), StatusCode::UNAUTHORIZED);
    for bad in ["abc", "86401", "-5", "1.5", ""] {
        let r = get(Some("alice"), d.to_string(), bad).await.unwrap();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{bad:?}");
        assert_eq!(code_of(&r.text().await.unwrap()), "UNSUPPORTED");
    }
    let r = get(Some("alice"), "v1".into(), "junk").await.unwrap();
    assert_eq!((r.status(), echoed(&r)), (StatusCode::OK, None), "on a tag the header is ignored");
    assert!(!key.exists(), "nothing was recorded");
    let r = get(Some("alice"), d.to_string(), "900").await.unwrap();
    assert_eq!((r.status(), echoed(&r).as_deref()), (StatusCode::OK, Some("60")), "at most the server's max_lease");
    let stored: serde_json::Value = serde_json::from_slice(&std::fs::read(&key).unwrap()).unwrap();
    assert_eq!(stored, json!({"seconds": 60}));
}

/// A lease counts as a pull of its manifest, even taken by a HEAD (which alone is not a
/// pull): `pulled_within` keeps what a running restore reads.
#[tokio::test]
async fn a_lease_counts_as_a_pull() {
    let s = TestServer::start(Config::default()).await;
    let c = Client::new();
    let d = sample_image(&c, &s, "vm", "v1", "pulled by lease").await;
    let other = sample_image(&c, &s, "vm", "v2", "only looked at").await;
    assert_eq!(c.head(s.u(&format!("/v2/vm/manifests/{other}"))).send().await.unwrap().status(), StatusCode::OK);
    assert_eq!(echoed(&lease(&c, &s, "vm", &d.to_string(), "60", true).await).as_deref(), Some("60"));
    let dir = s.stop().await; // writes the pulls recorded in memory
    let pulled = crate::pulls::read(&FsStore::open(dir.path()).unwrap(), &RepoName::parse("vm").unwrap()).await.unwrap();
    assert!(pulled.contains_key(&d) && !pulled.contains_key(&other), "{pulled:?}");
}
