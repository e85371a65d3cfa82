//! The kernel's side: FUSE requests answered from the [`Tree`] and [`crate::read`].
//!
//! Read-only (opens for writing get `EROFS`); every open served here keeps the page cache
//! (`FOPEN_KEEP_CACHE`: files are immutable, so what one process read or mapped serves
//! the next); reads are answered at full length (short only at the end of the file) or
//! with `EIO` when a chunk under them has no verified bytes; the kernel is asked for reads
//! and readahead of up to 1 MiB.
//!
//! ```text
//! open(ino): passthrough on, the file's whole-file copy ready, no open of it cached
//!              -> the kernel reads the copy (FOPEN_PASSTHROUGH, one backing file per
//!                 inode while it has such opens); the daemon sees no read of it
//!            else (or the kernel refuses the copy) -> cached: reads come here
//! ```
//!
//! The kernel refuses an open of either mode while the inode has an open of the other
//! (`EIO` to the process), so each inode counts its opens of each mode, and an open is
//! cached while any cached open of its inode lasts.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};

use fuser::{
    BackingId, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags, KernelConfig, OpenAccMode, OpenFlags, ReplyAttr,
    ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, Request,
};

use crate::chunks::Need;
use crate::copies::Copies;
use crate::tree::{Attr, Content, ContentId, Ino, Tree, ROOT};
use crate::Served;

/// Largest read and readahead asked of the kernel (it may allow less: `max_pages_limit`).
pub const MAX_READ: u32 = 1 << 20;
/// How long the kernel keeps names and attributes inside an image (they never change).
const IMAGE_TTL: Duration = Duration::from_secs(3600);
/// How long it keeps the root's names and attributes (images come and go).
const ROOT_TTL: Duration = Duration::from_secs(1);

/// An open file.
struct Handle {
    ino: Ino,
    served: Arc<Served>,
    content: Content,
    size: u64,
    /// Opened through FUSE passthrough (the kernel reads the copy; no read comes here).
    passthrough: bool,
}

/// One inode's opens by mode: the kernel takes them one mode at a time.
#[derive(Default)]
struct InodeOpens {
    cached: u64,
    passthrough: u64,
    /// The copy, registered with the kernel, while `passthrough` > 0: every passthrough
    /// open of the inode names this one.
    backing: Option<Arc<BackingId>>,
}

/// What the file system and the control side share.
pub struct Shared {
    pub tree: RwLock<Tree>,
    handles: Mutex<HashMap<u64, Handle>>,
    next_fh: AtomicU64,
    /// Owner of every node (the daemon's user).
    uid: u32,
    gid: u32,
    /// Requests answered so far (`statfs` included): the mount is alive.
    pub requests: AtomicU64,
    /// Largest read the kernel agreed to.
    pub max_read: AtomicU64,
    /// Whole-file copies, or why there are none (passthrough off).
    copies: Result<Copies, String>,
    /// Whether complete files are opened through passthrough, or why not: decided at the
    /// FUSE init.
    passthrough: OnceLock<Result<(), String>>,
    opens: Mutex<HashMap<Ino, InodeOpens>>,
    /// A backing open the kernel refused was logged (later ones are counted only).
    refusal_logged: AtomicBool,
}

