//! [`FsStore`]: objects as files under a root directory.
//!
//! Durability: every write goes to `ROOT/_tmp/`, is `fsync`ed, renamed into place, and
//! the destination directory is `fsync`ed. A crash at any moment leaves either the old
//! object or the complete new one; leftovers in `_tmp/` are removed on open.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use bytes::Bytes;
use futures::StreamExt;

use super::{check_key, BlobStore, ByteStream, ObjectMeta, Result, StoreError};

/// Directory (under the root) for staged and in-flight temp files.
const TMP_DIR: &str = "_tmp";
/// Objects stream out in mapped pieces of this size (see `get`).
const MAP_PIECE: u64 = 4 << 20;

/// A blob store on a local directory.
#[derive(Debug, Clone)]
pub struct FsStore {
    root: PathBuf,
    tmp: PathBuf,
}

impl FsStore {
    /// Open (creating if needed) a store at `root`, clearing stale temp files.
    pub fn open(root: &Path) -> Result<FsStore> {
        let tmp = root.join(TMP_DIR);
        if tmp.exists() {
            // Temp files belong to writes that never committed (crash or kill -9).
            std::fs::remove_dir_all(&tmp).map_err(|e| StoreError::io(tmp.display().to_string(), e))?;
        }
        std::fs::create_dir_all(&tmp).map_err(|e| StoreError::io(tmp.display().to_string(), e))?;
        let root = root.canonicalize().map_err(|e| StoreError::io(root.display().to_string(), e))?;
        Ok(FsStore { tmp: root.join(TMP_DIR), root })
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn path(&self, key: &str) -> Result<PathBuf> {
        check_key(key)?;
        if key == TMP_DIR || key.starts_with("_tmp/") {
            return Err(StoreError::InvalidKey(key.to_owned()));
        }
        Ok(self.root.join(key))
    }

    fn temp_path(&self) -> PathBuf {
        let n: u64 = rand::random();
        self.tmp.join(format!("w-{n:016x}"))
    }
}

fn meta_of(key: &str, m: &std::fs::Metadata) -> ObjectMeta {
    ObjectMeta { key: key.to_owned(), size: m.len(), modified: m.modified().unwrap_or(SystemTime::UNIX_EPOCH) }
}

/// rename `from` -> `to`, creating `to`'s parent and fsyncing it (blocking).
fn commit_rename(from: &Path, to: &Path) -> std::io::Result<()> {
    let parent = to.parent().expect("object paths have a parent");
    std::fs::create_dir_all(parent)?;
    std::fs::rename(from, to)?;
    std::fs::File::open(parent)?.sync_all()
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f).await.map_err(|e| StoreError::Backend(format!("blocking task failed: {e}")))?
}

#[async_trait::async_trait]
impl BlobStore for FsStore {
    async fn head(&self, key: &str) -> Result<ObjectMeta> {
        let p = self.path(key)?;
        let m = tokio::fs::metadata(&p).await.map_err(|e| StoreError::io(key, e))?;
        if !m.is_file() {
            return Err(StoreError::NotFound(key.to_owned()));
        }
        Ok(meta_of(key, &m))
    }

    async fn get(&self, key: &str, range: Option<Range<u64>>) -> Result<(ObjectMeta, ByteStream)> {
        let p = self.path(key)?;
        let k = key.to_owned();
        let (file, m) = blocking(move || {
            let f = std::fs::File::open(&p).map_err(|e| StoreError::io(k.clone(), e))?;
            let m = f.metadata().map_err(|e| StoreError::io(k, e))?;
            Ok((f, m))
        })
        .await?;
        if !m.is_file() {
            return Err(StoreError::NotFound(key.to_owned()));
        }
        let meta = meta_of(key, &m);
        let range = range.unwrap_or(0..meta.size);
        if range.start > range.end || range.end > meta.size {
            return Err(StoreError::Precondition { key: key.to_owned(), reason: format!("range {range:?} outside size {}", meta.size) });
        }
        // The whole range starts coming in from disk at once, in the background, instead
        // of a piece at a time as each is mapped (a registry's blobs are often cold by the
        // time a sandbox wakes).
        imgfmt::file::will_need(&file, range.start, range.end - range.start);
        // The range goes out as mapped pieces of the file, each mapped (and its pages
        // faulted in) on the blocking pool, so a cold disk read never stalls the runtime.
        // The HTTP stack sends straight from the page cache: reading into a buffer first
        // cost a copy per byte served and a hand-off per 256 KiB (a tenth of a pull's CPU
        // on 2 cores: bench/results/BENCHMARKS-diary-2026-11-29-to-12-01.md, "What
        // changed"). Objects are never written in place (every write is a new file renamed
        // over the name), which is what mapping them needs.
        let file = std::sync::Arc::new(file);
        let owned = key.to_owned();
        let end = range.end;
        let s = futures::stream::unfold(range.start, move |pos| {
            let (file, key) = (file.clone(), owned.clone());
            async move {
                if pos >= end {
                    return None;
                }
                let n = (end - pos).min(MAP_PIECE);
                let piece = blocking(move || imgfmt::file::map_range(&file, pos, n as usize).map_err(|e| StoreError::io(key, e))).await;
                // After an error the stream ends.
                let next = if piece.is_ok() { pos + n } else { end };
                Some((piece, next))
            }
        });
        Ok((meta, s.boxed()))
    }

