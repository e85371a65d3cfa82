//! Blob stores: the one place the registry touches bytes at rest.
//!
//! The registry speaks to storage only through [`BlobStore`], a small key/value
//! interface shaped after `object_store`: whole-object atomic writes, ranged streaming
//! reads, listing by prefix, copy/rename, delete. Keys are `/`-separated relative paths
//! built by [`crate::layout`] from validated names and digests only.
//!
//! Two backends, one [`conformance`] suite:
//! - [`FsStore`]: a directory on local disk (temp file + fsync + rename + fsync dir).
//! - [`ObjectStoreBackend`]: any `object_store` (S3 and compatibles), for replicas that
//!   share one bucket.

use std::ops::Range;
use std::path::Path;
use std::time::SystemTime;

use bytes::Bytes;
use futures::stream::BoxStream;

pub mod conformance;
mod fs;
mod metered;
mod object;

pub use fs::FsStore;
pub use metered::MeteredStore;
pub use object::ObjectStoreBackend;

/// A stream of bytes read from a store.
pub type ByteStream = BoxStream<'static, Result<Bytes, StoreError>>;

/// What a store knows about one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectMeta {
    /// The key, relative to the store's root.
    pub key: String,
    /// Size in bytes.
    pub size: u64,
    /// When the object was last written.
    pub modified: SystemTime,
}

/// Errors a caller can act on. Everything else is `Io` or `Backend` with a message.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum StoreError {
    /// object {0:?} not found
    NotFound(String),
    /// object {0:?} already exists
    AlreadyExists(String),
    /// precondition failed for {key:?}: {reason}
    Precondition {
        /// The key.
        key: String,
        /// What did not hold.
        reason: String,
    },
    /// invalid storage key {0:?}
    InvalidKey(String),
    /// I/O error on {key:?}: {source}
    Io {
        /// The key or local path involved.
        key: String,
        /// The error.
        source: std::io::Error,
    },
    /// storage backend error: {0}
    Backend(String),
}

impl StoreError {
    pub(crate) fn io(key: impl Into<String>, source: std::io::Error) -> StoreError {
        let key = key.into();
        if source.kind() == std::io::ErrorKind::NotFound {
            StoreError::NotFound(key)
        } else {
            StoreError::Io { key, source }
        }
    }

    /// Whether this is `NotFound`.
    pub fn is_not_found(&self) -> bool {
        matches!(self, StoreError::NotFound(_))
    }
}

