//! Upload sessions, persisted in the store so they survive a restart (or land on
//! another replica) and can be resumed.
//!
//! A session is `_uploads/<id>/state.json` plus its committed bytes, kept one of two
//! ways, chosen by the store:
//! - Object stores: committed chunks `_uploads/<id>/parts/<offset>`. Each PATCH streams
//!   its body into a staging file (hashing as it goes, off the reactor), then commits it
//!   as one part with an atomic `put_file`; the parts are joined into the blob at the
//!   end.
//! - The local fs store: one file `_uploads/<id>/data` that each PATCH appends to in
//!   place (then `fdatasync`), and `_uploads/<id>/committed`, the committed size,
//!   replaced atomically after the bytes are durable. The finished file is renamed into
//!   the blob, so every byte is written to disk once (joining parts wrote it twice: that
//!   was the largest cost of a 2 GiB push in 16 MiB pieces).
//!
//! Either way a crash mid-chunk loses only that chunk, and the session's offset is the
//! committed size. The running SHA-256 state is cached in memory per session; after a
//! restart (or on another replica) it is recomputed from the committed bytes. A blob
//! becomes visible (`blobs/...`) only after its digest was checked.
//!
//! Sessions idle for the upload TTL are removed whole (state, bytes, directories) by the
//! server's periodic sweep ([`Uploads::expire`]) and by gc ([`idle_sessions`],
//! [`remove_session`]): a client that opens sessions and walks away costs disk only for
//! that long.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::http::{header, StatusCode};
use bytes::Bytes;
use futures::{Stream, StreamExt, TryStreamExt};
use imgfmt::{OciDigest, OciHasher};

use crate::error::{ApiError, Code};
use crate::layout;
use crate::metrics::Metrics;
use crate::name::RepoName;
use crate::store::{BlobStore, StoreError};

/// Default idle time after which an upload session is removed: long enough for a client
/// to come back after a network failure or a crash and resume, short enough that an
/// abandoned upload does not hold its bytes for a day (`snapctl push` deletes a session it
/// gives up on, when no rerun could take it over; a killed one cannot).
pub const DEFAULT_UPLOAD_TTL: Duration = Duration::from_secs(15 * 60);

/// What `state.json` holds.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct UploadState {
    /// Repository the upload belongs to.
    pub repo: String,
    /// Unix seconds when the session started.
    pub started: u64,
}

/// The cached hash of a session's first `offset` bytes.
#[derive(Debug, Clone)]
struct HashAt {
    offset: u64,
    hasher: OciHasher,
}

/// Upload sessions over a store.
#[derive(Debug)]
pub struct Uploads {
    store: Arc<dyn BlobStore>,
    /// Per-session lock + cached hash state. Entries are dropped when a session ends.
    sessions: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Option<HashAt>>>>>,
    /// Sessions this process started that have not ended (as far as it knows: one that
    /// another replica or `snapctl gc` ended is found by [`Uploads::expire`]). Its size
    /// is the `uploads_in_progress` gauge.
    mine: Mutex<HashSet<String>>,
    metrics: Arc<Metrics>,
}

/// Sessions whose newest object is `ttl` old or older (ids, sorted). Objects of a
/// session without state (a crash between removing the state and the rest) count too.
pub async fn idle_sessions(store: &dyn BlobStore, ttl: Duration) -> Result<Vec<String>, StoreError> {
    let now = SystemTime::now();
    let mut newest: BTreeMap<String, SystemTime> = BTreeMap::new();
    for m in store.list(layout::UPLOADS).await? {
        if let Some(id) = m.key.strip_prefix(layout::UPLOADS).and_then(|r| r.split('/').next()) {
            let t = newest.entry(id.to_owned()).or_insert(UNIX_EPOCH);
            *t = (*t).max(m.modified);
        }
    }
    Ok(newest.into_iter().filter(|(_, t)| now.duration_since(*t).unwrap_or_default() >= ttl).map(|(id, _)| id).collect())
}

/// Remove session `id` whole: its state first (once that is gone the session is gone,
/// whatever else remains), then everything under `_uploads/<id>/`, directories included.
pub async fn remove_session(store: &dyn BlobStore, id: &str) -> Result<(), StoreError> {
    store.delete(&layout::upload_state(id)).await?;
    store.delete_prefix(&format!("{}{id}/", layout::UPLOADS)).await
}

