//! `snapctl lazy`: the userfaultfd page-fault server for restoring VMs (spec/lazy.md).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use imgfmt::reference::Reference;
use imgfmt::{OciLayout, Role};
use lazy::criu::{CriuDaemon, CriuReport};
use lazy::{ConnReport, Daemon, LayoutTraces, LazyOptions, LoadedAhead, PrefetchMode, RegistryTraces, RetryPolicy, TraceStore};

use super::common::{self, open_image};
use super::policy::{LayoutStore, RegistryStore};

/// Serve a restoring VM's memory page faults from the image's verified chunks.
///
/// Listens on a Unix socket for Firecracker's UFFD handshake: one message carrying a JSON
/// array of {base_host_virt_addr, size, offset, page_size, page_size_kib} and the VMM's
/// userfaultfd (SCM_RIGHTS). Each fault is served from the memory file: zero chunks with
/// UFFDIO_ZEROPAGE, others from the chunk cache or fetched, verified, and installed with
/// UFFDIO_COPY. Bytes that fail verification twice are never installed: the range is
/// poisoned instead. Serves many VMs at once; runs until signalled (or see --once).
///
/// page_size is 4096, or 2097152 for guest memory on 2 MiB huge pages (Firecracker's
/// "huge_pages": "2M"): a fault there is served by its whole huge page, every chunk under
/// it verified first. Any other page size is refused at the handshake.
///
/// With --criu-workdir DIR it takes the role of `criu lazy-pages` instead: it listens on
/// DIR/lazy-pages.socket, where `criu restore --lazy-pages` sends each restored task's pid
/// and userfaultfd, serves faults from the image's pagemap-<pid>.img and pages-<id>.img,
/// pushes the remaining pages once the restore has finished, and exits when every task is
/// done.
///
/// SIGTERM or SIGINT stops taking new connections (or, with --criu-workdir, stops waiting
/// for a restore) and exits once those being served have ended: a guest whose page server
/// goes away reads its untouched memory as zeros. A second signal exits at once (status 2).
///
/// The socket is created mode 0600 whatever the umask, and only processes of the daemon's
/// own user (or of --allow-uid / --allow-gid) are served: whoever connects gets the
/// snapshot's memory. Others are logged and disconnected unread.
///
/// Exit codes (with --once or --criu-workdir): 0 served, 1 a chunk failed verification
/// (poisoned), 2 error (with --criu-workdir: also a task that could not be fully served).
#[derive(Debug, clap::Args)]
pub struct LazyArgs {
    /// Image: oci:PATH[:TAG|@DIGEST] or HOST[:PORT]/REPO[:TAG|@DIGEST].
    pub image: String,
    /// Unix socket to listen on for Firecracker's handshake (a stale socket file there is
    /// replaced).
    #[arg(long, value_name = "PATH", required_unless_present = "criu_workdir", conflicts_with = "criu_workdir")]
    pub socket: Option<PathBuf>,
    /// Serve `criu restore --lazy-pages` run in work directory DIR (listens on
    /// DIR/lazy-pages.socket; serves one restore, then exits).
    #[arg(long, value_name = "DIR")]
    pub criu_workdir: Option<PathBuf>,
    /// With --criu-workdir: first write the dump into DIR (created if missing) for `criu
    /// restore --lazy-pages`, without the lazy pages: those stay holes in pages-<id>.img and
    /// come from this server when touched, so only the dump's metadata and non-lazy pages
    /// are fetched before the restore starts. The files are removed when the daemon exits:
    /// without the server they are not the dump (a plain `criu restore` of them would read
    /// zeros). Without this flag DIR must already hold the dump (e.g. `snapctl pull`).
    #[arg(long, requires = "criu_workdir")]
    pub criu_prepare: bool,
    /// The memory file to serve (default: the image's file with role "memory").
    #[arg(long, value_name = "NAME", conflicts_with = "criu_workdir")]
    pub file: Option<String>,
    /// Chunk cache directory (default: $SNAPCTL_CACHE, $XDG_CACHE_HOME/snapctl, ~/.cache/snapctl).
    #[arg(long, value_name = "DIR")]
    pub cache: Option<PathBuf>,
    /// Bound on everything kept under the cache directory (chunks, push layouts, upload
    /// state: see `snapctl cache`), e.g. 10GiB; least recently used entries are evicted
    /// [default: $SNAPCTL_CACHE_SIZE, else 10GiB].
    #[arg(long, value_name = "SIZE", value_parser = common::parse_size, env = "SNAPCTL_CACHE_SIZE")]
    pub cache_size: Option<u64>,
    /// Do not use the chunk cache (every chunk comes from the image source).
    #[arg(long, conflicts_with = "cache")]
    pub no_cache: bool,
    /// Install chunks ahead of the guest: `trace` replays the image's recorded trace if it
    /// has one, then streams the rest of the image once the guest's misses look scattered
    /// (see --stream-after); `all` replays the trace and streams the rest at once; `none`
    /// only serves faults. Faults always come first: see --stream-jobs.
    #[arg(long, default_value = "trace", value_parser = parse_prefetch)]
    pub prefetch: PrefetchMode,
    /// Requests the prefetcher keeps in flight at most (1-64). The stream of the rest of
    /// the image and the working-set replay are scavengers: they use the link only as far
    /// as they do not delay the guest's faults. Their requests in flight are bounded by a
    /// window that grows while a request as small as a fault's comes back within a tenth of
    /// the round trip (at least 2 ms) of the quickest one seen, and shrinks while it takes
    /// longer (LEDBAT, RFC 6817; a delay of a round trip more is a loss and halves it); the
    /// faults' own fetches take the window first. Once the guest has missed 15% of the
    /// image's data chunks it needs most of the image, and the target widens to a fifth of
    /// the round trip. A request reads a run of chunks stored one after another (at most
    /// half the window and 8 MiB), so the window's bytes are in few requests. This flag
    /// bounds the window, in chunks (32 MiB at 1 MiB chunks): at 50 ms and 1 Gbit/s a guest
    /// needing the whole image reaches it, yet 64 was no faster there, so raise it only for
    /// paths longer or faster than that; lower it to spare a shared registry.
    #[arg(long, default_value_t = lazy::prefetch::DEFAULT_STREAM_JOBS, value_name = "N", value_parser = parse_jobs)]
    pub stream_jobs: usize,
    /// With --prefetch trace: stream the rest of the image once faults have waited for this
    /// share of the memory file's non-zero chunks (e.g. 30%, 0.3), and at least 8 of them,
    /// or `never`. The default, 0, streams after the first 8 misses: any guest then takes
    /// at most about a pull's time plus a few round trips. Higher values keep a guest with
    /// a small, clustered working set from sharing the link with the stream and from
    /// ending with the whole image in memory, at the price of a round trip per chunk for a
    /// scattered one until the mark. A restore replaying a recorded working set uses at
    /// least 30%.
    #[arg(long, default_value = "0", value_name = "SHARE", value_parser = parse_share)]
    pub stream_after: f64,
    /// Prefetch at most this many bytes per second (0, the default: no bound beyond the
    /// stream's own pacing, which yields to the guest's faults).
    #[arg(long, default_value = "0", value_name = "SIZE", value_parser = common::parse_size)]
    pub prefetch_rate: u64,
    /// Record the order chunks are first faulted and store it with the image (an artifact
    /// whose subject is the image) when the connection ends.
    #[arg(long, conflicts_with = "criu_workdir")]
    pub record_trace: bool,
    /// Serve Prometheus metrics on http://ADDR/metrics (e.g. 127.0.0.1:9464).
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<String>,
    /// How long to keep retrying a failing source for one chunk before poisoning it
    /// (500ms, 120s, 2m, 1h30m; a plain number is seconds).
    #[arg(long, default_value = "120s", value_parser = common::parse_duration)]
    pub retry_budget: Duration,
    /// Recently used chunks kept in memory (shared by all connections). With
    /// --record-trace at least the memory file's non-zero bytes: a recording restore
    /// installs one page per fault and serves the next page of a chunk from here.
    #[arg(long, default_value = "256MiB", value_name = "SIZE", value_parser = common::parse_size)]
    pub memory: u64,
    /// Exit after the first connection (with a valid handshake) ends.
    #[arg(long)]
    pub once: bool,
    /// Write the socket path to this file once the socket is listening.
    #[arg(long, value_name = "PATH")]
    pub ready_file: Option<PathBuf>,
    /// Also serve processes of this user (repeatable; e.g. a VMM jailed under its own uid).
    /// The socket stays 0600: make it reachable for them (chown, a bind mount) as well.
    #[arg(long, value_name = "UID")]
    pub allow_uid: Vec<u32>,
    /// Also serve processes whose primary group is this one (repeatable).
    #[arg(long, value_name = "GID")]
    pub allow_gid: Vec<u32>,
    #[command(flatten)]
    pub registry: super::common::RegistryFlags,
    /// Print one JSON summary per finished connection on stdout (one line each).
    #[arg(long)]
    pub json: bool,
    /// `on` (the default): a chunk's first miss (a raw chunk with an outboard entry) fetches
    /// the faulting 4 KiB slice, verified against the outboard, and the whole chunk beside
    /// it: the slice serves the fault without waiting for the chunk's bytes. `off`: every
    /// fault waits for its whole chunk (spec/lazy.md "Slice faults"). A daemon that records
    /// no trace and has none to replay reads only the outboards' entries before it listens,
    /// and a chunk's CVs beside its first slice (spec/lazy.md "Waking").
    #[arg(long, default_value = "on", value_name = "on|off", value_parser = parse_on_off, action = clap::ArgAction::Set)]
    pub slice_faults: bool,
    /// `on` (the default): once the guest's first faults have settled (and after a working
    /// set's replay), fetch the rest of the memory file into the chunk cache in the
    /// background (not into guest memory), paced as the stream is so the guest's faults go
    /// first, in the trace's order and then the file's; zero chunks and chunks the cache
    /// holds are skipped. Once the whole file is in the cache ("no longer depends on the
    /// registry" on stderr, `fill.done` in --json) the restore survives the image being
    /// deleted from the registry (a tag that moved on, then gc). While the daemon runs, the
    /// file's chunks are pinned in the cache: no eviction, not even `snapctl cache prune
    /// --all`, deletes them; they count toward --cache-size, and the fill stops where they
    /// would pass it (the rest keeps depending on the registry). From a registry the daemon
    /// also holds a lease on the image, which `snapctl serve` honours through its gc.
    /// `off`: no fill (nothing without a chunk cache either). See spec/lazy.md "The fill".
    #[arg(long, default_value = "on", value_name = "on|off", value_parser = parse_on_off, action = clap::ArgAction::Set)]
    pub fill: bool,
    #[command(flatten)]
    pub policy: super::policy::PolicyFlags,
}

