//! What `push DIR` tells its caller as it goes ([`PushObserver`]), and the count of what
//! it is to upload that the observer is given (`UploadTally`).
//!
//! ```text
//! scan ---------------------------------> scanned (the packing total)
//! closest image -------------------------> parent (taken, not taken, none: why)
//! packer ---------------------------------> packed (source bytes), packing_done
//!   |  pack sealed -> tally.expect ------> upload_total (grows)
//!   v
//! senders / copy --TransferObserver--> tally -> upload_total (exact), uploaded (bytes)
//! ```
//!
//! The upload total is what the push is to send, as far as known: a pack counts from the
//! moment it is sealed (it holds new chunks, so it is expected to go up), the image's own
//! metadata from the end of packing; what the registry turns out to hold already (or
//! holds from an earlier, interrupted upload) comes off again, and what it asks for again
//! is added. Once packing is done it is exact unless the registry surprises, and once
//! every upload is done it equals the bytes sent.

use std::collections::HashMap;
use std::sync::Mutex;

use imgfmt::{Descriptor, OciDigest};
use regclient::UploadProgress;

use crate::copy::TransferObserver;
use crate::pack::PackReport;
use crate::scan::DirScan;

/// Why the image of a directory was not the one just packed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reused {
    /// The directory's stamp equals the one recorded when it was last packed with the
    /// same options: the recorded manifest, without reading the files.
    Stamp,
    /// Packed, and the index and packs equal the image pushed last from this directory
    /// (only the creation time differed): that image's manifest.
    Previous,
    /// Packed as a layer over the image the tag holds, and nothing differed from it (the
    /// same content, names, sizes and modes): that image's manifest, so the tag's chain
    /// does not grow by an empty layer.
    Parent,
}

