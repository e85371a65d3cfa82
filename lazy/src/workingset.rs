//! Working-set replay (as REAP does): the slices a recorded restore touched,
//! stored beside its trace as one blob, fetched in bulk when a later restore connects and
//! installed before the guest asks, each checked against the chunk's outboard first.
//!
//! ```text
//! trace.working_set = [file offsets of touched slices, first touch first]
//! working-set blob   = their bytes, in that order (the trace manifest's second layer)
//!   plan: offset -> (chunk, slice, length from the outboard), blob offsets summed
//!   RANGES_IN_FLIGHT readers: ranges of <= RANGE_BYTES of the blob, in order, each as the
//!     background's window (crate::pacing) has room for it, before the stream's requests
//!     -> verify::check_slice (entry merged to the chunk digest, slice CV) per slice
//!     -> Installer::install_slices (pages still missing, never over removed memory);
//!        in huge-page memory the slice's whole page instead, from verified chunks
//!     -> off the `Pending` set: a fault parked on the slice is woken by the install
//! ```
//! The blob is not trusted: a slice that fails its check is not installed, and a fault
//! on it takes the fault path (a verified fetch of its own). Nothing here holds a fault up
//! longer than its range's fetch.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use imgfmt::{BlobSource, Descriptor, Image, RetryPolicy};

use crate::install::Installer;
use crate::pacing::{Background, Class};
use crate::stats::End;
use crate::trace::Trace;

/// Bytes of the blob one request reads at most: small enough that the first ranges (the
/// first pages the guest touched) arrive early, large enough that a range costs much more
/// link time than its round trip.
pub const RANGE_BYTES: u64 = 1 << 20;
/// Requests in flight: 16 ranges of 1 MiB fill 1 Gbit/s at up to ~130 ms of round trip.
pub const RANGES_IN_FLIGHT: usize = 16;
/// A range that fails transiently is tried again this many times.
const RANGE_RETRY: RetryPolicy = RetryPolicy::attempts(3);

/// One slice of the working set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    chunk: u64,
    slice: u32,
    /// Its file offset (the key of [`Pending`]).
    at: u64,
    /// Where its bytes are in the blob, and how many.
    blob_at: u64,
    len: u64,
}

/// Where each listed slice's bytes are in the blob, checked against the image. Made once
/// per trace and shared by every connection that replays it.
#[derive(Debug, Clone)]
pub struct Plan {
    entries: Vec<Entry>,
    /// `None` when the trace lists zero chunks but no working set.
    blob: Option<Descriptor>,
    /// The trace: its zero chunks (those the recorded restore touched) are installed as
    /// zeros, nothing fetched.
    trace: Arc<Trace>,
}

impl Plan {
    /// Plan the replay of `trace`'s working set for file `file` of `image` (outboards
    /// loaded). `Ok(None)`: the trace has none. An offset that is not the start of a slice
    /// the outboard describes, one listed twice, or a blob whose size is not the sum of the
    /// slices': an error (the whole working set is refused; the restore goes on without).
    pub fn new(image: &Image, file: usize, trace: &Arc<Trace>) -> Result<Option<Plan>, String> {
        let chunks = &image.files[file].chunks;
        // The zero chunks are checked when replayed, by the fault path's own test
        // (`Fetcher::is_zero`).
        let blob = trace.working_set_blob.clone().filter(|_| !trace.working_set.is_empty());
        let Some(blob) = blob else {
            return Ok((!trace.zero_chunks.is_empty()).then(|| Plan { entries: Vec::new(), blob: None, trace: trace.clone() }));
        };
        let shift = image.chunk_shift();
        let n = chunks.len() as u64;
        let mut seen = HashSet::with_capacity(trace.working_set.len());
        let mut entries = Vec::with_capacity(trace.working_set.len());
        let mut blob_at = 0u64;
        for &at in &trace.working_set {
            let chunk = at >> shift;
            if chunk >= n {
                return Err(format!("working-set offset {at:#x} beyond the file"));
            }
            let cvs = image.slice_cvs(file, chunk).ok_or_else(|| format!("working-set offset {at:#x}: chunk {chunk} has no outboard entry"))?;
            let rel = at - (chunk << shift);
            if rel & (cvs.slice_size() - 1) != 0 || rel >= u64::from(cvs.chunk_len) {
                return Err(format!("working-set offset {at:#x} is not the start of a slice"));
            }
            if !seen.insert(at) {
                return Err(format!("working-set offset {at:#x} listed twice"));
            }
            let slice = (rel >> cvs.slice_shift) as u32;
            let r = cvs.slice_range(slice);
            entries.push(Entry { chunk, slice, at, blob_at, len: r.end - r.start });
            blob_at += r.end - r.start;
        }
        if blob_at != blob.size {
            return Err(format!("working-set blob {} is {} bytes, its slices {blob_at}", blob.digest, blob.size));
        }
        Ok(Some(Plan { entries, blob: Some(blob), trace: trace.clone() }))
    }

