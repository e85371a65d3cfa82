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

/// Scans and the last result.
#[derive(Debug)]
pub struct Stats {
    store: Arc<dyn BlobStore>,
    latest: Mutex<Option<Totals>>,
    logical: Mutex<HashMap<OciDigest, u64>>,
}

impl Stats {
    /// Statistics of `store`; nothing is known before the first [`Stats::scan`].
    pub fn new(store: Arc<dyn BlobStore>) -> Stats {
        Stats { store, latest: Mutex::new(None), logical: Mutex::new(HashMap::new()) }
    }

    /// The last scan's totals, if one finished.
    pub fn latest(&self) -> Option<Totals> {
        self.latest.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Walk the store and keep the totals.
    pub async fn scan(&self) -> Result<Totals, StoreError> {
        let t = Instant::now();
        let (mut blobs, mut stored_bytes) = (0u64, 0u64);
        self.walk(layout::BLOBS, |m| {
            blobs += 1;
            stored_bytes += m.size;
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
            links.extend(page.iter().filter_map(|m| match layout::parse_repo_key(&m.key) {
                Some(layout::RepoKey::Manifest(_, d)) => Some(d),
                _ => None,
            }));
            for d in &links {
                manifests += 1;
                logical_bytes += self.logical_size(d).await?;
            }
            if page.len() < PAGE {
                break;
            }
        }
        let scanned_at = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let totals = Totals { blobs, stored_bytes, manifests, repositories, logical_bytes, scanned_at, scan_ms: t.elapsed().as_millis() as u64 };
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
        let mut cache = self.logical.lock().unwrap_or_else(|p| p.into_inner());
        if cache.len() >= LOGICAL_CACHE_CAP {
            cache.clear();
        }
        cache.insert(d.clone(), n);
        Ok(n)
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
}
