//! One suite that every [`BlobStore`] backend must pass.
//!
//! `FsStore` and the in-memory `object_store` run it in unit tests; the S3 backend runs it
//! against a real S3 server in the integration tests (`tests/tests/it/registry.rs`).
//! Each check panics with a message naming the broken promise.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures::TryStreamExt;

use super::{BlobStore, StoreError};

/// Run every check on `store`. The store should be empty (or at least not contain the
/// `conformance/` prefix).
pub async fn all(store: &dyn BlobStore) {
    put_get_round_trip(store).await;
    put_replaces_whole(store).await;
    missing_is_not_found(store).await;
    ranged_reads(store).await;
    put_file_moves_staged_file(store).await;
    large_put_file_streams(store).await;
    copy_and_rename(store).await;
    delete_is_idempotent(store).await;
    list_is_by_directory_prefix(store).await;
    list_after_pages_in_key_order(store).await;
    delete_prefix_removes_everything_under_it(store).await;
    touch_creates_and_refreshes_markers(store).await;
    refuses_bad_keys(store).await;
}

async fn read(store: &dyn BlobStore, key: &str, range: Option<std::ops::Range<u64>>) -> Vec<u8> {
    let (_, s) = store.get(key, range).await.unwrap_or_else(|e| panic!("get {key}: {e}"));
    let parts: Vec<Bytes> = s.try_collect().await.unwrap_or_else(|e| panic!("read {key}: {e}"));
    parts.concat()
}

/// A put object reads back identically, with its size and a recent mtime.
pub async fn put_get_round_trip(store: &dyn BlobStore) {
    let key = "conformance/rt/obj";
    store.put(key, Bytes::from_static(b"hello, store")).await.expect("put");
    assert_eq!(read(store, key, None).await, b"hello, store");
    let m = store.head(key).await.expect("head");
    assert_eq!(m.size, 12, "head size");
    assert_eq!(m.key, key, "head returns the key as given");
    let age = SystemTime::now().duration_since(m.modified).unwrap_or_default();
    assert!(age < Duration::from_secs(600), "mtime of a fresh object is recent, got {age:?} old");
    assert_eq!(&store.get_bytes(key).await.unwrap()[..], b"hello, store");
}

/// A second put replaces the object entirely (no leftover tail).
pub async fn put_replaces_whole(store: &dyn BlobStore) {
    let key = "conformance/replace";
    store.put(key, Bytes::from(vec![7u8; 1000])).await.unwrap();
    store.put(key, Bytes::from_static(b"short")).await.unwrap();
    assert_eq!(read(store, key, None).await, b"short");
}

/// head/get of a missing key are `NotFound`.
pub async fn missing_is_not_found(store: &dyn BlobStore) {
    assert!(matches!(store.head("conformance/missing").await, Err(StoreError::NotFound(_))), "head missing");
    assert!(matches!(store.get("conformance/missing", None).await, Err(StoreError::NotFound(_))), "get missing");
}

/// Byte ranges: start, middle, end, empty, whole.
pub async fn ranged_reads(store: &dyn BlobStore) {
    let key = "conformance/range";
    let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    store.put(key, Bytes::from(data.clone())).await.unwrap();
    for r in [0..1, 10..20, 99_999..100_000, 0..100_000, 500..500, 65_535..70_001] {
        assert_eq!(read(store, key, Some(r.clone())).await, &data[r.start as usize..r.end as usize], "range {r:?}");
    }
}

/// `put_file` takes a file from the staging dir; the object appears whole.
pub async fn put_file_moves_staged_file(store: &dyn BlobStore) {
    let f = store.staging_dir().join("conformance-staged");
    std::fs::write(&f, b"staged bytes").unwrap();
    store.put_file("conformance/staged", &f).await.expect("put_file");
    assert_eq!(read(store, "conformance/staged", None).await, b"staged bytes");
    assert!(!f.exists(), "put_file consumes the staged file");
}

/// A file larger than one multipart part goes up intact.
pub async fn large_put_file_streams(store: &dyn BlobStore) {
    let f = store.staging_dir().join("conformance-large");
    let len = 17 * 1024 * 1024 + 3;
    let data: Vec<u8> = (0..len).map(|i| (i * 31 % 256) as u8).collect();
    std::fs::write(&f, &data).unwrap();
    store.put_file("conformance/large", &f).await.expect("put_file large");
    assert_eq!(store.head("conformance/large").await.unwrap().size, len as u64);
    let back = read(store, "conformance/large", None).await;
    assert!(back == data, "large object differs after put_file");
    store.delete("conformance/large").await.unwrap();
}

/// copy keeps the source; rename removes it.
pub async fn copy_and_rename(store: &dyn BlobStore) {
    store.put("conformance/cp/a", Bytes::from_static(b"A")).await.unwrap();
    store.copy("conformance/cp/a", "conformance/cp/b").await.expect("copy");
    assert_eq!(read(store, "conformance/cp/a", None).await, b"A");
    assert_eq!(read(store, "conformance/cp/b", None).await, b"A");
    store.rename("conformance/cp/b", "conformance/cp/deep/c").await.expect("rename");
    assert!(store.head("conformance/cp/b").await.unwrap_err().is_not_found(), "rename removes the source");
    assert_eq!(read(store, "conformance/cp/deep/c", None).await, b"A");
    assert!(store.copy("conformance/cp/none", "conformance/cp/x").await.unwrap_err().is_not_found());
}