    async fn put(&self, key: &str, data: Bytes) -> Result<()> {
        let dst = self.path(key)?;
        let tmp = self.temp_path();
        let k = key.to_owned();
        blocking(move || {
            let r = (|| {
                use std::io::Write;
                let mut f = std::fs::File::create(&tmp)?;
                f.write_all(&data)?;
                f.sync_all()?;
                commit_rename(&tmp, &dst)
            })();
            if r.is_err() {
                let _ = std::fs::remove_file(&tmp);
            }
            r.map_err(|e| StoreError::io(k, e))
        })
        .await
    }

    async fn put_file(&self, key: &str, file: &Path) -> Result<()> {
        let dst = self.path(key)?;
        let src = file.to_path_buf();
        if src.parent() != Some(self.tmp.as_path()) {
            return Err(StoreError::Precondition { key: key.to_owned(), reason: format!("{} is not in the staging dir", src.display()) });
        }
        let k = key.to_owned();
        blocking(move || {
            let r = (|| {
                std::fs::OpenOptions::new().write(true).open(&src)?.sync_all()?;
                commit_rename(&src, &dst)
            })();
            r.map_err(|e| StoreError::io(k, e))
        })
        .await
    }

    async fn copy(&self, from: &str, to: &str) -> Result<()> {
        let src = self.path(from)?;
        let dst = self.path(to)?;
        let tmp = self.temp_path();
        let k = from.to_owned();
        blocking(move || {
            let r = (|| {
                std::fs::copy(&src, &tmp)?;
                std::fs::OpenOptions::new().write(true).open(&tmp)?.sync_all()?;
                commit_rename(&tmp, &dst)
            })();
            if r.is_err() {
                let _ = std::fs::remove_file(&tmp);
            }
            r.map_err(|e| StoreError::io(k, e))
        })
        .await
    }

    async fn rename(&self, from: &str, to: &str) -> Result<()> {
        let src = self.path(from)?;
        let dst = self.path(to)?;
        let k = from.to_owned();
        blocking(move || commit_rename(&src, &dst).map_err(|e| StoreError::io(k, e))).await
    }

    async fn delete(&self, key: &str) -> Result<()> {
        let p = self.path(key)?;
        match tokio::fs::remove_file(&p).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::io(key, e)),
        }
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<()> {
        let p = self.path(prefix.trim_end_matches('/'))?;
        let k = prefix.to_owned();
        blocking(move || match std::fs::remove_dir_all(&p) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::io(k, e)),
        })
        .await
    }

    async fn touch(&self, key: &str) -> Result<()> {
        let p = self.path(key)?;
        let k = key.to_owned();
        blocking(move || {
            let open = || std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&p);
            let f = match open() {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    std::fs::create_dir_all(p.parent().expect("object paths have a parent")).and_then(|()| open())
                }
                r => r,
            };
            // Visible to every other process at once; no fsync: a marker lost in a crash
            // only makes a later gc keep less, and that gc cannot run before the restart.
            f.and_then(|f| f.set_modified(SystemTime::now())).map_err(|e| StoreError::io(k, e))
        })
        .await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        let dir_key = prefix.trim_end_matches('/');
        let dir = self.path(dir_key)?;
        let dir_key = dir_key.to_owned();
        blocking(move || {
            let mut out = Vec::new();
            let mut stack = vec![(dir, dir_key)];
            while let Some((d, k)) = stack.pop() {
                let rd = match std::fs::read_dir(&d) {
                    Ok(rd) => rd,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(StoreError::io(k, e)),
                };
                for ent in rd {
                    let ent = ent.map_err(|e| StoreError::io(k.clone(), e))?;
                    let name = ent.file_name().to_string_lossy().into_owned();
                    let key = format!("{k}/{name}");
                    if key == TMP_DIR {
                        continue;
                    }
                    let m = match ent.metadata() {
                        Ok(m) => m,
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                        Err(e) => return Err(StoreError::io(key, e)),
                    };
                    if m.is_dir() {
                        stack.push((ent.path(), key));
                    } else if m.is_file() {
                        out.push(meta_of(&key, &m));
                    }
                }
            }
            Ok(out)
        })
        .await
    }

    async fn list_after(&self, prefix: &str, after: Option<&str>, limit: usize) -> Result<Vec<ObjectMeta>> {
        let dir_key = prefix.trim_end_matches('/').to_owned();
        let dir = self.path(&dir_key)?;
        let after = after.map(str::to_owned);
        blocking(move || {
            let mut out = Vec::new();
            list_sorted(&dir, &dir_key, after.as_deref(), limit, &mut out)?;
            Ok(out)
        })
        .await
    }

    fn staging_dir(&self) -> &Path {
        &self.tmp
    }

    fn local_file(&self, key: &str) -> Option<PathBuf> {
        self.path(key).ok()
    }
}

