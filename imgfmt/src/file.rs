//! File helpers shared by everything that reads and writes blob, source and pulled files:
//!
//! - [`Dir`]: create and open files *beneath* a directory without ever following a
//!   symlink or writing through a hard link, for every place snapctl writes under a name
//!   that came from an image or into a directory someone else may also write (a pull's or
//!   an unpack's destination, a criu work directory, the chunk cache);
//! - page-cache hints: start a range coming in from disk ahead of use, start a written
//!   range going out to disk ahead of the fsync, and map a range so its bytes can be
//!   handed on (sent, sliced) without a copy;
//! - [`UseLock`]: "this is in use", for something a cleaner may delete (a push layout
//!   under the cache directory) while a command works in it.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{Mode, SFlag};

/// Why [`Dir`] refused a name: what was found there is not something it may write
/// through or take over. (Carried inside an `io::Error` of kind `Other`; the caller's
/// message names the path.)
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum Refused {
    /// a symlink (never followed here)
    Symlink,
    /// not a directory (a symlink is never followed here)
    NotDirectory,
    /// not a regular file
    NotRegular,
    /// a file with {0} hard links (only a file with one link is written or taken over)
    HardLinked(u64),
    /// owned by uid {0}, not by this process's user
    NotOwned(u32),
    /// not a single plain name
    BadName,
}

impl From<Refused> for io::Error {
    fn from(r: Refused) -> io::Error {
        io::Error::other(r)
    }
}

/// What `e` refused, if it is a refusal of [`Dir`] (rather than the OS failing).
pub fn refusal(e: &io::Error) -> Option<&Refused> {
    e.get_ref().and_then(|inner| inner.downcast_ref::<Refused>())
}

/// A directory held open, beneath which every name is resolved one component at a time
/// with `O_NOFOLLOW`: a symlink anywhere below it (a subdirectory, the file itself) is
/// refused, never followed, so nothing written through a `Dir` lands outside it. Files
/// are created with `O_EXCL` (never opened through whatever was planted under the name)
/// and taken over only when they are regular files with one link, owned by this user
/// ([`Dir::open_own_file`]). The directory itself was named by the caller, so symlinks
/// in *its* path are followed once, when it is opened.
///
/// This is the dirfd walk of `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`, done with
/// plain `openat` so it works on every kernel snapctl runs on.
#[derive(Debug)]
pub struct Dir {
    fd: OwnedFd,
    path: PathBuf,
}

fn nix_io(e: nix::errno::Errno) -> io::Error {
    io::Error::from(e)
}

/// One plain name (no `/`, not empty, `.` or `..`): what every `*at` call here is given,
/// so none of them can be handed an absolute or climbing path.
fn plain(name: &OsStr) -> io::Result<&OsStr> {
    use std::os::unix::ffi::OsStrExt;
    let b = name.as_bytes();
    if b.is_empty() || b == b"." || b == b".." || b.contains(&b'/') || b.contains(&0) {
        return Err(Refused::BadName.into());
    }
    Ok(name)
}

impl Dir {
    /// Open the directory `path` (symlinks in `path` itself are followed: the caller named it).
    pub fn open(path: &Path) -> io::Result<Dir> {
        let fd = nix::fcntl::open(path, OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty()).map_err(nix_io)?;
        Ok(Dir { fd, path: path.to_path_buf() })
    }

    /// Create `path` (and its parents) if missing, then open it.
    pub fn create_all(path: &Path) -> io::Result<Dir> {
        std::fs::create_dir_all(path)?;
        Dir::open(path)
    }

    /// The path this directory was opened as (for messages: names are resolved through
    /// the descriptor, never through this path).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `self.path()/name`, for messages.
    pub fn display_path(&self, name: impl AsRef<OsStr>) -> PathBuf {
        self.path.join(name.as_ref())
    }

    /// A second handle on the same directory.
    pub fn try_clone(&self) -> io::Result<Dir> {
        Ok(Dir { fd: self.fd.try_clone()?, path: self.path.clone() })
    }

