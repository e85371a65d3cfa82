//! The host daemon: one FUSE mount per host presenting every image mounted on it, each
//! shown in its DIRs by a bind mount of its directory, and the control socket through
//! which later `snapctl mount` and `snapctl umount` add and remove them.
//!
//! ```text
//! start: host dir (a dead mount left by a killed daemon is detached first) -> FUSE mount
//!        (allow_other, default_permissions, ro) -> control socket <host>.sock
//! add DIR:    DIR checked -> image into the tree -> bind <host>/<name> onto DIR
//! remove DIR: files open? refuse | wait | detach -> umount DIR -> tree: one bind fewer
//! the last DIR gone (or the host mount unmounted under it): the daemon ends, the host
//!             mount, the socket and the whole-file copies removed
//! ```

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use fuser::{Config, MountOption, SessionACL};
use imgfmt::{BlobSource, Image, RetryPolicy};
use lazy::{PrefetchMode, Trace};
use puller::ChunkCache;

use crate::control::{self, BindStatus, Busy, Request, Response};
use crate::fs::{MountFs, Shared};
use crate::target::{self, TargetError};
use crate::{copies, fill, io_err, Fetcher, MountError, Report, Served};

/// How the host daemon runs.
#[derive(Debug, Clone)]
pub struct HostOptions {
    /// The host mount point (created if missing); its control socket is beside it.
    pub dir: PathBuf,
    /// Threads answering the kernel's requests.
    pub threads: usize,
    /// Recently used chunks kept in memory per image, in bytes.
    pub memory_bytes: u64,
    /// How long a read may wait for a failing source before it gets `EIO`.
    pub retry: RetryPolicy,
    /// Whether complete files are served through FUSE passthrough.
    pub passthrough: Passthrough,
}

/// Whether a file complete in the chunk cache is copied whole and its opens served by
/// FUSE passthrough (the kernel reads the copy), or every read goes through the daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Passthrough {
    /// Where the kernel offers it (Linux 6.9 or later) and there is a chunk cache.
    #[default]
    Auto,
    Off,
}

impl std::str::FromStr for Passthrough {
    type Err = String;
    fn from_str(s: &str) -> Result<Passthrough, String> {
        match s {
            "auto" => Ok(Passthrough::Auto),
            "off" => Ok(Passthrough::Off),
            _ => Err(format!("{s:?}: expected auto or off")),
        }
    }
}

impl HostOptions {
    pub fn new(dir: PathBuf) -> HostOptions {
        HostOptions { dir, threads: 16, memory_bytes: 64 << 20, retry: RetryPolicy::stall(Duration::from_secs(60)), passthrough: Passthrough::Auto }
    }

    /// `$SNAPCTL_MOUNT_HOST`, else `/run/snapctl/mount` for root, else
    /// `$XDG_RUNTIME_DIR/snapctl/mount`, else `/tmp/snapctl-<uid>/mount`.
    pub fn default_dir() -> PathBuf {
        if let Some(p) = std::env::var_os("SNAPCTL_MOUNT_HOST").filter(|v| !v.is_empty()) {
            return PathBuf::from(p);
        }
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        if uid == 0 {
            return PathBuf::from("/run/snapctl/mount");
        }
        match std::env::var_os("XDG_RUNTIME_DIR").filter(|v| !v.is_empty()) {
            Some(r) => PathBuf::from(r).join("snapctl/mount"),
            None => PathBuf::from(format!("/tmp/snapctl-{uid}/mount")),
        }
    }
}

/// An image opened (and admitted by the policy) for the host to present.
pub struct Opened {
    /// Its reference, pinned by digest.
    pub reference: String,
    pub image: Arc<Image>,
    pub source: Arc<dyn BlobSource>,
    /// Its base, when it has one that could be opened from the same source.
    pub base: Option<Arc<Image>>,
    pub prefetch: PrefetchMode,
    /// Reads the memory file's recorded trace, for the fill's order. Called on the fill's
    /// thread once the image is shown: looking a trace up costs round trips that the
    /// first reads should not wait behind.
    pub trace: Option<TraceLookup>,
}

/// Looks up an image's recorded trace: `(file, trace)`, or `None` when it has none (or it
/// cannot be read: the lookup logs why).
pub type TraceLookup = Box<dyn FnOnce() -> Option<(usize, Trace)> + Send>;

/// Opens the references later `snapctl mount`s send (the CLI's: registries, credentials).
pub trait Opener: Send + Sync {
    fn open(&self, reference: &str, prefetch: PrefetchMode) -> Result<Opened, String>;
}