    pub fn slices(&self) -> usize {
        self.entries.len()
    }

    pub fn zero_chunks(&self) -> usize {
        self.trace.zero_chunks.len()
    }

    /// The entries in ranges of consecutive blob bytes of at most [`RANGE_BYTES`] (a slice
    /// larger than that is a range of its own).
    fn ranges(&self) -> Vec<std::ops::Range<usize>> {
        let mut out = Vec::new();
        let mut start = 0;
        for i in 0..self.entries.len() {
            let e = &self.entries[i];
            if i > start && e.blob_at + e.len - self.entries[start].blob_at > RANGE_BYTES {
                out.push(start..i);
                start = i;
            }
        }
        if start < self.entries.len() {
            out.push(start..self.entries.len());
        }
        out
    }
}

/// Working-set slices (file offsets) a replay is fetching: a fault on one waits for the
/// replay instead of fetching (the fault loop looks them up while the set is active).
/// One bit per 4 KiB of the memory file up to the last slice listed (working-set offsets
/// are slice starts, and slices are at least 4 KiB): a connection's share of a replay is
/// sized by the image, whatever the trace.
#[derive(Default)]
pub(crate) struct Pending {
    bits: Mutex<Vec<u64>>,
    active: AtomicBool,
    /// A replay is on its way or running ([`expect`](Pending::expect) until
    /// [`disarm`](Pending::disarm)).
    expected: AtomicBool,
}

/// The word and bit of file offset `at` in [`Pending`].
fn bit(at: u64) -> (usize, u64) {
    let i = at >> imgfmt::outboard::MIN_SLICE_SHIFT;
    ((i / 64) as usize, 1 << (i % 64))
}

impl Pending {
    /// Mark every slice of `plan` pending, so that faults on it wait for the replay
    /// instead of fetching: before the connection's fault loop reads its first fault.
    pub fn arm(&self, plan: &Plan) {
        let mut bits = self.bits.lock().expect("poisoned");
        for e in &plan.entries {
            let (w, b) = bit(e.at);
            if w >= bits.len() {
                bits.resize(w + 1, 0);
            }
            bits[w] |= b;
        }
        self.active.store(true, Ordering::Relaxed);
    }

    /// A replay is coming (its plan may still be on its way): until [`disarm`](Self::disarm),
    /// a fault's slice goes without its whole chunk beside it, as the working set carries
    /// the guest's next touches there.
    pub fn expect(&self) {
        self.expected.store(true, Ordering::Relaxed);
    }

    /// Whether a replay is coming or running.
    pub fn expected(&self) -> bool {
        self.expected.load(Ordering::Relaxed)
    }

    /// Undo [`arm`](Self::arm) and [`expect`](Self::expect): faults on the working set
    /// fetch for themselves.
    pub fn disarm(&self) {
        self.expected.store(false, Ordering::Relaxed);
        self.active.store(false, Ordering::Relaxed);
        *self.bits.lock().expect("poisoned") = Vec::new();
    }

