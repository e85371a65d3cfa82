//! One connection: the fault loop on the VMM's userfaultfd, and installing verified bytes.
//!
//! ```text
//! poll(uffd, socket) -> read events -> REMOVE/UNMAP: remember the range (zeros from now on)
//!                                   -> PAGEFAULT: span -> zero?  UFFDIO_ZEROPAGE
//!                                                        data?  fetch (verified) -> UFFDIO_COPY
//!                                                               slices of a raw BLAKE3 chunk
//!                                                               (outboard) or the whole chunk
//!                                                        none?  UFFDIO_POISON (never wrong bytes)
//! ```
//!
//! The fault thread does the work of a fault itself, so a fault never waits behind the
//! prefetcher; the prefetcher installs through the same lock and only fills gaps.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{Read, Write};
use std::ops::Range;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use userfaultfd::{Event, EventBuffer, Uffd};
use verify::{VerifiedChunk, VerifiedSlice};

use super::fetch::{FetchFailure, Fetcher, Origin, SliceFetch, Work};
use super::map::{MemoryMap, RemovedRanges, Span};
use super::prefetch::Detector;
use super::stats::{Counters, Rec};

// The three filling ioctls, called directly: the `userfaultfd` crate folds the byte
// count of a partial operation into its error for ZEROPAGE and reads a negative count as
// a huge one for COPY, and it has no POISON (Linux 6.6). Layouts from
// include/uapi/linux/userfaultfd.h.
#[repr(C)]
struct UffdioRange {
    start: u64,
    len: u64,
}
#[repr(C)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}
#[repr(C)]
struct UffdioZeropage {
    range: UffdioRange,
    mode: u64,
    zeropage: i64,
}
#[repr(C)]
struct UffdioPoison {
    range: UffdioRange,
    mode: u64,
    updated: i64,
}
const UFFDIO: u8 = 0xAA;
nix::ioctl_readwrite!(ioctl_copy, UFFDIO, 0x03, UffdioCopy);
nix::ioctl_readwrite!(ioctl_zeropage, UFFDIO, 0x04, UffdioZeropage);
nix::ioctl_readwrite!(ioctl_poison, UFFDIO, 0x08, UffdioPoison);

/// How filling a range went wrong.
#[derive(Debug)]
enum Fill {
    /// The guest's address space is changing (a remove event is pending): read events,
    /// then retry.
    Again,
    /// The VMM's memory is gone (it exited).
    Gone,
    /// The range is no longer registered (unmapped); nothing to fill.
    Unmapped,
    /// Anything else: a bug or an unsupported operation.
    Failed(Errno),
}

#[derive(Clone, Copy)]
enum Op<'a> {
    Copy(&'a [u8]),
    Zero,
    Poison,
}

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

/// Mutable per-connection state, behind one lock shared by the fault thread and the
/// prefetcher (held across an install so a remove cannot slip in between deciding what to
/// fill and filling it).
#[derive(Default)]
pub(crate) struct ConnState {
    pub removed: RemovedRanges,
    /// (region, unit) installed whole since the last remove touching it.
    pub installed: HashSet<(usize, u64)>,
    /// Host pages installed from verified slices (their unit is not whole), since the last
    /// remove touching them.
    pub slice_pages: HashSet<u64>,
    pub poisoned: HashSet<(usize, u64)>,
    /// Pages outside every region poisoned by a fault (counted once, not again by
    /// `poison_range`).
    pub outside_poisoned: HashSet<u64>,
    /// File chunks in the order first faulted (with --record-trace).
    pub trace: FirstSeen,
    /// The working set (with --record-trace): file offsets of the slices whose pages the
    /// guest touched, first touch first, and their bytes in that order.
    pub working_set: FirstSeen,
    pub working_set_bytes: Vec<u8>,
    /// Zero chunks the guest touched (with --record-trace), first touch first.
    pub zero_touched: FirstSeen,
}

impl ConnState {
    /// Record the slice at file offset `at` (its bytes `bytes`) in the working set, once.
    fn record_slice(&mut self, at: u64, bytes: &[u8]) {
        if self.working_set.add(at) {
            self.working_set_bytes.extend_from_slice(bytes);
        }
    }
}

/// Numbers in the order first added, each once: what a recording restore keeps.
#[derive(Default)]
pub(crate) struct FirstSeen {
    seen: HashSet<u64>,
    order: Vec<u64>,
}

impl FirstSeen {
    /// Add `x`; true if it was not there yet.
    pub fn add(&mut self, x: u64) -> bool {
        let new = self.seen.insert(x);
        if new {
            self.order.push(x);
        }
        new
    }

