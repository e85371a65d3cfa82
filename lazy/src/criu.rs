//! `snapctl lazy --criu-workdir DIR`: the role of `criu lazy-pages` for
//! `criu restore --lazy-pages`, serving faults from the image's verified CRIU files.
//!
//! ```text
//! criu restore --connect--> DIR/lazy-pages.socket   (one connection per restore)
//!   per restored task:  int pid (4 bytes)  then  1 dummy byte + SCM_RIGHTS [uffd]
//!   per zombie:         int -pid           (no fd)
//!   restore done:       u32 0x52535446 "RSTF" (LAZY_PAGES_RESTORE_FINISHED)
//! per task: pagemap-<pid>.img (verified) -> regions of pages-<id>.img -> the fault loop
//!   fault in a present entry  -> chunk of pages-<id>.img -> verified -> UFFDIO_COPY
//!   fault anywhere else       -> UFFDIO_ZEROPAGE      (PE_PARENT ranges: UFFDIO_POISON)
//! after RSTF: push every remaining page (or poison it), then close that task's uffd;
//! the daemon exits when every task is done.
//! ```
//!
//! Protocol as read in CRIU's criu/uffd.c (see spec/lazy.md for the function names).

use std::collections::HashMap;
use std::io::IoSliceMut;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use imgfmt::{BlobSource, Image};
use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
use serde::Serialize;

use super::fault::{Conn, ForkHook};
use super::fetch::{ChunkStore, Fetcher};
use super::handshake::Region;
use super::install::{Installer, Outside, Pushed};
use super::map::MemoryMap;
use super::pagemap::{self, Pagemap, PAGE_SIZE};
use super::prefetch::Demand;
use super::stats::{ConnReport, Counters, End, Rec};
use super::{LazyError, LazyOptions};

/// The socket's name in the work directory (criu/uffd.c `LAZY_PAGES_SOCK_NAME`).
pub const LAZY_PAGES_SOCK_NAME: &str = "lazy-pages.socket";
/// Sent once every task is restored (criu/uffd.c `LAZY_PAGES_RESTORE_FINISHED`, "RSTF").
/// No pid can collide with it: pids are below 2^22 (`PID_MAX_LIMIT`).
pub const LAZY_PAGES_RESTORE_FINISHED: u32 = 0x5253_5446;

/// One message of `criu restore` on the lazy-pages socket.
#[derive(Debug)]
pub enum Message {
    /// A restored task and its userfaultfd.
    Task { pid: i32, uffd: OwnedFd },
    /// A zombie (CRIU sends `-pid` and no fd: it has no memory to serve).
    Zombie(i32),
    /// Every task is restored: push the rest, then exit.
    Finished,
}

/// Why the lazy-pages conversation failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum CriuProtoError {
    /// criu lazy-pages socket: {0}
    Io(std::io::Error),
    /// criu lazy-pages socket: closed after {0} of 4 bytes of a pid
    ShortPid(usize),
    /// criu lazy-pages socket: pid {0} was not followed by a userfaultfd (SCM_RIGHTS)
    NoFd(i32),
    /// criu lazy-pages socket: the daemon is stopping
    Stopped,
}

/// Reads messages off the restore's connection. Descriptors that arrive early (with the
/// pid's bytes) are kept for the next task.
pub struct Reader<'a> {
    stream: &'a UnixStream,
    fds: Vec<OwnedFd>,
    stop: &'a AtomicBool,
}

impl<'a> Reader<'a> {
    /// `stream` should have a short read timeout so `stop` is noticed.
    pub fn new(stream: &'a UnixStream, stop: &'a AtomicBool) -> Self {
        Reader { stream, fds: Vec::new(), stop }
    }

