//! `snapctl mount` and `snapctl umount`: an image's files as a read-only FUSE file system
//! (spec/mount.md). Flags and glue; the host daemon is the `mount` crate's.

use std::io::{Read as _, Write as _};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use imgfmt::reference::{Reference, Selector};
use imgfmt::{Image, OutboardsAhead, RetryPolicy};
use lazy::PrefetchMode;
use mount::control::{self, Busy, Request};
use mount::{Host, HostOptions, Opened, Opener, Passthrough, Report};

use super::common;

/// Show an image's files, read lazily and verified, as a read-only file system in DIR.
///
/// Every file of the image (Firecracker's vm.state and vm.mem, gVisor's checkpoint.img,
/// pages_meta.img and pages.img, CRIU image directories, any directory) with its size and
/// mode. A read fetches only the chunks under it (zero chunks are never fetched), from the
/// chunk cache, else the image's source, each verified before a byte of it is returned; a
/// chunk that fails verification fails the reads that touch it with EIO (logged with its
/// file, chunk and offset) and the rest of the file keeps working. The page cache is kept
/// across opens and shared by every process that reads or maps a file; other users may
/// read (allow_other, the image's modes).
///
/// A file whose every stored chunk is in the chunk cache (after the fill, or at once when
/// the cache holds it) is copied whole, verified, to a private file under the cache
/// directory, and later opens of it are served by FUSE passthrough: the kernel reads the
/// copy without asking the daemon (--passthrough; spec/mount.md §8).
///
/// One host mount (--host) presents every image mounted on this host, each in a
/// directory named by its manifest digest; a file two images share is one inode, read
/// and cached once. The first `snapctl mount` starts it and serves until the last DIR is
/// unmounted; later ones add their image to it through its control socket and show it in
/// their DIR (a bind mount). An image with a base also shows the clone layout in
/// DIR/.clone: the base's memory file (shared by every clone), the image's own 4 KiB pages
/// and their map (spec/mount.md).
///
/// Runs in the foreground until DIR is unmounted (`snapctl umount DIR`); --daemon returns
/// once DIR shows the image. SIGTERM or SIGINT unmounts DIR once no process has a file of
/// it open or mapped (a process still mapping a file keeps it); a second signal detaches at
/// once, and the daemon's end leaves processes still reading with ENOTCONN. A killed daemon
/// leaves mounts that answer ENOTCONN: `snapctl umount DIR` removes them, and a new mount
/// starts from what the chunk cache kept.
///
/// Exit codes: 0 done, 1 the policy refused the image (or a chunk failed verification
/// while mounted), 2 error (DIR missing, not empty or a mount point, no /dev/fuse, not
/// permitted, an image with no files, ...).
#[derive(Debug, clap::Args)]
pub struct MountArgs {
    /// Image: oci:PATH[:TAG|@DIGEST] or HOST[:PORT]/REPO[:TAG|@DIGEST].
    pub image: String,
    /// An empty directory to show the image's files in.
    pub dir: PathBuf,
    /// The host mount point [default: $SNAPCTL_MOUNT_HOST, else /run/snapctl/mount as root,
    /// else $XDG_RUNTIME_DIR/snapctl/mount]; its control socket is HOST.sock.
    #[arg(long, value_name = "DIR")]
    pub host: Option<PathBuf>,
    #[command(flatten)]
    pub cache: super::cache::HostCacheArgs,
    /// What the background fill brings into the chunk cache beside the reads: `trace`
    /// the memory file's recorded trace first, then every chunk in file order; `all`
    /// every chunk in file order; `none` nothing (reads only).
    #[arg(long, default_value = "trace", value_parser = parse_prefetch)]
    pub prefetch: PrefetchMode,
    /// `auto`: once a file is complete in the chunk cache, serve its later opens by FUSE
    /// passthrough from a verified whole-file copy (needs Linux 6.9 or later and a chunk
    /// cache; its reads are not re-hashed); `off`: every read goes through the daemon.
    /// The host mount's setting: a mount that joins a running host mount keeps the host's
    /// and says so when this differs. [default: auto]
    #[arg(long, value_name = "auto|off", value_parser = parse_passthrough)]
    pub passthrough: Option<Passthrough>,
    /// How long a read waits for a failing source before it fails with EIO (500ms, 60s, 2m).
    #[arg(long, default_value = "60s", value_parser = common::parse_duration)]
    pub retry_budget: Duration,
    /// Recently used chunks kept in memory per image.
    #[arg(long, default_value = "64MiB", value_name = "SIZE", value_parser = common::parse_size)]
    pub memory: u64,
    /// Return once DIR shows the image; a host mount started here goes on in the
    /// background (its log: --log).
    #[arg(long)]
    pub daemon: bool,
    /// With --daemon: the background host daemon's log [default: HOST.log].
    #[arg(long, value_name = "FILE")]
    pub log: Option<PathBuf>,
    /// Print what the mount did as one JSON object on stdout when DIR is unmounted.
    #[arg(long)]
    pub json: bool,
    /// Write "ready" to this inherited descriptor once DIR shows the image (how --daemon
    /// hears from the process it starts).
    #[arg(long, hide = true, value_name = "FD")]
    pub ready_fd: Option<i32>,
    #[command(flatten)]
    pub registry: common::RegistryFlags,
    #[command(flatten)]
    pub policy: super::policy::PolicyFlags,
}

