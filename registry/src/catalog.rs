//! The repository catalog: which repositories a store holds, in pages, for
//! `GET /v2/_catalog` and the web view.
//!
//! ```text
//! manifest PUT ──> record(repo) ──> _catalog/<name with '/' as '!'>   (before the manifest link)
//!                                         │ flat keys, byte order = catalog order
//! GET /v2/_catalog?n=N&last=L ──> list_after(_catalog/, L, N+1) ──> N names (+ Link when more)
//! ```
//! - **Order.** Lexical by path component, as distribution orders it: `a`, `a/b`, `a-b`,
//!   `a.b`, `a0`. Entry keys spell `/` as `!`, which sorts below every other name
//!   character, so the byte order of the flat keys is that order on a directory and in S3.
//! - **Cost of a page.** A page lists entries starting after `last` ([`BlobStore::list_after`]):
//!   one S3 request (`start-after`) whatever the catalog's size; on a directory, one read of
//!   `_catalog/` (a directory cannot be read from a name).
//! - **Walks while repositories are added.** Pages are strictly after the previous page's
//!   last name, so no name comes twice, and a repository that existed during the whole walk
//!   sorts after some page's end or before it: it is listed once.
//! - **Which repositories.** Those that ever held a manifest (distribution lists a
//!   repository once it has `_manifests`, and keeps listing it after its manifests are
//!   deleted; so does this). The entry is written before the first manifest link, so a
//!   repository with a manifest always has its entry.
//! - **Stores written before the catalog existed.** The first server to open such a store
//!   indexes it from one listing of `repositories/`, then writes `_catalog.built`.
//! - **Rights.** A caller sees only the repositories it may pull. The ACL's patterns become
//!   ranges of the catalog (`team/*`: the keys starting `team!`; a name: its key), walked in
//!   order, so a page costs as much for a user who may read ten repositories of a million
//!   as for one who may read them all.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use crate::error::{ApiError, Code};
use crate::layout::{self, CATALOG};
use crate::name::RepoName;
use crate::store::{BlobStore, StoreError};

/// Most repositories one catalog page may ask for (`serve --catalog-max-entries`):
/// distribution's default `catalog.maxentries`.
pub const DEFAULT_MAX_ENTRIES: usize = 1000;
/// Page size when a request names no (valid) `n`, as distribution (capped by the maximum).
pub const DEFAULT_ENTRIES: usize = 100;
/// Repositories remembered as having their entry, so a push to a known repository costs no
/// storage call; when full, forgotten wholesale (the next pushes check the store again).
const KNOWN_CAP: usize = 65_536;
/// Entries written at once while indexing an old store (each is a durable write).
const BUILD_JOBS: usize = 16;
/// Keys listed at once while walking.
const LIST_PAGE: usize = 1000;

/// Which repositories a caller may read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readable {
    /// Every repository.
    All,
    /// Those matching these ACL patterns (exact names, `prefix/*`); may be empty.
    Only(Vec<String>),
}

/// The page size a request asks for with `n`, as distribution 2.8 reads it: absent, not
/// a number or negative means [`DEFAULT_ENTRIES`] (at most `max`); more than `max` is
/// 400 `PAGINATION_NUMBER_INVALID` with the number as `detail`.
pub fn page_size(n: Option<&str>, max: usize) -> Result<usize, ApiError> {
    match n.and_then(|n| n.parse::<i64>().ok()).filter(|n| *n >= 0) {
        None => Ok(DEFAULT_ENTRIES.min(max)),
        Some(n) if n as u64 > max as u64 => {
            Err(ApiError::bad(Code::PaginationNumberInvalid, "invalid number of results requested").with_detail(serde_json::json!({ "n": n })))
        }
        Some(n) => Ok(n as usize),
    }
}

/// A range of the catalog, in entry-key space.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Range {
    /// Exactly this entry key.
    Key(String),
    /// Every entry key starting with this.
    Prefix(String),
}

impl Range {
    fn start(&self) -> &str {
        match self {
            Range::Key(k) | Range::Prefix(k) => k,
        }
    }
}