    /// The numbers in first-added order, leaving this empty.
    pub fn take(&mut self) -> Vec<u64> {
        self.seen.clear();
        std::mem::take(&mut self.order)
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

/// One VMM connection.
pub(crate) struct Conn {
    pub pid: i32,
    pub uffd: Uffd,
    pub map: MemoryMap,
    pub fetcher: Arc<Fetcher>,
    pub rec: Rec,
    pub state: Mutex<ConnState>,
    pub record_trace: bool,
    pub started: Instant,
    /// Microseconds since `started` (+1) at which the fault being served was read; 0 idle.
    pub busy_since: AtomicU64,
    pub busy_addr: AtomicU64,
    pub gone: AtomicBool,
    /// Faults waiting for the fetch pool: the prefetcher yields to them.
    pub parked_faults: AtomicU64,
    /// Fetches those faults wait for (distinct chunks or slice ranges): the stream keeps
    /// its own requests in flight to what the link holds beside these.
    pub fault_fetches: AtomicU64,
    /// Decides, from this connection's misses, when to stream the rest of the image
    /// (`--prefetch trace`); `None`: never from misses (`all` streams at once, `none` not).
    pub detector: Mutex<Option<Detector>>,
    /// Set once the rest of the image is to be streamed (the detector fired, or `all`).
    pub stream_go: AtomicBool,
    /// Microseconds since `started` (+1) at which `stream_go` was set; 0 not yet.
    pub stream_started_us: AtomicU64,
    /// Working-set slices (file offsets) being fetched by the replay of a recorded working
    /// set: a fault on one waits for that replay instead of fetching (`crate::workingset`).
    pub ws_pending: Mutex<HashSet<u64>>,
    /// Set while the replay runs (a fault then looks its slice up in `ws_pending`).
    pub ws_active: AtomicBool,
    /// Fetch a chunk's first misses by slice (`LazyOptions::slice_faults`).
    pub slice_faults: bool,
    /// Faults outside every region: poison (the default) or zeros.
    pub outside: Outside,
    /// Who takes the userfaultfd of a child the process forked (UFFD_EVENT_FORK). Without
    /// one the child's uffd is closed, and the kernel then zero-fills whatever the child
    /// touches that was not yet installed: only for runtimes that do not fork.
    pub on_fork: Option<ForkHook>,
    sys_page: u64,
}

/// Called from the fault thread with the parent's connection and the child's userfaultfd.
pub(crate) type ForkHook = Box<dyn Fn(&Conn, Uffd) + Send + Sync>;

struct Fault {
    addr: u64,
    read_at: Instant,
}

/// The fault thread's queues.
struct Queues<'a> {
    pending: &'a mut VecDeque<Fault>,
    parked: &'a mut HashMap<Key, Vec<Fault>>,
    /// Faults on slices the working-set replay is fetching: its install wakes them.
    ws_parked: Vec<Fault>,
    arrived: &'a mut Arrivals,
    slicing: Slicing,
}

/// Fetches the pool finished for parked faults, consumed when those faults are served.
#[derive(Default)]
struct Arrivals {
    origin: HashMap<u64, Origin>,
    failed: HashMap<u64, FetchFailure>,
}

/// Fetch threads per connection: a slice and its chunk for each of a few vCPUs' faults.
const FETCHERS: usize = 8;

/// What the fetch pool is asked for.
enum Job {
    Chunk(u64),
    /// Slices of a chunk, one range request.
    Slices(u64, Range<u32>),
}

/// What parked faults wait for: a chunk, or one slice fetch (numbered: two fetches of one
/// chunk's slices may be in flight).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Key {
    Chunk(u64),
    Slices(u64, u64),
}

/// A finished job.
enum Done {
    Chunk(Result<(), FetchFailure>, Origin),
    Slices(Result<SliceFetch, FetchFailure>),
}

type Finished = (Key, Done, Work);

/// The first sequential miss in a chunk fetches this many slices (64 KiB at 4 KiB slices);
/// the one after that fetches the whole chunk.
const READAHEAD_SLICES: u32 = 16;
/// Pending faults on slices at most this far from a fetch's range join it (one request
/// for a few more KiB beats a round trip per fault).
const COALESCE_GAP: u32 = 8;

/// Per connection, on the fault thread: how each chunk's misses went, for deciding between
/// a slice fetch and the whole chunk.
#[derive(Default)]
struct Slicing {
    /// Slice fetches in flight: their ranges.
    jobs: HashMap<Key, (u64, Range<u32>)>,
    next: u64,
    /// Per chunk: slice fetches made, and where the last one ended.
    misses: HashMap<u64, (u32, u32)>,
    /// Chunks with no verifiable slices (no entry, or one that does not merge): whole.
    whole: HashSet<u64>,
}

fn fill_ioctl(fd: i32, op: Op, dst: u64, len: u64) -> (Result<(), Errno>, i64) {
    // SAFETY: each struct is the kernel's layout for its ioctl number and lives across the
    // call; `src` of a copy points at `len` readable bytes of a live slice (checked by the
    // caller), and the destination is in the *VMM's* address space, which the kernel checks
    // against the registered ranges.
    unsafe {
        match op {
            Op::Copy(b) => {
                let mut a = UffdioCopy { dst, src: b.as_ptr() as u64, len, mode: 0, copy: 0 };
                let r = ioctl_copy(fd, &mut a).map(|_| ());
                (r, a.copy)
            }
            Op::Zero => {
                let mut a = UffdioZeropage { range: UffdioRange { start: dst, len }, mode: 0, zeropage: 0 };
                let r = ioctl_zeropage(fd, &mut a).map(|_| ());
                (r, a.zeropage)
            }
            Op::Poison => {
                let mut a = UffdioPoison { range: UffdioRange { start: dst, len }, mode: 0, updated: 0 };
                let r = ioctl_poison(fd, &mut a).map(|_| ());
                (r, a.updated)
            }
        }
    }
}

impl Conn {
    pub fn new(pid: i32, uffd: Uffd, map: MemoryMap, fetcher: Arc<Fetcher>, conn: Arc<Counters>, daemon: Arc<Counters>, record_trace: bool) -> Self {
        // SAFETY: sysconf has no preconditions.
        let sys_page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
        Conn {
            pid,
            uffd,
            map,
            fetcher,
            rec: Rec(conn, daemon),
            state: Mutex::new(ConnState::default()),
            record_trace,
            started: Instant::now(),
            busy_since: AtomicU64::new(0),
            busy_addr: AtomicU64::new(0),
            gone: AtomicBool::new(false),
            parked_faults: AtomicU64::new(0),
            fault_fetches: AtomicU64::new(0),
            detector: Mutex::new(None),
            stream_go: AtomicBool::new(false),
            stream_started_us: AtomicU64::new(0),
            ws_pending: Mutex::new(HashSet::new()),
            ws_active: AtomicBool::new(false),
            slice_faults: false,
            outside: Outside::default(),
            on_fork: None,
            sys_page,
        }
    }

