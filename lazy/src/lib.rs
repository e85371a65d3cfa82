//! Lazy restore: serve a restoring VM's page faults from verified chunks (userfaultfd),
//! so a sandbox runs before its memory has arrived. The last stage of the pipeline:
//! image -> registry -> chunk cache (`puller`) -> page faults (here).
//!
//! ```text
//! VMM --connect--> socket --handshake (regions JSON + uffd)--> connection thread
//!   fault loop:  uffd event -> region -> file offset -> chunk
//!                -> zero chunk / removed range: UFFDIO_ZEROPAGE
//!                -> recent memory -> chunk cache -> source (single-flight, retried,
//!                   verified) -> UFFDIO_COPY
//!                -> first miss of a chunk: its 4 KiB slice (checked against the
//!                   outboard) serves the fault, the whole chunk comes beside it
//!                -> still no verified bytes: UFFDIO_POISON
//!   working set: a recorded trace's touched slices, one blob read in ranges at
//!                connect, each checked, installed before the guest asks ([`workingset`])
//!   prefetcher:  trace chunks, then the rest (at once with `all`, or after a few
//!                misses) -> up to 32 requests in flight, fewer while faults
//!                wait -> same fetch and install path, gaps only
//!   fill:        once faults settle, the rest of the file into the chunk cache (not into
//!                the guest), paced as the stream is, pinned there while the daemon runs
//! ```
//!
//! How long a restore depends on its registry: until the fill has put every data chunk in
//! the chunk cache ([`fill`]). Meanwhile a [`lease`] the daemon renews keeps the image
//! through a `snapctl serve`'s gc; other registries keep it only while a tag names it.
//!
//! Two front doors share that fault path: [`Daemon`] speaks Firecracker's UFFD handshake,
//! [`criu::CriuDaemon`] takes the place of `criu lazy-pages`. Both are woken the same way
//! ([`wake::prepare`], then [`wake::Prepared::serve`] or [`wake::Prepared::serve_criu`]):
//! a front end (the CLI) gives its clients' transport, its policy's gate and its messages
//! ([`wake::Front`]) and its flags ([`LazyOptions`]), and the library does the rest. One daemon serves many
//! connections over one image, one chunk cache and one in-flight map. The wire contract
//! and the `--json` summary are in `spec/lazy.md`.
//!
//! | module | its one job |
//! | --- | --- |
//! | [`wake`] | before the first connection: clients, resolve, lease, the front end's gate, outboards and trace, the daemon |
//! | this file | the Firecracker front door: socket, admission, a thread per connection, metrics |
//! | [`criu`] | the CRIU front door (`criu lazy-pages`): protocol, per-task setup, the push after restore |
//! | `fault` | one connection's fault loop: reads the userfaultfd, parks faults on a fetch pool |
//! | `slicing` | which part of a chunk a miss fetches (slice, readahead, whole) |
//! | `install` | fetch -> verify -> install of chunks, slices, zeros and poison, for every caller |
//! | `uffdio` | the three filling ioctls and their partial results |
//! | `fetch` | verified chunks: recent memory -> chunk cache -> source, single-flight, retried |
//! | [`prefetch`] | what goes ahead of the guest and when: the stream, its pacing, the detector |
//! | [`workingset`] | replay of a recorded working set |
//! | `fill` | the rest of the served file into the chunk cache, so the restore stops depending on the registry |
//! | [`lease`] | the restore's lease on its image at the registry, renewed while the daemon runs |
//! | [`trace`] | the trace format and where traces are kept (layout tag, registry referrers) |
//! | `record` | what a recording restore keeps until its trace is stored |
//! | [`map`], [`handshake`], [`pagemap`], [`stats`] | address arithmetic, the handshake, CRIU's pagemap, counters |
//!
//! Who calls whom (no module calls back into one that calls it): the front doors make a
//! `fault::Conn` per process; the fault loop, the stream ([`prefetch`]), the working-set
//! replay and the CRIU push each fill memory only through `install::Installer`, which
//! fetches through `fetch` and fills through `uffdio`. The fault loop tells the stream what
//! it waits for through `prefetch::Demand` and looks up slices still on their way in
//! `workingset::Pending`; neither of those knows the fault loop.
//!
//! Whoever connects gets the snapshot's memory copied into their address space, so the
//! socket is the daemon's user's alone: it is created mode 0600 whatever the umask
//! ([`listen`]), and every peer's credentials (`SO_PEERCRED`) are checked before a byte
//! or a descriptor of theirs is read ([`admit`]).

pub mod criu;
mod fault;
mod fetch;
mod fill;
pub mod handshake;
mod install;
pub mod lease;
pub mod map;
pub mod pacing;
pub mod pagemap;
pub mod prefetch;
mod record;
mod slicing;
pub mod stats;
pub mod trace;
mod uffdio;
pub mod wake;
pub mod workingset;

