//! One connection's fault loop: the only reader of the process's userfaultfd. It turns
//! events into work for the [`Installer`] and a small fetch pool, and tells the stream
//! what it waits for ([`Demand`]).
//!
//! ```text
//! poll(uffd, socket, pool) -> events: REMOVE/UNMAP -> Installer::removed
//!                                     PAGEFAULT    -> pending
//! pending fault -> installed from slices since?      wake
//!               -> on a working-set slice in flight? park on the replay (its install wakes)
//!               -> chunks not in memory?             park; pool: Slicing's slice + the chunk
//!               -> otherwise                         Installer::fault (zeros, bytes, poison)
//! pool done     -> slices: Installer::install_slices, wake; chunk: its faults go first
//! ```
//!
//! The fault thread does the work of a fault itself, so a fault never waits behind the
//! prefetcher; every install happens on this thread or under the installer's lock.

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::ops::Range;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use userfaultfd::{Event, EventBuffer, Uffd};

use crate::fetch::{FetchFailure, Origin, SliceFetch, Work};
use crate::install::{Arrivals, Installer, Kind};
use crate::pacing::{Background, Kind as PaceKind};
use crate::prefetch::Demand;
use crate::slicing::Slicing;
use crate::stats::{Counters, End};
use crate::workingset::Pending;

/// Called from the fault thread with the parent's connection and the child's userfaultfd.
pub(crate) type ForkHook = Box<dyn Fn(&Conn, Uffd) + Send + Sync>;

/// One connection: its installer, what its stream and working-set replay share with the
/// fault loop, and the fault loop itself ([`Conn::run`]).
pub(crate) struct Conn {
    pub inst: Arc<Installer>,
    pub demand: Arc<Demand>,
    /// Working-set slices the replay is fetching: a fault on one waits for it.
    pub ws: Arc<Pending>,
    started: Instant,
    /// Microseconds since `started` (+1) at which the oldest waiting fault was read; 0 idle.
    busy_since: AtomicU64,
    busy_addr: AtomicU64,
    /// Fetch a chunk's first misses by slice (`LazyOptions::slice_faults`).
    pub slice_faults: bool,
    /// The background class's pacing: the faults' slice fetches are its best samples of
    /// what a fault's request meets on the link.
    pub pacing: Option<Arc<Background>>,
    /// Who takes the userfaultfd of a child the process forked (UFFD_EVENT_FORK). Without
    /// one the child's uffd is closed, and the kernel then zero-fills whatever the child
    /// touches that was not yet installed: only for runtimes that do not fork.
    pub on_fork: Option<ForkHook>,
}

struct Fault {
    addr: u64,
    read_at: Instant,
    /// Waited for the working-set replay long enough: fetch for itself.
    no_replay: bool,
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

/// Fetch threads per connection: a slice and its chunk for each of 8 vCPUs' faults at once.
/// With 8 threads, 8 vCPUs faulting together queued half their slices behind the others'
/// chunks: a clustered guest's fault waited about two round trips (p50 57 ms at 20 ms,
/// bench/wan.sh --vcpus 8).
const FETCHERS: usize = 16;

/// Fetch threads started with the fault loop, before the first fault: its slice and its
/// chunk. The rest start when a job finds every thread busy: started all at once, with the
/// stream's, they took the host's cores at the guest's first fault (bench/wake.sh).
const FIRST_FETCHERS: usize = 2;

/// The fault thread's end of the fetch pool: jobs go out through `tx`; a job that finds
/// every thread busy starts one more, up to [`FETCHERS`].
struct Pool<'a> {
    tx: mpsc::Sender<(Key, Job)>,
    /// Jobs sent whose results have not come back.
    busy: usize,
    threads: usize,
    /// Starts a thread; false when the system has none to give.
    start: &'a dyn Fn() -> bool,
}