/// One DIR showing an image.
struct Bind {
    name: String,
    served: Arc<Served>,
}

/// The host daemon.
pub struct Host {
    opts: HostOptions,
    shared: Arc<Shared>,
    store: Option<Arc<ChunkCache>>,
    opener: Box<dyn Opener>,
    binds: Mutex<BTreeMap<PathBuf, Bind>>,
    /// Reports of DIRs unmounted, for `wait` (kept until the daemon ends).
    removed: Mutex<BTreeMap<PathBuf, Report>>,
    changed: Condvar,
    session: Mutex<Option<fuser::BackgroundSession>>,
    socket: PathBuf,
    draining: AtomicBool,
    stop_fill: Arc<AtomicBool>,
    added_any: AtomicBool,
    /// Control requests being handled: the daemon answers them before it ends.
    handling: std::sync::atomic::AtomicU64,
    /// Images being let go after their DIR was unmounted (their chunks still queued for
    /// the chunk cache are written): joined before the daemon ends, not before `umount`
    /// is answered.
    retiring: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl Host {
    /// Mount the host file system at `opts.dir` and listen on its control socket.
    pub fn start(opts: HostOptions, opener: Box<dyn Opener>, store: Option<Arc<ChunkCache>>) -> Result<Arc<Host>, MountError> {
        target::check_host()?;
        let dir = &opts.dir;
        std::fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
        let socket = control::socket_of(dir);
        if control::alive(&socket) {
            return Err(MountError::Refused(format!("{}: a host mount daemon already answers there", socket.display())));
        }
        detach_dead(dir);
        let shared = Shared::new(copies_for(opts.passthrough, store.as_deref()));
        let mut config = Config::default();
        config.mount_options = vec![
            MountOption::FSName("snapctl".into()),
            // mount(2) of type "fuse" with this shows as fuse.snapctl (target::FSTYPE)
            MountOption::CUSTOM("subtype=snapctl".into()),
            MountOption::RO,
            MountOption::DefaultPermissions,
            MountOption::NoDev,
            MountOption::NoSuid,
        ];
        config.acl = SessionACL::All;
        config.n_threads = Some(opts.threads.max(1));
        config.clone_fd = true;
        let session =
            fuser::Session::new(MountFs(shared.clone()), dir, &config).map_err(io_err(format!("mounting the host file system at {}", dir.display())))?;
        let session = session.spawn().map_err(io_err("starting the FUSE session"))?;
        raise_readahead(dir, u64::from(crate::fs::MAX_READ));
        let listener = match control::listen(&socket) {
            Ok(l) => l,
            Err(e) => {
                let _ = session.umount_and_join();
                return Err(e);
            }
        };
        let host = Arc::new(Host {
            opts,
            shared,
            store,
            opener,
            binds: Mutex::new(BTreeMap::new()),
            removed: Mutex::new(BTreeMap::new()),
            changed: Condvar::new(),
            session: Mutex::new(Some(session)),
            socket,
            draining: AtomicBool::new(false),
            stop_fill: Arc::new(AtomicBool::new(false)),
            added_any: AtomicBool::new(false),
            handling: Default::default(),
            retiring: Mutex::new(Vec::new()),
        });
        host.serve_control(listener)?;
        tracing::info!("host mount at {} (control socket {})", host.opts.dir.display(), host.socket.display());
        Ok(host)
    }

    pub fn dir(&self) -> &Path {
        &self.opts.dir
    }

    /// Present `o` and show it in `dir` (an empty directory, checked here). Returns the
    /// image's name (`sha256:<hex>`).
    pub fn add(&self, o: Opened, dir: &Path) -> Result<String, MountError> {
        if self.draining.load(Relaxed) {
            return Err(MountError::Refused("the host mount is stopping: mount again once it has".into()));
        }
        let dir = target::check_dir(dir)?;
        let name = o.image.manifest_digest.to_string();
        let fetcher = |image: &Arc<Image>| -> Arc<dyn crate::ChunkSource> {
            Fetcher::new(image.clone(), o.source.clone(), self.store.clone(), self.opts.retry, self.opts.memory_bytes)
        };
        let existing = self.shared.tree().image(&name).cloned();
        let served = match existing {
            Some(s) => s,
            None => Arc::new(Served {
                name: name.clone(),
                reference: o.reference.clone(),
                chunks: fetcher(&o.image),
                base: o.base.as_ref().map(fetcher),
                counters: Default::default(),
                added: Instant::now(),
            }),
        };
        let (_, fresh) = self.shared.tree_mut().add(served.clone())?;
        let inside = self.opts.dir.join(&name);
        if let Err(e) = bind(&inside, &dir) {
            self.shared.tree_mut().remove(&name);
            return Err(e);
        }
        self.binds.lock().expect("poisoned").insert(dir.clone(), Bind { name: name.clone(), served: served.clone() });
        self.added_any.store(true, Relaxed);
        if fresh {
            self.background(served, o.prefetch, o.trace);
        }
        tracing::info!("{} ({}) shown in {}", name, o.reference, dir.display());
        Ok(name)
    }

    /// Unmount `dir` and present its image one time fewer: with files of it open or
    /// mapped, as `busy` says. Returns what the image's mount did.
    pub fn remove(&self, dir: &Path, busy: Busy) -> Result<Report, MountError> {
        let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
        let name = match self.binds.lock().expect("poisoned").get(&dir) {
            Some(b) => b.name.clone(),
            None => return Err(MountError::Refused(format!("{}: this host mount shows no image there", dir.display()))),
        };
        let mut flags = 0;
        loop {
            let open = self.shared.tree().open_files(&name);
            if open == 0 {
                break;
            }
            match busy {
                Busy::Refuse => {
                    return Err(MountError::Refused(format!(
                        "{}: {open} file(s) of {name} are open or mapped: close them, or unmount with --wait or --lazy",
                        dir.display()
                    )))
                }
                Busy::Wait => std::thread::sleep(Duration::from_millis(50)),
                Busy::Detach => {
                    flags = libc::MNT_DETACH;
                    break;
                }
            }
        }
        unmount(&dir, flags)?;
        let bind = self.binds.lock().expect("poisoned").remove(&dir).expect("bound");
        let report = bind.served.report(&dir.display().to_string());
        let gone = self.shared.tree_mut().remove(&bind.name).is_some();
        if let (true, Some(copies)) = (gone, self.shared.copies()) {
            let tree = self.shared.tree();
            copies.retain(|id| tree.holds(id));
        }
        tracing::info!("{} unmounted from {}", bind.name, dir.display());
        self.removed.lock().expect("poisoned").insert(dir, report.clone());
        self.retire(bind);
        self.changed.notify_all();
        Ok(report)
    }

    /// Wait until `dir` is unmounted; what its image's mount did.
    pub fn wait(&self, dir: &Path) -> Result<Report, MountError> {
        let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
        let mut removed = self.removed.lock().expect("poisoned");
        loop {
            if let Some(r) = removed.get(&dir) {
                return Ok(r.clone());
            }
            if !self.binds.lock().expect("poisoned").contains_key(&dir) && !self.running() {
                return Err(MountError::Refused(format!("{}: not shown by this host mount", dir.display())));
            }
            removed = self.changed.wait_timeout(removed, Duration::from_millis(200)).expect("poisoned").0;
        }
    }

    /// The DIRs shown, their images and open files.
    pub fn status(&self) -> Vec<BindStatus> {
        let tree = self.shared.tree();
        self.binds
            .lock()
            .expect("poisoned")
            .iter()
            .map(|(d, b)| BindStatus { dir: d.clone(), name: b.name.clone(), reference: b.served.reference.clone(), open_files: tree.open_files(&b.name) })
            .collect()
    }

    /// Whether the daemon goes on: DIRs are shown, files are open (a DIR detached with
    /// files open), or none was added yet; and the host mount has not been unmounted under it.
    pub fn running(&self) -> bool {
        let session_alive = self.session.lock().expect("poisoned").as_ref().is_some_and(|s| !s.guard.is_finished());
        let in_use = !self.added_any.load(Relaxed) || !self.binds.lock().expect("poisoned").is_empty() || self.shared.open_handles() > 0;
        session_alive && in_use
    }

    /// Block until the daemon ends ([`Host::running`]), then unmount the host file system
    /// and remove the control socket.
    pub fn run(&self) {
        while self.running() {
            let g = self.binds.lock().expect("poisoned");
            drop(self.changed.wait_timeout(g, Duration::from_millis(200)).expect("poisoned"));
        }
        // The request that removed the last DIR (and any `wait` for it) gets its answer.
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.handling.load(Relaxed) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        self.stop();
    }

    /// Take no more images; unmount every DIR once its files are closed (each on a thread
    /// of its own). The daemon then ends.
    pub fn drain(self: &Arc<Self>) {
        self.draining.store(true, Relaxed);
        let dirs: Vec<PathBuf> = self.binds.lock().expect("poisoned").keys().cloned().collect();
        for d in dirs {
            let h = self.clone();
            let _ = std::thread::Builder::new().name("mount-drain".into()).spawn(move || {
                if let Err(e) = h.remove(&d, Busy::Wait) {
                    tracing::warn!("{e}");
                }
            });
        }
    }

    /// Detach every DIR and the host mount now: processes that still have files open or
    /// mapped get errors from then on (`ENOTCONN` once the daemon has gone).
    pub fn detach_all(&self) {
        self.draining.store(true, Relaxed);
        let dirs: Vec<PathBuf> = self.binds.lock().expect("poisoned").keys().cloned().collect();
        for d in dirs {
            let _ = self.remove(&d, Busy::Detach);
        }
        self.stop();
    }

    /// Let go of an unmounted DIR's image on a thread of its own: the last reference to
    /// it writes what is queued for the chunk cache, which the answer to `umount` does not
    /// wait for; the daemon does before it ends.
    fn retire(&self, bind: Bind) {
        let mut retiring = self.retiring.lock().expect("poisoned");
        retiring.retain(|h| !h.is_finished());
        match std::thread::Builder::new().name("mount-retire".into()).spawn(move || drop(bind)) {
            Ok(h) => retiring.push(h),
            Err(e) => tracing::debug!("no thread to let an image go ({e}): let go here"),
        }
    }

    fn stop(&self) {
        self.stop_fill.store(true, Relaxed);
        let _ = std::fs::remove_file(&self.socket);
        if let Some(s) = self.session.lock().expect("poisoned").take() {
            if let Err(e) = s.umount_and_join() {
                tracing::debug!("unmounting {}: {e}", self.opts.dir.display());
            }
        }
        for h in std::mem::take(&mut *self.retiring.lock().expect("poisoned")) {
            let _ = h.join();
        }
        self.shared.clear_copies();
        self.changed.notify_all();
    }

    /// Whether passthrough is on, or why not (`off: …`).
    pub fn passthrough(&self) -> String {
        self.shared.passthrough_state()
    }

    /// The fill of a newly presented image on a thread of its own, then the whole-file
    /// copies of its files complete in the chunk cache (with passthrough on).
    fn background(&self, served: Arc<Served>, prefetch: PrefetchMode, trace: Option<TraceLookup>) {
        let (stop, shared, name) = (self.stop_fill.clone(), self.shared.clone(), served.name.clone());
        if prefetch == PrefetchMode::None && shared.copies().is_none() {
            return;
        }
        let (image, who) = (served.chunks.image().clone(), name.clone());
        let served = Arc::downgrade(&served);
        let spawned = std::thread::Builder::new().name("mount-fill".into()).spawn(move || {
            let trace = trace.filter(|_| prefetch == PrefetchMode::Trace).and_then(|t| t());
            let (order, traced) = fill::order(&image, prefetch, trace.as_ref().map(|(f, t)| (*f, t)));
            if !order.is_empty() {
                tracing::info!("{who}: filling the chunk cache: {} chunks, {traced} of them first from its trace", order.len());
                fill::run(&served, &order, &stop);
                if let Some(s) = served.upgrade().filter(|_| !stop.load(Relaxed)) {
                    s.chunks.fill_done();
                    if let Some(b) = &s.base {
                        b.fill_done();
                    }
                }
            }
            if let Some(copies) = shared.copies() {
                copies::make_complete(&shared.tree, copies, &served, &stop);
            }
        });
        if let Err(e) = spawned {
            tracing::warn!("{name}: no fill and no whole-file copies (cannot start their thread: {e})");
        }
    }

    /// Accept control connections on a thread of their own, each request on its own thread.
    fn serve_control(self: &Arc<Self>, listener: UnixListener) -> Result<(), MountError> {
        let me = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("mount-control".into())
            .spawn(move || {
                for s in listener.incoming() {
                    let Some(host) = me.upgrade() else { return };
                    let Ok(s) = s else { continue };
                    if !control::admit(&s) {
                        continue;
                    }
                    host.handling.fetch_add(1, Relaxed);
                    let spawned = std::thread::Builder::new().name("mount-request".into()).spawn(move || {
                        let answer = match control::read_request(&s) {
                            Ok(r) => host.handle(r),
                            Err(e) => Response::failed(e),
                        };
                        control::answer(&s, &answer);
                        host.handling.fetch_sub(1, Relaxed);
                        host.changed.notify_all();
                    });
                    if let Err(e) = spawned {
                        tracing::warn!("a control request not served: {e}");
                    }
                }
            })
            .map_err(io_err("starting the control thread"))?;
        Ok(())
    }

    fn handle(&self, r: Request) -> Response {
        let ok =
            |name: Option<String>, report: Option<Report>| Response { ok: true, name, report, passthrough: Some(self.passthrough()), ..Response::default() };
        match r {
            Request::Add { reference, dir, prefetch } => {
                let mode = match prefetch.parse::<PrefetchMode>() {
                    Ok(m) => m,
                    Err(e) => return Response::failed(e),
                };
                match self.opener.open(&reference, mode).map_err(MountError::Refused).and_then(|o| self.add(o, &dir)) {
                    Ok(name) => ok(Some(name), None),
                    Err(e) => Response::failed(e),
                }
            }
            Request::Remove { dir, busy } => self.remove(&dir, busy).map_or_else(Response::failed, |r| ok(None, Some(r))),
            Request::Wait { dir } => self.wait(&dir).map_or_else(Response::failed, |r| ok(None, Some(r))),
            Request::Status => Response { ok: true, binds: self.status(), passthrough: Some(self.passthrough()), ..Response::default() },
        }
    }
}

/// The host's whole-file copies, in the chunk cache's directory (a killed daemon's swept
/// first), or why there are none and passthrough is off.
fn copies_for(mode: Passthrough, store: Option<&ChunkCache>) -> Result<copies::Copies, String> {
    let swept = store.map_or(0, |s| copies::sweep(s.root()));
    if swept > 0 {
        tracing::info!("removed the whole-file copies of {swept} host daemon(s) that are gone");
    }
    match (mode, store) {
        (Passthrough::Off, _) => Err("--passthrough off".into()),
        (Passthrough::Auto, None) => Err("no chunk cache (--no-cache): no file is ever complete".into()),
        (Passthrough::Auto, Some(s)) => copies::Copies::start(s.root()).map_err(|e| format!("no place for whole-file copies: {e}")),
    }
}

/// Let the kernel read ahead `bytes` at a time in the host mount: FUSE offers the daemon,
/// and keeps, the block layer's default (128 KiB), and a 1 MiB readahead is a
/// 1 MiB request per round trip to the daemon instead of eight.
fn raise_readahead(dir: &Path, bytes: u64) {
    use std::os::unix::fs::MetadataExt;
    let Ok(m) = std::fs::metadata(dir) else { return };
    let dev = m.dev();
    let path = format!("/sys/class/bdi/{}:{}/read_ahead_kb", libc::major(dev), libc::minor(dev));
    if bytes >= 4096 {
        if let Err(e) = std::fs::write(&path, format!("{}\n", bytes / 1024)) {
            tracing::debug!("{path}: {e}: readahead stays at the kernel's default");
        }
    }
}

/// A host mount left by a daemon that was killed answers `ENOTCONN`: detach it, so a new
/// daemon can mount there.
fn detach_dead(dir: &Path) {
    if let Err(e) = std::fs::metadata(dir) {
        if e.raw_os_error() == Some(libc::ENOTCONN) {
            tracing::info!("{}: detaching the mount a daemon that is gone left there", dir.display());
            let _ = unmount(dir, libc::MNT_DETACH);
        }
    }
}

fn cpath(p: &Path) -> Result<CString, MountError> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| MountError::Refused(format!("{}: a path with a NUL byte", p.display())))
}

/// Bind mount `from` onto `to`.
fn bind(from: &Path, to: &Path) -> Result<(), MountError> {
    let (f, t) = (cpath(from)?, cpath(to)?);
    // SAFETY: both are NUL-terminated paths; the other arguments may be null for MS_BIND.
    let rc = unsafe { libc::mount(f.as_ptr(), t.as_ptr(), std::ptr::null(), libc::MS_BIND, std::ptr::null()) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EPERM) {
            return Err(TargetError::NotPermitted.into());
        }
        return Err(MountError::Io { context: format!("bind-mounting {} onto {}", from.display(), to.display()), source: e });
    }
    Ok(())
}

/// `umount2(dir, flags)`.
pub fn unmount(dir: &Path, flags: libc::c_int) -> Result<(), MountError> {
    let d = cpath(dir)?;
    // SAFETY: a NUL-terminated path.
    if unsafe { libc::umount2(d.as_ptr(), flags) } != 0 {
        let e = std::io::Error::last_os_error();
        let hint = if e.raw_os_error() == Some(libc::EBUSY) { " (a process has its working directory there, or a mount below it)" } else { "" };
        return Err(MountError::Io { context: format!("unmounting {}{hint}", dir.display()), source: e });
    }
    Ok(())
}