    fn child(&self, name: &OsStr) -> io::Result<Dir> {
        let fd = nix::fcntl::openat(&self.fd, plain(name)?, OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC, Mode::empty())
            .map_err(|e| match e {
                // O_NOFOLLOW|O_DIRECTORY on a symlink fails with ENOTDIR (or ELOOP): say which.
                nix::errno::Errno::ELOOP => Refused::Symlink.into(),
                nix::errno::Errno::ENOTDIR if matches!(self.entry(name), Ok(Some(EntryKind::Symlink))) => Refused::Symlink.into(),
                nix::errno::Errno::ENOTDIR => Refused::NotDirectory.into(),
                e => nix_io(e),
            })?;
        Ok(Dir { fd, path: self.path.join(name) })
    }

    /// The existing directory `rel` (relative, plain components) beneath this one; a
    /// symlink or non-directory on the way is refused.
    pub fn open_dir(&self, rel: &Path) -> io::Result<Dir> {
        self.walk(rel, false)
    }

    /// The directory `rel` beneath this one, creating what is missing (mode `0o777` less
    /// the umask, as `mkdir -p`); a symlink or non-directory on the way is refused.
    pub fn create_dir_all(&self, rel: &Path) -> io::Result<Dir> {
        self.walk(rel, true)
    }

    fn walk(&self, rel: &Path, create: bool) -> io::Result<Dir> {
        let mut cur = self.try_clone()?;
        for c in rel.components() {
            let Component::Normal(name) = c else { return Err(Refused::BadName.into()) };
            cur = match cur.child(name) {
                Err(e) if create && e.kind() == io::ErrorKind::NotFound => {
                    match nix::sys::stat::mkdirat(&cur.fd, plain(name)?, Mode::from_bits_truncate(0o777)) {
                        // Made by someone else meanwhile: opened (and checked) below.
                        Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
                        Err(e) => return Err(nix_io(e)),
                    }
                    cur.child(name)?
                }
                other => other?,
            };
        }
        Ok(cur)
    }

    /// What is under `name` (not following a symlink): `None` if nothing.
    pub fn entry(&self, name: &OsStr) -> io::Result<Option<EntryKind>> {
        match nix::sys::stat::fstatat(&self.fd, plain(name)?, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some(EntryKind::of(st.st_mode))),
            Err(nix::errno::Errno::ENOENT) => Ok(None),
            Err(e) => Err(nix_io(e)),
        }
    }

    /// Create `name`, which must not exist (whatever is there, a symlink included, makes
    /// this fail with `AlreadyExists`), open for reading and writing, with `mode` (less
    /// the umask).
    pub fn create_new(&self, name: &OsStr, mode: u32) -> io::Result<File> {
        let flags = OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let fd = nix::fcntl::openat(&self.fd, plain(name)?, flags, Mode::from_bits_truncate(mode as libc::mode_t)).map_err(nix_io)?;
        Ok(File::from(fd))
    }

    /// Open the existing file `name` (for writing too if `write`) only if it is a regular
    /// file with one link, owned by this process's effective user: a symlink, a hard link
    /// to a file elsewhere, a device or FIFO, or another user's file is refused (checked
    /// on the open descriptor, so nothing can be swapped in between). The file to take
    /// over after a killed run, or to read as one of ours.
    pub fn open_own_file(&self, name: &OsStr, write: bool) -> io::Result<File> {
        let access = if write { OFlag::O_RDWR } else { OFlag::O_RDONLY };
        // O_NONBLOCK: opening a FIFO planted under the name must not hang (it is refused
        // below); it changes nothing for a regular file.
        let flags = access | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC | OFlag::O_NOCTTY;
        let fd = nix::fcntl::openat(&self.fd, plain(name)?, flags, Mode::empty()).map_err(|e| match e {
            nix::errno::Errno::ELOOP => Refused::Symlink.into(),
            e => nix_io(e),
        })?;
        let file = File::from(fd);
        check_own_file(&file)?;
        // Back to blocking I/O (a regular file ignores the flag, but say what we mean).
        let fl = OFlag::from_bits_truncate(nix::fcntl::fcntl(&file, nix::fcntl::FcntlArg::F_GETFL).map_err(nix_io)?);
        nix::fcntl::fcntl(&file, nix::fcntl::FcntlArg::F_SETFL(fl - OFlag::O_NONBLOCK)).map_err(nix_io)?;
        Ok(file)
    }

    /// Open the existing `name` for reading if it is a regular file (any owner, any link
    /// count: for files whose bytes are checked after reading, where only a symlink, a
    /// FIFO or a device must not be opened).
    pub fn open_regular(&self, name: &OsStr) -> io::Result<File> {
        open_regular_at(&self.fd, name)
    }

    /// Rename `from` to `to`, both in this directory (never through a symlink: names are
    /// plain). With `replace` false, an existing `to` makes this fail with
    /// `AlreadyExists` (`RENAME_NOREPLACE`); with it, `to` is replaced whatever it is
    /// (a symlink under `to` is replaced, not followed).
    pub fn rename(&self, from: &OsStr, to: &OsStr, replace: bool) -> io::Result<()> {
        self.rename_to(from, self, to, replace)
    }

    /// [`Dir::rename`] into another directory (on the same filesystem).
    pub fn rename_to(&self, from: &OsStr, to_dir: &Dir, to: &OsStr, replace: bool) -> io::Result<()> {
        let flags = if replace { nix::fcntl::RenameFlags::empty() } else { nix::fcntl::RenameFlags::RENAME_NOREPLACE };
        nix::fcntl::renameat2(&self.fd, plain(from)?, &to_dir.fd, plain(to)?, flags).map_err(nix_io)
    }

    /// Remove the name `name` (a symlink or a hard link is removed, not what it points at).
    pub fn remove_file(&self, name: &OsStr) -> io::Result<()> {
        nix::unistd::unlinkat(&self.fd, plain(name)?, nix::unistd::UnlinkatFlags::NoRemoveDir).map_err(nix_io)
    }

    /// Remove the empty directory `name`.
    pub fn remove_dir(&self, name: &OsStr) -> io::Result<()> {
        nix::unistd::unlinkat(&self.fd, plain(name)?, nix::unistd::UnlinkatFlags::RemoveDir).map_err(nix_io)
    }

    /// fsync the directory, so renames and creations in it are durable.
    pub fn sync(&self) -> io::Result<()> {
        nix::unistd::fsync(&self.fd).map_err(nix_io)
    }

    /// The names in this directory (read through the descriptor, not the path).
    pub fn names(&self) -> io::Result<Vec<OsString>> {
        let proc = PathBuf::from(format!("/proc/self/fd/{}", self.fd.as_raw_fd()));
        let rd = std::fs::read_dir(&proc).or_else(|_| std::fs::read_dir(&self.path))?;
        Ok(rd.flatten().map(|e| e.file_name()).collect())
    }
}

