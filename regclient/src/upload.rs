//! The write half: is a blob there (HEAD), mount it from another repository, upload it
//! (POST, then PATCH pieces, then PUT with the last piece and the digest), and PUT
//! manifests. See `spec/transfer.md` for the sequence on the wire.
//!
//! Uploads stream from any [`BlobSource`] one piece at a time (never the whole blob in
//! memory) and hash what they send: the final PUT, which is what commits the blob, is only
//! sent when the bytes read hash to the digest being pushed. Large uploads save their
//! session URL after every PATCH (see [`super::state`]) so a killed push resumes.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use imgfmt::digest::OciHasher;
use imgfmt::{media, BlobSource, FormatError, OciDigest};

use super::state::{self, UploadState};
use super::{Attempt, ClientError, RegistrySource};

/// Default upload piece: blobs up to this size go up in one PUT, larger ones in PATCHes of
/// this size (raised to the registry's `OCI-Chunk-Min-Length` when it asks for more).
pub const DEFAULT_PIECE: u64 = 16 << 20;
/// Largest piece this client holds in memory, whatever a registry asks for.
pub const MAX_PIECE: u64 = 1 << 30;

/// How to upload.
#[derive(Debug, Clone)]
pub struct UploadOptions {
    /// Bytes per PATCH (and the largest blob sent in a single PUT).
    pub piece: u64,
    /// Where resume state goes (`None`: an interrupted upload starts over).
    pub cache_dir: Option<PathBuf>,
    /// The caller computed the digest from these very bytes in this process (a pack it
    /// has just written), so the upload does not hash them a second time on the way out.
    /// The registry still checks the digest when the final PUT commits the blob (the
    /// distribution spec requires it; `snapctl serve` and distribution do), so bytes that
    /// changed on disk since are refused there, not stored. Off by default: a source read
    /// from a layout or another registry is hashed as it is sent.
    pub source_hashed: bool,
}

impl Default for UploadOptions {
    fn default() -> Self {
        UploadOptions { piece: DEFAULT_PIECE, cache_dir: Some(super::cache_dir()), source_hashed: false }
    }
}

/// What an upload did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Uploaded {
    /// Blob bytes sent in request bodies (a retried piece counts twice).
    pub bytes_sent: u64,
    /// Bytes the registry already held from an earlier, interrupted run.
    pub resumed_from: u64,
}

/// How an upload moves, for its progress callback. Over a finished upload, what was sent
/// is the blob's size less what was [`Skipped`](UploadProgress::Skipped) plus what was
/// sent [`Again`](UploadProgress::Again): the sum of [`Sent`](UploadProgress::Sent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UploadProgress {
    /// `n` more bytes were sent, in request bodies the registry took.
    Sent(u64),
    /// The registry holds `n` bytes that were not sent: an earlier, interrupted run
    /// uploaded them (a resumed session), or it said it kept more than it was sent.
    Skipped(u64),
    /// The registry holds `n` bytes fewer than it was sent (it kept less, or lost the
    /// session): they are sent again.
    Again(u64),
}

/// What a manifest PUT learned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutManifest {
    pub digest: OciDigest,
    /// The registry answered `OCI-Subject`: it indexes referrers itself.
    pub subject_indexed: bool,
}

/// One in-memory blob as a [`BlobSource`] (for small uploads: referrer payloads, configs).
pub struct MemSource {
    pub digest: OciDigest,
    pub data: Bytes,
}

impl MemSource {
    pub fn new(data: impl Into<Bytes>) -> Self {
        let data = data.into();
        MemSource { digest: OciDigest::of(&data), data }
    }
}