use std::os::fd::{FromRawFd, IntoRawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use imgfmt::{BlobSource, Image};

pub use fetch::{ChunkStore, FetchFailure, RetryPolicy, DEFAULT_RETRY};
pub use fill::FILL_SETTLE;
pub use lease::{Lease, LEASE_SECONDS};
pub use prefetch::PrefetchMode;
pub use stats::{ConnReport, Counters, End, FillReport};
pub use trace::{LayoutTraces, LoadedAhead, RegistryTraces, Trace, TraceStore, TRACE_MEDIA_TYPE};

use fault::Conn;
use install::Installer;
use map::MemoryMap;

/// A fault waiting longer than this is logged by the watchdog.
pub const SLOW_FAULT: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum LazyError {
    /// {context}: {source}
    Io { context: String, source: std::io::Error },
    /// {0}
    Invalid(String),
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> LazyError {
    let context = context.into();
    move |source| LazyError::Io { context, source }
}

/// How the daemon behaves.
#[derive(Debug, Clone)]
pub struct LazyOptions {
    /// Unix socket to listen on.
    pub socket: PathBuf,
    pub prefetch: PrefetchMode,
    /// Prefetch at most this many bytes per second (0: unbounded).
    pub prefetch_rate: u64,
    /// Requests the prefetcher keeps in flight at most (it sizes its depth from a timed
    /// round trip up to this).
    pub stream_jobs: usize,
    /// With `PrefetchMode::Trace`: stream the rest of the image once faults have waited
    /// for this fraction of the file's data chunks (see [`prefetch::Detector`]); `None`:
    /// never.
    pub stream_after: Option<f64>,
    pub record_trace: bool,
    /// Serve a chunk's first misses by verified slice where its outboard allows
    /// (spec/lazy.md "Slice faults"); off: whole chunks. The outboards must be loaded
    /// either way for working sets to be recorded and replayed.
    pub slice_faults: bool,
    /// Finish the served file into the chunk cache in the background (spec/lazy.md "The
    /// fill"), so the restore stops depending on the registry. Needs a chunk cache.
    pub fill: bool,
    pub retry: RetryPolicy,
    /// Recently used chunks kept in memory, in bytes.
    pub memory_bytes: u64,
    /// Exit after the first connection (that completed its handshake) ends.
    pub once: bool,
    /// Written (with the socket path) once the socket is bound.
    pub ready_file: Option<PathBuf>,
    /// Users whose processes may connect besides the daemon's own (a jailed VMM).
    pub allow_uids: Vec<u32>,
    /// Groups (a peer's primary group) whose processes may connect.
    pub allow_gids: Vec<u32>,
}

impl LazyOptions {
    pub fn new(socket: PathBuf) -> Self {
        LazyOptions {
            socket,
            prefetch: PrefetchMode::Trace,
            // Unbounded: the stream paces itself beside the faults (crate::pacing); a bound
            // of 256 MiB/s held a scattered restore at 4.5 s against a 2.0 s pull on an
            // uncapped 20 ms path (BENCHMARKS.md, "Lazy restore across a network").
            prefetch_rate: 0,
            stream_jobs: prefetch::DEFAULT_STREAM_JOBS,
            stream_after: Some(prefetch::DEFAULT_STREAM_AFTER),
            record_trace: false,
            slice_faults: true,
            fill: true,
            retry: fetch::DEFAULT_RETRY,
            memory_bytes: 256 << 20,
            once: false,
            ready_file: None,
            allow_uids: Vec::new(),
            allow_gids: Vec::new(),
        }
    }
}

/// The daemon: one image file, many connections.
pub struct Daemon {
    fetcher: Arc<fetch::Fetcher>,
    opts: LazyOptions,
    counters: Arc<Counters>,
    conns: Mutex<Vec<Weak<Conn>>>,
    active: AtomicU64,
    total: AtomicU64,
    /// The trace replayed, shared (never copied) by every connection.
    replay: Mutex<Option<Replay>>,
    /// A trace is on its way ([`Daemon::expect_replay`]): connections that start before it
    /// arrives wait for it on a thread of their own, beside their faults.
    coming: AtomicBool,
    /// Notified when the trace arrives or will not ([`Daemon::set_replay`]).
    arrived: Condvar,
    traces: Option<Box<dyn TraceStore>>,
    stop: Arc<AtomicBool>,
    /// Accept no more connections; return once those being served have ended.
    draining: AtomicBool,
    /// The fill of the chunk cache, shared by the connections (`None`: off, or no cache).
    fill: Option<Arc<fill::Fill>>,
    /// The served file's chunks, pinned in the chunk cache while the daemon lives.
    _pin: Option<Box<dyn std::any::Any + Send + Sync>>,
}

/// A trace to replay and its working set's plan, made once and shared by every connection.
struct Replay {
    trace: Arc<Trace>,
    /// `None`: no working set to replay (none recorded, or one that does not fit the image),
    /// or a recording daemon (pages installed ahead would never fault, and the working set
    /// it records would be only what the guest touched beyond the last).
    plan: Option<Arc<workingset::Plan>>,
}

impl Replay {
    fn new(image: &Image, file: usize, opts: &LazyOptions, trace: Trace) -> Replay {
        let trace = Arc::new(trace);
        // A recorded working set replaces the trace's chunk order: it holds what the guest
        // touched, by slice, where the chunk order of a scattered guest is nearly every chunk.
        let plan = match opts.prefetch {
            PrefetchMode::Trace | PrefetchMode::All if !opts.record_trace => workingset::Plan::new(image, file, &trace).unwrap_or_else(|e| {
                tracing::warn!("ignoring the trace's working set: {e}");
                None
            }),
            _ => None,
        };
        Replay { trace, plan: plan.map(Arc::new) }
    }
}

/// The trace `store` holds for file `file` of `image`, said on stderr; a trace that cannot
/// be used costs speed, not correctness: it is logged and left out.
fn load_trace(store: &dyn TraceStore, image: &Image, file: usize) -> Option<Trace> {
    let t = match store.load(image, file) {
        Ok(t) => t?,
        Err(e) => {
            tracing::warn!("ignoring the trace in {}: {e}", store.describe());
            return None;
        }
    };
    tracing::info!(
        "using the trace {} (created {}): {} chunks, a working set of {} slices, {} zero chunks",
        t.manifest.as_ref().map_or_else(|| "?".to_string(), |d| d.to_string()),
        t.created.as_deref().unwrap_or("?"),
        t.chunks.len(),
        t.working_set.len(),
        t.zero_chunks.len()
    );
    Some(t)
}

impl Daemon {
    /// Serve file `file` of `image` (read from `src`), with an optional chunk cache and an
    /// optional place to find and keep prefetch traces.
    pub fn new(
        image: Arc<Image>,
        file: usize,
        src: Arc<dyn BlobSource>,
        store: Option<Arc<dyn ChunkStore>>,
        traces: Option<Box<dyn TraceStore>>,
        opts: LazyOptions,
    ) -> Result<Arc<Self>, LazyError> {
        if file >= image.files.len() {
            return Err(LazyError::Invalid(format!("no file #{file} in the image")));
        }
        let trace = match (&traces, opts.prefetch) {
            (Some(t), PrefetchMode::Trace | PrefetchMode::All) => load_trace(t.as_ref(), &image, file),
            _ => None,
        };
        let replay = trace.map(|t| Replay::new(&image, file, &opts, t));
        let mut memory = opts.memory_bytes;
        if opts.record_trace {
            // Recording installs the guest's pages one fault at a time, each from its chunk
            // in recent memory: every data chunk the guest touches must stay there.
            memory = memory.max(image.files[file].chunks.iter().filter(|c| !matches!(c.at, imgfmt::StoredAt::Zero)).map(|c| u64::from(c.len)).sum());
        }
        // The image's chunks stay in the cache while the daemon runs, whoever evicts.
        let pin = store.as_ref().and_then(|s| {
            let f = &image.files[file];
            let chunks: Vec<_> = f.chunks.iter().filter(|c| !matches!(c.at, imgfmt::StoredAt::Zero)).map(|c| (image.config().hash, c.digest)).collect();
            s.pin(&format!("snapctl lazy (pid {}) serving {} of {}", std::process::id(), f.name, image.manifest_digest), &chunks)
        });
        let fetcher = Arc::new(fetch::Fetcher::new(image, file, src, store, opts.retry, memory));
        let fill = (opts.fill && fetcher.store().is_some()).then(|| Arc::new(fill::Fill::new(&fetcher)));
        Ok(Arc::new(Daemon {
            fetcher,
            opts,
            counters: Arc::new(Counters::default()),
            conns: Mutex::new(Vec::new()),
            active: AtomicU64::new(0),
            total: AtomicU64::new(0),
            replay: Mutex::new(replay),
            coming: AtomicBool::new(false),
            arrived: Condvar::new(),
            traces,
            stop: Arc::new(AtomicBool::new(false)),
            draining: AtomicBool::new(false),
            fill,
            _pin: pin,
        }))
    }

    pub fn has_trace(&self) -> bool {
        self.replay.lock().expect("poisoned").is_some()
    }

    /// Say that a trace to replay is on its way (its outboards and trace still being read
    /// when the socket is bound): a connection that starts before
    /// [`set_replay`](Self::set_replay) serves its faults at once and replays the working
    /// set once it arrives.
    pub fn expect_replay(&self) {
        self.coming.store(true, Ordering::Relaxed);
    }

    /// The trace read from `store` for this daemon's file, now that the image's outboards
    /// are in place (a working set is planned by slice against them), or none if there is
    /// none or it cannot be used. Wakes the connections waiting for it.
    pub fn set_replay(&self, store: &dyn TraceStore) {
        let image = &self.fetcher.image;
        let replay = match self.opts.prefetch {
            PrefetchMode::Trace | PrefetchMode::All => {
                load_trace(store, image, self.fetcher.file).map(|t| Replay::new(image, self.fetcher.file, &self.opts, t))
            }
            PrefetchMode::None => None,
        };
        let mut r = self.replay.lock().expect("poisoned");
        if replay.is_some() {
            *r = replay;
        }
        self.coming.store(false, Ordering::Relaxed);
        self.arrived.notify_all();
    }

    /// The replay once it is known, waiting while it is on its way, until `stop`.
    fn replay_when_known(&self, stop: &AtomicBool) -> Option<(Arc<Trace>, Option<Arc<workingset::Plan>>)> {
        let mut r = self.replay.lock().expect("poisoned");
        while self.coming.load(Ordering::Relaxed) && !stop.load(Ordering::Relaxed) {
            r = self.arrived.wait_timeout(r, Duration::from_millis(20)).expect("poisoned").0;
        }
        r.as_ref().map(|r| (r.trace.clone(), r.plan.clone()))
    }

    /// Read the background class (the stream, the working-set replay) through `src`, a
    /// client of its own beside the faults' (see `Fetcher::set_background_source`).
    pub fn set_background_source(&self, src: Arc<dyn BlobSource>) {
        self.fetcher.set_background_source(src);
    }

    /// Daemon-wide counters as Prometheus text.
    pub fn metrics_text(&self) -> String {
        stats::prometheus(&self.counters, self.active.load(Ordering::Relaxed), self.total.load(Ordering::Relaxed))
    }

    /// Serve `GET /metrics` on `addr` from a background thread; returns the bound address.
    pub fn serve_metrics(self: &Arc<Self>, addr: &str) -> Result<std::net::SocketAddr, LazyError> {
        serve_metrics(self, addr, Daemon::metrics_text)
    }

    /// Ask `run` to return (connections end at their next poll). A guest still being
    /// served then reads every page not yet installed as zeros: see [`Daemon::drain`].
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Ask `run` to stop accepting connections (the socket is removed) and to return once
    /// every connection being served has ended: what SIGTERM does.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Connections being served.
    pub fn active(&self) -> u64 {
        self.active.load(Ordering::Relaxed)
    }

    /// Bind the socket and serve connections until stopped (or, with `once`, until the
    /// first connection ends). `on_report` gets each finished connection's summary.
    pub fn run(self: &Arc<Self>, on_report: Arc<dyn Fn(&ConnReport) + Send + Sync>) -> Result<(), LazyError> {
        let path = &self.opts.socket;
        // A socket file left by an earlier daemon would make bind fail; anything else
        // under that name is not ours to delete.
        let (listener, cleanup) = listen(path, self.opts.ready_file.as_deref(), "daemon", "")?;
        self.spawn_watchdog();
        let mut workers: Vec<std::thread::JoinHandle<bool>> = Vec::new();
        loop {
            if self.stop.load(Ordering::Relaxed) || self.draining.load(Ordering::Relaxed) {
                break;
            }
            match listener.accept() {
                Ok((stream, _)) if !admit(&stream, &self.opts) => drop(stream),
                Ok((stream, _)) => {
                    let me = self.clone();
                    let cb = on_report.clone();
                    let h = std::thread::Builder::new()
                        .name("lazy-conn".into())
                        .spawn(move || me.connection(stream, cb.as_ref()))
                        .map_err(io_err("spawning a connection thread"))?;
                    workers.push(h);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => wait_for_connection(&listener),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => tracing::warn!("accept: {e}"),
            }
            let (done, running): (Vec<_>, Vec<_>) = workers.into_iter().partition(|h| h.is_finished());
            workers = running;
            for h in done {
                if h.join().unwrap_or(false) && self.opts.once {
                    self.stop();
                }
            }
        }
        // No new connections from here on; those being served run to their end.
        drop(listener);
        drop(cleanup);
        for h in workers {
            let _ = h.join();
        }
        Ok(())
    }

    fn spawn_watchdog(self: &Arc<Self>) {
        let me = Arc::downgrade(self);
        let _ = std::thread::Builder::new().name("lazy-watchdog".into()).spawn(move || {
            let mut warned: std::collections::HashMap<(i32, u64), Instant> = Default::default();
            loop {
                std::thread::sleep(Duration::from_millis(250));
                let Some(d) = me.upgrade() else { return };
                if d.stop.load(Ordering::Relaxed) {
                    return;
                }
                let conns: Vec<Arc<Conn>> = d.conns.lock().expect("poisoned").iter().filter_map(Weak::upgrade).collect();
                warned.retain(|_, t| t.elapsed() < Duration::from_secs(60));
                for c in conns {
                    if let Some((addr, waited)) = c.waiting() {
                        // Once a second per stuck fault: loud enough to see, not a flood.
                        let key = (c.pid(), addr);
                        let due = warned.get(&key).is_none_or(|t| t.elapsed() >= Duration::from_secs(1));
                        if waited >= SLOW_FAULT && due {
                            tracing::warn!("watchdog: pid {}: fault at {addr:#x} waiting {:.1}s", c.pid(), waited.as_secs_f64());
                            warned.insert(key, Instant::now());
                        }
                    }
                }
            }
        });
    }

    /// The connection's fill thread (spec/lazy.md "The fill"), in the order of `trace` then
    /// the file's; `None` when the daemon has no fill, it is done, or no thread started.
    fn spawn_fill(
        self: &Arc<Self>,
        trace: Option<&Trace>,
        inst: &Arc<Installer>,
        demand: &Arc<prefetch::Demand>,
        bg: &Arc<pacing::Background>,
        stop: &Arc<AtomicBool>,
    ) -> Option<std::thread::JoinHandle<()>> {
        let fill = self.fill.clone().filter(|f| !f.done())?;
        let store = self.fetcher.store()?.clone();
        let order = prefetch::prefetch_order(PrefetchMode::All, trace, &self.fetcher.image, self.fetcher.file);
        let (d, dm, b, s, i) = (self.clone(), demand.clone(), bg.clone(), stop.clone(), inst.clone());
        let spawned = std::thread::Builder::new().name("lazy-fill".into()).spawn(move || {
            let ended = || s.load(Ordering::Relaxed) || i.gone() || d.stop.load(Ordering::Relaxed);
            fill::Filler { fill: &fill, fetcher: &d.fetcher, store: store.as_ref(), bg: &b, demand: &dm, counters: &d.counters, ended: &ended }.run(&order)
        });
        spawned.map_err(|e| tracing::warn!("pid {}: no fill of the chunk cache: {e}", inst.pid)).ok()
    }

    /// Handle one connection from handshake to release. Returns whether the handshake
    /// succeeded (so the connection counts for `once`).
    fn connection(self: &Arc<Self>, mut stream: UnixStream, on_report: &(dyn Fn(&ConnReport) + Send + Sync)) -> bool {
        let t0 = Instant::now();
        let image = self.fetcher.image.clone();
        let file = &image.files[self.fetcher.file];
        let Some((pid, uffd, regions)) = accept_handshake(&mut stream, file.size) else { return false };
        let total_bytes: u64 = regions.iter().map(|r| r.size).sum();
        tracing::info!("pid {}: {} region(s), {} of {}", pid, regions.len(), imgfmt::size::human(total_bytes), file.name);
        let map = MemoryMap { regions, file_size: file.size, chunk_shift: image.chunk_shift() };
        let counters = Arc::new(Counters::default());
        let started = Instant::now();
        let inst = Arc::new(Installer::new(pid, uffd, map, self.fetcher.clone(), stats::Rec(counters.clone(), self.counters.clone()), self.opts.record_trace));
        self.active.fetch_add(1, Ordering::Relaxed);
        self.total.fetch_add(1, Ordering::Relaxed);

        // Shared, not copied: what a connection holds of a trace is a reference to it, and
        // what it makes of it (the stream's order, the pending slices) is sized by the image.
        let (mut trace, plan) = match &*self.replay.lock().expect("poisoned") {
            Some(r) => (Some(r.trace.clone()), r.plan.clone()),
            None => (None, None),
        };
        // A trace still on its way: its working set is replayed when it arrives, and until
        // then the stream holds back as it does beside a replay.
        let late = trace.is_none() && self.coming.load(Ordering::Relaxed) && !self.opts.record_trace;
        let chunk_trace = if plan.is_some() { None } else { trace.as_deref() };
        let (order, traced, demand) = self.stream_plan(&image, chunk_trace, plan.is_some() || late, started);
        // The stream and the replay share one window, moved by the faults' slice fetches and
        // by probes on the faults' source.
        let bg = pacing::Background::new(1 << image.chunk_shift(), self.opts.stream_jobs);
        let mut conn = Conn::new(inst.clone(), demand.clone(), Arc::default(), started);
        conn.slice_faults = self.opts.slice_faults;
        conn.pacing = Some(bg.clone());
        let conn = Arc::new(conn);
        {
            let mut cs = self.conns.lock().expect("poisoned");
            cs.retain(|w| w.strong_count() > 0);
            cs.push(Arc::downgrade(&conn));
        }
        let stop_prefetch = Arc::new(AtomicBool::new(false));
        let probe_blob = file.chunks.iter().find_map(|c| match c.at {
            imgfmt::StoredAt::Pack { pack, .. } => image.packs.get(pack as usize).map(|p| p.digest.clone()),
            imgfmt::StoredAt::Zero => None,
        });
        let filling = self.fill.as_ref().is_some_and(|f| !f.done());
        let prober = probe_blob.filter(|_| !order.is_empty() || plan.is_some() || late || filling).map(|blob| {
            let (b, s, src) = (bg.clone(), stop_prefetch.clone(), self.fetcher.source());
            std::thread::Builder::new().name("lazy-probe".into()).spawn(move || b.probe(src.as_ref(), &blob, &s))
        });
        // Whenever the stream ends (or with none), the fill may go.
        let over = prefetch::StreamOver(demand.clone());
        let prefetcher = (!order.is_empty()).then(|| {
            let (i, d, b, s, rate, jobs) = (inst.clone(), demand.clone(), bg.clone(), stop_prefetch.clone(), self.opts.prefetch_rate, self.opts.stream_jobs);
            std::thread::Builder::new().name("lazy-prefetch".into()).spawn(move || {
                let _over = over;
                prefetch::run(i, d, b, order, traced, jobs, rate, s)
            })
        });
        let replayer = self.start_replay(pid, plan, late, &inst, &conn, &bg, &demand, &stop_prefetch);
        let filler = self.spawn_fill(trace.as_deref(), &inst, &demand, &bg, &stop_prefetch);
        let ended = conn.run(stream, &self.stop);
        inst.set_gone();
        stop_prefetch.store(true, Ordering::Relaxed);
        let mut stream_run = prefetch::StreamRun::default();
        if let Some(Ok(h)) = prefetcher {
            stream_run = h.join().unwrap_or_default();
        }
        let mut replayed = None;
        if let Some(Ok(h)) = replayer {
            replayed = h.join().ok().flatten();
        }
        if let Some(h) = filler {
            let _ = h.join();
        }
        if let Some(Ok(h)) = prober {
            let _ = h.join();
        }
        let pacing = bg.report();
        self.active.fetch_sub(1, Ordering::Relaxed);
        let mut report = ConnReport::from_counters(pid, &counters, t0.elapsed().as_secs_f64(), ended);
        if late {
            trace = self.replay.lock().expect("poisoned").as_ref().map(|r| r.trace.clone());
        }
        if self.opts.prefetch != PrefetchMode::None {
            report.trace_digest = trace.as_ref().and_then(|t| t.manifest.as_ref()).map(|d| d.to_string());
        }
        report.stream_depth = stream_run.depth as u64;
        report.stream_threads = stream_run.threads as u64;
        report.stream_rtt_ms = stream_run.rtt.map(|d| d.as_secs_f64() * 1e3);
        report.pacing = pacing.into();
        report.working_set_s = replayed.map(|at: Instant| at.duration_since(started).as_secs_f64());
        report.stream_started_s = demand.went_after().map(|d| d.as_secs_f64());
        report.fill = stats::FillReport::of(&self.counters);
        if self.opts.record_trace {
            self.store_recording(pid, &inst, &image, &file.name, &mut report);
        }
        on_report(&report);
        true
    }

    /// The stream's chunk order, its traced count, and the demand that decides when it goes.
    fn stream_plan(&self, image: &Image, chunk_trace: Option<&Trace>, held_back: bool, started: Instant) -> (Vec<u64>, usize, Arc<prefetch::Demand>) {
        let (mut order, traced) = prefetch::stream_order(self.opts.prefetch, chunk_trace, image, self.fetcher.file);
        let mut detector = None;
        match (self.opts.prefetch, self.opts.stream_after) {
            (PrefetchMode::All, _) => {}
            (PrefetchMode::Trace, Some(f)) => {
                let f = if held_back { f.max(prefetch::REPLAY_STREAM_AFTER) } else { f };
                detector = Some(prefetch::Detector::new(image, self.fetcher.file, f));
            }
            // Nothing will let the rest go.
            _ => order.truncate(traced),
        }
        let demand = Arc::new(prefetch::Demand::new(started, detector));
        if self.opts.prefetch == PrefetchMode::All {
            demand.go();
        }
        (order, traced, demand)
    }

    /// Arms a plan in hand and starts the working-set replay (`None`: nothing to replay).
    #[allow(clippy::too_many_arguments)]
    fn start_replay(
        self: &Arc<Self>,
        pid: i32,
        plan: Option<Arc<workingset::Plan>>,
        late: bool,
        inst: &Arc<Installer>,
        conn: &Conn,
        bg: &Arc<pacing::Background>,
        demand: &Arc<prefetch::Demand>,
        stop_prefetch: &Arc<AtomicBool>,
    ) -> Option<std::io::Result<std::thread::JoinHandle<Option<Instant>>>> {
        // A plan in hand is armed before the fault loop reads its first fault; one still on
        // its way is armed when it arrives: a fault on a slice before then fetches it, and
        // the replay finds that page installed.
        if let Some(p) = &plan {
            tracing::info!("pid {}: replaying a working set of {} slices and {} zero chunks", pid, p.slices(), p.zero_chunks());
            conn.ws.arm(p);
        }
        let replayer = (plan.is_some() || late).then(|| {
            conn.ws.expect();
            let (d, pid, i, ws, b, s, src) =
                (self.clone(), pid, inst.clone(), conn.ws.clone(), bg.clone(), stop_prefetch.clone(), self.fetcher.background_source());
            // The fill waits while the replay runs (or its thread is not started), no longer.
            let replaying = prefetch::Demand::replaying(demand);
            std::thread::Builder::new().name("lazy-workingset".into()).spawn(move || {
                let _replaying = replaying;
                let p = match plan {
                    Some(p) => p,
                    None => {
                        let Some(p) = d.replay_when_known(&s).and_then(|(_, plan)| plan) else {
                            // No working set came: faults take their whole chunks again (a
                            // replay disarms the set itself when it ends).
                            ws.disarm();
                            return None;
                        };
                        tracing::info!(
                            "pid {pid}: replaying a working set of {} slices and {} zero chunks, which arrived after the guest",
                            p.slices(),
                            p.zero_chunks()
                        );
                        ws.arm(&p);
                        p
                    }
                };
                workingset::replay(i, ws, p, src, b, s)
            })
        });
        if let Some(Err(e)) = &replayer {
            // No replay will install them: the faults fetch for themselves.
            tracing::warn!("pid {}: no working-set replay: {e}", pid);
            conn.ws.disarm();
        }
        replayer
    }

    /// Stores the recorded trace (and makes it the replay) when there is one and a store.
    fn store_recording(&self, pid: i32, inst: &Installer, image: &Image, file_name: &str, report: &mut ConnReport) {
        let (mut t, ws_bytes) = inst.take_recording().take_trace(file_name, 1 << image.chunk_shift());
        report.working_set_recorded = t.working_set.len() as u64;
        match &self.traces {
            Some(store) if !t.chunks.is_empty() => match store.store(image, &t, &ws_bytes) {
                Ok((at, digest)) => {
                    tracing::info!(
                        "pid {}: trace of {} chunks and a working set of {} slices ({}) stored at {at}",
                        pid,
                        t.chunks.len(),
                        t.working_set.len(),
                        imgfmt::size::human(ws_bytes.len() as u64)
                    );
                    report.trace = Some(at);
                    t.manifest = Some(digest);
                    *self.replay.lock().expect("poisoned") = Some(Replay::new(image, self.fetcher.file, &self.opts, t));
                }
                Err(e) => tracing::warn!("pid {}: storing the trace failed: {e}", pid),
            },
            Some(_) => tracing::info!("pid {}: no chunk was fetched: no trace to store", pid),
            None => tracing::warn!("pid {}: nowhere to store the trace for this source", pid),
        }
    }
}

/// The peer's pid, non-blocking userfaultfd and checked regions; `None` (logged): close.
fn accept_handshake(stream: &mut UnixStream, file_size: u64) -> Option<(i32, userfaultfd::Uffd, Vec<handshake::Region>)> {
    let hs = match handshake::receive(stream) {
        Ok(h) => h,
        Err(e) => {
            tracing::warn!("connection refused: {e}");
            return None;
        }
    };
    let regions = match handshake::parse_regions(&hs.json, file_size) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!("pid {}: {e}; closing the connection", hs.pid);
            return None;
        }
    };
    // Non-blocking, so reading events never stalls the loop (the VMM does not read
    // this fd: it only registers memory on it).
    if let Err(e) = nix::fcntl::fcntl(&hs.uffd, nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK)) {
        tracing::warn!("pid {}: userfaultfd: {e}; closing the connection", hs.pid);
        return None;
    }
    // SAFETY: the descriptor was received over SCM_RIGHTS and is owned by nobody else;
    // `Uffd` takes over closing it.
    let uffd = unsafe { userfaultfd::Uffd::from_raw_fd(hs.uffd.into_raw_fd()) };
    let _ = stream.set_nonblocking(true);
    Some((hs.pid, uffd, regions))
}

