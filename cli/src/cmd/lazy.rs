//! `snapctl lazy`: the userfaultfd page-fault server for restoring VMs (spec/lazy.md).

mod criu;
mod front;
mod stop;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use imgfmt::reference::Reference;
use lazy::wake::{self, Front as _};
use lazy::{ConnReport, LazyOptions, PrefetchMode, RetryPolicy};

use super::common;

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
    #[command(flatten)]
    pub cache: super::cache::HostCacheArgs,
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
pub const DEFAULT_LOG: &str = "warn,lazy=info,snapctl=info";

pub fn run(a: LazyArgs) -> anyhow::Result<ExitCode> {
    let r: Reference = a.image.parse()?;
    let cli = front::Cli { image: &a.image, reference: &r, file: a.file.as_deref(), policy: &a.policy };
    let prepared = wake::prepare(&cli, &r, options(&a), a.criu_workdir.is_some())?;
    let store = a.cache.open()?.map(|c| Arc::new(c) as Arc<dyn lazy::ChunkStore>);
    if let Some(workdir) = &a.criu_workdir {
        let f = criu::CriuFlags { image: &a.image, workdir: workdir.clone(), prepare: a.criu_prepare, metrics: a.metrics.as_deref(), json: a.json };
        return criu::run(f, prepared, store);
    }
    let file = cli.memory_file(&prepared.image)?;
    let image = prepared.image.clone();
    let woken = prepared.serve(file, store)?;
    let daemon = woken.daemon.clone();
    let trace = match (daemon.has_trace(), woken.replay_coming, a.prefetch) {
        (_, _, PrefetchMode::None) => "",
        (true, _, _) => ", with a recorded prefetch trace",
        (false, true, _) => ", reading its prefetch trace (replayed once read and checked)",
        (false, false, _) => "",
    };
    let f = &image.files[file];
    tracing::info!("serving {} of {} ({}){trace}", f.name, a.image, imgfmt::size::human(f.size));
    if let Some(addr) = &a.metrics {
        let bound = daemon.serve_metrics(addr)?;
        tracing::info!("metrics on http://{bound}/metrics");
    }
    let d2 = daemon.clone();
    stop::on_terminate(move || {
        tracing::info!(
            "stopping: no new connections; waiting for the {} being served to end (a guest whose handler goes away reads untouched memory as zeros); signal again to exit now",
            d2.active()
        );
        d2.drain();
    })?;
    let failed = Arc::new(AtomicBool::new(false));
    daemon.run(on_report(a.json, failed.clone()))?;
    Ok(common::code(if failed.load(Ordering::Relaxed) { common::EXIT_FAILED } else { common::EXIT_OK }))
}

/// The daemon's options as the flags say.
fn options(a: &LazyArgs) -> LazyOptions {
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
    opts
}

/// Each finished connection's summary on stderr (and with --json on stdout); `failed` is
/// set when a chunk failed verification.
fn on_report(json: bool, failed: Arc<AtomicBool>) -> Arc<dyn Fn(&ConnReport) + Send + Sync> {
    Arc::new(move |r: &ConnReport| {
        if r.integrity_failed() {
            failed.store(true, Ordering::Relaxed);
        }
        tracing::info!("{}", r.summary());
        if json {
            // A page server keeps serving when its report reader has gone: a guest
            // still faulting must not lose its handler over a closed pipe.
            let _ = common::print_json_line(r);
        }
    })
}
