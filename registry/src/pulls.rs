//! Pull times: when each manifest was last pulled from each repository, for retention's
//! `pulled_within` and `most_recently_pulled_count`, without a write per GET.
//!
//! ```text
//! GET manifest ──► PullLog::record (memory, one entry per repository and manifest)
//!                     │ every `flush_every` (and when PENDING_MAX entries wait, and at shutdown)
//!                     ▼
//!             repositories/<name>/_pulled   {"sha256:…": <unix seconds>, …}   (read, merge, write)
//! ```
//!
//! A pull is a restore: it is recorded when the server answers a GET of a manifest (by
//! tag or digest) with 200 to a client restoring the image (`Snapctl-Purpose: restore`,
//! or no such header: another tool pulling), and for a restore lease taken or renewed
//! (crate::restore_lease::is_restore). A HEAD is not a pull, nor a read that says
//! `Snapctl-Purpose: read` (inspect, verify, a push resolving its parent). Replicas share the object: each flush reads it, keeps the
//! later time of each entry, writes it back, and reads it again to check that its own
//! entries survived (another replica may have written in between; then it merges again,
//! up to three times). gc drops the entries of manifests it deletes.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use imgfmt::OciDigest;

use crate::layout;
use crate::name::RepoName;
use crate::store::{BlobStore, StoreError};

/// Entries waiting in memory before a flush is started early. Bounds the log's memory
/// (a few hundred bytes an entry) whatever the request rate.
pub const PENDING_MAX: usize = 50_000;
/// How often a server writes its recorded pulls by default.
pub const DEFAULT_FLUSH_EVERY: Duration = Duration::from_secs(300);
/// Largest `_pulled` object read back (about 12 MB of entries: 150,000 manifests).
pub const MAX_PULLED_BYTES: u64 = 16 << 20;

/// Pulls recorded in memory, not yet written.
#[derive(Debug, Default)]
pub struct PullLog {
    pending: Mutex<HashMap<RepoName, HashMap<OciDigest, u64>>>,
    count: std::sync::atomic::AtomicUsize,
    /// Woken when [`PENDING_MAX`] entries wait.
    pub full: tokio::sync::Notify,
}