impl Readable {
    /// From ACL repository patterns (`*`, `prefix/*`, exact names).
    pub fn from_patterns(patterns: impl IntoIterator<Item = String>) -> Readable {
        let mut only = Vec::new();
        for p in patterns {
            if p == "*" {
                return Readable::All;
            }
            only.push(p);
        }
        Readable::Only(only)
    }

    /// Whether `name` is readable.
    pub fn allows(&self, name: &str) -> bool {
        match self {
            Readable::All => true,
            Readable::Only(ps) => ps.iter().any(|p| crate::auth::repo_matches(p, name)),
        }
    }

    /// The catalog ranges to walk, in order, none inside another. Patterns that no valid
    /// name can match are dropped.
    fn ranges(&self) -> Option<Vec<Range>> {
        let Readable::Only(ps) = self else { return None };
        let mut rs: Vec<Range> = ps
            .iter()
            .filter_map(|p| match p.strip_suffix("/*") {
                Some(prefix) => RepoName::parse(prefix).ok().map(|r| Range::Prefix(format!("{}!", layout::catalog_entry(&r)))),
                None => RepoName::parse(p).ok().map(|r| Range::Key(layout::catalog_entry(&r))),
            })
            .collect();
        rs.sort_by(|a, b| a.start().cmp(b.start()));
        let mut out: Vec<Range> = Vec::new();
        for r in rs {
            // Sorted by start: a range inside another comes right after a covering prefix.
            let covered = out.iter().rev().any(|o| matches!(o, Range::Prefix(p) if r.start().starts_with(p.as_str())));
            if !covered && out.last() != Some(&r) {
                out.push(r);
            }
        }
        Some(out)
    }
}

/// One page of the catalog.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    /// The repositories, in catalog order.
    pub repos: Vec<RepoName>,
    /// Whether a readable repository sorts after the last one.
    pub more: bool,
}

/// The catalog of one store.
#[derive(Debug)]
pub struct Catalog {
    store: Arc<dyn BlobStore>,
    /// Repositories whose entry this process wrote or saw.
    known: Mutex<HashSet<RepoName>>,
}

impl Catalog {
    /// The catalog kept in `store`.
    pub fn new(store: Arc<dyn BlobStore>) -> Catalog {
        Catalog { store, known: Mutex::new(HashSet::new()) }
    }

    /// Make sure `repo` has its entry (call before its first manifest link is written);
    /// whether this call wrote it (a repository new to the store).
    pub async fn record(&self, repo: &RepoName) -> Result<bool, StoreError> {
        if self.known.lock().unwrap_or_else(|p| p.into_inner()).contains(repo) {
            return Ok(false);
        }
        let key = layout::catalog_entry(repo);
        let new = match self.store.head(&key).await {
            Ok(_) => false,
            Err(e) if e.is_not_found() => {
                self.store.put(&key, bytes::Bytes::new()).await?;
                true
            }
            Err(e) => return Err(e),
        };
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        if known.len() >= KNOWN_CAP {
            known.clear();
        }
        known.insert(repo.clone());
        Ok(new)
    }

    /// Index a store laid out before the catalog existed: one walk over `repositories/`,
    /// an entry for each repository with a manifest, then `_catalog.built`. Returns how
    /// many repositories were found, or `None` when the store was indexed already.
    pub async fn build_if_missing(&self) -> Result<Option<usize>, StoreError> {
        match self.store.head(layout::CATALOG_BUILT).await {
            Ok(_) => return Ok(None),
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(e),
        }
        let mut found: HashSet<RepoName> = HashSet::new();
        let mut after: Option<String> = None;
        loop {
            let page = self.store.list_after(layout::REPOS, after.as_deref(), LIST_PAGE).await?;
            let Some(last) = page.last() else { break };
            after = Some(last.key.clone());
            let new: Vec<RepoName> = page
                .iter()
                .filter_map(|m| match layout::parse_repo_key(&m.key) {
                    Some(layout::RepoKey::Manifest(r, _)) => Some(r),
                    _ => None,
                })
                .filter(|r| found.insert(r.clone()))
                .collect();
            for some in new.chunks(BUILD_JOBS) {
                futures::future::try_join_all(some.iter().map(|r| self.record(r))).await?;
            }
            if page.len() < LIST_PAGE {
                break;
            }
        }
        self.store.put(layout::CATALOG_BUILT, bytes::Bytes::new()).await?;
        Ok(Some(found.len()))
    }