/// Unmount a DIR that `snapctl mount` shows an image in.
///
/// Refuses while a file of the image is open or mapped (naming how many), unless --wait
/// (wait until they are closed) or --lazy (detach DIR now; the image goes once they are).
/// A DIR left by a daemon that was killed (its reads answer ENOTCONN) is detached.
#[derive(Debug, clap::Args)]
pub struct UmountArgs {
    pub dir: PathBuf,
    /// Wait for the image's open and mapped files to be closed.
    #[arg(long, conflicts_with = "lazy")]
    pub wait: bool,
    /// Detach DIR at once, whatever is open.
    #[arg(long)]
    pub lazy: bool,
    /// Print what the mount did as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

fn parse_prefetch(s: &str) -> Result<PrefetchMode, String> {
    s.parse()
}

fn parse_passthrough(s: &str) -> Result<Passthrough, String> {
    s.parse()
}

fn prefetch_name(m: PrefetchMode) -> &'static str {
    match m {
        PrefetchMode::None => "none",
        PrefetchMode::Trace => "trace",
        PrefetchMode::All => "all",
    }
}

/// The daemon's progress lines (each image shown and unmounted) and every library's warnings.
pub const DEFAULT_LOG: &str = "warn,mount=info";

pub fn run(a: MountArgs) -> anyhow::Result<ExitCode> {
    mount::target::check_host()?;
    let dir = mount::target::check_dir(&a.dir)?;
    let (o, image) = open_to_show(&a.policy, &a.image)?;
    if image.files.is_empty() {
        anyhow::bail!("{}: the image has no files: nothing to mount", common::printable(&a.image));
    }
    let pinned = pinned_reference(&o, &image)?;
    let host_dir = a.host.clone().unwrap_or_else(HostOptions::default_dir);
    let socket = control::socket_of(&host_dir);
    if control::alive(&socket) {
        let req = Request::Add { reference: pinned, dir: dir.clone(), prefetch: prefetch_name(a.prefetch).into() };
        let r = control::call(&socket, &req)?;
        if !r.ok {
            anyhow::bail!("{}", r.error.unwrap_or_default());
        }
        let pt = r.passthrough.unwrap_or_else(|| "unknown".into());
        eprintln!("snapctl mount: {} shown in {} (host mount {}, passthrough {pt})", common::printable(&a.image), dir.display(), host_dir.display());
        if let Some(asked) = a.passthrough.filter(|&p| (p == Passthrough::Off) == (pt == "on")) {
            let asked = if asked == Passthrough::Off { "off" } else { "auto" };
            eprintln!("snapctl mount: --passthrough {asked} not applied: it is the host mount's, which runs with passthrough {pt} (unmount all of its DIRs to start it anew)");
        }
        ready(a.ready_fd);
        if a.daemon {
            return Ok(common::code(common::EXIT_OK));
        }
        return wait_as_client(&socket, &dir, a.json);
    }
    if a.daemon {
        return daemonize(&a, &host_dir);
    }
    serve(&a, &dir, host_dir, o, image, pinned)
}

/// The reference `o` names, pinned to `image`'s digest, with a layout's path made
/// absolute (the daemon may run elsewhere).
fn pinned_reference(o: &common::Opened, image: &Image) -> anyhow::Result<String> {
    let mut r: Reference = o.reference.parse()?;
    match &mut r {
        Reference::Layout { path, selector } => {
            *path = path.canonicalize().with_context(|| format!("{}", path.display()))?;
            *selector = Selector::Digest(image.manifest_digest.clone());
        }
        Reference::Registry { selector, .. } => *selector = Selector::Digest(image.manifest_digest.clone()),
    }
    Ok(r.to_string())
}

