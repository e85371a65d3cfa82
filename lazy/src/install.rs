//! The installer: fetch -> verify -> install into one process's memory, for every caller
//! that fills it (the fault loop, the stream, the working-set replay, the CRIU push).
//!
//! ```text
//! span (a unit of the memory file in one region)
//!   zero chunk (true zero record)  ─────────────────────────► UFFDIO_ZEROPAGE
//!   removed by the guest           ─────────────────────────► zeros (that part only)
//!   data ─► Fetcher (memory / cache / source, verified) ────► UFFDIO_COPY (gaps only)
//!   verified slices of a chunk     ─────────────────────────► UFFDIO_COPY page by page
//!   no verified bytes              ─────────────────────────► UFFDIO_POISON
//! ```
//!
//! One lock (`State`) is held across an install, so a remove event cannot slip in between
//! deciding what to fill and filling it; the installer never reads events itself. Where an
//! ioctl says the address space is changing (`EAGAIN`), the caller's `again` is asked what to
//! do: the fault loop reads the pending events, other threads wait for it to. Only verified
//! bytes ([`VerifiedChunk`], [`VerifiedSlice`]) are ever copied in.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use nix::errno::Errno;
use userfaultfd::Uffd;
use verify::{VerifiedChunk, VerifiedSlice};

use crate::fetch::{FetchFailure, Fetcher, Origin, Work};
use crate::map::{MemoryMap, RemovedRanges, Span};
use crate::record::Recording;
use crate::stats::{Counters, End, Rec};
use crate::uffdio::{Fill, Op, Uffdio};

/// What an installer does when the address space is changing: `Ok` to try again, `Err` to
/// give up (the connection's end, or a reason the caller logs).
pub(crate) type Again<'a> = &'a mut dyn FnMut() -> Result<(), End>;

/// The bytes a span needs, all verified.
enum SpanData {
    Zero,
    Chunk(Arc<VerifiedChunk>, usize),
    Owned(Vec<u8>),
}

impl SpanData {
    fn bytes(&self, len: usize) -> Option<&[u8]> {
        match self {
            SpanData::Zero => None,
            SpanData::Chunk(c, off) => Some(&c.as_bytes()[*off..*off + len]),
            SpanData::Owned(v) => Some(&v[..len]),
        }
    }
}

/// What has been put into the process's memory, behind the installer's one lock.
#[derive(Default)]
struct State {
    removed: RemovedRanges,
    /// (region, unit) installed whole since the last remove touching it.
    installed: HashSet<(usize, u64)>,
    /// Host pages installed from verified slices (their unit is not whole), since the last
    /// remove touching them.
    slice_pages: HashSet<u64>,
    poisoned: HashSet<(usize, u64)>,
    /// Pages outside every region poisoned by a fault (counted once, not again by
    /// `poison_range`).
    outside_poisoned: HashSet<u64>,
    /// With --record-trace.
    recording: Recording,
}

impl State {
    fn settled(&self, span: &Span) -> bool {
        self.installed.contains(&(span.region, span.unit)) || self.poisoned.contains(&(span.region, span.unit))
    }
}

/// What a fault outside every region gets.
#[derive(Debug, Clone, Default)]
pub(crate) struct Outside {
    /// Zeros (CRIU: registered memory no pagemap entry holds is zero-filled, as
    /// `criu lazy-pages` does with UFFDIO_ZEROPAGE). Otherwise poison (Firecracker: memory
    /// the VMM did not describe has no right content).
    pub zero: bool,
    /// Sorted `[start, end)` ranges that are poisoned even with `zero` (CRIU pages in a
    /// parent dump, which this server cannot read).
    pub poison: Vec<(u64, u64)>,
    /// Count pages poisoned here in `poisoned_pages` (CRIU; the Firecracker path only logs).
    pub count: bool,
}

impl Outside {
    fn poisons(&self, addr: u64) -> bool {
        let i = self.poison.partition_point(|r| r.0 <= addr);
        !self.zero || (i > 0 && addr < self.poison[i - 1].1)
    }
}

/// How pushing one span ahead of the process went (CRIU: after the restore finished).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pushed {
    /// Installed, poisoned, zero or no longer mapped: nothing left to do for it.
    Done,
    /// The address space is changing: try again later.
    Again,
    /// The process's memory is gone.
    Gone,
    /// An ioctl failed in a way that leaves the span unresolved (logged).
    Stuck,
}

/// How a fault was resolved, for its counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Zero,
    Removed,
    CacheHit,
    Fetched,
    /// Already installed (another vCPU, the prefetcher), or installed from slices.
    Present,
    /// The span was poisoned before: the fault was already answered.
    Poisoned,
}

/// Fetches the fault loop's pool made for the faults being served: a chunk's outcome is
/// consumed by the first fault served on it.
#[derive(Default)]
pub(crate) struct Arrivals {
    pub origin: std::collections::HashMap<u64, Origin>,
    pub failed: std::collections::HashMap<u64, FetchFailure>,
}

/// Fills one process's registered memory (a VMM's guest memory, or a CRIU task's).
pub(crate) struct Installer {
    pub pid: i32,
    pub io: Uffdio,
    pub map: MemoryMap,
    pub fetcher: Arc<Fetcher>,
    pub rec: Rec,
    state: Mutex<State>,
    /// Record the chunks, working set and zero chunks the guest touches (`--record-trace`).
    pub record_trace: bool,
    /// Faults outside every region: poison (the default) or zeros.
    pub outside: Outside,
    /// Set once the process's memory is gone or the connection ended: other threads stop.
    gone: AtomicBool,
}

