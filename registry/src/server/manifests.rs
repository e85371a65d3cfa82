//! Manifests: a reference (tag or digest) resolved, a manifest served (with a restore's
//! lease taken, renewed or released, and its pull recorded), checked and stored under a
//! lease on what it references (with its referrers-index entry and its tag), and deleted
//! with the tags that point at it.

use std::sync::atomic::Ordering::Relaxed;

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderName, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use futures::StreamExt;
use imgfmt::{OciDigest, OciHasher};

use super::wire::{accepts, content_length, empty, exists, parse_digest, respond};
use super::{manifest_refs, ManifestRefs, Server, MAX_REFERRER_ANNOTATIONS};
use crate::error::{ApiError, Code};
use crate::inuse;
use crate::layout;
use crate::name::{RepoName, Tag};

impl Server {
    /// Resolve a manifest reference to (digest, media type); `MANIFEST_UNKNOWN` if absent.
    async fn resolve(&self, repo: &RepoName, reference: &str) -> Result<(OciDigest, String), ApiError> {
        let unknown = || ApiError::not_found(Code::ManifestUnknown, format!("manifest {reference} unknown to {repo}"));
        let d = if reference.contains(':') {
            parse_digest(reference)?
        } else {
            let t = Tag::parse(reference).map_err(|e| ApiError::bad(Code::ManifestInvalid, e.to_string()))?;
            match self.store.get_bytes(&layout::tag(repo, &t)).await {
                Ok(b) => std::str::from_utf8(&b)
                    .ok()
                    .and_then(|s| s.trim().parse().ok())
                    .ok_or_else(|| ApiError::internal(format!("tag {t} of {repo} is corrupt")))?,
                Err(e) if e.is_not_found() => return Err(unknown()),
                Err(e) => return Err(e.into()),
            }
        };
        let mt = match self.store.get_bytes(&layout::manifest_link(repo, &d)).await {
            Ok(b) => String::from_utf8_lossy(&b).trim().to_owned(),
            Err(e) if e.is_not_found() => return Err(unknown()),
            Err(e) => return Err(e.into()),
        };
        Ok((d, mt))
    }

    pub(super) async fn get_manifest(&self, repo: &RepoName, reference: &str, headers: &HeaderMap, head: bool) -> Result<Response, ApiError> {
        // A restore's lease: by digest only (on a tag the header is ignored).
        let ask = match headers.get(crate::restore_lease::HEADER).filter(|_| reference.contains(':')) {
            Some(v) => Some(crate::restore_lease::parse(v.as_bytes()).map_err(|e| ApiError::bad(Code::Unsupported, e))?),
            None => None,
        };
        let (d, mt) = self.resolve(repo, reference).await?;
        if !accepts(headers, &mt) {
            return Err(ApiError::not_found(Code::ManifestUnknown, format!("manifest {reference} is {mt}, which the Accept header does not allow")));
        }
        let bytes = match self.store.get_bytes(&layout::blob(&d)).await {
            Ok(b) => b,
            Err(e) if e.is_not_found() => return Err(ApiError::not_found(Code::ManifestUnknown, format!("manifest {d} content missing"))),
            Err(e) => return Err(e.into()),
        };
        let mut hs = vec![
            (header::CONTENT_TYPE, mt),
            (HeaderName::from_static("docker-content-digest"), d.to_string()),
            (header::CONTENT_LENGTH, bytes.len().to_string()),
            (header::ETAG, format!("\"{d}\"")),
        ];
        if let Some(ask) = ask {
            if let Some(granted) = self.restore_lease(repo, &d, ask).await? {
                hs.push((HeaderName::from_static(crate::restore_lease::HEADER), granted.to_string()));
            }
        }
        let restoring = crate::restore_lease::is_restore(headers.get(crate::restore_lease::PURPOSE_HEADER).map(|v| v.as_bytes()));
        if (!head && restoring) || matches!(ask, Some(crate::restore_lease::Ask::Hold(_))) {
            // In memory; written in batches (crate::pulls). A lease is a restore: a pull.
            self.pulls.record(repo, &d);
        }
        if !head {
            self.metrics.bytes_out.fetch_add(bytes.len() as u64, Relaxed);
        }
        Ok(respond(StatusCode::OK, &hs, if head { Body::empty() } else { Body::from(bytes) }))
    }