impl Shared {
    /// `copies`: the host's whole-file copies, or why passthrough is off.
    pub fn new(copies: Result<Copies, String>) -> Arc<Shared> {
        // SAFETY: getuid and getgid have no preconditions.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        Arc::new(Shared {
            tree: RwLock::new(Tree::default()),
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            uid,
            gid,
            requests: AtomicU64::new(0),
            max_read: AtomicU64::new(0),
            copies,
            passthrough: OnceLock::new(),
            opens: Mutex::new(HashMap::new()),
            refusal_logged: AtomicBool::new(false),
        })
    }

    /// The copies to make and open, while passthrough is on.
    pub fn copies(&self) -> Option<&Copies> {
        self.passthrough.get().and_then(|p| p.as_ref().ok()).and(self.copies.as_ref().ok())
    }

    /// `on`, or `off: why` (decided at the FUSE init, the kernel's first request).
    pub fn passthrough_state(&self) -> String {
        match self.passthrough.get() {
            Some(Ok(())) => "on".into(),
            Some(Err(why)) => format!("off: {why}"),
            None => "not decided yet (the kernel has not started the mount)".into(),
        }
    }

    /// Remove every whole-file copy (the daemon ends).
    pub fn clear_copies(&self) {
        if let Ok(c) = &self.copies {
            c.clear();
        }
    }

    /// Decide at init whether opens may go through passthrough, and ask the kernel for it.
    fn init_passthrough(&self, config: &mut KernelConfig) {
        let state = match &self.copies {
            Err(why) => Err(why.clone()),
            Ok(c) => match config.add_capabilities(InitFlags::FUSE_PASSTHROUGH) {
                // Depth 1: the copies are on a plain file system, and the host mount may
                // itself be a layer of an overlay.
                Ok(()) => config.set_max_stack_depth(1).map(|_| ()).map_err(|max| format!("the kernel takes a stack depth of {max} at most")),
                Err(_) => Err("the kernel does not offer FUSE passthrough (Linux 6.9 or later, built with CONFIG_FUSE_PASSTHROUGH)".into()),
            }
            .inspect(|_| {
                tracing::info!(
                    "passthrough on: a file complete in the chunk cache is copied whole to {} and its later opens are read by the kernel from there",
                    c.path().display()
                )
            }),
        };
        if let Err(why) = &state {
            tracing::info!("passthrough off ({why}): every read goes through the daemon");
        }
        let _ = self.passthrough.set(state);
    }

    /// How an open of file `ino` (content `id`) is served: `Some(backing)` through
    /// passthrough (its copy ready, no cached open of the inode; a backing open the kernel
    /// refuses falls back, counted and logged), else cached. Counted in the inode's opens.
    fn open_mode(&self, ino: Ino, id: Option<&ContentId>, reply: &ReplyOpen, served: &Served) -> Option<Arc<BackingId>> {
        let mut opens = self.opens.lock().expect("poisoned");
        let o = opens.entry(ino).or_default();
        if o.cached == 0 {
            if let Some(b) = &o.backing {
                o.passthrough += 1;
                return Some(b.clone());
            }
            if let Some(file) = self.copies().zip(id).and_then(|(c, id)| c.open(id)) {
                match reply.open_backing(&file) {
                    Ok(b) => {
                        let b = Arc::new(b);
                        o.backing = Some(b.clone());
                        o.passthrough += 1;
                        return Some(b);
                    }
                    Err(e) => {
                        served.counters.passthrough_refused.fetch_add(1, Relaxed);
                        if !self.refusal_logged.swap(true, Relaxed) {
                            tracing::warn!("{}: the kernel refused a whole-file copy as a backing file ({e}): such opens go through the daemon (counted in passthrough_refused)", served.name);
                        }
                    }
                }
            }
        }
        o.cached += 1;
        None
    }

    /// A release of an open of `ino` in the mode it was opened in.
    fn closed(&self, ino: Ino, passthrough: bool) {
        let mut opens = self.opens.lock().expect("poisoned");
        let Some(o) = opens.get_mut(&ino) else { return };
        if passthrough {
            o.passthrough = o.passthrough.saturating_sub(1);
            if o.passthrough == 0 {
                o.backing = None;
            }
        } else {
            o.cached = o.cached.saturating_sub(1);
        }
        if o.cached == 0 && o.passthrough == 0 {
            opens.remove(&ino);
        }
    }

    fn file_attr(&self, a: &Attr) -> FileAttr {
        FileAttr {
            ino: INodeNo(a.ino),
            size: a.size,
            blocks: a.size.div_ceil(512),
            atime: a.mtime,
            mtime: a.mtime,
            ctime: a.mtime,
            crtime: a.mtime,
            kind: if a.dir { FileType::Directory } else { FileType::RegularFile },
            perm: a.perm,
            nlink: if a.dir { 2 } else { 1 },
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: MAX_READ,
            flags: 0,
        }
    }

    /// Files open now (an mmap keeps its file open until unmapped).
    pub fn open_handles(&self) -> usize {
        self.handles.lock().expect("poisoned").len()
    }

    pub(crate) fn tree(&self) -> std::sync::RwLockReadGuard<'_, Tree> {
        self.tree.read().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn tree_mut(&self) -> std::sync::RwLockWriteGuard<'_, Tree> {
        self.tree.write().unwrap_or_else(|p| p.into_inner())
    }
}

/// The FUSE file system over [`Shared`].
pub struct MountFs(pub Arc<Shared>);

fn ttl_of(ino: Ino, parent: Ino) -> Duration {
    if ino == ROOT || parent == ROOT {
        ROOT_TTL
    } else {
        IMAGE_TTL
    }
}