/// Result alias for store operations.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// An async key/value store for blobs, manifests, links and upload parts.
///
/// Every write is all-or-nothing: a reader sees the previous object, or the whole new
/// one, never a prefix. Implementations keep blocking I/O off the async reactor.
#[async_trait::async_trait]
pub trait BlobStore: Send + Sync + std::fmt::Debug + 'static {
    /// Size and modification time of `key`, or `NotFound`.
    async fn head(&self, key: &str) -> Result<ObjectMeta>;

    /// Stream `key`, or the byte `range` of it (which must lie inside the object;
    /// callers check against `head` first). Returns the object's metadata too.
    async fn get(&self, key: &str, range: Option<Range<u64>>) -> Result<(ObjectMeta, ByteStream)>;

    /// Read a small object whole.
    async fn get_bytes(&self, key: &str) -> Result<Bytes> {
        use futures::TryStreamExt;
        let (_, s) = self.get(key, None).await?;
        let parts: Vec<Bytes> = s.try_collect().await?;
        Ok(parts.concat().into())
    }

    /// Write a small object atomically, replacing any previous one.
    async fn put(&self, key: &str, data: Bytes) -> Result<()>;

    /// Move the complete local file `file` into `key` atomically. The file must live in
    /// [`BlobStore::staging_dir`]; the store may rename it (it is gone afterwards) or
    /// upload and delete it.
    async fn put_file(&self, key: &str, file: &Path) -> Result<()>;

    /// Copy `from` to `to` (replacing `to`).
    async fn copy(&self, from: &str, to: &str) -> Result<()>;

    /// Move `from` to `to` (replacing `to`); atomic where the backend allows.
    async fn rename(&self, from: &str, to: &str) -> Result<()> {
        self.copy(from, to).await?;
        self.delete(from).await
    }

    /// Delete `key`. Deleting a missing key is not an error.
    async fn delete(&self, key: &str) -> Result<()>;

    /// Delete every object under `prefix` (a directory: ends with `/`) and, on a store
    /// with real directories, the directories too, so nothing of it is left behind.
    /// Deleting a missing prefix is not an error.
    async fn delete_prefix(&self, prefix: &str) -> Result<()> {
        for m in self.list(prefix).await? {
            self.delete(&m.key).await?;
        }
        Ok(())
    }

    /// Create `key` as an empty marker object, or refresh its modification time if it
    /// exists. For markers only: their content does not matter (an object store rewrites
    /// it empty) and the refresh need not survive a crash (the fs store does not fsync).
    async fn touch(&self, key: &str) -> Result<()> {
        self.put(key, Bytes::new()).await
    }

    /// Every object whose key starts with `prefix`, which names a directory (ends with `/`),
    /// at any depth, in no particular order.
    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>>;

    /// At most `limit` objects under `prefix` (a directory: ends with `/`) whose keys sort
    /// after `after` (a key under `prefix`, or `None` for the start), in byte order of their
    /// keys. A listing can go on where the previous page ended, so a walk over a huge
    /// directory holds one page at a time; a key written during the walk appears in it if
    /// it sorts after the current position, and no key appears twice.
    ///
    /// The default lists everything and sorts it; a backend that can start a listing at a
    /// key (S3 `start-after`) overrides it.
    async fn list_after(&self, prefix: &str, after: Option<&str>, limit: usize) -> Result<Vec<ObjectMeta>> {
        let mut all = self.list(prefix).await?;
        all.retain(|m| after.is_none_or(|a| m.key.as_str() > a));
        all.sort_by(|a, b| a.key.cmp(&b.key));
        all.truncate(limit);
        Ok(all)
    }

    /// A local directory for staging files that [`BlobStore::put_file`] will accept.
    fn staging_dir(&self) -> &Path;

    /// The local file that holds `key`, when this store keeps objects as plain files on
    /// a local file system (the fs store). Upload sessions then append PATCH bodies to
    /// one file in place, so a blob uploaded in many pieces is written to disk once,
    /// rather than once as parts and again when the parts are joined. `None` (the
    /// default, object stores): parts are objects of their own.
    fn local_file(&self, _key: &str) -> Option<std::path::PathBuf> {
        None
    }
}

/// Check a storage key: relative, `/`-separated, no empty, `.` or `..` components, no
/// backslashes or NULs. Keys come from [`crate::layout`]; this is the last line of defence.
pub fn check_key(key: &str) -> Result<()> {
    let ok = !key.is_empty()
        && !key.starts_with('/')
        && !key.contains('\\')
        && !key.contains('\0')
        && key.split('/').all(|c| !c.is_empty() && c != "." && c != "..");
    if ok {
        Ok(())
    } else {
        Err(StoreError::InvalidKey(key.to_owned()))
    }
}

/// Open a store from a `--storage` argument: `s3://BUCKET[/PREFIX]` or a directory path.
///
/// S3 settings come from the environment (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`,
/// `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ALLOW_HTTP`, ...). `staging` is the local
/// directory for upload staging when the store is remote (default: the system temp dir).
pub fn open(spec: &str, staging: Option<&Path>) -> Result<std::sync::Arc<dyn BlobStore>> {
    if let Some(rest) = spec.strip_prefix("s3://") {
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let staging = staging.map(Path::to_path_buf).unwrap_or_else(|| std::env::temp_dir().join("snapctl-staging"));
        Ok(std::sync::Arc::new(ObjectStoreBackend::s3_from_env(bucket, prefix, &staging)?))
    } else if spec.contains("://") {
        Err(StoreError::Backend(format!("unsupported storage URL {spec:?} (use a directory or s3://BUCKET/PREFIX)")))
    } else {
        Ok(std::sync::Arc::new(FsStore::open(Path::new(spec))?))
    }
}