    /// A connection for a child this one's process forked: the same memory layout and
    /// chunks, the same policy outside the regions, and the parent's removed ranges (they
    /// are missing in the child too and must stay zeros). Nothing is installed in the child
    /// as far as it knows: pages the parent had are present in the child, and installing
    /// them again gets EEXIST, which is skipped.
    pub fn child(&self, uffd: Uffd, conn: Arc<Counters>) -> Conn {
        let mut c = Conn::new(self.pid, uffd, self.map.clone(), self.fetcher.clone(), conn, self.rec.1.clone(), false);
        c.outside = self.outside.clone();
        c.slice_faults = self.slice_faults;
        c.state.lock().expect("poisoned").removed = self.state.lock().expect("poisoned").removed.clone();
        c
    }

    /// Fill `[dst, dst + len)` page by page where needed: pages already present (EEXIST)
    /// are skipped, partial progress is kept.
    fn fill(&self, op: Op, dst: u64, len: u64, page: u64) -> Result<(), Fill> {
        let fd = self.uffd.as_raw_fd();
        let mut off = 0u64;
        while off < len {
            let op_here = match op {
                Op::Copy(b) => Op::Copy(&b[off as usize..len as usize]),
                o => o,
            };
            let (r, count) = fill_ioctl(fd, op_here, dst + off, len - off);
            match r {
                Ok(()) => off = len,
                Err(Errno::EAGAIN) if count > 0 && (count as u64) <= len - off => off += count as u64,
                Err(Errno::EAGAIN) => return Err(Fill::Again),
                Err(Errno::EEXIST) => off += page,
                Err(Errno::ESRCH) => return Err(Fill::Gone),
                // One ioctl must stay inside one VMA: a range over a VMA boundary (a CRIU
                // pagemap entry may cover adjacent VMAs) fails as a whole, so retry it page
                // by page and skip only the pages that really are unmapped.
                Err(Errno::ENOENT) if len - off > page => return self.fill_pages(op, dst + off, len - off, page, off),
                Err(Errno::ENOENT) => return Err(Fill::Unmapped),
                Err(e) => return Err(Fill::Failed(e)),
            }
        }
        Ok(())
    }

    /// `fill` one page at a time (`skip`: bytes of `op`'s data before `dst`).
    fn fill_pages(&self, op: Op, dst: u64, len: u64, page: u64, skip: u64) -> Result<(), Fill> {
        let mut mapped = false;
        for p in (0..len).step_by(page as usize) {
            let op_here = match op {
                Op::Copy(b) => Op::Copy(&b[(skip + p) as usize..(skip + p + page) as usize]),
                o => o,
            };
            match self.fill(op_here, dst + p, page, page) {
                Ok(()) => mapped = true,
                Err(Fill::Unmapped) => {}
                Err(e) => return Err(e),
            }
        }
        if mapped {
            Ok(())
        } else {
            Err(Fill::Unmapped)
        }
    }

    /// Fill `[a, b)` with zeros: one UFFDIO_ZEROPAGE, or a copy of zeros page by page for
    /// huge pages (which have no zero page).
    fn fill_zeros(&self, a: u64, b: u64, page: u64) -> Result<(), Fill> {
        match self.zero_op(page) {
            Op::Copy(z) => (a..b).step_by(page as usize).try_for_each(|p| self.fill(Op::Copy(z), p, page, page)),
            op => self.fill(op, a, b - a, page),
        }
    }

