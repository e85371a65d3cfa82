//! What a restore tells the registry: that its reads are a restore ([`PURPOSE_HEADER`],
//! [`is_restore`]: only those are pulls), and its lease, which keeps the manifest it reads
//! from, and everything that manifest needs, through gc, however long its guest runs.
//!
//! ```text
//! restore (lazy daemon)                      snapctl serve                     gc (serve's or `snapctl gc`)
//! GET/HEAD /v2/<name>/manifests/<digest>
//!   Snapctl-Lease: 900            ──────►   rely on <digest> (crate::inuse),
//!                                           put repositories/<name>/_leases/<alg>/<hex>
//!                                               {"seconds":900}   (its mtime: the start)
//!                                 ◄──────   200, Snapctl-Lease: 900
//! every 300 s: the same again (renewal)                                       scan: lease ends
//! at exit: Snapctl-Lease: 0       ──────►   delete the object                 retention: a leased
//!                                                                              manifest is kept as if
//!                                                                              tagged until its end
//! ```
//!
//! A lease ends at the object's mtime plus its seconds (on the store's clock, like every
//! time gc compares). Until then retention keeps the manifest with rule `leased`, and with
//! it what a tagged manifest keeps (index children, a snapshot's base, referrers, tags
//! named after it) and every blob it lists. After it ends, the untagged delay runs from
//! its end. The object is one small durable write per (repository, manifest), written
//! before the response, so a `snapctl gc` in another process sees it.
//!
//! Bounds: a lease lasts at most the server's `max_lease` (and never more than
//! [`MAX_SECONDS`], whatever an object says); a repository holds at most
//! [`MAX_PER_REPOSITORY`] live leases (a new one beyond is served without being recorded:
//! no `Snapctl-Lease` in the response). Expired leases are dropped when a new lease of the
//! repository is recorded (once they no longer count for the delay) and by gc.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use imgfmt::OciDigest;

use crate::layout;
use crate::name::RepoName;
use crate::store::{BlobStore, ObjectMeta, StoreError};

/// The request and response header.
pub const HEADER: &str = "snapctl-lease";
/// The request header saying what a client's reads are for: `restore` or `read`
/// (`regclient::Purpose`, the client's end of it).
pub const PURPOSE_HEADER: &str = "snapctl-purpose";

/// Whether a manifest read with `purpose` (the request's [`PURPOSE_HEADER`]) is a pull, a
/// restore that retention's `pulled_within` counts: `restore` is; `read` (snapctl's
/// inspect, verify, a push resolving its parent) is not, nor is any other value; no
/// header at all is (another tool, skopeo or oras, pulling an image is restoring it).
pub fn is_restore(purpose: Option<&[u8]>) -> bool {
    match purpose {
        None => true,
        Some(v) => std::str::from_utf8(v).is_ok_and(|v| v.trim().eq_ignore_ascii_case("restore")),
    }
}
/// The largest value a request may send, and the longest a stored lease counts (24 h).
pub const MAX_SECONDS: u64 = 86_400;
/// The server's `max_lease` when the configuration sets none.
pub const DEFAULT_MAX_LEASE: Duration = Duration::from_secs(MAX_SECONDS);
/// Live leases one repository may hold.
pub const MAX_PER_REPOSITORY: usize = 10_000;
/// Largest lease object read (they are ~16 bytes).
const MAX_OBJECT_BYTES: u64 = 256;

/// What a request's `Snapctl-Lease` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ask {
    /// Keep the manifest for this many seconds from now (1..=[`MAX_SECONDS`]).
    Hold(u64),
    /// Release the lease now (`0`).
    Release,
}