    /// Exactly `buf.len()` bytes (`Ok(n < len)` only at end of stream), collecting any
    /// descriptors that ride along.
    fn read_exact(&mut self, buf: &mut [u8]) -> Result<usize, CriuProtoError> {
        let mut got = 0;
        while got < buf.len() {
            if self.stop.load(Ordering::Relaxed) {
                return Err(CriuProtoError::Stopped);
            }
            let mut iov = [IoSliceMut::new(&mut buf[got..])];
            let mut space = nix::cmsg_space!([RawFd; 8]);
            let r = recvmsg::<()>(self.stream.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC);
            let msg = match r {
                Ok(m) => m,
                Err(nix::errno::Errno::EAGAIN) | Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(CriuProtoError::Io(e.into())),
            };
            let n = msg.bytes;
            for c in msg.cmsgs().map_err(|e| CriuProtoError::Io(e.into()))? {
                if let ControlMessageOwned::ScmRights(received) = c {
                    // SAFETY: the kernel just installed these descriptors for us; each is
                    // wrapped exactly once (and closed on drop).
                    self.fds.extend(received.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
                }
            }
            if n == 0 {
                return Ok(got);
            }
            got += n;
        }
        Ok(got)
    }

    /// The next message, or `None` at end of stream.
    pub fn next_message(&mut self) -> Result<Option<Message>, CriuProtoError> {
        let mut w = [0u8; 4];
        match self.read_exact(&mut w)? {
            0 => return Ok(None),
            4 => {}
            n => return Err(CriuProtoError::ShortPid(n)),
        }
        let v = i32::from_ne_bytes(w);
        if v as u32 == LAZY_PAGES_RESTORE_FINISHED {
            return Ok(Some(Message::Finished));
        }
        if v < 0 {
            return Ok(Some(Message::Zombie(v.checked_neg().unwrap_or(i32::MAX))));
        }
        // criu's send_fd: one dummy byte carrying SCM_RIGHTS.
        if self.fds.is_empty() {
            let mut b = [0u8; 1];
            if self.read_exact(&mut b)? == 0 {
                return Err(CriuProtoError::NoFd(v));
            }
        }
        if self.fds.is_empty() {
            return Err(CriuProtoError::NoFd(v));
        }
        Ok(Some(Message::Task { pid: v, uffd: self.fds.remove(0) }))
    }
}

/// What the daemon knows of one task's memory, from its pagemap.
#[derive(Debug, Clone)]
pub struct TaskLayout {
    pub pagemap_file: usize,
    pub pages_file: usize,
    pub regions: Vec<Region>,
    pub parent: Vec<(u64, u64)>,
    pub present_pages: u64,
    pub lazy_pages: u64,
    pub parent_pages: u64,
    pub zero_pages: u64,
}

/// The `--json` line for one task: the connection summary plus what the pagemap said.
#[derive(Debug, Clone, Serialize)]
pub struct CriuReport {
    #[serde(flatten)]
    pub conn: ConnReport,
    /// `pagemap-<pid>.img`.
    pub pagemap: String,
    /// `pages-<id>.img`, when the pagemap could be read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pages_file: Option<String>,
    pub present_pages: u64,
    pub lazy_pages: u64,
    pub parent_pages: u64,
    pub zero_pages: u64,
    /// Why this task could not be (fully) served; its faults there got poison, never
    /// made-up bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Set on the report of a child a restored task forked: that task's pid (`pid` is then
    /// the same, the child's own pid being unknown here).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<i32>,
}

impl CriuReport {
    /// The task's summary as one line for people (`pid N done (...): ...`).
    pub fn summary(&self) -> String {
        let c = &self.conn;
        format!(
            "pid {} done ({}): {} faults ({} zero, {} cache, {} fetched, {} present), {} fetched, {} pushed, latency p50 {}us p99 {}us, {} verify failures, {} pages poisoned{}",
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
            self.error.as_deref().map(|e| format!("; ERROR: {e}")).unwrap_or_default()
        )
    }
}

/// An error resolving or creating names beneath the work directory, its kind kept.
fn dest_err(e: puller::UnpackError) -> LazyError {
    match e {
        puller::UnpackError::Io { path, source } => LazyError::Io { context: path.display().to_string(), source },
        e => LazyError::Invalid(e.to_string()),
    }
}

/// What [`CriuDaemon::prepare_workdir`] wrote.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// Every file written, to remove when the restore is over.
    pub paths: Vec<PathBuf>,
    /// Bytes written (verified chunk data; holes not counted).
    pub bytes_written: u64,
    /// Bytes of lazy pages left as holes for this server to serve.
    pub lazy_bytes_left: u64,
    /// The same files as (directory, name): removed through the directory, never through
    /// a path that a symlink swapped in since could redirect.
    files: Vec<(std::sync::Arc<imgfmt::file::Dir>, std::ffi::OsString)>,
}

/// The CRIU lazy-pages server: one image, one restore.
pub struct CriuDaemon {
    image: Arc<Image>,
    src: Arc<dyn BlobSource>,
    store: Option<Arc<dyn ChunkStore>>,
    opts: LazyOptions,
    workdir: PathBuf,
    fetchers: Mutex<HashMap<usize, Arc<Fetcher>>>,
    forks: Mutex<Forks>,
    counters: Arc<Counters>,
    active: AtomicU64,
    total: AtomicU64,
    stop: Arc<AtomicBool>,
    /// Stop waiting for a restore to connect (one that has connected is served to its end).
    draining: AtomicBool,
}

/// A file of the image by name: exact, or the one file with that base name (an image
/// packed from a parent directory keeps the dump under a subdirectory).
fn find_file(image: &Image, name: &str) -> Option<usize> {
    if let Some((i, _)) = image.file(name) {
        return Some(i);
    }
    let hits: Vec<usize> = image.files.iter().enumerate().filter(|(_, f)| f.name.rsplit('/').next() == Some(name)).map(|(i, _)| i).collect();
    match hits.as_slice() {
        [i] => Some(*i),
        _ => None,
    }
}

struct Task {
    pid: i32,
    conn: Arc<Conn>,
    layout: Option<TaskLayout>,
    error: Option<String>,
    /// Our end of the pair the fault loop watches: dropping it ends the loop.
    end: Mutex<Option<UnixStream>>,
    counters: Arc<Counters>,
    t0: Instant,
    /// Why the task ended, when the pusher decided it.
    ended: Mutex<Option<End>>,
    /// The pid of the restored task this one is a forked child of (a child's own pid is
    /// not in the fork event).
    forked_from: Option<i32>,
}

impl Task {
    /// Record why the task ended and drop our end of its pair, which ends its fault loop
    /// (and so closes its userfaultfd).
    fn release(&self, why: End) {
        *self.ended.lock().expect("poisoned") = Some(why);
        self.end.lock().expect("poisoned").take();
    }
}

/// Children the restored tasks forked (UFFD_EVENT_FORK), followed like tasks: each gets a
/// fault loop, and a push once the restore has finished.
#[derive(Default)]
struct Forks {
    /// The restore sent its finish word: a child forked from now on is pushed at once.
    finished: bool,
    tasks: Vec<Arc<Task>>,
    loops: Vec<std::thread::JoinHandle<End>>,
    pushers: Vec<std::thread::JoinHandle<()>>,
}

impl CriuDaemon {
    /// `opts.socket` is ignored: the socket is `workdir/lazy-pages.socket`.
    pub fn new(image: Arc<Image>, src: Arc<dyn BlobSource>, store: Option<Arc<dyn ChunkStore>>, workdir: PathBuf, mut opts: LazyOptions) -> Arc<Self> {
        opts.socket = workdir.join(LAZY_PAGES_SOCK_NAME);
        Arc::new(CriuDaemon {
            image,
            src,
            store,
            opts,
            workdir,
            fetchers: Mutex::new(HashMap::new()),
            forks: Mutex::new(Forks::default()),
            counters: Arc::new(Counters::default()),
            active: AtomicU64::new(0),
            total: AtomicU64::new(0),
            stop: Arc::new(AtomicBool::new(false)),
            draining: AtomicBool::new(false),
        })
    }

    pub fn socket_path(&self) -> PathBuf {
        self.opts.socket.clone()
    }