    /// Whether a replay is running (faults then look their slice up).
    pub fn active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }

    /// Whether the slice at file offset `at` is still on its way.
    pub fn contains(&self, at: u64) -> bool {
        let (w, b) = bit(at);
        self.bits.lock().expect("poisoned").get(w).is_some_and(|x| x & b != 0)
    }

    fn done(&self, entries: &[Entry]) {
        let mut bits = self.bits.lock().expect("poisoned");
        for e in entries {
            let (w, b) = bit(e.at);
            if let Some(x) = bits.get_mut(w) {
                *x &= !b;
            }
        }
    }
}

/// Replay `plan` into `inst`'s process (`pending` armed with [`Pending::arm`]): every slice
/// stays pending until it is installed or given up. Returns when it was done, unless the
/// connection ended or `stop` was set first; `pending` is disarmed on the way out whatever
/// happened.
pub(crate) fn replay(
    inst: Arc<Installer>,
    pending: Arc<Pending>,
    plan: Arc<Plan>,
    src: Arc<dyn BlobSource>,
    bg: Arc<Background>,
    stop: Arc<AtomicBool>,
) -> Option<Instant> {
    struct Clear<'a>(&'a Pending);
    impl Drop for Clear<'_> {
        fn drop(&mut self) {
            self.0.disarm();
        }
    }
    let _clear = Clear(&pending);
    let ranges = plan.ranges();
    let next = AtomicUsize::new(0);
    let ended = || stop.load(Ordering::Relaxed) || inst.gone();
    // The probes run while the ranges are on their way.
    let wanting = plan.blob.is_some().then(|| bg.wanting());
    std::thread::scope(|s| {
        if let Some(blob) = &plan.blob {
            for _ in 0..RANGES_IN_FLIGHT.min(ranges.len()) {
                let spawned = std::thread::Builder::new().name("lazy-workingset".into()).spawn_scoped(s, || loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= ranges.len() || ended() {
                        return;
                    }
                    let entries = &plan.entries[ranges[i].clone()];
                    // A scavenger like the stream (before it): room in the background's
                    // window first. Given up, the slices take the fault path.
                    let len = entries.iter().map(|e| e.len).sum::<u64>();
                    let Some(permit) = bg.acquire(len, Class::Replay, &ended) else {
                        pending.done(entries);
                        continue;
                    };
                    replay_range(&inst, blob, entries, src.as_ref());
                    drop(permit);
                    pending.done(entries);
                });
                if spawned.is_err() {
                    break;
                }
            }
        }
        // While the ranges are on their way: the zero chunks, from here (no fetch).
        for &c in &plan.trace.zero_chunks {
            if ended() {
                break;
            }
            // Only where the image agrees the chunk is zero (a zero record with the digest
            // of zeros): a trace is a hint, never a source of bytes.
            if !matches!(inst.fetcher.is_zero(c), Ok(true)) {
                continue;
            }
            for span in inst.map.spans_of_chunk(c) {
                inst.prefetch_zero_span(&span);
            }
        }
    });
    drop(wanting);
    (!ended()).then(Instant::now)
}