impl Pool<'_> {
    fn start_up_to(&mut self, n: usize) {
        while self.threads < n.min(FETCHERS) && (self.start)() {
            self.threads += 1;
        }
    }

    fn send(&mut self, key: Key, job: Job) -> Result<(), End> {
        if self.busy >= self.threads {
            self.start_up_to(self.threads + 1);
        }
        if self.threads == 0 {
            // Out of threads: nothing would ever take the job.
            return Err(End::Failed("no fetch thread could be started".into()));
        }
        self.tx.send((key, job)).map_err(|_| End::Failed("fetch pool gone".into()))?;
        self.busy += 1;
        Ok(())
    }
}

/// What the fetch pool is asked for.
enum Job {
    /// A whole chunk; `true`: sent beside a slice fetch that also reads the chunk's CVs,
    /// so its request leaves [`SLICE_HEAD_START`] after theirs.
    Chunk(u64, bool),
    /// Slices of a chunk, one range request.
    Slices(u64, Range<u32>),
}

/// How much later the whole chunk's request leaves than those of a slice fetch beside it
/// that must read the chunk's CVs (an image opened with outboard tables). The three
/// requests go out at once from three threads; when the chunk's answer (1 MiB) reached the
/// bottleneck first, the slice's and the CVs' answers (12 KiB) queued behind it: +8 ms at
/// 1 Gbit/s on the guest's first fault (bench/wake.sh at 20 ms RTT: ready to first page
/// 30.6 ms, 22.8 ms with this head start). Far under a round trip, so the chunk still
/// arrives about one round trip after the fault.
const SLICE_HEAD_START: Duration = Duration::from_millis(1);

/// What parked faults wait for: a chunk, or one slice fetch (numbered by [`Slicing`]: two
/// fetches of one chunk's slices may be in flight).
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

impl Conn {
    pub fn new(inst: Arc<Installer>, demand: Arc<Demand>, ws: Arc<Pending>, started: Instant) -> Conn {
        Conn { inst, demand, ws, started, busy_since: AtomicU64::new(0), busy_addr: AtomicU64::new(0), slice_faults: false, pacing: None, on_fork: None }
    }

    /// A connection for a child this one's process forked ([`Installer::child`]), with a
    /// fault loop of its own and no stream or replay.
    pub fn child(&self, uffd: Uffd, conn: Arc<Counters>) -> Conn {
        let now = Instant::now();
        let mut c = Conn::new(Arc::new(self.inst.child(uffd, conn)), Arc::new(Demand::new(now, None)), Arc::default(), now);
        c.slice_faults = self.slice_faults;
        c
    }

    pub fn pid(&self) -> i32 {
        self.inst.pid
    }

    /// The address of the oldest fault waiting, and how long it has waited, if one is.
    pub fn waiting(&self) -> Option<(u64, Duration)> {
        let since = self.busy_since.load(Ordering::Relaxed);
        (since != 0).then(|| {
            let at = Duration::from_micros(since - 1);
            (self.busy_addr.load(Ordering::Relaxed), self.started.elapsed().saturating_sub(at))
        })
    }

    /// Read every pending event without blocking: faults are queued, removes applied.
    fn drain_events(&self, pending: &mut VecDeque<Fault>) -> Result<(), End> {
        let mut buf = EventBuffer::new(64);
        loop {
            let events: Vec<_> = match self.inst.io.uffd().read_events(&mut buf) {
                Ok(it) => it.collect(),
                Err(userfaultfd::Error::ReadEof) => return Err(End::UffdClosed),
                Err(e) => return Err(End::Failed(format!("reading the userfaultfd: {e}"))),
            };
            if events.is_empty() {
                return Ok(());
            }
            let now = Instant::now();
            for e in events {
                match e {
                    Ok(Event::Pagefault { addr, .. }) => pending.push_back(Fault { addr: addr as u64, read_at: now, no_replay: false }),
                    Ok(Event::Remove { start, end }) | Ok(Event::Unmap { start, end }) => self.inst.removed(start as u64, end as u64),
                    Ok(Event::Remap { from, to, len }) => {
                        tracing::warn!("pid {}: guest memory remapped {from:?} -> {to:?} ({len} bytes): not followed", self.pid())
                    }
                    Ok(Event::Fork { uffd }) => match &self.on_fork {
                        Some(hook) => hook(self, uffd),
                        None => {
                            tracing::warn!("pid {}: fork event not followed: the child's untouched memory will read as zeros", self.pid());
                            drop(uffd);
                        }
                    },
                    Err(e) => tracing::warn!("pid {}: bad userfaultfd event: {e}", self.pid()),
                }
            }
        }
    }