impl Installer {
    pub fn new(pid: i32, uffd: Uffd, map: MemoryMap, fetcher: Arc<Fetcher>, rec: Rec, record_trace: bool) -> Installer {
        Installer {
            pid,
            io: Uffdio::new(uffd),
            map,
            fetcher,
            rec,
            state: Mutex::new(State::default()),
            record_trace,
            outside: Outside::default(),
            gone: AtomicBool::new(false),
        }
    }

    /// An installer for a child this one's process forked: the same memory layout and
    /// chunks, the same policy outside the regions, and the parent's removed ranges (they
    /// are missing in the child too and must stay zeros). Nothing is installed in the child
    /// as far as it knows: pages the parent had are present in the child, and installing
    /// them again gets EEXIST, which is skipped.
    pub fn child(&self, uffd: Uffd, conn: Arc<Counters>) -> Installer {
        let mut c = Installer::new(self.pid, uffd, self.map.clone(), self.fetcher.clone(), Rec(conn, self.rec.1.clone()), false);
        c.outside = self.outside.clone();
        c.state.lock().expect("poisoned").removed = self.state.lock().expect("poisoned").removed.clone();
        c
    }

    /// Whether the process's memory is gone or the connection ended.
    pub fn gone(&self) -> bool {
        self.gone.load(Ordering::Relaxed)
    }

    pub fn set_gone(&self) {
        self.gone.store(true, Ordering::Relaxed);
    }

    /// What was recorded (with --record-trace), leaving it empty.
    pub fn take_recording(&self) -> Recording {
        std::mem::take(&mut self.state.lock().expect("poisoned").recording)
    }

    /// The page size at `addr`: its region's, or the system's outside every region.
    pub fn page_at(&self, addr: u64) -> u64 {
        self.map.span_at(addr).map(|s| self.map.regions[s.region].page_size).unwrap_or(self.io.sys_page())
    }

    pub fn account(&self, w: &Work) {
        self.rec.add(|c| &c.bytes_fetched, w.bytes_fetched);
        self.rec.add(|c| &c.slice_bytes, w.slice_bytes);
        self.rec.add(|c| &c.retries, w.retries);
        self.rec.add(|c| &c.verify_failures, w.verify_failures);
    }

    /// Apply a remove (or unmap) event: the range reads as zeros from now on.
    pub fn removed(&self, start: u64, end: u64) {
        let mut st = self.state.lock().expect("poisoned");
        st.removed.insert(start, end);
        for u in self.map.units_touching(start, end) {
            st.installed.remove(&u);
        }
        if !st.slice_pages.is_empty() {
            st.slice_pages.retain(|&p| p < start || p >= end);
        }
        self.rec.add(|c| &c.removed_ranges, 1);
    }

    /// Fill a span with `data` where the guest has not removed memory and with zeros where
    /// it has, under the state lock. On `Again` the caller reads events and calls again.
    fn install(&self, st: &mut State, span: &Span, data: &SpanData) -> Result<(), Fill> {
        let page = self.map.regions[span.region].page_size;
        for (removed, a, b) in st.removed.split(span.host, span.host + span.len) {
            let bytes = data.bytes(span.len as usize).map(|d| &d[(a - span.host) as usize..(b - span.host) as usize]);
            match (removed, bytes) {
                (false, Some(d)) => self.io.fill(Op::Copy(d), a, b - a, page)?,
                _ => self.io.fill_zeros(a, b, page)?,
            }
        }
        st.installed.insert((span.region, span.unit));
        Ok(())
    }

    /// Fill only the removed parts of a span with zeros (a fault in memory the guest gave
    /// back). The rest of the span still holds snapshot data the guest may read later, so it
    /// is left for a fault or the prefetcher to fill with that data, never with zeros.
    fn install_removed(&self, st: &State, span: &Span) -> Result<(), Fill> {
        let page = self.map.regions[span.region].page_size;
        for (removed, a, b) in st.removed.split(span.host, span.host + span.len) {
            if removed {
                self.io.fill_zeros(a, b, page)?;
            }
        }
        Ok(())
    }

    /// The verified bytes of a span (assembled from several chunks for huge pages).
    /// `stream`: the stream asks (its fetches wait for room in the cache's queue).
    fn span_data(&self, span: &Span, work: &mut Work, arrived: &mut Arrivals, stream: bool) -> Result<(SpanData, Option<Origin>), FetchFailure> {
        let shift = self.map.chunk_shift;
        let chunks = span.chunks(shift);
        let mut origin = None;
        let mut got = Vec::new();
        for c in chunks.clone() {
            if self.fetcher.is_zero(c)? {
                got.push((c, None));
                continue;
            }
            if let Some(f) = arrived.failed.remove(&c) {
                return Err(f);
            }
            let (o, mut from, w) = if stream { self.fetcher.get_background(c) } else { self.fetcher.get(c) };
            if let Some(o) = arrived.origin.remove(&c) {
                // Fetched by the pool for this fault: it counts as this fault's fetch.
                from = o;
            }
            work.bytes_fetched += w.bytes_fetched;
            work.retries += w.retries;
            work.verify_failures += w.verify_failures;
            origin = Some(if from == Origin::Fetched || origin == Some(Origin::Fetched) { Origin::Fetched } else { Origin::Cache });
            got.push((c, Some(o?)));
        }
        if got.iter().all(|(_, d)| d.is_none()) {
            return Ok((SpanData::Zero, None));
        }
        if got.len() == 1 {
            let (c, d) = got.pop().expect("one");
            return Ok((SpanData::Chunk(d.expect("not zero"), (span.file_offset - (c << shift)) as usize), origin));
        }
        let mut buf = vec![0u8; span.len as usize];
        for (c, d) in got {
            if let Some(d) = d {
                let (c0, c1) = (c << shift, (c << shift) + d.len() as u64);
                let (a, b) = (c0.max(span.file_offset), c1.min(span.file_offset + span.len));
                buf[(a - span.file_offset) as usize..(b - span.file_offset) as usize].copy_from_slice(&d.as_bytes()[(a - c0) as usize..(b - c0) as usize]);
            }
        }
        Ok((SpanData::Owned(buf), origin))
    }