    /// Ask `run` to return (tasks' fault loops end at their next poll; the tasks then read
    /// pages not yet installed as zeros: see [`CriuDaemon::drain`]).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// What SIGTERM does: if no restore has connected yet, stop waiting for one; a restore
    /// being served is served to its end.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Daemon-wide counters as Prometheus text.
    pub fn metrics_text(&self) -> String {
        super::stats::prometheus(&self.counters, self.active.load(Ordering::Relaxed), self.total.load(Ordering::Relaxed))
    }

    /// Serve `GET /metrics` on `addr` from a background thread; returns the bound address.
    pub fn serve_metrics(self: &Arc<Self>, addr: &str) -> Result<std::net::SocketAddr, LazyError> {
        super::serve_metrics(self, addr, Self::metrics_text)
    }

    /// One fetcher per file of the image, made on first use (each task's pages file).
    fn fetcher(&self, file: usize) -> Arc<Fetcher> {
        self.fetchers
            .lock()
            .expect("poisoned")
            .entry(file)
            .or_insert_with(|| Arc::new(Fetcher::new(self.image.clone(), file, self.src.clone(), self.store.clone(), self.opts.retry, self.opts.memory_bytes)))
            .clone()
    }

    /// The verified bytes of a whole (small) file of the image.
    fn read_file(&self, file: usize, limit: usize) -> Result<Vec<u8>, String> {
        let f = &self.image.files[file];
        if f.size > limit as u64 {
            return Err(format!("{} is {} bytes (at most {limit})", f.name, f.size));
        }
        let fetcher = self.fetcher(file);
        let mut out = Vec::with_capacity(f.size as usize);
        for (c, ch) in f.chunks.iter().enumerate() {
            if fetcher.is_zero(c as u64).map_err(|e| e.to_string())? {
                out.resize(out.len() + ch.len as usize, 0);
            } else {
                let (v, _, _) = fetcher.get(c as u64);
                out.extend_from_slice(v.map_err(|e| e.to_string())?.as_bytes());
            }
        }
        if out.len() as u64 != f.size {
            return Err(format!("{}: chunks hold {} bytes, the file {}", f.name, out.len(), f.size));
        }
        Ok(out)
    }

    /// Read and check the task's pagemap and find its pages file.
    pub fn layout(&self, pid: i32) -> Result<TaskLayout, String> {
        let name = format!("pagemap-{pid}.img");
        let pagemap_file = find_file(&self.image, &name).ok_or_else(|| format!("the image has no {name}"))?;
        let bytes = self.read_file(pagemap_file, pagemap::MAX_PAGEMAP_BYTES)?;
        let pm: Pagemap = pagemap::decode_pagemap(&bytes).map_err(|e| format!("{name}: {e}"))?;
        let pages_name = format!("pages-{}.img", pm.pages_id);
        let need = pm.pages_bytes();
        let pages_file = match find_file(&self.image, &pages_name) {
            Some(i) => i,
            // A pagemap with no present pages needs no pages file.
            None if need == 0 => pagemap_file,
            None => return Err(format!("{name} names {pages_name}, which the image does not have")),
        };
        let size = self.image.files[pages_file].size;
        if need > 0 && size < need {
            return Err(format!("{name} needs {need} bytes of {pages_name}, which has {size}"));
        }
        let regions: Vec<Region> = pm.runs().iter().map(|r| Region { base: r.vaddr, size: r.len, offset: r.offset, page_size: PAGE_SIZE }).collect();
        let pages = |f: fn(&pagemap::PagemapEntry) -> bool| pm.entries.iter().filter(|e| f(e)).map(|e| e.nr_pages as u64).sum::<u64>();
        Ok(TaskLayout {
            pagemap_file,
            pages_file,
            regions,
            parent: pm.parent_ranges(),
            present_pages: pages(|e| e.present()),
            lazy_pages: pages(|e| e.present() && e.lazy()),
            parent_pages: pages(|e| e.in_parent()),
            zero_pages: pages(|e| !e.present() && !e.in_parent()),
        })
    }

    /// Write the image's files into the work directory for `criu restore --lazy-pages`,
    /// leaving out exactly what this server will serve: in each `pages-<id>.img` the
    /// ranges of lazy pages (PE_LAZY in any pagemap naming that pages file) stay holes,
    /// every other byte is written from verified chunks. criu restore reads only the
    /// non-lazy pages itself, so the restore starts without the bulk of the memory ever
    /// being on this host. Each file is written under a temporary name and renamed when
    /// complete. Returns the paths written, for [`CriuDaemon::remove_prepared`]: the
    /// pages files are NOT the dump (their lazy pages read as zeros) and must not outlive
    /// the restore they were made for.
    pub fn prepare_workdir(&self) -> Result<Prepared, LazyError> {
        let mut lazy_runs: HashMap<String, Vec<(u64, u64)>> = HashMap::new();
        for (i, f) in self.image.files.iter().enumerate() {
            let base = f.name.rsplit('/').next().unwrap_or(&f.name);
            if !(base.starts_with("pagemap-") && base.ends_with(".img")) {
                continue;
            }
            let bytes = self.read_file(i, pagemap::MAX_PAGEMAP_BYTES).map_err(LazyError::Invalid)?;
            let pm = pagemap::decode_pagemap(&bytes).map_err(|e| LazyError::Invalid(format!("{}: {e}", f.name)))?;
            let runs = lazy_runs.entry(format!("pages-{}.img", pm.pages_id)).or_default();
            runs.extend(pm.runs().iter().filter(|r| r.lazy).map(|r| (r.offset, r.offset + r.len)));
        }
        // Every destination is checked before anything is written: the daemon never
        // overwrites a dump, and a refusal leaves the directory as it was. Names are
        // resolved beneath the work directory without following symlinks (a planted one
        // is refused, or counts as a file already there).
        let mut dirs = puller::DestDirs::create(&self.workdir).map_err(dest_err)?;
        let mut plan = Vec::with_capacity(self.image.files.len());
        for f in &self.image.files {
            let dest = self.workdir.join(&f.name);
            if dirs.exists(&f.name).map_err(dest_err)? {
                return Err(LazyError::Invalid(format!("{} already exists: --criu-prepare writes into a directory without the dump", dest.display())));
            }
            let base = f.name.rsplit('/').next().unwrap_or(&f.name);
            let mut skip = lazy_runs.remove(base).unwrap_or_default();
            skip.sort_unstable();
            plan.push((dest, skip));
        }
        let mut out = Prepared { paths: Vec::new(), bytes_written: 0, lazy_bytes_left: 0, files: Vec::new() };
        for (i, (dest, skip)) in plan.into_iter().enumerate() {
            let written = dirs.dir_of(&self.image.files[i].name, true).map_err(dest_err).and_then(|d| {
                let (dir, base) = d.expect("created");
                self.write_prepared(i, &dir, &base, &skip).map(|n| (n, dir, base))
            });
            match written {
                Ok((n, dir, base)) => {
                    out.bytes_written += n;
                    out.files.push((dir, base));
                }
                Err(e) => {
                    self.remove_prepared(&out);
                    return Err(e);
                }
            }
            out.lazy_bytes_left += skip.iter().map(|(a, b)| b - a).sum::<u64>();
            out.paths.push(dest);
        }
        Ok(out)
    }

