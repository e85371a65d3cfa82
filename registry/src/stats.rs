//! What the store holds, in totals: bytes, blobs, manifests, repositories and how much
//! sharing saves. For `/metrics` gauges and the web view.
//!
//! A scrape must not cost a walk over the store (a million blobs, a scrape every 15 s),
//! and counters kept by each replica would drift from what gc and other replicas do. So a
//! background task scans the store every `--stats-interval` and the last result is served:
//!
//! ```text
//! every interval: blobs/ (pages of 1000: count, bytes) ─┐
//!                 _catalog/ (count)                      ├─> Totals (cached) ──> /metrics, /ui/
//!                 repositories/ _manifests links ────────┘
//!                   └─ each manifest's logical size: read once, remembered by digest
//! ```
//! Memory is bounded: listings are paged, and the remembered manifest sizes are capped
//! ([`LOGICAL_CACHE_CAP`]; forgotten wholesale when full, so the next scan reads them again).
//!
//! Between scans the totals follow this server's own writes as they happen
//! ([`Stats::note`]: a blob stored, a manifest linked or unlinked, a repository created),
//! and a gc run inside the server asks for a scan when it ends ([`Stats::rescan_soon`]).
//! The periodic scan stays as the reconciliation: what other replicas and `snapctl gc`
//! in another process change is seen at the next scan.
//!
//! Per repository, a scan also counts its own and its shared bytes ([`RepoBytes`]): each
//! object under `blobs/` that the repository links (`_layers`, `_manifests`) is its own
//! when no other repository links it, shared when another does (then it is counted in
//! each). That takes a map of every blob (about 40 bytes each), so it is done for stores
//! of up to [`OWNERSHIP_CAP`] blobs; beyond, the per-repository figures are left out.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use imgfmt::OciDigest;

use crate::layout;
use crate::store::{BlobStore, StoreError};

/// Default time between two scans.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(300);
/// Manifest logical sizes remembered between scans.
const LOGICAL_CACHE_CAP: usize = 200_000;
/// Keys listed per storage call.
const PAGE: usize = 1000;
/// Manifests larger than this are not read for their logical size (the registry refuses
/// to store bigger ones by default; see `--max-manifest-bytes`).
const MAX_MANIFEST_READ: u64 = 16 << 20;
/// Most blobs a scan tracks to count each repository's own and shared bytes.
pub const OWNERSHIP_CAP: usize = 2_000_000;

/// One repository's bytes in the store, at the last scan.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RepoBytes {
    pub repository: String,
    /// Bytes of the blobs (and manifests) it links that no other repository links: what
    /// deleting the repository would free.
    pub own_bytes: u64,
    /// Bytes of the blobs it links that other repositories link too.
    pub shared_bytes: u64,
}

/// A change this server made to the store, applied to the totals at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// A blob (or manifest) of `bytes` was stored under `blobs/` where none was.
    Stored { bytes: u64 },
    /// A manifest was linked into a repository where it was not: `logical` is its bytes
    /// plus those its descriptors name ([`descriptor_sizes`]).
    Linked { logical: u64 },
    /// A manifest link was deleted.
    Unlinked { logical: u64 },
    /// A repository entered the catalog.
    NewRepository,
}

/// The store's totals at one moment.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Totals {
    /// Objects under `blobs/` (blobs and manifests, each stored once).
    pub blobs: u64,
    /// Their bytes: what the store holds.
    pub stored_bytes: u64,
    /// Manifests, counted once per repository that holds them.
    pub manifests: u64,
    /// Repositories in the catalog.
    pub repositories: u64,
    /// What pulling every manifest of every repository would transfer: each manifest's
    /// own bytes and the sizes of the descriptors it lists (config, layers, blobs, index
    /// entries), counted again for every manifest and repository that lists them.
    pub logical_bytes: u64,
    /// When the scan finished, seconds since the Unix epoch.
    pub scanned_at: u64,
    /// How long the scan took, milliseconds.
    pub scan_ms: u64,
    /// Each repository's own and shared bytes, by name; `None` when the store held more
    /// than [`OWNERSHIP_CAP`] blobs.
    pub repository_bytes: Option<Vec<RepoBytes>>,
}