impl Filesystem for MountFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let ra = config.set_max_readahead(MAX_READ).map_or_else(|max| config.set_max_readahead(max).map(|_| max).unwrap_or(max), |_| MAX_READ);
        self.0.max_read.store(u64::from(ra), Relaxed);
        // Lookups of different names in one directory at once (many images, many readers).
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS);
        self.0.init_passthrough(config);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        self.0.requests.fetch_add(1, Relaxed);
        let Some(name) = name.to_str() else { return reply.error(Errno::ENOENT) };
        match self.0.tree().lookup(parent.0, name) {
            Some(a) => reply.entry(&ttl_of(a.ino, parent.0), &self.0.file_attr(&a), Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        self.0.requests.fetch_add(1, Relaxed);
        match self.0.tree().attr(ino.0) {
            Some(a) => reply.attr(&ttl_of(ino.0, 0), &self.0.file_attr(&a)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        self.0.requests.fetch_add(1, Relaxed);
        let Some(entries) = self.0.tree().readdir(ino.0) else { return reply.error(Errno::ENOTDIR) };
        let dots = [(".".to_string(), ino.0, true), ("..".to_string(), ino.0, true)];
        let all = dots.into_iter().chain(entries.into_iter().map(|(n, a)| (n, a.ino, a.dir)));
        for (i, (name, ino, dir)) in all.enumerate().skip(offset as usize) {
            let kind = if dir { FileType::Directory } else { FileType::RegularFile };
            if reply.add(INodeNo(ino), i as u64 + 1, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        self.0.requests.fetch_add(1, Relaxed);
        if flags.acc_mode() != OpenAccMode::O_RDONLY {
            return reply.error(Errno::EROFS);
        }
        let mut tree = self.0.tree_mut();
        let Some((served, content, size)) = tree.provider(ino.0) else { return reply.error(Errno::ENOENT) };
        let id = tree.content_id(ino.0);
        tree.opened(ino.0, 1);
        drop(tree);
        served.counters.opens.fetch_add(1, Relaxed);
        let fh = self.0.next_fh.fetch_add(1, Relaxed);
        let backing = self.0.open_mode(ino.0, id.as_ref(), &reply, &served);
        if backing.is_some() {
            served.counters.passthrough_files.fetch_add(1, Relaxed);
        }
        let handle = Handle { ino: ino.0, served, content, size, passthrough: backing.is_some() };
        self.0.handles.lock().expect("poisoned").insert(fh, handle);
        match backing {
            // Not FOPEN_KEEP_CACHE: pages the inode kept from reads through the daemon may
            // go; its bytes are the copy's page cache from now on.
            Some(b) => reply.opened_passthrough(FileHandle(fh), FopenFlags::empty(), &b),
            None => reply.opened(FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock: Option<fuser::LockOwner>,
        reply: ReplyData,
    ) {
        self.0.requests.fetch_add(1, Relaxed);
        let h = self.0.handles.lock().expect("poisoned").get(&fh.0).map(|h| (h.served.clone(), h.content, h.size));
        let Some((served, content, file_size)) = h else { return reply.error(Errno::EBADF) };
        let t0 = Instant::now();
        let c = &served.counters;
        c.reads.fetch_add(1, Relaxed);
        let got = crate::read::read(&served, content, file_size, offset, size, Need::Read);
        match got {
            Ok(bytes) => {
                c.bytes_read.fetch_add(bytes.len() as u64, Relaxed);
                c.latency.record(t0.elapsed().as_micros() as u64);
                reply.data(&bytes);
            }
            Err(e) => {
                c.read_failures.fetch_add(1, Relaxed);
                tracing::error!("{}: read of {size} bytes at {offset}: EIO: {e}", served.name);
                reply.error(Errno::EIO);
            }
        }
    }

    fn release(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, _flags: OpenFlags, _lock: Option<fuser::LockOwner>, _flush: bool, reply: ReplyEmpty) {
        self.0.requests.fetch_add(1, Relaxed);
        if let Some(h) = self.0.handles.lock().expect("poisoned").remove(&fh.0) {
            self.0.tree_mut().opened(h.ino, -1);
            self.0.closed(h.ino, h.passthrough);
        }
        reply.ok();
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _lock: fuser::LockOwner, reply: ReplyEmpty) {
        reply.ok();
    }

    /// No extended attributes.
    fn getxattr(&self, _req: &Request, _ino: INodeNo, _name: &OsStr, _size: u32, reply: fuser::ReplyXattr) {
        reply.error(Errno::NO_XATTR);
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, size: u32, reply: fuser::ReplyXattr) {
        if size == 0 {
            reply.size(0);
        } else {
            reply.data(&[]);
        }
    }

    fn access(&self, _req: &Request, ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        match self.0.tree().attr(ino.0) {
            Some(_) => reply.ok(),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        self.0.requests.fetch_add(1, Relaxed);
        let tree = self.0.tree();
        let bytes: u64 = tree.images().map(|(_, s)| s.chunks.image().files.iter().map(|f| f.size).sum::<u64>()).sum();
        reply.statfs(bytes.div_ceil(4096), 0, 0, 0, 0, 4096, 255, 4096);
    }
}