/// This process becomes the host daemon: mount, show the image in `dir`, serve until the
/// last DIR is unmounted.
fn serve(a: &MountArgs, dir: &Path, host_dir: PathBuf, o: common::Opened, image: Image, pinned: String) -> anyhow::Result<ExitCode> {
    let store = a.cache.open()?.map(Arc::new);
    let mut opts = HostOptions::new(host_dir.clone());
    opts.memory_bytes = a.memory;
    opts.retry = RetryPolicy { budget: Some(a.retry_budget), ..RetryPolicy::stall(a.retry_budget) };
    opts.passthrough = a.passthrough.unwrap_or_default();
    let host = Host::start(opts, Box::new(CliOpener), store)?;
    let opened = opened(o.source, Arc::new(image), pinned, a.prefetch);
    if let Err(e) = host.add(opened, dir) {
        host.detach_all();
        return Err(e.into());
    }
    eprintln!(
        "snapctl mount: {} shown in {} (host mount {}, passthrough {})",
        common::printable(&a.image),
        dir.display(),
        host_dir.display(),
        host.passthrough()
    );
    ready(a.ready_fd);
    let (h1, h2) = (host.clone(), host.clone());
    on_terminate(
        move || {
            eprintln!("snapctl mount: stopping: every DIR is unmounted once no process has its files open or mapped; signal again to detach now");
            h1.drain();
        },
        move || h2.detach_all(),
    )?;
    host.run();
    let report = host.wait(dir).ok();
    finish(report, a.json)
}

/// A later `snapctl mount` in the foreground: wait until `dir` is unmounted, unmounting it
/// on a signal (at once on a second).
fn wait_as_client(socket: &Path, dir: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let (s1, d1, s2, d2) = (socket.to_path_buf(), dir.to_path_buf(), socket.to_path_buf(), dir.to_path_buf());
    on_terminate(
        move || {
            eprintln!("snapctl mount: unmounting {} once no process has its files open or mapped; signal again to detach now", d1.display());
            let _ = control::call(&s1, &Request::Remove { dir: d1.clone(), busy: Busy::Wait });
        },
        move || {
            let _ = control::call(&s2, &Request::Remove { dir: d2.clone(), busy: Busy::Detach });
        },
    )?;
    let r = control::call(socket, &Request::Wait { dir: dir.to_path_buf() })?;
    if !r.ok {
        anyhow::bail!("{}", r.error.unwrap_or_default());
    }
    finish(r.report, json)
}

/// Print the report (with --json) and exit 1 if a chunk failed verification.
fn finish(report: Option<Report>, json: bool) -> anyhow::Result<ExitCode> {
    let Some(r) = report else { return Ok(common::code(common::EXIT_OK)) };
    eprintln!(
        "snapctl mount: {} unmounted from {}: {} opens ({} by passthrough), {} reads ({}), {} chunks fetched ({}), {} cache hits, {} verify failures, {} reads failed, {:.2}s",
        r.image,
        r.dir,
        r.opens,
        r.passthrough_files,
        r.reads,
        imgfmt::size::human(r.bytes_read),
        r.fetched_chunks,
        imgfmt::size::human(r.bytes_fetched),
        r.cache_hits,
        r.verify_failures,
        r.read_failures,
        r.seconds
    );
    if json {
        common::print_json_line(&r)?;
    }
    Ok(common::code(if r.verify_failures > 0 { common::EXIT_FAILED } else { common::EXIT_OK }))
}