/// Whether the peer of a freshly accepted connection may use the daemon: its user is the
/// daemon's effective user (root peers only when the daemon is root) or in `allow_uids`,
/// or its primary group is in `allow_gids`. A refused peer is logged and closed before
/// anything it sent is read, so the userfaultfd it may have attached is never received.
fn admit(stream: &UnixStream, opts: &LazyOptions) -> bool {
    use nix::sys::socket::{getsockopt, sockopt};
    // SAFETY: geteuid takes nothing and cannot fail.
    let me = unsafe { libc::geteuid() };
    match getsockopt(stream, sockopt::PeerCredentials) {
        Ok(c) if peer_allowed(c.uid(), c.gid(), me, opts) => true,
        Ok(c) => {
            tracing::warn!(
                "{}: refusing a connection from uid {} gid {} pid {}: not the daemon's user (uid {me}) nor allowed by --allow-uid/--allow-gid",
                opts.socket.display(),
                c.uid(),
                c.gid(),
                c.pid()
            );
            false
        }
        Err(e) => {
            tracing::warn!("{}: refusing a connection whose credentials cannot be read: {e}", opts.socket.display());
            false
        }
    }
}

/// The rule [`admit`] applies to a peer `uid`/`gid` of a daemon running as `me`.
fn peer_allowed(uid: u32, gid: u32, me: u32, opts: &LazyOptions) -> bool {
    uid == me || opts.allow_uids.contains(&uid) || opts.allow_gids.contains(&gid)
}