impl Totals {
    /// Prometheus gauges of these totals: bytes, blobs, manifests,
    /// repositories, logical bytes, the dedup ratio and when the scan ran.
    pub fn render_prometheus(&self) -> String {
        let mut o = String::new();
        let gauges: [(&str, &str, String); 8] = [
            ("snapctl_store_bytes", "Bytes the store holds under blobs/ (blobs and manifests, each once).", self.stored_bytes.to_string()),
            ("snapctl_store_blobs", "Objects under blobs/ (blobs and manifests).", self.blobs.to_string()),
            ("snapctl_store_manifests", "Manifests, counted once per repository holding them.", self.manifests.to_string()),
            ("snapctl_store_repositories", "Repositories in the catalog.", self.repositories.to_string()),
            ("snapctl_store_logical_bytes", "Bytes a pull of every manifest of every repository would transfer.", self.logical_bytes.to_string()),
            ("snapctl_store_dedup_ratio", "Logical bytes over stored bytes (0 when empty).", format!("{:.4}", self.dedup_ratio())),
            ("snapctl_store_scan_timestamp_seconds", "When the store totals were taken (Unix time).", self.scanned_at.to_string()),
            ("snapctl_store_scan_seconds", "How long taking the store totals took.", format!("{:.3}", self.scan_ms as f64 / 1000.0)),
        ];
        for (name, help, v) in gauges {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        }
        if let Some(repos) = &self.repository_bytes {
            render_repository_bytes(&mut o, repos);
        }
        o
    }

    /// logical / stored: how many times over sharing stores the data (1.0 = no sharing;
    /// 0 when the store is empty).
    pub fn dedup_ratio(&self) -> f64 {
        if self.stored_bytes == 0 {
            0.0
        } else {
            self.logical_bytes as f64 / self.stored_bytes as f64
        }
    }
}

/// Repository series in `/metrics`, at most: the repositories with the most bytes (names
/// are chosen by whoever may push, and each is a series).
pub const MAX_REPOSITORY_SERIES: usize = 500;

/// `snapctl_repository_bytes{repository,kind}` of the [`MAX_REPOSITORY_SERIES`]
/// repositories holding the most bytes.
fn render_repository_bytes(o: &mut String, repos: &[RepoBytes]) {
    let mut top: Vec<&RepoBytes> = repos.iter().collect();
    top.sort_by(|a, b| (b.own_bytes + b.shared_bytes).cmp(&(a.own_bytes + a.shared_bytes)).then(a.repository.cmp(&b.repository)));
    top.truncate(MAX_REPOSITORY_SERIES);
    top.sort_by(|a, b| a.repository.cmp(&b.repository));
    let name = "snapctl_repository_bytes";
    let _ = writeln!(
        o,
        "# HELP {name} Bytes of the blobs a repository links at the last scan: own (no other repository links them) or shared.\n# TYPE {name} gauge"
    );
    for r in top {
        // Repository names are [a-z0-9._/-]: nothing to escape in a label value.
        let _ = writeln!(o, "{name}{{repository=\"{}\",kind=\"own\"}} {}", r.repository, r.own_bytes);
        let _ = writeln!(o, "{name}{{repository=\"{}\",kind=\"shared\"}} {}", r.repository, r.shared_bytes);
    }
}

/// Scans and the last result.
#[derive(Debug)]
pub struct Stats {
    store: Arc<dyn BlobStore>,
    latest: Mutex<Option<Totals>>,
    logical: Mutex<HashMap<OciDigest, u64>>,
    rescan: Arc<tokio::sync::Notify>,
}

impl Stats {
    /// Statistics of `store`; nothing is known before the first [`Stats::scan`].
    pub fn new(store: Arc<dyn BlobStore>) -> Stats {
        Stats { store, latest: Mutex::new(None), logical: Mutex::new(HashMap::new()), rescan: Arc::default() }
    }