/// Whether `id` looks like one of our session ids (32 lowercase hex).
pub fn valid_id(id: &str) -> bool {
    id.len() == 32 && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn io_err(e: std::io::Error) -> ApiError {
    ApiError::internal(format!("staging file: {e}"))
}

/// Where a streamed request body goes.
#[derive(Debug, Clone)]
enum Sink {
    /// A new file; removed again if the body fails.
    New(PathBuf),
    /// The file (created if missing) from byte `at` on, made durable (`fdatasync`) once
    /// the body is complete. Anything past `at` is the torn tail of an earlier append
    /// that failed, and is cut first; on failure the file is cut back to `at`.
    AppendAt(PathBuf, u64),
}

/// Stream `body` into a new file at `dest`, feeding `hasher` (if any) on a blocking
/// thread. At most `limit` bytes are accepted. Returns bytes written and the hasher.
/// On error the file is removed.
pub async fn stream_to_file<S, E>(body: S, dest: &Path, hasher: Option<OciHasher>, limit: Option<u64>) -> Result<(u64, Option<OciHasher>), ApiError>
where
    S: Stream<Item = Result<Bytes, E>> + Send,
    E: std::fmt::Display,
{
    stream_into(body, Sink::New(dest.to_path_buf()), hasher, limit).await
}

async fn stream_into<S, E>(body: S, sink: Sink, mut hasher: Option<OciHasher>, limit: Option<u64>) -> Result<(u64, Option<OciHasher>), ApiError>
where
    S: Stream<Item = Result<Bytes, E>> + Send,
    E: std::fmt::Display,
{
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(8);
    let target = sink.clone();
    let writer = tokio::task::spawn_blocking(move || -> std::io::Result<(u64, Option<OciHasher>)> {
        use std::io::{Seek, Write};
        let (f, base) = match &target {
            Sink::New(path) => (std::fs::File::create(path)?, 0),
            Sink::AppendAt(path, at) => {
                let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(false).open(path)?;
                f.set_len(*at)?;
                f.seek(std::io::SeekFrom::Start(*at))?;
                (f, *at)
            }
        };
        let mut w = std::io::BufWriter::with_capacity(1024 * 1024, f);
        let mut n = 0u64;
        let mut kicked = 0u64;
        while let Some(chunk) = rx.blocking_recv() {
            if let Some(h) = hasher.as_mut() {
                h.update(&chunk);
            }
            w.write_all(&chunk)?;
            n += chunk.len() as u64;
            if n - kicked >= WRITEBACK_EVERY {
                w.flush()?;
                imgfmt::file::start_writeback(w.get_ref(), base + kicked, n - kicked);
                kicked = n;
            }
        }
        w.flush()?;
        if matches!(target, Sink::AppendAt(..)) && n > 0 {
            // The caller records these bytes as committed next: they must be on disk
            // first, so a crash can lose a commit but never commit lost bytes.
            w.get_ref().sync_data()?;
        }
        Ok((n, hasher))
    });
    let mut body = std::pin::pin!(body);
    let mut seen = 0u64;
    let mut failure = None;
    while let Some(chunk) = body.next().await {
        match chunk {
            Ok(c) => {
                seen += c.len() as u64;
                if limit.is_some_and(|l| seen > l) {
                    failure = Some(ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, Code::SizeInvalid, "body too large"));
                    break;
                }
                if tx.send(c).await.is_err() {
                    break; // writer failed; its error is reported below
                }
            }
            Err(e) => {
                failure = Some(ApiError::bad(Code::BlobUploadInvalid, format!("reading request body: {e}")));
                break;
            }
        }
    }
    drop(tx);
    let res = writer.await.map_err(|e| ApiError::internal(format!("writer task: {e}")))?;
    let res = match (failure, res) {
        (Some(f), _) => Err(f),
        (None, Err(e)) => Err(io_err(e)),
        (None, Ok(v)) => Ok(v),
    };
    if res.is_err() {
        match sink {
            Sink::New(path) => {
                let _ = tokio::fs::remove_file(path).await;
            }
            Sink::AppendAt(path, at) => {
                // Best effort: the next append cuts the tail anyway.
                let _ = tokio::task::spawn_blocking(move || std::fs::OpenOptions::new().write(true).open(path).and_then(|f| f.set_len(at))).await;
            }
        }
    }
    res
}