    /// Write file `file` of the image as `base` in `dir` (via a temporary name created
    /// there, never opened through anything planted), leaving the sorted, non-overlapping
    /// byte ranges `skip` as holes; the bytes written.
    fn write_prepared(&self, file: usize, dir: &imgfmt::file::Dir, base: &std::ffi::OsStr, skip: &[(u64, u64)]) -> Result<u64, LazyError> {
        use std::os::unix::fs::{FileExt as _, PermissionsExt as _};
        let f = &self.image.files[file];
        let tmp_path = imgfmt::layout::tempname(dir.path(), &format!(".{}.snapctl-prepare", base.to_string_lossy()));
        let tmp = tmp_path.file_name().expect("temp name").to_os_string();
        let dest = dir.display_path(base);
        let out = dir.create_new(&tmp, 0o600).map_err(super::io_err(format!("creating {}", tmp_path.display())))?;
        let result = (|| {
            out.set_len(f.size).map_err(super::io_err(format!("sizing {}", tmp_path.display())))?;
            let fetcher = self.fetcher(file);
            let shift = self.image.chunk_shift();
            let mut written = 0u64;
            for (c, ch) in f.chunks.iter().enumerate() {
                let start = (c as u64) << shift;
                let end = start + ch.len as u64;
                // The parts of [start, end) not inside a skipped range.
                let mut keep = Vec::new();
                let mut at = start;
                for &(a, b) in skip.iter().filter(|(a, b)| *b > start && *a < end) {
                    if a > at {
                        keep.push((at, a.min(end)));
                    }
                    at = at.max(b);
                }
                if at < end {
                    keep.push((at, end));
                }
                if keep.is_empty() || fetcher.is_zero(c as u64).map_err(|e| LazyError::Invalid(format!("{}: {e}", f.name)))? {
                    continue;
                }
                let (v, _, _) = fetcher.get(c as u64);
                let chunk = v.map_err(|e| LazyError::Invalid(format!("{} chunk {c}: {e}", f.name)))?;
                let bytes = chunk.as_bytes();
                for (a, b) in keep {
                    out.write_all_at(&bytes[(a - start) as usize..(b - start) as usize], a)
                        .map_err(super::io_err(format!("writing {}", tmp_path.display())))?;
                    written += b - a;
                }
            }
            Ok(written)
        })();
        let result = result.and_then(|n| {
            out.set_permissions(std::fs::Permissions::from_mode(imgfmt::config::applied_mode(f.mode)))
                .map_err(super::io_err(format!("setting the mode of {}", tmp_path.display())))?;
            // Never over a file that appeared meanwhile (RENAME_NOREPLACE).
            dir.rename(&tmp, base, false).map_err(super::io_err(format!("renaming {} to {}", tmp_path.display(), dest.display())))?;
            Ok(n)
        });
        if result.is_err() {
            let _ = dir.remove_file(&tmp);
        }
        result
    }

