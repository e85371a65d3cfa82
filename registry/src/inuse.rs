//! Blobs in use: how live requests and a running gc agree on what may be deleted.
//!
//! gc marks from a listing of every manifest, then deletes the blobs it did not reach.
//! Meanwhile a request may come to rely on one of those blobs: a HEAD that tells a
//! pushing client it need not upload it, a cross-repository mount, an upload of bytes the
//! registry already holds, a manifest PUT whose manifest appears after gc's listing.
//! Marking takes as long as reading every manifest (seconds for 40,000 of them), so this
//! is not a rare window: without the marks a push could report success and gc then delete
//! its blobs.
//!
//! The store is the only state the two sides share (replicas and `snapctl gc` are other
//! processes, maybe on other hosts, over one directory or bucket). Each side writes
//! before it reads, so of a request and a gc deciding about the same blob B, at least
//! one sees the other:
//!
//! ```text
//! a request relying on blob B                 gc, for each unmarked blob B older than --grace
//! 1 touch _gc/used/B                          a touch _gc/condemned/B
//!   (a manifest PUT first puts a lease        b read the leases and _gc/used/B: keep B if a
//!    _gc/inflight/<id> naming its blobs)         lease names it or the mark is not older than
//! 2 wait while _gc/condemned/B exists            (gc start - grace)
//! 3 check that B exists; answer by what       c delete B, unless kept
//!   that finds                                d delete _gc/condemned/B
//! ```
//!
//! - If step 2 found no mark because it ran before `a`, step 1 came before `b`: gc sees the
//!   use (made after gc started) and keeps B.
//! - If step 2 found the mark, the request waits for `d`, and step 3 sees what gc did: a
//!   deleted blob is answered as missing (HEAD 404, the client uploads it; manifest PUT
//!   `MANIFEST_BLOB_UNKNOWN`), never as present.
//! - A manifest PUT may start before gc and write its manifest after gc's listing, so its
//!   step-1 mark can be older than gc's start. Its lease covers that: the lease exists
//!   from before its checks until after the manifest is written and its blobs' marks
//!   were touched again (then newer than gc's listing, so newer than gc's start).
//!
//! A use keeps a blob for `--grace` after it, exactly as an upload does: a HEAD that
//! found a blob protects it until the client's manifest PUT, if that comes within the
//! grace period. Times are compared on the store's clock (object mtimes, and gc's start
//! is the mtime of `_gc/run`).
//!
//! Retention deletes manifest links and tags, not only blobs. A manifest link is decided
//! exactly as a blob (the condemned mark and the use mark of the manifest's digest: a PUT
//! of that manifest leases and waits for it like for its blobs). A tag has its own mark,
//! `_gc/retiring/<name>/_tags/<tag>`, and a manifest PUT to a tag names the tag in its
//! lease (`tag:<name>:<tag>`) and waits while the tag's mark exists before writing it: a
//! re-push racing retention either keeps the tag (gc saw the lease, or the tag changed
//! since gc read it) or writes it after gc deleted the old one.
//!
//! `_gc/run` exists while a gc runs, refreshed as it goes. A condemned mark whose gc
//! stopped refreshing `_gc/run` for [`GC_STALE`] is void: that gc deletes nothing more
//! (it stops itself once it could not refresh for half that time).

use std::collections::HashSet;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use imgfmt::OciDigest;

use crate::layout;
use crate::name::{RepoName, Tag};
use crate::store::{BlobStore, StoreError};

/// How long a request waits for a gc deciding about a blob before it gives up (503).
pub const CONDEMN_WAIT: Duration = Duration::from_secs(30);
/// A gc whose `_gc/run` has not been refreshed for this long has stopped.
pub const GC_STALE: Duration = Duration::from_secs(300);
/// A lease older than this belongs to a request that died (a killed server): gc ignores
/// and removes it. A live request gives up long before ([`Lease::check_fresh`]).
pub const LEASE_STALE: Duration = Duration::from_secs(3600);

/// Why a request could not rely on a blob.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum InUseError {
    /// storage: {0}
    Store(#[from] StoreError),
    /// garbage collection has been deciding about {0} for more than 30 s; retry
    Busy(OciDigest),
    /// garbage collection has been deciding about tag {0} for more than 30 s; retry
    BusyTag(String),
    /// the request took more than {0:?} between checking its blobs and committing; retry
    TooSlow(Duration),
}

/// Record that the caller relies on blob `d`, then wait until no gc is deciding about it.
/// After `Ok`, the caller must check that `d` exists and answer by what it finds: a
/// running gc has either seen this use (and keeps `d`) or finished with `d`.
pub async fn rely_on(store: &dyn BlobStore, d: &OciDigest) -> Result<(), InUseError> {
    store.touch(&layout::gc_used(d)).await?;
    settled(store, d).await
}