/// Start write-back of a staged file every this many bytes, so that the fsync before
/// commit finds little left to write and dirty pages do not pile up for a 2 GiB blob.
const WRITEBACK_EVERY: u64 = 4 * 1024 * 1024;

/// A fresh staging path in the store's staging dir.
pub fn staging_path(store: &dyn BlobStore, what: &str) -> PathBuf {
    let n: u64 = rand::random();
    store.staging_dir().join(format!("{what}-{n:016x}"))
}

impl Uploads {
    /// Sessions over `store`; the sessions this process starts are counted in
    /// `metrics.uploads_in_progress`.
    pub fn new(store: Arc<dyn BlobStore>, metrics: Arc<Metrics>) -> Uploads {
        Uploads { store, sessions: Mutex::new(HashMap::new()), mine: Mutex::new(HashSet::new()), metrics }
    }

    /// Change the set of sessions this process started, and the gauge with it.
    fn mine(&self, f: impl FnOnce(&mut HashSet<String>)) {
        let mut m = self.mine.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut m);
        self.metrics.uploads_in_progress.store(m.len() as i64, Relaxed);
    }

    /// Remove the sessions idle for `ttl` or longer, whole; a session with a request in
    /// this process is not idle. Sessions this process started that have ended elsewhere
    /// (another replica, `snapctl gc`) leave the gauge. Returns how many were removed.
    pub async fn expire(&self, ttl: Duration) -> Result<usize, StoreError> {
        let mut removed = 0;
        for id in idle_sessions(self.store.as_ref(), ttl).await? {
            let lock = self.lock_of(&id);
            // Held by a PATCH or PUT streaming a body (on an object store its bytes are
            // not in the store yet, so the session looks idle): not idle.
            let Ok(_busy) = lock.try_lock() else { continue };
            tracing::info!(%id, ?ttl, "removing idle upload session");
            remove_session(self.store.as_ref(), &id).await?;
            self.forget(&id);
            removed += 1;
        }
        let mine: Vec<String> = self.mine.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned().collect();
        for id in mine {
            match self.store.head(&layout::upload_state(&id)).await {
                Err(e) if e.is_not_found() => self.mine(|m| {
                    m.remove(&id);
                }),
                Err(e) => return Err(e),
                Ok(_) => {}
            }
        }
        Ok(removed)
    }

    fn lock_of(&self, id: &str) -> Arc<tokio::sync::Mutex<Option<HashAt>>> {
        let mut m = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(id.to_owned()).or_default().clone()
    }

    fn forget(&self, id: &str) {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner()).remove(id);
        self.mine(|m| {
            m.remove(id);
        });
    }

    /// Start a session for `repo`; returns its id.
    pub async fn start(&self, repo: &RepoName) -> Result<String, ApiError> {
        let id = format!("{:032x}", rand::random::<u128>());
        let st = UploadState { repo: repo.to_string(), started: unix_now() };
        let body = serde_json::to_vec(&st).expect("state serializes");
        self.store.put(&layout::upload_state(&id), body.into()).await?;
        self.mine(|m| {
            m.insert(id.clone());
        });
        Ok(id)
    }

    async fn check(&self, repo: &RepoName, id: &str) -> Result<(), ApiError> {
        let unknown = || ApiError::not_found(Code::BlobUploadUnknown, format!("upload {id} unknown"));
        if !valid_id(id) {
            return Err(unknown());
        }
        let raw = match self.store.get_bytes(&layout::upload_state(id)).await {
            Ok(b) => b,
            Err(e) if e.is_not_found() => return Err(unknown()),
            Err(e) => return Err(e.into()),
        };
        let st: UploadState = serde_json::from_slice(&raw).map_err(|e| ApiError::internal(format!("upload {id}: bad state: {e}")))?;
        if st.repo != repo.as_str() {
            return Err(unknown());
        }
        Ok(())
    }

    /// The local file that session `id`'s bytes are appended to, when the store keeps
    /// objects as local files (see [`BlobStore::local_file`]).
    fn local_data(&self, id: &str) -> Option<PathBuf> {
        self.store.local_file(&layout::upload_data(id))
    }

    /// Committed parts in order as (offset, size, key); stops at the first gap. On a
    /// local store the one part is the data file's committed prefix (the file may run
    /// past it: a failed append's tail, cut by the next append).
    async fn parts(&self, id: &str) -> Result<Vec<(u64, u64, String)>, ApiError> {
        if self.local_data(id).is_some() {
            let committed = match self.store.get_bytes(&layout::upload_committed(id)).await {
                // Empty or torn after a crash (it is not fsynced, see `append`): start over
                // from 0, which is always safe.
                Ok(b) => std::str::from_utf8(&b).ok().and_then(|t| t.trim().parse::<u64>().ok()).unwrap_or_else(|| {
                    tracing::warn!(%id, "upload's committed size unreadable: restarting it from 0");
                    0
                }),
                Err(e) if e.is_not_found() => 0,
                Err(e) => return Err(e.into()),
            };
            return Ok(if committed == 0 { Vec::new() } else { vec![(0, committed, layout::upload_data(id))] });
        }
        let mut v: Vec<(u64, u64, String)> = self
            .store
            .list(&layout::upload_parts(id))
            .await?
            .into_iter()
            .filter_map(|m| {
                let off: u64 = m.key.rsplit('/').next()?.parse().ok()?;
                Some((off, m.size, m.key))
            })
            .collect();
        v.sort();
        let mut end = 0;
        let mut out = Vec::new();
        for p in v {
            if p.0 != end {
                break;
            }
            end += p.1;
            out.push(p);
        }
        Ok(out)
    }

    fn end_of(parts: &[(u64, u64, String)]) -> u64 {
        parts.last().map(|p| p.0 + p.1).unwrap_or(0)
    }

    /// Bytes committed so far in session `id` of `repo`.
    pub async fn status(&self, repo: &RepoName, id: &str) -> Result<u64, ApiError> {
        self.check(repo, id).await?;
        Ok(Self::end_of(&self.parts(id).await?))
    }

    /// Hash of the committed parts, recomputed by reading them back into `h` (fresh).
    async fn rehash(&self, parts: &[(u64, u64, String)], mut h: OciHasher) -> Result<OciHasher, ApiError> {
        for (_, size, key) in parts {
            let (_, mut s) = self.store.get(key, Some(0..*size)).await?;
            while let Some(c) = s.try_next().await? {
                // Chunks are at most a few hundred KiB: hashing them inline is short.
                h.update(&c);
            }
        }
        Ok(h)
    }

    /// Append `body` to session `id`. `start` is the first byte's offset from
    /// `Content-Range`, if the client sent one: it must equal the committed size (else
    /// 416). Returns the new size.
    pub async fn append<S, E>(&self, repo: &RepoName, id: &str, start: Option<u64>, body: S) -> Result<u64, ApiError>
    where
        S: Stream<Item = Result<Bytes, E>> + Send,
        E: std::fmt::Display,
    {
        let lock = self.lock_of(id);
        let mut cached = lock.lock().await;
        // Under the lock: the idle sweep removes a session only while holding it.
        self.check(repo, id).await?;
        let parts = self.parts(id).await?;
        let offset = Self::end_of(&parts);
        if let Some(s) = start {
            if s != offset {
                return Err(ApiError::new(
                    StatusCode::RANGE_NOT_SATISFIABLE,
                    Code::BlobUploadInvalid,
                    format!("chunk starts at {s}, upload has {offset} bytes"),
                )
                .with_header(header::RANGE, range_header(offset))
                .with_header(header::LOCATION, upload_location(repo, id)));
            }
        }
        let hasher = match cached.take() {
            Some(h) if h.offset == offset => h.hasher,
            // The running hash is sha256 (the usual digest); `finish` rehashes for sha512.
            _ => self.rehash(&parts, OciHasher::sha256()).await?,
        };
        if let Some(data) = self.local_data(id) {
            let res = stream_into(body, Sink::AppendAt(data, offset), Some(hasher.clone()), None).await;
            let (n, new_hasher) = match res {
                Ok(v) => v,
                Err(e) => {
                    *cached = Some(HashAt { offset, hasher });
                    return Err(e);
                }
            };
            if n > 0 {
                // The commit record is what makes these bytes part of the upload. It is
                // replaced atomically but not fsynced: the bytes it counts are already
                // durable, so a crash can only lose the record (back to an earlier size,
                // or unreadable: 0), never make it claim bytes that are not there. That
                // saves two fsyncs per PATCH.
                let end = offset + n;
                let record = self.store.local_file(&layout::upload_committed(id)).expect("local store");
                let written = tokio::task::spawn_blocking(move || {
                    let mut tmp = record.clone().into_os_string();
                    tmp.push(".tmp");
                    std::fs::write(&tmp, end.to_string()).and_then(|()| std::fs::rename(&tmp, &record))
                })
                .await
                .map_err(|e| ApiError::internal(format!("writer task: {e}")))
                .and_then(|r| r.map_err(io_err));
                if let Err(e) = written {
                    *cached = Some(HashAt { offset, hasher });
                    return Err(e);
                }
                *cached = Some(HashAt { offset: end, hasher: new_hasher.expect("hasher returned") });
            } else {
                *cached = Some(HashAt { offset, hasher });
            }
            return Ok(offset + n);
        }
        let tmp = staging_path(self.store.as_ref(), "part");
        let res = stream_to_file(body, &tmp, Some(hasher.clone()), None).await;
        let (n, new_hasher) = match res {
            Ok(v) => v,
            Err(e) => {
                *cached = Some(HashAt { offset, hasher });
                return Err(e);
            }
        };
        if n == 0 {
            let _ = tokio::fs::remove_file(&tmp).await;
            *cached = Some(HashAt { offset, hasher });
            return Ok(offset);
        }
        if let Err(e) = self.store.put_file(&layout::upload_part(id, offset), &tmp).await {
            let _ = tokio::fs::remove_file(&tmp).await;
            *cached = Some(HashAt { offset, hasher });
            return Err(e.into());
        }
        *cached = Some(HashAt { offset: offset + n, hasher: new_hasher.expect("hasher returned") });
        Ok(offset + n)
    }

    /// Finish session `id`: append `body` (if non-empty), check the whole content against
    /// `digest`, make the blob visible and link it into `repo`. A wrong digest ends the
    /// session and is `DIGEST_INVALID`. Returns the blob's size when it was stored now
    /// (`None`: the store held those bytes already).
    pub async fn finish<S, E>(&self, repo: &RepoName, id: &str, digest: &OciDigest, body: S) -> Result<Option<u64>, ApiError>
    where
        S: Stream<Item = Result<Bytes, E>> + Send,
        E: std::fmt::Display,
    {
        self.append(repo, id, None, body).await?;
        let lock = self.lock_of(id);
        let mut cached = lock.lock().await;
        self.check(repo, id).await?;
        let parts = self.parts(id).await?;
        let total = Self::end_of(&parts);
        let hasher = match cached.take() {
            Some(h) if h.offset == total && h.hasher.algorithm() == digest.algorithm() => h.hasher,
            _ => self.rehash(&parts, OciHasher::for_digest(digest)).await?,
        };
        let got = hasher.finish();
        if &got != digest {
            drop(cached);
            self.cancel_unchecked(id).await?;
            return Err(ApiError::bad(Code::DigestInvalid, format!("content is {got}, not {digest}")));
        }
        let bkey = layout::blob(digest);
        // The registry may hold these bytes already, and then they are not stored again:
        // rely on them first, so a running gc keeps them or we see them gone and store
        // ours (crate::inuse).
        crate::inuse::rely_on(self.store.as_ref(), digest).await?;
        let exists = match self.store.head(&bkey).await {
            Ok(_) => true,
            Err(e) if e.is_not_found() => false,
            Err(e) => return Err(e.into()),
        };
        if !exists {
            match parts.as_slice() {
                [] => self.store.put(&bkey, Bytes::new()).await?,
                // One part (or a local store's data file, cut to the committed size by
                // the append above): the blob is those bytes, moved, not copied.
                [(_, _, key)] => self.store.rename(key, &bkey).await?,
                many => {
                    let tmp = staging_path(self.store.as_ref(), "concat");
                    let stores = self.store.clone();
                    let keys: Vec<String> = many.iter().map(|p| p.2.clone()).collect();
                    let s: crate::store::ByteStream = futures::stream::iter(keys)
                        .then(move |k| {
                            let st = stores.clone();
                            async move { st.get(&k, None).await.map(|(_, s)| s) }
                        })
                        .try_flatten()
                        .boxed();
                    stream_to_file(s, &tmp, None, None).await?;
                    self.store.put_file(&bkey, &tmp).await?;
                }
            }
        }
        self.store.put(&layout::layer_link(repo, digest), Bytes::new()).await?;
        drop(cached);
        self.cancel_unchecked(id).await?;
        Ok((!exists).then_some(total))
    }

    /// Cancel session `id` of `repo`.
    pub async fn cancel(&self, repo: &RepoName, id: &str) -> Result<(), ApiError> {
        self.check(repo, id).await?;
        self.cancel_unchecked(id).await
    }

    async fn cancel_unchecked(&self, id: &str) -> Result<(), ApiError> {
        remove_session(self.store.as_ref(), id).await?;
        self.forget(id);
        Ok(())
    }
}