    /// Take, renew or release a restore's lease on manifest `d` (crate::restore_lease);
    /// the seconds granted when the lease was recorded (`Some(0)`: released).
    async fn restore_lease(&self, repo: &RepoName, d: &OciDigest, ask: crate::restore_lease::Ask) -> Result<Option<u64>, ApiError> {
        let seconds = match ask {
            crate::restore_lease::Ask::Release => {
                crate::restore_lease::release(self.store.as_ref(), repo, d).await?;
                return Ok(Some(0));
            }
            crate::restore_lease::Ask::Hold(s) => s.min(self.cfg.max_lease.as_secs()),
        };
        if seconds == 0 {
            return Ok(None); // max_lease = 0: this server grants no lease
        }
        // Rely on the manifest like a push relies on a blob: a gc that listed the store
        // before this lease was written sees the use and keeps the manifest (crate::inuse);
        // one deleting it now finishes first, and the manifest is answered as missing.
        inuse::rely_on(self.store.as_ref(), d).await?;
        if !exists(self.store.as_ref(), &layout::manifest_link(repo, d)).await? || !exists(self.store.as_ref(), &layout::blob(d)).await? {
            return Err(ApiError::not_found(Code::ManifestUnknown, format!("manifest {d} unknown to {repo}")));
        }
        let keep_expired = self.cfg.gc.as_ref().map(|g| g.options.delay()).unwrap_or_else(|| crate::gc::GcOptions::default().delay());
        let recorded = crate::restore_lease::hold(self.store.as_ref(), repo, d, seconds, keep_expired).await?;
        Ok(recorded.then_some(seconds))
    }