/// Wait until no gc is deciding about `d` (step 2 above).
pub async fn settled(store: &dyn BlobStore, d: &OciDigest) -> Result<(), InUseError> {
    settled_within(store, d, CONDEMN_WAIT).await
}

async fn settled_within(store: &dyn BlobStore, d: &OciDigest, wait: Duration) -> Result<(), InUseError> {
    wait_while_marked(store, &layout::gc_condemned(d), wait).await.map_err(|e| e.unwrap_or_else(|| InUseError::Busy(d.clone())))
}

/// Wait until no gc is deciding about tag `t` of `repo` (a manifest PUT, before it writes
/// the tag).
pub async fn settled_tag(store: &dyn BlobStore, repo: &RepoName, t: &Tag) -> Result<(), InUseError> {
    wait_while_marked(store, &layout::gc_retiring_tag(repo, t), CONDEMN_WAIT).await.map_err(|e| e.unwrap_or_else(|| InUseError::BusyTag(format!("{repo}:{t}"))))
}

/// Wait while `mark` exists and a live gc keeps it; `Err(None)`: waited `wait` in vain.
async fn wait_while_marked(store: &dyn BlobStore, mark: &str, wait: Duration) -> Result<(), Option<InUseError>> {
    let start = tokio::time::Instant::now();
    let mut pause = Duration::from_millis(10);
    loop {
        match store.head(mark).await {
            Err(e) if e.is_not_found() => return Ok(()),
            Err(e) => return Err(Some(e.into())),
            Ok(_) if start.elapsed() < wait => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(500));
            }
            Ok(_) => {
                if gc_running(store).await.map_err(|e| Some(e.into()))? {
                    return Err(None);
                }
                tracing::warn!(%mark, "ignoring a mark left by a gc that stopped");
                return Ok(());
            }
        }
    }
}

/// Whether a gc is running: `_gc/run` exists and was refreshed within [`GC_STALE`].
pub async fn gc_running(store: &dyn BlobStore) -> Result<bool, StoreError> {
    match store.head(layout::GC_RUN).await {
        Ok(m) => Ok(SystemTime::now().duration_since(m.modified).unwrap_or_default() < GC_STALE),
        Err(e) if e.is_not_found() => Ok(false),
        Err(e) => Err(e),
    }
}

/// A manifest PUT's lease on the blobs it references, from before it checks them until
/// after its manifest is written. Release it with [`Lease::release_committed`] or
/// [`Lease::release`]; a lease dropped without either (a cancelled request) stays until
/// gc finds it stale.
#[derive(Debug)]
#[must_use = "a lease protects blobs until it is released"]
pub struct Lease {
    key: String,
    digests: Vec<OciDigest>,
    taken: Instant,
}

/// Take a lease on `digests` (step 1 of a manifest PUT).
pub async fn lease(store: &dyn BlobStore, digests: Vec<OciDigest>) -> Result<Lease, StoreError> {
    lease_tagged(store, digests, None).await
}

/// How a lease names a tag it is about to write.
pub fn lease_tag_name(repo: &RepoName, t: &Tag) -> String {
    format!("tag:{repo}:{t}")
}

/// Take a lease on `digests` and, for a PUT to a tag, on that tag of `repo`.
pub async fn lease_tagged(store: &dyn BlobStore, digests: Vec<OciDigest>, tag: Option<(&RepoName, &Tag)>) -> Result<Lease, StoreError> {
    let key = layout::gc_inflight(&format!("{:032x}", rand::random::<u128>()));
    let mut names: Vec<String> = digests.iter().map(OciDigest::to_string).collect();
    names.extend(tag.map(|(r, t)| lease_tag_name(r, t)));
    store.put(&key, Bytes::from(serde_json::to_vec(&names).expect("strings serialize"))).await?;
    Ok(Lease { key, digests, taken: Instant::now() })
}

impl Lease {
    /// Fail when the lease is old enough that a gc could soon take it for a dead
    /// request's: committing after that would not be covered.
    pub fn check_fresh(&self) -> Result<(), InUseError> {
        if self.taken.elapsed() > LEASE_STALE / 2 {
            return Err(InUseError::TooSlow(LEASE_STALE / 2));
        }
        Ok(())
    }

    /// The manifest is written: touch each blob's mark (a gc whose listing missed the
    /// manifest then sees a use newer than its start), then drop the lease. On an error
    /// the lease stays, and keeps protecting until it is stale.
    pub async fn release_committed(self, store: &dyn BlobStore) -> Result<(), StoreError> {
        for d in &self.digests {
            store.touch(&layout::gc_used(d)).await?;
        }
        self.release(store).await
    }