/// Bind a Unix socket at `path` that only this user can connect to, whatever the umask:
/// bound inside a fresh directory only the owner can enter, made 0600 there, then moved
/// to `path` (never replacing anything there). No one can connect in between: reaching
/// the socket before the move needs the directory, after it the mode. `umask` is not
/// used, as it is process-wide and other threads create files.
fn bind_private(path: &std::path::Path) -> std::io::Result<UnixListener> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    let private = imgfmt::layout::tempname(dir, ".snapctl");
    std::fs::DirBuilder::new().mode(0o700).create(&private)?;
    let inner = private.join("s");
    let res = (|| {
        let l = UnixListener::bind(&inner)?;
        std::fs::set_permissions(&inner, std::fs::Permissions::from_mode(0o600))?;
        rename_noreplace(&inner, path)?;
        Ok(l)
    })();
    let _ = std::fs::remove_file(&inner);
    let _ = std::fs::remove_dir(&private);
    res
}

/// `rename(from, to)` failing with `EEXIST` when `to` exists (`RENAME_NOREPLACE`); where
/// the file system lacks the flag, checked first (then a file created in between would be
/// replaced: the stale-socket check before has the same window).
fn rename_noreplace(from: &std::path::Path, to: &std::path::Path) -> std::io::Result<()> {
    use nix::fcntl::{renameat2, RenameFlags, AT_FDCWD};
    match renameat2(AT_FDCWD, from, AT_FDCWD, to, RenameFlags::RENAME_NOREPLACE) {
        Ok(()) => Ok(()),
        Err(nix::errno::Errno::EINVAL | nix::errno::Errno::ENOSYS) => {
            if std::fs::symlink_metadata(to).is_ok() {
                return Err(std::io::Error::from_raw_os_error(libc::EEXIST));
            }
            std::fs::rename(from, to)
        }
        Err(e) => Err(e.into()),
    }
}