impl BlobSource for MemSource {
    fn describe(&self) -> String {
        "memory".into()
    }
    fn resolve_tag(&self, tag: &str) -> Result<OciDigest, FormatError> {
        Err(FormatError::TagNotFound { layout: "memory".into(), tag: tag.into() })
    }
    fn read_blob_unverified(&self, d: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError> {
        if d != &self.digest {
            return Err(FormatError::BlobNotFound(d.clone()));
        }
        if self.data.len() as u64 > limit {
            return Err(FormatError::TooLarge { what: "blob size", got: self.data.len() as u64, limit });
        }
        Ok(self.data.to_vec())
    }
    fn blob_size(&self, d: &OciDigest) -> Result<u64, FormatError> {
        if d != &self.digest {
            return Err(FormatError::BlobNotFound(d.clone()));
        }
        Ok(self.data.len() as u64)
    }
    fn read_at_unverified(&self, d: &OciDigest, offset: u64, buf: &mut [u8]) -> Result<(), FormatError> {
        self.blob_size(d)?;
        let end = offset.checked_add(buf.len() as u64).filter(|&e| e <= self.data.len() as u64);
        let Some(end) = end else {
            return Err(FormatError::Truncated { what: "blob", got: self.data.len() as u64, expected: offset.saturating_add(buf.len() as u64) });
        };
        buf.copy_from_slice(&self.data[offset as usize..end as usize]);
        Ok(())
    }
}

/// The digest of a blob's first bytes, kept in step with what the registry holds
/// (`hasher` is `None` when the source's bytes need no second hashing, see
/// [`UploadOptions::source_hashed`]).
struct Prefix<'a> {
    src: &'a dyn BlobSource,
    digest: &'a OciDigest,
    hasher: Option<OciHasher>,
    upto: u64,
}

impl Prefix<'_> {
    /// Hash up to `offset`, re-reading from the source what was not hashed yet (after a
    /// resume, or when the registry kept less than was sent).
    fn advance_to(&mut self, offset: u64, buf: &mut Vec<u8>) -> Result<(), ClientError> {
        let Some(hasher) = &mut self.hasher else {
            self.upto = offset;
            return Ok(());
        };
        if offset < self.upto {
            *hasher = OciHasher::for_digest(self.digest);
            self.upto = 0;
        }
        while self.upto < offset {
            let n = (offset - self.upto).min(4 << 20) as usize;
            buf.resize(n, 0);
            self.src.read_at_unverified(self.digest, self.upto, &mut buf[..n]).map_err(|source| ClientError::Source { digest: self.digest.clone(), source })?;
            hasher.update(&buf[..n]);
            self.upto += n as u64;
        }
        Ok(())
    }
}

/// An upload session: where to send the next bytes, and how many the registry holds.
struct Session {
    location: reqwest::Url,
    offset: u64,
}

/// One blob's upload in progress: what it reads, where its resume state goes, and how
/// it is going.
struct Upload<'a> {
    reg: &'a RegistrySource,
    d: &'a OciDigest,
    size: u64,
    src: &'a dyn BlobSource,
    progress: &'a (dyn Fn(UploadProgress) + Sync),
    /// Where the registry's offset is as far as `progress` was told.
    told: u64,
    state_file: Option<PathBuf>,
    /// Bytes per PATCH (raised to the registry's minimum).
    piece: u64,
    buf: Vec<u8>,
    prefix: Prefix<'a>,
    /// Names the upload in errors and logs.
    what: String,
    /// A save of the state failed and was said: said once per blob, as the state is saved
    /// after every piece and a directory that refuses one write refuses them all.
    save_failed: bool,
    /// Consecutive transient failures under the client's policy (progress resets the
    /// count; a budget, if the policy has one, runs from the upload's start).
    retry: imgfmt::retry::Retry,
    /// The session in progress (its latest URL): what is deleted if the upload gives up.
    open: Option<reqwest::Url>,
    /// The session's state file holds where it is: a rerun can take it over.
    resumable: bool,
    out: Uploaded,
}