    /// Drop the lease (nothing was committed, or its blobs are marked already).
    pub async fn release(self, store: &dyn BlobStore) -> Result<(), StoreError> {
        store.delete(&self.key).await
    }
}

/// What the live leases name.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Leases {
    /// Digests (blobs and manifests).
    pub digests: HashSet<OciDigest>,
    /// Tags, as [`lease_tag_name`] spells them.
    pub tags: HashSet<String>,
}

/// The digests of every live lease. Leases older than `stale_before` are dead requests':
/// they are ignored, and removed unless `dry_run`.
pub async fn leased(store: &dyn BlobStore, stale_before: Option<SystemTime>, dry_run: bool) -> Result<HashSet<OciDigest>, StoreError> {
    Ok(leases(store, stale_before, dry_run).await?.digests)
}

/// Everything the live leases name ([`leased`], with tags).
pub async fn leases(store: &dyn BlobStore, stale_before: Option<SystemTime>, dry_run: bool) -> Result<Leases, StoreError> {
    let mut out = Leases::default();
    for m in store.list(layout::GC_INFLIGHT).await? {
        if stale_before.is_some_and(|t| m.modified < t) {
            tracing::warn!(key = %m.key, "removing a stale lease (its request died)");
            if !dry_run {
                store.delete(&m.key).await?;
            }
            continue;
        }
        let raw = match store.get_bytes(&m.key).await {
            Ok(b) => b,
            Err(e) if e.is_not_found() => continue, // released since the listing
            Err(e) => return Err(e),
        };
        match serde_json::from_slice::<Vec<String>>(&raw) {
            Ok(names) => {
                for n in names {
                    if n.starts_with("tag:") {
                        out.tags.insert(n);
                    } else if let Ok(d) = n.parse() {
                        out.digests.insert(d);
                    }
                }
            }
            Err(e) => tracing::warn!(key = %m.key, %e, "unreadable lease ignored"),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::FsStore;

    /// A request finding a condemned mark waits for gc to finish with the blob, and
    /// answers by what gc did.
    #[tokio::test]
    async fn a_condemned_blob_is_waited_for() {
        let dir = tempfile::tempdir().unwrap();
        let store: std::sync::Arc<dyn BlobStore> = std::sync::Arc::new(FsStore::open(dir.path()).unwrap());
        let d = OciDigest::of(b"x");
        store.touch(layout::GC_RUN).await.unwrap();
        store.touch(&layout::gc_condemned(&d)).await.unwrap();
        let s2 = store.clone();
        let d2 = d.clone();
        let gc = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            s2.delete(&layout::gc_condemned(&d2)).await.unwrap();
        });
        let t = Instant::now();
        rely_on(store.as_ref(), &d).await.unwrap();
        assert!(t.elapsed() >= Duration::from_millis(250), "did not wait for gc: {:?}", t.elapsed());
        gc.await.unwrap();
        assert!(store.head(&layout::gc_used(&d)).await.is_ok(), "the use was recorded");
    }

    /// A condemned mark of a gc that stopped (no fresh `_gc/run`) does not block forever;
    /// a live gc's is waited for, then refused.
    #[tokio::test]
    async fn a_dead_gcs_mark_is_void() {
        let dir = tempfile::tempdir().unwrap();
        let store = FsStore::open(dir.path()).unwrap();
        let d = OciDigest::of(b"x");
        store.touch(&layout::gc_condemned(&d)).await.unwrap();
        let wait = Duration::from_millis(200);
        settled_within(&store, &d, wait).await.unwrap();
        store.touch(layout::GC_RUN).await.unwrap();
        assert!(matches!(settled_within(&store, &d, wait).await, Err(InUseError::Busy(_))), "a live gc's mark must not be ignored");
    }

    #[tokio::test]
    async fn leases_name_their_digests_until_released() {
        let dir = tempfile::tempdir().unwrap();
        let store = FsStore::open(dir.path()).unwrap();
        let (a, b) = (OciDigest::of(b"a"), OciDigest::of(b"b"));
        let l = lease(&store, vec![a.clone(), b.clone()]).await.unwrap();
        assert_eq!(leased(&store, None, false).await.unwrap(), [a.clone(), b.clone()].into_iter().collect());
        l.release_committed(&store).await.unwrap();
        assert!(leased(&store, None, false).await.unwrap().is_empty());
        assert!(store.head(&layout::gc_used(&a)).await.is_ok() && store.head(&layout::gc_used(&b)).await.is_ok());
        let _dead = lease(&store, vec![a]).await.unwrap();
        let later = SystemTime::now() + Duration::from_secs(60);
        assert!(leased(&store, Some(later), false).await.unwrap().is_empty(), "stale lease ignored");
        assert!(store.list(layout::GC_INFLIGHT).await.unwrap().is_empty(), "stale lease removed");
    }
}