/// What the search for the closest image of the repository came to (only told when
/// `push DIR` searches: not with a parent named, nor with none wanted).
#[derive(Debug, Clone, Copy)]
pub enum ParentNote<'a> {
    /// `reference` (`digest`) is the parent, for `why`.
    Taken { reference: &'a str, digest: &'a OciDigest, why: &'a str },
    /// The closest image, `reference`, could not be taken after all (it did not open, or
    /// is not of the same files): `why`.
    NotTaken { reference: &'a str, why: &'a str },
    /// No image of the repository is taken: `why`.
    None { why: &'a str },
}

/// What `push DIR` tells its caller as it goes, from the threads that do the work. Every
/// method defaults to nothing; `()` is the observer that is told nothing.
pub trait PushObserver: Sync {
    /// The directory was walked: `scan.total_bytes()` is what packing goes through.
    fn scanned(&self, _scan: &DirScan) {}
    /// The closest image was searched for.
    fn parent(&self, _note: &ParentNote<'_>) {}
    /// `n` more bytes of the directory were packed (holes included).
    fn packed(&self, _n: u64) {}
    /// Packing is over (or was skipped: the stamp), and how it went (`report` is `None`
    /// when it was skipped). Packs may still be going up.
    fn packing_done(&self, _reused: Option<Reused>, _report: Option<&PackReport>) {}
    /// The bytes this push is to upload, as far as known now (see the module doc).
    fn upload_total(&self, _bytes: u64) {}
    /// `n` more bytes were uploaded.
    fn uploaded(&self, _n: u64) {}
}

impl PushObserver for () {}

/// The count behind [`PushObserver::upload_total`]: blobs expected to go up before their
/// upload starts (sealed packs, the image's metadata), and every upload as the copy
/// engine reports it.
pub(crate) struct UploadTally<'o> {
    observer: &'o dyn PushObserver,
    state: Mutex<Tally>,
}

#[derive(Default)]
struct Tally {
    /// The upload total.
    total: u64,
    /// The blobs counted in `total`.
    blobs: HashMap<OciDigest, Counted>,
    /// Bytes sent by early sends that failed (the copy that follows sends those blobs
    /// again).
    lost: u64,
}

/// One blob counted in the upload total.
#[derive(Clone, Copy)]
struct Counted {
    /// Bytes of it counted and not sent yet.
    left: u64,
    /// Bytes of it sent.
    sent: u64,
    /// Its upload has started (an expected blob is counted before).
    started: bool,
}

impl<'o> UploadTally<'o> {
    pub(crate) fn new(observer: &'o dyn PushObserver) -> UploadTally<'o> {
        UploadTally { observer, state: Mutex::new(Tally::default()) }
    }

    /// Change the total under the lock, and tell the observer the new one.
    fn update<R>(&self, f: impl FnOnce(&mut Tally) -> R) -> R {
        let mut t = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let before = t.total;
        let r = f(&mut t);
        if t.total != before {
            self.observer.upload_total(t.total);
        }
        r
    }

    /// Blob `d` of `size` bytes is expected to go up: counted now, before its upload
    /// starts (once: a blob counted already is left as it is).
    pub(crate) fn expect(&self, d: &OciDigest, size: u64) {
        self.update(|t| {
            if !t.blobs.contains_key(d) {
                t.blobs.insert(d.clone(), Counted { left: size, sent: 0, started: false });
                t.total += size;
            }
        });
    }

    /// An early send of blob `d` failed: what it had not sent comes off (the copy that
    /// follows sends the blob again, and counts it then).
    pub(crate) fn failed(&self, d: &OciDigest) {
        self.update(|t| {
            if let Some(c) = t.blobs.remove(d) {
                t.total -= c.left;
                t.lost += c.sent;
            }
        });
    }

    /// Bytes sent by early sends that failed: sent, though no blob's upload report has
    /// them.
    pub(crate) fn lost(&self) -> u64 {
        self.update(|t| t.lost)
    }
}

impl TransferObserver for UploadTally<'_> {
    fn found(&self, blob: &Descriptor) {
        self.update(|t| {
            if let Some(c) = t.blobs.remove(&blob.digest) {
                t.total -= c.left;
            }
        });
    }

    fn upload_starts(&self, blob: &Descriptor) {
        self.update(|t| match t.blobs.get_mut(&blob.digest) {
            Some(c) if !c.started => c.started = true,
            Some(c) => {
                c.left += blob.size;
                t.total += blob.size;
            }
            None => {
                t.blobs.insert(blob.digest.clone(), Counted { left: blob.size, sent: 0, started: true });
                t.total += blob.size;
            }
        });
    }

    fn progress(&self, blob: &Descriptor, p: UploadProgress) {
        self.update(|t| {
            let Some(c) = t.blobs.get_mut(&blob.digest) else { return };
            match p {
                UploadProgress::Sent(n) => {
                    c.left = c.left.saturating_sub(n);
                    c.sent += n;
                }
                UploadProgress::Skipped(n) => {
                    let n = n.min(c.left);
                    c.left -= n;
                    t.total -= n;
                }
                UploadProgress::Again(n) => {
                    c.left += n;
                    t.total += n;
                }
            }
        });
        if let UploadProgress::Sent(n) = p {
            self.observer.uploaded(n);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

    #[derive(Default)]
    struct Seen {
        total: AtomicU64,
        uploaded: AtomicU64,
    }
    impl PushObserver for Seen {
        fn upload_total(&self, bytes: u64) {
            self.total.store(bytes, Relaxed);
        }
        fn uploaded(&self, n: u64) {
            self.uploaded.fetch_add(n, Relaxed);
        }
    }

    fn blob(b: &[u8], size: u64) -> Descriptor {
        Descriptor::new("application/octet-stream", OciDigest::of(b), size)
    }

    /// A pack counted when sealed, found at the registry, resumed, failed early and sent
    /// again: the total ends at what was sent, every time.
    #[test]
    fn the_upload_total_ends_at_the_bytes_sent() {
        let seen = Seen::default();
        let t = UploadTally::new(&seen);
        let (a, b, c, meta) = (blob(b"a", 100), blob(b"b", 50), blob(b"c", 80), blob(b"m", 7));
        // Three packs sealed: 230 bytes expected.
        for p in [&a, &b, &c] {
            t.expect(&p.digest, p.size);
        }
        assert_eq!(seen.total.load(Relaxed), 230);
        // `a` goes up in two pieces, the registry asking for 10 bytes again.
        t.upload_starts(&a);
        t.progress(&a, UploadProgress::Sent(60));
        t.progress(&a, UploadProgress::Again(10));
        t.progress(&a, UploadProgress::Sent(50));
        // The registry has `b` already.
        t.found(&b);
        assert_eq!(seen.total.load(Relaxed), 190);
        // `c`'s early send resumes an earlier run at 30, sends 20, fails; the copy after
        // packing sends it again, resuming at 50.
        t.upload_starts(&c);
        t.progress(&c, UploadProgress::Skipped(30));
        t.progress(&c, UploadProgress::Sent(20));
        t.failed(&c.digest);
        t.upload_starts(&c);
        t.progress(&c, UploadProgress::Skipped(50));
        t.progress(&c, UploadProgress::Sent(30));
        // Metadata found missing after packing, and `a` found there by the copy.
        t.upload_starts(&meta);
        t.progress(&meta, UploadProgress::Sent(7));
        t.found(&a);
        let sent = 60 + 50 + 20 + 30 + 7;
        assert_eq!(seen.uploaded.load(Relaxed), sent);
        assert_eq!(seen.total.load(Relaxed), sent);
        assert_eq!(t.lost(), 20, "the failed early send's bytes");
    }
}