impl Upload<'_> {
    /// A session saved by an earlier run, if the registry still has it (else the saved
    /// state is dropped).
    fn resume_saved(&mut self) -> Result<Option<Session>, ClientError> {
        let (reg, d, size) = (self.reg, self.d, self.size);
        let Some(p) = &self.state_file else { return Ok(None) };
        let Some(saved) = state::load(p, &reg.host, &reg.repository, d) else { return Ok(None) };
        match reqwest::Url::parse(&saved.location).ok().map(|u| reg.upload_status(&u)).transpose()? {
            Some(Some(s)) if s.offset <= size => {
                tracing::info!("{d}: resuming upload at {} of {size} bytes", s.offset);
                self.out.resumed_from = s.offset;
                Ok(Some(s))
            }
            _ => {
                state::remove(p);
                Ok(None)
            }
        }
    }

    /// A new session (POST), the piece raised to the registry's minimum, saved.
    fn start(&mut self) -> Result<Session, ClientError> {
        let (s, min) = self.reg.start_upload(self.d)?;
        if min > MAX_PIECE {
            return Err(ClientError::TooLarge { what: format!("{}: OCI-Chunk-Min-Length {min}", self.what), limit: MAX_PIECE });
        }
        self.piece = self.piece.max(min);
        self.save(&s);
        Ok(s)
    }

    /// Save where the session is, for a rerun to resume (blobs of more than one piece).
    fn save(&mut self, s: &Session) {
        self.open = Some(s.location.clone());
        if let (Some(p), true) = (&self.state_file, self.size > self.piece) {
            let st = UploadState {
                host: self.reg.host.clone(),
                repository: self.reg.repository.clone(),
                digest: self.d.clone(),
                location: s.location.to_string(),
                offset: s.offset,
            };
            let saved = state::save(p, &st);
            self.resumable = saved.is_ok();
            if let Err(e) = saved {
                if !std::mem::replace(&mut self.save_failed, true) {
                    tracing::warn!("{}: cannot save upload state: {e} (if interrupted, this blob's upload starts over)", p.display());
                }
            }
        }
    }

    /// The upload gives up with `e`. A session a rerun can take over is kept when the
    /// failure may pass (the registry removes it if nobody comes back); any other is
    /// deleted, once and without retries, so the registry does not hold its bytes until it
    /// expires.
    fn give_up(&mut self, e: &ClientError) {
        let Some(loc) = self.open.take() else { return };
        if self.resumable && e.kind().is_transient() {
            return;
        }
        self.forget_state();
        tracing::debug!("{}: giving up: deleting the upload session", self.what);
        let _ = self.reg.attempt(&self.what, &|c| c.delete(loc.clone()));
    }

    /// Send the blob: resume or start a session, PATCH whole pieces, PUT the rest.
    fn run(&mut self) -> Result<Uploaded, ClientError> {
        let mut session = self.resume_saved()?;
        loop {
            let mut s = match session.take() {
                Some(s) => s,
                None => self.start()?,
            };
            self.open = Some(s.location.clone());
            self.moved_to(s.offset);
            self.prefix.advance_to(s.offset, &mut self.buf)?;
            if self.send_pieces(&mut s)?.is_break() {
                // The session is gone: start over.
                self.open = None;
                self.forget_state();
                self.prefix.advance_to(0, &mut self.buf)?;
                continue;
            }
            match self.put_last(s)? {
                ControlFlow::Break(out) => {
                    self.open = None;
                    return Ok(out);
                }
                ControlFlow::Continue(next) => session = next,
            }
            if session.is_none() {
                self.open = None;
                self.forget_state();
            }
        }
    }

    /// `n` bytes were sent and taken.
    fn sent(&mut self, n: u64) {
        self.out.bytes_sent += n;
        self.told += n;
        (self.progress)(UploadProgress::Sent(n));
    }

    /// The registry's offset is now `offset`: `progress` is told of bytes it holds without
    /// their being sent, or of bytes to send again.
    fn moved_to(&mut self, offset: u64) {
        match offset.cmp(&self.told) {
            std::cmp::Ordering::Greater => (self.progress)(UploadProgress::Skipped(offset - self.told)),
            std::cmp::Ordering::Less => (self.progress)(UploadProgress::Again(self.told - offset)),
            std::cmp::Ordering::Equal => {}
        }
        self.told = offset;
    }

    /// The saved state names a session that will not be continued.
    fn forget_state(&self) {
        if let Some(p) = &self.state_file {
            state::remove(p);
        }
    }

    /// Count a transient failure; give up (keeping the state file) after the client's
    /// retries.
    fn failed(&mut self, message: String, retry_after: Option<Duration>) -> Result<(), ClientError> {
        let Some(wait) = self.retry.failed(retry_after) else {
            return Err(ClientError::RetriesExhausted { what: self.what.clone(), attempts: self.retry.failures(), last: message });
        };
        super::log_retry(&self.what, &message, self.retry.failures(), wait);
        std::thread::sleep(wait);
        Ok(())
    }

    /// Whole pieces by PATCH while more than one piece is left (the rest, 1..=piece
    /// bytes or 0, goes with the PUT), following the registry's offset after each.
    /// `Break` when the session is gone.
    fn send_pieces(&mut self, s: &mut Session) -> Result<ControlFlow<()>, ClientError> {
        let (reg, d, size, piece) = (self.reg, self.d, self.size, self.piece);
        while size - s.offset > piece {
            let n = piece as usize;
            let chunk = self.src.read_range_unverified(d, s.offset, n).map_err(|source| ClientError::Source { digest: d.clone(), source })?;
            let range = format!("{}-{}", s.offset, s.offset + piece - 1);
            let loc = s.location.clone();
            let r = reg.attempt_within(&self.what, reg.deadline.for_bytes(piece), &|c| {
                c.patch(loc.clone())
                    .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
                    .header(reqwest::header::CONTENT_RANGE, range.clone())
                    .header(reqwest::header::CONTENT_LENGTH, n.to_string())
                    .body(chunk.clone())
            })?;
            match r {
                Attempt::Done(resp) if resp.status().as_u16() == 202 => {
                    self.sent(piece);
                    super::count_transferred(piece);
                    let held = resp.headers().get(reqwest::header::RANGE).and_then(|v| v.to_str().ok()).and_then(state::parse_upload_range);
                    let new_loc = reg.location(&resp, &self.what).unwrap_or(loc);
                    let expect = s.offset + piece;
                    if held.is_none_or(|h| h == expect) {
                        if let Some(h) = &mut self.prefix.hasher {
                            h.update(&chunk);
                        }
                        self.prefix.upto = expect;
                        *s = Session { location: new_loc, offset: expect };
                    } else {
                        // The registry kept a different amount: believe it.
                        *s = Session { location: new_loc, offset: held.expect("checked").min(size) };
                        self.moved_to(s.offset);
                        self.prefix.advance_to(s.offset, &mut self.buf)?;
                    }
                    self.retry.progressed();
                    self.save(s);
                }
                Attempt::Done(resp) if resp.status().as_u16() == 416 || resp.status().as_u16() == 404 => {
                    // Out of step with the registry (416), or the session is gone.
                    match reg.upload_status(&s.location)? {
                        Some(st) if st.offset <= size => {
                            *s = st;
                            self.moved_to(s.offset);
                            self.prefix.advance_to(s.offset, &mut self.buf)?;
                            self.failed(format!("PATCH answered {}", resp.status()), None)?;
                        }
                        _ => {
                            self.failed("upload session gone".into(), None)?;
                            return Ok(ControlFlow::Break(()));
                        }
                    }
                }
                Attempt::Done(resp) => {
                    self.forget_state();
                    return Err(RegistrySource::refusal(&self.what, resp));
                }
                Attempt::Transient { message, retry_after } => {
                    self.failed(message, retry_after)?;
                    match reg.upload_status(&s.location)? {
                        Some(st) if st.offset <= size => {
                            *s = st;
                            self.moved_to(s.offset);
                            self.prefix.advance_to(s.offset, &mut self.buf)?;
                        }
                        _ => return Ok(ControlFlow::Break(())),
                    }
                }
            }
        }
        Ok(ControlFlow::Continue(()))
    }

    /// The last piece, checked with the whole digest before it is sent: the PUT is what
    /// makes the blob exist, so it never carries bytes that do not match. `Break` with
    /// the upload's report once the blob is there; `Continue` with the session to go on
    /// with (`None`: start over).
    fn put_last(&mut self, s: Session) -> Result<ControlFlow<Uploaded, Option<Session>>, ClientError> {
        let (reg, d, size) = (self.reg, self.d, self.size);
        let n = (size - s.offset) as usize;
        let last = self.src.read_range_unverified(d, s.offset, n).map_err(|source| ClientError::Source { digest: d.clone(), source })?;
        let actual = self.prefix.hasher.clone().map(|mut whole| {
            whole.update(&last);
            whole.finish()
        });
        if let Some(actual) = actual.filter(|a| a != d) {
            // `give_up` deletes the session.
            return Err(ClientError::DigestMismatch { digest: d.clone(), actual });
        }
        let mut put_url = s.location.clone();
        put_url.query_pairs_mut().append_pair("digest", d.as_str());
        let r = reg.attempt_within(&self.what, reg.deadline.for_bytes(n as u64), &|c| {
            c.put(put_url.clone())
                .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
                .header(reqwest::header::CONTENT_LENGTH, n.to_string())
                .body(last.clone())
        })?;
        match r {
            Attempt::Done(resp) if resp.status().is_success() => {
                self.sent(n as u64);
                super::count_transferred(n as u64);
                self.forget_state();
                Ok(ControlFlow::Break(self.out))
            }
            Attempt::Done(resp) if resp.status().as_u16() == 404 || resp.status().as_u16() == 416 => {
                self.failed(format!("PUT answered {}", resp.status()), None)?;
                Ok(ControlFlow::Continue(reg.upload_status(&s.location)?.filter(|st| st.offset <= size)))
            }
            Attempt::Done(resp) => {
                self.forget_state();
                Err(RegistrySource::refusal(&self.what, resp))
            }
            Attempt::Transient { message, retry_after } => {
                self.failed(message, retry_after)?;
                // The PUT may have committed before the connection broke.
                if reg.blob_exists(d)? {
                    self.sent(n as u64);
                    self.forget_state();
                    return Ok(ControlFlow::Break(self.out));
                }
                Ok(ControlFlow::Continue(reg.upload_status(&s.location)?.filter(|st| st.offset <= size)))
            }
        }
    }
}