    /// The chunks a fault at `addr` needs from the cache or the source that are not in
    /// memory yet (empty: it can be served right away). `waited_on(c)`: the fault loop's
    /// pool is fetching chunk `c` for a waiting fault.
    pub fn chunks_to_fetch(&self, addr: u64, waited_on: impl Fn(u64) -> bool) -> Vec<u64> {
        let Some(span) = self.map.span_at(addr) else { return Vec::new() };
        let page = self.map.regions[span.region].page_size;
        {
            let st = self.state.lock().expect("poisoned");
            if st.removed.contains(addr & !(page - 1)) || st.poisoned.contains(&(span.region, span.unit)) {
                return Vec::new();
            }
        }
        // A chunk the pool is fetching for a parked fault may already be in memory: this
        // fault still waits behind that one, so the fetch is counted once, for the first.
        span.chunks(self.map.chunk_shift).filter(|&c| !matches!(self.fetcher.is_zero(c), Ok(true)) && (!self.fetcher.has_recent(c) || waited_on(c))).collect()
    }

    /// Resolve a fault at `addr` in `span`: removed memory gets zeros, a poisoned span
    /// nothing more, anything else its verified bytes (or poison, when there are none).
    /// `arrived`: what the pool fetched for it. The faulting page is woken. `Some(kind)`:
    /// count the fault so; `None`: it was poisoned or left unresolved (logged).
    pub fn fault(&self, span: &Span, addr: u64, arrived: &mut Arrivals, again: Again) -> Result<Option<Kind>, End> {
        let page = self.map.regions[span.region].page_size;
        let fault_page = addr & !(page - 1);
        let mut work = Work::default();
        let result = loop {
            {
                let st = self.state.lock().expect("poisoned");
                if st.removed.contains(fault_page) {
                    match self.install_removed(&st, span) {
                        Ok(()) => break Ok(Kind::Removed),
                        Err(Fill::Again) => {}
                        Err(e) => break Err(e),
                    }
                    drop(st);
                    again()?;
                    continue;
                }
                if st.poisoned.contains(&(span.region, span.unit)) {
                    break Ok(Kind::Poisoned);
                }
            }
            let data = match self.span_data(span, &mut work, arrived, false) {
                Ok(d) => d,
                Err(failure) => {
                    self.account(&work);
                    self.poison(span, &failure, again)?;
                    return Ok(None);
                }
            };
            let mut st = self.state.lock().expect("poisoned");
            let known = st.installed.contains(&(span.region, span.unit));
            if known {
                // Another vCPU's fault or the prefetcher filled this span: the page is
                // most likely present, and trying it alone costs one ioctl.
                let one = match data.0.bytes(span.len as usize) {
                    Some(b) => {
                        let o = (fault_page - span.host) as usize;
                        Op::Copy(&b[o..o + page as usize])
                    }
                    None => self.io.zero_op(page),
                };
                match self.io.try_once(one, fault_page, page) {
                    Err(Errno::EEXIST) => break Ok(Kind::Present),
                    Err(Errno::EAGAIN) => {
                        drop(st);
                        again()?;
                        continue;
                    }
                    _ => {}
                }
            }
            if self.record_trace {
                Self::record_chunks(&mut st, span, self.map.chunk_shift, data.0.bytes(0).is_none());
            }
            if let Some(b) = self.record_working_set(&mut st, span, &data.0, fault_page, page) {
                // Recording a working set: only the faulting page is installed, so every
                // page the guest touches faults once and is recorded (the chunk stays in
                // recent memory for the next one).
                match self.io.fill(Op::Copy(b), fault_page, page, page) {
                    Ok(()) => {
                        st.slice_pages.insert(fault_page);
                        break Ok(if data.1 == Some(Origin::Fetched) { Kind::Fetched } else { Kind::CacheHit });
                    }
                    Err(Fill::Again) => {
                        drop(st);
                        again()?;
                        continue;
                    }
                    Err(e) => break Err(e),
                }
            }
            match self.install(&mut st, span, &data.0) {
                Ok(()) => {
                    break Ok(match data.1 {
                        None => Kind::Zero,
                        Some(Origin::Cache) => Kind::CacheHit,
                        Some(Origin::Fetched) => Kind::Fetched,
                    })
                }
                Err(Fill::Again) => {
                    drop(st);
                    again()?;
                }
                Err(e) => break Err(e),
            }
        };
        self.account(&work);
        // Pages filled by someone else were not woken by our ioctls.
        self.io.wake(fault_page, page);
        self.fault_outcome(span, result)
    }

    /// Records `span`'s chunks in the trace: as zero chunks when its data is zeros (`zero`).
    fn record_chunks(st: &mut State, span: &Span, chunk_shift: u8, zero: bool) {
        for c in span.chunks(chunk_shift) {
            if zero {
                st.recording.zero_chunks.add(c);
            } else {
                st.recording.chunks.add(c);
            }
        }
    }