/// Bind the Unix socket `path` (0600, see [`bind_private`]; non-blocking; replacing a
/// stale socket file, refusing when another `who` answers there), say so on stderr
/// (`snapctl lazy: {tag}listening on PATH`: tests and bench/lazy.sh wait for that line)
/// and write `ready` (aside, then renamed, so a watcher never reads it half-written). The
/// guard removes the socket file.
/// Wait until `listener` has a connection to accept, or 20 ms (so the accept loop notices
/// `stop` and `once`). A sleep instead cost a guest's wake up to 20 ms: the runtime's
/// handshake and first fault sat in the socket's backlog until the next look.
fn wait_for_connection(listener: &UnixListener) {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    let mut fds = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
    if poll(&mut fds, PollTimeout::from(20u8)).is_err() {
        // EINTR or a poll that cannot be made: look again after the same 20 ms.
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn listen(path: &std::path::Path, ready: Option<&std::path::Path>, who: &str, tag: &str) -> Result<(UnixListener, RemoveOnDrop), LazyError> {
    if let Ok(m) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        if m.file_type().is_socket() {
            if UnixStream::connect(path).is_ok() {
                return Err(LazyError::Invalid(format!("{}: another {who} is listening there", path.display())));
            }
            std::fs::remove_file(path).map_err(io_err(format!("removing stale socket {}", path.display())))?;
        }
    }
    let listener = bind_private(path).map_err(io_err(format!("binding {}", path.display())))?;
    listener.set_nonblocking(true).map_err(io_err("socket"))?;
    let cleanup = RemoveOnDrop(path.to_path_buf());
    tracing::info!("{tag}listening on {}", path.display());
    if let Some(r) = ready {
        let mut tmp = r.to_path_buf().into_os_string();
        tmp.push(format!(".{}.tmp", std::process::id()));
        std::fs::write(&tmp, format!("{}\n", path.display())).map_err(io_err(format!("writing {}", r.display())))?;
        std::fs::rename(&tmp, r).map_err(io_err(format!("writing {}", r.display())))?;
    }
    Ok((listener, cleanup))
}

/// Metrics connections served at once, at most; one more is closed unanswered. Each is
/// served on a thread of its own, so a client that dawdles holds its own slot, never the
/// listener: a scraper is answered beside up to this many slow clients.
pub const MAX_METRICS_CONNECTIONS: usize = 8;
/// A metrics client has this long, in all, to send its request line and take the answer
/// (a deadline for the whole exchange, not per read: a client sending a byte now and then
/// is cut off all the same).
pub const METRICS_DEADLINE: Duration = Duration::from_secs(2);

/// Serve `GET /metrics` on `addr` from a background thread, answering with `text(owner)`
/// while `owner` lives (the Firecracker and the CRIU daemons both); returns the bound
/// address.
fn serve_metrics<T: Send + Sync + 'static>(owner: &Arc<T>, addr: &str, text: fn(&T) -> String) -> Result<std::net::SocketAddr, LazyError> {
    let l = std::net::TcpListener::bind(addr).map_err(io_err(format!("binding metrics address {addr}")))?;
    let bound = l.local_addr().map_err(io_err("metrics address"))?;
    let me = Arc::downgrade(owner);
    let busy = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("lazy-metrics".into())
        .spawn(move || {
            for s in l.incoming() {
                let Some(d) = me.upgrade() else { return };
                let Ok(s) = s else { continue };
                if busy.fetch_add(1, Ordering::Relaxed) >= MAX_METRICS_CONNECTIONS {
                    busy.fetch_sub(1, Ordering::Relaxed);
                    tracing::debug!("metrics: {MAX_METRICS_CONNECTIONS} connections being served; closing another");
                    continue;
                }
                let (body, slot) = (text(&d), busy.clone());
                drop(d);
                let spawned = std::thread::Builder::new().name("lazy-metrics-conn".into()).spawn(move || {
                    let _ = answer_metrics_text(s, &body, Instant::now() + METRICS_DEADLINE);
                    slot.fetch_sub(1, Ordering::Relaxed);
                });
                if spawned.is_err() {
                    busy.fetch_sub(1, Ordering::Relaxed);
                }
            }
        })
        .map_err(io_err("spawning the metrics thread"))?;
    Ok(bound)
}

/// Answer one HTTP request before `deadline`: `text` for `GET /metrics`, 404 otherwise.
fn answer_metrics_text(mut s: std::net::TcpStream, text: &str, deadline: Instant) -> std::io::Result<()> {
    use std::io::{Read, Write};
    let left = || deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()).ok_or(std::io::ErrorKind::TimedOut);
    // The request line, at most 8 KiB, before the deadline however it trickles in.
    let mut line = Vec::new();
    let mut buf = [0u8; 1024];
    while !line.contains(&b'\n') && line.len() < 8192 {
        s.set_read_timeout(Some(left()?))?;
        match s.read(&mut buf)? {
            0 => break,
            n => line.extend_from_slice(&buf[..n]),
        }
    }
    let (status, body) = if line.starts_with(b"GET /metrics ") || line.starts_with(b"GET /metrics\r") {
        ("200 OK", text)
    } else {
        ("404 Not Found", "not found; try /metrics\n")
    };
    s.set_write_timeout(Some(left()?))?;
    write!(s, "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len())?;
    Ok(())
}

struct RemoveOnDrop(PathBuf);
impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[cfg(test)]
mod tests;