/// `on` or `off`.
fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("expected on or off, not {s:?}")),
    }
}

fn parse_prefetch(s: &str) -> Result<PrefetchMode, String> {
    s.parse()
}

/// 1 to 64.
fn parse_jobs(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=64).contains(&n) => Ok(n),
        _ => Err(format!("expected 1 to 64 requests, not {s:?}")),
    }
}

/// `N%` (0-100), a fraction in 0..=1, or `never` (infinity).
fn parse_share(s: &str) -> Result<f64, String> {
    let bad = || format!("expected a share such as 30% or 0.3, or never; not {s:?}");
    if s == "never" {
        return Ok(f64::INFINITY);
    }
    let v = match s.strip_suffix('%') {
        Some(p) => p.trim().parse::<f64>().map_err(|_| bad())? / 100.0,
        None => s.trim().parse::<f64>().map_err(|_| bad())?,
    };
    if !(0.0..=1.0).contains(&v) {
        return Err(bad());
    }
    Ok(v)
}

/// The log filter unless SNAPCTL_LOG or RUST_LOG says otherwise: the daemon's progress
/// (listening, each connection, traces stored) and every library's warnings.
pub const DEFAULT_LOG: &str = "warn,lazy=info";

/// Connections the faults' client opens while the image is being opened: one per vCPU of a
/// small guest, and the pacing's probe.
const WARM_FAULT_CONNECTIONS: usize = 3;
/// The same for the stream's and the replay's client (the pacing keeps about two requests
/// of it in flight).
const WARM_BACKGROUND_CONNECTIONS: usize = 2;