impl AsFd for Dir {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// What a name in a [`Dir`] is, without following it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    File,
    Dir,
    Symlink,
    /// A device, FIFO or socket.
    Other,
}

impl EntryKind {
    fn of(mode: libc::mode_t) -> EntryKind {
        match SFlag::from_bits_truncate(mode & SFlag::S_IFMT.bits()) {
            SFlag::S_IFREG => EntryKind::File,
            SFlag::S_IFDIR => EntryKind::Dir,
            SFlag::S_IFLNK => EntryKind::Symlink,
            _ => EntryKind::Other,
        }
    }
}

fn open_regular_at(dir: impl AsFd, name: &(impl nix::NixPath + ?Sized)) -> io::Result<File> {
    let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC | OFlag::O_NOCTTY;
    let fd = nix::fcntl::openat(dir, name, flags, Mode::empty()).map_err(|e| match e {
        nix::errno::Errno::ELOOP => Refused::Symlink.into(),
        e => nix_io(e),
    })?;
    let file = File::from(fd);
    if !file.metadata()?.file_type().is_file() {
        return Err(Refused::NotRegular.into());
    }
    Ok(file)
}

/// Open `path` for reading if its last component is a regular file, not a symlink, FIFO
/// or device (`O_NOFOLLOW | O_NONBLOCK`, checked on the descriptor): for a path recorded
/// earlier (a cache entry, a file a reference names) whose bytes are checked after
/// reading, so that what is planted there can neither hang the reader nor be opened.
pub fn open_regular(path: &Path) -> io::Result<File> {
    open_regular_at(nix::fcntl::AT_FDCWD, path)
}

/// This process's effective uid.
fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions, touches no memory and cannot fail.
    unsafe { libc::geteuid() }
}

/// `file` is a regular file with one link, owned by this process's effective user.
pub fn check_own_file(file: &File) -> io::Result<()> {
    let md = file.metadata()?;
    if !md.file_type().is_file() {
        return Err(Refused::NotRegular.into());
    }
    if md.nlink() != 1 {
        return Err(Refused::HardLinked(md.nlink()).into());
    }
    if md.uid() != euid() {
        return Err(Refused::NotOwned(md.uid()).into());
    }
    Ok(())
}