    fn zero_op(&self, page: u64) -> Op<'static> {
        // UFFDIO_ZEROPAGE maps the shared zero page; it does not exist for huge pages.
        if page <= self.sys_page {
            Op::Zero
        } else {
            Op::Copy(zeros(page))
        }
    }

    /// Fill a span with `data` where the guest has not removed memory and with zeros where
    /// it has, under the state lock. On `Again` the caller reads events and calls again.
    fn install(&self, st: &mut ConnState, span: &Span, data: &SpanData) -> Result<(), Fill> {
        let page = self.map.regions[span.region].page_size;
        for (removed, a, b) in st.removed.split(span.host, span.host + span.len) {
            let bytes = data.bytes(span.len as usize).map(|d| &d[(a - span.host) as usize..(b - span.host) as usize]);
            match (removed, bytes) {
                (false, Some(d)) => self.fill(Op::Copy(d), a, b - a, page)?,
                _ => self.fill_zeros(a, b, page)?,
            }
        }
        st.installed.insert((span.region, span.unit));
        Ok(())
    }

    /// Fill only the removed parts of a span with zeros (a fault in memory the guest gave
    /// back). The rest of the span still holds snapshot data the guest may read later, so it
    /// is left for a fault or the prefetcher to fill with that data, never with zeros.
    fn install_removed(&self, st: &ConnState, span: &Span) -> Result<(), Fill> {
        let page = self.map.regions[span.region].page_size;
        for (removed, a, b) in st.removed.split(span.host, span.host + span.len) {
            if removed {
                self.fill_zeros(a, b, page)?;
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
            let (o, mut from, w) = if stream { self.fetcher.get_waiting_for_cache(c) } else { self.fetcher.get(c) };
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

    fn account(&self, w: &Work) {
        self.rec.add(|c| &c.bytes_fetched, w.bytes_fetched);
        self.rec.add(|c| &c.slice_bytes, w.slice_bytes);
        self.rec.add(|c| &c.retries, w.retries);
        self.rec.add(|c| &c.verify_failures, w.verify_failures);
    }

    /// Apply a remove (or unmap) event: the range reads as zeros from now on.
    fn removed(&self, start: u64, end: u64) {
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

    /// Read every pending event without blocking: faults are queued, removes applied.
    fn drain_events(&self, pending: &mut VecDeque<Fault>) -> Result<(), String> {
        let mut buf = EventBuffer::new(64);
        loop {
            let events: Vec<_> = match self.uffd.read_events(&mut buf) {
                Ok(it) => it.collect(),
                Err(userfaultfd::Error::ReadEof) => return Err("userfaultfd closed".into()),
                Err(e) => return Err(format!("reading the userfaultfd: {e}")),
            };
            if events.is_empty() {
                return Ok(());
            }
            let now = Instant::now();
            for e in events {
                match e {
                    Ok(Event::Pagefault { addr, .. }) => pending.push_back(Fault { addr: addr as u64, read_at: now }),
                    Ok(Event::Remove { start, end }) | Ok(Event::Unmap { start, end }) => self.removed(start as u64, end as u64),
                    Ok(Event::Remap { from, to, len }) => {
                        tracing::warn!("pid {}: guest memory remapped {from:?} -> {to:?} ({len} bytes): not followed", self.pid)
                    }
                    Ok(Event::Fork { uffd }) => match &self.on_fork {
                        Some(hook) => hook(self, uffd),
                        None => {
                            tracing::warn!("pid {}: fork event not followed: the child's untouched memory will read as zeros", self.pid);
                            drop(uffd);
                        }
                    },
                    Err(e) => tracing::warn!("pid {}: bad userfaultfd event: {e}", self.pid),
                }
            }
        }
    }

    /// Serve one fault. `Err` ends the connection.
    fn serve(&self, f: &Fault, pending: &mut VecDeque<Fault>, arrived: &mut Arrivals) -> Result<(), String> {
        let Some(span) = self.map.span_at(f.addr) else {
            if !self.outside.poisons(f.addr) {
                return self.serve_outside_zero(f, pending);
            }
            // Registered memory the VMM did not describe: there is no right content for
            // it, so the vCPU gets a memory error rather than a hang or made-up bytes.
            tracing::warn!("pid {}: fault at {:#x} outside every region; poisoning the page", self.pid, f.addr);
            let p = f.addr & !(self.sys_page - 1);
            let mut st = self.state.lock().expect("poisoned");
            if self.fill(Op::Poison, p, self.sys_page, self.sys_page).is_ok() && self.outside.count && st.outside_poisoned.insert(p) {
                self.rec.add(|c| &c.poisoned_pages, 1);
            }
            return Ok(());
        };
        let page = self.map.regions[span.region].page_size;
        let fault_page = f.addr & !(page - 1);
        let mut work = Work::default();
        let result = loop {
            {
                let st = self.state.lock().expect("poisoned");
                if st.removed.contains(fault_page) {
                    match self.install_removed(&st, &span) {
                        Ok(()) => break Ok(Kind::Removed),
                        Err(Fill::Again) => {}
                        Err(e) => break Err(e),
                    }
                    drop(st);
                    self.drain_events(pending)?;
                    continue;
                }
                if st.poisoned.contains(&(span.region, span.unit)) {
                    break Ok(Kind::Poisoned);
                }
            }
            let data = match self.span_data(&span, &mut work, arrived, false) {
                Ok(d) => d,
                Err(failure) => {
                    self.account(&work);
                    return self.poison(&span, &failure, pending);
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
                    None => self.zero_op(page),
                };
                match fill_ioctl(self.uffd.as_raw_fd(), one, fault_page, page).0 {
                    Err(Errno::EEXIST) => break Ok(Kind::Present),
                    Err(Errno::EAGAIN) => {
                        drop(st);
                        self.drain_events(pending)?;
                        continue;
                    }
                    _ => {}
                }
            }
            if self.record_trace {
                let zero = data.0.bytes(0).is_none();
                for c in span.chunks(self.map.chunk_shift) {
                    if zero {
                        st.zero_touched.add(c);
                    } else {
                        st.trace.add(c);
                    }
                }
            }
            if let Some(b) = self.record_working_set(&mut st, &span, &data.0, fault_page, page) {
                // Recording a working set: only the faulting page is installed, so every
                // page the guest touches faults once and is recorded (the chunk stays in
                // recent memory for the next one).
                match self.fill(Op::Copy(b), fault_page, page, page) {
                    Ok(()) => {
                        st.slice_pages.insert(fault_page);
                        break Ok(if data.1 == Some(Origin::Fetched) { Kind::Fetched } else { Kind::CacheHit });
                    }
                    Err(Fill::Again) => {
                        drop(st);
                        self.drain_events(pending)?;
                        continue;
                    }
                    Err(e) => break Err(e),
                }
            }
            match self.install(&mut st, &span, &data.0) {
                Ok(()) => {
                    break Ok(match data.1 {
                        None => Kind::Zero,
                        Some(Origin::Cache) => Kind::CacheHit,
                        Some(Origin::Fetched) => Kind::Fetched,
                    })
                }
                Err(Fill::Again) => {
                    drop(st);
                    self.drain_events(pending)?;
                }
                Err(e) => break Err(e),
            }
        };
        self.account(&work);
        // Pages filled by someone else were not woken by our ioctls.
        let _ = self.uffd.wake(fault_page as *mut libc::c_void, page as usize);
        match result {
            Ok(kind) => {
                match kind {
                    Kind::Zero => self.rec.add(|c| &c.zero, 1),
                    Kind::Removed => {
                        self.rec.add(|c| &c.zero, 1);
                        self.rec.add(|c| &c.removed_zero, 1);
                    }
                    Kind::CacheHit => self.rec.add(|c| &c.cache_hit, 1),
                    Kind::Fetched => self.rec.add(|c| &c.fetched, 1),
                    Kind::Present | Kind::Poisoned => self.rec.add(|c| &c.present, 1),
                }
                self.rec.latency(f.read_at.elapsed().as_micros() as u64);
                Ok(())
            }
            Err(Fill::Gone) => Err("the VMM's memory is gone".into()),
            Err(Fill::Unmapped) => Ok(()),
            Err(Fill::Again) => unreachable!("retried above"),
            Err(Fill::Failed(e)) => {
                tracing::warn!("pid {}: installing {:#x}+{:#x} failed: {e}; the fault stays unresolved", self.pid, span.host, span.len);
                Ok(())
            }
        }
    }

    /// No verified bytes for this span: poison it so the guest gets a memory error, never
    /// wrong data. Removed parts of the span still get zeros (they need no snapshot data).
    fn poison(&self, span: &Span, failure: &FetchFailure, pending: &mut VecDeque<Fault>) -> Result<(), String> {
        tracing::error!("pid {}: {failure}: POISONING guest memory {:#x}+{:#x} (file offset {:#x})", self.pid, span.host, span.len, span.file_offset);
        let page = self.map.regions[span.region].page_size;
        loop {
            let mut st = self.state.lock().expect("poisoned");
            let mut poisoned = 0;
            let mut res = Ok(());
            for (removed, a, b) in st.removed.split(span.host, span.host + span.len) {
                res = if removed { self.fill_zeros(a, b, page) } else { self.fill(Op::Poison, a, b - a, page) };
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
                    self.drain_events(pending)?;
                }
                Err(Fill::Gone) => return Err("the VMM's memory is gone".into()),
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

    /// The chunks a fault at `addr` needs from the cache or the source that are not in
    /// memory yet (empty: it can be served right away).
    fn to_fetch(&self, addr: u64, parked: &HashMap<Key, Vec<Fault>>) -> Vec<u64> {
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
        span.chunks(self.map.chunk_shift)
            .filter(|&c| !matches!(self.fetcher.is_zero(c), Ok(true)) && (!self.fetcher.has_recent(c) || parked.contains_key(&Key::Chunk(c))))
            .collect()
    }

    /// The fault loop: until the peer goes away. Returns why the connection ended.
    ///
    /// Faults whose chunks must be fetched are parked while a small pool fetches them, so
    /// one slow chunk does not hold up faults on other chunks; every install still happens
    /// on this thread, which alone reads the uffd's events.
    pub fn run(&self, mut sock: UnixStream, stop: &AtomicBool) -> String {
        let mut pending: VecDeque<Fault> = VecDeque::new();
        let mut parked: HashMap<Key, Vec<Fault>> = HashMap::new();
        let mut arrived = Arrivals::default();
        let (wake_tx, wake_rx) = match UnixStream::pair() {
            Ok(p) => p,
            Err(e) => return format!("creating the wake-up socket: {e}"),
        };
        let _ = wake_rx.set_nonblocking(true);
        let _ = wake_tx.set_nonblocking(true);
        let (job_tx, job_rx) = mpsc::channel::<(Key, Job)>();
        let (done_tx, done_rx) = mpsc::channel::<Finished>();
        let job_rx = Arc::new(Mutex::new(job_rx));
        std::thread::scope(|scope| {
            for _ in 0..FETCHERS {
                let (job_rx, done_tx, wake_tx) = (job_rx.clone(), done_tx.clone(), &wake_tx);
                scope.spawn(move || loop {
                    let Ok((key, job)) = job_rx.lock().expect("poisoned").recv() else { return };
                    let done = match job {
                        Job::Chunk(c) => {
                            let (o, origin, work) = self.fetcher.get(c);
                            (key, Done::Chunk(o.map(|_| ()), origin), work)
                        }
                        Job::Slices(c, range) => {
                            let (o, work) = self.fetcher.get_slices(c, range);
                            (key, Done::Slices(o), work)
                        }
                    };
                    if done_tx.send(done).is_err() {
                        return;
                    }
                    let _ = (&*wake_tx).write(&[1]);
                });
            }
            drop(done_tx);
            let mut q = Queues { pending: &mut pending, parked: &mut parked, ws_parked: Vec::new(), arrived: &mut arrived, slicing: Slicing::default() };
            let ended = self.fault_loop(&mut sock, stop, &mut q, &job_tx, &done_rx, &wake_rx);
            drop(job_tx);
            ended
        })
    }

    fn fault_loop(
        &self,
        sock: &mut UnixStream,
        stop: &AtomicBool,
        q: &mut Queues,
        job_tx: &mpsc::Sender<(Key, Job)>,
        done_rx: &mpsc::Receiver<Finished>,
        wake_rx: &UnixStream,
    ) -> String {
        loop {
            if stop.load(Ordering::Relaxed) {
                return "daemon stopping".into();
            }
            // Before waiting: a fault parked just now waits from now on, and the prefetcher
            // must yield to it now, not after the poll below.
            self.publish_parked(q.parked);
            if q.pending.is_empty() {
                let mut fds = [
                    PollFd::new(self.uffd.as_fd(), PollFlags::POLLIN),
                    PollFd::new(sock.as_fd(), PollFlags::POLLIN),
                    PollFd::new(wake_rx.as_fd(), PollFlags::POLLIN),
                ];
                // Faults parked on the working-set replay are woken by its installs; a slice
                // it could not install goes back to the fault path at the next look.
                let timeout = if q.ws_parked.is_empty() { 200u16 } else { 2 };
                match poll(&mut fds, PollTimeout::from(timeout)) {
                    Ok(_) | Err(Errno::EINTR) => {}
                    Err(e) => return format!("poll failed: {e}"),
                }
                let (u, s) = (fds[0].revents().unwrap_or(PollFlags::empty()), fds[1].revents().unwrap_or(PollFlags::empty()));
                if u.intersects(PollFlags::POLLERR | PollFlags::POLLHUP | PollFlags::POLLNVAL) {
                    return "userfaultfd closed".into();
                }
                if s.intersects(PollFlags::POLLHUP | PollFlags::POLLERR) {
                    return "peer closed the socket".into();
                }
                if s.contains(PollFlags::POLLIN) {
                    // Nothing more is expected after the handshake: drain and ignore, EOF ends.
                    let mut b = [0u8; 512];
                    match sock.read(&mut b) {
                        Ok(0) => return "peer closed the socket".into(),
                        Ok(_) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => return format!("socket: {e}"),
                    }
                }
                let mut b = [0u8; 64];
                while matches!((&*wake_rx).read(&mut b), Ok(n) if n > 0) {}
            }
            if let Err(e) = self.drain_events(q.pending) {
                return e;
            }
            // Fetches that finished: their faults go first.
            while let Ok((key, done, work)) = done_rx.try_recv() {
                self.account(&work);
                let faults = q.parked.remove(&key).unwrap_or_default();
                let requeue = match (key, done) {
                    (Key::Chunk(c), Done::Chunk(res, origin)) => {
                        match res {
                            // Fetched beside a slice, and no fault waits for it: install it
                            // now, so the guest's next touches there do not fault.
                            Ok(()) if faults.is_empty() => {
                                for span in self.map.spans_of_chunk(c) {
                                    self.prefetch_span(&span);
                                }
                            }
                            Ok(()) => {
                                q.arrived.origin.insert(c, origin);
                            }
                            // No fault waits: the next one on this chunk fetches it again.
                            Err(_) if faults.is_empty() => {}
                            Err(f) => {
                                q.arrived.failed.insert(c, f);
                            }
                        }
                        faults
                    }
                    (Key::Slices(c, _), Done::Slices(res)) => {
                        q.slicing.jobs.remove(&key);
                        match res {
                            Ok(SliceFetch::Slices(v)) => {
                                if let Err(e) = self.install_slices(c, &v, q.pending) {
                                    return e;
                                }
                                self.wake_sliced(faults, true)
                            }
                            Ok(SliceFetch::Whole) => {
                                // Never over this connection's own fetch of the chunk that
                                // put it there: that one counts as the fetch.
                                q.arrived.origin.entry(c).or_insert(Origin::Cache);
                                faults
                            }
                            Ok(SliceFetch::Declined) => {
                                q.slicing.whole.insert(c);
                                faults
                            }
                            Err(f) => {
                                q.arrived.failed.insert(c, f);
                                faults
                            }
                        }
                    }
                    (k, _) => unreachable!("job {k:?} answered with another kind"),
                };
                for f in requeue.into_iter().rev() {
                    q.pending.push_front(f);
                }
            }
            self.recheck_ws_parked(q);
            self.publish_parked(q.parked);
            let oldest = q.parked.values().flatten().chain(q.pending.iter()).min_by_key(|f| f.read_at).map(|f| (f.addr, f.read_at));
            match oldest {
                Some((addr, at)) => {
                    self.busy_addr.store(addr, Ordering::Relaxed);
                    self.busy_since.store(at.duration_since(self.started).as_micros() as u64 + 1, Ordering::Relaxed);
                }
                None => self.busy_since.store(0, Ordering::Relaxed),
            }
            if let Some(f) = q.pending.pop_front() {
                if self.slice_installed(f.addr) {
                    // Installed by a slice fetch since it was read: only a wake-up is needed.
                    let _ = self.wake_sliced(vec![f], false);
                    continue;
                }
                if self.ws_waiting(f.addr) {
                    self.rec.add(|c| &c.ws_waits, 1);
                    q.ws_parked.push(f);
                    continue;
                }
                let need = self.to_fetch(f.addr, q.parked);
                if let Some(&c) = need.iter().find(|c| !q.arrived.origin.contains_key(c) && !q.arrived.failed.contains_key(c)) {
                    if need.len() == 1 {
                        if let Some((key, job)) = self.plan_slices(&f, c, q) {
                            q.parked.entry(key).or_default().push(f);
                            if let Some(range) = job {
                                self.missed(c);
                                if job_tx.send((key, Job::Slices(c, range))).is_err() {
                                    return "fetch pool gone".into();
                                }
                                // The whole chunk at once, beside the slice: the slice serves
                                // this fault in a round trip, the chunk the guest's next
                                // touches there without another (installed when it arrives).
                                let whole = Key::Chunk(c);
                                if let std::collections::hash_map::Entry::Vacant(e) = q.parked.entry(whole) {
                                    e.insert(Vec::new());
                                    if job_tx.send((whole, Job::Chunk(c))).is_err() {
                                        return "fetch pool gone".into();
                                    }
                                }
                            }
                            continue;
                        }
                    }
                    let key = Key::Chunk(c);
                    let first = !q.parked.contains_key(&key);
                    q.parked.entry(key).or_default().push(f);
                    if first {
                        self.missed(c);
                        if job_tx.send((key, Job::Chunk(c))).is_err() {
                            return "fetch pool gone".into();
                        }
                    }
                    continue;
                }
                if let Err(e) = self.serve(&f, q.pending, q.arrived) {
                    return e;
                }
            }
        }
    }

    /// With --record-trace, where the working set can be recorded by slice (a raw chunk
    /// with an outboard entry, pages no larger than a slice, one chunk per unit): record
    /// the slice the fault's page lies in (once) and return that page's bytes, the only
    /// ones to install. `None`: install the whole unit as usual.
    fn record_working_set<'d>(&self, st: &mut ConnState, span: &Span, data: &'d SpanData, fault_page: u64, page: u64) -> Option<&'d [u8]> {
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
        st.record_slice((c << self.map.chunk_shift) + r.start, slice);
        Some(here)
    }

    /// File offset of the outboard slice holding `addr` (`None`: no slices there).
    fn slice_at(&self, addr: u64) -> Option<u64> {
        let (_, off) = self.map.locate(addr)?;
        let cvs = self.fetcher.image.slice_cvs(self.fetcher.file, off >> self.map.chunk_shift)?;
        Some(off & !(cvs.slice_size() - 1))
    }

    /// Whether the page of `addr` lies in a slice the working-set replay is fetching.
    fn ws_waiting(&self, addr: u64) -> bool {
        if !self.ws_active.load(Ordering::Relaxed) {
            return false;
        }
        self.slice_at(addr).is_some_and(|at| self.ws_pending.lock().expect("poisoned").contains(&at))
    }

    /// Faults parked on the working-set replay whose slice it is done with: woken and
    /// counted where it installed their page, back to the fault path where it did not (a
    /// slice that failed its check, a remove in between).
    fn recheck_ws_parked(&self, q: &mut Queues) {
        if q.ws_parked.is_empty() {
            return;
        }
        let active = self.ws_active.load(Ordering::Relaxed);
        let done: Vec<Fault> = {
            let pending = self.ws_pending.lock().expect("poisoned");
            let (done, wait) =
                std::mem::take(&mut q.ws_parked).into_iter().partition(|f| !active || self.slice_at(f.addr).is_none_or(|at| !pending.contains(&at)));
            q.ws_parked = wait;
            done
        };
        for f in self.wake_sliced(done, false).into_iter().rev() {
            q.pending.push_front(f);
        }
    }

    /// Tell the prefetcher how many faults wait, and for how many fetches.
    fn publish_parked(&self, parked: &HashMap<Key, Vec<Fault>>) {
        self.parked_faults.store(parked.values().map(|v| v.len() as u64).sum(), Ordering::Relaxed);
        self.fault_fetches.store(parked.len() as u64, Ordering::Relaxed);
    }

    /// A fault had to wait for chunk `c` to be fetched: tell the detector, and start the
    /// stream of the rest once it says the misses look scattered.
    fn missed(&self, c: u64) {
        let fire = self.detector.lock().expect("poisoned").as_mut().is_some_and(|d| d.miss(c));
        if fire {
            self.start_stream();
        }
    }

    /// Let the stream of the rest of the image go (once; later calls do nothing).
    pub fn start_stream(&self) {
        if !self.stream_go.swap(true, Ordering::Relaxed) {
            self.stream_started_us.store(self.started.elapsed().as_micros() as u64 + 1, Ordering::Relaxed);
        }
    }

    /// Whether a fault at `addr` needs only part of its chunk, and which: the slice fetch
    /// in flight that covers its slice (no new job), or a new range. `None`: fetch the
    /// whole chunk (no verifiable slices, huge pages, or a chunk that missed before).
    ///
    /// A chunk's first miss fetches its slice, with any pending faults on slices near it
    /// in the same range. A second miss right past that range (the guest walking through
    /// memory) fetches [`READAHEAD_SLICES`]; any other second miss, and any third, fetches
    /// the whole chunk: past that point round trips cost more than the bytes they save, and
    /// the whole chunk goes into memory and the chunk cache.
    fn plan_slices(&self, f: &Fault, c: u64, q: &mut Queues) -> Option<(Key, Option<Range<u32>>)> {
        if !self.slice_faults || q.slicing.whole.contains(&c) || q.parked.contains_key(&Key::Chunk(c)) || self.fetcher.in_flight(c) {
            return None;
        }
        let (region, _) = self.map.locate(f.addr)?;
        let cvs = self.fetcher.image.slice_cvs(self.fetcher.file, c)?;
        // A huge page needs more than a slice, and a unit larger than the chunk needs more
        // than the chunk: both go whole.
        if self.map.regions[region].page_size > cvs.slice_size() || self.map.unit_size(region) != self.map.chunk_size() {
            return None;
        }
        let count = cvs.slice_count();
        let shift = cvs.slice_shift;
        let slice_of = |addr: u64| -> Option<u32> {
            let (_, off) = self.map.locate(addr)?;
            (off >> self.map.chunk_shift == c).then(|| ((off - (c << self.map.chunk_shift)) >> shift) as u32)
        };
        let s = slice_of(f.addr)?;
        if let Some((k, _)) = q.slicing.jobs.iter().find(|(_, (jc, r))| *jc == c && r.contains(&s)) {
            return Some((*k, None));
        }
        let (misses, end) = q.slicing.misses.get(&c).copied().unwrap_or((0, 0));
        let mut range = match misses {
            0 => s..s + 1,
            1 if s >= end && s < end + 2 => s..(s + READAHEAD_SLICES).min(count),
            _ => return None,
        };
        // Pending faults on this chunk near the range ride along.
        let mut near: Vec<u32> = q.pending.iter().filter_map(|p| slice_of(p.addr)).collect();
        near.sort_unstable();
        loop {
            let before = range.clone();
            for &t in &near {
                if t < range.start && t + COALESCE_GAP >= range.start {
                    range.start = t;
                } else if t >= range.end && t < range.end + COALESCE_GAP {
                    range.end = t + 1;
                }
            }
            if range == before {
                break;
            }
        }
        q.slicing.misses.insert(c, (misses + 1, range.end));
        let key = Key::Slices(c, q.slicing.next);
        q.slicing.next += 1;
        q.slicing.jobs.insert(key, (c, range.clone()));
        Some((key, Some(range)))
    }

    /// Whether the page of `addr` was installed from slices (and not removed since).
    fn slice_installed(&self, addr: u64) -> bool {
        let Some(span) = self.map.span_at(addr) else { return false };
        let page = self.map.regions[span.region].page_size;
        let st = self.state.lock().expect("poisoned");
        !st.slice_pages.is_empty() && st.slice_pages.contains(&(addr & !(page - 1)))
    }

    /// Install verified slices of chunk `c` wherever the guest maps them, page by page
    /// where pages are missing (pages already present are skipped by `fill`), never over
    /// memory the guest removed (a fault there gets zeros).
    fn install_slices(&self, c: u64, slices: &[VerifiedSlice], pending: &mut VecDeque<Fault>) -> Result<(), String> {
        self.install_slices_with(c, slices, &mut || self.drain_events(pending))
    }

    /// [`install_slices`](Self::install_slices) with what to do when the address space is
    /// changing (`again`: the fault thread reads the pending events; another thread waits
    /// for the fault thread to). `Err` ends the connection (or, from `again`, the install).
    pub fn install_slices_with(&self, c: u64, slices: &[VerifiedSlice], again: &mut dyn FnMut() -> Result<(), String>) -> Result<(), String> {
        let base = c << self.map.chunk_shift;
        for span in self.map.spans_of_chunk(c) {
            let page = self.map.regions[span.region].page_size;
            'again: loop {
                let mut st = self.state.lock().expect("poisoned");
                if st.installed.contains(&(span.region, span.unit)) || st.poisoned.contains(&(span.region, span.unit)) {
                    break;
                }
                if self.record_trace {
                    st.trace.add(c);
                    // Slices a fault fetched are pages the guest touched (or pending faults
                    // near them): part of the working set.
                    for sl in slices {
                        st.record_slice(base + sl.offset_in_chunk(), sl.as_bytes());
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
                        match self.fill(Op::Copy(&sl.as_bytes()[from..from + (y - x) as usize]), x, y - x, page) {
                            Ok(()) => st.slice_pages.extend((x..y).step_by(page as usize)),
                            Err(Fill::Unmapped) => {}
                            Err(Fill::Again) => {
                                drop(st);
                                again()?;
                                continue 'again;
                            }
                            Err(Fill::Gone) => return Err("the VMM's memory is gone".into()),
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

    /// Wake faults a slice install served and count them (with `fetched`, the first as the
    /// fetch; the others as present); hand back those it did not serve (a remove in between).
    fn wake_sliced(&self, faults: Vec<Fault>, fetched: bool) -> Vec<Fault> {
        let mut left = Vec::new();
        let mut first = fetched;
        for f in faults {
            if !self.slice_installed(f.addr) {
                left.push(f);
                continue;
            }
            let page = self.map.span_at(f.addr).map(|s| self.map.regions[s.region].page_size).unwrap_or(self.sys_page);
            let _ = self.uffd.wake((f.addr & !(page - 1)) as *mut libc::c_void, page as usize);
            if std::mem::take(&mut first) {
                self.rec.add(|c| &c.fetched, 1);
                self.rec.add(|c| &c.slice_fetches, 1);
            } else {
                self.rec.add(|c| &c.present, 1);
            }
            self.rec.latency(f.read_at.elapsed().as_micros() as u64);
        }
        left
    }

    /// A fault outside every region where the policy is zeros (CRIU: memory no pagemap
    /// entry holds, or an entry that is not present, is zero-filled).
    fn serve_outside_zero(&self, f: &Fault, pending: &mut VecDeque<Fault>) -> Result<(), String> {
        let p = f.addr & !(self.sys_page - 1);
        loop {
            match self.fill(Op::Zero, p, self.sys_page, self.sys_page) {
                Ok(()) => {
                    self.rec.add(|c| &c.zero, 1);
                    self.rec.latency(f.read_at.elapsed().as_micros() as u64);
                    break;
                }
                Err(Fill::Again) => self.drain_events(pending)?,
                Err(Fill::Gone) => return Err("the process's memory is gone".into()),
                Err(Fill::Unmapped) => break,
                Err(Fill::Failed(e)) => {
                    tracing::warn!("pid {}: zero-filling {p:#x} failed: {e}; the fault stays unresolved", self.pid);
                    break;
                }
            }
        }
        let _ = self.uffd.wake(p as *mut libc::c_void, self.sys_page as usize);
        Ok(())
    }

    /// Install one span ahead of the process, or poison it when no verified bytes can be
    /// had, so that nothing of it is left for the kernel to zero-fill once the userfaultfd
    /// is closed. Zero chunks are left alone: a zero-fill is their right content. Never
    /// reads events (the fault thread does): `Again` means retry later.
    pub fn push_span(&self, span: &Span) -> Pushed {
        {
            let st = self.state.lock().expect("poisoned");
            if st.installed.contains(&(span.region, span.unit)) || st.poisoned.contains(&(span.region, span.unit)) {
                return Pushed::Done;
            }
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
                    match self.fill(Op::Poison, a, b - a, page) {
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
            match self.fill(Op::Copy(&bytes[(a - span.host) as usize..(b - span.host) as usize]), a, b - a, page) {
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
        let page = self.sys_page;
        let mut poisoned = 0;
        let parts = st.removed.split(start, end);
        for (removed, a, b) in parts {
            if removed {
                continue;
            }
            match self.fill(Op::Poison, a, b - a, page) {
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

    /// How long the fault being served has waited, if one is.
    pub fn waiting(&self) -> Option<(u64, Duration)> {
        let since = self.busy_since.load(Ordering::Relaxed);
        (since != 0).then(|| {
            let at = Duration::from_micros(since - 1);
            (self.busy_addr.load(Ordering::Relaxed), self.started.elapsed().saturating_sub(at))
        })
    }

    /// Install a span of a zero chunk ahead of the guest (a recorded working set's zero
    /// chunks: no fetch, and a fault saved per page the guest touches there). Skips spans
    /// already installed or being changed, never fills removed memory (it reads as zeros
    /// anyway).
    pub fn prefetch_zero_span(&self, span: &Span) {
        let mut st = self.state.lock().expect("poisoned");
        if st.installed.contains(&(span.region, span.unit)) || st.poisoned.contains(&(span.region, span.unit)) {
            return;
        }
        let page = self.map.regions[span.region].page_size;
        for (removed, a, b) in st.removed.split(span.host, span.host + span.len) {
            if !removed && self.fill_zeros(a, b, page).is_err() {
                return;
            }
        }
        st.installed.insert((span.region, span.unit));
    }

    /// Install one span ahead of the guest (prefetch). Returns the bytes installed; skips
    /// spans already installed, poisoned, or being changed (the fault path serves those).
    pub fn prefetch_span(&self, span: &Span) -> u64 {
        {
            let st = self.state.lock().expect("poisoned");
            if st.installed.contains(&(span.region, span.unit)) || st.poisoned.contains(&(span.region, span.unit)) {
                return 0;
            }
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
            match self.fill(Op::Copy(d), a, b - a, page) {
                Ok(()) => done += b - a,
                Err(Fill::Gone) => {
                    self.gone.store(true, Ordering::Relaxed);
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

#[derive(Debug, Clone, Copy)]
enum Kind {
    Zero,
    Removed,
    CacheHit,
    Fetched,
    Present,
    Poisoned,
}

/// A page of zeros at least `len` long (huge pages have no UFFDIO_ZEROPAGE).
fn zeros(len: u64) -> &'static [u8] {
    static Z: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    let z = Z.get_or_init(|| vec![0u8; super::handshake::MAX_PAGE_SIZE as usize]);
    &z[..len as usize]
}