/// The same for the client reading the image's metadata: beside the manifest's own
/// connection (the config's next), one each for the index, the outboard's entries and the
/// trace lookup, all read at once. One fewer and the last of them waits for a new
/// connection: a round trip more before the socket is bound.
const WARM_METADATA_CONNECTIONS: usize = 3;

/// Open `n` connections of `client` (and answer the registry's challenge, if it has one)
/// while the image's metadata is read on another client: without it the guest's first
/// faults paid a connection's set-up (a round trip, more with TLS) on top of their own
/// round trip. `GET /v2/`, each on a thread of its own so they overlap; a failure is left
/// to the first real request to report.
fn warm_up(client: &Arc<regclient::RegistrySource>, n: usize) {
    for _ in 0..n {
        let c = client.clone();
        let _ = std::thread::Builder::new().name("lazy-warm-up".into()).spawn(move || {
            let _ = c.check_login();
        });
    }
}

/// The clients chunk reads go through, each opening its connections at once: the faults'
/// and the background's (the stream and the working-set replay), so a fault's small
/// response is never read behind the stream's megabytes. Neither retries on its own: the
/// daemon retries chunk reads with backoff inside --retry-budget and counts every retry.
fn chunk_clients_for(host: &str, repository: &str) -> anyhow::Result<(Arc<dyn imgfmt::BlobSource>, Arc<dyn imgfmt::BlobSource>)> {
    let client = |warm: usize| -> anyhow::Result<Arc<regclient::RegistrySource>> {
        let mut c = common::registry_client(host, repository, false)?;
        c.set_retry_policy(lazy::RetryPolicy::never());
        let c = Arc::new(c);
        warm_up(&c, warm);
        Ok(c)
    };
    Ok((client(WARM_FAULT_CONNECTIONS)?, client(WARM_BACKGROUND_CONNECTIONS)?))
}