    /// The last scan's totals, with the changes noted since, if a scan finished.
    pub fn latest(&self) -> Option<Totals> {
        self.latest.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Apply a change this server made to the totals (nothing before the first scan,
    /// which sees it). A change made while a scan runs may be counted by the scan and
    /// lost with its result, or not; the next scan settles it.
    pub fn note(&self, c: Change) {
        let mut g = self.latest.lock().unwrap_or_else(|p| p.into_inner());
        let Some(t) = g.as_mut() else { return };
        match c {
            Change::Stored { bytes } => {
                t.blobs += 1;
                t.stored_bytes += bytes;
            }
            Change::Linked { logical } => {
                t.manifests += 1;
                t.logical_bytes += logical;
            }
            Change::Unlinked { logical } => {
                t.manifests = t.manifests.saturating_sub(1);
                t.logical_bytes = t.logical_bytes.saturating_sub(logical);
            }
            Change::NewRepository => t.repositories += 1,
        }
    }

    /// Ask the background scanner for a scan now (after a gc run changed the store).
    pub fn rescan_soon(&self) {
        self.rescan.notify_one();
    }

    /// What [`Stats::rescan_soon`] wakes: the scanner waits on it between scans; a gc
    /// schedule holds a clone.
    pub fn rescan_signal(&self) -> Arc<tokio::sync::Notify> {
        self.rescan.clone()
    }

    /// The logical size of manifest `bytes` (`d`), remembered for the scans.
    pub fn logical_of(&self, d: &OciDigest, bytes: &[u8]) -> u64 {
        let n = bytes.len() as u64 + descriptor_sizes(bytes);
        self.remember(d, n);
        n
    }

    /// The remembered logical size of `d`, or it read from the store (0 when missing).
    pub async fn logical(&self, d: &OciDigest) -> Result<u64, StoreError> {
        self.logical_size(d).await
    }

    fn remember(&self, d: &OciDigest, n: u64) {
        let mut cache = self.logical.lock().unwrap_or_else(|p| p.into_inner());
        if cache.len() >= LOGICAL_CACHE_CAP {
            cache.clear();
        }
        cache.insert(d.clone(), n);
    }

    /// Walk the store and keep the totals.
    pub async fn scan(&self) -> Result<Totals, StoreError> {
        let t = Instant::now();
        let (mut blobs, mut stored_bytes) = (0u64, 0u64);
        let mut owners = Ownership::default();
        self.walk(layout::BLOBS, |m| {
            blobs += 1;
            stored_bytes += m.size;
            owners.blob(&m.key, m.size);
        })
        .await?;
        let mut repositories = 0u64;
        self.walk(layout::CATALOG, |m| {
            if layout::parse_catalog_entry(&m.key).is_some() {
                repositories += 1;
            }
        })
        .await?;
        let mut links: Vec<OciDigest> = Vec::new();
        let (mut manifests, mut logical_bytes) = (0u64, 0u64);
        let mut after: Option<String> = None;
        loop {
            let page = self.store.list_after(layout::REPOS, after.as_deref(), PAGE).await?;
            let Some(last) = page.last() else { break };
            after = Some(last.key.clone());
            links.clear();
            for m in &page {
                match layout::parse_repo_key(&m.key) {
                    Some(layout::RepoKey::Manifest(r, d)) => {
                        owners.link(&r, &d);
                        links.push(d);
                    }
                    Some(layout::RepoKey::Layer(r, d)) => owners.link(&r, &d),
                    _ => {}
                }
            }
            for d in &links {
                manifests += 1;
                logical_bytes += self.logical_size(d).await?;
            }
            if page.len() < PAGE {
                break;
            }
        }
        let scanned_at = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let totals = Totals {
            blobs,
            stored_bytes,
            manifests,
            repositories,
            logical_bytes,
            scanned_at,
            scan_ms: t.elapsed().as_millis() as u64,
            repository_bytes: owners.finish(),
        };
        *self.latest.lock().unwrap_or_else(|p| p.into_inner()) = Some(totals.clone());
        Ok(totals)
    }

    /// Call `f` for every object under `prefix`, a page at a time.
    async fn walk(&self, prefix: &str, mut f: impl FnMut(&crate::store::ObjectMeta)) -> Result<(), StoreError> {
        let mut after: Option<String> = None;
        loop {
            let page = self.store.list_after(prefix, after.as_deref(), PAGE).await?;
            page.iter().for_each(&mut f);
            match page.last() {
                Some(m) if page.len() == PAGE => after = Some(m.key.clone()),
                _ => return Ok(()),
            }
        }
    }

    /// A manifest's bytes plus the sizes its descriptors name; 0 when it is missing or
    /// not a manifest (gc took it; it is counted by the next scan if it comes back).
    async fn logical_size(&self, d: &OciDigest) -> Result<u64, StoreError> {
        if let Some(n) = self.logical.lock().unwrap_or_else(|p| p.into_inner()).get(d) {
            return Ok(*n);
        }
        let key = layout::blob(d);
        let size = match self.store.head(&key).await {
            Ok(m) => m.size,
            Err(e) if e.is_not_found() => return Ok(0),
            Err(e) => return Err(e),
        };
        let mut n = size;
        if size <= MAX_MANIFEST_READ {
            let bytes = match self.store.get_bytes(&key).await {
                Ok(b) => b,
                Err(e) if e.is_not_found() => return Ok(0),
                Err(e) => return Err(e),
            };
            n += descriptor_sizes(&bytes);
        }
        self.remember(d, n);
        Ok(n)
    }
}

/// Which repositories link each blob, as a scan meets them: a blob's owner is the one
/// repository linking it, or [`Ownership::SHARED`] once a second one does.
#[derive(Default)]
struct Ownership {
    /// A hash of the blob's key → (size, owner). Hashes, not digests: 40 bytes a blob
    /// where a digest alone is ~100; a collision misplaces one blob's bytes in a report.
    blobs: HashMap<u64, (u64, u32)>,
    repos: HashMap<String, u32>,
    /// Per repository index: (name, own, shared).
    totals: Vec<(String, u64, u64)>,
    /// More blobs than [`OWNERSHIP_CAP`]: nothing is counted.
    over: bool,
}

impl Ownership {
    const NONE: u32 = u32::MAX;
    const SHARED: u32 = u32::MAX - 1;

    fn key_hash(key: &str) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        key.hash(&mut h);
        h.finish()
    }

    fn blob(&mut self, key: &str, size: u64) {
        if self.over {
            return;
        }
        if self.blobs.len() >= OWNERSHIP_CAP {
            self.over = true;
            self.blobs = HashMap::new();
            return;
        }
        self.blobs.insert(Self::key_hash(key), (size, Self::NONE));
    }

    fn link(&mut self, repo: &crate::name::RepoName, d: &OciDigest) {
        if self.over {
            return;
        }
        let Some((size, owner)) = self.blobs.get_mut(&Self::key_hash(&layout::blob(d))) else { return };
        let next = self.totals.len() as u32;
        let i = *self.repos.entry(repo.as_str().to_owned()).or_insert(next);
        if i == next {
            self.totals.push((repo.as_str().to_owned(), 0, 0));
        }
        match *owner {
            Self::NONE => {
                *owner = i;
                self.totals[i as usize].1 += *size;
            }
            o if o == i => {}
            Self::SHARED => self.totals[i as usize].2 += *size,
            o => {
                self.totals[o as usize].1 -= *size;
                self.totals[o as usize].2 += *size;
                self.totals[i as usize].2 += *size;
                *owner = Self::SHARED;
            }
        }
    }

    fn finish(self) -> Option<Vec<RepoBytes>> {
        if self.over {
            return None;
        }
        let mut v: Vec<RepoBytes> =
            self.totals.into_iter().map(|(repository, own_bytes, shared_bytes)| RepoBytes { repository, own_bytes, shared_bytes }).collect();
        v.sort_by(|a, b| a.repository.cmp(&b.repository));
        Some(v)
    }
}

/// The sum of the `size`s of a manifest's config, layers, blobs and index entries.
pub fn descriptor_sizes(manifest: &[u8]) -> u64 {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(manifest) else { return 0 };
    let size = |d: &serde_json::Value| d.get("size").and_then(|s| s.as_u64()).unwrap_or(0);
    let mut n = v.get("config").map(size).unwrap_or(0);
    for k in ["layers", "blobs", "manifests"] {
        if let Some(a) = v.get(k).and_then(|a| a.as_array()) {
            n = a.iter().map(size).fold(n, u64::saturating_add);
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::name::RepoName;
    use bytes::Bytes;

    #[tokio::test]
    async fn totals_count_sharing() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn BlobStore> = Arc::new(crate::store::FsStore::open(dir.path()).unwrap());
        let layer = vec![7u8; 1000];
        let ld = OciDigest::of(&layer);
        store.put(&layout::blob(&ld), Bytes::from(layer)).await.unwrap();
        let m = serde_json::to_vec(&serde_json::json!({"layers": [{"digest": ld.to_string(), "size": 1000}]})).unwrap();
        let md = OciDigest::of(&m);
        store.put(&layout::blob(&md), Bytes::from(m.clone())).await.unwrap();
        // One manifest in two repositories: stored once, pulled twice.
        for r in ["a", "b/c"] {
            let r = RepoName::parse(r).unwrap();
            store.put(&layout::catalog_entry(&r), Bytes::new()).await.unwrap();
            store.put(&layout::manifest_link(&r, &md), Bytes::new()).await.unwrap();
        }
        let s = Stats::new(store);
        assert!(s.latest().is_none());
        let t = s.scan().await.unwrap();
        let stored = 1000 + m.len() as u64;
        assert_eq!((t.blobs, t.stored_bytes, t.manifests, t.repositories), (2, stored, 2, 2));
        assert_eq!(t.logical_bytes, 2 * stored);
        assert!((t.dedup_ratio() - 2.0).abs() < 1e-9);
        assert_eq!(s.latest(), Some(t));
    }

    #[tokio::test]
    async fn regression_issue_39_each_repository_has_own_and_shared_bytes_and_changes_show_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn BlobStore> = Arc::new(crate::store::FsStore::open(dir.path()).unwrap());
        let put = |data: Vec<u8>| {
            let store = store.clone();
            async move {
                let d = OciDigest::of(&data);
                store.put(&layout::blob(&d), Bytes::from(data)).await.unwrap();
                d
            }
        };
        let (shared, own_a, own_b) = (put(vec![1u8; 1000]).await, put(vec![2u8; 300]).await, put(vec![3u8; 70]).await);
        let (a, b) = (RepoName::parse("team/a").unwrap(), RepoName::parse("b").unwrap());
        for (r, d) in [(&a, &shared), (&a, &own_a), (&b, &shared), (&b, &own_b), (&b, &own_b)] {
            store.put(&layout::layer_link(r, d), Bytes::new()).await.unwrap();
        }
        let s = Stats::new(store.clone());
        let t = s.scan().await.unwrap();
        let repos = t.repository_bytes.clone().unwrap();
        assert_eq!(
            repos,
            vec![
                RepoBytes { repository: "b".into(), own_bytes: 70, shared_bytes: 1000 },
                RepoBytes { repository: "team/a".into(), own_bytes: 300, shared_bytes: 1000 },
            ]
        );
        let text = t.render_prometheus();
        assert!(text.contains("snapctl_repository_bytes{repository=\"team/a\",kind=\"own\"} 300\n"), "{text}");
        assert!(text.contains("snapctl_repository_bytes{repository=\"b\",kind=\"shared\"} 1000\n"), "{text}");
        // This server's writes count at once; the next scan settles them.
        s.note(Change::Stored { bytes: 5000 });
        s.note(Change::Linked { logical: 6000 });
        s.note(Change::NewRepository);
        let now = s.latest().unwrap();
        assert_eq!((now.blobs, now.stored_bytes, now.manifests, now.logical_bytes, now.repositories), (4, 1370 + 5000, 1, 6000, 1));
        s.note(Change::Unlinked { logical: 6000 });
        assert_eq!((s.latest().unwrap().manifests, s.latest().unwrap().logical_bytes), (0, 0));
    }
}