    /// Remove what [`CriuDaemon::prepare_workdir`] wrote (the socket is removed by `run`).
    pub fn remove_prepared(&self, prepared: &Prepared) {
        for ((dir, name), p) in prepared.files.iter().zip(&prepared.paths) {
            if let Err(e) = dir.remove_file(name) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!("criu: could not remove {}: {e}", p.display());
                }
            }
        }
    }

    /// Bind `DIR/lazy-pages.socket`, serve one restore (every task it sends) and return
    /// once every task is done, or when stopped. `on_report` gets each task's summary.
    pub fn run(self: &Arc<Self>, on_report: Arc<dyn Fn(&CriuReport) + Send + Sync>) -> Result<(), LazyError> {
        let path = self.opts.socket.clone();
        if !self.workdir.is_dir() {
            return Err(LazyError::Invalid(format!("--criu-workdir {}: not a directory", self.workdir.display())));
        }
        let (listener, cleanup) = super::listen(&path, self.opts.ready_file.as_deref(), "lazy-pages server", "criu lazy-pages: ")?;
        // Like criu lazy-pages: one restore connects; the socket goes when it has.
        let stream = loop {
            if self.stop.load(Ordering::Relaxed) || self.draining.load(Ordering::Relaxed) {
                return Ok(());
            }
            match listener.accept() {
                Ok((s, _)) if !super::admit(&s, &self.opts) => drop(s),
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => super::wait_for_connection(&listener),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(LazyError::Io { context: "accepting the restore's connection".into(), source: e }),
            }
        };
        drop(listener);
        drop(cleanup);
        if self.session(stream, on_report.as_ref()) || self.stop.load(Ordering::Relaxed) {
            Ok(())
        } else {
            Err(LazyError::Invalid("criu restore closed the lazy-pages connection (or broke the protocol) before it finished".into()))
        }
    }

    /// Serve one restore; whether it got to the finish word.
    fn session(self: &Arc<Self>, stream: UnixStream, on_report: &(dyn Fn(&CriuReport) + Send + Sync)) -> bool {
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
        let mut tasks: Vec<Arc<Task>> = Vec::new();
        let mut loops: Vec<std::thread::JoinHandle<End>> = Vec::new();
        let mut reader = Reader::new(&stream, &self.stop);
        let finished = loop {
            match reader.next_message() {
                Ok(Some(Message::Task { pid, uffd })) => {
                    let (task, h) = self.start_task(pid, uffd);
                    tasks.push(task);
                    loops.push(h);
                }
                Ok(Some(Message::Zombie(pid))) => tracing::warn!("criu: pid {pid} is a zombie: no memory to serve"),
                Ok(Some(Message::Finished)) => break true,
                Ok(None) => {
                    tracing::error!("criu: the restore closed the connection before it finished; releasing its tasks");
                    break false;
                }
                Err(CriuProtoError::Stopped) => break false,
                Err(e) => {
                    tracing::error!("criu: {e}; releasing the restore's tasks");
                    break false;
                }
            }
        };
        drop(reader);
        // Children forked before the finish word are pushed with the tasks; later ones by
        // the fork hook itself.
        let early_children: Vec<Arc<Task>> = {
            let mut f = self.forks.lock().expect("poisoned");
            f.finished = finished;
            f.tasks.clone()
        };
        let mut pushers = Vec::new();
        for t in tasks.iter().chain(early_children.iter()) {
            if !finished {
                t.release(End::RestoreFailed);
                continue;
            }
            pushers.push(self.spawn_push(t));
        }
        if finished {
            tracing::info!("criu: restore finished ({} task(s)); pushing the remaining pages", tasks.len());
        }
        for (t, h) in tasks.iter().zip(loops) {
            let ended = h.join().unwrap_or_else(|_| End::Failed("fault loop panicked".into()));
            self.report(t, ended, on_report);
        }
        for p in pushers.into_iter().flatten() {
            let _ = p.join();
        }
        // Then every forked child (and its children, as they appear) until none is left.
        let mut reported = 0;
        loop {
            let (children, loops, pushers) = {
                let mut f = self.forks.lock().expect("poisoned");
                (f.tasks[reported..].to_vec(), std::mem::take(&mut f.loops), std::mem::take(&mut f.pushers))
            };
            if children.is_empty() && loops.is_empty() && pushers.is_empty() {
                break;
            }
            if !finished {
                for t in &children {
                    t.release(End::RestoreFailed);
                }
            }
            for p in pushers {
                let _ = p.join();
            }
            for (t, h) in children.iter().zip(loops) {
                let ended = h.join().unwrap_or_else(|_| End::Failed("fault loop panicked".into()));
                self.report(t, ended, on_report);
            }
            reported += children.len();
        }
        drop(stream);
        finished
    }

    /// The `--json` report of a task whose fault loop ended.
    fn report(&self, t: &Task, ended: End, on_report: &(dyn Fn(&CriuReport) + Send + Sync)) {
        t.conn.inst.set_gone();
        self.active.fetch_sub(1, Ordering::Relaxed);
        let ended = t.ended.lock().expect("poisoned").take().unwrap_or(ended);
        let conn = ConnReport::from_counters(t.pid, &t.counters, t.t0.elapsed().as_secs_f64(), ended);
        let l = t.layout.as_ref();
        let report = CriuReport {
            conn,
            pagemap: l.map(|l| self.image.files[l.pagemap_file].name.clone()).unwrap_or_else(|| format!("pagemap-{}.img", t.pid)),
            pages_file: l.filter(|l| !l.regions.is_empty()).map(|l| self.image.files[l.pages_file].name.clone()),
            present_pages: l.map_or(0, |l| l.present_pages),
            lazy_pages: l.map_or(0, |l| l.lazy_pages),
            parent_pages: l.map_or(0, |l| l.parent_pages),
            zero_pages: l.map_or(0, |l| l.zero_pages),
            error: t.error.clone(),
            forked_from: t.forked_from,
        };
        on_report(&report);
    }

    /// The hook that follows a fork of a task with this layout.
    fn fork_hook(self: &Arc<Self>, layout: Option<TaskLayout>) -> ForkHook {
        let me = Arc::downgrade(self);
        Box::new(move |parent: &Conn, uffd: userfaultfd::Uffd| match me.upgrade() {
            Some(d) => d.start_child(parent, uffd, layout.clone()),
            None => drop(uffd),
        })
    }

    /// Follow a child `parent`'s process forked: its own fault loop on the child's
    /// userfaultfd, serving the same pages; pushed like a task once the restore finished.
    fn start_child(self: &Arc<Self>, parent: &Conn, uffd: userfaultfd::Uffd, layout: Option<TaskLayout>) {
        let counters = Arc::new(Counters::default());
        let conn = parent.child(uffd, counters.clone());
        tracing::info!("criu: pid {} forked a child: serving its memory too", parent.pid());
        let (task, h) = self.launch(conn, counters, layout, None, Instant::now(), Some(parent.pid()));
        let mut f = self.forks.lock().expect("poisoned");
        if f.finished {
            if let Ok(p) = self.spawn_push(&task) {
                f.pushers.push(p);
            }
        }
        f.tasks.push(task);
        f.loops.push(h);
    }

    /// Give `conn` the fork hook and its own fault loop thread: the task, and that loop's
    /// handle (its result is why the loop ended).
    fn launch(
        self: &Arc<Self>,
        mut conn: Conn,
        counters: Arc<Counters>,
        layout: Option<TaskLayout>,
        error: Option<String>,
        t0: Instant,
        forked_from: Option<i32>,
    ) -> (Arc<Task>, std::thread::JoinHandle<End>) {
        let pid = conn.pid();
        conn.on_fork = Some(self.fork_hook(layout.clone()));
        let conn = Arc::new(conn);
        let (ours, theirs) = match UnixStream::pair() {
            Ok(p) => (Some(p.0), Some(p.1)),
            Err(e) => {
                tracing::warn!("criu: pid {pid}: socketpair: {e}");
                (None, None)
            }
        };
        let task = Arc::new(Task { pid, conn: conn.clone(), layout, error, end: Mutex::new(ours), counters, t0, ended: Mutex::new(None), forked_from });
        self.active.fetch_add(1, Ordering::Relaxed);
        self.total.fetch_add(1, Ordering::Relaxed);
        let stop = self.stop.clone();
        let name = if forked_from.is_some() { "lazy-criu-child" } else { "lazy-criu-task" };
        let h = std::thread::Builder::new().name(name.into()).spawn(move || match theirs {
            Some(s) => conn.run(s, &stop),
            None => End::Failed("no socketpair".into()),
        });
        let h = h.unwrap_or_else(|e| std::thread::spawn(move || End::Failed(format!("spawning the fault loop: {e}"))));
        (task, h)
    }

    /// Push the rest of `t`'s pages from a thread of its own.
    fn spawn_push(self: &Arc<Self>, t: &Arc<Task>) -> std::io::Result<std::thread::JoinHandle<()>> {
        let (t, me) = (t.clone(), self.clone());
        std::thread::Builder::new().name("lazy-criu-push".into()).spawn(move || me.push(&t))
    }

    /// Set up a task's fault loop. A task whose pagemap cannot be used still gets one, that
    /// poisons every fault: closing its userfaultfd would let the kernel zero-fill memory
    /// that has content.
    fn start_task(self: &Arc<Self>, pid: i32, uffd: OwnedFd) -> (Arc<Task>, std::thread::JoinHandle<End>) {
        let t0 = Instant::now();
        let (layout, mut error) = match self.layout(pid) {
            Ok(l) => (Some(l), None),
            Err(e) => {
                tracing::error!("criu: pid {pid}: {e}; every fault of this task gets poison (SIGBUS)");
                (None, Some(e))
            }
        };
        if let Some(l) = &layout {
            tracing::info!(
                "criu: pid {pid}: {} present pages ({} lazy) in {} run(s) of {}, {} zero, {} in a parent dump",
                l.present_pages,
                l.lazy_pages,
                l.regions.len(),
                self.image.files[l.pages_file].name,
                l.zero_pages,
                l.parent_pages
            );
            if l.parent_pages > 0 {
                let e = format!(
                    "{} pages are in a parent dump (PE_PARENT, --prev-images-dir), which snapctl lazy does not read: they are poisoned",
                    l.parent_pages
                );
                tracing::error!("criu: pid {pid}: {e}");
                error = Some(e);
            }
        }
        // The fault loop reads without blocking; CRIU opens the uffd O_NONBLOCK already.
        if let Err(e) = nix::fcntl::fcntl(&uffd, nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK)) {
            tracing::warn!("criu: pid {pid}: userfaultfd: {e}");
        }
        // SAFETY: received over SCM_RIGHTS and owned by nobody else; `Uffd` closes it.
        let uffd = unsafe { userfaultfd::Uffd::from_raw_fd(uffd.into_raw_fd()) };
        let (file, regions, outside) = match &layout {
            Some(l) => (l.pages_file, l.regions.clone(), Outside { zero: true, poison: l.parent.clone(), count: true }),
            None => (0, Vec::new(), Outside { zero: false, poison: Vec::new(), count: true }),
        };
        let fetcher = self.fetcher(file);
        let map = MemoryMap { regions, file_size: self.image.files[file].size, chunk_shift: self.image.chunk_shift() };
        let counters = Arc::new(Counters::default());
        let mut inst = Installer::new(pid, uffd, map, fetcher, Rec(counters.clone(), self.counters.clone()), false);
        inst.outside = outside;
        let started = Instant::now();
        let mut conn = Conn::new(Arc::new(inst), Arc::new(Demand::new(started, None)), Arc::default(), started);
        conn.slice_faults = self.opts.slice_faults;
        self.launch(conn, counters, layout, error, t0, None)
    }

    /// After the restore finished: install every page the task has not faulted yet (or
    /// poison it), then end its fault loop, which closes the userfaultfd. Only then is it
    /// safe to close: from there on the kernel zero-fills missing pages.
    fn push(&self, t: &Task) {
        let Some(layout) = &t.layout else {
            // Nothing known about this task's memory: keep poisoning its faults until the
            // daemon is stopped.
            return;
        };
        let (conn, inst) = (&t.conn, &t.conn.inst);
        let rate = self.opts.prefetch_rate;
        let t0 = Instant::now();
        let mut bytes = 0u64;
        let mut outcome = End::AllInstalled;
        let settle = |f: &dyn Fn() -> Pushed| -> Pushed {
            loop {
                if self.stop.load(Ordering::Relaxed) {
                    return Pushed::Gone;
                }
                match f() {
                    // The fault thread applies the pending remove; try again shortly.
                    Pushed::Again => std::thread::sleep(Duration::from_millis(1)),
                    p => return p,
                }
            }
        };
        let mut stuck = false;
        'push: for (i, r) in inst.map.regions.iter().enumerate() {
            let us = inst.map.unit_size(i);
            for unit in r.offset / us..=(r.offset + r.size - 1) / us {
                let Some(span) = inst.map.span(i, unit) else { continue };
                // Faults waiting for fetches come first.
                while conn.demand.parked_faults() > 0 && !self.stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                match settle(&|| inst.push_span(&span)) {
                    Pushed::Done => {}
                    Pushed::Gone => {
                        outcome = End::TaskGone;
                        break 'push;
                    }
                    Pushed::Stuck => stuck = true,
                    Pushed::Again => unreachable!("settled"),
                }
                bytes += span.len;
                if rate > 0 {
                    let due = Duration::from_secs_f64(bytes as f64 / rate as f64);
                    if let Some(wait) = due.checked_sub(t0.elapsed()) {
                        std::thread::sleep(wait.min(Duration::from_millis(500)));
                    }
                }
            }
        }
        for &(a, b) in &layout.parent {
            match settle(&|| inst.poison_range(a, b)) {
                Pushed::Stuck => stuck = true,
                Pushed::Gone => break,
                _ => {}
            }
        }
        if stuck && !self.stop.load(Ordering::Relaxed) {
            // Closing now would let the kernel zero-fill what we could neither install nor
            // poison: keep serving faults until the daemon is stopped.
            tracing::error!("criu: pid {}: some pages could be neither installed nor poisoned; serving faults until stopped", t.pid);
            return;
        }
        tracing::info!("criu: pid {}: {outcome}; releasing its userfaultfd", t.pid);
        t.release(outcome);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::socket::{sendmsg, ControlMessage};
    use std::io::{IoSlice, Write};

    fn send_task(s: &UnixStream, pid: i32, fd: RawFd) {
        (&*s).write_all(&pid.to_ne_bytes()).unwrap();
        let fds = [fd];
        sendmsg::<()>(s.as_raw_fd(), &[IoSlice::new(&[0])], &[ControlMessage::ScmRights(&fds)], MsgFlags::empty(), None).unwrap();
    }

    #[test]
    fn reads_tasks_zombies_and_finish_as_criu_sends_them() {
        let (a, b) = UnixStream::pair().unwrap();
        a.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let f1 = tempfile::tempfile().unwrap();
        let f2 = tempfile::tempfile().unwrap();
        send_task(&b, 41, f1.as_raw_fd());
        (&b).write_all(&(-42i32).to_ne_bytes()).unwrap();
        send_task(&b, 43, f2.as_raw_fd());
        (&b).write_all(&LAZY_PAGES_RESTORE_FINISHED.to_ne_bytes()).unwrap();
        drop(b);
        let stop = AtomicBool::new(false);
        let mut r = Reader::new(&a, &stop);
        assert!(matches!(r.next_message().unwrap(), Some(Message::Task { pid: 41, .. })));
        assert!(matches!(r.next_message().unwrap(), Some(Message::Zombie(42))));
        assert!(matches!(r.next_message().unwrap(), Some(Message::Task { pid: 43, .. })));
        assert!(matches!(r.next_message().unwrap(), Some(Message::Finished)));
        assert!(r.next_message().unwrap().is_none());
    }

    #[test]
    fn a_pid_without_fd_or_a_short_pid_is_an_error() {
        let (a, b) = UnixStream::pair().unwrap();
        a.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        (&b).write_all(&7i32.to_ne_bytes()).unwrap();
        (&b).write_all(&[0]).unwrap();
        drop(b);
        let stop = AtomicBool::new(false);
        assert!(matches!(Reader::new(&a, &stop).next_message(), Err(CriuProtoError::NoFd(7))));
        let (a, b) = UnixStream::pair().unwrap();
        (&b).write_all(&[1, 2]).unwrap();
        drop(b);
        assert!(matches!(Reader::new(&a, &stop).next_message(), Err(CriuProtoError::ShortPid(2))));
        // A stop request ends a wait for the next message.
        let (a, _b) = UnixStream::pair().unwrap();
        a.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        stop.store(true, Ordering::Relaxed);
        assert!(matches!(Reader::new(&a, &stop).next_message(), Err(CriuProtoError::Stopped)));
    }

    /// `files` written into `dir/dump` and packed (64 KiB chunks) into `dir/layout`: the
    /// image and the layout.
    fn packed_dump(dir: &std::path::Path, files: &[(&str, &[u8])]) -> (Arc<Image>, Arc<imgfmt::OciLayout>) {
        let src = dir.join("dump");
        std::fs::create_dir_all(&src).unwrap();
        for (name, bytes) in files {
            std::fs::create_dir_all(src.join(name).parent().unwrap()).unwrap();
            std::fs::write(src.join(name), bytes).unwrap();
        }
        let layout = imgfmt::OciLayout::open_or_create(dir.join("layout")).unwrap();
        let opts = pusher::PackOptions { chunk_shift: 16, ..Default::default() };
        pusher::pack(&src, &layout, "t", &opts).unwrap();
        let image = Arc::new(Image::open(&layout, &layout.resolve_tag("t").unwrap()).unwrap());
        (image, Arc::new(layout))
    }

    /// A CRIU dump packed into an image: the layout of a task comes out of its verified
    /// pagemap; a missing pagemap or pages file is a clear error.
    #[test]
    fn task_layout_from_a_packed_dump() {
        use pagemap::{encode_pagemap, PagemapEntry, PE_LAZY, PE_PARENT, PE_PRESENT};
        let dir = tempfile::tempdir().unwrap();
        let pm = Pagemap {
            pages_id: 2,
            entries: vec![
                PagemapEntry { vaddr: 0x7e00_0000_0000, nr_pages: 16, flags: PE_PRESENT | PE_LAZY },
                PagemapEntry { vaddr: 0x7e00_0001_0000, nr_pages: 4, flags: 0 },
                PagemapEntry { vaddr: 0x7e00_0010_0000, nr_pages: 8, flags: PE_PRESENT },
                PagemapEntry { vaddr: 0x7e00_0020_0000, nr_pages: 2, flags: PE_PARENT },
            ],
        };
        let mut short = pm.clone();
        short.pages_id = 3;
        let (image, layout) = packed_dump(
            dir.path(),
            &[
                ("pagemap-5.img", &encode_pagemap(&pm)),
                ("pages-2.img", &[7u8; 24 * 4096]),
                ("pagemap-6.img", &encode_pagemap(&short)),
                ("pages-3.img", &[7u8; 4096]),
                ("pagemap-8.img", b"not a pagemap"),
            ],
        );
        assert_eq!(image.config().kind, imgfmt::Kind::Criu);
        let d = CriuDaemon::new(image.clone(), layout, None, dir.path().to_path_buf(), LazyOptions::new(PathBuf::new()));
        let l = d.layout(5).unwrap();
        assert_eq!(image.files[l.pages_file].name, "pages-2.img");
        assert_eq!(
            l.regions,
            vec![
                Region { base: 0x7e00_0000_0000, size: 16 * 4096, offset: 0, page_size: 4096 },
                Region { base: 0x7e00_0010_0000, size: 8 * 4096, offset: 16 * 4096, page_size: 4096 },
            ]
        );
        assert_eq!((l.present_pages, l.lazy_pages, l.zero_pages, l.parent_pages), (24, 16, 4, 2));
        assert_eq!(l.parent, vec![(0x7e00_0020_0000, 0x7e00_0020_2000)]);
        assert!(d.layout(6).unwrap_err().contains("needs 98304 bytes of pages-3.img, which has 4096"));
        assert!(d.layout(7).unwrap_err().contains("no pagemap-7.img"));
        assert!(d.layout(8).unwrap_err().contains("magic"));
    }

    /// Issue 14 §1: `--criu-prepare` writes only beneath the work directory. A symlink
    /// planted under the temp name it used to use (`.<name>.snapctl-prepare-<pid>`) does
    /// not carry the dump's bytes into its target, and a subdirectory that is a symlink
    /// is refused before anything is written.
    #[test]
    fn regression_issue_14_prepare_never_writes_through_planted_symlinks() {
        use std::os::unix::fs::symlink;
        let dir = tempfile::tempdir().unwrap();
        let (image, layout) = packed_dump(dir.path(), &[("core-5.img", b"core of task 5"), ("sub/inventory.img", b"inventory")]);
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();

        let work = dir.path().join("work");
        std::fs::create_dir_all(&work).unwrap();
        symlink(&victim, work.join(format!(".core-5.img.snapctl-prepare-{}", std::process::id()))).unwrap();
        let d = CriuDaemon::new(image.clone(), layout.clone(), None, work.clone(), LazyOptions::new(PathBuf::new()));
        let p = d.prepare_workdir().unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious", "the victim was written through a planted symlink");
        assert!(std::fs::symlink_metadata(work.join("core-5.img")).unwrap().is_file());
        assert_eq!(std::fs::read(work.join("core-5.img")).unwrap(), b"core of task 5");
        d.remove_prepared(&p);

        let work2 = dir.path().join("work2");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(&work2).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        symlink(&outside, work2.join("sub")).unwrap();
        let d = CriuDaemon::new(image, layout, None, work2.clone(), LazyOptions::new(PathBuf::new()));
        let e = d.prepare_workdir().unwrap_err().to_string();
        assert!(e.contains("symlink"), "{e}");
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0, "written outside the work directory");
        assert!(!work2.join("core-5.img").exists(), "a refusal writes nothing");
    }

    /// `--criu-prepare`: every file of the image is written, except that the pages file has
    /// its lazy pages as holes (zeros) and its non-lazy pages from the image; nothing is
    /// overwritten, a refusal writes nothing, and `remove_prepared` takes it all away.
    #[test]
    fn prepare_workdir_leaves_exactly_the_lazy_pages_out() {
        use pagemap::{encode_pagemap, PagemapEntry, PE_LAZY, PE_PRESENT};
        let dir = tempfile::tempdir().unwrap();
        let pm = Pagemap {
            pages_id: 2,
            entries: vec![
                PagemapEntry { vaddr: 0x7e00_0000_0000, nr_pages: 3, flags: PE_PRESENT },
                PagemapEntry { vaddr: 0x7e00_0000_3000, nr_pages: 16, flags: PE_PRESENT | PE_LAZY },
                PagemapEntry { vaddr: 0x7e00_0010_0000, nr_pages: 8, flags: PE_PRESENT },
            ],
        };
        let pages: Vec<u8> = (0..27 * 4096u32).map(|i| (i / 4096 + 1) as u8 ^ (i as u8)).collect();
        let pagemap_bytes = encode_pagemap(&pm);
        let (image, layout) = packed_dump(dir.path(), &[("pagemap-5.img", &pagemap_bytes), ("pages-2.img", &pages), ("core-5.img", b"core of task 5")]);

        let work = dir.path().join("work");
        std::fs::create_dir_all(&work).unwrap();
        let d = CriuDaemon::new(image.clone(), layout.clone(), None, work.clone(), LazyOptions::new(PathBuf::new()));
        let p = d.prepare_workdir().unwrap();
        assert_eq!(p.paths.len(), 3);
        assert_eq!(p.lazy_bytes_left, 16 * 4096);
        assert_eq!(p.bytes_written, (3 + 8) * 4096 + 14 + pagemap_bytes.len() as u64);
        assert_eq!(std::fs::read(work.join("core-5.img")).unwrap(), b"core of task 5");
        assert_eq!(std::fs::read(work.join("pagemap-5.img")).unwrap(), pagemap_bytes);
        let got = std::fs::read(work.join("pages-2.img")).unwrap();
        assert_eq!(got.len(), pages.len());
        assert_eq!(got[..3 * 4096], pages[..3 * 4096], "non-lazy pages before the lazy run");
        assert!(got[3 * 4096..19 * 4096].iter().all(|&b| b == 0), "lazy pages must be holes");
        assert_eq!(got[19 * 4096..], pages[19 * 4096..], "non-lazy pages after the lazy run");
        let names: Vec<String> = std::fs::read_dir(&work).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert!(names.iter().all(|n| !n.starts_with('.')), "temporary files left: {names:?}");

        // A second prepare into the same directory refuses, and writes nothing.
        assert!(d.prepare_workdir().unwrap_err().to_string().contains("already exists"));
        d.remove_prepared(&p);
        assert_eq!(std::fs::read_dir(&work).unwrap().count(), 0);

        // A directory holding one of the dump's files: refused before anything is written.
        std::fs::write(work.join("pages-2.img"), b"keep me").unwrap();
        assert!(d.prepare_workdir().is_err());
        assert_eq!(std::fs::read(work.join("pages-2.img")).unwrap(), b"keep me");
        assert_eq!(std::fs::read_dir(&work).unwrap().count(), 1);
    }
}