pub fn run(a: LazyArgs) -> anyhow::Result<ExitCode> {
    // Registry references get a client of their own so traces can be pushed as referrers
    // through it; layouts keep traces under the fallback tag.
    let mut chunk_clients = None;
    let mut lease_client = None;
    let metadata_source: Arc<dyn imgfmt::BlobSource>;
    let sig_store: Box<dyn sign::Store>;
    let (mut o, traces): (common::Opened, Option<Box<dyn TraceStore>>) = match a.image.parse::<Reference>()? {
        Reference::Layout { path, selector } => {
            let o = common::Opened {
                source: Box::new(OciLayout::open(&path).with_context(|| format!("opening {}", a.image))?),
                selector,
                reference: a.image.clone(),
            };
            sig_store = Box::new(LayoutStore(OciLayout::open(&path).with_context(|| format!("opening {}", a.image))?));
            metadata_source = Arc::new(OciLayout::open(&path).with_context(|| format!("opening {}", a.image))?);
            (o, Some(Box::new(LayoutTraces(OciLayout::open(&path).with_context(|| format!("opening {}", path.display()))?))))
        }
        Reference::Registry { host, repository, selector } => {
            let src = Arc::new(common::registry_client(&host, &repository, false)?);
            // The config, index and outboards are read at once after the manifest.
            warm_up(&src, WARM_METADATA_CONNECTIONS);
            chunk_clients = Some(chunk_clients_for(&host, &repository)?);
            sig_store = Box::new(RegistryStore(src.clone()));
            metadata_source = src.clone();
            lease_client = Some(src.clone());
            let o = common::Opened { source: Box::new(src.clone()), selector, reference: a.image.clone() };
            (o, Some(Box::new(RegistryTraces::new(src))))
        }
    };
    // The policy decides before the socket exists: its signature reads overlap reading
    // the image's metadata, and no runtime's handshake is accepted for a refused image.
    let r: Reference = a.image.parse()?;
    // Resolved once, here, so finding the image's trace (a registry's referrers: round
    // trips of their own) goes on beside reading the image's metadata.
    let digest = common::resolve(&o)?;
    o.selector = imgfmt::reference::Selector::Digest(digest.clone());
    // Held until the daemon ends cleanly (then released): the registry keeps the image
    // through its gc meanwhile, if it honours leases.
    let _lease = lease_client.map(|c| lazy::Lease::take(c, digest.clone()));
    let (image, outboards, maybe_trace) = std::thread::scope(|s| {
        let looking = traces.as_deref().filter(|_| a.prefetch != PrefetchMode::None).map(|t| s.spawn(|| t.prepare(&digest)));
        let opened = open_gated(&a, &r, sig_store.as_ref(), &mut o, &metadata_source);
        let maybe_trace = looking.is_some_and(|h| h.join().unwrap_or(true));
        opened.map(|(image, outboards)| (image, outboards, maybe_trace))
    })?;
    let image = Arc::new(image);
    let mut traces = traces;
    // A replay listens at once, as a restore that only serves faults does: its outboards
    // and trace are read after the socket is bound, and its working set replayed when they
    // are in (the guest's first faults are served meanwhile).
    let mut replay_later = None;
    if let Some(pending) = outboards {
        // A recording restore keeps the working set by slice from the first fault, and a
        // CRIU restore pushes its pages by slice: they wait for the outboards. A restore
        // that only serves faults listens at once, and its faults fetch whole chunks until
        // the outboards are in.
        if maybe_trace && !a.record_trace && a.criu_workdir.is_none() && traces.is_some() {
            replay_later = Some((pending, traces.take().expect("checked")));
        } else if maybe_trace && a.criu_workdir.is_none() && traces.is_some() {
            // A recording restore that found a trace (its chunk order leads the stream).
            let file = memory_file(&a, &image)?;
            traces = Some(Box::new(outboards_beside_trace(pending, &image, traces.take().expect("checked"), file)));
        } else if a.record_trace || maybe_trace || a.criu_workdir.is_some() {
            finish_outboards(pending, &image);
        } else if image.slices_on_demand() {
            // Every outboard's entries are in: a fault reads its chunk's CVs beside its
            // slice, and the whole blobs never cross the link.
            drop(pending);
        } else {
            let i = image.clone();
            std::thread::Builder::new().name("lazy-outboards".into()).spawn(move || finish_outboards(pending, &i)).context("spawning a thread")?;
        }
    }
    let store: Option<Arc<dyn lazy::ChunkStore>> = if a.no_cache {
        None
    } else {
        let dir = a.cache.clone().unwrap_or_else(puller::ChunkCache::default_dir);
        let limit = a.cache_size.unwrap_or(puller::cache::DEFAULT_LIMIT);
        Some(Arc::new(puller::ChunkCache::open(&dir, limit).with_context(|| format!("opening the chunk cache {}", dir.display()))?))
    };
    let mut opts = LazyOptions::new(a.socket.clone().unwrap_or_default());
    opts.prefetch = a.prefetch;
    opts.prefetch_rate = a.prefetch_rate;
    opts.stream_jobs = a.stream_jobs;
    opts.stream_after = a.stream_after.is_finite().then_some(a.stream_after);
    opts.record_trace = a.record_trace;
    opts.slice_faults = a.slice_faults;
    opts.fill = a.fill;
    opts.retry = RetryPolicy { budget: Some(a.retry_budget), ..lazy::DEFAULT_RETRY };
    opts.memory_bytes = a.memory;
    opts.once = a.once;
    opts.ready_file = a.ready_file.clone();
    opts.allow_uids = a.allow_uid.clone();
    opts.allow_gids = a.allow_gid.clone();
    let (src, background_source): (Arc<dyn imgfmt::BlobSource>, _) = match chunk_clients {
        Some((faults, background)) => (faults, Some(background)),
        None => (Arc::from(o.source), None),
    };
    if let Some(workdir) = &a.criu_workdir {
        return run_criu(&a, image, src, store, workdir.clone(), opts);
    }
    let file = memory_file(&a, &image)?;
    let daemon = Daemon::new(image.clone(), file, src, store, traces, opts)?;
    if let Some(bg) = background_source {
        daemon.set_background_source(bg);
    }
    let replay_coming = replay_later.is_some();
    if let Some((pending, store)) = replay_later {
        daemon.expect_replay();
        let (d, i) = (daemon.clone(), image.clone());
        std::thread::Builder::new()
            .name("lazy-trace".into())
            .spawn(move || d.set_replay(&outboards_beside_trace(pending, &i, store, file)))
            .context("spawning a thread")?;
    }
    eprintln!(
        "snapctl lazy: serving {} of {} ({}){}",
        image.files[file].name,
        a.image,
        imgfmt::size::human(image.files[file].size),
        match (daemon.has_trace(), replay_coming, a.prefetch) {
            (_, _, PrefetchMode::None) => "",
            (true, _, _) => ", with a recorded prefetch trace",
            (false, true, _) => ", reading its prefetch trace (replayed once read and checked)",
            (false, false, _) => "",
        }
    );
    if let Some(addr) = &a.metrics {
        let bound = daemon.serve_metrics(addr)?;
        eprintln!("snapctl lazy: metrics on http://{bound}/metrics");
    }
    let d2 = daemon.clone();
    on_terminate(move || {
        eprintln!(
            "snapctl lazy: stopping: no new connections; waiting for the {} being served to end (a guest whose handler goes away reads untouched memory as zeros); signal again to exit now",
            d2.active()
        );
        d2.drain();
    })?;
    let failed = Arc::new(AtomicBool::new(false));
    let (json, f2) = (a.json, failed.clone());
    daemon.run(Arc::new(move |r: &ConnReport| {
        if r.integrity_failed() {
            f2.store(true, Ordering::Relaxed);
        }
        eprintln!(
            "snapctl lazy: pid {} done ({}): {} faults ({} zero, {} cache, {} fetched, {} present), {} fetched, latency p50 {}us p99 {}us max {}us, {} retries, {} verify failures, {} pages poisoned, {:.2}s",
            r.pid,
            r.ended,
            r.faults.total,
            r.faults.zero,
            r.faults.cache_hit,
            r.faults.fetched,
            r.faults.present,
            imgfmt::size::human(r.bytes_fetched),
            r.latency_us.p50,
            r.latency_us.p99,
            r.latency_us.max,
            r.retries,
            r.verify_failures,
            r.poisoned_pages,
            r.seconds
        );
        if json {
            // A page server keeps serving when its report reader has gone: a guest
            // still faulting must not lose its handler over a closed pipe.
            let _ = common::print_json_line(r);
        }
    }))?;
    Ok(common::code(if failed.load(Ordering::Relaxed) { common::EXIT_FAILED } else { common::EXIT_OK }))
}