/// `Range` header value for `size` committed bytes (`0-<size-1>`; `0-0` when empty, as
/// docker/distribution does).
pub fn range_header(size: u64) -> String {
    format!("0-{}", size.saturating_sub(1))
}

/// The upload URL of session `id`.
pub fn upload_location(repo: &RepoName, id: &str) -> String {
    format!("/v2/{repo}/blobs/uploads/{id}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{FsStore, ObjectStoreBackend};

    fn repo() -> RepoName {
        RepoName::parse("vm/mem").unwrap()
    }

    fn ok_body(data: &[u8]) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Send {
        futures::stream::iter(data.chunks(1000).map(|c| Ok(Bytes::copy_from_slice(c))).collect::<Vec<_>>())
    }

    /// `good` bytes, then the connection "drops".
    fn cut_body(good: &[u8]) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Send {
        let mut v: Vec<Result<Bytes, std::io::Error>> = vec![Ok(Bytes::copy_from_slice(good))];
        v.push(Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset")));
        futures::stream::iter(v)
    }

    /// Chunked appends, a PATCH cut mid-body, a restart (fresh `Uploads`, so the hash is
    /// recomputed from what is committed), then the rest: the blob is exactly the
    /// committed bytes, and the session leaves nothing behind.
    async fn resume_and_cut_tail(store: Arc<dyn BlobStore>) {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        let digest = OciDigest::of(&data);
        let up = Uploads::new(store.clone(), Default::default());
        let id = up.start(&repo()).await.unwrap();
        assert_eq!(up.append(&repo(), &id, Some(0), ok_body(&data[..100_000])).await.unwrap(), 100_000);
        assert_eq!(up.append(&repo(), &id, Some(100_000), ok_body(&data[100_000..150_000])).await.unwrap(), 150_000);
        // 40 000 bytes arrive, then the connection drops: none of them count, and the
        // garbage that follows them in this body must not leak into the blob either.
        let mut torn = data[150_000..190_000].to_vec();
        torn[39_999] ^= 0xff;
        assert!(up.append(&repo(), &id, Some(150_000), cut_body(&torn)).await.is_err());
        assert_eq!(up.status(&repo(), &id).await.unwrap(), 150_000);

        let up = Uploads::new(store.clone(), Default::default()); // a restart: no cached hash
        assert_eq!(up.status(&repo(), &id).await.unwrap(), 150_000);
        let e = up.append(&repo(), &id, Some(149_000), ok_body(&data[149_000..])).await.unwrap_err();
        assert_eq!(e.status, StatusCode::RANGE_NOT_SATISFIABLE);
        assert_eq!(up.append(&repo(), &id, Some(150_000), ok_body(&data[150_000..250_000])).await.unwrap(), 250_000);
        up.finish(&repo(), &id, &digest, ok_body(&data[250_000..])).await.unwrap();

        let blob = store.get_bytes(&layout::blob(&digest)).await.unwrap();
        assert!(blob[..] == data[..], "blob differs from the uploaded bytes");
        let left = store.list(&format!("{}{id}/", layout::UPLOADS)).await.unwrap();
        assert!(left.is_empty(), "session left {left:?}");
    }

    #[tokio::test]
    async fn regression_issue_4_fs_uploads_append_in_place_resume_and_cut_torn_tails() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn BlobStore> = Arc::new(FsStore::open(dir.path()).unwrap());
        assert!(store.local_file(&layout::upload_data("x")).is_some());
        resume_and_cut_tail(store).await;
    }

    #[tokio::test]
    async fn object_store_uploads_commit_parts_resume_and_drop_cut_ones() {
        let dir = tempfile::tempdir().unwrap();
        let mem = Arc::new(object_store::memory::InMemory::new());
        let store: Arc<dyn BlobStore> = Arc::new(ObjectStoreBackend::new(mem, "p", dir.path()).unwrap());
        assert!(store.local_file(&layout::upload_data("x")).is_none());
        resume_and_cut_tail(store).await;
    }

    /// On the fs store the parts are never separate files: each PATCH lands in the one
    /// data file, whose inode becomes the blob's (written once, renamed, not copied).
    #[tokio::test]
    async fn fs_upload_data_file_becomes_the_blob() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn BlobStore> = Arc::new(FsStore::open(dir.path()).unwrap());
        let up = Uploads::new(store.clone(), Default::default());
        let id = up.start(&repo()).await.unwrap();
        let data = vec![7u8; 50_000];
        for i in 0..5 {
            up.append(&repo(), &id, None, ok_body(&data[i * 10_000..(i + 1) * 10_000])).await.unwrap();
        }
        let keys: Vec<String> = store.list(&format!("{}{id}/", layout::UPLOADS)).await.unwrap().into_iter().map(|m| m.key).collect();
        assert!(!keys.iter().any(|k| k.contains("/parts/")), "{keys:?}");
        let ino = std::fs::metadata(store.local_file(&layout::upload_data(&id)).unwrap()).unwrap().ino();
        let digest = OciDigest::of(&data);
        up.finish(&repo(), &id, &digest, ok_body(&[])).await.unwrap();
        let blob = store.local_file(&layout::blob(&digest)).unwrap();
        assert_eq!(std::fs::metadata(blob).unwrap().ino(), ino);
    }

    /// Issue 14: sessions never expired in the server, and expiry left a directory per
    /// session. Idle sessions go whole; a session with a request in flight stays; the
    /// gauge follows, also for sessions another process removed.
    async fn idle_sessions_expire_whole(store: Arc<dyn BlobStore>) {
        let m = Arc::new(Metrics::default());
        let gauge = || m.uploads_in_progress.load(Relaxed);
        let up = Uploads::new(store.clone(), m.clone());
        let a = up.start(&repo()).await.unwrap();
        up.append(&repo(), &a, None, ok_body(&[1u8; 5000])).await.unwrap();
        let b = up.start(&repo()).await.unwrap();
        let c = up.start(&repo()).await.unwrap();
        assert_eq!(gauge(), 3);
        assert_eq!(up.expire(Duration::from_secs(3600)).await.unwrap(), 0, "nothing is an hour old");
        let lock = up.lock_of(&b);
        let busy = lock.lock().await;
        assert_eq!(up.expire(Duration::ZERO).await.unwrap(), 2, "a and c are idle; b has a request in flight");
        assert_eq!(gauge(), 1);
        drop(busy);
        assert!(up.status(&repo(), &a).await.unwrap_err().code == Code::BlobUploadUnknown);
        assert!(up.status(&repo(), &c).await.is_err());
        // Another process (gc, a replica) removes b: the gauge learns it at the next sweep.
        remove_session(store.as_ref(), &b).await.unwrap();
        assert_eq!(up.expire(Duration::from_secs(3600)).await.unwrap(), 0);
        assert_eq!(gauge(), 0);
        assert!(store.list(layout::UPLOADS).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn regression_issue_14_fs_idle_sessions_expire_whole() {
        let dir = tempfile::tempdir().unwrap();
        idle_sessions_expire_whole(Arc::new(FsStore::open(dir.path()).unwrap())).await;
        let left: Vec<_> = std::fs::read_dir(dir.path().join("_uploads")).unwrap().flatten().map(|e| e.path()).collect();
        assert!(left.is_empty(), "directories left: {left:?}");
    }

    #[tokio::test]
    async fn regression_issue_14_object_store_idle_sessions_expire_whole() {
        let dir = tempfile::tempdir().unwrap();
        let mem = Arc::new(object_store::memory::InMemory::new());
        idle_sessions_expire_whole(Arc::new(ObjectStoreBackend::new(mem, "p", dir.path()).unwrap())).await;
    }
}