    /// Up to `n` readable repositories that sort after `last` (any text; `None` = from the
    /// start), and whether more follow.
    pub async fn page(&self, last: Option<&str>, n: usize, readable: &Readable) -> Result<Page, StoreError> {
        let cursor = last.filter(|l| !l.is_empty()).map(|l| format!("{CATALOG}{}", layout::catalog_position(l)));
        let mut repos: Vec<RepoName> = Vec::new();
        // One more than asked: whether it exists decides the Link header.
        let want = n.saturating_add(1);
        match readable.ranges() {
            None => self.walk(cursor.as_deref(), None, want, readable, &mut repos).await?,
            Some(ranges) => {
                for r in ranges {
                    if repos.len() >= want {
                        break;
                    }
                    match &r {
                        Range::Key(k) => {
                            if cursor.as_deref().is_some_and(|c| k.as_str() <= c) {
                                continue;
                            }
                            match self.store.head(k).await {
                                Ok(_) => repos.extend(layout::parse_catalog_entry(k)),
                                Err(e) if e.is_not_found() => {}
                                Err(e) => return Err(e),
                            }
                        }
                        Range::Prefix(p) => {
                            if cursor.as_deref().is_some_and(|c| c > p.as_str() && !c.starts_with(p.as_str())) {
                                continue; // the whole range sorts before the cursor
                            }
                            // Start at the later of the cursor and the range (the prefix
                            // itself is no entry: names do not end with '/').
                            let from = match cursor.as_deref() {
                                Some(c) if c >= p.as_str() => c,
                                _ => p.as_str(),
                            };
                            self.walk(Some(from), Some(p), want, readable, &mut repos).await?;
                        }
                    }
                }
            }
        }
        let more = repos.len() > n;
        repos.truncate(n);
        Ok(Page { repos, more })
    }