/// The file to serve: `--file`, else the image's one file with role memory.
fn memory_file(a: &LazyArgs, image: &imgfmt::Image) -> anyhow::Result<usize> {
    Ok(match &a.file {
        Some(name) => image.file(name).with_context(|| format!("{}: no file named {name:?}", a.image))?.0,
        None => {
            let mem: Vec<usize> = image.files.iter().enumerate().filter(|(_, f)| f.role == Role::Memory).map(|(i, _)| i).collect();
            match mem.as_slice() {
                [i] => *i,
                [] => bail!("{}: no file has role memory; name one with --file", a.image),
                _ => bail!("{}: several memory files; name one with --file", a.image),
            }
        }
    })
}

/// The image `o` names, once the policy accepts it (its signature reads overlap the
/// image's). Outboards let a fault fetch a verified slice instead of its whole chunk, a
/// recording restore keep the guest's working set by slice, and a later restore check that
/// working set slice by slice before installing it; their reads begin with the config's
/// and index's (through `src`, `o`'s source) and end after this returns.
fn open_gated(
    a: &LazyArgs,
    r: &Reference,
    store: &dyn sign::Store,
    o: &mut common::Opened,
    src: &Arc<dyn imgfmt::BlobSource>,
) -> anyhow::Result<(imgfmt::Image, Option<imgfmt::PendingOutboards>)> {
    if !(a.slice_faults || a.record_trace || a.prefetch != PrefetchMode::None) {
        return a.policy.gate(r, store, o, open_image).map(|image| (image, None));
    }
    // A recording or CRIU restore wants every chunk's slice CVs at once: the whole blobs,
    // read beside the config and index. A restore serving faults reads only the
    // outboards' entries, and a chunk's CVs when it first faults (spec/lazy.md "Waking").
    let ahead = if a.record_trace || a.criu_workdir.is_some() { imgfmt::OutboardsAhead::Whole } else { imgfmt::OutboardsAhead::Tables };
    let (image, pending) = a.policy.gate(r, store, o, |o| common::open_image_outboards_later(src.clone(), o, ahead))?;
    Ok((image, Some(pending)))
}