    /// Serve one fault through the installer and count it. `Err` ends the connection.
    fn serve(&self, f: &Fault, pending: &mut VecDeque<Fault>, arrived: &mut Arrivals) -> Result<(), End> {
        let mut again = || self.drain_events(pending);
        let kind = match self.inst.map.span_at(f.addr) {
            None => self.inst.fault_outside(f.addr, &mut again)?,
            Some(span) => self.inst.fault(&span, f.addr, arrived, &mut again)?,
        };
        if let Some(kind) = kind {
            let rec = &self.inst.rec;
            match kind {
                Kind::Zero => rec.add(|c| &c.zero, 1),
                Kind::Removed => {
                    rec.add(|c| &c.zero, 1);
                    rec.add(|c| &c.removed_zero, 1);
                }
                Kind::CacheHit => rec.add(|c| &c.cache_hit, 1),
                Kind::Fetched => rec.add(|c| &c.fetched, 1),
                Kind::Present | Kind::Poisoned => rec.add(|c| &c.present, 1),
            }
            rec.latency(f.read_at.elapsed().as_micros() as u64);
        }
        Ok(())
    }

    /// Wake faults a slice install served and count them (with `fetched`, the first as the
    /// fetch; the others as present); hand back those it did not serve (a remove in between).
    fn wake_sliced(&self, faults: Vec<Fault>, fetched: bool) -> Vec<Fault> {
        let mut left = Vec::new();
        let mut first = fetched;
        for f in faults {
            if !self.inst.slice_installed(f.addr) {
                left.push(f);
                continue;
            }
            let page = self.inst.page_at(f.addr);
            self.inst.io.wake(f.addr & !(page - 1), page);
            let rec = &self.inst.rec;
            if std::mem::take(&mut first) {
                rec.add(|c| &c.fetched, 1);
                rec.add(|c| &c.slice_fetches, 1);
            } else {
                rec.add(|c| &c.present, 1);
            }
            rec.latency(f.read_at.elapsed().as_micros() as u64);
        }
        left
    }

    /// The fault loop: until the peer goes away. Returns why the connection ended.
    ///
    /// Faults whose chunks must be fetched are parked while a small pool fetches them, so
    /// one slow chunk does not hold up faults on other chunks; every install still happens
    /// on this thread, which alone reads the uffd's events.
    pub fn run(&self, mut sock: UnixStream, stop: &AtomicBool) -> End {
        let mut pending: VecDeque<Fault> = VecDeque::new();
        let mut parked: HashMap<Key, Vec<Fault>> = HashMap::new();
        let mut arrived = Arrivals::default();
        let (wake_tx, wake_rx) = match UnixStream::pair() {
            Ok(p) => p,
            Err(e) => return End::Failed(format!("creating the wake-up socket: {e}")),
        };
        let _ = wake_rx.set_nonblocking(true);
        let _ = wake_tx.set_nonblocking(true);
        let (job_tx, job_rx) = mpsc::channel::<(Key, Job)>();
        let (done_tx, done_rx) = mpsc::channel::<Finished>();
        let job_rx = Mutex::new(job_rx);
        let (fetcher, pacing) = (&self.inst.fetcher, &self.pacing);
        std::thread::scope(|scope| {
            let start = || {
                let (job_rx, done_tx, wake_tx) = (&job_rx, done_tx.clone(), &wake_tx);
                std::thread::Builder::new()
                    .name("lazy-fetch".into())
                    .spawn_scoped(scope, move || loop {
                        let Ok((key, job)) = job_rx.lock().expect("poisoned").recv() else { return };
                        // The fetch's bytes take the background's window first while it runs.
                        let wire = match &job {
                            Job::Chunk(c, _) => fetcher.wire_bytes(*c),
                            Job::Slices(c, range) => fetcher.slice_bytes(*c, range.clone()),
                        };
                        let held = pacing.as_ref().map(|bg| bg.foreground(wire));
                        let done = match job {
                            Job::Chunk(c, behind_slice) => {
                                if behind_slice {
                                    std::thread::sleep(SLICE_HEAD_START);
                                }
                                let (o, origin, work) = fetcher.get(c);
                                (key, Done::Chunk(o.map(|_| ()), origin), work)
                            }
                            Job::Slices(c, range) => {
                                let t = Instant::now();
                                let (o, work) = fetcher.get_slices(c, range);
                                // A slice read from the source at the first try: one sample of
                                // what a fault's request meets.
                                if let (Some(bg), Ok(SliceFetch::Slices(_))) = (pacing, &o) {
                                    if work.retries == 0 && work.verify_failures == 0 {
                                        bg.sample(PaceKind::Slice, t.elapsed());
                                    }
                                }
                                (key, Done::Slices(o), work)
                            }
                        };
                        drop(held);
                        if done_tx.send(done).is_err() {
                            return;
                        }
                        let _ = (&*wake_tx).write(&[1]);
                    })
                    .is_ok()
            };
            let mut pool = Pool { tx: job_tx, busy: 0, threads: 0, start: &start };
            pool.start_up_to(FIRST_FETCHERS);
            let mut q = Queues { pending: &mut pending, parked: &mut parked, ws_parked: Vec::new(), arrived: &mut arrived, slicing: Slicing::default() };
            let ended = self.fault_loop(&mut sock, stop, &mut q, &mut pool, &done_rx, &wake_rx);
            // The threads end once the jobs' channel is closed.
            drop(pool);
            ended
        })
    }