    /// Add to `out` the readable entries after `from` (and within `prefix`), until it holds
    /// `want`.
    async fn walk(&self, from: Option<&str>, prefix: Option<&str>, want: usize, readable: &Readable, out: &mut Vec<RepoName>) -> Result<(), StoreError> {
        let mut after = from.map(str::to_owned);
        while out.len() < want {
            let limit = (want - out.len()).clamp(1, LIST_PAGE);
            let page = self.store.list_after(CATALOG, after.as_deref(), limit).await?;
            let full = page.len() == limit;
            for m in page {
                if prefix.is_some_and(|p| !m.key.starts_with(p)) {
                    return Ok(()); // past the range: its keys are contiguous
                }
                if let Some(r) = layout::parse_catalog_entry(&m.key) {
                    if readable.allows(r.as_str()) && out.len() < want {
                        out.push(r);
                    }
                }
                after = Some(m.key);
            }
            if !full {
                break;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::FsStore;

    fn names(p: &Page) -> Vec<&str> {
        p.repos.iter().map(|r| r.as_str()).collect()
    }

    async fn catalog_with(names: &[&str]) -> (tempfile::TempDir, Catalog) {
        let dir = tempfile::tempdir().unwrap();
        let c = Catalog::new(Arc::new(FsStore::open(dir.path()).unwrap()));
        for n in names {
            c.record(&RepoName::parse(n).unwrap()).await.unwrap();
        }
        (dir, c)
    }

    #[test]
    fn page_size_is_read_as_distribution_reads_it() {
        assert_eq!(page_size(None, 1000).unwrap(), 100);
        assert_eq!(page_size(None, 3).unwrap(), 3);
        assert_eq!(page_size(Some("-1"), 1000).unwrap(), 100);
        assert_eq!(page_size(Some("x"), 1000).unwrap(), 100);
        assert_eq!(page_size(Some("0"), 1000).unwrap(), 0);
        assert_eq!(page_size(Some("1000"), 1000).unwrap(), 1000);
        let e = page_size(Some("1001"), 1000).unwrap_err();
        assert_eq!((e.status.as_u16(), e.code.as_str()), (400, "PAGINATION_NUMBER_INVALID"));
        assert_eq!(e.detail, Some(serde_json::json!({"n": 1001})));
    }

    #[tokio::test]
    async fn pages_are_in_distributions_order() {
        let (_d, c) = catalog_with(&["b", "a0", "a.b", "a-b", "a/b", "a", "c/d/e"]).await;
        let all = c.page(None, 100, &Readable::All).await.unwrap();
        assert_eq!(names(&all), ["a", "a/b", "a-b", "a.b", "a0", "b", "c/d/e"], "distribution 2.8 lists these in this order");
        assert!(!all.more);
        let p = c.page(Some("a/b"), 2, &Readable::All).await.unwrap();
        assert_eq!((names(&p), p.more), (vec!["a-b", "a.b"], true));
        let p = c.page(Some("a.b"), 3, &Readable::All).await.unwrap();
        assert_eq!((names(&p), p.more), (vec!["a0", "b", "c/d/e"], false), "a full last page has no next");
        let p = c.page(Some("a-"), 2, &Readable::All).await.unwrap();
        assert_eq!(names(&p), ["a-b", "a.b"], "last need not be a repository");
        assert!(c.page(Some("zzz"), 2, &Readable::All).await.unwrap().repos.is_empty());
        let p = c.page(None, 0, &Readable::All).await.unwrap();
        assert!(p.repos.is_empty() && p.more);
    }

    #[tokio::test]
    async fn only_readable_repositories_are_listed() {
        let (_d, c) = catalog_with(&["team/a", "team/b/c", "team-x", "teamy", "public", "other/z", "team"]).await;
        let r = Readable::from_patterns(["team/*".to_owned(), "public".into(), "team/a".into(), "nosuch".into(), "Not Valid/*".into()]);
        assert_eq!(names(&c.page(None, 100, &r).await.unwrap()), ["public", "team/a", "team/b/c"]);
        let p = c.page(None, 1, &r).await.unwrap();
        assert_eq!((names(&p), p.more), (vec!["public"], true));
        let p = c.page(Some("public"), 1, &r).await.unwrap();
        assert_eq!((names(&p), p.more), (vec!["team/a"], true));
        let p = c.page(Some("team/a"), 1, &r).await.unwrap();
        assert_eq!((names(&p), p.more), (vec!["team/b/c"], false));
        assert!(c.page(None, 10, &Readable::Only(vec![])).await.unwrap().repos.is_empty());
        assert_eq!(Readable::from_patterns(["a".to_owned(), "*".into()]), Readable::All);
    }

    #[tokio::test]
    async fn an_old_store_is_indexed_once() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn BlobStore> = Arc::new(FsStore::open(dir.path()).unwrap());
        let d = imgfmt::OciDigest::of(b"m");
        for n in ["x/y", "x", "z"] {
            store.put(&layout::manifest_link(&RepoName::parse(n).unwrap(), &d), bytes::Bytes::new()).await.unwrap();
        }
        // A repository with blobs and no manifest is not listed (nor by distribution).
        store.put(&layout::layer_link(&RepoName::parse("w").unwrap(), &d), bytes::Bytes::new()).await.unwrap();
        let c = Catalog::new(store.clone());
        assert_eq!(c.build_if_missing().await.unwrap(), Some(3));
        assert_eq!(names(&c.page(None, 10, &Readable::All).await.unwrap()), ["x", "x/y", "z"]);
        assert_eq!(Catalog::new(store).build_if_missing().await.unwrap(), None, "indexed once");
    }
}