/// Put the outboards in place once they are in, and meanwhile read file `file`'s trace from
/// `store`: the trace's own round trips (its manifest, its JSON, whether its working set is
/// there) need nothing of the outboards, so they overlap the outboards' bytes.
fn outboards_beside_trace(pending: imgfmt::PendingOutboards, image: &imgfmt::Image, store: Box<dyn TraceStore>, file: usize) -> LoadedAhead {
    std::thread::scope(|s| {
        let reading = s.spawn(|| finish_outboards(pending, image));
        let ahead = LoadedAhead::read(store, image, file);
        let _ = reading.join();
        ahead
    })
}

/// Put the outboards in place once they are in. Without them (an old image, a blob that
/// will not load) faults fetch whole chunks and traces are chunk orders only.
fn finish_outboards(pending: imgfmt::PendingOutboards, image: &imgfmt::Image) {
    if let Err(e) = pending.finish(image) {
        eprintln!("snapctl lazy: warning: {e}; faults fetch whole chunks, and no working set is recorded or replayed");
    }
}

/// `--criu-workdir`: one `criu restore --lazy-pages`, every task it restores.
fn run_criu(
    a: &LazyArgs,
    image: Arc<imgfmt::Image>,
    src: Arc<dyn imgfmt::BlobSource>,
    store: Option<Arc<dyn lazy::ChunkStore>>,
    workdir: PathBuf,
    opts: LazyOptions,
) -> anyhow::Result<ExitCode> {
    if image.config().kind != imgfmt::Kind::Criu {
        eprintln!("snapctl lazy: warning: {} is a {} image, not criu", a.image, image.config().kind);
    }
    let daemon = CriuDaemon::new(image, src, store, workdir.clone(), opts);
    if let Some(addr) = &a.metrics {
        let bound = daemon.serve_metrics(addr)?;
        eprintln!("snapctl lazy: metrics on http://{bound}/metrics");
    }
    let prepared = if a.criu_prepare {
        let t0 = std::time::Instant::now();
        std::fs::create_dir_all(&workdir).with_context(|| format!("creating {}", workdir.display()))?;
        let p = daemon.prepare_workdir().with_context(|| format!("preparing {} for criu restore --lazy-pages", workdir.display()))?;
        eprintln!(
            "snapctl lazy: criu: wrote {} files ({}) into {} in {:.2}s; {} of lazy pages left to serve",
            p.paths.len(),
            imgfmt::size::human(p.bytes_written),
            workdir.display(),
            t0.elapsed().as_secs_f64(),
            imgfmt::size::human(p.lazy_bytes_left)
        );
        Some(p)
    } else {
        None
    };
    let d2 = daemon.clone();
    on_terminate(move || {
        eprintln!("snapctl lazy: criu: stopping once the restore being served (if any) is done; signal again to exit now (its tasks would then read untouched memory as zeros)");
        d2.drain();
    })?;
    let result = serve_criu(a, &daemon);
    if let Some(p) = &prepared {
        daemon.remove_prepared(p);
    }
    result
}