    fn fault_loop(
        &self,
        sock: &mut UnixStream,
        stop: &AtomicBool,
        q: &mut Queues,
        pool: &mut Pool,
        done_rx: &mpsc::Receiver<Finished>,
        wake_rx: &UnixStream,
    ) -> End {
        loop {
            if stop.load(Ordering::Relaxed) {
                return End::Stopping;
            }
            // Before waiting: a fault parked just now waits from now on, and the prefetcher
            // must yield to it now, not after the poll below.
            self.publish_parked(q.parked);
            if q.pending.is_empty() {
                if let Err(end) = self.wait(sock, wake_rx, !q.ws_parked.is_empty()) {
                    return end;
                }
            }
            if let Err(e) = self.drain_events(q.pending) {
                return e;
            }
            // Fetches that finished: their faults go first.
            while let Ok((key, done, work)) = done_rx.try_recv() {
                pool.busy -= 1;
                if let Err(end) = self.finished(key, done, &work, q) {
                    return end;
                }
            }
            self.expire(q);
            self.recheck_ws_parked(q);
            self.publish_parked(q.parked);
            self.publish_oldest(q);
            if let Some(f) = q.pending.pop_front() {
                if let Err(end) = self.next_fault(f, q, pool) {
                    return end;
                }
            }
        }
    }

