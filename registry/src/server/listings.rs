//! The paged listings: `/v2/_catalog` (the repositories a caller may read), a
//! repository's tags, and a subject's referrers (filtered by artifact type), each with a
//! `Link` to its next page.

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderName, StatusCode, Uri};
use axum::response::Response;

use super::wire::{param, parse_digest, respond};
use super::{Server, MAX_REFERRER_ANNOTATIONS, OCI_INDEX, REFERRERS_PAGE};
use crate::auth::Identity;
use crate::error::{ApiError, Code};
use crate::layout;
use crate::name::RepoName;

/// Largest stored referrers-index descriptor served; a larger one (stored before the
/// annotation bound) is skipped.
const MAX_REFERRER_DESCRIPTOR: u64 = MAX_REFERRER_ANNOTATIONS as u64 + 4096;

impl Server {
    /// `GET /v2/_catalog?n=&last=`, as distribution answers it (see [`crate::catalog`]).
    pub(super) async fn catalog_page(&self, id: &Identity, uri: &Uri, headers: &HeaderMap, q: &[(String, String)], head: bool) -> Result<Response, ApiError> {
        let Some(readable) = self.readable(id) else {
            return Err(ApiError::new(StatusCode::UNAUTHORIZED, Code::Unauthorized, "authentication required")
                .with_header(header::WWW_AUTHENTICATE, self.challenge(uri, headers, Some("registry:catalog:*".into()), false)));
        };
        let n = crate::catalog::page_size(param(q, "n"), self.cfg.catalog_max_entries)?;
        let last = param(q, "last");
        let page = if n == 0 { crate::catalog::Page { repos: Vec::new(), more: false } } else { self.catalog.page(last, n, &readable).await? };
        let mut hs = vec![(header::CONTENT_TYPE, "application/json; charset=utf-8".to_owned())];
        if let (true, Some(end)) = (page.more, page.repos.last()) {
            let last: String = form_urlencoded::byte_serialize(end.as_str().as_bytes()).collect();
            hs.push((header::LINK, format!("</v2/_catalog?last={last}&n={n}>; rel=\"next\"")));
        }
        let names: Vec<&str> = page.repos.iter().map(|r| r.as_str()).collect();
        let body = serde_json::to_vec(&serde_json::json!({ "repositories": names })).expect("json");
        Ok(respond(StatusCode::OK, &hs, if head { Body::empty() } else { Body::from(body) }))
    }

    pub(super) async fn tags(&self, repo: &RepoName, q: &[(String, String)]) -> Result<Response, ApiError> {
        let mut tags: Vec<String> =
            self.store.list(&layout::tags_dir(repo)).await?.into_iter().filter_map(|m| m.key.rsplit('/').next().map(str::to_owned)).collect();
        if tags.is_empty() && self.store.list(&layout::manifests_dir(repo)).await?.is_empty() {
            return Err(ApiError::not_found(Code::NameUnknown, format!("repository {repo} unknown")));
        }
        tags.sort();
        if let Some(last) = param(q, "last") {
            tags.retain(|t| t.as_str() > last);
        }
        let mut hs = vec![(header::CONTENT_TYPE, "application/json".to_owned())];
        if let Some(n) = param(q, "n") {
            let n: usize = n.parse().map_err(|_| ApiError::bad(Code::Unsupported, format!("bad n={n:?}")))?;
            if tags.len() > n {
                tags.truncate(n);
                if let Some(last) = tags.last() {
                    hs.push((header::LINK, format!("</v2/{repo}/tags/list?n={n}&last={last}>; rel=\"next\"")));
                }
            }
        }
        let body = serde_json::to_vec(&serde_json::json!({ "name": repo.as_str(), "tags": tags })).expect("json");
        Ok(respond(StatusCode::OK, &hs, Body::from(body)))
    }

    /// `GET /v2/<name>/referrers/<digest>[?artifactType=T][&n=N][&last=DIGEST]`: a page of
    /// at most `n` (default and most [`REFERRERS_PAGE`]) referrer descriptors in digest
    /// order after `last`, with a `Link: <…>; rel="next"` to the next page when there is one.
    pub(super) async fn referrers(&self, repo: &RepoName, d: &str, q: &[(String, String)]) -> Result<Response, ApiError> {
        let subject = parse_digest(d)?;
        let filter = param(q, "artifactType");
        let n = match param(q, "n") {
            None => REFERRERS_PAGE,
            Some(v) => v.parse::<usize>().map_err(|_| ApiError::bad(Code::Unsupported, format!("bad n={v:?}")))?.clamp(1, REFERRERS_PAGE),
        };
        let last = param(q, "last");
        let mut entries: Vec<_> = self.store.list(&layout::referrers_dir(repo, &subject)).await?;
        entries.sort_by(|a, b| a.key.cmp(&b.key));
        let mut manifests = Vec::new();
        let mut more = false;
        for m in entries {
            // Keys end in the referrer's digest (`…/<alg>-<hex>`): the order and the cursor.
            let name = m.key.rsplit('/').next().unwrap_or("").replacen('-', ":", 1);
            if last.is_some_and(|l| name.as_str() <= l) {
                continue;
            }
            if m.size > MAX_REFERRER_DESCRIPTOR {
                tracing::warn!(key = %m.key, size = m.size, "skipping an oversized referrers-index entry");
                continue;
            }
            let b = match self.store.get_bytes(&m.key).await {
                Ok(b) => b,
                Err(e) if e.is_not_found() => continue,
                Err(e) => return Err(e.into()),
            };
            let Ok(desc) = serde_json::from_slice::<serde_json::Value>(&b) else { continue };
            if let Some(f) = filter {
                if desc.get("artifactType").and_then(|v| v.as_str()) != Some(f) {
                    continue;
                }
            }
            if manifests.len() == n {
                more = true;
                break;
            }
            manifests.push(desc);
        }
        let body = serde_json::json!({ "schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests });
        let mut hs = vec![(header::CONTENT_TYPE, OCI_INDEX.to_owned())];
        if filter.is_some() {
            hs.push((HeaderName::from_static("oci-filters-applied"), "artifactType".to_owned()));
        }
        if let (true, Some(last)) = (more, manifests.last().and_then(|m| m["digest"].as_str())) {
            let mut next = form_urlencoded::Serializer::new(String::new());
            if let Some(f) = filter {
                next.append_pair("artifactType", f);
            }
            next.append_pair("n", &n.to_string()).append_pair("last", last);
            hs.push((header::LINK, format!("</v2/{repo}/referrers/{subject}?{}>; rel=\"next\"", next.finish())));
        }
        Ok(respond(StatusCode::OK, &hs, Body::from(serde_json::to_vec(&body).expect("json"))))
    }
}