    pub(super) async fn put_manifest(
        &self,
        repo: &RepoName,
        reference: &str,
        headers: &HeaderMap,
        body: impl futures::Stream<Item = Result<Bytes, axum::Error>> + Send,
    ) -> Result<Response, ApiError> {
        let limit = self.cfg.max_manifest_bytes;
        let too_big = || ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, Code::SizeInvalid, format!("manifest larger than {limit} bytes"));
        if content_length(headers).is_some_and(|n| n > limit as u64) {
            return Err(too_big());
        }
        let mut buf = Vec::new();
        let mut body = std::pin::pin!(body);
        while let Some(c) = body.next().await {
            let c = c.map_err(|e| ApiError::bad(Code::ManifestInvalid, format!("reading body: {e}")))?;
            if buf.len() + c.len() > limit {
                return Err(too_big());
            }
            buf.extend_from_slice(&c);
        }
        let tag = if reference.contains(':') { None } else { Some(Tag::parse(reference).map_err(|e| ApiError::bad(Code::ManifestInvalid, e.to_string()))?) };
        let d = match &tag {
            None => {
                let want = parse_digest(reference)?;
                let got = OciHasher::for_digest(&want).finish_with(&buf);
                if got != want {
                    return Err(ApiError::bad(Code::DigestInvalid, format!("manifest is {got}, not {want}")));
                }
                got
            }
            Some(_) => OciDigest::of(&buf),
        };
        let json: serde_json::Value = serde_json::from_slice(&buf).map_err(|e| ApiError::bad(Code::ManifestInvalid, format!("manifest is not JSON: {e}")))?;
        let ct = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).map(|s| s.split(';').next().unwrap_or(s).trim().to_owned());
        let field = json.get("mediaType").and_then(|v| v.as_str()).map(str::to_owned);
        let mt = match (ct, field) {
            (Some(c), Some(f)) if c != f => return Err(ApiError::bad(Code::ManifestInvalid, format!("Content-Type {c} but mediaType {f}"))),
            (Some(c), _) => c,
            (None, Some(f)) => f,
            (None, None) => return Err(ApiError::bad(Code::ManifestInvalid, "no Content-Type and no mediaType")),
        };
        let refs = manifest_refs(&json)?;
        // Lease what this manifest relies on (its children and its own bytes) before
        // checking it: a gc whose listing misses this manifest then keeps them, or we
        // see them gone (crate::inuse).
        let mut relied: Vec<OciDigest> = refs.children.iter().map(|(c, _)| c.clone()).collect();
        relied.push(d.clone());
        let lease = inuse::lease_tagged(self.store.as_ref(), relied, tag.as_ref().map(|t| (repo, t))).await?;
        let done = self.commit_manifest(repo, &d, tag.as_ref(), mt, buf, &json, &refs, &lease).await;
        let released = match done {
            Ok(_) => lease.release_committed(self.store.as_ref()).await,
            Err(_) => lease.release(self.store.as_ref()).await,
        };
        if let Err(e) = released {
            // The lease stays and keeps protecting until it is stale; nothing is lost.
            tracing::warn!(%e, %d, "could not release a manifest lease");
        }
        done
    }

    /// The part of a manifest PUT under its lease: check what it references, then write it.
    #[allow(clippy::too_many_arguments)]
    async fn commit_manifest(
        &self,
        repo: &RepoName,
        d: &OciDigest,
        tag: Option<&Tag>,
        mt: String,
        buf: Vec<u8>,
        json: &serde_json::Value,
        refs: &ManifestRefs,
        lease: &inuse::Lease,
    ) -> Result<Response, ApiError> {
        for (child, is_manifest) in &refs.children {
            inuse::settled(self.store.as_ref(), child).await?;
            let key = if *is_manifest { layout::manifest_link(repo, child) } else { layout::layer_link(repo, child) };
            // The bytes too, not only the link: gc may have swept an old unreferenced
            // blob that a client skipped uploading because HEAD said it existed.
            if !exists(self.store.as_ref(), &key).await? || !exists(self.store.as_ref(), &layout::blob(child)).await? {
                return Err(ApiError::bad(Code::ManifestBlobUnknown, format!("{child} is not in {repo}")));
            }
        }
        // Our own bytes may be an old unreferenced copy a gc is deleting: let it finish first.
        inuse::settled(self.store.as_ref(), d).await?;
        lease.check_fresh()?;
        let (d, size) = (d.clone(), buf.len());
        // Whether the bytes and the link are new, for the store totals (crate::stats).
        let (stored, linked) = (exists(self.store.as_ref(), &layout::blob(&d)).await?, exists(self.store.as_ref(), &layout::manifest_link(repo, &d)).await?);
        let logical = self.stats.logical_of(&d, &buf);
        self.store.put(&layout::blob(&d), Bytes::from(buf)).await?;
        if !stored {
            self.stats.note(crate::stats::Change::Stored { bytes: size as u64 });
        }
        // Listed before its first manifest is: a repository with a manifest is in the catalog.
        if self.catalog.record(repo).await? {
            self.stats.note(crate::stats::Change::NewRepository);
        }
        self.store.put(&layout::manifest_link(repo, &d), Bytes::from(mt.clone())).await?;
        if !linked {
            self.stats.note(crate::stats::Change::Linked { logical });
        }
        let mut hs = vec![(header::LOCATION, format!("/v2/{repo}/manifests/{d}")), (HeaderName::from_static("docker-content-digest"), d.to_string())];
        if let Some(subject) = &refs.subject {
            let mut desc = serde_json::json!({ "mediaType": mt, "digest": d.to_string(), "size": size });
            let at = json.get("artifactType").and_then(|v| v.as_str()).or_else(|| json.pointer("/config/mediaType").and_then(|v| v.as_str()));
            if let Some(at) = at {
                desc["artifactType"] = at.into();
            }
            if let Some(a) = json.get("annotations").filter(|a| a.is_object()) {
                let size = serde_json::to_vec(a).map_or(usize::MAX, |v| v.len());
                if size > MAX_REFERRER_ANNOTATIONS {
                    return Err(ApiError::bad(
                        Code::ManifestInvalid,
                        format!("a manifest with a subject may carry at most {MAX_REFERRER_ANNOTATIONS} bytes of annotations into the referrers index, this one has {size}"),
                    ));
                }
                desc["annotations"] = a.clone();
            }
            let raw = serde_json::to_vec(&desc).expect("descriptor serializes");
            self.store.put(&layout::referrer(repo, subject, &d), raw.into()).await?;
            hs.push((HeaderName::from_static("oci-subject"), subject.to_string()));
        }
        if let Some(t) = tag {
            // A gc deciding about this tag (retention) finishes first; it saw our lease, or
            // we write the tag after it deleted the old one (crate::inuse).
            inuse::settled_tag(self.store.as_ref(), repo, t).await?;
            lease.check_fresh()?;
            self.store.put(&layout::tag(repo, t), Bytes::from(d.to_string())).await?;
        }
        Ok(empty(StatusCode::CREATED, &hs))
    }

    pub(super) async fn delete_manifest(&self, repo: &RepoName, reference: &str) -> Result<Response, ApiError> {
        if !reference.contains(':') {
            let t = Tag::parse(reference).map_err(|e| ApiError::bad(Code::ManifestInvalid, e.to_string()))?;
            let key = layout::tag(repo, &t);
            if !exists(self.store.as_ref(), &key).await? {
                return Err(ApiError::not_found(Code::ManifestUnknown, format!("tag {t} unknown to {repo}")));
            }
            self.store.delete(&key).await?;
            return Ok(empty(StatusCode::ACCEPTED, &[]));
        }
        let (d, _) = self.resolve(repo, reference).await?;
        if let Ok(b) = self.store.get_bytes(&layout::blob(&d)).await {
            if let Ok(json) = serde_json::from_slice::<serde_json::Value>(&b) {
                if let Ok(Some(subject)) = manifest_refs(&json).map(|r| r.subject) {
                    self.store.delete(&layout::referrer(repo, &subject, &d)).await?;
                }
            }
        }
        // Tags pointing at the manifest go with it, as in docker/distribution.
        for m in self.store.list(&layout::tags_dir(repo)).await? {
            if let Ok(b) = self.store.get_bytes(&m.key).await {
                if b.as_ref() == d.to_string().as_bytes() {
                    self.store.delete(&m.key).await?;
                }
            }
        }
        let logical = self.stats.logical(&d).await.unwrap_or(0);
        self.store.delete(&layout::manifest_link(repo, &d)).await?;
        self.stats.note(crate::stats::Change::Unlinked { logical });
        Ok(empty(StatusCode::ACCEPTED, &[]))
    }
}