    /// Wait for an event, the peer, or the pool. `ws_waits`: faults wait on the
    /// working-set replay, which wakes nobody here: look again soon.
    fn wait(&self, sock: &mut UnixStream, wake_rx: &UnixStream, ws_waits: bool) -> Result<(), End> {
        let mut fds = [
            PollFd::new(self.inst.io.uffd().as_fd(), PollFlags::POLLIN),
            PollFd::new(sock.as_fd(), PollFlags::POLLIN),
            PollFd::new(wake_rx.as_fd(), PollFlags::POLLIN),
        ];
        // Faults parked on the working-set replay are woken by its installs; a slice
        // it could not install goes back to the fault path at the next look.
        let timeout = if ws_waits { 2u16 } else { 200 };
        match poll(&mut fds, PollTimeout::from(timeout)) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(e) => return Err(End::Failed(format!("poll failed: {e}"))),
        }
        let (u, s) = (fds[0].revents().unwrap_or(PollFlags::empty()), fds[1].revents().unwrap_or(PollFlags::empty()));
        if u.intersects(PollFlags::POLLERR | PollFlags::POLLHUP | PollFlags::POLLNVAL) {
            return Err(End::UffdClosed);
        }
        if s.intersects(PollFlags::POLLHUP | PollFlags::POLLERR) {
            return Err(End::PeerClosed);
        }
        if s.contains(PollFlags::POLLIN) {
            // Nothing more is expected after the handshake: drain and ignore, EOF ends.
            let mut b = [0u8; 512];
            match sock.read(&mut b) {
                Ok(0) => return Err(End::PeerClosed),
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(End::Failed(format!("socket: {e}"))),
            }
        }
        let mut b = [0u8; 64];
        while matches!((&*wake_rx).read(&mut b), Ok(n) if n > 0) {}
        Ok(())
    }

    /// A fetch of the pool finished: its faults go to the front of the queue, slices are
    /// installed at once, a chunk fetched beside a slice that no fault waits for is
    /// installed ahead of the guest.
    fn finished(&self, key: Key, done: Done, work: &Work, q: &mut Queues) -> Result<(), End> {
        self.inst.account(work);
        let faults = q.parked.remove(&key).unwrap_or_default();
        let requeue = match (key, done) {
            (Key::Chunk(c), Done::Chunk(res, origin)) => {
                match res {
                    // Fetched beside a slice, and no fault waits for it: install it
                    // now, so the guest's next touches there do not fault. A chunk of a
                    // huge page fetched beside its sibling (a fault waits on that one)
                    // is left for that fault: installing here would wait for the sibling
                    // on this thread.
                    Ok(()) if faults.is_empty() => {
                        for span in self.inst.map.spans_of_chunk(c) {
                            if span.chunks(self.inst.map.chunk_shift).count() == 1 {
                                self.inst.prefetch_span(&span);
                            } else {
                                q.arrived.origin.insert(c, origin);
                            }
                        }
                        // The install woke the faults parked on a slice of this chunk:
                        // they are served (and counted, as this fetch) now, not when
                        // their slice comes, by which time the peer may be gone.
                        let mut woken = Vec::new();
                        for (k, v) in q.parked.iter_mut() {
                            if matches!(k, Key::Slices(s, _) if *s == c) {
                                woken.append(v);
                            }
                        }
                        if !woken.is_empty() {
                            q.arrived.origin.insert(c, origin);
                        }
                        woken
                    }
                    Ok(()) => {
                        q.arrived.origin.insert(c, origin);
                        faults
                    }
                    // No fault waits: the next one on this chunk fetches it again.
                    Err(_) if faults.is_empty() => faults,
                    Err(f) => {
                        q.arrived.failed.insert(c, f);
                        faults
                    }
                }
            }
            (Key::Slices(c, id), Done::Slices(res)) => {
                q.slicing.finished(id);
                match res {
                    // Its faults timed out (`expire`): nothing waits for what it found.
                    Ok(SliceFetch::Whole) | Err(_) if faults.is_empty() => faults,
                    Ok(SliceFetch::Slices(v)) => {
                        self.inst.install_slices(c, &v, &mut || self.drain_events(q.pending))?;
                        self.wake_sliced(faults, true)
                    }
                    Ok(SliceFetch::Whole) => {
                        // Never over this connection's own fetch of the chunk that
                        // put it there: that one counts as the fetch.
                        q.arrived.origin.entry(c).or_insert(Origin::Cache);
                        faults
                    }
                    Ok(SliceFetch::Declined) => {
                        q.slicing.whole(c);
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
        Ok(())
    }

    /// Look at the next pending fault: wake it, park it on the replay or on fetches, or
    /// serve it now.
    fn next_fault(&self, f: Fault, q: &mut Queues, pool: &mut Pool) -> Result<(), End> {
        if self.inst.slice_installed(f.addr) {
            // Installed by a slice fetch since it was read: only a wake-up is needed.
            let _ = self.wake_sliced(vec![f], false);
            return Ok(());
        }
        if !f.no_replay && self.ws_waiting(f.addr) {
            self.inst.rec.add(|c| &c.ws_waits, 1);
            q.ws_parked.push(f);
            return Ok(());
        }
        let need = self.inst.chunks_to_fetch(f.addr, |c| q.parked.contains_key(&Key::Chunk(c)));
        let Some(&c) = need.iter().find(|c| !q.arrived.origin.contains_key(c) && !q.arrived.failed.contains_key(c)) else {
            return self.serve(&f, q.pending, q.arrived);
        };
        if need.len() == 1 && self.slice_faults && !q.parked.contains_key(&Key::Chunk(c)) && !self.inst.fetcher.in_flight(c) {
            let (map, image, file) = (&self.inst.map, &self.inst.fetcher.image, self.inst.fetcher.file);
            if let Some((id, job)) = q.slicing.plan(map, image, file, f.addr, c, q.pending.iter().map(|p| p.addr)) {
                let key = Key::Slices(c, id);
                q.parked.entry(key).or_default().push(f);
                if let Some(range) = job {
                    self.demand.missed(c);
                    let cvs_to_read = image.slice_cvs(file, c).is_none();
                    pool.send(key, Job::Slices(c, range))?;
                    // The whole chunk at once, beside the slice: the slice serves this
                    // fault in a round trip, the chunk the guest's next touches there
                    // without another (installed when it arrives). Not while a working set
                    // is replayed or on its way: it carries those touches, and whole chunks
                    // beside it would be megabytes ahead of it on the link.
                    if self.ws.expected() {
                        return Ok(());
                    }
                    let whole = Key::Chunk(c);
                    if let std::collections::hash_map::Entry::Vacant(e) = q.parked.entry(whole) {
                        e.insert(Vec::new());
                        pool.send(whole, Job::Chunk(c, cvs_to_read))?;
                    }
                }
                return Ok(());
            }
        }
        let key = Key::Chunk(c);
        let first = !q.parked.contains_key(&key);
        q.parked.entry(key).or_default().push(f);
        if first {
            self.demand.missed(c);
            pool.send(key, Job::Chunk(c, false))?;
        }
        // A huge page needs several chunks: all of them are asked for at once (the fault
        // waits on the first, then on the next still missing), not one round trip each.
        for &other in need.iter().filter(|&&o| o != c && !q.arrived.origin.contains_key(&o) && !q.arrived.failed.contains_key(&o)) {
            if let std::collections::hash_map::Entry::Vacant(e) = q.parked.entry(Key::Chunk(other)) {
                e.insert(Vec::new());
                self.demand.missed(other);
                pool.send(Key::Chunk(other), Job::Chunk(other, false))?;
            }
        }
        Ok(())
    }

    /// The retry budget bounds how long a fault waits for its bytes, whatever the transport
    /// does: a source that drips bytes keeps every read alive and never fails, so the
    /// fetcher's own budget (checked between failed attempts) never runs out. A fault parked
    /// longer than the budget is served with a timeout, which poisons its span as any
    /// failure does; its fetch goes on, and its result, if it comes, finds the span settled.
    /// A fault waiting on the working-set replay leaves it after half the budget and fetches
    /// for itself.
    fn expire(&self, q: &mut Queues) {
        let Some(budget) = self.inst.fetcher.budget() else { return };
        let now = Instant::now();
        let late = |f: &Fault| now.duration_since(f.read_at) >= budget;
        let keys: Vec<Key> = q.parked.iter().filter(|(_, faults)| faults.iter().any(late)).map(|(k, _)| *k).collect();
        for key in keys {
            let (Key::Chunk(c) | Key::Slices(c, _)) = key;
            if let Key::Slices(_, id) = key {
                q.slicing.finished(id);
            }
            q.arrived.failed.insert(c, FetchFailure::TimedOut { chunk: c, seconds: budget.as_secs_f64() });
            for f in q.parked.remove(&key).unwrap_or_default().into_iter().rev() {
                q.pending.push_front(f);
            }
        }
        if q.ws_parked.iter().any(|f| now.duration_since(f.read_at) >= budget / 2) {
            let (gone, wait): (Vec<Fault>, Vec<Fault>) =
                std::mem::take(&mut q.ws_parked).into_iter().partition(|f| now.duration_since(f.read_at) >= budget / 2);
            q.ws_parked = wait;
            for mut f in gone.into_iter().rev() {
                f.no_replay = true;
                q.pending.push_front(f);
            }
        }
    }

    /// Whether the page of `addr` lies in a slice the working-set replay is fetching.
    fn ws_waiting(&self, addr: u64) -> bool {
        self.ws.active() && self.inst.slice_at(addr).is_some_and(|at| self.ws.contains(at))
    }

    /// Faults parked on the working-set replay whose slice it is done with: woken and
    /// counted where it installed their page, back to the fault path where it did not (a
    /// slice that failed its check, a remove in between).
    fn recheck_ws_parked(&self, q: &mut Queues) {
        if q.ws_parked.is_empty() {
            return;
        }
        let active = self.ws.active();
        let (done, wait): (Vec<Fault>, Vec<Fault>) =
            std::mem::take(&mut q.ws_parked).into_iter().partition(|f| !active || self.inst.slice_at(f.addr).is_none_or(|at| !self.ws.contains(at)));
        q.ws_parked = wait;
        for f in self.wake_sliced(done, false).into_iter().rev() {
            q.pending.push_front(f);
        }
    }

    /// Tell the prefetcher (the CRIU push) how many faults wait.
    fn publish_parked(&self, parked: &HashMap<Key, Vec<Fault>>) {
        self.demand.publish(parked.values().map(|v| v.len() as u64).sum());
    }

    /// Tell the watchdog about the oldest fault waiting.
    fn publish_oldest(&self, q: &Queues) {
        let oldest = q.parked.values().flatten().chain(q.pending.iter()).min_by_key(|f| f.read_at).map(|f| (f.addr, f.read_at));
        match oldest {
            Some((addr, at)) => {
                self.busy_addr.store(addr, Ordering::Relaxed);
                self.busy_since.store(at.duration_since(self.started).as_micros() as u64 + 1, Ordering::Relaxed);
            }
            None => self.busy_since.store(0, Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// The fetch pool starts two threads with the fault loop and one more only when a job
    /// finds every thread busy, never more than FETCHERS: a guest's first fault no longer
    /// waits beside sixteen thread starts (bench/wake.sh at RTT 0: 4.4 → 2.3 ms from the
    /// handshake to the first page).
    #[test]
    fn regression_issue_23_fetch_threads_start_when_every_one_is_busy() {
        let started = Cell::new(0usize);
        let start = || {
            started.set(started.get() + 1);
            true
        };
        let (tx, rx) = mpsc::channel();
        let mut pool = Pool { tx, busy: 0, threads: 0, start: &start };
        pool.start_up_to(FIRST_FETCHERS);
        assert_eq!((pool.threads, started.get()), (2, 2));
        // A slice and its chunk: the two threads take them.
        pool.send(Key::Slices(0, 0), Job::Slices(0, 0..1)).unwrap();
        pool.send(Key::Chunk(0), Job::Chunk(0, true)).unwrap();
        assert_eq!((pool.busy, pool.threads), (2, 2));
        // Both come back: the next fault's pair needs no new thread.
        pool.busy -= 2;
        pool.send(Key::Slices(1, 1), Job::Slices(1, 0..1)).unwrap();
        pool.send(Key::Chunk(1), Job::Chunk(1, true)).unwrap();
        assert_eq!((pool.busy, pool.threads), (2, 2));
        // Every thread busy: one more per job, up to FETCHERS.
        for c in 2..40 {
            pool.send(Key::Chunk(c), Job::Chunk(c, false)).unwrap();
            assert_eq!(pool.threads, pool.busy.clamp(2, FETCHERS), "after {} jobs", pool.busy);
        }
        assert_eq!((pool.threads, started.get()), (FETCHERS, FETCHERS));
        assert_eq!(rx.try_iter().count(), 42, "every job was sent");
    }

    /// A host with no thread to give: the job is refused, never left with nobody to take it.
    #[test]
    fn a_pool_without_threads_refuses_jobs() {
        let (tx, _rx) = mpsc::channel();
        let mut pool = Pool { tx, busy: 0, threads: 0, start: &|| false };
        pool.start_up_to(FIRST_FETCHERS);
        assert!(matches!(pool.send(Key::Chunk(0), Job::Chunk(0, false)), Err(End::Failed(_))));
    }
}