impl RegistrySource {
    pub(crate) fn mark_writing(&self) {
        if !self.writing.swap(true, Ordering::Relaxed) {
            // A token obtained for reading lacks `push`: forget it, the next request's
            // challenge gets one with both.
            let mut a = self.auth.lock().expect("poisoned");
            if a.as_deref().is_some_and(|v| v.starts_with("Bearer ")) {
                *a = None;
            }
        }
    }

    /// Ask for `scope` in every token from now on. A token obtained before lacks it (a
    /// registry that checks scopes declines a mount from a repository the token does not
    /// name, and answers 202, not 401): it is forgotten, so the next request's challenge
    /// gets one with every scope asked so far, as a copy's first mount does.
    fn need_scope(&self, scope: String) {
        if self.scopes.lock().expect("poisoned").insert(scope) {
            let mut a = self.auth.lock().expect("poisoned");
            if a.as_deref().is_some_and(|v| v.starts_with("Bearer ")) {
                *a = None;
            }
        }
    }

    /// Resolve a `Location` header (absolute, or relative to the URL that answered). It
    /// may name any server: whether credentials go there is decided when a request is
    /// sent to it ([`super::may_send_credentials`]).
    fn location(&self, resp: &reqwest::blocking::Response, what: &str) -> Result<reqwest::Url, ClientError> {
        let loc = resp
            .headers()
            .get(reqwest::header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| ClientError::Http { what: what.into(), message: format!("HTTP {} without a Location header", resp.status()) })?;
        let url = resp.url().join(loc).map_err(|e| ClientError::Http { what: what.into(), message: format!("bad Location {loc:?}: {e}") })?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(ClientError::Http { what: what.into(), message: format!("Location {loc:?} is not an HTTP(S) URL") });
        }
        Ok(url)
    }

    /// Whether the repository has blob `d` (HEAD; 404 = no).
    pub fn blob_exists(&self, d: &OciDigest) -> Result<bool, ClientError> {
        let url = self.url("blobs", d.as_str());
        let what = format!("HEAD {d} on {}", self.describe());
        let resp = self.send(&what, &|c| c.head(&url))?;
        match resp.status().as_u16() {
            200..=299 => Ok(true),
            404 => Ok(false),
            _ => Err(Self::refusal(&what, resp)),
        }
    }

    /// Whether the repository has manifest `d` (HEAD on `/manifests/`).
    pub fn manifest_exists(&self, d: &OciDigest) -> Result<bool, ClientError> {
        let url = self.url("manifests", d.as_str());
        let what = format!("HEAD manifest {d} on {}", self.describe());
        let resp = self.send(&what, &|c| c.head(&url).header(reqwest::header::ACCEPT, Self::accept()))?;
        match resp.status().as_u16() {
            200..=299 => Ok(true),
            404 => Ok(false),
            _ => Err(Self::refusal(&what, resp)),
        }
    }

    /// Cross-repository mount of `d` from repository `from` of the same registry:
    /// `Ok(true)` when the registry linked it (201), `Ok(false)` when it declined (202: it
    /// opened an upload session instead, which is cancelled here; the caller uploads).
    pub fn mount_blob(&self, d: &OciDigest, from: &str) -> Result<bool, ClientError> {
        self.mark_writing();
        self.need_scope(format!("repository:{from}:pull"));
        let url = format!("{}/v2/{}/blobs/uploads/", self.base, self.repository);
        let what = format!("mounting {d} from {from} into {}", self.describe());
        let resp = self.send(&what, &|c| c.post(&url).query(&[("mount", d.as_str()), ("from", from)]).header(reqwest::header::CONTENT_LENGTH, "0"))?;
        match resp.status().as_u16() {
            201 => Ok(true),
            202 => {
                if let Ok(loc) = self.location(&resp, &what) {
                    let _ = self.attempt(&what, &|c| c.delete(loc.clone()));
                }
                Ok(false)
            }
            _ => Err(Self::refusal(&what, resp)),
        }
    }

    /// Start an upload session (POST). Returns it and the registry's minimum PATCH size.
    fn start_upload(&self, d: &OciDigest) -> Result<(Session, u64), ClientError> {
        let url = format!("{}/v2/{}/blobs/uploads/", self.base, self.repository);
        let what = format!("starting upload of {d} to {}", self.describe());
        let resp = self.send(&what, &|c| c.post(&url).header(reqwest::header::CONTENT_LENGTH, "0"))?;
        if resp.status().as_u16() != 202 {
            return Err(Self::refusal(&what, resp));
        }
        let min = resp.headers().get("oci-chunk-min-length").and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse().ok()).unwrap_or(0);
        Ok((Session { location: self.location(&resp, &what)?, offset: 0 }, min))
    }

    /// Ask the registry how much of a session it holds (GET → 204 + `Range`). `Ok(None)`:
    /// the session is gone (or the registry no longer accepts this URL for it).
    fn upload_status(&self, loc: &reqwest::Url) -> Result<Option<Session>, ClientError> {
        let what = format!("upload status on {}", self.describe());
        let resp = self.send(&what, &|c| c.get(loc.clone()))?;
        if !resp.status().is_success() {
            tracing::debug!("{what}: HTTP {}: session gone", resp.status());
            return Ok(None);
        }
        let offset = resp.headers().get(reqwest::header::RANGE).and_then(|v| v.to_str().ok()).and_then(state::parse_upload_range);
        let location = self.location(&resp, &what).unwrap_or_else(|_| loc.clone());
        Ok(Some(Session { location, offset: offset.unwrap_or(0) }))
    }

    /// Upload blob `d` (`size` bytes) read from `src`. Sends only what the registry does
    /// not hold from an earlier interrupted run (when `opts.cache_dir` is set), retries
    /// transient failures from the registry's own offset, and commits (final PUT) only
    /// bytes that hash to `d`. `progress` is told of bytes as they are sent and taken, of
    /// bytes the registry holds from an earlier run, and of bytes it asks for again.
    pub fn upload_blob(
        &self,
        d: &OciDigest,
        size: u64,
        src: &dyn BlobSource,
        opts: &UploadOptions,
        progress: &(dyn Fn(UploadProgress) + Sync),
    ) -> Result<Uploaded, ClientError> {
        self.mark_writing();
        let mut up = Upload {
            reg: self,
            d,
            size,
            src,
            progress,
            told: 0,
            state_file: opts.cache_dir.as_ref().map(|c| state::state_path(c, &self.host, &self.repository, d)),
            piece: opts.piece.clamp(1, MAX_PIECE),
            buf: Vec::new(),
            prefix: Prefix { src, digest: d, hasher: (!opts.source_hashed).then(|| OciHasher::for_digest(d)), upto: 0 },
            what: format!("uploading {d} to {}", self.describe()),
            save_failed: false,
            retry: self.retry.start(),
            open: None,
            resumable: false,
            out: Uploaded::default(),
        };
        let r = up.run();
        if let Err(e) = &r {
            up.give_up(e);
        }
        r
    }

    /// PUT a manifest under `reference` (a tag, or its digest). The media type is taken
    /// from the manifest's own `mediaType` (OCI image manifest when absent).
    pub fn put_manifest(&self, reference: &str, bytes: &[u8]) -> Result<PutManifest, ClientError> {
        self.mark_writing();
        #[derive(serde::Deserialize)]
        struct Head {
            #[serde(rename = "mediaType")]
            media_type: Option<String>,
        }
        let mt = serde_json::from_slice::<Head>(bytes).ok().and_then(|h| h.media_type).unwrap_or_else(|| media::OCI_MANIFEST.into());
        let url = self.url("manifests", reference);
        let what = format!("putting manifest {}:{reference}", self.describe());
        let body = Bytes::copy_from_slice(bytes);
        let resp = self.send(&what, &|c| c.put(&url).header(reqwest::header::CONTENT_TYPE, mt.clone()).body(body.clone()))?;
        if !resp.status().is_success() {
            return Err(Self::refusal(&what, resp));
        }
        let digest = OciDigest::of(bytes);
        if let Some(h) = resp.headers().get("docker-content-digest").and_then(|v| v.to_str().ok()).and_then(|s| s.parse::<OciDigest>().ok()) {
            if h.algorithm() == "sha256" && h != digest {
                return Err(ClientError::DigestMismatch { digest, actual: h });
            }
        }
        let subject_indexed = resp.headers().contains_key("oci-subject");
        self.manifests.lock().expect("poisoned").insert(digest.clone());
        Ok(PutManifest { digest, subject_indexed })
    }

    /// Push a small in-memory blob unless the repository has it; returns its digest.
    pub fn push_small_blob(&self, data: &[u8]) -> Result<OciDigest, ClientError> {
        let m = MemSource::new(Bytes::copy_from_slice(data));
        if !self.blob_exists(&m.digest)? {
            let opts = UploadOptions { piece: DEFAULT_PIECE, cache_dir: None, source_hashed: false };
            self.upload_blob(&m.digest, data.len() as u64, &m, &opts, &|_| {})?;
        }
        Ok(m.digest)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn mem_source_reads_and_bounds() {
        let m = MemSource::new(b"hello world".to_vec());
        let mut b = [0u8; 5];
        m.read_at_unverified(&m.digest, 6, &mut b).unwrap();
        assert_eq!(&b, b"world");
        assert!(m.read_at_unverified(&m.digest, 7, &mut b).is_err());
        assert!(m.read_at_unverified(&m.digest, u64::MAX, &mut b).is_err());
        assert!(m.blob_size(&OciDigest::of(b"other")).is_err());
    }

    #[test]
    fn prefix_hash_follows_the_registry_offset() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let m = MemSource::new(data.clone());
        let mut buf = Vec::new();
        let mut p = Prefix { src: &m, digest: &m.digest, hasher: Some(OciHasher::for_digest(&m.digest)), upto: 0 };
        p.advance_to(7000, &mut buf).unwrap();
        // The registry says it holds less than we hashed: rehash from the start.
        p.advance_to(3000, &mut buf).unwrap();
        p.advance_to(10_000, &mut buf).unwrap();
        assert_eq!(p.hasher.unwrap().finish(), OciDigest::of(&data));
    }

    /// Issue 4 (a CI failure of `login_then_push`): parallel HEADs answer the registry's
    /// challenge while the push starts writing and drops the read-only token. A request
    /// that had already answered its one challenge then went out with no credentials and
    /// failed with 401. Each round starts unauthenticated, four HEADs race, and the token
    /// is dropped at a random moment; every HEAD must still get its answer.
    #[test]
    fn regression_issue_4_requests_in_flight_survive_a_dropped_read_token() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let h = bcrypt::hash("pw", 4).unwrap();
        let auth = registry::auth::Auth::new(&format!("alice:{h}\n"), None, false, vec![7; 32]).unwrap();
        let store = Arc::new(registry::store::FsStore::open(dir.path()).unwrap());
        let server = registry::server::Server::new(store, registry::server::Config { auth: Some(auth), ..Default::default() });
        let l = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let host = l.local_addr().unwrap().to_string();
        rt.spawn(async move {
            let _ = server.serve(l, std::future::pending::<()>()).await;
        });
        let creds = crate::Credentials::Password { username: "alice".into(), password: "pw".into() };
        let c = Arc::new(RegistrySource::new(&host, "vm/auth", true, Some(creds)).unwrap());
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for round in 0..150 {
            *c.auth.lock().unwrap() = None;
            c.writing.store(false, Ordering::Relaxed);
            let heads: Vec<_> = (0..4u8)
                .map(|i| {
                    let c = c.clone();
                    std::thread::spawn(move || c.blob_exists(&OciDigest::of(&[round as u8, i])))
                })
                .collect();
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            std::thread::sleep(std::time::Duration::from_micros(rng % 1500));
            c.mark_writing();
            for h in heads {
                assert!(!h.join().unwrap().unwrap_or_else(|e| panic!("round {round}: {e}")), "round {round}: no such blob");
            }
        }
    }

    /// A server in-process over a temp dir, for the blocking client (its own runtime).
    pub(crate) fn local_server() -> (tokio::runtime::Runtime, tempfile::TempDir, String) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(registry::store::FsStore::open(dir.path()).unwrap());
        let server = registry::server::Server::new(store, registry::server::Config::default());
        let l = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let host = l.local_addr().unwrap().to_string();
        rt.spawn(async move {
            let _ = server.serve(l, std::future::pending::<()>()).await;
        });
        (rt, dir, host)
    }

    /// `source_hashed` skips the client's own hashing; a source whose bytes do not match
    /// the digest must still never become a blob: the registry's check at the final PUT
    /// refuses it, whether the blob goes in one PUT or in PATCHed pieces.
    #[test]
    fn source_hashed_upload_of_wrong_bytes_is_refused_by_the_registry() {
        let (_rt, _dir, host) = local_server();
        let c = RegistrySource::new(&host, "vm/hashed", true, None).unwrap();
        for (size, piece) in [(10_000usize, DEFAULT_PIECE), (300_000, 64 << 10)] {
            let good: Vec<u8> = (0..size as u32).map(|i| (i % 253) as u8).collect();
            let mut bad = good.clone();
            bad[size / 2] ^= 1;
            let d = OciDigest::of(&good);
            // The wrong bytes, presented under the right digest.
            let lying = MemSource { digest: d.clone(), data: Bytes::from(bad) };
            for hashed in [false, true] {
                let opts = UploadOptions { piece, cache_dir: None, source_hashed: hashed };
                let e = c.upload_blob(&d, size as u64, &lying, &opts, &|_| {}).unwrap_err();
                if hashed {
                    assert!(!matches!(e, ClientError::DigestMismatch { .. }), "the client did not hash: {e}");
                } else {
                    assert!(matches!(e, ClientError::DigestMismatch { .. }), "{e}");
                }
                assert!(!c.blob_exists(&d).unwrap(), "size {size}, source_hashed {hashed}: wrong bytes stored");
            }
            // The right bytes, not hashed by the client, are stored and read back whole.
            let right = MemSource { digest: d.clone(), data: Bytes::from(good.clone()) };
            let opts = UploadOptions { piece, cache_dir: None, source_hashed: true };
            c.upload_blob(&d, size as u64, &right, &opts, &|_| {}).unwrap();
            assert_eq!(c.read_range_unverified(&d, 0, size).unwrap(), good);
        }
    }

    /// The range fast path hands back exactly the bytes asked for, across the server's
    /// mapped pieces (4 MiB) and at odd offsets; a range past the end is an error.
    #[test]
    fn range_reads_return_the_bytes_asked_for() {
        let (_rt, _dir, host) = local_server();
        let c = RegistrySource::new(&host, "vm/ranges", true, None).unwrap();
        let data: Vec<u8> = (0..(9u32 << 20) + 123).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
        let m = MemSource::new(data.clone());
        let opts = UploadOptions { piece: 4 << 20, cache_dir: None, source_hashed: false };
        c.upload_blob(&m.digest, data.len() as u64, &m, &opts, &|_| {}).unwrap();
        for (off, len) in [(0usize, 1usize), (1, 4 << 20), ((4 << 20) - 7, 5 << 20), (0, data.len()), (data.len() - 10, 10)] {
            let got = c.read_range_unverified(&m.digest, off as u64, len).unwrap();
            assert!(got[..] == data[off..off + len], "range {off}+{len}");
            let mut buf = vec![0u8; len];
            c.read_at_unverified(&m.digest, off as u64, &mut buf).unwrap();
            assert!(buf == data[off..off + len], "read_at {off}+{len}");
        }
        assert!(c.read_range_unverified(&m.digest, data.len() as u64 - 5, 10).is_err());
    }
}