/// Walk directory `dir` (key `key`) in byte order of the keys beneath it, adding to `out`
/// the objects whose keys sort after `after`, until `out` holds `limit`.
///
/// Every key below a subdirectory `d` starts with `d/`, so those keys are contiguous in byte
/// order and sort where `d/` sorts among its siblings' keys: children are visited in order
/// of their name, with `/` appended to directories' names (`a-b` before `a/x`, as S3 lists
/// them). A subdirectory whose keys all sort before `after` is skipped unread. A directory
/// cannot be read from a given name, so each one visited is read whole, but only the
/// `limit` entries that come next are kept (a heap; no allocation or `stat` for the others):
/// a page of 10 from a directory of 10,000 costs one pass of `getdents`.
fn list_sorted(dir: &Path, key: &str, after: Option<&str>, limit: usize, out: &mut Vec<ObjectMeta>) -> Result<()> {
    // Where `after` falls among this directory's children, as a child sort name.
    let here = format!("{key}/");
    let mut floor: Option<String> = match after {
        Some(a) if a.starts_with(&here) => Some(a[here.len()..].to_owned()),
        Some(a) if a > here.as_str() => return Ok(()), // every key here sorts before `after`
        _ => None,
    };
    // The subdirectory `after` lies in is listed first, from `after`; then everything that
    // sorts after that subdirectory.
    if let Some((sub, _)) = floor.as_deref().and_then(|f| f.split_once('/')) {
        let sub = sub.to_owned();
        list_sorted(&dir.join(&sub), &format!("{key}/{sub}"), after, limit, out)?;
        floor = Some(format!("{sub}/"));
    }
    while out.len() < limit {
        let want = limit - out.len();
        // The `want` smallest children past the floor, by sort name (a directory's is its
        // name and '/'), in a max-heap: entries that do not make it cost no allocation.
        let mut best: std::collections::BinaryHeap<(String, bool)> = std::collections::BinaryHeap::new();
        let mut dropped = false;
        let rd = match std::fs::read_dir(dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound || e.kind() == std::io::ErrorKind::NotADirectory => return Ok(()),
            Err(e) => return Err(StoreError::io(key, e)),
        };
        for ent in rd {
            let ent = ent.map_err(|e| StoreError::io(key, e))?;
            let name = ent.file_name();
            let Some(name) = name.to_str() else { continue }; // not a key this store wrote
            let is_dir = match ent.file_type() {
                Ok(t) => t.is_dir(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(StoreError::io(key, e)),
            };
            if floor.as_deref().is_some_and(|f| sort_cmp(name, is_dir, f) != std::cmp::Ordering::Greater) {
                continue;
            }
            if best.len() == want && best.peek().is_some_and(|(top, _)| sort_cmp(name, is_dir, top) != std::cmp::Ordering::Less) {
                dropped = true;
                continue;
            }
            best.push((if is_dir { format!("{name}/") } else { name.to_owned() }, is_dir));
            if best.len() > want {
                best.pop();
                dropped = true;
            }
        }
        for (sort_name, is_dir) in best.into_sorted_vec() {
            if out.len() >= limit {
                return Ok(());
            }
            let name = sort_name.trim_end_matches('/');
            let child = format!("{key}/{name}");
            if is_dir {
                list_sorted(&dir.join(name), &child, after, limit, out)?;
            } else {
                match std::fs::metadata(dir.join(name)) {
                    Ok(m) if m.is_file() => out.push(meta_of(&child, &m)),
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(StoreError::io(child, e)),
                }
            }
            floor = Some(sort_name);
        }
        // Short only because a subdirectory held fewer keys than its place in the heap
        // (an empty one, say): read on from where this pass ended.
        if !dropped {
            break;
        }
    }
    Ok(())
}

/// Compare child `name` (with '/' appended when `is_dir`) with `other`, allocation-free.
fn sort_cmp(name: &str, is_dir: bool, other: &str) -> std::cmp::Ordering {
    let suffix: &[u8] = if is_dir { b"/" } else { b"" };
    name.as_bytes().iter().chain(suffix).cmp(other.as_bytes().iter())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn fs_store_conformance() {
        let dir = tempfile::tempdir().unwrap();
        let store = FsStore::open(dir.path()).unwrap();
        super::super::conformance::all(&store).await;
    }

    #[tokio::test]
    async fn open_clears_stale_temp_files_but_keeps_objects() {
        let dir = tempfile::tempdir().unwrap();
        let store = FsStore::open(dir.path()).unwrap();
        store.put("a/b", Bytes::from_static(b"kept")).await.unwrap();
        std::fs::write(store.staging_dir().join("w-partial"), b"half a blob").unwrap();
        let store = FsStore::open(dir.path()).unwrap();
        assert_eq!(std::fs::read_dir(store.staging_dir()).unwrap().count(), 0);
        assert_eq!(&store.get_bytes("a/b").await.unwrap()[..], b"kept");
    }

    /// Issue 14: removing an upload session left its directory behind, one per upload.
    #[tokio::test]
    async fn delete_prefix_leaves_no_directory() {
        let dir = tempfile::tempdir().unwrap();
        let store = FsStore::open(dir.path()).unwrap();
        store.put("_uploads/x/parts/0001", Bytes::from_static(b"1")).await.unwrap();
        store.put("_uploads/x/state.json", Bytes::from_static(b"{}")).await.unwrap();
        store.delete_prefix("_uploads/x/").await.unwrap();
        assert!(!dir.path().join("_uploads/x").exists());
        assert!(dir.path().join("_uploads").exists());
    }

    /// A touch refreshes the mtime of an old marker (and creates its directories).
    #[tokio::test]
    async fn touch_refreshes_an_old_marker() {
        let dir = tempfile::tempdir().unwrap();
        let store = FsStore::open(dir.path()).unwrap();
        store.touch("m/a/b").await.unwrap();
        let p = dir.path().join("m/a/b");
        let old = SystemTime::now() - std::time::Duration::from_secs(7200);
        std::fs::File::options().write(true).open(&p).unwrap().set_modified(old).unwrap();
        store.touch("m/a/b").await.unwrap();
        let m = store.head("m/a/b").await.unwrap();
        assert!(m.modified > old + std::time::Duration::from_secs(3600), "mtime not refreshed");
    }

    /// Deletes leave empty directories behind; a page walks past them.
    #[tokio::test]
    async fn list_after_walks_past_empty_directories() {
        let dir = tempfile::tempdir().unwrap();
        let store = FsStore::open(dir.path()).unwrap();
        for k in ["d/a/1", "d/b/1", "d/c/1", "d/e"] {
            store.put(k, Bytes::new()).await.unwrap();
        }
        for k in ["d/a/1", "d/b/1"] {
            store.delete(k).await.unwrap();
        }
        std::fs::create_dir_all(dir.path().join("d/bb/x/y")).unwrap();
        let keys = |v: Vec<ObjectMeta>| v.into_iter().map(|m| m.key).collect::<Vec<_>>();
        assert_eq!(keys(store.list_after("d/", None, 1).await.unwrap()), ["d/c/1"]);
        assert_eq!(keys(store.list_after("d/", Some("d/a/0"), 2).await.unwrap()), ["d/c/1", "d/e"]);
    }

    #[tokio::test]
    async fn refuses_escaping_keys() {
        let dir = tempfile::tempdir().unwrap();
        let store = FsStore::open(dir.path()).unwrap();
        for k in ["../x", "/etc/passwd", "a/../../b", "_tmp/x", "a//b", ""] {
            assert!(matches!(store.put(k, Bytes::new()).await, Err(StoreError::InvalidKey(_))), "{k:?}");
        }
    }
}
