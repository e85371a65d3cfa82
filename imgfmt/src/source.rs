//! Where blobs come from: a local OCI layout, a registry, a cache. One sync trait so the
//! format, verification and unpacking code does not care.

use crate::digest::OciDigest;
use crate::FormatError;

/// A content-addressed blob store to read from.
///
/// Methods return bytes as the store holds them: **unverified**. Callers check them
/// (metadata blobs against their OCI digest in [`crate::Image::open`], chunks against their
/// chunk digest in the `verify` crate) before using them.
pub trait BlobSource: Send + Sync {
    /// Human description for messages (`oci:/path`, `host/repo`).
    fn describe(&self) -> String;
    /// Resolve a tag to a manifest digest.
    fn resolve_tag(&self, tag: &str) -> Result<OciDigest, FormatError>;
    /// A whole blob, refusing blobs larger than `limit` (checked before reading).
    fn read_blob_unverified(&self, digest: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError>;
    /// Size of a blob as stored.
    fn blob_size(&self, digest: &OciDigest) -> Result<u64, FormatError>;
    /// Fill `buf` from `offset` of a blob; short blobs are an error.
    fn read_at_unverified(&self, digest: &OciDigest, offset: u64, buf: &mut [u8]) -> Result<(), FormatError>;
    /// `len` bytes from `offset` of a blob, in a buffer the caller may slice and keep
    /// without copying (a pull hands each chunk of a range on as a slice of it). The
    /// default fills a fresh buffer with [`BlobSource::read_at_unverified`]; a source that
    /// receives the bytes in buffers of its own (an HTTP body) returns those instead of
    /// zeroing one and copying into it.
    fn read_range_unverified(&self, digest: &OciDigest, offset: u64, len: usize) -> Result<bytes::Bytes, FormatError> {
        let mut buf = vec![0u8; len];
        self.read_at_unverified(digest, offset, &mut buf)?;
        Ok(buf.into())
    }
    /// The bytes of a blob from `offset`, cut into pieces of `lens` bytes in order, each
    /// handed to `each(i, bytes)` as soon as it is in: a source reading one response
    /// (an HTTP body) hands a reader its first piece once that piece has arrived, not
    /// once the whole range has, and the later pieces come behind it on the same
    /// connection. Pieces handed over before an error stay handed over; the caller reads
    /// the rest some other way. The default reads the whole range, then hands out every
    /// piece.
    fn read_pieces_unverified(&self, digest: &OciDigest, offset: u64, lens: &[usize], each: &mut dyn FnMut(usize, bytes::Bytes)) -> Result<(), FormatError> {
        split_pieces(self.read_range_unverified(digest, offset, lens.iter().sum())?, lens, each);
        Ok(())
    }
}

/// Hand `all` out as consecutive pieces of `lens` bytes (it holds their sum).
pub fn split_pieces(all: bytes::Bytes, lens: &[usize], each: &mut dyn FnMut(usize, bytes::Bytes)) {
    let mut at = 0;
    for (i, &n) in lens.iter().enumerate() {
        each(i, all.slice(at..at + n));
        at += n;
    }
}

/// A shared source is a source: a daemon hands one client to many threads (and to the
/// image opener) without a wrapper type per caller. Every method forwards, the provided
/// ones too, so a source's own `read_range_unverified` is never replaced by the default.
impl<T: BlobSource + ?Sized> BlobSource for std::sync::Arc<T> {
    fn describe(&self) -> String {
        (**self).describe()
    }
    fn resolve_tag(&self, tag: &str) -> Result<OciDigest, FormatError> {
        (**self).resolve_tag(tag)
    }
    fn read_blob_unverified(&self, digest: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError> {
        (**self).read_blob_unverified(digest, limit)
    }
    fn blob_size(&self, digest: &OciDigest) -> Result<u64, FormatError> {
        (**self).blob_size(digest)
    }
    fn read_at_unverified(&self, digest: &OciDigest, offset: u64, buf: &mut [u8]) -> Result<(), FormatError> {
        (**self).read_at_unverified(digest, offset, buf)
    }
    fn read_range_unverified(&self, digest: &OciDigest, offset: u64, len: usize) -> Result<bytes::Bytes, FormatError> {
        (**self).read_range_unverified(digest, offset, len)
    }
    fn read_pieces_unverified(&self, digest: &OciDigest, offset: u64, lens: &[usize], each: &mut dyn FnMut(usize, bytes::Bytes)) -> Result<(), FormatError> {
        (**self).read_pieces_unverified(digest, offset, lens, each)
    }
}

/// A source that wraps another and changes only some of its calls: counting, delaying,
/// failing or corrupting reads (fault injection in tests, byte counts in copies). Every
/// method not written forwards to [`Forward::inner`], except `read_range_unverified`,
/// which by default goes through the wrapper's own `read_at_unverified`, so a wrapper that
/// intercepts that sees every ranged read. Implementing `Forward` makes a `BlobSource`.
pub trait Forward: Send + Sync {
    /// The wrapped source.
    fn inner(&self) -> &dyn BlobSource;
    fn describe(&self) -> String {
        self.inner().describe()
    }
    fn resolve_tag(&self, tag: &str) -> Result<OciDigest, FormatError> {
        self.inner().resolve_tag(tag)
    }
    fn read_blob_unverified(&self, digest: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError> {
        self.inner().read_blob_unverified(digest, limit)
    }
    fn blob_size(&self, digest: &OciDigest) -> Result<u64, FormatError> {
        self.inner().blob_size(digest)
    }
    fn read_at_unverified(&self, digest: &OciDigest, offset: u64, buf: &mut [u8]) -> Result<(), FormatError> {
        self.inner().read_at_unverified(digest, offset, buf)
    }
    fn read_range_unverified(&self, digest: &OciDigest, offset: u64, len: usize) -> Result<bytes::Bytes, FormatError> {
        let mut buf = vec![0u8; len];
        Forward::read_at_unverified(self, digest, offset, &mut buf)?;
        Ok(buf.into())
    }
}

impl<T: Forward> BlobSource for T {
    fn describe(&self) -> String {
        Forward::describe(self)
    }
    fn resolve_tag(&self, tag: &str) -> Result<OciDigest, FormatError> {
        Forward::resolve_tag(self, tag)
    }
    fn read_blob_unverified(&self, digest: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError> {
        Forward::read_blob_unverified(self, digest, limit)
    }
    fn blob_size(&self, digest: &OciDigest) -> Result<u64, FormatError> {
        Forward::blob_size(self, digest)
    }
    fn read_at_unverified(&self, digest: &OciDigest, offset: u64, buf: &mut [u8]) -> Result<(), FormatError> {
        Forward::read_at_unverified(self, digest, offset, buf)
    }
    fn read_range_unverified(&self, digest: &OciDigest, offset: u64, len: usize) -> Result<bytes::Bytes, FormatError> {
        Forward::read_range_unverified(self, digest, offset, len)
    }
    /// Through the wrapper's own `read_range_unverified`, so a wrapper sees these reads too.
    fn read_pieces_unverified(&self, digest: &OciDigest, offset: u64, lens: &[usize], each: &mut dyn FnMut(usize, bytes::Bytes)) -> Result<(), FormatError> {
        split_pieces(Forward::read_range_unverified(self, digest, offset, lens.iter().sum())?, lens, each);
        Ok(())
    }
}

/// Stored pieces, sorted by blob and offset, cut into runs each read with one range
/// request. A run grows while the next piece is in the same blob, starts at most `max_gap`
/// bytes past the run's end (a gap small enough to read through), and keeps the run within
/// `max_range` bytes; a piece longer than that is a run of its own. `span` gives a piece's
/// blob number and byte range. Pull (gaps allowed) and verify's audit (none) share it.
pub fn coalesce_ranges<T>(items: &[T], span: impl Fn(&T) -> (u32, u64, u64), max_gap: u64, max_range: u64) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut run: Option<(usize, u32, u64, u64)> = None; // first item, blob, start, end
    for (i, item) in items.iter().enumerate() {
        let (blob, s, e) = span(item);
        if let Some((first, rblob, start, end)) = &mut run {
            // Sorted by offset, so `s >= start`.
            if *rblob == blob && s <= end.saturating_add(max_gap) && e.max(*end) - *start <= max_range {
                *end = e.max(*end);
                continue;
            }
            out.push(*first..i);
        }
        run = Some((i, blob, s, e));
    }
    if let Some((first, ..)) = run {
        out.push(first..items.len());
    }
    out
}

/// Small reads (configs, indexes, outboards, pack sizes) a reader keeps in flight at once.
/// Each costs a round trip and few bytes, so what bounds them is latency: at 8 a chain of
/// 64 ancestors at 20 ms RTT paid ~0.75 s of round trips in a verify (bench/chain.sh
/// --rtt 20); at 32 it pays 2 per kind of blob.
pub const SMALL_READS_IN_FLIGHT: usize = 32;

/// The shorter of two timed round trips to `src`: size queries of `blob` (a HEAD, for a
/// registry). The first may pay for a fresh connection; the second, on a kept-alive one,
/// is the round trip. `None` if the source does not answer (its reads will say why).
/// Pull and the lazy stream size their requests in flight from it.
pub fn round_trip(src: &dyn BlobSource, blob: &OciDigest) -> Option<std::time::Duration> {
    let mut best: Option<std::time::Duration> = None;
    for _ in 0..2 {
        let t = std::time::Instant::now();
        if src.blob_size(blob).is_err() {
            return best;
        }
        best = Some(best.map_or(t.elapsed(), |b| b.min(t.elapsed())));
    }
    best
}

/// One range read of `digest`, tried again under `policy` while the source says its
/// failure is transient (a registry still failing once its client's own retries are
/// spent). Other errors (a missing blob, a refused login, a range past the end) are
/// answers and are not retried. `on_try(again)` runs before each attempt, `again` true for
/// a retry (callers count requests and retries). The bytes are **unverified**.
pub fn read_range_retrying(
    src: &dyn BlobSource,
    digest: &OciDigest,
    offset: u64,
    len: usize,
    policy: crate::RetryPolicy,
    mut on_try: impl FnMut(bool),
) -> Result<bytes::Bytes, FormatError> {
    let mut retry = policy.start();
    let mut again = false;
    loop {
        on_try(again);
        match src.read_range_unverified(digest, offset, len) {
            Err(e) if e.is_transient() => {
                let Some(wait) = retry.failed(None) else { return Err(e) };
                std::thread::sleep(wait);
                again = true;
            }
            other => return other,
        }
    }
}

/// Stream blob `digest` (`size` bytes as stored) to `f` in pieces of at most 4 MiB, in
/// order. The pieces are **unverified**: the caller hashes what it sees and decides.
pub fn stream_blob_unverified<E: From<FormatError>>(
    src: &dyn BlobSource,
    digest: &OciDigest,
    size: u64,
    mut f: impl FnMut(&[u8]) -> Result<(), E>,
) -> Result<(), E> {
    let mut buf = vec![0u8; (4usize << 20).min(size as usize)];
    let mut off = 0u64;
    while off < size {
        let n = (size - off).min(buf.len() as u64) as usize;
        src.read_at_unverified(digest, off, &mut buf[..n])?;
        f(&buf[..n])?;
        off += n as u64;
    }
    Ok(())
}

/// Read a small metadata blob and check its OCI digest: what comes back is verified.
pub fn read_verified_blob(src: &dyn BlobSource, digest: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError> {
    let b = src.read_blob_unverified(digest, limit)?;
    let mut h = crate::digest::OciHasher::for_digest(digest);
    h.update(&b);
    let actual = h.finish();
    if &actual != digest {
        return Err(FormatError::BlobDigestMismatch { digest: digest.clone(), actual });
    }
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A source whose own range read answers differently from the default, so a wrapper
    /// that fell back to the default would be seen.
    struct OwnRanges;
    impl BlobSource for OwnRanges {
        fn describe(&self) -> String {
            "own".into()
        }
        fn resolve_tag(&self, _: &str) -> Result<OciDigest, FormatError> {
            Err(FormatError::invalid("tag", "no tags"))
        }
        fn read_blob_unverified(&self, _: &OciDigest, _: u64) -> Result<Vec<u8>, FormatError> {
            Ok(b"blob".to_vec())
        }
        fn blob_size(&self, _: &OciDigest) -> Result<u64, FormatError> {
            Ok(7)
        }
        fn read_at_unverified(&self, _: &OciDigest, _: u64, buf: &mut [u8]) -> Result<(), FormatError> {
            buf.fill(b'a');
            Ok(())
        }
        fn read_range_unverified(&self, _: &OciDigest, _: u64, len: usize) -> Result<bytes::Bytes, FormatError> {
            Ok(vec![b'r'; len].into())
        }
    }

    #[test]
    fn pieces_coalesce_into_runs_within_their_blob_gap_and_bound() {
        // (blob, start, end)
        let p = [(0u32, 0u64, 10u64), (0, 10, 20), (0, 25, 30), (0, 30, 100), (1, 100, 110), (1, 110, 300), (1, 300, 310)];
        let span = |x: &(u32, u64, u64)| *x;
        // No gap: 0..2 back to back; 25 is past 20; 30..100 would pass 40 from 25; blob 1:
        // 110..300 alone is longer than the bound.
        assert_eq!(coalesce_ranges(&p, span, 0, 40), vec![0..2, 2..3, 3..4, 4..5, 5..6, 6..7]);
        // A gap of 5 is read through; the bound still cuts.
        assert_eq!(coalesce_ranges(&p, span, 5, 40), vec![0..3, 3..4, 4..5, 5..6, 6..7]);
        assert_eq!(coalesce_ranges(&p, span, 5, 1000), vec![0..4, 4..7]);
        assert!(coalesce_ranges(&[] as &[(u32, u64, u64)], span, 0, 1).is_empty());
    }

    #[test]
    fn a_shared_source_forwards_every_method_to_its_own() {
        let d: OciDigest = format!("sha256:{}", "0".repeat(64)).parse().unwrap();
        let shared: Arc<dyn BlobSource> = Arc::new(OwnRanges);
        let outer = Arc::new(shared);
        assert_eq!(outer.describe(), "own");
        assert!(outer.resolve_tag("x").is_err());
        assert_eq!(outer.blob_size(&d).unwrap(), 7);
        assert_eq!(outer.read_blob_unverified(&d, 10).unwrap(), b"blob");
        let mut buf = [0u8; 3];
        outer.read_at_unverified(&d, 0, &mut buf).unwrap();
        assert_eq!(&buf, b"aaa");
        // The source's own range read, not the default built on read_at_unverified.
        assert_eq!(&outer.read_range_unverified(&d, 0, 3).unwrap()[..], b"rrr");
    }
}