    /// The fault's outcome from its install loop's result: a kind, unresolved (logged), or the VMM's end.
    fn fault_outcome(&self, span: &Span, result: Result<Kind, Fill>) -> Result<Option<Kind>, End> {
        match result {
            Ok(kind) => Ok(Some(kind)),
            Err(Fill::Gone) => Err(End::VmmGone),
            Err(Fill::Unmapped) => Ok(None),
            Err(Fill::Again) => unreachable!("retried above"),
            Err(Fill::Failed(e)) => {
                tracing::warn!("pid {}: installing {:#x}+{:#x} failed: {e}; the fault stays unresolved", self.pid, span.host, span.len);
                Ok(None)
            }
        }
    }

    /// A fault at `addr` outside every region: zeros or poison by the [`Outside`] policy.
    /// `Some(Kind::Zero)`: zero-filled (and woken); `None`: poisoned or left unresolved.
    pub fn fault_outside(&self, addr: u64, again: Again) -> Result<Option<Kind>, End> {
        let sys_page = self.io.sys_page();
        let p = addr & !(sys_page - 1);
        if self.outside.poisons(addr) {
            // Registered memory the VMM did not describe: there is no right content for
            // it, so the vCPU gets a memory error rather than a hang or made-up bytes.
            tracing::warn!("pid {}: fault at {addr:#x} outside every region; poisoning the page", self.pid);
            let mut st = self.state.lock().expect("poisoned");
            if self.io.fill(Op::Poison, p, sys_page, sys_page).is_ok() && self.outside.count && st.outside_poisoned.insert(p) {
                self.rec.add(|c| &c.poisoned_pages, 1);
            }
            return Ok(None);
        }
        // CRIU: memory no pagemap entry holds, or an entry that is not present, is
        // zero-filled.
        let mut kind = None;
        loop {
            match self.io.fill(Op::Zero, p, sys_page, sys_page) {
                Ok(()) => {
                    kind = Some(Kind::Zero);
                    break;
                }
                Err(Fill::Again) => again()?,
                Err(Fill::Gone) => return Err(End::ProcessGone),
                Err(Fill::Unmapped) => break,
                Err(Fill::Failed(e)) => {
                    tracing::warn!("pid {}: zero-filling {p:#x} failed: {e}; the fault stays unresolved", self.pid);
                    break;
                }
            }
        }
        self.io.wake(p, sys_page);
        Ok(kind)
    }

    /// No verified bytes for this span: poison it so the guest gets a memory error, never
    /// wrong data. Removed parts of the span still get zeros (they need no snapshot data).
    pub fn poison(&self, span: &Span, failure: &FetchFailure, again: Again) -> Result<(), End> {
        tracing::error!("pid {}: {failure}: POISONING guest memory {:#x}+{:#x} (file offset {:#x})", self.pid, span.host, span.len, span.file_offset);
        let page = self.map.regions[span.region].page_size;
        loop {
            let mut st = self.state.lock().expect("poisoned");
            let mut poisoned = 0;
            let mut res = Ok(());
            for (removed, a, b) in st.removed.split(span.host, span.host + span.len) {
                res = if removed { self.io.fill_zeros(a, b, page) } else { self.io.fill(Op::Poison, a, b - a, page) };
                if res.is_err() {
                    break;
                }
                if !removed {
                    // Pages installed from verified slices keep their bytes (EEXIST).
                    let kept = if st.slice_pages.is_empty() { 0 } else { st.slice_pages.iter().filter(|&&p| p >= a && p < b).count() as u64 };
                    poisoned += (b - a) / page - kept;
                }
            }
            match res {
                Ok(()) => {
                    st.poisoned.insert((span.region, span.unit));
                    self.rec.add(|c| &c.poisoned_pages, poisoned);
                    return Ok(());
                }
                Err(Fill::Again) => {
                    drop(st);
                    again()?;
                }
                Err(Fill::Gone) => return Err(End::VmmGone),
                Err(e) => {
                    // No poison on this kernel: leaving the fault unresolved stalls the
                    // vCPU, which is still better than handing it bytes we could not verify.
                    tracing::error!("pid {}: UFFDIO_POISON failed ({e:?}); the faulting vCPU stays stalled", self.pid);
                    st.poisoned.insert((span.region, span.unit));
                    return Ok(());
                }
            }
        }
    }