/// Fetch one range of the blob, check each slice, install those that pass.
fn replay_range(inst: &Installer, blob: &Descriptor, entries: &[Entry], src: &dyn BlobSource) {
    let (first, last) = (entries[0], entries[entries.len() - 1]);
    let len = (last.blob_at + last.len - first.blob_at) as usize;
    let bytes = match imgfmt::source::read_range_retrying(src, &blob.digest, first.blob_at, len, RANGE_RETRY, |_| {}) {
        Ok(b) if b.len() == len => Some(b),
        Ok(b) => {
            tracing::warn!(
                "pid {}: working-set blob {}: {} bytes at {} instead of {len}; its slices take the fault path",
                inst.pid,
                blob.digest,
                b.len(),
                first.blob_at
            );
            None
        }
        Err(e) => {
            tracing::warn!("pid {}: working-set blob {}: {e}; its slices take the fault path", inst.pid, blob.digest);
            None
        }
    };
    if let Some(bytes) = bytes {
        inst.rec.add(|c| &c.ws_bytes, len as u64);
        let image = &inst.fetcher.image;
        let mut i = 0;
        // Slices of one chunk go in together (one install pass over its spans).
        while i < entries.len() {
            let chunk = entries[i].chunk;
            let mut verified = Vec::new();
            while i < entries.len() && entries[i].chunk == chunk {
                let e = entries[i];
                let piece = bytes.slice((e.blob_at - first.blob_at) as usize..(e.blob_at - first.blob_at + e.len) as usize);
                match verify::check_slice(image, inst.fetcher.file, chunk, e.slice, piece) {
                    Ok(v) => verified.push(v),
                    // The blob is a hint, not the image: a slice of it that fails its check
                    // is not installed, and the guest's touch there is served (verified) by
                    // the fault path. Nothing wrong reached the guest: a warning, counted
                    // apart from the image's own verification failures.
                    Err(err) => {
                        inst.rec.add(|c| &c.ws_rejected, 1);
                        tracing::warn!(
                            "pid {}: working-set blob {}: {err}; that slice is not installed (a fault there fetches it, verified)",
                            inst.pid,
                            blob.digest
                        );
                    }
                }
                i += 1;
            }
            if !verified.is_empty() {
                install(inst, chunk, &verified);
            }
        }
    }
}

/// Install verified slices from this (non-fault) thread: while the address space is
/// changing, wait for the fault thread to read the events, a while at most.
fn install(inst: &Installer, chunk: u64, slices: &[verify::VerifiedSlice]) {
    let t0 = Instant::now();
    let mut again = || {
        if t0.elapsed() > Duration::from_secs(1) || inst.gone() {
            return Err(End::Failed("the address space kept changing".to_string()));
        }
        std::thread::sleep(Duration::from_millis(1));
        Ok(())
    };
    let spans = inst.map.spans_of_chunk(chunk);
    if spans.iter().any(|s| inst.sliceable(s.region)) {
        match inst.install_slices(chunk, slices, &mut again) {
            Ok(()) => inst.rec.add(|c| &c.ws_slices, slices.len() as u64),
            Err(e) => tracing::debug!("pid {}: working-set slices of chunk {chunk} not installed: {e}", inst.pid),
        }
    }
    // A huge page is filled whole: where the chunk lies in huge-page memory, its slices
    // only say the guest touched it, and the whole page goes in from verified chunks (as
    // the stream installs it, counted as prefetched) before the slices leave the pending
    // set.
    for span in spans.iter().filter(|s| !inst.sliceable(s.region)) {
        inst.prefetch_span(span);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the fault loop looks up while a replay runs: every planned slice is pending
    /// once armed, leaves as its range is done, and nothing is pending once disarmed.
    #[test]
    fn pending_slices_are_armed_done_and_disarmed() {
        let entry = |at: u64| Entry { chunk: at >> 16, slice: ((at & 0xffff) >> 12) as u32, at, blob_at: 0, len: 4096 };
        let plan =
            Plan { entries: vec![entry(0x1000), entry(0x23000), entry(0x5f000)], blob: None, trace: Arc::new(Trace::new("vm.mem", 1 << 16, Vec::new())) };
        let p = Pending::default();
        assert!(!p.active() && !p.contains(0x1000));
        p.arm(&plan);
        assert!(p.active());
        assert!(p.contains(0x1000) && p.contains(0x23000) && p.contains(0x5f000));
        assert!(!p.contains(0x2000));
        p.done(&plan.entries[..2]);
        assert!(!p.contains(0x1000) && !p.contains(0x23000) && p.contains(0x5f000));
        p.disarm();
        assert!(!p.active() && !p.contains(0x5f000));
    }
}
