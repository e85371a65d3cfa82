//! Retention through the API: tags moved by pushes, subjects deleted by clients, gc after.

use super::*;
use crate::gc::{run, GcOptions};
use std::time::Duration;

/// Let a tick of the kernel's file clock pass: gc's start (the mtime the kernel gives
/// `_gc/run`) is then strictly later than the use marks of the pushes before it (set from
/// the finer system clock), as `--grace 0s` needs.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(20)).await;
}

/// Every key under `dir` in the store at `root` (relative, sorted).
fn keys_under(root: &std::path::Path, dir: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![root.join(dir)];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p.strip_prefix(root).unwrap().to_string_lossy().into_owned());
            }
        }
    }
    out.sort();
    out
}

/// Issue 22: `vm:latest` pushed twice; the first snapshot is untagged and nothing
/// references it. gc --grace 0s kept it (and its blobs) forever: the manifest link was a
/// mark root whether tagged or not.
#[tokio::test]
async fn regression_issue_22_a_repushed_tag_leaves_no_untagged_manifest_behind() {
    let s = TestServer::start(Config::default()).await;
    let c = Client::new();
    let first = sample_image(&c, &s, "vm", "latest", "first").await;
    let second = sample_image(&c, &s, "vm", "latest", "second").await;
    let store = FsStore::open(s.dir.path()).unwrap();
    settle().await;
    let rep = run(&store, &GcOptions { grace: Duration::ZERO, ..GcOptions::default() }).await.unwrap();
    assert_eq!(c.get(s.u(&format!("/v2/vm/manifests/{first}"))).send().await.unwrap().status(), StatusCode::NOT_FOUND, "{rep:?}");
    assert_eq!(c.get(s.u(&format!("/v2/vm/manifests/{second}"))).send().await.unwrap().status(), StatusCode::OK);
    assert_eq!(c.get(s.u("/v2/vm/manifests/latest")).send().await.unwrap().status(), StatusCode::OK);
    // The first image's manifest, config and layer are gone; the second's stay.
    assert_eq!(rep.swept, 3, "{rep:?}");
    assert!(!s.dir.path().join(layout::blob(&first)).exists());
    assert!(s.dir.path().join(layout::blob(&second)).exists());
}

/// Issue 22: an artifact attached to an image (a trace, a signature); the client deletes
/// the image. The referrer stayed, `/referrers/<subject>` still listed it, and its blobs
/// (a working-set trace is tens of MB) were never freed.
#[tokio::test]
async fn regression_issue_22_a_deleted_subjects_referrers_go_with_it() {
    let s = TestServer::start(Config::default()).await;
    let c = Client::new();
    let subject = sample_image(&c, &s, "vm", "v1", "subject").await;
    let payload = push_blob(&c, &s, "vm", b"a working set, tens of MB in life").await;
    let empty = push_blob(&c, &s, "vm", b"{}").await;
    let m = json!({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": "application/vnd.snapctl.trace.v1+json",
        "config": {"mediaType": "application/vnd.oci.empty.v1+json", "digest": empty.to_string(), "size": 2},
        "layers": [{"mediaType": "application/octet-stream", "digest": payload.to_string(), "size": 33}],
        "subject": {"mediaType": OCI_MANIFEST, "digest": subject.to_string(), "size": 1}});
    let referrer = sha(&serde_json::to_vec(&m).unwrap());
    assert_eq!(push_manifest(&c, &s, "vm", &referrer.to_string(), &m).await.status(), StatusCode::CREATED);
    assert_eq!(c.delete(s.u(&format!("/v2/vm/manifests/{subject}"))).send().await.unwrap().status(), StatusCode::ACCEPTED);
    let store = FsStore::open(s.dir.path()).unwrap();
    settle().await;
    let rep = run(&store, &GcOptions { grace: Duration::ZERO, ..GcOptions::default() }).await.unwrap();
    let listed: serde_json::Value = c.get(s.u(&format!("/v2/vm/referrers/{subject}"))).send().await.unwrap().json().await.unwrap();
    assert_eq!(listed["manifests"].as_array().map(Vec::len), Some(0), "{listed} {rep:?}");
    assert_eq!(c.get(s.u(&format!("/v2/vm/manifests/{referrer}"))).send().await.unwrap().status(), StatusCode::NOT_FOUND);
    assert!(!s.dir.path().join(layout::blob(&payload)).exists(), "the referrer's payload is freed: {rep:?}");
    assert_eq!(keys_under(s.dir.path(), "repositories/vm/_referrers"), Vec::<String>::new());
}

