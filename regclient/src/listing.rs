//! What a registry lists and deletes: a repository's tags (`GET /v2/<name>/tags/list`),
//! the registry's repositories (`GET /v2/_catalog`), both page by page (`?n=`, `Link:
//! <…>; rel="next"` on the registry's own origin), and `DELETE /v2/<name>/manifests/<ref>`.

use std::io::Read as _;

use imgfmt::reference::Selector;
use imgfmt::FormatError;

use super::{ClientError, RegistrySource};

/// Entries asked for per page of a listing.
const PAGE: usize = 1000;
/// Most pages of one listing read: a bound on what a registry can make a client loop on
/// (a million names at [`PAGE`] a page).
const MAX_PAGES: usize = 1000;
/// Largest page body accepted.
const MAX_PAGE_BYTES: u64 = 16 << 20;

#[derive(serde::Deserialize)]
struct TagList {
    #[serde(default)]
    tags: Option<Vec<String>>,
}

#[derive(serde::Deserialize)]
struct Catalog {
    #[serde(default)]
    repositories: Vec<String>,
}

/// A repository's tags as listed, in the registry's order (lexical for distribution and
/// `snapctl serve`), up to a bound.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tags {
    pub tags: Vec<String>,
    /// The repository had more than the bound.
    pub truncated: bool,
}

impl RegistrySource {
    /// Every tag of this repository, sorted. A repository the registry does not know
    /// (404 `NAME_UNKNOWN`): `FormatError::RepositoryNotFound`.
    pub fn list_tags(&self) -> Result<Vec<String>, FormatError> {
        let Some(Tags { mut tags, .. }) = self.tags_up_to(usize::MAX)? else {
            return Err(FormatError::RepositoryNotFound { registry: self.host.clone(), repository: self.repository.clone() });
        };
        tags.sort();
        tags.dedup();
        Ok(tags)
    }

    /// The first `max` tags of this repository in the registry's order (no more pages are
    /// read once `max` are in); `None` for a repository the registry does not know.
    pub fn tags_up_to(&self, max: usize) -> Result<Option<Tags>, FormatError> {
        let what = format!("listing the tags of {}/{}", self.host, self.repository);
        let first = format!("{}/v2/{}/tags/list?n={}", self.base, self.repository, max.clamp(1, PAGE));
        let mut out = Tags::default();
        let found = self.list_pages(&what, first, |body| {
            let page: TagList = serde_json::from_slice(body).map_err(|e| ClientError::Http { what: what.clone(), message: format!("not a tag list: {e}") })?;
            for t in page.tags.unwrap_or_default() {
                if out.tags.len() == max {
                    out.truncated = true;
                    return Ok(false);
                }
                out.tags.push(t);
            }
            Ok(out.tags.len() < max)
        })?;
        Ok(found.then_some(out))
    }

    /// Every repository the registry lists to this client (`/v2/_catalog`), sorted; the
    /// client's own repository plays no part.
    pub fn catalog(&self) -> Result<Vec<String>, FormatError> {
        let what = format!("listing the repositories of {}", self.host);
        let mut repos = Vec::new();
        let found = self.list_pages(&what, format!("{}/v2/_catalog?n={PAGE}", self.base), |body| {
            let page: Catalog = serde_json::from_slice(body).map_err(|e| ClientError::Http { what: what.clone(), message: format!("not a catalog: {e}") })?;
            repos.extend(page.repositories);
            Ok(true)
        })?;
        if !found {
            let e = ClientError::Registry { what: what.clone(), status: 404, code: None, message: "this registry has no catalog (GET /v2/_catalog)".into() };
            return Err(e.into_source_error(&self.host));
        }
        repos.sort();
        repos.dedup();
        Ok(repos)
    }

    /// Read the pages of a listing from `first` on, handing each body to `page` (which says
    /// whether to read on); `false` when the first page is a 404.
    fn list_pages(&self, what: &str, first: String, mut page: impl FnMut(&[u8]) -> Result<bool, ClientError>) -> Result<bool, FormatError> {
        let mut next = Some(first);
        let mut pages = 0;
        while let Some(url) = next.take() {
            if pages == MAX_PAGES {
                tracing::warn!("{what}: more than {MAX_PAGES} pages; listing what they held");
                break;
            }
            let resp = self.send(what, &|c| c.get(&url)).map_err(|e| self.source_err(e))?;
            if resp.status().as_u16() == 404 && pages == 0 {
                return Ok(false);
            }
            if !resp.status().is_success() {
                return Err(self.source_err(Self::refusal(what, resp)));
            }
            next = super::referrers::next_link(resp.headers()).and_then(|l| resp.url().join(&l).ok()).and_then(|u| {
                if super::may_send_credentials(&self.origin, &u) {
                    Some(u.to_string())
                } else {
                    tracing::warn!("{what}: the next page is on another origin ({u}); listing only what this one had");
                    None
                }
            });
            let mut body = Vec::new();
            resp.take(MAX_PAGE_BYTES + 1)
                .read_to_end(&mut body)
                .map_err(|e| self.source_err(ClientError::Http { what: what.into(), message: e.to_string() }))?;
            if body.len() as u64 > MAX_PAGE_BYTES {
                return Err(self.source_err(ClientError::TooLarge { what: what.into(), limit: MAX_PAGE_BYTES }));
            }
            pages += 1;
            if !page(&body).map_err(|e| self.source_err(e))? {
                break;
            }
        }
        Ok(true)
    }

    /// `DELETE` the manifest `what` names: a tag (where the registry deletes tags alone),
    /// or a manifest by digest (its tags go with it). Absent (404): `TagNotFound` or
    /// `BlobNotFound`; a registry that does not allow it (405, distribution without
    /// `storage.delete.enabled`): `FormatError::Refused` holding its answer.
    pub fn delete_manifest(&self, what: &Selector) -> Result<(), FormatError> {
        let reference = match what {
            Selector::Tag(t) => t.clone(),
            Selector::Digest(d) => d.to_string(),
        };
        let url = self.url("manifests", &reference);
        let doing = format!("deleting {}/{}{what}", self.host, self.repository);
        self.mark_writing();
        let resp = self.send(&doing, &|c| c.delete(&url)).map_err(|e| self.source_err(e))?;
        match (resp.status().as_u16(), what) {
            (200..=299, _) => {
                self.forget(what);
                Ok(())
            }
            (404, Selector::Tag(t)) => Err(FormatError::TagNotFound { layout: format!("{}/{}", self.host, self.repository), tag: t.clone() }),
            (404, Selector::Digest(d)) => Err(FormatError::BlobNotFound(d.clone())),
            _ => Err(self.source_err(Self::refusal(&doing, resp))),
        }
    }

    /// Drop what the client remembers of a deleted manifest.
    fn forget(&self, what: &Selector) {
        let mut resolved = self.resolved.lock().expect("poisoned");
        if let Selector::Digest(d) = what {
            self.manifests.lock().expect("poisoned").remove(d);
            if resolved.as_ref().is_some_and(|(r, _)| r == d) {
                *resolved = None;
            }
        } else {
            *resolved = None;
        }
    }
}

/// Whether `e` is a registry's refusal to delete at all (405, or `UNSUPPORTED`), rather
/// than a refusal of this one deletion.
pub fn refuses_deletes(e: &FormatError) -> bool {
    let FormatError::Refused { source, .. } = e else { return false };
    source.downcast_ref::<ClientError>().is_some_and(|c| match c {
        ClientError::Registry { status, code, .. } => *status == 405 || code.as_deref() == Some("UNSUPPORTED"),
        _ => false,
    })
}
