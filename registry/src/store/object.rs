//! [`ObjectStoreBackend`]: a [`BlobStore`] over any `object_store::ObjectStore`
//! (S3 and compatibles, in production; the in-memory store in tests).
//!
//! Objects live under a key prefix (`s3://BUCKET/PREFIX`). Writes are single PUTs for
//! small objects and multipart uploads for staged files; S3 makes either visible only
//! once complete, which gives the same all-or-nothing guarantee as [`super::FsStore`].
//! Nothing is kept in the server between requests, so replicas can share a bucket.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as OsPath;
use object_store::{GetOptions, GetRange, ObjectStore, PutPayload, WriteMultipart};
use tokio::io::AsyncReadExt;

use super::{check_key, BlobStore, ByteStream, ObjectMeta, Result, StoreError};

/// Files up to this size go up in one PUT; bigger ones as multipart uploads.
const SINGLE_PUT_MAX: u64 = 16 * 1024 * 1024;
/// Multipart part size (S3 needs >= 5 MiB for all but the last part).
const PART_SIZE: usize = 16 * 1024 * 1024;
/// Parts in flight at once per upload.
const PARTS_IN_FLIGHT: usize = 4;

/// A blob store over an `object_store` backend.
#[derive(Debug, Clone)]
pub struct ObjectStoreBackend {
    inner: Arc<dyn ObjectStore>,
    prefix: String,
    staging: PathBuf,
}

fn map_err(key: &str, e: object_store::Error) -> StoreError {
    match e {
        object_store::Error::NotFound { .. } => StoreError::NotFound(key.to_owned()),
        object_store::Error::AlreadyExists { .. } => StoreError::AlreadyExists(key.to_owned()),
        object_store::Error::Precondition { source, .. } => StoreError::Precondition { key: key.to_owned(), reason: source.to_string() },
        other => StoreError::Backend(format!("{key}: {other}")),
    }
}

impl ObjectStoreBackend {
    /// Wrap an `object_store`, keeping objects under `prefix` and staging local files in
    /// `staging` (created if needed).
    pub fn new(inner: Arc<dyn ObjectStore>, prefix: &str, staging: &Path) -> Result<ObjectStoreBackend> {
        std::fs::create_dir_all(staging).map_err(|e| StoreError::io(staging.display().to_string(), e))?;
        let prefix = prefix.trim_matches('/');
        if !prefix.is_empty() {
            check_key(prefix)?;
        }
        Ok(ObjectStoreBackend { inner, prefix: prefix.to_owned(), staging: staging.to_path_buf() })
    }

    /// An S3 store configured from `AWS_*` environment variables.
    pub fn s3_from_env(bucket: &str, prefix: &str, staging: &Path) -> Result<ObjectStoreBackend> {
        if bucket.is_empty() {
            return Err(StoreError::Backend("s3:// URL has no bucket".into()));
        }
        let s3 = object_store::aws::AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .build()
            .map_err(|e| StoreError::Backend(format!("configuring S3 bucket {bucket}: {e}")))?;
        ObjectStoreBackend::new(Arc::new(s3), prefix, staging)
    }

    /// An S3 store configured from `AWS_*` environment variables, then `overrides`
    /// (`object_store` S3 config keys such as `aws_endpoint`, `aws_access_key_id`,
    /// `aws_allow_http`): for tests and embedders that must not touch the environment.
    pub fn s3_with(bucket: &str, prefix: &str, staging: &Path, overrides: &[(&str, &str)]) -> Result<ObjectStoreBackend> {
        let mut b = object_store::aws::AmazonS3Builder::from_env().with_bucket_name(bucket);
        for (k, v) in overrides {
            let key: object_store::aws::AmazonS3ConfigKey = k.parse().map_err(|e| StoreError::Backend(format!("S3 option {k}: {e}")))?;
            b = b.with_config(key, *v);
        }
        let s3 = b.build().map_err(|e| StoreError::Backend(format!("configuring S3 bucket {bucket}: {e}")))?;
        ObjectStoreBackend::new(Arc::new(s3), prefix, staging)
    }

    fn path(&self, key: &str) -> Result<OsPath> {
        check_key(key)?;
        let full = if self.prefix.is_empty() { key.to_owned() } else { format!("{}/{key}", self.prefix) };
        OsPath::parse(&full).map_err(|_| StoreError::InvalidKey(key.to_owned()))
    }

    fn key_of(&self, p: &OsPath) -> String {
        let s = p.as_ref();
        if self.prefix.is_empty() {
            s.to_owned()
        } else {
            s.strip_prefix(&self.prefix).map(|r| r.trim_start_matches('/')).unwrap_or(s).to_owned()
        }
    }

    fn meta(&self, m: &object_store::ObjectMeta) -> ObjectMeta {
        let ts = m.last_modified.timestamp();
        let modified =
            if ts >= 0 { SystemTime::UNIX_EPOCH + Duration::new(ts as u64, m.last_modified.timestamp_subsec_nanos()) } else { SystemTime::UNIX_EPOCH };
        ObjectMeta { key: self.key_of(&m.location), size: m.size, modified }
    }
}