/// `--daemon`: run this command again without it, in a session of its own, and return once
/// it says DIR shows the image (or with its error).
fn daemonize(a: &MountArgs, host_dir: &Path) -> anyhow::Result<ExitCode> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error()).context("creating a pipe");
    }
    // SAFETY: pipe2 just returned these two descriptors, owned by nobody else.
    let (read_end, write_end) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let log = a.log.clone().unwrap_or_else(|| {
        let mut p = host_dir.as_os_str().to_os_string();
        p.push(".log");
        PathBuf::from(p)
    });
    if let Some(d) = log.parent() {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    let log_file = std::fs::OpenOptions::new().create(true).append(true).open(&log).with_context(|| format!("opening {}", log.display()))?;
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).filter(|s| s != "--daemon").collect();
    let mut cmd = std::process::Command::new(std::env::current_exe().context("finding this program")?);
    cmd.args(args).arg("--ready-fd").arg(write_end.as_raw_fd().to_string());
    cmd.stdin(std::process::Stdio::null()).stdout(std::process::Stdio::null()).stderr(log_file);
    let wfd = write_end.as_raw_fd();
    use std::os::unix::process::CommandExt;
    // SAFETY: between fork and exec only async-signal-safe calls: setsid and fcntl.
    unsafe {
        cmd.pre_exec(move || {
            libc::setsid();
            let flags = libc::fcntl(wfd, libc::F_GETFD);
            libc::fcntl(wfd, libc::F_SETFD, flags & !libc::FD_CLOEXEC);
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("starting the host mount daemon")?;
    drop(write_end);
    let mut said = String::new();
    let _ = std::fs::File::from(read_end).read_to_string(&mut said);
    if said.trim() == "ready" {
        eprintln!("snapctl mount: {} shown in {} (host mount daemon pid {}, log {})", common::printable(&a.image), a.dir.display(), child.id(), log.display());
        return Ok(common::code(common::EXIT_OK));
    }
    // It failed: its own last word (in its log) and its exit code are ours.
    let status = child.wait().context("waiting for the host mount daemon")?;
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let last = text.lines().rev().find(|l| l.starts_with("snapctl: ")).unwrap_or("snapctl: the host mount daemon ended before DIR showed the image");
    eprintln!("{last}");
    Ok(common::code(status.code().and_then(|c| u8::try_from(c).ok()).unwrap_or(common::EXIT_ERROR)))
}

/// Tell the `--daemon` parent, if any, that DIR shows the image.
fn ready(fd: Option<i32>) {
    if let Some(fd) = fd {
        // SAFETY: the descriptor was handed to this process for this one write, and is
        // closed when the file is dropped.
        let mut f = unsafe { std::fs::File::from_raw_fd(fd) };
        let _ = f.write_all(b"ready\n");
    }
}

/// On the first SIGTERM or SIGINT `first` (on a thread of its own, so that a second
/// signal is heard while it waits), on a second `second`, then exit with status 2.
fn on_terminate(first: impl Fn() + Send + Sync + 'static, second: impl Fn() + Send + 'static) -> anyhow::Result<()> {
    let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        let h = hits.clone();
        // SAFETY: the handler only increments an atomic counter, which is async-signal-safe.
        unsafe { signal_hook::low_level::register(sig, move || _ = h.fetch_add(1, Ordering::SeqCst)) }.context("installing a signal handler")?;
    }
    let first = Arc::new(first);
    std::thread::Builder::new()
        .name("mount-signals".into())
        .spawn(move || {
            let mut started = false;
            loop {
                let n = hits.load(Ordering::SeqCst);
                if n >= 1 && !started {
                    started = true;
                    let f = first.clone();
                    let _ = std::thread::Builder::new().name("mount-stop".into()).spawn(move || f());
                }
                if n >= 2 {
                    second();
                    std::process::exit(i32::from(common::EXIT_ERROR));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
        .context("spawning the signal thread")?;
    Ok(())
}

/// The image `reference` names, admitted by `policy`, opened as a mount shows it soonest:
/// connections to a registry opened while the manifest is read, and only the outboards'
/// tables read (beside the config and index), never their whole blobs, whose megabytes
/// would sit in front of the first reads on the link; a chunk's CVs are read beside its
/// first slice read.
fn open_to_show(policy: &super::policy::PolicyFlags, reference: &str) -> anyhow::Result<(common::Opened, Image)> {
    let r: Reference = reference.parse()?;
    let mut o = common::open_to_restore(&r, reference)?;
    if let Some(c) = &o.registry {
        lazy::wake::warm_up(c, lazy::wake::WARM_METADATA_CONNECTIONS);
    }
    let image = policy.gate(&r, &mut o, open_tables)?;
    Ok((o, image))
}

/// [`open_to_show`]'s opening, once the policy admits the image.
fn open_tables(o: &common::Opened) -> anyhow::Result<Image> {
    // With the tables read, nothing is pending: the image reads each chunk's CVs itself.
    let (image, _nothing_pending) = common::open_image_outboards_later(o.source.clone(), o, OutboardsAhead::Tables)?;
    Ok(image)
}

/// An image and what the host needs to present it. Its trace is looked up once it is
/// shown, on the fill's thread.
fn opened(source: Arc<dyn imgfmt::BlobSource>, image: Arc<Image>, reference: String, prefetch: PrefetchMode) -> Opened {
    let base = image.config().base.as_ref().and_then(|b| match Image::open_outboards_later(source.clone(), &b.manifest, OutboardsAhead::Tables) {
        Ok((i, _nothing_pending)) => Some(Arc::new(i)),
        Err(e) => {
            tracing::warn!("{reference}: its base {} cannot be opened from the same place ({e}): no clone layout", b.manifest);
            None
        }
    });
    let trace = (prefetch == PrefetchMode::Trace).then(|| {
        let (reference, image) = (reference.clone(), image.clone());
        Box::new(move || memory_trace(&reference, &image)) as mount::TraceLookup
    });
    Opened { reference, image, source, base, prefetch, trace }
}

/// The recorded trace of the image's memory file (its one file of role memory), for the
/// fill's order; none when there is no such file or trace, or it cannot be read (logged).
fn memory_trace(reference: &str, image: &Image) -> Option<(usize, lazy::Trace)> {
    let mut memory = image.files.iter().enumerate().filter(|(_, f)| f.role == imgfmt::Role::Memory);
    let (file, _) = memory.next().filter(|_| memory.next().is_none())?;
    let r = reference.parse::<Reference>().ok()?;
    let store: Box<dyn lazy::TraceStore> = match (r.layout_path(), r.registry()) {
        (Some(path), _) => Box::new(lazy::LayoutTraces(imgfmt::OciLayout::open(path).ok()?)),
        (None, Some((host, repository))) => Box::new(lazy::RegistryTraces::new(Arc::new(common::registry_client(host, repository).ok()?))),
        (None, None) => return None,
    };
    match store.load(image, file) {
        Ok(t) => t.map(|t| (file, t)),
        Err(e) => {
            tracing::warn!("{reference}: ignoring its trace: {e}");
            None
        }
    }
}

/// Opens the references later `snapctl mount`s send to this daemon (their policy was
/// checked by them).
struct CliOpener;

impl Opener for CliOpener {
    fn open(&self, reference: &str, prefetch: PrefetchMode) -> Result<Opened, String> {
        let r: Reference = reference.parse().map_err(|e| format!("{e:#}"))?;
        let o = common::open_to_restore(&r, reference).map_err(|e| format!("{e:#}"))?;
        let image = open_tables(&o).map_err(|e| format!("{e:#}"))?;
        Ok(opened(o.source, Arc::new(image), reference.to_string(), prefetch))
    }
}

pub fn run_umount(a: UmountArgs) -> anyhow::Result<ExitCode> {
    let dir = std::path::absolute(&a.dir).with_context(|| format!("{}", a.dir.display()))?;
    let dir = dir.canonicalize().unwrap_or(dir);
    let Some(m) = mount::target::mount_at(&dir) else {
        anyhow::bail!("{}: not a mount point: nothing to unmount", dir.display());
    };
    if m.fstype != mount::target::FSTYPE {
        return Err(mount::target::TargetError::NotOurs(dir.display().to_string(), m.fstype).into());
    }
    let host = mount::target::host_of(&m);
    let socket = host.as_ref().map(|h| control::socket_of(&h.mount_point));
    let Some(socket) = socket.filter(|s| control::alive(s)) else {
        // The daemon is gone: its mounts answer ENOTCONN; detach them.
        mount::host::unmount(&dir, libc::MNT_DETACH)?;
        if let Some(h) = host.filter(|h| h.mount_point != dir) {
            if mount::target::mountinfo().iter().filter(|x| x.dev == h.dev).count() == 1 {
                let _ = mount::host::unmount(&h.mount_point, libc::MNT_DETACH);
            }
        }
        eprintln!("snapctl umount: {}: its daemon was gone; detached", dir.display());
        return Ok(common::code(common::EXIT_OK));
    };
    let busy = if a.wait {
        Busy::Wait
    } else if a.lazy {
        Busy::Detach
    } else {
        Busy::Refuse
    };
    let r = control::call(&socket, &Request::Remove { dir: dir.clone(), busy })?;
    if !r.ok {
        anyhow::bail!("{}", r.error.unwrap_or_default());
    }
    if a.json {
        if let Some(rep) = &r.report {
            common::print_json_line(rep)?;
        }
    }
    Ok(common::code(common::EXIT_OK))
}