/// The web view shows when a manifest was last pulled (recorded in memory, not yet
/// written, and once written), and what retention would delete: a re-pushed tag's old
/// image, not the current one. Before, every page said "not recorded" and there was no
/// retention page.
#[tokio::test]
async fn the_web_view_shows_pull_times_and_what_retention_would_delete() {
    let s = TestServer::start(Config::default()).await;
    let c = Client::new();
    let first = sample_image(&c, &s, "vm", "latest", "first").await;
    let second = sample_image(&c, &s, "vm", "latest", "second").await;
    let page = |s: &TestServer, p: &str| {
        let (c, u) = (c.clone(), s.u(p));
        async move { c.get(u).send().await.unwrap().text().await.unwrap() }
    };
    let mp = format!("/ui/repo/vm/_manifest/{second}");
    let m = page(&s, &mp).await;
    assert!(m.contains("never (since pulls were recorded)"), "{m}");
    assert_eq!(c.get(s.u("/v2/vm/manifests/latest")).send().await.unwrap().status(), StatusCode::OK);
    let year = time::OffsetDateTime::now_utc().year().to_string();
    let pulled = |html: &str| html.split("last pulled</th><td>").nth(1).unwrap_or("").starts_with(&year);
    let m = page(&s, &mp).await;
    assert!(pulled(&m), "a pull not yet written shows: {m}");
    // Written at shutdown; a new server reads it from the store.
    let s = TestServer::start_in(s.stop().await, Config::default()).await;
    assert!(pulled(&page(&s, &mp).await), "a written pull shows");
    let repo = page(&s, "/ui/repo/vm").await;
    assert!(repo.contains("<th>last pulled</th>") && repo.matches(&year).count() >= 2, "{repo}");
    // The default delay is the grace period (1 h): nothing would go yet.
    let r = page(&s, "/ui/retention").await;
    assert!(r.contains("0 manifests") && !r.contains(&first.to_string()), "{r}");
    // The server's own schedule, with no delay: the first image would go, the second not.
    let opts = GcOptions { grace: Duration::ZERO, ..GcOptions::default() };
    let s2 = TestServer::start(Config { gc: Some(crate::gc::Schedule { interval: Duration::from_secs(3600), options: opts }), ..Config::default() }).await;
    let f2 = sample_image(&c, &s2, "vm", "latest", "first").await;
    let s2nd = sample_image(&c, &s2, "vm", "latest", "second").await;
    settle().await;
    let r = page(&s2, "/ui/retention").await;
    assert!(r.contains("1 manifests") && r.contains(&f2.to_string()) && !r.contains(&s2nd.to_string()), "{r}");
    assert!(r.contains("untagged"), "{r}");
    assert_eq!(c.get(s2.u(&format!("/v2/vm/manifests/{f2}"))).send().await.unwrap().status(), StatusCode::OK, "a dry run deletes nothing");
}

/// Issue 39: the retention page said "0 B" for every deletion: its dry run stopped before
/// the sweep, which counts the bytes. It shows what `gc --dry-run` counts now.
#[tokio::test]
async fn regression_issue_39_the_retention_page_shows_the_bytes_gc_dry_run_counts() {
    let opts = GcOptions { grace: Duration::ZERO, ..GcOptions::default() };
    let s =
        TestServer::start(Config { gc: Some(crate::gc::Schedule { interval: Duration::from_secs(3600), options: opts.clone() }), ..Config::default() }).await;
    let c = Client::new();
    let first = sample_image(&c, &s, "vm", "latest", "first").await;
    sample_image(&c, &s, "vm", "latest", "second").await;
    settle().await;
    let store = FsStore::open(s.dir.path()).unwrap();
    let dry = run(&store, &GcOptions { dry_run: true, ..opts }).await.unwrap();
    let v = dry.retention.manifests.iter().find(|v| v.digest == first).unwrap();
    assert!(v.bytes > 0, "{dry:?}");
    let page = c.get(s.u("/ui/retention")).send().await.unwrap().text().await.unwrap();
    let row = page.split(&first.to_string()).nth(1).unwrap_or_else(|| panic!("{page}"));
    let cells: Vec<&str> = row.split("<td class=num>").skip(1).map(|c| c.split('<').next().unwrap()).collect();
    assert_eq!(cells.first().copied(), Some(imgfmt::size::human(v.bytes).as_str()), "{page}");
}