/// Deleting twice is fine.
pub async fn delete_is_idempotent(store: &dyn BlobStore) {
    store.put("conformance/del", Bytes::from_static(b"x")).await.unwrap();
    store.delete("conformance/del").await.expect("delete");
    store.delete("conformance/del").await.expect("delete again");
    assert!(store.head("conformance/del").await.unwrap_err().is_not_found());
}

/// `list("p/")` returns every object under `p/` at any depth, and nothing from `p2/`.
pub async fn list_is_by_directory_prefix(store: &dyn BlobStore) {
    for k in ["conformance/l/a", "conformance/l/sub/b", "conformance/l/sub/deeper/c", "conformance/l2/x"] {
        store.put(k, Bytes::from_static(b"1")).await.unwrap();
    }
    let mut keys: Vec<String> = store.list("conformance/l/").await.unwrap().into_iter().map(|m| m.key).collect();
    keys.sort();
    assert_eq!(keys, ["conformance/l/a", "conformance/l/sub/b", "conformance/l/sub/deeper/c"]);
    assert!(store.list("conformance/nothing-here/").await.unwrap().is_empty(), "list of empty prefix");
}

/// `delete_prefix("p/")` removes every object under `p/` at any depth, nothing from
/// `p2/`, and a missing prefix is not an error.
pub async fn delete_prefix_removes_everything_under_it(store: &dyn BlobStore) {
    for k in ["conformance/dp/a", "conformance/dp/sub/b", "conformance/dp2/x"] {
        store.put(k, Bytes::from_static(b"1")).await.unwrap();
    }
    store.delete_prefix("conformance/dp/").await.expect("delete_prefix");
    assert!(store.list("conformance/dp/").await.unwrap().is_empty(), "objects left under the prefix");
    assert!(store.head("conformance/dp2/x").await.is_ok(), "delete_prefix went past its prefix");
    store.delete_prefix("conformance/dp/").await.expect("delete_prefix of a missing prefix");
}

/// `touch` creates an empty marker (parents included) and refreshes an existing one's mtime.
pub async fn touch_creates_and_refreshes_markers(store: &dyn BlobStore) {
    let key = "conformance/touch/deep/marker";
    store.touch(key).await.expect("touch a new key");
    let m = store.head(key).await.expect("head after touch");
    assert_eq!(m.size, 0);
    let age = SystemTime::now().duration_since(m.modified).unwrap_or_default();
    assert!(age < Duration::from_secs(300), "touched object's mtime is {age:?} old");
    store.touch(key).await.expect("touch an existing key");
    assert!(store.head(key).await.expect("head").modified >= m.modified, "touch moved the mtime back");
}

/// Keys that could escape the store are refused before any I/O.
pub async fn refuses_bad_keys(store: &dyn BlobStore) {
    for k in ["../escape", "/abs", "a/../b", "a//b", "", "a\\b"] {
        assert!(matches!(store.put(k, Bytes::new()).await, Err(StoreError::InvalidKey(_))), "key {k:?} accepted");
    }
}

/// `list_after` pages through a directory in byte order of the keys (nested keys where S3
/// would put them), from any position, without repeating or skipping a key.
pub async fn list_after_pages_in_key_order(store: &dyn BlobStore) {
    let names = ["a-b", "a/x", "a/y/z", "a.b", "a0", "bb", "b/c/d/e", "z"];
    for n in names {
        store.put(&format!("conformance/page/{n}"), Bytes::new()).await.unwrap();
    }
    store.put("conformance/pagex", Bytes::new()).await.unwrap();
    let mut want: Vec<String> = names.iter().map(|n| format!("conformance/page/{n}")).collect();
    want.sort();
    let keys = |v: Vec<super::ObjectMeta>| v.into_iter().map(|m| m.key).collect::<Vec<_>>();
    assert_eq!(keys(store.list_after("conformance/page/", None, 100).await.unwrap()), want, "a whole listing in key order");
    for page in [1, 2, 4] {
        let (mut got, mut after) = (Vec::new(), None::<String>);
        loop {
            let p = keys(store.list_after("conformance/page/", after.as_deref(), page).await.unwrap());
            assert!(p.len() <= page, "page of {page} returned {}", p.len());
            let Some(last) = p.last().cloned() else { break };
            got.extend(p);
            after = Some(last);
        }
        assert_eq!(got, want, "walk in pages of {page}");
    }
    // From a position that is not a key, and past a directory.
    let from = keys(store.list_after("conformance/page/", Some("conformance/page/a/xx"), 3).await.unwrap());
    assert_eq!(from, ["conformance/page/a/y/z", "conformance/page/a0", "conformance/page/b/c/d/e"], "from a position between keys");
    assert!(store.list_after("conformance/nothing/", None, 5).await.unwrap().is_empty(), "missing directory lists nothing");
}