/// Split an image file name (`a/b/c`, checked by [`crate::config::check_name`]) into its
/// directory (`a/b`, empty for a top-level name) and its last component (`c`).
pub fn split_name(name: &str) -> (&Path, &OsStr) {
    match name.rsplit_once('/') {
        Some((dir, base)) => (Path::new(dir), OsStr::new(base)),
        None => (Path::new(""), OsStr::new(name)),
    }
}

/// Ask the kernel to start reading `[offset, offset + len)` of `file` into the page cache
/// (`POSIX_FADV_WILLNEED`, asynchronous). A hint: failure changes nothing but speed.
pub fn will_need(file: &File, offset: u64, len: u64) {
    let (Ok(off), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else { return };
    // SAFETY: posix_fadvise only reads its integer arguments; the fd is borrowed from `file`
    // and stays open for the call.
    let _ = unsafe { libc::posix_fadvise(file.as_raw_fd(), off, len, libc::POSIX_FADV_WILLNEED) };
}

/// Start writing `[offset, offset + len)` of `file` to disk without waiting for it
/// (`sync_file_range(SYNC_FILE_RANGE_WRITE)`), so the disk works while the caller goes on
/// and a later fsync finds little left to do (`len` 0: to the end of the file). A hint,
/// not durability: if it fails, the fsync does the work.
pub fn start_writeback(file: &File, offset: u64, len: u64) {
    let (Ok(off), Ok(n)) = (libc::off64_t::try_from(offset), libc::off64_t::try_from(len)) else { return };
    // SAFETY: sync_file_range only reads its integer arguments; the fd is borrowed from
    // `file` and stays open for the call.
    let _ = unsafe { libc::sync_file_range(file.as_raw_fd(), off, n, libc::SYNC_FILE_RANGE_WRITE) };
}

/// `len` bytes of `file` from `offset`, mapped and faulted in, as a buffer that unmaps when
/// its last slice is dropped.
///
/// Only for files that are never written in place or truncated while mapped: content-
/// addressed blobs, written under a temporary name and renamed into place complete (a
/// file deleted meanwhile stays mapped). The caller checks the range against the file's
/// size first.
pub fn map_range(file: &File, offset: u64, len: usize) -> io::Result<bytes::Bytes> {
    // SAFETY: the callers' contract above: the file's bytes in this range neither change
    // nor go away while mapped, and the range lies within the file.
    let map = unsafe { memmap2::MmapOptions::new().offset(offset).len(len).populate().map(file)? };
    Ok(bytes::Bytes::from_owner(map))
}

/// A lock file saying "in use" for something a cleaner may delete: users hold it shared
/// (any number at once), a cleaner takes it exclusively without waiting and leaves the
/// thing alone when it cannot. A cleaner deletes the lock file while it holds it, so a
/// user that opened the file just before and locks it just after holds a lock on a file
/// no longer under the name: [`UseLock::shared`] checks, after locking, that the name
/// still names the file it locked, and starts over when it does not.
#[derive(Debug)]
pub struct UseLock {
    file: File,
    path: PathBuf,
}

impl UseLock {
    /// Hold `path` (created if missing) shared, waiting for a cleaner to finish; its mtime
    /// is set to now (the thing's last use, for least-recently-used eviction).
    pub fn shared(path: &Path) -> io::Result<UseLock> {
        loop {
            let l = Self::open(path)?;
            l.file.lock_shared()?;
            if l.still_named()? {
                let _ = l.file.set_modified(std::time::SystemTime::now());
                return Ok(l);
            }
        }
    }

    /// Hold `path` exclusively if nobody holds it (`None` when someone does); a missing
    /// file is created (nothing is in use).
    pub fn try_exclusive(path: &Path) -> io::Result<Option<UseLock>> {
        let l = Self::open(path)?;
        match l.file.try_lock() {
            Ok(()) if l.still_named()? => Ok(Some(l)),
            Ok(()) => Ok(None),
            Err(std::fs::TryLockError::WouldBlock) => Ok(None),
            Err(std::fs::TryLockError::Error(e)) => Err(e),
        }
    }

    /// Turn a shared hold into an exclusive one if no one else holds the lock; `false`
    /// when someone does, the hold shared again. (`flock` converts by dropping the old
    /// lock first, so the shared hold is taken anew: a cleaner that got in between is
    /// waited for, and what it guarded may be gone by then.)
    pub fn try_upgrade(&self) -> io::Result<bool> {
        match self.file.try_lock() {
            Ok(()) => Ok(true),
            Err(std::fs::TryLockError::WouldBlock) => self.file.lock_shared().map(|()| false),
            Err(std::fs::TryLockError::Error(e)) => Err(e),
        }
    }

    /// Delete the lock file, while it is held exclusively (a cleaner, done).
    pub fn remove(self) -> io::Result<()> {
        std::fs::remove_file(&self.path)
    }

    fn open(path: &Path) -> io::Result<UseLock> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new().create(true).truncate(false).write(true).mode(0o644).custom_flags(libc::O_NOFOLLOW).open(path)?;
        Ok(UseLock { file, path: path.to_path_buf() })
    }

    /// Whether `path` still names the file this holds (a cleaner did not delete it between
    /// the open and the lock).
    fn still_named(&self) -> io::Result<bool> {
        let held = self.file.metadata()?;
        Ok(std::fs::symlink_metadata(&self.path).is_ok_and(|now| now.ino() == held.ino() && now.dev() == held.dev()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::fs::{symlink, PermissionsExt};

    /// Users share a [`UseLock`]; a cleaner gets it only when nobody holds it, and a user
    /// that locks a file the cleaner deleted meanwhile notices and takes the new one.
    #[test]
    fn use_lock_is_shared_by_users_and_taken_by_a_cleaner_only_when_free() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.lock");
        let a = UseLock::shared(&p).unwrap();
        let b = UseLock::shared(&p).unwrap();
        assert!(UseLock::try_exclusive(&p).unwrap().is_none(), "held by users");
        assert!(!b.try_upgrade().unwrap(), "another user holds it");
        drop(a);
        assert!(UseLock::try_exclusive(&p).unwrap().is_none(), "a failed upgrade leaves the hold shared");
        assert!(b.try_upgrade().unwrap(), "the last user may take it whole");
        drop(b);
        let clean = UseLock::try_exclusive(&p).unwrap().expect("free");
        // A user that opened the file before the cleaner deleted it locks a file no longer
        // under the name: it starts over on a new one.
        let stale = UseLock::open(&p).unwrap();
        clean.remove().unwrap();
        stale.file.lock_shared().unwrap();
        assert!(!stale.still_named().unwrap());
        let fresh = UseLock::shared(&p).unwrap();
        assert!(fresh.still_named().unwrap() && p.exists());
    }

    fn refused(e: &io::Error) -> Refused {
        refusal(e).cloned().unwrap_or_else(|| panic!("not a refusal: {e}"))
    }

    /// A subdirectory that is a symlink (to a directory outside) is refused, never
    /// followed, whether the walk creates or only opens; nothing is created outside.
    #[test]
    fn symlinked_subdirectory_is_refused() {
        let t = tempfile::tempdir().unwrap();
        let (root, outside) = (t.path().join("root"), t.path().join("outside"));
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        symlink(&outside, root.join("sub")).unwrap();
        let d = Dir::open(&root).unwrap();
        assert_eq!(refused(&d.create_dir_all(Path::new("sub/deeper")).unwrap_err()), Refused::Symlink);
        assert_eq!(refused(&d.open_dir(Path::new("sub")).unwrap_err()), Refused::Symlink);
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
        std::fs::write(root.join("file"), b"x").unwrap();
        assert_eq!(refused(&d.create_dir_all(Path::new("file/x")).unwrap_err()), Refused::NotDirectory);
        // Missing directories are made, plain ones opened.
        let deep = d.create_dir_all(Path::new("a/b/c")).unwrap();
        deep.create_new(OsStr::new("f"), 0o600).unwrap();
        assert!(root.join("a/b/c/f").is_file());
        assert!(d.open_dir(Path::new("a/b")).is_ok());
        assert_eq!(d.open_dir(Path::new("nope")).unwrap_err().kind(), io::ErrorKind::NotFound);
        for bad in ["../x", "/etc", "./a", "a/../b"] {
            assert_eq!(refused(&d.create_dir_all(Path::new(bad)).unwrap_err()), Refused::BadName, "{bad}");
        }
    }

    /// `create_new` never opens what is planted under the name: a symlink to a victim
    /// fails with AlreadyExists and the victim is untouched.
    #[test]
    fn create_new_does_not_write_through_a_planted_symlink() {
        let t = tempfile::tempdir().unwrap();
        let victim = t.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        symlink(&victim, t.path().join("tmp")).unwrap();
        let d = Dir::open(t.path()).unwrap();
        assert_eq!(d.create_new(OsStr::new("tmp"), 0o600).unwrap_err().kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        let mut f = d.create_new(OsStr::new("new"), 0o600).unwrap();
        f.write_all(b"ok").unwrap();
        assert_eq!(std::fs::metadata(t.path().join("new")).unwrap().permissions().mode() & 0o077, 0, "created 0600");
    }

    /// Only a regular file with one link, owned by us, is opened by `open_own_file`.
    #[test]
    fn open_own_file_refuses_symlinks_hard_links_fifos_and_others_files() {
        let t = tempfile::tempdir().unwrap();
        let p = |n: &str| t.path().join(n);
        std::fs::write(p("victim"), b"precious").unwrap();
        symlink(p("victim"), p("link")).unwrap();
        std::fs::hard_link(p("victim"), p("hard")).unwrap();
        nix::unistd::mkfifo(&p("fifo"), Mode::from_bits_truncate(0o600)).unwrap();
        std::fs::write(p("mine"), b"mine").unwrap();
        let d = Dir::open(t.path()).unwrap();
        assert_eq!(refused(&d.open_own_file(OsStr::new("link"), true).unwrap_err()), Refused::Symlink);
        assert_eq!(refused(&d.open_own_file(OsStr::new("hard"), true).unwrap_err()), Refused::HardLinked(2));
        assert_eq!(refused(&d.open_own_file(OsStr::new("fifo"), false).unwrap_err()), Refused::NotRegular);
        assert_eq!(refused(&d.open_own_file(OsStr::new("."), false).unwrap_err()), Refused::BadName);
        let mut s = String::new();
        d.open_own_file(OsStr::new("mine"), false).unwrap().read_to_string(&mut s).unwrap();
        assert_eq!(s, "mine");
        if euid() == 0 {
            std::fs::write(p("theirs"), b"x").unwrap();
            std::os::unix::fs::chown(p("theirs"), Some(4242), None).unwrap();
            assert_eq!(refused(&d.open_own_file(OsStr::new("theirs"), true).unwrap_err()), Refused::NotOwned(4242));
        }
        assert_eq!(d.entry(OsStr::new("link")).unwrap(), Some(EntryKind::Symlink));
        assert_eq!(d.entry(OsStr::new("fifo")).unwrap(), Some(EntryKind::Other));
        assert_eq!(d.entry(OsStr::new("none")).unwrap(), None);
    }

    /// A rename without `replace` never clobbers; with it, a symlink under the target name
    /// is replaced, not followed.
    #[test]
    fn rename_replaces_names_not_what_they_point_at() {
        let t = tempfile::tempdir().unwrap();
        let p = |n: &str| t.path().join(n);
        std::fs::write(p("victim"), b"precious").unwrap();
        symlink(p("victim"), p("final")).unwrap();
        std::fs::write(p("tmp"), b"new").unwrap();
        let d = Dir::open(t.path()).unwrap();
        assert_eq!(d.rename(OsStr::new("tmp"), OsStr::new("final"), false).unwrap_err().kind(), io::ErrorKind::AlreadyExists);
        d.rename(OsStr::new("tmp"), OsStr::new("final"), true).unwrap();
        assert_eq!(std::fs::read(p("victim")).unwrap(), b"precious");
        assert!(std::fs::symlink_metadata(p("final")).unwrap().is_file());
        d.remove_file(OsStr::new("final")).unwrap();
        let mut names = d.names().unwrap();
        names.sort();
        assert_eq!(names, vec![OsString::from("victim")]);
    }

    #[test]
    fn names_split_into_directory_and_base() {
        assert_eq!(split_name("vm.mem"), (Path::new(""), OsStr::new("vm.mem")));
        assert_eq!(split_name("a/b/c.img"), (Path::new("a/b"), OsStr::new("c.img")));
    }
}