#[async_trait::async_trait]
impl BlobStore for ObjectStoreBackend {
    async fn head(&self, key: &str) -> Result<ObjectMeta> {
        let p = self.path(key)?;
        let m = self.inner.head(&p).await.map_err(|e| map_err(key, e))?;
        Ok(self.meta(&m))
    }

    async fn get(&self, key: &str, range: Option<Range<u64>>) -> Result<(ObjectMeta, ByteStream)> {
        let p = self.path(key)?;
        if let Some(r) = &range {
            if r.start == r.end {
                // object_store refuses empty ranges; an empty read needs no request.
                let m = self.head(key).await?;
                return Ok((m, futures::stream::empty().boxed()));
            }
        }
        let opts = GetOptions { range: range.map(GetRange::Bounded), ..Default::default() };
        let r = self.inner.get_opts(&p, opts).await.map_err(|e| map_err(key, e))?;
        let meta = self.meta(&r.meta);
        let k = key.to_owned();
        let s = r.into_stream().map_err(move |e| map_err(&k, e));
        Ok((meta, s.boxed()))
    }

    async fn put(&self, key: &str, data: Bytes) -> Result<()> {
        let p = self.path(key)?;
        self.inner.put(&p, PutPayload::from(data)).await.map_err(|e| map_err(key, e))?;
        Ok(())
    }

    async fn put_file(&self, key: &str, file: &Path) -> Result<()> {
        let p = self.path(key)?;
        let local = |e| StoreError::io(file.display().to_string(), e);
        let mut f = tokio::fs::File::open(file).await.map_err(local)?;
        let size = f.metadata().await.map_err(local)?.len();
        if size <= SINGLE_PUT_MAX {
            let mut buf = Vec::with_capacity(size as usize);
            f.read_to_end(&mut buf).await.map_err(local)?;
            self.inner.put(&p, PutPayload::from(buf)).await.map_err(|e| map_err(key, e))?;
        } else {
            let upload = self.inner.put_multipart(&p).await.map_err(|e| map_err(key, e))?;
            let mut w = WriteMultipart::new_with_chunk_size(upload, PART_SIZE);
            let mut buf = vec![0u8; 1024 * 1024];
            let res: Result<()> = async {
                loop {
                    let n = f.read(&mut buf).await.map_err(local)?;
                    if n == 0 {
                        break;
                    }
                    w.wait_for_capacity(PARTS_IN_FLIGHT).await.map_err(|e| map_err(key, e))?;
                    w.write(&buf[..n]);
                }
                Ok(())
            }
            .await;
            match res {
                Ok(()) => {
                    w.finish().await.map_err(|e| map_err(key, e))?;
                }
                Err(e) => {
                    let _ = w.abort().await;
                    return Err(e);
                }
            }
        }
        let _ = tokio::fs::remove_file(file).await;
        Ok(())
    }

    async fn copy(&self, from: &str, to: &str) -> Result<()> {
        let (a, b) = (self.path(from)?, self.path(to)?);
        self.inner.copy(&a, &b).await.map_err(|e| map_err(from, e))
    }

    async fn delete(&self, key: &str) -> Result<()> {
        let p = self.path(key)?;
        match self.inner.delete(&p).await {
            Ok(()) => Ok(()),
            Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(map_err(key, e)),
        }
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        let p = self.path(prefix.trim_end_matches('/'))?;
        let metas: Vec<object_store::ObjectMeta> = self.inner.list(Some(&p)).try_collect().await.map_err(|e| map_err(prefix, e))?;
        Ok(metas.iter().map(|m| self.meta(m)).collect())
    }

    async fn list_after(&self, prefix: &str, after: Option<&str>, limit: usize) -> Result<Vec<ObjectMeta>> {
        let p = self.path(prefix.trim_end_matches('/'))?;
        // S3 starts the listing after `offset` (ListObjectsV2 `start-after`): a page costs
        // one request however many keys sort before it.
        let stream = match after {
            Some(a) => self.inner.list_with_offset(Some(&p), &self.path(a)?),
            None => self.inner.list(Some(&p)),
        };
        let metas: Vec<object_store::ObjectMeta> = stream.take(limit).try_collect().await.map_err(|e| map_err(prefix, e))?;
        let mut out: Vec<ObjectMeta> = metas.iter().map(|m| self.meta(m)).collect();
        // S3 lists in key order already; other object stores need not.
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    fn staging_dir(&self) -> &Path {
        &self.staging
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn in_memory_object_store_conformance() {
        let dir = tempfile::tempdir().unwrap();
        let store = ObjectStoreBackend::new(Arc::new(object_store::memory::InMemory::new()), "some/prefix", dir.path()).unwrap();
        super::super::conformance::all(&store).await;
    }
}
