//! [`MeteredStore`]: a [`BlobStore`] wrapper that records the latency of every call.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

use super::{BlobStore, ByteStream, ObjectMeta, Result};
use crate::metrics::Metrics;

/// Times each store operation into [`Metrics`] (`snapctl_storage_seconds{op=...}`).
#[derive(Debug, Clone)]
pub struct MeteredStore {
    inner: Arc<dyn BlobStore>,
    metrics: Arc<Metrics>,
}

impl MeteredStore {
    /// Wrap `inner`.
    pub fn new(inner: Arc<dyn BlobStore>, metrics: Arc<Metrics>) -> MeteredStore {
        MeteredStore { inner, metrics }
    }
}

macro_rules! timed {
    ($self:ident, $op:literal, $e:expr) => {{
        let t = Instant::now();
        let r = $e.await;
        $self.metrics.storage_op($op, t.elapsed(), r.is_err() && !matches!(r, Err(super::StoreError::NotFound(_))));
        r
    }};
}

#[async_trait::async_trait]
impl BlobStore for MeteredStore {
    async fn head(&self, key: &str) -> Result<ObjectMeta> {
        timed!(self, "head", self.inner.head(key))
    }
    async fn get(&self, key: &str, range: Option<Range<u64>>) -> Result<(ObjectMeta, ByteStream)> {
        timed!(self, "get", self.inner.get(key, range))
    }
    async fn get_bytes(&self, key: &str) -> Result<Bytes> {
        timed!(self, "get", self.inner.get_bytes(key))
    }
    async fn put(&self, key: &str, data: Bytes) -> Result<()> {
        timed!(self, "put", self.inner.put(key, data))
    }
    async fn put_file(&self, key: &str, file: &Path) -> Result<()> {
        timed!(self, "put_file", self.inner.put_file(key, file))
    }
    async fn copy(&self, from: &str, to: &str) -> Result<()> {
        timed!(self, "copy", self.inner.copy(from, to))
    }
    async fn rename(&self, from: &str, to: &str) -> Result<()> {
        timed!(self, "rename", self.inner.rename(from, to))
    }
    async fn delete(&self, key: &str) -> Result<()> {
        timed!(self, "delete", self.inner.delete(key))
    }
    async fn delete_prefix(&self, prefix: &str) -> Result<()> {
        timed!(self, "delete", self.inner.delete_prefix(prefix))
    }
    async fn touch(&self, key: &str) -> Result<()> {
        timed!(self, "put", self.inner.touch(key))
    }
    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        timed!(self, "list", self.inner.list(prefix))
    }
    async fn list_after(&self, prefix: &str, after: Option<&str>, limit: usize) -> Result<Vec<ObjectMeta>> {
        timed!(self, "list", self.inner.list_after(prefix, after, limit))
    }
    fn staging_dir(&self) -> &Path {
        self.inner.staging_dir()
    }
    fn local_file(&self, key: &str) -> Option<std::path::PathBuf> {
        self.inner.local_file(key)
    }
}
