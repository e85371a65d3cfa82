//! Blobs and their uploads: `GET`/`HEAD`/`DELETE` of a blob (ranges served, the bytes
//! left to gc), and the upload flow: a session started by `POST` (or a cross-repository
//! mount, or the whole blob in one `POST`), chunks by `PATCH`, closed by `PUT` with the
//! digest, cancelled by `DELETE`.

use std::sync::atomic::Ordering::Relaxed;

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderName, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use imgfmt::{OciDigest, OciHasher};

use super::wire::{content_length, count_bytes, empty, exists, param, parse_content_range, parse_digest, parse_range, respond};
use super::Server;
use crate::auth::{Action, Identity};
use crate::error::{ApiError, Code};
use crate::inuse;
use crate::layout;
use crate::name::RepoName;
use crate::upload::{self, range_header, upload_location};

impl Server {
    pub(super) async fn get_blob(&self, repo: &RepoName, d: &str, headers: &HeaderMap, head: bool) -> Result<Response, ApiError> {
        let d = parse_digest(d)?;
        let unknown = || ApiError::not_found(Code::BlobUnknown, format!("blob {d} unknown to {repo}"));
        let linked = exists(self.store.as_ref(), &layout::layer_link(repo, &d)).await? || exists(self.store.as_ref(), &layout::manifest_link(repo, &d)).await?;
        if !linked {
            return Err(unknown());
        }
        let key = layout::blob(&d);
        let meta = match self.store.head(&key).await {
            Ok(m) => m,
            Err(e) if e.is_not_found() => return Err(unknown()),
            Err(e) => return Err(e.into()),
        };
        if head {
            // A HEAD that finds a blob lets a pushing client skip uploading it: rely on
            // it, so a running gc keeps it, and answer by what is there after that.
            inuse::rely_on(self.store.as_ref(), &d).await?;
            if !exists(self.store.as_ref(), &key).await? {
                return Err(unknown());
            }
        }
        let range = parse_range(headers.get(header::RANGE), meta.size)?;
        let mut hs = vec![
            (header::CONTENT_TYPE, "application/octet-stream".to_owned()),
            (HeaderName::from_static("docker-content-digest"), d.to_string()),
            (header::ACCEPT_RANGES, "bytes".to_owned()),
            (header::ETAG, format!("\"{d}\"")),
        ];
        let status = match &range {
            Some(r) => {
                hs.push((header::CONTENT_RANGE, format!("bytes {}-{}/{}", r.start, r.end - 1, meta.size)));
                StatusCode::PARTIAL_CONTENT
            }
            None => StatusCode::OK,
        };
        let len = range.as_ref().map(|r| r.end - r.start).unwrap_or(meta.size);
        hs.push((header::CONTENT_LENGTH, len.to_string()));
        if head {
            return Ok(respond(status, &hs, Body::empty()));
        }
        let (_, stream) = match self.store.get(&key, range).await {
            Ok(s) => s,
            Err(e) if e.is_not_found() => return Err(unknown()),
            Err(e) => return Err(e.into()),
        };
        let stream = count_bytes(stream, self.metrics.clone(), false);
        Ok(respond(status, &hs, Body::from_stream(stream)))
    }

    pub(super) async fn delete_blob(&self, repo: &RepoName, d: &str) -> Result<Response, ApiError> {
        let d = parse_digest(d)?;
        let link = layout::layer_link(repo, &d);
        if !exists(self.store.as_ref(), &link).await? {
            return Err(ApiError::not_found(Code::BlobUnknown, format!("blob {d} unknown to {repo}")));
        }
        // Only the repository's link goes; the bytes are shared and left to gc.
        self.store.delete(&link).await?;
        Ok(empty(StatusCode::ACCEPTED, &[]))
    }

    pub(super) async fn start_upload(
        &self,
        repo: &RepoName,
        q: &[(String, String)],
        id: &Identity,
        body: impl futures::Stream<Item = Result<Bytes, axum::Error>> + Send,
    ) -> Result<Response, ApiError> {
        if let Some(m) = param(q, "mount") {
            let d = parse_digest(m)?;
            if self.try_mount(repo, &d, param(q, "from"), id).await? {
                return Ok(blob_created(repo, &d));
            }
            // Not mountable (unknown, or no read access to the source): fall through to a
            // fresh upload session, as the spec allows.
        } else if let Some(ds) = param(q, "digest") {
            // Monolithic upload in one POST.
            let d = parse_digest(ds)?;
            self.put_whole_blob(repo, &d, body).await?;
            self.metrics.uploads_completed.fetch_add(1, Relaxed);
            return Ok(blob_created(repo, &d));
        }
        let uid = self.uploads.start(repo).await?;
        self.metrics.uploads_started.fetch_add(1, Relaxed);
        let mut hs = upload_headers(repo, &uid, 0);
        hs.push((HeaderName::from_static("oci-chunk-min-length"), self.cfg.chunk_min_length.to_string()));
        Ok(empty(StatusCode::ACCEPTED, &hs))
    }

    /// Cross-repository mount; `false` when the blob cannot (or may not) be mounted.
    async fn try_mount(&self, repo: &RepoName, d: &OciDigest, from: Option<&str>, id: &Identity) -> Result<bool, ApiError> {
        let blob_there = exists(self.store.as_ref(), &layout::blob(d)).await?;
        if !blob_there {
            return Ok(false);
        }
        match from {
            Some(f) => {
                let Ok(from) = RepoName::parse(f) else { return Ok(false) };
                if !self.may(id, &from, Action::Pull) {
                    tracing::info!(%repo, %from, "mount refused: no pull access to source");
                    return Ok(false);
                }
                if !exists(self.store.as_ref(), &layout::layer_link(&from, d)).await? {
                    return Ok(false);
                }
            }
            None => {
                // Without `from` only an open registry mounts: with auth, knowing a digest
                // must not be enough to obtain a blob from a repository one cannot read.
                if self.cfg.auth.is_some() {
                    return Ok(false);
                }
            }
        }
        inuse::rely_on(self.store.as_ref(), d).await?;
        if !exists(self.store.as_ref(), &layout::blob(d)).await? {
            return Ok(false); // a gc took it meanwhile: the client uploads it instead
        }
        self.store.put(&layout::layer_link(repo, d), Bytes::new()).await?;
        Ok(true)
    }

