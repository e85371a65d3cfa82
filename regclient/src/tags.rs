//! The tags of a repository (`GET /v2/<name>/tags/list`, pages followed through
//! `Link: <…>; rel="next"` on the registry's own origin), bounded whatever the registry
//! holds: a push looks among them for the closest image to build on.

use std::io::Read;

use imgfmt::BlobSource;

use super::referrers::next_link;
use super::{ClientError, RegistrySource};

/// Pages read at most for one listing.
pub const MAX_TAG_PAGES: usize = 16;
/// Bytes of one page read at most (a page of 1000 long tags is ~130 KB).
const MAX_TAG_PAGE_BYTES: u64 = 4 << 20;

/// A repository's tags as listed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tags {
    /// In the registry's order (lexical, for distribution and `snapctl serve`).
    pub tags: Vec<String>,
    /// More were there than `max` or [`MAX_TAG_PAGES`] pages allowed.
    pub truncated: bool,
}

#[derive(serde::Deserialize)]
struct Page {
    #[serde(default)]
    tags: Option<Vec<String>>,
}

impl RegistrySource {
    /// The repository's tags, up to `max` of them; an unknown repository has none.
    pub fn list_tags(&self, max: usize) -> Result<Tags, ClientError> {
        let what = format!("listing the tags of {}", self.describe());
        let mut out = Tags::default();
        let mut next = Some(format!("{}/v2/{}/tags/list", self.base, self.repository));
        let mut pages = 0;
        while let Some(url) = next.take() {
            if pages == MAX_TAG_PAGES || out.tags.len() >= max {
                out.truncated = true;
                break;
            }
            let resp = self.send(&what, &|c| c.get(&url))?;
            match resp.status().as_u16() {
                200 => {}
                404 if pages == 0 => return Ok(out),
                _ => return Err(Self::refusal(&what, resp)),
            }
            pages += 1;
            next = next_link(resp.headers())
                .and_then(|l| resp.url().join(&l).ok())
                .filter(|u| super::may_send_credentials(&self.origin, u))
                .map(|u| u.to_string());
            let mut b = Vec::new();
            resp.take(MAX_TAG_PAGE_BYTES + 1).read_to_end(&mut b).map_err(|e| ClientError::Http { what: what.clone(), message: e.to_string() })?;
            if b.len() as u64 > MAX_TAG_PAGE_BYTES {
                return Err(ClientError::TooLarge { what, limit: MAX_TAG_PAGE_BYTES });
            }
            let page: Page = serde_json::from_slice(&b).map_err(|e| ClientError::Http { what: what.clone(), message: format!("not a tag list: {e}") })?;
            for t in page.tags.unwrap_or_default() {
                if out.tags.len() == max {
                    out.truncated = true;
                    break;
                }
                out.tags.push(t);
            }
        }
        Ok(out)
    }
}