    /// With --record-trace, where the working set can be recorded by slice (a raw chunk
    /// with an outboard entry, pages no larger than a slice, one chunk per unit): record
    /// the slice the fault's page lies in (once) and return that page's bytes, the only
    /// ones to install. `None`: install the whole unit as usual.
    fn record_working_set<'d>(&self, st: &mut State, span: &Span, data: &'d SpanData, fault_page: u64, page: u64) -> Option<&'d [u8]> {
        if !self.record_trace || self.map.unit_size(span.region) != self.map.chunk_size() {
            return None;
        }
        let SpanData::Chunk(chunk, off) = data else { return None };
        let fo = span.file_offset + (fault_page - span.host);
        let c = fo >> self.map.chunk_shift;
        let cvs = self.fetcher.image.slice_cvs(self.fetcher.file, c)?;
        if page > cvs.slice_size() {
            return None;
        }
        let r = cvs.slice_range(((fo - (c << self.map.chunk_shift)) >> cvs.slice_shift) as u32);
        let bytes = chunk.as_bytes();
        let o = off + (fault_page - span.host) as usize;
        let here = bytes.get(o..o + page as usize)?;
        let slice = bytes.get(r.start as usize..r.end as usize)?;
        st.recording.slice((c << self.map.chunk_shift) + r.start, slice);
        Some(here)
    }

    /// File offset of the outboard slice holding `addr` (`None`: no slices there).
    pub fn slice_at(&self, addr: u64) -> Option<u64> {
        let (_, off) = self.map.locate(addr)?;
        let cvs = self.fetcher.image.slice_cvs(self.fetcher.file, off >> self.map.chunk_shift)?;
        Some(off & !(cvs.slice_size() - 1))
    }

    /// Whether the page of `addr` was installed from slices (and not removed since).
    pub fn slice_installed(&self, addr: u64) -> bool {
        let Some(span) = self.map.span_at(addr) else { return false };
        let page = self.map.regions[span.region].page_size;
        let st = self.state.lock().expect("poisoned");
        !st.slice_pages.is_empty() && st.slice_pages.contains(&(addr & !(page - 1)))
    }

    /// Whether slices can be installed in region `region`: its pages are no larger than
    /// the system's base page. A huge page is filled whole or not at all, so slices there
    /// are never installed (callers fill such spans whole: [`Installer::prefetch_span`]).
    pub fn sliceable(&self, region: usize) -> bool {
        self.map.regions[region].page_size <= self.io.sys_page()
    }

    /// Install verified slices of chunk `c` wherever the process maps them, page by page
    /// where pages are missing (pages already present are skipped), never over memory the
    /// guest removed (a fault there gets zeros). The unit is not marked installed. Spans in
    /// huge-page regions are left alone ([`Installer::sliceable`]).
    pub fn install_slices(&self, c: u64, slices: &[VerifiedSlice], again: Again) -> Result<(), End> {
        let base = c << self.map.chunk_shift;
        for span in self.map.spans_of_chunk(c) {
            if !self.sliceable(span.region) {
                continue;
            }
            let page = self.map.regions[span.region].page_size;
            'again: loop {
                let mut st = self.state.lock().expect("poisoned");
                if st.settled(&span) {
                    break;
                }
                if self.record_trace {
                    st.recording.chunks.add(c);
                    // Slices a fault fetched are pages the guest touched (or pending faults
                    // near them): part of the working set.
                    for sl in slices {
                        st.recording.slice(base + sl.offset_in_chunk(), sl.as_bytes());
                    }
                }
                for sl in slices {
                    let (f0, f1) = (base + sl.offset_in_chunk(), base + sl.offset_in_chunk() + sl.len() as u64);
                    let (a, b) = (f0.max(span.file_offset), f1.min(span.file_offset + span.len));
                    if a >= b {
                        continue;
                    }
                    let (ha, hb) = (span.host + (a - span.file_offset), span.host + (b - span.file_offset));
                    for (removed, x, y) in st.removed.split(ha, hb) {
                        if removed {
                            continue;
                        }
                        let from = (a - f0 + (x - ha)) as usize;
                        match self.io.fill(Op::Copy(&sl.as_bytes()[from..from + (y - x) as usize]), x, y - x, page) {
                            Ok(()) => st.slice_pages.extend((x..y).step_by(page as usize)),
                            Err(Fill::Unmapped) => {}
                            Err(Fill::Again) => {
                                drop(st);
                                again()?;
                                continue 'again;
                            }
                            Err(Fill::Gone) => return Err(End::VmmGone),
                            Err(Fill::Failed(e)) => {
                                tracing::warn!("pid {}: installing {x:#x}+{:#x} failed: {e}; faults there stay unresolved", self.pid, y - x)
                            }
                        }
                    }
                }
                break;
            }
        }
        Ok(())
    }

    /// Install one span ahead of the process, or poison it when no verified bytes can be
    /// had, so that nothing of it is left for the kernel to zero-fill once the userfaultfd
    /// is closed. Zero chunks are left alone: a zero-fill is their right content. Never
    /// reads events (the fault thread does): `Again` means retry later.
    pub fn push_span(&self, span: &Span) -> Pushed {
        if self.state.lock().expect("poisoned").settled(span) {
            return Pushed::Done;
        }
        let mut work = Work::default();
        let data = self.span_data(span, &mut work, &mut Arrivals::default(), true);
        self.account(&work);
        let page = self.map.regions[span.region].page_size;
        let data = match data {
            Ok((d, _)) => d,
            Err(failure) => {
                let mut st = self.state.lock().expect("poisoned");
                if st.poisoned.contains(&(span.region, span.unit)) {
                    return Pushed::Done;
                }
                tracing::error!("pid {}: {failure}: POISONING memory {:#x}+{:#x} (file offset {:#x})", self.pid, span.host, span.len, span.file_offset);
                let mut poisoned = 0;
                for (removed, a, b) in st.removed.split(span.host, span.host + span.len) {
                    if removed {
                        continue;
                    }
                    match self.io.fill(Op::Poison, a, b - a, page) {
                        Ok(()) => poisoned += (b - a) / page,
                        Err(Fill::Unmapped) => {}
                        Err(Fill::Again) => return Pushed::Again,
                        Err(Fill::Gone) => return Pushed::Gone,
                        Err(Fill::Failed(e)) => {
                            tracing::error!("pid {}: UFFDIO_POISON failed ({e}); {:#x}+{:#x} stays unresolved", self.pid, a, b - a);
                            return Pushed::Stuck;
                        }
                    }
                }
                st.poisoned.insert((span.region, span.unit));
                self.rec.add(|c| &c.poisoned_pages, poisoned);
                return Pushed::Done;
            }
        };
        let Some(bytes) = data.bytes(span.len as usize) else { return Pushed::Done };
        let mut st = self.state.lock().expect("poisoned");
        if st.installed.contains(&(span.region, span.unit)) {
            return Pushed::Done;
        }
        let mut done = 0;
        for (removed, a, b) in st.removed.split(span.host, span.host + span.len) {
            if removed {
                continue;
            }
            match self.io.fill(Op::Copy(&bytes[(a - span.host) as usize..(b - span.host) as usize]), a, b - a, page) {
                Ok(()) => done += b - a,
                Err(Fill::Unmapped) => {}
                Err(Fill::Again) => return Pushed::Again,
                Err(Fill::Gone) => return Pushed::Gone,
                Err(Fill::Failed(e)) => {
                    tracing::error!("pid {}: installing {a:#x}+{:#x} failed: {e}; it stays unresolved", self.pid, b - a);
                    return Pushed::Stuck;
                }
            }
        }
        st.installed.insert((span.region, span.unit));
        self.rec.add(|c| &c.prefetched_chunks, 1);
        self.rec.add(|c| &c.prefetched_bytes, done);
        Pushed::Done
    }

    /// Poison `[start, end)` outside the parts the process removed (CRIU pages in a parent
    /// dump: no verified bytes exist for them here). Never reads events.
    pub fn poison_range(&self, start: u64, end: u64) -> Pushed {
        let mut st = self.state.lock().expect("poisoned");
        let page = self.io.sys_page();
        let mut poisoned = 0;
        let parts = st.removed.split(start, end);
        for (removed, a, b) in parts {
            if removed {
                continue;
            }
            match self.io.fill(Op::Poison, a, b - a, page) {
                // Each page counts once, whoever poisons it first: a fault on one of these
                // pages may be served (and counted) before or after this push.
                Ok(()) => poisoned += (a..b).step_by(page as usize).filter(|&p| st.outside_poisoned.insert(p)).count() as u64,
                Err(Fill::Unmapped) => {}
                Err(Fill::Again) => return Pushed::Again,
                Err(Fill::Gone) => return Pushed::Gone,
                Err(Fill::Failed(e)) => {
                    tracing::error!("pid {}: UFFDIO_POISON failed ({e}); {a:#x}+{:#x} stays unresolved", self.pid, b - a);
                    return Pushed::Stuck;
                }
            }
        }
        self.rec.add(|c| &c.poisoned_pages, poisoned);
        Pushed::Done
    }

    /// Install a span of a zero chunk ahead of the guest (a recorded working set's zero
    /// chunks: no fetch, and a fault saved per page the guest touches there). Skips spans
    /// already installed or being changed, never fills removed memory (it reads as zeros
    /// anyway).
    pub fn prefetch_zero_span(&self, span: &Span) {
        let mut st = self.state.lock().expect("poisoned");
        if st.settled(span) {
            return;
        }
        let page = self.map.regions[span.region].page_size;
        for (removed, a, b) in st.removed.split(span.host, span.host + span.len) {
            if !removed && self.io.fill_zeros(a, b, page).is_err() {
                return;
            }
        }
        st.installed.insert((span.region, span.unit));
    }

    /// Whether chunk `c` still has a span to install (not every one installed or poisoned).
    pub fn chunk_pending(&self, c: u64) -> bool {
        let st = self.state.lock().expect("poisoned");
        self.map.spans_of_chunk(c).iter().any(|s| !st.settled(s))
    }

    /// Prefetch `run`'s chunks (each adjacent to the one before in its pack: see
    /// [`Fetcher::adjacent`]) with one range request per stretch not held elsewhere, then
    /// install their spans as [`prefetch_span`](Self::prefetch_span) does, calling
    /// `fetched` in between (when the run's bytes have arrived). A chunk the fetch refused
    /// is not installed (a fault there takes the fault path). Bytes installed, and chunks
    /// that had bytes installed.
    pub fn prefetch_run(&self, run: &[u64], fetched: impl FnOnce()) -> (u64, u64) {
        let mut refused = Vec::new();
        if !self.gone() {
            let work = match run {
                [c] if matches!(self.fetcher.is_zero(*c), Ok(false)) => {
                    let (outcome, _, work) = self.fetcher.get_background(*c);
                    if outcome.is_err() {
                        // Refused or given up: not installed here (installing would fetch
                        // it again); a fault there takes the fault path's fetch.
                        self.account(&work);
                        fetched();
                        return (0, 0);
                    }
                    work
                }
                [_] => Work::default(),
                _ => {
                    let (work, r) = self.fetcher.get_background_run(run);
                    refused = r;
                    work
                }
            };
            self.account(&work);
        }
        // The bytes are off the link: installing them uses none of it.
        fetched();
        let (mut bytes, mut chunks) = (0, 0);
        // A chunk the run's fetch refused is not installed here either: installing would
        // fetch it again, and a fault there takes the fault path's fetch.
        for &c in run.iter().filter(|c| !refused.contains(c)) {
            let mut b = 0;
            for span in self.map.spans_of_chunk(c) {
                if self.gone() {
                    break;
                }
                b += self.prefetch_span(&span);
            }
            bytes += b;
            chunks += u64::from(b > 0);
        }
        (bytes, chunks)
    }

    /// Install one span ahead of the guest (prefetch). Returns the bytes installed; skips
    /// spans already installed, poisoned, or being changed (the fault path serves those).
    pub fn prefetch_span(&self, span: &Span) -> u64 {
        if self.state.lock().expect("poisoned").settled(span) {
            return 0;
        }
        let mut work = Work::default();
        let data = self.span_data(span, &mut work, &mut Arrivals::default(), true);
        self.account(&work);
        let Ok((data, _)) = data else { return 0 };
        if data.bytes(0).is_none() {
            return 0;
        }
        if self.record_trace {
            // Recording a working set: the chunk is in recent memory now, and the guest's
            // own faults install it page by page (installing it here would hide them).
            return span.len;
        }
        let mut st = self.state.lock().expect("poisoned");
        if st.installed.contains(&(span.region, span.unit)) {
            return 0;
        }
        let page = self.map.regions[span.region].page_size;
        let mut done = 0;
        for (removed, a, b) in st.removed.split(span.host, span.host + span.len) {
            if removed {
                continue;
            }
            let d = &data.bytes(span.len as usize).expect("data")[(a - span.host) as usize..(b - span.host) as usize];
            match self.io.fill(Op::Copy(d), a, b - a, page) {
                Ok(()) => done += b - a,
                Err(Fill::Gone) => {
                    self.set_gone();
                    return done;
                }
                Err(_) => return done,
            }
        }
        st.installed.insert((span.region, span.unit));
        self.rec.add(|c| &c.prefetched_chunks, 1);
        self.rec.add(|c| &c.prefetched_bytes, done);
        done
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsRawFd, FromRawFd};
    use std::sync::atomic::Ordering::SeqCst;
    use std::time::Duration;

    use super::*;
    use crate::fetch::tests::sample_image;
    use crate::fetch::{RetryPolicy, SliceFetch};
    use crate::handshake::Region;
    use crate::tests::{flaky, resident, with_outboards, Guest};

    const K64: usize = 64 << 10;

    /// An installer over `guest`'s one region (the whole memory file at 64 KiB chunks),
    /// reading through `src`, with no fault loop and no daemon: what the stream, the
    /// replay and the CRIU push see.
    fn installer(guest: &Guest, image: Arc<imgfmt::Image>, src: Arc<dyn imgfmt::BlobSource>) -> Installer {
        let (p, size, _) = guest.regions[0];
        // SAFETY: dup of a live descriptor; the new one is owned by the Uffd made here.
        let uffd = unsafe { Uffd::from_raw_fd(libc::dup(guest.uffd.as_raw_fd())) };
        let map =
            MemoryMap { regions: vec![Region { base: p as u64, size: size as u64, offset: 0, page_size: 4096 }], file_size: size as u64, chunk_shift: 16 };
        let file = image.file("vm.mem").unwrap().0;
        let policy = RetryPolicy { first_backoff: Duration::from_millis(1), ..RetryPolicy::stall(Duration::from_secs(2)) };
        let fetcher = Arc::new(Fetcher::new(image, file, src, None, policy, 0));
        Installer::new(7, uffd, map, fetcher, Rec(Arc::default(), Arc::default()), false)
    }

    /// Whether the page at `off` of the region reads as an error (poisoned), read through
    /// process_vm_readv (a poisoned page is EFAULT there, not a SIGBUS). Only for pages
    /// known to be present or poisoned: a missing one would wait for a fault handler.
    fn poisoned(base: *mut u8, off: usize) -> bool {
        let mut buf = vec![0u8; 4096];
        let local = libc::iovec { iov_base: buf.as_mut_ptr() as *mut libc::c_void, iov_len: 4096 };
        // SAFETY: inside the live guest mapping.
        let remote = libc::iovec { iov_base: unsafe { base.add(off) } as *mut libc::c_void, iov_len: 4096 };
        // SAFETY: both iovecs describe live memory of this process.
        unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) == -1 }
    }

    /// The stream's request gives its room in the background's window back once its bytes
    /// have arrived, not after installing them: the installs (a copy into the guest per
    /// page) use none of the link, and holding the room through them kept the window's
    /// bytes off the link for that long. A single chunk and a run of adjacent ones alike.
    #[test]
    fn regression_issue_23_a_stream_run_is_fetched_before_its_room_goes_back_and_installed_after() {
        let (dir, mem, image, _layout) = sample_image(8);
        let Some(guest) = Guest::new(&[(mem.len(), 0)]) else { return };
        let src = flaky(imgfmt::OciLayout::open(dir.path().join("layout")).unwrap());
        let inst = installer(&guest, image, src.clone());
        let data: Vec<u64> = (0..8).filter(|&c| !inst.fetcher.is_zero(c).unwrap()).collect();
        let pair = data.windows(2).find(|w| inst.fetcher.adjacent(w[0], w[1])).expect("two adjacent data chunks").to_vec();
        let single = vec![*data.iter().find(|c| !pair.contains(c)).expect("a third data chunk")];
        for run in [single, pair] {
            let reads = src.reads.load(SeqCst);
            let mut at_fetched = None;
            let (bytes, chunks) = inst.prefetch_run(&run, || at_fetched = Some((src.reads.load(SeqCst) - reads, run.iter().all(|&c| inst.chunk_pending(c)))));
            assert_eq!(at_fetched, Some((1, true)), "{run:?}: one read done, nothing installed yet, when the room goes back");
            assert_eq!((bytes, chunks), (run.len() as u64 * K64 as u64, run.len() as u64), "{run:?}");
            assert!(run.iter().all(|&c| !inst.chunk_pending(c)), "{run:?}: installed after");
            for &c in &run {
                let at = c as usize * K64;
                assert_eq!(guest.region(0)[at..at + K64], mem[at..at + K64], "chunk {c}");
            }
        }
    }

    /// A chunk of a stream run that fails its check is read alone once more and refused;
    /// installing the run must not read it a third time (nor count two more verify
    /// failures) to find out again: the guest's fault there takes the fault path.
    #[test]
    fn regression_issue_23_a_chunk_a_run_refused_is_not_fetched_again_to_install_it() {
        let (dir, mem, image, _layout) = sample_image(8);
        let Some(guest) = Guest::new(&[(mem.len(), 0)]) else { return };
        let src = flaky(imgfmt::OciLayout::open(dir.path().join("layout")).unwrap());
        let inst = installer(&guest, image, src.clone());
        let data: Vec<u64> = (0..8).filter(|&c| !inst.fetcher.is_zero(c).unwrap()).collect();
        let pair = data.windows(2).find(|w| inst.fetcher.adjacent(w[0], w[1])).expect("two adjacent data chunks").to_vec();
        // Every read's first byte flipped: in the run's read, that is the first chunk's.
        src.corrupt.store(true, SeqCst);
        let reads = src.reads.load(SeqCst);
        let (bytes, chunks) = inst.prefetch_run(&pair, || {});
        assert_eq!(src.reads.load(SeqCst) - reads, 2, "the run's read, then the refused chunk's own; no third");
        assert_eq!((bytes, chunks), (K64 as u64, 1), "the good chunk installed");
        assert!(inst.chunk_pending(pair[0]), "the refused chunk is left to the fault path");
        let at = pair[1] as usize * K64;
        assert_eq!(guest.region(0)[at..at + K64], mem[at..at + K64]);
    }

    /// The installer on its own, against anonymous memory registered with userfaultfd and
    /// nobody serving faults: a data chunk is installed verified and only into gaps, a zero
    /// chunk as zeros, verified slices page by page, nothing over a removed range, and a
    /// chunk that cannot be verified is poisoned, never filled.
    #[test]
    fn installer_fills_chunks_zeros_slices_and_poison_without_a_fault_loop() {
        let (dir, mem, image, layout) = sample_image(8);
        let image = with_outboards(image, &layout);
        let Some(guest) = Guest::new(&[(mem.len(), 0)]) else { return };
        let src = flaky(imgfmt::OciLayout::open(dir.path().join("layout")).unwrap());
        let inst = installer(&guest, image, src.clone());
        let (base, _, _) = guest.regions[0];
        let pages = |c: usize| c * 16..(c + 1) * 16;
        let span = |c: u64| inst.map.spans_of_chunk(c)[0];

        // A data chunk: installed whole, its bytes the snapshot's; a second time, nothing.
        assert_eq!(inst.prefetch_span(&span(0)), K64 as u64);
        assert!(resident(base, mem.len())[pages(0)].iter().all(|&x| x));
        assert_eq!(guest.region(0)[..K64], mem[..K64]);
        assert_eq!(inst.prefetch_span(&span(0)), 0, "gaps only");
        assert!(!resident(base, mem.len())[pages(2)].iter().any(|&x| x), "nothing else was installed");

        // A zero chunk (1): zeros, nothing fetched.
        let reads = src.reads.load(SeqCst);
        inst.prefetch_zero_span(&span(1));
        assert!(resident(base, mem.len())[pages(1)].iter().all(|&x| x));
        assert!(guest.region(0)[K64..2 * K64].iter().all(|&b| b == 0));
        assert_eq!(src.reads.load(SeqCst), reads);

        // Verified slices 3 and 4 of chunk 2: those two pages, nothing around them.
        let (Ok(SliceFetch::Slices(v)), _) = inst.fetcher.get_slices(2, 3..5) else { panic!("slices of a raw BLAKE3 chunk") };
        inst.install_slices(2, &v, &mut || unreachable!("no remove is pending")).unwrap();
        let present = resident(base, mem.len());
        assert_eq!(present[pages(2)].iter().filter(|&&x| x).count(), 2);
        assert!(present[2 * 16 + 3] && present[2 * 16 + 4]);
        assert!(inst.slice_installed(base as u64 + (2 * K64 + 3 * 4096) as u64));
        assert!(!inst.slice_installed(base as u64 + (2 * K64 + 5 * 4096) as u64));
        assert_eq!(guest.region(0)[2 * K64 + 3 * 4096..2 * K64 + 5 * 4096], mem[2 * K64 + 3 * 4096..2 * K64 + 5 * 4096]);

        // Pages 0-1 of chunk 3 removed by the guest: the chunk is installed around them.
        inst.removed(base as u64 + 3 * K64 as u64, base as u64 + (3 * K64 + 2 * 4096) as u64);
        assert_eq!(inst.prefetch_span(&span(3)), (K64 - 2 * 4096) as u64);
        let present = resident(base, mem.len());
        assert!(!present[3 * 16] && !present[3 * 16 + 1], "removed pages are never filled ahead");
        assert!(present[3 * 16 + 2..4 * 16].iter().all(|&x| x));

        // A chunk whose bytes do not verify (5): poisoned, every page, never filled.
        src.corrupt.store(true, SeqCst);
        assert_eq!(inst.push_span(&span(5)), Pushed::Done);
        assert!((0..16).all(|p| poisoned(base, 5 * K64 + p * 4096)), "the chunk is poisoned");
        assert_eq!(inst.prefetch_span(&span(5)), 0, "a poisoned span is settled");
        let c = &inst.rec.0;
        assert_eq!(c.poisoned_pages.load(SeqCst), 16);
        assert_eq!(c.verify_failures.load(SeqCst), 2, "fetched twice, then refused");
        assert_eq!(c.prefetched_chunks.load(SeqCst), 2);
        assert_eq!(c.prefetched_bytes.load(SeqCst), (2 * K64 - 2 * 4096) as u64);
        assert_eq!(c.removed_ranges.load(SeqCst), 1);
    }
}