/// On the first SIGTERM or SIGINT, `drain` (from a thread of its own); on a second, exit at
/// once with status 2. Stopping a page server while a guest still faults would let the
/// kernel zero-fill that guest's untouched memory, so the first signal only stops taking
/// new work.
fn on_terminate(drain: impl Fn() + Send + 'static) -> anyhow::Result<()> {
    let hit = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        // Registered first, so it sees the flag as it was before this signal set it.
        signal_hook::flag::register_conditional_shutdown(sig, common::EXIT_ERROR as i32, hit.clone()).context("installing a signal handler")?;
        signal_hook::flag::register(sig, hit.clone()).context("installing a signal handler")?;
    }
    std::thread::Builder::new()
        .name("lazy-signals".into())
        .spawn(move || {
            while !hit.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(50));
            }
            drain();
        })
        .context("spawning the signal thread")?;
    Ok(())
}

/// Serve the restore; the exit code from the tasks' reports.
fn serve_criu(a: &LazyArgs, daemon: &Arc<CriuDaemon>) -> anyhow::Result<ExitCode> {
    let (failed, errored) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    let (json, f2, e2) = (a.json, failed.clone(), errored.clone());
    daemon.run(Arc::new(move |r: &CriuReport| {
        let c = &r.conn;
        if c.integrity_failed() {
            f2.store(true, Ordering::Relaxed);
        }
        if r.error.is_some() {
            e2.store(true, Ordering::Relaxed);
        }
        eprintln!(
            "snapctl lazy: criu: pid {} done ({}): {} faults ({} zero, {} cache, {} fetched, {} present), {} fetched, {} pushed, latency p50 {}us p99 {}us, {} verify failures, {} pages poisoned{}",
            c.pid,
            c.ended,
            c.faults.total,
            c.faults.zero,
            c.faults.cache_hit,
            c.faults.fetched,
            c.faults.present,
            imgfmt::size::human(c.bytes_fetched),
            imgfmt::size::human(c.prefetched_bytes),
            c.latency_us.p50,
            c.latency_us.p99,
            c.verify_failures,
            c.poisoned_pages,
            r.error.as_deref().map(|e| format!("; ERROR: {e}")).unwrap_or_default()
        );
        if json {
            // A page server keeps serving when its report reader has gone: a guest
            // still faulting must not lose its handler over a closed pipe.
            let _ = common::print_json_line(r);
        }
    }))?;
    Ok(common::code(if errored.load(Ordering::Relaxed) {
        common::EXIT_ERROR
    } else if failed.load(Ordering::Relaxed) {
        common::EXIT_FAILED
    } else {
        common::EXIT_OK
    }))
}
