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