    async fn put_whole_blob(
        &self,
        repo: &RepoName,
        d: &OciDigest,
        body: impl futures::Stream<Item = Result<Bytes, axum::Error>> + Send,
    ) -> Result<(), ApiError> {
        let tmp = upload::staging_path(self.store.as_ref(), "mono");
        let (n, h) = upload::stream_to_file(body, &tmp, Some(OciHasher::for_digest(d)), None).await?;
        let got = h.expect("hasher").finish();
        if &got != d {
            let _ = tokio::fs::remove_file(&tmp).await;
            self.metrics.uploads_cancelled.fetch_add(1, Relaxed);
            return Err(ApiError::bad(Code::DigestInvalid, format!("content is {got}, not {d}")));
        }
        let key = layout::blob(d);
        // Bytes the registry already holds are not stored again; rely on those, so a
        // running gc keeps them (or they are stored again if it took them).
        if let Err(e) = inuse::rely_on(self.store.as_ref(), d).await {
            let _ = tokio::fs::remove_file(&tmp).await;
            return Err(e.into());
        }
        if exists(self.store.as_ref(), &key).await? {
            let _ = tokio::fs::remove_file(&tmp).await;
        } else if let Err(e) = self.store.put_file(&key, &tmp).await {
            let _ = tokio::fs::remove_file(&tmp).await;
            return Err(e.into());
        } else {
            self.stats.note(crate::stats::Change::Stored { bytes: n });
        }
        self.store.put(&layout::layer_link(repo, d), Bytes::new()).await?;
        Ok(())
    }

    /// `GET` of an upload session: the bytes it holds so far.
    pub(super) async fn upload_status(&self, repo: &RepoName, uid: &str) -> Result<Response, ApiError> {
        let n = self.uploads.status(repo, uid).await?;
        Ok(empty(StatusCode::NO_CONTENT, &upload_headers(repo, uid, n)))
    }

    /// `PATCH`: a chunk appended at its `Content-Range` offset (else at the end), no shorter
    /// than the announced `OCI-Chunk-Min-Length`.
    pub(super) async fn patch_upload(
        &self,
        repo: &RepoName,
        uid: &str,
        headers: &HeaderMap,
        body: impl futures::Stream<Item = Result<Bytes, axum::Error>> + Send,
    ) -> Result<Response, ApiError> {
        let cr = parse_content_range(headers.get(header::CONTENT_RANGE))?;
        let min = self.cfg.chunk_min_length;
        if let Some(cl) = content_length(headers).filter(|&cl| min > 0 && cl < min) {
            return Err(ApiError::bad(
                Code::BlobUploadInvalid,
                format!("PATCH of {cl} bytes is below OCI-Chunk-Min-Length {min} (only the last piece, sent with the PUT, may be shorter)"),
            ));
        }
        if let (Some((_, len)), Some(cl)) = (cr, content_length(headers)) {
            if len != cl {
                return Err(ApiError::bad(Code::BlobUploadInvalid, "Content-Range and Content-Length disagree"));
            }
        }
        let n = self.uploads.append(repo, uid, cr.map(|c| c.0), body).await?;
        Ok(empty(StatusCode::ACCEPTED, &upload_headers(repo, uid, n)))
    }

    /// `PUT ?digest=`: the last piece appended and the session closed as blob `digest`.
    pub(super) async fn finish_upload(
        &self,
        repo: &RepoName,
        uid: &str,
        q: &[(String, String)],
        body: impl futures::Stream<Item = Result<Bytes, axum::Error>> + Send,
    ) -> Result<Response, ApiError> {
        let d = parse_digest(param(q, "digest").unwrap_or(""))?;
        match self.uploads.finish(repo, uid, &d, body).await {
            Ok(stored) => {
                self.metrics.uploads_completed.fetch_add(1, Relaxed);
                if let Some(bytes) = stored {
                    self.stats.note(crate::stats::Change::Stored { bytes });
                }
            }
            Err(e) => {
                if e.code == Code::DigestInvalid {
                    self.metrics.uploads_cancelled.fetch_add(1, Relaxed);
                }
                return Err(e);
            }
        }
        Ok(blob_created(repo, &d))
    }

    /// `DELETE` of an upload session: it and its parts removed.
    pub(super) async fn cancel_upload(&self, repo: &RepoName, uid: &str) -> Result<Response, ApiError> {
        self.uploads.cancel(repo, uid).await?;
        self.metrics.uploads_cancelled.fetch_add(1, Relaxed);
        Ok(empty(StatusCode::NO_CONTENT, &[]))
    }
}

fn upload_headers(repo: &RepoName, uid: &str, size: u64) -> Vec<(HeaderName, String)> {
    vec![(header::LOCATION, upload_location(repo, uid)), (header::RANGE, range_header(size)), (HeaderName::from_static("docker-upload-uuid"), uid.to_owned())]
}

fn blob_created(repo: &RepoName, d: &OciDigest) -> Response {
    empty(StatusCode::CREATED, &[(header::LOCATION, format!("/v2/{repo}/blobs/{d}")), (HeaderName::from_static("docker-content-digest"), d.to_string())])
}