/// Parse a `Snapctl-Lease` value: a decimal integer, 0..=[`MAX_SECONDS`], nothing else.
pub fn parse(value: &[u8]) -> Result<Ask, String> {
    let text = std::str::from_utf8(value).map_err(|_| "Snapctl-Lease is not text".to_owned())?.trim();
    if text.is_empty() || text.len() > 6 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("Snapctl-Lease {text:?}: expected whole seconds, 0 to {MAX_SECONDS}"));
    }
    match text.parse::<u64>() {
        Ok(0) => Ok(Ask::Release),
        Ok(s) if s <= MAX_SECONDS => Ok(Ask::Hold(s)),
        _ => Err(format!("Snapctl-Lease {text}: more than {MAX_SECONDS} seconds")),
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Stored {
    seconds: u64,
}

/// When a lease object ends: its mtime plus its seconds (at most [`MAX_SECONDS`]). `None`
/// when the object is not a lease.
pub fn end_of(raw: &[u8], modified: SystemTime) -> Option<SystemTime> {
    let s: Stored = serde_json::from_slice(raw).ok()?;
    modified.checked_add(Duration::from_secs(s.seconds.min(MAX_SECONDS)))
}

/// Read the lease object `m` (a `_leases/` key from a listing): when it ends, or `None`
/// when it is gone or not a lease.
pub async fn read(store: &dyn BlobStore, m: &ObjectMeta) -> Result<Option<SystemTime>, StoreError> {
    if m.size > MAX_OBJECT_BYTES {
        tracing::warn!(key = %m.key, size = m.size, "oversized lease object ignored");
        return Ok(None);
    }
    match store.get_bytes(&m.key).await {
        Ok(raw) => {
            let end = end_of(&raw, m.modified);
            if end.is_none() {
                tracing::warn!(key = %m.key, "unreadable lease object ignored");
            }
            Ok(end)
        }
        Err(e) if e.is_not_found() => Ok(None),
        Err(e) => Err(e),
    }
}

/// Record a lease of `seconds` on manifest `d` of `repo` (a renewal replaces the one
/// there). A new lease in a repository that holds [`MAX_PER_REPOSITORY`] live ones is not
/// recorded (`Ok(false)`); leases that ended more than `keep_expired` ago are dropped on
/// the way.
pub async fn hold(store: &dyn BlobStore, repo: &RepoName, d: &OciDigest, seconds: u64, keep_expired: Duration) -> Result<bool, StoreError> {
    hold_within(store, repo, d, seconds, keep_expired, MAX_PER_REPOSITORY).await
}

async fn hold_within(store: &dyn BlobStore, repo: &RepoName, d: &OciDigest, seconds: u64, keep_expired: Duration, cap: usize) -> Result<bool, StoreError> {
    let key = layout::restore_lease(repo, d);
    let renewal = match store.head(&key).await {
        Ok(_) => true,
        Err(e) if e.is_not_found() => false,
        Err(e) => return Err(e),
    };
    if !renewal && live_after_pruning(store, repo, keep_expired).await? >= cap {
        tracing::warn!(%repo, %d, max = cap, "too many live restore leases in the repository; this one is not recorded");
        return Ok(false);
    }
    let body = serde_json::to_vec(&Stored { seconds: seconds.min(MAX_SECONDS) }).expect("lease serializes");
    store.put(&key, Bytes::from(body)).await?;
    Ok(true)
}

/// Live leases of `repo`, deleting those that ended more than `keep_expired` ago.
async fn live_after_pruning(store: &dyn BlobStore, repo: &RepoName, keep_expired: Duration) -> Result<usize, StoreError> {
    let now = SystemTime::now();
    let mut live = 0;
    for m in store.list(&layout::restore_leases_dir(repo)).await? {
        match read(store, &m).await? {
            Some(end) if end > now => live += 1,
            Some(end) if end.checked_add(keep_expired).is_some_and(|t| t > now) => {}
            _ => match store.delete(&m.key).await {
                Ok(()) => {}
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(e),
            },
        }
    }
    Ok(live)
}

/// Release the lease on manifest `d` of `repo` (none there: nothing to do).
pub async fn release(store: &dyn BlobStore, repo: &RepoName, d: &OciDigest) -> Result<(), StoreError> {
    match store.delete(&layout::restore_lease(repo, d)).await {
        Err(e) if !e.is_not_found() => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::FsStore;

    #[test]
    fn regression_issue_39_only_restores_and_foreign_clients_are_pulls() {
        assert!(is_restore(None), "a client that does not say: skopeo, oras");
        assert!(is_restore(Some(b"restore")));
        assert!(is_restore(Some(b" Restore ")));
        for not in [&b"read"[..], b"", b"inspect", b"\xff"] {
            assert!(!is_restore(Some(not)), "{not:?}");
        }
    }

    #[test]
    fn header_values() {
        assert_eq!(parse(b"900"), Ok(Ask::Hold(900)));
        assert_eq!(parse(b" 86400 "), Ok(Ask::Hold(MAX_SECONDS)));
        assert_eq!(parse(b"0"), Ok(Ask::Release));
        for bad in [&b""[..], b"86401", b"-1", b"1.5", b"9e3", b"0x10", b"99999999999999999999", b"\xff", b"+5"] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_stored_lease_never_counts_for_more_than_a_day() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        assert_eq!(end_of(br#"{"seconds":60}"#, t), Some(t + Duration::from_secs(60)));
        assert_eq!(end_of(br#"{"seconds":18446744073709551615}"#, t), Some(t + Duration::from_secs(MAX_SECONDS)));
        assert_eq!(end_of(b"[]", t), None);
    }

    #[tokio::test]
    async fn leases_are_bounded_per_repository_and_expired_ones_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let store = FsStore::open(dir.path()).unwrap();
        let r = RepoName::parse("vm").unwrap();
        let d = |i: usize| OciDigest::of(&i.to_le_bytes());
        // An expired lease, long past: dropped when a new one is recorded.
        store.put(&layout::restore_lease(&r, &d(0)), Bytes::from_static(br#"{"seconds":1}"#)).await.unwrap();
        let old = std::time::SystemTime::now() - Duration::from_secs(7200);
        std::fs::File::options().write(true).open(dir.path().join(layout::restore_lease(&r, &d(0)))).unwrap().set_modified(old).unwrap();
        let cap = 3;
        let ds: Vec<OciDigest> = (0..5).map(d).collect();
        let hold = |i: usize| hold_within(&store, &r, &ds[i], 60, Duration::from_secs(3600), cap);
        assert!(hold(1).await.unwrap());
        assert!(store.head(&layout::restore_lease(&r, &d(0))).await.unwrap_err().is_not_found());
        assert!(hold(2).await.unwrap() && hold(3).await.unwrap());
        assert!(!hold(4).await.unwrap(), "one more than the cap");
        assert!(store.head(&layout::restore_lease(&r, &d(4))).await.unwrap_err().is_not_found());
        assert!(hold(1).await.unwrap(), "a renewal always goes through");
        release(&store, &r, &d(1)).await.unwrap();
        release(&store, &r, &d(1)).await.unwrap();
        assert!(hold(4).await.unwrap(), "a released lease frees its place");
    }
}