fn unix(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

impl PullLog {
    /// Record that `d` was pulled from `repo` now.
    pub fn record(&self, repo: &RepoName, d: &OciDigest) {
        self.record_at(repo, d, SystemTime::now());
    }

    /// Record that `d` was pulled from `repo` at `t` (tests drive a clock of their own).
    pub fn record_at(&self, repo: &RepoName, d: &OciDigest, t: SystemTime) {
        let mut p = self.pending.lock().expect("poisoned");
        let e = p.entry(repo.clone()).or_default();
        let slot = e.entry(d.clone()).or_insert_with(|| {
            self.count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            0
        });
        *slot = (*slot).max(unix(t));
        if self.count.load(std::sync::atomic::Ordering::Relaxed) >= PENDING_MAX {
            self.full.notify_one();
        }
    }

    /// The pulls of `repo` recorded here and not yet written (unix seconds).
    pub fn pending_for(&self, repo: &RepoName) -> HashMap<OciDigest, u64> {
        self.pending.lock().expect("poisoned").get(repo).cloned().unwrap_or_default()
    }

    /// Drop the pulls of `gone` recorded here and not yet written: gc deleted those
    /// manifests, and a pull recorded between the flush before its run and the deletion
    /// would otherwise be written after it, for a manifest that no longer exists.
    pub fn forget_pending<'a>(&self, gone: impl IntoIterator<Item = (&'a str, &'a OciDigest)>) {
        let mut p = self.pending.lock().expect("poisoned");
        for (repo, d) in gone {
            let Ok(r) = RepoName::parse(repo) else { continue };
            if let Some(e) = p.get_mut(&r) {
                if e.remove(d).is_some() {
                    self.count.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }
    }

    /// Entries waiting to be written.
    pub fn pending(&self) -> usize {
        self.count.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Write every recorded pull to its repository's `_pulled` object. Entries of a
    /// repository that could not be written are kept for the next flush (up to
    /// [`PENDING_MAX`] of them; beyond, the oldest are dropped). Returns how many entries
    /// were written.
    pub async fn flush(&self, store: &dyn BlobStore) -> Result<usize, StoreError> {
        let taken = {
            let mut p = self.pending.lock().expect("poisoned");
            self.count.store(0, std::sync::atomic::Ordering::Relaxed);
            std::mem::take(&mut *p)
        };
        let mut written = 0;
        let mut first_err = None;
        let mut failed = Vec::new();
        for (repo, entries) in taken {
            match merge_into(store, &repo, &entries).await {
                Ok(()) => written += entries.len(),
                Err(e) => {
                    tracing::warn!(%repo, %e, "could not write pull times; keeping them for the next flush");
                    failed.push((repo, entries));
                    first_err.get_or_insert(e);
                }
            }
        }
        for (repo, entries) in failed {
            for (d, t) in entries {
                if self.pending() < PENDING_MAX {
                    self.record_at(&repo, &d, UNIX_EPOCH + Duration::from_secs(t));
                }
            }
        }
        match first_err {
            Some(e) if written == 0 => Err(e),
            _ => Ok(written),
        }
    }
}

/// The pull times stored for `repo` (empty when none were).
pub async fn read(store: &dyn BlobStore, repo: &RepoName) -> Result<HashMap<OciDigest, SystemTime>, StoreError> {
    Ok(read_raw(store, repo).await?.into_iter().map(|(d, t)| (d, UNIX_EPOCH + Duration::from_secs(t))).collect())
}

async fn read_raw(store: &dyn BlobStore, repo: &RepoName) -> Result<HashMap<OciDigest, u64>, StoreError> {
    let key = layout::pulled(repo);
    let meta = match store.head(&key).await {
        Ok(m) => m,
        Err(e) if e.is_not_found() => return Ok(HashMap::new()),
        Err(e) => return Err(e),
    };
    if meta.size > MAX_PULLED_BYTES {
        tracing::warn!(%repo, size = meta.size, "pull times object too large; ignored (and replaced at the next flush)");
        return Ok(HashMap::new());
    }
    let raw = match store.get_bytes(&key).await {
        Ok(b) => b,
        Err(e) if e.is_not_found() => return Ok(HashMap::new()),
        Err(e) => return Err(e),
    };
    match decode(&raw) {
        Ok(m) => Ok(m),
        Err(e) => {
            // Only pull times: a damaged object costs what it recorded, never a request.
            tracing::warn!(%repo, %e, "unreadable pull times object; starting it again");
            Ok(HashMap::new())
        }
    }
}

/// A `_pulled` object's entries: `{"sha256:…": <unix seconds>, …}`. Keys that are not
/// digests are skipped (a later flush writes the object without them); anything else that
/// is not that shape is an error. The caller bounds the input ([`MAX_PULLED_BYTES`]).
pub fn decode(raw: &[u8]) -> Result<HashMap<OciDigest, u64>, serde_json::Error> {
    let m = serde_json::from_slice::<HashMap<String, u64>>(raw)?;
    Ok(m.into_iter().filter_map(|(d, t)| Some((d.parse().ok()?, t))).collect())
}

/// The `_pulled` object of `m`, keys in order.
pub fn encode(m: &HashMap<OciDigest, u64>) -> Vec<u8> {
    let named: std::collections::BTreeMap<String, u64> = m.iter().map(|(d, t)| (d.to_string(), *t)).collect();
    serde_json::to_vec(&named).expect("map serializes")
}

async fn write_raw(store: &dyn BlobStore, repo: &RepoName, m: &HashMap<OciDigest, u64>) -> Result<(), StoreError> {
    store.put(&layout::pulled(repo), Bytes::from(encode(m))).await
}

/// Merge `entries` into `repo`'s object (later time wins), checking they survived.
async fn merge_into(store: &dyn BlobStore, repo: &RepoName, entries: &HashMap<OciDigest, u64>) -> Result<(), StoreError> {
    for attempt in 0..3 {
        let mut m = read_raw(store, repo).await?;
        for (d, t) in entries {
            let e = m.entry(d.clone()).or_insert(0);
            *e = (*e).max(*t);
        }
        write_raw(store, repo, &m).await?;
        let back = read_raw(store, repo).await?;
        if entries.iter().all(|(d, t)| back.get(d).is_some_and(|b| b >= t)) {
            return Ok(());
        }
        tracing::info!(%repo, attempt, "another writer replaced the pull times; merging again");
    }
    Err(StoreError::Precondition { key: layout::pulled(repo), reason: "pull times kept being replaced by another writer".into() })
}

/// Drop the entries of `gone` from `repo`'s object (gc, after deleting those manifests).
pub async fn forget(store: &dyn BlobStore, repo: &RepoName, gone: &std::collections::HashSet<&OciDigest>) -> Result<(), StoreError> {
    let mut m = read_raw(store, repo).await?;
    let before = m.len();
    m.retain(|d, _| !gone.contains(d));
    if m.len() != before {
        write_raw(store, repo, &m).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::FsStore;
    use std::sync::Arc;

    async fn pulls_survive_flushes_and_merges(store: &dyn BlobStore) {
        let r = RepoName::parse("team/vm").unwrap();
        let (a, b) = (OciDigest::of(b"a"), OciDigest::of(b"b"));
        let log = PullLog::default();
        let t = |s: u64| UNIX_EPOCH + Duration::from_secs(s);
        for s in [100, 300, 200] {
            log.record_at(&r, &a, t(s));
        }
        assert_eq!(log.pending(), 1, "one entry per manifest, however many pulls");
        assert!(store.head(&layout::pulled(&r)).await.is_err(), "nothing is written per pull");
        assert_eq!(log.flush(store).await.unwrap(), 1);
        assert_eq!(log.pending(), 0);
        // A second replica's log: later for b, earlier for a (the earlier does not win).
        let other = PullLog::default();
        other.record_at(&r, &a, t(50));
        other.record_at(&r, &b, t(400));
        other.flush(store).await.unwrap();
        let got = read(store, &r).await.unwrap();
        assert_eq!(got.get(&a), Some(&t(300)));
        assert_eq!(got.get(&b), Some(&t(400)));
        forget(store, &r, &[&a].into_iter().collect()).await.unwrap();
        assert_eq!(read(store, &r).await.unwrap().keys().collect::<Vec<_>>(), vec![&b]);
        // A damaged object is started again, not an error.
        store.put(&layout::pulled(&r), Bytes::from_static(b"{not json")).await.unwrap();
        assert!(read(store, &r).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn fs_store() {
        let dir = tempfile::tempdir().unwrap();
        pulls_survive_flushes_and_merges(&FsStore::open(dir.path()).unwrap()).await;
    }

    /// S3's key space, through object_store's in-memory store.
    #[tokio::test]
    async fn object_store() {
        let staging = tempfile::tempdir().unwrap();
        let mem = Arc::new(object_store::memory::InMemory::new());
        let store = crate::store::ObjectStoreBackend::new(mem, "reg", staging.path()).unwrap();
        pulls_survive_flushes_and_merges(&store).await;
    }

    #[test]
    fn regression_issue_22_deleted_manifests_leave_the_pending_log() {
        let log = PullLog::default();
        let repo = RepoName::parse("dev/vm").unwrap();
        let (a, b) = (OciDigest::of(b"a"), OciDigest::of(b"b"));
        log.record(&repo, &a);
        log.record(&repo, &b);
        log.forget_pending([("dev/vm", &a), ("other/repo", &b)]);
        assert_eq!(log.pending(), 1);
        assert_eq!(log.pending_for(&repo).keys().collect::<Vec<_>>(), vec![&b]);
    }

    #[test]
    fn a_full_log_asks_for_a_flush() {
        let log = PullLog::default();
        let r = RepoName::parse("vm").unwrap();
        for i in 0..PENDING_MAX {
            log.record(&r, &OciDigest::of(&i.to_le_bytes()));
        }
        assert_eq!(log.pending(), PENDING_MAX);
        // The permit is stored: the flusher's next wait returns at once.
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async { tokio::time::timeout(Duration::from_secs(1), log.full.notified()).await.expect("notified") });
    }
}
